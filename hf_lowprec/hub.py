"""Publishing: export a trained model as a loadable folder with its plan and model card; push it to the Hub.

An exported folder holds
- the weights (``save_pretrained``): ``master`` exports write the high-precision master weights that the
  low-precision layers trained (plain ``transformers`` checkpoint); ``int4-packed`` exports write the
  INT4 layers as real packed codes (two per byte) with their steps and ``quant_method: hf_lowprec`` in
  ``config.json`` (transformers rebuilds them after ``import hf_lowprec``; see ``hf_lowprec.hf_quantizer``),
  plus LoRA adapters in ``adapter/`` for INT4 + LoRA runs;
- ``hf_lowprec_plan.json``: the precision plan; ``hf_lowprec_run.json``: the run record (see below);
- ``README.md``: the model card (``model_cards/model_card.md.jinja`` through ``huggingface_hub.ModelCard``).

The run record is a JSON dict: ``name``, ``base_model`` (hub id or None), ``base_model_path``, ``recipe``
(dict), ``dataset``, ``data_kind``, ``plan`` (dict), ``layers`` ([{name, format, params}]), ``plan_rows``
(``PrecisionPlan.summary`` rows), ``training`` (figures), ``eval`` ([{dataset, split, metric, value}]),
``hardware``, ``export`` ({weights, loader, library_name, dtype, description}), and optionally ``adapter``
(LoRA), ``merge`` (re-quantization error of a merged export), ``summary`` and ``limitations`` (card text).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import yaml
from huggingface_hub import EvalResult, HfApi, ModelCard, ModelCardData, get_token, snapshot_download
from torch import nn

from hf_lowprec.assets import shipped_folder
from hf_lowprec.convert import apply_plan, eligible_layers, freeze, revert
from hf_lowprec.modules import PackedInt4Linear, PackedInt8Linear, PackedLinear
from hf_lowprec.modules.kernels.cpu import cpu_info
from hf_lowprec.plan import PrecisionPlan, atomic_write_text

logger = logging.getLogger(__name__)

PLAN_FILE = "hf_lowprec_plan.json"
RUN_FILE = "hf_lowprec_run.json"
CARD_FILE = "README.md"
TEMPLATE = "model_card.md.jinja"
EXPORT_WEIGHTS = ("master", "int4-packed")
TASK_TYPES = {"perplexity": "text-generation", "loss": "text-generation", "accuracy": "text-classification"}
# files a run folder holds that an export does not publish
RUN_ONLY = ("checkpoints", "log_history.json")


# ------------------------------------------------------------------------------------ folders
@contextlib.contextmanager
def atomic_output_dir(out: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary sibling of ``out``; on success it replaces ``out`` in one rename.

    Raises ``ValueError`` if ``out`` exists (and is not empty) without ``overwrite``. On any error the
    temporary folder is removed and ``out`` is left exactly as it was.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {str(out)!r} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"output folder {str(out)!r} already exists; pass --overwrite to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".partial"))
    try:
        yield tmp
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def replace_dir(src: Path, dst: Path) -> None:
    """Move folder ``src`` to ``dst``, replacing ``dst``; ``dst`` is never half-written (rename, then delete the old)."""
    old = None
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        os.replace(dst, old)
    try:
        os.replace(src, dst)
    except BaseException:
        if old is not None:
            os.replace(old, dst)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------------- hardware
def hardware_info() -> dict:
    """What the run ran on: device, its name, CPU cores and capabilities, torch version, whether FP8 tensor cores exist."""
    info = {"device": "cpu", "name": cpu_info().model, "cpu_cores": os.cpu_count(), "torch": torch.__version__,
            "cpu": cpu_info().to_dict()}  # fmt: skip
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        info.update(device="cuda", name=torch.cuda.get_device_name(), compute_capability=f"{cap[0]}.{cap[1]}", gpus=torch.cuda.device_count())
        info["fp8_tensor_cores"] = cap >= (8, 9)
    else:
        info["fp8_tensor_cores"] = False
    return info


# ------------------------------------------------------------------------------ plan records
def plan_record(model: nn.Module, plan: PrecisionPlan) -> tuple[list[dict], list[dict]]:
    """``(per-layer [{name, format, params}], PrecisionPlan.summary rows)`` of ``plan`` on ``model``.

    Frozen packed INT4 layers keep no dense weight; they are summarised through a meta-device Linear
    of their shape (no memory), so the figures are those of the layer before packing.
    """
    layers = {n: _dense_view(m) for n, m in eligible_layers(model).items()}
    per_layer = [{"name": n, "format": spec.name, "params": layers[n].weight.numel()} for n, spec in plan.assign(layers).items()]
    return per_layer, plan.summary(layers)


def _dense_view(module: nn.Module) -> nn.Module:
    if isinstance(module, PackedLinear):
        return nn.Linear(module.in_features, module.out_features, bias=False, device="meta", dtype=module.step.dtype)
    return module


# ------------------------------------------------------------------------------- model cards
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
    if run.get("export", {}).get("weights") == "int4-packed":
        tags.append("4-bit")
    return tags


def _eval_results(run: Mapping, model_name: str) -> list[EvalResult]:
    out = []
    for row in run.get("eval", []):
        out.append(EvalResult(
            task_type=TASK_TYPES.get(row["metric"], "text-generation"), dataset_type=row["dataset"],
            dataset_name=row["dataset"], dataset_split=row.get("split"), metric_type=row["metric"],
            metric_value=row["value"],
        ))  # fmt: skip
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
        base_model=base_model, library_name=run.get("export", {}).get("library_name", "transformers"),
        tags=_tags(run), datasets=datasets, metrics=sorted({r["metric"] for r in eval_rows}) or None,
        pipeline_tag="text-generation", model_name=model_name, eval_results=_eval_results(run, model_name) or None,
    )  # fmt: skip
    from hf_lowprec import __version__

    template = shipped_folder("model_cards").joinpath(TEMPLATE).read_text()
    fractions = ", ".join(f"{100 * r['fraction']:.1f}% {r['format']}" for r in run.get("plan_rows", []))
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
        "`bf16` marks layers left in the model's own dtype.",
        plan_rows=run.get("plan_rows", []),
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
    text = ("Low-precision training changes the numerics of the layers in the plan; check the evaluation above on "
            "your own data before relying on the model.")  # fmt: skip
    if any(r["format"].startswith("fp8") for r in run.get("plan_rows", [])) and not run.get("hardware", {}).get("fp8_tensor_cores"):
        text += " The FP8 layers ran emulated FP8 numerics (this hardware has no FP8 tensor cores): same numbers, slower steps."
    return text


def _rows(figures: Mapping) -> list[tuple[str, str]]:
    out = []
    for key, value in figures.items():
        if isinstance(value, float):
            value = f"{value:.4g}"
        out.append((key.replace("_", " "), str(value)))
    return out


# ------------------------------------------------------------------------------------ export
def export_model(
    model: nn.Module, tokenizer, out: str | os.PathLike, run: Mapping, *, weights: str = "master", merge: bool = False,
    merged_dtype: str | None = None, overwrite: bool = False, repo_id: str | None = None,
    extra_files: Mapping[str, str | bytes] | None = None,
) -> Path:  # fmt: skip
    """Write ``model`` (its plan applied) as a publishable folder at ``out``, atomically; returns ``out``.

    ``weights``: ``master`` (plain high-precision weights; FP8/INT4 layers reverted on a copy) or
    ``int4-packed`` (INT4 layers frozen to packed codes on a copy, other layers as master weights;
    ``config.json`` gets ``quant_method: hf_lowprec`` so ``from_pretrained`` rebuilds them after
    ``import hf_lowprec``). A PEFT model from ``finetune.prepare_int4_lora`` is saved by
    ``finetune.export_int4_lora``: packed base + adapters, or with ``merge`` the adapters merged and re-quantized
    (``merged_dtype`` ``bf16``/``fp32``: merged into a plain dense model instead).
    ``run``: the run record (see the module docstring); its ``plan``/``layers``/``export`` are filled in here.
    ``extra_files``: ``{name: text or bytes}`` written next to the weights (e.g. ``recipe.yaml``, a loss-curve PNG).
    """
    if weights not in EXPORT_WEIGHTS:
        raise ValueError(f"export weights {weights!r}: choose one of {', '.join(EXPORT_WEIGHTS)}")
    peft = getattr(model, "peft_config", None) is not None
    base = model.get_base_model() if peft else model
    plan = getattr(base, "hf_lowprec_plan", None) or PrecisionPlan()
    run = dict(run)
    run["plan"] = plan.to_dict()
    run["layers"], run["plan_rows"] = plan_record(base, plan)
    if peft:
        return _export_lora(model, tokenizer, Path(out), run, merge, merged_dtype, overwrite, repo_id, extra_files)
    if merge:
        raise ValueError("merge applies to LoRA adapters; this model has none")
    with atomic_output_dir(out, overwrite) as tmp:
        copy_ = copy.deepcopy(model)
        if weights == "int4-packed":
            if freeze(copy_) == 0:
                raise ValueError("export weights 'int4-packed' needs int4 (or per-channel int8) layers in the plan; this model has none (export 'master')")
            revert(copy_)  # FP8 / other layers back to plain layers with their master weights
            run["export"] = {"weights": weights, "loader": "hf_lowprec", "library_name": "hf-lowprec", "dtype": _dtype_name(copy_),
                             "description": f"{_packed_layers(copy_)} with their learned steps"}  # fmt: skip
        else:
            revert(copy_)
            run["export"] = {"weights": weights, "loader": "transformers", "library_name": "transformers", "dtype": _dtype_name(copy_),
                             "description": "high-precision master weights"}  # fmt: skip
        copy_.save_pretrained(tmp)
        if weights == "int4-packed":
            _mark_packed(copy_.config, plan, tmp)
        del copy_
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / PLAN_FILE).write_text(json.dumps(plan.to_dict(), indent=2) + "\n")
        _write_record(tmp, run, repo_id, extra_files)
    return Path(out)


def _mark_packed(config, plan: PrecisionPlan, folder: Path) -> None:
    """``config.json`` with ``quantization_config`` so transformers rebuilds the packed layers (hf_lowprec.hf_quantizer)."""
    from hf_lowprec.hf_quantizer import quantization_config_dict

    config = copy.deepcopy(config)
    config.quantization_config = quantization_config_dict(plan)
    config.save_pretrained(folder)


def _write_record(folder: Path, run: Mapping, repo_id: str | None, extra_files: Mapping[str, str | bytes] | None) -> None:
    """Run record, extra files and model card into ``folder`` (a temporary folder renamed into place as a whole)."""
    (folder / RUN_FILE).write_text(json.dumps(run, indent=2, default=str) + "\n")
    for name, data in (extra_files or {}).items():
        (folder / name).write_bytes(data) if isinstance(data, bytes) else (folder / name).write_text(data)
    render_model_card(run, repo_id).save(folder / CARD_FILE)


def _packed_layers(model: nn.Module) -> str:
    """``"N layers as packed INT4 codes (two per byte)[, M as int8 codes]"`` for ``model``'s packed layers."""
    n4 = sum(isinstance(m, PackedInt4Linear) for m in model.modules())
    n8 = sum(isinstance(m, PackedInt8Linear) for m in model.modules())
    return f"{n4} layers as packed INT4 codes (two per byte)" + (f", {n8} as int8 codes" if n8 else "")


