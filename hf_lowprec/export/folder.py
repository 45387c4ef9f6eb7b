"""Exporting a trained model as a loadable folder (master weights, packed INT4, or INT4 base + LoRA) and loading one."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from huggingface_hub import snapshot_download
from peft import PeftModel
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.tensor import DTensor

from hf_lowprec.checkpoints import (
    architecture_class,
    cannot_load,
    is_local_checkpoint,
    load_pretrained,
    public_name,
    refuse_a_missing_local_path,
)
from hf_lowprec.convert import apply_plan, freeze, packs_when_frozen, revert
from hf_lowprec.export.compressed_tensors import rerounded, vllm_serving, write_compressed_tensors
from hf_lowprec.export.gguf import ADAPTER_FILE, export_gguf
from hf_lowprec.export.hf_quantizer import quantization_config_dict, with_load_guards
from hf_lowprec.export.publish import check_repo_id
from hf_lowprec.export.records import (
    CARD_FILE,
    kept_layers_stored_in,
    plan_record,
    published,
    read_run,
    relative_file_name,
    write_record,
)
from hf_lowprec.folders import TRACES_DIR, atomic_output_dir
from hf_lowprec.layers import eligible_layers
from hf_lowprec.modules import FROZEN_TYPES, LOW_PRECISION_TYPES, PackedEmbedding, PackedInt4Linear, PackedInt8Linear
from hf_lowprec.modules.packed import packed_class
from hf_lowprec.ondevice import MERGE_DTYPES, MERGE_FILE, export_int4_lora, load_int4_model
from hf_lowprec.ondevice.export import (
    ADAPTER_CONFIG,
    NO_ADAPTER_LOOKUP,
    adapter_config_naming,
    adapter_folder,
    dense_merged_state,
    without_hf_quantizer,
)
from hf_lowprec.plan import PLAN_FILE, PrecisionPlan
from hf_lowprec.recipe import EXPORT_WEIGHTS
from hf_lowprec.scaling import TELEMETRY_BUFFERS, make_policy_factory

logger = logging.getLogger(__name__)

CONVERSION_OPTIONS = ("scaler", "scaler_options", "learn_scales")  # a session's, recorded: plan numerics reuse them
LEARNED_STATE_FILE = "hf_lowprec_learned_state.safetensors"  # its unpacked layers' INT4 steps, smoothing scales
# export_run: the run's own files, the packed INT4 layers as compressed-tensors, or a dense bf16 model
EXPORT_FORMATS = ("native", "compressed-tensors", "bf16", "gguf")
AS_TRAINED = "the model as trained, before export"  # an eval row's label where the export changed the weights


def export_model(
    model: nn.Module,
    tokenizer,
    out: str | os.PathLike,
    run: Mapping,
    *,
    weights: str = "master",
    merge: bool = False,
    merged_dtype: str | None = None,
    overwrite: bool = False,
    repo_id: str | None = None,
    extra_files: Mapping[str, str | bytes] | None = None,
) -> Path:
    """Write ``model`` (its plan applied) as a publishable folder at ``out``, atomically; returns ``out``.

    ``weights``: ``master`` (plain high-precision weights; FP8/INT4 layers reverted on a copy, what they learned
    besides their weights, INT4 steps and smoothing scales, in ``LEARNED_STATE_FILE``),
    ``int4-packed`` (INT4 layers frozen to packed codes on a copy, other layers as master weights;
    ``config.json`` gets ``quant_method: hf_lowprec`` so ``from_pretrained`` rebuilds them after
    ``import hf_lowprec``), or ``auto``: ``int4-packed`` when the plan put layers in INT4, else ``master`` (the run
    record says which). A trained INT4 layer's master weight is not what it learned: its forward saw the
    quantized weight, and its updates, far below an INT4 step, barely move the codes while its learned steps
    adapt the grid (SmolLM2-135M, the auto-mixed recipe's plan, 200 steps, 3 seeds: served as trained 1.027x bf16's
    perplexity, ``int4-packed`` 1.021x, ``master`` 1.051x; ``benchmarks/finetune_quality.py``). A PEFT model from ``finetune.prepare_int4_lora`` is saved by
    ``finetune.export_int4_lora``: packed base + adapters, or with ``merge`` the adapters merged and re-quantized
    (``merged_dtype`` ``bf16``/``fp32``: merged into a plain dense model instead).
    ``run``: the run record (see the module docstring); its ``plan``/``layers``/``export`` are filled in here.
    ``extra_files``: ``{name: text or bytes}`` written next to the weights (e.g. ``recipe.yaml``, a loss-curve PNG).
    """
    if weights not in EXPORT_WEIGHTS:
        raise ValueError(f"export weights {weights!r}: choose one of {', '.join(EXPORT_WEIGHTS)}")
    if any(isinstance(p, DTensor) for p in model.parameters()):  # FSDP2's shards, tensor parallelism (no deepcopy)
        raise ValueError(
            "export_model needs whole weights, not distributed tensors (FSDP2 or tensor-parallel shards): gather them "
            "(accelerator.get_state_dict(model)) into a fresh model converted with the same plan "
            "(LowPrecisionPlugin(plan).convert(fresh)) and export that"
        )
    peft = getattr(model, "peft_config", None) is not None
    base = model.get_base_model() if peft else model
    if weights == "auto":
        weights = resolved_weights(base, weights)
        logger.info("export weights auto: %s", weights)
    plan = getattr(base, "hf_lowprec_plan", None) or PrecisionPlan()
    run = dict(run)
    name = getattr(base.config, "name_or_path", None)
    if name and not {"base_model", "base_model_path"} & set(run):  # the card's "starting from"
        run["base_model_path" if is_local_checkpoint(name) else "base_model"] = public_name(name)
    run["plan"] = plan.to_dict()
    run["layers"], run["plan_rows"] = plan_record(base, plan)
    if (options := getattr(base, "hf_lowprec_options", None)) is not None:  # a training session's: plan numerics
        run["conversion_options"] = {k: options[k] for k in CONVERSION_OPTIONS}
    if peft:
        return _export_lora(
            model, tokenizer, Path(out), run, merge, merged_dtype, overwrite, repo_id, extra_files, source=name
        )
    if merge:
        raise ValueError("merge applies to LoRA adapters; this model has none")
    with atomic_output_dir(out, overwrite, source=name) as tmp:
        copy_ = copy.deepcopy(model)
        learned = _learned_state(copy_, packing=weights == "int4-packed")
        run["export"] = _export_weights(copy_, weights)
        if getattr(copy_.config, "use_cache", None) is not None:
            copy_.config.use_cache = True  # training turned the KV cache off; generation wants it
        packed = weights == "int4-packed"
        copy_.save_pretrained(tmp, state_dict=with_load_guards(copy_, copy_.state_dict()) if packed else None)
        if learned:
            save_file(learned, tmp / LEARNED_STATE_FILE)
        if weights == "int4-packed":
            _mark_packed(copy_, plan, tmp)
        del copy_
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / PLAN_FILE).write_text(json.dumps(plan.to_dict(), indent=2) + "\n")
        write_record(tmp, run, repo_id, extra_files)
    return Path(out)


def _learned_state(model: nn.Module, packing: bool = False) -> dict[str, torch.Tensor]:
    """What the low-precision layers learned or calibrated besides their weights (INT4 steps, smoothing scales),
    ``{state-dict key: tensor}``: an export keeps it next to the weights, so the plan re-applied on load
    (``load_exported(apply_plan_numerics=True)``) computes as the trained model did rather than from fresh steps.
    ``packing``: only the layers an ``int4-packed`` export keeps dense (its packed ones hold their steps)."""
    state = {}
    for name, module in model.named_modules():
        if packing and packs_when_frozen(module):
            continue
        if isinstance(module, LOW_PRECISION_TYPES) and not isinstance(module, FROZEN_TYPES):
            prefix = f"{name}." if name else ""
            learned = {  # telemetry counters are no numerics: the re-applied layers (defaults) have none
                k: v
                for k, v in module.state_dict().items()
                if k not in ("weight", "bias") and k.rsplit(".", 1)[-1] not in TELEMETRY_BUFFERS
            }
            # cloned: a tied head and embedding share one quantizer, and safetensors refuses shared storage
            state.update({prefix + k: v.detach().clone().contiguous() for k, v in learned.items()})
    return state


def _export_weights(model: nn.Module, weights: str) -> dict:
    """Turn ``model`` (a copy) into what ``weights`` exports, in place; returns the run record's ``export``."""
    if weights == "int4-packed":
        if freeze(model) == 0 and sum(_packed_counts(model)) == 0:  # a reloaded packed export: packed already
            raise ValueError(
                "export weights 'int4-packed' needs int4 (or per-channel int8) layers in the plan; this model "
                "has none (export 'master')"
            )
        revert(model)  # FP8 / other layers back to plain layers with their master weights
        loader, description = "hf_lowprec", f"{_packed_layers(model)} with their learned steps"
    else:
        revert(model)
        loader, description = "transformers", "high-precision master weights"
    library = "hf-lowprec" if loader == "hf_lowprec" else "transformers"
    return {
        "weights": weights,
        "loader": loader,
        "library_name": library,
        "dtype": _dtype_name(model),
        "description": description,
    }


