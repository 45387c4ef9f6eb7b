"""The int8 backend's tile kernels give the bits of its ``torch._int_mm`` path: the AMX ones (``kernels/amx.py``) and
the AVX2 ones (``kernels/avx2_int8.py``, which run on every CPU the C++ kernels build on, so are tested everywhere)
sum the int8 products exactly in int32 and dequantize them with the same fp32 operations."""

import pytest
import torch
from conftest import exact_int_mm, needs_cpp

import hf_lowprec.modules.packed as packed_module
from hf_lowprec.modules import Int4Linear
from hf_lowprec.modules.kernels.cpp import cpu_kernels
from hf_lowprec.modules.kernels.cpu import CpuInfo, cpu_info

AVX2_ONLY = CpuInfo("an AVX2 CPU", "x86_64", ("avx2", "fma"), "AVX2")


def packed(spec: str, k: int, n: int, seed: int = 0):
    torch.manual_seed(seed)
    return Int4Linear.from_linear(torch.nn.Linear(k, n, bias=True), spec, learn_scales=False).freeze()


def _amx_runs() -> bool:
    return cpu_info().has("amx_int8") and cpu_kernels() is not None and cpu_kernels().amx_ready()


needs_amx = pytest.mark.skipif(not _amx_runs(), reason="no AMX-INT8 here (or the OS does not grant its tile state)")
FAMILIES = [pytest.param("amx", marks=needs_amx), pytest.param("avx2", marks=needs_cpp)]


def tile_kernels(family: str):
    ext = cpu_kernels()
    if family == "amx":
        return ext.amx_linear, ext.amx_linear_grad_input
    return ext.avx2_int8_linear, ext.avx2_int8_linear_grad_input


def both_paths(layer, x: torch.Tensor, g: torch.Tensor, family: str, monkeypatch) -> list[tuple[torch.Tensor, ...]]:
    """``(output, grad-input)`` of the int8 backend through ``family``'s tile kernels, then through its
    ``torch._int_mm`` path with the products summed exactly (``exact_int_mm``): oneDNN's own AVX2 int8 GEMM saturates
    16-bit pair sums (under ``ONEDNN_MAX_CPU_ISA=AVX2`` on an AMX Xeon a 256-long sum came out 89,628 off)."""
    layer.backend = "int8"
    monkeypatch.setattr(packed_module, "int8_backend_available", lambda *a: (True, "forced by the test"))
    monkeypatch.setattr(torch, "_int_mm", exact_int_mm)
    results = []
    for kernels in (tile_kernels(family), None):
        monkeypatch.setattr(packed_module, "int8_tile_kernels", lambda layer, k=kernels: k)
        xi = x.detach().clone().requires_grad_()
        y = layer(xi)
        y.backward(g)
        results.append((y.detach(), xi.grad))
    return results


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("spec", ["int4-g64-asym", "int4-g32", "int4-g128-asym", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 45, 64])  # one token; rows not a multiple of the register or tile blocks; whole
def test_tile_kernels_give_the_int_mm_paths_bits(family, spec, dtype, rows, monkeypatch):
    layer = packed(spec, k=256, n=192).to(dtype)
    x, g = torch.randn(rows, 256, dtype=dtype), torch.randn(rows, 192, dtype=dtype)
    x[:, :4] *= 20  # outlier channels: multiplied apart, their weight columns read from the packed codes
    (y, gx), (y_ref, gx_ref) = both_paths(layer, x, g, family, monkeypatch)
    assert torch.equal(y, y_ref) and torch.equal(gx, gx_ref)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("spec", ["int4-g64-asym-sq", "int4-g64-asym"])
def test_tile_kernels_with_input_scales_and_learned_steps(family, spec, monkeypatch):
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
    (y, gx), (y_ref, gx_ref) = both_paths(layer, x, g, family, monkeypatch)
    assert torch.equal(y, y_ref) and torch.equal(gx, gx_ref)


