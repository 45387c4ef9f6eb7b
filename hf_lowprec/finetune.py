"""On-device fine-tuning of pretrained checkpoints: a frozen packed-INT4 base with PEFT LoRA adapters.

The PEFT way, with the base in INT4::

    from peft import LoraConfig
    from hf_lowprec.finetune import load_int4_lora, finetune_int4_lora, export_int4_lora

    model, tokenizer, report = load_int4_lora("path/or/hub-id", LoraConfig(r=16, target_modules="all-linear"))
    result = finetune_int4_lora(model, tokenizer, blocks, steps=50, lr=2e-4, batch_size=4, output_dir="run")

The base linears go through the precision plan (``convert.apply_plan`` then ``convert.freeze``), so a
plan may keep sensitive layers in int8/bf16; everything a plan puts in ``int4`` becomes a
:class:`~hf_lowprec.modules.PackedInt4Linear` (0.5 byte/parameter + steps), per-channel ``int8`` a
:class:`~hf_lowprec.modules.PackedInt8Linear` (1 byte/parameter), whose forward and grad-input run from
the codes (int8 ``_int_mm`` on CPUs; see ``modules/packed.py``).
Only the LoRA adapters train, so optimizer states exist for them only.

Activation memory, which dominates at this model size, is cut by storing the tensors saved for backward
in 8 bits (default; or gradient checkpointing) and by a chunked loss that never materialises the
``[tokens, vocab]`` fp32 logits.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn

import hf_lowprec.hf_quantizer  # noqa: F401  (registers quant_method "hf_lowprec": from_pretrained loads exported folders)
from hf_lowprec.activations import ActivationStorage
from hf_lowprec.calibration import ROUNDINGS, check_rounding
from hf_lowprec.convert import ConversionReport, apply_plan, canonical_name, eligible_layers, freeze
from hf_lowprec.formats import FormatSpec
from hf_lowprec.modules.kernels.autotune import resolve_dtype
from hf_lowprec.modules.int4_lora import register_int4_lora
from hf_lowprec.modules.packed import BACKENDS, PackedInt4Linear, PackedLinear, compiled
from hf_lowprec.plan import PrecisionPlan

logger = logging.getLogger(__name__)

DEFAULT_FORMAT = "int4-g64-asym"  # SmolLM2-135M held-out perplexity after packing: 65.5 (asym) vs 80.6 (symmetric); bf16 49.7
AUTO_FORMATS = (DEFAULT_FORMAT, "int8")  # what plan="auto" chooses from for each Linear (or keeps it bf16)
# plan="auto" budget: the most INT4-sensitive half of the linear weights in int8 (4.5 bits + 0.5 x 3.5); on SmolLM2-135M
# 1.027x bf16 LoRA's held-out perplexity after 100 steps, against 1.079x with every Linear in INT4 (benchmarks/ondevice.py)
AUTO_BUDGET = {"target_bits_per_param": 6.25}
ALL_LINEAR = "all-linear"
IGNORE_INDEX = -100
ProgressFn = Callable[[int, int, dict], None]


# ------------------------------------------------------------------------------------ planning
def _output_layer_name(model: nn.Module) -> str | None:
    """Canonical name of the model's output projection (``lm_head``), if it has one."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    if head is None:
        return None
    return next((canonical_name(n) for n, m in model.named_modules() if m is head), None)


def int4_plan(model: nn.Module, plan: "PrecisionPlan | str | None" = None) -> PrecisionPlan:
    """The plan for the frozen base: ``None`` → every Linear in ``int4-g64-asym``; a format name → every Linear
    in that format. Both keep the output projection (``lm_head``) in high precision: it is usually tied to
    the input embedding, so packing it would add a copy rather than save memory, and it is the most
    sensitive layer. A :class:`PrecisionPlan` is used exactly as given. (``auto``: see :func:`scan_int4_plan`.)
    """
    if isinstance(plan, PrecisionPlan):
        return plan
    fmt = FormatSpec.parse(plan or DEFAULT_FORMAT)
    head = _output_layer_name(model)
    return PrecisionPlan.uniform(fmt, keep=(head,) if head else ())


def scan_int4_plan(model: nn.Module, calibration: torch.Tensor, budget: dict | None = None,
                   formats: Sequence[str] = AUTO_FORMATS) -> PrecisionPlan:  # fmt: skip
    """A plan for the frozen base from a sensitivity scan: every Linear but the output projection gets one of
    ``formats`` (or stays bf16) so that the predicted loss increase is least within ``budget``.

    Args:
        calibration: token blocks ``[n, T]``; each block runs as its own forward (Fisher scan: activation
            gradients only, so the peak memory is that of one block's forward and backward).
        budget: keyword arguments of :func:`hf_lowprec.sensitivity.allocate` (default ``AUTO_BUDGET``).
        formats: candidate formats (default ``AUTO_FORMATS``).
    """
    from hf_lowprec.sensitivity import allocate, scan

    head = _output_layer_name(model)
    linears = [n for n, m in eligible_layers(model).items() if isinstance(m, nn.Linear) and n != head]
    batches = [{"input_ids": block[None], "labels": block[None]} for block in _check_calibration(calibration)]
    result = scan(model, batches, formats=tuple(formats), method="fisher", layers=linears, max_batch_tokens=calibration.shape[1])
    return allocate(result, **(AUTO_BUDGET if budget is None else budget))  # the output projection, not scanned, stays bf16


