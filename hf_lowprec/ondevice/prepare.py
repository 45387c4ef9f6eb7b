"""Packing a pretrained model into the INT4 base and wrapping it in LoRA: :func:`prepare_int4_lora`,
:func:`load_int4_lora`.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from torch import nn

from hf_lowprec.allocator import freed_memory_returned
from hf_lowprec.checkpoints import (
    DenseWeights,
    load_pretrained,
    local_checkpoint_folder,
    refuse_an_untrainable_checkpoint,
    resolve_checkpoint,
    source_kwargs,
)
from hf_lowprec.convert import ConversionReport, apply_plan, canonical_name, eligible_layers, freeze
from hf_lowprec.export.hf_quantizer import HfLowprecConfig, packs_on_load
from hf_lowprec.file_pages import file_mappings, in_file_mapping
from hf_lowprec.formats import FormatSpec
from hf_lowprec.layers import output_head_name, swap_layers
from hf_lowprec.modules import FROZEN_TYPES
from hf_lowprec.modules.int4 import Int4Linear
from hf_lowprec.modules.int4_lora import register_int4_lora
from hf_lowprec.modules.kernels.autotune import named_dtype, resolve_dtype
from hf_lowprec.modules.packed import PACKED_BACKENDS, PackedInt4Linear, PackedLinear, compact_steps, packed_class
from hf_lowprec.modules.packed_embedding import PackedEmbedding, TiedPackedEmbedding, share_packed_head, tied_head_names
from hf_lowprec.ondevice.calibration import ROUNDINGS, CalibratedCodes, calibrated_codes, check_rounding, summary
from hf_lowprec.ondevice.learned_steps import (
    check_learn_steps,
    keep_learned_steps_with_adapters,
    learn_base_steps,
    learned_kinds,
)
from hf_lowprec.ondevice.loftq import loftq_factors, loftq_for_targets, lora_scaling
from hf_lowprec.ondevice.planning import (
    ALL_LINEAR,
    AUTO_FORMATS,
    check_calibration,
    check_quantizable,
    int4_plan,
    lora_targets,
    scan_int4_plan,
)
from hf_lowprec.plan import PrecisionPlan, is_auto
from hf_lowprec.smoothing import calibrate_smoothed_layers
from hf_lowprec.training.fused_blocks import fuse_blocks

logger = logging.getLogger(__name__)
CHECKPOINT_READ_ROWS = 8192  # output rows of a checkpoint weight read at once (checkpoint_weights): 32 MB at 2048


def prepare_int4_lora(
    model: nn.Module,
    lora_config: LoraConfig | None = None,
    plan: "PrecisionPlan | str | None" = None,
    *,
    loftq_init: bool = False,
    rounding: str = "nearest",
    calibration: torch.Tensor | None = None,
    budget: dict | None = None,
    auto_formats: Sequence[str] = AUTO_FORMATS,
    adapter_dtype: torch.dtype | str = "auto",
    backend: str = "auto",
    learn_steps: bool | str = False,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[PeftModel, ConversionReport]:
    """Pack ``model``'s base linears into INT4 (per ``plan``) and wrap them in LoRA: ``(peft_model, report)``.

    Args:
        model: a causal LM (fp32 or bf16; that dtype is the compute dtype). Modified in place.
        lora_config: a ``peft.LoraConfig`` (default: r=16, alpha=32, all linear layers); ``target_modules``
            accepts names, suffixes, a regex or ``all-linear`` (packed layers included).
        plan: see :func:`int4_plan`; layers it puts in per-channel ``int8`` are packed too, other int8/nf4
            formats stay fake-quantized, bf16/fp32 stay dense. ``"auto"``: a sensitivity scan on
            ``calibration`` chooses int4/int8/bf16 per layer within ``budget`` (:func:`scan_int4_plan`).
        loftq_init: initialise LoRA on INT4 layers from the SVD of their quantization residual (LoftQ).
        rounding: how the INT4 codes are chosen: ``nearest``, or calibrated on ``calibration`` tokens —
            ``gptq`` (output-preserving rounding), ``awq`` (activation-aware input scales), ``awq+gptq``
            (see :mod:`hf_lowprec.ondevice.calibration`; same formats, lower output error).
        calibration: token blocks ``[n, T]`` for ``plan="auto"``, the calibrated roundings and a plan's smoothed
            (``-sq``) layers, which calibrate on the first batch.
        budget: ``plan="auto"`` only: :func:`hf_lowprec.sensitivity.allocate` keywords (default ``AUTO_BUDGET``).
        auto_formats: ``plan="auto"`` only: the formats it chooses from besides bf16 (default ``AUTO_FORMATS``).
        adapter_dtype: dtype of the adapter weights; they compute in the activation dtype either way. ``auto``
            (default): bf16 when the model computes in bf16 or fp32 (no fp32 master copies: the optimizer rounds each
            update stochastically, :func:`~hf_lowprec.ondevice.train.adapter_optimizer`), else fp32; ``bf16``, ``fp32`` or
            a torch dtype (:func:`resolve_adapter_dtype`).
        backend: ``auto`` (measured per shape), ``int8``, ``tiled`` or ``dequant`` for every packed layer (see
            ``modules/packed.py``).
        learn_steps: ``True``: the packed layers' group steps and zero points train with the adapters (a gain and a
            shift per group, fp32 and bf16; the codes stay frozen: :mod:`~hf_lowprec.ondevice.learned_steps`), at a
            weight-gradient GEMM per packed layer and step; ``"zero_points"``: the zero points alone, whose gradient
            costs a GEMM 1/group-size of that; ``False``: neither.
        progress: ``progress(done, total)`` after each tenth of the layers a calibrated rounding has coded (also
            logged at INFO): at a billion parameters that takes minutes.

    Raises ``ValueError`` for a target that matches nothing, a plan that packs nothing, a model whose
    layers are narrower than one INT4 group, calibration tokens missing (``auto`` plan, calibrated rounding,
    ``-sq`` layers) or unused, a budget without an ``auto`` plan, or a ``learn_steps`` not in ``LEARN_STEPS``.
    """
    adapter_dtype = resolve_adapter_dtype(adapter_dtype, model)  # before packing: the model's dtype computes
    check_learn_steps(learn_steps)
    fixed = None if is_auto(plan) else int4_plan(model, plan)
    smoothed = fixed is not None and fixed.smooths
    auto, calibrated = _check_arguments(plan, rounding, calibration, budget, auto_formats, backend, smoothed)
    config = copy.deepcopy(lora_config or LoraConfig(r=16, lora_alpha=32, target_modules=ALL_LINEAR))
    config.target_modules = lora_targets(model, config)
    decoder_only = not getattr(getattr(model, "config", None), "is_encoder_decoder", False)
    if config.task_type is None and decoder_only and output_head_name(model) is not None:
        # a PeftModelForCausalLM, and adapter_config.json says so (what AutoPeftModelForCausalLM and the Hub read)
        config.task_type = "CAUSAL_LM"
    if calibration is not None:
        check_calibration(calibration)
    # packed while loading: the checkpoint's reader, used here and dropped once the plan passes its checks (the files
    # are no longer needed; a call that failed on its arguments can be made again on the same model)
    dense_weights = getattr(model, "hf_lowprec_dense_weights", None)
    plan = scan_int4_plan(model, calibration, budget, auto_formats, dense_weights) if auto else fixed
    check_quantizable(model, plan)
    model.__dict__.pop("hf_lowprec_dense_weights", None)
    reread = _repack_replanned(model, plan, dense_weights)
    report = apply_plan(model, plan, learn_scales=False)
    if calibration is not None:  # '-sq' layers calibrate on the first batch
        calibrate_smoothed_layers(model, calibration[:4])
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if calibrated:  # LoftQ factors, if asked, come from each layer's calibrated codes
        loftq = config if loftq_init else None
        report.calibration = _calibrated_pack(model, calibration, rounding, loftq, factors, dense_weights, progress)
    elif loftq_init:
        factors.update(loftq_for_targets(model, config, dense_weights))
    _freeze_base(model, report, backend, reread)
    peft_model = _with_adapters(model, config, factors, adapter_dtype)
    learned = learn_base_steps(model, learn_steps is True) if learn_steps else []  # a gain and/or a shift per group
    keep_learned_steps_with_adapters(peft_model)
    fused = fuse_blocks(model)
    logger.info(
        "INT4 base: %s%s; LoRA (%s) on %d layers%s; fused for backward: %d SwiGLU MLPs, %d RMSNorms",
        report,
        f"; {learned_kinds(learn_steps)} learned ({sum(p.numel() for p in learned):,} numbers)" if learned else "",
        str(adapter_dtype).removeprefix("torch."),
        len(config.target_modules),
        " (LoftQ init)" if loftq_init else "",
        fused["swiglu_mlp"],
        fused["rms_norm"],
    )
    return peft_model, report


def _check_arguments(
    plan, rounding: str, calibration, budget, auto_formats, backend: str, smoothed: bool
) -> tuple[bool, bool]:
    """``(plan is auto, rounding is calibrated)`` after checking that the arguments of :func:`prepare_int4_lora` fit
    (``smoothed``: the plan has ``-sq`` layers)."""
    if backend not in PACKED_BACKENDS:
        raise ValueError(f"backend {backend!r}: choose one of {', '.join(PACKED_BACKENDS)}")
    auto, calibrated = is_auto(plan), check_rounding(rounding) != "nearest"
    if calibration is None and (auto or calibrated or smoothed):
        needs = "plan auto" if auto else f"rounding {rounding!r}" if calibrated else "a plan with '-sq' layers"
        raise ValueError(f"{needs} needs calibration= token blocks [n, T]")
    if calibration is not None and not (auto or calibrated or smoothed):
        raise ValueError(
            "calibration tokens are used by plan='auto', by the roundings "
            + ", ".join(ROUNDINGS[1:])
            + " and by '-sq' layers; this call has none of them"
        )
    if any(FormatSpec.parse(f).smooth for f in auto_formats):
        raise ValueError("auto_formats: the on-device scan does not offer '-sq' formats; name them in a plan")
    if smoothed and rounding.startswith("awq"):
        raise ValueError(f"rounding {rounding!r} chooses its own input scales; '-sq' layers take nearest or gptq")
    if (budget is not None or tuple(auto_formats) != AUTO_FORMATS) and not auto:
        raise ValueError("budget= and auto_formats= apply to plan='auto' (the sensitivity scan's allocation)")
    return auto, calibrated


def _repack_replanned(model: nn.Module, plan: PrecisionPlan, dense_weights) -> set[str]:
    """Re-read, one layer at a time, every layer packed while loading that ``plan`` gives another format (an ``auto``
    plan's int8, rotated or bf16 layers): packed anew from its checkpoint weight (``dense_weights``) to nearest where
    the format packs, a dense ``nn.Linear`` otherwise. The dense model is never whole in memory. Returns the re-read
    layers' names."""
    assigned = plan.assign(model)
    stale = {
        fqn: assigned[canonical_name(fqn)]
        for fqn, m in model.named_modules()
        if isinstance(m, PackedLinear) and assigned.get(canonical_name(fqn), m.spec).name != m.spec.name
    }
    if stale and dense_weights is None:
        name = next(iter(stale))
        raise ValueError(f"layer {name!r} is packed already and the plan gives it another format; pass a dense model")

    def reread(fqn: str, layer: PackedLinear) -> nn.Module:
        weight, spec = dense_weights(f"{fqn}.weight"), stale[fqn]
        if packed_class(spec) is None:
            return layer.dense_linear(weight)
        # rounded a block of rows at a time, as on load: a fake-quantized twin frozen whole held ~430 MB of fp32 and
        # int64 copies of a 1B-size MLP weight (the auto recipe's load peak at the Llama-3.2-1B shape, scale.py)
        return packed_class(spec).from_weight(weight, spec, layer.bias, dtype=layer.dtype)

    swap_layers(model, lambda _, fqn, m: reread(fqn, m) if fqn in stale else None)
    return {canonical_name(fqn) for fqn in stale}


def _freeze_base(model: nn.Module, report: ConversionReport, backend: str, reread: set[str]) -> None:
    """Pack the plan's layers, set their ``backend``, name in ``report`` the modules that now run (and which of those
    packed while loading were ``reread`` from the checkpoint), freeze the rest; an input embedding tied to a packed
    output head reads the head's rows, an untied one the plan packs holds its own
    (:mod:`~hf_lowprec.modules.packed_embedding`). Steps are kept as a frozen base keeps them (``compact_steps``),
    however the base was packed."""
    tied = tied_head_names(model)
    freeze(model)
    for module in model.modules():
        if isinstance(module, (PackedLinear, PackedEmbedding)):
            compact_steps(module)
    layers = eligible_layers(model)
    for row in report.layers:  # the report was made before freezing: name the modules that now run
        if row.name not in layers:
            continue  # an embedding that reads a packed head already (packed while loading)
        row.module = type(layers[row.name]).__name__
        if row.name in reread and row.reason == "unchanged":
            row.reason = "packed while loading, then re-read from the checkpoint in this format"
        if isinstance(layers[row.name], FROZEN_TYPES) and row.reason == "unchanged":
            row.reason = "packed while loading"
        if isinstance(layers[row.name], PackedLinear):
            layers[row.name].backend = backend
            row.backend = backend
            fits, why = layers[row.name].kernel_shape_supported()
            if not fits and backend != "dequant":  # e.g. a group size that does not divide the layer's inputs
                logger.warning("%s: only the dequant kernel runs this shape (%s): slower steps", row.name, why)
                row.backend, row.reason = "dequant", f"{row.reason}; only the dequant kernel runs this shape ({why})"
    if tied is not None and share_packed_head(model, tied):
        for row in report.layers:
            if row.name == canonical_name(tied[1]):
                row.module, row.reason = TiedPackedEmbedding.__name__, f"reads the rows of the packed {tied[0]}"
    for p in model.parameters():
        p.requires_grad_(False)
    _own_dense_tensors(model)


# bf16 adapters by default where the model computes in bf16 or fp32, by measurement: SmolLM2-135M, the
# int4-ondevice-lora recipe's plan, 100 steps, 3 seeds (benchmarks/ondevice.py quality, variant auto+loftq+adam8+bf16ad):
# held-out perplexity 37.99 +- 0.04 against fp32 adapters' 37.96 +- 0.12 in bf16 compute; Llama-3.2-1B shape, batch
# 1x256 (benchmarks/scale.py, AVX512-BF16 EPYC): peak 1,482 -> 1,460 MiB forward, 1,461 -> 1,439 backward (-2 bytes per
# adapter weight and gradient). In fp32 compute (the AVX2 class) the adapters are cast to fp32 for their two small
# matmuls (modules/int4_lora.py): 37.92 +- 0.11 against fp32 adapters' 37.93 +- 0.12, same runs, HF_LOWPREC_CPU_CLASS=avx2
# (results/ondevice_quality_AVX2-emulated.json); 21.5 MiB of weights (and of gradients) less at 1B. fp16 compute: fp32.
def resolve_adapter_dtype(adapter_dtype: torch.dtype | str | None, model: nn.Module) -> torch.dtype:
    """The adapters' dtype: ``auto`` → bf16 when ``model`` computes in bf16 or fp32, else fp32; or the dtype named."""
    if adapter_dtype is None or adapter_dtype == "auto":
        return torch.bfloat16 if getattr(model, "dtype", None) in (torch.bfloat16, torch.float32) else torch.float32
    return named_dtype(adapter_dtype, "adapter_dtype")


def _with_adapters(model: nn.Module, config: LoraConfig, factors: dict, adapter_dtype: torch.dtype) -> PeftModel:
    """``model`` wrapped in LoRA per ``config``; adapters named in ``factors`` start from them (LoftQ)."""
    saved = [config.modules_to_save] if isinstance(config.modules_to_save, str) else config.modules_to_save or []
    if packed := [  # a name ending in an entry, as PEFT's _set_trainable matches; a copy of codes trained nothing
        f"{canonical_name(n)} ({type(m).__name__})"
        for n, m in model.named_modules(remove_duplicate=False)
        if isinstance(m, (*FROZEN_TYPES, TiedPackedEmbedding)) and any(n.endswith(k) for k in saved)
    ]:
        raise ValueError(
            f"modules_to_save names packed layers, whose integer codes cannot train: {', '.join(packed)}; keep them "
            "dense in the plan (a rule with format 'bf16') or leave them out of modules_to_save"
        )
    peft_model = get_peft_model(model, register_int4_lora(config), autocast_adapter_dtype=False)
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and canonical_name(name) in factors:
            a, b = factors[canonical_name(name)]
            module.lora_A["default"].weight.data.copy_(a)
            module.lora_B["default"].weight.data.copy_(b)
    # a layer the plan keeps dense gets PEFT's own LoRA layer, which computes in its adapters' dtype and which PEFT
    # reloads in fp32 (autocast_adapter_dtype): there the adapters train in fp32, as they will reload
    # the adapters alone: a modules_to_save copy or a bias PEFT trains (bias="all") keeps its dtype, as it computes
    for m in peft_model.modules():
        if isinstance(m, LoraLayer):
            dtype = adapter_dtype if isinstance(m.get_base_layer(), PackedLinear) else torch.float32
            for p in (*m.lora_A.parameters(), *m.lora_B.parameters()):
                p.data = p.data.to(dtype)
    return peft_model


@torch.no_grad()
def _own_dense_tensors(model: nn.Module) -> None:
    """Copy the parameters and buffers that stay dense (embeddings, norms) and still live in a memory-mapped
    checkpoint file into memory of their own.

    transformers maps safetensors checkpoints into memory; the linear weights read while quantizing stay
    resident (and count in RSS) for as long as any tensor of the file is alive. Owning the few dense
    tensors releases the file: on SmolLM2-135M, 146 MB less resident memory for the rest of training. Tensors
    already in memory of their own (quantized on load) are left alone: copying a 128k-vocabulary embedding would
    add its size to the peak.
    """
    mapped = file_mappings()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if in_file_mapping(p, mapped):
                p.data = p.data.clone()
        for name, b in module.named_buffers(recurse=False):
            if b is not None and b.is_floating_point() and in_file_mapping(b, mapped):
                module._buffers[name] = b.clone()


def _calibrated_pack(
    model: nn.Module,
    calibration: torch.Tensor,
    rounding: str,
    loftq: LoraConfig | None,
    factors: dict,
    dense_weights,
    report_progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Pack every INT4 ``Int4Linear`` with codes calibrated by ``rounding`` (LoftQ factors from their residual
    into ``factors`` when ``loftq`` is given, minimising the output error on the calibration tokens); returns
    :func:`hf_lowprec.ondevice.calibration.summary`, also logged.
    ``dense_weights`` reads the checkpoint weights of layers packed while loading; ``report_progress(done, total)``
    after each tenth of the layers, when that is logged."""
    layers = {n: m for n, m in model.named_modules() if _calibrates(m)}
    targets = set(loftq.target_modules) if loftq is not None else set()
    dense_weight = _dense_weight_source(layers, dense_weights)

    def replace(name: str, result: CalibratedCodes, hessian: torch.Tensor, weight: torch.Tensor) -> None:
        module = layers.pop(name)  # not kept once replaced: the packed base would be held twice
        grid = (result.codes, result.step, result.zero, module.spec)
        packed = PackedInt4Linear.from_codes(*grid, module.bias, weight.dtype, input_scale=result.input_scale)
        if name in targets:
            residual = weight.detach().float() - packed.dequantized_weight(torch.float32)
            factors[canonical_name(name)] = loftq_factors(residual, loftq.r, lora_scaling(loftq), hessian)
        swap_layers(model, lambda _, fqn, module: packed if fqn == name else None)  # this layer, as it is calibrated

    start = time.perf_counter()

    def progress(done: int, total: int) -> None:  # a 1B model's calibration takes minutes: a line per tenth
        if done == total or done % max(1, total // 10) == 0:
            logger.info("%s: %d of %d layers calibrated (%.0f s)", rounding, done, total, time.perf_counter() - start)
            if report_progress is not None:
                report_progress(done, total)

    with freed_memory_returned():  # each layer's dense weight and GPTQ/LoftQ temporaries leave no holes in the heap
        codes = calibrated_codes(
            model, layers, calibration, replace, rounding, progress=progress, dense_weight=dense_weight
        )
    stats = {"rounding": rounding, **summary(codes)}
    stats["seconds"] = time.perf_counter() - start
    logger.info(
        "%s on %d tokens: output error %.3g (round-to-nearest %.3g), median over %d layers, %.0f s",
        rounding,
        calibration.numel(),
        stats["output_error_median"],
        stats["output_error_nearest_median"],
        stats["layers"],
        stats["seconds"],
    )
    return stats


def _calibrates(module: nn.Module) -> bool:
    """An INT4 layer the calibrated roundings choose codes for: fake-quantized, or packed to nearest while loading."""
    return isinstance(module, (Int4Linear, PackedInt4Linear)) and module.spec.family == "int4"


def _dense_weight_source(layers: dict[str, nn.Module], reader):
    """``(fqn, layer) -> dense weight``: the layer's own, or for a layer packed while loading the checkpoint's tensor
    (read by ``reader``, see :func:`load_int4_base`) in the layer's dtype."""
    packed = [n for n, m in layers.items() if isinstance(m, PackedInt4Linear)]
    if packed and (reader is None or any(f"{n}.weight" not in reader for n in packed)):
        raise ValueError(
            f"layer {packed[0]!r} is packed already and its dense weight cannot be read for calibrated rounding; "
            "pass a dense model, or load it with load_int4_lora(path, rounding=...)"
        )

    def dense_weight(name: str, module: nn.Module) -> torch.Tensor:
        return reader(f"{name}.weight").to(module.dtype) if isinstance(module, PackedLinear) else module.weight

    return dense_weight


def load_int4_base(
    model_id_or_path: str | os.PathLike,
    plan: "PrecisionPlan | str | None" = None,
    *,
    dtype: torch.dtype,
    rounding: str = "nearest",
    loftq_init: bool = False,
    auto_formats: Sequence[str] = AUTO_FORMATS,
    gguf_file: str | None = None,
    dense_reader: bool = False,
    **from_pretrained_kwargs,
) -> tuple[nn.Module, object, "PrecisionPlan | str | None"]:
    """Load a checkpoint for :func:`prepare_int4_lora`, packed while loading where it can be: ``(model, tokenizer,
    plan to prepare it with)``.

    With a plan that packs every layer it quantizes (the default), or ``plan="auto"`` (every layer packed to nearest in
    the first INT4 format of ``auto_formats``; the scan re-plans after), each weight is packed as it is read
    (:class:`~hf_lowprec.export.hf_quantizer.HfLowprecConfig`): the dense model never exists whole. The steps of
    :func:`prepare_int4_lora` that need dense weights (the auto scan, a calibrated ``rounding``, ``loftq_init``) then
    read them back from the checkpoint's safetensors one layer at a time (``model.hf_lowprec_dense_weights``, a
    :class:`~hf_lowprec.checkpoints.DenseWeights` that :func:`prepare_int4_lora` drops); for a hub id, from its
    snapshot in the Hugging Face cache. Plans with formats that do not pack, and those steps on a checkpoint without
    safetensors (``.bin`` files, a GGUF file on the Hub), load dense. ``dense_reader``: attach that reader where no
    step needs it too, for :func:`checkpoint_weights` (e.g. the unquantized checkpoint's loss before training), if the
    checkpoint's safetensors are at hand; it changes nothing in how the model loads.
    """
    auto = is_auto(plan)
    reads_dense = auto or check_rounding(rounding) != "nearest" or loftq_init
    on_load = auto or packs_on_load(plan)
    source, gguf = resolve_checkpoint(model_id_or_path, gguf_file)  # one clear error for a path that does not exist
    refuse_an_untrainable_checkpoint(source, gguf, **from_pretrained_kwargs)
    snapshot = None  # the folder of the safetensors to re-read: a local one, or a hub id's in the Hugging Face cache
    if on_load and reads_dense and not (gguf and Path(source).is_dir()):  # a local GGUF file is cached as safetensors
        snapshot = None if gguf else local_checkpoint_folder(source, **source_kwargs(from_pretrained_kwargs))
        on_load = snapshot is not None
    first_int4 = next((f for f in auto_formats if FormatSpec.parse(f).family == "int4"), None) if auto else plan
    model, tokenizer = load_pretrained(  # packed on load: each weight inside the lean allocator (hf_quantizer.py)
        model_id_or_path,
        gguf_file=gguf_file,
        dtype=dtype,
        quantization_config=HfLowprecConfig(first_int4) if on_load else None,
        **from_pretrained_kwargs,
    )
    if not on_load:
        return model, tokenizer, plan
    if reads_dense:
        model.hf_lowprec_dense_weights = DenseWeights(snapshot or model.name_or_path)
    elif dense_reader and (folder := _safetensors_folder(model.name_or_path, from_pretrained_kwargs)):
        model.hf_lowprec_dense_weights = DenseWeights(folder)
    return model, tokenizer, plan if auto else model.hf_lowprec_plan  # resolved; its packed layers stay as they are


def _safetensors_folder(name_or_path: str, from_pretrained_kwargs: dict) -> str | None:
    """The local folder of a loaded checkpoint's safetensors (:func:`local_checkpoint_folder`), or ``None`` where it
    has none or its snapshot cannot be read (said in the log)."""
    try:
        return local_checkpoint_folder(name_or_path, **source_kwargs(from_pretrained_kwargs))
    except ValueError as e:
        logger.info("no dense weights to read back for %s: %s", name_or_path, e)
        return None


@contextmanager
def checkpoint_weights(model: nn.Module):
    """Within the block, every layer of ``model`` packed while loading computes with its checkpoint weight, read back
    one layer at a time (``model.hf_lowprec_dense_weights``): the unquantized model's outputs, e.g. its loss, in the
    memory of the packed one. Without a reader, nothing changes (the model is dense already)."""
    reader = getattr(model, "hf_lowprec_dense_weights", None)
    tables = (PackedEmbedding, TiedPackedEmbedding)
    packed = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, (*FROZEN_TYPES, *tables))] if reader else []
    tied = tied_head_names(model) if reader else None  # a tied head's checkpoint tensor is the embedding's
    stored = {} if tied is None or f"{tied[0]}.weight" in reader else {tied[0]: tied[1]}
    for fqn, module in packed:
        name = f"{stored.get(fqn, fqn)}.weight"
        if isinstance(module, tables):  # the rows looked up, not the whole table

            def checkpoint_rows(ids, name=name, m=module):
                return m.scaled(reader.rows(name, ids).to(m.table.dtype))

            module.forward = checkpoint_rows
        else:
            module.forward = lambda x, name=name, m=module: _checkpoint_linear(reader, name, x, m.out_features, m.bias)
    try:
        yield model
    finally:
        for _, module in packed:
            del module.forward