def _export_lora(model, tokenizer, out: Path, run: dict, merge: bool, merged_dtype: str | None, overwrite: bool, repo_id,
                 extra_files) -> Path:  # fmt: skip
    """Packed INT4 base + LoRA adapters (or merged) through ``finetune.export_int4_lora``, then the record and card."""
    from hf_lowprec.ondevice import ADAPTER_DIR, MERGE_DTYPES, MERGE_FILE, export_int4_lora

    if merged_dtype is not None and merged_dtype not in MERGE_DTYPES:
        raise ValueError(f"merged dtype {merged_dtype!r}: choose one of {', '.join(MERGE_DTYPES)}")
    if merged_dtype is not None and not merge:
        raise ValueError("a merged dtype applies to --merge")
    packed = _packed_layers(model)
    if merged_dtype is not None:
        run["export"] = {"weights": "dense", "loader": "transformers", "library_name": "transformers",
                         "dtype": str(MERGE_DTYPES[merged_dtype]).removeprefix("torch."),
                         "description": f"LoRA merged into a dense {merged_dtype} model: {packed} dequantized plus their adapter "
                                        "deltas, rounded once"}  # fmt: skip
        run.pop("adapter", None)
    elif merge:
        run["export"] = {"weights": "int4-packed", "loader": "hf_lowprec", "library_name": "hf-lowprec", "dtype": _dtype_name(model),
                         "description": f"{packed}, LoRA merged in and re-quantized (error in {MERGE_FILE})"}  # fmt: skip
        run.pop("adapter", None)
    else:
        run["export"] = {"weights": "int4-packed", "loader": "hf_lowprec", "library_name": "hf-lowprec", "dtype": _dtype_name(model),
                         "description": f"base: {packed}, plus LoRA adapters in PEFT format"}  # fmt: skip
        run["adapter"] = {**run.get("adapter", {}), "folder": f"{ADAPTER_DIR}/",
                          "note": "load_exported applies them; `hf-lowprec export --merge` folds them into the INT4 base"}  # fmt: skip
    with atomic_output_dir(out, overwrite) as tmp:
        export_int4_lora(model, tmp, merge=merge, merged_dtype=MERGE_DTYPES.get(merged_dtype), tokenizer=tokenizer,
                         overwrite=True)  # tmp is empty: written in place  # fmt: skip
        if merge and merged_dtype is None:
            run["merge"] = json.loads((tmp / MERGE_FILE).read_text())["summary"]
        _write_record(tmp, run, repo_id, extra_files)
    return out


