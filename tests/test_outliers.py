"""Outlier handling: Hadamard rotation (``-rht``), smoothing (``-sq``) and MXFP8 (``fp8-mx``), each against a reference computed another way
(torchao's own MX cast and Hadamard matrix, fp32 math on rotated operands, dequantized copies)."""

import copy
import json
import logging

import pytest
import torch
import torch.nn.functional as F
from conftest import on_dequant_backend, randomize_adapters, tiny_llama
from peft import LoraConfig
from tiny_assets import save_tiny_model
from torch import nn
from torchao.prototype.mx_formats.mx_tensor import ScaleCalculationMode, to_dtype, to_mx
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

from hf_lowprec import PrecisionPlan, apply_plan
from hf_lowprec.convert import freeze
from hf_lowprec.formats import (
    E4M3,
    E5M2,
    FormatSpec,
    dequantize_int,
    fake_quantize_per_token_int8,
    fp8_quantize_dequantize,
    int_steps,
    quantize_int,
)
from hf_lowprec.modules import FP8Embedding, FP8Linear, Int4Embedding, Int4Linear, PackedInt4Linear, PackedLinear
from hf_lowprec.ondevice import export_int4_lora, load_int4_lora, load_int4_model
from hf_lowprec.ondevice.calibration import calibrate_layer
from hf_lowprec.rotation import rotate, rotation_block, rotation_matrix, unrotate
from hf_lowprec.smoothing import (
    MIN_CALIBRATION_TOKENS,
    InputSmoothing,
    calibrate_smoothed_layers,
    calibrate_smoothing,
    smoothing_scale,
)
from hf_lowprec.training.callback import LowPrecisionCallback


def _mx_reference(x: torch.Tensor, dtype=E4M3) -> torch.Tensor:
    """torchao's MX cast (RCEIL scales, 1x32 blocks along the last dim), dequantized to fp32."""
    scale, data = to_mx(x.float().contiguous(), dtype, 32, ScaleCalculationMode.RCEIL)
    return to_dtype(data, scale, dtype, 32, torch.float32)


def test_rotation_is_an_orthogonal_signed_hadamard_block():
    from torchao.prototype.spinquant.hadamard_utils import hadamard_matrix

    for block in (16, 64, 128):
        r = rotation_matrix(block)
        torch.testing.assert_close(r @ r.t(), torch.eye(block), rtol=0, atol=1e-6)
        h = hadamard_matrix(block, "cpu").float()  # torchao's (unsigned) normalized Hadamard matrix
        signs = (r / h)[:, :1]  # each row of ours is a row of torchao's times +-1
        assert set(signs.flatten().tolist()) == {1.0, -1.0}
        torch.testing.assert_close(r, signs * h, rtol=0, atol=1e-6)
    assert [rotation_block(k) for k in (576, 1536, 192, 2048, 100, 8)] == [64, 128, 64, 128, None, None]
    x = torch.randn(3, 5, 576, dtype=torch.float64)
    torch.testing.assert_close(unrotate(rotate(x, 64), 64), x)
    torch.testing.assert_close(rotate(x, 64).norm(dim=-1), x.norm(dim=-1))


def test_format_names_parse_and_reject_what_does_not_apply():
    for name in ("fp8-mx", "fp8-rowwise-rht", "fp8-mx-rht", "int4-g64-asym-rht", "int8-rht"):
        assert FormatSpec.parse(name).name == name
    assert FormatSpec.parse("fp8-mx").granularity == "mx" and FormatSpec.parse("int4-g64-rht").rotate
    assert FormatSpec.parse("fp8-mx").bytes_per_param() == 1 + 1 / 32
    for bad, match in (("nf4-g64-rht", "nf4 takes only"), ("bf16-rht", "takes no options"), ("fp8-mx-g32", "not -g")):
        with pytest.raises(ValueError, match=match):
            FormatSpec.parse(bad)
    with pytest.raises(ValueError, match="no input to rotate or smooth"):
        Int4Embedding(10, 64, spec="int4-g32-rht")
    with pytest.raises(ValueError, match="no input to rotate or smooth"):
        FP8Embedding(10, 64, spec="fp8-rht")
    with pytest.raises(ValueError, match="divisible by 16"):
        FP8Linear(40, 8, spec="fp8-rht")


