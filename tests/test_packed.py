"""PackedInt4Linear and PackedInt8Linear: both backends against a dequantized fp32 reference, backend choice,
re-quantization."""

import logging
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from conftest import exact_int_mm, needs_cpp

from hf_lowprec.formats import pack_int4, unpack_int4_planes
from hf_lowprec.modules import Int4Linear, PackedInt4Linear, PackedInt8Linear, PackedLinear
from hf_lowprec.modules.kernels import autotune
from hf_lowprec.modules.kernels.cpp import cpu_kernels
from hf_lowprec.modules.kernels.cpu import cpu_info
from hf_lowprec.modules.packed import compact_steps, int8_backend_available, packed_class
from hf_lowprec.modules.packed_embedding import PackedEmbedding

INT8_OK, _ = int8_backend_available(torch.device("cpu"))
needs_int8 = pytest.mark.skipif(not INT8_OK, reason="this CPU has no int8 dot-product instructions")
BACKENDS_HERE = ("tiled", "int8") if INT8_OK else ("tiled",)


def packed(spec: str, k: int = 128, n: int = 96, bias: bool = True, seed: int = 0) -> PackedLinear:
    torch.manual_seed(seed)
    return Int4Linear.from_linear(torch.nn.Linear(k, n, bias=bias), spec, learn_scales=False).freeze()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def run(layer: PackedLinear, backend: str, x: torch.Tensor, g: torch.Tensor):
    layer.backend = backend
    x = x.detach().clone().requires_grad_()
    y = layer(x)
    y.backward(g)
    return y.detach(), x.grad


def reference(layer: PackedLinear, x: torch.Tensor, g: torch.Tensor):
    """fp32 math on the dequantized weight: the numbers the packed codes stand for."""
    x = x.detach().float().requires_grad_()
    bias = None if layer.bias is None else layer.bias.detach().float()
    y = F.linear(x, layer.dequantized_weight(torch.float32), bias)
    y.backward(g.float())
    return y.detach(), x.grad


def test_unpack_int4_planes_splits_columns_by_parity():
    signed = torch.randint(-8, 8, (5, 10), dtype=torch.int8)
    even, odd = unpack_int4_planes(pack_int4(signed), signed=True)
    assert torch.equal(even, signed[:, 0::2]) and torch.equal(odd, signed[:, 1::2])
    unsigned = torch.randint(0, 16, (5, 10), dtype=torch.uint8)
    even, odd = unpack_int4_planes(pack_int4(unsigned), signed=False)
    assert torch.equal(even, unsigned[:, 0::2].to(torch.int8)) and torch.equal(odd, unsigned[:, 1::2].to(torch.int8))


@pytest.mark.parametrize("spec", ["int4-g64", "int4-g32-asym", "int4", "int8"])
def test_dequant_backend_is_exact_in_fp32(spec):
    layer = packed(spec)
    x, g = torch.randn(3, 5, 128), torch.randn(3, 5, 96)
    y, gx = run(layer, "dequant", x, g)
    y_ref, gx_ref = reference(layer, x, g)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-5, atol=1e-5)


