"""glibc's allocator while a checkpoint is packed on load: every freed block of 64 KiB or more goes back to the system.

Packing on load reads each dense weight (up to 501 MB for a 128k-vocabulary embedding), packs it and frees it.
glibc's default allocator keeps freed blocks below its dynamic ``mmap`` threshold (which climbs to 32 MiB once such a
block is freed) in its heap, where later tensors fragment them, so the load peak depends on the order of frees.
Measured on the Llama-3.2-1B shape (AVX512-BF16 AMD EPYC, ``benchmarks/scale.py``'s int4-lora configuration, five
runs): load peak 1.60-1.75 GB and 1.51-1.72 GB resident after loading with glibc's defaults; 1.29 GB and 1.27 GB
within :func:`freed_memory_returned` (the packed model plus one weight; since 2026-12-03 around each weight's packing,
``export/hf_quantizer.py``: 1.29-1.30 GB in 3 runs, as around the whole load), for 6-8 s more loading (of 9 s: each
weight read lands in fresh pages). Training then peaked 1.68 GB at batch 1x256 against 1.76-1.81 GB.

Training keeps the heap too: blocks below 32 MiB are reused (fast), but the holes freed tensors leave between live
ones stay resident, so glibc's peak runs 190-540 MB over the live tensors' on that shape (1.59-1.94 GB at 1x256,
against 1.40 GB where every freed block of 64 KiB or more is unmapped, which costs 1.4x the step in page faults).
:func:`freed_memory_returned_per_block` returns the holes (``malloc_trim``) at each decoder block's boundary, forward
and backward: at 1x256 1,418-1,433 MB in three runs against 1,593-1,669 alternating with them, for 1.15x the step (5 ms
a trim, the rest re-faulting the pages reused); in ``benchmarks/scale.py`` (``int4-lora-returned``) 1,422 MiB against
1,599 at 1.14x the step, and at 4x256 1,845 against 2,607 at 1.08x (AVX512-BF16 EPYC).
:func:`returning_freed_memory` picks the context for a ``return_freed_memory`` setting: with ``"auto"`` a block's
boundary trims only while this process holds more than :data:`AUTO_SHARE` of the memory it can use
(:func:`usable_memory_bytes`), as PyTorch's CUDA allocator reclaims cached blocks past its
``garbage_collection_threshold``: no cost where memory is ample, the lower peak where it is short.

Written by hand: no library of the field tunes the host allocator (PyTorch's CPU allocator is plain ``malloc``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
import threading
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch import nn

from hf_lowprec.layers import decoder_blocks

logger = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
LOAD_THRESHOLD = 64 * 1024  # bytes: blocks this large or larger are mapped on their own and unmapped when freed
AFTER_THRESHOLD = 32 * 2**20  # bytes: glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit, where its dynamic one ends
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")
_LOCK = threading.Lock()  # mallopt's setting is the process's: one depth count for all threads
_DEPTH = [0]  # blocks of freed_memory_returned open now
RETURN_FREED_MEMORY = (False, True, "auto")
"""``return_freed_memory``: never; at every decoder block's boundary; there while this process holds more than
:data:`AUTO_SHARE` of the memory it can use."""
AUTO_SHARE = 0.5
UNLIMITED = 2**60  # bytes: a cgroup limit this large is no limit (cgroup v1 writes 2**63 rounded down to a page)
_AUTO_LOGGED = [False]  # "auto" says once per process that it began to trim


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


def check_return_freed_memory(value) -> None:
    """Raise ``ValueError`` naming the allowed values unless ``value`` is one of :data:`RETURN_FREED_MEMORY`."""
    if not isinstance(value, bool) and value != "auto":  # not `in`: 1 == True, 0 == False
        raise ValueError(f"return_freed_memory must be false, true or 'auto', got {value!r}")


def resident_bytes() -> int:
    """This process's resident memory now (``/proc/self/statm``), bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cgroup_limit_bytes(root: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")) -> int | None:
    """The lowest memory limit on this process's cgroup and its ancestors (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``), bytes; ``None`` without one. The cgroup's path (``membership``) is looked up under
    ``root`` with as many leading parts dropped as it takes to exist: a container mounts its own cgroup as the root."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "?", "")
        if controllers == "":  # v2: mounted at the root, or beside v1 as "unified"
            base, name = (root if (root / "cgroup.controllers").exists() else root / "unified"), "memory.max"
        elif "memory" in controllers.split(","):
            base, name = root / "memory", "memory.limit_in_bytes"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        folders = (base.joinpath(*parts[start:]) for start in range(len(parts) + 1))
        folder = next((f for f in folders if f.is_dir()), None)
        while folder is not None:
            limits.append(_limit_in(folder / name))
            folder = None if folder == base else folder.parent
    limits = [limit for limit in limits if limit is not None]
    return min(limits) if limits else None


def _limit_in(path: Path) -> int | None:
    """The memory limit a cgroup file states, bytes; ``None`` for none (``max``, near 2**63, absent, unreadable)."""
    try:
        text = path.read_text().strip()
        return int(text) if text != "max" and int(text) < UNLIMITED else None
    except (OSError, ValueError):
        return None


def usable_memory_bytes() -> int | None:
    """The memory this process can use, bytes: its resident memory plus what the system has available
    (``MemAvailable``), or its cgroup's limit where that is lower; ``None`` where ``/proc/meminfo`` is absent."""
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None
    limit = cgroup_limit_bytes()
    usable = available + resident_bytes()
    return usable if limit is None else min(usable, limit)


