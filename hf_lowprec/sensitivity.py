"""Sensitivity scan and budgeted precision allocation.

:func:`scan` scores, for every eligible layer (``nn.Linear``, ``nn.Embedding``, the output head) and
every candidate format, how much the calibration loss rises when *only that layer* runs in that format:

- ``measured``: run the calibration batches with the layer's output replaced by its low-precision
  twin (the same classes :func:`hf_lowprec.convert.apply_plan` installs), record Δloss and the KL
  divergence of the logits from the unquantized model's.
- ``fisher``: one forward/backward per batch. For each layer output ``y`` and format, the output
  perturbation ``δy = y_q - y`` is computed from the same input; a second-order Taylor expansion
  with the empirical Fisher for the Hessian gives ``Δloss ≈ (gᵀδy + ½ Σ g² δy²) / N``, with ``g``
  the gradient of the summed token loss w.r.t. ``y`` and ``N`` the calibration tokens. This is
  ModelOpt AutoQuantize's output-space score (which keeps only the ``g²δy²`` term) plus the
  first-order term: working in output space covers activation quantization (FP8 inputs, ``-a8``)
  as well as weight error, and needs activation gradients only.
- ``auto``: ``fisher`` for every layer, then ``measured`` for the (layer, format) pairs with the
  highest predicted Δloss per byte saved: the choices a budget decides on first, and the largest
  perturbations, where a Taylor estimate is least reliable.

Twins run through forward hooks on the original layers: the scan swaps no module (only
:mod:`hf_lowprec.convert` does), so module objects, parameters, gradients and train/eval modes are
exactly as they were afterwards, also after an interrupt. (``apply_plan`` + ``revert`` would leave
new ``nn.Linear`` objects behind.) Measured Δloss includes the first-order effect of the calibration
data's gradient; the Fisher estimate keeps that term for the same reason.

:func:`allocate` turns a :class:`ScanResult` and a :class:`Budget` into an explicit
:class:`~hf_lowprec.plan.PrecisionPlan` by solving a multiple-choice knapsack; :func:`measure_plan`
measures a whole plan's Δloss on held-out batches.

Layers that share one weight (tied input/output embeddings) are scored and allocated as one unit.
"""

from __future__ import annotations

import difflib
import fnmatch
import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hf_lowprec.convert import eligible_layers
from hf_lowprec.formats import FormatSpec
from hf_lowprec.modules import LOW_PRECISION_TYPES, low_precision_layer
from hf_lowprec.plan import PrecisionPlan, atomic_write_text

logger = logging.getLogger(__name__)

METHODS = ("auto", "measured", "fisher")
DEFAULT_FORMATS = ("fp8", "int4-g64")
KEEP = "bf16"
"""Label of the high-precision choice: the layer stays as it is (plans write it as ``bf16``)."""
DEFAULT_RELATIVE_LOSS_INCREASE = 0.01
"""Budget used by :func:`allocate` when none is given: Δloss ≤ 1% of the calibration loss."""
SOLVERS = ("auto", "ilp", "greedy")
ILP_MAX_VARIABLES = 20000  # beyond this many (unit, choice) pairs the greedy solver is used
IGNORE_INDEX = -100
_AN_EMBEDDING = nn.Embedding(1, 1)  # PrecisionPlan.resolve looks at a module's type only
Progress = Callable[[int, int, str], None]


# ------------------------------------------------------------------------------------ results


@dataclass
class LayerScore:
    """Scores of one unit: a layer, or layers sharing one weight (``tied``).

    Attributes:
        name: the unit's first layer in model order (canonical name).
        tied: the other layers sharing its weight.
        kind: ``Linear`` or ``Embedding`` (of ``name``).
        params: weight elements (counted once for tied layers).
        bytes: weight storage per choice in bytes, scales included; ``bf16`` is the layer as it is.
        predicted: Taylor estimate of Δloss (nats/token) per format: ``first_order + second_order``.
        first_order, second_order: the two Taylor terms.
        measured: measured Δloss per format (layers that were measured).
        kl: measured KL(unquantized ‖ quantized) of the next-token distribution, nats/token.
    """

    name: str
    tied: tuple[str, ...] = ()
    kind: str = "Linear"
    params: int = 0
    bytes: dict[str, float] = field(default_factory=dict)
    predicted: dict[str, float] = field(default_factory=dict)
    first_order: dict[str, float] = field(default_factory=dict)
    second_order: dict[str, float] = field(default_factory=dict)
    measured: dict[str, float] = field(default_factory=dict)
    kl: dict[str, float] = field(default_factory=dict)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.tied)

    @property
    def formats(self) -> list[str]:
        """Low-precision formats this unit can take (those it has a score for)."""
        return [f for f in self.bytes if f != KEEP]

    def score(self, fmt: str) -> float:
        """Δloss of ``fmt``: measured when available, else predicted; 0 for ``bf16`` (may be negative:
        quantizing moved the calibration loss down; :func:`allocate` counts that as 0)."""
        if fmt == KEEP:
            return 0.0
        return self.measured[fmt] if fmt in self.measured else self.predicted[fmt]


