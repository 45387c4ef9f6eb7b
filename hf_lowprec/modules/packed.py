"""Frozen linears whose weight is stored as packed integer codes: ``PackedInt4Linear`` (two codes per
byte, group-wise steps) and ``PackedInt8Linear`` (one byte per code, one step per output row).

Forward and grad-input are both computed from the codes, never from a full-precision copy kept between
calls, so a model whose base linears are packed still passes correct gradients to earlier layers and to
LoRA adapters. A precision plan puts most layers in INT4 and may keep the sensitive ones in int8; both
run the same three backends (:data:`KERNELS`):

- ``int8`` (CPUs with int8 dot products: VNNI, AMX; AVX2 CPUs through 16-bit multiply-adds): the weight is an
  int8 matrix with one step per row (int8 codes as stored; INT4 codes unpacked, each row rescaled to one step
  ``r[n] = max|W[n]| / 127``); activations and output gradients are quantized dynamically to int8 per row (token),
  the few loudest input channels of each call excepted (multiplied in the activation dtype, see
  ``_int8_forward``); the products are summed exactly in int32, by tile kernels that unpack the weight a block at a
  time (AMX, ``kernels/amx.py``; AVX2, ``kernels/avx2_int8.py``) or by ``torch._int_mm`` on the weight unpacked
  whole into a reused buffer (``kernels/scratch.py``), with C++ kernels (``kernels/cpp.py``) unpacking, quantizing
  and dequantizing around it: the same sums, the same results. About 0.8% relative error against the
  dequantized fp32 reference (forward and grad-input alike).
- ``tiled`` (any x86-64 CPU with AVX2): C++ dequantizes one cache-sized tile of the weight at a time into the
  activation dtype and multiplies it with the BLAS GEMM; exact up to the GEMM's rounding, and the dense
  weight never exists whole. Where int8 or bf16 dot products are missing (AVX2), the fp32 GEMM is the
  fastest arithmetic the CPU has, and this runs at its speed.
- ``dequant``: the whole weight is dequantized per call with torch ops and multiplied with ``mm``;
  the numerical reference, and the path for other devices.

An optional per-input-channel ``input_scale`` ``s [K]`` (activation-aware scaling, see
:mod:`hf_lowprec.ondevice.calibration.awq`) is folded into the codes: they encode ``W diag(s)``, inputs are divided
by ``s``
(inside the int8 quantization, or in the dequantized weight), so ``y = (x / s) (W diag(s))^T = x W^T``.
``s`` holds powers of two, exact in every float dtype; all ones (the default) costs nothing.

A ``-rht`` format stores the codes of ``W R`` (``R`` the randomized block Hadamard rotation of
:mod:`hf_lowprec.rotation`) and rotates every input first, ``y = (x R)(W R)^T``; the codes, steps, scales and the
backends all live in the rotated basis, and :meth:`PackedLinear.dequantized_weight` rotates back.

Learned steps (PEQA, arXiv:2305.14152, with its zero points): :meth:`PackedLinear.learn_steps` gives a layer a
trainable gain ``[N, G]`` multiplying its steps and, asymmetric, a shift ``[N, G]`` added to its zero points; the codes
stay frozen, and both gradients come from one weight-gradient GEMM per call (:func:`_learned_grads`; the zero points
learned alone, from the inputs' group sums). A state dict holds
the steps and zero points with them folded in, so exports and loaders see a plain packed layer (whose zero points need
not be integers any more).

``backend="auto"`` times the backends this CPU and layer shape can run, once per machine, shape and dtype
(:mod:`hf_lowprec.modules.kernels.autotune`), and runs the fastest; the choice and its measured reason are
logged once and readable as ``layer.last_backend``. A layer that learns its steps runs an exact forward: ``auto``
chooses among ``tiled``, ``dequant`` and, where int8 runs, ``tiled/int8`` and ``dequant/int8`` (that forward, int8's
grad-input).

Why hand-written: torchao's INT4 CPU kernel has no backward and its int8 dynamic-activation layers
pass no gradient to their input; nothing in torch/torchao multiplies a gradient by an INT4 weight.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
import weakref

import torch
from torch import nn

from hf_lowprec.formats import (
    FormatSpec,
    dequantize_int,
    group_view,
    int_steps,
    pack_int4,
    quantize_int,
    unpack_int4,
    unpack_int4_planes,
)
from hf_lowprec.fp32_state import Fp32State
from hf_lowprec.modules.kernels.autotune import fastest
from hf_lowprec.modules.kernels.cpp import cpu_kernels
from hf_lowprec.modules.kernels.cpu import cpu_info
from hf_lowprec.modules.kernels.scratch import scratch
from hf_lowprec.rotation import layer_rotation, rotate, unrotate

logger = logging.getLogger(__name__)

PACKED_BACKENDS = ("auto", "int8", "tiled", "dequant")
# weight tile of the tiled backend, at most this many output rows (forward) / input columns (grad-input); the
# tile count is then rounded to a multiple of the thread count so that no thread idles (measured on SmolLM2
# and Llama-3.2-1B shapes, benchmarks/kernel_speed.py: 5 tiles on 2 threads cost up to 25%)
ROW_TILE = 128
COLUMN_TILE = 256
# and at most this many weight elements per tile (each thread's scratch): wider layers take narrower tiles
TILE_ELEMENTS = 1 << 23
# the grad-input of a weight whose COLUMN_TILE columns exceed TILE_ELEMENTS (a 128k-vocabulary head) goes by tiles of
# this many rows per dtype, each thread summing its tiles' products in fp32. Llama-3.2-1B head, 65 tokens, 2 threads,
# against column tiles (64 columns): bf16 66 vs 128 ms (AVX512-BF16 EPYC), fp32 193 vs 276 ms (AVX2 class emulated on
# it); scratch per thread 2 vs 16 MB in bf16, 2 vs 32 MB in fp32. With glibc mapping every block of 64 KiB or more
# (MALLOC_MMAP_THRESHOLD_=65536, the memory benchmarks' setting) fewer, larger bf16 tiles win (the GEMM's own buffers:
# 256 rows 0.17-0.21 s, 512 0.12-0.16, 1024 0.10-0.12) and fp32 keeps 256 (0.23 s; 512 0.25). Row tiles lost on square
# and wide layers (down_proj 2048x8192 at 256 tokens: bf16 18.0 vs 12.5 ms, fp32 50.9 vs 43.4)
TALL_ROW_TILE = {torch.bfloat16: 512, torch.float32: 256}
# rows of the weight gradient per tile of the C++ learned_step_sums: its bf16 GEMM runs faster on taller tiles (each
# thread's scratch: 8 MB at 8192 columns). 2-core AMX Xeon, 256 tokens, 2048 -> 8192: 128 rows 7.3 ms, 256 6.3, 512
# 5.7, 1024 5.2; 8192 -> 2048: 6.2, 5.0, 4.6, 4.5. fp32 (the AVX2 class) not re-measured: ROW_TILE
LEARNED_SUMS_TILE = {torch.bfloat16: 512, torch.float32: ROW_TILE}
# weights above this many elements: auto never times (nor picks) dequant, whose timing makes the dense weight (in
# fp32, then the compute dtype: a 100 MB first-run spike at 8192x2048). It never won above 2048x2048 on either CPU class
# (benchmarks/kernel_speed.py, Llama-3.2-1B shapes, 256 and 1024 tokens: 0.33-0.76x the fastest backend)
DEQUANT_AUTOTUNE_MAX = 1 << 22
AUTOTUNE_TOKENS = 256  # rows of the probe input when auto times the backends of a layer shape
# at most this many output elements per probe, and per chunk of the chunked loss (chunked_loss.py's CHUNK_LOGITS): a
# 128k-vocabulary head is timed on the 65 rows a chunk gives it, not 256, whose probe output and gradient were a
# first-run spike of ~100 MB at the Llama-3.2-1B shape
AUTOTUNE_OUTPUTS = 1 << 23
CHUNK_ELEMENTS = 1 << 22  # weight elements quantized per slice when packing a dense weight (16 MB in fp32)
# set True on each nn.Linear a packed folder's plan keeps dense as it loads: LoRA adapters on it are fp32, as trained
KEPT_DENSE = "hf_lowprec_kept_dense"
# weight elements dequantized at a time for an INT4 layer's row maxima (the int8 backend's row steps), made at the
# layer's first call: in the first forward, on top of the activations saved so far. 4 MB in fp32: with CHUNK_ELEMENTS
# the first 1B step (scale.py's warm-up) peaked in the last layer's forward, ~20 MB over the later steps' peak
ROW_MAX_ELEMENTS = 1 << 20
# int32 products of the int8 backend held at a time (2 MB; see _int_mm_dequantized). At 4 MB the 1B step's peak (in
# the chunked loss) was 2 MB higher and a 128k-vocabulary head's forward at 65 rows 1.5% faster (78.3 against 79.5
# ms; AVX512-BF16 EPYC, 2026-12-04)
INT32_TILE = 1 << 19
# int8 values of an INT4 weight the int8 backend's torch._int_mm path unpacks at a time (2 MB): a block of rows
# forward, of whole groups of columns for the grad-input. The whole weight at once held the largest one (16 MB at the
# Llama-3.2-1B shape) in the scratch buffer all step, peaks included (see _weight_block)
WEIGHT_TILE = 1 << 21
# the int8 backend multiplies through its tile kernels where they run (int8_tile_kernels); False: through
# torch._int_mm (benchmarks compare the two in one process)
USE_TILE_KERNELS = True
OUTLIER_COLUMNS = 8  # input channels per call the int8 backend multiplies in the activation dtype (see _int8_forward)
# group steps and zero points of a frozen INT4 base (quantized on load, the on-device base) whatever it computes in
# (see compact_steps): fp32 ones made an fp32 model (the AVX2 class's compute dtype) 58 MB larger at the
# Llama-3.2-1B shape (15.2M groups)
BASE_STEP_DTYPE = torch.bfloat16
_INT8_MAX = 127.0
# a row's largest magnitude below this counts as this when it sets the row's int8 step: 127 / it stays finite in fp32
# (1e-12 did: rows of gradients below it, 1e-13 at the grad-input of an fp32 model, came out 90% wrong). The C++
# row quantizer (kernels/cpp.py) clamps at the same value
_SMALLEST_AMAX = 1e-30
_logged: set[tuple[str, str]] = set()


def _backend_reason(winner: str, seconds: dict[str, float]) -> str:
    ranked = ", ".join(
        f"{name} {seconds[winner] / t:.2f}x" for name, t in sorted(seconds.items(), key=lambda kv: kv[1])
    )
    return f"fastest measured here ({cpu_info().cpu_class}; speed relative to {winner}: {ranked})"


def _log_once(backend: str, reason: str) -> None:
    if (backend, reason) not in _logged:
        _logged.add((backend, reason))
        logger.info("packed linears run the %s backend: %s", backend, reason)


# --------------------------------------------------------------------------------- int8 kernels
# The elementwise passes around torch._int_mm (per-row quantize, unpacking the codes, dequantizing the
# int32 product) cost as much as the int8 matmul saves when run as eager torch ops, one pass over memory
# each. They run as hand-written C++ (modules/kernels/cpp.py) on CPUs with AVX2, else as torch.compile'd
# functions (else eagerly, with a warning, where neither can be built).


def _quantize_rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True).clamp(min=_SMALLEST_AMAX)
    return torch.round(xf * (_INT8_MAX / amax)).to(torch.int8), amax / _INT8_MAX


def _quantize_scaled_rows_torch(x: torch.Tensor, col_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize_rows_torch(x.float() * col_scale)


def _column_absmax_torch(x: torch.Tensor) -> torch.Tensor:
    return x.abs().amax(0).float()


def _dequantize_torch(
    acc: torch.Tensor, row_step: torch.Tensor, col_step: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    return (acc.float() * row_step * col_step).to(dtype)


def _dequantize_rows_torch(acc: torch.Tensor, row_step: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (acc.float() * row_step).to(dtype)


def native_kernels(*tensors: torch.Tensor):
    """The C++ kernels if they run for these tensors (CPU; bf16/fp32 floats), else ``None``."""
    if not all(t.device.type == "cpu" for t in tensors):
        return None
    if any(t.is_floating_point() and t.dtype not in (torch.bfloat16, torch.float32) for t in tensors):
        return None
    return cpu_kernels()


def quantize_rows(
    x: torch.Tensor, col_scale: torch.Tensor | None = None, in_place: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row of ``x [M, C]`` (times fp32 ``col_scale [C]`` first): ``(int8 [M, C], fp32 step [M,
    1])``. ``in_place``: the codes may overwrite ``x`` (they do where the C++ kernels run; ``x`` is then garbage)."""
    x = x.detach().contiguous()
    ext = native_kernels(x)
    if ext is not None:
        return tuple(ext.quantize_rows(x, None if col_scale is None else col_scale.float().contiguous(), in_place))
    if col_scale is None:
        return compiled(_quantize_rows_torch)(x)
    return compiled(_quantize_scaled_rows_torch)(x, col_scale)


