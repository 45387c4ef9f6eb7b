"""Results of a sensitivity scan: one :class:`LayerScore` per unit (layers sharing one weight), gathered in a
:class:`ScanResult` that prints, saves and plots itself.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from hf_lowprec.folders import atomic_write_text
from hf_lowprec.plan import PrecisionPlan

KEEP = "bf16"
"""Label of the high-precision choice: the layer stays as it is (plans write it as ``bf16``)."""
CONVERSION, AFTER_TRAINING = "conversion", "after-training"
SCORES = (CONVERSION, AFTER_TRAINING)
"""What a choice's Δloss counts (:meth:`LayerScore.score`)."""

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

    def score(self, fmt: str, kind: str = CONVERSION) -> float:
        """Δloss of ``fmt`` (0 for ``bf16``), nats/token.

        ``conversion``: measured when available, else predicted: the model converted as it is (may be negative:
        quantizing moved the calibration loss down; :func:`allocate` counts that as 0).
        ``after-training``: without the first-order term ``gᵀδy``, measured minus it, else ``second_order``. Training
        moves the model to where the calibration gradient ``g`` vanishes, in any format, so that term is not the
        format's to pay or to keep: quantization noise that happens to point down the gradient (INT4 lowering the
        calibration loss of an instruct model on unseen text) is no lasting gain, its curvature cost is.
        """
        if fmt == KEEP:
            return 0.0
        if kind == CONVERSION:
            return self.measured[fmt] if fmt in self.measured else self.predicted[fmt]
        if fmt not in self.first_order:
            raise ValueError(
                f"score {AFTER_TRAINING!r} needs the scan's Taylor terms, which {self.name!r} has none of in {fmt}: "
                "scan with method 'auto' or 'fisher'"
            )
        return self.measured[fmt] - self.first_order[fmt] if fmt in self.measured else self.second_order[fmt]


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

    @property
    def score_kind(self) -> str:
        """The score the last allocation counted (``SCORES``; ``conversion`` before any): what tables show."""
        return (self.allocation or {}).get("budget", {}).get("score", CONVERSION)

    def ranking(self, fmt: str) -> list[str]:
        """Unit names, most sensitive to ``fmt`` first (by :meth:`LayerScore.score` of :attr:`score_kind`)."""
        units = [u for u in self.layers if fmt in u.bytes]
        return [u.name for u in sorted(units, key=lambda u: -u.score(fmt, self.score_kind))]

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
                row[f] = u.score(f, self.score_kind) if f in u.bytes else None
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
        lines.append(
            f"Δloss ({self.score_kind}) in nats/token over {self.tokens} tokens (base loss {self.base_loss:.4f}); "
            "* measured, else predicted; +t tied weights"
        )
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "formats": list(self.formats),
            "base_loss": self.base_loss,
            "tokens": self.tokens,
            "seed": self.seed,
            "seconds": self.seconds,
            "model": self.model,
            "layers": [{**asdict(u), "tied": list(u.tied)} for u in self.layers],
            "plan": None if self.plan is None else self.plan.to_dict(),
            "allocation": self.allocation,
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> "ScanResult":
        layers = [LayerScore(**{**u, "tied": tuple(u.get("tied", ()))}) for u in data["layers"]]
        plan = data.get("plan")
        return cls(
            layers,
            tuple(data["formats"]),
            data["method"],
            data.get("base_loss", float("nan")),
            data.get("tokens", 0),
            data.get("seed", 0),
            dict(data.get("seconds", {})),
            data.get("model"),
            None if plan is None else PrecisionPlan.from_dict(plan),
            data.get("allocation"),
        )

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
                    values[i, j] = u.score(f, self.score_kind)
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
        ax.set_yticks(
            range(len(self.layers)), [u.name + (" (tied)" if u.tied else "") for u in self.layers], fontsize=6
        )
        chosen = self.chosen()
        for i, u in enumerate(self.layers):
            for j, f in enumerate(fmts):
                if f in u.measured:
                    ax.plot(j + 0.3, i, "o", color="white", markeredgecolor="black", markersize=3)
                if chosen.get(u.name) == f:
                    ax.add_patch(
                        Rectangle((j - 0.45, i - 0.4), 0.9, 0.8, fill=False, edgecolor="deepskyblue", linewidth=1.5)
                    )
        ax.set_title(
            title or f"{self.model or 'model'}: per-layer Δloss ({self.method}, {self.score_kind}); dots measured, "
            "boxes chosen",
            fontsize=8,
        )
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp.png")
        fig.savefig(tmp, dpi=90, format="png")
        tmp.replace(path)
        return path
