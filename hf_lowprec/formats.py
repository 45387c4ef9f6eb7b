"""Numeric formats: the one place that knows bit layouts, ranges and scale granularities.

A :class:`FormatSpec` is parsed from a short name (``fp8``, ``fp8-rowwise``, ``int4-g64-asym``,
``nf4-g64`` ...). The functions below quantize and dequantize tensors for those formats; the
trainable layers in :mod:`hf_lowprec.modules` read their numerics from here.

Scale convention (the same as torchao's float8 code): for FP8 a *scale* multiplies the high-precision
tensor to bring it into the format's range (``q = saturate(x * scale)``, ``x ≈ q / scale``). For the
integer formats a *step* is the size of one code (``x ≈ (code - zero) * step``), as in LSQ and GPTQ.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass, field

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
"""Largest finite magnitude of each FP8 dtype; casts saturate to it."""
FP8_MANTISSA_BITS = {E4M3: 3, E5M2: 2}
_EPS = 1e-12  # smallest amax considered non-zero (same as torchao.float8.float8_utils.EPS)

NF4_LEVELS = torch.tensor(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ]
)
"""The 16 NormalFloat-4 levels published with QLoRA (Dettmers et al., 2023, appendix E)."""

FAMILIES = ("fp32", "bf16", "fp8", "int8", "int4", "nf4")
HIGH_PRECISION = ("fp32", "bf16")
FP8_GRANULARITIES = {"": "tensor", "tensorwise": "tensor", "rowwise": "row", "block": "block", "mx": "mx"}
_FP8_NAMES = {"tensor": "fp8", "row": "fp8-rowwise", "block": "fp8-block", "mx": "fp8-mx"}  # canonical, per granularity
BLOCK = 128  # DeepSeek-V3 / TransformerEngine Float8BlockScaling: 1x128 activations, 128x128 weights
MX_BLOCK = 32  # OCP Microscaling (MXFP8): 32 consecutive elements along the contraction dim share an E8M0 scale
EXAMPLE_NAMES = (
    "fp32",
    "bf16",
    "fp8",
    "fp8-rowwise",
    "fp8-block",
    "fp8-mx",
    "fp8-rowwise-rht",
    "int8",
    "int4",
    "int4-g32",
    "int4-g64",
    "int4-g128",
    "int4-g64-asym",
    "int4-g64-a8",
    "int4-g64-asym-rht",
    "int4-g64-a8-sq",
    "nf4-g64",
)
_NAME_RE = re.compile(
    r"^(?P<family>fp32|bf16|fp8|int8|int4|nf4)"
    r"(?:-(?P<fp8g>tensorwise|rowwise|block|mx))?"
    r"(?:-g(?P<group>\d+))?"
    r"(?P<asym>-asym)?"
    r"(?P<a8>-a8)?"
    r"(?P<sq>-sq)?"
    r"(?P<rht>-rht)?$"
)


@dataclass(frozen=True)
class FormatSpec:
    """How one layer stores and computes: family, scale granularity and options.

    Attributes:
        family: one of ``fp32, bf16, fp8, int8, int4, nf4``.
        granularity: ``tensor``, ``row``, ``block`` (1x128 / 128x128) or ``mx`` (1x32 along the contraction
            dimension, power-of-two scales: MXFP8) for FP8; ``channel`` (one step per output row) or ``group``
            for the integer and NF4 formats; ``none`` for fp32/bf16.
        group_size: elements per scale group along the input dimension (``group`` only).
        symmetric: integer codes centred on zero (``False``: a zero point per group).
        act_int8: also fake-quantize the layer's input to int8 per token (int4/int8 only).
        rotate: quantize the input and weight in a randomized Hadamard basis of the input dimension
            (``-rht``; fp8, int4 and int8 linears; :mod:`hf_lowprec.rotation`).
        smooth: divide the input by per-channel scales folded into the weight's columns, calibrated on the first
            batch (``-sq``, SmoothQuant; fp8, int4 and int8 linears; :mod:`hf_lowprec.smoothing`).
    """

    family: str
    granularity: str = "none"
    group_size: int | None = None
    symmetric: bool = True
    act_int8: bool = False
    rotate: bool = False
    smooth: bool = False
    name: str = field(default="", compare=False)

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"unknown format family {self.family!r}; choose one of {', '.join(FAMILIES)}")
        allowed = {
            "fp32": ("none",),
            "bf16": ("none",),
            "fp8": ("tensor", "row", "block", "mx"),
            "int8": ("channel", "group"),
            "int4": ("channel", "group"),
            "nf4": ("group",),
        }[self.family]
        if self.granularity not in allowed:
            raise ValueError(
                f"format {self.family}: granularity {self.granularity!r} not allowed; choose one of {allowed}"
            )
        if (self.granularity == "group") != (self.group_size is not None):
            raise ValueError(f"format {self.family}: group_size is required exactly for granularity 'group'")
        if self.group_size is not None and (self.group_size < 2 or self.group_size % 2):
            raise ValueError(f"group size must be an even number >= 2, got {self.group_size}")
        if self.act_int8 and self.family not in ("int4", "int8"):
            raise ValueError(f"'-a8' (int8 activations) applies to int4/int8 formats, not {self.family}")
        if not self.symmetric and self.family not in ("int4", "int8"):
            raise ValueError(f"'-asym' applies to int4/int8 formats, not {self.family}")
        if self.rotate and self.family not in ("fp8", "int4", "int8"):
            raise ValueError(f"'-rht' (Hadamard rotation) applies to fp8/int4/int8 formats, not {self.family}")
        if self.smooth and self.family not in ("fp8", "int4", "int8"):
            raise ValueError(f"'-sq' (smoothing) applies to fp8/int4/int8 formats, not {self.family}")
        if self.smooth and self.rotate:
            raise ValueError("'-sq' and '-rht' are two outlier treatments of the same input; choose one")
        object.__setattr__(self, "name", self._canonical_name())

    @classmethod
    def parse(cls, name: "str | FormatSpec") -> "FormatSpec":
        """Parse a short name such as ``fp8-rowwise`` or ``int4-g64-asym`` (``FormatSpec`` passes through)."""
        if isinstance(name, FormatSpec):
            return name
        if not isinstance(name, str):
            raise ValueError(f"format must be a string such as 'fp8' or 'int4-g64', got {type(name).__name__}")
        m = _NAME_RE.match(name.strip().lower())
        if m is None:
            close = difflib.get_close_matches(name, EXAMPLE_NAMES, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ValueError(
                f"unknown format {name!r}{hint}; choose one of {', '.join(EXAMPLE_NAMES)}, or combine: any group size, "
                "'-asym' for zero points, '-rht' or '-sq' on fp8/int4/int8 (fp8-mx-rht, int4-g128-asym, fp8-sq)"
            )
        family, fp8g, group = m["family"], m["fp8g"], m["group"]
        rotate, smooth = m["rht"] is not None, m["sq"] is not None
        if fp8g is not None and family != "fp8":
            raise ValueError(f"unknown format {name!r}: '-{fp8g}' applies to fp8 only")
        if family == "fp8":
            if group is not None:
                raise ValueError(f"unknown format {name!r}: fp8 takes -tensorwise, -rowwise, -block or -mx, not -g")
            return cls("fp8", FP8_GRANULARITIES[fp8g or ""], rotate=rotate, smooth=smooth)
        if family in HIGH_PRECISION:
            if group or m["asym"] or m["a8"] or rotate or smooth:
                raise ValueError(f"unknown format {name!r}: {family} takes no options")
            return cls(family)
        if family == "nf4":
            if m["asym"] or m["a8"] or rotate or smooth:
                raise ValueError(f"unknown format {name!r}: nf4 takes only a group size (nf4-g64)")
            return cls("nf4", "group", int(group or 64))
        gran = "group" if group else "channel"
        return cls(family, gran, int(group) if group else None, m["asym"] is None, m["a8"] is not None, rotate, smooth)

    def _canonical_name(self) -> str:
        suffix = ("-sq" if self.smooth else "") + ("-rht" if self.rotate else "")
        if self.family == "fp8":
            return _FP8_NAMES[self.granularity] + suffix
        name = self.family
        if self.group_size is not None:
            name += f"-g{self.group_size}"
        if not self.symmetric:
            name += "-asym"
        if self.act_int8:
            name += "-a8"
        return name + suffix

    def __str__(self) -> str:
        return self.name

    @property
    def is_high_precision(self) -> bool:
        """True for fp32/bf16: the layer is left as it is."""
        return self.family in HIGH_PRECISION

    @property
    def bits(self) -> int:
        """Bits per stored weight element, scales excluded."""
        return {"fp32": 32, "bf16": 16, "fp8": 8, "int8": 8, "int4": 4, "nf4": 4}[self.family]

    def bytes_per_param(self, in_features: int = 4096) -> float:
        """Stored bytes per weight element, scales (bf16 steps, fp32 FP8 scales, E8M0 MX scales) included; a row's
        last group, padded when ``in_features`` is no multiple of the group, holds its scales as a whole one does."""
        base = self.bits / 8
        if self.granularity == "group":
            per_group = 2 + (0 if self.symmetric else 2)
            return base + math.ceil(in_features / self.group_size) * per_group / in_features
        if self.granularity == "channel":
            return base + (2 if self.symmetric else 4) / in_features
        if self.granularity == "row":
            return base + 4 / in_features
        if self.granularity == "block":
            return base + 4 / (BLOCK * BLOCK)
        if self.granularity == "mx":
            return base + math.ceil(in_features / MX_BLOCK) / in_features
        return base

    @property
    def qrange(self) -> tuple[int, int]:
        """Smallest and largest integer code (int formats only)."""
        bits = self.bits
        if self.symmetric:
            return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        return 0, 2**bits - 1


# ----------------------------------------------------------------------------------------- FP8


def fp8_saturate(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast to ``dtype`` clamping to its largest finite value (E5M2 would otherwise overflow to inf)."""
    fmax = FP8_MAX[dtype]
    return x.clamp(-fmax, fmax).to(dtype)


