"""FP8 storage of the activations autograd keeps for backward.

Between forward and backward, every op leaves tensors behind for its gradient (inputs of matmuls,
norms, activation functions, attention, the loss). :class:`FP8SavedActivations` packs them, through
``torch.autograd.graph.saved_tensors_hooks``, into E4M3 with one fp32 scale per row (last dim) — 1 byte
per element instead of 2 (bf16) or 4 (fp32) — and dequantizes them when backward asks. Gradients are
then computed from the FP8 copies (as COAT, Xi et al. 2024, and the FP8 layers' own tensorwise inputs
do); the forward pass is unchanged.

Written here because torch provides only the hook mechanism; torchao's float8 training stores FP8
copies for its own linears only.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from hf_lowprec.formats import E4M3, E5M2, dequantize_fp8, fp8_amax, fp8_scale, quantize_fp8


_SLICE = 1 << 20  # elements (de)quantized at a time: bounds the fp32 temporaries of a large tensor (logits)


class _Packed:
    """An FP8 copy of a saved tensor: codes ``[R, C]``, row scales ``[R, 1]``, original shape and dtype."""

    __slots__ = ("q", "scale", "shape", "dtype", "__weakref__")

    def __init__(self, t: torch.Tensor, dtype: torch.dtype):
        rows = t.detach().reshape(-1, t.shape[-1])
        self.q = torch.empty(rows.shape, dtype=dtype, device=rows.device)
        self.scale = torch.empty(rows.shape[0], 1, device=rows.device)
        step = max(1, _SLICE // rows.shape[1])
        for r0 in range(0, rows.shape[0], step):
            part = rows[r0 : r0 + step]
            scale = fp8_scale(fp8_amax(part, "row", dim=-1), dtype)
            self.scale[r0 : r0 + step] = scale
            self.q[r0 : r0 + step] = quantize_fp8(part, scale, dtype)
        self.shape, self.dtype = t.shape, t.dtype

    def unpack(self) -> torch.Tensor:
        out = torch.empty(self.q.shape, dtype=self.dtype, device=self.q.device)
        step = max(1, _SLICE // self.q.shape[1])
        for r0 in range(0, self.q.shape[0], step):
            out[r0 : r0 + step] = dequantize_fp8(self.q[r0 : r0 + step], self.scale[r0 : r0 + step], self.dtype)
        return out.reshape(self.shape)


class FP8SavedActivations(torch.autograd.graph.saved_tensors_hooks):
    """Context manager: tensors saved for backward inside it are stored in FP8 (see the module docstring).

    Args:
        module: its parameters (and anything sharing their storage, such as a weight cast that returned
            the weight itself) are saved as they are: they stay in memory anyway.
        min_numel: smaller tensors are saved as they are (scales would cost more than they save).
        dtype: FP8 storage dtype, E4M3 by default (E5M2 trades precision for range).

    Integer and FP8 tensors pass through. A tensor (or view) saved by several ops is packed once. Use it around
    the forward pass: ``with FP8SavedActivations(model): loss = model(**batch).loss`` then
    ``loss.backward()`` outside or inside.
    """

    def __init__(self, module: nn.Module | None = None, min_numel: int = 4096, dtype: torch.dtype = E4M3):
        if dtype not in (E4M3, E5M2):
            raise ValueError(f"FP8 activation storage dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
        self.min_numel, self.dtype = min_numel, dtype
        self._keep = set() if module is None else {p.untyped_storage().data_ptr() for p in module.parameters()}
        self._cache: dict[tuple, tuple[weakref.ref, int, weakref.ref]] = {}  # view key -> (base, version, packed)
        self.packed_bytes = 0
        self.original_bytes = 0
        super().__init__(self._pack, self._unpack)

    def __exit__(self, *args):
        self._cache.clear()
        return super().__exit__(*args)

    def _pack(self, t: torch.Tensor):
        if (
            not t.is_floating_point() or t.dtype in (E4M3, E5M2) or t.dim() == 0 or t.numel() < self.min_numel
            or t.untyped_storage().data_ptr() in self._keep
        ):  # fmt: skip
            return t
        # ops often save views of one tensor (a linear's input reshaped to 2-D, once per q/k/v projection):
        # key on the viewed tensor and the view's geometry, and check the base is still the same, unchanged tensor
        base = t if t._base is None else t._base
        key = (id(base), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        hit = self._cache.get(key)
        if hit is not None and hit[0]() is base and hit[1] == t._version and hit[2]() is not None:
            return hit[2]()
        packed = _Packed(t, self.dtype)
        if len(self._cache) > 4096:
            self._cache = {k: v for k, v in self._cache.items() if v[0]() is not None and v[2]() is not None}
        self._cache[key] = (weakref.ref(base), t._version, weakref.ref(packed))
        self.packed_bytes += packed.q.numel() + packed.scale.numel() * 4
        self.original_bytes += t.numel() * t.element_size()
        return packed

    @staticmethod
    def _unpack(saved):
        return saved.unpack() if isinstance(saved, _Packed) else saved