@needs_int8
@pytest.mark.parametrize("spec", ["int4-g64", "int4-g32-asym", "int4", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_backend_forward_and_grad_input_match_reference(spec, dtype):
    layer = packed(spec).to(dtype)
    x, g = torch.randn(4, 33, 128, dtype=dtype), torch.randn(4, 33, 96, dtype=dtype)
    y, gx = run(layer, "int8", x, g)
    assert layer.last_backend == "int8" and y.dtype == dtype and gx.dtype == dtype
    y_ref, gx_ref = reference(layer, x, g)
    # int8 activations/gradients per row and an int8 weight per row: ~0.8% relative error on Gaussian data
    assert rel(y, y_ref) < 0.02
    assert rel(gx, gx_ref) < 0.02
    # the error is rounding, not a wrong formula: it is far below what a missing term would give
    assert rel(gx, gx_ref) < 0.1 * rel(torch.zeros_like(gx_ref), gx_ref)


@needs_int8
@pytest.mark.parametrize("backend", ["int8", "auto"])
def test_int8_backend_runs_under_inference_mode(backend, tmp_path, monkeypatch):
    """Inference tensors have no version counter, which keys the int8 rows kept for layers sharing an input: under
    ``torch.inference_mode()`` nothing is kept and the forward matches the reference (it raised before, ``auto``
    too, whose first timing ran int8)."""
    monkeypatch.setenv("HF_LOWPREC_CACHE", str(tmp_path))  # empty autotune caches: auto times int8 here
    monkeypatch.setattr(autotune, "_memory", {})
    layer = packed("int4-g64-asym")
    layer.backend = backend
    x = torch.randn(5, 128)
    with torch.inference_mode():
        y = layer(x)
        again = layer(x)  # same input object twice: computed again, not read from a kept entry
    y_ref = F.linear(x, layer.dequantized_weight(torch.float32), layer.bias.detach())
    assert rel(y, y_ref) < 0.02 and torch.equal(y, again)


@needs_cpp
def test_int8_grad_input_keeps_a_nan_gradient_nan():
    """A NaN in an output gradient makes its row of the int8 grad-input NaN, as fp32 math does: the row maximum
    dropped the NaN before and cast its code to 0, a finite gradient hiding the divergence."""
    import hf_lowprec.modules.packed as packed_module

    layer = packed("int4-g64-asym")
    grad_out = torch.randn(3, 96)
    grad_out[1, 5] = float("nan")
    codes, step = packed_module.quantize_rows(grad_out)
    assert step[1].isnan().all() and step[[0, 2]].isfinite().all()
    got = packed_module._int8_grad_input(grad_out, layer)
    expected = grad_out @ layer.dequantized_weight(torch.float32)
    assert torch.equal(got.isfinite(), expected.isfinite()) and not got[1].isfinite().any()
    assert rel(got[[0, 2]], expected[[0, 2]]) < 0.02


def test_int8_layer_with_odd_in_features_runs_without_the_tile_kernels():
    """The C++ tile reader takes codes in pairs: an int8 layer of odd ``in_features`` does not offer ``tiled`` (``auto``
    timed it and failed in C++ with no layer named), and computes the reference on what runs."""
    torch.manual_seed(0)
    layer = PackedInt8Linear.from_weight(torch.randn(64, 129), "int8", dtype=torch.float32)
    x, g = torch.randn(4, 129), torch.randn(4, 64)
    status = layer.backend_status(x)
    assert not status["tiled"][0] and "odd" in status["tiled"][1]
    y, gx = run(layer, "auto", x, g)
    y_ref, gx_ref = reference(layer, x, g)
    assert rel(y, y_ref) < 0.02 and rel(gx, gx_ref) < 0.02


def test_int8_backend_is_not_offered_for_fp16_activations():
    """The int8 tile kernels write bf16 or fp32 outputs: fp16 activations are not offered the int8 backend, as the
    tiled one, and ``auto`` computes the reference in fp16 on what runs."""
    layer = packed("int4-g64-asym").to(torch.float16)
    x, g = torch.randn(4, 128, dtype=torch.float16), torch.randn(4, 96, dtype=torch.float16)
    ok, reason = layer.backend_status(x)["int8"]
    assert not ok and "float16" in reason
    y, gx = run(layer, "auto", x, g)
    y_ref, gx_ref = reference(layer, x, g)
    assert layer.last_backend == "dequant" and rel(y, y_ref) < 0.01 and rel(gx, gx_ref) < 0.01


@needs_int8
def test_int8_forward_in_column_tiles_is_the_whole_product(monkeypatch):
    """Output columns tiled (int32 products held a block at a time) give the same bits as one _int_mm."""
    import hf_lowprec.modules.packed as packed_module

    layer = packed("int8", k=128, n=200).to(torch.bfloat16)
    x = torch.randn(66, 128, dtype=torch.bfloat16)
    monkeypatch.setattr(packed_module, "USE_TILE_KERNELS", False)  # the torch._int_mm path, whatever the CPU
    monkeypatch.setattr(torch, "_int_mm", exact_int_mm)  # exact sums (oneDNN's AVX2 path saturates)
    expected = packed_module._int8_forward(x, layer)
    assert rel(expected, x.float() @ layer.dequantized_weight(torch.float32).t()) < 0.02  # int8 rows: within 2%
    monkeypatch.setattr(packed_module, "INT32_TILE", 66 * 64)  # 64 columns a tile at 66 rows: 4 tiles, the last short
    torch.testing.assert_close(packed_module._int8_forward(x.clone(), layer), expected, rtol=0, atol=0)


def test_int8_grad_input_in_row_tiles_is_the_whole_product(monkeypatch):
    """Rows of the grad-input tiled (int32 products held a block at a time) give the same bits as one _int_mm."""
    import hf_lowprec.modules.packed as packed_module

    layer = packed("int4-g64-asym", k=192, n=40).to(torch.bfloat16)
    grad_out = torch.randn(67, 40, dtype=torch.bfloat16)
    monkeypatch.setattr(torch, "_int_mm", exact_int_mm)  # exact sums wherever the torch path runs
    expected = packed_module._int8_grad_input(grad_out, layer)
    assert rel(expected, reference(layer, torch.zeros(67, 192), grad_out)[1]) < 0.02  # int8 gradients: a few %
    monkeypatch.setattr(packed_module, "INT32_TILE", 192 * 20)  # 20 rows a tile: 4 tiles, the last short
    torch.testing.assert_close(packed_module._int8_grad_input(grad_out, layer), expected, rtol=0, atol=0)


@needs_cpp
@pytest.mark.parametrize("spec", ["int8", "int4-g64-asym"])
def test_a_consumable_gradient_is_quantized_in_place_into_the_same_grad_input(spec):
    """Handed a gradient its caller gives up (``consumable_gradient``: the chunked loss's logits gradient), the int8
    grad-input writes the gradient's int8 codes over it instead of into a new tensor, through autograd's views of
    it: the same bits as from a gradient it must keep."""
    from hf_lowprec.modules.packed import consumable_gradient

    layer = packed(spec, k=192, n=48, bias=False).to(torch.bfloat16)
    layer.backend = "int8"
    x = torch.randn(3, 7, 192, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(3, 7, 48, dtype=torch.bfloat16)
    kept = g.clone()
    (expected,) = torch.autograd.grad(layer(x), x, kept)
    given = g.clone()
    with consumable_gradient(given):
        (got,) = torch.autograd.grad(layer(x), x, given)
    assert torch.equal(got, expected)
    assert torch.equal(kept, g) and not torch.equal(given, g)  # only the consumable one was overwritten


@needs_int8
@pytest.mark.parametrize("spec", ["int4-g32-asym", "int4-g64", "int4"])
def test_int8_weight_unpacked_in_blocks_gives_the_whole_products(monkeypatch, spec):
    """An INT4 weight unpacked a block at a time (rows forward, whole groups of columns for the grad-input, the last
    block short) gives the same bits as the weight unpacked whole, both ways."""
    import hf_lowprec.modules.packed as packed_module

    layer = packed(spec, k=192, n=200).to(torch.bfloat16)
    x, grad_out = torch.randn(66, 192, dtype=torch.bfloat16), torch.randn(66, 200, dtype=torch.bfloat16)
    monkeypatch.setattr(packed_module, "USE_TILE_KERNELS", False)  # the torch._int_mm path, whatever the CPU
    monkeypatch.setattr(torch, "_int_mm", exact_int_mm)  # exact sums (oneDNN's AVX2 path saturates)
    expected = packed_module._int8_forward(x.clone(), layer), packed_module._int8_grad_input(grad_out, layer)
    w = layer.dequantized_weight(torch.float32)
    for got, ref in zip(expected, (x.float() @ w.t(), grad_out.float() @ w)):  # the products alone, no bias
        assert rel(got, ref) < 0.02  # int8 activations and gradients: within 2% of fp32 math
    # 64 weight rows a block forward (200 = 3 x 64 + 8); 64 columns (one or two groups, per-row groups: all 192)
    monkeypatch.setattr(packed_module, "WEIGHT_TILE", 64 * 192)
    assert packed_module._weight_block(layer, 192, 64) == 64
    got = packed_module._int8_forward(x.clone(), layer), packed_module._int8_grad_input(grad_out, layer)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_cpp), False], ids=["C++", "torch"])
