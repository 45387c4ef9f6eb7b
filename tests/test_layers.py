"""Low-precision layers: parity with torchao's Float8Linear, and input gradients vs dequantized references."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

from hf_lowprec.formats import (
    E4M3,
    E5M2,
    FormatSpec,
    dequantize_fp8,
    dequantize_int,
    fp8_amax,
    fp8_scale,
    int_steps,
    quantize_fp8,
    quantize_int,
)
from hf_lowprec.modules import FP8Embedding, FP8Linear, Int4Embedding, Int4Linear

BF16_ULP = 2.0**-7  # relative spacing of bf16 at the top of a binade


def _run(layer, x, g):
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(g)
    return y, x.grad, layer.weight.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe,spec,grad_dtype", [("tensorwise", "fp8", E5M2), ("rowwise", "fp8-rowwise", E4M3)])
def test_fp8_linear_matches_torchao_float8linear(dtype, recipe, spec, grad_dtype):
    torch.manual_seed(0)
    lin = nn.Linear(256, 96, bias=False).to(dtype)
    ref = convert_to_float8_training(nn.Sequential(copy.deepcopy(lin)), config=Float8LinearConfig.from_recipe_name(recipe))[0]
    ours = FP8Linear.from_linear(copy.deepcopy(lin), spec, backend="emulated", grad_dtype=grad_dtype)
    x, g = torch.randn(48, 256, dtype=dtype) * 3, torch.randn(48, 96, dtype=dtype)
    for a, b in zip(_run(ours, x, g), _run(ref, x, g)):
        assert a.dtype == b.dtype
        a, b = a.detach().float(), b.detach().float()
        # Same FP8 operands; the results differ only by output rounding: our bf16 GEMM rounds before
        # applying the scale (one extra bf16 rounding: at most 1 ulp of the element, 2 ulp of the
        # largest element's binade), and torchao's rowwise path rounds fp32 outputs through bf16
        # (a torch._scaled_mm limitation) — so two bf16 ulps of the largest value bound both.
        exact = dtype == torch.float32 and recipe == "tensorwise"
        tol = 1e-5 if exact else 2 * BF16_ULP
        assert (a - b).abs().max() <= tol * b.abs().max(), (a - b).abs().max()
        # no common factor: a bf16 tensorwise scale's inverse scaled everything by up to 0.4% (half a bf16 ulp)
        assert float((a * b).sum() / (b * b).sum()) == pytest.approx(1, abs=BF16_ULP / 16)


def test_fp8_linear_torchao_backend_is_torchaos_layer():
    """Its GEMMs are configured as Float8Linear's (a fast-accumulating output GEMM, no copy padding a token count
    that divides by 16); a token count that does not is padded (_scaled_mm needs the weight gradient's inner
    dimension to divide by 16)."""
    torch.manual_seed(0)
    lin = nn.Linear(128, 64)
    ref = convert_to_float8_training(nn.Sequential(copy.deepcopy(lin)))[0]
    ours = FP8Linear.from_linear(copy.deepcopy(lin), "fp8", backend="torchao")
    x, g = torch.randn(16, 128), torch.randn(16, 64)
    for a, b in zip(_run(ours, x, g), _run(ref, x, g)):
        assert torch.equal(a, b)
    assert ours._torchao_config[0][False] == ref.linear_mm_config
    x, g = torch.randn(20, 128), torch.randn(20, 64)
    ours.weight.grad = ours.bias.grad = None
    padded = convert_to_float8_training(nn.Sequential(copy.deepcopy(lin)), config=Float8LinearConfig(pad_inner_dim=True))[0]
    for a, b in zip(_run(ours, x, g), _run(padded, x, g)):
        assert torch.equal(a, b)


def test_torchao_backend_refuses_policies_its_kernels_would_ignore_and_policies_follow_the_weight():
    """torchao's kernels scale dynamically: a delayed or gradient policy asked for with backend='torchao' would not
    run (it was silently dropped). A converted layer's policies keep their statistics on the weight's device."""
    from hf_lowprec.scaling import DelayedScaling, GradientScaling

    for policy in (DelayedScaling(), GradientScaling()):
        with pytest.raises(ValueError, match=rf"^backend='torchao' scales dynamically; {type(policy).__name__} would"):
            FP8Linear.from_linear(nn.Linear(128, 64), "fp8", backend="torchao", policies={"grad": policy})
    on_meta = FP8Linear.from_linear(nn.Linear(128, 64, device="meta"), "fp8", policies={"input": DelayedScaling()})
    assert {b.device.type for b in on_meta.scaling.buffers()} == {"meta"}  # a CUDA weight's: CUDA


def test_fp8_auto_backend_leaves_torchao_where_scaled_mm_cannot_run(monkeypatch):
    """On an FP8 GPU, ``auto`` runs torchao's kernels only for shapes ``torch._scaled_mm`` takes (both weight
    dimensions divisible by 16) and tensor/row scales; elsewhere the layer is emulated and its report says why."""
    monkeypatch.setattr("hf_lowprec.modules.fp8.fp8_hardware_available", lambda device: True)  # an H100's answer
    even, odd = FP8Linear.from_linear(nn.Linear(128, 64), "fp8"), FP8Linear.from_linear(nn.Linear(100, 72), "fp8")
    assert (even.backend, even.torchao_blocker()) == ("torchao", None)
    assert odd.backend == "emulated"
    assert odd.torchao_blocker() == "torch._scaled_mm needs weight dimensions divisible by 16, not 72x100"
    block = FP8Linear.from_linear(nn.Linear(128, 64), "fp8-block")
    assert block.backend == "emulated" and block.torchao_blocker() == "torchao's kernels do not cover fp8-block"
    assert FP8Linear.from_linear(nn.Linear(100, 72), "fp8", backend="emulated").torchao_blocker() is not None


def _fp8_roundtrip(t, dtype, gran, dim=-1):
    s = fp8_scale(fp8_amax(t, gran, dim), dtype, power_of_two=gran != "tensor")
    return dequantize_fp8(quantize_fp8(t, s, dtype), s)


@pytest.mark.parametrize("spec", ["fp8", "fp8-rowwise"])
def test_fp8_linear_input_gradient_matches_dequantized_reference(spec):
    """grad_x = Q(g) @ Q(W) computed in fp32 from independently dequantized operands."""
    torch.manual_seed(0)
    lin = nn.Linear(200, 72, bias=True)
    layer = FP8Linear.from_linear(lin, spec, backend="emulated")
    x, g = torch.randn(3, 10, 200), torch.randn(3, 10, 72)
    y, gx, _ = _run(layer, x, g)
    gran = FormatSpec.parse(spec).granularity
    g2 = g.reshape(-1, 72)
    w_for_gx = _fp8_roundtrip(lin.weight.detach(), E4M3, gran, dim=0 if gran == "row" else -1)
    ref_gx = _fp8_roundtrip(g2, E5M2, gran) @ w_for_gx
    assert torch.allclose(gx.reshape(-1, 200), ref_gx, rtol=1e-5, atol=1e-5)
    ref_y = _fp8_roundtrip(x.reshape(-1, 200), E4M3, gran) @ _fp8_roundtrip(lin.weight.detach(), E4M3, gran).t() + lin.bias
    assert torch.allclose(y.reshape(-1, 72), ref_y, rtol=1e-5, atol=1e-5)
    # and it is a faithful low-precision gradient: within FP8's error of the exact one
    assert (gx.reshape(-1, 200) - g2 @ lin.weight.detach()).norm() / (g2 @ lin.weight.detach()).norm() < 0.1


def test_fp8_block_linear_gradients_match_dequantized_reference():
    torch.manual_seed(0)
    lin = nn.Linear(300, 260, bias=False)  # neither dim a multiple of 128
    layer = FP8Linear.from_linear(lin, "fp8-block", backend="emulated")
    x, g = torch.randn(40, 300), torch.randn(40, 260)
    y, gx, gw = _run(layer, x, g)

    def rt(t, dtype, block):
        s = fp8_scale(fp8_amax(t, "block", block=block), dtype, power_of_two=True)
        return dequantize_fp8(quantize_fp8(t, s, dtype, block), s, block=block)

    xd, wd, gd = rt(x, E4M3, (1, 128)), rt(lin.weight.detach(), E4M3, (128, 128)), rt(g, E5M2, (1, 128))
    assert torch.allclose(y, xd @ wd.t(), rtol=1e-5, atol=1e-5)
    assert torch.allclose(gx, gd @ wd, rtol=1e-5, atol=1e-5)
    assert torch.allclose(gw, gd.t() @ xd, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("spec", ["int4-g64", "int4-g64-asym", "int4-g32-a8", "int8", "nf4-g64"])
def test_int_linear_input_gradient_matches_dequantized_reference(spec):
    torch.manual_seed(0)
    lin = nn.Linear(200, 72)  # 200 is not a multiple of 64
    layer = Int4Linear.from_linear(lin, spec)
    x, g = torch.randn(30, 200), torch.randn(30, 72)
    y, gx, gw = _run(layer, x, g)
    fs = FormatSpec.parse(spec)
    w = lin.weight.detach()
    if fs.family == "nf4":
        from hf_lowprec.formats import dequantize_nf4, quantize_nf4

        wd = dequantize_nf4(*quantize_nf4(w, 64), 64)
    else:
        step, zero = int_steps(w, fs)
        wd = dequantize_int(quantize_int(w, fs, step, zero), fs, step, zero)
    assert torch.allclose(gx, g @ wd, rtol=1e-5, atol=1e-5)
    x_in = x
    if fs.act_int8:
        s = x.abs().amax(-1, keepdim=True) / 127
        x_in = torch.round(x / s).clamp(-128, 127) * s
    assert torch.allclose(y, x_in @ wd.t() + lin.bias, rtol=1e-5, atol=1e-5)
    # straight-through: inside the range the weight gradient is the plain one
    assert torch.allclose(gw, g.t() @ x_in, rtol=1e-4, atol=1e-4)


def test_int4_learned_steps_get_gradients_and_freeze_packs_the_same_weights():
    torch.manual_seed(0)
    layer = Int4Linear.from_linear(nn.Linear(130, 40), "int4-g64")
    x = torch.randn(8, 130)
    layer(x).pow(2).sum().backward()
    assert layer.weight_quantizer.step.grad is not None and layer.weight_quantizer.step.grad.abs().sum() > 0
    packed = layer.freeze()
    assert packed.qweight.dtype == torch.uint8 and packed.qweight.shape == (40, 65)
    with torch.no_grad():
        assert torch.allclose(packed(x), layer(x), atol=1e-5)
    xg = x.clone().requires_grad_()
    packed(xg).sum().backward()
    assert torch.allclose(xg.grad, torch.ones(8, 40) @ packed.dequantized_weight(), atol=1e-5)


@pytest.mark.parametrize("spec", ["int4-g64", "int4-g64-asym"])
def test_a_trained_int4_layer_computes_with_exactly_the_weights_its_packed_form_holds(spec):
    """The learned steps' scaled gradient must not leave rounding in the forward value: a packed export of a QAT
    layer is then bit-equal to it (the composed ``(s - s*g).detach() + s*g`` was off by ~1e-7 in 2% of the weights,
    which bf16 autocast and FP8 layers downstream grew to 0.005 nats on SmolLM2-135M)."""
    torch.manual_seed(0)
    layer = Int4Linear.from_linear(nn.Linear(256, 96), spec)
    with torch.no_grad():
        layer.weight_quantizer.step.mul_(1 + 0.01 * torch.rand_like(layer.weight_quantizer.step))  # learned: not amax/qmax
    trained = layer.quantized_weight()
    trained.sum().backward()
    assert layer.weight_quantizer.step.grad.abs().sum() > 0
    assert torch.equal(layer.freeze().dequantized_weight(torch.float32), trained.detach())


@pytest.mark.parametrize("cls,spec", [(FP8Embedding, "fp8-rowwise"), (FP8Embedding, "fp8"), (Int4Embedding, "int4-g32"), (Int4Embedding, "nf4-g64")])
def test_embedding_lookup_reads_the_quantized_table(cls, spec):
    torch.manual_seed(0)
    emb = nn.Embedding(50, 96, padding_idx=0)
    layer = cls.from_embedding(emb, spec)
    ids = torch.tensor([[0, 3, 3, 7], [49, 1, 0, 2]])
    out = layer(ids)
    fs = FormatSpec.parse(spec)
    w = emb.weight.detach()
    if fs.family == "fp8":
        table = _fp8_roundtrip(w, E4M3, fs.granularity)
    elif fs.family == "nf4":
        from hf_lowprec.formats import dequantize_nf4, quantize_nf4

        table = dequantize_nf4(*quantize_nf4(w, 64), 64)
    else:
        step, zero = int_steps(w, fs)
        table = dequantize_int(quantize_int(w, fs, step, zero), fs, step, zero)
    assert torch.allclose(out, F.embedding(ids, table), atol=1e-6)
    g = torch.randn_like(out)
    out.backward(g)
    ref = torch.zeros_like(w).index_add_(0, ids.flatten(), g.reshape(-1, 96))
    ref[0] = 0  # padding row never updates
    assert torch.allclose(emb.weight.grad, ref, atol=1e-6)


@pytest.mark.parametrize("cls", [FP8Embedding, Int4Embedding])
def test_an_embedding_built_directly_works_as_one_wrapped(cls):
    """Int4Embedding(50, 96) had no weight quantizer (only from_embedding made one): its first lookup, freeze and
    load_state_dict failed. Built directly, it looks up what the same table wrapped does, and reloads its state."""
    torch.manual_seed(0)
    spec = "fp8-rowwise" if cls is FP8Embedding else "int4-g32"
    direct = cls(50, 96, spec=spec)
    wrapped = cls.from_embedding(nn.Embedding.from_pretrained(direct.weight.detach().clone(), freeze=False), spec)
    ids = torch.tensor([[0, 3, 3, 7], [49, 1, 0, 2]])
    assert torch.equal(direct(ids), wrapped(ids))
    again = cls(50, 96, spec=spec)
    again.load_state_dict(direct.state_dict())
    assert torch.equal(again(ids), direct(ids))


def test_fp8_saturates_activations_instead_of_producing_nan():
    layer = FP8Linear.from_linear(nn.Linear(32, 16), "fp8", backend="emulated")
    x = torch.randn(4, 32)
    x[0, 0] = 1e30
    y = layer(x)
    y.sum().backward()
    assert torch.isfinite(y).all() and torch.isfinite(layer.weight.grad).all()
    # reference: the saturating E4M3 casts computed directly (tensorwise scale from the amax; 1e30 lands on 448 / scale)
    casts = [(t, fp8_scale(fp8_amax(t, "tensor"), E4M3)) for t in (x, layer.weight.detach())]
    xq, wq = (dequantize_fp8(quantize_fp8(t, s, E4M3), s) for t, s in casts)
    torch.testing.assert_close(y.detach(), F.linear(xq, wq, layer.bias.detach()), rtol=1e-5, atol=1e-5)
    assert xq[0, 0] == 1e30 and (xq[1:] == 0).all()  # the others underflow against a 1e30 amax: zero, not NaN


@pytest.mark.parametrize("spec", ["fp8", "fp8-rowwise", "fp8-rowwise-rht", "fp8-block", "fp8-mx", "int4-g32", "int8",
                                  "int4-g32-a8"])
def test_an_empty_batch_gives_an_empty_output_and_zero_gradients(spec):
    """A batch of no tokens (``[2, 0, K]``) runs as ``nn.Linear`` does: output ``[2, 0, N]``, zero weight gradient and
    the bias's (the tensorwise and rowwise FP8 casts took an amax over no element and raised; a learned activation
    step started from the mean of no element, NaN, and every later batch came out NaN)."""
    torch.manual_seed(0)
    reference = nn.Linear(64, 32)
    options = {"learn_activation_scales": True} if spec.endswith("-a8") else {}
    layer = (FP8Linear if spec.startswith("fp8") else Int4Linear).from_linear(copy.deepcopy(reference), spec, **options)
    x = torch.zeros(2, 0, 64)
    for module in (reference, layer):
        module(x).sum().backward()
    assert layer(x).shape == (2, 0, 32)
    assert torch.equal(layer.weight.grad, torch.zeros(32, 64)) and torch.equal(layer.bias.grad, reference.bias.grad)
    assert torch.isfinite(layer(torch.randn(3, 64))).all()  # the next batch: its scales start from it


def test_invalid_layer_options_raise():
    with pytest.raises(ValueError, match="fp8 format"):
        FP8Linear(8, 8, spec="int4-g64")
    with pytest.raises(ValueError, match="unknown FP8 backend"):
        FP8Linear(8, 8, backend="cuda")
    with pytest.raises(ValueError, match="int4, int8, nf4"):
        Int4Linear(8, 8, spec="fp8")