@dataclass
class ScanResult:
    """Per-layer, per-format sensitivity scores from :func:`scan`.

    Attributes:
        layers: one :class:`LayerScore` per unit, in model order.
        formats: the scanned format names.
        method: ``auto``, ``measured`` or ``fisher``.
        base_loss: mean next-token loss of the unquantized model on the calibration batches.
        tokens: calibration tokens (label positions) the losses average over.
        seconds: wall time per phase.
        plan, allocation: the last :func:`allocate` result on these scores and its summary.
    """

    layers: list[LayerScore]
    formats: tuple[str, ...]
    method: str
    base_loss: float = float("nan")
    tokens: int = 0
    seed: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    model: str | None = None
    plan: PrecisionPlan | None = None
    allocation: dict | None = None

    def __getitem__(self, name: str) -> LayerScore:
        for unit in self.layers:
            if name in unit.names:
                return unit
        raise KeyError(f"{name!r} is not a scanned layer")

    def ranking(self, fmt: str) -> list[str]:
        """Unit names, most sensitive to ``fmt`` first (by :meth:`LayerScore.score`)."""
        units = [u for u in self.layers if fmt in u.bytes]
        return [u.name for u in sorted(units, key=lambda u: -u.score(fmt))]

    def chosen(self) -> dict[str, str]:
        """``{unit name: format}`` of the last allocation (empty if none)."""
        if self.plan is None:
            return {}
        return {u.name: self.plan.layers.get(u.name, self.plan.default).name for u in self.layers}

    def rows(self) -> list[dict]:
        """One dict per unit for a table: layer, tied, params, score per format, measured, chosen."""
        chosen = self.chosen()
        out = []
        for u in self.layers:
            row = {"layer": u.name, "tied": ", ".join(u.tied), "params": u.params}
            for f in self.formats:
                row[f] = u.score(f) if f in u.bytes else None
            row["measured"] = bool(u.measured)
            row["chosen"] = chosen.get(u.name)
            out.append(row)
        return out

    def format_table(self) -> str:
        """The :meth:`rows` as plain text (Δloss in nats/token; ``*`` marks measured values)."""
        width = max([len(u.name) + (3 if u.tied else 0) for u in self.layers] + [5]) + 2
        head = f"{'layer':<{width}}{'params':>12}" + "".join(f"{f:>14}" for f in self.formats) + f"{'chosen':>11}"
        lines = [head]
        for u, row in zip(self.layers, self.rows()):
            name = u.name + (" +t" if u.tied else "")
            cells = ""
            for f in self.formats:
                v = row[f]
                mark = "*" if f in u.measured else " "
                cells += f"{'n/a':>14}" if v is None else f"{v:>13.3e}{mark}"
            lines.append(f"{name:<{width}}{u.params:>12,}{cells}{row['chosen'] or '':>11}")
        lines.append(f"Δloss in nats/token over {self.tokens} tokens (base loss {self.base_loss:.4f}); * measured, else predicted; +t tied weights")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "method": self.method, "formats": list(self.formats), "base_loss": self.base_loss,
            "tokens": self.tokens, "seed": self.seed, "seconds": self.seconds, "model": self.model,
            "layers": [{**asdict(u), "tied": list(u.tied)} for u in self.layers],
            "plan": None if self.plan is None else self.plan.to_dict(), "allocation": self.allocation,
        }  # fmt: skip

    @classmethod
    def from_dict(cls, data: Mapping) -> "ScanResult":
        layers = [LayerScore(**{**u, "tied": tuple(u.get("tied", ()))}) for u in data["layers"]]
        plan = data.get("plan")
        return cls(
            layers, tuple(data["formats"]), data["method"], data.get("base_loss", float("nan")), data.get("tokens", 0),
            data.get("seed", 0), dict(data.get("seconds", {})), data.get("model"),
            None if plan is None else PrecisionPlan.from_dict(plan), data.get("allocation"),
        )  # fmt: skip

    def save(self, path: str | Path) -> Path:
        """Write JSON atomically; returns the path."""
        path = Path(path)
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "ScanResult":
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"scan file {str(path)!r} does not exist")
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"scan file {str(path)!r} is not a saved ScanResult: {e}") from None

    def save_heatmap(self, path: str | Path, title: str | None = None) -> Path:
        """PNG heat map, layer × format, of log10 Δloss; boxes mark the allocated format, dots measured values.

        Drawn on a bare ``matplotlib.figure.Figure`` (Agg canvas): no pyplot state, no backend switch.
        """
        from matplotlib.figure import Figure
        from matplotlib.patches import Rectangle

        fmts = list(self.formats)
        values = np.full((len(self.layers), len(fmts)), np.nan)
        for i, u in enumerate(self.layers):
            for j, f in enumerate(fmts):
                if f in u.bytes:
                    values[i, j] = u.score(f)
        positive = values[np.isfinite(values) & (values > 0)]
        floor = positive.min() if positive.size else 1e-12
        shown = np.log10(np.where(np.isfinite(values), np.maximum(values, floor), np.nan))
        height = max(3.0, 0.13 * len(self.layers) + 1.5)
        fig = Figure(figsize=(5.5 + 1.0 * len(fmts), height))
        ax = fig.subplots()
        im = ax.imshow(shown, aspect="auto", cmap="magma_r", interpolation="nearest")
        fig.colorbar(im, ax=ax, label="log10 Δloss (nats/token; ≤ 0 shown at the smallest)", fraction=0.08, pad=0.03)
        ax.set_xticks(range(len(fmts)), fmts)
        ax.tick_params(axis="x", top=True, labeltop=True)
        ax.set_yticks(range(len(self.layers)), [u.name + (" (tied)" if u.tied else "") for u in self.layers], fontsize=6)
        chosen = self.chosen()
        for i, u in enumerate(self.layers):
            for j, f in enumerate(fmts):
                if f in u.measured:
                    ax.plot(j + 0.3, i, "o", color="white", markeredgecolor="black", markersize=3)
                if chosen.get(u.name) == f:
                    ax.add_patch(Rectangle((j - 0.45, i - 0.4), 0.9, 0.8, fill=False, edgecolor="deepskyblue", linewidth=1.5))
        ax.set_title(title or f"{self.model or 'model'}: per-layer Δloss ({self.method}); dots measured, boxes chosen", fontsize=8)
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp.png")
        fig.savefig(tmp, dpi=90, format="png")
        tmp.replace(path)
        return path


# ------------------------------------------------------------------------------------ helpers


def _check_batches(batches: Iterable[Mapping]) -> list[dict]:
    out = []
    for i, batch in enumerate(batches):
        if not isinstance(batch, Mapping) or "input_ids" not in batch:
            raise ValueError(f"batch {i}: each batch must be a dict with 'input_ids' and 'labels' tensors")
        if "labels" not in batch:
            raise ValueError("batches need a 'labels' key (causal LM: labels=input_ids)")
        out.append(dict(batch))
    if not out:
        raise ValueError("scan needs at least one calibration batch")
    return out


def _merge(batches: list[dict], max_tokens: int) -> list[dict]:
    """Concatenate consecutive batches of the same layout along dim 0, up to ``max_tokens`` per batch.

    Fewer, larger forwards: every low-precision twin quantizes its weight once per forward, which
    for a 135M model costs as much as the matmuls of a few hundred tokens.
    """
    out: list[dict] = []
    for batch in batches:
        last = out[-1] if out else None
        if last is not None and _same_layout(last, batch) and last["input_ids"].numel() + batch["input_ids"].numel() <= max_tokens:
            out[-1] = {k: torch.cat([last[k], v]) if torch.is_tensor(v) else v for k, v in batch.items()}
        else:
            out.append(batch)
    return out