def _check_calibration(calibration: torch.Tensor) -> torch.Tensor:
    if not torch.is_tensor(calibration) or calibration.dim() != 2 or calibration.dtype not in (torch.int32, torch.int64) or not len(calibration):
        got = f"{calibration.dtype} {tuple(calibration.shape)}" if torch.is_tensor(calibration) else type(calibration).__name__
        raise ValueError(f"calibration must be token ids [n, T] (int64), got {got}")
    return calibration


def _check_quantizable(model: nn.Module, plan: PrecisionPlan) -> None:
    """Raise ``ValueError`` if the plan packs nothing or a layer is narrower than its INT4 group."""
    assigned = plan.assign(model)
    layers = eligible_layers(model)
    packed = {n: s for n, s in assigned.items() if s.family == "int4" and isinstance(layers[n], nn.Linear)}
    if not packed:
        raise ValueError(f"plan {plan.to_dict()} puts no Linear layer of this model in int4; nothing to pack into an INT4 base")
    narrow = [f"{n} ({layers[n].in_features} inputs)" for n, s in packed.items()
              if s.group_size is not None and layers[n].in_features < s.group_size]  # fmt: skip
    if narrow:
        group = next(s.group_size for s in packed.values() if s.group_size)
        raise ValueError(
            f"model too small to quantize with groups of {group}: {', '.join(narrow[:3])}{' ...' if len(narrow) > 3 else ''} "
            f"have fewer inputs than one group; use a smaller group (e.g. int4-g{max(2, group // 4)}) or keep them in bf16"
        )


def resolve_target_modules(model: nn.Module, target_modules) -> list[str]:
    """Full module names LoRA will wrap, from PEFT-style ``target_modules`` (names, suffixes, ``all-linear``, a regex).

    ``all-linear`` means every Linear (packed or not) except the output projection, as in PEFT. Raises
    ``ValueError`` for a name or regex that matches no Linear layer.
    """
    linears = {fqn: m for fqn, m in model.named_modules() if isinstance(m, (nn.Linear, PackedLinear))}
    names = sorted({canonical_name(f).rsplit(".", 1)[-1] for f in linears})
    head = _output_layer_name(model)
    if target_modules is None:
        raise ValueError(f"LoraConfig.target_modules is required here; e.g. 'all-linear' or some of {names}")
    if isinstance(target_modules, str):
        if target_modules.lower() == ALL_LINEAR:
            return sorted(f for f in linears if canonical_name(f) != head)
        import re

        found = sorted(f for f in linears if re.fullmatch(target_modules, f))
        if not found:
            raise ValueError(f"target_modules regex {target_modules!r} matches no Linear layer; Linear layers are named {names}")
        return found
    targets = list(target_modules)
    if any(isinstance(t, str) and t.lower() == ALL_LINEAR for t in targets):
        return sorted(f for f in linears if canonical_name(f) != head)
    chosen = set()
    for t in targets:
        hit = [f for f in linears if f == t or f.endswith(f".{t}")]
        if not hit:
            raise ValueError(f"target module {t!r} matches no Linear layer of this model; Linear layers are named {names}")
        chosen.update(hit)
    return sorted(chosen)