def returning_freed_memory(model: nn.Module, setting: bool | str):
    """The context a training step runs in for a ``return_freed_memory`` ``setting``: nothing (``False``),
    :func:`freed_memory_returned_per_block` (``True``), or the same trimming only while this process holds more than
    :data:`AUTO_SHARE` of :func:`usable_memory_bytes` (``"auto"``; nothing where that is unknown or ``model`` has no
    decoder blocks). Raises ``ValueError`` for another value."""
    check_return_freed_memory(setting)
    if setting is False:
        return nullcontext()
    if setting is True:
        return freed_memory_returned_per_block(model)
    usable = usable_memory_bytes()
    if usable is None or not decoder_blocks(model):  # no /proc to compare against; no blocks to trim between
        return nullcontext()
    return freed_memory_returned_per_block(model, above_bytes=int(AUTO_SHARE * usable))


def _log_auto_trims(above_bytes: int) -> None:
    if not _AUTO_LOGGED[0]:
        _AUTO_LOGGED[0] = True
        logger.warning(
            "this process holds %.2f GB, over %.0f%% of the %.2f GB it can use: glibc's heap returns the memory freed "
            "tensors leave at each decoder block's boundary while it does (return_freed_memory='auto'; false: never, "
            "true: always)", resident_bytes() / 1e9, 100 * AUTO_SHARE, above_bytes / AUTO_SHARE / 1e9,
        )


@contextmanager
def freed_memory_returned_per_block(model: nn.Module, above_bytes: int | None = None):
    """Within the block, glibc returns the free memory of its heap (``malloc_trim``) as each decoder block of ``model``
    ends its forward and as its backward begins: the holes a block's freed tensors leave are not resident while the
    next block runs. With ``above_bytes``, only at the boundaries where this process's resident memory exceeds it.
    Nothing changes off glibc, or when the environment sets glibc's allocator. Raises ``ValueError`` for a model
    without decoder blocks (:func:`~hf_lowprec.layers.decoder_blocks`)."""
    blocks = decoder_blocks(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__} names no decoder blocks (no nn.ModuleList of layers): returning "
                         "freed memory per block needs a transformers model")  # fmt: skip
    libc = _glibc()
    if libc is None or any(name in os.environ for name in USER_SETTINGS):
        yield
        return

    def returned(*_) -> None:
        if above_bytes is None:
            libc.malloc_trim(0)
        elif resident_bytes() > above_bytes:
            _log_auto_trims(above_bytes)
            libc.malloc_trim(0)

    def after_forward(module: nn.Module, inputs, output) -> None:
        returned()
        hidden = output[0] if isinstance(output, (tuple, list)) else output
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(returned)  # runs as this block's backward begins (returns None: the gradient stays)

    handles = [block.register_forward_hook(after_forward) for block in blocks]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
