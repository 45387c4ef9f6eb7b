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

import functools
import json
import logging
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Trainer, TrainerCallback
from transformers.trainer import OPTIMIZER_NAME, TRAINER_STATE_NAME
from transformers.trainer_callback import CallbackHandler, ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from hf_lowprec.convert import eligible_layers
from hf_lowprec.modules import LOW_PRECISION_TYPES
from hf_lowprec.plan import PLAN_FILE, PrecisionPlan, is_auto, plan_folder
from hf_lowprec.ranks import process_world
from hf_lowprec.scaling import ADDED_BUFFERS, TELEMETRY_PREFIX
from hf_lowprec.training.compensation import CompensatedOptimizer
from hf_lowprec.training.new_parameters import (
    insert_new_parameters,
    orphaned_parameters,
    without_learned_parameters,
)
from hf_lowprec.training.session import (
    SessionOwner,
    owned_session,
    scan_progress,
    trainer_autocast,
)
from hf_lowprec.training.telemetry import skip_step_if_requested

logger = logging.getLogger(__name__)

STATE_FILE = "hf_lowprec_state.safetensors"
COMPENSATION_FILE = "hf_lowprec_compensation.pt"
TELEMETRY_KEYS = ("scan_seconds", "steps_skipped")
"""Keys (after ``lowprec/``) in every training log. Besides: ``params_<format>`` and ``flops_<format>``,
the fraction of eligible parameters and of Linear FLOPs in each applied format; the scale policies'
``<format>/<role>_saturation``, ``_underflow`` and ``_scale_log2`` (and ``spikes`` with the ``gradient``
scaler, see :func:`hf_lowprec.training.telemetry.collect_telemetry`); ``loss_scale`` under an fp16 GradScaler."""


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


