"""Pages of memory-mapped checkpoints: releasing a consumed weight's pages, and quantize-on-load keeping none of them."""

import mmap
import os
import sys

import pytest
import torch
from conftest import tiny_llama
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from hf_lowprec.checkpoints import load_pretrained
from hf_lowprec.export.hf_quantizer import HfLowprecConfig
from hf_lowprec.file_pages import file_mappings, in_file_mapping, release_file_bytes
from hf_lowprec.pread_safetensors import read_safetensors

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="pages are released on Linux only")


def resident_bytes(path) -> int:
    """Bytes of file ``path`` resident in this process (``/proc/self/smaps``, all its mappings)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's first line
            inside = len(fields) == 6 and fields[5] == os.path.realpath(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


def test_a_released_weight_leaves_resident_memory_and_still_reads_the_same(tmp_path):
    path = tmp_path / "w.safetensors"
    weights = {"a": torch.randn(1024, 1024), "b": torch.randn(3, 5)}  # a: 4 MiB
    save_file(weights, path)
    with safe_open(path, framework="pt", backend="mmap") as f:
        a, b = f.get_slice("a")[...], f.get_slice("b")[...]
        assert in_file_mapping(a, file_mappings())  # a view of the mapped file, no copy
        assert torch.equal(a, weights["a"])  # every page of it read
        held = resident_bytes(path)
        where = read_safetensors(path)["a"]
        released = release_file_bytes(path, where.offset, where.nbytes)
        assert released >= where.nbytes - 2 * mmap.PAGESIZE  # whole pages inside its bytes
        assert resident_bytes(path) <= held - released
        assert torch.equal(a, weights["a"]) and torch.equal(b, weights["b"])  # read again from the file
        assert release_file_bytes(path, where.offset + 1, mmap.PAGESIZE - 1) == 0  # no whole page: nothing
    assert release_file_bytes(tmp_path / "not-mapped", 0, 2**20) == 0


@pytest.mark.parametrize("symlinked", [False, True], ids=["folder", "symlinked-files"])
def test_quantize_on_load_keeps_no_packed_weight_resident(tmp_path, symlinked):
    """``from_pretrained(dense, quantization_config=HfLowprecConfig())`` reads through transformers' memory map: the
    pages of each packed weight leave once it is packed (before: the whole file stayed resident through the load and
    while the dense tensors still lived in the mapping), and the model is the one the pread path loads. Also when the
    folder holds symlinks to the files, as a Hub cache snapshot does (the mapping names the file they point to)."""
    tiny_llama(hidden_size=256, intermediate_size=1024).to(torch.bfloat16).save_pretrained(tmp_path / "files")
    path, folder = tmp_path / "files" / "model.safetensors", tmp_path / "files"
    if symlinked:
        folder = tmp_path / "snapshot"
        folder.mkdir()
        for file in (tmp_path / "files").iterdir():
            (folder / file.name).symlink_to(file)
    packed = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, quantization_config=HfLowprecConfig())
    slices = read_safetensors(path)
    dense = sum(s.nbytes for name, s in slices.items() if "proj" not in name)  # embedding, norms: in use
    packed_bytes = sum(s.nbytes for name, s in slices.items() if "proj" in name)
    assert any(m.path == os.path.realpath(path) for m in file_mappings())  # the dense tensors keep the file mapped
    assert packed_bytes > 2 * dense and resident_bytes(path) <= dense + 16 * mmap.PAGESIZE
    reference, _ = load_pretrained(folder, dtype=torch.bfloat16, quantization_config=HfLowprecConfig())
    expected = reference.state_dict()
    assert packed.state_dict().keys() == expected.keys()
    assert all(torch.equal(packed.state_dict()[k], v) for k, v in expected.items())


def test_quantize_on_load_leaves_the_pages_of_a_model_loaded_before_alone(tmp_path):
    """A dense copy of the same checkpoint loaded earlier (being trained, edited, a teacher) maps the file too, its
    weights views of that mapping: releasing "every mapping of the file" reverted the pages it had written to the
    file's bytes (an edited weight lost three quarters of the edit, silently). Only this load's mappings are released,
    and they still are."""
    tiny_llama(hidden_size=256, intermediate_size=1024).save_pretrained(tmp_path)  # fp32, loaded as views of the map
    dense = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    weight = dense.model.layers[0].self_attn.q_proj.weight
    assert in_file_mapping(weight, file_mappings())
    with torch.no_grad():
        weight.add_(1.0)  # an optimizer step's worth of writes: pages copied on write
    edited = weight.detach().clone()
    earlier = set(file_mappings())
    packed = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, quantization_config=HfLowprecConfig())
    assert torch.equal(weight, edited)
    quantizer = packed.hf_quantizer
    assert quantizer.checkpoint_mappings() and not set(quantizer.checkpoint_mappings()) & earlier  # its own, released
