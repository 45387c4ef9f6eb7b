"""8-bit stored activations: tensors saved for backward kept as int8 or FP8 (per-row scales) instead of bf16/fp32.

Between forward and backward, every op leaves tensors behind for its gradient (inputs of matmuls,
norms, activation functions, attention, the loss). At small model sizes they dominate training
memory (SmolLM2-135M, 4 x 256 tokens: ~0.9 GB of bf16 activations against ~0.1 GB of INT4 weights).
Gradient checkpointing drops them and pays a second forward; :class:`ActivationStorage` instead packs
them, through ``torch.autograd.graph.saved_tensors_hooks``, into 1 byte per element with one fp32
scale per row (per token for ``[..., hidden]`` tensors) and unpacks them when backward asks.
Gradients are then computed from the 8-bit copies (as COAT, Xi et al. 2024); the forward pass is
unchanged.

Formats:
- ``int8`` (default): symmetric, 127 levels per sign. Measured LoRA-gradient error against exact bf16
  storage on 6 layers of SmolLM2-135M: median 2.3%, worst 7.8%.
- ``fp8``: E4M3, 3 mantissa bits (<= 6.25% per element): median 3.7%, worst 17.5% on the same test.
- ``fp8-e5m2``: E5M2, more range, 2 mantissa bits.

Parameters, buffers, weights made from them (a trainable weight's autocast cast, an INT4 layer's fake-quantized
weight: :meth:`ActivationStorage.keep_weight`), integer and FP8 tensors and small tensors are saved as they are; a
tensor (or a view of it) saved by several ops (one input feeding q, k and v) is stored once, and one that an
elementwise op made from tensors stored already (SwiGLU's product, RMSNorm's output:
:mod:`~hf_lowprec.training.fused_blocks`) is not stored but rebuilt from them in backward
(:meth:`ActivationStorage.derive`). Written here because torch provides only the hook mechanism; torchao's float8
training stores FP8 copies for its own linears only.

    with ActivationStorage(model):
        loss = compute_loss(model, batch)
    loss.backward()
"""

from __future__ import annotations

import functools
import logging
import weakref

import torch
from torch import nn

from hf_lowprec.formats import E4M3, E5M2, dequantize_fp8, fp8_amax, fp8_scale, quantize_fp8
from hf_lowprec.modules.packed import compiled, dequantize_rows, quantize_rows, view_key

MIN_NUMEL = 1 << 16  # smaller tensors (norm statistics, rotary tables) are not worth a kernel launch
FORMATS = {"int8": torch.int8, "fp8": E4M3, "fp8-e5m2": E5M2}
_SLICE = 1 << 20  # elements (un)packed at a time: bounds the temporaries of a large tensor (logits)
_PACKED_DTYPES = (torch.bfloat16, torch.float32, torch.float16)
logger = logging.getLogger(__name__)