def _same_layout(a: Mapping, b: Mapping) -> bool:
    if a.keys() != b.keys():
        return False
    for k, v in b.items():
        w = a[k]
        if torch.is_tensor(v) != torch.is_tensor(w):
            return False
        if torch.is_tensor(v) and (v.dim() == 0 or v.shape[1:] != w.shape[1:] or v.dtype != w.dtype):
            return False
        if not torch.is_tensor(v) and v != w:
            return False
    return True


def _shifts_labels(model: nn.Module, labels: torch.Tensor) -> bool:
    """Whether ``labels`` are next-token targets (causal LM) rather than per-position or per-sequence classes."""
    if labels.is_floating_point():
        raise ValueError("scan needs class or token labels (integer tensors); regression labels (float) are not supported")
    return labels.dim() == 2 and getattr(model, "loss_type", "ForCausalLM") == "ForCausalLM"


def _label_count(model: nn.Module, batch: Mapping) -> int:
    """Positions the loss scores: next tokens for a causal LM, labels as they are for classification."""
    labels = batch["labels"]
    return int(((labels[:, 1:] if _shifts_labels(model, labels) else labels) != IGNORE_INDEX).sum())


def _forward(model: nn.Module, batch: Mapping, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits at label positions [T, C] fp32, labels [T])`` of one batch.

    Causal LM: next-token logits and labels (``T`` tokens, ``C`` = vocabulary). Token
    classification: one row per labelled token. Sequence classification (logits ``[B, C]``,
    labels ``[B]``): one row per sequence.
    """
    inputs = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items() if k != "labels"}
    if getattr(getattr(model, "config", None), "use_cache", None) is not None:
        inputs.setdefault("use_cache", False)  # no KV cache: less memory, and blocks can be replayed
    logits = model(**inputs).logits
    labels = batch["labels"].to(device)
    if _shifts_labels(model, labels):
        logits, labels = logits[:, :-1], labels[:, 1:]
    if logits.shape[: labels.dim()] != labels.shape:
        raise ValueError(f"labels of shape {tuple(batch['labels'].shape)} do not fit logits of shape {tuple(logits.shape)} ({type(model).__name__})")
    valid = labels != IGNORE_INDEX
    return logits[valid].float(), labels[valid]


@dataclass
class _Unit:
    name: str
    members: list[tuple[str, nn.Module]]
    formats: list[str]


def _units(model: nn.Module, formats: Sequence[FormatSpec]) -> list[_Unit]:
    """Eligible layers grouped by shared weight, with the formats every member can take."""
    layers = eligible_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no eligible layers (nn.Linear / nn.Embedding) to scan")
    converted = [n for n, m in layers.items() if isinstance(m, LOW_PRECISION_TYPES)]
    if converted:
        raise ValueError(
            f"scan needs an unconverted model, but {len(converted)} layers are already low precision "
            f"(e.g. {converted[0]!r}); call hf_lowprec.revert(model) first"
        )
    groups: dict[int, _Unit] = {}
    for name, module in layers.items():
        unit = groups.setdefault(id(module.weight), _Unit(name, [], []))
        unit.members.append((name, module))
    for unit in groups.values():
        has_embedding = any(isinstance(m, nn.Embedding) for _, m in unit.members)
        unit.formats = [s.name for s in formats if not (s.act_int8 and has_embedding)]
        if len(unit.formats) < len(formats):
            logger.info("%s: embeddings have no activation to quantize; skipping -a8 formats", unit.name)
    return list(groups.values())


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


def _layer_bytes(unit: _Unit) -> dict[str, float]:
    w = unit.members[0][1].weight
    out = {KEEP: float(w.numel() * w.element_size())}
    for f in unit.formats:
        out[f] = float(w.numel() * FormatSpec.parse(f).bytes_per_param(w.shape[-1]))
    return out


@contextmanager
def _scanning(model: nn.Module, seed: int):
    """Eval mode, a forked and seeded RNG, and hooks removed afterwards, whatever happens."""
    modes = [(m, m.training) for m in model.modules()]
    hooks: list = []
    device = next(model.parameters()).device
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            model.eval()
            yield hooks
    finally:
        for h in hooks:
            h.remove()
        for m, mode in modes:
            m.training = mode


class _BlockReplay:
    """Outputs of the model's blocks (outermost children of its ``nn.ModuleList``s: decoder layers)
    recorded in the unquantized pass, so that a measured pass for one layer replays the blocks that
    finished before the layer first runs — their inputs are unchanged — instead of computing them.

    Recording hooks stay in ``hooks`` until :meth:`stop`; :meth:`replaying` swaps a block's
    ``forward`` for the recorded output and restores it afterwards (a block called more than once
    per forward, or returning something other than tensors, is always computed).
    """

    def __init__(self, model: nn.Module, units: list[_Unit], hooks: list):
        lists = [n for n, m in model.named_modules() if isinstance(m, nn.ModuleList)]
        named = [(f"{n}.{i}" if n else str(i), b) for n in lists for i, b in enumerate(model.get_submodule(n))]
        self.blocks = [b for n, b in named if not any(n.startswith(o + ".") for o, _ in named)]
        self.outputs: list[list] = [[] for _ in self.blocks]
        self.calls = [0] * len(self.blocks)
        self.end: list[int | None] = [None] * len(self.blocks)
        self.start: dict[int, int] = {}
        self.clock, self.batch, self.recorded = 0, 0, 0
        self._recording = [b.register_forward_hook(self._finished(k)) for k, b in enumerate(self.blocks)]
        self._recording += [m.register_forward_pre_hook(self._started) for u in units for _, m in u.members]
        hooks.extend(self._recording)
        self._hooks = hooks

    def _started(self, module, args):
        self.clock += 1
        if self.batch == 0:
            self.start.setdefault(id(module), self.clock)

    def _finished(self, k: int):
        def hook(module, args, out):
            self.clock += 1
            if self.batch == 0:
                self.calls[k] += 1
                self.end[k] = self.clock
            self.outputs[k].append(_detached(out))

        return hook

    def next_batch(self) -> None:
        self.recorded += 1
        self.batch = self.recorded

    def stop(self) -> None:
        """Stop recording (after the unquantized pass)."""
        for h in self._recording:
            h.remove()
            self._hooks.remove(h)
        self._recording = []

    def skippable(self, unit: _Unit) -> list[int]:
        first = min(self.start.get(id(m), math.inf) for _, m in unit.members)
        return [k for k, end in enumerate(self.end)
                if end is not None and end < first and self.calls[k] == 1 and len(self.outputs[k]) == self.recorded
                and all(o is not None for o in self.outputs[k])]  # fmt: skip

    @contextmanager
    def replaying(self, blocks: list[int]):
        saved = [(self.blocks[k], self.blocks[k].__dict__.get("forward")) for k in blocks]
        try:
            for k in blocks:
                self.blocks[k].forward = self._replay(k)
            yield
        finally:
            for block, forward in saved:
                if forward is None:
                    del block.forward
                else:
                    block.forward = forward

    def _replay(self, k: int):
        def forward(*args, **kwargs):
            return _cloned(self.outputs[k][self.batch])

        return forward


def _detached(out):
    """A detached copy of a tensor or a tuple of tensors (None for anything else)."""
    if torch.is_tensor(out):
        return out.detach().clone()
    if isinstance(out, tuple) and all(torch.is_tensor(o) or o is None for o in out):
        return tuple(None if o is None else o.detach().clone() for o in out)
    return None


def _cloned(out):
    return out.clone() if torch.is_tensor(out) else tuple(None if o is None else o.clone() for o in out)


class _Tracker:
    def __init__(self, progress: Progress | None, total: int):
        self.progress, self.total, self.done = progress, total, 0

    def step(self, description: str) -> None:
        self.done += 1
        if self.progress is not None:
            self.progress(self.done, self.total, description)


# ------------------------------------------------------------------------------------ scan


def scan(
    model: nn.Module,
    batches: Iterable[Mapping],
    formats: Sequence[str] = DEFAULT_FORMATS,
    method: str = "auto",
    *,
    progress: Progress | None = None,
    seed: int = 0,
    measure_top_fraction: float = 0.05,
    layers: Sequence[str] | None = None,
    max_batch_tokens: int = 2048,
    fp8_backend: str = "auto",
) -> ScanResult:
    """Score every eligible layer of ``model`` for every format in ``formats``.

    Args:
        batches: dicts with ``input_ids`` ``[B, T]``, optional ``attention_mask``, and ``labels``
            (causal LM: ``labels=input_ids``; token classification ``[B, T]``; sequence
            classification ``[B]``; ``-100`` ignored). Consumed once.
        formats: low-precision formats to score (``bf16`` — keeping the layer — is always the baseline).
        method: ``auto``, ``measured`` or ``fisher`` (see the module docstring).
        progress: ``progress(done, total, description)`` after each step.
        seed: seeds a forked RNG for the scan (the global RNG is left as it was).
        measure_top_fraction: ``auto`` only: fraction of (layer, format) pairs measured after the
            Fisher pass, those with the highest predicted Δloss per byte saved.
        layers: names or globs of the layers to scan (default: every eligible layer).
        max_batch_tokens: consecutive batches of one shape run as one forward up to this many
            tokens (FP8 tensorwise activation scales then span the merged batch).
        fp8_backend: passed to the FP8 layers (as in :func:`hf_lowprec.convert.apply_plan`).

    The model is left exactly as it was (modules, parameters, gradients, train/eval mode), also when
    interrupted. Raises ``ValueError`` for a model without eligible layers, an already converted
    model, or batches without labels.
    """
    if method not in METHODS:
        raise ValueError(f"unknown scan method {method!r}; choose one of {', '.join(METHODS)}")
    if max_batch_tokens < 1:
        raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
    if not 0.0 <= measure_top_fraction <= 1.0:
        raise ValueError(f"measure_top_fraction must be in [0, 1], got {measure_top_fraction}")
    specs = [FormatSpec.parse(f) for f in formats]
    if not specs:
        raise ValueError("scan needs at least one format, e.g. formats=('fp8', 'int4-g64')")
    for s in specs:
        if s.is_high_precision:
            raise ValueError(f"format {s.name!r} is high precision: scan low-precision formats (fp8, int4-g64, ...); {KEEP} is always the baseline")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"formats contain duplicates: {names}")
    units = _units(model, specs)
    if layers is not None:
        units = _select(units, [layers] if isinstance(layers, str) else layers)
    batches = _merge(_check_batches(batches), max_batch_tokens)
    tokens = sum(_label_count(model, b) for b in batches)
    if tokens == 0:
        raise ValueError("the calibration batches have no labelled positions (all labels are -100, or causal-LM sequences of length 1)")
    device = next(model.parameters()).device
    scores = [LayerScore(u.name, tuple(n for n, _ in u.members[1:]), type(u.members[0][1]).__name__,
                         u.members[0][1].weight.numel(), _layer_bytes(u)) for u in units]  # fmt: skip
    result = ScanResult(scores, tuple(names), method, tokens=tokens, seed=seed, model=getattr(getattr(model, "config", None), "name_or_path", None) or None)
    start = time.perf_counter()
    with _scanning(model, seed) as hooks:
        if method == "measured":
            pairs = [(i, f) for i, u in enumerate(units) for f in u.formats]
            tracker = _Tracker(progress, len(batches) + len(pairs))
            replay = _BlockReplay(model, units, hooks)
            base = _base_pass(model, batches, device, tracker, replay)
            result.base_loss = base[0]
            _measure(model, batches, device, units, pairs, scores, base, hooks, tracker, fp8_backend, replay)
        else:
            measure = method == "auto" and measure_top_fraction > 0
            tracker = _Tracker(progress, len(batches))
            replay = _BlockReplay(model, units, hooks) if measure else None
            base = _fisher_pass(model, batches, device, units, scores, hooks, tracker, fp8_backend, replay)
            result.base_loss = base[0]
            result.seconds["fisher"] = time.perf_counter() - start
            if measure:
                pairs = _boundary_pairs(units, scores, measure_top_fraction)
                tracker.total += len(pairs)
                _measure(model, batches, device, units, pairs, scores, base, hooks, tracker, fp8_backend, replay)
    result.seconds["total"] = time.perf_counter() - start
    if method != "fisher":
        result.seconds["measured"] = result.seconds["total"] - result.seconds.get("fisher", 0.0)
    return result


@torch.no_grad()
def _base_pass(model, batches, device, tracker, replay: "_BlockReplay | None" = None) -> tuple[float, list[torch.Tensor]]:
    """Mean loss of the unquantized model and its log-probabilities per batch (for KL)."""
    nll, logps = 0.0, []
    for i, batch in enumerate(batches):
        logits, labels = _forward(model, batch, device)
        logp = torch.log_softmax(logits, -1)
        nll -= logp.gather(1, labels[:, None]).sum().item()
        logps.append(logp)
        if replay is not None:
            replay.next_batch()
        tracker.step(f"unquantized pass, batch {i + 1}/{len(batches)}")
    if replay is not None:
        replay.stop()
    return nll / sum(len(lp) for lp in logps), logps


def _fisher_pass(model, batches, device, units, scores, hooks, tracker, fp8_backend, replay: "_BlockReplay | None"):
    """One forward/backward per batch: output-space Taylor estimate for every (unit, format).

    The forward records each layer's input and output; after the backward (activation gradients
    only), each low-precision twin runs on the recorded input to give ``δy``, one layer at a time.
    """
    twins: dict[int, list[tuple[tuple[str, str], nn.Module]]] = {}
    for u in units:
        for f in u.formats:
            for _, module, twin in _twins(u, f, fp8_backend):
                twins.setdefault(id(module), []).append(((u.name, f), twin))
    first = {(u.name, f): 0.0 for u in units for f in u.formats}
    second = dict(first)
    record: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    def hook(module, args, out):
        if not out.requires_grad:  # frozen weights: make the output a leaf so gradients reach it
            out = out.detach().requires_grad_(True)
        record.append((id(module), args[0].detach(), out))
        return out

    for u in units:
        for _, module in u.members:
            hooks.append(module.register_forward_hook(hook))
    nll, logps, count = 0.0, [], 0
    for i, batch in enumerate(batches):
        record.clear()
        with torch.enable_grad():
            logits, labels = _forward(model, batch, device)
            loss_sum = F.cross_entropy(logits, labels, reduction="sum")
            grads = list(torch.autograd.grad(loss_sum, [out for _, _, out in record], allow_unused=True))
        nll += loss_sum.item()
        count += len(labels)
        if replay is not None:  # needed only for the measured passes that follow
            logps.append(torch.log_softmax(logits.detach(), -1))
            replay.next_batch()
        del logits, loss_sum
        with torch.no_grad():
            for j, (module_id, x, out) in enumerate(record):
                g = grads[j]
                grads[j] = None  # free as we go
                if g is None:
                    continue
                g = g.float().flatten()
                for key, twin in twins[module_id]:
                    gd = twin(x).float().flatten().sub_(out.detach().float().flatten()).mul_(g)  # g * δy
                    first[key] += gd.sum().item()
                    second[key] += 0.5 * torch.dot(gd, gd).item()
        record.clear()
        tracker.step(f"fisher pass, batch {i + 1}/{len(batches)}")
    if replay is not None:
        replay.stop()
    for h in hooks:
        h.remove()
    hooks.clear()
    for u, s in zip(units, scores):
        for f in u.formats:
            s.first_order[f] = first[u.name, f] / count
            s.second_order[f] = second[u.name, f] / count
            s.predicted[f] = s.first_order[f] + s.second_order[f]
    return nll / count, logps


def _boundary_pairs(units, scores, fraction: float) -> list[tuple[int, str]]:
    """The top ``fraction`` of (unit, format) pairs by predicted Δloss per byte saved, in model order.

    These are the choices a budget keeps out of low precision first, so the ones whose estimate
    matters most; they are also the largest perturbations, where a Taylor estimate is least reliable.
    """
    pairs = [(i, f) for i, u in enumerate(units) for f in u.formats]
    n = math.ceil(fraction * len(pairs))

    def per_byte(pair):
        s = scores[pair[0]]
        return s.predicted[pair[1]] / max(s.bytes[KEEP] - s.bytes[pair[1]], 1.0)

    top = set(sorted(pairs, key=per_byte, reverse=True)[:n])
    return [pair for pair in pairs if pair in top]


@torch.no_grad()
def _measure(model, batches, device, units, pairs, scores, base, hooks, tracker, fp8_backend, replay: _BlockReplay):
    """Measured Δloss and KL for each (unit index, format) in ``pairs``, one at a time."""
    base_loss, base_logps = base
    for i, fmt in pairs:
        unit, s = units[i], scores[i]
        handles = [module.register_forward_hook(_replace_output(twin)) for _, module, twin in _twins(unit, fmt, fp8_backend)]
        hooks.extend(handles)
        try:
            with replay.replaying(replay.skippable(unit)):
                nll, kl, count = _loss_and_kl(model, batches, device, base_logps, replay)
        finally:
            for h in handles:
                h.remove()
                hooks.remove(h)
        s.measured[fmt] = nll / count - base_loss
        s.kl[fmt] = kl / count
        tracker.step(f"measured {unit.name} in {fmt}")


def _loss_and_kl(model, batches, device, base_logps, replay: "_BlockReplay | None" = None) -> tuple[float, float, int]:
    """Summed next-token loss, summed KL(base ‖ model) and token count over ``batches``."""
    nll, kl, count = 0.0, 0.0, 0
    for b, (batch, base_logp) in enumerate(zip(batches, base_logps)):
        if replay is not None:
            replay.batch = b
        logits, labels = _forward(model, batch, device)
        logp = torch.log_softmax(logits, -1)
        nll -= logp.gather(1, labels[:, None]).sum().item()
        kl += F.kl_div(logp, base_logp, reduction="sum", log_target=True).item()
        count += len(labels)
    return nll, kl, count


def _replace_output(twin: nn.Module):
    def hook(module, args, out):
        return twin(args[0])

    return hook


def measure_plan(model: nn.Module, plan: "PrecisionPlan | Mapping", batches: Iterable[Mapping], *, fp8_backend: str = "auto") -> dict:
    """Measure a whole plan's Δloss and KL on ``batches`` (held-out data), leaving ``model`` as it was.

    Every layer runs through the low-precision layer :func:`~hf_lowprec.convert.apply_plan` would
    install for its planned format. Returns ``base_loss``, ``plan_loss``, ``delta_loss``, ``kl``
    (nats/token) and ``tokens``.
    """
    plan = plan if isinstance(plan, PrecisionPlan) else PrecisionPlan.from_dict(plan)
    plan.validate(model)
    batches = _check_batches(batches)  # one forward per batch, as training would run them
    device = next(model.parameters()).device
    assignment = plan.assign(model)
    layers = eligible_layers(model)
    converted = [n for n, m in layers.items() if isinstance(m, LOW_PRECISION_TYPES)]
    if converted:
        raise ValueError(f"measure_plan needs an unconverted model ({converted[0]!r} is already low precision); call hf_lowprec.revert(model) first")
    shared: dict[int, tuple[str, object]] = {}
    with _scanning(model, 0) as hooks, torch.no_grad():
        base_loss, base_logps = _base_pass(model, batches, device, _Tracker(None, 0))
        for name, module in layers.items():
            spec = assignment[name]
            if spec.is_high_precision:
                continue
            twin_of = shared.get(id(module.weight))
            if twin_of is not None and spec.family != "fp8" and twin_of[0] != spec.name:
                raise ValueError(f"layers sharing one weight need one integer format: {name!r} is planned {spec.name} but its tied twin is {twin_of[0]}")
            twin = low_precision_layer(module, spec, {"fp8_backend": fp8_backend, "learn_scales": False}, None if twin_of is None else twin_of[1])
            if twin_of is None and hasattr(twin, "weight_quantizer"):
                shared[id(module.weight)] = (spec.name, twin.weight_quantizer)
            hooks.append(module.register_forward_hook(_replace_output(twin)))
        nll, kl, count = _loss_and_kl(model, batches, device, base_logps)
    plan_loss = nll / count
    return {"base_loss": base_loss, "plan_loss": plan_loss, "delta_loss": plan_loss - base_loss, "kl": kl / count, "tokens": count}


# ------------------------------------------------------------------------------------ allocation


@dataclass(frozen=True)
class Budget:
    """What an allocation must respect (give at least one).

    Attributes:
        max_loss_increase: predicted Δloss of the whole plan (sum over layers), nats/token.
        target_bits_per_param: mean stored bits per eligible weight, scales included (a layer kept
            as it is counts its own dtype: 32 for fp32, 16 for bf16).
        min_fp8_fraction: at least this fraction of eligible parameters in FP8 or lower precision.
        int4_fraction: at most this fraction of eligible parameters in 4-bit formats (0 forbids INT4).

    With ``target_bits_per_param`` or ``min_fp8_fraction`` the allocator minimizes the predicted
    Δloss; otherwise it minimizes memory within ``max_loss_increase`` and ``int4_fraction``.
    """

    max_loss_increase: float | None = None
    target_bits_per_param: float | None = None
    min_fp8_fraction: float | None = None
    int4_fraction: float | None = None

    def __post_init__(self):
        values = asdict(self)
        if all(v is None for v in values.values()):
            raise ValueError(f"a Budget needs at least one of {', '.join(values)}")
        for key, v in values.items():
            if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)):
                raise ValueError(f"budget {key} must be a finite number, got {v!r}")
        if self.max_loss_increase is not None and self.max_loss_increase < 0:
            raise ValueError(f"budget max_loss_increase must be >= 0 (nats/token), got {self.max_loss_increase}")
        if self.target_bits_per_param is not None and self.target_bits_per_param <= 0:
            raise ValueError(f"budget target_bits_per_param must be > 0, got {self.target_bits_per_param}")
        for key in ("min_fp8_fraction", "int4_fraction"):
            v = values[key]
            if v is not None and not 0.0 <= v <= 1.0:
                raise ValueError(f"budget {key} must be a fraction in [0, 1], got {v}")

    @property
    def minimizes_loss(self) -> bool:
        return self.target_bits_per_param is not None or self.min_fp8_fraction is not None


@dataclass
class _Problem:
    """The multiple-choice knapsack: one row per (unit, choice)."""

    unit: np.ndarray  # unit index per row
    choice: list[str]
    loss: np.ndarray  # Δloss >= 0
    nbytes: np.ndarray
    params: np.ndarray  # unit params on every row
    low: np.ndarray  # 1 if the choice is low precision
    four_bit: np.ndarray  # 1 if the choice is a 4-bit format
    fixed: np.ndarray  # rows forbidden by keep/force
    n_units: int
    total_params: float


def _problem(result: ScanResult, keep: Sequence[str], force: Mapping[str, str]) -> _Problem:
    units = [u for u in result.layers]
    if not units:
        raise ValueError("the scan has no layers to allocate (the model had no eligible nn.Linear / nn.Embedding layers)")
    all_names = [n for u in units for n in u.names]
    rules: dict[int, str] = {}

    def match(pattern: str, what: str) -> list[int]:
        hits = [i for i, u in enumerate(units) if any(fnmatch.fnmatchcase(n, pattern) for n in u.names)]
        if not hits and any(c in pattern for c in "*?["):  # e.g. "*norm*": norms are never quantized anyway
            logger.warning("%s pattern %r matches no scanned layer (only nn.Linear / nn.Embedding are scanned)", what, pattern)
        elif not hits:
            close = difflib.get_close_matches(pattern, all_names, n=3, cutoff=0.6)
            hint = f"; close matches: {', '.join(close)}" if close else f" (e.g. {all_names[0]!r})"
            raise ValueError(f"{what} entry {pattern!r} is not a scanned layer{hint}")
        return hits

    for pattern in keep:
        for i in match(pattern, "keep"):
            rules[i] = KEEP
    for pattern, fmt in (force or {}).items():
        spec = FormatSpec.parse(fmt)
        name = KEEP if spec.is_high_precision else spec.name
        for i in match(pattern, "force"):
            if name != KEEP and name not in units[i].bytes:
                allowed = ", ".join([KEEP, *units[i].formats])
                raise ValueError(f"force entry {pattern!r}: format {name!r} was not scanned for {units[i].name!r}; choose one of {allowed}")
            if rules.get(i, name) != name:
                raise ValueError(f"layer {units[i].name!r} (with its tied twins {list(units[i].tied)}) gets both {rules[i]} and {name} from keep/force")
            rules[i] = name
    rows = [(i, c) for i, u in enumerate(units) for c in [KEEP, *u.formats]]
    negative = sum(1 for i, c in rows if units[i].score(c) < 0)
    if negative:
        logger.info("%d (layer, format) scores are negative (quantizing lowered the calibration loss); counted as 0", negative)
    return _Problem(
        unit=np.array([i for i, _ in rows]),
        choice=[c for _, c in rows],
        loss=np.array([max(units[i].score(c), 0.0) for i, c in rows]),
        nbytes=np.array([units[i].bytes[c] for i, c in rows]),
        params=np.array([float(units[i].params) for i, _ in rows]),
        low=np.array([0.0 if c == KEEP else 1.0 for _, c in rows]),
        four_bit=np.array([1.0 if c != KEEP and FormatSpec.parse(c).bits <= 4 else 0.0 for _, c in rows]),
        fixed=np.array([i in rules and rules[i] != c for i, c in rows]),
        n_units=len(units),
        total_params=float(sum(u.params for u in units)),
    )


_CONSTRAINTS = ("max_loss_increase", "target_bits_per_param", "min_fp8_fraction", "int4_fraction")


def _limits(p: _Problem, budget: Budget, skip: str | None = None) -> list[tuple[np.ndarray, float, float]]:
    """Linear constraints ``lo <= a·x <= hi`` for the budget (leaving out ``skip``)."""
    total = p.total_params
    out = []
    if budget.max_loss_increase is not None and skip != "max_loss_increase":
        out.append((p.loss, -np.inf, budget.max_loss_increase))
    if budget.target_bits_per_param is not None and skip != "target_bits_per_param":
        out.append((p.nbytes * 8 / total, -np.inf, budget.target_bits_per_param))
    if budget.min_fp8_fraction is not None and skip != "min_fp8_fraction":
        out.append((p.low * p.params / total, budget.min_fp8_fraction - 1e-12, np.inf))
    if budget.int4_fraction is not None and skip != "int4_fraction":
        out.append((p.four_bit * p.params / total, -np.inf, budget.int4_fraction + 1e-12))
    return out


def _solve_ilp(p: _Problem, objective: np.ndarray, limits, tiebreak: np.ndarray | None = None) -> np.ndarray | None:
    """Exact 0/1 solution (HiGHS branch and bound via scipy) minimizing ``objective``; None if infeasible.

    An ILP rather than a DP: the budget can constrain loss, memory and two fractions at once, which a
    one-dimensional knapsack DP cannot express.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp

    n = len(p.unit)
    onehot = np.zeros((p.n_units, n))
    onehot[p.unit, np.arange(n)] = 1.0
    constraints = [LinearConstraint(onehot, 1.0, 1.0)]
    constraints += [LinearConstraint(a[None, :], lo, hi) for a, lo, hi in limits]
    bounds = Bounds(np.zeros(n), np.where(p.fixed, 0.0, 1.0))
    options = {"time_limit": 60.0, "mip_rel_gap": 1e-9}
    scale = max(np.abs(objective).max(), 1e-30)
    res = milp(objective / scale, integrality=np.ones(n), bounds=bounds, constraints=constraints, options=options)
    if res.x is None:
        return None
    if res.status != 0:
        logger.warning("allocation ILP stopped before proving optimality (%s); using its best solution", res.message)
    x = np.round(res.x)
    if tiebreak is not None:  # among optimal solutions, the best by the second criterion
        best = float(objective @ x)
        tol = 1e-9 * max(abs(best), 1e-12) + 1e-15
        res2 = milp(tiebreak / max(np.abs(tiebreak).max(), 1e-30), integrality=np.ones(n), bounds=bounds,
                    constraints=[*constraints, LinearConstraint(objective[None, :], -np.inf, best + tol)], options=options)  # fmt: skip
        if res2.x is not None:
            x = np.round(res2.x)
    return x