def _mark_packed(model: nn.Module, plan: PrecisionPlan, folder: Path) -> None:
    """``config.json`` with ``quantization_config`` so transformers rebuilds the packed layers
    (hf_lowprec.export.hf_quantizer)."""
    config = copy.deepcopy(model.config)
    config.quantization_config = quantization_config_dict(plan, model)
    config.save_pretrained(folder)


def resolved_weights(model: nn.Module, weights: str) -> str:
    """What an export of ``model`` with ``weights`` writes: ``auto`` is ``int4-packed`` when a layer packs when frozen
    (INT4, per-channel int8), else ``master``; the others as they are."""
    if weights != "auto":
        return weights
    return "int4-packed" if any(packs_when_frozen(m) for m in model.modules()) else "master"


def _packed_counts(model: nn.Module) -> tuple[int, int]:
    """``(packed INT4 layers, packed int8 layers)`` of ``model``: linears and the embeddings that own their codes (a
    tied one reads its head's, counted once, with the head)."""
    tables = [m.table if isinstance(m, PackedEmbedding) else m for m in model.modules()]
    return sum(isinstance(t, PackedInt4Linear) for t in tables), sum(isinstance(t, PackedInt8Linear) for t in tables)


def _packed_layers(model: nn.Module) -> str:
    """``"N layers as packed INT4 codes (two per byte)[, M as int8 codes]"`` for ``model``'s packed layers."""
    n4, n8 = _packed_counts(model)
    return f"{n4} layers as packed INT4 codes (two per byte)" + (f", {n8} as int8 codes" if n8 else "")