def test_mx_cast_is_torchaos_rceil_mxfp8():
    x = torch.randn(16, 96) * torch.logspace(-4, 4, 96)  # blocks of very different magnitudes
    for dtype in (E4M3, E5M2):
        torch.testing.assert_close(fp8_quantize_dequantize(x, dtype, "mx"), _mx_reference(x, dtype), rtol=0, atol=0)


def test_mx_linear_quantizes_every_gemm_along_its_contraction_dim():
    """Forward, grad-input and grad-weight equal fp32 GEMMs of torchao's MX casts along K, N and T respectively."""
    torch.manual_seed(0)
    lin = nn.Linear(128, 64, bias=False)
    layer = FP8Linear.from_linear(lin, "fp8-mx", backend="emulated")
    x = (torch.randn(64, 128) * torch.logspace(-2, 2, 128)).requires_grad_()
    g = torch.randn(64, 64)
    y = layer(x)
    y.backward(g)
    w = lin.weight.detach()
    torch.testing.assert_close(y, _mx_reference(x.detach()) @ _mx_reference(w).t(), rtol=1e-5, atol=1e-5)
    grad_x = _mx_reference(g, E5M2) @ _mx_reference(w.t()).t()  # contraction over the 64 outputs
    torch.testing.assert_close(x.grad, grad_x, rtol=1e-5, atol=1e-5)
    grad_w = _mx_reference(g.t(), E5M2) @ _mx_reference(x.detach().t()).t()  # contraction over the 64 tokens
    torch.testing.assert_close(lin.weight.grad, grad_w, rtol=1e-5, atol=1e-5)


def outlier_case(in_features: int, tokens: int) -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    """A ``Linear(in_features, 48)``, inputs ``[tokens, in_features]`` with one outlier channel, output gradients."""
    torch.manual_seed(0)
    lin = nn.Linear(in_features, 48)
    x, g = torch.randn(tokens, in_features), torch.randn(tokens, 48)
    x[:, 5] *= 40
    return lin, x, g


