"""The Llama family's SwiGLU MLP and RMSNorm (Llama, Mistral, Qwen2/3, SmolLM) as autograd nodes that leave less to
backward; :func:`fuse_blocks` switches a model's modules to them, outputs unchanged.

- **SwiGLU** (``down(silu(gate(x)) * up(x))``): transformers' ``LlamaMLP`` saves four ``[tokens, intermediate]``
  tensors: ``gate(x)`` (for SiLU's gradient), ``silu(gate(x))`` and ``up(x)`` (for the product's) and the product
  (the down projection's input, which its LoRA gradient reads). :func:`silu_mul` saves ``gate(x)`` and ``up(x)``.
- **RMSNorm**: ``LlamaRMSNorm`` saves its input in fp32 (twice over, for the square and the product) besides the
  normalized output its consumers save. :func:`rms_norm` saves the input in its own dtype and one fp32 scale per row.

Under :class:`~hf_lowprec.training.activations.ActivationStorage` the product and the normalized output are not
stored either: the storage rebuilds them in backward from its 8-bit copies of the inputs
(:meth:`ActivationStorage.derive`). On the Llama-3.2-1B shape these are most of a decoder layer's saved activations.

Written here because Liger-Kernel's fused SwiGLU and RMSNorm are Triton (GPUs only) and torch has neither fused. Forwards
are transformers' own torch ops, so outputs are the same bit for bit; SwiGLU's backward runs in the C++ CPU kernels
where they build (one pass; eager fp32 torch ops make eight, 4x slower at 256 x 8192), else as torch ops on row
blocks.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import SiLUActivation
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from hf_lowprec.modules.packed import native_kernels
from hf_lowprec.training.activations import ActivationStorage, row_blocks


def _elementwise_kernels(*tensors: torch.Tensor):
    """The C++ kernels (``modules/kernels/cpp.py``) for CPU tensors of one dtype, bf16 or fp32; else ``None``."""
    if len({t.dtype for t in tensors}) > 1:
        return None
    return native_kernels(*tensors)


def silu_mul_values(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (``[..., I]`` each) as transformers computes it, bit for bit: SiLU rounded to ``gate``'s
    dtype, then the product (two passes of torch ops; a model trained with the fused MLP gives a plain transformers
    model's outputs)."""
    return F.silu(gate) * up


