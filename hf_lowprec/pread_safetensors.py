"""Lazy tensors of safetensors files, each read by ``pread`` straight into the memory of the tensor it returns.

Written by hand because safetensors' own ``backend="pread"`` reads a whole tensor into a buffer and then copies it,
whatever the slice asked for (measured with safetensors 0.8.0 on Llama-3.2-1B's 128k x 2048 bf16 embedding, 501 MB:
reading it whole peaked at 2x its size; one row took 0.28 s and peaked at +500 MB). Here a tensor costs its own
bytes once, and rows ``[a:b]`` read only those rows: quantizing a checkpoint on load never holds two copies of its
largest tensor, and an embedding lookup reads the rows it looks up.

The file format (https://github.com/huggingface/safetensors#format): 8 bytes little-endian header length ``n``,
``n`` bytes of JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}}`` (offsets from the end of the
header; an optional ``"__metadata__"``), then the data, C order, little-endian.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import torch

DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64, "F16": torch.float16,
    "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
"""safetensors' dtype names -> torch dtypes."""


class PreadSlice:
    """One tensor of a safetensors file, read when indexed: ``[...]`` reads it whole, ``[a:b]`` / ``[i]`` (first
    dimension, step 1) read only those rows, any further indices apply to the rows read. The same
    ``get_shape()``/``get_dtype()`` as safetensors' slices, so transformers' loading accepts it in a ``state_dict``."""

    def __init__(self, path: str, dtype: str, shape: list[int], offset: int, nbytes: int):
        """``offset``: where the tensor's bytes start in the file; ``nbytes``: how many there are."""
        if dtype not in DTYPES:
            raise ValueError(f"{path}: unsupported safetensors dtype {dtype!r}; supported: {', '.join(DTYPES)}")
        self.path, self.dtype, self.shape, self.offset, self.nbytes = path, dtype, list(shape), offset, nbytes

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return self.dtype

    def __getitem__(self, key) -> torch.Tensor:
        key = key if isinstance(key, tuple) else (key,)
        if not self.shape:
            return self._read_scalar()[key]
        first, rest = (key[0], key[1:]) if key else (Ellipsis, ())
        if isinstance(first, int):
            row = first + self.shape[0] if first < 0 else first
            if not 0 <= row < self.shape[0]:
                raise IndexError(f"index {first} is out of bounds for dimension 0 with size {self.shape[0]}")
            return self._read_rows(row, row + 1)[0][rest]
        if isinstance(first, slice) and first.step in (None, 1):
            start, stop, _ = first.indices(self.shape[0])
            return self._read_rows(start, max(start, stop))[(slice(None), *rest)]
        return self._read_rows(0, self.shape[0])[key]  # ``...`` and any other index: the whole tensor, indexed

    def _read_scalar(self) -> torch.Tensor:
        out = torch.empty((), dtype=DTYPES[self.dtype])
        self._pread(out, 0)  # a 0-d tensor reads as one element
        return out

    def _read_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` as a tensor of their own (``[stop - start, *shape[1:]]``)."""
        out = torch.empty((stop - start, *self.shape[1:]), dtype=DTYPES[self.dtype])
        row_bytes = math.prod(self.shape[1:]) * out.element_size()
        self._pread(out, start * row_bytes)
        return out

    def _pread(self, out: torch.Tensor, start: int) -> None:
        """Fill the contiguous ``out`` with the tensor's bytes from its byte ``start`` on."""
        view = memoryview(out.view(-1).view(torch.uint8).numpy())
        if start + len(view) > self.nbytes:
            raise ValueError(f"{self.path}: tensor data ends before byte {start + len(view)} (corrupt file?)")
        fd = os.open(self.path, os.O_RDONLY)
        try:
            done = 0
            while done < len(view):  # pread may return fewer bytes than asked (e.g. above 2 GB)
                n = os.preadv(fd, [view[done:]], self.offset + start + done)
                if n == 0:
                    raise ValueError(f"{self.path}: file ends before its tensor data does (truncated?)")
                done += n
        finally:
            os.close(fd)


def read_safetensors(path: str | os.PathLike) -> dict[str, PreadSlice]:
    """``{name: PreadSlice}`` of one safetensors file (its header read now, no tensor data; a tensor the file was cut
    short in fails when read); ``ValueError`` naming the file for a header cut short or not safetensors."""
    path = str(Path(path))
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        if length is None or length > size - 8:  # cut short: reading it would ask for up to 2^64 bytes
            raise ValueError(f"{path}: not a safetensors file (cut short: {size} bytes, its header says more)")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a safetensors file (its header is not JSON: {e})") from e
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file (its header is no JSON object)")
    slices = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            dtype, shape = info["dtype"], list(info["shape"])
        except (TypeError, KeyError, ValueError):
            raise ValueError(f"{path}: not a safetensors file (tensor {name!r}: {info!r:.80})") from None
        if not 0 <= begin <= end:
            raise ValueError(f"{path}: not a safetensors file (tensor {name!r}: data_offsets {begin}, {end})")
        slices[name] = PreadSlice(path, dtype, shape, 8 + length + begin, end - begin)
    return slices