def forward_backward(layer: nn.Module, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(layer(x), its gradient w.r.t. x)`` for output gradient ``g``; the layer's weight gradient accumulates."""
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(g)
    return y, x.grad


@pytest.mark.parametrize("spec", ["fp8-rht", "fp8-rowwise-rht", "fp8-block-rht", "fp8-mx-rht"])
def test_rotated_fp8_linear_is_the_plain_layer_on_rotated_operands(spec):
    """``-rht`` = the same FP8 layer applied to ``x R`` with weight ``W R``; the input gradient is rotated back."""
    lin, x, g = outlier_case(192, 24)
    ours = FP8Linear.from_linear(lin, spec, backend="emulated")
    plain = nn.Linear(192, 48)
    plain.weight.data, plain.bias.data = rotate(lin.weight.detach(), 64), lin.bias.detach().clone()
    plain = FP8Linear.from_linear(plain, spec.removesuffix("-rht"), backend="emulated")
    (ya, grad_a), (yb, grad_b) = forward_backward(ours, x, g), forward_backward(plain, rotate(x, 64), g)
    torch.testing.assert_close(ya, yb, rtol=0, atol=1e-5)
    torch.testing.assert_close(grad_a, unrotate(grad_b, 64), rtol=0, atol=1e-5)
    torch.testing.assert_close(lin.weight.grad, unrotate(plain.weight.grad, 64), rtol=0, atol=1e-5)


def test_rotated_int4_trains_packs_and_passes_input_gradients():
    torch.manual_seed(0)
    lin = nn.Linear(256, 64)
    x = torch.randn(16, 256)
    spec = FormatSpec.parse("int4-g64-asym-rht")
    layer = Int4Linear.from_linear(lin, spec, learn_scales=False)
    wr = rotate(lin.weight.detach(), 128)
    step, zero = int_steps(wr, spec)
    q = dequantize_int(quantize_int(wr, spec, step, zero), spec, step, zero)
    reference = rotate(x, 128) @ q.t() + lin.bias.detach()
    torch.testing.assert_close(layer(x), reference, rtol=0, atol=1e-5)

    packed = layer.freeze()
    assert packed.spec.rotate and packed.rotation_block == 128
    dense = packed.dequantized_weight()  # rotated back into the input's basis
    torch.testing.assert_close(dense, unrotate(q, 128), rtol=0, atol=1e-6)
    torch.testing.assert_close(packed.dequantized_rows(torch.tensor([3, 7]), torch.float32), dense[[3, 7]])
    for backend in ("dequant", "tiled", "int8"):
        if backend not in packed.runnable_backends(x):
            continue
        packed.backend = backend
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        out = packed(xa)
        ref = F.linear(xb, dense, lin.bias.detach())
        tol = 2e-2 if backend == "int8" else 1e-4  # int8: quantized activations (see test_packed)
        assert (out - ref).norm() / ref.norm() < tol, backend
        out.backward(torch.ones_like(out))
        ref.backward(torch.ones_like(ref))
        assert (xa.grad - xb.grad).norm() / xb.grad.norm() < tol, backend
    same = PackedInt4Linear.from_weight(lin.weight.detach(), spec, lin.bias.detach(), torch.float32)
    assert torch.equal(same.qweight, packed.qweight)  # packing a dense weight rotates it the same way
    reloaded = PackedInt4Linear(256, 64, spec, bias=True, dtype=torch.float32)
    reloaded.load_state_dict(packed.state_dict())
    reloaded.backend = packed.backend = "dequant"
    assert torch.equal(reloaded(x), packed(x))  # the rotation is not stored: it is rebuilt from the format


def test_gptq_on_a_rotated_layer_beats_nearest_on_the_layer_output():
    """The calibration works in the rotated basis (codes of ``W R``, Hessian ``R^T H R``); measured on the layer."""
    torch.manual_seed(0)
    w = torch.randn(64, 256)
    x = torch.randn(512, 256) * torch.logspace(-1, 1, 256)
    spec = FormatSpec.parse("int4-g64-rht")
    result = calibrate_layer(w, x.t() @ x, spec, "gptq")
    packed = PackedInt4Linear.from_codes(result.codes, result.step, result.zero, spec, None, torch.float32)
    nearest = PackedInt4Linear.from_weight(w, spec, dtype=torch.float32)
    ref = x @ w.t()
    err = lambda layer: ((layer.dequantized_weight() @ x.t()).t() - ref).norm() ** 2 / ref.norm() ** 2  # noqa: E731
    assert err(packed) < 0.8 * err(nearest)
    assert err(packed).item() == pytest.approx(result.output_error, rel=1e-3)
    from_inputs = calibrate_layer(w, x.t() @ x, spec, "gptq", inputs=x)  # X rotated as H is
    assert torch.equal(from_inputs.codes, result.codes)
    assert from_inputs.output_error == pytest.approx(result.output_error, rel=1e-3)


def test_plans_apply_rotation_and_report_layers_that_cannot_rotate():
    model = tiny_llama(hidden_size=64, intermediate_size=136)  # down_proj: 136 inputs, 8 | 136 but 16 does not
    report = apply_plan(model, PrecisionPlan(default="fp8-mx-rht", layers={"lm_head": "bf16"}))
    downs = [r for r in report.layers if r.name.endswith("down_proj")]
    assert downs and all(r.requested == "fp8-mx-rht" and r.applied == "fp8-mx" for r in downs)
    assert all("not rotated: 136 input features" in r.reason for r in downs)
    assert {r.name for r in report.not_applied} == {r.name for r in downs}
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, FP8Linear) and q.rotation_block == 64
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    assert q.weight.grad is not None and torch.isfinite(q.weight.grad).all()
    again = apply_plan(model, PrecisionPlan(default="fp8-mx-rht", layers={"lm_head": "bf16"}))
    assert all(r.reason.startswith("not rotated") or r.reason == "unchanged" for r in again.layers if r.applied != "bf16")

    int4 = tiny_llama(hidden_size=64, intermediate_size=128)
    apply_plan(int4, PrecisionPlan(default="int4-g32-rht", layers={"lm_head": "bf16"}), learn_scales=False)
    with torch.no_grad():
        fake = int4(input_ids=ids).logits
        freeze(int4)
        assert all(m.spec.rotate for m in int4.modules() if isinstance(m, PackedLinear))
        torch.testing.assert_close(on_dequant_backend(int4)(input_ids=ids).logits, fake, rtol=0, atol=1e-4)


