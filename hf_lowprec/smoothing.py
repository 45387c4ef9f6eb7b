"""Per-input-channel smoothing of a linear's input (SmoothQuant; Xiao et al., 2023): outlier handling for the ``-sq``
formats.

For a positive ``s [K]``, ``y = x W^T = (x / s)(W diag(s))^T``: quantizing ``x / s`` and ``W diag(s)`` in place of
``x`` and ``W`` changes nothing in exact arithmetic, while an input channel whose activations are ``100x`` the others'
is divided down and its weight column multiplied up, moving the quantization difficulty from the activations to the
weights. ``s_k = max|x_k|^alpha / max|W_:,k|^(1 - alpha)`` with ``alpha = SMOOTHING_ALPHA`` (SmoothQuant's default),
from the input of the layer's first forward of at least ``MIN_CALIBRATION_TOKENS`` tokens ("calibrated on the first
batch"), then fixed and saved with the layer. The Trainer callback and the Accelerate plugin run that forward
before training (:func:`calibrate_smoothing`: the first batches' real tokens, every rank taking rank 0's), the
on-device path on its calibration blocks, so the learned steps re-fitted to ``s`` start training on it. ``s`` is
rounded to powers of two, so dividing by it is exact in every float dtype and the change of basis adds no rounding of
its own.

It pays where activations are quantized to integers: on SmolLM2-135M converted without training, W4A8
(``int4-g64-a8``) 1.590x -> 1.483x the bf16 perplexity (1.307x where the scan chooses per layer), while FP8 (a float
grid whose relative precision does not depend on the scale) and weight-only INT4 (where
:mod:`hf_lowprec.ondevice.calibration.awq` searches its own scales) gain nothing (``benchmarks/outliers.py``;
AVX512-BF16 AMD EPYC).

Written by hand: torchao's SmoothQuant (``torchao.prototype.smoothquant``) replaces the linear with its own
inference-only int8 layer, with no backward and no FP8 or INT4 weights.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from itertools import islice

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hf_lowprec.fp32_state import Fp32State
from hf_lowprec.once_flags import OnceFlags
from hf_lowprec.ranks import distributed, process_world

logger = logging.getLogger(__name__)

SMOOTHING_ALPHA = 0.5
"""Migration strength: the share of an input channel's range moved into its weight column."""
MIN_CALIBRATION_TOKENS = 64
"""Fewest tokens a forward needs to calibrate the smoothing (a single generated token would give a poor ``max|x|``)."""
CALIBRATION_TOKENS = 1024
"""Most tokens :func:`calibrate_smoothing` runs through the model in its one forward (the logits of each are made)."""
_EPS = 1e-5  # channel ranges below this count as this (weights), or as a channel that never fired (inputs)


def smoothing_scale(input_amax: torch.Tensor, weight: torch.Tensor, alpha: float = SMOOTHING_ALPHA) -> torch.Tensor:
    """``s [K]`` (fp32 powers of two) from each input channel's ``max|x| [K]`` and ``weight [N, K]``; 1 for a channel
    that never fired in calibration (``max|x| <= _EPS``: no range to move; the formula divided its weight column down
    to ~2^-9 of its group's step, and would multiply its input by ~512 the day it fires)."""
    weight_amax = weight.detach().abs().amax(0).float().clamp(min=_EPS)
    amax = input_amax.float()
    s = amax.clamp(min=_EPS).pow(alpha) / weight_amax.pow(1 - alpha)
    return torch.where(amax > _EPS, torch.exp2(torch.round(torch.log2(s))), torch.ones_like(s))


class InputSmoothing(Fp32State, OnceFlags):
    """The smoothing ``s [K]`` of one linear: :meth:`inputs` gives ``x / s``, :meth:`weights` ``W diag(s)``.

    Uncalibrated (``s = 1``) until :meth:`calibrate` sees a forward input of ``>= MIN_CALIBRATION_TOKENS`` tokens;
    ``scale`` and ``calibrated`` are buffers, so a saved layer reloads calibrated.
    """

    def __init__(self, in_features: int, device=None):
        super().__init__()
        if device is not None and torch.device(device).type == "meta":
            device = None  # a layer built on "meta" to wrap existing weights: made here, moved to them by .to()
        self.register_buffer("scale", torch.ones(in_features, device=device))
        self.register_buffer("calibrated", torch.zeros((), dtype=torch.bool, device=device))

    @torch.no_grad()
    def calibrate(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Set ``s`` from input ``x [..., K]`` and ``weight [N, K]`` unless calibrated already or ``x`` has too few
        tokens; returns whether this call calibrated."""
        tokens = x.numel() // x.shape[-1]
        if self.flag_set("calibrated") or tokens < MIN_CALIBRATION_TOKENS:
            return False
        amax = x.detach().reshape(-1, x.shape[-1]).abs().amax(0)
        self.scale.copy_(smoothing_scale(amax, weight))
        self.set_flag("calibrated")
        logger.debug("smoothing calibrated on %d tokens: s in [%g, %g]", tokens, self.scale.min(), self.scale.max())
        return True

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K] / s`` in ``x``'s dtype (exact: ``s`` holds powers of two)."""
        return x / self.scale.to(x.dtype)

    def weights(self, w: torch.Tensor) -> torch.Tensor:
        """``w [N, K] diag(s)`` in ``w``'s dtype (exact)."""
        return w * self.scale.to(w.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.scale.numel()}, alpha={SMOOTHING_ALPHA}"


@torch.no_grad()
def calibrate_smoothed_layers(model: nn.Module, input_ids: torch.Tensor) -> int:
    """Run ``input_ids [B, T]`` through ``model`` (eval mode) if it has uncalibrated ``-sq`` layers, each calibrating
    on it; returns how many did. ``ValueError`` if one is left (fewer than ``MIN_CALIBRATION_TOKENS`` tokens)."""
    pending = _uncalibrated(model)
    if not pending:
        return 0
    was_training = model.training
    model.eval()(input_ids=input_ids.to(next(model.parameters()).device), use_cache=False)
    model.train(was_training)
    left = _uncalibrated(model)
    if left:
        raise ValueError(
            f"'-sq' layers {', '.join(n.removesuffix('.smoothing') for n in left[:3])} saw fewer than "
            f"{MIN_CALIBRATION_TOKENS} calibration tokens; pass longer or more token blocks"
        )
    return len(pending)


def _uncalibrated(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, InputSmoothing) and not bool(m.calibrated)]


