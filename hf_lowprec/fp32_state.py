"""Modules whose fp32 state stays fp32 when the model is cast (``model.to(torch.bfloat16)``, ``model.half()``, the
Trainer's ``bf16_full_eval``): learned quantization steps and gains, scale statistics. In bf16 an AdamW update of a
step (~1e-4 of it) falls below half a ulp (2^-9) and the step stops learning; an amax history loses its digits."""

from __future__ import annotations

import torch
from torch import nn


class Fp32State(nn.Module):
    """An ``nn.Module`` whose fp32 parameters and buffers (``FP32_STATE`` names them; ``None``: every one) keep their
    dtype, values and gradients through ``_apply`` casts; only their device follows. A Parameter stays the same
    object, so an optimizer holding it keeps working."""

    FP32_STATE: tuple[str, ...] | None = None

    def _apply(self, fn, recurse=True):
        named = {**self._parameters, **self._buffers}
        kept = {
            name: (t.data, t.grad.data if isinstance(t, nn.Parameter) and t.grad is not None else None)
            for name, t in named.items()
            if t is not None and t.dtype == torch.float32 and (self.FP32_STATE is None or name in self.FP32_STATE)
        }
        super()._apply(fn, recurse)
        for name, (value, grad) in kept.items():
            now = self._parameters[name] if name in self._parameters else self._buffers[name]
            if now.dtype == torch.float32:
                continue  # only the device moved (.to(device), .to_empty(): a meta tensor's value cannot be copied)
            if name in self._parameters:
                now.data = value.to(now.device)
                now.grad = None if grad is None else grad.to(now.device)
            else:
                self._buffers[name] = value.to(now.device)
        return self