# --------------------------------------------------------------------------------------- LoftQ
@torch.no_grad()
def loftq_factors(residual: torch.Tensor, rank: int, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """LoRA ``(A [r, K], B [N, r])`` with ``scaling * B @ A`` the best rank-``r`` approximation of ``residual [N, K]``.

    LoftQ (Li et al., 2023), one alternation: the adapters start as the truncated SVD of the
    quantization residual ``W - dequant(Q(W))``, so the INT4 model starts where the full-precision one was.
    """
    u, s, vh = torch.linalg.svd(residual.float(), full_matrices=False)
    root = s[:rank].sqrt() / math.sqrt(scaling)
    return (root.unsqueeze(1) * vh[:rank]).contiguous(), (u[:, :rank] * root).contiguous()


# -------------------------------------------------------------------------------------- prepare
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
    adapter_dtype: torch.dtype = torch.float32,
    backend: str = "auto",
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
            (see :mod:`hf_lowprec.calibration`; same formats, lower output error).
        calibration: token blocks ``[n, T]`` for ``plan="auto"`` and the calibrated roundings.
        budget: ``plan="auto"`` only: :func:`hf_lowprec.sensitivity.allocate` keywords (default ``AUTO_BUDGET``).
        auto_formats: ``plan="auto"`` only: the formats it chooses from besides bf16 (default ``AUTO_FORMATS``).
        adapter_dtype: dtype of the adapter weights (fp32 master copies by default; they compute in the
            activation dtype either way).
        backend: ``auto``, ``int8`` or ``dequant`` for every packed layer (see ``modules/packed.py``).

    Raises ``ValueError`` for a target that matches nothing, a plan that packs nothing, a model whose
    layers are narrower than one INT4 group, calibration tokens missing (``auto`` plan, calibrated rounding)
    or unused, or a budget without an ``auto`` plan.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    auto, calibrated = isinstance(plan, str) and plan == "auto", check_rounding(rounding) != "nearest"
    if calibration is None and (auto or calibrated):
        raise ValueError(f"{'plan auto' if auto else f'rounding {rounding!r}'} needs calibration= token blocks [n, T]")
    if calibration is not None and not (auto or calibrated):
        raise ValueError("calibration tokens are used by plan='auto' and by the roundings " + ", ".join(ROUNDINGS[1:]) + "; this call has neither")
    if (budget is not None or tuple(auto_formats) != AUTO_FORMATS) and not auto:
        raise ValueError("budget= and auto_formats= apply to plan='auto' (the sensitivity scan's allocation)")
    config = copy.deepcopy(lora_config) if lora_config is not None else LoraConfig(r=16, lora_alpha=32, target_modules=ALL_LINEAR)
    config.target_modules = resolve_target_modules(model, config.target_modules)
    if calibration is not None:
        _check_calibration(calibration)
    plan = scan_int4_plan(model, calibration, budget, auto_formats) if auto else int4_plan(model, plan)
    _check_quantizable(model, plan)
    report = apply_plan(model, plan, learn_scales=False)
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if calibrated:
        report.calibration = _calibrated_pack(model, calibration, rounding, config if loftq_init else None, factors)
    if loftq_init:
        factors.update(_loftq_for_targets(model, config))
    freeze(model)
    layers = eligible_layers(model)
    for row in report.layers:  # the report was made before freezing: name the modules that now run
        row.module = type(layers[row.name]).__name__
        if isinstance(layers[row.name], PackedLinear):
            layers[row.name].backend = backend
            row.backend = backend
    for p in model.parameters():
        p.requires_grad_(False)
    _own_dense_tensors(model)
    peft_model = get_peft_model(model, register_int4_lora(config), autocast_adapter_dtype=False)
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and canonical_name(name) in factors:
            a, b = factors[canonical_name(name)]
            module.lora_A["default"].weight.data.copy_(a)
            module.lora_B["default"].weight.data.copy_(b)
    for name, p in peft_model.named_parameters():
        if p.requires_grad:
            p.data = p.data.to(adapter_dtype)
    logger.info("INT4 base: %s; LoRA on %d layers%s", report, len(config.target_modules), " (LoftQ init)" if loftq_init else "")
    return peft_model, report


@torch.no_grad()
def _own_dense_tensors(model: nn.Module) -> None:
    """Copy the parameters and buffers that stay dense (embeddings, norms) into memory of their own.

    transformers maps safetensors checkpoints into memory; the linear weights read while quantizing stay
    resident (and count in RSS) for as long as any tensor of the file is alive. Owning the few dense
    tensors releases the file: on SmolLM2-135M, 146 MB less resident memory for the rest of training.
    """
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            p.data = p.data.clone()
        for name, b in module.named_buffers(recurse=False):
            if b is not None and b.is_floating_point():
                module._buffers[name] = b.clone()


def _calibrated_pack(model: nn.Module, calibration: torch.Tensor, rounding: str, loftq: LoraConfig | None, factors: dict) -> dict:
    """Pack every INT4 ``Int4Linear`` with codes calibrated by ``rounding`` (LoftQ factors from their residual
    into ``factors`` when ``loftq`` is given); returns :func:`hf_lowprec.calibration.summary`, also logged."""
    from hf_lowprec.calibration import CalibratedCodes, calibrated_codes, summary
    from hf_lowprec.convert import _set_module
    from hf_lowprec.modules.int4 import Int4Linear

    layers = {n: m for n, m in model.named_modules() if isinstance(m, Int4Linear) and m.spec.family == "int4"}
    targets = set(loftq.target_modules) if loftq is not None else set()

    def replace(name: str, result: CalibratedCodes) -> None:
        module = layers[name]
        packed = PackedInt4Linear.from_codes(result.codes, result.step, result.zero, module.spec, module.bias, module.weight.dtype,
                                             input_scale=result.input_scale)  # fmt: skip
        if name in targets:
            residual = module.weight.detach().float() - packed.dequantized_weight(torch.float32)
            factors[canonical_name(name)] = loftq_factors(residual, loftq.r, _lora_scaling(loftq))
        _set_module(model, name, packed)

    start = time.perf_counter()
    stats = {"rounding": rounding, **summary(calibrated_codes(model, layers, calibration, replace, rounding))}
    stats["seconds"] = time.perf_counter() - start
    logger.info("%s on %d tokens: output error %.3g (round-to-nearest %.3g), median over %d layers, %.0f s", rounding,
                calibration.numel(), stats["output_error_median"], stats["output_error_nearest_median"], stats["layers"], stats["seconds"])  # fmt: skip
    return stats


def _lora_scaling(config: LoraConfig) -> float:
    return config.lora_alpha / (math.sqrt(config.r) if config.use_rslora else config.r)


def _loftq_for_targets(model: nn.Module, config: LoraConfig) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """LoftQ factors for every LoRA target that the plan put in int4 (called before ``freeze``)."""
    from hf_lowprec.modules.int4 import Int4Linear

    scaling = _lora_scaling(config)
    out = {}
    for fqn in config.target_modules:
        module = model.get_submodule(fqn)
        if isinstance(module, Int4Linear) and module.spec.family == "int4":
            residual = module.weight.detach().float() - module.quantized_weight().detach().float()
            out[canonical_name(fqn)] = loftq_factors(residual, config.r, scaling)
    return out


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
    adapter_dtype: torch.dtype = torch.float32,
    backend: str = "auto",
):
    """Load a pretrained checkpoint and :func:`prepare_int4_lora` it: ``(peft_model, tokenizer, report)``.

    ``dtype``: the compute dtype, ``"auto"`` (bf16 where this CPU runs bf16 GEMMs fast, measured once per
    machine; fp32 otherwise, e.g. on AVX2), ``"bf16"``/``"fp32"`` or a torch dtype; the choice and its reason
    are in ``report.compute``. ``calibration``: token blocks ``[n, T]``, or a callable ``tokenizer -> blocks``
    (the tokenizer is only known after loading), for ``plan="auto"`` and the calibrated roundings (see
    :func:`prepare_int4_lora`).
    """
    from hf_lowprec.checkpoints import load_pretrained

    dtype, reason = resolve_dtype(dtype, "cuda" if torch.cuda.is_available() else "cpu")
    logger.info(reason)
    model, tokenizer = load_pretrained(model_id_or_path, gguf_file=gguf_file, dtype=dtype)
    if callable(calibration):
        calibration = calibration(tokenizer)
    peft_model, report = prepare_int4_lora(
        model, lora_config, plan, loftq_init=loftq_init, rounding=rounding, calibration=calibration, budget=budget,
        auto_formats=auto_formats, adapter_dtype=adapter_dtype, backend=backend,
    )
    report.compute = {"dtype": str(dtype).removeprefix("torch."), "reason": reason}
    return peft_model, tokenizer, report


