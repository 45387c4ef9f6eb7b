"""LowPrecisionCallback: FP8/INT4 training inside an unmodified ``transformers.Trainer``.

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[LowPrecisionCallback("fp8")])

When the plan is known without data (a :class:`PrecisionPlan`, a dict, a plan file, a folder holding
``hf_lowprec_plan.json`` such as a checkpoint, a format name, or ``"auto"`` with ``calibration_data``)
the model is converted at ``on_init_end``: before the Trainer builds its optimizer and before it
wraps the model for DDP/FSDP. The optimizer then holds every parameter, learned INT4 steps included,
and ``resume_from_checkpoint`` restores model and optimizer state the usual way.

``plan="auto"`` without calibration data scans the first training batches at ``on_train_begin``
(transformers 5.x has built the optimizer by then). New parameters are inserted into the optimizer
group that holds their layer's weight, in model order: the layout the Trainer builds for a model
converted before it, so a run resumed with the saved plan (``plan=<checkpoint folder>``) loads the
optimizer state unchanged. A learned step trains exactly when its layer's weight does (PEFT-frozen
base layers keep fixed steps).

Every checkpoint gets ``hf_lowprec_plan.json`` and ``hf_lowprec_state.safetensors`` (learned steps and
scale-policy buffers of the low-precision layers, which PEFT's adapter-only checkpoints leave out);
counters travel in ``trainer_state.json`` through :class:`transformers.trainer_callback.ExportableState`.
The plan is written next to the final model at ``on_train_end``. Telemetry goes into the Trainer's
training logs under ``lowprec/`` (see :data:`TELEMETRY_KEYS`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import time
from collections.abc import Iterable, Mapping
from itertools import islice
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import TrainerCallback
from transformers.trainer import OPTIMIZER_NAME
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from hf_lowprec import sensitivity
from hf_lowprec.convert import ConversionReport, apply_plan, as_plan, eligible_layers
from hf_lowprec.formats import FormatSpec
from hf_lowprec.modules import LOW_PRECISION_TYPES
from hf_lowprec.modules.fp8 import FP8_BACKENDS
from hf_lowprec.plan import PLAN_FILE, PrecisionPlan
from hf_lowprec.scaling import TELEMETRY_PREFIX, make_policy_factory
from hf_lowprec.training.compensation import METHODS as COMPENSATIONS
from hf_lowprec.training.compensation import CompensatedOptimizer
from hf_lowprec.training.new_parameters import align_new_parameters, insert_new_parameters, orphaned_parameters
from hf_lowprec.training.telemetry import collect_telemetry, skip_step_if_requested

logger = logging.getLogger(__name__)

STATE_FILE = "hf_lowprec_state.safetensors"
COMPENSATION_FILE = "hf_lowprec_compensation.pt"
TELEMETRY_KEYS = ("scan_seconds", "steps_skipped")
"""Keys (after ``lowprec/``) in every training log. Besides: ``params_<format>`` and ``flops_<format>``,
the fraction of eligible parameters and of Linear FLOPs in each applied format; the scale policies'
``<format>/<role>_saturation``, ``_underflow`` and ``_scale_log2`` (and ``spikes`` with the ``gradient``
scaler, see :func:`hf_lowprec.training.telemetry.collect_telemetry`); ``loss_scale`` under an fp16 GradScaler."""


def coverage(model: nn.Module, report: ConversionReport) -> dict[str, float]:
    """``params_<fmt>``: fraction of eligible parameters per applied format; ``flops_<fmt>``: of Linear FLOPs.

    A Linear's FLOPs per token are proportional to its weight size; embedding lookups do no GEMM.
    """
    out = {f"params_{fmt}": frac for fmt, frac in report.fractions().items()}
    layers = eligible_layers(model)
    linear = [r for r in report.layers if isinstance(layers.get(r.name), nn.Linear)]
    total = sum(r.params for r in linear) or 1
    for r in linear:
        out[f"flops_{r.applied}"] = out.get(f"flops_{r.applied}", 0.0) + r.params / total
    return out


def low_precision_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Learned steps and scale-policy buffers of every low-precision layer, by full name (copies).

    FSDP2-sharded values are gathered, so every rank must call this.
    """
    out = {}
    for fqn, module in model.named_modules():
        if isinstance(module, LOW_PRECISION_TYPES):
            for key, value in module.state_dict().items():
                if key not in ("weight", "bias") and value is not None:
                    value = value.full_tensor() if hasattr(value, "full_tensor") else value
                    out[f"{fqn}.{key}"] = value.detach().clone().contiguous().cpu()
    return out


