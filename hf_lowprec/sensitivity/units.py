"""The units a scan scores: eligible layers grouped by shared weight (tied embeddings), the formats each can
take, their low-precision twins and their storage per choice.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hf_lowprec.convert import eligible_layers
from hf_lowprec.formats import FormatSpec
from hf_lowprec.modules import FROZEN_TYPES, LOW_PRECISION_TYPES, PackedEmbedding, low_precision_layer
from hf_lowprec.modules.packed import PackedLinear
from hf_lowprec.modules.packed_embedding import embedding_scale
from hf_lowprec.rotation import MIN_ROTATION_BLOCK, rotation_block
from hf_lowprec.sensitivity.results import KEEP, LayerScore

logger = logging.getLogger(__name__)


@dataclass
class _Unit:
    name: str
    members: list[tuple[str, nn.Module]]
    formats: list[str]


def _units(model: nn.Module, formats: Sequence[FormatSpec], packed: bool = False) -> list[_Unit]:
    """Eligible layers grouped by shared weight, with the formats every member can take; ``packed``: linears packed
    while loading are scanned too (their dense weights are read from the checkpoint), embeddings packed while loading
    are left out."""
    layers = eligible_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no eligible layers (nn.Linear / nn.Embedding) to scan")
    allowed = FROZEN_TYPES if packed else ()
    converted = [n for n, m in layers.items() if isinstance(m, LOW_PRECISION_TYPES) and not isinstance(m, allowed)]
    if converted:
        raise ValueError(
            f"scan needs an unconverted model, but {len(converted)} layers are already low precision "
            f"(e.g. {converted[0]!r}); call hf_lowprec.revert(model) first"
        )
    groups: dict[int, _Unit] = {}
    for name, module in layers.items():
        if isinstance(module, PackedEmbedding):
            logger.info("%s: not scanned (an embedding table packed while loading stays as it is)", name)
            continue
        key = id(module) if isinstance(module, PackedLinear) else id(module.weight)
        unit = groups.setdefault(key, _Unit(name, [], []))
        unit.members.append((name, module))
    unscanned: dict[str, list[str]] = {}  # why -> layers no scanned format fits: a plan keeps them as they are
    for unit in groups.values():
        unit.formats = [s.name for s in formats if not _cannot_take(unit, s)]
        for s in formats:
            if why := _cannot_take(unit, s):
                logger.info("%s: skipping %s (%s)", unit.name, s.name, why)
        if not unit.formats:
            unscanned.setdefault(_cannot_take(unit, formats[0]), []).append(unit.name)
    for why, names in unscanned.items():
        logger.warning(
            "%d layers take none of the scanned formats, so a plan from this scan keeps them as they are (%s): %s",
            len(names), ", ".join(names[:4]) + (", ..." if len(names) > 4 else ""), why,
        )  # fmt: skip
    return list(groups.values())


def _cannot_take(unit: _Unit, spec: FormatSpec) -> str:
    """Why a member of ``unit`` cannot run ``spec`` (``""`` when every member can): embeddings have no activation to
    quantize (``-a8``) nor input to rotate (``-rht``) or smooth (``-sq``); a rotated linear's input size must be a
    multiple of the smallest rotation block."""
    for _, module in unit.members:
        if isinstance(module, nn.Embedding):
            if spec.act_int8 or spec.rotate or spec.smooth:
                return "an embedding has no activation to quantize nor input to rotate or smooth"
            if embedding_scale(module) is not None:
                return "it scales its rows (embed_scale), which trainable FP8/INT4 embeddings do not (packed ones do)"
        elif spec.rotate and rotation_block(module.in_features) is None:
            return f"{module.in_features} input features are not a multiple of {MIN_ROTATION_BLOCK}: cannot rotate"
    return ""


def _select(units: list[_Unit], patterns: Sequence[str]) -> list[_Unit]:
    """The units with a member matching one of ``patterns`` (names or globs)."""
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(n, pattern) for u in units for n, _ in u.members):
            raise ValueError(f"layers entry {pattern!r} matches no eligible layer (e.g. {units[0].name!r})")
    return [u for u in units if any(fnmatch.fnmatchcase(n, p) for n, _ in u.members for p in patterns)]


def _twins(unit: _Unit, fmt: str, fp8_backend: str) -> list[tuple[str, nn.Module, nn.Module]]:
    """``(name, layer, low-precision twin)`` for each member; twins share weights (and integer quantizers)."""
    spec = FormatSpec.parse(fmt)
    options = {"fp8_backend": fp8_backend, "learn_scales": False}
    out, quantizer = [], None
    for name, module in unit.members:
        twin = low_precision_layer(module, spec, options, quantizer)
        quantizer = getattr(twin, "weight_quantizer", quantizer)
        out.append((name, module, twin))
    return out


def _dense_shape(module: nn.Module) -> tuple[int, int, torch.dtype]:
    """``(rows, columns, dtype)`` of a layer's dense weight; a packed layer's in its compute dtype."""
    if isinstance(module, PackedLinear):
        return module.out_features, module.in_features, module.dtype
    return *module.weight.shape, module.weight.dtype


def _layer_bytes(unit: _Unit) -> dict[str, float]:
    rows, columns, dtype = _dense_shape(unit.members[0][1])
    out = {KEEP: float(rows * columns * dtype.itemsize)}
    for f in unit.formats:
        out[f] = float(rows * columns * FormatSpec.parse(f).bytes_per_param(columns))
    return out


def unscored(unit: _Unit) -> LayerScore:
    """A unit's score row before any pass: its name, tied members, type, parameters and bytes."""
    first = unit.members[0][1]
    tied = tuple(n for n, _ in unit.members[1:])
    rows, columns, _ = _dense_shape(first)
    kind = "Linear" if isinstance(first, PackedLinear) else type(first).__name__
    return LayerScore(unit.name, tied, kind, rows * columns, _layer_bytes(unit))
