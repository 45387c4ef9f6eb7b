"""Pages of memory-mapped checkpoint files in this process: which tensors live in them, and handing back the pages of
weights already consumed.

transformers reads safetensors through a memory map: each tensor it hands over is a view of the mapped file, and every
page of it that was read stays in this process's resident memory for as long as the file is mapped (the whole load).
Packing a 1.2B checkpoint on load through ``from_pretrained(path, quantization_config=HfLowprecConfig())`` therefore
peaked at the bf16 file plus the packed model (3.6 GB at the Llama-3.2-1B shape, 2.5 GB of it file pages), although
each dense weight is read once and dropped. :func:`release_file_bytes` takes a weight's pages out of the process
(``madvise(MADV_DONTNEED)``) once it is packed: the mapping stays valid, and a later read of those bytes maps them in
again from the file.

Written by hand: neither safetensors nor transformers releases the pages of a mapped tensor (Linux only: elsewhere
nothing is released).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys
from typing import NamedTuple

import torch

MADV_DONTNEED = 4  # Linux's value (sys/mman.h)


class FileMapping(NamedTuple):
    """One file-backed mapping of this process: addresses ``[start, end)`` hold the file's bytes from ``offset``."""

    start: int
    end: int
    offset: int
    path: str


def file_mappings() -> list[FileMapping] | None:
    """This process's file-backed memory mappings (``/proc/self/maps``), or ``None`` where there is no such file."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    mappings = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[4] != "0":  # an inode: backed by a file
            start, end = fields[0].split("-")
            mappings.append(FileMapping(int(start, 16), int(end, 16), int(fields[2], 16), fields[5]))
    return mappings


def in_file_mapping(t: torch.Tensor, mappings: list[FileMapping] | None) -> bool:
    """Whether ``t``'s storage lies in one of ``mappings`` (``None``, unknown: every tensor counts as mapped)."""
    if mappings is None:
        return True
    address = t.untyped_storage().data_ptr()
    return any(m.start <= address < m.end for m in mappings)


def release_file_bytes(
    path: str | os.PathLike, offset: int, nbytes: int, mappings: list[FileMapping] | None = None
) -> int:
    """Take the whole pages of bytes ``[offset, offset + nbytes)`` of file ``path`` out of this process's resident
    memory, in every mapping of that file (of ``mappings``, default :func:`file_mappings` read now: ~2 ms, so a caller
    releasing many tensors of files it knows to be mapped passes them once); returns how many bytes were released (0
    off Linux, or when the file is not mapped). Only for bytes nothing will write to: a page a private mapping had
    copied on write reverts to the file."""
    if sys.platform != "linux" or nbytes <= 0:
        return 0
    target = os.path.realpath(path)
    released = 0
    for m in (file_mappings() or []) if mappings is None else mappings:
        if m.path != target:
            continue
        begin = max(offset, m.offset) - m.offset + m.start  # the file range's addresses inside this mapping
        end = min(offset + nbytes, m.offset + m.end - m.start) - m.offset + m.start
        begin = -(-begin // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages only: the neighbours' bytes stay
        end = end // mmap.PAGESIZE * mmap.PAGESIZE
        if end > begin and _madvise()(begin, end - begin, MADV_DONTNEED) == 0:
            released += end - begin
    return released


@functools.cache
def _madvise():
    """libc's ``madvise(address, length, advice) -> 0 | -1``."""
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes, madvise.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    return madvise
