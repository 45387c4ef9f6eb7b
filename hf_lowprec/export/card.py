"""The model card of an exported run: YAML metadata (``ModelCardData``) and the shipped Jinja template."""

from __future__ import annotations

import math
import shlex
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, metadata

import yaml
from huggingface_hub import EvalResult, ModelCard, ModelCardData

from hf_lowprec import __version__
from hf_lowprec.assets import shipped_folder
from hf_lowprec.checkpoints import is_hub_id
from hf_lowprec.data import DEFAULT_CORPUS
from hf_lowprec.plan import PLAN_FILE, row_label
from hf_lowprec.recipe import as_shown

TEMPLATE = "model_card.md.jinja"
TASK_TYPES = {"perplexity": "text-generation", "loss": "text-generation", "accuracy": "text-classification"}


def _tags(run: Mapping) -> list[str]:
    formats = {row["format"] for row in run.get("plan_rows", [])}
    tags = ["hf-lowprec"]
    if any(f.startswith("fp8") for f in formats):
        tags.append("fp8")
    if any(f.startswith("int4") for f in formats):
        tags.append("int4")
    recipe = run.get("recipe", {})
    if recipe.get("method") == "full" and any(f.startswith(("int4", "int8", "nf4")) for f in formats):
        tags.append("qat")
    if recipe.get("method") == "int4-lora":
        tags.append("lora")
    if run.get("adapter") and run.get("export", {}).get("weights") != "gguf":  # PEFT's files are in the repo
        tags.append("peft")
    if run.get("export", {}).get("weights") in ("int4-packed", "gguf", "compressed-tensors"):  # INT4 codes stored
        tags.append("4-bit")
    if run.get("export", {}).get("weights") == "gguf":
        tags.append("gguf")
    return tags


def _eval_results(run: Mapping, model_name: str) -> list[EvalResult]:
    out = []
    for row in run.get("eval", []):
        if not math.isfinite(row["value"]):  # a diverged figure: the table shows it, the Hub's metadata takes numbers
            continue
        out.append(
            EvalResult(
                task_type=TASK_TYPES.get(row["metric"], "text-generation"),
                dataset_type=row["dataset"],
                dataset_name=row["dataset"],
                dataset_split=row.get("split"),
                metric_type=row["metric"],
                metric_name=f"{row['metric']} ({row['computed']})" if row.get("computed") else None,
                metric_value=row["value"],
            )
        )
    return out


def _computed_cell(row: Mapping, run: Mapping) -> str:
    """The evaluation table's "computed with" of ``row``: how, and over how many tokens (records before the count:
    how alone)."""
    tokens = row.get("tokens_scored")
    if tokens is None:
        return row.get("computed", "")
    which = ", the assistant's turns only" if run.get("trained_on") == "completions" else ""
    return "; ".join(filter(None, (row.get("computed"), f"{tokens:,} tokens scored{which}")))


def render_model_card(run: Mapping, repo_id: str | None = None) -> ModelCard:
    """The model card of an exported run: YAML metadata (``ModelCardData``) + the packaged Jinja template.

    ``repo_id`` appears in the loading snippets (default: a placeholder path).
    """
    recipe = run.get("recipe", {})
    model_name = (repo_id or run.get("name") or "hf-lowprec-model").split("/")[-1]
    base_model = run.get("base_model")
    eval_rows = [{**row, "computed": _computed_cell(row, run)} for row in run.get("eval", [])]
    datasets = [run["dataset"]] if _on_hub(run.get("dataset")) else None
    card_data = ModelCardData(
        base_model=base_model,
        library_name=run.get("export", {}).get("library_name", "transformers"),
        tags=_tags(run),
        datasets=datasets,
        metrics=sorted({r["metric"] for r in eval_rows}) or None,
        pipeline_tag="text-generation",
        model_name=model_name,
        eval_results=_eval_results(run, model_name) or None,
    )
    template = shipped_folder("model_cards").joinpath(TEMPLATE).read_text()
    plan_rows = [{**r, "label": row_label(r)} for r in run.get("plan_rows", [])]
    training = run.get("training", {})
    if run.get("export_changes"):  # the master weights the run exported and measured are not this export's
        training = {key.replace("exported_weights", "run's_master_weights"): v for key, v in training.items()}
    fractions = ", ".join(f"{100 * r['fraction']:.1f}% {r['label']}" for r in plan_rows)
    return ModelCard.from_template(
        card_data,
        template_str=template,
        model_name=model_name,
        summary=run.get("summary", f"A model fine-tuned with low-precision layers ({fractions})."),
        version=__version__,
        homepage=_homepage(),
        recipe=recipe,
        recipe_yaml=yaml.safe_dump(as_shown(recipe), sort_keys=False),
        base_model=base_model,
        base_model_path=run.get("base_model_path"),
        repo_id=repo_id or f"path/to/{model_name}",
        export=run.get("export", {"loader": "transformers", "dtype": "fp32"}),
        adapter=run.get("adapter"),
        plan_file=PLAN_FILE,
        plan_sentence=f"Share of the eligible parameters (Linear/Embedding weights) per training format: {fractions}. "
        "`kept` marks layers left as they were, in the dtype they trained in.",
        plan_rows=plan_rows,
        fp8_layers=[f"{r['layers']} {r['label']}" for r in plan_rows if r["format"].startswith("fp8")],
        layers=run.get("layers", []),
        dataset=run.get("dataset"),
        data_cell=_data_cell(run),
        training_rows=_rows(training),
        loss_curve=run.get("loss_curve"),
        eval_rows=eval_rows,
        export_changes=run.get("export_changes", []),
        eval_command=_eval_command(run, repo_id, model_name),
        local_data=run.get("dataset") not in (None, DEFAULT_CORPUS) and not _on_hub(run.get("dataset")),
        hardware_rows=_rows(run.get("hardware", {})),
        limitations=run.get("limitations", _limitations(run)),
    )


