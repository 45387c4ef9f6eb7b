"""Format numerics against analytic bounds and independent references."""

import re

import bitsandbytes.functional as bnbf
import pytest
import torch

from hf_lowprec.formats import (
    E4M3,
    E5M2,
    FP8_MAX,
    NF4_LEVELS,
    FormatSpec,
    dequantize_int,
    dequantize_nf4,
    fp8_amax,
    fp8_relative_ulp,
    fp8_saturate,
    fp8_scale,
    int_steps,
    pack_int4,
    quantize_fp8,
    quantize_int,
    quantize_nf4,
    unpack_int4,
)

MIN_NORMAL = {E4M3: 2.0**-6, E5M2: 2.0**-14}


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_fp8_relative_error_within_half_ulp(dtype):
    g = torch.Generator().manual_seed(0)
    lo, hi = torch.log2(torch.tensor(MIN_NORMAL[dtype])), torch.log2(torch.tensor(FP8_MAX[dtype]))
    x = torch.exp2(lo + (hi - lo) * torch.rand(100_000, generator=g, dtype=torch.float64)).float()
    x = x * torch.where(torch.rand(x.shape, generator=g) < 0.5, -1.0, 1.0)
    rel = ((fp8_saturate(x, dtype).float() - x).abs() / x.abs()).max().item()
    assert rel <= fp8_relative_ulp(dtype)
    assert rel > fp8_relative_ulp(dtype) / 2  # the bound is tight: the format really rounds


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_fp8_saturates_instead_of_overflowing(dtype):
    big = torch.tensor([1e9, -1e9, float("inf"), -float("inf"), FP8_MAX[dtype] * 1.01])
    out = fp8_saturate(big, dtype).float()
    assert torch.isfinite(out).all()
    assert out.tolist() == [FP8_MAX[dtype], -FP8_MAX[dtype], FP8_MAX[dtype], -FP8_MAX[dtype], FP8_MAX[dtype]]


def test_fp8_scale_maps_amax_to_format_max():
    x = torch.randn(64, 96) * 3
    scale = fp8_scale(fp8_amax(x, "tensor"), E4M3)
    q = quantize_fp8(x, scale, E4M3).float()
    assert q.abs().max().item() == FP8_MAX[E4M3]