# ---------------------------------------------------------------------------------- the callback
class LowPrecisionCallback(SessionOwner, TrainerCallback, ExportableState):
    """Converts the Trainer's model to a precision plan and keeps it stable and observable in training.

    Args:
        plan: ``"auto"`` (sensitivity scan + budgeted allocation), a :class:`PrecisionPlan`, a dict, a
            ``.json``/``.yaml`` plan file, a folder holding ``hf_lowprec_plan.json`` (a checkpoint:
            pass it to resume an ``auto`` run), or a format name for every Linear (``"fp8"``, ``"int4-g64"``).
        keep: layer names/patterns left in high precision (format-name and ``auto`` plans); default: the model's
            output head (``get_output_embeddings()``, e.g. ``lm_head``; a classifier's ``classifier``/``score``), as
            the CLI's recipes; ``()`` keeps none.
        budget: ``auto`` only: a ``sensitivity.Budget`` or a dict of its fields.
        formats: ``auto`` only: candidate formats of the scan.
        calibration_data: ``auto``, ``fp8_rounding`` or a plan with ``-sq`` formats: model-input batches (a list, or a
            DataLoader for ``auto`` alone) to scan and to calibrate on (``-sq`` layers then calibrate before the
            Trainer wraps the model: what FSDP needs); with it the plan is applied at ``on_init_end``, otherwise the
            first training batches are scanned at ``on_train_begin``. The scan computes as the Trainer's steps will:
            under bf16 autocast with ``bf16=True``, as Accelerate runs it.
        calibration_batches: how many batches the scan and the FP8 rounding use.
        scan_method: ``auto`` only: the scan's ``method``.
        scaler: FP8 scale policy by name (``dynamic``, ``delayed``, ``gradient``); ``scaler_options`` go
            to it (e.g. ``{"spike_action": "skip"}``).
        sync: reduce FP8 tensorwise amaxes with MAX over ranks; default: when more than one process runs.
            ``False`` under DDP: DDP copies rank 0's buffers to every rank before each forward (its default
            ``broadcast_buffers``), so each rank scales from rank 0's statistics and other ranks' spikes go uncounted.
        compensation: ``kahan`` or ``stochastic``: wrap the Trainer's optimizer in a
            :class:`~hf_lowprec.training.compensation.CompensatedOptimizer` so bf16/fp16 weights train without an
            fp32 master copy (the model must have such weights).
        fp8_backend: ``auto``, ``emulated`` or ``torchao`` (see :class:`hf_lowprec.modules.FP8Linear`).
        learn_scales: train INT4/INT8 group steps (LSQ).
        fp8_rounding: ``gptq``: after the conversion, move each FP8 layer's master weight to the grid point GPTQ
            chooses on ``calibration_data`` (:func:`hf_lowprec.ondevice.calibration.fp8.round_fp8_weights`), so every
            step's round-to-nearest cast reproduces it; ``nearest`` (default): leave the weights as they are.
        seed: the scan's seed.
    """

    def __init__(self, plan="auto", *, calibration_data: Iterable[Mapping] | None = None, **options):
        rounds = options.get("fp8_rounding", "nearest") != "nearest"
        if rounds and calibration_data is None:
            raise ValueError(
                f"fp8_rounding={options['fp8_rounding']!r} needs calibration_data= (a list of a few training batches)"
            )
        self.session = owned_session(type(self).__name__, plan, options, also=("calibration_data",))
        smooths = self.session.plan is not None and self.session.plan.smooths  # '-sq' layers calibrate on it too
        if not is_auto(plan) and not rounds and not smooths and calibration_data is not None:
            fixed = f"plan={plan!r}" if isinstance(plan, str) else "a fixed plan"
            raise ValueError(
                f"calibration_data= applies only to plan='auto', fp8_rounding='gptq' or a plan with '-sq' formats, "
                f"not to {fixed}"
            )
        self.calibration_data = calibration_data
        self._plan_folder = plan_folder(plan)
        self._hook = None
        self._optimizer = None
        self._first_attempt: dict[str, torch.Tensor] | None = None  # see on_train_begin (auto_find_batch_size)
        self._skipping = False  # this step's optimizer step is skipped (a gradient spike)
        self._flagged_skip = False  # this step's skip set Accelerate's step_was_skipped (on_optimizer_step)

    def _convert(self, model: nn.Module) -> None:
        plan = self.session.bind(model)
        self.session.record(model, plan, self.session.apply(model, plan, process_world()[1]))

    # ------------------------------------------------------------------------------ events
    def on_init_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if getattr(args, "deepspeed", None):
            raise ValueError("LowPrecisionCallback does not support DeepSpeed; use DDP or FSDP")
        _run_before_trackers(self)
        if (trainer := _calling(lambda caller: isinstance(caller, Trainer))) is not None:
            _convert_what_model_init_makes(self, trainer)
            _no_decay_on_learned_steps(trainer)
        if model is None:
            return  # model_init: converted at on_train_begin
        if not eligible_layers(model):
            raise ValueError(
                f"{type(model).__name__} has no eligible layers (nn.Linear / nn.Embedding) to put in low precision"
            )
        if self.compensation and not any(
            p.requires_grad and p.dtype in (torch.bfloat16, torch.float16) for p in model.parameters()
        ):
            raise ValueError(
                f"compensation={self.compensation!r} keeps bf16/fp16 weights exact without an fp32 master copy, "
                "but every trainable weight of this model is fp32: load the model in bf16 or drop compensation"
            )
        if self.session.auto and self.plan is None:
            resume = getattr(args, "resume_from_checkpoint", None)
            if resume and (Path(resume) / PLAN_FILE).is_file():
                self.plan = PrecisionPlan.load(Path(resume) / PLAN_FILE)
            elif self.calibration_data is not None:
                with scan_progress(not args.disable_tqdm) as progress:
                    self.session.scan(model, self.calibration_data, trainer_autocast(args), progress)
        if self.plan is None:
            # a checkpoint written with INT4 layers must not load silently into an unconverted model
            self._hook = model.register_load_state_dict_post_hook(_refuse_low_precision_keys)
            return
        self._convert(model)
        self.session.calibrate(model, self.calibration_data)
        if optimizer is not None:  # the user passed optimizers=(...)
            insert_new_parameters(optimizer, model, self.session.new_params)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, train_dataloader=None, **kwargs):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._optimizer = None
        if model is not None and getattr(model, "hf_lowprec_plan", None) is None:
            self._convert_late(args, state, model, optimizer, train_dataloader)
        elif self.report is None and model is not None:  # a callback restored from trainer_state.json
            if self.plan is None:
                self.plan = model.hf_lowprec_plan
            self._convert(model)
        if state.global_step == 0 and train_dataloader is not None and model is not None:
            self.session.calibrate_smoothing(model, train_dataloader)  # '-sq' layers no calibration_data calibrated
        if args.auto_find_batch_size and state.global_step == 0 and model is not None and self.plan is not None:
            # after an out-of-memory error Accelerate's find_executable_batch_size runs the training loop again on
            # this model (no on_train_end between): the aborted attempt's forward was left in the scale statistics
            if self._first_attempt is None:
                self._first_attempt = low_precision_state(model)
            else:
                _copy_low_precision_state(self._first_attempt, model)
        if self.compensation and optimizer is not None:
            self._compensate(optimizer)
        if state.global_step > 0:
            self._restore(args, state, model, optimizer)
        else:  # a run from its start (a second train() too): no skipped steps yet
            self.steps_skipped = 0
        if args.fp16 and getattr(optimizer, "scaler", None) is None:
            logger.warning(
                "fp16=True but no GradScaler is active: Accelerate applies fp16 autocast and loss scaling only on "
                "accelerators, so on %s the model trains in %s without loss scaling",
                args.device,
                next(model.parameters()).dtype,
            )
        if optimizer is not None:
            orphans = orphaned_parameters(model, optimizer)
            ours = {id(p) for p in self.session.new_params}
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
            raise ValueError(
                "under FSDP the plan must be applied before wrapping: pass calibration_data= or a fixed plan"
            )
        if self.plan is None:
            if train_dataloader is None:
                raise ValueError("plan='auto' needs training data or calibration_data= to scan")
            with scan_progress(not args.disable_tqdm) as progress:
                self.session.scan(model, train_dataloader, trainer_autocast(args), progress)
        self._convert(model)
        if state.global_step == 0:
            self.session.calibrate(model, self.calibration_data)
        if self.session.new_params and process_world()[1] > 1:
            raise ValueError(
                "the plan adds learned INT4 steps after DDP wrapped the model, so their gradients would not be "
                "averaged across ranks: pass calibration_data= (converts before wrapping) or learn_scales=False"
            )
        if optimizer is not None:
            insert_new_parameters(optimizer, model, self.session.new_params)

    def _compensate(self, optimizer) -> None:
        """Wrap the optimizer inside the Trainer's ``AcceleratedOptimizer`` in a ``CompensatedOptimizer``."""
        if getattr(optimizer, "scaler", None) is not None:
            raise ValueError("compensation with an fp16 GradScaler is not supported: train bf16 weights (bf16=True)")
        inner = getattr(optimizer, "optimizer", None)
        if inner is None:
            raise ValueError(f"compensation needs the Trainer's AcceleratedOptimizer, got {type(optimizer).__name__}")
        if not isinstance(inner, CompensatedOptimizer):
            optimizer.optimizer = CompensatedOptimizer(inner, self.compensation, seed=self.session.seed)

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
            logger.warning(
                "resumed at step %d without %s: low-precision state comes from the model weights only",
                state.global_step,
                STATE_FILE,
            )
            return
        saved_plan = PrecisionPlan.load(folder / PLAN_FILE)
        if saved_plan.to_dict() != self.plan.to_dict():
            raise ValueError(
                f"checkpoint {str(folder)!r} was trained with another plan: {saved_plan.to_dict()}; this run uses "
                f"{self.plan.to_dict()}. To continue with the checkpoint's plan, pass "
                f"LowPrecisionCallback(plan={str(folder)!r})"
            )
        _load_low_precision_state(folder / STATE_FILE, model)
        if not (folder / OPTIMIZER_NAME).is_file():  # save_only_model=True: transformers resumes without a word
            logger.warning(
                "%s holds no %s (saved with save_only_model=True): the optimizer%s, so the run does not continue "
                "the interrupted one's loss curve exactly", folder, OPTIMIZER_NAME,
                " and its compensation buffers restart" if self.compensation else " restarts",
            )  # fmt: skip
        elif self.compensation and optimizer is not None:
            if not (folder / COMPENSATION_FILE).is_file():
                raise ValueError(
                    f"{folder} holds no {COMPENSATION_FILE}: it was saved by a run without compensation=; resume it "
                    "without compensation, or start this one afresh"
                )
            # the Trainer loaded optimizer.pt into the unwrapped optimizer, casting the fp32 moments of
            # bf16 weights to bf16; load it again through the wrapper, which keeps them fp32
            extra = torch.load(folder / COMPENSATION_FILE, weights_only=True)
            inner = torch.load(folder / OPTIMIZER_NAME, weights_only=True)
            optimizer.optimizer.load_state_dict({"optimizer": inner, **extra})

    def _checkpoint_folder(self, args, state) -> Path | None:
        """The checkpoint being resumed: the first of ``train(resume_from_checkpoint=)``'s,
        ``args.resume_from_checkpoint``, ``<output_dir>/checkpoint-<step>`` and the plan folder that holds the
        low-precision state and was saved at this step (its ``trainer_state.json``). A plan folder saved at another
        step is not: its steps and scale histories would replace the newer ones the Trainer just loaded with the
        weights."""
        candidates = [
            _resumed_checkpoint(),  # what the Trainer resumes (it ignores args.resume_from_checkpoint)
            getattr(args, "resume_from_checkpoint", None),
            Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}",
            self._plan_folder,
        ]
        for c in candidates:
            if c and (Path(c) / STATE_FILE).is_file() and (Path(c) / PLAN_FILE).is_file():
                saved_at = _saved_at_step(Path(c))
                if saved_at in (None, state.global_step):
                    return Path(c)
                logger.warning("%s was saved at step %d, not at %d: its low-precision state is not resumed", c,
                               saved_at, state.global_step)  # fmt: skip
        return None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        # the Trainer unscaled an fp16 GradScaler's gradients already (clip_grad_norm_, to clip or measure them)
        if model is not None and skip_step_if_requested(model):
            self.steps_skipped += 1  # a gradient spike under scaler="gradient", spike_action="skip"
            self._skipping = True

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if self._skipping and hasattr(optimizer, "_is_overflow"):
            # Accelerate's flag of a skipped step (step_was_skipped), set after its step (under fp16 its GradScaler's
            # step set it from the loss scale): the Trainer then leaves the LR schedule where it is, as for an fp16
            # overflow; other callbacks see it at the step's end, and the next step clears it
            optimizer._is_overflow = self._flagged_skip = True
        self._skipping = False

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        if self._flagged_skip:
            optimizer._is_overflow = self._flagged_skip = False

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        if optimizer is not None and getattr(optimizer, "step_was_skipped", False) and not self._flagged_skip:
            self.steps_skipped += 1  # the fp16 GradScaler found inf/NaN gradients
        self._optimizer = optimizer

    def telemetry(self) -> dict[str, float]:
        """The current ``lowprec/...`` values (reading resets the scale policies' per-window counters)."""
        out = self.session.telemetry()
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
            for name, value in (
                (COMPENSATION_FILE, {k: v for k, v in saved.items() if k != "optimizer"}),
                (OPTIMIZER_NAME, saved["optimizer"]),
            ):
                tmp = folder / f".{name}.tmp"
                torch.save(value, tmp)
                os.replace(tmp, folder / name)

    def on_train_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.on_step_begin(args, state, control, optimizer=optimizer)  # a last step's skip flag, cleared
        self._first_attempt = None
        best = state.best_model_checkpoint and Path(state.best_model_checkpoint) / STATE_FILE
        if args.load_best_model_at_end and model is not None and best and best.is_file():
            # the Trainer reloaded the best checkpoint's weights, a PEFT model's adapters alone: its learned steps and
            # scale statistics are in our file (a full model's weights hold them too: the same values again)
            _load_low_precision_state(best, model)
        if args.should_save and self.plan is not None:
            self.plan.save(Path(args.output_dir) / PLAN_FILE)

    # ------------------------------------------------------------------------- ExportableState
    def state(self) -> dict:
        """JSON-serialisable: the plan in use (so a restored callback re-applies the same one) and counters."""
        return {
            "args": {
                "plan": self.plan.to_dict() if self.plan is not None else "auto",
                "keep": (None if self.session.keep is None else list(self.session.keep)) if self.plan is None else [],
                "calibration_batches": self.session.calibration_batches,
                "scaler": self.session.scaler,
                "scaler_options": self.session.scaler_options,
                "fp8_backend": self.session.fp8_backend,
                "learn_scales": self.session.learn_scales,
                "sync": self.session.sync,
                "compensation": self.compensation,
                "seed": self.session.seed,
            },
            "attributes": {"scan_seconds": self.scan_seconds, "steps_skipped": self.steps_skipped},
        }


