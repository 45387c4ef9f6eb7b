"""Scale policies: delayed amax history, the gradient scaler (robust statistic, spikes, power-of-two
adjustment, cross-rank sync), LSQ steps, FP16 loss scaling, telemetry, state_dict round trips."""

import contextlib
import copy
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import tiny_llama
from text_batches import text_batches

from hf_lowprec import FP8Linear, apply_plan
from hf_lowprec.formats import (
    E4M3,
    E5M2,
    FP8_MAX,
    FormatSpec,
    dequantize_fp8,
    fake_quantize_int,
    fp8_amax,
    fp8_scale,
    quantize_fp8,
)
from hf_lowprec.modules import Int4Linear
from hf_lowprec.modules.fp8 import cast_fp8
from hf_lowprec.modules.lsq import LearnedActivationQuantizer, LearnedStepQuantizer
from hf_lowprec.scaling import (
    DelayedScaling,
    DynamicLossScaler,
    DynamicScaling,
    GradientScaling,
    make_policy,
    make_policy_factory,
)
from hf_lowprec.training.new_parameters import add_new_parameters
from hf_lowprec.training.telemetry import collect_telemetry, layer_telemetry, skip_step_if_requested


def _amax(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


# ------------------------------------------------------------------------------------ delayed


@pytest.mark.parametrize("reduction", ["max", "most_recent"])
def test_delayed_scaling_scales_from_previous_amaxes(reduction):
    amaxes = [1.0, 4.0, 2.0, 8.0, 0.5, 3.0]
    policy = DelayedScaling(history_len=2, reduction=reduction)
    got = [policy.scale(_amax(a), E4M3).item() for a in amaxes]
    # reference: the cast at step t sees the amaxes of steps t-2, t-1 (the first one sees its own)
    expected = []
    for t, a in enumerate(amaxes):
        past = amaxes[max(0, t - 2) : t]
        ref = a if not past else (max(past) if reduction == "max" else past[-1])
        expected.append(448.0 / ref)
    assert got == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("reduction", ["max", "most_recent"])
def test_delayed_scaling_records_neither_an_overflowed_nor_an_all_zero_amax(reduction):
    """An inf/NaN amax (an overflowed gradient, a step the loss scaler skips) or a 0 (an all-zero cast: a micro-batch
    whose labels are all -100) scales its own cast from the history and is not recorded: the casts after it scale as
    if it had not come (an inf/NaN made the next history_len scales 0 or NaN; a 0 scaled the next cast to saturate
    every value)."""
    amaxes = [0.0, 1.0, 4.0, math.inf, 2.0, math.nan, 0.0, 8.0, 0.0, 0.5]
    policy = DelayedScaling(history_len=2, reduction=reduction)
    got = [policy.scale(_amax(a), E4M3).item() for a in amaxes]
    kept, expected = [], []
    for a in amaxes:
        past = kept[-2:]
        if past:
            expected.append(448.0 / (max(past) if reduction == "max" else past[-1]))
        else:  # an empty history: the cast's own amax (a 0 gives fp8_scale's largest scale)
            expected.append(fp8_scale(_amax(a), E4M3).item())
        kept += [a] if math.isfinite(a) and a > 0 else []
    assert got == pytest.approx(expected, rel=1e-6)
    assert got[1] == pytest.approx(448.0, rel=1e-6)  # the first cast after an all-zero one: its own amax, 1


def test_delayed_scaling_after_an_all_zero_gradient_matches_dynamic_scaling():
    """An FP8 layer whose first backward receives a zero gradient (every label -100) then casts the next gradient
    with that gradient's own scale: its grad_W and grad_x match dynamic scaling's (they were ~1e-10 of them)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 48)
    layers = {
        name: FP8Linear.from_linear(copy.deepcopy(linear), "fp8", backend="emulated",
                                    policies={r: make() for r in ("input", "weight", "grad")})  # fmt: skip
        for name, make in (("delayed", lambda: DelayedScaling(reduction="max")), ("dynamic", DynamicScaling))
    }
    x, grad = torch.randn(8, 32), torch.randn(8, 48)
    grads = {}
    for name, layer in layers.items():
        layer(x.clone().requires_grad_()).backward(torch.zeros(8, 48))
        layer.zero_grad()
        xx = x.clone().requires_grad_()
        layer(xx).backward(grad)
        grads[name] = (layer.weight.grad, xx.grad)
    for got, want in zip(grads["delayed"], grads["dynamic"]):
        torch.testing.assert_close(got, want)


def test_delayed_scaling_margin_power_of_two_and_tensorwise_only():
    policy = DelayedScaling(history_len=4, margin=1, power_of_two=True)
    s = policy.scale(_amax(3.0), E4M3).item()
    assert s == 2.0 ** math.floor(math.log2(448.0 / 3.0)) / 2
    with pytest.raises(ValueError, match="tensorwise"):
        policy.scale(torch.ones(4, 1), E4M3)
    with pytest.raises(ValueError, match="delayed scaling needs tensorwise.*fp8-rowwise"):
        apply_plan(tiny_llama(), "fp8-rowwise", fp8_backend="emulated", policy_factory=make_policy_factory("delayed"))


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_forward_activation_checkpointing_recomputes_takes_its_first_runs_scales(reentrant):
    """Checkpointing recomputes a layer's forward in backward: its casts replay the scales the first run took and
    record nothing (the recompute recorded its amax a second time and cast with a scale from that history: other
    saved tensors, gradients of another function), and telemetry counts each cast once."""
    torch.manual_seed(0)

    def policies():
        return {r: DelayedScaling(history_len=4, reduction="most_recent", telemetry=True) for r in ("input", "weight")}

    plain = FP8Linear(32, 16, spec="fp8", backend="emulated", policies=policies())
    checkpointed = copy.deepcopy(plain)
    for scale in (1.0, 4.0, 0.5):  # amaxes that move: every step's history differs from the last
        x = (scale * torch.randn(8, 32)).requires_grad_()  # the reentrant variant needs an input that does
        plain(x).square().sum().backward()
        run = torch.utils.checkpoint.checkpoint(checkpointed, x, use_reentrant=reentrant)
        run.square().sum().backward()
    for a, b in zip(plain.parameters(), checkpointed.parameters()):
        assert torch.equal(a.grad, b.grad)
    for role in ("input", "weight"):
        first, replayed = plain.scaling[role], checkpointed.scaling[role]
        assert torch.equal(first.amax_history, replayed.amax_history) and replayed.recorded.item() == 3
        assert first.tele_casts.item() == replayed.tele_casts.item() == 3


def test_a_forward_in_eval_mode_casts_with_the_training_scales_and_records_nothing():
    """An evaluation between training steps (Trainer's eval_steps: eval mode, no_grad): its casts take the scales the
    history gives and change neither the history nor the telemetry, so evaluating does not change what training
    computes (it did: other trained weights with an evaluation every step)."""
    torch.manual_seed(0)
    policies = {r: DelayedScaling(history_len=4, telemetry=True) for r in ("input", "weight")}
    layer = FP8Linear(32, 16, bias=False, spec="fp8", backend="emulated", policies=policies)
    layer(torch.randn(8, 32)).sum().backward()
    before = copy.deepcopy(layer.state_dict())
    big = 10 * torch.randn(8, 32)
    with torch.no_grad():
        y = layer.eval()(big)
    assert all(torch.equal(before[k], v) for k, v in layer.state_dict().items())
    sx = fp8_scale(layer.scaling["input"].amax_history.max(), E4M3)  # the trained history's, not the input's own
    sw = fp8_scale(layer.weight.detach().abs().amax(), E4M3)
    xd = dequantize_fp8(quantize_fp8(big, sx, E4M3), sx)
    wd = dequantize_fp8(quantize_fp8(layer.weight.detach(), sw, E4M3), sw)
    torch.testing.assert_close(y, xd @ wd.t(), rtol=1e-5, atol=1e-6)
    layer(big)  # trained in eval mode (dropout off), autograd on: recorded as training
    assert layer.scaling["input"].recorded.item() == 2 and layer.scaling["input"].tele_casts.item() == 2
    with torch.no_grad():  # in training mode under no_grad (reentrant checkpointing's first run): recorded
        layer.train()(big)
    assert layer.scaling["input"].recorded.item() == 3 and layer.scaling["input"].tele_casts.item() == 3


def test_delayed_scaling_inside_fp8_linear_saturates_a_growing_input():
    torch.manual_seed(0)
    layer = FP8Linear(32, 16, bias=False, spec="fp8", backend="emulated",
                      policies={"input": DelayedScaling(history_len=4)})  # fmt: skip
    x1, x2 = torch.randn(8, 32), 3 * torch.randn(8, 32)
    layer(x1)
    y2 = layer(x2)
    # reference: x2 cast with x1's scale (values beyond x1's amax clip), weight with its own amax
    sx = fp8_scale(x1.abs().amax(), E4M3)
    sw = fp8_scale(layer.weight.detach().abs().amax(), E4M3)
    xd = dequantize_fp8(quantize_fp8(x2, sx, E4M3), sx)
    wd = dequantize_fp8(quantize_fp8(layer.weight.detach(), sw, E4M3), sw)
    torch.testing.assert_close(y2, xd @ wd.t(), rtol=1e-5, atol=1e-6)
    assert (xd.abs().amax() - x1.abs().amax()).abs() < 1e-5 * x1.abs().amax()  # clipped at the old amax


# ---------------------------------------------------------------------------- gradient scaler


def _warm(policy: GradientScaling, shape=(64, 64), casts: int = 6, dtype=E5M2, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    for _ in range(casts):
        x = torch.randn(shape, generator=g) * 1e-3
        cast_fp8(x, policy, dtype, "tensor")
    return torch.randn(shape, generator=g) * 1e-3


def test_gradient_spike_rescaled_keeps_direction_and_running_magnitude():
    policy = GradientScaling()
    g = _warm(policy)
    running = policy.running_amax.item()
    q, scale = cast_fp8(1000 * g, policy, E5M2, "tensor")
    deq = dequantize_fp8(q, scale)
    assert policy.spikes.item() == 1
    assert deq.abs().amax().item() == pytest.approx(running, rel=2**-3)  # shrunk to the running amax (E5M2: ±1/2 ulp)
    assert torch.nn.functional.cosine_similarity(deq.flatten(), g.flatten(), dim=0) > 0.995  # E5M2 rounding only
    assert policy.running_amax.item() <= running * (0.9 + 0.1 * policy.spike_threshold)  # winsorized
    # a dynamic scale would have passed the x1000 gradient through
    qd, sd = cast_fp8(1000 * g, DynamicScaling(), E5M2, "tensor")
    assert dequantize_fp8(qd, sd).abs().amax() > 500 * running


@pytest.mark.parametrize("statistic", ["ema", "percentile"])
def test_warmup_casts_far_below_the_later_level_are_followed_after_new_level_after_casts(statistic):
    """Warmup casts 1000x below the later level made the next ten casts spikes (shrunk to 0.1%..12%, or ten skipped
    steps). After ``new_level_after`` (3) casts above the threshold the statistic restarts from the new level: two
    spikes, and a later spike is found. A quiet spell of three casts at a tenth of the level restarts nothing: the
    return to the usual level is no spike."""
    policy = GradientScaling(statistic=statistic)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        cast_fp8(torch.randn(64, 64, generator=g) * 1e-3, policy, E5M2, "tensor")
    kept = []
    for _ in range(6):
        grad = torch.randn(64, 64, generator=g)
        kept.append(dequantize_fp8(*cast_fp8(grad, policy, E5M2, "tensor")).abs().amax() / grad.abs().amax())
    assert policy.spikes.item() == 2
    assert all(k > 0.8 for k in kept[2:])  # the new level's casts pass whole (E5M2 rounding only)
    assert policy._statistic().item() == pytest.approx(4.0, rel=0.25)  # the randn amax of 4096 values: about 4
    cast_fp8(50 * torch.randn(64, 64, generator=g), policy, E5M2, "tensor")
    assert policy.spikes.item() == 3
    for level in [0.1] * 3 + [1.0] * 4:
        cast_fp8(level * torch.randn(64, 64, generator=g), policy, E5M2, "tensor")
    assert policy.spikes.item() == 3


def test_a_gradient_scaling_state_saved_before_level_streaks_loads():
    """States saved before ``new_level_after`` existed have no ``level_streak``: they load, with no streak under way."""
    saved = GradientScaling().state_dict()
    del saved["level_streak"]
    policy = GradientScaling()
    policy.level_streak.fill_(2)
    policy.load_state_dict(saved)
    assert policy.level_streak.item() == 0


@pytest.mark.parametrize("statistic", ["ema", "percentile"])
def test_an_overflowed_gradient_in_warmup_is_not_recorded(statistic):
    """An inf gradient (fp16 loss scaling's first steps overflow) leaves the running statistic as it was: recorded,
    it held the EMA at inf, and a spike was never found again."""
    policy = GradientScaling(statistic=statistic)
    overflowed = torch.randn(64, 64) * 1e-3
    overflowed[0, 0] = float("inf")
    cast_fp8(overflowed, policy, E5M2, "tensor")
    assert policy.recorded.item() == 0
    g = _warm(policy)
    assert torch.isfinite(policy._statistic()) and policy.spikes.item() == 0
    cast_fp8(1000 * g, policy, E5M2, "tensor")
    assert policy.spikes.item() == 1


@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
def test_a_dynamic_cast_of_an_inf_saturates_it_and_keeps_every_other_value(granularity):
    """An inf in a tensor gave the scale 448/inf = 0 and the cast inf x 0 = NaN everywhere in its group (the whole
    tensor when tensorwise): a saturating cast never makes NaN. The inf's group now casts unscaled, the inf saturated."""
    x = torch.randn(4, 256) * 1e-2
    x[0, 0] = float("inf")
    block = (1, 128) if granularity == "block" else None
    q, scale = cast_fp8(x, DynamicScaling(), E5M2, granularity, block=block)
    deq = dequantize_fp8(q, scale, block=block)
    assert torch.isfinite(deq).all() and deq[0, 0] == FP8_MAX[E5M2]
    ref = x.clone()
    ref[0, 0] = 0
    torch.testing.assert_close(deq.index_put((torch.tensor([0]), torch.tensor([0])), torch.tensor(0.0)), ref, rtol=0.25, atol=2e-5)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize("action", ["rescale", "clip", "skip"])
def test_an_inf_or_nan_gradient_after_warmup_is_a_spike_kept_to_its_own_row(action, bad):
    """One inf/NaN element of an output gradient made every element of grad_x and grad_W NaN (``rescale`` shrank the
    scale by ``limit / inf``; a NaN amax passed into the scale) and was not a spike (``skip`` let it through). Now it is
    a spike: ``skip`` drops it and asks for a skip; ``rescale``/``clip`` clip it at the limit, an inf to a finite value,
    a NaN left in its own row as fp32 math leaves it; the other rows equal the fp32 gradients of the cast operands."""
    torch.manual_seed(0)
    layer = FP8Linear(32, 16, bias=False, spec="fp8", backend="emulated", policies={"grad": GradientScaling(spike_action=action)})
    policy = layer.scaling["grad"]
    for _ in range(4):
        layer(torch.randn(16, 32)).backward(torch.randn(16, 16) * 1e-2)
    x, g = torch.randn(16, 32, requires_grad=True), torch.randn(16, 16) * 1e-2
    g[0, 0] = bad
    layer.weight.grad = None
    layer(x).backward(g)
    assert policy.spikes.item() == 1 and torch.isfinite(policy.running_amax)
    assert policy.skip_pending.item() == (action == "skip")
    if action == "skip":
        assert x.grad.abs().max() == 0 and layer.weight.grad.abs().max() == 0
        return
    broken = ~torch.isfinite(x.grad).all(dim=1)
    assert broken.tolist() == [bad != bad] + [False] * 15  # a NaN stays in row 0; an inf saturated
    assert (~torch.isfinite(layer.weight.grad).all(dim=1)).tolist() == [bad != bad] + [False] * 15
    scale = fp8_scale(policy._last_limit, E5M2, power_of_two=True)  # the limit onto E5M2's max: values beyond saturate
    clipped = dequantize_fp8(quantize_fp8(g, scale, E5M2), scale)
    w = dequantize_fp8(*cast_fp8(layer.weight.detach(), DynamicScaling(), E4M3, "tensor"))
    rows = slice(1 if bad != bad else 0, None)  # fp32 math on the cast operands; an inf's row too
    torch.testing.assert_close(x.grad[rows], (clipped @ w)[rows], rtol=1e-2, atol=1e-6)


def _cast_along_both_axes(policy: GradientScaling, grad: torch.Tensor) -> list[torch.Tensor]:
    """``grad`` cast per token (grad_x), then per column under ``recast`` (grad_W), as a rowwise backward casts it;
    both dequantized."""
    outs = []
    for dim, context in ((-1, contextlib.nullcontext()), (0, policy.recast())):
        with context:
            outs.append(dequantize_fp8(*cast_fp8(grad, policy, E5M2, "row", dim=dim)))
    return outs


@pytest.mark.parametrize("action", ["rescale", "clip", "skip"])
def test_a_gradient_cast_along_two_axes_is_judged_once(action):
    """A rowwise backward casts the output gradient per token (grad_x), then per column (grad_W): the second cast,
    under ``recast``, takes the first one's decision. Judged twice, a 10x spike raised the statistic at the first cast
    and passed the second as calm: rescaled for grad_x, only clipped for grad_W, ``adjust`` lowered, recorded twice."""
    policy = GradientScaling(spike_action=action)
    g = torch.Generator().manual_seed(0)
    for _ in range(10):
        _cast_along_both_axes(policy, torch.randn(64, 64, generator=g))
    before = {k: getattr(policy, k).clone() for k in ("recorded", "adjust", "running_amax", "spikes")}
    assert before["recorded"].item() == 10 and before["adjust"].item() == 0
    spike = 10 * torch.randn(64, 64, generator=g)
    outs = _cast_along_both_axes(policy, spike)
    assert policy.spikes.item() == 1 and policy.recorded.item() == 11 and policy.adjust.item() == 0
    by_rows, by_columns = (o.abs().amax().item() for o in outs)
    assert by_rows == pytest.approx(by_columns, rel=0.3)  # one treatment: both rescaled, clipped or dropped alike
    if action == "skip":
        assert by_rows == by_columns == 0.0
    else:
        assert by_rows < 0.5 * spike.abs().amax().item()


def test_a_spike_holding_an_inf_is_clipped_alike_along_both_axes():
    """A spike holding an inf is clipped at the limit, not rescaled: the recast (grad_W's columns) takes that decision
    too. It read 'a spike under rescale' and left grad_W's columns unclipped (a 20x column passed whole)."""
    policy = GradientScaling()
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        _cast_along_both_axes(policy, torch.randn(64, 64, generator=g))
    spike = torch.randn(64, 64, generator=g)
    spike[:, 3] *= 20
    spike[0, 0] = float("inf")
    outs = _cast_along_both_axes(policy, spike)
    assert policy.spikes.item() == 1
    limit = policy._last_limit.item()
    for out in outs:
        assert out[1:, 3].abs().max().item() <= 2 * limit  # clipped at the limit (rounded up to a power of two)


def test_a_rowwise_fp8_backward_records_its_gradient_once():
    """End to end: one backward of a rowwise FP8 layer with the gradient scaler records one amax per gradient."""
    for spec in ("fp8-rowwise", "fp8-mx"):
        layer = FP8Linear(64, 32, spec=spec, backend="emulated", policies={"grad": GradientScaling()})
        x = torch.randn(8, 64, requires_grad=True)
        layer(x).sum().backward()
        assert layer.scaling["grad"].recorded.item() == 1 and layer.scaling["grad"].tele_casts.item() == 2


def test_outlier_clipped_instead_of_flushing_everything_else_to_zero():
    """One huge element: a dynamic E4M3 scale flushes the rest to zero, the robust scale clips it."""
    policy = GradientScaling(spike_action="clip")
    g = _warm(policy, dtype=E4M3)
    limit = policy.running_amax.item()
    g[0, 0] = 1e6 * g.abs().amax()
    q_dyn, s_dyn = cast_fp8(g, DynamicScaling(), E4M3, "tensor")
    q_rob, s_rob = cast_fp8(g, policy, E4M3, "tensor")
    rest = torch.ones_like(g, dtype=torch.bool)
    rest[0, 0] = False
    zero_dyn = (dequantize_fp8(q_dyn, s_dyn)[rest] == 0).float().mean()
    zero_rob = (dequantize_fp8(q_rob, s_rob)[rest] == 0).float().mean()
    assert zero_dyn > 0.99 and zero_rob < 0.01
    rel = ((dequantize_fp8(q_rob, s_rob) - g)[rest].abs() / g[rest].abs()).median()
    assert rel < 2**-4  # E4M3 keeps its 3-bit resolution for everything but the outlier
    # the outlier saturates at the robust range: the running amax, times at most 2 for the power-of-two
    # scale and 2**-adjust for the saturation headroom the warm-up casts asked for
    clip = FP8_MAX[E4M3] / s_rob.item()
    assert dequantize_fp8(q_rob, s_rob)[0, 0].item() == pytest.approx(clip)
    assert limit <= clip <= 2 * limit * 2.0 ** -policy.adjust.item()
    assert collect_telemetry(torch.nn.Sequential())  == {}  # no layers, no keys


def test_gradient_spike_skip_zeroes_the_gradient_and_skips_the_step():
    torch.manual_seed(0)
    factory = make_policy_factory("gradient", spike_action="skip")
    layer = FP8Linear(32, 16, spec="fp8", backend="emulated", policies={"grad": factory("l", "grad", FormatSpec.parse("fp8"))})
    model = torch.nn.Sequential(layer)
    x = torch.randn(8, 32)
    for _ in range(4):
        model(x).square().sum().backward()
        assert not skip_step_if_requested(model)
        model.zero_grad()
    (1000 * model(x).square().sum()).backward()
    assert layer.weight.grad.abs().max() == 0  # the spiking gradient was zeroed in the cast
    assert skip_step_if_requested(model)
    assert all(p.grad is None for p in model.parameters())
    assert not skip_step_if_requested(model)  # the request is consumed
    assert layer.scaling["grad"].skips_requested.item() == 1
    assert layer.scaling["grad"].tele_casts.item() == 4  # the dropped cast is left out of the telemetry


def test_power_of_two_adjustment_follows_saturation_and_underflow():
    policy = GradientScaling(spike_threshold=100.0, growth_interval=2)
    g = torch.Generator().manual_seed(0)
    # amax grows 3x per cast: the running statistic lags, casts saturate, the scale steps down
    for i in range(4):
        cast_fp8(torch.randn(64, 64, generator=g) * 3.0**i, policy, E4M3, "tensor")
    assert policy.adjust.item() < 0
    # a stable gradient with a wide range (E4M3 flushes its small values): the scale steps up again
    wide = torch.randn(64, 64, generator=g) * torch.logspace(-9, 0, 64).unsqueeze(0)
    start = policy.adjust.item()
    for _ in range(30):
        cast_fp8(wide / wide.abs().amax(), policy, E4M3, "tensor")
    assert policy.adjust.item() > start
    assert policy.adjust.item() <= policy.max_adjust


def _spike_run(scaler: str, spikes: set[int], steps: int = 80) -> tuple[float, float]:
    model = tiny_llama()
    apply_plan(model, "fp8", fp8_backend="emulated", policy_factory=make_policy_factory(scaler))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for i, batch in enumerate(text_batches(steps)):
        loss = model(**batch).loss
        (loss * (1000.0 if i in spikes else 1.0)).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        held_out = sum(model(**b).loss.item() for b in text_batches(4, 8, 64, held_out=True)) / 4
    return held_out, collect_telemetry(model).get("lowprec/spikes", 0.0)


def test_injected_gradient_spikes_are_absorbed_by_the_gradient_scaler():
    """x1000 loss-gradient spikes on 3 of 80 steps: AdamW's second moment absorbs a 1e6 spike and then
    takes tiny steps for hundreds of steps; with the scaler each FP8 layer rescales the spike to its
    running magnitude, so training continues as if it had not happened."""
    spikes = {20, 21, 40}
    clean, _ = _spike_run("gradient", set())
    spiky, detected = _spike_run("gradient", spikes)
    clean_dyn, _ = _spike_run("dynamic", set())
    spiky_dyn, _ = _spike_run("dynamic", spikes)
    assert all(math.isfinite(v) for v in (clean, spiky, clean_dyn, spiky_dyn))
    assert detected >= len(spikes)
    assert abs(spiky - clean) / clean < 0.02
    assert spiky_dyn > 1.05 * clean_dyn and spiky_dyn > 1.05 * spiky


# -------------------------------------------------------------------------------------- LSQ


def test_lsq_step_gradient_is_the_lsq_formula_scaled_by_one_over_sqrt_n_qp():
    torch.manual_seed(0)
    spec = FormatSpec.parse("int4-g64")
    qmin, qmax = spec.qrange
    w = torch.randn(4, 128)
    quant = LearnedStepQuantizer(w, spec)
    with torch.no_grad():
        quant.step.mul_(0.7)  # some weights now fall outside the grid, exercising both branches
    s = quant.step.detach().repeat_interleave(64, dim=1)
    v = w / s
    # the half-step bands just beyond the grid edges are conventions that differ between
    # implementations (formats.py counts a code that rounds into range as inside): no upstream there
    band = ((v >= qmax) & (v < qmax + 0.5)) | ((v <= qmin) & (v > qmin - 0.5))
    upstream = torch.randn(4, 128) * ~band
    (quant(w) * upstream).sum().backward()
    # reference: d(w_hat)/ds = round(v) - v inside the grid, the clamp bound outside (Esser et al., 2020, eq. 3)
    dw_ds = torch.where((v > qmin) & (v < qmax), torch.round(v) - v, v.clamp(qmin, qmax).round())
    expected = (upstream * dw_ds).reshape(4, 2, 64).sum(-1) / math.sqrt(64 * qmax)
    torch.testing.assert_close(quant.step.grad, expected, rtol=1e-4, atol=1e-6)
    assert quant.grad_scale == 1 / math.sqrt(64 * 7)
    # and exactly the unscaled gradient of the same fake-quantization, times 1/sqrt(N Qp)
    plain = quant.step.detach().clone().requires_grad_()
    (fake_quantize_int(w, spec, plain) * upstream).sum().backward()
    torch.testing.assert_close(quant.step.grad, plain.grad * quant.grad_scale, rtol=1e-6, atol=0)


def test_lsq_steps_made_after_the_optimizer_are_added_and_trained():
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    report = apply_plan(model, "int4-g64")
    steps = report.new_parameters
    assert steps and all(n.endswith("weight_quantizer.step") for n in steps)
    assert add_new_parameters(opt, steps, scheduler=sched) == len(steps)
    assert add_new_parameters(opt, steps, scheduler=sched) == 0  # never twice
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    assert all(id(p) in in_opt for p in model.parameters() if p.requires_grad)
    before = {n: p.detach().clone() for n, p in steps.items()}
    for batch in text_batches(3):
        model(**batch).loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    assert all(not torch.equal(before[n], p) for n, p in steps.items())
    assert opt.param_groups[-1]["weight_decay"] == 0.0
    assert opt.param_groups[-1]["lr"] == pytest.approx(opt.param_groups[0]["lr"])  # follows the schedule


def test_learned_activation_quantizer_init_grid_and_gradient():
    torch.manual_seed(0)
    quant = LearnedActivationQuantizer("int8")
    x = torch.randn(16, 32, requires_grad=True)
    y = quant(x)
    step = quant.step.detach()
    assert step.item() == pytest.approx(2 * x.detach().abs().mean().item() / math.sqrt(127), rel=1e-6)
    codes = y.detach() / step
    torch.testing.assert_close(codes, codes.round(), rtol=0, atol=1e-4)
    upstream = torch.randn(16, 32)
    (y * upstream).sum().backward()
    v = x.detach() / step
    inside = (v > -128) & (v < 127)
    expected = (upstream * torch.where(inside, v.round() - v, v.clamp(-128, 127))).sum() / math.sqrt(x.numel() * 127)
    torch.testing.assert_close(quant.step.grad, expected, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(x.grad, upstream * inside)  # straight through inside the grid


def test_learned_activation_step_initializes_once_and_a_loaded_state_decides_again():
    """The first forward sets the step from its input, later ones keep it; a loaded state dict's ``initialized``
    decides anew: an initialized one keeps its loaded step, an uninitialized one re-initializes on the next input."""
    torch.manual_seed(0)
    x1, x2, x3 = torch.randn(8, 16), 3 * torch.randn(8, 16), 5 * torch.randn(8, 16)
    first, second = LearnedActivationQuantizer("int8"), LearnedActivationQuantizer("int8")
    first(x1)
    second(x2)
    second(x1)
    assert second.step.item() == pytest.approx(2 * x2.abs().mean().item() / math.sqrt(127), rel=1e-6)
    second.load_state_dict(first.state_dict())
    second(x3)
    assert second.step.item() == first.step.item()
    second.load_state_dict(LearnedActivationQuantizer("int8").state_dict())
    second(x3)
    assert second.step.item() == pytest.approx(2 * x3.abs().mean().item() / math.sqrt(127), rel=1e-6)


def test_learned_activation_steps_wired_into_a8_layers_train_and_match_a_manual_reference():
    model = tiny_llama()
    report = apply_plan(model, "int4-g32-a8", learn_activation_scales=True)
    act_steps = {n: p for n, p in report.new_parameters.items() if n.endswith("input_quantizer.step")}
    assert len(act_steps) == 15  # every Linear of the 2-layer Llama, lm_head included
    layer = model.model.layers[0].mlp.down_proj
    x = torch.randn(2, 8, layer.in_features)
    y = layer(x)
    step = layer.input_quantizer.step.detach()
    reference = torch.nn.functional.linear((x / step).round().clamp(-128, 127) * step, layer.quantized_weight().detach())
    torch.testing.assert_close(y.detach(), reference, rtol=1e-5, atol=1e-6)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for batch in text_batches(4):
        before = {n: p.detach().clone() for n, p in act_steps.items()}
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(not torch.equal(before[n], p.detach()) for n, p in act_steps.items())  # the steps train
    assert losses[-1] < losses[0]
    with pytest.raises(ValueError, match="needs a format that quantizes activations"):
        Int4Linear(64, 64, spec="int4-g32", learn_activation_scales=True)


# ------------------------------------------------------------------------ state and telemetry


POLICY_CASES = {
    "dynamic": lambda: DynamicScaling(telemetry=True),
    "delayed": lambda: DelayedScaling(history_len=3, reduction="max"),
    "gradient-ema": lambda: GradientScaling(),
    "gradient-percentile-skip": lambda: GradientScaling(statistic="percentile", history_len=4, spike_action="skip"),
}


@pytest.mark.parametrize("case", list(POLICY_CASES))
def test_policy_state_dict_round_trip_continues_identically(case):
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(32, 32, generator=g) * (1000 if i == 5 else 1) for i in range(10)]
    a = POLICY_CASES[case]()
    for x in xs[:6]:
        cast_fp8(x, a, E5M2, "tensor")
    b = POLICY_CASES[case]()
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]) or (v.isnan().any() and torch.equal(v.isnan(), b.state_dict()[k].isnan())), k
    for x in xs[6:]:
        qa, sa = cast_fp8(x, a, E5M2, "tensor")
        qb, sb = cast_fp8(x, b, E5M2, "tensor")
        assert torch.equal(sa, sb) and torch.equal(qa.view(torch.uint8), qb.view(torch.uint8))


def test_model_with_policies_round_trips_through_state_dict():
    factory = make_policy_factory("gradient")
    a, b = tiny_llama(), tiny_llama(seed=1)
    apply_plan(a, "fp8", fp8_backend="emulated", policy_factory=factory)
    apply_plan(b, "fp8", fp8_backend="emulated", policy_factory=factory)
    for batch in text_batches(3):
        a(**batch).loss.backward()
    b.load_state_dict(a.state_dict())
    sa, sb = a.state_dict(), b.state_dict()
    assert any(".scaling.grad.running_amax" in k for k in sa)
    a.to(torch.bfloat16)  # statistics keep their precision when the model is cast
    assert all(v.dtype == torch.float32 for k, v in a.state_dict().items() if ".scaling." in k and v.is_floating_point())
    assert all(torch.equal(sa[k], sb[k]) or torch.equal(sa[k].isnan(), sb[k].isnan()) for k in sa)


def test_collect_telemetry_counts_saturation_and_underflow():
    torch.manual_seed(0)
    layer = FP8Linear(64, 32, bias=False, spec="fp8", backend="emulated",
                      policies={"input": DelayedScaling(history_len=2, telemetry=True), "grad": GradientScaling()})  # fmt: skip
    model = torch.nn.Sequential(layer)
    x1 = torch.randn(16, 64)
    x2 = x1 * torch.logspace(-12, 1, 64)  # grows past x1's amax (saturates) and spans far below E4M3's range
    model(x1).sum().backward()
    model(x2).sum().backward()
    # reference for the second input cast: x1's scale (delayed), E4M3 limits
    s = fp8_scale(x1.abs().amax(), E4M3)
    sat = (x2.abs() * s > FP8_MAX[E4M3]).sum().item()
    under = ((quantize_fp8(x2, s, E4M3).float() == 0) & (x2 != 0)).sum().item()
    first_under = ((quantize_fp8(x1, s, E4M3).float() == 0) & (x1 != 0)).sum().item()
    logs = collect_telemetry(model)
    assert logs["lowprec/fp8/input_saturation"] == pytest.approx(sat / (2 * x1.numel()))
    assert logs["lowprec/fp8/input_underflow"] == pytest.approx((under + first_under) / (2 * x1.numel()))
    assert sat > 0 and under > 0
    assert {"lowprec/fp8/grad_saturation", "lowprec/fp8/grad_underflow", "lowprec/fp8/grad_scale_log2",
            "lowprec/spikes", "lowprec/skips_requested"} <= set(logs)  # fmt: skip
    assert "weight" not in layer_telemetry(model)["0"]  # a plain dynamic weight policy keeps no telemetry
    # reset after reading: a window without casts (or layers on torchao's kernels, which scale inside them) gives no
    # figures, not zeros that read as a scale of 1 with nothing saturated
    assert not any(k.startswith("lowprec/fp8/") for k in collect_telemetry(model))


def test_dynamic_scaling_never_counts_the_amax_as_saturated():
    """scale = max / amax maps the amax onto the largest FP8 value up to fp32 rounding: nothing is clipped.
    (Comparing |x| with max / scale without a tolerance counted 4 elements in these 50 casts.)"""
    policy = DynamicScaling(telemetry=True)
    for i in range(50):
        cast_fp8(torch.randn(64, 64, generator=torch.Generator().manual_seed(i)) * (i + 1), policy, E4M3, "tensor")
    assert int(policy.tele_elements) == 50 * 64 * 64 and int(policy.tele_saturated) == 0


def test_factory_and_policy_errors():
    with pytest.raises(ValueError, match="unknown scaler 'fancy'; choose one of dynamic, delayed, gradient"):
        make_policy_factory("fancy")
    with pytest.raises(ValueError, match="unknown options \\['spike_thresold'\\]"):
        make_policy_factory("gradient", spike_thresold=4)
    with pytest.raises(ValueError, match=r"^saturation_tol \(a fraction of the tensor's elements\) must be in \[0, 1\]"):
        make_policy_factory("gradient", saturation_tol=-1)  # a value is checked with the factory, not at a first layer
    with pytest.raises(ValueError, match="unknown spike_action"):
        make_policy("gradient", spike_action="ignore")
    with pytest.raises(ValueError, match="unknown amax reduction"):
        make_policy("delayed", reduction="mean")
    assert isinstance(make_policy("delayed", history_len=8), DelayedScaling)
    factory = make_policy_factory("gradient", spike_action="skip", sync=True)
    spec = FormatSpec.parse("fp8-rowwise")
    grad, inp = factory("x", "grad", spec), factory("x", "input", spec)
    assert isinstance(grad, GradientScaling) and grad.sync and grad.spike_action == "skip" and grad.power_of_two
    assert type(inp) is DynamicScaling and inp.sync and inp.telemetry
    assert factory.to_dict()["options"] == {"spike_action": "skip"}


# -------------------------------------------------------------------------- FP16 loss scaling


def test_fp16_dynamic_loss_scaler_skips_overflow_halves_and_grows():
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 4)  # fp32 master weights, fp16 autocast: torch's supported fp16 recipe
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=3)
    x = torch.randn(16, 8)

    def step(overflow: bool):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = layer(x).float().square().mean()
        scaler.scale(loss).backward()
        if overflow:
            layer.weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    before = layer.weight.detach().clone()
    step(overflow=True)
    assert torch.equal(layer.weight, before)  # skipped
    assert scaler.get_scale() == 2.0**9 and scaler.steps_skipped == 1
    for _ in range(3):
        step(overflow=False)
    assert scaler.get_scale() == 2.0**10  # grown after 3 clean steps
    assert not torch.equal(layer.weight, before)
    other = DynamicLossScaler()
    other.load_state_dict(scaler.state_dict())
    assert other.state_dict() == scaler.state_dict()
    assert other.telemetry() == {"lowprec/loss_scale": 2.0**10, "lowprec/loss_scale_steps_skipped": 1.0}