def _dtype_name(model: nn.Module) -> str:
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def export_run(run_dir: str | os.PathLike, out: str | os.PathLike, *, overwrite: bool = False, repo_id: str | None = None,
               merge: bool = False, merged_dtype: str | None = None) -> Path:  # fmt: skip
    """Copy a finetune run folder's publishable files (weights, tokenizer, plan, record) to ``out`` and re-render its card.

    ``merge``: load the run's INT4 base + LoRA adapters and write them merged (re-quantized) instead;
    ``merged_dtype`` (``bf16``/``fp32``): merged into a plain dense model.
    """
    run_dir = Path(run_dir)
    run = read_run(run_dir)
    if merge:
        if not run.get("adapter"):
            raise ValueError(f"--merge: {str(run_dir)!r} has no LoRA adapters to merge (recipe method {run.get('recipe', {}).get('method')!r})")
        model, tokenizer = load_exported(run_dir)
        return export_model(model, tokenizer, out, run, weights="int4-packed", merge=True, merged_dtype=merged_dtype, overwrite=overwrite,
                            repo_id=repo_id)  # fmt: skip
    with atomic_output_dir(out, overwrite) as tmp:
        for item in run_dir.iterdir():
            if item.name in RUN_ONLY or item.name == CARD_FILE:
                continue
            (shutil.copytree if item.is_dir() else shutil.copy2)(item, tmp / item.name)
        render_model_card(run, repo_id).save(tmp / CARD_FILE)
    return Path(out)


