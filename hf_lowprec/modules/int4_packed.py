"""``PackedInt4Linear``: a frozen linear whose weight is stored as packed INT4 codes (two per byte).

Forward and grad-input are both computed from the packed codes (the codes are dequantized tile by
tile, never kept as a full-precision copy between forward and backward), so a model whose base
linears are packed still passes correct gradients to earlier layers and to LoRA adapters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hf_lowprec.formats import FormatSpec, dequantize_int, pack_int4, unpack_int4


class _PackedInt4Function(torch.autograd.Function):
    """``y = x @ dequant(W)^T``; backward gives ``grad_x = grad_y @ dequant(W)`` and no weight gradient."""

    @staticmethod
    def forward(ctx, x2d, layer: "PackedInt4Linear"):
        ctx.layer = layer
        return torch.mm(x2d, layer.dequantized_weight(x2d.dtype).t())

    @staticmethod
    def backward(ctx, grad_out):
        return torch.mm(grad_out, ctx.layer.dequantized_weight(grad_out.dtype)), None


class PackedInt4Linear(nn.Module):
    """Frozen INT4 linear: ``qweight`` uint8 ``[N, ceil(K/2)]``, ``step`` ``[N, G]``, optional ``zero``.

    Build it with :meth:`from_codes` (``Int4Linear.freeze()`` does).
    """

    def __init__(self, in_features: int, out_features: int, spec: FormatSpec | str, bias: bool = False,
                 dtype: torch.dtype = torch.bfloat16, device=None):  # fmt: skip
        super().__init__()
        self.spec = FormatSpec.parse(spec)
        if self.spec.family != "int4":
            raise ValueError(f"PackedInt4Linear stores int4 formats, got {self.spec.name!r}")
        self.in_features, self.out_features = in_features, out_features
        groups = 1 if self.spec.group_size is None else -(-in_features // self.spec.group_size)
        self.register_buffer("qweight", torch.zeros(out_features, (in_features + 1) // 2, dtype=torch.uint8, device=device))
        self.register_buffer("step", torch.ones(out_features, groups, dtype=dtype, device=device))
        zero = None if self.spec.symmetric else torch.zeros(out_features, groups, dtype=dtype, device=device)
        self.register_buffer("zero", zero)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None

    @classmethod
    def from_codes(cls, codes, step, zero, spec: FormatSpec, bias: torch.Tensor | None, dtype: torch.dtype):
        """Pack integer ``codes [N, K]`` with their ``step``/``zero`` ``[N, G]``; steps kept in ``dtype``."""
        out_features, in_features = codes.shape
        new = cls(in_features, out_features, spec, bias is not None, dtype, codes.device)
        new.qweight.copy_(pack_int4(codes))
        new.step.copy_(step)
        if zero is not None:
            new.zero.copy_(zero)
        if bias is not None:
            new.bias.data.copy_(bias.detach())
        return new

    def codes(self) -> torch.Tensor:
        """The integer codes ``[N, K]`` (int8 when symmetric, else values in ``[0, 15]``)."""
        return unpack_int4(self.qweight, self.in_features, signed=self.spec.symmetric)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``(codes - zero) * step`` as a dense ``[N, K]`` tensor."""
        zero = None if self.zero is None else self.zero.float()
        return dequantize_int(self.codes(), self.spec, self.step.float(), zero, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = _PackedInt4Function.apply(x.reshape(-1, shape[-1]), self).reshape(*shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.spec.name}, packed"