@pytest.mark.parametrize("make", [DelayedScaling, lambda: GradientScaling(statistic="percentile")])
def test_amax_histories_record_without_a_data_dependent_graph_break_under_torch_compile(make):
    """``history[slot] = ...`` with a tensor ``slot`` is a host sync torch.compile cannot trace: every delayed or
    percentile cast broke the graph there, and Inductor logged a "Backend compiler exception" warning for it
    (``TrainingArguments(torch_compile=True)``). The compiled casts record what the eager ones do."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager, compiled = make(), make()
    scale = torch.compile(compiled.scale, backend="aot_eager")
    for v in (1.0, 2.0, 0.0, 3.0):
        assert scale(_amax(v), E4M3) == eager.scale(_amax(v), E4M3)
    torch.testing.assert_close(compiled.amax_history, eager.amax_history, equal_nan=True, rtol=0, atol=0)
    assert not [reason for reason in counters["graph_break"] if "_local_scalar_dense" in reason]


# ------------------------------------------------------------------------------- cross-rank sync


_SYNC_WORKER = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    from hf_lowprec.formats import E5M2
    from hf_lowprec.modules.fp8 import cast_fp8
    from hf_lowprec.scaling import DelayedScaling, DynamicScaling, GradientScaling
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
    out = []
    for policy in (DynamicScaling(sync=True), DelayedScaling(sync=True), GradientScaling(sync=True)):
        for i in range(4):
            x = torch.randn(16, 16, generator=torch.Generator().manual_seed(10 * i + rank)) * (1 + 3 * rank)
            out.append(cast_fp8(x, policy, E5M2, "tensor")[1].item())
    print(" ".join(repr(v) for v in out))
    dist.destroy_process_group()
    """
)