@pytest.mark.parametrize("family", FAMILIES)
def test_tile_kernels_sum_the_reduction_in_blocks(family, monkeypatch):
    """More than 2048 output features (AMX: weight rows unpacked 2048 at a time in the grad-input) and more than 512
    input features (AVX2: panels of 512 codes in the forward, 512 rows in the grad-input), the int32 sums carried
    over in memory between blocks; AVX2 also with a last block of 32 input and 16 output features."""
    k, n = (64, 2048 + 128) if family == "amx" else (1024 + 96, 512 + 16 + 64)
    layer = packed("int4-g32", k=k, n=n).to(torch.bfloat16)
    x, g = torch.randn(40, k, dtype=torch.bfloat16), torch.randn(40, n, dtype=torch.bfloat16)
    (y, gx), (y_ref, gx_ref) = both_paths(layer, x, g, family, monkeypatch)
    assert torch.equal(y, y_ref) and torch.equal(gx, gx_ref)


@needs_amx
def test_shapes_the_amx_kernels_cannot_tile_keep_int_mm():
    untileable = (packed("int4-g64-asym", 192, 96), packed("int4-g64-asym", 96, 128), packed("int4-g16", 128, 64))
    assert all(packed_module.int8_tile_kernels(layer) is None for layer in untileable)
    assert packed_module.int8_tile_kernels(packed("int4-g64-asym", k=192, n=128))[0] == cpu_kernels().amx_linear


@needs_cpp
def test_an_avx2_cpu_runs_the_int8_backend_where_its_kernels_tile_the_shape(monkeypatch):
    """Without int8 dot products ``torch._int_mm`` is emulated (35x slower than fp32): the int8 backend runs only
    through the AVX2 kernels, so only on the shapes they take, and says so for the others."""
    monkeypatch.setattr(packed_module, "cpu_info", lambda: AVX2_ONLY)
    tileable = packed("int4-g64-asym", k=128, n=48)
    assert tileable.runnable_backends(torch.zeros(2, 128)).get("int8", "").startswith("AVX2 int8 kernels")
    assert packed_module.int8_tile_kernels(tileable)[0] == cpu_kernels().avx2_int8_linear
    for k, n, spec in ((96, 40, "int4-g32"), (80, 48, "int8"), (128, 48, "int4-g16")):
        layer = packed(spec, k=k, n=n)
        assert packed_module.int8_tile_kernels(layer) is None
        assert "int8" not in layer.runnable_backends(torch.zeros(2, k))
        layer.backend = "int8"
        with pytest.raises(ValueError, match="no int8 dot-product instructions .* AVX2 int8 kernels need"):
            layer(torch.zeros(2, k))


@needs_cpp
@pytest.mark.parametrize("spec", ["int4-g64-asym", "int4-g32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_columns_read_from_the_codes_are_the_unpacked_weights_columns(spec, dtype):
    layer = packed(spec, k=192, n=100)
    w8, row_step = layer.int8_weight()
    columns = torch.tensor([191, 0, 64, 7, 64, 33])
    expected = packed_module.weight_columns(w8, columns, row_step, dtype)
    assert torch.equal(layer.int8_columns(columns, layer.tile_operands(), dtype), expected)
    with pytest.raises(RuntimeError, match="column out of range"):
        layer.int8_columns(torch.tensor([192]), layer.tile_operands(), dtype)


@pytest.mark.slow
@needs_cpp
def test_the_kernels_build_for_an_avx2_cpu_without_the_amx_ones(tmp_path):
    """A machine this suite develops on may have AMX; CI's may be AVX2 only. The same source compiled for an AVX2
    target (Haswell) must build, and its AMX functions must say they cannot run (~30 s of compiling)."""
    from torch.utils.cpp_extension import load_inline

    from hf_lowprec.modules.kernels import cpp

    flags = cpp._CFLAGS + ["-march=haswell"]
    haswell = load_inline(
        "hf_lowprec_haswell_build_check",
        cpp_sources=cpp._SOURCE,
        functions=cpp._FUNCTIONS,
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        build_directory=str(tmp_path),
    )
    assert haswell.amx_ready() is False
    layer = packed("int4-g64-asym", k=128, n=64)  # and its AVX2 int8 kernels give the native build's bits
    xq, x_step = packed_module.quantize_rows(torch.randn(5, 128))
    outputs = []
    weight, ratio, zero, row_step = layer.tile_operands()
    for ext in (haswell, cpu_kernels()):
        outputs.append(torch.empty(5, 64))
        ext.avx2_int8_linear(xq, x_step.view(-1), weight, ratio, zero, False, row_step, outputs[-1])
    assert torch.equal(*outputs)
