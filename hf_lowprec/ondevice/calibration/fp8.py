"""GPTQ rounding of FP8 master weights: error compensation at conversion for the FP8 training layers.

An ``FP8Linear`` casts its (fp32 or bf16) master weight to E4M3 round-to-nearest on every step. Three mantissa bits
cost SmolLM2-135M most of its FP8 perplexity gap (``benchmarks/outliers.py``: with exact activations FP8 is still
2.9% worse, with exact weights 1.3%), and that error is static: the weights move little during fine-tuning.
:func:`round_fp8_weights` moves the master weights so that their round-to-nearest cast gives the grid points GPTQ
chooses (the values that preserve the layer's output on calibration tokens,
:func:`~hf_lowprec.ondevice.calibration.gptq.gptq_columns`) instead of its own.

A weight whose GPTQ point differs from its nearest one moves by whole grid cells and keeps its place inside its cell;
every other weight stays as it was. Snapping the weights onto the grid points instead costs the training that
follows: a weight on a grid point needs half a cell of updates before its cast changes at all, and on SmolLM2-135M
(200 steps at lr 2e-5, 3 seeds) the snapped start ended at 1.087x ± 0.004 the perplexity of bf16's run, where
round-to-nearest ended at 1.021x ± 0.002.

The grid is the one the layer's cast will use: the weight's own dynamic scales (tensor, row, 128x128 block or 1x32
MX, power of two as the layer's weight policy says). Each scale group's largest element keeps its value and no other
outgrows it, so the dynamic scale computed from the rounded weight is the one GPTQ rounded on. ``-rht``
layers are rounded in their rotated basis and rotated back, ``-sq`` layers in their smoothed one (calibrated on the
first batch first). Layers are processed a decoder block at a time
(:mod:`~hf_lowprec.ondevice.calibration.passes`), each on the inputs the already-rounded ones give it (sequential, as
in GPTQ).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from hf_lowprec.formats import (
    E4M3,
    FP8_MANTISSA_BITS,
    FormatSpec,
    block_shape,
    expand_scale,
    fp8_amax,
    fp8_saturate,
    fp8_scale,
)
from hf_lowprec.modules.fp8 import FP8Linear
from hf_lowprec.ondevice.calibration.awq import output_error
from hf_lowprec.ondevice.calibration.gptq import full_precision, gptq_columns
from hf_lowprec.ondevice.calibration.passes import HESSIAN_BUDGET_BYTES, calibration_passes
from hf_lowprec.rotation import rotate, rotated_hessian, unrotate
from hf_lowprec.smoothing import calibrate_smoothed_layers

logger = logging.getLogger(__name__)

FP8_ROUNDINGS = ("nearest", "gptq")
OFFSET_LIMIT = 0.4  # cells: how far inside its cell a moved weight keeps its place (0.49 crossed cells in bf16)


@dataclass
class FP8Rounding:
    """A weight ``[N, K]`` on its FP8 grid (fp32), and the output errors ``tr(E H E^T) / tr(W H W^T)`` of it and of
    round-to-nearest."""

    weight: torch.Tensor
    output_error: float
    output_error_nearest: float


def _grid(w: torch.Tensor, spec: FormatSpec, power_of_two: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-element scale and scale-group amax of ``w [N, K]`` as the layer's weight cast computes them (``[N, K]``)."""
    block = block_shape(spec.granularity, "weight")
    amax = fp8_amax(w, spec.granularity, -1, block or (1, 1))
    scale = fp8_scale(amax, E4M3, power_of_two)
    if block is None:
        return scale.expand_as(w), amax.expand_as(w)
    return expand_scale(scale, w.shape, block), expand_scale(amax, w.shape, block)


def _cell(scaled: torch.Tensor) -> torch.Tensor:
    """Spacing of the E4M3 grid at ``scaled`` (values in the format's units): ``2^(e-3)`` in ``[2^e, 2^(e+1))``,
    ``2^-9`` among the subnormals."""
    exponent = torch.floor(torch.log2(scaled.abs().clamp(min=2.0**-6)))
    return torch.exp2(exponent - FP8_MANTISSA_BITS[E4M3])