def _two_ranks(worker: str, tmp_path) -> list[str]:
    """The standard outputs of ``worker`` (a script of two gloo ranks: ``argv[1]`` its rank, ``argv[2]`` the
    rendezvous file) run as two processes."""
    script = tmp_path / "worker.py"
    script.write_text(worker)
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(tmp_path / "rendezvous")], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]  # fmt: skip
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][1][-2000:] + outs[1][1][-2000:]
    return [out for out, _ in outs]


_NON_FINITE_WORKER = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    from hf_lowprec.formats import E5M2
    from hf_lowprec.scaling import DelayedScaling, DynamicScaling, GradientScaling
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
    for bad in ("nan", "inf"):
        for make in (DynamicScaling, DelayedScaling, GradientScaling):
            policy = make(sync=True)
            for _ in range(getattr(policy, "warmup", 1)):
                policy.scale(torch.tensor(1.0), E5M2)
            scale = policy.scale(torch.tensor(float(bad) if rank == 1 else 1.0), E5M2)
            after = policy.scale(torch.tensor(1.0), E5M2)
            print(bad, make.__name__, scale.item(), after.item(), int(getattr(policy, "spikes", -1)), flush=True)
    dist.destroy_process_group()
    """
)


def test_a_non_finite_amax_on_one_rank_is_inf_on_every_rank(tmp_path):
    """A NaN amax on rank 1 alone: gloo's MAX dropped it (it keeps rank 0's), so no rank saw the NaN gradient; and an
    inf is inf, not the largest finite float (a level 3.4e38 scaled the next casts to 1e-36). With sync=True every rank
    scales, records and judges as one process does an inf amax."""
    outs = _two_ranks(_NON_FINITE_WORKER, tmp_path)
    assert outs[0] == outs[1]
    expected = []
    for bad in ("nan", "inf"):
        for make in (DynamicScaling, DelayedScaling, GradientScaling):
            policy = make()  # one process, an inf amax
            for _ in range(getattr(policy, "warmup", 1)):
                policy.scale(_amax(1.0), E5M2)
            scale, after = policy.scale(_amax(math.inf), E5M2), policy.scale(_amax(1.0), E5M2)
            expected.append(f"{bad} {make.__name__} {scale.item()} {after.item()} {int(getattr(policy, 'spikes', -1))}")
    assert outs[0].splitlines() == expected
    assert expected[2].split()[-1] == "1" and float(expected[2].split()[3]) > 1  # the spike found, the level kept


def test_sync_gives_every_rank_the_same_scales(tmp_path):
    """Two gloo ranks see different gradients; with sync=True both use the scale of the global amax."""
    scales = [[float(v) for v in out.split()] for out in _two_ranks(_SYNC_WORKER, tmp_path)]
    assert scales[0] == scales[1]
    # the dynamic scales equal the scale of the larger (rank 1) tensor's amax
    for i in range(4):
        x1 = torch.randn(16, 16, generator=torch.Generator().manual_seed(10 * i + 1)) * 4
        x0 = torch.randn(16, 16, generator=torch.Generator().manual_seed(10 * i))
        amax = torch.maximum(fp8_amax(x0, "tensor"), fp8_amax(x1, "tensor"))
        assert scales[0][i] == fp8_scale(amax, E5M2).item()