def assert_exports_round_trip(model, tmp_path) -> None:
    """An INT4+LoRA ``model`` (adapters randomized) reloads from its packed export with the same logits, and its
    compressed-tensors export re-quantizes every layer with an outlier option on the plain grid (``tmp_path / "ct"``)."""
    from hf_lowprec.export.compressed_tensors import export_compressed_tensors

    ids = torch.randint(0, 100, (2, 16))
    randomize_adapters(model, std=0.05)
    with torch.no_grad():
        trained = on_dequant_backend(model).eval()(input_ids=ids).logits
    export_int4_lora(model, tmp_path / "run")
    reloaded, _ = load_int4_model(tmp_path / "run", backend="dequant")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, trained, rtol=0, atol=1e-5)
    errors = export_compressed_tensors(model, tmp_path / "ct").requantized
    # a layer whose scales are powers of two constant within each group re-quantizes exactly (error 0)
    assert errors and all(0 <= e < 0.2 for e in errors.values()) and any(e > 0 for e in errors.values())


def test_rotated_int4_lora_round_trips_through_the_packed_folder_and_compressed_tensors(tmp_path):
    base_dir = save_tiny_model(tmp_path / "base", hidden_size=64, intermediate_size=128)
    plan = PrecisionPlan({"lm_head": "bf16"}, default="int4-g32-asym-rht")
    model, _, report = load_int4_lora(base_dir, LoraConfig(r=4, target_modules="all-linear"), plan, dtype=torch.float32)
    assert {r.applied for r in report.layers if r.name.startswith("model.layers.")} == {"int4-g32-asym-rht"}
    assert_exports_round_trip(model, tmp_path)
    config = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    group = next(iter(config["config_groups"].values()))
    assert group["weights"]["group_size"] == 32 and group["weights"]["symmetric"] is False


def test_loading_a_base_with_a_layer_that_cannot_rotate_names_it(tmp_path):
    base_dir = save_tiny_model(tmp_path / "base", hidden_size=64, intermediate_size=136)
    plan = PrecisionPlan({"lm_head": "bf16"}, default="int4-g8-rht")
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj \(136 inputs\).*without '-rht'"):
        load_int4_lora(base_dir, LoraConfig(r=4, target_modules="all-linear"), plan, dtype=torch.float32)


def test_smoothing_scale_is_smoothquants_rounded_to_powers_of_two_and_calibrates_once():
    torch.manual_seed(0)
    w = torch.randn(32, 96) * 0.05
    x = torch.randn(80, 96) * torch.logspace(-1, 2, 96)
    amax = x.abs().amax(0)
    s = smoothing_scale(amax, w)
    exact = amax.sqrt() / w.abs().amax(0).sqrt()  # SmoothQuant with alpha = 0.5
    torch.testing.assert_close(torch.log2(s), torch.round(torch.log2(exact)), rtol=0, atol=0)
    silent = amax.clone()
    silent[[3, 50, 70]] = torch.tensor([0.0, 1e-12, 1e-6])  # channels that never fired: left unscaled (~2^-9 before)
    expected = torch.where(silent > 1e-5, s, 1.0)
    assert torch.equal(smoothing_scale(silent, w), expected) and torch.equal(expected[[3, 50, 70]], torch.ones(3))
    smoothing = InputSmoothing(96)
    assert not smoothing.calibrate(x[:MIN_CALIBRATION_TOKENS - 1], w)  # too few tokens: stays unsmoothed
    assert torch.equal(smoothing.scale, torch.ones(96))
    assert smoothing.calibrate(x, w) and not smoothing.calibrate(x * 100, w)  # the first batch, then fixed
    torch.testing.assert_close(smoothing.scale, s, rtol=0, atol=0)
    for dtype in (torch.float32, torch.bfloat16):  # powers of two: the change of basis adds no rounding
        xd, wd = x.to(dtype), w.to(dtype)
        assert torch.equal(smoothing.inputs(xd) * s.to(dtype), xd)
        assert torch.equal(smoothing.weights(wd) / s.to(dtype), wd)