def _export_lora(
    model,
    tokenizer,
    out: Path,
    run: dict,
    merge: bool,
    merged_dtype: str | None,
    overwrite: bool,
    repo_id,
    extra_files,
    source: str | None,
) -> Path:
    """Packed INT4 base + LoRA adapters (or merged) through ``finetune.export_int4_lora``, then the record and card."""
    if merged_dtype is not None and merged_dtype not in MERGE_DTYPES:
        raise ValueError(f"merged dtype {merged_dtype!r}: choose one of {', '.join(MERGE_DTYPES)}")
    if merged_dtype is not None and not merge:
        raise ValueError("a merged dtype applies to --merge")
    packed = _packed_layers(model)
    if merged_dtype is not None:
        run["export"] = {
            "weights": "dense",
            "loader": "transformers",
            "library_name": "transformers",
            "dtype": str(MERGE_DTYPES[merged_dtype]).removeprefix("torch."),
            "description": f"LoRA merged into a dense {merged_dtype} model: {packed} dequantized plus their adapter "
            "deltas, rounded once",
        }
        run.pop("adapter", None)
        kept_layers_stored_in(run, MERGE_DTYPES[merged_dtype])
        if MERGE_DTYPES[merged_dtype] != torch.float32:
            _weights_changed(
                run,
                f"adapters merged into a dense {merged_dtype} model: weights cast to {merged_dtype} (the dequantized "
                "INT4 weights plus the adapter deltas, rounded once)",
            )
    elif merge:
        run["export"] = {
            "weights": "int4-packed",
            "loader": "hf_lowprec",
            "library_name": "hf-lowprec",
            "dtype": _dtype_name(model),
            "description": f"{packed}, LoRA merged in and re-quantized (error in {MERGE_FILE})",
        }
        run.pop("adapter", None)
    else:
        run["export"] = {
            "weights": "int4-packed",
            "loader": "hf_lowprec",
            # not peft: the repository is a packed model with its adapters embedded, which from_pretrained loads
            # whole after `import hf_lowprec`; the Hub's peft snippet would put them onto the dense base_model
            "library_name": "hf-lowprec",
            "dtype": _dtype_name(model),
            "description": f"base: {packed}, plus LoRA adapters beside the weights (PEFT format)",
        }
        run["adapter"] = {
            **run.get("adapter", {}),
            "folder": "./",
            "note": "`hf-lowprec export --merge` folds them into the INT4 base",
        }
        if run["adapter"].get("learned_steps"):
            run["adapter"]["note"] += (
                "; they were trained with this base's learned steps and zero points and belong with it, not with the "
                "original checkpoint"
            )
    with atomic_output_dir(out, overwrite, source) as tmp:
        export_int4_lora(
            model,
            tmp,
            merge=merge,
            merged_dtype=MERGE_DTYPES.get(merged_dtype),
            tokenizer=tokenizer,
            overwrite=True,  # tmp is empty: written in place
            base_model_id=repo_id,  # the adapters' base is this folder's packed model
        )
        if merge and merged_dtype is None:
            run["merge"] = m = json.loads((tmp / MERGE_FILE).read_text())["summary"]
            _weights_changed(
                run,
                f"adapters merged into the INT4 codes: re-quantized ({m['layers']} layers, relative weight error "
                f"median {100 * m['rel_error_median']:.3g}%)",
            )
        write_record(tmp, run, repo_id, extra_files)
    return out


