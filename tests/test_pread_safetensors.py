"""The pread reader of safetensors files against safetensors' own reader: same tensors, same slices, and only the
bytes asked for read (a file cut right after them still serves them)."""

import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hf_lowprec.pread_safetensors import read_safetensors

TENSORS = {
    "bf16": torch.randn(7, 5).to(torch.bfloat16),
    "f32": torch.randn(3, 4, 2),
    "f16": torch.randn(6).half(),
    "i8": torch.randint(-128, 127, (4, 3), dtype=torch.int8),
    "u8": torch.randint(0, 255, (2, 9), dtype=torch.uint8),
    "i64": torch.arange(10).reshape(5, 2),
    "bool": torch.rand(3, 3) > 0.5,
    "e4m3": torch.randn(4, 4).to(torch.float8_e4m3fn),
    "scalar": torch.tensor(3.5),
    "empty": torch.zeros(0, 4),
}


@pytest.fixture()
def file(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(TENSORS, str(path), metadata={"format": "pt"})
    return path


def test_every_tensor_reads_as_safetensors_reads_it(file):
    ours = read_safetensors(file)
    with safe_open(str(file), framework="pt") as theirs:
        assert sorted(ours) == sorted(theirs.keys())
        for name in theirs.keys():
            expected, got = theirs.get_tensor(name), ours[name][...]
            assert got.dtype == expected.dtype and got.shape == expected.shape, name
            assert torch.equal(got.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)), name  # bits
            assert ours[name].get_shape() == theirs.get_slice(name).get_shape()
            assert ours[name].get_dtype() == theirs.get_slice(name).get_dtype()


INDICES = [slice(2, 5), slice(-3, None), slice(4, 2), 0, -1, 6, (slice(1, 3), slice(2, 4)), (3, 1), slice(0, 7, 2)]


@pytest.mark.parametrize("index", INDICES)
def test_slices_match_the_whole_tensors(file, index):
    tensor = read_safetensors(file)["bf16"]
    assert torch.equal(tensor[index], TENSORS["bf16"][index])


def test_out_of_range_row_raises_index_error(file):
    with pytest.raises(IndexError, match="out of bounds"):
        read_safetensors(file)["bf16"][7]


def test_rows_read_only_their_bytes(file, tmp_path):
    """A copy of the file cut right after rows 0-1 of the last tensor in it still serves those rows; the whole
    tensor then reports the file as truncated."""
    ours = read_safetensors(file)
    last = max(ours.values(), key=lambda t: t.offset)
    name = next(k for k, v in ours.items() if v is last)
    row_bytes = last.nbytes // last.shape[0]
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(file.read_bytes()[: last.offset + 2 * row_bytes])
    tensor = read_safetensors(cut)[name]
    assert torch.equal(tensor[0:2].view(torch.uint8), TENSORS[name][0:2].view(torch.uint8))
    with pytest.raises(ValueError, match="truncated"):
        tensor[...]


@pytest.mark.parametrize(
    "content, why",
    [
        ((16).to_bytes(8, "little") + b"not json at all!", "its header is not JSON"),
        (b"12345", "cut short: 5 bytes"),  # it failed on "unpack requires a buffer of 8 bytes", naming no file
        ((1 << 62).to_bytes(8, "little") + b"{}", "cut short: 10 bytes"),  # it asked for 2^62 bytes: MemoryError
        ((2).to_bytes(8, "little") + b"[]", "its header is no JSON object"),
        ((23).to_bytes(8, "little") + b'{"w": {"dtype": "F32"}}', "tensor 'w': {'dtype': 'F32'}"),
    ],
)
def test_a_file_that_is_not_safetensors_is_one_clear_error(tmp_path, content, why):
    path = tmp_path / "model.safetensors"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=rf"^{path}: not a safetensors file \({re.escape(why)}"):
        read_safetensors(path)
