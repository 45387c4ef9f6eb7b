"""What :class:`~hf_lowprec.training.callback.LowPrecisionCallback` and
:class:`~hf_lowprec.training.accelerate.LowPrecisionPlugin` share: their options (validated once), the plan (fixed, or
found by a scan of calibration batches), the conversion and its bookkeeping (report, coverage, learned parameters),
and the ``lowprec/`` telemetry. The callback and the plugin only react to their framework's events.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import logging
import random
import time
from collections.abc import Iterable, Mapping, Sequence
from itertools import islice

import numpy as np
import torch
from torch import nn
from transformers.utils.logging import tqdm

from hf_lowprec import sensitivity
from hf_lowprec.convert import ConversionReport, apply_plan, eligible_layers
from hf_lowprec.formats import FormatSpec
from hf_lowprec.layers import dense_views, task_head_name
from hf_lowprec.modules.fp8 import FP8_BACKENDS
from hf_lowprec.plan import (
    PrecisionPlan,
    converts_nothing,
    format_shares,
    is_auto,
    kept_label,
    names_a_format,
    resolve_plan,
)
from hf_lowprec.ranks import process_world
from hf_lowprec.scaling import TELEMETRY_PREFIX, make_policy_factory, needs_tensorwise
from hf_lowprec.smoothing import calibrate_smoothing
from hf_lowprec.training.compensation import METHODS as COMPENSATIONS
from hf_lowprec.training.new_parameters import align_new_parameters
from hf_lowprec.training.telemetry import collect_telemetry

logger = logging.getLogger(__name__)


def coverage(model: nn.Module, report: ConversionReport) -> dict[str, float]:
    """``params_<fmt>``: fraction of eligible parameters per applied format; ``flops_<fmt>``: of Linear FLOPs (a tied
    head's counted).
    Layers the plan leaves in high precision count as ``kept`` (their own dtype, fp32 or bf16, as the model card
    says), not under the plan's ``bf16``.

    A Linear's FLOPs per token are proportional to its weight size; embedding lookups do no GEMM.
    """
    out = {f"params_{fmt}": frac for fmt, frac in report.fractions(kept=True).items()}
    layers = dense_views(model)  # a packed layer's is an nn.Linear: it multiplies
    # by weight size, not the report's params: a head tied to the embedding holds none, and multiplies all the same
    linear = [
        (kept_label(r.applied), view.weight.numel())
        for r in report.layers
        if isinstance(view := layers.get(r.name), nn.Linear)
    ]
    out.update({f"flops_{fmt}": frac for fmt, frac in format_shares(linear).items()})
    return out


@contextlib.contextmanager
def _preserved_rng(batches=None):
    """Run a block without moving Python, NumPy or torch random streams (a scan must not change training), nor the
    generators a DataLoader ``batches`` shuffles with (its own, its sampler's), which reading its batches moves."""
    py, npy = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    batch_sampler = getattr(batches, "batch_sampler", None)
    owners = (batches, getattr(batches, "sampler", None), getattr(batch_sampler, "sampler", None))
    generators = {id(g): g for o in owners if isinstance(g := getattr(o, "generator", None), torch.Generator)}
    states = [(g, g.get_state()) for g in generators.values()]
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:  # a scan that failed (a budget, an interrupt) leaves them as they were too
        random.setstate(py)
        np.random.set_state(npy)
        for generator, state in states:
            generator.set_state(state)


def _same_on_all_ranks(plan: PrecisionPlan) -> PrecisionPlan:
    """Rank 0's plan on every rank (scans on different batches could disagree)."""
    rank, world = process_world()
    if world == 1:
        return plan
    box = [plan.to_dict() if rank == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)
    return PrecisionPlan.from_dict(box[0])


def trainer_autocast(args):
    """The autocast a ``Trainer`` with ``TrainingArguments`` ``args`` computes under, as Accelerate decides it: bf16 on
    any device, fp16 off CPUs (on a CPU, Accelerate runs ``fp16=True`` in fp32); else none."""
    device = args.device.type
    if getattr(args, "bf16", False):
        return torch.autocast(device, torch.bfloat16)
    if getattr(args, "fp16", False) and device != "cpu":
        return torch.autocast(device, torch.float16)
    return contextlib.nullcontext()


@contextlib.contextmanager
def scan_progress(show: bool):
    """A progress bar for an ``auto`` scan (minutes on a CPU, before training's own progress moves), on the main
    process when ``show``; yields the scan's ``progress(done, total, description)``, or ``None`` without a bar."""
    if not show or process_world()[0] != 0:
        yield None
        return
    bar = tqdm(desc="hf-lowprec sensitivity scan", unit="pass")

    def progress(done: int, total: int, description: str) -> None:
        bar.total, bar.n = total, done
        bar.set_postfix_str(description, refresh=True)

    try:
        yield progress
    finally:
        bar.close()


def scan_plan(
    model: nn.Module, batches: Iterable[Mapping], options, computing=contextlib.nullcontext(), progress=None
) -> tuple[PrecisionPlan, float]:
    """Scan the first ``options.calibration_batches`` batches, allocate under ``options.budget``; ``(plan, seconds)``.

    ``options`` carries ``calibration_batches``, ``formats``, ``scan_method``, ``budget`` (a
    ``sensitivity.Budget``, a dict of its fields, or None), ``seed`` and ``kept(model)``, the layers kept out of the
    allocation. ``computing``: the context training
    computes in (its autocast, if any), which the scan then computes in too. ``progress``: the scan's
    ``progress(done, total, description)``. Random streams are left as they were;
    under several processes every rank gets rank 0's plan.
    """
    keep = options.kept(model)
    sensitivity.check_budget(model, options.formats, options.budget, keep=keep)  # not after minutes of scan
    start = time.perf_counter()
    was_training = model.training
    try:
        with _preserved_rng(batches), computing:
            data = list(islice(iter(batches), options.calibration_batches))
            if not data:
                raise ValueError("plan='auto' found no calibration batches to scan")
            result = sensitivity.scan(
                model, data, formats=options.formats, method=options.scan_method, seed=options.seed, progress=progress
            )
    finally:
        model.train(was_training)
    plan = sensitivity.allocate(result, options.budget, keep=keep)
    return _same_on_all_ranks(plan), time.perf_counter() - start


def _string_tuple(value: str | Iterable[str] | None, argument: str) -> tuple[str, ...] | None:
    """``value`` as a tuple of strings: a single string is one name (as PEFT's ``target_modules`` takes one)."""
    if value is None or isinstance(value, str):
        return value if value is None else (value,)
    items = tuple(value) if isinstance(value, Iterable) and not isinstance(value, Mapping) else None
    if items is None or not all(isinstance(v, str) for v in items):
        raise ValueError(f"{argument}= takes a string or a list of strings, got {value!r}")
    return items


class LowPrecisionSession:
    """Options, plan, conversion and telemetry of one training run (see the module docstring).

    Args: as for :class:`~hf_lowprec.training.callback.LowPrecisionCallback` (``calibration_data`` aside).
    After :meth:`record`: ``plan``, ``report``, ``coverage``, ``model`` and ``new_params`` (the learned
    parameters the conversion added, in model order); ``scan_seconds`` and ``steps_skipped`` count.
    """

    def __init__(
        self,
        plan="auto",
        *,
        keep: str | Sequence[str] | None = None,
        budget=None,
        formats: str | Sequence[str] | None = None,
        calibration_batches: int = 4,
        scan_method: str | None = None,
        scaler: str = "dynamic",
        scaler_options: Mapping | None = None,
        fp8_backend: str = "auto",
        learn_scales: bool = True,
        sync: bool | None = None,
        compensation: str | None = None,
        fp8_rounding: str = "nearest",
        seed: int = 0,
    ):
        from hf_lowprec.ondevice.calibration.fp8 import FP8_ROUNDINGS  # hf_lowprec.ondevice imports PEFT: not at import

        self.auto = is_auto(plan)
        auto_only = {"budget": budget, "formats": formats, "scan_method": scan_method}
        given = [f"{name}=" for name, value in auto_only.items() if value is not None]
        if not self.auto and given:
            fixed = f"plan={plan!r}" if isinstance(plan, str) else "a fixed plan"
            raise ValueError(
                f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only to plan='auto' (the sensitivity "
                f"scan), not to {fixed}: drop {'it' if len(given) == 1 else 'them'} or pass plan='auto'"
            )
        sensitivity.check_budget_fields(budget, scan_method)  # now, not when training starts
        keep = _string_tuple(keep, "keep")
        formats = sensitivity.DEFAULT_FORMATS if formats is None else _string_tuple(formats, "formats")
        scan_method = "auto" if scan_method is None else scan_method
        if scan_method not in sensitivity.METHODS:
            raise ValueError(f"unknown scan_method {scan_method!r}; choose one of {', '.join(sensitivity.METHODS)}")
        if calibration_batches < 1:
            raise ValueError(f"calibration_batches must be >= 1, got {calibration_batches}")
        if fp8_backend not in FP8_BACKENDS:
            raise ValueError(f"unknown fp8_backend {fp8_backend!r}; choose one of {', '.join(FP8_BACKENDS)}")
        sensitivity.check_formats(formats)  # a high-precision one or a duplicate, now, not when training starts
        if compensation is not None and compensation not in COMPENSATIONS:
            raise ValueError(f"unknown compensation {compensation!r}; choose one of {', '.join(COMPENSATIONS)} or None")
        if fp8_rounding not in FP8_ROUNDINGS:
            raise ValueError(f"unknown fp8_rounding {fp8_rounding!r}; choose one of {', '.join(FP8_ROUNDINGS)}")
        if own := sorted({"sync", "telemetry", "power_of_two"} & set(scaler_options or {})):
            raise ValueError(
                f"scaler_options {own}: set for every scale by hf_lowprec (pass sync= itself); the scaler's options "
                "are its own, e.g. {'spike_action': 'skip'}"
            )
        make_policy_factory(scaler, **dict(scaler_options or {}))  # raises for unknown names/options and bad values
        self.plan: PrecisionPlan | None = None if self.auto else resolve_plan(plan, keep or ())
        planned = formats if self.auto else [self.plan.default, *self.plan.layers.values()]
        planned = [FormatSpec.parse(f) for f in planned]
        not_tensorwise = [s.name for s in planned if s.family == "fp8" and s.granularity != "tensor"]
        if scaler == "delayed" and not_tensorwise:  # now, not at the first layer (after an auto plan's scan)
            raise ValueError(f"scaler 'delayed' {needs_tensorwise(not_tensorwise)}")
        self.keep = keep
        self.budget, self.formats = budget, tuple(formats)
        self.calibration_batches, self.scan_method, self.seed = calibration_batches, scan_method, seed
        self.scaler, self.scaler_options = scaler, dict(scaler_options or {})
        self.fp8_backend, self.learn_scales, self.sync = fp8_backend, learn_scales, sync
        self.compensation = None if compensation == "none" else compensation
        self.fp8_rounding = fp8_rounding
        self.rounding: dict | None = None  # round_fp8_weights' summary once the FP8 weights were rounded
        # a format name without keep= keeps the output head of the model it meets (bind)
        self._keeps_head = keep is None and names_a_format(plan)
        self.report: ConversionReport | None = None
        self.coverage: dict[str, float] = {}
        self.scan_seconds = 0.0
        self.steps_skipped = 0
        self.model: nn.Module | None = None
        self.new_params: list[nn.Parameter] = []

    def kept(self, model: nn.Module) -> tuple[str, ...]:
        """The layers ``keep`` leaves in high precision; by default (``keep=None``) ``model``'s output head (a
        classifier's head, :func:`~hf_lowprec.layers.task_head_name`)."""
        if self.keep is not None:
            return self.keep
        head = task_head_name(model)
        return () if head is None or head not in eligible_layers(model) else (head,)

    def bind(self, model: nn.Module) -> PrecisionPlan | None:
        """:attr:`plan` for ``model``: a format-name plan given without ``keep`` leaves ``model``'s output head in
        high precision (as torchtitan's and Accelerate's FP8 recipes do); the plan is then fixed."""
        if self._keeps_head:
            self.plan = PrecisionPlan.uniform(self.plan.default, keep=self.kept(model))
            self._keeps_head = False
        return self.plan

    def scan(
        self, model: nn.Module, batches: Iterable[Mapping], computing=contextlib.nullcontext(), progress=None
    ) -> PrecisionPlan:
        """Find the plan by a scan of ``batches`` (``plan="auto"``) in ``computing``, the context training computes in
        (its autocast, if any), reporting to ``progress`` (see :func:`scan_plan`); the plan becomes :attr:`plan`."""
        self.plan, self.scan_seconds = scan_plan(model, batches, self, computing, progress)
        return self.plan

    def apply(self, model: nn.Module, plan: PrecisionPlan, world: int) -> ConversionReport:
        """:func:`~hf_lowprec.convert.apply_plan` with these options (amaxes synced over ``world`` processes by
        default)."""
        sync = world > 1 if self.sync is None else self.sync
        options = {"scaler": self.scaler, "scaler_options": dict(self.scaler_options), "sync": sync,
                   "fp8_backend": self.fp8_backend, "learn_scales": self.learn_scales}  # fmt: skip
        before = getattr(model, "hf_lowprec_options", None)
        if before is not None and before != options:  # apply_plan leaves layers already in their format as they are
            changed = ", ".join(f"{k}={before.get(k)!r} (now {v!r})" for k, v in options.items() if before.get(k) != v)
            raise ValueError(
                f"this model was converted with {changed}: its converted layers keep theirs; hf_lowprec.revert(model) "
                "first, or load the model afresh, to convert it with these options"
            )
        factory = make_policy_factory(self.scaler, sync=sync, **self.scaler_options)
        report = apply_plan(
            model, plan, fp8_backend=self.fp8_backend, learn_scales=self.learn_scales, policy_factory=factory
        )
        model.hf_lowprec_options = options
        return report

    def smoothed_layers(self) -> list[str]:
        """The converted layers with ``-sq`` formats."""
        return [r.name for r in self.report.swapped if FormatSpec.parse(r.applied).smooth]

    def calibrate_smoothing(self, model: nn.Module, batches: Iterable[Mapping]) -> None:
        """The converted model's uncalibrated ``-sq`` layers calibrated on the first ``calibration_batches`` of
        ``batches`` (:func:`~hf_lowprec.smoothing.calibrate_smoothing`), random streams left as they were."""
        if self.smoothed_layers():
            with _preserved_rng(batches):
                calibrate_smoothing(model, batches, self.calibration_batches)

    def calibrate(self, model: nn.Module, batches: Iterable[Mapping] | None) -> None:
        """Calibrate the converted model on the first ``calibration_batches`` of ``batches`` (their ``input_ids``)
        before training: its ``-sq`` layers' smoothing (:meth:`calibrate_smoothing`; ``batches=None``: none given, the
        callback calibrates them on its training data, else their first forward does), then its FP8 master weights
        moved to the grid points ``fp8_rounding`` chooses (nothing for ``nearest``)."""
        rounds = self.fp8_rounding != "nearest"
        if rounds and not any(FormatSpec.parse(r.applied).family == "fp8" for r in self.report.swapped):
            said = (f"FP8 weight rounding {self.fp8_rounding!r} (fp8_rounding=, a recipe's precision.rounding) rounds "
                    f"FP8 weights, but the plan {self.plan.brief()} puts no layer in FP8")  # fmt: skip
            if not self.auto:
                raise ValueError(f"{said}: use 'nearest', or a plan with FP8 layers")
            logger.warning("%s (the scan chose none): nothing to round", said)  # not the scan's minutes thrown away
            rounds = False
        if batches is None or not (rounds or self.smoothed_layers()):
            batches = []
        else:
            with _preserved_rng(batches):  # read once, for both (a generator of batches is read only once)
                batches = list(islice(iter(batches), self.calibration_batches))
        if batches and self.smoothed_layers():  # a list, read with the random streams kept
            calibrate_smoothing(model, batches, self.calibration_batches)
        if not rounds:
            return
        from hf_lowprec.ondevice.calibration.fp8 import round_fp8_weights

        data = [b["input_ids"] for b in batches]
        if not data:
            raise ValueError(f"fp8_rounding={self.fp8_rounding!r} found no calibration batches")
        self.rounding = round_fp8_weights(model, data, self.fp8_rounding)

    def record(self, model: nn.Module, plan: PrecisionPlan, report: ConversionReport) -> None:
        """Keep what a conversion of ``model`` to ``plan`` did; ``ValueError`` if no layer went to low precision."""
        if not report.swapped:
            raise converts_nothing(plan, model)
        self.plan, self.model, self.report = plan, model, report
        self.new_params = align_new_parameters(model, report.new_parameters.values())
        self.coverage = coverage(model, report)
        logger.info("hf_lowprec: %s", report)

    def telemetry(self) -> dict[str, float]:
        """``lowprec/...``: coverage, the scale policies' telemetry (reading resets their windows), scan time, skips."""
        out = {TELEMETRY_PREFIX + k: v for k, v in self.coverage.items()}
        if self.model is not None:
            out.update(collect_telemetry(self.model))
        out[TELEMETRY_PREFIX + "scan_seconds"] = self.scan_seconds
        out[TELEMETRY_PREFIX + "steps_skipped"] = float(self.steps_skipped)
        return out


def _session_attribute(name: str) -> property:
    """A property reading and writing ``self.session.<name>``."""
    return property(lambda self: getattr(self.session, name), lambda self, value: setattr(self.session, name, value))


def owned_session(owner: str, plan, options: Mapping, also: Sequence[str] = ()) -> LowPrecisionSession:
    """The :class:`LowPrecisionSession` of the keyword ``options`` given to ``owner`` (the class called, taking
    ``also`` besides them): an unknown one is a ``TypeError`` naming ``owner``, the option, the closest allowed one
    and all of them, not one about the session's ``__init__``."""
    allowed = [*(name for name in inspect.signature(LowPrecisionSession).parameters if name != "plan"), *also]
    unknown = [name for name in options if name not in allowed]
    if unknown:
        close = difflib.get_close_matches(unknown[0], allowed, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TypeError(f"{owner} got an unknown option {unknown[0]!r}{hint}; its options: plan, {', '.join(allowed)}")
    return LowPrecisionSession(plan, **options)


class SessionOwner:
    """Base of the callback and the plugin: their session's state under the names users (and a Trainer's saved
    callback state) read and write."""

    session: LowPrecisionSession
    plan = _session_attribute("plan")
    report = _session_attribute("report")
    coverage = _session_attribute("coverage")
    scan_seconds = _session_attribute("scan_seconds")
    steps_skipped = _session_attribute("steps_skipped")
    compensation = _session_attribute("compensation")