def _weights_changed(run: dict, change: str) -> None:
    """Record that the export's weights are not those its run measured: ``change`` (what the export did to them) joins
    ``run["export_changes"]``, and each ``eval`` row is labeled as the figure of the model as trained."""
    run["export_changes"] = [*run.get("export_changes", []), change]
    if "eval" in run:
        run["eval"] = [{**row, "computed": _as_trained(row.get("computed"))} for row in run["eval"]]


def _as_trained(computed: str | None) -> str:
    """An eval row's ``computed`` labeled as the trained model's, once."""
    if computed and computed.startswith(AS_TRAINED):
        return computed
    return f"{AS_TRAINED}: {computed}" if computed else AS_TRAINED


def _dtype_name(model: nn.Module) -> str:
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def export_run(
    run_dir: str | os.PathLike,
    out: str | os.PathLike,
    *,
    overwrite: bool = False,
    repo_id: str | None = None,
    merge: bool = False,
    merged_dtype: str | None = None,
    weights_format: str = "native",
) -> Path:
    """Copy a finetune run folder's publishable files (weights, tokenizer, plan, record) to ``out`` and re-render its
    card.

    ``merge``: load the run's INT4 base + LoRA adapters and write them merged (re-quantized) instead;
    ``merged_dtype`` (``bf16``/``fp32``): merged into a plain dense model. ``weights_format``: ``native`` (the
    run's own files, which hf-lowprec resumes training from), ``compressed-tensors`` (the packed INT4 layers in the
    layout transformers loads without hf-lowprec and vLLM reads; adapters kept in PEFT format) or ``bf16`` (a dense
    bf16 model transformers loads alone: LoRA adapters merged in, packed layers dequantized, master weights cast);
    :func:`run_formats` says which apply to a run.
    """
    run_dir = Path(run_dir)
    run = read_run(run_dir)
    source, target = run_dir.resolve(), Path(out).resolve()
    if target == source or target.is_relative_to(source) or source.is_relative_to(target):
        raise ValueError(
            f"export out {str(out)!r} is the run folder {str(run_dir)!r} itself, inside it or around it: the export "
            "would replace what it reads; choose a folder of its own"
        )
    if weights_format not in EXPORT_FORMATS:
        raise ValueError(f"export format {weights_format!r}: choose one of {', '.join(EXPORT_FORMATS)}")
    if repo_id is not None:  # it goes into the card's snippets and the adapters' config
        check_repo_id(repo_id)
    formats = run_formats(run)
    if weights_format not in formats:
        held = run.get("export", {}).get("description", "no export record")
        raise ValueError(
            f"export format {weights_format!r} does not apply to {str(run_dir)!r} ({held}); choose one of "
            f"{', '.join(formats)}"
        )
    if merge and weights_format != "native":
        raise ValueError(f"--merge applies to the native format; format {weights_format!r} chooses the weights itself")
    if weights_format == "compressed-tensors":
        return _export_compressed_tensors(run_dir, Path(out), run, overwrite, repo_id)
    if weights_format == "gguf":
        return _export_gguf(run_dir, Path(out), run, overwrite, repo_id)
    if weights_format == "bf16" and not run.get("adapter"):
        return _export_dense(run_dir, Path(out), run, overwrite, repo_id)
    if weights_format == "bf16":  # LoRA merged into a dense bf16 model
        merge, merged_dtype = True, "bf16"
    if merge:
        if not run.get("adapter"):
            raise ValueError(
                f"--merge: {str(run_dir)!r} has no LoRA adapters to merge (recipe method "
                f"{run.get('recipe', {}).get('method')!r}); its export formats are {', '.join(formats)}"
            )
        held = run.get("export", {})
        if held.get("weights") != "int4-packed":  # its adapters sit on another layout's base
            raise ValueError(
                f"--merge: {str(run_dir)!r} holds {held.get('description', 'no packed INT4 base')}, not the "
                "packed INT4 base hf-lowprec merges adapters into; merge from the run folder or its native export"
            )
        model, tokenizer = load_exported(run_dir)
        return export_model(
            model,
            tokenizer,
            out,
            run,
            weights="int4-packed",
            merge=True,
            merged_dtype=merged_dtype,
            overwrite=overwrite,
            repo_id=repo_id,
            extra_files=_run_files(run_dir, run),
        )
    with atomic_output_dir(out, overwrite) as tmp:
        for item in run_dir.rglob("*"):  # the model's files (no stray unfinished write or hidden file), card aside
            if item.is_file() and item.name != CARD_FILE and published(item, run_dir):
                (tmp / item.relative_to(run_dir)).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(item, tmp / item.relative_to(run_dir))
        if repo_id is not None and (adapters := adapter_folder(tmp)) is not None:  # their base: this folder's model
            config = adapters / ADAPTER_CONFIG
            config.write_text(adapter_config_naming(config, repo_id))
        write_record(tmp, run, repo_id, None)
    return Path(out)


