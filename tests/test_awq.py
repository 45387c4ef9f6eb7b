"""Activation-aware input scales: never worse than none on the calibration inputs, better on held-out ones
when a few channels dominate, and composable with GPTQ on the scaled weight."""

import pytest
import torch

from hf_lowprec.formats import FormatSpec, dequantize_int
from hf_lowprec.ondevice.calibration import calibrate_layer
from hf_lowprec.ondevice.calibration.awq import (
    power_of_two_scales,
    round_to_nearest,
    search_input_scale,
)

SPEC = FormatSpec.parse("int4-g64-asym")


def outlier_inputs(seed: int, k: int = 128, tokens: int = 1024) -> torch.Tensor:
    """Inputs ``[tokens, k]`` as transformer layers see them: channels of log-normally spread magnitude, four of
    them 20x louder, mildly correlated; one distribution (fixed mixing and magnitudes), ``seed`` draws the samples."""
    gen = torch.Generator().manual_seed(1234)
    mix = torch.eye(k) + 0.3 * torch.randn(k, k, generator=gen) / k**0.5
    rms = torch.exp(0.5 * torch.randn(k, generator=gen))
    rms[:4] *= 20
    return (torch.randn(tokens, k, generator=torch.Generator().manual_seed(seed)) @ mix) * rms


def weight(seed: int = 2) -> torch.Tensor:
    return torch.randn(64, 128, generator=torch.Generator().manual_seed(seed)) * 0.05


def calibration_error(err: torch.Tensor, w: torch.Tensor, x: torch.Tensor) -> float:
    """The relative output error on the calibration inputs themselves, ``|X E^T|^2 / |X W^T|^2``: the reference for
    the Hessian form ``tr(E H E^T) / tr(W H W^T)`` the code computes."""
    return float((x.double() @ err.double().T).square().sum() / (x.double() @ w.double().T).square().sum())


def held_out_error(effective: torch.Tensor, w: torch.Tensor) -> float:
    x = outlier_inputs(seed=1)  # the calibration sample is seed 0
    return ((x @ (effective - w).T).norm() / (x @ w.T).norm()).item()


def test_scales_are_powers_of_two_centred_on_one():
    s = power_of_two_scales(torch.tensor([0.1, 1.0, 3.0, 40.0]), alpha=0.5)
    assert torch.equal(s, torch.exp2(torch.round(torch.log2(s))))  # exact in bf16/fp16
    assert s[0] < 1 < s[-1] and torch.all(s[1:] >= s[:-1])
    assert torch.equal(power_of_two_scales(torch.tensor([0.1, 40.0]), alpha=0.0), torch.ones(2))


def test_search_lowers_the_output_error_where_a_few_channels_dominate():
    w, x = weight(), outlier_inputs(seed=0)
    found = search_input_scale(w, x.T @ x, SPEC)
    assert 0 < found.alpha <= 1 and found.output_error < 0.6 * found.output_error_unscaled
    s = found.scale
    effective = round_to_nearest(w * s, SPEC) / s
    assert found.output_error == pytest.approx(calibration_error(effective - w, w, x), rel=1e-5)
    assert held_out_error(effective, w) < 0.8 * held_out_error(round_to_nearest(w, SPEC), w)  # a norm: 0.8^2 = 0.64
    assert s[:4].min() > s[4:].median()  # the loud channels (x[:, :4] 20x louder) get the finer steps


def test_without_a_loud_channel_the_search_may_keep_unit_scales():
    """alpha = 0 (no scaling) is on the grid: the result is never worse than plain rounding."""
    w, h = weight(), torch.eye(128) * 3.0  # every channel alike: nothing to gain
    found = search_input_scale(w, h, SPEC)
    assert found.output_error <= found.output_error_unscaled and torch.equal(found.scale, torch.ones(128))


@pytest.mark.parametrize("rounding, held_out_ratio", [("awq", 0.8), ("awq+gptq", 0.8), ("gptq", 1.0)])
def test_calibrated_codes_pack_the_scaled_weight(rounding, held_out_ratio):
    w, x = weight(), outlier_inputs(seed=0)
    result = calibrate_layer(w, x.T @ x, SPEC, rounding)
    lo, hi = SPEC.qrange
    assert result.codes.dtype == torch.uint8 and result.codes.min() >= lo and result.codes.max() <= hi
    assert (result.input_scale is None) == (rounding == "gptq")
    s = 1.0 if result.input_scale is None else result.input_scale
    effective = dequantize_int(result.codes, SPEC, result.step, result.zero) / s
    assert result.output_error == pytest.approx(calibration_error(effective - w, w, x), rel=1e-4)
    from_inputs = calibrate_layer(w, x.T @ x, SPEC, rounding, inputs=x)  # errors from X, not H: the same choice
    assert torch.equal(from_inputs.codes, result.codes) and from_inputs.alpha == result.alpha
    assert from_inputs.output_error == pytest.approx(result.output_error, rel=1e-4)
    assert from_inputs.output_error_nearest == pytest.approx(result.output_error_nearest, rel=1e-4)
    assert result.output_error < 0.8 * result.output_error_nearest
    assert held_out_error(effective, w) < held_out_ratio * held_out_error(round_to_nearest(w, SPEC), w)


def test_awq_and_gptq_together_beat_either_alone():
    w, x = weight(), outlier_inputs(seed=0)
    errors = {r: calibrate_layer(w, x.T @ x, SPEC, r).output_error for r in ("awq", "gptq", "awq+gptq")}
    assert errors["awq+gptq"] < min(errors["awq"], errors["gptq"]), errors


def test_hessian_must_match_the_weight():
    with pytest.raises(ValueError, match="Hessian \\(64, 64\\) does not match a weight with 128 inputs"):
        search_input_scale(weight(), torch.eye(64), SPEC)