# ----------------------------------------------------------------------------------------- loss
def cross_entropy_with_grad(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy of ``logits [C, V]`` against ``labels [C]`` (``-100`` ignored) and its gradient
    w.r.t. the logits (``softmax - onehot``, in the logits' dtype), computed in fp32 in one fused kernel.

    Hand-written because autograd's ``log_softmax`` + ``nll_loss`` forward and backward take ~3x longer on
    this CPU (92 ms vs 30 ms per 256 x 49152 chunk, torch.compile'd).
    """
    x = logits.float()
    valid = labels != IGNORE_INDEX
    target = torch.where(valid, labels, 0).unsqueeze(1)
    lse = torch.logsumexp(x, -1, keepdim=True)
    weight = valid.unsqueeze(1).float()
    loss = ((lse - x.gather(1, target)) * weight).sum()
    # the one-hot as a comparison, not a scatter_add: torch 2.13's inductor corrupts the heap on 2+ threads when
    # fp32 logits (aliased by .float()) meet scatter_add with dynamic shapes; the comparison also fuses (~1.6x)
    onehot = torch.arange(x.shape[1], device=x.device) == target
    grad = (torch.exp(x - lse) - onehot.float()) * weight
    return loss, grad.to(logits.dtype)


class _ChunkedLMLoss(torch.autograd.Function):
    """Summed cross-entropy of ``head(hidden)`` against ``labels``, ``chunk`` tokens at a time.

    The gradient w.r.t. ``hidden`` is computed chunk by chunk during the forward (the loss is a
    scalar, so it only needs rescaling later); only one chunk's ``[chunk, vocab]`` logits exist at a
    time and nothing is recomputed. transformers computes the full fp32 logits (201 MB for 1024
    tokens x 49k vocabulary, plus their gradient); no library offers this for an arbitrary head module.
    """

    @staticmethod
    def forward(ctx, hidden, labels, head, chunk):
        grad = torch.empty_like(hidden) if hidden.requires_grad else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for i in range(0, hidden.shape[0], chunk):
            with torch.enable_grad():
                h = hidden[i : i + chunk].detach().requires_grad_(grad is not None)
                logits = head(h)
            loss, grad_logits = compiled(cross_entropy_with_grad)(logits.detach(), labels[i : i + chunk].contiguous())
            if grad is not None:
                (grad[i : i + chunk],) = torch.autograd.grad(logits, h, grad_logits)
            total += loss
        ctx.save_for_backward(grad)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        (grad,) = ctx.saved_tensors
        return grad * grad_total.to(grad.dtype), None, None, None


def causal_lm_loss(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   chunk_tokens: int = 128) -> torch.Tensor:  # fmt: skip
    """Mean next-token cross-entropy of a causal LM (PEFT-wrapped or not), ``input_ids [B, T]``.

    Runs the decoder, then the output head and the loss over ``chunk_tokens`` tokens at a time (see
    :class:`_ChunkedLMLoss`). Falls back to the model's own loss (full logits) when the model has no
    ``get_decoder``, scales or caps its logits, or when its output head trains.
    """
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    labels = input_ids[:, 1:]
    if attention_mask is not None:
        labels = labels.masked_fill(attention_mask[:, 1:] == 0, IGNORE_INDEX)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    cfg = getattr(base, "config", None)
    plain_head = head is not None and hasattr(base, "get_decoder") and not any(p.requires_grad for p in head.parameters())
    plain_head = plain_head and getattr(cfg, "final_logit_softcapping", None) is None and getattr(cfg, "logit_scale", None) is None
    if not plain_head:
        full_labels = torch.cat((torch.full_like(labels[:, :1], IGNORE_INDEX), labels), 1)
        return model(input_ids=input_ids, attention_mask=attention_mask, labels=full_labels).loss
    hidden = base.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    flat_labels = labels.reshape(-1)
    total = _ChunkedLMLoss.apply(hidden[:, :-1].reshape(-1, hidden.shape[-1]), flat_labels, head, chunk_tokens)
    return total / (flat_labels != IGNORE_INDEX).sum().clamp(min=1)


@torch.no_grad()
def evaluate_loss(model: nn.Module, blocks: torch.Tensor, batch_size: int = 4, chunk_tokens: int = 128) -> float:
    """Mean next-token loss over ``blocks [n, T]`` (token-weighted; ``exp`` of it is the perplexity)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(blocks), batch_size):
        batch = blocks[i : i + batch_size]
        tokens = batch.shape[0] * (batch.shape[1] - 1)
        total += causal_lm_loss(model, batch, chunk_tokens=chunk_tokens).item() * tokens
        count += tokens
    model.train(was_training)
    return total / max(count, 1)


def token_blocks(tokenizer, texts: Sequence[str], block_size: int, max_blocks: int | None = None) -> torch.Tensor:
    """Tokenize ``texts``, join them with EOS and cut the stream into ``[n, block_size]`` blocks (tail dropped)."""
    if block_size < 2:
        raise ValueError(f"block_size must be at least 2 tokens, got {block_size}")
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"] + eos)
        if max_blocks is not None and len(ids) >= max_blocks * block_size:
            break
    n = len(ids) // block_size if max_blocks is None else min(len(ids) // block_size, max_blocks)
    if n == 0:
        raise ValueError(f"the texts give {len(ids)} tokens, fewer than one block of {block_size}")
    return torch.tensor(ids[: n * block_size], dtype=torch.long).view(n, block_size)


# ------------------------------------------------------------------------------------- training
def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, MB (``ru_maxrss``)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def backend_counts(model: nn.Module) -> dict[str, int]:
    """How many packed layers ran each backend in their last forward (``never run`` before the first)."""
    counts: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, PackedLinear):
            key = m.last_backend or "never run"
            counts[key] = counts.get(key, 0) + 1
    return counts


@dataclass
class FinetuneResult:
    """What :func:`finetune_int4_lora` did; ``to_dict()`` is JSON-ready."""

    steps: int
    losses: list[float]
    step_seconds: list[float]
    train_seconds: float
    peak_rss_mb: float
    eval_loss_before: float | None = None
    eval_loss_after: float | None = None
    plan_fractions: dict[str, float] = field(default_factory=dict)
    backends: dict[str, int] = field(default_factory=dict)
    trainable_params: int = 0
    output_dir: str | None = None

    @property
    def perplexity_before(self) -> float | None:
        return None if self.eval_loss_before is None else math.exp(self.eval_loss_before)

    @property
    def perplexity_after(self) -> float | None:
        return None if self.eval_loss_after is None else math.exp(self.eval_loss_after)

    @property
    def median_step_seconds(self) -> float:
        s = sorted(self.step_seconds)
        return s[len(s) // 2] if s else float("nan")

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(perplexity_before=self.perplexity_before, perplexity_after=self.perplexity_after,
                   median_step_seconds=self.median_step_seconds)  # fmt: skip
        return out


def finetune_int4_lora(
    model: PeftModel,
    tokenizer,
    train_blocks: torch.Tensor,
    *,
    steps: int,
    lr: float = 2e-4,
    batch_size: int = 4,
    output_dir: str | os.PathLike | None = None,
    eval_blocks: torch.Tensor | None = None,
    progress: ProgressFn | None = None,
    seed: int = 0,
    activation_storage: str | None = "int8",
    gradient_checkpointing: bool = False,
    chunk_tokens: int = 128,
    warmup_steps: int | None = None,
    weight_decay: float = 0.0,
    max_grad_norm: float = 1.0,
    merge: bool = False,
    overwrite: bool = False,
) -> FinetuneResult:
    """Train the LoRA adapters of ``model`` (from :func:`prepare_int4_lora`) on ``train_blocks [n, T]``.

    AdamW on the trainable parameters only, linear warm-up (default ``steps // 10``, at most 10) then
    linear decay, gradient clipping at ``max_grad_norm``.

    Activation memory: ``activation_storage`` (``int8``, ``fp8`` or ``None``) keeps what autograd saves
    in 8 bits (:class:`~hf_lowprec.activations.ActivationStorage`; a few % of gradient error);
    ``gradient_checkpointing`` (``True``, or every ``n`` layers) recomputes layers instead (exact, slower).

    ``progress(step, steps, metrics)`` is called after every step with ``loss``, ``lr``, ``step_seconds``
    and ``peak_rss_mb`` (and once more with ``eval_loss`` after the last step). With ``output_dir`` the
    result is exported there (:func:`export_int4_lora`; adapters kept, or merged with ``merge``) along with
    ``finetune_metrics.json``. Raises ``ValueError`` for an output folder that exists (unless ``overwrite``).
    """
    from transformers import get_scheduler

    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps and batch_size must be positive, got steps={steps}, batch_size={batch_size}")
    if not isinstance(train_blocks, torch.Tensor) or train_blocks.dim() != 2 or train_blocks.shape[1] < 2:
        raise ValueError("train_blocks must be a LongTensor [n_blocks, block_size >= 2] (see token_blocks)")
    if output_dir is not None:
        _check_output_dir(Path(output_dir), overwrite)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters; build it with prepare_int4_lora / load_int4_lora")
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    if gradient_checkpointing:
        base.activation_checkpointing_enable({"use_reentrant": False}, every_n_layers=int(gradient_checkpointing))
    storage = ActivationStorage(model, activation_storage) if activation_storage else contextlib.nullcontext()
    if getattr(base, "config", None) is not None:
        base.config.use_cache = False
    eval_before = evaluate_loss(model, eval_blocks, batch_size, chunk_tokens) if eval_blocks is not None else None
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    warmup = min(10, steps // 10) if warmup_steps is None else warmup_steps
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=warmup, num_training_steps=steps)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    order = torch.randperm(len(train_blocks), generator=gen)
    cursor = 0
    losses, times = [], []
    model.train()
    start = time.perf_counter()
    for step in range(1, steps + 1):
        if cursor + batch_size > len(order):
            order, cursor = torch.randperm(len(train_blocks), generator=gen), 0
        batch = train_blocks[order[cursor : cursor + batch_size]]
        cursor += batch_size
        t0 = time.perf_counter()
        with storage:
            loss = causal_lm_loss(model, batch, chunk_tokens=chunk_tokens)
        loss.backward()
        if max_grad_norm:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"loss became {losses[-1]} at step {step}; lower the learning rate (now {lr})")
        if progress is not None:
            metrics = {"loss": losses[-1], "lr": scheduler.get_last_lr()[0], "step_seconds": times[-1], "peak_rss_mb": peak_rss_mb()}
            progress(step, steps, metrics)
    train_seconds = time.perf_counter() - start
    if gradient_checkpointing:
        base.activation_checkpointing_disable()
    model.eval()
    eval_after = evaluate_loss(model, eval_blocks, batch_size, chunk_tokens) if eval_blocks is not None else None
    if progress is not None and eval_after is not None:
        progress(steps, steps, {"loss": losses[-1], "eval_loss": eval_after, "peak_rss_mb": peak_rss_mb()})
    plan = getattr(base, "hf_lowprec_plan", None)
    result = FinetuneResult(
        steps=steps, losses=losses, step_seconds=times, train_seconds=train_seconds, peak_rss_mb=peak_rss_mb(),
        eval_loss_before=eval_before, eval_loss_after=eval_after,
        plan_fractions=_plan_fractions(base, plan) if plan is not None else {}, backends=backend_counts(model),
        trainable_params=sum(p.numel() for p in params),
    )  # fmt: skip
    if output_dir is not None:
        metrics = json.dumps(result.to_dict(), indent=2) + "\n"
        result.output_dir = str(export_int4_lora(model, output_dir, tokenizer=tokenizer, merge=merge, overwrite=overwrite,
                                                 extra_files={METRICS_FILE: metrics}))  # fmt: skip
    return result


def _plan_fractions(model: nn.Module, plan: PrecisionPlan) -> dict[str, float]:
    """Fraction of eligible parameters per format, from the plan (works after freezing)."""
    return {row["format"]: row["fraction"] for row in _plan_rows(model, plan)}


def _plan_rows(model: nn.Module, plan: PrecisionPlan) -> list[dict]:
    layers = eligible_layers(model)
    total = 0
    rows: dict[str, dict] = {}
    for name, spec in plan.assign(layers).items():
        m = layers[name]
        n = m.in_features * m.out_features if isinstance(m, PackedLinear) else m.weight.numel()
        total += n
        row = rows.setdefault(spec.name, {"format": spec.name, "layers": 0, "params": 0})
        row["layers"] += 1
        row["params"] += n
    for row in rows.values():
        row["fraction"] = row["params"] / max(total, 1)
    return sorted(rows.values(), key=lambda r: -r["params"])


METRICS_FILE = "finetune_metrics.json"
MERGE_FILE = "hf_lowprec_merge.json"
MERGE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}  # export --merge-into dense dtypes
ADAPTER_DIR = "adapter"  # not the top folder: transformers would try to load adapters there itself, without the INT4 dispatch