def _run_files(run_dir: Path, run: Mapping) -> dict[str, bytes]:
    """What an export made from the run folder carries beside its weights: the loss-curve PNG the card shows and the
    TensorBoard traces (``runs/``, which the Hub shows as training metrics)."""
    files = {f"{TRACES_DIR}/{f.relative_to(run_dir / TRACES_DIR).as_posix()}": f.read_bytes()
             for f in sorted((run_dir / TRACES_DIR).rglob("*")) if f.is_file()}  # fmt: skip
    curve = run.get("loss_curve")
    if curve and (path := run_dir / relative_file_name(curve)).is_file():
        files[curve] = path.read_bytes()
    return files


def run_formats(run: Mapping) -> tuple[str, ...]:
    """The :data:`EXPORT_FORMATS` that apply to the run or export whose record is ``run``: ``native`` always,
    ``compressed-tensors`` and ``gguf`` to packed INT4 weights, ``bf16`` to packed or high-precision weights."""
    weights = run.get("export", {}).get("weights")
    if weights == "int4-packed":
        return EXPORT_FORMATS
    return ("native", "bf16") if weights in ("master", "dense") else ("native",)


def _export_dense(run_dir: Path, out: Path, run: dict, overwrite: bool, repo_id: str | None) -> Path:
    """A full run as a plain dense bf16 model that transformers loads alone: packed layers dequantized (their learned
    steps applied), the other weights (master weights) cast to bf16; with the record and card."""
    model, tokenizer = load_exported(run_dir)
    dtype = MERGE_DTYPES["bf16"]
    state, sources = dense_merged_state(model, dtype)
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "bfloat16"
    config.use_cache = True  # training turned the KV cache off; generation wants it
    n4, n8 = _packed_counts(model)
    weights = f"{n4} packed INT4" + (f" and {n8} int8" if n8 else "") + " layers dequantized, the other weights"
    weights = weights if n4 + n8 else "the high-precision master weights"
    cast_from = f" from {', '.join(sorted(sources))}" if sources else ""
    if n4 + n8:
        other = f", the other weights{cast_from}" if cast_from else ""
        _weights_changed(run, f"weights cast to bf16 ({n4 + n8} packed layers dequantized{other})")
    elif cast_from:
        _weights_changed(run, f"weights cast{cast_from} to bf16")
    kept_layers_stored_in(run, dtype)
    run["export"] = {
        "weights": "dense",
        "loader": "transformers",
        "library_name": "transformers",
        "dtype": "bfloat16",
        "description": f"a dense bf16 model: {weights} cast to bf16",
    }
    with atomic_output_dir(out, overwrite) as tmp, without_hf_quantizer(model):
        model.save_pretrained(tmp, state_dict=state)
        config.save_pretrained(tmp)  # model.config stays untouched
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        write_record(tmp, run, repo_id, _run_files(run_dir, run))
    return out