def _load_low_precision_state(file: Path, model: nn.Module) -> None:
    """Copy a checkpoint's :data:`STATE_FILE` (learned steps, scale statistics) into ``model``'s tensors."""
    tensors = load_file(str(file))
    expected = low_precision_state(model)
    lacking = {k for k in set(expected) - set(tensors) if k.rsplit(".", 1)[-1] not in ADDED_BUFFERS}
    if lacking or set(tensors) - set(expected):
        raise ValueError(f"{file} does not match this model's low-precision layers")
    _copy_low_precision_state(tensors, model)


def _copy_low_precision_state(tensors: Mapping[str, torch.Tensor], model: nn.Module) -> None:
    """Copy :func:`low_precision_state`'s ``tensors`` into ``model``'s own, in place (optimizers keep their
    parameters)."""
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    with torch.no_grad():
        for key, value in tensors.items():
            params[key].copy_(value)


def _run_before_trackers(callback: TrainerCallback) -> None:
    """Move ``callback`` ahead of the Trainer's experiment trackers (``report_to``) so that their ``on_log`` sees the
    ``lowprec/*`` values it adds.

    The Trainer puts its ``report_to`` integrations before the user's callbacks and has no API to reorder them; the
    list is that of the ``CallbackHandler`` dispatching this event, found in the calling frame. Moving an item to an
    earlier place while the handler iterates neither skips nor repeats a callback.
    """
    handler = _calling(lambda caller: isinstance(caller, CallbackHandler) and callback in caller.callbacks)
    if handler is None:
        logger.warning("LowPrecisionCallback: no Trainer callback list found; report_to trackers miss lowprec/* values")
        return
    callbacks = handler.callbacks
    trackers = [i for i, c in enumerate(callbacks) if type(c).__module__.startswith("transformers.integrations")]
    if trackers and callbacks.index(callback) > trackers[0]:
        callbacks.remove(callback)
        callbacks.insert(trackers[0], callback)