def silu_mul_grad(
    grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, in_place: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`silu_mul_values` w.r.t. ``(gate, up)`` given the output's ``grad``, in fp32 then each
    input's dtype: ``d_up = grad * silu(gate)``, ``d_gate = grad * up * (s + silu(gate) * (1 - s))``,
    ``s = sigmoid(gate)``. ``in_place``: the gradients may overwrite ``gate`` and ``up`` (they do where the C++
    kernels run); else inputs are never written (``.float()`` of an fp32 tensor is the tensor itself)."""
    ext = _elementwise_kernels(grad, gate, up)
    if ext is not None:
        return tuple(ext.silu_mul_backward(grad.contiguous(), gate.contiguous(), up.contiguous(), in_place))
    d_gate = torch.empty_like(gate, memory_format=torch.contiguous_format)
    d_up = torch.empty_like(up, memory_format=torch.contiguous_format)
    for gr, g, u, dg, du in row_blocks(grad, gate, up, d_gate, d_up):
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
        gate, up = ctx.saved_tensors  # copies rebuilt from 8-bit storage for this backward alone take the gradients
        return silu_mul_grad(grad, gate, up, ActivationStorage.reader_owns(gate) and ActivationStorage.reader_owns(up))


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (``[..., I]`` each) as one autograd node that saves ``gate`` and ``up``; inside an
    :class:`ActivationStorage`, the output is registered as rebuilt from their stored copies when saved again."""
    out = _SiLUMul.apply(gate, up)
    storage = ActivationStorage.active()
    if storage is not None and out.requires_grad:
        storage.derive(out, silu_mul_values, (gate, up))
    return out


def rms_norm_values(
    x: torch.Tensor, weight: torch.Tensor, eps: float, rstd: torch.Tensor | None = None
) -> torch.Tensor:
    """``LlamaRMSNorm``'s output, bit for bit: ``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``, the
    normalization in fp32; ``x [..., H]``, ``weight [H]``. The fp32 ``rsqrt`` factors go into ``rstd [..., 1]`` if
    given."""
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    scales = torch.empty(*x.shape[:-1], 1, device=x.device) if rstd is None else rstd
    for xs, o, r in row_blocks(x, out, scales):
        xf = xs.float()
        r.copy_(torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))
        o.copy_(weight * (xf * r).to(x.dtype))
    return out


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        rstd = torch.empty(*x.shape[:-1], 1, device=x.device)
        out = rms_norm_values(x, weight, eps, rstd)
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx, grad):
        """With ``n = x * rstd`` (fp32) and ``d = grad * weight``: ``grad_x = rstd * (d - n * mean(d * n))``,
        ``grad_weight = sum over rows of grad * n`` (``n`` rounded to ``x``'s dtype, as the forward multiplies it)."""
        x, weight, rstd = ctx.saved_tensors
        grad_x = torch.empty_like(x, memory_format=torch.contiguous_format)
        grad_weight = torch.zeros(weight.shape, device=weight.device) if ctx.needs_input_grad[1] else None
        w = weight.float()
        for g, xs, r, gx in row_blocks(grad, x, rstd, grad_x):
            g, n = g.float(), xs.float() * r
            d = g * w
            gx.copy_(r * (d - n * (d * n).mean(-1, keepdim=True)))
            if grad_weight is not None:
                grad_weight += (g * n.to(x.dtype).float()).sum(0)
        return grad_x, None if grad_weight is None else grad_weight.to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rms_norm_values` as one autograd node that saves ``x`` and its fp32 scales ``[..., 1]``; inside an
    :class:`ActivationStorage`, the output is registered as rebuilt from ``x``'s stored copy when saved again."""
    out = _RMSNorm.apply(x, weight, eps)
    storage = ActivationStorage.active()
    if storage is not None and out.requires_grad:
        storage.derive(out, lambda stored: rms_norm_values(stored, weight, eps), (x,))
    return out


def _swiglu_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


def _rms_norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return rms_norm(x, self.weight, self.variance_epsilon)


def _same_forward(module: nn.Module, reference: type) -> bool:
    """Whether ``module``'s class has ``reference``'s forward (the same bytecode and names: a copy of it, as
    transformers' ``# Copied from`` classes are)."""
    forward, expected = type(module).forward.__code__, reference.forward.__code__
    return forward.co_code == expected.co_code and forward.co_names == expected.co_names


def is_swiglu_mlp(module: nn.Module) -> bool:
    """Whether ``module`` computes ``LlamaMLP``'s forward with a SiLU activation."""
    return isinstance(getattr(module, "act_fn", None), (SiLUActivation, nn.SiLU)) and _same_forward(module, LlamaMLP)


def is_rms_norm(module: nn.Module) -> bool:
    """Whether ``module`` computes ``LlamaRMSNorm``'s forward."""
    return isinstance(getattr(module, "weight", None), torch.Tensor) and _same_forward(module, LlamaRMSNorm)


FUSED = {"swiglu_mlp": (is_swiglu_mlp, _swiglu_forward), "rms_norm": (is_rms_norm, _rms_norm_forward)}
"""kind -> (which modules, the forward they are given)."""


def fuse_blocks(model: nn.Module) -> dict[str, int]:
    """Give every module of ``model`` that :data:`FUSED` recognises its fused forward, in place (an instance
    ``forward``; weights and ``state_dict`` unchanged). Returns how many of each kind it changed."""
    counts = dict.fromkeys(FUSED, 0)
    for module in model.modules():
        if "forward" in module.__dict__:
            continue  # fused already, or hooked by someone else
        for kind, (recognise, forward) in FUSED.items():
            if recognise(module):
                module.forward = types.MethodType(forward, module)
                counts[kind] += 1
                break
    return counts