def block_shape(granularity: str, role: str) -> tuple[int, int] | None:
    """Scale block of a forward GEMM operand (blocks along its last, contraction, dimension): ``block`` 128x128
    for weights and 1x128 for activations and gradients; ``mx`` 1x32 for every role; ``None`` otherwise."""
    if granularity == "mx":
        return (1, MX_BLOCK)
    if granularity == "block":
        return (BLOCK, BLOCK) if role == "weight" else (1, BLOCK)
    return None


def fp8_amax(x: torch.Tensor, granularity: str, dim: int = -1, block: tuple[int, int] = (1, BLOCK)) -> torch.Tensor:
    """Absolute maximum of a 2-D tensor ``[R, C]`` per scaling group, fp32.

    Shapes: ``tensor`` → ``[]``; ``row`` → amax over ``dim`` kept as size 1 (``dim=-1``: ``[R, 1]``,
    ``dim=0``: ``[1, C]``); ``block`` and ``mx`` → ``[ceil(R/br), ceil(C/bc)]``.
    """
    if granularity == "tensor":
        return x.abs().amax().float()
    if granularity == "row":
        return x.abs().amax(dim=dim, keepdim=True).float()
    if granularity in ("block", "mx"):
        br, bc = block
        padded = _pad_to(x, (br, bc))
        r, c = padded.shape
        return padded.abs().reshape(r // br, br, c // bc, bc).amax(dim=(1, 3)).float()
    raise ValueError(f"unknown FP8 granularity {granularity!r}; choose one of tensor, row, block, mx")


def fp8_scale(amax: torch.Tensor, dtype: torch.dtype, power_of_two: bool = False) -> torch.Tensor:
    """Scale that maps ``amax`` onto the format's largest value (fp32; computed in fp64 like torchao). An inf/NaN
    ``amax`` (an overflowed gradient) gives 1: its finite values cast as they are, ±inf saturates and a NaN stays where
    it was (torchao's scale of 0 turned the whole cast into NaN: ``inf x 0``)."""
    top = FP8_MAX[dtype]
    scale = (top / amax.double().nan_to_num(nan=top, posinf=top).clamp(min=_EPS)).float()
    if power_of_two:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def expand_scale(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    """Broadcast a block scale ``[ceil(R/br), ceil(C/bc)]`` to a full ``[R, C]`` tensor."""
    br, bc = block
    full = scale.repeat_interleave(br, dim=0).repeat_interleave(bc, dim=1)
    return full[: shape[0], : shape[1]]


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, block: tuple[int, int] | None = None):
    """``saturate(x * scale)`` in ``dtype``; ``block`` given when ``scale`` is a block scale."""
    if block is not None:
        scale = expand_scale(scale, x.shape, block)
    return fp8_saturate(x.float() * scale, dtype)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, out_dtype=torch.float32, block=None) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8`: ``q / scale`` in ``out_dtype``."""
    if block is not None:
        scale = expand_scale(scale, q.shape, block)
    return (q.float() / scale).to(out_dtype)


def fp8_quantize_dequantize(
    x: torch.Tensor, dtype: torch.dtype, granularity: str, role: str = "input", amax: torch.Tensor | None = None
) -> torch.Tensor:
    """Round-trip a 2-D ``x`` through FP8 with a dynamic scale (from ``amax`` if given); keeps ``x``'s dtype."""
    block = block_shape(granularity, role)
    if amax is None:
        amax = fp8_amax(x, granularity, -1, block or (1, BLOCK))
    scale = fp8_scale(amax, dtype, power_of_two=granularity != "tensor")  # as FP8Linear does
    return dequantize_fp8(quantize_fp8(x, scale, dtype, block), scale, x.dtype, block)


# ------------------------------------------------------------------------------ integer and NF4


def _pad_to(x: torch.Tensor, multiple: tuple[int, int]) -> torch.Tensor:
    """Zero-pad a 2-D tensor so each dimension is a multiple of ``multiple``."""
    pr = -x.shape[0] % multiple[0]
    pc = -x.shape[1] % multiple[1]
    return torch.nn.functional.pad(x, (0, pc, 0, pr)) if (pr or pc) else x


def group_view(w: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """``[R, C]`` → ``[R, G, g]`` with the last group zero-padded when ``C % g != 0`` (``None``: one group)."""
    g = w.shape[1] if group_size is None else group_size
    return _pad_to(w, (1, g)).reshape(w.shape[0], -1, g)


def int_steps(w: torch.Tensor, spec: FormatSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-group step (and zero point if asymmetric) for weight ``w [R, C]``; shapes ``[R, G]``, fp32.

    Symmetric: ``step = amax / qmax``. Asymmetric: ``step = (max - min) / (2^b - 1)`` with the range
    widened to include 0, ``zero = round(-min / step)``.
    """
    grouped = group_view(w.detach().float(), spec.group_size)
    qmin, qmax = spec.qrange
    if spec.symmetric:
        return (grouped.abs().amax(-1) / qmax).clamp(min=_EPS), None
    lo = grouped.amin(-1).clamp(max=0)
    hi = grouped.amax(-1).clamp(min=0)
    step = ((hi - lo) / (qmax - qmin)).clamp(min=_EPS)
    return step, torch.round(-lo / step).clamp(qmin, qmax)


def quantize_int(w: torch.Tensor, spec: FormatSpec, step: torch.Tensor, zero: torch.Tensor | None = None):
    """Integer codes (int8 tensor ``[R, C]``) of ``w`` for given steps/zero points ``[R, G]``."""
    qmin, qmax = spec.qrange
    grouped = group_view(w.float(), spec.group_size)
    codes = torch.round(grouped / step.unsqueeze(-1))
    if zero is not None:
        codes = codes + zero.unsqueeze(-1)
    codes = codes.clamp(qmin, qmax).reshape(w.shape[0], -1)[:, : w.shape[1]]
    return codes.to(torch.int8 if spec.symmetric else torch.uint8)


def dequantize_int(codes: torch.Tensor, spec: FormatSpec, step, zero=None, out_dtype=torch.float32):
    """Inverse of :func:`quantize_int`: ``(codes - zero) * step`` as ``out_dtype [R, C]``."""
    rows, cols = codes.shape
    grouped = group_view(codes.float(), spec.group_size)
    if zero is not None:
        grouped = grouped - zero.unsqueeze(-1)
    return (grouped * step.unsqueeze(-1)).reshape(rows, -1)[:, :cols].to(out_dtype)


def quantize_nf4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """NF4 level indices (uint8 ``[R, C]``) and per-group absmax (fp32 ``[R, G]``)."""
    grouped = group_view(w.detach().float(), group_size)
    absmax = grouped.abs().amax(-1).clamp(min=_EPS)
    normed = grouped / absmax.unsqueeze(-1)
    midpoints = (NF4_LEVELS[1:] + NF4_LEVELS[:-1]).to(w.device) / 2
    idx = torch.bucketize(normed, midpoints)  # nearest level; O(1) memory unlike an argmin over 16
    return idx.reshape(w.shape[0], -1)[:, : w.shape[1]].to(torch.uint8), absmax


def dequantize_nf4(idx: torch.Tensor, absmax: torch.Tensor, group_size: int, out_dtype=torch.float32):
    """Inverse of :func:`quantize_nf4`."""
    rows, cols = idx.shape
    values = group_view(NF4_LEVELS.to(idx.device)[idx.long()], group_size)
    return (values * absmax.unsqueeze(-1)).reshape(rows, -1)[:, :cols].to(out_dtype)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes (any int dtype, values in ``[-8, 15]``, last dim ``C``) two per byte → uint8 ``[...,
    ceil(C/2)]``.

    Element ``2i`` goes to the low nibble of byte ``i``, ``2i+1`` to the high nibble. Signed codes are
    stored as their two's-complement nibble; :func:`unpack_int4` with ``signed=True`` restores them.
    """
    nibbles = (codes.to(torch.int16) & 0xF).to(torch.uint8)
    if nibbles.shape[-1] % 2:
        nibbles = torch.nn.functional.pad(nibbles, (0, 1))
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor, cols: int, signed: bool = True) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: int8 codes ``[..., cols]`` (``signed``: ``[-8, 7]``, else ``[0, 15]``)."""
    low = (packed & 0xF).to(torch.int8)
    high = (packed >> 4).to(torch.int8)
    codes = torch.stack((low, high), dim=-1).flatten(-2)[..., :cols]
    return torch.where(codes > 7, codes - 16, codes) if signed else codes


def unpack_int4_planes(packed: torch.Tensor, signed: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes of :func:`pack_int4` split by column parity: ``(codes[..., 0::2], codes[..., 1::2])``, int8.

    Cheaper than :func:`unpack_int4` (no interleave): each is one elementwise pass over the bytes.
    """
    if signed:
        as_int8 = packed.view(torch.int8)
        return (as_int8 << 4) >> 4, as_int8 >> 4  # arithmetic shifts sign-extend each nibble
    return (packed & 0xF).view(torch.int8), (packed >> 4).view(torch.int8)


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest with a straight-through gradient."""
    return x + (torch.round(x) - x).detach()


class _FakeQuantizeInt(torch.autograd.Function):
    """Quantize-dequantize with the LSQ gradients, saving only ``w`` and ``step`` for backward.

    Written by hand (not composed from autograd ops) because the composed graph keeps four fp32
    copies of the weight alive until backward (several times a bf16 layer's activations; benchmarks/layers.py).
    """

    @staticmethod
    def forward(ctx, w, step, zero, spec):
        ctx.save_for_backward(w, step, zero)
        ctx.spec = spec
        # in place on one buffer, without the backward's mask: the sensitivity scan quantizes every weight once per
        # batch, and this takes 1.15 ms instead of 3.33 for a 1536x576 int4-g64-asym weight (2-core AVX2 CPU)
        out = _unrounded(w, spec, step, zero).round_().clamp_(*spec.qrange)
        if zero is not None:
            out.sub_(zero.unsqueeze(-1))
        return _ungroup(out.mul_(step.unsqueeze(-1)), w).to(w.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        w, step, zero = ctx.saved_tensors
        q, v, in_range = _int_grid(w, ctx.spec, step, zero)
        g = group_view(grad_out.float(), ctx.spec.group_size)
        grad_w = _ungroup(g * in_range, w).to(w.dtype)
        # d out / d step: (round(v) - v) inside the range, (q - zero) where the code clips
        d_step = torch.where(in_range, q - v, q if zero is None else q - zero.unsqueeze(-1))
        return grad_w, (g * d_step).sum(-1).to(step.dtype), None, None


def _int_grid(w, spec: FormatSpec, step, zero):
    """Codes ``q`` (clamped), unrounded ``v = w/step + zero`` and the in-range mask, grouped ``[R, G, g]``."""
    qmin, qmax = spec.qrange
    v = _unrounded(w, spec, step, zero)
    r = torch.round(v)
    in_range = (r >= qmin) & (r <= qmax)  # on the rounded value: w = ±amax (w/s = qmax ± 1 ulp) stays in
    return r.clamp(qmin, qmax), v, in_range


def _unrounded(w, spec: FormatSpec, step, zero) -> torch.Tensor:
    """``w / step + zero`` grouped ``[R, G, g]``, fp32, in a buffer of its own."""
    v = group_view(w.float(), spec.group_size) / step.float().unsqueeze(-1)
    return v if zero is None else v.add_(zero.unsqueeze(-1))


def _ungroup(grouped: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``[R, G, g]`` → ``[R, C]`` dropping the padding of the last group."""
    rows, cols = like.shape
    return grouped.reshape(rows, -1)[:, :cols]


def fake_quantize_int(w: torch.Tensor, spec: FormatSpec, step: torch.Tensor, zero: torch.Tensor | None = None):
    """Differentiable quantize-dequantize of ``w [R, C]`` with steps ``[R, G]``.

    Gradient to ``w``: straight-through where the rounded code is in range, zero where it clips (LSQ clips the
    unrounded ``w / s``: within half a step beyond the grid's ends this passes the gradient, as PyTorch's learnable
    fake-quantize does). Gradient to ``step``: the LSQ gradient (Esser et al., 2020) — the caller scales it (see
    :mod:`hf_lowprec.scaling`). ``zero`` is treated as a constant.
    """
    return _FakeQuantizeInt.apply(w, step, zero, spec)


def fake_quantize_per_token_int8(x: torch.Tensor) -> torch.Tensor:
    """Dynamic symmetric int8 per-token (last dim) quantize-dequantize, straight-through gradient."""
    step = (x.detach().abs().amax(-1, keepdim=True).float() / 127).clamp(min=_EPS)
    return (round_ste(x.float() / step).clamp(-128, 127) * step).to(x.dtype)


def fp8_relative_ulp(dtype: torch.dtype) -> float:
    """Half an ulp relative to a normal value: the bound on round-to-nearest relative error."""
    return 2.0 ** -(FP8_MANTISSA_BITS[dtype] + 1)