def _checkpoint_linear(reader, name: str, x: torch.Tensor, out_features: int, bias: torch.Tensor | None):
    """``F.linear`` of ``x`` with the checkpoint's weight ``name``, read ``CHECKPOINT_READ_ROWS`` output rows at a
    time: read whole, a 128k-vocabulary head's weight alone would add 525 MB (bf16) to the packed model's memory."""
    y = x.new_empty(*x.shape[:-1], out_features)
    for rows, weight in reader.row_blocks(name, CHECKPOINT_READ_ROWS):
        y[..., rows] = F.linear(x, weight.to(x.dtype), None if bias is None else bias[rows])
    return y


def load_int4_lora(
    model_id_or_path: str | os.PathLike,
    lora_config: LoraConfig | None = None,
    plan: "PrecisionPlan | str | None" = None,
    *,
    gguf_file: str | None = None,
    dtype: torch.dtype | str = "auto",
    loftq_init: bool = False,
    rounding: str = "nearest",
    calibration=None,
    budget: dict | None = None,
    auto_formats: Sequence[str] = AUTO_FORMATS,
    adapter_dtype: torch.dtype | str = "auto",
    backend: str = "auto",
    learn_steps: bool | str = False,
    **from_pretrained_kwargs,
):
    """Load a pretrained checkpoint (:func:`load_int4_base`: packed while loading where it can be) and
    :func:`prepare_int4_lora` it: ``(peft_model, tokenizer, report)``. ``from_pretrained_kwargs`` (``revision``,
    ``token``, ``trust_remote_code``...) go to ``from_pretrained``.

    ``dtype``: the compute dtype, ``"auto"`` (bf16 where this CPU runs bf16 GEMMs fast, measured once per
    machine; fp32 otherwise, e.g. on AVX2), ``"bf16"``/``"fp32"`` or a torch dtype; the choice and its reason
    are in ``report.compute``. ``calibration``: token blocks ``[n, T]``, or a callable ``tokenizer -> blocks``
    (the tokenizer is only known after loading), for ``plan="auto"`` and the calibrated roundings (see
    :func:`prepare_int4_lora`).
    """
    dtype, reason = resolve_dtype(dtype, "cuda" if torch.cuda.is_available() else "cpu")
    logger.info(reason)
    model, tokenizer, plan = load_int4_base(
        model_id_or_path,
        plan,
        dtype=dtype,
        rounding=rounding,
        loftq_init=loftq_init,
        auto_formats=auto_formats,
        gguf_file=gguf_file,
        **from_pretrained_kwargs,
    )
    if callable(calibration):
        calibration = calibration(tokenizer)
    peft_model, report = prepare_int4_lora(
        model,
        lora_config,
        plan,
        loftq_init=loftq_init,
        rounding=rounding,
        calibration=calibration,
        budget=budget,
        auto_formats=auto_formats,
        adapter_dtype=adapter_dtype,
        backend=backend,
        learn_steps=learn_steps,
    )
    report.compute = {"dtype": str(dtype).removeprefix("torch."), "reason": reason}
    return peft_model, tokenizer, report