def _plan_layers_held_dense(model: nn.Module, run_dir: Path, run: dict, loader: str) -> None:
    """A full run's packed export holds the layers its plan computes in a format that does not pack (FP8) as their
    dense master weights, which ``loader`` computes unquantized: record it (:func:`_weights_changed`) and warn."""
    if run.get("recipe", {}).get("method") != "full" or not (run_dir / PLAN_FILE).is_file():
        return
    assigned = PrecisionPlan.load(run_dir / PLAN_FILE).assign(model)
    held = [spec.name for name, spec in assigned.items() if not spec.is_high_precision and packed_class(spec) is None]
    if held:
        change = (
            f"{len(held)} layers the plan computes in {', '.join(sorted(set(held)))} held as their dense master "
            f"weights, which {loader} computes unquantized"
        )
        logger.warning("%s export: %s; it computes unlike the model as trained", loader, change)
        _weights_changed(run, change)


def _export_compressed_tensors(run_dir: Path, out: Path, run: dict, overwrite: bool, repo_id: str | None) -> Path:
    """The run's packed model (and adapters) in the compressed-tensors layout, with its record and card."""
    model, tokenizer = load_exported(run_dir)
    n4, n8 = _packed_counts(model)
    # the layout has no packed embedding: an INT4 one is written as its dense dequantized table
    tables = sum(isinstance(m, PackedEmbedding) and isinstance(m.table, PackedInt4Linear) for m in model.modules())
    n4 -= tables
    _plan_layers_held_dense(model, run_dir, run, "compressed-tensors")
    with atomic_output_dir(out, overwrite) as tmp:
        done = write_compressed_tensors(model, tmp, tokenizer=tokenizer, base_model_id=repo_id)
        if done.requantized:
            change = rerounded(done.requantized, n4)
            logger.warning("compressed-tensors export: %s; it computes unlike the model as trained", change)
            _weights_changed(run, change)
        adapters = "; LoRA adapters beside the weights (PEFT format)" if run.get("adapter") else ""
        if done.adapter_rank is not None:
            adapters += (
                f", rank {done.adapter_rank}: the run's rank {run['adapter'].get('r')} plus the fractional part of "
                f"{done.residual_layers} layers' learned zero points, which the layout stores as integers (exact; "
                f"{vllm_serving(done.adapter_rank)})"
            )
        run["export"] = {
            "weights": "compressed-tensors",
            "loader": "compressed-tensors",
            "library_name": "transformers",  # its from_pretrained loads the model with the adapters beside it
            "dtype": _dtype_name(model),
            "description": f"{n4} layers as packed INT4 codes (two per byte)"
            + (f"; {n8} int8 layers as dense weights" if n8 else "")
            + ("; the INT4 input embedding as a dense table (the layout packs no embedding)" if tables else "")
            + adapters,
            "requantized_layers": done.requantized,
        }
        if run.get("adapter"):
            note = "the fine-tuning: from_pretrained applies them (PEFT) as it loads the folder"
            run["adapter"] = {**run["adapter"], "note": note}
        write_record(tmp, run, repo_id, _run_files(run_dir, run))
    return out