def _solve_greedy(p: _Problem, budget: Budget) -> np.ndarray:
    """Greedy for problems too large for the ILP: start from each unit's lowest-Δloss choice, then
    repeatedly take the feasible move with the least Δloss per byte saved."""
    total = p.total_params
    allowed = ~p.fixed
    state = np.zeros(p.n_units, dtype=int)
    for u in range(p.n_units):
        rows = np.flatnonzero((p.unit == u) & allowed)
        state[u] = rows[np.lexsort((p.nbytes[rows], p.loss[rows]))[0]]
    loss_cap = math.inf if budget.minimizes_loss or budget.max_loss_increase is None else budget.max_loss_increase
    int4_cap = math.inf if budget.int4_fraction is None else budget.int4_fraction * total + 1e-9
    while True:
        cur = state[p.unit]
        t = _totals(p, np.bincount(state, minlength=len(p.unit)).astype(float))
        if budget.minimizes_loss and not _violations_of(t, budget, ("target_bits_per_param", "min_fp8_fraction")):
            break
        saved = p.nbytes[cur] - p.nbytes
        ok = allowed & (saved > 0)
        ok &= t["max_loss_increase"] + p.loss - p.loss[cur] <= loss_cap
        ok &= t["int4_fraction"] * total + (p.four_bit - p.four_bit[cur]) * p.params <= int4_cap
        if not ok.any():
            break
        slope = np.where(ok, (p.loss - p.loss[cur]) / np.where(ok, saved, 1.0), np.inf)
        j = int(np.argmin(slope))
        state[p.unit[j]] = j
    x = np.zeros(len(p.unit))
    x[state] = 1.0
    return x