def _calling(wanted) -> object | None:
    """The nearest ``self`` among the calling frames for which ``wanted(self)`` holds (the Trainer, its callback
    handler: callbacks are given neither), else ``None``."""
    found = _caller_locals(lambda f: wanted(f.get("self")))
    return None if found is None else found["self"]


def _caller_locals(wanted) -> dict | None:
    """The locals of the nearest calling frame for which ``wanted(locals)`` holds, else ``None``."""
    frame = sys._getframe(1)
    while frame is not None and not wanted(frame.f_locals):
        frame = frame.f_back
    return None if frame is None else frame.f_locals


def _resumed_checkpoint() -> str | None:
    """The folder ``Trainer.train(resume_from_checkpoint=...)`` resumes from (a local of its training loop: callbacks
    are not given it, and a callback that transformers rebuilt from the checkpoint's ``trainer_state.json``
    (``restore_callback_states_from_checkpoint``) holds a plan, not the folder its state lies in)."""
    found = _caller_locals(
        lambda f: isinstance(f.get("self"), Trainer) and isinstance(f.get("resume_from_checkpoint"), str)
    )
    return None if found is None else found["resume_from_checkpoint"]


def _no_decay_on_learned_steps(trainer: Trainer) -> None:
    """Keep learned steps out of the weight-decay group of the optimizer ``trainer`` creates (their names have
    neither 'bias' nor 'norm', so it decayed them); a late conversion puts them in its no-decay group too. Without
    weight decay the layout stays as it was: checkpoints of earlier versions resume."""
    if getattr(trainer.get_decay_parameter_names, "without_learned_steps", False):
        return
    decayed = trainer.get_decay_parameter_names

    def get_decay_parameter_names(model: nn.Module) -> list[str]:
        names = decayed(model)
        return without_learned_parameters(names, model) if trainer.args.weight_decay else names

    get_decay_parameter_names.without_learned_steps = True
    trainer.get_decay_parameter_names = get_decay_parameter_names