def test_int8_weight_blocks_are_slices_of_the_whole(monkeypatch, native):
    """``int8_block`` unpacks exactly that block of the whole int8 weight (C++ kernel and torch ops), into the scratch
    buffer or a tensor of its own; columns that split a group are refused."""
    import hf_lowprec.modules.packed as packed_module

    if not native:
        monkeypatch.setattr(packed_module, "native_kernels", lambda *tensors: None)
    for spec in ("int4-g32-asym", "int4-g64"):
        layer = packed(spec, k=192, n=40)
        whole, _ = layer.int8_weight()
        rows, columns = slice(8, 29), slice(64, 192)
        for scratch_ok in (True, False):
            block = packed_module.int8_block(layer, layer.tile_operands(), rows, columns, scratch_ok)
            assert block.shape == (21, 128) and torch.equal(block, whole[rows, columns])
        with pytest.raises(ValueError, match="split its groups of"):
            packed_module.int8_block(layer, layer.tile_operands(), columns=slice(16, 96))


# only the int8 backend's torch._int_mm path reads the scratch buffers, and torch._int_mm sums exactly only where int8
# dot products exist (oneDNN's AVX2 int8 GEMM saturates 16-bit pair sums: seen with ONEDNN_MAX_CPU_ISA=AVX2)
@pytest.mark.skipif(not cpu_info().int8_dot, reason="torch._int_mm is emulated here (no int8 dot products)")
def test_layers_sharing_the_scratch_buffers_match_their_own_unpacked_weights(monkeypatch):
    """Layers of different shapes unpack into one reused buffer per kind: each forward and grad-input still
    equals the product with its own freshly unpacked int8 weight, computed here with fp32 matmuls."""
    import hf_lowprec.modules.packed as packed_module

    torch.manual_seed(0)
    big, small = packed("int4-g64-asym", k=192, n=96), packed("int4-g32", k=128, n=40)
    big.outlier_columns = small.outlier_columns = 0  # every input channel through the int8 rows
    monkeypatch.setattr(packed_module, "USE_TILE_KERNELS", False)  # torch._int_mm on the unpacked weights
    for layer, k in ((big, 192), (small, 128), (big, 192)):  # big again: its buffer now holds small's codes first
        x = torch.randn(9, k)
        w8, r = layer.int8_weight()  # a tensor of its own
        xq, x_step = packed_module.quantize_rows(x)
        expected = (xq.float() @ w8.float().t()) * x_step * r
        y = packed_module._int8_forward(x, layer)
        torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-6)
        grad_out = torch.randn(9, layer.out_features)
        gq, g_step = packed_module.quantize_rows(grad_out, r)
        torch.testing.assert_close(
            packed_module._int8_grad_input(grad_out, layer), (gq.float() @ w8.float()) * g_step, rtol=1e-6, atol=1e-6
        )
    shared = packed_module.int8_block(big, big.tile_operands())
    again = packed_module.int8_block(small, small.tile_operands())
    assert shared.untyped_storage().data_ptr() == again.untyped_storage().data_ptr()


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_outlier_weight_columns_kernel_is_torchs_gather(dtype):
    """The C++ gather of the outlier channels' weight columns equals torch's ``index_select`` times the row steps,
    rounded once into ``dtype``, bit for bit; a column out of range is refused."""
    import hf_lowprec.modules.packed as packed_module

    w8 = torch.randint(-127, 128, (1000, 192), dtype=torch.int8)
    row_step = torch.rand(1000) / 100
    columns = torch.tensor([191, 0, 64, 7, 64])
    expected = (w8.index_select(1, columns).float() * row_step.unsqueeze(1)).to(dtype)
    assert torch.equal(packed_module.weight_columns(w8, columns, row_step, dtype), expected)
    wide = torch.randint(-127, 128, (1000, 384), dtype=torch.int8)
    wide[:, ::2] = w8  # a strided view: torch's gather
    assert torch.equal(packed_module.weight_columns(wide[:, ::2], columns, row_step, dtype), expected)
    with pytest.raises(RuntimeError, match="column out of range"):
        packed_module.weight_columns(w8, torch.tensor([192]), row_step, dtype)


@needs_int8
def test_int8_weight_reconstructs_dequantized_weight():
    layer = packed("int4-g64-asym", k=192, n=40)
    w8, row_step = layer.int8_weight()
    assert w8.dtype == torch.int8 and w8.shape == (40, 192)
    approx = w8.float() * row_step.unsqueeze(1)
    # one int8 step per row: error at most half of it per element
    assert ((approx - layer.dequantized_weight()).abs() <= row_step.unsqueeze(1) / 2 + 1e-7).all()


@pytest.mark.parametrize("spec", ["int4-g64-asym", "int4-g32", "int8"])
def test_row_maxima_read_in_row_blocks_are_the_whole_grids(spec, monkeypatch):
    """The int8 backend's per-row steps come from the codes a block of rows at a time, not from the whole fp32 grid."""
    import hf_lowprec.modules.packed as packed_module

    layer = packed(spec, k=192, n=40)
    whole = layer.grid_weight().abs().amax(-1)
    monkeypatch.setattr(packed_module, "ROW_MAX_ELEMENTS", 192 * 7)  # 7 rows a block: 6 blocks, the last short
    assert torch.equal(layer._row_absmax(), whole)