def _check_output_dir(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {str(out)!r} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"output folder {str(out)!r} already exists and is not empty; pass overwrite=True to replace it")


# --------------------------------------------------------------------------------------- export
def _adapterless_state(base: nn.Module) -> dict[str, torch.Tensor]:
    """``base``'s state dict without the LoRA tensors, keys as in the unwrapped model."""
    return {k.replace(".base_layer", ""): v for k, v in base.state_dict().items() if ".lora_" not in k}


def _adapter_delta(module: nn.Module) -> torch.Tensor | None:
    """The summed weight delta (fp32) of a LoRA layer's active adapters; ``None`` for other modules."""
    if not hasattr(module, "lora_A") or not module.active_adapters:
        return None
    return sum(module.get_delta_weight(n).float() for n in module.active_adapters if n in module.lora_A)


def _dense_merged_state(base: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The base model's state dict as plain ``dtype`` weights: every packed layer dequantized, LoRA deltas added
    (one rounding, to ``dtype``); other tensors as they are."""
    state = _adapterless_state(base)
    for fqn, module in base.named_modules():
        layer = module.get_base_layer() if hasattr(module, "get_base_layer") else module
        if not isinstance(layer, PackedLinear) or fqn.endswith(".base_layer"):
            continue
        weight = layer.dequantized_weight(torch.float32)
        delta = _adapter_delta(module)
        if delta is not None:
            weight = weight + delta
        for buf in PackedLinear.BUFFERS:
            state.pop(f"{fqn}.{buf}", None)
        state[f"{fqn}.weight"] = weight.to(dtype)
    return state


def _packed_base_state(base: nn.Module, merge: bool) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """The base model's state dict without adapters (``merge``: LoRA deltas merged, packed layers re-quantized)."""
    from hf_lowprec.modules.int4_lora import PackedLoraLinear

    state = _adapterless_state(base)
    errors = []
    if not merge:
        return state, errors
    for fqn, module in base.named_modules():
        delta = _adapter_delta(module)
        if delta is None:
            continue
        layer = module.get_base_layer()
        if isinstance(module, PackedLoraLinear):
            merged = layer.dequantized_weight(torch.float32) + delta
            shell = copy.deepcopy(layer)
            stats = shell.requantize_(merged)
            err = (shell.dequantized_weight(torch.float32) - merged).norm()
            stats.update(layer=canonical_name(fqn), delta_norm=delta.norm().item(),
                         error_vs_delta=(err / delta.norm().clamp(min=1e-12)).item())  # fmt: skip
            errors.append(stats)
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
) -> Path:
    """Save an INT4-base LoRA model as a ``save_pretrained`` folder, atomically; returns its path.

    ``merge=False``: the packed base (``model.safetensors``, ``quant_method: hf_lowprec``) plus the
    adapters in PEFT format in ``adapter/`` (``adapter_config.json``, ``adapter_model.safetensors``). ``merge=True``:
    each adapter's delta is added to its dequantized base weight and re-quantized to INT4 with fresh
    steps — a second rounding, so the merged model differs from the trained one; the per-layer error
    is written to ``hf_lowprec_merge.json`` and logged. Reload either with :func:`load_int4_model`
    (or ``AutoModelForCausalLM.from_pretrained`` after ``import hf_lowprec``, then PEFT for adapters).

    ``merge=True, merged_dtype=torch.bfloat16`` (or fp32) instead writes a plain dense model — every
    packed weight dequantized plus its adapter delta, rounded once to ``merged_dtype`` — that any
    ``transformers`` install loads without hf-lowprec. Re-quantizing to INT4 (the default merge) loses
    adapter deltas smaller than half an INT4 step, which on small models is most of what LoRA learned.
    Refuses an existing non-empty ``out_dir`` unless ``overwrite``.
    """
    from hf_lowprec.hf_quantizer import quantization_config_dict
    from hf_lowprec.hub import PLAN_FILE, atomic_output_dir
    from hf_lowprec.plan import atomic_write_text

    if not isinstance(model, PeftModel):
        raise ValueError(f"export_int4_lora exports a PEFT model from prepare_int4_lora, got {type(model).__name__}")
    if merged_dtype is not None and not merge:
        raise ValueError("merged_dtype applies to merge=True")
    if merged_dtype is not None and merged_dtype not in MERGE_DTYPES.values():
        raise ValueError(f"merged_dtype must be one of {', '.join(str(d) for d in MERGE_DTYPES.values())}, got {merged_dtype}")
    base = model.get_base_model()
    plan = getattr(base, "hf_lowprec_plan", None)
    if plan is None:
        raise ValueError("the model has no hf_lowprec plan; build it with prepare_int4_lora / load_int4_lora")
    _check_output_dir(Path(out_dir), overwrite)
    dense = merged_dtype is not None
    config = copy.deepcopy(base.config)
    config.use_cache = True
    if dense:
        state, errors = _dense_merged_state(base, merged_dtype), []
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = str(merged_dtype).removeprefix("torch.")
    else:
        state, errors = _packed_base_state(base, merge)
        config.quantization_config = quantization_config_dict(plan)
    with atomic_output_dir(out_dir, overwrite) as tmp, _without_hf_quantizer(base):
        base.save_pretrained(tmp, state_dict=state)
        config.save_pretrained(tmp)  # base.config stays untouched
        if not merge:
            model.save_pretrained(tmp / ADAPTER_DIR)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if not dense:
            plan.save(tmp / PLAN_FILE)
        if merge and not dense:
            summary = _merge_summary(errors)
            atomic_write_text(tmp / MERGE_FILE, json.dumps({"summary": summary, "layers": errors}, indent=2) + "\n")
            logger.warning("merged LoRA into the INT4 base and re-quantized %d layers: weight error %.3g%% (median), "
                           "%.3g of the adapter delta's norm (median; max %.3g)", summary["layers"],
                           100 * summary["rel_error_median"], summary["error_vs_delta_median"], summary["error_vs_delta_max"])  # fmt: skip
        for name, text in (extra_files or {}).items():
            atomic_write_text(tmp / name, text)
    return Path(out_dir)


