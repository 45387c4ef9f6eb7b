"""GPTQ rounding of the frozen INT4 base: exact where it must be (uncorrelated inputs), better where it claims to be;
calibrated packing of a whole model (GPTQ, AWQ scales + GPTQ) and its errors."""

import pytest
import torch
from conftest import markov_batches, tiny_llama, with_loud_channels
from peft import LoraConfig

from hf_lowprec.formats import FormatSpec, dequantize_int, int_steps, quantize_int
from hf_lowprec.modules import PackedInt4Linear
from hf_lowprec.ondevice import prepare_int4_lora
from hf_lowprec.ondevice.calibration.fp8 import gptq_fp8
from hf_lowprec.ondevice.calibration.gptq import gptq_quantize
from hf_lowprec.ondevice.calibration.passes import _HessianHooks, calibration_passes, decoder_blocks, hessian_groups

LORA = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")


def correlated_inputs(tokens: int = 512, k: int = 128, seed: int = 0) -> torch.Tensor:
    """Inputs ``[tokens, k]`` with strongly correlated features and a few large channels, as in transformer
    layers: one distribution (fixed mixing), ``seed`` draws the samples."""
    mix = torch.randn(k, k, generator=torch.Generator().manual_seed(1234)) / k**0.5 + torch.eye(k)
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(seed)) @ mix
    x[:, :4] *= 8.0
    return x


@pytest.mark.parametrize("fmt", ["int4-g64", "int4-g32-asym"])
def test_uncorrelated_inputs_give_round_to_nearest(fmt):
    """H = I: no error is propagated, so GPTQ's codes are exactly the round-to-nearest codes."""
    spec = FormatSpec.parse(fmt)
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(1))
    step, zero = int_steps(w, spec)
    result = gptq_quantize(w, torch.eye(128), spec, step, zero)
    assert torch.equal(result.codes, quantize_int(w, spec, step, zero))
    assert result.output_error == pytest.approx(result.output_error_nearest, rel=1e-5)


@pytest.mark.parametrize("fmt", ["int4-g64", "int4-g64-asym"])
def test_gptq_lowers_the_output_error_on_the_same_grid(fmt):
    spec = FormatSpec.parse(fmt)
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(2)) * 0.05
    x, x_new = correlated_inputs(seed=0), correlated_inputs(seed=1)  # calibrate on one sample, judge on another
    step, zero = int_steps(w, spec)
    result = gptq_quantize(w, x.T @ x, spec, step, zero)
    lo, hi = spec.qrange
    assert result.codes.min() >= lo and result.codes.max() <= hi
    assert torch.equal(result.step, step)  # same grid: packs like any other layer
    gptq_w = dequantize_int(result.codes, spec, step, zero)
    nearest_w = dequantize_int(quantize_int(w, spec, step, zero), spec, step, zero)
    err = lambda q: ((x_new @ (q - w).T).norm() / (x_new @ w.T).norm()).item()  # noqa: E731
    assert err(gptq_w) < 0.7 * err(nearest_w), (err(gptq_w), err(nearest_w))
    assert result.output_error < 0.6 * result.output_error_nearest


def reference_gptq_codes(w, h, spec, step, zero, percdamp=0.01):
    """GPTQ as first written (OBQ's update, Frantar et al., 2022): float64, one column at a time, the inverse Hessian of
    the columns left updated by Gaussian elimination after each; no Cholesky, no blocks, no transposed layout."""
    w, h = w.double().clone(), h.double().clone()
    h.diagonal().add_(percdamp * h.diagonal().mean())
    hinv = torch.linalg.inv(h)
    steps = step.double().repeat_interleave(spec.group_size, 1)
    zeros = 0 if zero is None else zero.double().repeat_interleave(spec.group_size, 1)
    lo, hi = spec.qrange
    codes = torch.empty_like(w)
    for i in range(w.shape[1]):
        codes[:, i] = torch.round(w[:, i] / steps[:, i] + (0 if zero is None else zeros[:, i])).clamp(lo, hi)
        err = (w[:, i] - (codes[:, i] - (0 if zero is None else zeros[:, i])) * steps[:, i]) / hinv[i, i]
        w[:, i:] -= err[:, None] * hinv[i, i:][None, :]
        hinv -= torch.outer(hinv[:, i], hinv[i, :]) / hinv[i, i]
    return codes