def test_row_maxima_of_learning_layers_bound_their_grids_from_group_numbers():
    """Learned steps and zero points: the per-row maxima of the int8 backend come from ``[N, G]`` numbers each call;
    round-to-nearest asymmetric groups hold both code ends, so there they are the grid's own maxima; symmetric ones
    may overstate them by up to 8/7 (their codes rarely reach -8), never understate them."""
    layer = packed("int4-g64-asym", k=192, n=40)
    (shift,) = layer.learn_steps(steps=False)
    with torch.no_grad():
        shift.uniform_(-2.0, 2.0)  # learned zero points well away from the grid's: the bound moves with them
    torch.testing.assert_close(layer._row_absmax(), layer.grid_weight().abs().amax(-1), rtol=1e-6, atol=0)
    symmetric = packed("int4-g32", k=192, n=40)
    (gain,) = symmetric.learn_steps()
    with torch.no_grad():
        gain.uniform_(0.5, 1.5)
    bound, actual = symmetric._row_absmax(), symmetric.grid_weight().abs().amax(-1)
    assert (bound >= actual * (1 - 1e-6)).all() and (bound <= actual * 8 / 7 * (1 + 1e-6)).all()


def test_int8_layer_stores_one_code_per_byte_and_multiplies_them_as_stored():
    torch.manual_seed(0)
    dense = torch.nn.Linear(192, 40)
    layer = Int4Linear.from_linear(dense, "int8", learn_scales=False).freeze()
    assert isinstance(layer, PackedInt8Linear) and layer.qweight.dtype == torch.int8 and layer.qweight.shape == (40, 192)
    step = dense.weight.detach().abs().amax(-1) / 127  # symmetric per-row step, computed here from the dense weight
    torch.testing.assert_close(layer.step.view(-1), step)
    assert ((layer.dequantized_weight() - dense.weight).abs() <= step.unsqueeze(1) / 2 + 1e-7).all()
    w8, row_step = layer.int8_weight()
    assert w8 is layer.qweight and torch.equal(row_step, layer.step.view(-1))  # no re-quantization on the int8 path
    stats = layer.requantize_(dense.weight.detach() * 2)
    assert torch.equal(layer.qweight, w8) and stats["rel_error"] < 0.01  # scaling the weight scales only the steps
    other = PackedInt8Linear(192, 40, "int8", bias=True, dtype=torch.float32)
    other.load_state_dict(layer.state_dict())
    x = torch.randn(5, 192)
    torch.testing.assert_close(other(x), layer(x), rtol=0, atol=0)
    for spec in ("int8-g64", "int8-asym", "int4-g64"):
        with pytest.raises(ValueError, match="PackedInt8Linear stores"):
            PackedInt8Linear(192, 40, spec)


@needs_cpp
@pytest.mark.parametrize("backend", ["tiled", pytest.param("int8", marks=needs_int8)])
def test_the_c_kernels_run_under_inference_mode_on_several_threads(backend):
    """The C++ kernels' parallel bodies run in the caller's InferenceMode: under ``torch.inference_mode()`` on 2
    threads the tiled forward's tiles (torch ops on OpenMP's other threads, outside inference mode) raised "Inplace
    update to inference tensor outside InferenceMode"; an autotuned ``auto`` picks tiled for many shapes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        layer = packed("int4-g32", k=64, n=512)
        layer.backend = backend
        x = torch.randn(3, 64)
        with torch.no_grad():
            expected = layer(x)
        with torch.inference_mode():
            y = layer(x)
    finally:
        torch.set_num_threads(threads)
    assert layer.last_backend == backend and torch.equal(y, expected)


@needs_cpp
def test_the_c_kernels_run_alike_on_every_thread_under_hooks_grad_and_autocast():
    """The C++ kernels' parallel bodies (torch ops on OpenMP's threads) run in the state they need on every thread:
    under Python saved-tensor hooks (``ActivationStorage``) on 2 threads every backend finishes (copying the caller's
    whole thread-local state took the GIL the caller held while waiting: a deadlock); on 8 threads the tiled forward
    and backward of an input that requires grad finish (grad mode on the other threads recorded graphs into one
    output, a race); under autocast every thread's tiles compute as on 1 thread (the caller's ran in bf16, the others
    in fp32). In a process of its own, so that a deadlock fails instead of hanging."""
    script = textwrap.dedent(f"""
        import torch
        from hf_lowprec.modules import Int4Linear
        torch.manual_seed(0)
        layer = Int4Linear.from_linear(torch.nn.Linear(128, 512), "int4-g32", learn_scales=False).freeze()
        torch.set_num_threads(2)
        for backend in {BACKENDS_HERE!r}:
            layer.backend = backend
            x = torch.randn(64, 128, requires_grad=True)
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                layer(x).sum().backward()
            print(backend, layer.last_backend)
        layer.backend = "tiled"
        x, out = torch.randn(64, 128), {{}}
        for threads in (1, 8):
            torch.set_num_threads(threads)
            for _ in range(30):
                layer(x.clone().requires_grad_()).sum().backward()
            with torch.autocast("cpu", torch.bfloat16):
                out[threads] = layer(x)
        print("autocast", torch.equal(out[1], out[8]))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [*(word for b in BACKENDS_HERE for word in (b, b)), "autocast", "True"]


