"""Scratch buffers the int8 backend's kernels reuse from call to call: the unpacked int8 weight and the int32 products.

Where it multiplies through ``torch._int_mm``, a packed layer's int8 backend unpacks its INT4 weight to int8 on every
forward and grad-input and multiplies into int32: at the Llama-3.2-1B shape and 256 tokens that is 2.7 GB of fresh
tensors per training step, all dead as soon as the layer returns. glibc serves them either from its heap, where they
fragment it, or, with a low ``MALLOC_MMAP_THRESHOLD_``, from fresh pages that fault in on every call. One buffer per
kind and thread, grown to the largest request and kept, removes that traffic; it holds one block of the weight in int8
(``packed.WEIGHT_TILE``, 2 MB: a buffer for the whole largest weight, 16 MB at the 1B shape, raised that step's peak
by 14 MB on an AVX512-BF16 EPYC) and one block of int32 products (at most 2 MB, ``packed.INT32_TILE``). On the 1B shape
(``benchmarks/scale.py``, AMX Xeon) the step with the mmap allocator went from 4.66 to 3.98 s at 1x256 and glibc's
training peak from 1763 to 1746 MB; the peak read with the mmap allocator stayed 1434-1435 MB. The whole grad-input
product in one buffer instead (one ``_int_mm`` call, no row blocks) measured the same step times within the machine's
noise and higher peaks: 1439 MB at 1x256, 1847 against 1818 MB (glibc: 2792 against 2619) at 4x256.

Written by hand: PyTorch's CPU allocator is plain ``malloc`` (no caching allocator as on CUDA), and no library of the
field offers a reusable workspace for CPU kernels.
"""

from __future__ import annotations

import math
import threading

import torch

_local = threading.local()  # autograd may run a backward on another thread than its forward: buffers per thread


def scratch(kind: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A contiguous tensor of ``shape`` and ``dtype`` on this thread's buffer ``kind``, its contents undefined, valid
    until the next call for ``kind`` on this thread: what a kernel writes and reads before it returns, never a result.

    The buffer grows to the largest request and stays allocated (:func:`release_scratch` frees them). Buffers made in
    inference mode are kept apart (an inference tensor cannot be written outside it)."""
    buffers = _local.__dict__.setdefault("buffers", {})
    key = (kind, dtype, torch.device(device), torch.is_inference_mode_enabled())
    numel = math.prod(shape)
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        buffers.pop(key, None)  # the old one freed before the larger one is made
        buffer = buffers[key] = torch.empty(numel, dtype=dtype, device=device)
    return buffer[:numel].view(shape)


def release_scratch() -> None:
    """Free this thread's scratch buffers (they are made again, at the size needed, by the next call)."""
    _local.__dict__.pop("buffers", None)