def test_format_names_with_smoothing_parse_and_reject_what_does_not_apply():
    for name in ("fp8-sq", "fp8-rowwise-sq", "int4-g64-a8-sq", "int4-g32-asym-sq", "int8-sq"):
        assert FormatSpec.parse(name).name == name and FormatSpec.parse(name).smooth
    for bad, match in (("fp8-sq-rht", "choose one"), ("nf4-g64-sq", "nf4 takes only"), ("bf16-sq", "no options")):
        with pytest.raises(ValueError, match=match):
            FormatSpec.parse(bad)
    with pytest.raises(ValueError, match="no input to rotate or smooth"):
        Int4Embedding(10, 64, spec="int4-g32-sq")
    with pytest.raises(ValueError, match="cannot share its quantizer"):
        lin = nn.Linear(64, 8)
        Int4Linear.from_linear(lin, "int4-g32-sq", quantizer=Int4Linear.from_linear(lin, "int4-g32").weight_quantizer)


def test_smoothing_calibrates_on_the_real_tokens_of_the_first_batches_not_their_padding():
    """A padded row's activations (here a pad token whose embedding holds all its norm in one channel, which the MLPs
    amplify) set ``max|x|`` of the channels they reached: ``calibrate_smoothing`` runs the real tokens alone, in rows
    of the batch's length."""
    model = _smoothed_tiny_llama()
    pad = 5
    model.model.embed_tokens.weight.data[pad] = F.one_hot(torch.tensor(0), 64).float()
    for layer in model.model.layers:
        layer.mlp.gate_proj.weight.data[:, 0] *= 20
        layer.mlp.up_proj.weight.data[:, 0] *= 20
    real = torch.randint(10, 200, (1, 64), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": torch.cat([real, torch.full((1, 64), pad)]), "attention_mask": torch.tensor([[1] * 64, [0] * 64])}
    on_real, with_padding = copy.deepcopy(model), copy.deepcopy(model)
    calibrate_smoothed_layers(on_real, real)
    calibrate_smoothed_layers(with_padding, batch["input_ids"])
    assert calibrate_smoothing(model, [batch], count=4) == 2
    layers = [(m.model.layers[i].mlp.down_proj.smoothing.scale for m in (model, on_real, with_padding)) for i in (0, 1)]
    for ours, reference, padded in layers:
        assert torch.equal(ours, reference) and not torch.equal(ours, padded)



@pytest.mark.parametrize("batches, why", [
    ([{"input_ids": torch.arange(10, 18)[None]}], "the first 4 batches hold 8 real tokens"),
    ([(torch.arange(10, 138)[None],)], "the calibration batches are no dicts with input_ids"),
])  # fmt: skip
def test_batches_that_cannot_calibrate_the_smoothing_leave_it_to_the_first_forward_saying_why(batches, why, caplog):
    """Too few real tokens, batches of tuples: nothing calibrated, one warning naming the layers and why (it raised, or
    failed on the batch's type, where training without this step ran)."""
    model = _smoothed_tiny_llama()
    with caplog.at_level(logging.WARNING, logger="hf_lowprec.smoothing"):
        assert calibrate_smoothing(model, batches, count=4) == 0
    assert "'-sq' layers (model.layers.0.mlp.down_proj, model.layers.1.mlp.down_proj) calibrate on their first" in caplog.text
    assert why in caplog.text and not model.model.layers[0].mlp.down_proj.smoothing.calibrated


def _smoothed_tiny_llama():
    model = tiny_llama()
    apply_plan(model, {"default": "bf16", "layers": {"*.mlp.down_proj": "int4-g64-sq"}})
    return model


def test_the_callback_calibrates_smoothing_on_the_first_training_batches_before_the_first_step(tmp_path):
    """Forwards of 2x16 tokens, fewer than the 64 a '-sq' layer calibrates on: the layers trained unsmoothed for the
    whole run. The callback now calibrates them on the first batches (128 tokens) before the first step."""
    rows = torch.randint(10, 200, (16, 16), generator=torch.Generator().manual_seed(0))
    calibrated_at_start = []

    class Probe(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step == 0:
                calibrated_at_start.extend(bool(m.calibrated) for m in model.modules() if isinstance(m, InputSmoothing))

    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to=[], disable_tqdm=True, save_strategy="no",
                             per_device_train_batch_size=2, max_steps=2)  # fmt: skip
    callback = LowPrecisionCallback({"default": "bf16", "layers": {"*.mlp.down_proj": "int4-g64-sq"}})
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=[{"input_ids": r, "labels": r} for r in rows],
                      callbacks=[callback, Probe()])  # fmt: skip
    trainer.train()
    assert calibrated_at_start == [True, True]
    # given calibration data, a fixed '-sq' plan calibrates when the model is converted (before any wrapping: FSDP)
    given = LowPrecisionCallback({"default": "bf16", "layers": {"*.mlp.down_proj": "int4-g64-sq"}},
                                 calibration_data=[{"input_ids": rows[:8]}])  # fmt: skip
    model = tiny_llama()
    Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in rows], callbacks=[given])
    assert [bool(layer.mlp.down_proj.smoothing.calibrated) for layer in model.model.layers] == [True, True]