@needs_cpp
@pytest.mark.parametrize("spec", ["int4-g64", "int4-g32-asym", "int4", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tile_elements", [None, 400])
def test_tiled_backend_forward_and_grad_input_match_reference(spec, dtype, tile_elements, monkeypatch):
    if tile_elements is not None:  # tiles capped by their size, as a 128k-vocabulary head's: 2 rows, grad-input included
        monkeypatch.setattr("hf_lowprec.modules.packed.TILE_ELEMENTS", tile_elements)
    layer = packed(spec, k=192, n=200).to(dtype)  # 200 rows: tiles of unequal size
    layer.input_scale.copy_(2.0 ** torch.randint(-2, 3, (192,)).float())
    x, g = torch.randn(3, 11, 192, dtype=dtype), torch.randn(3, 11, 200, dtype=dtype)
    y, gx = run(layer, "tiled", x, g)
    assert layer.last_backend == "tiled" and y.dtype == dtype and gx.dtype == dtype
    y_ref, gx_ref = reference(layer, x, g)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # fp32: the same products summed in another order
    torch.testing.assert_close(y.float(), y_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(gx.float(), gx_ref, rtol=tol, atol=tol)


@pytest.mark.times_kernels
def test_auto_backend_is_a_measured_runnable_one_and_errors_name_the_choices(caplog, monkeypatch):
    monkeypatch.setattr("hf_lowprec.modules.packed._logged", set())  # logged once per process: an earlier test may have
    layer = packed("int4-g64")
    x = torch.zeros(2, 128)
    runnable = layer.runnable_backends(x)
    assert "dequant" in runnable and ("int8" in runnable) == INT8_OK and ("tiled" in runnable) == (cpu_kernels() is not None)
    with caplog.at_level(logging.INFO, logger="hf_lowprec.modules.packed"):
        chosen = layer.resolve_backend(x)
    assert chosen in runnable
    if len(runnable) > 1:  # measured, and the measurement is kept for this machine
        assert "fastest measured here" in caplog.text
        entry = autotune.measured()["packed:PackedInt4Linear:int4-g64:96x128:float32"]
        assert entry["value"] == chosen and set(entry["seconds"]) == set(runnable)
    odd = packed("int4-g64", k=100)  # 100 is not a multiple of the group: only the dequant path can run
    assert odd.resolve_backend(torch.zeros(2, 100)) == "dequant"
    for backend in ("int8", "tiled"):
        odd.backend = backend
        with pytest.raises(ValueError, match="not a multiple of the group size"):
            odd(torch.zeros(2, 100))
    with pytest.raises(ValueError, match="choose one of auto, int8, tiled, dequant"):
        layer.backend = "fast"
    x, g = torch.randn(2, 100), torch.randn(2, 96)
    y, gx = run(odd, "dequant", x, g)
    y_ref, gx_ref = reference(odd, x, g)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-5, atol=1e-5)


def test_requantize_is_idempotent_and_reports_error():
    layer = packed("int4-g64", bias=False)
    codes = layer.codes().clone()
    stats = layer.requantize_(layer.dequantized_weight())
    assert torch.equal(layer.codes(), codes)
    assert stats["rel_error"] < 1e-5
    dense = torch.randn(96, 128)
    stats = layer.requantize_(dense)
    assert 0.01 < stats["rel_error"] < 0.2  # real int4 rounding of a Gaussian matrix (~10%)
    with pytest.raises(ValueError, match="weight shape"):
        layer.requantize_(torch.randn(3, 3))


def test_state_dict_roundtrip_gives_identical_outputs():
    layer = packed("int4-g64")
    other = PackedInt4Linear(128, 96, "int4-g64", bias=True, dtype=torch.float32)
    x = torch.randn(7, 128)
    other(x)  # builds (and must drop) a cache for the empty weights
    other.load_state_dict(layer.state_dict())
    for backend in layer.runnable_backends(x):
        layer.backend = other.backend = backend
        assert torch.equal(layer(x), other(x))


@needs_cpp
# groups of 32 bytes (g64; per row: 96), 16 (g32), 32 + 16 (g96), 16 + an 8-byte tail (g48): each unpacking step
@pytest.mark.parametrize("spec", ["int4-g64", "int4-g32-asym", "int4", "int4-g96", "int4-g48-asym"])
def test_cpu_kernels_match_torch_reference(spec):
    from hf_lowprec.modules import packed as P

    ext = cpu_kernels()
    layer = packed(spec, k=192, n=40)
    ratio, _ = layer._int8_scales()
    zero = None if layer.zero is None else layer.zero.float()
    # unpacking: the int4 codes (unpacked by formats.unpack_int4) rescaled per group, computed in fp32 here
    codes = layer.codes().float()
    group = layer.spec.group_size or 192
    expected = codes.view(40, -1, group)
    if zero is not None:
        expected = expected - zero.unsqueeze(-1)
    expected = torch.round(expected * ratio.unsqueeze(-1)).view(40, 192).to(torch.int8)
    assert torch.equal(ext.unpack_int4_int8(layer.qweight, ratio, zero, layer.spec.symmetric, 192, None), expected)
    into = torch.full((40, 192), 99, dtype=torch.int8)
    written = ext.unpack_int4_int8(layer.qweight, ratio, zero, layer.spec.symmetric, 192, into)
    assert written.data_ptr() == into.data_ptr() and torch.equal(into, expected)
    with pytest.raises(RuntimeError, match="contiguous int8"):
        ext.unpack_int4_int8(layer.qweight, ratio, zero, layer.spec.symmetric, 192, into[:, :96])
    x = torch.randn(33, 192, dtype=torch.bfloat16)
    col = torch.rand(192) + 0.5
    for scale in (None, col):
        q, step = ext.quantize_rows(x, scale, False)
        q_ref, step_ref = P._quantize_rows_torch(x.float() * (1 if scale is None else scale))
        assert (q.int() - q_ref.int()).abs().max() <= 1 and torch.allclose(step, step_ref)
        for xx in (x.clone(), x.float()):  # in place: the codes overwrite the input's first bytes, rows in order
            expected = ext.quantize_rows(xx, scale, False)
            q, step = ext.quantize_rows(xx, scale, True)
            assert q.data_ptr() == xx.data_ptr() and q.shape == xx.shape
            assert torch.equal(q, expected[0]) and torch.equal(step, expected[1])
    for scale in (None, col):
        for xx in (x, x.float()):
            expected = xx.float().abs().amax(0) * (1 if scale is None else scale)
            torch.testing.assert_close(ext.column_absmax(xx, scale), expected, rtol=0, atol=0)
    acc = torch.randint(-30000, 30000, (33, 40), dtype=torch.int32)
    rows, cols = torch.rand(33, 1), torch.rand(40)
    expected = (acc.float() * rows * cols).bfloat16()
    torch.testing.assert_close(ext.dequantize(acc, rows, cols, torch.bfloat16, None), expected, rtol=0, atol=0)
    torch.testing.assert_close(ext.dequantize(acc.to(torch.int8).clamp(-127, 127), rows, None, torch.float32, None),
                               acc.to(torch.int8).clamp(-127, 127).float() * rows)  # fmt: skip
    wide = torch.full((33, 100), 7.0, dtype=torch.bfloat16)  # into a block of a wider output's columns, nothing else
    ext.dequantize(acc, rows, cols, torch.bfloat16, wide[:, 50:90])
    assert torch.equal(wide[:, 50:90], expected) and (wide[:, :50] == 7).all() and (wide[:, 90:] == 7).all()


@needs_int8
def test_layers_fed_one_input_share_its_int8_rows_and_see_changes_to_it():
    from hf_lowprec.modules import packed as P

    a, b = packed("int4-g64", seed=1), packed("int4-g64", seed=2)
    scaled, _, _ = input_scaled("int4-g64")  # its own input scale: rows of x / s, not shareable
    for layer in (a, b, scaled):
        layer.backend = "int8"
    x = torch.randn(3, 11, 128)
    x[..., 5] *= 20
    fresh = [layer(x.clone()) for layer in (a, b, scaled)]  # distinct tensors: nothing to share
    assert [torch.equal(layer(x), f) for layer, f in zip((a, b, scaled), fresh)] == [True, True, True]
    scaled_rows = P._last_rows[0][3]
    b(x)
    rows = P._last_rows[0][3]
    assert rows is not scaled_rows  # the scaled layer quantizes x / s: not b's rows
    a(x)
    assert P._last_rows[0][3] is rows  # the same unchanged input: quantized once
    x.mul_(2)  # in place: the version changes, the rows are recomputed
    y = a(x)
    assert P._last_rows[0][3] is not rows and torch.equal(y, a(x.clone())) and not torch.equal(y, fresh[0])


@needs_int8
@pytest.mark.parametrize("others", [0, 1, 2])
def test_layers_fed_a_refilled_input_buffer_quantize_it_again(others):
    """Writes through ``.data`` or a numpy array leave the tensor's version as it was: the kept rows serve other
    layers (q/k/v), never a layer they served already: one layer twice in a row returned the previous input's output
    (107% off), and so did A after A, B, refill (139% off)."""
    import numpy as np

    layer, *rest = [packed("int4-g64-asym", seed=seed) for seed in range(1 + others)]
    for each in (layer, *rest):
        each.backend = "int8"
    for x in (torch.randn(4, 128), torch.from_numpy(np.random.default_rng(0).standard_normal((4, 128), np.float32))):
        with torch.no_grad():
            for each in (layer, *rest):
                each(x)
            x.data.copy_(torch.randn(4, 128) * 3)
            y = layer(x)
        assert rel(y, layer(x.clone())) == 0 and rel(y, reference(layer, x, torch.ones(4, 96))[0]) < 0.02


@needs_int8
@pytest.mark.parametrize("magnitude", [1e-13, 1e-20])
def test_int8_backend_keeps_tiny_activations_and_gradients(magnitude):
    """A row's int8 step came from a maximum clamped at 1e-12: rows of gradients near 1e-13 (an fp32 model's deep
    layers, times the weight's row step) were 90% wrong, and at 1e-20 all zeros."""
    layer = packed("int4-g64-asym")
    x, g = torch.randn(5, 128) * magnitude, torch.randn(5, 96) * magnitude
    layer.bias = None
    y, gx = run(layer, "int8", x, g)
    y_ref, gx_ref = reference(layer, x, g)
    assert rel(y, y_ref) < 0.02 and rel(gx, gx_ref) < 0.02


def test_a_tied_embedding_passes_the_learned_steps_their_gradient_and_reads_no_ids():
    """Rows an input embedding reads from a head that learns its steps: the forward used the gain and shift, their
    gradient from this use was dropped (the head's optimizer fit them to the head alone)."""
    from hf_lowprec.formats import dequantize_int
    from hf_lowprec.modules.packed_embedding import TiedPackedEmbedding

    head = packed("int4-g32-asym", k=64, n=20)
    embedding = TiedPackedEmbedding(head)
    gain, shift = head.learn_steps()
    with torch.no_grad():
        gain.uniform_(0.5, 1.5), shift.uniform_(-0.5, 0.5)
    ids, weights = torch.tensor([[1, 2], [3, 1]]), torch.randn(2, 2, 64, dtype=torch.float64)
    (embedding(ids).double() * weights).sum().backward()
    g64, s64 = gain.detach().double().requires_grad_(), shift.detach().double().requires_grad_()
    table = dequantize_int(head.codes(), head.spec, head.step.double() * g64, head.zero.double() + s64, torch.float64)
    (table[ids] * weights).sum().backward()
    torch.testing.assert_close(gain.grad.double(), g64.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(shift.grad.double(), s64.grad, rtol=2e-2, atol=1e-3)  # the shift is bf16
    assert embedding(torch.tensor([], dtype=torch.long)).shape == (0, 64)  # as nn.Embedding
    assert embedding(torch.zeros(2, 0, dtype=torch.long)).shape == (2, 0, 64)


def test_a_packed_layer_runs_on_the_meta_device():
    layer = packed("int4-g64").to("meta")
    assert layer(torch.empty(3, 128, device="meta")).shape == (3, 96)


def input_scaled(spec: str, dtype=torch.float32):
    """A layer whose codes encode ``W diag(s)`` (``s`` powers of two): ``(layer, W, independent effective weight)``."""
    from hf_lowprec.formats import FormatSpec, dequantize_int, int_steps, quantize_int

    fmt = FormatSpec.parse(spec)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(96, 128, generator=gen) * 0.05
    s = torch.exp2(torch.randint(-1, 2, (128,), generator=gen).float())  # 1/2, 1, 2
    step, zero = int_steps(w * s, fmt)
    codes = quantize_int(w * s, fmt, step, zero)
    layer = PackedInt4Linear.from_codes(codes, step, zero, fmt, None, torch.float32, input_scale=s).to(dtype)
    return layer, w, dequantize_int(codes, fmt, step, zero) / s


@pytest.mark.parametrize("spec", ["int4-g64", "int4-g32-asym"])
@pytest.mark.parametrize("backend", ["dequant", pytest.param("tiled", marks=needs_cpp), pytest.param("int8", marks=needs_int8)])
def test_input_scale_is_divided_out_of_inputs_and_grad_inputs(spec, backend):
    layer, w, effective = input_scaled(spec)
    assert torch.equal(layer.dequantized_weight(), effective) and rel(effective, w) < 0.3  # codes of W diag(s): still W
    x, g = torch.randn(4, 33, 128), torch.randn(4, 33, 96)
    x[..., :8] *= 10  # outlier input channels, as in transformer layers
    y, gx = run(layer, backend, x, g)
    y_ref, gx_ref = x @ effective.T, g @ effective  # fp32 math on the weight the codes stand for
    if backend == "int8":  # the designed numerics: x / s quantized per token, its 8 loudest channels exact
        assert rel(y, int8_rows_reference(x / layer.input_scale, 8) @ layer.grid_weight().T) < 0.02  # + the int8 weight's rounding
    tol = 0.02 if backend == "int8" else 1e-5
    assert rel(y, y_ref) < tol and rel(gx, gx_ref) < 0.025, (rel(y, y_ref), rel(gx, gx_ref))


def int8_rows_reference(x: torch.Tensor, outliers: int) -> torch.Tensor:
    """``x [..., K]`` as the int8 backend represents it: the ``outliers`` channels of largest ``max |x|`` exact,
    the rest fake-quantized to int8 per row (fp32 math)."""
    from hf_lowprec.formats import fake_quantize_per_token_int8

    x2d = x.reshape(-1, x.shape[-1]).float()
    loud = x2d.abs().amax(0).topk(outliers).indices if outliers else torch.zeros(0, dtype=torch.long)
    rest = x2d.clone()
    rest[:, loud] = 0
    out = fake_quantize_per_token_int8(rest)
    out[:, loud] = x2d[:, loud]
    return out.reshape(x.shape)


@needs_int8
def test_int8_backend_multiplies_the_loudest_input_channels_exactly():
    layer = packed("int4-g64", k=192, n=64, bias=False)
    x = torch.randn(50, 192)
    x[:, [3, 70, 71, 150]] *= 30  # a few channels far above the rest, as in LLM hidden states
    y_ref = x @ layer.dequantized_weight().T
    errors = {}
    for k in (0, 4, 8):
        layer.outlier_columns = k
        y, _ = run(layer, "int8", x, torch.randn(50, 64))
        assert rel(y, int8_rows_reference(x, k) @ layer.dequantized_weight().T) < 0.01  # the designed numerics
        errors[k] = rel(y, y_ref)
    # with the loud channels in the int8 rows, their step is too coarse for every other channel
    assert errors[4] < errors[0] / 4 and errors[8] <= errors[4] * 1.1, errors


def test_input_scale_survives_state_dict_dtype_casts_and_requantization():
    layer, w, effective = input_scaled("int4-g64-asym")
    shell = PackedInt4Linear(128, 96, "int4-g64-asym", bias=False, dtype=torch.float32)
    shell.load_state_dict(layer.state_dict())
    x = torch.randn(5, 128)
    torch.testing.assert_close(F.linear(x, shell.dequantized_weight()), x @ effective.T)
    assert torch.equal(layer.to(torch.bfloat16).input_scale.float(), layer.input_scale.float())  # powers of two: exact in bf16
    stats = shell.requantize_(w)  # fresh steps, same input scale
    assert torch.equal(shell.input_scale, layer.input_scale.float()) and stats["rel_error"] < 0.3
    assert rel(shell.dequantized_weight(), w) == pytest.approx(stats["rel_error"], rel=1e-4)


def test_compact_steps_keep_int4_codes_and_compute_dtype_and_move_weights_within_the_bf16_rounding_of_a_step():
    """A frozen base keeps INT4 steps and zero points in bf16 whatever it computes in (``compact_steps``): the codes
    stay, a weight moves by at most ``|code - zero| x 2^-8`` of its group's fp32 step, outputs keep the layer's dtype,
    and ``.to()`` changes that dtype (a packed embedding's rows follow it); int8 rows keep their steps."""
    torch.manual_seed(0)
    w = torch.randn(96, 128)
    layer = PackedInt4Linear.from_weight(w, "int4-g32-asym")
    before, codes, step, zero = layer.dequantized_weight(), layer.codes(), layer.step.clone(), layer.zero.clone()
    assert compact_steps(layer) is layer and layer.step.dtype == layer.zero.dtype == torch.bfloat16
    assert torch.equal(layer.codes(), codes) and torch.equal(layer.zero.float(), zero) and layer.dtype == torch.float32
    offsets = (codes.float().view(96, 4, 32) - zero.unsqueeze(-1)).abs()
    bound = (offsets * step.unsqueeze(-1) * 2**-8).view(96, 128)
    moved = (layer.dequantized_weight() - before).abs()
    assert (moved <= bound + 1e-9).all() and moved.max() > 0
    x = torch.randn(3, 128)
    assert layer(x).dtype == torch.float32 and layer.dense_linear(w).weight.dtype == torch.float32
    layer.to(torch.bfloat16)
    assert layer.dtype == torch.bfloat16 and layer.dense_linear(w).weight.dtype == torch.bfloat16
    int8 = PackedInt8Linear.from_weight(w, "int8")
    assert compact_steps(int8).step.dtype == torch.float32
    embedding = PackedEmbedding.from_weight(w, "int4-g32", dtype=torch.float32)
    compact_steps(embedding.table)
    ids = torch.tensor([[0, 5, 95]])
    assert embedding(ids).dtype == torch.float32 and embedding.to(torch.bfloat16)(ids).dtype == torch.bfloat16


@pytest.mark.parametrize("spec", ["int4-g64-asym", "int8"])
def test_from_weight_packs_as_freeze_does_a_slice_of_rows_at_a_time(spec, monkeypatch):
    """``from_weight`` (quantize-on-load) quantizes rows in slices: the codes are those of ``Int4Linear.freeze``."""
    monkeypatch.setattr("hf_lowprec.modules.packed.CHUNK_ELEMENTS", 128 * 7)  # 7 rows a slice: 96 rows -> 14 slices
    frozen = packed(spec)
    dense = frozen.dequantized_weight()  # re-quantizing a grid weight must give the same grid
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 96)
    fresh = type(frozen).from_weight(linear.weight, spec, linear.bias)
    for name, tensor in frozen.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
    assert rel(type(frozen).from_weight(dense, spec).dequantized_weight(), dense) < 1e-6


LLAMA_1B_SHAPES = {"q_proj": (2048, 2048), "k_proj": (2048, 512), "gate_proj": (2048, 8192), "down_proj": (8192, 2048)}


@pytest.mark.slow
@pytest.mark.parametrize("shape", list(LLAMA_1B_SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_1b_shapes_every_runnable_backend_matches_the_dequantized_reference(shape, dtype):
    """Llama-3.2-1B's linear shapes, packed from a dense weight as on load: forward and grad-input of each backend
    this CPU runs against fp32 math on the dequantized weight (issue 18)."""
    k, n = LLAMA_1B_SHAPES[shape]
    torch.manual_seed(0)
    layer = PackedInt4Linear.from_weight(torch.randn(n, k, dtype=dtype) * 0.02, "int4-g64-asym")
    x, g = torch.randn(2, 128, k, dtype=dtype), torch.randn(2, 128, n, dtype=dtype)
    y_ref, gx_ref = reference(layer, x, g)
    backends = layer.runnable_backends(x)
    assert "dequant" in backends
    for backend in backends:
        y, gx = run(layer, backend, x, g)
        assert layer.last_backend == backend and y.dtype == dtype and gx.dtype == dtype
        # int8: dynamic int8 activations (~0.8%); bf16: one rounding of the output (2^-9 relative)
        tol = 0.02 if backend == "int8" else (1e-5 if dtype == torch.float32 else 8e-3)
        assert rel(y, y_ref) < tol and rel(gx, gx_ref) < tol, (backend, rel(y, y_ref), rel(gx, gx_ref))


@pytest.mark.slow
@needs_cpp
@pytest.mark.parametrize("spec", ["int8", "int4-g64-asym"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_128k_vocabulary_head_grad_input_by_row_tiles_matches_the_dequantized_reference(spec, dtype):
    """Llama-3.2-1B's output head (128256 x 2048) at one chunk of the chunked loss (65 tokens): its grad-input goes by
    tiles of rows summed in fp32 (``TALL_ROW_TILE``); forward and grad-input against fp32 math."""
    torch.manual_seed(0)
    layer = packed_class(spec).from_weight(torch.randn(128256, 2048, dtype=dtype) * 0.02, spec)
    x, g = torch.randn(65, 2048, dtype=dtype), torch.randn(65, 128256, dtype=dtype)
    y, gx = run(layer, "tiled", x, g)
    weight = layer.dequantized_weight(torch.float32)
    y_ref, gx_ref = x.float() @ weight.T, g.float() @ weight
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    assert rel(y, y_ref) < tol and rel(gx, gx_ref) < tol, (rel(y, y_ref), rel(gx, gx_ref))


def test_auto_never_times_the_dequant_backend_of_a_large_layer(monkeypatch):
    """Timing ``dequant`` materialises the dense weight (a 128k-vocabulary head: 1 GB); above
    ``DEQUANT_AUTOTUNE_MAX`` elements auto chooses among the kernels that work from the codes, and where this CPU
    has none (no int8 dot products, no C++ kernels) runs ``dequant`` untimed, the one backend there is."""
    import hf_lowprec.modules.packed as packed_module

    x = torch.randn(4, 128)
    real = packed_module.fastest
    for without_kernels in (False, True):  # this CPU's backends, then a CPU with neither int8 nor the C++ kernels
        if without_kernels:
            for check in ("int8_backend_available", "tiled_backend_available"):
                monkeypatch.setattr(packed_module, check, lambda *a: (False, "not on this CPU"))
        runnable = set(packed("int4-g64").runnable_backends(x))
        kernels = runnable - {"dequant"}
        for limit, candidates in ((1 << 30, runnable), (0, kernels or runnable)):
            timed = []
            monkeypatch.setattr(packed_module, "fastest", lambda key, c, why: timed.append(set(c)) or real(key, c, why))
            monkeypatch.setattr(packed_module, "DEQUANT_AUTOTUNE_MAX", limit)
            layer = packed("int4-g64")
            layer(x)
            # timed only when there is a choice; the large layer's candidates leave dequant out whenever a kernel runs
            assert timed == ([candidates] if len(candidates) > 1 else []) and layer.last_backend in candidates
    assert runnable == {"dequant"}  # the second pass did run the one-backend case