def read_run(folder: str | os.PathLike) -> dict:
    """The run record of an exported/run folder; ``ValueError`` if it is not one."""
    path = Path(folder) / RUN_FILE
    if not Path(folder).is_dir():
        raise ValueError(f"{str(folder)!r} is not a folder")
    if not path.is_file():
        raise ValueError(f"{str(folder)!r} is not an hf-lowprec run or export folder (no {RUN_FILE})")
    return json.loads(path.read_text())


# -------------------------------------------------------------------------------------- load
def load_exported(path_or_repo: str | os.PathLike, *, apply_plan_numerics: bool = False, dtype: torch.dtype | None = None,
                  backend: str = "auto"):  # fmt: skip
    """``(model, tokenizer)`` of an exported folder or Hub repo.

    ``master`` exports load as plain ``transformers`` models (fp32 unless ``dtype``); with
    ``apply_plan_numerics`` the plan is re-applied so the model computes with its training-time FP8/INT4
    numerics. ``int4-packed`` exports load through ``finetune.load_int4_model`` (transformers with the
    ``hf_lowprec`` quantizer; a PEFT model when the folder holds adapters), their packed layers computing
    with ``backend`` (``auto``: int8 kernels where the CPU has them; ``dequant``: exactly the codes' values).
    """
    from hf_lowprec.checkpoints import load_pretrained

    folder = Path(path_or_repo)
    if not folder.is_dir():
        folder = Path(snapshot_download(str(path_or_repo)))
    run = read_run(folder)
    if run.get("export", {}).get("weights") == "int4-packed":
        from hf_lowprec.ondevice import load_int4_model

        if apply_plan_numerics:
            raise ValueError("a packed INT4 export already computes with its quantized weights; apply_plan_numerics is for master exports")
        return load_int4_model(folder, dtype=dtype, backend=backend)
    model, tokenizer = load_pretrained(folder, dtype=dtype or torch.float32)
    if apply_plan_numerics:
        apply_plan(model, PrecisionPlan.load(folder / PLAN_FILE))
    return model, tokenizer


# -------------------------------------------------------------------------------------- push
def push(folder: str | os.PathLike, repo_id: str, *, private: bool = False, create_pr: bool = False, token: str | None = None) -> str:
    """Create ``repo_id`` (if needed) and upload ``folder``; returns the commit or pull-request URL.

    The token comes from ``token``, else the usual places (``HF_TOKEN``, ``hf auth login``); it is sent
    only in request headers, never logged or written. The card's loading snippet is re-rendered for ``repo_id``.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{str(folder)!r} is not a folder to push")
    token = token or get_token()
    if not token:
        raise ValueError("no Hugging Face token found: set HF_TOKEN or run `hf auth login`")
    if (folder / RUN_FILE).is_file():
        atomic_write_text(folder / CARD_FILE, render_model_card(read_run(folder), repo_id).content)
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        info = api.upload_folder(folder_path=folder, repo_id=repo_id, create_pr=create_pr,
                                 commit_message="Upload model trained with hf-lowprec")  # fmt: skip
    except Exception as e:  # huggingface_hub raises HTTP, validation and connection errors
        message = str(e).replace(token, "***").strip().splitlines()
        raise ValueError(f"push to {repo_id!r} failed: {message[0] if message else type(e).__name__}") from None
    return info.pr_url or info.commit_url
