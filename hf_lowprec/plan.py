"""PrecisionPlan: which format each layer of a model trains in.

A plan is data: an ordered set of rules ``pattern → format`` and a default for the ``nn.Linear``
layers no rule names. A pattern is an exact module name (``model.layers.3.mlp.up_proj``), a glob
(``*.mlp.*``) or a regular expression (``re:.*\\.(q|k)_proj``). An exact name wins over patterns;
among patterns the first that matches wins. Embeddings change format only when a rule names them.

Module names are those of the unwrapped model: PEFT's ``base_model.model.`` prefix and
``.base_layer`` suffix are ignored, so one plan serves a model with or without LoRA adapters.

Plans load from and save to JSON or YAML::

    {"default": "fp8", "layers": {"lm_head": "bf16", "*.mlp.down_proj": "int4-g64"}}
"""

from __future__ import annotations

import difflib
import fnmatch
import json
import logging
import os
import re
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml
from torch import nn

from hf_lowprec.checkpoints import public_name
from hf_lowprec.folders import atomic_write_text
from hf_lowprec.formats import HIGH_PRECISION, FormatSpec
from hf_lowprec.layers import canonical_name, dense_views, matrix_parameters, unconverted_layers

logger = logging.getLogger(__name__)

PLAN_KEYS = ("default", "layers", "model")


def _is_pattern(key: str) -> bool:
    return key.startswith("re:") or any(c in key for c in "*?[")


PLAN_FILE = "hf_lowprec_plan.json"  # a plan's file name in checkpoints, run and export folders