@pytest.mark.parametrize("spec", ["fp8-sq", "fp8-rowwise-sq", "fp8-mx-sq"])
def test_smoothed_fp8_linear_is_the_plain_layer_on_smoothed_operands(spec):
    """``-sq`` = the same FP8 layer applied to ``x / s`` with weight ``W diag(s)``, ``s`` from the first batch."""
    lin, x, g = outlier_case(128, 96)
    ours = FP8Linear.from_linear(lin, spec, backend="emulated")
    ya, grad_a = forward_backward(ours, x, g)
    s = smoothing_scale(x.abs().amax(0), lin.weight)
    assert ours.smoothing.calibrated and torch.equal(ours.smoothing.scale, s) and s[5] > 1
    plain = nn.Linear(128, 48)
    plain.weight.data, plain.bias.data = lin.weight.detach() * s, lin.bias.detach().clone()
    plain = FP8Linear.from_linear(plain, spec.removesuffix("-sq"), backend="emulated")
    yb, grad_b = forward_backward(plain, x / s, g)
    torch.testing.assert_close(ya, yb, rtol=0, atol=0)
    torch.testing.assert_close(grad_a, grad_b / s, rtol=0, atol=0)
    torch.testing.assert_close(lin.weight.grad, plain.weight.grad * s, rtol=0, atol=0)


def test_smoothed_w4a8_trains_reloads_and_beats_the_unsmoothed_layer_on_outlier_inputs_and_is_not_packed():
    """W4A8 with smoothing computes what its reference says and beats plain W4A8 on outlier inputs. Packing it is
    refused: the packed kernels compute weight-only INT4, which would have run under the -a8 name (a smoothed INT4
    layer without -a8 packs: test_int4_lora_with_a_smoothed_plan_...)."""
    torch.manual_seed(0)
    lin = nn.Linear(256, 64)
    x = torch.randn(128, 256)
    x[:, [3, 77, 200]] *= 50  # outlier channels, as LLM activations have
    reference = F.linear(x, lin.weight.detach(), lin.bias.detach())
    spec = FormatSpec.parse("int4-g64-a8-sq")
    layer = Int4Linear.from_linear(lin, spec)  # learned steps: re-initialized for W diag(s) at calibration
    out = layer(x)
    s = layer.smoothing.scale
    ws = lin.weight.detach() * s
    step, zero = int_steps(ws, spec)
    torch.testing.assert_close(layer.weight_quantizer.step.detach(), step, rtol=0, atol=0)
    q = dequantize_int(quantize_int(ws, spec, step, zero), spec, step, zero)
    expected = fake_quantize_per_token_int8(x / s) @ q.t() + lin.bias.detach()
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)
    unsmoothed = Int4Linear.from_linear(nn.Linear(256, 64).requires_grad_(False), "int4-g64-a8")
    unsmoothed.weight.data.copy_(lin.weight.detach())
    unsmoothed.weight_quantizer.reinitialize(lin.weight.detach())
    unsmoothed.bias.data.copy_(lin.bias.detach())
    error = lambda y: ((y - reference).norm() / reference.norm()).item()  # noqa: E731
    assert error(out) < 0.7 * error(unsmoothed(x))

    out.sum().backward()
    assert lin.weight.grad is not None and layer.weight_quantizer.step.grad is not None
    with pytest.raises(ValueError, match="int4-g64-a8-sq, whose int8 inputs \\(-a8\\) no packed kernel computes"):
        layer.freeze()

    again = Int4Linear.from_linear(nn.Linear(256, 64), spec)
    again.load_state_dict(layer.state_dict())  # reloads calibrated: a different first batch changes nothing
    assert bool(again.smoothing.calibrated)
    torch.testing.assert_close(again(x * 3), layer(x * 3), rtol=0, atol=0)


