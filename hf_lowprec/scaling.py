"""Scale policies: how a low-precision layer chooses the scale of each tensor it quantizes.

A policy is an ``nn.Module`` (its state travels in ``state_dict``) with one job: turn the amax of a
tensor into an FP8 scale (``q = saturate(x * scale)``). Layers hold one policy per tensor role:
``input``, ``weight`` and ``grad`` (the gradient of the layer's output).

For the integer formats the step size itself can be a trained parameter: see
:class:`LearnedStepQuantizer` (LSQ).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from hf_lowprec.formats import (
    FormatSpec,
    dequantize_nf4,
    fake_quantize_int,
    fp8_scale,
    int_steps,
    quantize_nf4,
)

ROLES = ("input", "weight", "grad")


class ScalePolicy(nn.Module):
    """Base class: ``scale(amax, dtype) -> fp32 scale`` of ``amax``'s shape.

    Subclasses may keep statistics in buffers; ``power_of_two`` rounds scales down to a power of two
    (exact rescaling, as torchao's rowwise recipe and DeepSeek-V3 do). A subclass that sets
    ``observes = True`` also sees every cast through :meth:`observe` (telemetry, running statistics).
    """

    observes = False

    def __init__(self, power_of_two: bool = False):
        super().__init__()
        self.power_of_two = power_of_two

    def scale(self, amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def observe(self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> None:
        """Called after ``x`` was cast to ``q`` with ``scale`` (block scales: ``block`` is their shape)."""

    def extra_repr(self) -> str:
        return f"power_of_two={self.power_of_two}"


class DynamicScaling(ScalePolicy):
    """Scale from the current tensor's amax (torchao's ``dynamic`` scaling)."""

    def scale(self, amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return fp8_scale(amax, dtype, self.power_of_two)


class LearnedStepQuantizer(nn.Module):
    """Fake-quantizes a weight ``[R, C]`` with per-group steps ``[R, G]`` that can be trained (LSQ).

    The step is initialised from the weight (``amax / qmax``, or min/max with a zero point when
    asymmetric). When ``learnable``, it is an ``nn.Parameter`` whose gradient is scaled by
    ``1 / sqrt(N * Qp)`` with ``N`` the group size (Esser et al., 2020, "Learned Step Size
    Quantization"); otherwise steps are recomputed from the weight on every call (max calibration).
    NF4 has no integer grid and always uses the per-group absmax.
    """

    def __init__(self, weight: torch.Tensor, spec: FormatSpec, learnable: bool = True):
        super().__init__()
        if spec.family not in ("int4", "int8", "nf4"):
            raise ValueError(f"LearnedStepQuantizer handles int4, int8 and nf4 formats, not {spec.name}")
        self.spec = spec
        self.learnable = learnable and spec.family != "nf4"
        cols = weight.shape[1]
        self.grad_scale = 1.0 / math.sqrt(min(spec.group_size or cols, cols) * max(spec.qrange[1], 1))
        if self.learnable:
            step, zero = int_steps(weight, spec)
            self.step = nn.Parameter(step.to(weight.device))
            self.register_buffer("zero", None if zero is None else zero.to(weight.device))

    def forward(self, weight: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Quantize-dequantize ``weight`` (or only ``weight[rows]``, ``rows`` a 1-D index: ``[len(rows), C]``).

        Straight-through gradient to the weight, LSQ gradient to the step.
        """
        w = weight if rows is None else weight[rows]
        if self.spec.family == "nf4":
            idx, absmax = quantize_nf4(w, self.spec.group_size)
            q = dequantize_nf4(idx, absmax, self.spec.group_size, w.dtype)
            return w + (q - w).detach()
        if not self.learnable:
            step, zero = int_steps(w, self.spec)
            return fake_quantize_int(w, self.spec, step, zero)
        step, zero = self.step, self.zero
        if rows is not None:
            step, zero = step[rows], None if zero is None else zero[rows]
        scaled = step * self.grad_scale
        step = step.detach() + (scaled - scaled.detach())  # exactly the step's value; gradient x grad_scale (LSQ)
        return fake_quantize_int(w, self.spec, step.abs().clamp(min=1e-8), zero)

    def steps(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The steps ``[R, G]`` (fp32, detached) and zero points in use for ``weight``."""
        if self.learnable:
            return self.step.detach().abs().clamp(min=1e-8).float(), self.zero
        return int_steps(weight, self.spec)

    def extra_repr(self) -> str:
        return f"{self.spec.name}, learnable={self.learnable}"


def make_policy(name: str, **kwargs) -> ScalePolicy:
    """Build a scale policy by name (``dynamic``)."""
    policies = {"dynamic": DynamicScaling}
    if name not in policies:
        raise ValueError(f"unknown scale policy {name!r}; choose one of {', '.join(policies)}")
    return policies[name](**kwargs)