def _totals(p: _Problem, x: np.ndarray) -> dict:
    total = p.total_params
    return {
        "max_loss_increase": float(p.loss @ x),
        "target_bits_per_param": float(p.nbytes @ x) * 8 / total,
        "min_fp8_fraction": float((p.low * p.params) @ x) / total,
        "int4_fraction": float((p.four_bit * p.params) @ x) / total,
    }


def _violations(p: _Problem, x: np.ndarray, budget: Budget) -> list[str]:
    return _violations_of(_totals(p, x), budget, _CONSTRAINTS)


def _violations_of(t: dict, budget: Budget, keys: Sequence[str]) -> list[str]:
    """The budget constraints among ``keys`` that the totals ``t`` break."""
    tol = 1e-9
    bad = []
    if budget.max_loss_increase is not None and t["max_loss_increase"] > budget.max_loss_increase + tol:
        bad.append("max_loss_increase")
    if budget.target_bits_per_param is not None and t["target_bits_per_param"] > budget.target_bits_per_param + tol:
        bad.append("target_bits_per_param")
    if budget.min_fp8_fraction is not None and t["min_fp8_fraction"] < budget.min_fp8_fraction - tol:
        bad.append("min_fp8_fraction")
    if budget.int4_fraction is not None and t["int4_fraction"] > budget.int4_fraction + tol:
        bad.append("int4_fraction")
    return [k for k in bad if k in keys]


