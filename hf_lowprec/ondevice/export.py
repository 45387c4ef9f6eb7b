"""Export of an INT4+LoRA model: the packed base with PEFT adapters, or merged (into the INT4 base, or a dense
bf16/fp32 model), and reloading it.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import shutil
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel
from peft.utils import CONFIG_NAME as ADAPTER_CONFIG
from peft.utils import ModulesToSaveWrapper
from torch import nn
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

from hf_lowprec.allocator import freed_memory_returned
from hf_lowprec.checkpoints import TOKENIZER_FILES, architecture_class
from hf_lowprec.convert import canonical_name

# also registers quant_method "hf_lowprec" with transformers: from_pretrained loads exported folders
from hf_lowprec.export.hf_quantizer import quantization_config_dict, with_load_guards
from hf_lowprec.folders import atomic_output_dir, atomic_write_text, check_output_dir
from hf_lowprec.modules.int4_lora import PackedLoraLinear, lora_delta, register_int4_lora, requantize_merged
from hf_lowprec.modules.packed import PackedLinear
from hf_lowprec.modules.packed_embedding import with_dense_tables
from hf_lowprec.ondevice.learned_steps import learned_steps_folded_in
from hf_lowprec.plan import PLAN_FILE, PrecisionPlan
from hf_lowprec.pread_safetensors import read_safetensors

logger = logging.getLogger(__name__)


MERGE_FILE = "hf_lowprec_merge.json"
MERGE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}  # export --merge-into dense dtypes
LEGACY_ADAPTER_DIR = "adapter"  # where exports before 2026-12-06 kept their adapters (still read)
# from_pretrained(folder, adapter_kwargs=NO_ADAPTER_LOOKUP) loads a folder's model without the adapters at its top,
# which transformers otherwise applies itself (inference-only LoRA layers, not a PeftModel) when it finds an
# adapter_config.json there. transformers has no switch for that lookup, so it is pointed at a subfolder no
# folder has (a local path: no Hub request).
NO_ADAPTER_LOOKUP = {"subfolder": ".hf-lowprec-base-only"}


def adapter_folder(folder: Path) -> Path | None:
    """Where the export ``folder`` keeps its LoRA adapters (PEFT format): its top, where transformers'
    ``from_pretrained(folder)`` and ``pipeline`` apply them with the model (their convention for a model with its
    adapter embedded), or ``adapter/`` in exports written before 2026-12-06; ``None`` without adapters."""
    for where in (folder, folder / LEGACY_ADAPTER_DIR):
        if (where / ADAPTER_CONFIG).is_file():
            return where
    return None


def adapter_config_naming(config: Path, base_model_id: str) -> str:
    """The text of the adapter config file ``config`` with ``base_model_id`` (a Hub id) as the adapters' base: what
    ``push`` uploads and ``export --repo-id`` writes, so that ``from_pretrained(base_model_id)`` finds it."""
    named = {**json.loads(config.read_text()), "base_model_name_or_path": base_model_id}
    return json.dumps(named, indent=2, sort_keys=True)


def adapterless_state(base: nn.Module, merged: bool = False) -> dict[str, torch.Tensor]:
    """``base``'s state dict without the LoRA tensors, keys as in the unwrapped model. A layer PEFT trains a copy of
    (``modules_to_save``) is its original, or with ``merged`` the copy the model computes with (the first active
    adapter's, as PEFT's forward takes it; none while adapters are disabled), under the layer's own
    name (its ``original_module``/``modules_to_save`` keys left a merged export's head missing: random on reload)."""
    state = {k.replace(".base_layer", ""): v for k, v in base.state_dict().items() if ".lora_" not in k}
    for fqn, wrapper in base.named_modules():
        if not isinstance(wrapper, ModulesToSaveWrapper):
            continue
        for key in [k for k in state if k.startswith((f"{fqn}.original_module.", f"{fqn}.modules_to_save."))]:
            del state[key]
        active = [n for n in wrapper.active_adapters if n in wrapper.modules_to_save]
        computing = merged and not wrapper.disable_adapters and active
        layer = wrapper.modules_to_save[active[0]] if computing else wrapper.original_module
        state.update({f"{fqn}.{k}": v for k, v in layer.state_dict().items()})
    return state


def _adapter_delta(module: nn.Module) -> torch.Tensor | None:
    """The summed weight delta (fp32) a LoRA layer's active adapters add to its base as it computes: none for an
    adapter merged into the base already (``merge_adapter()``) or while adapters are disabled
    (``disable_adapter()``); ``None`` for other modules and where no adapter adds one."""
    if not hasattr(module, "lora_A") or module.disable_adapters:
        return None
    names = [n for n in module.active_adapters if n in module.lora_A and n not in module.merged_adapters]
    return sum(lora_delta(module, n) for n in names) if names else None


def dense_merged_state(base: nn.Module, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], set[str]]:
    """``(the base model's state dict as plain dtype weights, the dtypes other tensors were cast from)``: every packed
    layer dequantized, LoRA deltas added to packed and dense layers alike (one rounding, to ``dtype``); packed
    embeddings written dense; every other floating tensor cast (a tied head and embedding stay one tensor, unless
    ``modules_to_save`` trained a copy of one)."""
    state = with_dense_tables(adapterless_state(base, merged=True), base, dtype)
    for fqn, module in base.named_modules():
        layer = module.get_base_layer() if hasattr(module, "get_base_layer") else module
        delta = _adapter_delta(module)
        if fqn.endswith(".base_layer") or not isinstance(layer, PackedLinear) and delta is None:
            continue
        if isinstance(layer, PackedLinear):
            weight = layer.dequantized_weight(torch.float32)
            for buf in PackedLinear.BUFFERS:
                state.pop(f"{fqn}.{buf}", None)
        else:  # a layer the plan kept, with an adapter
            weight = layer.weight.float()
        state[f"{fqn}.weight"] = (weight if delta is None else weight + delta).to(dtype)
    cast, sources = {}, set()
    for key, tensor in state.items():
        if tensor.is_floating_point() and tensor.dtype != dtype:
            storage = (tensor.data_ptr(), tensor.shape)
            if storage not in cast:
                cast[storage] = tensor.to(dtype)
            sources.add(str(tensor.dtype).removeprefix("torch."))
            state[key] = cast[storage]
    return state, sources