@contextlib.contextmanager
def _without_hf_quantizer(model: nn.Module):
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
    return {"layers": len(errors), "rel_error_median": med([e["rel_error"] for e in errors]),
            "error_vs_delta_median": med([e["error_vs_delta"] for e in errors]),
            "error_vs_delta_max": max(e["error_vs_delta"] for e in errors)}  # fmt: skip


def load_int4_model(
    path: str | os.PathLike, *, dtype: torch.dtype | None = None, backend: str = "auto", is_trainable: bool = False
):
    """``(model, tokenizer)`` from a folder written by :func:`export_int4_lora` (a ``PeftModel`` if it holds adapters).

    ``dtype``: default the saved one. ``is_trainable``: load adapters for further training.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from hf_lowprec.checkpoints import TOKENIZER_FILES

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{str(folder)!r} is not a model folder (no config.json)")
    config = AutoConfig.from_pretrained(folder)
    qc = getattr(config, "quantization_config", None)
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    if method != "hf_lowprec":
        raise ValueError(f"{str(folder)!r} is not a packed INT4 folder (quant_method {method!r}); load it with from_pretrained")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or getattr(config, "dtype", None) or torch.float32)
    for m in model.modules():
        if isinstance(m, PackedLinear):
            m.backend = backend
    if (folder / ADAPTER_DIR).is_dir():
        lora = register_int4_lora(LoraConfig.from_pretrained(folder / ADAPTER_DIR))
        model = PeftModel.from_pretrained(model, folder / ADAPTER_DIR, config=lora, is_trainable=is_trainable)
    tokenizer = AutoTokenizer.from_pretrained(folder) if any((folder / f).is_file() for f in TOKENIZER_FILES) else None
    return model.eval(), tokenizer