def test_int4_lora_with_a_smoothed_plan_calibrates_on_the_first_batch_and_round_trips(tmp_path):
    base_dir = save_tiny_model(tmp_path / "base", hidden_size=64, intermediate_size=128)
    plan = PrecisionPlan({"lm_head": "bf16"}, default="int4-g32-sq")
    lora = LoraConfig(r=4, target_modules="all-linear")
    with pytest.raises(ValueError, match="'-sq' layers needs calibration="):
        load_int4_lora(base_dir, lora, plan, dtype=torch.float32)
    calibration = torch.randint(0, 100, (4, 32))
    with pytest.raises(ValueError, match="take nearest or gptq"):
        load_int4_lora(base_dir, lora, plan, dtype=torch.float32, calibration=calibration, rounding="awq")

    captured = {}
    dense = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    q_proj = dense.model.layers[0].self_attn.q_proj
    q_proj.register_forward_pre_hook(lambda m, a: captured.setdefault("x", a[0].detach()))
    with torch.no_grad():
        dense(input_ids=calibration)
    for rounding in ("nearest", "gptq"):
        model, _, report = load_int4_lora(
            base_dir, lora, plan, dtype=torch.float32, calibration=calibration, rounding=rounding
        )
        assert {r.applied for r in report.layers if r.name.startswith("model.layers.")} == {"int4-g32-sq"}
        packed = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
        assert isinstance(packed, PackedInt4Linear) and packed.spec.smooth
        expected = smoothing_scale(captured["x"].reshape(-1, 64).abs().amax(0), q_proj.weight)
        assert torch.equal(packed.input_scale, expected) and not bool((expected == 1).all())
    assert_exports_round_trip(model, tmp_path)


def test_fp8_gptq_rounds_a_smoothed_layer_on_the_grid_its_forward_casts():
    """``round_fp8_weights`` on a ``-sq`` layer: the output error it reports is that of the weight the layer's forward
    then computes with (read back through identity inputs, which the cast keeps exact). With power-of-two ``s`` the FP8
    grid of ``W diag(s)`` is ``W``'s own scaled column by column, so rounding in either basis agrees up to the range's
    ends; the smoothed basis is the one that is right at them."""
    from hf_lowprec.ondevice.calibration.fp8 import _round_layer

    torch.manual_seed(0)
    lin = nn.Linear(128, 32, bias=False)
    x = torch.randn(256, 128) * torch.logspace(-1, 1.5, 128)
    layer = FP8Linear.from_linear(lin, "fp8-sq", backend="emulated")  # tensorwise: s changes the scale, so the grid
    w = lin.weight.detach().clone()
    with torch.no_grad():
        layer(x)  # calibrates s
        result = _round_layer(layer, x.t() @ x)
        computed = layer(torch.eye(128)).t()  # column k: the weight column the forward multiplies input k by
    assert not torch.equal(layer.weight.detach(), w)  # GPTQ moved some weights
    error = float((x @ (computed - w).t()).square().sum() / (x @ w.t()).square().sum())  # on the inputs themselves
    assert error == pytest.approx(result.output_error, rel=1e-3) and error < result.output_error_nearest