def _packed_base_state(base: nn.Module, merge: bool) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """The base model's state dict without adapters (``merge``: LoRA deltas merged, packed layers re-quantized)."""
    state = adapterless_state(base, merged=merge)
    errors = []
    if not merge:
        return state, errors
    for fqn, module in base.named_modules():
        delta = _adapter_delta(module)
        if delta is None:
            continue
        layer = module.get_base_layer()
        if isinstance(module, PackedLoraLinear):
            shell = copy.deepcopy(layer)
            stats = requantize_merged(shell, layer.dequantized_weight(torch.float32) + delta, delta)
            errors.append({**stats, "layer": canonical_name(fqn)})
            for buf in PackedLinear.BUFFERS:
                if getattr(shell, buf) is not None:
                    state[f"{fqn}.{buf}"] = getattr(shell, buf)
        else:
            state[f"{fqn}.weight"] = (layer.weight.float() + delta).to(layer.weight.dtype)
    return state, errors


def export_int4_lora(
    model: PeftModel,
    out_dir: str | os.PathLike,
    merge: bool = False,
    *,
    merged_dtype: torch.dtype | None = None,
    tokenizer=None,
    overwrite: bool = False,
    extra_files: dict[str, str] | None = None,
    base_model_id: str | None = None,
) -> Path:
    """Save an INT4-base LoRA model as a ``save_pretrained`` folder, atomically; returns its path.

    ``merge=False``: the packed base (``model.safetensors``, ``quant_method: hf_lowprec``) plus the
    adapters in PEFT format beside it (``adapter_config.json``, ``adapter_model.safetensors``). ``merge=True``:
    each adapter's delta is added to its dequantized base weight and re-quantized to INT4 with fresh
    steps — a second rounding, so the merged model differs from the trained one; the per-layer error
    is written to ``hf_lowprec_merge.json`` and logged. Reload either with :func:`load_int4_model`
    (or ``AutoModelForCausalLM.from_pretrained`` after ``import hf_lowprec``, which applies the adapters too).

    ``merge=True, merged_dtype=torch.bfloat16`` (or fp32) instead writes a plain dense model — every
    packed weight dequantized plus its adapter delta, rounded once to ``merged_dtype`` — that any
    ``transformers`` install loads without hf-lowprec. Re-quantizing to INT4 (the default merge) loses
    adapter deltas smaller than half an INT4 step, which on small models is most of what LoRA learned.
    Refuses an existing non-empty ``out_dir`` unless ``overwrite``. A packed export holds the steps and zero points
    the base learned (``learn_steps``) rounded into its own: ``fold_learned_steps(model)`` at the end of training (as
    ``finetune_int4_lora`` and the CLI do) makes ``model`` compute what the folder reloads to.

    ``base_model_id``: the Hub id the adapters' ``base_model_name_or_path`` names: their base is this folder's
    packed model, so the id this folder will have on the Hub (``push`` fills it in), else none. The checkpoint it
    was packed from would be the wrong base (``AutoPeftModelForCausalLM`` would put the adapters, trained on the
    rounded weights, onto its dense ones), and a local path of this machine means nothing elsewhere.
    After ``import hf_lowprec``, ``AutoModelForCausalLM.from_pretrained(folder)`` (and ``pipeline``) loads the packed
    base with its adapters applied; :func:`load_int4_model` as a ``PeftModel`` (``is_trainable=True`` to train on).
    """
    base, plan = _checked_base(model, merge, merged_dtype)
    check_output_dir(Path(out_dir), overwrite, getattr(model, "name_or_path", None))
    dense = merged_dtype is not None
    config = copy.deepcopy(base.config)
    config.use_cache = True
    with freed_memory_returned() if merge else contextlib.nullcontext():  # each layer's fp32 copies leave no holes
        if dense:
            (state, _), errors = dense_merged_state(base, merged_dtype), []
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            config.dtype = str(merged_dtype).removeprefix("torch.")
        else:
            state, errors = _packed_base_state(base, merge)
            state = with_load_guards(base, state)
            config.quantization_config = quantization_config_dict(plan, base)
    tied_ends = (base.get_input_embeddings(), base.get_output_embeddings())
    if merge and any(isinstance(m, ModulesToSaveWrapper) for m in tied_ends):  # the trained copy beside the original:
        config.tie_word_embeddings = False  # a loader tying them by the config dropped the copy
    with atomic_output_dir(out_dir, overwrite) as tmp, without_hf_quantizer(base):
        base.save_pretrained(tmp, state_dict=state)
        config.save_pretrained(tmp)  # base.config stays untouched
        if not merge:
            save_adapters(model, tmp, base_model_id)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if not dense:
            plan.save(tmp / PLAN_FILE)
        if merge and not dense:
            _write_merge_errors(tmp, errors)
        for name, text in (extra_files or {}).items():
            atomic_write_text(tmp / name, text)
    return Path(out_dir)


