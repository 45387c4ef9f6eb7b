"""The AMX tile kernels of the int8 backend (``modules/kernels/amx.py``) give the bits of its ``torch._int_mm`` path:
both sum the same int8 products exactly in int32 and dequantize them with the same fp32 operations."""

import pytest
import torch
from conftest import needs_cpp

import hf_lowprec.modules.packed as packed_module
from hf_lowprec.modules import Int4Linear
from hf_lowprec.modules.kernels.cpp import cpu_kernels
from hf_lowprec.modules.kernels.cpu import cpu_info


def packed(spec: str, k: int, n: int, seed: int = 0):
    torch.manual_seed(seed)
    return Int4Linear.from_linear(torch.nn.Linear(k, n, bias=True), spec, learn_scales=False).freeze()


def _amx_runs() -> bool:
    return cpu_info().has("amx_int8") and cpu_kernels() is not None and cpu_kernels().amx_ready()


needs_amx = pytest.mark.skipif(not _amx_runs(), reason="no AMX-INT8 here (or the OS does not grant its tile state)")


def both_paths(layer, x: torch.Tensor, g: torch.Tensor, monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(output, grad-input)`` of the int8 backend through the AMX kernels, then through ``torch._int_mm``."""
    layer.backend = "int8"
    results = []
    for use_amx in (True, False):
        monkeypatch.setattr(packed_module, "USE_AMX", use_amx)
        assert (packed_module.amx_kernels(layer) is not None) == use_amx
        xi = x.detach().clone().requires_grad_()
        y = layer(xi)
        y.backward(g)
        results.append((y.detach(), xi.grad))
    return results


@needs_amx
@pytest.mark.parametrize("spec", ["int4-g64-asym", "int4-g32", "int4-g128-asym", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 45, 64])  # one token; rows padded to tiles of 32; whole tiles
def test_amx_kernels_give_the_int_mm_paths_bits(spec, dtype, rows, monkeypatch):
    layer = packed(spec, k=256, n=192).to(dtype)
    x, g = torch.randn(rows, 256, dtype=dtype), torch.randn(rows, 192, dtype=dtype)
    x[:, :4] *= 20  # outlier channels: multiplied apart, their weight columns read from the packed codes
    (y, gx), (y_ref, gx_ref) = both_paths(layer, x, g, monkeypatch)
    assert torch.equal(y, y_ref) and torch.equal(gx, gx_ref)


@needs_amx
@pytest.mark.parametrize("spec", ["int4-g64-asym-sq", "int4-g64-asym"])
def test_amx_kernels_with_input_scales_and_learned_steps(spec, monkeypatch):
    """Smoothing's input scales (a column step of the grad-input) and learned steps (ratios made per call)."""
    layer = packed(spec, k=128, n=64)
    if spec.endswith("-sq"):
        layer.input_scale.copy_(torch.exp2(torch.randint(-1, 2, (128,)).float()))
    else:
        layer.learn_steps()
        with torch.no_grad():
            layer.step_gain.uniform_(0.9, 1.1)
            layer.zero_shift.uniform_(-0.5, 0.5)
    x, g = torch.randn(3, 11, 128), torch.randn(3, 11, 64)
    (y, gx), (y_ref, gx_ref) = both_paths(layer, x, g, monkeypatch)
    assert torch.equal(y, y_ref) and torch.equal(gx, gx_ref)


@needs_amx
def test_amx_grad_input_sums_weight_rows_in_blocks(monkeypatch):
    """More than 2048 output features: the grad-input's weight rows are unpacked 2048 at a time, the int32 sums
    carried over in memory between blocks."""
    layer = packed("int4-g64-asym", k=64, n=2048 + 128).to(torch.bfloat16)
    x, g = torch.randn(40, 64, dtype=torch.bfloat16), torch.randn(40, 2048 + 128, dtype=torch.bfloat16)
    (y, gx), (y_ref, gx_ref) = both_paths(layer, x, g, monkeypatch)
    assert torch.equal(y, y_ref) and torch.equal(gx, gx_ref)


@needs_amx
def test_shapes_the_amx_kernels_cannot_tile_keep_int_mm():
    untileable = (packed("int4-g64-asym", 192, 96), packed("int4-g64-asym", 96, 128), packed("int4-g16", 128, 64))
    assert all(packed_module.amx_kernels(layer) is None for layer in untileable)
    assert packed_module.amx_kernels(packed("int4-g64-asym", k=192, n=128)) is not None


@needs_cpp
@pytest.mark.parametrize("spec", ["int4-g64-asym", "int4-g32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_columns_read_from_the_codes_are_the_unpacked_weights_columns(spec, dtype):
    layer = packed(spec, k=192, n=100)
    w8, row_step = layer.int8_weight()
    columns = torch.tensor([191, 0, 64, 7, 64, 33])
    expected = packed_module.weight_columns(w8, columns, row_step, dtype)
    assert torch.equal(layer.int8_columns(columns, row_step, dtype), expected)
    with pytest.raises(RuntimeError, match="column out of range"):
        layer.int8_columns(torch.tensor([192]), row_step, dtype)


@pytest.mark.slow
@needs_cpp
def test_the_kernels_build_for_an_avx2_cpu_without_the_amx_ones(tmp_path):
    """A machine this suite develops on may have AMX; CI's may be AVX2 only. The same source compiled for an AVX2
    target (Haswell) must build, and its AMX functions must say they cannot run (~30 s of compiling)."""
    from torch.utils.cpp_extension import load_inline

    from hf_lowprec.modules.kernels import cpp

    flags = ["-march=haswell" if flag == "-march=native" else flag for flag in cpp._CFLAGS]
    haswell = load_inline(
        "hf_lowprec_haswell_build_check",
        cpp_sources=cpp._SOURCE,
        functions=cpp._FUNCTIONS,
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        build_directory=str(tmp_path),
    )
    assert haswell.amx_ready() is False
