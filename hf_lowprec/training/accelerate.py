"""LowPrecisionPlugin: a precision plan in an Accelerate training loop, with one call around ``prepare``.

    accelerator = Accelerator()
    lowprec = LowPrecisionPlugin("fp8")
    model, optimizer, loader = lowprec.prepare(accelerator, model, optimizer, loader)

``prepare`` converts the model *before* Accelerate wraps it for DDP/FSDP, so every rank holds the
same layers and DDP registers the learned INT4 steps; it puts new parameters into the optimizer
(the group of their layer's weight), re-points the optimizer at any parameter a conversion replaced,
and raises if any trainable parameter is still missing from it — before and after Accelerate's own
``prepare``. Accelerate's ``mixed_precision="fp8"`` alone, called as ``prepare(model, optimizer)``,
swaps Linear weights after the optimizer captured them and leaves them untrained; with the plugin
that cannot happen.

With ``mixed_precision="fp8"`` and torchao as Accelerate's FP8 backend, the plan's FP8 Linear layers
whose scaling matches the recipe (``fp8`` tensorwise / ``fp8-rowwise`` axiswise) are handed to
torchao: the plan becomes ``AORecipeKwargs.module_filter_func``, so torchao's ``Float8Linear`` (and
its ``_scaled_mm`` kernels on FP8 GPUs) runs exactly those layers and no others; the plugin's own
layers run the rest of the plan.

``accelerator.save_state(dir)`` writes the plan to ``dir/hf_lowprec_plan.json``: ``LowPrecisionPlugin(plan=dir)``
resumes with it, and ``load_state`` refuses a state saved under another plan before Accelerate loads its weights.

Under more than one process the FP8 scale policies reduce their tensorwise amaxes with ``MAX`` over
ranks (``sync``), so every rank quantizes with the same scales. Layers that torchao's kernels run (on FP8 GPUs)
compute their own per-rank dynamic scales and record no ``lowprec/*`` telemetry; the policies then do not run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch import nn

from hf_lowprec.convert import canonical_name, eligible_layers
from hf_lowprec.folders import atomic_write_text
from hf_lowprec.layers import wrapper_of
from hf_lowprec.plan import PLAN_FILE, PrecisionPlan
from hf_lowprec.ranks import process_world
from hf_lowprec.smoothing import say_first_forward_calibrates
from hf_lowprec.training.compensation import CompensatedOptimizer
from hf_lowprec.training.new_parameters import insert_new_parameters, orphaned_parameters
from hf_lowprec.training.session import SessionOwner, owned_session, scan_progress
from hf_lowprec.training.telemetry import skip_step_if_requested

logger = logging.getLogger(__name__)

OPTIONS_FILE = "hf_lowprec_options.json"  # beside a saved state: the plugin options it was saved with
TORCHAO_MIN_DIM = 16  # torch._scaled_mm needs both GEMM dims divisible by 16 (Accelerate's own filter)


def _torchao_granularity(config) -> str | None:
    """The FP8 granularity (``tensor``/``row``) of a torchao ``Float8LinearConfig``; None if mixed."""
    from torchao.float8.config import ScalingGranularity

    grans = {
        c.scaling_granularity
        for c in (config.cast_config_input, config.cast_config_weight, config.cast_config_grad_output)
    }
    if grans == {ScalingGranularity.TENSORWISE}:
        return "tensor"
    if grans == {ScalingGranularity.AXISWISE}:
        return "row"
    return None


class LowPrecisionPlugin(SessionOwner):
    """Apply a precision plan in an Accelerate loop and keep every trainable parameter in the optimizer.

    Args:
        plan: ``"auto"`` (scan + allocation; needs ``calibration_data`` or a DataLoader in ``prepare``),
            a :class:`PrecisionPlan`, a dict, a plan file, a folder holding ``hf_lowprec_plan.json``,
            or a format name for every Linear.
        the other keywords (checked by :class:`~hf_lowprec.training.session.LowPrecisionSession`):
        keep, budget, formats, calibration_batches, scan_method, fp8_rounding, seed: as for
            :class:`hf_lowprec.training.callback.LowPrecisionCallback` (``fp8_rounding`` also calibrates on
            ``calibration_data`` or the prepared DataLoader).
        scaler: FP8 scale policy (``dynamic``, ``delayed``, ``gradient``); ``scaler_options`` go to it.
        fp8_backend: the plugin's own FP8 layers: ``auto``, ``emulated`` or ``torchao``.
        learn_scales: train INT4/INT8 group steps (LSQ).
        sync: reduce FP8 amaxes over ranks; default: when more than one process runs.
            ``False`` under DDP: DDP copies rank 0's buffers to every rank before each forward (its default
            ``broadcast_buffers``), so each rank scales from rank 0's statistics and other ranks' spikes go uncounted.
        compensation: ``kahan`` or ``stochastic``: the optimizer is wrapped in a
            :class:`~hf_lowprec.training.compensation.CompensatedOptimizer` (for bf16/fp16 weights without an fp32
            copy).
    """

    def __init__(self, plan="auto", **options):
        self.session = owned_session(type(self).__name__, plan, options)
        self.torchao_layers: list[str] = []
        self._main_process = True  # the process that writes the plan file beside a saved state
        self._accelerated = None  # Accelerate's optimizer, whose step_was_skipped a skip sets
        self._flagged_skip = False  # the last step's skip set it (without a loss scaler, nothing else clears it)

    # ----------------------------------------------------------------------------------- prepare
    def prepare(self, accelerator, *objects, calibration_data: Iterable[Mapping] | None = None):
        """Convert the one model among ``objects``, fix the optimizer, then ``accelerator.prepare(*objects)``.

        Returns what ``accelerator.prepare`` returns, in the same order. ``calibration_data``: batches
        for ``plan="auto"`` (default: the first DataLoader among ``objects``).
        """
        models = [o for o in objects if isinstance(o, nn.Module)]
        optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
        if len(models) != 1 or len(optimizers) > 1:
            raise ValueError(
                f"prepare takes one model and at most one optimizer, got {len(models)} models and "
                f"{len(optimizers)} optimizers"
            )
        model, optimizer = models[0], (optimizers[0] if optimizers else None)
        if calibration_data is None:  # read only as needed: an auto plan, fp8_rounding, '-sq' smoothing
            calibration_data = next((o for o in objects if isinstance(o, torch.utils.data.DataLoader)), None)
        self.convert(model, optimizer, accelerator=accelerator, calibration_data=calibration_data)
        if self.compensation and optimizer is not None:
            if not any(p.requires_grad and p.dtype in (torch.bfloat16, torch.float16) for p in model.parameters()):
                raise ValueError(
                    f"compensation={self.compensation!r} is for bf16/fp16 weights, but every trainable weight is fp32"
                )
            wrapped = CompensatedOptimizer(optimizer, self.compensation, seed=self.session.seed)
            objects = tuple(wrapped if o is optimizer else o for o in objects)
        prepared = accelerator.prepare(*objects)
        # a tuple, one object alone, or under FSDP2 a list (Accelerate 1.15's _prepare_fsdp2)
        prepared = tuple(prepared) if isinstance(prepared, (tuple, list)) else (prepared,)
        if optimizer is not None:
            wrapped = next(o for o in prepared if isinstance(o, nn.Module))
            inner = next(o for o in prepared if isinstance(o, torch.optim.Optimizer))
            self._accelerated = inner if hasattr(inner, "_is_overflow") else None
            orphans = orphaned_parameters(accelerator.unwrap_model(wrapped), inner)
            if orphans:
                raise ValueError(
                    f"after accelerator.prepare, trainable parameters are missing from the optimizer: {orphans[:5]}"
                )
        return prepared if len(prepared) > 1 else prepared[0]

    def convert(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        accelerator=None,
        calibration_data: Iterable[Mapping] | None = None,
    ) -> nn.Module:
        """Convert ``model`` in place and fit ``optimizer`` to it, without wrapping (for loops that wrap
        the model themselves, e.g. with ``torch.distributed.fsdp.fully_shard``: call this first).

        With ``accelerator``, its ``save_state``/``load_state`` keep the plan and options as after :meth:`prepare`.
        Raises ``ValueError`` if a trainable parameter is missing from ``optimizer`` afterwards.
        """
        wrapper = "Accelerate's prepare" if getattr(model, "_is_accelerate_prepared", False) else wrapper_of(model)
        if wrapper is not None:
            raise ValueError(
                f"the model is already wrapped by {wrapper}; pass the plain model so it is converted before wrapping "
                "(before fully_shard / prepare)"
            )
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if accelerator is not None and accelerator.num_processes == 1 and launched > 1:
            # each process would train alone on all the data, writing the same files (Accelerate on a machine
            # without accelerators makes no process group of its own unless told to run on the CPU)
            raise ValueError(
                f"this is one of {launched} launched processes (WORLD_SIZE), but its Accelerator runs alone "
                f"({accelerator.distributed_type}); on a CPU-only machine make it Accelerator(cpu=True), which joins "
                "them over gloo"
            )
        if not eligible_layers(model):
            raise ValueError(
                f"{type(model).__name__} has no eligible layers (nn.Linear / nn.Embedding) to put in low precision"
            )
        rounding = self.session.fp8_rounding
        needs = ["plan='auto'"] if self.plan is None else []
        needs += [f"fp8_rounding={rounding!r}"] if rounding != "nearest" else []
        if needs and calibration_data is None:
            raise ValueError(f"{' and '.join(needs)}: needs calibration_data= or a DataLoader among the prepared ones")
        if self.plan is None:
            computing = accelerator.autocast() if accelerator is not None else contextlib.nullcontext()
            show = accelerator is None or accelerator.is_local_main_process
            with scan_progress(show) as progress:  # as training computes: its autocast, if any
                self.session.scan(model, calibration_data, computing, progress)
        before = {name: p for name, p in model.named_parameters()}
        self._convert(accelerator, model)
        self.session.calibrate(model, calibration_data)
        if calibration_data is None and (smoothed := self.session.smoothed_layers()):
            say_first_forward_calibrates(smoothed, "no calibration_data")
        if optimizer is not None:
            self._repoint(optimizer, model, before)
            insert_new_parameters(optimizer, model, self.session.new_params)
            orphans = orphaned_parameters(model, optimizer)
            if orphans:
                raise ValueError(
                    "trainable parameters missing from the optimizer: "
                    f"{orphans[:5]}{' ...' if len(orphans) > 5 else ''}; freeze them (requires_grad_(False)) or "
                    "add them"
                )
            getattr(optimizer, "optimizer", optimizer).register_step_pre_hook(self._before_step)
        if accelerator is not None:
            accelerator.register_for_checkpointing(self)
            accelerator.register_save_state_pre_hook(self._write_plan_file)
            accelerator.register_load_state_pre_hook(self._refuse_another_plan)
            self._main_process = accelerator.is_main_process
        return model

    def _convert(self, accelerator, model: nn.Module) -> None:
        """Our layers for the plan, minus the FP8 layers handed to Accelerate's torchao backend."""
        plan = self.session.bind(model)
        fp8 = getattr(accelerator, "fp8_enabled", False)
        handler = getattr(accelerator, "ao_recipe_handler", None) if fp8 else None
        if fp8 and handler is None:
            raise ValueError(
                f"mixed_precision='fp8' with Accelerate's {accelerator.fp8_backend} backend is not supported; use "
                "torchao (AORecipeKwargs) or mixed_precision='no'/'bf16'"
            )
        ours = plan
        if handler is not None:
            gran = _torchao_granularity(handler.config)
            layers = eligible_layers(model)
            self.torchao_layers = [
                name
                for name, spec in plan.assign(model).items()
                if spec.family == "fp8"
                and spec.granularity == gran
                and type(layers[name]) is nn.Linear
                and layers[name].in_features % TORCHAO_MIN_DIM == 0
                and layers[name].out_features % TORCHAO_MIN_DIM == 0
            ]
            if self.torchao_layers and self.session.scaler != "dynamic":  # its kernels scale dynamically
                raise ValueError(
                    f"scaler={self.session.scaler!r} does not run in the {len(self.torchao_layers)} FP8 layers "
                    "Accelerate's torchao backend converts (mixed_precision='fp8'): use scaler='dynamic', or "
                    "mixed_precision='no'/'bf16' to run them in hf_lowprec's FP8 layers with this scaler"
                )
            ours = PrecisionPlan(
                {**plan.layers, **{n: "bf16" for n in self.torchao_layers}}, default=plan.default, model=plan.model
            )
        world = accelerator.num_processes if accelerator is not None else process_world()[1]
        report = self.session.apply(model, ours, world)
        model.hf_lowprec_plan = plan  # the whole plan, torchao's layers included
        if handler is not None:
            handler.module_filter_func = self._torchao_filter
            from accelerate.utils.ao import convert_model_to_fp8_ao

            # convert now, before the optimizer is re-pointed; Accelerate's own pass in prepare() then
            # finds no plain Linear the filter accepts and changes nothing
            convert_model_to_fp8_ao(model, config=handler.config, module_filter_func=self._torchao_filter)
            for r in report.layers:
                if r.name in self.torchao_layers:
                    r.requested = r.applied = plan.resolve(r.name).name
                    r.module, r.backend, r.reason = (
                        "torchao.Float8Linear",
                        "torchao",
                        "handed to Accelerate's torchao backend",
                    )
        self.session.record(model, plan, report)

    def _torchao_filter(self, module: nn.Module, fqn: str) -> bool:
        """``AORecipeKwargs.module_filter_func``: exactly the plan's FP8 layers torchao runs."""
        return type(module) is nn.Linear and canonical_name(fqn) in self.torchao_layers

    @staticmethod
    def _repoint(optimizer: torch.optim.Optimizer, model: nn.Module, before: Mapping[str, nn.Parameter]) -> None:
        """Replace, in ``optimizer``, every parameter a conversion replaced (same name, new object)."""
        after = dict(model.named_parameters())
        mapping = {id(p): after[n] for n, p in before.items() if n in after and after[n] is not p}
        if not mapping:
            return
        for group in optimizer.param_groups:
            group["params"] = [mapping.get(id(p), p) for p in group["params"]]
        for old_id, new in mapping.items():
            old = next((p for p in optimizer.state if id(p) == old_id), None)
            if old is not None:
                optimizer.state[new] = optimizer.state.pop(old)
        logger.info("re-pointed %d optimizer parameters replaced by the conversion", len(mapping))

    def _before_step(self, optimizer, args, kwargs) -> None:
        """Optimizer step pre-hook: a gradient policy's spike ``skip`` drops this step on every rank, and Accelerate's
        optimizer then says so (``step_was_skipped``): its scheduler leaves the LR where it is, as for an fp16
        overflow (it advanced over the skipped step)."""
        accelerated = self._accelerated
        if accelerated is not None and self._flagged_skip:
            accelerated._is_overflow = self._flagged_skip = False
        if self.session.model is None or not skip_step_if_requested(self.session.model):
            return
        self.steps_skipped += 1
        if accelerated is None:
            return
        if accelerated.scaler is not None:
            accelerated._accelerate_step_called = False  # its fp16 step sets step_was_skipped from this, after us
        else:
            accelerated._is_overflow = self._flagged_skip = True

    # --------------------------------------------------------------------------------- telemetry
    def telemetry(self) -> dict[str, float]:
        """``lowprec/...`` values for ``accelerator.log``: coverage, saturation/underflow, spikes, skips, scan time."""
        return self.session.telemetry()

    # -------------------------------------------------------- Accelerate save_state / load_state
    def state_dict(self) -> dict:
        return {
            "plan": None if self.plan is None else self.plan.to_dict(),
            "steps_skipped": self.steps_skipped,
            "scan_seconds": self.scan_seconds,
        }

    def load_state_dict(self, state: Mapping) -> None:
        self._check_same_plan(state.get("plan"))
        self.steps_skipped = int(state.get("steps_skipped", 0))
        self.scan_seconds = float(state.get("scan_seconds", 0.0))

    def _write_plan_file(self, models, weights, output_dir: str) -> None:
        """``save_state`` pre-hook: the plan as ``hf_lowprec_plan.json`` beside the weights, so that
        ``LowPrecisionPlugin(plan=output_dir)`` resumes with it (an ``auto`` plan without scanning again), and the
        options the state depends on (:data:`OPTIONS_FILE`)."""
        if self.plan is not None and self._main_process:
            self.plan.save(Path(output_dir) / PLAN_FILE)
            atomic_write_text(Path(output_dir) / OPTIONS_FILE, json.dumps(self._state_options(), indent=2))

    def _state_options(self) -> dict:
        """The options that decide what a saved state holds: scale histories (scaler), learned INT4 steps,
        compensation buffers."""
        s = self.session
        return {"scaler": s.scaler, "scaler_options": dict(s.scaler_options), "learn_scales": s.learn_scales,
                "compensation": s.compensation}  # fmt: skip

    def _refuse_another_plan(self, models, input_dir: str) -> None:
        """``load_state`` pre-hook: refuse a state saved under another plan or other options before Accelerate loads
        its weights (whose other parameters it would list key by key, or fail on a missing optimizer key)."""
        path = Path(input_dir) / PLAN_FILE
        if path.is_file():
            self._check_same_plan(PrecisionPlan.load(path).to_dict())
        path = Path(input_dir) / OPTIONS_FILE
        if path.is_file():
            saved, now = json.loads(path.read_text()), self._state_options()
            if changed := [f"{k}={saved.get(k)!r} (this run: {v!r})" for k, v in now.items() if saved.get(k) != v]:
                raise ValueError(
                    f"the saved state was trained with {', '.join(changed)}: resume with the options it was saved with"
                )

    def _check_same_plan(self, saved: Mapping | None) -> None:
        if saved is not None and self.plan is not None and saved != self.plan.to_dict():
            raise ValueError(
                f"the saved state was trained with another plan: {saved}; this run uses {self.plan.to_dict()} "
                "(resume with LowPrecisionPlugin(plan=<the state folder>))"
            )


__all__ = ["LowPrecisionPlugin"]
