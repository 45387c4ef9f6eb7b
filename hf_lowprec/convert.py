"""apply_plan / revert / freeze: the only place that walks a model and swaps its modules.

Swaps keep the original ``weight``/``bias`` ``nn.Parameter`` objects, so an optimizer built before
the swap keeps training them; parameters the new layers add (learned INT4 steps) are returned in
the report so a caller can add them to its optimizer (the callback and the plugin do).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from hf_lowprec.formats import E5M2, FormatSpec
from hf_lowprec.layers import (  # noqa: F401  (re-exported)
    canonical_name,
    dense_view,
    eligible_layers,
    swap_layers,
    wrapper_of,
)
from hf_lowprec.modules import FROZEN_TYPES, LOW_PRECISION_TYPES, TiedQuantizers
from hf_lowprec.modules.embedding import like_embedding
from hf_lowprec.modules.fp8 import FP8Linear
from hf_lowprec.modules.int4 import Int4Embedding, Int4Linear
from hf_lowprec.modules.packed import packed_class
from hf_lowprec.modules.packed_embedding import share_packed_head, tied_head_names
from hf_lowprec.plan import PrecisionPlan, format_shares, kept_label, resolve_plan
from hf_lowprec.rotation import MIN_ROTATION_BLOCK, rotation_block

logger = logging.getLogger(__name__)

PolicyFactory = Callable[[str, str, FormatSpec], object]


@dataclass
class LayerReport:
    """What happened to one layer."""

    name: str
    requested: str
    applied: str
    module: str
    params: int
    backend: str = ""
    reason: str = ""
    tied_to: str = ""  # the earlier layer whose weight this one shares (tied embeddings); counted there


@dataclass
class ConversionReport:
    """Result of :func:`apply_plan`: one :class:`LayerReport` per eligible layer, and new parameters."""

    layers: list[LayerReport] = field(default_factory=list)
    new_parameters: dict[str, nn.Parameter] = field(default_factory=dict)
    calibration: dict | None = (
        None  # hf_lowprec.ondevice.calibration.summary when the INT4 codes were calibrated (GPTQ, AWQ)
    )
    compute: dict | None = None  # {"dtype", "reason"}: the compute dtype chosen at load and why

    @property
    def swapped(self) -> list[LayerReport]:
        return [r for r in self.layers if r.applied not in ("bf16", "fp32", "kept")]

    @property
    def not_applied(self) -> list[LayerReport]:
        """Layers that could not run their requested format (never silently)."""
        return [r for r in self.layers if r.requested != r.applied]

    def fractions(self, kept: bool = False) -> dict[str, float]:
        """Fraction of eligible parameters per applied format (a weight shared by tied layers counts once); ``kept``:
        the high-precision formats together as ``kept`` (layers left in their own dtype, whatever the plan names)."""
        label = kept_label if kept else str
        return format_shares((label(r.applied), r.params) for r in self.layers if not r.tied_to)

    def to_dict(self) -> dict:
        return {
            "layers": [asdict(r) for r in self.layers],
            "fractions": self.fractions(),
            "new_parameters": list(self.new_parameters),
            "calibration": self.calibration,
            "compute": self.compute,
        }

    def __str__(self) -> str:
        lines = [
            f"{len(self.swapped)} of {len(self.layers)} layers in low precision; "
            + ", ".join(f"{k} {v:.1%}" for k, v in self.fractions(kept=True).items())
        ]
        if self.compute:
            lines.append(f"  {self.compute['reason']}")
        for r in self.not_applied:
            lines.append(f"  {r.name}: requested {r.requested}, runs {r.applied} ({r.reason})")
        return "\n".join(lines)


def _high_precision(module: nn.Module) -> nn.Module:
    """A plain ``nn.Linear``/``nn.Embedding`` sharing ``module``'s parameters."""
    if isinstance(module, FROZEN_TYPES):
        raise ValueError(f"a frozen {type(module).__name__} has no high-precision weight left to revert to")
    if isinstance(module, nn.Embedding):
        return like_embedding(nn.Embedding, module)
    new = nn.Linear(module.in_features, module.out_features, module.bias is not None, device="meta")
    new.weight, new.bias = module.weight, module.bias
    return new