@pytest.mark.parametrize("fmt, block", [("int4-g64", 128), ("int4-g32-asym", 48)])
def test_gptq_chooses_the_codes_of_the_reference_algorithm(fmt, block):
    """The blocked, Cholesky-based loop (block sizes that do and do not divide K) picks the codes of the textbook
    update; a few may differ where float32 and float64 land on either side of a rounding boundary."""
    spec = FormatSpec.parse(fmt)
    w = torch.randn(40, 256, generator=torch.Generator().manual_seed(3)) * 0.05
    x = correlated_inputs(k=256)
    step, zero = int_steps(w, spec)
    result = gptq_quantize(w, x.T @ x, spec, step, zero, block=block)
    reference = reference_gptq_codes(w, x.T @ x, spec, step, zero)
    assert (result.codes.double() != reference).float().mean() < 0.002
    assert not torch.equal(result.codes, quantize_int(w, spec, step, zero))  # correlated inputs: GPTQ moved some


def test_hessian_groups_respect_the_budget_and_keep_order():
    sizes = {"a": 64, "b": 64, "c": 128, "d": 64}
    assert hessian_groups(sizes, budget_bytes=4 * (64 * 64 * 2)) == [["a", "b"], ["c"], ["d"]]
    assert hessian_groups(sizes, budget_bytes=1) == [["a"], ["b"], ["c"], ["d"]]  # one layer always fits