_BEST = {  # how to optimize one budget quantity alone: (objective row, sign, wording)
    "max_loss_increase": (lambda p: p.loss, 1, "lowest predicted Δloss reachable"),
    "target_bits_per_param": (lambda p: p.nbytes * 8 / p.total_params, 1, "fewest bits per parameter reachable"),
    "min_fp8_fraction": (lambda p: p.low * p.params / p.total_params, -1, "largest FP8-or-lower fraction reachable"),
    "int4_fraction": (lambda p: p.four_bit * p.params / p.total_params, 1, "smallest INT4 fraction reachable"),
}


def _unmeetable(p: _Problem, budget: Budget, failed: list[str]) -> ValueError:
    """The error for a budget that cannot be met, naming the best reachable value of a failing constraint."""
    given = {k: v for k, v in asdict(budget).items() if v is not None}
    for key in failed or list(given):
        row, sign, wording = _BEST[key]
        x = _solve_ilp(p, sign * row(p), _limits(p, budget, skip=key))
        if x is None:
            continue
        others = ", ".join(f"{k}={v:g}" for k, v in given.items() if k != key)
        return ValueError(
            f"budget {key}={given[key]:g} cannot be met: the {wording}{' with ' + others if others else ''} "
            f"(and keep/force) is {float(row(p) @ x):.6g}"
        )
    return ValueError(f"budget {given} cannot be met by any combination of the scanned formats with keep/force")


