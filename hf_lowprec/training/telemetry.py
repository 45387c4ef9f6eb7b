"""Telemetry of the scale policies over a model (saturation, underflow, scales, gradient spikes) for Trainer logs,
and the optimizer-step skip that :class:`~hf_lowprec.scaling.GradientScaling` may request."""

from __future__ import annotations

import logging

import torch
from torch import nn

from hf_lowprec.convert import canonical_name
from hf_lowprec.ranks import distributed, on_main_process
from hf_lowprec.scaling import TELEMETRY_PREFIX, GradientScaling, ScalePolicy

logger = logging.getLogger(__name__)


def _policies(model: nn.Module):
    """``(layer name, role, policy, layer)`` for every scale policy held by a layer's ``scaling`` dict."""
    for fqn, module in model.named_modules():
        scaling = getattr(module, "scaling", None)
        if isinstance(scaling, nn.ModuleDict):
            for role, policy in scaling.items():
                if isinstance(policy, ScalePolicy):
                    yield canonical_name(fqn), role, policy, module


@torch.no_grad()
def skip_step_if_requested(model: nn.Module) -> bool:
    """If any :class:`GradientScaling` (``spike_action="skip"``) saw a spike since the last call, drop every
    parameter gradient of ``model`` (set to ``None``: optimizers then leave the parameter and its state
    alone) and return True. Call it between ``backward`` and ``optimizer.step``; with a loss scaler
    (``torch.amp.GradScaler``, :class:`~hf_lowprec.scaling.DynamicLossScaler`), after ``scaler.unscale_(optimizer)``:
    a scaler's step asserts when it finds no gradient it unscaled itself. The Trainer callback and the Accelerate
    plugin call it after the unscale.
    """
    skipping = [p for _, _, p, _ in _policies(model) if isinstance(p, GradientScaling) and p.spike_action == "skip"]
    if not skipping:
        return False
    spiked = sum(bool(p.skip_pending) for p in skipping)
    skip = spiked > 0
    if distributed():
        # every rank skips when one does: with sync=False a spike is judged per rank, and the ranks that stepped
        # would leave the one that skipped behind (DDP averaged the same gradients into every rank's parameters)
        flag = torch.tensor(float(skip), device=skipping[0].skip_pending.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        skip = flag.item() > 0
    if not skip:
        return False
    for policy in skipping:
        policy.skip_pending.fill_(False)
    for param in model.parameters():
        param.grad = None
    if on_main_process():  # every rank skips alike
        where = f"in {spiked} casts" if spiked else "on another rank"
        logger.warning("gradient spike %s: optimizer step skipped", where)
    return True


def layer_telemetry(model: nn.Module) -> dict[str, dict[str, dict[str, float]]]:
    """``{layer: {role: {saturation, underflow, scale_log2, casts[, spikes, skips, adjust]}}}`` since the last reset."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, role, policy, _ in _policies(model):
        if not policy.telemetry:
            continue
        n = max(int(policy.tele_elements), 1)
        entry = {
            "saturation": int(policy.tele_saturated) / n,
            "underflow": int(policy.tele_underflow) / n,
            "scale_log2": float(policy.tele_scale_log2),
            "casts": float(policy.tele_casts),
        }
        if isinstance(policy, GradientScaling):
            entry.update(spikes=float(policy.spikes), skips=float(policy.skips_requested), adjust=float(policy.adjust))
        out.setdefault(name, {})[role] = entry
    return out


@torch.no_grad()
def collect_telemetry(model: nn.Module, reset: bool = True) -> dict[str, float]:
    """Telemetry aggregated over every low-precision layer of ``model``, for Trainer logs.

    Keys (``{fmt}`` a format name such as ``fp8``, ``{role}`` one of input/weight/grad; only formats
    and roles whose policies record telemetry appear, and only those that cast since the last reset: layers on
    torchao's kernels compute their scales inside them and record none):

    - ``lowprec/{fmt}/{role}_saturation`` and ``..._underflow``: fraction of elements clipped at the
      format's max / flushed to zero, over all casts since the last reset;
    - ``lowprec/{fmt}/{role}_scale_log2``: mean over layers of log2 of the last scale;
    - ``lowprec/spikes``, ``lowprec/skips_requested``: gradient spikes detected and casts zeroed for a
      step skip, cumulative over training (:class:`GradientScaling`).

    ``reset`` zeroes the per-window counters (not the spike counts) after reading.
    """
    sums: dict[tuple[str, str], list[float]] = {}
    spikes = skips = 0
    any_gradient = False
    for _, role, policy, layer in _policies(model):
        if not policy.telemetry:
            continue
        spec = getattr(layer, "spec", None)
        key = (spec.name if spec is not None else "fp8", role)
        acc = sums.setdefault(key, [0.0, 0.0, 0.0, 0.0, 0.0])
        acc[0] += int(policy.tele_elements)
        acc[1] += int(policy.tele_saturated)
        acc[2] += int(policy.tele_underflow)
        if int(policy.tele_casts):
            acc[3] += float(policy.tele_scale_log2)
            acc[4] += 1
        if isinstance(policy, GradientScaling):
            any_gradient = True
            spikes += int(policy.spikes)
            skips += int(policy.skips_requested)
        if reset:
            for name in ("tele_elements", "tele_saturated", "tele_underflow", "tele_casts"):
                getattr(policy, name).zero_()
    out: dict[str, float] = {}
    for (fmt, role), (n, sat, under, log2sum, layers) in sums.items():
        prefix = f"{TELEMETRY_PREFIX}{fmt}/{role}"
        if n:  # no casts counted (a window without steps; layers on torchao's kernels, which scale inside): no
            # figures, rather than zeros that read as a scale of 1 and nothing saturated
            out[f"{prefix}_saturation"] = sat / n
            out[f"{prefix}_underflow"] = under / n
        if layers:
            out[f"{prefix}_scale_log2"] = log2sum / layers
    if any_gradient:
        out[f"{TELEMETRY_PREFIX}spikes"] = float(spikes)
        out[f"{TELEMETRY_PREFIX}skips_requested"] = float(skips)
    return out