def _checked_base(model, merge: bool, merged_dtype) -> tuple[nn.Module, PrecisionPlan]:
    """``(base model, its plan)`` of a PEFT model from :func:`prepare_int4_lora`, after checking the export options."""
    if not isinstance(model, PeftModel):
        raise ValueError(f"export_int4_lora exports a PEFT model from prepare_int4_lora, got {type(model).__name__}")
    if merged_dtype is not None and not merge:
        raise ValueError("merged_dtype applies to merge=True")
    if merged_dtype is not None and merged_dtype not in MERGE_DTYPES.values():
        raise ValueError(
            f"merged_dtype must be one of {', '.join(str(d) for d in MERGE_DTYPES.values())}, got {merged_dtype}"
        )
    base = model.get_base_model()
    plan = getattr(base, "hf_lowprec_plan", None)
    if plan is None:
        raise ValueError("the model has no hf_lowprec plan; build it with prepare_int4_lora / load_int4_lora")
    if not merge and any(getattr(m, "merged", False) for m in base.modules()):  # its adapters would apply twice
        raise ValueError(
            "the adapters are merged into the packed base (merge_adapter()): export with merge=True, which writes the "
            "merged codes as they are, or call unmerge_adapter() first"
        )
    return base, plan


def _write_merge_errors(folder: Path, errors: list[dict]) -> None:
    """``hf_lowprec_merge.json``: the re-quantization error of each merged layer and their summary (also logged)."""
    summary = _merge_summary(errors)
    atomic_write_text(folder / MERGE_FILE, json.dumps({"summary": summary, "layers": errors}, indent=2) + "\n")
    logger.warning(
        "merged LoRA into the INT4 base and re-quantized %d layers: weight error %.3g%% (median), "
        "%.3g of the adapter delta's norm (median; max %.3g)",
        summary["layers"],
        100 * summary["rel_error_median"],
        summary["error_vs_delta_median"],
        summary["error_vs_delta_max"],
    )