def predict_plan(result: ScanResult, plan: "PrecisionPlan | Mapping") -> dict:
    """Predicted Δloss (sum of per-layer scores, negatives as 0), bits per parameter and format
    fractions of any ``plan`` over the scanned layers (e.g. a hand-written one, to compare with
    :func:`allocate`'s). Raises ``ValueError`` if the plan gives tied layers different formats or
    a format the scan did not score."""
    plan = plan if isinstance(plan, PrecisionPlan) else PrecisionPlan.from_dict(plan)
    total = sum(u.params for u in result.layers) or 1
    loss = nbytes = 0.0
    fractions: dict[str, float] = {}
    for u in result.layers:
        # the unit's first layer has kind u.kind; tied twins are output heads (Linear)
        specs = {plan.resolve(n, _AN_EMBEDDING if (n == u.name and u.kind == "Embedding") else None) for n in u.names}
        names = {KEEP if s.is_high_precision else s.name for s in specs}
        if len(names) > 1:
            raise ValueError(f"plan gives the tied layers {list(u.names)} different formats {sorted(names)}; the scan scored them as one unit")
        fmt = names.pop()
        if fmt not in u.bytes:
            raise ValueError(f"plan puts {u.name!r} in {fmt}, which the scan did not score; scanned: {', '.join(result.formats)}")
        loss += max(u.score(fmt), 0.0)
        nbytes += u.bytes[fmt]
        fractions[fmt] = fractions.get(fmt, 0.0) + u.params / total
    return {"predicted_delta_loss": loss, "bits_per_param": nbytes * 8 / total, "fractions": fractions}