def _export_gguf(run_dir: Path, out: Path, run: dict, overwrite: bool, repo_id: str | None) -> Path:
    """The run's packed model as llama.cpp's ``model.gguf`` (and its adapters as ``adapter.gguf``), with its record
    and card (:mod:`hf_lowprec.export.gguf`)."""
    model, tokenizer = load_exported(run_dir, backend="dequant")  # read, not run: no kernel timing
    _plan_layers_held_dense(model, run_dir, run, "llama.cpp")
    with atomic_output_dir(out, overwrite) as tmp:
        written = export_gguf(model, tokenizer, tmp, run.get("name") or run_dir.name)
        kinds = ", ".join(f"{count} {kind}" for kind, count in written["tensor_types"].items())
        run["export"] = {
            "weights": "gguf",
            "loader": "llama.cpp",
            "library_name": "gguf",
            "dtype": _dtype_name(model),
            "description": f"{kinds} tensors: the INT4 codes as trained, in Q4_1 blocks whose scales round to fp16 "
            f"(decoded weights at most {written['max_scale_error']:.2g} of a step off)"
            + (f"; LoRA adapters in {ADAPTER_FILE}" if ADAPTER_FILE in written["files"] else ""),
            "files": written["files"],
        }
        if run.get("adapter"):
            run["adapter"] = {**run["adapter"], "folder": ADAPTER_FILE, "note": "llama.cpp's LoRA adapter file"}
        write_record(tmp, run, repo_id, _run_files(run_dir, run))
    return out


# -------------------------------------------------------------------------------------- load
def loadable_weights(folder: Path, name: str, apply_plan_numerics: bool) -> str | None:
    """The ``export.weights`` kind of the run or export ``folder`` (called ``name``) that :func:`load_exported` loads
    (with ``apply_plan_numerics``); ``ValueError`` where it loads none: not a run folder, a GGUF export, the plan's
    numerics of a compressed-tensors export."""
    export = read_run(folder).get("export") or {}  # a folder missing a file it names: said here, not by its loader
    weights = export.get("weights")
    if weights == "gguf":
        lora = f" --lora {ADAPTER_FILE}" if ADAPTER_FILE in export.get("files", ()) else ""
        raise ValueError(
            f"{name!r} is a GGUF export, which llama.cpp runs (llama-completion -m model.gguf{lora}); "
            "load or evaluate the run folder it was exported from"
        )
    if apply_plan_numerics and weights == "compressed-tensors":
        raise ValueError(
            "a compressed-tensors export computes with its quantized weights; the plan's numerics "
            "(apply_plan_numerics, eval --plan-numerics) are for native exports"
        )
    if apply_plan_numerics and not (folder / PLAN_FILE).is_file():
        raise ValueError(
            f"{name!r} holds no precision plan ({PLAN_FILE}): its {weights or 'dense'} weights compute as they are; "
            "the plan's numerics (apply_plan_numerics, eval --plan-numerics) are for native exports and run folders"
        )
    return weights


