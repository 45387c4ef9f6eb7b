"""Which layers of a pretrained checkpoint go into the packed base, in which format: a fixed plan or one scanned
on calibration tokens under a bit budget, and the LoRA targets.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence

import torch
from torch import nn

from hf_lowprec.convert import canonical_name, eligible_layers
from hf_lowprec.formats import FormatSpec
from hf_lowprec.layers import dense_view, output_head_name
from hf_lowprec.modules.packed import PackedLinear, packed_class
from hf_lowprec.modules.packed_embedding import check_embedding_format, tied_head_names
from hf_lowprec.plan import PrecisionPlan, check_convertible, names_a_format, resolve_plan
from hf_lowprec.rotation import MIN_ROTATION_BLOCK, rotation_block
from hf_lowprec.sensitivity import allocate, check_budget, scan

logger = logging.getLogger(__name__)


DEFAULT_FORMAT = "int4-g64-asym"  # zero points fit LLM weights' skewed groups better than symmetric steps (ondevice.py)
AUTO_FORMATS = (DEFAULT_FORMAT, "int8")  # what plan="auto" chooses from for each Linear (or keeps it bf16)
# plan="auto" budget: the most INT4-sensitive half of the linear weights in int8 (4.5 bits + 0.5 x 3.5); its quality
# against all-INT4 and bf16 LoRA is measured by benchmarks/ondevice.py (results/REPORT.md)
AUTO_BUDGET = {"target_bits_per_param": 6.25}
ALL_LINEAR = "all-linear"
# output heads above this many weights (a 128k vocabulary at hidden 2048: 263M) are packed in per-channel int8, not
# kept bf16: it halves the head (and the tied embedding's table: -262 MB at Llama-3.2-1B, benchmarks/scale.py) for
# +0.6% held-out perplexity on SmolLM2-135M (63.23 -> 63.62, INT4 base, no training; an int4 head: 73.21). An untied
# input embedding that large (Llama-3.1-8B, Qwen2.5-7B: 525M+) is packed in per-row int8 likewise
# (:class:`~hf_lowprec.modules.packed_embedding.PackedEmbedding`; -525 MB at Llama-3.1-8B)
HEAD_INT8_MIN_PARAMS = 1 << 27
# tokens per forward of plan="auto"'s scan (calibration blocks are merged up to this, one block at least): a forward
# of few tokens spends most of its time reading and quantizing every dense weight (once per forward), while the
# memory grows with the tokens. The make-demo scan (SmolLM2-135M packed while loading, 16 blocks of 128, fp32, 2-core
# AVX2 CPU): 128 tokens 45 s, peak 1,057 MB; 256: 35 s, 1,356 MB (its training steps peak at 1,789); 512: 27 s, 1,990
SCAN_BATCH_TOKENS = 256


def int4_plan(model: nn.Module, plan: "PrecisionPlan | str | None" = None) -> PrecisionPlan:
    """The plan for the frozen base: ``None`` → every Linear in ``int4-g64-asym``; a format name → every Linear
    in that format. Both keep the output projection (``lm_head``), the most sensitive layer, out of INT4: in bf16,
    or in per-channel ``int8`` when it has more than ``HEAD_INT8_MIN_PARAMS`` weights (a tied head is then also the
    embedding's table; an untied embedding that large is packed in int8 too: :func:`table_formats`). Any other plan
    (a :class:`PrecisionPlan`, a dict, a file or folder) is used exactly as given
    (:func:`hf_lowprec.plan.resolve_plan`; ``auto``: see :func:`scan_int4_plan`).
    """
    if plan is None or names_a_format(plan):
        uniform = resolve_plan(plan or DEFAULT_FORMAT)
        return PrecisionPlan(table_formats(model), default=uniform.default)
    return resolve_plan(plan)


def table_formats(model: nn.Module) -> dict[str, str]:
    """``{layer: format}`` for the vocabulary tables: the output head in ``int8`` when it has more than
    ``HEAD_INT8_MIN_PARAMS`` weights, else ``bf16``; an untied input embedding that large in ``int8`` (packed, see
    :class:`~hf_lowprec.modules.packed_embedding.PackedEmbedding`); a smaller one is left out (it stays bf16)."""
    formats = {}
    head = output_head_name(model)
    if head is not None:
        out = model.get_output_embeddings()
        formats[head] = "int8" if out.in_features * out.out_features > HEAD_INT8_MIN_PARAMS else "bf16"
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if get is not None else None
    if embedding is not None and tied_head_names(model) is None:
        view = dense_view(embedding)
        name = next((canonical_name(n) for n, m in model.named_modules() if m is embedding), None)
        if name is not None and isinstance(view, nn.Embedding) and view.weight.numel() > HEAD_INT8_MIN_PARAMS:
            formats[name] = "int8"
    return formats


def scan_int4_plan(
    model: nn.Module,
    calibration: torch.Tensor,
    budget: dict | None = None,
    formats: Sequence[str] = AUTO_FORMATS,
    dense_weights=None,
) -> PrecisionPlan:
    """A plan for the frozen base from a sensitivity scan: every Linear but the output projection gets one of
    ``formats`` (or stays bf16) so that the predicted loss increase is least within ``budget``; the output projection
    gets what :func:`int4_plan` gives it.

    Args:
        calibration: token blocks ``[n, T]``, merged into forwards of up to ``SCAN_BATCH_TOKENS`` tokens (one block
            at least; Fisher scan: activation gradients only).
        budget: keyword arguments of :func:`hf_lowprec.sensitivity.allocate` (default ``AUTO_BUDGET``).
        formats: candidate formats (default ``AUTO_FORMATS``).
        dense_weights: for a model packed while loading, the reader of its checkpoint weights (see
            :func:`hf_lowprec.sensitivity.scan`): the scan then runs on the packed model, one dense weight at a time.
    """
    head = output_head_name(model)
    linears = [n for n, m in eligible_layers(model).items() if isinstance(m, (nn.Linear, PackedLinear)) and n != head]
    budget = AUTO_BUDGET if budget is None else budget
    check_budget(model, formats, budget, layers=linears, packed=dense_weights is not None)  # not after the scan
    batches = [{"input_ids": block[None], "labels": block[None]} for block in check_calibration(calibration)]
    result = scan(
        model,
        batches,
        formats=tuple(formats),
        method="fisher",
        layers=linears,
        max_batch_tokens=max(SCAN_BATCH_TOKENS, calibration.shape[1]),
        dense_weights=dense_weights,
    )
    plan = allocate(result, budget)
    return PrecisionPlan({**plan.layers, **table_formats(model)}, default=plan.default, model=plan.model)


def check_calibration(calibration: torch.Tensor) -> torch.Tensor:
    if (
        not torch.is_tensor(calibration)
        or calibration.dim() != 2
        or calibration.dtype not in (torch.int32, torch.int64)
        or not len(calibration)
    ):
        got = (
            f"{calibration.dtype} {tuple(calibration.shape)}"
            if torch.is_tensor(calibration)
            else type(calibration).__name__
        )
        raise ValueError(f"calibration must be token ids [n, T] (int64), got {got}")
    return calibration


def base_holds(spec: FormatSpec) -> bool:
    """Whether a frozen INT4 base can hold a layer planned in ``spec``: packed (int4-*, per-channel int8) or left in
    high precision; FP8, NF4 and grouped int8 would run emulated and export dense."""
    return spec.is_high_precision or packed_class(spec) is not None


def check_quantizable(model: nn.Module, plan: PrecisionPlan) -> None:
    """Raise ``ValueError`` if the plan packs nothing, a layer is narrower than its INT4 group, a ``-rht`` layer's
    input cannot be rotated, or an embedding is planned in a packed format it cannot take (``-a8``, ``-rht``); or the
    model multiplies in layers no plan converts (:func:`~hf_lowprec.plan.check_convertible`: GPT-2's ``Conv1D``)."""
    check_convertible(model)
    assigned = plan.assign(model)
    layers = eligible_layers(model)
    linear = (nn.Linear, PackedLinear)  # packed already when quantized on load
    for name, spec in assigned.items():
        if isinstance(dense_view(layers[name]), nn.Embedding) and not spec.is_high_precision and packed_class(spec):
            check_embedding_format(spec)  # an int4 embedding without -a8 / -rht, or per-row int8
    dense_only = sorted(
        n for n, s in assigned.items() if isinstance(layers[n], linear) and not base_holds(s)
    )
    if dense_only:
        formats = sorted({assigned[n].name for n in dense_only})
        raise ValueError(
            f"plan puts {len(dense_only)} Linear layers (e.g. {dense_only[0]}) in {', '.join(formats)}, which no "
            "packed layer stores: a frozen INT4 base takes int4-* and int8 formats or keeps layers in high precision. "
            "Train such a plan in full (apply_plan on the dense model; hf-lowprec finetune --recipe auto-mixed), or "
            "scan for the INT4 base with formats int4-g64-asym,int8"
        )
    packed = {n: s for n, s in assigned.items() if s.family == "int4" and isinstance(layers[n], linear)}
    if not packed:
        raise ValueError(
            f"plan {plan.brief()} puts no Linear layer of this model in int4; nothing to pack into an INT4 base"
        )
    narrow = [
        f"{n} ({layers[n].in_features} inputs)"
        for n, s in packed.items()
        if s.group_size is not None and layers[n].in_features < s.group_size
    ]
    if narrow:
        group = next(s.group_size for s in packed.values() if s.group_size)
        raise ValueError(
            f"model too small to quantize with groups of {group}: "
            f"{', '.join(narrow[:3])}{' ...' if len(narrow) > 3 else ''} "
            f"have fewer inputs than one group; use a smaller group (e.g. int4-g{max(2, group // 4)}) or keep them "
            "in bf16"
        )
    unrotatable = [
        f"{n} ({layers[n].in_features} inputs)"
        for n, s in assigned.items()
        if s.rotate and isinstance(layers[n], linear) and rotation_block(layers[n].in_features) is None
    ]
    if unrotatable:
        raise ValueError(
            f"'-rht' needs input sizes that are multiples of {MIN_ROTATION_BLOCK}: {', '.join(unrotatable[:3])}"
            f"{' ...' if len(unrotatable) > 3 else ''} cannot be rotated; plan them without '-rht'"
        )


def resolve_target_modules(model: nn.Module, target_modules) -> list[str]:
    """Full module names LoRA will wrap, from PEFT-style ``target_modules`` (names, suffixes, ``all-linear``, a regex).

    ``all-linear`` means every Linear (packed or not) except the output projection, as in PEFT. Raises
    ``ValueError`` for a name or regex that matches no Linear layer.
    """
    linears = {fqn: m for fqn, m in model.named_modules() if isinstance(m, (nn.Linear, PackedLinear))}
    names = sorted({canonical_name(f).rsplit(".", 1)[-1] for f in linears})
    head = output_head_name(model)
    if target_modules is None:
        raise ValueError(f"LoraConfig.target_modules is required here; e.g. 'all-linear' or some of {names}")
    every = sorted(f for f in linears if canonical_name(f) != head)
    listed = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    all_linear = any(isinstance(t, str) and t.lower() == ALL_LINEAR for t in listed)
    if all_linear and not every:
        raise ValueError(
            f"target_modules 'all-linear': {type(model).__name__} has no Linear layer besides its output head "
            f"({names or 'none'}), so LoRA and INT4 have nothing to work on"
        )
    if all_linear:
        return every
    if isinstance(target_modules, str):
        import re

        found = sorted(f for f in linears if re.fullmatch(target_modules, f))
        if not found:
            raise ValueError(
                f"target_modules regex {target_modules!r} matches no Linear layer; Linear layers are named {names}"
            )
        return found
    chosen = set()
    for t in listed:
        hit = [f for f in linears if f == t or f.endswith(f".{t}")]
        if not hit:
            raise ValueError(
                f"target module {t!r} matches no Linear layer of this model; Linear layers are named {names}"
            )
        chosen.update(hit)
    return sorted(chosen)


def lora_targets(model: nn.Module, config) -> set[str]:
    """The full names of the layers a ``LoraConfig`` wraps in ``model`` (:func:`resolve_target_modules`), narrowed by
    its ``layers_to_transform``/``layers_pattern`` through PEFT's own matching: PEFT applies those to suffix matches
    only, so full names alone would wrap every block. A set, as PEFT keeps ``target_modules`` (its
    ``add_weighted_adapter`` refuses to mix a list and a set)."""
    from peft.tuners.tuners_utils import check_target_module_exists

    found = resolve_target_modules(model, config.target_modules)
    if config.layers_to_transform is None:
        return set(found)
    probe = copy.copy(config)
    probe.target_modules = {name.rsplit(".", 1)[-1] for name in found}
    return {name for name in found if check_target_module_exists(probe, name)}
