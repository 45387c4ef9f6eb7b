"""Scale policies: how a low-precision layer chooses the scale of each tensor it quantizes.

A policy is an ``nn.Module`` (its state lives in buffers, so it travels in ``state_dict``) with one
job: turn the amax of a tensor into an FP8 scale (``q = saturate(x * scale)``). FP8 layers hold one
policy per tensor role: ``input``, ``weight`` and ``grad`` (the gradient of the layer's output).

- :class:`DynamicScaling` — the current tensor's amax (torchao's ``dynamic``).
- :class:`DelayedScaling` — a reduction over the amaxes of the previous casts (TransformerEngine's
  ``DelayedScaling``; torchao removed it). Tensorwise only.
- :class:`GradientScaling` — for quantized gradients: the scale follows a robust running statistic of
  the gradient's amax, spikes beyond ``k`` times it are clipped (or the step skipped) and counted, and
  a power-of-two adjustment reacts to saturation/underflow rates (GradScale, Sun et al. 2020; MS-AMP).
- :class:`DynamicLossScaler` — FP16 loss scaling (torch's ``GradScaler`` plus a skipped-step count).

Every policy can record telemetry (saturated and underflowed elements, last scale;
:mod:`hf_lowprec.training.telemetry` aggregates it over a model); :func:`make_policy_factory` builds the
``policy_factory`` that :func:`hf_lowprec.convert.apply_plan` takes. The integer formats' learned steps
(LSQ) are in :mod:`hf_lowprec.modules.lsq`.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from hf_lowprec.formats import (
    FP8_MAX,
    FormatSpec,
    expand_scale,
    fp8_scale,
)
from hf_lowprec.fp32_state import Fp32State
from hf_lowprec.ranks import distributed

logger = logging.getLogger(__name__)

ROLES = ("input", "weight", "grad")
REDUCTIONS = ("max", "most_recent")
STATISTICS = ("ema", "percentile")
SPIKE_ACTIONS = ("rescale", "clip", "skip")
TELEMETRY_PREFIX = "lowprec/"  # of every telemetry key in Trainer logs
# a policy's telemetry counters (counts, then the last scale's log2): training's statistics, not its numerics
TELEMETRY_BUFFERS = ("tele_elements", "tele_saturated", "tele_underflow", "tele_casts", "tele_scale_log2")


_FORWARD = contextvars.ContextVar("hf_lowprec_casts_of", default="training")
FORWARDS = ("training", "replaying", "evaluating")


@contextlib.contextmanager
def casts_of(forward: str) -> Iterator[None]:
    """Within: the casts of a forward of kind ``forward`` (:data:`FORWARDS`):

    - ``training``: every policy records its statistics and telemetry, and reduces tensorwise amaxes over ranks;
    - ``replaying``: a forward activation checkpointing recomputes in backward, whose casts take the scales the first
      run took (a history that recorded the first run's amax gave other ones: other saved tensors, gradients of
      another function) and count no telemetry twice;
    - ``evaluating``: a forward outside training (the layer in eval mode under ``torch.no_grad``: an evaluation,
      generation, a forward on one rank alone), whose casts take their scales from the statistics as they are and
      change nothing: no amax recorded (an evaluation every step changed delayed scaling's history, so the trained
      weights), no telemetry counted, no amax reduced over ranks (that collective hung a forward run on one rank).
    """
    token = _FORWARD.set(forward)
    try:
        yield
    finally:
        _FORWARD.reset(token)


class ScalePolicy(Fp32State):
    """Base class: ``scale(amax, dtype) -> fp32 scale`` of ``amax``'s shape.

    Args:
        power_of_two: round scales down to a power of two (exact rescaling, as torchao's rowwise
            recipe and DeepSeek-V3 do).
        telemetry: count saturated elements (``|x * scale| > max``) and underflows (``x != 0`` cast
            to 0) of every cast, and keep the last scale, in buffers (see :func:`collect_telemetry`).
        sync: when ``torch.distributed`` is initialized, reduce tensorwise amaxes with ``MAX`` over
            ranks before use, so every rank computes the same scale (row/block amaxes are per token
            and stay local).

    A subclass that sets ``observes = True`` sees every cast through :meth:`observe`.
    """

    observes = False

    def __init__(self, power_of_two: bool = False, *, telemetry: bool = False, sync: bool = False):
        super().__init__()
        self.power_of_two = power_of_two
        self.telemetry = telemetry
        self.sync = sync
        if telemetry:
            self.observes = True
            for name in TELEMETRY_BUFFERS[:-1]:
                self.register_buffer(name, torch.zeros((), dtype=torch.int64))
            self.register_buffer(TELEMETRY_BUFFERS[-1], torch.zeros(()))

    def scale(self, amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    @contextlib.contextmanager
    def recast(self) -> Iterator[None]:
        """Within: casts of the tensor this policy's last cast quantized, along another axis (a rowwise or MX
        backward casts the output gradient per token for grad_x, then per column for grad_W). A policy that decides
        per tensor (:class:`GradientScaling`) takes its first cast's decision again; the others need nothing."""
        yield

    def observe(self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> None:
        """Called after ``x`` was cast to ``q`` with ``scale`` (block scales: ``block`` is their shape).

        ``q`` and ``scale`` are the tensors the layer goes on to use: a policy may change them in place
        (:class:`GradientScaling` does, to rescale or drop a spike).
        """
        if self.telemetry and _FORWARD.get() == "training":
            self._count(x, q, scale, block)

    @torch.no_grad()
    def _count(self, x, q, scale, block, used: torch.Tensor | bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """This cast's (saturated, underflow) fractions as fp32 scalars; added to the telemetry buffers
        when ``used`` (a bool tensor keeps this free of host syncs)."""
        full = expand_scale(scale, x.shape, block) if block is not None else scale
        limit = (
            FP8_MAX[q.dtype] * (1 + 2**-20) / full
        )  # the amax itself maps to FP8_MAX up to fp32 rounding: not clipped
        saturated = (x.abs().float() > limit).sum()
        underflow = ((q.view(torch.uint8) & 0x7F) == 0).logical_and_(x != 0).sum()
        used = torch.as_tensor(used).long()
        self.tele_elements += x.numel() * used
        self.tele_saturated += saturated * used
        self.tele_underflow += underflow * used
        self.tele_casts += used
        self.tele_scale_log2.copy_(torch.where(used > 0, torch.log2(scale.float()).mean(), self.tele_scale_log2))
        return saturated.float() / x.numel(), underflow.float() / x.numel()

    def _reduce_amax(self, amax: torch.Tensor) -> torch.Tensor:
        """``amax`` reduced with MAX over ranks when ``sync`` and distributed (tensorwise only; not outside training:
        :func:`casts_of`); a NaN on any rank gives inf on every rank."""
        if self.sync and amax.dim() == 0 and distributed() and _FORWARD.get() != "evaluating":
            # a NaN as inf, the largest value (gloo's MAX kept a NaN from rank 0 but dropped rank 1's, so no rank saw
            # the NaN gradient); an inf stays inf (nan_to_num's default made it 3.4e38, a finite level)
            amax = torch.where(amax.isnan(), float("inf"), amax)
            torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX)
        return amax

    def extra_repr(self) -> str:
        return f"power_of_two={self.power_of_two}, telemetry={self.telemetry}, sync={self.sync}"


def _record_in(history: torch.Tensor, recorded: torch.Tensor, record: torch.Tensor, amax: torch.Tensor) -> None:
    """Write ``amax`` into the ring buffer ``history [L]`` at slot ``recorded % L`` where ``record`` (0-d tensors): as
    a mask, not ``history[slot] = ...``, whose tensor index torch.compile turns into a host sync and a graph break."""
    at = torch.arange(history.numel(), device=history.device) == recorded % history.numel()
    history.copy_(torch.where(at & record, amax, history))


class DynamicScaling(ScalePolicy):
    """Scale from the current tensor's amax (torchao's ``dynamic`` scaling)."""

    def scale(self, amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return fp8_scale(self._reduce_amax(amax), dtype, self.power_of_two)


class DelayedScaling(ScalePolicy):
    """Scale from the amaxes of the previous ``history_len`` casts (TransformerEngine's DelayedScaling).

    The cast at step ``t`` uses ``reduction`` (``max`` or ``most_recent``) over the amaxes recorded
    at steps ``t-L .. t-1`` — values above that saturate — and then records its own amax. The first
    cast, with an empty history, uses its own amax; all-zero and inf/NaN casts are not recorded. ``margin``: scales are divided by ``2**margin``
    (headroom, as in TransformerEngine). Tensorwise scales only: per-token amaxes have no history.
    """

    def __init__(
        self, history_len: int = 16, reduction: str = "max", margin: int = 0, power_of_two: bool = False, **kwargs
    ):
        super().__init__(power_of_two, **kwargs)
        if history_len < 1:
            raise ValueError(f"history_len must be >= 1, got {history_len}")
        if reduction not in REDUCTIONS:
            raise ValueError(f"unknown amax reduction {reduction!r}; choose one of {', '.join(REDUCTIONS)}")
        self.history_len, self.reduction, self.margin = history_len, reduction, margin
        self.register_buffer("amax_history", torch.zeros(history_len))
        self.register_buffer("recorded", torch.zeros((), dtype=torch.int64))
        self.register_buffer("last_scale", torch.ones(()), persistent=False)  # for a replayed forward

    @torch.no_grad()
    def scale(self, amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if amax.dim() != 0:
            raise ValueError(
                f"DelayedScaling needs tensorwise scales (format 'fp8'), got an amax of shape {tuple(amax.shape)}; "
                "use dynamic or gradient scaling for fp8-rowwise and fp8-block"
            )
        if _FORWARD.get() == "replaying":  # the forward activation checkpointing recomputes: its first run's scale
            return self.last_scale.clone()
        amax = self._reduce_amax(amax.float())
        if self.reduction == "max":
            past = self.amax_history.max()
        else:
            past = self.amax_history[(self.recorded - 1) % self.history_len]
        reference = torch.where(self.recorded == 0, amax, past)
        if _FORWARD.get() == "evaluating":
            return fp8_scale(reference, dtype, self.power_of_two) / 2.0**self.margin
        # an inf/NaN amax (an overflowed gradient: a step the loss scaler skips) is not recorded: in the history it
        # made the next history_len scales 0 or NaN; nor is an all-zero cast's 0 (a micro-batch whose labels are all
        # -100, a zero-initialised weight), which carries no level: the next cast scaled to 0 saturated every value
        kept = torch.isfinite(amax) & (amax > 0)
        _record_in(self.amax_history, self.recorded, kept, amax)
        self.recorded += kept.long()
        scale = fp8_scale(reference, dtype, self.power_of_two) / 2.0**self.margin
        self.last_scale.copy_(scale)
        return scale

    def extra_repr(self) -> str:
        return (
            f"history_len={self.history_len}, reduction={self.reduction}, margin={self.margin}, {super().extra_repr()}"
        )


ADDED_BUFFERS = ("level_streak",)
"""GradientScaling buffers added after states were saved (2026-12-07, ``new_level_after``): a state without them
loads with their initial zeros (no streak under way)."""


class GradientScaling(ScalePolicy):
    """Scale for quantized gradients that follows a robust running statistic instead of the raw max.

    Per cast, with ``a`` the tensor's amax and ``r`` the running statistic (``ema``: exponential moving
    average with ``ema_decay``; ``percentile``: that percentile of the last ``history_len``) of past
    amaxes, each winsorized at ``spike_threshold * r`` before it is recorded (so one spike barely moves
    ``r``); ``new_level_after`` consecutive casts whose amax lies above ``spike_threshold * r`` are a lasting rise
    of level (warmup casts far below the later level, a new phase of training): ``r`` restarts from the last one's
    amax, which is not a spike (the casts before it were). A fall is followed by ``r``'s own decay: restarted after a
    quiet spell, ``r`` made the return to the usual level a spike:

    - the scale maps ``limit = r * 2**-adjust`` onto the format's max (row/block scales: each group's
      amax, capped at ``limit``), so values beyond ``limit`` saturate — FP8 casts clip, they never
      overflow — and one outlier does not stretch the grid for every other value;
    - ``a > spike_threshold * r`` is a spike, and so is an inf/NaN ``a``, counted and handled per ``spike_action``:
      ``rescale`` (default) shrinks the whole gradient so its amax is ``limit`` (magnitude clipping:
      direction kept, quantized at full resolution; an inf/NaN one is clipped instead, a NaN left where it
      was); ``clip`` clips values at ``limit`` (saturation);
      ``skip`` zeroes this gradient and requests a step skip (see :func:`skip_step_if_requested`);
    - ``adjust`` (a power of two, within ``±max_adjust``) drops by one when more than
      ``saturation_tol`` of a non-spike cast saturates, and rises by one after ``growth_interval``
      consecutive casts that lose more than ``underflow_tol`` to zero without saturating
      (GradScale, Sun et al. 2020; MS-AMP's automatic scaling factor).

    The first ``warmup`` casts only feed the statistic (dynamic scale, no spike test); all-zero
    gradients are not recorded. With ``sync=True`` the amax and the saturation/underflow fractions are
    reduced with MAX over ranks, so every rank takes the same decisions. Telemetry is always on.
    Telemetry counts are per cast: a rowwise backward casts each gradient twice, the second time under
    :meth:`recast`, which takes the first cast's decision (spike, limit) again and records nothing (judged twice, a
    spike between 8x and 13.6x the statistic was rescaled for grad_x and only clipped for grad_W, and lowered
    ``adjust``). ``rescale`` and ``skip`` act on the cast's output in place, in :meth:`observe`.
    """

    observes = True

    def __init__(
        self,
        statistic: str = "ema",
        ema_decay: float = 0.9,
        history_len: int = 16,
        percentile: float = 50.0,
        spike_threshold: float = 8.0,
        spike_action: str = "rescale",
        warmup: int = 2,
        saturation_tol: float = 1e-3,
        underflow_tol: float = 1e-2,
        growth_interval: int = 4,
        max_adjust: int = 4,
        new_level_after: int = 3,
        power_of_two: bool = True,
        telemetry: bool = True,
        sync: bool = False,
    ):
        if not telemetry:
            raise ValueError("GradientScaling needs telemetry=True: its scale adjustments read the saturation counts")
        super().__init__(power_of_two, telemetry=True, sync=sync)
        if statistic not in STATISTICS:
            raise ValueError(f"unknown gradient statistic {statistic!r}; choose one of {', '.join(STATISTICS)}")
        if spike_action not in SPIKE_ACTIONS:
            raise ValueError(f"unknown spike_action {spike_action!r}; choose one of {', '.join(SPIKE_ACTIONS)}")
        if not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1), got {ema_decay}")
        if not 0.0 < percentile <= 100.0:
            raise ValueError(f"percentile must be in (0, 100], got {percentile}")
        if spike_threshold <= 1.0:
            raise ValueError(f"spike_threshold must be > 1, got {spike_threshold}")
        for option, value, low in (("history_len", history_len, 1), ("warmup", warmup, 1),
                                   ("growth_interval", growth_interval, 1), ("max_adjust", max_adjust, 0),
                                   ("new_level_after", new_level_after, 2)):  # fmt: skip
            if value < low:
                raise ValueError(f"{option} must be >= {low}, got {value}")
        for option, value in (("saturation_tol", saturation_tol), ("underflow_tol", underflow_tol)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{option} (a fraction of the tensor's elements) must be in [0, 1], got {value}")
        self.statistic, self.ema_decay, self.percentile = statistic, ema_decay, percentile
        self.spike_threshold, self.spike_action, self.warmup = spike_threshold, spike_action, warmup
        self.saturation_tol, self.underflow_tol = saturation_tol, underflow_tol
        self.growth_interval, self.max_adjust, self.new_level_after = growth_interval, max_adjust, new_level_after
        int_zero = torch.zeros((), dtype=torch.int64)
        self.register_buffer("running_amax", torch.zeros(()))
        self.register_buffer("amax_history", torch.full((history_len,), float("nan")))
        for name in ("recorded", "adjust", "clean_streak", "level_streak", "spikes", "skips_requested"):
            self.register_buffer(name, int_zero.clone())
        self.register_buffer("last_spike", torch.zeros((), dtype=torch.bool))
        self.register_buffer("last_shrink", torch.ones(()))
        self.register_buffer("skip_pending", torch.zeros((), dtype=torch.bool))
        self._last_limit: torch.Tensor | None = None  # the last judged cast's limit (a recast's: the same)
        self._last_rescale: torch.Tensor | None = None  # whether the last judged cast was rescaled (a recast's too)
        self._recasting = False

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name in ADDED_BUFFERS:  # a state saved before they existed: their initial zeros
            state_dict.setdefault(prefix + name, torch.zeros_like(getattr(self, name)))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @contextlib.contextmanager
    def recast(self) -> Iterator[None]:
        self._recasting = True
        try:
            yield
        finally:
            self._recasting = False

    def _statistic(self) -> torch.Tensor:
        if self.statistic == "ema":
            return self.running_amax
        return torch.nanquantile(self.amax_history, self.percentile / 100.0)

    @torch.no_grad()
    def scale(self, amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        a = self._reduce_amax(amax.float().amax())
        amax = a if amax.dim() == 0 else amax.float()  # tensorwise: the (rank-synced) amax
        if self._recasting and self._last_limit is not None:  # the last cast's tensor again: its decision
            capped = torch.where(self._last_rescale, amax, torch.fmin(amax, self._last_limit))
            return fp8_scale(capped, dtype, self.power_of_two)
        stat = self._statistic()
        warm = (self.recorded >= self.warmup) & (stat > 0)
        finite = torch.isfinite(a)
        level = (a > 0) & finite  # an amax that carries a level
        beyond = warm & level & (a > self.spike_threshold * stat)
        streak = torch.where(beyond, self.level_streak + 1, torch.where(level, 0, self.level_streak))
        new_level = streak >= self.new_level_after
        self.level_streak.copy_(torch.where(new_level, 0, streak))
        judged = warm & ~new_level
        ref = torch.where(judged, stat, a)
        spike = judged & ((a > self.spike_threshold * ref) | ~finite)  # an inf/NaN gradient is abnormal too
        limit = ref * torch.exp2(-self.adjust.float())
        # an inf/NaN one is clipped at the limit, not rescaled (shrunk by limit / inf, it was all NaN)
        rescale = spike & finite if self.spike_action == "rescale" else torch.zeros_like(spike)
        self._last_limit, self._last_rescale = limit, rescale
        # a rescaled spike is quantized at full resolution, its scale shrunk afterwards (observe); a group whose amax
        # is inf/NaN takes the limit (finite values keep their grid, inf saturates, a NaN stays where it was)
        capped = torch.where(rescale, amax, torch.fmin(amax, limit))  # fmin: a NaN amax gives the limit
        self.last_shrink.copy_(torch.where(rescale, limit / a, torch.ones_like(a)))
        # record the amax winsorized at the spike threshold; all-zero gradients carry no level, and an inf/NaN one (an
        # overflowed fp16 gradient: a step the loss scaler skips) none either: recorded in warmup, it held the running
        # amax at inf for good, and no spike was ever found again
        sample = torch.where(judged, torch.minimum(a, self.spike_threshold * ref), a)
        record = level
        if self.statistic == "ema":
            restart = (self.recorded == 0) | new_level
            ema = torch.where(restart, sample, self.ema_decay * self.running_amax + (1 - self.ema_decay) * sample)
            self.running_amax.copy_(torch.where(record, ema, self.running_amax))
        else:
            self.amax_history.masked_fill_(new_level, float("nan"))  # the old level's amaxes
            _record_in(self.amax_history, self.recorded, record, sample)
        self.recorded += record
        self.spikes += spike
        self.last_spike.copy_(spike)
        return fp8_scale(capped, dtype, self.power_of_two)

    @torch.no_grad()
    def observe(self, x, q, scale, block) -> None:
        spike = self.last_spike
        if self.spike_action == "rescale":
            scale.div_(self.last_shrink)  # dequantized values shrink by limit / amax
        dropped = spike & (self.spike_action == "skip")
        saturated, underflow = self._count(x, q, scale * self.last_shrink, block, used=~dropped)
        if self._recasting:  # judged with the first cast: its output dropped alike, nothing else moves
            if self.spike_action == "skip":
                q.view(torch.uint8).masked_fill_(spike, 0)
            return
        if self.sync and distributed():
            rates = torch.stack((saturated, underflow))
            torch.distributed.all_reduce(rates, op=torch.distributed.ReduceOp.MAX)
            saturated, underflow = rates[0], rates[1]
        if self.spike_action == "skip":
            q.view(torch.uint8).masked_fill_(spike, 0)  # the cast's output feeds the backward GEMMs: drop it
            self.skips_requested += spike
            self.skip_pending |= spike
        calm = ~spike
        down = calm & (saturated > self.saturation_tol)
        starving = calm & ~down & (saturated == 0) & (underflow > self.underflow_tol)
        streak = torch.where(starving, self.clean_streak + 1, torch.zeros_like(self.clean_streak))
        up = streak >= self.growth_interval
        self.clean_streak.copy_(torch.where(up, torch.zeros_like(streak), streak))
        self.adjust.copy_((self.adjust - down.long() + up.long()).clamp(-self.max_adjust, self.max_adjust))

    def extra_repr(self) -> str:
        return (
            f"statistic={self.statistic}, spike_threshold={self.spike_threshold}, spike_action={self.spike_action}, "
            f"{super().extra_repr()}"
        )


# ------------------------------------------------------------------------------------ factories


POLICIES = {"dynamic": DynamicScaling, "delayed": DelayedScaling, "gradient": GradientScaling}
SCALERS = tuple(POLICIES)


def _options_of(cls) -> set[str]:
    names: set[str] = set()
    for klass in (cls, ScalePolicy):
        names |= {p for p in inspect.signature(klass.__init__).parameters if p not in ("self", "kwargs")}
    return names


def make_policy(name: str, **kwargs) -> ScalePolicy:
    """Build a scale policy by name (``dynamic``, ``delayed``, ``gradient``) with its options."""
    if name not in POLICIES:
        raise ValueError(f"unknown scale policy {name!r}; choose one of {', '.join(POLICIES)}")
    cls = POLICIES[name]
    unknown = set(kwargs) - _options_of(cls)
    if unknown:
        raise ValueError(
            f"scale policy {name!r}: unknown options {sorted(unknown)}; allowed: {sorted(_options_of(cls))}"
        )
    return cls(**kwargs)


def needs_tensorwise(formats: list[str]) -> str:
    """Why delayed scaling cannot scale ``formats`` (rowwise/block FP8), and what to choose instead."""
    return (
        f"needs tensorwise fp8 (format 'fp8'), not {', '.join(formats)}; choose scaler 'dynamic' or 'gradient' for "
        "rowwise/blockwise layers"
    )


@dataclass(frozen=True)
class PolicyFactory:
    """``(layer name, role, spec) -> ScalePolicy`` for :func:`hf_lowprec.convert.apply_plan`.

    ``scaler`` names the policy of the ``grad`` role (``dynamic``, ``delayed`` or ``gradient``);
    ``input``/``weight`` use ``delayed`` when ``scaler="delayed"`` and ``dynamic`` otherwise.
    ``options`` go to the gradient policy; ``telemetry``, ``sync`` and ``power_of_two`` (default: power
    of two for row/block scales, as FP8Linear does) go to every role.
    """

    scaler: str = "dynamic"
    options: Mapping = field(default_factory=dict)
    telemetry: bool = True
    sync: bool = False
    power_of_two: bool | None = None

    def __post_init__(self):
        if self.scaler not in SCALERS:
            raise ValueError(f"unknown scaler {self.scaler!r}; choose one of {', '.join(SCALERS)}")
        allowed = _options_of(POLICIES[self.scaler]) - {"telemetry", "sync", "power_of_two"}
        unknown = set(self.options) - allowed
        if unknown:
            raise ValueError(f"scaler {self.scaler!r}: unknown options {sorted(unknown)}; allowed: {sorted(allowed)}")
        self("probe", "grad", FormatSpec.parse("fp8"))  # the options' values checked now, not at the first layer

    def __call__(self, name: str, role: str, spec: FormatSpec) -> ScalePolicy:
        if role not in ROLES:
            raise ValueError(f"unknown tensor role {role!r}; choose one of {', '.join(ROLES)}")
        if self.scaler == "delayed" and spec.granularity != "tensor":
            raise ValueError(f"layer {name!r}: delayed scaling {needs_tensorwise([spec.name])}")
        pow2 = spec.granularity != "tensor" if self.power_of_two is None else self.power_of_two
        common = {"telemetry": self.telemetry, "sync": self.sync}
        if role == "grad" or self.scaler == "delayed":
            if self.scaler == "gradient":
                common["telemetry"] = True
            return POLICIES[self.scaler](**dict(self.options), power_of_two=pow2, **common)
        return DynamicScaling(pow2, **common)

    def to_dict(self) -> dict:
        return {
            "scaler": self.scaler,
            "options": dict(self.options),
            "telemetry": self.telemetry,
            "sync": self.sync,
            "power_of_two": self.power_of_two,
        }


def make_policy_factory(
    scaler: str = "dynamic", *, telemetry: bool = True, sync: bool = False, power_of_two: bool | None = None, **options
) -> PolicyFactory:
    """The ``policy_factory`` for ``apply_plan``: e.g. ``make_policy_factory("gradient", spike_action="skip",
    sync=True)``."""
    return PolicyFactory(scaler, dict(options), telemetry, sync, power_of_two)


# ---------------------------------------------------------------------------- FP16 loss scaling


class DynamicLossScaler(torch.amp.GradScaler):
    """FP16 dynamic loss scaling: multiply the loss by ``scale``, skip the step and halve ``scale`` when a
    gradient is inf/NaN, double it after ``growth_interval`` clean steps.

    That scheme is exactly torch's ``GradScaler`` (CPU and CUDA), which this class is; it adds only what
    torch lacks for telemetry: ``steps_skipped``, counted in :meth:`update` and kept in ``state_dict``.
    Use as ``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()`` with fp32 (master)
    weights under ``torch.autocast(..., dtype=torch.float16)``: torch refuses to unscale fp16 gradients.
    """

    def __init__(
        self,
        device: str = "cpu",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ):
        super().__init__(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)
        self.steps_skipped = 0

    def update(self, new_scale=None) -> None:
        if not self.is_enabled():
            return
        before = self.get_scale()
        super().update(new_scale)
        if new_scale is None and self.get_scale() < before:
            self.steps_skipped += 1

    def state_dict(self) -> dict:
        state = super().state_dict()
        if state:
            state["steps_skipped"] = self.steps_skipped
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state = dict(state_dict)
        self.steps_skipped = int(state.pop("steps_skipped", 0))
        super().load_state_dict(state)

    def telemetry(self) -> dict[str, float]:
        """``lowprec/loss_scale`` and ``lowprec/loss_scale_steps_skipped``."""
        return {
            f"{TELEMETRY_PREFIX}loss_scale": self.get_scale(),
            f"{TELEMETRY_PREFIX}loss_scale_steps_skipped": float(self.steps_skipped),
        }