def column_absmax(x: torch.Tensor, col_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``max_m |x[m, c]|`` (times ``|col_scale[c]|``) of ``x [M, C]``: fp32 ``[C]``."""
    x = x.detach().contiguous()
    ext = native_kernels(x)
    if ext is not None:
        return ext.column_absmax(x, None if col_scale is None else col_scale.float().contiguous())
    amax = compiled(_column_absmax_torch)(x)
    return amax if col_scale is None else amax * col_scale.float().abs()


def dequantize_rows(
    codes: torch.Tensor,
    row_step: torch.Tensor,
    col_step: torch.Tensor | None,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``codes [M, C]`` (int32 products or int8 codes) times ``row_step [M, 1]`` (and ``col_step [C]``), in
    ``dtype``; written into ``out`` (``[M, C]``, rows may lie apart: a block of a wider output's columns) if given."""
    ext = native_kernels(codes) if dtype in (torch.bfloat16, torch.float32) else None
    if ext is not None:
        col = None if col_step is None else col_step.contiguous()
        return ext.dequantize(codes, row_step.contiguous(), col, dtype, out)
    if col_step is None:
        result = compiled(_dequantize_rows_torch)(codes, row_step, dtype)
    else:
        result = compiled(_dequantize_torch)(codes, row_step, col_step, dtype)
    return result if out is None else out.copy_(result)


_compiled: dict[object, object] = {}


def compiled(fn):
    """``torch.compile(fn, dynamic=True)``, made once per function (``fn`` itself if compilation is unavailable).

    Call it with plain contiguous tensors that do not require grad: anything else adds guards and
    recompilations.
    """
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=True) if _can_compile() else fn
    return _compiled[fn]


@functools.cache
def _can_compile() -> bool:
    """Whether inductor finds a C++ compiler; asked at the first compile (importing inductor takes ~2 s: at import
    time every ``hf-lowprec --help`` paid it)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
        return True
    except Exception as e:  # no C++ toolchain: inductor cannot build CPU kernels
        logger.warning("torch.compile unavailable (%s); the int8 path runs its quantize/dequantize eagerly (slower)", e)
        return False


def int8_backend_available(
    device: torch.device, layer: "PackedLinear | None" = None, dtype: torch.dtype | None = None
) -> tuple[bool, str]:
    """Whether the ``int8`` backend can run on ``device`` (for ``layer``'s shape and activations of ``dtype``, where
    given) at int8 speed, and why (not): with int8 dot products in hardware, or on an AVX2 CPU through the AVX2 int8
    kernels, which tile most shapes (``avx2_int8_tileable``; ``torch._int_mm`` is emulated there, 35x slower than an
    fp32 GEMM)."""
    if device.type != "cpu":
        return False, f"{device.type}: the int8 path is written for CPUs"
    if dtype not in (None, torch.float32, torch.bfloat16):  # the tile kernels write bf16 or fp32 outputs
        return False, f"activations in {dtype}: the int8 path computes in fp32 or bf16"
    if not hasattr(torch, "_int_mm"):
        return False, "this torch has no torch._int_mm"
    if cpu_info().int8_dot:
        return True, "CPU with int8 dot products"
    no_dot = f"this CPU has no int8 dot-product instructions ({cpu_info().cpu_class}: no VNNI/AMX)"
    if cpu_kernels() is None:
        return False, f"{no_dot} and the C++ CPU kernels could not be built here (see the log)"
    if layer is not None and not avx2_int8_tileable(layer):
        return False, f"{no_dot} and the AVX2 int8 kernels need in_features a multiple of 32, out_features of 16 " \
            "and INT4 groups of a multiple of 32 codes"
    return True, "AVX2 int8 kernels (16-bit multiply-adds; this CPU has no int8 dot products)"


def tiled_backend_available(device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether the ``tiled`` backend (C++ tile dequantization into the BLAS GEMM) can run, and why (not)."""
    if device.type != "cpu":
        return False, f"{device.type}: the tiled path is written for CPUs"
    if dtype not in (torch.float32, torch.bfloat16):
        return False, f"activations in {dtype}: the tiled path computes in fp32 or bf16"
    if cpu_kernels() is None:
        return False, "the C++ CPU kernels could not be built here (see the log)"
    return True, "CPU GEMM on weight tiles dequantized in cache"


# ---------------------------------------------------------------------------------- autograd


def _dequant_forward(x2d: torch.Tensor, layer: "PackedLinear") -> torch.Tensor:
    return torch.mm(x2d, layer.operand_weight(x2d.dtype).t())


def _dequant_grad_input(grad_out: torch.Tensor, layer: "PackedLinear") -> torch.Tensor:
    return torch.mm(grad_out, layer.operand_weight(grad_out.dtype))