@contextlib.contextmanager
def _preserved_rng():
    """Run a block without moving Python, NumPy or torch random streams (a scan must not change training)."""
    py, npy = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        yield
    random.setstate(py)
    np.random.set_state(npy)


def process_world() -> tuple[int, int]:
    """``(rank, world size)`` of the default process group (``(0, 1)`` when none)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _same_on_all_ranks(plan: PrecisionPlan) -> PrecisionPlan:
    """Rank 0's plan on every rank (scans on different batches could disagree)."""
    rank, world = process_world()
    if world == 1:
        return plan
    box = [plan.to_dict() if rank == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)
    return PrecisionPlan.from_dict(box[0])


def scan_plan(model: nn.Module, batches: Iterable[Mapping], options) -> tuple[PrecisionPlan, float]:
    """Scan the first ``options.calibration_batches`` batches, allocate under ``options.budget``; ``(plan, seconds)``.

    ``options`` carries ``calibration_batches``, ``formats``, ``scan_method``, ``budget`` (a
    ``sensitivity.Budget``, a dict of its fields, or None), ``keep`` and ``seed``. Random streams are left
    as they were; under several processes every rank gets rank 0's plan.
    """
    start = time.perf_counter()
    was_training = model.training
    with _preserved_rng():
        data = list(islice(iter(batches), options.calibration_batches))
        if not data:
            raise ValueError("plan='auto' found no calibration batches to scan")
        result = sensitivity.scan(model, data, formats=options.formats, method=options.scan_method, seed=options.seed)
    model.train(was_training)
    if isinstance(options.budget, Mapping):
        plan = sensitivity.allocate(result, keep=options.keep, **options.budget)
    else:
        plan = sensitivity.allocate(result, budget=options.budget, keep=options.keep)
    return _same_on_all_ranks(plan), time.perf_counter() - start


def is_auto_plan(plan) -> bool:
    """True for the plan spec ``"auto"`` (scan + allocation)."""
    return isinstance(plan, str) and plan == "auto"


def load_plan_source(plan, keep: tuple[str, ...] = ()) -> PrecisionPlan:
    """A fixed plan from a plan, dict, plan file, folder holding ``hf_lowprec_plan.json``, or format name."""
    if isinstance(plan, (str, os.PathLike)) and Path(plan).is_dir():
        path = Path(plan) / PLAN_FILE
        if not path.is_file():
            raise ValueError(f"plan folder {str(plan)!r} holds no {PLAN_FILE}")
        return PrecisionPlan.load(path)
    if isinstance(plan, str) and Path(plan).suffix not in (".json", ".yaml", ".yml"):
        try:
            return PrecisionPlan.uniform(FormatSpec.parse(plan), keep=keep)
        except ValueError as e:
            raise ValueError(f"plan must be 'auto', a plan file or folder, or a format name: {e}") from None
    if keep:
        raise ValueError("keep= applies to a format-name plan or 'auto'; write kept layers into the plan itself")
    return as_plan(plan)