def row_blocks(*tensors: torch.Tensor):
    """Matching blocks of rows, about ``_SLICE`` elements each, of tensors ``[..., C]`` with one row count (``C`` may
    differ), as 2-D views (of contiguous tensors; write results into those only): bounds the temporaries of work done a
    block at a time."""
    rows = [t.reshape(-1, t.shape[-1]) for t in tensors]
    step = max(1, _SLICE // rows[0].shape[1])
    for r0 in range(0, rows[0].shape[0], step):
        yield [r[r0 : r0 + step] for r in rows]


def pack_fp8_rows(x: torch.Tensor, dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [R, C]`` → ``(FP8 codes [R, C], fp32 scale [R, 1])`` with ``x ≈ codes / scale``."""
    scale = fp8_scale(fp8_amax(x, "row"), dtype)
    return quantize_fp8(x, scale, dtype), scale


def unpack_fp8_rows(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`pack_fp8_rows`, in ``dtype``."""
    return dequantize_fp8(codes, scale, dtype)


@functools.cache
def fp8_row_kernels():
    """``(pack, unpack)``: :func:`pack_fp8_rows` / :func:`unpack_fp8_rows` compiled, if the compiled pair
    reproduces the eager one on a probe; else the eager pair, with a warning.

    Why the check: torch 2.13's inductor, generating AVX2 vector code with dynamic shapes, converts lanes 8-15
    of every 16 FP8 values wrongly (NaN and garbage; seen with ``ATEN_CPU_CAPABILITY=avx2``).
    """
    pack, unpack = compiled(pack_fp8_rows), compiled(unpack_fp8_rows)
    probe = torch.randn(4, 48, generator=torch.Generator().manual_seed(0)) * 10
    codes, scale = pack_fp8_rows(probe)
    try:
        got_codes, got_scale = pack(probe, E4M3)
        same = torch.equal(got_codes.float(), codes.float()) and torch.equal(got_scale, scale)
        same = same and torch.equal(unpack(codes, scale, torch.float32), unpack_fp8_rows(codes, scale, torch.float32))
    except Exception as e:  # a compiler error: the eager pair still works
        logger.warning("compiling the FP8 row casts failed (%s); activations are packed by eager torch ops", e)
        return pack_fp8_rows, unpack_fp8_rows
    if not same:
        logger.warning(
            "the compiled FP8 row casts disagree with eager ones on this CPU (%s); activations are packed by "
            "eager torch ops",
            torch.backends.cpu.get_cpu_capability(),
        )
        return pack_fp8_rows, unpack_fp8_rows
    return pack, unpack


class _Stored:
    """What a saved tensor became. :meth:`take` rebuilds it once for every op that saved it (``uses``; q, k and v's
    projections, their LoRA adapters and a packed base learning its steps all save one input): the rebuilt tensor is
    kept until the last of them has taken it, then dropped. A graph walked again (``retain_graph``) rebuilds it for
    each reader. A tensor rebuilt for one reader alone is marked so (:meth:`ActivationStorage.reader_owns`)."""

    __slots__ = ("uses", "rebuilt")

    def __init__(self):
        self.uses, self.rebuilt = 1, None

    def take(self) -> torch.Tensor:
        fresh = self.rebuilt is None
        out = self.unpack() if fresh else self.rebuilt
        self.uses -= 1
        self.rebuilt = out if self.uses > 0 else None
        if fresh and self.rebuilt is None:
            _HANDED_OUT[out.data_ptr()] = weakref.ref(out.untyped_storage())
        return out

    def unpack(self) -> torch.Tensor:
        raise NotImplementedError


class _Packed(_Stored):
    """An 8-bit copy of a saved tensor: codes ``[R, C]``, row scales ``[R, 1]`` fp32, original shape and dtype."""

    __slots__ = ("codes", "scale", "shape", "dtype", "__weakref__")

    def __init__(self, t: torch.Tensor, code_dtype: torch.dtype):
        super().__init__()
        self.shape, self.dtype = t.shape, t.dtype
        rows = t.detach().reshape(-1, t.shape[-1])
        self.codes = torch.empty(rows.shape, dtype=code_dtype, device=rows.device)
        self.scale = torch.empty(rows.shape[0], 1, device=rows.device)
        for part, codes, scale in row_blocks(rows, self.codes, self.scale):
            if code_dtype == torch.int8:
                codes[:], scale[:] = quantize_rows(part.contiguous())
            else:
                codes[:], scale[:] = fp8_row_kernels()[0](part.contiguous(), code_dtype)

    def represents_its_tensor(self) -> bool:
        """False when a row held an infinity (int8 step or FP8 scale non-finite or zero): 8 bits cannot hold it. An
        additive attention mask of ``-inf`` (which SDPA saves) is such a tensor; its copy would come back NaN."""
        return not bool((~torch.isfinite(self.scale) | (self.scale == 0)).any())

    def unpack(self) -> torch.Tensor:
        out = torch.empty(self.codes.shape, dtype=self.dtype, device=self.codes.device)
        for codes, scale, part in row_blocks(self.codes, self.scale, out):
            if self.codes.dtype == torch.int8:
                part[:] = dequantize_rows(codes, scale, None, self.dtype)
            else:
                part[:] = fp8_row_kernels()[1](codes, scale, self.dtype)
        return out.view(self.shape)

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scale.numel() * 4


class _Derived(_Stored):
    """A saved view ``(shape, stride, offset)`` of ``fn(*inputs)``, rebuilt from the inputs' stored copies."""

    __slots__ = ("fn", "inputs", "geometry", "__weakref__")

    def __init__(self, fn, inputs: tuple[_Packed, ...], t: torch.Tensor):
        super().__init__()
        self.fn, self.inputs, self.geometry = fn, inputs, (t.shape, t.stride(), t.storage_offset())

    def unpack(self) -> torch.Tensor:
        return self.fn(*(x.unpack() for x in self.inputs)).as_strided(*self.geometry)


class _Alias(_Stored):
    """A saved view of memory that another saved view stored already, rebuilt from that copy: attention's output,
    stored by SDPA as ``[B, H, T, D]`` over ``[B, T, H, D]`` memory and saved again by the output projection as
    ``[B x T, H x D]`` (Llama-3.2-1B: 0.5 MB a layer per 256 tokens in int8)."""

    __slots__ = ("stored", "memory", "geometry", "__weakref__")

    def __init__(self, stored: _Packed, memory: tuple, t: torch.Tensor):
        super().__init__()
        self.stored, self.memory, self.geometry = stored, memory, (t.shape, t.stride())

    def unpack(self) -> torch.Tensor:
        values = self.stored.unpack()
        memory = torch.empty_strided(*self.memory, dtype=values.dtype, device=values.device)
        return memory.copy_(values).as_strided(*self.geometry)


def _made_from_weights(t: torch.Tensor) -> bool:
    """Whether ``t`` was made from one trainable parameter by ops of one input (autocast's cast, a transpose): a
    weight, not an activation, which comes through ops of two or more inputs (a matmul of the input by a weight).
    A frozen weight's autocast cast has no history, like the tensors a custom function saves (which are to be
    stored): it is stored in 8 bits (keep frozen weights in the compute dtype, as ``load_int4_lora`` does)."""
    fn = t.grad_fn
    for _ in range(4):  # a cast of a transpose of a view...
        if fn is None or len(fn.next_functions) != 1:
            return False
        fn = fn.next_functions[0][0]
        if type(fn).__name__ == "AccumulateGrad":
            return isinstance(fn.variable, nn.Parameter)
    return False


def _covers_its_span(t: torch.Tensor) -> bool:
    """Whether view ``t`` reads every element of its memory span once (any order of dimensions)."""
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size > 1)
    return t.numel() == span and min(t.stride(), default=0) >= 0


class ActivationStorage:
    """Context manager: tensors autograd saves inside it are stored in 8 bits (see the module docstring).

    Args:
        model: its parameters and buffers (and anything sharing their storage) are never converted;
            ``None`` converts everything eligible.
        fmt: ``int8``, ``fp8`` (E4M3) or ``fp8-e5m2``.
        min_numel: smaller tensors are saved as they are.

    Counters ``original_bytes`` and ``stored_bytes`` (codes + scales) accumulate over its uses.
    """

    def __init__(self, model: nn.Module | None = None, fmt: str = "int8", min_numel: int = MIN_NUMEL):
        if fmt not in FORMATS:
            raise ValueError(f"activation storage format {fmt!r}: choose one of {', '.join(FORMATS)}")
        self.fmt, self.min_numel, self.model = fmt, min_numel, model
        self._keep: set[int] = set()  # storages of the model's parameters and buffers, read at each __enter__
        self._weights: set[int] = set()  # storages of weights layers computed in this forward (keep_weight)
        self._cache: dict[tuple, tuple[weakref.ref, int, weakref.ref]] = {}  # view key -> (base, version, packed)
        self._derived: dict[int, tuple[weakref.ref, int, object, tuple]] = {}  # id -> (tensor, version, fn, inputs)
        self._spans: dict[tuple, tuple] = {}  # (id, offset, numel, dtype) -> (tensor, version, packed, its geometry)
        self._hooks = None
        self.original_bytes = 0
        self.stored_bytes = 0

    def _pack(self, t: torch.Tensor):
        if (
            t.dtype not in _PACKED_DTYPES
            or t.dim() < 2
            or t.numel() < self.min_numel
            or t.untyped_storage().data_ptr() in self._keep
            or t.untyped_storage().data_ptr() in self._weights
            or _made_from_weights(t)
        ):
            return t
        # ops often save views of one tensor (a linear's input reshaped to 2-D, once per q/k/v projection):
        # key on the viewed tensor and the view's geometry, and check the base is still the same, unchanged tensor
        base, key = view_key(t)
        stored = self._lookup(base, key, t._version)
        if isinstance(stored, torch.Tensor):  # kept as it is by an earlier save of this view
            return stored
        if stored is not None:
            stored.uses += 1
            return stored
        derived = self._derived.get(id(base))
        span = (id(base), t.storage_offset(), t.numel(), t.dtype) if _covers_its_span(t) else None
        if derived is not None and derived[0]() is base and derived[1] == base._version:
            stored = _Derived(derived[2], derived[3], t)
        else:
            stored = self._alias(base, span, t)
        if stored is None:
            stored = _Packed(t, FORMATS[self.fmt])
            if not stored.represents_its_tensor():
                stored, span = t, None  # saved as it is (and so again, from the cache, by the next op saving it)
            self.stored_bytes += stored.nbytes
            if span is not None:  # other views of this memory are rebuilt from this copy
                self._spans[span] = (weakref.ref(base), t._version, weakref.ref(stored), (t.shape, t.stride()))
        if len(self._cache) > 4096:
            self._cache = {k: v for k, v in self._cache.items() if v[0]() is not None and v[2]() is not None}
        self._cache[key] = (weakref.ref(base), t._version, weakref.ref(stored))
        self.original_bytes += t.numel() * t.element_size()
        return stored

    def _alias(self, base: torch.Tensor, span: tuple | None, t: torch.Tensor) -> "_Alias | None":
        """``t`` as a view of memory another view stored (same tensor, offset, elements; unchanged), if any."""
        hit = None if span is None else self._spans.get(span)
        if hit is None or hit[0]() is not base or base._version != hit[1] or hit[2]() is None:
            return None
        return _Alias(hit[2](), hit[3], t)

    def _stored(self, t: torch.Tensor) -> "_Packed | _Derived | None":
        """What this forward stored for ``t`` (or the same view of the same unchanged tensor) already, if anything."""
        return self._lookup(*view_key(t), t._version)

    def _lookup(self, base: torch.Tensor, key: tuple, version: int) -> "_Packed | _Derived | None":
        hit = self._cache.get(key)
        return hit[2]() if hit is not None and hit[0]() is base and hit[1] == version else None

    def derive(self, output: torch.Tensor, fn, inputs: tuple[torch.Tensor, ...]) -> bool:
        """Register ``output = fn(*inputs)`` (a contiguous tensor just computed): when an op saves it (or a view of
        it) later in this forward, nothing is stored and backward gets ``fn`` of the inputs' stored copies. Only
        if every input was stored in 8 bits by this storage already (saved by the op that made ``output``);
        returns whether it was registered."""
        stored = [self._stored(x) for x in inputs]
        if not output.is_contiguous() or not all(isinstance(x, _Packed) for x in stored):
            return False
        self._derived[id(output)] = (weakref.ref(output), output._version, fn, tuple(stored))
        return True

    @staticmethod
    def keep_weight(w: torch.Tensor) -> None:
        """Have the active storage (if any) save ``w`` as it is: a weight a layer computed in its forward (an INT4
        layer's fake-quantized weight), which backward's input gradient reads; in 8 bits, gradients moved by up to
        7% (a tiny Llama, its MLPs in int4-g64)."""
        if _ACTIVE:
            _ACTIVE[-1]._weights.add(w.untyped_storage().data_ptr())

    @staticmethod
    def active() -> "ActivationStorage | None":
        """The innermost storage whose block is running, if any."""
        return _ACTIVE[-1] if _ACTIVE else None

    @staticmethod
    def reader_owns(t: torch.Tensor) -> bool:
        """Whether saved tensor ``t``, as a backward got it, was rebuilt for that backward alone: nothing else refers
        to it, and the backward may overwrite it (SwiGLU's writes its gradients over the rebuilt inputs). Known by its
        storage: autograd hands a backward a new tensor object over the memory the storage rebuilt."""
        storage = _HANDED_OUT.get(t.data_ptr())
        return storage is not None and storage() is t.untyped_storage()

    @staticmethod
    def _unpack(saved):
        return saved.take() if isinstance(saved, _Stored) else saved

    def __enter__(self):
        _HANDED_OUT.clear()  # what earlier backwards handed out (the memory of most of it freed since)
        # read now, not once: an optimizer or a user may have replaced a parameter's .data since
        tensors = () if self.model is None else (*self.model.parameters(), *self.model.buffers())
        self._keep = {t.untyped_storage().data_ptr() for t in tensors}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        self._hooks.__exit__(*exc)
        self._cache.clear()  # the graph keeps what it needs; the dedup tables are per forward
        self._weights.clear()
        self._derived.clear()
        self._spans.clear()
        return False


_ACTIVE: list[ActivationStorage] = []  # the storages whose blocks are running, innermost last
# data_ptr -> the storage of a tensor rebuilt there for one reader alone (a later tensor at that address, shared or
# saved as it was, has another storage)
_HANDED_OUT: dict[int, weakref.ref] = {}