@torch.no_grad()
def calibrate_smoothing(model: nn.Module, batches: Iterable, count: int) -> int:
    """Calibrate ``model``'s uncalibrated ``-sq`` layers, before training moves them (a layer calibrated by a later
    forward re-fits its learned steps mid-training), on the real tokens of the first ``count`` of ``batches``
    (``input_ids [B, T]``, the ``attention_mask`` zeros left out: padding is no activation range), in rows of ``T``,
    at most :data:`CALIBRATION_TOKENS` of them. Under a process group every rank then takes rank 0's smoothing and
    its layers' states (steps re-fitted to it): DDP broadcasts buffers, not parameters, on each forward.

    Returns how many layers calibrated: none, with a warning, where the batches cannot calibrate them (not dicts with
    ``input_ids``; an encoder-decoder, whose decoder needs inputs of its own; fewer than ``MIN_CALIBRATION_TOKENS``
    real tokens on a rank): they calibrate on their first forward instead. ``ValueError`` for a model FSDP shards:
    calibrate it before wrapping."""
    pending = _uncalibrated(model)
    if not pending:
        return 0
    ranks = distributed()
    if ranks and any(isinstance(p, DTensor) or "FlatParameter" in type(p).__name__ for p in model.parameters()):
        raise ValueError(
            "'-sq' layers of a model FSDP shards calibrate before it is wrapped: give calibration_data= (a few "
            "training batches) so they calibrate when the model is converted"
        )
    tokens, width, why = _real_tokens(model, batches, count)
    enough = torch.tensor(int(tokens.numel() >= MIN_CALIBRATION_TOKENS), device=next(model.parameters()).device)
    if ranks:  # every rank decides alike, or one would wait in the broadcast below for good
        torch.distributed.all_reduce(enough, op=torch.distributed.ReduceOp.MIN)
    if not enough:
        why = why or f"the first {count} batches hold {tokens.numel()} real tokens (padding left out) on a rank"
        say_first_forward_calibrates([n.removesuffix(".smoothing") for n in pending], why)
        return 0
    width = min(width, tokens.numel())
    calibrated = calibrate_smoothed_layers(model, tokens[: tokens.numel() // width * width].view(-1, width))
    if ranks:
        for layer in (m for m in model.modules() if isinstance(getattr(m, "smoothing", None), InputSmoothing)):
            for tensor in (*layer.parameters(), *layer.buffers()):
                torch.distributed.broadcast(tensor.data, src=0)
    return calibrated


def say_first_forward_calibrates(layers: list[str], why: str) -> None:
    """Warn that the ``-sq`` ``layers`` calibrate on their first forward instead of before training (``why``); under
    more than one process, refuse (``ValueError``): each rank would calibrate on its own batch and re-fit its own
    learned steps, parameters DDP never makes alike again."""
    names = ", ".join(layers[:3])
    remedy = f"give calibration_data= (dicts with input_ids, {MIN_CALIBRATION_TOKENS} real tokens or more on each rank)"
    world = process_world()[1]
    if world > 1:
        raise ValueError(
            f"'-sq' layers ({names}) cannot calibrate before training ({why}), and on their first forward each of the "
            f"{world} processes would calibrate on its own batch and re-fit its own learned steps, which train apart "
            f"for good: {remedy}"
        )
    logger.warning(
        "'-sq' layers (%s) calibrate on their first forward of %d tokens or more, re-fitting their learned steps then "
        "(%s); %s to calibrate them before training", names, MIN_CALIBRATION_TOKENS, why, remedy,
    )  # fmt: skip


def _real_tokens(model: nn.Module, batches: Iterable, count: int) -> tuple[torch.Tensor, int, str | None]:
    """``(the real tokens of the first count batches, at most CALIBRATION_TOKENS, [n]; the batches' width; why there
    are none, or None)``."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return torch.zeros(0, dtype=torch.long), 0, "an encoder-decoder's decoder needs inputs of its own"
    real, width = [], 0
    for batch in islice(iter(batches), count):
        if not isinstance(batch, Mapping) or "input_ids" not in batch:
            return torch.zeros(0, dtype=torch.long), 0, "the calibration batches are no dicts with input_ids"
        ids, mask = batch["input_ids"], batch.get("attention_mask")
        real.append(ids[mask.bool()] if mask is not None else ids.reshape(-1))
        width = max(width, ids.shape[-1])
    tokens = torch.cat(real)[:CALIBRATION_TOKENS] if real else torch.zeros(0, dtype=torch.long)
    return tokens, width, None