def test_blockwise_amax_is_computed_per_block():
    x = torch.randn(300, 260)
    for block in [(128, 128), (1, 128)]:
        amax = fp8_amax(x, "block", block=block)
        br, bc = block
        assert amax.shape == (-(-300 // br), -(-260 // bc))
        for i in range(amax.shape[0]):
            for j in range(0, amax.shape[1]):
                ref = x[i * br : (i + 1) * br, j * bc : (j + 1) * bc].abs().max()
                assert amax[i, j] == ref


def test_rowwise_amax_along_either_axis():
    x = torch.randn(5, 7)
    assert torch.equal(fp8_amax(x, "row", dim=-1).squeeze(1), x.abs().amax(1))
    assert torch.equal(fp8_amax(x, "row", dim=0).squeeze(0), x.abs().amax(0))


@pytest.mark.parametrize("name,cols", [("int4-g64", 704), ("int4-g128", 704), ("int4-g64-asym", 576), ("int4", 576), ("int8", 100)])
def test_int_codes_in_range_and_error_within_half_step(name, cols):
    spec = FormatSpec.parse(name)
    w = torch.randn(32, cols) * torch.linspace(0.1, 3, cols)
    step, zero = int_steps(w, spec)
    codes = quantize_int(w, spec, step, zero)
    qmin, qmax = spec.qrange
    assert codes.shape == w.shape
    assert codes.min() >= qmin and codes.max() <= qmax
    deq = dequantize_int(codes, spec, step, zero)
    g = spec.group_size or cols
    step_full = step.repeat_interleave(g, dim=1)[:, :cols]
    assert ((deq - w).abs() <= step_full / 2 + 1e-6).all()


def test_int4_symmetric_uses_full_negative_range_only_when_needed():
    spec = FormatSpec.parse("int4-g64")
    assert spec.qrange == (-8, 7)
    assert FormatSpec.parse("int4-g64-asym").qrange == (0, 15)


def test_nf4_levels_equal_published_values():
    published = bnbf.get_4bit_type("nf4", device="cpu")  # bitsandbytes' table, an independent copy
    assert torch.allclose(NF4_LEVELS, published.float(), atol=1e-7)


def test_nf4_picks_the_nearest_level():
    w = torch.randn(16, 200)
    idx, absmax = quantize_nf4(w, 64)
    normed = torch.nn.functional.pad(w, (0, 56)).reshape(16, -1, 64) / absmax.unsqueeze(-1)
    brute = (normed.unsqueeze(-1) - NF4_LEVELS).abs().argmin(-1).reshape(16, -1)[:, :200]
    assert torch.equal(idx.long(), brute)
    deq = dequantize_nf4(idx, absmax, 64)
    assert deq.shape == w.shape


@pytest.mark.parametrize("cols", [1, 7, 64, 577])
@pytest.mark.parametrize("signed", [True, False])
def test_packed_int4_round_trips_exactly(cols, signed):
    lo, hi = (-8, 8) if signed else (0, 16)
    codes = torch.randint(lo, hi, (9, cols), dtype=torch.int8)
    packed = pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (9, (cols + 1) // 2)
    assert torch.equal(unpack_int4(packed, cols, signed=signed), codes)


@pytest.mark.parametrize(
    "name,canonical",
    [("fp8", "fp8"), ("fp8-tensorwise", "fp8"), ("FP8-rowwise", "fp8-rowwise"), ("fp8-block", "fp8-block"),
     ("int4-g64", "int4-g64"), ("int4-g128-asym", "int4-g128-asym"), ("nf4", "nf4-g64"), ("nf4-g64", "nf4-g64"),
     ("int8", "int8"), ("bf16", "bf16"), ("int4-g32-a8", "int4-g32-a8")],
)  # fmt: skip
def test_format_names_parse_to_canonical(name, canonical):
    spec = FormatSpec.parse(name)
    assert spec.name == canonical
    assert FormatSpec.parse(spec.name) == spec


@pytest.mark.parametrize("bad", ["int3", "fp8-g64", "bf16-asym", "nf4-asym", "int4-g3", "fp9", ""])
def test_unknown_format_names_raise_one_line_value_error(bad):
    with pytest.raises(ValueError) as e:
        FormatSpec.parse(bad)
    assert "\n" not in str(e.value)
    assert repr(bad) in str(e.value) or "group size" in str(e.value)


def test_the_unknown_format_error_offers_only_names_that_parse():
    """Every name the error lists or gives as an example of a combination is a format."""
    with pytest.raises(ValueError) as e:
        FormatSpec.parse("fp7")
    offered = re.findall(r"\b(?:fp|bf|int|nf)\d+(?:-[a-z0-9]+)*", str(e.value).split("; ", 1)[1])
    assert {"fp8-mx-rht", "int4-g128-asym", "fp8-sq", "int4-g64-a8-sq"} <= set(offered)
    assert all(FormatSpec.parse(name).name == name for name in offered), offered


@pytest.mark.parametrize("fmt, columns", [("int4-g64", 2), ("int4-g64", 48), ("int4-g64-asym", 100), ("int4-g32", 4096)])
def test_bytes_per_param_counts_the_scales_a_layer_stores_padded_last_group_included(fmt, columns):
    """Bytes per weight as plans count them: the codes and a bf16 step (and zero point) for every group of a row, as a
    frozen base keeps them (compact_steps), a row's last partial group too (two columns under g64 hold a whole group's
    step: 1.5 B a weight, not 0.53)."""
    from hf_lowprec.modules import Int4Linear

    layer = Int4Linear.from_linear(torch.nn.Linear(columns, 8, bias=False), FormatSpec.parse(fmt))
    stored = layer.weight.numel() * FormatSpec.parse(fmt).bits / 8
    stored += sum(p.numel() * 2 for n, p in layer.named_parameters() if n != "weight")  # bf16 steps/zeros
    stored += sum(b.numel() * 2 for n, b in layer.named_buffers() if "zero" in n)
    assert FormatSpec.parse(fmt).bytes_per_param(columns) * layer.weight.numel() == pytest.approx(stored)
