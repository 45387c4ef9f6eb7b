"""8-bit stored activations: tensors saved for backward kept as int8 or FP8 (per-row scales) instead of bf16/fp32.

At small model sizes the activations autograd keeps between forward and backward dominate training
memory (SmolLM2-135M, 4 x 256 tokens: ~0.9 GB of bf16 activations against ~0.1 GB of INT4 weights).
Gradient checkpointing drops them and pays a second forward; storing them in 8 bits halves (bf16) or
quarters (fp32) them for two elementwise passes and a rounding error in the gradients.

Formats (one scale per row, i.e. per token for ``[..., hidden]`` tensors):
- ``int8`` (default): symmetric, 127 levels per sign. Measured LoRA-gradient error against exact bf16
  storage on 6 layers of SmolLM2-135M: median 2.3%, worst 7.8%.
- ``fp8``: E4M3, 3 mantissa bits (<= 6.25% per element): median 3.7%, worst 17.5% on the same test.

Parameters, buffers, integer tensors and small tensors are saved as they are; a tensor saved several
times (one input feeding q, k and v) is stored once.

    with ActivationStorage(model):
        loss = compute_loss(model, batch)
    loss.backward()
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from hf_lowprec.formats import E4M3, dequantize_fp8, fp8_amax, fp8_scale, quantize_fp8
from hf_lowprec.modules.int4_packed import compiled, dequantize_rows, quantize_rows

MIN_NUMEL = 1 << 16  # smaller tensors (norm statistics, rotary tables) are not worth a kernel launch
FORMATS = ("int8", "fp8")


def pack_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [R, C]`` → ``(E4M3 codes [R, C], fp32 scale [R, 1])`` with ``x ≈ codes / scale``."""
    scale = fp8_scale(fp8_amax(x, "row"), E4M3)
    return quantize_fp8(x, scale, E4M3), scale


def unpack_fp8_rows(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`pack_fp8_rows`, in ``dtype``."""
    return dequantize_fp8(codes, scale, dtype)


class _Packed:
    __slots__ = ("codes", "scale", "shape", "dtype", "fmt")

    def __init__(self, t: torch.Tensor, fmt: str):
        self.shape, self.dtype, self.fmt = t.shape, t.dtype, fmt
        rows = t.detach().reshape(-1, t.shape[-1]).contiguous()
        self.codes, self.scale = quantize_rows(rows) if fmt == "int8" else compiled(pack_fp8_rows)(rows)

    def unpack(self) -> torch.Tensor:
        if self.fmt == "int8":
            return dequantize_rows(self.codes, self.scale, None, self.dtype).view(self.shape)
        return compiled(unpack_fp8_rows)(self.codes, self.scale, self.dtype).view(self.shape)


class ActivationStorage:
    """Context manager: tensors autograd saves inside it are stored in 8 bits (see the module docstring).

    ``model``: its parameters and buffers are never converted. ``fmt``: ``int8`` or ``fp8``. Counters
    ``packed_bytes`` (original size) and ``stored_bytes`` (codes + scales) accumulate over its uses.
    """

    def __init__(self, model: nn.Module, fmt: str = "int8", min_numel: int = MIN_NUMEL):
        if fmt not in FORMATS:
            raise ValueError(f"activation storage format {fmt!r}: choose one of {', '.join(FORMATS)}")
        self.fmt = fmt
        self.min_numel = min_numel
        self._skip = {t.data_ptr() for t in (*model.parameters(), *model.buffers())}
        self._seen: dict[tuple, tuple[weakref.ref, _Packed]] = {}
        self._hooks = None
        self.packed_bytes = 0
        self.stored_bytes = 0

    def _pack(self, t: torch.Tensor):
        if t.dtype not in (torch.bfloat16, torch.float32, torch.float16) or t.numel() < self.min_numel or t.dim() < 2:
            return t
        if t.data_ptr() in self._skip:
            return t
        key = (t.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version)
        seen = self._seen.get(key)
        if seen is not None and seen[0]() is t:  # the same live tensor (memory reused by a new one does not match)
            return seen[1]
        packed = _Packed(t, self.fmt)
        self._seen[key] = (weakref.ref(t), packed)
        self.packed_bytes += t.numel() * t.element_size()
        self.stored_bytes += packed.codes.numel() + packed.scale.numel() * 4
        return packed

    @staticmethod
    def _unpack(p):
        return p.unpack() if isinstance(p, _Packed) else p

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self._seen.clear()  # the graph keeps what it needs; the dedup table is per forward
        return False