def balanced_tile(size: int, most: int, width: int) -> int:
    """An even tile of at most ``most`` lines (about), and ``TILE_ELEMENTS`` weight elements at ``width`` per line, that
    cuts ``size`` lines into a multiple of the thread count of tiles."""
    most = min(most, max(2, TILE_ELEMENTS // width))
    threads = torch.get_num_threads()
    tiles = threads * -(-size // (threads * most))
    return max(2, -(-size // tiles) + (-(-size // tiles)) % 2)


def _tiled_forward(x2d: torch.Tensor, layer: "PackedLinear") -> torch.Tensor:
    tile = balanced_tile(layer.out_features, ROW_TILE, layer.in_features)
    return cpu_kernels().tiled_linear(x2d.contiguous(), *layer.tiled_operands(), tile)


def _tiled_grad_input(grad_out: torch.Tensor, layer: "PackedLinear") -> torch.Tensor:
    if layer.out_features * COLUMN_TILE > TILE_ELEMENTS:  # a tall weight (an output head): tiles of rows
        tile = balanced_tile(layer.out_features, TALL_ROW_TILE[grad_out.dtype], layer.in_features)
        return cpu_kernels().tiled_linear_grad_input_rows(grad_out.contiguous(), *layer.tiled_operands(), tile)
    tile = balanced_tile(layer.in_features, COLUMN_TILE, layer.out_features)
    return cpu_kernels().tiled_linear_grad_input(grad_out.contiguous(), *layer.tiled_operands(), tile)


def view_key(t: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """``(the tensor t views, key of the view)``: two views with one key read the same elements for as long
    as that tensor is alive and its ``_version`` unchanged (ops save views of one input, layers share it)."""
    base = t if t._base is None else t._base
    return base, (id(base), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


_last_rows: list = [None]  # (key, weakref to the input, its version, result, its inverse, layers served) of _int8_rows


def _int8_rows(x2d: torch.Tensor, inverse: torch.Tensor | None, k: int, layer: nn.Module):
    """``(int8 rows [M, K], steps [M, 1], outlier channels [k] or None, x / s at them [M, k])`` of ``x2d / s``.

    The ``k`` channels of largest ``max |x / s|`` are zeroed in the int8 rows and returned apart. Layers fed
    the same unchanged tensor (q/k/v, gate/up) share one result: the last call's is kept, keyed on the
    input's identity and version (as ``ActivationStorage`` dedups saved views), for the layers it has not served yet
    (a layer fed the same tensor again is fed a refilled buffer: writes through ``.data`` or numpy leave the version
    as it was; A, B, refill, A read B's rows of the old values).
    """
    base, view = view_key(x2d)
    if base.is_inference():  # no version counter: in-place changes go unseen, so nothing is kept
        return _int8_rows_of(x2d, inverse, k)
    key = (view, k, None if inverse is None else id(inverse))
    hit = _last_rows[0]
    if (
        hit is not None
        and hit[0] == key
        and hit[1]() is base
        and hit[2] == base._version
        and (inverse is None or hit[4]() is inverse)
        and not any(served() is layer for served in hit[5])
    ):
        _last_rows[0] = (*hit[:5], (*hit[5], weakref.ref(layer)))
        return hit[3]
    result = _int8_rows_of(x2d, inverse, k)
    _last_rows[0] = (
        key,
        weakref.ref(base),
        base._version,
        result,
        None if inverse is None else weakref.ref(inverse),
        (weakref.ref(layer),),
    )
    return result


def _int8_rows_of(x2d: torch.Tensor, inverse: torch.Tensor | None, k: int):
    """What :func:`_int8_rows` returns, computed (no cache)."""
    if not k:
        return (*quantize_rows(x2d, inverse), None, None)  # x / s, then int8 per row
    outliers = column_absmax(x2d, inverse).topk(k).indices
    col_scale = torch.ones(x2d.shape[1], device=x2d.device) if inverse is None else inverse.clone()
    col_scale[outliers] = 0  # x / s without the outlier channels, then int8 per row
    x_out = x2d.index_select(1, outliers)
    if inverse is not None:
        x_out = (x_out.float() * inverse[outliers]).to(x2d.dtype)
    return (*quantize_rows(x2d, col_scale), outliers, x_out)


def _int8_forward(x2d: torch.Tensor, layer: "PackedLinear") -> torch.Tensor:
    """``x @ W^T`` through ``torch._int_mm``: int8 weight (INT4 codes unpacked per call) times int8 rows.

    The ``layer.outlier_columns`` input channels with the largest ``|x / s|`` in this call are left out of
    the int8 rows and multiplied in the activation dtype instead (LLM.int8()'s decomposition, with a fixed
    count instead of a threshold). LLM inputs carry a few channels far above the rest (a token's max 10-20x
    its rms); one of them would set the token's int8 step for all others. The grad-input needs no such split:
    output gradients have no such channels.
    """
    inverse = layer.inverse_input_scale()
    xq, x_step, outliers, x_out = _int8_rows(x2d, inverse, min(layer.outlier_columns, x2d.shape[1]), layer)
    operands = layer.tile_operands()  # once per call: an INT4 layer's fp32 ratio and zero are made per call
    kernels = int8_tile_kernels(layer)
    if kernels is not None:  # the weight unpacked tile by tile inside the kernel
        weight, ratio, zero, row_step = operands
        y = torch.empty(x2d.shape[0], layer.out_features, dtype=x2d.dtype, device=x2d.device)
        kernels[0](xq, x_step.view(-1), weight, ratio, zero, layer.spec.symmetric, row_step, y)
    else:
        y = _int_mm_dequantized(xq, x_step, layer, operands, x2d.dtype)
    if outliers is None:
        return y
    return y.addmm_(x_out, layer.int8_columns(outliers, operands, x2d.dtype).t())


def int8_tile_kernels(layer: "PackedLinear"):
    """``(forward, grad_input)``: the C++ kernels that multiply by ``layer``'s weight unpacked tile by tile, with the
    signatures of ``amx_linear`` and ``amx_linear_grad_input``, or ``None``: the int8 backend multiplies through
    ``torch._int_mm``. Both sum the same int8 products exactly in int32, so give the same results.

    - AMX tiles (``kernels/amx.py``): a CPU with AMX-INT8 (not restricted away by ``HF_LOWPREC_CPU_CLASS``) whose OS
      grants the tile state; ``in_features`` and ``out_features`` multiples of 64, INT4 groups of 32 codes or more;
    - 16-bit multiply-adds (``kernels/avx2_int8.py``): a CPU without int8 dot products, where ``torch._int_mm`` is
      emulated; shapes of :func:`avx2_int8_tileable`.
    """
    if not USE_TILE_KERNELS or layer.qweight.device.type != "cpu":
        return None
    ext = cpu_kernels()
    if ext is None:
        return None
    if cpu_info().has("amx_int8") and ext.amx_ready() and _tileable(layer, 64, 64):
        return ext.amx_linear, ext.amx_linear_grad_input
    if not cpu_info().int8_dot and avx2_int8_tileable(layer):
        return ext.avx2_int8_linear, ext.avx2_int8_linear_grad_input
    return None


def avx2_int8_tileable(layer: "PackedLinear") -> bool:
    """Whether the AVX2 int8 kernels take ``layer``'s shape: ``in_features`` a multiple of 32, ``out_features`` of
    16, INT4 groups of a multiple of 32 codes."""
    return _tileable(layer, 32, 16)


def _tileable(layer: "PackedLinear", k_multiple: int, n_multiple: int) -> bool:
    group = layer.spec.group_size or layer.in_features
    groups = isinstance(layer, PackedInt8Linear) or group % 32 == 0
    return groups and layer.in_features % k_multiple == 0 and layer.out_features % n_multiple == 0


def weight_columns(w8: torch.Tensor, columns: torch.Tensor, row_step: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``w8[:, columns] * row_step[:, None]`` in ``dtype`` (``[N, k]``), each product rounded once: the grid weight's
    columns (W diag(s)) of the outlier channels, without ``[N, k]`` fp32 copies (a 128k-vocabulary head: 8 MB at the
    chunked loss's peak). The C++ kernel reads a 128k x 2048 head's 8 columns in 7.4 ms where ``index_select`` took
    18.8 (once per chunk of the chunked loss): the Llama-3.2-1B shape's step at 1x256 went from 2.18 to 2.11 s (median
    of 6 steps each, interleaved in one process, AMX Xeon)."""
    out = torch.empty(w8.shape[0], len(columns), dtype=dtype, device=w8.device)
    ext = native_kernels(w8) if dtype in (torch.bfloat16, torch.float32) and w8.is_contiguous() else None
    if ext is not None:
        ext.gather_columns(w8, columns.contiguous(), row_step.contiguous(), out)
        return out
    return torch.mul(w8.index_select(1, columns), row_step.unsqueeze(1), out=out)


def _int_mm_dequantized(
    xq: torch.Tensor, x_step: torch.Tensor, layer: "PackedLinear", operands: tuple, dtype: torch.dtype
) -> torch.Tensor:
    """``(xq x_step) @ (w8 row_step)^T`` in ``dtype``: int8 ``xq [M, K]``, ``layer``'s int8 weight ``w8 [N, K]`` (from
    its ``tile_operands()``, which end with ``row_step``); fp32 steps ``[M, 1]``, ``[N]``. A block of output columns at
    a time: its int32 products ``INT32_TILE`` at most (``_int_mm_into``; a wide layer's whole ``[M, N]`` int32 result
    beside its output would cost 6 bytes per output: a 128k-vocabulary head, 65 tokens, 33 MB of int32 besides 17 MB
    of bf16 logits), its weight rows ``WEIGHT_TILE`` (``_weight_block``)."""
    m, n, k = xq.shape[0], layer.out_features, layer.in_features
    cols = min(n, max(64, INT32_TILE // max(m, 1) // 64 * 64), _weight_block(layer, k, 64))
    row_step = operands[3]
    y = torch.empty(m, n, dtype=dtype, device=xq.device)
    for n0 in range(0, n, cols):
        block = slice(n0, n0 + cols)
        w8 = int8_block(layer, operands, rows=block)
        _int_mm_into(xq, w8.t(), x_step, row_step[block], y[:, block])
    return y


def int8_block(
    layer: "PackedLinear",
    operands: tuple,
    rows: slice = slice(None),
    columns: slice = slice(None),
    scratch_ok: bool = True,
) -> torch.Tensor:
    """``w8[rows, columns]``: a block of ``layer``'s int8 weight (``columns`` in whole groups) from its
    ``tile_operands()``: a view of stored int8 codes, else INT4 codes unpacked into this thread's scratch buffer
    (``scratch_ok``; valid until the next such call: for kernels that use it before they return) or a new tensor."""
    weight, ratio, zero, _ = operands
    if ratio is None:
        return weight[rows, columns]
    k0, k1, _ = columns.indices(layer.in_features)
    group = layer.spec.group_size or layer.in_features
    if k0 % group or k1 % group:
        raise ValueError(f"columns {k0}:{k1} of the int8 weight split its groups of {group}")
    groups = slice(k0 // group, k1 // group)
    weight, ratio = weight[rows, k0 // 2 : k1 // 2], ratio[rows, groups]
    zero = None if zero is None else zero[rows, groups]
    n, k = weight.shape[0], k1 - k0
    into = scratch("int8 weight", (n, k), torch.int8, weight.device) if scratch_ok else None
    ext = native_kernels(weight)
    if ext is not None:
        return ext.unpack_int4_int8(weight, ratio, zero, layer.spec.symmetric, k, into)
    even, odd = unpack_int4_planes(weight, signed=layer.spec.symmetric)
    codes = torch.stack((even, odd), -1).view(n, ratio.shape[1], -1).float()
    if zero is not None:
        codes = codes - zero.unsqueeze(-1)
    w8 = torch.round(codes * ratio.unsqueeze(-1)).clamp(-_INT8_MAX, _INT8_MAX).view(n, k)
    return w8.to(torch.int8) if into is None else into.copy_(w8)


def _weight_block(layer: "PackedLinear", length: int, unit: int) -> int:
    """How many rows (or columns) of ``length`` int8 values the torch._int_mm path takes of ``layer``'s weight at a
    time: all of them where it stores int8 codes (views: nothing is unpacked), else multiples of ``unit`` filling
    ``WEIGHT_TILE``. Measured on an AVX512-BF16 EPYC (2026-12-04): at Llama-3.2-1B's shapes and 256 rows
    ``torch._int_mm`` takes the same time in blocks of 2 MB as whole within 2%, except the 8192 -> 2048 projection's
    forward (256-row blocks: 15.0 against 12.5 ms); the 1B step at 1x256 (``benchmarks/scale.py``) peaked at 1,411 MB
    against 1,426 with the whole weight unpacked, its step within the machine's run-to-run spread."""
    if isinstance(layer, PackedInt8Linear):
        return 1 << 62
    return max(unit, WEIGHT_TILE // length // unit * unit)


def _int_mm_into(
    a: torch.Tensor, b: torch.Tensor, row_step: torch.Tensor, col_step: torch.Tensor | None, out: torch.Tensor
) -> None:
    """``out = (a @ b) * row_step (* col_step)`` in ``out``'s dtype: int8 ``a [M, K]``, ``b [K, C]``, the int32
    products in this thread's scratch buffer (``kernels/scratch.py``)."""
    products = scratch("int32 products", (a.shape[0], b.shape[1]), torch.int32, a.device)
    dequantize_rows(torch._int_mm(a, b, out=products), row_step, col_step, out.dtype, out=out)


_consumable = threading.local()  # autograd runs a CPU backward on the thread that called it


@contextlib.contextmanager
def consumable_gradient(grad: torch.Tensor):
    """Within: a packed layer's int8 grad-input handed ``grad`` (its memory, in any of autograd's views of it)
    quantizes it in place, its int8 codes overwriting it, instead of into a new tensor. For a caller that owns ``grad``
    and reads it no more: the chunked loss's logits gradient (8.3 MB a chunk at a 128k vocabulary, at the peak of the
    Llama-3.2-1B step)."""
    previous = getattr(_consumable, "key", None)
    _consumable.key = (grad.data_ptr(), grad.numel(), grad.dtype)
    try:
        yield
    finally:
        _consumable.key = previous


def _is_consumable(grad: torch.Tensor) -> bool:
    return grad.is_contiguous() and getattr(_consumable, "key", None) == (grad.data_ptr(), grad.numel(), grad.dtype)


def _int8_grad_input(grad_out: torch.Tensor, layer: "PackedLinear") -> torch.Tensor:
    """``grad_out @ W``: through the tile kernels where they run (``int8_tile_kernels``), else ``torch._int_mm``, a
    block of ``WEIGHT_TILE`` weight columns at a time (``_weight_block``), their int32 products ``INT32_TILE`` at a
    time (blocks of rows, ``_int_mm_into``)."""
    kernels = int8_tile_kernels(layer)
    weight, ratio, zero, row_step = operands = layer.tile_operands()
    # grad_x[m, k] = sum_n g[m, n] r[n] w8[n, k] / s[k]: the per-row weight step r[n] lies on the
    # summed dimension, so it is folded into the gradient before that is quantized per row
    gq, g_step = quantize_rows(grad_out, row_step, in_place=_is_consumable(grad_out))
    m, k = gq.shape[0], layer.in_features
    inverse = layer.inverse_input_scale()
    grad_x = torch.empty(m, k, dtype=grad_out.dtype, device=grad_out.device)
    if kernels is not None:
        kernels[1](gq, g_step.view(-1), weight, ratio, zero, layer.spec.symmetric, inverse, k, grad_x)
        return grad_x
    group = layer.spec.group_size or k
    cols = min(k, _weight_block(layer, layer.out_features, math.lcm(64, group)))  # whole groups of columns
    rows = max(1, INT32_TILE // cols)
    for k0 in range(0, k, cols):
        span = slice(k0, k0 + cols)
        w8 = int8_block(layer, operands, columns=span)
        for m0 in range(0, m, rows):
            block = slice(m0, m0 + rows)
            _int_mm_into(gq[block], w8, g_step[block], None if inverse is None else inverse[span], grad_x[block, span])
    return grad_x


KERNELS = {
    "int8": (_int8_forward, _int8_grad_input),
    "tiled": (_tiled_forward, _tiled_grad_input),
    "dequant": (_dequant_forward, _dequant_grad_input),
    # the pairs ``auto`` may give a layer whose forward must be exact (``exact_kernels``): the forward exact, the
    # grad-input in int8, whose rounding of the output gradient is noise in a gradient, not a change of the function
    "tiled/int8": (_tiled_forward, _int8_grad_input),
    "dequant/int8": (_dequant_forward, _int8_grad_input),
}
"""backend -> (forward(x2d, layer), grad_input(grad_out, layer)); none computes a weight gradient."""


def _learned_grads(grad_out: torch.Tensor, x2d: torch.Tensor, layer: "PackedLinear", gain: bool, shift: bool):
    """``(dL/dgain, dL/dshift or None)``, fp32 ``[N, G]``, of the operand weight
    ``W[n, k] = (codes - zero - shift) step gain / input_scale[k]`` from the weight gradient ``G = grad_out^T x``
    divided by ``input_scale``: with ``S = sum_{k in g} G`` and ``C = sum_{k in g} G codes``,
    ``dL/dgain = step (C - (zero + shift) S)`` and ``dL/dshift = -step gain S`` (``grad_out [T, N]``, ``x2d [T, K]`` as
    the backends see them: divided by ``input_scale``, rotated for ``-rht``). ``S`` and ``C`` come from the C++
    ``learned_step_sums`` (a tile of ``G`` per thread, reduced against the packed codes in one pass), else torch ops.
    ``gain=False`` (zero points learned alone): ``(None, dL/dshift)`` from ``S`` alone, ``grad_out^T`` times ``x``'s
    group sums (``T N K / size`` multiply-adds instead of the weight gradient's ``T N K``)."""
    inverse, size = layer.inverse_input_scale(), layer.spec.group_size or layer.in_features
    if not gain:
        return None, _group_sums_grad(grad_out, x2d, inverse, size).mul_(-layer.effective_step())
    zero = layer.effective_zero()
    ext = cpu_kernels() if x2d.device.type == "cpu" and isinstance(layer, PackedInt4Linear) else None
    if ext is not None and grad_out.dtype == x2d.dtype and size % 2 == 0 and layer.in_features % size == 0:
        tile = balanced_tile(layer.out_features, LEARNED_SUMS_TILE[x2d.dtype], layer.in_features)
        sums, gain = ext.learned_step_sums(  # detached: its GEMM writes into scratch (an out= op autograd refuses)
            grad_out.detach().contiguous(), x2d.detach().contiguous(), layer.qweight.view(torch.uint8), inverse, size,
            layer.spec.symmetric, tile,
        )
        if zero is None:
            sums = None
    else:
        sums, gain = _learned_sums_torch(grad_out, x2d, layer, inverse, zero is not None, size)
    if sums is not None:
        gain.sub_(zero * sums)
    gain.mul_(layer.step.float())
    return gain, sums.mul_(-layer.effective_step()) if shift else None


def _group_sums_grad(grad_out: torch.Tensor, x2d: torch.Tensor, inverse: torch.Tensor | None, size: int):
    """``S = sum_{k in g} (grad_out^T x)[n, k] / input_scale[k]`` fp32 ``[N, G]`` as ``grad_out^T (x / input_scale)``
    summed per group of ``size`` input channels first (``grad_out [T, N]``, ``x2d [T, K]``)."""
    x = x2d.float() if inverse is None else x2d.float() * inverse
    return torch.mm(grad_out.float().t(), group_view(x, size).sum(-1))


def _learned_sums_torch(grad_out, x2d, layer: "PackedLinear", inverse, with_sums: bool, size: int):
    """``(S or None, C)`` of :func:`_learned_grads` (the C++ kernel's order) by torch ops, ``CHUNK_ELEMENTS`` weight elements at a time: where
    the C++ kernel does not run (int8 layers, no kernels, mixed dtypes)."""
    rows = max(1, CHUNK_ELEMENTS // layer.in_features)
    gain = torch.empty(layer.step.shape, device=x2d.device)
    sums = torch.empty(layer.step.shape, device=x2d.device) if with_sums else None
    dtype = torch.promote_types(grad_out.dtype, x2d.dtype)  # autocast: a bf16 gradient of an fp32 input
    x2d = x2d.to(dtype)
    for r0 in range(0, layer.out_features, rows):
        block = slice(r0, r0 + rows)
        grad_w = torch.mm(grad_out[:, block].t().to(dtype), x2d).float()
        if inverse is not None:
            grad_w.mul_(inverse)
        if sums is not None:
            sums[block] = group_view(grad_w, size).sum(-1)
        codes = layer._unpack(layer.qweight[block]).float()  # fp32 first: a uint8 operand makes mul_ 30x slower
        gain[block] = group_view(grad_w.mul_(codes), size).sum(-1)
    return sums, gain


class _PackedMatmul(torch.autograd.Function):
    """``y = x @ W^T`` and ``grad_x = grad_y @ W`` by one backend's kernels (:data:`KERNELS`); with a trainable step
    ``gain`` (:meth:`PackedLinear.learn_steps`) also its gradient."""

    @staticmethod
    def forward(ctx, x2d, gain, shift, layer: "PackedLinear", backend: str):
        ctx.layer, ctx.backend = layer, backend
        learned = any(p is not None and p.requires_grad for p in (gain, shift))
        ctx.save_for_backward(x2d if learned else None)
        return KERNELS[backend][0](x2d, layer)

    @staticmethod
    def backward(ctx, grad_out):
        (x2d,) = ctx.saved_tensors
        grads = (None, None)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:  # first: the grad-input may consume grad_out
            grads = _learned_grads(grad_out, x2d, ctx.layer, ctx.needs_input_grad[1], ctx.needs_input_grad[2])
        grad_x = KERNELS[ctx.backend][1](grad_out, ctx.layer) if ctx.needs_input_grad[0] else None
        return grad_x, grads[0] if ctx.needs_input_grad[1] else None, grads[1], None, None


# ------------------------------------------------------------------------------------ module


class PackedWeightRead(AttributeError):
    """A packed layer's dense ``.weight`` was read (:class:`NoDenseWeight`)."""


class NoDenseWeight:
    """Mixin of the modules that hold their weight packed: reading ``.weight`` (``resize_token_embeddings``, code
    written for ``nn.Linear`` / ``nn.Embedding``) fails saying why (:class:`PackedWeightRead`), not with nn.Module's
    bare "has no attribute"."""

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name != "weight":
                raise
        raise PackedWeightRead(
            f"{type(self).__name__} holds its weight packed, no dense .weight (dequantized_weight() makes one): "
            "resize_token_embeddings and code written for nn.Linear / nn.Embedding need the model before packing"
        )


class PackedLinear(NoDenseWeight, Fp32State):
    """Frozen linear stored as integer codes: ``qweight``, ``step`` ``[N, G]``, optional ``zero``, ``input_scale``
    fp32 ``[K]`` (ones unless activation-aware scaling chose others). Subclasses say how codes are stored.
    ``dtype``: the dtype of the dense layer it stands for (its bias; dense twins and dequantized rows are made in it;
    ``.to()`` changes it); the steps are kept in it too, unless :meth:`store_steps_in` chose another.

    Build one with :meth:`from_codes` (``Int4Linear.freeze()`` does). ``backend``: one of ``auto``,
    ``int8``, ``dequant`` (see the module docstring); a requested ``int8`` that cannot run raises.
    ``outlier_columns``: input channels per call that the int8 backend multiplies in the activation dtype
    (default ``OUTLIER_COLUMNS``; 0: every channel in int8). ``step_gain``: ``None``, or the trainable fp32 ``[N, G]``
    gain and ``zero_shift`` ``None`` or the trainable ``[N, G]`` shift (the zero points' dtype) of :meth:`learn_steps`.
    ``exact_kernels``: ``auto`` never picks ``int8``'s forward, only its grad-input (``tiled/int8``; set by
    :meth:`learn_steps`, and on loading a folder whose steps were learned: steps fit to an exact forward lose 0.5-1%
    of perplexity under int8's re-rounding).
    """

    BUFFERS = ("qweight", "step", "zero", "input_scale")  # what a state dict holds for the weight
    FP32_STATE = ("step_gain",)  # learned: stays fp32 when the model is cast (the steps follow the layer's dtype)
    STORES = ""  # what the subclass stores, for error messages

    def __init__(
        self,
        in_features: int,
        out_features: int,
        spec: FormatSpec | str,
        bias: bool = False,
        dtype: torch.dtype = torch.bfloat16,
        device=None,
        backend: str = "auto",
    ):
        super().__init__()
        self.spec = FormatSpec.parse(spec)
        self._check_spec(self.spec)
        self.in_features, self.out_features = in_features, out_features
        self.rotation_block = layer_rotation(self.spec, in_features, f"{type(self).__name__}({self.spec.name})")
        groups = 1 if self.spec.group_size is None else -(-in_features // self.spec.group_size)
        self.register_buffer("qweight", self._empty_codes(out_features, in_features, device))
        self.dtype = dtype
        self.register_buffer("step", torch.ones(out_features, groups, dtype=dtype, device=device))
        zero = None if self.spec.symmetric else torch.zeros(out_features, groups, dtype=dtype, device=device)
        self.register_buffer("zero", zero)
        self.register_buffer("input_scale", torch.ones(in_features, device=device))
        self.register_parameter("step_gain", None)
        self.register_parameter("zero_shift", None)
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        )
        self.backend = backend
        self.last_backend: str | None = None
        self.outlier_columns = OUTLIER_COLUMNS
        self.exact_kernels = False
        self._cache: dict[str, torch.Tensor | None] = {}

    @classmethod
    def stores(cls, spec: FormatSpec) -> bool:
        """Whether this class stores format ``spec``."""
        raise NotImplementedError

    @classmethod
    def _check_spec(cls, spec: FormatSpec) -> None:
        if not cls.stores(spec):
            raise ValueError(f"{cls.__name__} stores {cls.STORES}, got {spec.name!r}")

    @property
    def backend(self) -> str:
        return self._backend

    @backend.setter
    def backend(self, value: str) -> None:
        if value not in PACKED_BACKENDS:
            raise ValueError(f"{type(self).__name__} backend {value!r}: choose one of {', '.join(PACKED_BACKENDS)}")
        self._backend = value

    @classmethod
    def from_codes(
        cls,
        codes,
        step,
        zero,
        spec: FormatSpec,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        backend: str = "auto",
        input_scale: torch.Tensor | None = None,
    ):
        """Store integer ``codes [N, K]`` (of ``W diag(input_scale)``, ``W R diag(input_scale)`` for ``-rht``) with
        their ``step``/``zero`` ``[N, G]``, kept in ``dtype``, the layer's."""
        out_features, in_features = codes.shape
        new = cls(in_features, out_features, spec, bias is not None, dtype, codes.device, backend)
        new.qweight.copy_(new._store(codes))
        new.step.copy_(step)
        if zero is not None:
            new.zero.copy_(zero)
        if input_scale is not None:
            new.input_scale.copy_(input_scale)
        if bias is not None:
            new.bias.data.copy_(bias.detach())
        return new

    # ----------------------------------------------------------------------- storage (subclasses)
    def _empty_codes(self, out_features: int, in_features: int, device) -> torch.Tensor:
        raise NotImplementedError

    def _store(self, codes: torch.Tensor) -> torch.Tensor:
        """``qweight`` holding integer ``codes [N, K]``."""
        raise NotImplementedError

    def _unpack(self, qweight: torch.Tensor) -> torch.Tensor:
        """The integer codes ``[n, K]`` of stored rows ``qweight [n, ...]`` (int8 when symmetric, else uint8)."""
        raise NotImplementedError

    def codes(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The integer codes ``[N, K]`` (int8 when symmetric, else non-negative uint8); of output rows ``rows`` (an
        index) only, ``[len(rows), K]``."""
        return self._unpack(self.qweight if rows is None else self.qweight[rows])

    def int8_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w8 [N, K] int8, r [N] fp32)`` with ``grid_weight ≈ r[:, None] * w8``, whole (the int8 backend unpacks a
        block at a time: :func:`int8_block`)."""
        raise NotImplementedError

    def tile_operands(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """``(weight, ratio, zero, r)``: what the tile kernels (:func:`int8_tile_kernels`) read to make
        :meth:`int8_weight`'s ``w8`` tile by tile: the stored codes, per-group fp32 ``ratio``/``zero`` ``[N, G]`` turning
        INT4 codes into ``w8`` (``None`` for stored int8 codes), and ``r [N]`` fp32."""
        raise NotImplementedError

    def int8_columns(self, columns: torch.Tensor, operands: tuple, dtype: torch.dtype) -> torch.Tensor:
        """``w8[:, columns] * row_step[:, None]`` in ``dtype`` (``[N, k]``, :func:`weight_columns`) read from the stored
        codes (``operands``: :meth:`tile_operands`, which end with ``row_step``), without unpacking the rest."""
        raise NotImplementedError

    def kernel_shape_supported(self) -> tuple[bool, str]:
        """Whether this layer's shape allows the int8 and tiled backends (and why not)."""
        return True, ""

    # ------------------------------------------------------------------------------- steps
    def learn_steps(self, steps: bool = True) -> list[nn.Parameter]:
        """Make the group steps and zero points trainable: a gain ``[N, G]`` fp32 (ones) multiplying ``step`` and, for
        an asymmetric format, a shift ``[N, G]`` (zeros) added to ``zero``, in every backend; the codes stay
        frozen. The shift is kept in the zero points' dtype (bf16 for a frozen base, ``compact_steps``): a small change
        of them (about a step at most), which bf16 rounds by at most 2^-9 of itself per update (unbiased where the
        optimizer rounds stochastically, as for bf16 adapters), less than folding it into bf16 zero points rounds
        (up to 2^-5 of a step); in fp32 it took twice the memory (Llama-3.2-1B shape: 58 MB). ``steps=False``: the
        zero points alone, no gain (a symmetric layer then learns nothing): their gradient needs the inputs' group
        sums, not a weight gradient. Returns what the layer learns (a second call
        returns the same parameters, and those the first did not make)."""
        learned = self.learns_steps
        if steps and self.step_gain is None:
            self.step_gain = nn.Parameter(torch.ones(self.step.shape, device=self.step.device))
        if self.zero is not None and self.zero_shift is None:
            self.zero_shift = nn.Parameter(torch.zeros(self.step.shape, dtype=self.zero.dtype, device=self.step.device))
        if self.learns_steps and not learned:
            self.exact_kernels = True
            self._cache.clear()
        return [p for p in (self.step_gain, self.zero_shift) if p is not None]

    @property
    def learns_steps(self) -> bool:
        """Whether a trainable gain or shift (:meth:`learn_steps`) applies to the steps or zero points."""
        return self.step_gain is not None or self.zero_shift is not None

    def effective_step(self, rows: torch.Tensor | None = None, grad: bool = False) -> torch.Tensor:
        """``step x step_gain`` fp32 ``[N, G]`` (``step`` without a gain): the steps the layer computes with; of
        ``rows`` alone where given; ``grad``: through autograd to the gain (the layer's own ops pass it theirs)."""
        step = self.step.float() if rows is None else self.step[rows].float()
        if self.step_gain is None:
            return step
        gain = self.step_gain if rows is None else self.step_gain[rows]
        return step * (gain if grad else gain.detach())

    def effective_zero(self, rows: torch.Tensor | None = None, grad: bool = False) -> torch.Tensor | None:
        """``zero + zero_shift`` fp32 ``[N, G]`` (``zero`` without a shift; ``None`` when symmetric); ``rows`` and
        ``grad`` as :meth:`effective_step`'s."""
        if self.zero is None:
            return None
        zero = self.zero.float() if rows is None else self.zero[rows].float()
        if self.zero_shift is None:
            return zero
        shift = self.zero_shift if rows is None else self.zero_shift[rows]
        return zero + (shift if grad else shift.detach())

    @torch.no_grad()
    def fold_learned_steps(self) -> None:
        """Store the learned steps and zero points in ``step`` and ``zero`` (rounded to their dtype), the gain back at
        one and the shift at zero: the layer then computes exactly what its state dict holds (no-op without them)."""
        if self.step_gain is not None:
            self.step.copy_(self.effective_step().to(self.step.dtype))
            self.step_gain.fill_(1.0)
        if self.zero_shift is not None:
            self.zero.copy_(self.effective_zero().to(self.zero.dtype))
            self.zero_shift.zero_()
        self._cache.clear()

    # ------------------------------------------------------------------------------- weights
    def grid_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``(codes - zero) * step`` as a dense ``[N, K]`` tensor: the (rotated) weight times ``input_scale``."""
        return dequantize_int(self.codes(), self.spec, self.effective_step(), self.effective_zero(), dtype)

    def _row_absmax(self) -> torch.Tensor:
        """``max_k |grid_weight[n, k]|`` fp32 ``[N]``, dequantized ``ROW_MAX_ELEMENTS`` at a time (the whole fp32 grid
        and its absolute value: 134 MB for one 8192x2048 projection). With learned steps, a bound instead (below)."""
        if self.learns_steps:  # steps that change every optimizer step: per call, from [N, G] numbers
            return self._row_reach_bound()
        rows = max(1, ROW_MAX_ELEMENTS // self.in_features)
        out = torch.empty(self.out_features, device=self.qweight.device)
        for r0 in range(0, self.out_features, rows):
            block = slice(r0, r0 + rows)
            zero = None if self.zero is None else self.zero[block].float()
            grid = dequantize_int(self._unpack(self.qweight[block]), self.spec, self.step[block].float(), zero)
            out[block] = grid.abs_().amax(-1)
        return out

    def _row_reach_bound(self) -> torch.Tensor:
        """``max_g |step[n, g]| x max(|qmax - zero[n, g]|, |qmin - zero[n, g]|)`` fp32 ``[N]``: the largest
        ``|grid_weight|`` a row's codes could reach, from ``[N, G]`` numbers alone. Round-to-nearest asymmetric groups
        hold both ends of the code range, so there it is the row's maximum; symmetric groups rarely use ``qmin``
        (-8: the bound is 8/7 of the maximum). Not the groups' own code ranges: kept, those cost 2 bytes a group
        (30 MB over the Llama-3.2-1B shape's learning layers)."""
        qmin, qmax = self.spec.qrange
        zero = self.effective_zero()
        reach = max(-qmin, qmax) if zero is None else (qmax - zero).abs().maximum((qmin - zero).abs())
        return (self.effective_step().abs() * reach).amax(-1)

    def operand_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``grid_weight / input_scale``, dense ``[N, K]``: the weight the backends multiply (``W R`` for ``-rht``)."""
        inverse = self.inverse_input_scale()
        if inverse is None:
            return self.grid_weight(dtype)
        return (self.grid_weight(torch.float32) * inverse).to(dtype)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the layer computes with, in its input's basis (``operand_weight`` rotated back for ``-rht``),
        dense ``[N, K]``."""
        if self.rotation_block is None:
            return self.operand_weight(dtype)
        return self._original_basis(self.operand_weight(torch.float32)).to(dtype)

    def dense_linear(self, weight: torch.Tensor, rows: slice = slice(None)) -> nn.Linear:
        """A frozen ``nn.Linear`` of this layer's shape and bias with the dense ``weight [N, K]`` in the layer's compute
        dtype (e.g. the checkpoint's weight, read back to score or re-plan this layer); with ``rows``, the layer of
        those output rows only (``weight`` holds just them)."""
        out_features = len(range(self.out_features)[rows])
        if tuple(weight.shape) != (out_features, self.in_features):
            raise ValueError(
                f"dense weight {tuple(weight.shape)} does not fit a {out_features}x{self.in_features} layer"
            )
        dense = nn.Linear(self.in_features, out_features, bias=False, device="meta")
        dense.weight = nn.Parameter(weight.to(self.dtype), requires_grad=False)
        whole = out_features == self.out_features
        dense.bias = self.bias if self.bias is None or whole else nn.Parameter(self.bias[rows], requires_grad=False)
        return dense

    def _original_basis(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight R^T`` for ``-rht`` layers (rows of the stored basis back in the input's), else ``weight``."""
        return weight if self.rotation_block is None else unrotate(weight, self.rotation_block)

    def dequantized_rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``index`` (any shape) of :meth:`dequantized_weight`, ``[*index.shape, K]`` in ``dtype``, dequantized
        from their codes alone: what an input embedding tied to this (output head) layer reads per token. Learned
        steps (:meth:`learn_steps`) get this use's gradient too, through autograd (the head's own forward passes them
        theirs)."""
        flat = index.reshape(-1)
        if not flat.numel():
            return torch.empty(*index.shape, self.in_features, dtype=dtype, device=self.qweight.device)
        low, high = (int(v) for v in torch.aminmax(flat))  # indexing would wrap negative ids, nn.Embedding raises
        if low < 0 or high >= self.out_features:
            raise IndexError(f"token ids must lie in [0, {self.out_features}) (the vocabulary), got {low}..{high}")
        step, zero = self.effective_step(flat, grad=True), self.effective_zero(flat, grad=True)
        rows = dequantize_int(self._unpack(self.qweight[flat]), self.spec, step, zero)
        inverse = self.inverse_input_scale()
        rows = self._original_basis(rows if inverse is None else rows * inverse)
        return rows.to(dtype).view(*index.shape, self.in_features)

    def inverse_input_scale(self) -> torch.Tensor | None:
        """``1 / input_scale`` fp32 ``[K]``, or ``None`` when the scale is all ones; cached until the buffers change."""
        if "inverse" not in self._cache:
            s = self.input_scale.float()
            if s.is_meta:  # no values to compare (a shape-only forward)
                return None
            self._cache["inverse"] = None if bool((s == 1).all()) else (1.0 / s).contiguous()
        return self._cache["inverse"]

    def tiled_operands(self) -> tuple:
        """``(codes as uint8, step fp32 [N, G], zero fp32 or None, 1/input_scale or None, K, group size,
        signed, int4)``: the arguments of the C++ ``tiled_*`` kernels. Steps and zero points are converted on every
        call (``[N, G]``: 1/64 of the codes): kept, their fp32 copies would add 8 bytes per group, 116 MB on a
        1.2B-parameter model."""
        zero = None if self.zero is None else self.effective_zero().contiguous()
        group = self.spec.group_size or self.in_features
        int4 = isinstance(self, PackedInt4Linear)
        step = self.effective_step().contiguous()
        inverse = self.inverse_input_scale()
        return self.qweight.view(torch.uint8), step, zero, inverse, self.in_features, group, self.spec.symmetric, int4

    @classmethod
    @torch.no_grad()
    def from_weight(
        cls, weight: torch.Tensor, spec: FormatSpec | str, bias: torch.Tensor | None = None, dtype=None,
        backend: str = "auto",
    ):
        """Round-to-nearest codes of a dense ``weight [N, K]`` (steps from each group's range, ``int_steps``) for a
        layer computing in ``dtype`` (default ``weight.dtype``), steps kept in it. Rows are quantized a slice at a time, so the fp32 working copy
        stays near ``CHUNK_ELEMENTS`` whatever the weight's size (a 128k-vocabulary head: 1 GB whole)."""
        out_features, in_features = weight.shape
        new = cls(in_features, out_features, spec, bias is not None, dtype or weight.dtype, weight.device, backend)
        new._store_weight(weight)
        if bias is not None:
            new.bias.data.copy_(bias.detach())
        return new

    @torch.no_grad()
    def store_steps_in(self, dtype: torch.dtype) -> None:
        """Keep ``step`` and ``zero`` in ``dtype`` (``BASE_STEP_DTYPE`` for a frozen base); the codes stay, and the
        layer still computes in :attr:`dtype`."""
        self.step = self.step.to(dtype)
        if self.zero is not None:
            self.zero = self.zero.to(dtype)
        self._cache.clear()

    def _store_weight(self, weight: torch.Tensor) -> None:
        """Store ``weight diag(input_scale)`` (``weight`` dense ``[N, K]``, rotated first for ``-rht``) with fresh
        round-to-nearest steps."""
        rows = max(1, CHUNK_ELEMENTS // self.in_features)
        scale = self.input_scale.float()
        for start in range(0, self.out_features, rows):
            part = slice(start, start + rows)
            w = weight[part].detach().float()
            w = (w if self.rotation_block is None else rotate(w, self.rotation_block)) * scale
            step, zero = int_steps(w, self.spec)
            self.qweight[part] = self._store(quantize_int(w, self.spec, step, zero))
            self.step[part] = step
            if zero is not None:
                self.zero[part] = zero
        if self.step_gain is not None:  # fresh steps and zero points: nothing learned applies to them
            self.step_gain.data.fill_(1.0)
        if self.zero_shift is not None:
            self.zero_shift.data.zero_()
        self._cache.clear()

    @torch.no_grad()
    def requantize_(self, weight: torch.Tensor) -> dict:
        """Re-store a dense ``weight [N, K]`` in this layer's format, in place (fresh steps from
        ``weight diag(input_scale)``; the input scale stays).

        Returns ``{"rel_error": ||Q(W) - W|| / ||W||}`` (Frobenius; fp32) so callers can report the loss.
        """
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"requantize_: weight shape {tuple(weight.shape)} != ({self.out_features}, {self.in_features})"
            )
        self._store_weight(weight)
        w = weight.detach().float()
        err = (self.dequantized_weight(torch.float32) - w).norm() / w.norm().clamp(min=1e-12)
        return {"rel_error": err.item()}

    def backend_status(self, x: torch.Tensor) -> dict[str, tuple[bool, str]]:
        """``{backend: (can run, why)}`` for input ``x``: this layer's shape, the device, the CPU, the kernels."""
        shape_ok, shape_reason = self.kernel_shape_supported()
        out = {}
        for name, (ok, reason) in (
            ("int8", int8_backend_available(x.device, self, x.dtype)),
            ("tiled", tiled_backend_available(x.device, x.dtype)),
        ):
            out[name] = (ok, reason) if shape_ok else (False, shape_reason)
        out["dequant"] = (True, "dense weight dequantized per call" + (f" ({shape_reason})" if not shape_ok else ""))
        return out

    def runnable_backends(self, x: torch.Tensor) -> dict[str, str]:
        """``{backend: why it can run}`` for input ``x``; ``dequant`` always can."""
        return {name: reason for name, (ok, reason) in self.backend_status(x).items() if ok}

    def resolve_backend(self, x: torch.Tensor) -> str:
        """The backend that runs for input ``x``: the one asked for, or for ``auto`` the fastest runnable one
        for this shape and dtype, measured once per machine (:mod:`hf_lowprec.modules.kernels.autotune`)."""
        if self.backend == "auto":
            key = ("auto", x.device.type, x.dtype)  # resolved once per layer, device, dtype (dropped on .to())
            if key not in self._cache:
                runnable = self.runnable_backends(x)
                if self.exact_kernels and len(runnable) > 1:
                    # learned steps: an exact forward (tiled, dequant), not int8's, whose per-token int8 activations
                    # add noise the steps cannot fit. SmolLM2-135M, every linear int4-g64-asym + LoftQ + learned steps,
                    # 100 steps of 4x256, seed 0, held-out perplexity trained and evaluated on int8 38.05, on dequant
                    # 37.43 (bf16 LoRA 37.24); 210 vs 223 s of training (the steps' gradient GEMMs weigh on both)
                    int8 = runnable.pop("int8", None)
                    if int8 is not None:  # the grad-input may still run int8 (KERNELS)
                        runnable |= {f"{name}/int8": f"{why}; grad-input: {int8}" for name, why in runnable.items()}
                if len(runnable) > 1 and self.in_features * self.out_features > DEQUANT_AUTOTUNE_MAX:
                    # timing dequant makes the whole dense weight (a 128k-vocabulary head: 1 GB)
                    runnable = {name: why for name, why in runnable.items() if not name.startswith("dequant")}
                if len(runnable) > 1:
                    choice = self._autotune(x.device, x.dtype, runnable)
                    self._cache[key], reason = choice.value, choice.reason
                else:
                    self._cache[key], reason = next(iter(runnable.items()))
                _log_once(self._cache[key], reason)
            return self._cache[key]
        status = self.backend_status(x)
        ok, reason = status[self.backend]
        if not ok:
            runnable = ", ".join(name for name, (can, _) in status.items() if can)
            raise ValueError(
                f"{type(self).__name__} backend {self.backend!r} cannot run here: {reason}; "
                f"use 'auto' or one of {runnable}"
            )
        return self.backend

    def _autotune(self, device: torch.device, dtype: torch.dtype, runnable: dict[str, str]):
        """Time forward + grad-input of each runnable backend on a random ``[T, K]`` input, ``T = AUTOTUNE_TOKENS`` or
        fewer where the output would exceed ``AUTOTUNE_OUTPUTS`` elements (made only when this machine has not
        measured this shape yet)."""
        probe: dict[str, torch.Tensor] = {}
        tokens = max(1, min(AUTOTUNE_TOKENS, AUTOTUNE_OUTPUTS // self.out_features))

        def run(backend):
            if not probe:
                gen = torch.Generator(device).manual_seed(0)
                probe["x"] = torch.randn(tokens, self.in_features, generator=gen, device=device, dtype=dtype)
                probe["g"] = torch.randn(tokens, self.out_features, generator=gen, device=device, dtype=dtype)
            x = probe["x"].mul_(1.0)  # a new version: the int8 rows of the last call are not reused
            forward, grad_input = KERNELS[backend]
            return forward(x, self), grad_input(probe["g"], self)

        key = f"packed:{type(self).__name__}:{self.spec.name}:{self.out_features}x{self.in_features}:{str(dtype)[6:]}"
        key += ":exact-forward" if self.exact_kernels else ""  # timed without int8's forward (learned steps): apart
        return fastest(key, {name: (lambda name=name: run(name)) for name in runnable}, _backend_reason)

    # ------------------------------------------------------------------------------- compute
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2d = x.reshape(-1, shape[-1])
        if self.rotation_block is not None:
            x2d = rotate(x2d, self.rotation_block)
        self.last_backend = self.resolve_backend(x)
        out = _PackedMatmul.apply(x2d, self.step_gain, self.zero_shift, self, self.last_backend)
        out = out.reshape(*shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    # ------------------------------------------------------------------- cache invalidation
    def _apply(self, fn, recurse=True):
        self._cache.clear()
        self.dtype = fn(torch.empty(0, dtype=self.dtype, device=self.qweight.device)).dtype  # .to(dtype), .half()
        return super()._apply(fn, recurse)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """Steps and zero points are saved with the learned gain and shift folded in (rounded to their dtype: in bf16
        a step by at most 2^-9 of itself, a zero point by at most 2^-5 of a step), and no gain or shift: a plain packed
        layer for every loader."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.step_gain is not None:
            del destination[prefix + "step_gain"]
            destination[prefix + "step"] = self.effective_step().to(self.step.dtype)
        if self.zero_shift is not None:
            del destination[prefix + "zero_shift"]
            destination[prefix + "zero"] = self.effective_zero().to(self.zero.dtype)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors):
        self._cache.clear()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors)
        for name, start in (("step_gain", 1.0), ("zero_shift", 0.0)):  # saved folded (above): start again from them
            if getattr(self, name) is not None and prefix + name not in state_dict:
                missing_keys.remove(prefix + name)
                getattr(self, name).data.fill_(start)

    def extra_repr(self) -> str:
        shape = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{shape}, format={self.spec.name}, packed, backend={self.backend}"


class PackedInt4Linear(PackedLinear):
    """INT4 codes, two per byte: ``qweight`` uint8 ``[N, ceil(K/2)]``, group-wise ``step``/``zero`` ``[N, G]``."""

    STORES = "int4 formats"

    @classmethod
    def stores(cls, spec: FormatSpec) -> bool:
        # -a8 quantizes the inputs to int8 per token too, which the packed kernels do not: packed, those layers
        # computed weight-only INT4 under their -a8 name
        return spec.family == "int4" and not spec.act_int8

    def _empty_codes(self, out_features: int, in_features: int, device) -> torch.Tensor:
        return torch.zeros(out_features, (in_features + 1) // 2, dtype=torch.uint8, device=device)

    def _store(self, codes: torch.Tensor) -> torch.Tensor:
        return pack_int4(codes)

    def _unpack(self, qweight: torch.Tensor) -> torch.Tensor:
        return unpack_int4(qweight, self.in_features, signed=self.spec.symmetric)

    def _int8_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(step / r [N, G], r [N])`` fp32, with ``r[n] = max_k |grid_weight[n, k]| / 127``; ``r`` is cached until
        the buffers change (it needs the whole weight), the ratio computed per call (cached, 4 bytes per group)."""
        if "row_step" in self._cache:
            row_step = self._cache["row_step"]
        else:
            row_step = (self._row_absmax() / _INT8_MAX).clamp(min=_SMALLEST_AMAX / _INT8_MAX)
            if not self.learns_steps:  # learned steps change every optimizer step (and are cheap to redo)
                self._cache["row_step"] = row_step
        return (self.effective_step() / row_step.unsqueeze(-1)).contiguous(), row_step

    def int8_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Unpacked from the codes on every call into a tensor of its own (see :meth:`PackedLinear.int8_weight`).
        Needs ``K`` even and a multiple of the group size (see :meth:`kernel_shape_supported`)."""
        operands = self.tile_operands()
        return int8_block(self, operands, scratch_ok=False), operands[3]

    def tile_operands(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        ratio, row_step = self._int8_scales()
        zero = None if self.zero is None else self.effective_zero().contiguous()
        return self.qweight, ratio, zero, row_step

    def int8_columns(self, columns: torch.Tensor, operands: tuple, dtype: torch.dtype) -> torch.Tensor:
        weight, ratio, zero, row_step = operands
        out = torch.empty(self.out_features, len(columns), dtype=dtype, device=weight.device)
        ext = native_kernels(weight, out)
        if ext is None:
            return weight_columns(int8_block(self, operands, scratch_ok=False), columns, row_step, dtype)
        ext.int4_columns(weight, ratio, zero, self.spec.symmetric, self.in_features, columns.contiguous(), row_step, out)
        return out

    def kernel_shape_supported(self) -> tuple[bool, str]:
        k, g = self.in_features, self.spec.group_size
        if k % 2:
            return False, f"in_features {k} is odd"
        if g is not None and k % g:
            return False, f"in_features {k} is not a multiple of the group size {g}"
        return True, ""


class PackedInt8Linear(PackedLinear):
    """int8 codes, one per byte: ``qweight`` int8 ``[N, K]``, one symmetric ``step`` per output row ``[N, 1]``
    (format ``int8``, per channel). The int8 backend multiplies the stored codes as they are."""

    STORES = "per-channel symmetric int8 ('int8')"

    def backend_status(self, x: torch.Tensor) -> dict[str, tuple[bool, str]]:
        status = super().backend_status(x)
        if self.in_features % 2 and status["tiled"][0]:  # the C++ tile reader takes codes in pairs (packed_weight)
            status["tiled"] = (False, f"in_features {self.in_features} is odd: the tile kernels read codes in pairs")
        return status

    @classmethod
    def stores(cls, spec: FormatSpec) -> bool:
        return spec.family == "int8" and spec.granularity == "channel" and spec.symmetric and not spec.act_int8

    def _empty_codes(self, out_features: int, in_features: int, device) -> torch.Tensor:
        return torch.zeros(out_features, in_features, dtype=torch.int8, device=device)

    def _store(self, codes: torch.Tensor) -> torch.Tensor:
        return codes.to(torch.int8)

    def _unpack(self, qweight: torch.Tensor) -> torch.Tensor:
        return qweight

    def tile_operands(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        return self.qweight, None, None, self.int8_weight()[1]

    def int8_columns(self, columns: torch.Tensor, operands: tuple, dtype: torch.dtype) -> torch.Tensor:
        return weight_columns(self.qweight, columns, operands[3], dtype)

    def int8_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored codes themselves (nothing is unpacked)."""
        if self.step_gain is not None:
            return self.qweight, self.effective_step().view(-1).contiguous()
        if "row_step" not in self._cache:
            self._cache["row_step"] = self.step.float().view(-1).contiguous()
        return self.qweight, self._cache["row_step"]


def compact_steps(layer: nn.Module) -> nn.Module:
    """``layer`` (a packed linear, or a packed embedding: its table), an INT4 one with its group steps and zero points
    kept in ``BASE_STEP_DTYPE`` (as a frozen base keeps them): the kernels read them as fp32 per call, zero points are
    integers (exact), and a step rounds by at most 2^-8 of itself, so a weight moves by at most ``|code - zero| x
    2^-8`` of its group's step (under 6%; rounding to the grid moved it by up to 50%). int8 rows keep theirs: one step
    per row saves nothing, and codes up to 127 would move by half a step."""
    table = getattr(layer, "table", layer)  # packed embeddings (modules/packed_embedding.py) read a packed table
    if isinstance(table, PackedInt4Linear):
        table.store_steps_in(BASE_STEP_DTYPE)
    return layer


def packed_class(spec: FormatSpec | str) -> type[PackedLinear] | None:
    """The packed class that stores ``spec`` (INT4 formats; per-channel symmetric ``int8``), else ``None``."""
    spec = FormatSpec.parse(spec)
    return next((cls for cls in (PackedInt4Linear, PackedInt8Linear) if cls.stores(spec)), None)