def save_adapters(model: PeftModel, folder: Path, base_model_id: str | None) -> None:
    """The active adapter, PEFT's way (``adapter_config.json``, ``adapter_model.safetensors``), into the top of
    ``folder`` beside the model it goes onto, whatever its name: ``from_pretrained(folder)`` then applies it (others are
    left out, with a warning; several active together are refused). Each adapter config names
    ``base_model_id`` as its base (the Hub id of the folder whose packed model they go onto, or none; never a local
    path nor the dense checkpoint the base was packed from). PEFT's own README.md is left out: the folder's card is
    hf-lowprec's (PEFT would append to it). ``save_embedding_layers=False``: the base's vocabulary is the
    checkpoint's (hf-lowprec never resizes it), so PEFT need not look the base's config up on the Hub, which offline
    printed two warnings per export."""
    if len(model.active_adapters) != 1:
        raise ValueError(f"adapters {model.active_adapters} are active together; export one (model.set_adapter(name))")
    active = model.active_adapters[0]
    if others := [name for name in model.peft_config if name != active]:
        logger.warning("exporting the active adapter %r; left out: %s", active, ", ".join(map(repr, others)))
    saved = {name: config.base_model_name_or_path for name, config in model.peft_config.items()}
    for config in model.peft_config.values():
        config.base_model_name_or_path = base_model_id
    base = model.get_base_model()  # PEFT fills a config's None from the model's path
    named = base.__dict__.get("name_or_path"), base.config._name_or_path
    base.name_or_path = base.config._name_or_path = base_model_id or ""
    staging = folder / ".adapters.tmp"
    try:
        with learned_steps_folded_in():  # folded into the base's steps and zero points, which this folder holds
            model.save_pretrained(staging, save_embedding_layers=False, selected_adapters=[active])
        # PEFT writes an adapter not named "default" into a subfolder of its name, which no loader of the folder
        # reads (transformers' from_pretrained and pipeline apply the adapter at the top): its files go to the top
        for path in (staging if active == "default" else staging / active).iterdir():
            if path.name != "README.md":
                path.rename(folder / path.name)
        _index_the_model_weights(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        for name, config in model.peft_config.items():
            config.base_model_name_or_path = saved[name]
        base.name_or_path, base.config._name_or_path = named


def _index_the_model_weights(folder: Path) -> None:
    """``model.safetensors.index.json`` for a one-file model beside its adapters: vLLM (``DefaultModelLoader``), and
    loaders like it, read every ``*.safetensors`` of a folder as model weights unless an index names the model's, and
    would take ``adapter_model.safetensors`` for some. transformers reads ``model.safetensors`` first either way."""
    single = folder / SAFE_WEIGHTS_NAME
    if not single.is_file() or (folder / SAFE_WEIGHTS_INDEX_NAME).is_file():
        return
    tensors = read_safetensors(single)  # the header alone
    total = sum(t.nbytes for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict.fromkeys(tensors, SAFE_WEIGHTS_NAME)}
    atomic_write_text(folder / SAFE_WEIGHTS_INDEX_NAME, json.dumps(index, indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def without_hf_quantizer(model: nn.Module):
    """Hide a reloaded model's ``hf_quantizer`` while saving: transformers' ``save_pretrained`` takes
    the state dict from the quantizer when there is one and would ignore ours (the merged weights)."""
    quantizer = model.__dict__.pop("hf_quantizer", None)
    try:
        yield
    finally:
        if quantizer is not None:
            model.hf_quantizer = quantizer


def _merge_summary(errors: list[dict]) -> dict:
    if not errors:
        return {"layers": 0, "rel_error_median": 0.0, "error_vs_delta_median": 0.0, "error_vs_delta_max": 0.0}
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {
        "layers": len(errors),
        "rel_error_median": med([e["rel_error"] for e in errors]),
        "error_vs_delta_median": med([e["error_vs_delta"] for e in errors]),
        "error_vs_delta_max": max(e["error_vs_delta"] for e in errors),
    }


def load_int4_model(
    path: str | os.PathLike, *, dtype: torch.dtype | None = None, backend: str = "auto", is_trainable: bool = False
):
    """``(model, tokenizer)`` from a folder written by :func:`export_int4_lora` (a ``PeftModel`` if it holds adapters).

    ``dtype``: default the saved one. ``is_trainable``: load adapters for further training.
    """
    from transformers import AutoConfig, AutoTokenizer

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{str(folder)!r} is not a model folder (no config.json)")
    config = AutoConfig.from_pretrained(folder)
    qc = getattr(config, "quantization_config", None)
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    if method != "hf_lowprec":
        raise ValueError(
            f"{str(folder)!r} is not a packed INT4 folder (quant_method {method!r}); load it with from_pretrained"
        )
    model = architecture_class(folder).from_pretrained(
        folder, dtype=dtype or getattr(config, "dtype", None) or torch.float32, adapter_kwargs=NO_ADAPTER_LOOKUP
    )
    for m in model.modules():
        if isinstance(m, PackedLinear):
            m.backend = backend
    if (adapters := adapter_folder(folder)) is not None:
        lora = register_int4_lora(LoraConfig.from_pretrained(adapters))
        model = PeftModel.from_pretrained(model, adapters, config=lora, is_trainable=is_trainable)
    tokenizer = AutoTokenizer.from_pretrained(folder) if any((folder / f).is_file() for f in TOKENIZER_FILES) else None
    return model.eval(), tokenizer