def apply_plan(
    model: nn.Module,
    plan: "PrecisionPlan | Mapping | str | Path",
    *,
    fp8_backend: str = "auto",
    grad_dtype: torch.dtype = E5M2,
    learn_scales: bool = True,
    learn_activation_scales: bool = False,
    policy_factory: PolicyFactory | None = None,
) -> ConversionReport:
    """Swap ``model``'s layers in place for the formats ``plan`` assigns; returns a report.

    Args:
        plan: a :class:`PrecisionPlan`, a dict, a JSON/YAML path, or a format name for every Linear.
        fp8_backend: ``auto`` (torchao kernels on FP8 GPUs, emulation elsewhere), ``emulated`` or ``torchao``.
        grad_dtype: FP8 dtype of output gradients.
        learn_scales: train INT4/INT8 group steps with LSQ.
        learn_activation_scales: ``-a8`` formats: quantize each layer's input with one LSQ-trained step
            (a new parameter in the report) instead of dynamic per-token scales.
        policy_factory: ``(layer name, role, spec) -> ScalePolicy or None`` for FP8 layers.

    Idempotent: layers already in their planned format are left alone; layers planned ``bf16``/``fp32``
    that were converted earlier are reverted. Raises ``ValueError`` if the plan does not fit the model.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"apply_plan converts a torch nn.Module (a transformers model), got {type(model).__name__}")
    wrapper = wrapper_of(model)
    if wrapper is not None:
        raise ValueError(
            f"apply_plan got a model already wrapped by {wrapper}; convert the plain model first, then wrap it "
            "(apply_plan before DistributedDataParallel / fully_shard / accelerator.prepare)"
        )
    plan = resolve_plan(plan)
    plan.validate(model)
    assignments = plan.assign(model)
    report = ConversionReport()
    options = {
        "fp8_backend": fp8_backend,
        "grad_dtype": grad_dtype,
        "learn_scales": learn_scales,
        "learn_activation_scales": learn_activation_scales,
    }
    convert = _LayerConversion(assignments, report, options, policy_factory)
    swap_layers(model, convert)
    for r in report.layers:
        if r.reason and r.reason != "unchanged":
            logger.info("%s: %s (%s)", r.name, r.applied, r.reason)
    model.hf_lowprec_plan = plan
    return report


class _LayerConversion:
    """``(name, fqn, module) -> new layer or None`` for :func:`swap_layers`: each layer in its planned format, a
    :class:`LayerReport` for every layer, learned parameters the new layers add, tied weights sharing a quantizer."""

    def __init__(self, assignments: dict[str, FormatSpec], report: ConversionReport, options: dict, policy_factory):
        self.assignments, self.report, self.options, self.policy_factory = assignments, report, options, policy_factory
        self.quantizers = TiedQuantizers()  # layers on one weight share its quantizer
        self.first_user: dict[int, str] = {}  # id(weight) -> the first layer holding it

    def __call__(self, name: str, fqn: str, module: nn.Module) -> nn.Module | None:
        requested = spec = self.assignments[name]
        reason = ""
        view = dense_view(module)
        if spec.rotate and not isinstance(view, nn.Embedding) and rotation_block(module.in_features) is None:
            spec = replace(spec, rotate=False)
            reason = f"not rotated: {module.in_features} input features are not a multiple of {MIN_ROTATION_BLOCK}"
            logger.warning("%s: requested %s, runs %s (%s)", name, requested.name, spec.name, reason)
        params = view.weight.numel()
        tied = self.first_user.setdefault(id(getattr(module, "weight", module)), name)
        tied = "" if tied == name else tied
        if tied and _stored_apart(spec) != _stored_apart(twin := self.assignments[tied]):  # allowed, and said
            mixed = f"shares its weight with {tied!r}, which runs {twin.name}: counted there"
            reason = "; ".join(r for r in (reason, mixed) if r)
            logger.warning("%s runs %s and %s", name, spec.name, mixed)
        if isinstance(module, LOW_PRECISION_TYPES) and module.spec == spec:
            kind = type(module).__name__
            backend = _backend(module)
            row = LayerReport(name, requested.name, spec.name, kind, params, backend, reason or "unchanged", tied)
            self.report.layers.append(row)
            return None
        if isinstance(module, FROZEN_TYPES):
            raise ValueError(
                f"layer {name!r} is packed {module.spec.name} (frozen codes, no dense weight) and cannot change to "
                f"{spec.name}: a plan for a packed model keeps its packed layers in their formats (a plan file, or "
                "exclusions of those layers); to train them in another, load the checkpoint dense (without "
                "HfLowprecConfig / load_int4_lora) and convert that"
            )
        original = _high_precision(module) if isinstance(module, LOW_PRECISION_TYPES) else module
        if spec.is_high_precision:
            kind = type(original).__name__
            row = LayerReport(name, spec.name, spec.name, kind, params, reason=reason, tied_to=tied)
            self.report.layers.append(row)
            return original
        options = dict(self.options)
        if self.policy_factory is not None and spec.family == "fp8":
            roles = ("input", "weight", "grad")
            options["policies"] = {r: p for r in roles if (p := self.policy_factory(name, r, spec)) is not None}
        before = {id(p) for p in original.parameters()}
        new = self.quantizers.build(name, original, spec, options)
        for pname, p in new.named_parameters():
            if id(p) not in before and p.requires_grad:
                self.report.new_parameters[f"{fqn}.{pname}"] = p
        reason = "; ".join(r for r in (reason, _note(new)) if r)
        self.report.layers.append(
            LayerReport(name, requested.name, spec.name, type(new).__name__, params, _backend(new), reason, tied)
        )
        return new


def _stored_apart(spec: FormatSpec) -> bool:
    """Whether ``spec`` stores a weight as integer codes (its FP8 and high-precision layers compute from the master
    weight itself)."""
    return not spec.is_high_precision and spec.family != "fp8"


def _backend(module: nn.Module) -> str:
    return (
        module.backend
        if isinstance(module, FP8Linear)
        else ("emulated" if isinstance(module, LOW_PRECISION_TYPES) else "")
    )


def _note(module: nn.Module) -> str:
    """Say when an FP8 layer runs emulated numerics rather than FP8 tensor cores."""
    if isinstance(module, FP8Linear) and module.backend == "emulated":
        return f"FP8 numerics emulated: {module.torchao_blocker() or 'as asked (fp8_backend emulated)'}"
    return ""


def revert(model: nn.Module) -> int:
    """Put plain ``nn.Linear``/``nn.Embedding`` back for every converted (non-frozen) layer; returns the count."""
    count = swap_layers(model, lambda name, fqn, m: _high_precision(m) if _revertible(m) else None)
    for m in model.modules():  # the model's own, or the one a wrapper (a PeftModel) forwards attributes to
        for recorded in ("hf_lowprec_plan", "hf_lowprec_options"):  # the plan, a training session's options
            vars(m).pop(recorded, None)
    return count


@torch.no_grad()
def freeze(model: nn.Module) -> int:
    """Replace every ``Int4Linear`` and ``Int4Embedding`` whose format packs (int4; per-channel int8) by its frozen
    packed layer (:func:`~hf_lowprec.modules.packed.packed_class`); returns the count. An embedding tied to the output
    head is not packed a second time: a fake-quantized one (sharing the head's quantizer) comes to read the packed
    head's rows (:func:`~hf_lowprec.modules.packed_embedding.share_packed_head`), its dense table gone; one kept dense
    keeps its table."""
    tied = tied_head_names(model)
    tied_embedding = tied[1] if tied is not None else None
    count = swap_layers(model, lambda _, fqn, m: m.freeze() if packs_when_frozen(m) and fqn != tied_embedding else None)
    if tied is not None and isinstance(model.get_submodule(tied[1]), Int4Embedding):
        share_packed_head(model, tied)
    return count


def _revertible(module: nn.Module) -> bool:
    return isinstance(module, LOW_PRECISION_TYPES) and not isinstance(module, FROZEN_TYPES)


def packs_when_frozen(module: nn.Module) -> bool:
    """Whether :func:`freeze` packs ``module`` (an ``Int4Linear``/``Int4Embedding`` of a format that packs)."""
    return isinstance(module, (Int4Linear, Int4Embedding)) and packed_class(module.spec) is not None