@pytest.mark.parametrize("tokens", [32, 64])
def test_calibration_keeps_the_inputs_of_layers_at_least_twice_as_wide_as_the_tokens(tokens):
    """Their ``X`` is kept beside ``H``: its ``X^T X`` is the Hessian (the output errors are computed from it)."""
    model = tiny_llama(hidden_size=64, intermediate_size=128)
    layers = {n: m for n, m in model.named_modules() if n.endswith(("q_proj", "down_proj"))}  # 64 and 128 inputs
    hooks = _HessianHooks(layers, tokens)
    ids = torch.randint(0, model.config.vocab_size, (tokens // 16, 16), generator=torch.Generator().manual_seed(0))
    hooks.run(lambda: model(input_ids=ids))
    hooks.remove()
    assert set(hooks.inputs) == {n for n, m in layers.items() if 2 * tokens <= m.in_features}
    assert {layers[n].in_features for n in hooks.inputs} == ({64, 128} if tokens == 32 else {128})
    for name, chunks in hooks.inputs.items():
        x = torch.cat(chunks)
        assert x.shape == (tokens, layers[name].in_features)
        torch.testing.assert_close(x.T @ x, hooks.hessians[name], rtol=1e-5, atol=1e-5)
    on_meta = torch.nn.Linear(8, 4, device="meta")  # another device than the CPU's (a GPU's, where one is)
    assert _HessianHooks({"layer": on_meta}, tokens).hessians["layer"].device.type == "meta"  # the layer's device


def tiny_qwen2_with_sliding_window():
    """Two Qwen2 blocks, the second attending over a window of 4 tokens: the blocks get different attention masks."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, use_sliding_window=True,
                         sliding_window=4, layer_types=["full_attention", "sliding_attention"])  # fmt: skip
    return Qwen2ForCausalLM(config).eval()


@pytest.mark.parametrize("make_model", [lambda: tiny_llama().eval(), tiny_qwen2_with_sliding_window])
def test_block_by_block_passes_gather_the_hessians_of_whole_model_passes(make_model):
    """Groups inside decoder blocks from each block's kept inputs and own arguments (the sliding-window block its own
    mask), the output head (outside the blocks) by a whole-model pass: the Hessians of whole-model passes."""
    model = make_model()
    layers = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    ids = torch.randint(0, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    batches = [ids[:2], ids[2:]]
    whole = _HessianHooks(layers, tokens=ids.numel())
    for batch in batches:
        whole.run(lambda batch=batch: model(input_ids=batch))
    whole.remove()
    assert decoder_blocks(model) == ("model.layers", model.model.layers)
    gathered = {}
    with torch.no_grad():
        for group, hooks in calibration_passes(model, dict(layers), batches, budget_bytes=4 * 64 * 64 * 3):
            assert len(group) <= 3 or all(layers[n].in_features > 64 for n in group)
            gathered.update({name: hooks.pop(name) for name in group})
    assert list(gathered) == list(layers) and list(layers)[-1] == "lm_head"  # model order, the head last
    for name, (hessian, inputs) in gathered.items():
        torch.testing.assert_close(hessian, whole.hessians[name], rtol=1e-5, atol=1e-4, msg=name)
        assert (inputs is None) == (name not in whole.inputs), name  # kept for the 128-input down_proj only
        if inputs is not None:
            torch.testing.assert_close(inputs, torch.cat(whole.inputs[name]), rtol=1e-5, atol=1e-5, msg=name)


def test_later_blocks_are_calibrated_on_what_the_rounded_earlier_ones_give():
    """The consumer changes each layer once it has its Hessian (here: halves its weight); block 1's Hessians are those
    of a whole-model pass through the changed block 0 (sequential calibration), not through the original one."""
    import copy

    model = tiny_llama().eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    changed = copy.deepcopy(model)
    with torch.no_grad():
        for module in changed.model.layers[0].modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.mul_(0.5)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers.1." in n}
    whole = _HessianHooks({n: changed.get_submodule(n) for n in layers}, tokens=ids.numel())
    whole.run(lambda: changed(input_ids=ids))
    whole.remove()
    layers = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    unchanged = _hessian_of(model, "model.layers.1.self_attn.q_proj", ids)
    gathered = {}
    with torch.no_grad():
        for group, hooks in calibration_passes(model, dict(layers), [ids]):
            for name in group:
                gathered[name] = hooks.pop(name)[0]
                layers[name].weight.mul_(0.5)
    for name in whole.hessians:
        torch.testing.assert_close(gathered[name], whole.hessians[name], rtol=1e-5, atol=1e-4, msg=name)
    assert not torch.allclose(gathered["model.layers.1.self_attn.q_proj"], unchanged, rtol=0.01)  # the change shows


def _hessian_of(model, name: str, ids: torch.Tensor) -> torch.Tensor:
    hooks = _HessianHooks({name: model.get_submodule(name)}, tokens=ids.numel())
    hooks.run(lambda: model(input_ids=ids))
    hooks.remove()
    return hooks.hessians[name]


def test_prepare_int4_lora_with_calibration_packs_codes_closer_to_the_model():
    ids = markov_batches(n=2, batch=4, seq=32)
    calibration, held_out = ids[0]["input_ids"], ids[1]["input_ids"]
    model_like_a_pretrained_one = lambda: with_loud_channels(tiny_llama(3, hidden_size=128, intermediate_size=256))  # noqa: E731
    with torch.no_grad():
        target = model_like_a_pretrained_one()(input_ids=held_out).logits
    errors, stats = {}, {}
    for rounding in ("nearest", "gptq", "awq+gptq"):
        model, report = prepare_int4_lora(model_like_a_pretrained_one(), LORA, rounding=rounding,
                                          calibration=None if rounding == "nearest" else calibration, backend="dequant")  # fmt: skip
        packed = [m for m in model.get_base_model().modules() if isinstance(m, PackedInt4Linear)]
        assert len(packed) == 14 and any(bool((m.input_scale != 1).any()) for m in packed) == (rounding == "awq+gptq")
        with torch.no_grad():
            errors[rounding] = ((model(input_ids=held_out).logits - target).norm() / target.norm()).item()
        stats[rounding] = report.calibration
    assert stats["nearest"] is None
    for rounding in ("gptq", "awq+gptq"):
        assert stats[rounding]["rounding"] == rounding and stats[rounding]["layers"] == 14
        assert stats[rounding]["output_error_median"] < stats[rounding]["output_error_nearest_median"]
    assert errors["awq+gptq"] < errors["gptq"] < errors["nearest"], errors
    with pytest.raises(ValueError, match="calibration must be token ids"):
        prepare_int4_lora(tiny_llama(), LORA, rounding="gptq", calibration=torch.rand(2, 8))
    with pytest.raises(ValueError, match="rounding 'awq' needs calibration= token blocks"):
        prepare_int4_lora(tiny_llama(), LORA, rounding="awq")
    with pytest.raises(ValueError, match=r"calibration tokens are used by plan='auto', by the roundings gptq, awq, awq\+gptq and by '-sq' layers; this call has none of them"):
        prepare_int4_lora(tiny_llama(), LORA, calibration=calibration)
    with pytest.raises(ValueError, match="unknown rounding 'rtn'; choose one of nearest, gptq, awq, awq\+gptq"):
        prepare_int4_lora(tiny_llama(), LORA, rounding="rtn")


@pytest.mark.parametrize("fmt,pow2", [("fp8", False), ("fp8-rowwise", True), ("fp8-block", True), ("fp8-mx", True)])
def test_fp8_gptq_weights_cast_to_gptqs_points_and_lower_the_output_error(fmt, pow2):
    """The layer's own cast (its dynamic scales unchanged) of the rounded weight gives points whose output error on
    held-out inputs of the calibration distribution beats round-to-nearest's; only weights whose point changed moved,
    and by less than a cell beyond it (they keep their place in the cell, so training moves them as before)."""
    from hf_lowprec.formats import E4M3, block_shape, fp8_amax, fp8_quantize_dequantize

    spec = FormatSpec.parse(fmt)
    w = torch.randn(160, 256, generator=torch.Generator().manual_seed(3)) * 0.05
    x = correlated_inputs(tokens=1024, k=256)
    hessian = x.t() @ x
    result = gptq_fp8(w, hessian, spec, pow2)
    block = block_shape(spec.granularity, "weight") or (1, 1)
    torch.testing.assert_close(fp8_amax(result.weight, spec.granularity, -1, block), fp8_amax(w, spec.granularity, -1, block))
    cast = lambda t: fp8_quantize_dequantize(t, E4M3, spec.granularity, role="weight")  # noqa: E731 (pow2 as FP8Linear)
    moved = result.weight != w
    assert torch.equal(moved, cast(result.weight) != cast(w)) and 0 < moved.float().mean() < 0.8
    off_grid = (result.weight != cast(result.weight)) | ~moved  # moved weights keep their place in the cell...
    assert off_grid.float().mean() > 0.95  # ...rather than sitting on a grid point (but a few at a cell's edge)
    held_out = correlated_inputs(tokens=1024, k=256, seed=1)
    err = lambda q: ((held_out @ (q - w).t()).norm() / (held_out @ w.t()).norm()).item()  # noqa: E731
    assert err(cast(result.weight)) < 0.8 * err(cast(w))
    assert result.output_error < 0.8 * result.output_error_nearest
    assert result.output_error == pytest.approx(
        ((cast(result.weight) - w) @ hessian * (cast(result.weight) - w)).sum().item() / ((w @ hessian) * w).sum().item(), rel=1e-3
    )  # what GPTQ chose is what the cast gives
    with torch.autocast("cpu", torch.bfloat16):  # as in a bf16 training run: the rounding still computes in fp32
        assert torch.equal(gptq_fp8(w, hessian, spec, pow2).weight, result.weight)
    from_inputs = gptq_fp8(w, hessian, spec, pow2, inputs=x)  # errors from X rather than H: the same rounding
    assert torch.equal(from_inputs.weight, result.weight)
    assert from_inputs.output_error == pytest.approx(result.output_error, rel=1e-4)


@pytest.mark.parametrize("fmt", ["fp8-rowwise", "fp8-rowwise-rht"])
def test_bf16_fp8_master_weights_report_the_error_of_what_the_layer_casts(fmt):
    """bf16 master weights: a moved weight kept its place up to 0.49 of a cell inside its cell, bf16 (1/16 of a
    cell) pushed 3-7% of them into the next one, and the error reported was GPTQ's (about half the gain lost,
    unsaid). Now a rowwise layer's cast, read through its own forward, gives GPTQ's points; an -rht layer's bf16
    weight, stored rotated back, cannot hold them all, and the error reported is that of its own cast."""
    from torch import nn

    from hf_lowprec.formats import E4M3, fp8_quantize_dequantize
    from hf_lowprec.modules import FP8Linear
    from hf_lowprec.ondevice.calibration.fp8 import _round_layer
    from hf_lowprec.rotation import rotate

    linear = nn.Linear(256, 128, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(128, 256, generator=torch.Generator().manual_seed(3)) * 0.05)
    layer = FP8Linear.from_linear(linear.bfloat16(), fmt)
    inputs = correlated_inputs(tokens=1024, k=256)
    block = layer.rotation_block
    before = layer.weight.detach().float() if block is None else rotate(layer.weight.detach().float(), block)
    x = inputs if block is None else rotate(inputs, block)  # the layer's rotated basis, where its weight is cast
    result = _round_layer(layer, inputs.t() @ inputs)
    weight = layer.weight.detach() if block is None else rotate(layer.weight.detach(), block)  # as forward: in bf16
    cast = fp8_quantize_dequantize(weight.float(), E4M3, "row", role="weight")
    if block is None:  # one-hot inputs read the cast weight through the layer's forward, exactly
        with torch.no_grad():
            assert torch.equal(layer(torch.eye(256, dtype=torch.bfloat16)).float(), cast.t())
        assert torch.equal(cast, fp8_quantize_dequantize(result.weight, E4M3, "row", role="weight"))  # GPTQ's points
    measured = ((x @ (cast - before).t()).norm() ** 2 / (x @ before.t()).norm() ** 2).item()
    assert result.output_error == pytest.approx(measured, rel=1e-3)
    assert result.output_error < 0.6 * result.output_error_nearest


@pytest.mark.parametrize(
    "fmt, rows", [("fp8", 32), ("fp8-rowwise-rht", 32), ("fp8-rowwise-sq", 32), ("fp8-rowwise-rht", 4)]
)
def test_round_fp8_weights_brings_an_fp8_model_closer_to_its_unquantized_outputs(fmt, rows):
    """With 32 rows of 32 calibration tokens every layer keeps its Hessian only; with 4 rows (128 tokens), the
    256-input down_proj keeps its inputs too and its output errors come from them (``_HessianHooks``)."""
    from hf_lowprec import PrecisionPlan, apply_plan
    from hf_lowprec.ondevice.calibration.fp8 import round_fp8_weights

    model = with_loud_channels(tiny_llama(hidden_size=128, intermediate_size=256))
    calibration = torch.cat([b["input_ids"] for b in markov_batches(n=4)])[:rows]
    held_out = torch.cat([b["input_ids"] for b in markov_batches(n=1, seed=9)])
    with torch.no_grad():
        reference = model(input_ids=held_out).logits
        apply_plan(model, PrecisionPlan.uniform(fmt, keep=("lm_head",)))
        nearest = model(input_ids=held_out).logits
        stats = round_fp8_weights(model, calibration, batch_size=8)
        rounded = model(input_ids=held_out).logits
    assert stats["layers"] == 14 and stats["output_error_median"] < 0.8 * stats["output_error_nearest_median"]
    assert (rounded - reference).norm() < 0.9 * (nearest - reference).norm(), fmt
    with pytest.raises(ValueError, match="choose one of nearest, gptq"):
        round_fp8_weights(model, calibration, "awq")
    with pytest.raises(ValueError, match="no FP8Linear layers"):
        round_fp8_weights(tiny_llama(), calibration)