@torch.no_grad()
@full_precision()
def gptq_fp8(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    spec: FormatSpec,
    power_of_two: bool,
    inputs: torch.Tensor | None = None,
    held_in: Sequence[torch.dtype] = (torch.float32,),
) -> FP8Rounding:
    """GPTQ rounding of ``weight [N, K]`` onto its E4M3 grid given ``hessian [K, K]`` (``X^T X`` of the layer's input;
    the output errors computed from those ``inputs [T, K]`` when given).

    The returned weight casts to GPTQ's choice under the layer's own dynamic scales, which equal ``weight``'s (each
    scale group keeps its largest magnitude), also once rounded to each of ``held_in`` (the dtypes the layer stores
    and computes its weight in: a bf16 step is 1/16 of a cell, and 3-7% of the moved weights crossed into the next
    cell); it differs from ``weight`` only where that choice is not the nearest grid point, by whole cells (see the
    module docstring).
    """
    w = weight.detach().float()
    scale, amax = _grid(w, spec, power_of_two)
    pinned = w.abs() == amax

    def to_grid(values: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return fp8_saturate(values * s, E4M3).float() / s

    nearest = to_grid(w, scale)

    def round_column(i: int, values: torch.Tensor) -> torch.Tensor:
        limit = amax[:, i]
        rounded = to_grid(torch.maximum(torch.minimum(values, limit), -limit), scale[:, i])  # no value outgrows amax
        return torch.where(pinned[:, i], nearest[:, i], rounded)

    rounded = gptq_columns(w, hessian, round_column)
    # where GPTQ moved a weight to another grid point: that point plus the weight's offset inside its own cell (in
    # cells, the grid is finer below each power of two); a value beyond its group's amax stays at the amax, which
    # casts to the same point; where the cast would still not give GPTQ's point (a cell edge), the point itself
    offset = ((w - nearest) * scale / _cell(nearest * scale)).clamp(-OFFSET_LIMIT, OFFSET_LIMIT)
    shifted = rounded + offset * _cell(rounded * scale) / scale
    shifted, snapped = (torch.maximum(torch.minimum(t, amax), -amax) for t in (shifted, rounded))
    for dtype in held_in:  # rounded up past the amax, a value would change its group's scale: clamped again
        shifted = torch.maximum(torch.minimum(shifted.to(dtype).float(), amax), -amax)
        shifted = torch.where(to_grid(shifted, scale) == rounded, shifted, snapped)
    stored = torch.where(pinned | (rounded == nearest), w, shifted)
    error = output_error(w, hessian, inputs)
    return FP8Rounding(stored, error(rounded - w), error(nearest - w))


@full_precision()
def _round_layer(layer: FP8Linear, hessian: torch.Tensor, inputs: torch.Tensor | None = None) -> FP8Rounding:
    """Round ``layer``'s master weight in place (in its rotated basis for ``-rht``, its smoothed one for ``-sq``);
    returns the rounding. ``inputs [T, K]``: the calibration inputs behind ``hessian``, where kept."""
    weight, block = layer.weight.detach().float().clone(), layer.rotation_block  # kept: the layer's is rewritten
    if block is not None:  # inputs X R: Hessian R^T H R, weight W R
        weight, hessian = rotate(weight, block), rotated_hessian(hessian, block)
        inputs = None if inputs is None else rotate(inputs, block)
    s = None if layer.smoothing is None else layer.smoothing.scale.float()
    if s is not None:  # inputs X / s: Hessian H / s s^T, weight W diag(s)
        weight, hessian = weight * s, hessian / s[:, None] / s[None, :]
        inputs = None if inputs is None else inputs / s
    power_of_two = layer.scaling["weight"].power_of_two
    held_in = (layer.weight.dtype, torch.bfloat16) if block is None and s is None else (torch.float32,)
    result = gptq_fp8(weight, hessian, layer.spec, power_of_two, inputs, held_in)
    rounded = result.weight if s is None else result.weight / s
    layer.weight.data.copy_(rounded if block is None else unrotate(rounded, block))
    if block is None and s is None:  # held as GPTQ rounded it (held_in): the layer casts GPTQ's points
        return result
    # the error of what the layer casts: a bf16 weight stored rotated back (or unscaled) misses some of GPTQ's points
    cast = _layer_weight(layer)
    scale, _ = _grid(cast, layer.spec, power_of_two)
    actual = fp8_saturate(cast * scale, E4M3).float() / scale
    return replace(result, output_error=output_error(weight, hessian, inputs)(actual - weight))


def _layer_weight(layer: FP8Linear) -> torch.Tensor:
    """The weight ``[N, K]`` (fp32) ``layer``'s forward casts to FP8: in its dtype, smoothed, rotated."""
    weight = layer.weight.detach()
    if layer.smoothing is not None:
        weight = layer.smoothing.weights(weight)
    if layer.rotation_block is not None:
        weight = rotate(weight, layer.rotation_block)
    return weight.float()


@torch.no_grad()
def round_fp8_weights(
    model: nn.Module,
    blocks: "torch.Tensor | Sequence[torch.Tensor]",
    rounding: str = "gptq",
    *,
    batch_size: int = 4,
    budget_bytes: int = HESSIAN_BUDGET_BYTES,
) -> dict:
    """Move the master weight of every ``FP8Linear`` of ``model`` onto the FP8 grid point ``rounding`` chooses,
    calibrated on token ``blocks [n, T]`` (run ``batch_size`` at a time) or a sequence of ``input_ids`` batches;
    returns a summary (layers, median output errors, seconds), also logged.

    ``rounding``: ``gptq``, or ``nearest`` (nothing to do: the layers round to nearest on every step). Raises
    ``ValueError`` for an unknown rounding or a model without FP8 layers.
    """
    if rounding not in FP8_ROUNDINGS:
        raise ValueError(f"unknown FP8 weight rounding {rounding!r}; choose one of {', '.join(FP8_ROUNDINGS)}")
    layers = {n: m for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    if not layers:
        raise ValueError("round_fp8_weights: the model has no FP8Linear layers; apply an fp8 plan first")
    if rounding == "nearest":
        return {"rounding": "nearest", "layers": len(layers)}
    if torch.is_tensor(blocks):
        blocks = [blocks[i : i + batch_size] for i in range(0, len(blocks), batch_size)]
    calibrate_smoothed_layers(model, blocks[0])  # '-sq' layers: rounded on the grid of their smoothed weight
    start, results = time.perf_counter(), {}
    for group, hooks in calibration_passes(model, layers, blocks, budget_bytes):
        for name in group:
            results[name] = _round_layer(layers[name], *hooks.pop(name))
    stats = {
        "rounding": rounding,
        "layers": len(results),
        "tokens": sum(b.numel() for b in blocks),
        "output_error_median": statistics.median(r.output_error for r in results.values()),
        "output_error_nearest_median": statistics.median(r.output_error_nearest for r in results.values()),
        "seconds": time.perf_counter() - start,
    }
    logger.info(
        "FP8 weights rounded by %s on %d tokens: output error %.3g (nearest %.3g), median of %d layers, %.0f s",
        rounding, stats["tokens"], stats["output_error_median"], stats["output_error_nearest_median"], stats["layers"],
        stats["seconds"],
    )  # fmt: skip
    return stats


__all__ = ["FP8_ROUNDINGS", "FP8Rounding", "gptq_fp8", "round_fp8_weights"]