def _convert_what_model_init_makes(callback: LowPrecisionCallback, trainer: Trainer) -> None:
    """Wrap ``trainer.model_init`` so that each model it makes is converted as it is made, with the plan known by
    then (else it refuses a checkpoint with low-precision state): ``train()`` makes a new model and loads a resumed
    checkpoint into it, then the optimizer state, all before ``on_train_begin`` (the learned steps were dropped as
    unexpected keys, and the optimizer's groups did not match its state)."""
    if trainer.model_init is None or getattr(trainer.model_init, "converts_for", None) is callback:
        return
    made = trainer.model_init

    @functools.wraps(made)  # the same signature: the Trainer passes a trial to a model_init of one argument
    def model_init(*trial):
        model = made(*trial)
        if callback.plan is not None:
            callback._convert(model)
        else:
            callback._hook = model.register_load_state_dict_post_hook(_refuse_low_precision_keys)
        return model

    model_init.converts_for = callback
    trainer.model_init = model_init


def _refuse_low_precision_keys(module: nn.Module, incompatible) -> None:
    """``load_state_dict`` post-hook: a checkpoint with low-precision state needs its plan applied first."""
    ours = [k for k in incompatible.unexpected_keys if ".weight_quantizer." in k or ".scaling." in k]
    if ours:
        raise ValueError(
            f"this checkpoint holds low-precision layer state ({ours[0]}, ...) but the model is not converted yet: "
            "pass its plan, LowPrecisionCallback(plan='<checkpoint folder>')"
        )


def _saved_at_step(folder: Path) -> int | None:
    """The step a Trainer checkpoint folder was saved at (its ``trainer_state.json``); ``None`` without one."""
    try:
        return json.loads((folder / TRAINER_STATE_NAME).read_text())["global_step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


__all__ = [
    "COMPENSATION_FILE",
    "LowPrecisionCallback",
    "STATE_FILE",
    "TELEMETRY_KEYS",
    "low_precision_state",
]