def load_exported(
    path_or_repo: str | os.PathLike,
    *,
    apply_plan_numerics: bool = False,
    dtype: torch.dtype | None = None,
    backend: str = "auto",
):
    """``(model, tokenizer)`` of an exported folder or Hub repo.

    ``master`` exports load as plain ``transformers`` models (fp32 unless ``dtype``); with
    ``apply_plan_numerics`` the plan is re-applied, with the layers' learned INT4 steps and smoothing scales, so the
    model computes with its training-time FP8/INT4 numerics. ``int4-packed`` exports load through
    ``finetune.load_int4_model`` (transformers with the ``hf_lowprec`` quantizer; a PEFT model when the folder holds
    adapters), their packed layers computing with ``backend`` (``auto``: int8 kernels where the CPU has them;
    ``dequant``: exactly the codes' values); ``apply_plan_numerics`` re-applies the plan to the layers they hold
    dense (a mixed plan's FP8 ones) and, for a model whose INT4 layers trained fake-quantized (full training, not
    a LoRA base), makes ``auto`` compute them as those did: ``dequant``. Other folders holding adapters
    (compressed-tensors exports) load as a ``PeftModel`` too.
    """
    name = os.fspath(path_or_repo)
    folder = Path(name).expanduser()
    if folder.is_file():
        raise ValueError(f"{name!r} is a file; pass an exported folder or a Hub repo id")
    if not folder.is_dir():
        refuse_a_missing_local_path(name, "export folder")
        try:
            folder = Path(snapshot_download(name))
        except (OSError, ValueError) as e:  # not found, gated, unreachable (OSErrors); a refused repo id (ValueError)
            raise cannot_load(name, e) from e
    weights = loadable_weights(folder, name, apply_plan_numerics)
    if weights == "int4-packed":
        method = read_run(folder, whole=False).get("recipe", {}).get("method")
        lora_base = adapter_folder(folder) is not None or method == "int4-lora"
        if apply_plan_numerics and backend == "auto" and not lora_base:
            backend = "dequant"  # its INT4 layers trained on their dequantized weights, not through int8 kernels
        model, tokenizer = load_int4_model(folder, dtype=dtype, backend=backend)
    else:
        model_class = architecture_class(folder)
        model, tokenizer = load_pretrained(
            folder, dtype=dtype or torch.float32, model_class=model_class, adapter_kwargs=NO_ADAPTER_LOOKUP
        )
        if (adapters := adapter_folder(folder)) is not None:  # a compressed-tensors export's LoRA adapters
            model = PeftModel.from_pretrained(model, adapters).eval()
    if apply_plan_numerics:
        _apply_plan_numerics(model, folder)
    return model, tokenizer


def _apply_plan_numerics(model: nn.Module, folder: Path) -> None:
    """The export's own plan (not one "made for" the base model it names) re-applied to the layers ``model`` holds
    dense (every layer of a master export; an int4-packed one's unpacked layers), with the training session's options
    (the record's ``conversion_options``: its scaler, learned steps) and what the layers learned
    (:data:`LEARNED_STATE_FILE`)."""
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    # a tied embedding reading its packed head's codes is no layer to convert: rules naming it alone are dropped
    plan = dataclasses.replace(PrecisionPlan.load(folder / PLAN_FILE).restricted_to(eligible_layers(base)), model=None)
    options = read_run(folder, whole=False).get("conversion_options")
    factory = None if options is None else make_policy_factory(options["scaler"], **options["scaler_options"])
    learn = True if options is None else options["learn_scales"]
    apply_plan(base, plan, learn_scales=learn, policy_factory=factory)
    if (folder / LEARNED_STATE_FILE).is_file():  # the trained layers' INT4 steps, smoothing scales
        learned, own = load_file(folder / LEARNED_STATE_FILE), base.state_dict()
        base.load_state_dict({k: v for k, v in learned.items() if k in own}, strict=False)
        left = sorted(set(learned) - set(own))
        if left:  # the run converted with other options (a delayed scaling's amax history, learned activation steps)
            logger.warning(
                "%s: %d entries the re-applied layers lack (%s, ...): the run's layers were converted with other "
                "options than the plan is re-applied with (apply_plan's policy_factory or learn_activation_scales "
                "outside a Trainer callback / Accelerate plugin), so these numerics are not exactly the run's",
                LEARNED_STATE_FILE, len(left), left[0],
            )  # fmt: skip
