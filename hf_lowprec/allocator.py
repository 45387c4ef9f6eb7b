"""glibc's allocator while a checkpoint is packed on load: every freed block of 64 KiB or more goes back to the system.

Packing on load reads each dense weight (up to 501 MB for a 128k-vocabulary embedding), packs it and frees it.
glibc's default allocator keeps freed blocks below its dynamic ``mmap`` threshold (which climbs to 32 MiB once such a
block is freed) in its heap, where later tensors fragment them, so the load peak depends on the order of frees.
Measured on the Llama-3.2-1B shape (AVX512-BF16 AMD EPYC, ``benchmarks/scale.py``'s int4-lora configuration, five
runs): load peak 1.60-1.75 GB and 1.51-1.72 GB resident after loading with glibc's defaults; 1.29 GB and 1.27 GB
within :func:`freed_memory_returned` (the packed model plus one weight; since 2026-12-03 around each weight's packing,
``export/hf_quantizer.py``: 1.29-1.30 GB in 3 runs, as around the whole load), for 6-8 s more loading (of 9 s: each
weight read lands in fresh pages). Training then peaked 1.68 GB at batch 1x256 against 1.76-1.81 GB.

Written by hand: no library of the field tunes the host allocator (PyTorch's CPU allocator is plain ``malloc``).
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import threading
from contextlib import contextmanager

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
LOAD_THRESHOLD = 64 * 1024  # bytes: blocks this large or larger are mapped on their own and unmapped when freed
AFTER_THRESHOLD = 32 * 2**20  # bytes: glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit, where its dynamic one ends
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")
_LOCK = threading.Lock()  # mallopt's setting is the process's: one depth count for all threads
_DEPTH = [0]  # blocks of freed_memory_returned open now


def _glibc() -> ctypes.CDLL | None:
    """glibc, when this process runs on it (Linux, not musl), else ``None``."""
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


@contextmanager
def freed_memory_returned():
    """Within the block, glibc returns every freed block of 64 KiB or more to the system; after it, blocks below
    32 MiB are kept for reuse again (glibc's threshold once it has adapted: faster steps) and the free memory left in
    the heap is returned (``malloc_trim``). Nothing changes off glibc, or when the environment sets glibc's
    allocator (``MALLOC_MMAP_THRESHOLD_`` and the like: the user's choice stands). Blocks may nest: the outermost one sets
    and restores."""
    libc = _glibc()
    if libc is None or any(name in os.environ for name in USER_SETTINGS):
        yield
        return
    with _LOCK:
        _DEPTH[0] += 1
        if _DEPTH[0] == 1:
            libc.mallopt(M_MMAP_THRESHOLD, LOAD_THRESHOLD)
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH[0] -= 1
            if _DEPTH[0] == 0:
                libc.mallopt(M_MMAP_THRESHOLD, AFTER_THRESHOLD)
                libc.malloc_trim(0)
