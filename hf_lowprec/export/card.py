"""The model card of an exported run: YAML metadata (``ModelCardData``) and the shipped Jinja template."""

from __future__ import annotations

from collections.abc import Mapping

import yaml
from huggingface_hub import EvalResult, ModelCard, ModelCardData

from hf_lowprec import __version__
from hf_lowprec.assets import shipped_folder
from hf_lowprec.plan import PLAN_FILE, row_label

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
        tags += ["lora", "peft"]
    if run.get("export", {}).get("weights") in ("int4-packed", "gguf"):
        tags.append("4-bit")
    if run.get("export", {}).get("weights") == "gguf":
        tags.append("gguf")
    return tags


def _eval_results(run: Mapping, model_name: str) -> list[EvalResult]:
    out = []
    for row in run.get("eval", []):
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


def render_model_card(run: Mapping, repo_id: str | None = None) -> ModelCard:
    """The model card of an exported run: YAML metadata (``ModelCardData``) + the packaged Jinja template.

    ``repo_id`` appears in the loading snippets (default: a placeholder path).
    """
    recipe = run.get("recipe", {})
    model_name = (repo_id or run.get("name") or "hf-lowprec-model").split("/")[-1]
    base_model = run.get("base_model")
    eval_rows = list(run.get("eval", []))
    datasets = [run["dataset"]] if run.get("dataset") else None
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
    fractions = ", ".join(f"{100 * r['fraction']:.1f}% {r['label']}" for r in plan_rows)
    return ModelCard.from_template(
        card_data,
        template_str=template,
        model_name=model_name,
        summary=run.get("summary", f"A model fine-tuned with low-precision layers ({fractions})."),
        version=__version__,
        recipe=recipe,
        recipe_yaml=yaml.safe_dump(recipe, sort_keys=False),
        base_model=base_model,
        base_model_path=run.get("base_model_path"),
        repo_id=repo_id or f"path/to/{model_name}",
        export=run.get("export", {"loader": "transformers", "dtype": "fp32"}),
        adapter=run.get("adapter"),
        plan_file=PLAN_FILE,
        plan_sentence=f"Share of the eligible parameters (Linear/Embedding weights) per training format: {fractions}. "
        "`kept` marks layers left as they were, with the dtype their trained weights are stored in.",
        plan_rows=plan_rows,
        layers=run.get("layers", []),
        dataset=run.get("dataset", "unknown"),
        data_kind=run.get("data_kind", "text"),
        training_rows=_rows(run.get("training", {})),
        loss_curve=run.get("loss_curve"),
        eval_rows=eval_rows,
        hardware_rows=_rows(run.get("hardware", {})),
        limitations=run.get("limitations", _limitations(run)),
    )


def _limitations(run: Mapping) -> str:
    text = (
        "Low-precision training changes the numerics of the layers in the plan; check the evaluation above on "
        "your own data before relying on the model."
    )
    fp8 = any(r["format"].startswith("fp8") for r in run.get("plan_rows", []))
    if fp8 and not run.get("hardware", {}).get("fp8_tensor_cores"):
        text += " The FP8 layers ran emulated FP8 numerics (this hardware has no FP8 tensor cores): same numbers, "
        text += "slower steps."
    return text


def _rows(figures: Mapping) -> list[tuple[str, str]]:
    return [(key.replace("_", " "), _cell(value)) for key, value in figures.items()]


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
