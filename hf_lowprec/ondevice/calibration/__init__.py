"""Calibrated INT4 codes for the frozen base: activation-aware input scales and/or GPTQ rounding.

``rounding`` names how a layer's INT4 codes are chosen:

- ``nearest``: each weight rounded to its nearest code (no calibration data);
- ``gptq``: codes chosen to preserve the layer's output on calibration tokens
(:mod:`hf_lowprec.ondevice.calibration.gptq`);
- ``awq``: a per-input-channel scale folded into the weight first, chosen on calibration tokens
  (:mod:`hf_lowprec.ondevice.calibration.awq`), then rounding to nearest;
- ``awq+gptq``: both, GPTQ on the scaled weight with the correspondingly scaled Hessian.

All use each layer's own format and grid, so the results pack into
:class:`~hf_lowprec.modules.packed.PackedInt4Linear` like any other. Layers are processed a decoder
block at a time (:mod:`~hf_lowprec.ondevice.calibration.passes`) and packed as they go: later layers are calibrated
on the inputs the already-quantized ones give them (sequential, as in GPTQ), and only a bounded number of input
Hessians exist at once.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
from torch import nn

from hf_lowprec.formats import FormatSpec, quantize_int
from hf_lowprec.modules.packed import BASE_STEP_DTYPE
from hf_lowprec.ondevice.calibration.awq import search_input_scale, stored_steps
from hf_lowprec.ondevice.calibration.gptq import full_precision, gptq_quantize
from hf_lowprec.ondevice.calibration.passes import HESSIAN_BUDGET_BYTES, calibration_passes, hessian_groups
from hf_lowprec.rotation import layer_rotation, rotate, rotated_hessian

logger = logging.getLogger(__name__)

ROUNDINGS = ("nearest", "gptq", "awq", "awq+gptq")


@dataclass
class CalibratedCodes:
    """Codes ``[N, K]`` (int8 symmetric / uint8 asymmetric) of ``W diag(input_scale)``, their grid
    ``step``/``zero`` ``[N, G]`` fp32, the ``input_scale [K]`` (``None``: not scaled) and its ``alpha``,
    and the calibration output error ``tr(E H E^T) / tr(W H W^T)`` of the result and of round-to-nearest.
    :func:`calibrated_codes` returns them with ``codes``, ``step`` and ``zero`` dropped (``None``) once packed."""

    codes: torch.Tensor | None
    step: torch.Tensor | None
    zero: torch.Tensor | None
    input_scale: torch.Tensor | None
    alpha: float | None
    output_error: float
    output_error_nearest: float


def check_rounding(rounding: str) -> str:
    if rounding not in ROUNDINGS:
        raise ValueError(f"unknown rounding {rounding!r}; choose one of {', '.join(ROUNDINGS)}")
    return rounding


@torch.no_grad()
@full_precision()
def calibrate_layer(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    spec: FormatSpec,
    rounding: str,
    step_dtype: torch.dtype = BASE_STEP_DTYPE,
    smoothing: torch.Tensor | None = None,
    inputs: torch.Tensor | None = None,
) -> CalibratedCodes:
    """Codes of ``weight [N, K]`` by ``rounding`` (not ``nearest``) given its input Hessian ``hessian [K, K]``.

    ``step_dtype``: the dtype the packed layer stores its steps in; the codes are chosen on that grid.
    ``smoothing``: a ``-sq`` layer's calibrated ``s [K]`` (:mod:`hf_lowprec.smoothing`), the input scale kept as it is
    (``gptq`` only: the ``awq`` roundings choose their own).
    ``inputs``: the calibration inputs ``X [T, K]`` (``hessian = X^T X``) where they are fewer than the inputs' width:
    the output errors are computed from them, at a fraction of the cost.
    """
    w, h = weight.detach().float(), hessian.float()
    block = layer_rotation(spec, w.shape[1], f"calibrating {spec.name}")
    if block is not None:  # the codes of W R for inputs X R, whose Hessian is R^T H R
        w, h = rotate(w, block), rotated_hessian(h, block)
        inputs = None if inputs is None else rotate(inputs.float(), block)
    awq = check_rounding(rounding).startswith("awq")
    if smoothing is not None and awq:
        raise ValueError(f"rounding {rounding!r} chooses its own input scales; a '-sq' layer takes gptq")
    scale = search_input_scale(w, h, spec, step_dtype, inputs=inputs) if awq else None
    s = smoothing.float() if smoothing is not None else None if scale is None else scale.scale
    scaled = w if s is None else w * s
    step, zero = stored_steps(scaled, spec, step_dtype)
    if rounding.endswith("gptq"):
        # the output error is the same in scaled coordinates (W s, H / s s^T) as in the layer's own
        if s is not None:
            h, inputs = h / s[:, None] / s[None, :], None if inputs is None else inputs / s
        result = gptq_quantize(scaled, h, spec, step, zero, inputs=inputs)
        codes, error, nearest = result.codes, result.output_error, result.output_error_nearest
    else:  # awq: the search already measured its round-to-nearest codes
        codes, error = quantize_int(scaled, spec, step, zero), scale.output_error
    if scale is not None:
        nearest = scale.output_error_unscaled
    return CalibratedCodes(codes, step, zero, s, None if scale is None else scale.alpha, error, nearest)


@torch.no_grad()
def calibrated_codes(
    model: nn.Module,
    layers: dict[str, nn.Module],
    blocks: torch.Tensor,
    replace,
    rounding: str = "gptq",
    *,
    batch_size: int = 4,
    budget_bytes: int = HESSIAN_BUDGET_BYTES,
    progress=None,
    dense_weight=lambda name, module: module.weight,
) -> dict[str, CalibratedCodes]:
    """Codes by ``rounding`` for ``layers`` (fqn → ``Int4Linear`` in model order) calibrated on token ``blocks [n, T]``.

    ``dense_weight(fqn, module)``: the weight to calibrate (default the layer's own); a layer packed already (round to
    nearest, while loading) is calibrated from its checkpoint weight, read one at a time.

    Layers are handled in groups that fit ``budget_bytes`` of Hessians: one calibration pass per group, ``batch_size``
    blocks at a time, a decoder block at a time (:func:`~hf_lowprec.ondevice.calibration.passes.calibration_passes`),
    then each layer's codes are computed and ``replace(fqn, result, hessian, weight)`` swaps it (so later groups see
    quantized inputs; ``hessian [K, K]``: the layer's ``X^T X`` on the calibration tokens; ``weight``: the dense weight
    calibrated, read once). ``progress(done, total)`` after each layer. Returns the results by name without their codes
    and grids, which ``replace`` has packed (kept, they would be a byte per weight: a gigabyte at 1B); nor does it keep
    the layers it replaced.
    """
    if check_rounding(rounding) == "nearest":
        raise ValueError(
            "calibrated_codes: rounding 'nearest' needs no calibration; pack the layers with Int4Linear.freeze()"
        )
    batches = [blocks[i : i + batch_size] for i in range(0, len(blocks), batch_size)]
    out: dict[str, CalibratedCodes] = {}
    pending, total = dict(layers), len(layers)  # a layer leaves once replaced: the old module can be freed
    for group, hooks in calibration_passes(model, pending, batches, budget_bytes):
        for name in group:
            module = pending.pop(name)
            weight = dense_weight(name, module)
            smoothing = None if getattr(module, "smoothing", None) is None else module.smoothing.scale
            hessian, inputs = hooks.pop(name)
            result = calibrate_layer(weight, hessian, module.spec, rounding, smoothing=smoothing, inputs=inputs)
            del module, inputs
            replace(name, result, hessian, weight)
            del weight
            out[name] = dataclasses.replace(result, codes=None, step=None, zero=None)
            if progress is not None:
                progress(len(out), total)
    return out


def summary(results: dict[str, CalibratedCodes]) -> dict:
    """Median relative calibration output error (and AWQ exponent) over the layers, and round-to-nearest's."""
    med = lambda xs: sorted(xs)[len(xs) // 2] if xs else 0.0  # noqa: E731
    alphas = [r.alpha for r in results.values() if r.alpha is not None]
    return {
        "layers": len(results),
        "output_error_median": med([r.output_error for r in results.values()]),
        "output_error_nearest_median": med([r.output_error_nearest for r in results.values()]),
        **({"awq_alpha_median": med(alphas)} if alphas else {}),
    }


__all__ = [
    "ROUNDINGS",
    "CalibratedCodes",
    "calibrate_layer",
    "calibrated_codes",
    "check_rounding",
    "hessian_groups",
    "summary",
]