def _homepage() -> str | None:
    """The project's homepage, from the installed package's metadata (pyproject's ``[project.urls]``)."""
    try:
        urls = metadata("hf-lowprec").get_all("Project-URL") or []
    except PackageNotFoundError:  # a plain checkout on sys.path, not installed
        return None
    return dict(url.split(", ", 1) for url in urls).get("Homepage")


def _on_hub(dataset: str | None) -> bool:
    """Whether the run's ``dataset`` names a Hub dataset (``owner/name``); a local file or folder is recorded by its
    name alone, the offline corpus as ``shakespeare``."""
    return bool(dataset) and "/" in dataset and is_hub_id(dataset)


def _data_cell(run: Mapping) -> str:
    """The training table's data: a Hub dataset linked, the offline corpus described, local data named as such, with
    the data's kind."""
    name, kind = run.get("dataset"), run.get("data_kind", "text")
    if _on_hub(name):
        return f"[{name}](https://huggingface.co/datasets/{name}) ({kind})"
    if name == DEFAULT_CORPUS:
        return f"`{name}` (Shakespeare's plays from Project Gutenberg, hf-lowprec's offline corpus, {kind})"
    return f"`{name}` (local data, {kind})" if name else f"unknown ({kind})"


def _eval_command(run: Mapping, repo_id: str | None, model_name: str) -> str:
    """The shell lines that evaluate this export on the run's held-out rows. ``eval --held-out`` reads the record of a
    local folder, so a Hub repo is downloaded first; the offline corpus is eval's default data."""
    folder = shlex.quote(model_name if repo_id else f"path/to/{model_name}")
    download = f"hf download {repo_id} --local-dir {folder}\n" if repo_id else ""
    data = run.get("dataset")
    option = "" if data == DEFAULT_CORPUS else f" --data {shlex.quote(data) if data else '<data>'}"
    held_out = " --held-out" if "training" in run.get("recipe", {}) else ""
    return f"{download}hf-lowprec eval {folder}{option}{held_out}"


def _limitations(run: Mapping) -> str:
    text = (
        "Low-precision training changes the numerics of the layers in the plan; check the evaluation above on "
        "your own data before relying on the model."
    )
    fp8 = any(r["format"].startswith("fp8") for r in run.get("plan_rows", []))
    fp8_layers = [r for r in run.get("layers", []) if "backend" in r]  # records before it: the hardware says
    emulated = [r for r in fp8_layers if r["backend"] == "emulated"]
    if fp8 and run.get("hardware", {}).get("fp8_tensor_cores") is False:  # not where the hardware went unrecorded
        text += " The FP8 layers ran emulated FP8 numerics (this hardware has no FP8 tensor cores): the same FP8 "
        text += "rounding, slower steps (FP8 tensor cores sum the products in their own order: not bit-identical)."
    elif emulated:  # FP8 hardware, and layers torchao's kernels do not run
        reasons = "; ".join(sorted({r["emulated_because"] for r in emulated}))
        text += f" {len(emulated)} of the {len(fp8_layers)} FP8 layers ran emulated FP8 numerics ({reasons}): "
        text += "the same FP8 rounding, slower steps."
    return text


def _rows(figures: Mapping) -> list[tuple[str, str]]:
    """``(label, cell)`` per figure: its key in words, a ``_mb`` key's unit named (MiB, as ``metrics`` measures); a
    loss to 4 decimals, as the evaluation table has it (to 4 figures, 10.7752 and 10.7750 both read 10.78)."""
    return [(_label(key), f"{value:.4f}" if "loss" in key and isinstance(value, float) else _cell(value))
            for key, value in figures.items()]  # fmt: skip


def _label(key: str) -> str:
    return f"{key.removesuffix('_mb').replace('_', ' ')} (MiB)" if key.endswith("_mb") else key.replace("_", " ")


def _cell(value) -> str:
    """A record's value as one line of the card: floats to 4 figures, a mapping (the CPU's) as ``key: value`` pairs,
    a list space-separated."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, Mapping):
        return ", ".join(f"{k.replace('_', ' ')}: {_cell(v)}" for k, v in value.items() if v is not None)
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value)