def allocate(
    result: ScanResult,
    budget: Budget | None = None,
    *,
    keep: Sequence[str] = (),
    force: Mapping[str, str] | None = None,
    solver: str = "auto",
    **budget_kwargs,
) -> PrecisionPlan:
    """Choose a format per layer under ``budget``; returns a plan naming every scanned layer.

    Args:
        result: a :class:`ScanResult`; each choice costs its measured Δloss if measured, else its
            prediction (negative values count as 0).
        budget: a :class:`Budget`, or its fields as keyword arguments. Neither: Δloss ≤ 1% of the
            calibration loss.
        keep: names or globs of layers to leave as they are (a tied twin follows its unit); an
            exact name that is no scanned layer raises, a glob that matches none is logged.
        force: ``{name or glob: format}`` fixing a layer's format (a scanned format or ``bf16``).
        solver: ``auto`` (exact ILP up to 20,000 choices, greedy beyond), ``ilp`` or ``greedy``.

    Records the plan and a summary (predicted Δloss, bits per parameter, fractions) on ``result``.
    Raises ``ValueError`` naming the best reachable value when the budget cannot be met.
    """
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    if isinstance(keep, str):
        keep = (keep,)
    if budget is not None and budget_kwargs:
        raise ValueError("pass either a Budget or budget keyword arguments, not both")
    if budget is None:
        if budget_kwargs:
            unknown = sorted(set(budget_kwargs) - set(_CONSTRAINTS))
            if unknown:
                raise ValueError(f"unknown budget argument(s) {unknown}; choose from {', '.join(_CONSTRAINTS)}")
            budget = Budget(**budget_kwargs)
        else:
            if not math.isfinite(result.base_loss):
                raise ValueError("the scan has no calibration loss to derive a default budget from; pass a budget")
            budget = Budget(max_loss_increase=DEFAULT_RELATIVE_LOSS_INCREASE * result.base_loss)
            logger.info("no budget given: max_loss_increase = %.4g (1%% of the calibration loss)", budget.max_loss_increase)
    p = _problem(result, keep, force or {})
    use_ilp = solver == "ilp" or (solver == "auto" and len(p.unit) <= ILP_MAX_VARIABLES)
    if use_ilp:
        primary, second = (p.loss, p.nbytes) if budget.minimizes_loss else (p.nbytes, p.loss)
        x = _solve_ilp(p, primary, _limits(p, budget), tiebreak=second)
        if x is None:
            raise _unmeetable(p, budget, [])
    else:
        x = _solve_greedy(p, budget)
    failed = _violations(p, x, budget)
    if failed:
        raise _unmeetable(p, budget, failed)
    chosen = {int(p.unit[j]): p.choice[j] for j in np.flatnonzero(x > 0.5)}
    layers = {}
    for i, unit in enumerate(result.layers):
        for name in unit.names:
            layers[name] = chosen[i]
    plan = PrecisionPlan(layers, default=KEEP, model=result.model)
    totals = _totals(p, x)
    fractions: dict[str, float] = {}
    for i, unit in enumerate(result.layers):
        fractions[chosen[i]] = fractions.get(chosen[i], 0.0) + unit.params / p.total_params
    result.plan = plan
    result.allocation = {
        "budget": {k: v for k, v in asdict(budget).items() if v is not None},
        "keep": list(keep), "force": dict(force or {}), "solver": "ilp" if use_ilp else "greedy",
        "predicted_delta_loss": totals["max_loss_increase"], "bits_per_param": totals["target_bits_per_param"],
        "fractions": fractions,
    }  # fmt: skip
    logger.info("allocated: predicted Δloss %.4g, %.2f bits/param, %s", totals["max_loss_increase"],
                totals["target_bits_per_param"], ", ".join(f"{k} {v:.1%}" for k, v in fractions.items()))  # fmt: skip
    return plan
