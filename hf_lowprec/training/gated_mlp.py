"""SwiGLU MLPs (``down(silu(gate(x)) * up(x))``: Llama, Mistral, Qwen2/3, SmolLM) that leave two
``[tokens, intermediate]`` tensors to backward instead of four.

transformers' ``LlamaMLP`` saves ``gate(x)`` (for SiLU's gradient), ``silu(gate(x))`` and ``up(x)`` (for the
product's) and the product itself (the down projection's input, which its LoRA gradient reads). :func:`silu_mul` is
one autograd node that saves ``gate(x)`` and ``up(x)`` only and recomputes SiLU in backward. Under
:class:`~hf_lowprec.training.activations.ActivationStorage` the product is not stored either: the storage rebuilds it
in backward from its 8-bit copies of the two (:meth:`ActivationStorage.derive`). At 4 layers' worth of
``intermediate_size`` per token this is most of a decoder layer's saved activations.

Written here because Liger-Kernel's fused SwiGLU is Triton (GPUs only) and torch has no fused SiLU-and-multiply op.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import SiLUActivation
from transformers.models.llama.modeling_llama import LlamaMLP

from hf_lowprec.training.activations import ActivationStorage

_SLICE = 1 << 20  # elements computed at a time: bounds the fp32 temporaries of a [tokens, intermediate] tensor


def _row_slices(*tensors: torch.Tensor):
    """Matching row blocks of ``_SLICE`` elements of tensors of one shape ``[..., C]``, as 2-D views."""
    rows = [t.reshape(-1, t.shape[-1]) for t in tensors]
    step = max(1, _SLICE // rows[0].shape[1])
    for r0 in range(0, rows[0].shape[0], step):
        yield [r[r0 : r0 + step] for r in rows]


def silu_mul_values(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` computed in fp32, rounded once to ``gate``'s dtype; ``gate``, ``up`` ``[..., I]``."""
    out = torch.empty_like(gate, memory_format=torch.contiguous_format)
    for g, u, o in _row_slices(gate, up, out):
        o.copy_(F.silu(g.float()).mul_(u.float()))
    return out


def silu_mul_grad(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`silu_mul_values` w.r.t. ``(gate, up)`` given the output's ``grad``, in fp32 then each
    input's dtype: ``d_up = grad * silu(gate)``, ``d_gate = grad * up * (s + silu(gate) * (1 - s))``,
    ``s = sigmoid(gate)``. Inputs are never written (``.float()`` of an fp32 tensor is the tensor itself)."""
    d_gate = torch.empty_like(gate, memory_format=torch.contiguous_format)
    d_up = torch.empty_like(up, memory_format=torch.contiguous_format)
    for gr, g, u, dg, du in _row_slices(grad, gate, up, d_gate, d_up):
        gr, s = gr.float(), torch.sigmoid(g.float())
        silu = g.float() * s
        du.copy_(gr * silu)
        dg.copy_((gr * u.float()).mul_(silu.mul_(1 - s).add_(s)))
    return d_gate, d_up


class _SiLUMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return silu_mul_values(gate, up)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        return silu_mul_grad(grad, gate, up)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (``[..., I]`` each) as one autograd node that saves ``gate`` and ``up``; inside an
    :class:`ActivationStorage`, the output is registered as rebuilt from their stored copies when saved again."""
    out = _SiLUMul.apply(gate, up)
    storage = ActivationStorage.active()
    if storage is not None and out.requires_grad:
        storage.derive(out, silu_mul_values, (gate, up))
    return out


def _swiglu_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


def is_swiglu_mlp(module: nn.Module) -> bool:
    """Whether ``module``'s forward is ``LlamaMLP``'s (same bytecode and names) with a SiLU activation."""
    forward, reference = type(module).forward.__code__, LlamaMLP.forward.__code__
    return (
        isinstance(getattr(module, "act_fn", None), (SiLUActivation, nn.SiLU))
        and forward.co_code == reference.co_code
        and forward.co_names == reference.co_names
    )


def fuse_swiglu_mlps(model: nn.Module) -> int:
    """Make every SwiGLU MLP of ``model`` (:func:`is_swiglu_mlp`) compute its product with :func:`silu_mul`, in
    place (an instance ``forward``; weights and ``state_dict`` unchanged). Returns how many it changed."""
    count = 0
    for module in model.modules():
        if "forward" not in module.__dict__ and is_swiglu_mlp(module):
            module.forward = types.MethodType(_swiglu_forward, module)
            count += 1
    return count
