"""AdamW with 8-bit block-wise states (Dettmers et al., 2022), torchao's ``AdamW8bit`` with a one-pass CPU step.

The states are torchao's (``OptimState8bit``: uint8 codes into the dynamic-exponent map, one fp32 absmax per block
of 256), and so are the update's numerics and the ``state_dict``: a checkpoint moves between this class and
``torchao.optim.AdamW8bit``. What differs is the step on a CPU. torchao runs ``single_param_adam`` through
``torch.compile``, which on a CPU takes 11x fp32 AdamW's time for the LoRA adapters of a 1B model
(``benchmarks/adapter_optimizer.py``); here one C++ pass per block (``modules/kernels/cpp.py``, ``adamw8bit_``)
dequantizes, updates and re-quantizes both states and steps the weight: fp32, or bf16 rounded once (to nearest, or
stochastically with ``bf16_stochastic_round=True``, as torchao rounds: other random bits, the same distribution).
Tensors torchao keeps in fp32 (fewer than 4096 elements, or not a multiple of the block) and every tensor where the
C++ kernels do not run take torchao's own update: compiled as torchao compiles it on GPUs, eagerly on CPUs
(inductor's CPU code needs the compiler the kernels did not find).

For LoRA adapters the states shrink from 8 to 2 bytes per parameter (+ 8 bytes per 256): 64 MB at the Llama-3.2-1B
shape (r=16, every linear).
"""

from __future__ import annotations

import functools

import torch
from torchao.optim import AdamW8bit as _TorchaoAdamW8bit
from torchao.optim.adam import single_param_adam
from torchao.optim.subclass_8bit import OptimState8bit

from hf_lowprec.modules.packed import native_kernels


class AdamW8bit(_TorchaoAdamW8bit):
    """``torchao.optim.AdamW8bit`` (same arguments, defaults, states) whose CPU step is one C++ pass per tensor."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamW8bit does not support sparse gradients")
                state = self.state[p]
                if not state:  # torchao's initialisation: 8-bit states for tensors of >= 4096 elements in whole blocks
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = self._new_buffer(p, True)
                    state["exp_avg_sq"] = self._new_buffer(p, False)
                    if group["amsgrad"]:
                        state["max_exp_avg_sq"] = self._new_buffer(p, False)
                state["step"] += 1
                self._update(p, state, group)
        return loss

    def _update(self, p: torch.Tensor, state: dict, group: dict) -> None:
        m, v, lr = state["exp_avg"], state["exp_avg_sq"], group["lr"]
        beta1, beta2 = group["betas"]
        stochastic = self.bf16_stochastic_round and p.dtype is torch.bfloat16
        ext = native_kernels(p, p.grad)
        one_pass = (ext is not None and not group["amsgrad"] and isinstance(m, OptimState8bit)
                    and p.dtype == p.grad.dtype and p.dtype in (torch.float32, torch.bfloat16)
                    and p.is_contiguous() and p.grad.is_contiguous())  # fmt: skip
        if not one_pass:
            update = single_param_adam if p.device.type == "cpu" else _compiled_single_param_adam()
            lr = lr if isinstance(lr, torch.Tensor) else torch.tensor(lr, dtype=torch.float32)
            with torch._dynamo.utils.disable_cache_limit():  # as torchao: one compilation per argument combination
                update(p.detach(), p.grad, state["step"], m, v, state.get("max_exp_avg_sq"), lr, beta1, beta2,
                       group["weight_decay"], group["eps"], True, stochastic)  # fmt: skip
            return
        step = state["step"]  # the bias corrections as torchao computes them: fp32 tensor arithmetic
        # the rounding's random bits: one draw from torch's generator keys a hash of each element's index
        seed = int(torch.randint(0, 2**62, (), dtype=torch.int64)) if stochastic else -1
        ext.adamw8bit_(p.detach(), p.grad, m.codes, m.scale, m.qmap, v.codes, v.scale, v.qmap, float(lr),
                       beta1, beta2, group["weight_decay"], group["eps"], (1 - beta1**step).item(),
                       (1 - beta2**step).item(), seed)  # fmt: skip


@functools.cache
def _compiled_single_param_adam():
    """torchao's update compiled as ``torchao.optim`` compiles it (GPUs)."""
    return torch.compile(single_param_adam, fullgraph=True, dynamic=False)