@dataclass(frozen=True)
class PrecisionPlan:
    """Layer name (or pattern) → :class:`FormatSpec`.

    Attributes:
        layers: ordered rules, ``{pattern: format}``; values may be names such as ``"int4-g64"``.
        default: format of every ``nn.Linear`` no rule names (``bf16``: left as it is).
        model: optional name of the model the plan was made for (informational: ``validate`` warns when it applies
            the plan to a model of another name).
    """

    layers: Mapping[str, FormatSpec] = field(default_factory=dict)
    default: FormatSpec = FormatSpec.parse("bf16")
    model: str | None = None

    def __post_init__(self):
        parsed = {}
        for key, fmt in dict(self.layers).items():
            if not isinstance(key, str) or not key:
                raise ValueError(f"plan entry {key!r}: layer names must be non-empty strings")
            try:
                parsed[key] = FormatSpec.parse(fmt)
            except ValueError as e:
                raise ValueError(f"plan entry {key!r}: {e}") from None
            if key.startswith("re:"):
                try:
                    re.compile(key[3:])
                except re.error as e:
                    raise ValueError(f"plan entry {key!r}: invalid regular expression ({e})") from None
        object.__setattr__(self, "layers", parsed)
        try:
            object.__setattr__(self, "default", FormatSpec.parse(self.default))
        except ValueError as e:
            raise ValueError(f"plan default: {e}") from None

    # ----------------------------------------------------------------------------- construction
    @classmethod
    def uniform(cls, fmt: str | FormatSpec, keep: tuple[str, ...] = ()) -> "PrecisionPlan":
        """Every ``nn.Linear`` in ``fmt`` except the names/patterns in ``keep`` (left in high precision)."""
        return cls({k: "bf16" for k in keep}, default=fmt)

    @classmethod
    def from_dict(cls, data: Mapping, source: str = "") -> "PrecisionPlan":
        """Build from ``{"default": ..., "layers": {...}, "model": ...}``; ``source`` names the origin in errors."""
        where = f"{source}: " if source else ""
        if not isinstance(data, Mapping):
            raise ValueError(
                f"{where}a plan must be a mapping with keys {', '.join(PLAN_KEYS)}, got {type(data).__name__}"
            )
        unknown = sorted(set(data) - set(PLAN_KEYS))
        if unknown:
            example = '{"default": "fp8", "layers": {"lm_head": "bf16"}}'
            raise ValueError(
                f"{where}unknown plan key(s) {', '.join(map(repr, unknown))}; allowed keys are {', '.join(PLAN_KEYS)} "
                f"(layer rules go under 'layers', e.g. {example})"
            )
        layers = data.get("layers") or {}
        if not isinstance(layers, Mapping):
            raise ValueError(f"{where}'layers' must map layer names to formats, got {type(layers).__name__}")
        if not isinstance(data.get("model", ""), (str, type(None))):
            raise ValueError(f"{where}'model' must be the model's name or path (a string), got {data['model']!r}")
        try:
            return cls(dict(layers), default=data.get("default", "bf16"), model=data.get("model"))
        except ValueError as e:
            raise ValueError(f"{where}{e}") from None

    @classmethod
    def load(cls, path: str | os.PathLike) -> "PrecisionPlan":
        """Read a plan from a ``.json``, ``.yaml`` or ``.yml`` file."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"plan file {str(path)!r} does not exist")
        text = path.read_text()
        try:
            data = json.loads(text, object_pairs_hook=_unique_keys) if path.suffix == ".json" else read_yaml(text)
        except (ValueError, yaml.YAMLError) as e:  # json.JSONDecodeError is a ValueError
            first = describe_yaml_error(e) if isinstance(e, yaml.YAMLError) else str(e).splitlines()[0]
            raise ValueError(
                f"plan file {str(path)!r} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {first}"
            ) from None
        return cls.from_dict(data, source=f"plan file {str(path)!r}")

    def to_dict(self) -> dict:
        out = {"default": self.default.name, "layers": {k: v.name for k, v in self.layers.items()}}
        if self.model:
            out["model"] = self.model
        return out

    def brief(self, shown: int = 3) -> str:
        """The plan in one short line for messages: its default and its first ``shown`` rules."""
        rules = ", ".join(f"{k}: {v.name}" for k, v in list(self.layers.items())[:shown])
        more = f", and {len(self.layers) - shown} more" if len(self.layers) > shown else ""
        return f"(default {self.default.name}; rules {rules or 'none'}{more})"

    @property
    def smooths(self) -> bool:
        """Whether a rule gives a smoothed (``-sq``) format, whose layers calibrate on their first batch."""
        return any(spec.smooth for spec in (self.default, *self.layers.values()))

    def restricted_to(self, names: Iterable[str]) -> "PrecisionPlan":
        """This plan without the rules that name none of the layers ``names`` (exact names, patterns that match
        none of them): re-applied to a model whose other layers are no longer eligible (a tied embedding that reads
        its packed head's codes)."""
        names = list(names)
        def names_one(key: str) -> bool:
            return any(_matches(key, n) for n in names) if _is_pattern(key) else key in names

        return replace(self, layers={k: v for k, v in self.layers.items() if names_one(k)})

    def save(self, path: str | os.PathLike) -> Path:
        """Write JSON (``.json``) or YAML (anything else) atomically; returns the path."""
        path = Path(path)
        data = self.to_dict()
        text = json.dumps(data, indent=2) + "\n" if path.suffix == ".json" else yaml.safe_dump(data, sort_keys=False)
        atomic_write_text(path, text)
        return path

    # ------------------------------------------------------------------------------- resolution
    def resolve(self, name: str, module: nn.Module | None = None) -> FormatSpec:
        """The format of the layer ``name`` (an ``nn.Embedding`` no rule names stays high precision)."""
        if name in self.layers:
            return self.layers[name]
        for key, spec in self.layers.items():
            if _is_pattern(key) and _matches(key, name):
                return spec
        if isinstance(module, nn.Embedding):
            return FormatSpec.parse("bf16")
        return self.default

    def assign(self, layers: "Mapping[str, nn.Module] | nn.Module") -> dict[str, FormatSpec]:
        """``{name: format}`` for every eligible layer, after checking every rule names something.

        Raises ``ValueError`` for an exact name that is no eligible layer (listing close matches and
        why, e.g. a module that is not a Linear/Embedding) and for a pattern that matches nothing.
        """
        source = layers
        layers = _layers_of(layers)
        for key in self.layers:
            if _is_pattern(key):
                if not any(_matches(key, n) for n in layers):
                    raise ValueError(f"plan entry {key!r} matches no eligible layer (Linear/Embedding) of this model")
            else:
                check_layer_name(source, key, "plan entry", layers)
        return {n: self.resolve(n, m) for n, m in layers.items()}

    def validate(self, model: nn.Module) -> dict[str, FormatSpec]:
        """Raise ``ValueError`` if the plan does not fit ``model``, else return :meth:`assign`'s ``{name: format}``."""
        if not _layers_of(model):
            raise ValueError(f"{type(model).__name__} has no eligible layers (nn.Linear / nn.Embedding) to quantize")
        assigned = self.assign(model)
        specs = [self.default, *assigned.values()]  # a low-precision default also names the layers it cannot reach
        if isinstance(model, nn.Module) and any(not spec.is_high_precision for spec in specs):
            check_convertible(model)
        applied_to = getattr(getattr(model, "config", None), "name_or_path", None)
        if self.model and applied_to and Path(self.model).name != Path(public_name(applied_to)).name:
            made_for = self.model
            logger.warning("the plan was made for %r and is applied to %r (its layer names fit)", made_for, applied_to)
        return assigned

    # ---------------------------------------------------------------------------------- reports
    def summary(self, model: "nn.Module | Mapping[str, nn.Module]") -> list[dict]:
        """Per format: layers, parameters, bytes of weight storage, fraction of eligible parameters.

        A weight shared by several layers (tied embeddings) counts once, with the first layer that uses it; a frozen
        packed layer counts as the dense layer it was.
        """
        layers = _layers_of(model)
        rows: dict[str, dict] = {}
        seen = set()
        for name, spec in self.assign(layers).items():
            w = layers[name].weight
            row = rows.setdefault(spec.name, {"format": spec.name, "layers": 0, "params": 0, "bytes": 0.0})
            row["layers"] += 1
            if id(w) in seen:
                continue
            seen.add(id(w))
            n = w.numel()
            per = w.element_size() if spec.is_high_precision else spec.bytes_per_param(w.shape[-1])
            row["params"] += n
            row["bytes"] += n * per
        shares = format_shares((row["format"], row["params"]) for row in rows.values())
        for row in rows.values():
            row["fraction"] = shares[row["format"]]
            row["bytes"] = int(row["bytes"])
        return sorted(rows.values(), key=lambda r: -r["params"])

    def memory_estimate(self, model: "nn.Module | Mapping[str, nn.Module]") -> dict:
        """Weight bytes of the eligible layers: ``{"planned": ..., "unquantized": ..., "ratio": ...}``."""
        layers = _layers_of(model)
        before = sum(m.weight.numel() * m.weight.element_size() for m in layers.values())
        after = sum(r["bytes"] for r in self.summary(layers))
        return {"planned": after, "unquantized": before, "ratio": after / max(before, 1)}

    def format_summary(self, model: "nn.Module | Mapping[str, nn.Module]") -> str:
        """A plain-text table of :meth:`summary` (the CLI renders the same rows with rich)."""
        lines = [f"{'format':<16}{'layers':>8}{'params':>14}{'fraction':>10}{'MB':>10}"]
        for r in self.summary(model):
            lines.append(
                f"{r['format']:<16}{r['layers']:>8}{r['params']:>14,}{r['fraction']:>10.1%}{r['bytes'] / 1e6:>10.2f}"
            )
        return "\n".join(lines)


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader refusing a mapping key written twice (PyYAML keeps the last one silently: a recipe's
    second ``training:`` section would replace the first whole)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # "<<: *anchor": merged by PyYAML, its keys may repeat
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                problem = f"key {key!r} is written twice"
                raise yaml.constructor.ConstructorError(None, None, problem, key_node.start_mark)
            if isinstance(key, Hashable):  # an unhashable key: PyYAML's own error follows
                seen.add(key)
        return super().construct_mapping(node, deep)


def read_yaml(text: str):
    """``yaml.safe_load(text)``, refusing duplicate mapping keys (a ``yaml.YAMLError`` naming the line)."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """``json.loads``' ``object_pairs_hook`` refusing a key written twice (json keeps the last one silently)."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} is written twice")
        out[key] = value
    return out


def describe_yaml_error(e: yaml.YAMLError) -> str:
    """One line for a YAML parse error: where (1-based line and column) and what, e.g. ``line 1, column 26:
    expected ',' or ']', but got '<stream end>' (while parsing a flow sequence)``."""
    mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
    if mark is None or problem is None:
        return str(e).splitlines()[0]
    context = getattr(e, "context", None)
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" + (f" ({context})" if context else "")


def check_convertible(model: nn.Module) -> None:
    """``ValueError`` if ``model`` multiplies by weights hf-lowprec cannot convert (:func:`unconverted_layers`, e.g.
    GPT-2's ``Conv1D``): a low-precision plan or scan would leave them in their dtype while naming a format."""
    other = unconverted_layers(model)
    if not other:
        return
    kinds = "/".join(sorted({type(m).__name__ for m in other.values()}))
    theirs = {id(p): p.numel() for m in other.values() for p in matrix_parameters(m)}
    matrices = theirs | {id(m.weight): m.weight.numel() for m in _layers_of(model).values()}  # tied: once
    share = sum(theirs.values()) / sum(matrices.values())
    raise ValueError(
        f"{type(model).__name__} multiplies {share:.0%} of its matrix weights in {len(other)} {kinds} layers (e.g. "
        f"{next(iter(other))!r}), which hf-lowprec does not convert (it converts nn.Linear and nn.Embedding): they "
        "would train in their own dtype under a low-precision plan, so this architecture is not supported"
    )


def converts_nothing(plan: PrecisionPlan, model: nn.Module) -> ValueError:
    """The error of a ``plan`` that puts no layer of ``model`` in low precision."""
    return ValueError(f"the plan {plan.brief()} puts no layer of {type(model).__name__} in low precision")


def kept_label(fmt: str) -> str:
    """A format's name for people: ``kept`` for the high-precision ones (layers left as they are, in their own
    dtype, whatever the plan calls them), else the format."""
    return "kept" if fmt in HIGH_PRECISION else fmt


def row_label(row: Mapping) -> str:
    """A :meth:`PrecisionPlan.summary` row's name for people: its format, or for a high-precision row (layers left as
    they are) ``kept (<dtype>)``, the dtype its weights are stored in, which its bytes count."""
    if row["format"] not in HIGH_PRECISION or not row["params"]:
        return row["format"]
    stored = {2: "bf16", 4: "fp32"}.get(round(row["bytes"] / row["params"]), f"{row['bytes'] / row['params']:.1f} B")
    return f"kept ({stored})"


def format_shares(counts: Iterable[tuple[str, int]]) -> dict[str, float]:
    """Fraction of the total per format from ``(format, parameters)`` pairs (all 0 when the total is 0); the one
    count behind the plan summary, the conversion report and the training coverage."""
    counts = list(counts)
    total = sum(n for _, n in counts)
    out: dict[str, float] = {}
    for fmt, n in counts:
        out[fmt] = out.get(fmt, 0.0) + (n / total if total else 0.0)
    return out


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    return fnmatch.fnmatchcase(name, pattern)


def check_kept_names(model, keep: Iterable[str], what: str = "keep entry") -> None:
    """:func:`check_layer_name` for each name in ``keep`` that is no pattern (one matching no layer is only logged, by
    the allocator: ``*norm*`` keeps norms, which are never quantized anyway)."""
    layers = _layers_of(model)
    for key in keep:
        if not _is_pattern(key):
            check_layer_name(model, key, what, layers)


def check_layer_name(model, key: str, what: str, layers: Mapping[str, nn.Module] | None = None) -> None:
    """``ValueError`` naming ``what`` (``plan entry``, ``precision.keep entry``) unless ``key`` is an eligible layer of
    ``model`` (a module or ``{name: layer}``; ``layers``: its eligible layers, found already): what ``key`` names
    instead (a module of another kind), or the close matches, or how its layers are named (a plan made for another
    model)."""
    layers = _layers_of(model) if layers is None else layers
    if key in layers:
        return
    found = _find_module(model, key)
    if isinstance(found, nn.Embedding):  # a subclass computing more than a lookup (layers._is_eligible)
        raise ValueError(
            f"{what} {key!r} is a {type(found).__name__}, an embedding whose forward computes more than a lookup "
            "(positions, a norm): hf-lowprec leaves it as it is; only plain nn.Linear and nn.Embedding layers can "
            "change format"
        )
    if found is not None:
        raise ValueError(
            f"{what} {key!r} is a {type(found).__name__}; only nn.Linear and nn.Embedding layers can change format"
        )
    names = list(layers)
    close = difflib.get_close_matches(key, names, n=3, cutoff=0.6)
    examples = f"; its layers are named like {names[0]!r}, {names[len(names) // 2]!r}" if names else ""
    hint = f"; close matches: {', '.join(close)}" if close else examples
    raise ValueError(f"{what} {key!r} is not a layer of this model{hint}")


def _find_module(model, name: str) -> nn.Module | None:
    """The module called ``name`` (canonical name) in ``model``, if ``model`` is a module."""
    if not isinstance(model, nn.Module):
        return None
    return next((m for fqn, m in model.named_modules() if canonical_name(fqn) == name), None)


def _layers_of(model_or_layers) -> dict[str, nn.Module]:
    """``{name: layer}``; a model's frozen packed layers seen as the dense layers they were (:func:`dense_views`)."""
    if isinstance(model_or_layers, nn.Module):
        return dense_views(model_or_layers)
    return dict(model_or_layers)


AUTO = "auto"
"""The ``plan=`` value that asks for a sensitivity scan instead of naming a plan."""


def is_auto(plan) -> bool:
    """True for ``plan="auto"`` (scan + allocation), which each entry point resolves with its own data."""
    return isinstance(plan, str) and plan == AUTO


def names_a_format(plan) -> bool:
    """True for a ``plan=`` argument that is a format name (``"fp8"``, ``"int4-g64"``) or a :class:`FormatSpec`:
    every ``nn.Linear`` in that one format."""
    if isinstance(plan, FormatSpec):
        return True
    if not isinstance(plan, str):
        return False
    try:
        FormatSpec.parse(plan)
        return True
    except ValueError:
        return False


def plan_folder(plan) -> Path | None:
    """The folder a ``plan=`` argument names (a checkpoint or an export holding ``hf_lowprec_plan.json``), else
    ``None``. A format name is one even where the working folder holds a folder of that name (an earlier run's
    ``-o fp8``): that folder is ``./fp8``."""
    if not isinstance(plan, (str, os.PathLike)) or not str(plan) or not Path(plan).is_dir():  # '': no folder named
        return None
    return None if isinstance(plan, str) and names_a_format(plan) else Path(plan)


def resolve_plan(plan, keep: tuple[str, ...] = ()) -> PrecisionPlan:
    """The one reading of a ``plan=`` argument (``"auto"`` aside: callers check :func:`is_auto` first).

    A :class:`PrecisionPlan` as it is; a dict (``PrecisionPlan.to_dict`` layout); a ``.json``/``.yaml`` file; a folder
    holding ``hf_lowprec_plan.json`` (a checkpoint or an export); a format name: every ``nn.Linear`` in that format
    except ``keep`` (names or patterns left in high precision; for format names only).
    """
    is_path = isinstance(plan, (str, os.PathLike)) and any(sep in str(plan) for sep in "/" + os.sep)
    if is_path and not Path(plan).exists():  # no format name holds a slash
        raise ValueError(f"plan {str(plan)!r} does not exist (a plan .json/.yaml file, or a folder with {PLAN_FILE})")
    folder = plan_folder(plan)
    if (
        isinstance(plan, FormatSpec)
        or isinstance(plan, str)
        and Path(plan).suffix not in (".json", ".yaml", ".yml")
        and folder is None
    ):
        try:
            return PrecisionPlan.uniform(FormatSpec.parse(plan), keep=tuple(keep))
        except ValueError as e:
            raise ValueError(f"plan must be 'auto', a plan file or folder, or a format name: {e}") from None
    if keep:
        raise ValueError("keep= applies to a format-name plan or 'auto'; write kept layers into the plan itself")
    if isinstance(plan, PrecisionPlan):
        return plan
    if isinstance(plan, Mapping):
        return PrecisionPlan.from_dict(plan)
    if folder is not None:
        if not (folder / PLAN_FILE).is_file():
            raise ValueError(f"plan folder {str(plan)!r} holds no {PLAN_FILE}")
        return PrecisionPlan.load(folder / PLAN_FILE)
    if isinstance(plan, (str, os.PathLike)):
        return PrecisionPlan.load(Path(plan))
    raise ValueError(
        "plan must be a PrecisionPlan, a dict, a .json/.yaml path, a plan folder or a format name, got "
        f"{type(plan).__name__}"
    )