# ---------------------------------------------------------------------------------- the callback
class LowPrecisionCallback(TrainerCallback, ExportableState):
    """Converts the Trainer's model to a precision plan and keeps it stable and observable in training.

    Args:
        plan: ``"auto"`` (sensitivity scan + budgeted allocation), a :class:`PrecisionPlan`, a dict, a
            ``.json``/``.yaml`` plan file, a folder holding ``hf_lowprec_plan.json`` (a checkpoint:
            pass it to resume an ``auto`` run), or a format name for every Linear (``"fp8"``, ``"int4-g64"``).
        keep: layer names/patterns left in high precision (format-name and ``auto`` plans).
        budget: ``auto`` only: a ``sensitivity.Budget`` or a dict of its fields.
        formats: ``auto`` only: candidate formats of the scan.
        calibration_data: ``auto`` only: model-input batches (e.g. a DataLoader) to scan; with it the
            plan is applied at ``on_init_end``, otherwise the first training batches are scanned at
            ``on_train_begin``.
        calibration_batches: how many batches the scan uses.
        scan_method: ``auto`` only: the scan's ``method``.
        scaler: FP8 scale policy by name (``dynamic``, ``delayed``, ``gradient``); ``scaler_options`` go
            to it (e.g. ``{"spike_action": "skip"}``).
        sync: reduce FP8 tensorwise amaxes with MAX over ranks; default: when more than one process runs.
        compensation: ``kahan`` or ``stochastic``: wrap the Trainer's optimizer in a
            :class:`~hf_lowprec.training.compensation.CompensatedOptimizer` so bf16/fp16 weights train without an
            fp32 master copy (the model must have such weights).
        fp8_backend: ``auto``, ``emulated`` or ``torchao`` (see :class:`hf_lowprec.modules.FP8Linear`).
        learn_scales: train INT4/INT8 group steps (LSQ).
        seed: the scan's seed.
    """

    def __init__(
        self, plan="auto", *, keep: tuple[str, ...] = (), budget=None, formats=("fp8", "int4-g64"),
        calibration_data: Iterable[Mapping] | None = None, calibration_batches: int = 4, scan_method: str = "auto",
        scaler: str = "dynamic", scaler_options: Mapping | None = None, fp8_backend: str = "auto",
        learn_scales: bool = True, sync: bool | None = None, compensation: str | None = None, seed: int = 0,
    ):  # fmt: skip
        self._auto = is_auto_plan(plan)
        if not self._auto and (budget is not None or calibration_data is not None):
            raise ValueError("budget= and calibration_data= apply only to plan='auto'")
        if calibration_batches < 1:
            raise ValueError(f"calibration_batches must be >= 1, got {calibration_batches}")
        if fp8_backend not in FP8_BACKENDS:
            raise ValueError(f"unknown fp8_backend {fp8_backend!r}; choose one of {', '.join(FP8_BACKENDS)}")
        for fmt in formats:
            FormatSpec.parse(fmt)
        if compensation is not None and compensation not in COMPENSATIONS:
            raise ValueError(f"unknown compensation {compensation!r}; choose one of {', '.join(COMPENSATIONS)} or None")
        make_policy_factory(scaler, **dict(scaler_options or {}))  # raises for unknown names/options
        self.keep, self.budget, self.formats = tuple(keep), budget, tuple(formats)
        self.calibration_data, self.calibration_batches, self.scan_method = calibration_data, calibration_batches, scan_method
        self.scaler, self.scaler_options = scaler, dict(scaler_options or {})
        self.fp8_backend, self.learn_scales, self.sync, self.seed = fp8_backend, learn_scales, sync, seed
        self.compensation = None if compensation == "none" else compensation
        self.plan = None if self._auto else load_plan_source(plan, self.keep)
        self._plan_folder = Path(plan) if isinstance(plan, (str, os.PathLike)) and Path(plan).is_dir() else None
        self.report: ConversionReport | None = None
        self.coverage: dict[str, float] = {}
        self.scan_seconds = 0.0
        self.steps_skipped = 0
        self._model: nn.Module | None = None
        self._new_params: list[nn.Parameter] = []
        self._hook = None
        self._optimizer = None

    # -------------------------------------------------------------------------- conversion
    def _convert(self, model: nn.Module, plan: PrecisionPlan) -> None:
        """Apply ``plan`` to ``model``; remember the report and which new parameters train."""
        sync = process_world()[1] > 1 if self.sync is None else self.sync
        factory = make_policy_factory(self.scaler, sync=sync, **self.scaler_options)
        self.report = apply_plan(model, plan, fp8_backend=self.fp8_backend, learn_scales=self.learn_scales, policy_factory=factory)
        if not self.report.swapped:
            raise ValueError(f"the plan puts no layer of {type(model).__name__} in low precision: {plan.to_dict()}")
        for r in self.report.not_applied:
            logger.warning("%s: requested %s, runs %s (%s)", r.name, r.requested, r.applied, r.reason)
        self.plan, self._model = plan, model
        self._new_params = align_new_parameters(model, self.report.new_parameters.values())
        self.coverage = coverage(model, self.report)
        logger.info("hf_lowprec: %s", self.report)

    def _scan(self, model: nn.Module, batches: Iterable[Mapping]) -> PrecisionPlan:
        plan, self.scan_seconds = scan_plan(model, batches, self)
        return plan

    # ------------------------------------------------------------------------------ events
    def on_init_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if getattr(args, "deepspeed", None):
            raise ValueError("LowPrecisionCallback does not support DeepSpeed; use DDP or FSDP")
        if model is None:
            return  # model_init: converted at on_train_begin
        if not eligible_layers(model):
            raise ValueError(f"{type(model).__name__} has no eligible layers (nn.Linear / nn.Embedding) to put in low precision")
        if self.compensation and not any(p.requires_grad and p.dtype in (torch.bfloat16, torch.float16) for p in model.parameters()):
            raise ValueError(
                f"compensation={self.compensation!r} keeps bf16/fp16 weights exact without an fp32 master copy, "
                "but every trainable weight of this model is fp32: load the model in bf16 or drop compensation"
            )
        if self._auto and self.plan is None:
            resume = getattr(args, "resume_from_checkpoint", None)
            if resume and (Path(resume) / PLAN_FILE).is_file():
                self.plan = PrecisionPlan.load(Path(resume) / PLAN_FILE)
            elif self.calibration_data is not None:
                self.plan = self._scan(model, self.calibration_data)
        if self.plan is None:
            # a checkpoint written with INT4 layers must not load silently into an unconverted model
            self._hook = model.register_load_state_dict_post_hook(_refuse_low_precision_keys)
            return
        self._convert(model, self.plan)
        if optimizer is not None:  # the user passed optimizers=(...)
            insert_new_parameters(optimizer, model, self._new_params)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, train_dataloader=None, **kwargs):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._optimizer = None
        if model is not None and getattr(model, "hf_lowprec_plan", None) is None:
            self._convert_late(args, state, model, optimizer, train_dataloader)
        elif self.report is None and model is not None:  # a callback restored from trainer_state.json
            self._convert(model, model.hf_lowprec_plan if self.plan is None else self.plan)
        if self.compensation and optimizer is not None:
            self._compensate(optimizer)
        if state.global_step > 0:
            self._restore(args, state, model, optimizer)
        if args.fp16 and getattr(optimizer, "scaler", None) is None:
            logger.warning(
                "fp16=True but no GradScaler is active: Accelerate applies fp16 autocast and loss scaling only on "
                "accelerators, so on %s the model trains in %s without loss scaling", args.device, next(model.parameters()).dtype
            )
        if optimizer is not None:
            orphans = orphaned_parameters(model, optimizer)
            ours = {id(p) for p in self._new_params}
            if any(id(p) in ours for n, p in model.named_parameters() if n in orphans):
                raise ValueError(f"learned low-precision parameters missing from the optimizer: {orphans}")
            if orphans:
                logger.warning("%d trainable parameters are not in the optimizer: %s", len(orphans), orphans[:5])

    def _convert_late(self, args, state, model, optimizer, train_dataloader) -> None:
        """Convert after the optimizer exists (``auto`` on training data, or ``model_init``)."""
        if state.global_step > 0 and self.plan is None:
            raise ValueError(
                f"resuming at step {state.global_step} with plan='auto': pass the plan saved with the checkpoint, "
                "LowPrecisionCallback(plan='<checkpoint folder>'), so it is applied before the optimizer state loads"
            )
        if args.fsdp or type(model).__name__.startswith("FullyShardedDataParallel"):
            raise ValueError("under FSDP the plan must be applied before wrapping: pass calibration_data= or a fixed plan")
        if self.plan is None:
            if train_dataloader is None:
                raise ValueError("plan='auto' needs training data or calibration_data= to scan")
            self.plan = self._scan(model, train_dataloader)
        self._convert(model, self.plan)
        if self._new_params and process_world()[1] > 1:
            raise ValueError(
                "the plan adds learned INT4 steps after DDP wrapped the model, so their gradients would not be "
                "averaged across ranks: pass calibration_data= (converts before wrapping) or learn_scales=False"
            )
        if optimizer is not None:
            insert_new_parameters(optimizer, model, self._new_params)

    def _compensate(self, optimizer) -> None:
        """Wrap the optimizer inside the Trainer's ``AcceleratedOptimizer`` in a ``CompensatedOptimizer``."""
        if getattr(optimizer, "scaler", None) is not None:
            raise ValueError("compensation with an fp16 GradScaler is not supported: train bf16 weights (bf16=True)")
        inner = getattr(optimizer, "optimizer", None)
        if inner is None:
            raise ValueError(f"compensation needs the Trainer's AcceleratedOptimizer, got {type(optimizer).__name__}")
        if not isinstance(inner, CompensatedOptimizer):
            optimizer.optimizer = CompensatedOptimizer(inner, self.compensation, seed=self.seed)

    def _restore(self, args, state, model, optimizer) -> None:
        """On resume: counters from ``trainer_state.json``; steps and scaler buffers from our checkpoint file."""
        saved = (state.stateful_callbacks or {}).get(type(self).__name__)
        if isinstance(saved, list):
            saved = saved[0] if saved else None
        if saved:
            for key, value in saved.get("attributes", {}).items():
                setattr(self, key, value)
        folder = self._checkpoint_folder(args, state)
        if folder is None and self.compensation:
            raise ValueError(
                f"resuming at step {state.global_step} with compensation={self.compensation!r} needs the checkpoint's "
                f"{COMPENSATION_FILE}: pass LowPrecisionCallback(plan='<checkpoint folder>', ...)"
            )
        if folder is None:
            logger.warning("resumed at step %d without %s: low-precision state comes from the model weights only", state.global_step, STATE_FILE)
            return
        saved_plan = PrecisionPlan.load(folder / PLAN_FILE)
        if saved_plan.to_dict() != self.plan.to_dict():
            raise ValueError(f"checkpoint {str(folder)!r} was trained with another plan: {saved_plan.to_dict()}; this run uses {self.plan.to_dict()}")
        tensors = load_file(str(folder / STATE_FILE))
        expected = low_precision_state(model)
        if set(tensors) != set(expected):
            raise ValueError(f"{folder / STATE_FILE} does not match this model's low-precision layers")
        params = dict(model.named_parameters()) | dict(model.named_buffers())
        with torch.no_grad():
            for key, value in tensors.items():
                params[key].copy_(value)
        if self.compensation and optimizer is not None:
            # the Trainer loaded optimizer.pt into the unwrapped optimizer, casting the fp32 moments of
            # bf16 weights to bf16; load it again through the wrapper, which keeps them fp32
            extra = torch.load(folder / COMPENSATION_FILE, weights_only=True)
            inner = torch.load(folder / OPTIMIZER_NAME, weights_only=True)
            optimizer.optimizer.load_state_dict({"optimizer": inner, **extra})

    def _checkpoint_folder(self, args, state) -> Path | None:
        """The checkpoint being resumed: the plan folder, ``args.resume_from_checkpoint`` or ``<output_dir>/checkpoint-<step>``."""
        candidates = [self._plan_folder, getattr(args, "resume_from_checkpoint", None), Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"]
        for c in candidates:
            if c and (Path(c) / STATE_FILE).is_file() and (Path(c) / PLAN_FILE).is_file():
                return Path(c)
        return None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if model is not None and skip_step_if_requested(model):
            self.steps_skipped += 1  # a gradient spike under scaler="gradient", spike_action="skip"

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        if optimizer is not None and getattr(optimizer, "step_was_skipped", False):
            self.steps_skipped += 1  # the fp16 GradScaler found inf/NaN gradients
        self._optimizer = optimizer

    def telemetry(self) -> dict[str, float]:
        """The current ``lowprec/...`` values (reading resets the scale policies' per-window counters)."""
        out = {TELEMETRY_PREFIX + k: v for k, v in self.coverage.items()}
        if self._model is not None:
            out.update(collect_telemetry(self._model))
        out[TELEMETRY_PREFIX + "scan_seconds"] = self.scan_seconds
        out[TELEMETRY_PREFIX + "steps_skipped"] = float(self.steps_skipped)
        scaler = getattr(self._optimizer, "scaler", None)
        if scaler is not None:
            out[TELEMETRY_PREFIX + "loss_scale"] = float(scaler.get_scale())
        return out

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs or self.report is None:
            return
        values = self.telemetry()
        logs.update(values)  # callbacks after this one (progress bar, printer) see them
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(values)  # the Trainer copied logs into the history before on_log

    def on_save(self, args, state, control, model=None, **kwargs):
        if self.plan is None or model is None:
            return
        tensors = low_precision_state(model)  # on every rank: gathering FSDP shards is collective
        if not args.should_save:
            return
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        self.plan.save(folder / PLAN_FILE)
        tmp = folder / f".{STATE_FILE}.tmp"
        save_file(tensors, str(tmp), metadata={"global_step": str(state.global_step)})
        os.replace(tmp, folder / STATE_FILE)
        if self.compensation and (folder / OPTIMIZER_NAME).is_file():
            # The Trainer saved the CompensatedOptimizer's state_dict; a resumed Trainer loads optimizer.pt
            # into a plain optimizer before this callback can wrap it. Keep the plain optimizer's part
            # there and the compensation buffers and generator states in our own file.
            saved = torch.load(folder / OPTIMIZER_NAME, weights_only=True)
            for name, value in ((COMPENSATION_FILE, {k: v for k, v in saved.items() if k != "optimizer"}), (OPTIMIZER_NAME, saved["optimizer"])):
                tmp = folder / f".{name}.tmp"
                torch.save(value, tmp)
                os.replace(tmp, folder / name)

    def on_train_end(self, args, state, control, **kwargs):
        if args.should_save and self.plan is not None:
            self.plan.save(Path(args.output_dir) / PLAN_FILE)

    # ------------------------------------------------------------------------- ExportableState
    def state(self) -> dict:
        """JSON-serialisable: the plan in use (so a restored callback re-applies the same one) and counters."""
        return {
            "args": {
                "plan": self.plan.to_dict() if self.plan is not None else "auto",
                "keep": list(self.keep) if self.plan is None else [],
                "calibration_batches": self.calibration_batches,
                "scaler": self.scaler,
                "scaler_options": self.scaler_options,
                "fp8_backend": self.fp8_backend,
                "learn_scales": self.learn_scales,
                "sync": self.sync,
                "compensation": self.compensation,
                "seed": self.seed,
            },
            "attributes": {"scan_seconds": self.scan_seconds, "steps_skipped": self.steps_skipped},
        }


def _refuse_low_precision_keys(module: nn.Module, incompatible) -> None:
    """``load_state_dict`` post-hook: a checkpoint with low-precision state needs its plan applied first."""
    ours = [k for k in incompatible.unexpected_keys if ".weight_quantizer." in k or ".scaling." in k]
    if ours:
        raise ValueError(
            f"this checkpoint holds low-precision layer state ({ours[0]}, ...) but the model is not converted yet: "
            "pass its plan, LowPrecisionCallback(plan='<checkpoint folder>')"
        )


__all__ = [
    "COMPENSATION_FILE",
    "LowPrecisionCallback",
    "STATE_FILE",
    "TELEMETRY_KEYS",
    "coverage",
    "load_plan_source",
    "low_precision_state",
    "scan_plan",
]
