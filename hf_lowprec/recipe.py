"""Recipes: named, schema-checked training configurations (``recipes/*.yaml``).

A recipe says how a run trains: the method (full fine-tuning through a precision plan, or an INT4
base with LoRA adapters), the precision plan or how to find one, the optimisation settings, the
LoRA settings, how data is read and how the result is exported. Built-in recipes ship in the
package ``hf_lowprec.recipes``; any YAML file with the same schema works too::

    name: fp8-train
    method: full
    precision: {plan: fp8, keep: [lm_head]}
    training: {max_steps: 200, learning_rate: 2.0e-5}

Every section is a frozen dataclass checked on construction: an unknown key, a wrong type or a
value outside its allowed set raises one ``ValueError`` naming the key, the file and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.resources.abc import Traversable
from pathlib import Path

import yaml

from hf_lowprec.allocator import RETURN_FREED_MEMORY
from hf_lowprec.assets import shipped_folder
from hf_lowprec.data import TRAIN_ON
from hf_lowprec.formats import EXAMPLE_NAMES, FormatSpec
from hf_lowprec.ondevice.calibration import ROUNDINGS
from hf_lowprec.ondevice.calibration.fp8 import FP8_ROUNDINGS
from hf_lowprec.ondevice.learned_steps import LEARN_STEPS
from hf_lowprec.plan import AUTO, PrecisionPlan, describe_yaml_error, plan_folder, read_yaml, resolve_plan
from hf_lowprec.sensitivity.allocate import budget_from
from hf_lowprec.sensitivity.results import CONVERSION, SCORES

logger = logging.getLogger(__name__)

METHODS = ("full", "int4-lora")
PLAN_SOURCES = ("auto",)  # besides a format name or a plan file path
SCAN_SETTINGS = ("formats", "budget", "score", "scan_method")  # the precision keys only plan 'auto' (a scan) reads
DTYPES = ("auto", "fp32", "bf16")  # auto: bf16 where this CPU runs bf16 GEMMs fast (measured), else fp32
ACTIVATION_STORAGE = ("none", "int8", "fp8", "fp8-e5m2")  # hf_lowprec.training.activations formats
SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")
# TrainingArguments.optim names: fp32 AdamW, or 8-bit states (torchao's; one C++ pass per step on CPUs with int4-lora)
OPTIMIZERS = ("adamw_torch", "adamw_torch_8bit")
LORA_INITS = ("default", "loftq")
EXPORT_WEIGHTS = ("master", "int4-packed", "auto")  # hf_lowprec.export.folder.export_model says what each writes

MIN_BLOCK_SIZE = 8  # tokens per training sequence (--block-size and training.block_size)


def _choices(*values) -> dict:
    return {"choices": values}


def _spelled(value) -> str:
    """``value`` as a recipe spells it (YAML's ``true``/``false``)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


@dataclass(frozen=True)
class PrecisionSection:
    """Which format each layer trains in.

    Attributes:
        plan: a format name for every eligible Linear (``fp8``, ``int4-g64``, ...), ``auto`` (sensitivity
            scan + budgeted allocation), or the path of a plan file (JSON/YAML) or of a folder holding one.
        keep: layer names/patterns left in high precision (format-name and ``auto`` plans; a plan file names its
            own). ``int4-lora`` keeps only the output head out of INT4, by size
            (:func:`hf_lowprec.ondevice.int4_plan`: per-channel int8 above 134M weights, else bf16); other kept
            layers there belong in a plan file.
        formats: candidate formats of the ``auto`` scan.
        budget: ``auto`` budget, passed to ``sensitivity.allocate`` (e.g. ``{target_bits_per_param: 6}``).
        score: which Δloss the ``auto`` budget counts: ``conversion`` or ``after-training`` (see
            ``sensitivity.LayerScore.score``).
        calibration_batches: batches the ``auto`` scan measures on, and calibrated rounding calibrates on.
        scan_method: ``auto`` scan method.
        rounding: how the weights are rounded, calibrated on the first ``calibration_batches`` training batches.
            ``int4-lora``: the frozen base's INT4 codes: ``nearest``, ``gptq``, ``awq``, ``awq+gptq`` (lower output
            error; see ``hf_lowprec.ondevice.calibration``). ``full``: ``nearest`` or ``gptq``, which first moves each
            FP8 layer's master weight to the grid point GPTQ chooses (``hf_lowprec.ondevice.calibration.fp8``).
        learn_steps: ``int4-lora`` only: ``true``: the frozen base's group steps and zero points train with the
            adapters (its codes stay frozen; ``hf_lowprec.ondevice.learned_steps``); ``zero_points``: its zero points
            alone (cheaper: no weight gradient); ``false``: neither.
    """

    plan: str = "fp8"
    keep: tuple[str, ...] = ("lm_head",)
    formats: tuple[str, ...] = ("fp8", "int4-g64")
    budget: Mapping[str, float] = field(default_factory=dict)
    score: str = field(default=CONVERSION, metadata=_choices(*SCORES))
    calibration_batches: int = 4
    scan_method: str = field(default="auto", metadata=_choices("auto", "fisher", "measured"))
    rounding: str = field(default="nearest", metadata=_choices(*ROUNDINGS))
    learn_steps: bool | str = field(default=False, metadata=_choices(*LEARN_STEPS))

    def __post_init__(self):
        if not self.formats:  # a scan then failed after the model's load and evaluation
            raise ValueError("'formats' is empty: name the formats an auto plan chooses among, e.g. [fp8, int4-g64]")
        for fmt in self.formats:
            FormatSpec.parse(fmt)
        if self.plan not in PLAN_SOURCES and not self.is_file:
            try:
                FormatSpec.parse(self.plan)
            except ValueError as e:
                raise ValueError(
                    f"'plan' must be 'auto', a plan file (.json/.yaml) or a folder holding one, or a format: {e}"
                ) from None
        if self.calibration_batches < 1:
            raise ValueError(f"'calibration_batches' must be >= 1, got {self.calibration_batches}")
        if self.budget:  # checked whatever the plan: a fixed plan's recipe keeps it for --plan auto
            budget_from(self.auto_budget())

    @property
    def is_auto(self) -> bool:
        return self.plan == AUTO

    def auto_budget(self) -> dict | None:
        """The ``auto`` allocation's budget: ``budget`` with ``score``; None for the allocator's default (Δloss ≤ 1%
        of the calibration loss, at conversion)."""
        budget = dict(self.budget) | ({} if self.score == CONVERSION else {"score": self.score})
        return budget or None

    @property
    def is_file(self) -> bool:
        """Whether ``plan`` is a plan file (.json/.yaml) or a folder holding one (a checkpoint, a run or an
        export): a plan that names the layers it keeps itself."""
        return Path(self.plan).suffix in (".json", ".yaml", ".yml") or plan_folder(self.plan) is not None

    def fixed_plan(self) -> PrecisionPlan:
        """The plan of a format-name or file ``plan`` (``auto`` needs a scan; see the CLI)."""
        if self.is_auto:
            raise ValueError("precision.plan 'auto' has no fixed plan; it is found by a sensitivity scan")
        return resolve_plan(self.plan, keep=() if self.is_file else self.keep)  # a file names its kept layers itself

    def int4_base_plan(self) -> PrecisionPlan | str:
        """``int4-lora``'s plan for the frozen base: ``auto``, a plan file's plan, or the format name, which
        :func:`hf_lowprec.ondevice.int4_plan` resolves against the model (the output head in int8 or bf16 by size)."""
        return self.fixed_plan() if self.is_file else self.plan


@dataclass(frozen=True)
class TrainingSection:
    """Optimisation settings under ``transformers.TrainingArguments``' own names; ``block_size``, ``dtype`` (the
    compute dtype), ``activation_storage``, ``return_freed_memory`` and ``eval_blocks`` are hf-lowprec's."""

    RENAMED: typing.ClassVar[dict[str, str]] = {  # earlier names, still read (with a deprecation message)
        "batch_size": "per_device_train_batch_size",
        "lr_scheduler": "lr_scheduler_type",
    }

    max_steps: int = 60
    learning_rate: float = 1e-4
    per_device_train_batch_size: int = 4
    gradient_accumulation_steps: int = 1
    block_size: int = 256
    warmup_steps: int = 0
    weight_decay: float = 0.0
    lr_scheduler_type: str = field(default="cosine", metadata=_choices(*SCHEDULERS))
    optim: str = field(default="adamw_torch", metadata=_choices(*OPTIMIZERS))
    dtype: str = field(default="auto", metadata=_choices(*DTYPES))
    gradient_checkpointing: bool = False
    activation_storage: str = field(default="none", metadata=_choices(*ACTIVATION_STORAGE))
    # int4-lora: glibc's heap returns freed memory per decoder block (true), while the process holds over half of the
    # memory it can use (auto), or never (false)
    return_freed_memory: bool | str = field(default=False, metadata=_choices(*RETURN_FREED_MEMORY))
    save_steps: int = 20
    logging_steps: int = 5
    eval_blocks: int = 8
    seed: int = 0
    report_to: str = (
        "none"  # experiment trackers, comma-separated (TrainingArguments.report_to): none, tensorboard, ...
    )

    def __post_init__(self):
        for key in (
            "max_steps",
            "per_device_train_batch_size",
            "gradient_accumulation_steps",
            "save_steps",
            "logging_steps",
            "eval_blocks",
        ):
            if getattr(self, key) < 1:
                raise ValueError(f"{key!r} must be >= 1, got {getattr(self, key)}")
        if self.block_size < MIN_BLOCK_SIZE:
            raise ValueError(f"'block_size' must be >= {MIN_BLOCK_SIZE} tokens, got {self.block_size}")
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):  # nan/inf: NaN weights, exit 0
            raise ValueError(f"'learning_rate' must be a finite number > 0, got {self.learning_rate}")
        for key in ("warmup_steps", "weight_decay"):  # else transformers/torch reject them after the model loads
            if not (math.isfinite(getattr(self, key)) and getattr(self, key) >= 0):
                raise ValueError(f"{key!r} must be a finite number >= 0, got {getattr(self, key)}")
        if not 0 <= self.seed < 2**32:  # numpy's seed range (transformers.set_seed)
            raise ValueError(f"'seed' must be in [0, 2**32), got {self.seed}")
        allowed = _tracker_names()
        unknown = [t for t in self.trackers if t not in allowed]
        if unknown:
            raise ValueError(f"'report_to' {', '.join(unknown)}: choose from {', '.join(allowed)}")
        installed = _trackers_installed()
        missing = [t for t in self.trackers if t not in ("none", "all", *installed, *UNCHECKED_TRACKERS)]
        if missing:  # else the Trainer refuses it, after the model has loaded and been evaluated
            raise ValueError(
                f"'report_to' {', '.join(missing)}: not installed here; installed trackers: "
                f"{', '.join(installed) or 'none'}"
            )

    def warm_up_note(self) -> str | None:
        """What is odd about the warm-up, or ``None``: transformers allows one as long as the run (a learning rate
        that never reaches its peak), which is a slip more often than a choice."""
        if self.warmup_steps < self.max_steps:
            return None
        return (
            f"training.warmup_steps ({self.warmup_steps}) >= max_steps ({self.max_steps}): the learning rate rises for "
            f"the whole run and never reaches {self.learning_rate:g}"
        )

    @property
    def trackers(self) -> list[str]:
        """``report_to`` as the list ``TrainingArguments`` takes."""
        return [t.strip() for t in self.report_to.split(",") if t.strip()] or ["none"]


@functools.cache
def _tracker_names() -> tuple[str, ...]:
    """The ``report_to`` values transformers knows (its integrations module takes seconds to import: once)."""
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    return ("none", "all", *INTEGRATION_TO_CALLBACK)


UNCHECKED_TRACKERS = ("azure_ml", "flyte")
"""Trackers transformers' availability list leaves out (``azure_ml`` when MLflow is installed): the Trainer checks
those itself."""


@functools.cache
def _trackers_installed() -> tuple[str, ...]:
    """The trackers whose package transformers finds here."""
    from transformers.integrations.integration_utils import get_available_reporting_integrations

    return tuple(get_available_reporting_integrations())


@dataclass(frozen=True)
class LoraSection:
    """LoRA adapters of the ``int4-lora`` method under ``peft.LoraConfig``'s names (``init``: default or loftq)."""

    RENAMED: typing.ClassVar[dict[str, str]] = {"alpha": "lora_alpha", "dropout": "lora_dropout"}

    r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    target_modules: tuple[str, ...] = ("all-linear",)
    init: str = field(default="default", metadata=_choices(*LORA_INITS))

    def __post_init__(self):  # checked here, not by PEFT/PyTorch after the model has loaded
        if self.r < 1:
            raise ValueError(f"'r' must be >= 1, got {self.r}")
        if not self.target_modules:
            raise ValueError("'target_modules' is empty: name the layers to adapt, e.g. [all-linear] or [q_proj, v_proj]")
        if not (math.isfinite(self.lora_alpha) and self.lora_alpha > 0):
            raise ValueError(f"'lora_alpha' must be a finite number > 0, got {self.lora_alpha}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"'lora_dropout' must be in [0, 1), got {self.lora_dropout}")


@dataclass(frozen=True)
class DataSection:
    """How training data is read: ``text_column``/``messages_column`` force a column (else detected); the held-out
    rows are the data's ``validation`` split where it has one, else the last ``eval_fraction`` of ``split``'s rows (one
    at least: every run evaluates its base and its result on them; of its characters for text of fewer than
    ``1 / eval_fraction`` rows, such as one ``.txt`` file)."""

    text_column: str | None = None
    messages_column: str | None = None
    split: str = "train"
    eval_fraction: float = 0.05
    # chat data: all tokens, the completions, or auto (the completions of prompt/response pairs, all of conversations)
    train_on: str = field(default="auto", metadata=_choices(*TRAIN_ON))

    def __post_init__(self):
        if self.text_column is not None and self.messages_column is not None:  # the messages column won, unsaid
            raise ValueError(
                f"'text_column' {self.text_column!r} and 'messages_column' {self.messages_column!r}: data is read as "
                "text or as chat messages; set one"
            )
        if not 0.0 < self.eval_fraction < 1.0:  # 0 held one row out all the same
            raise ValueError(
                f"'eval_fraction' must be in (0, 1), got {self.eval_fraction}: a run evaluates on held-out rows (one "
                "at least)"
            )


@dataclass(frozen=True)
class ExportSection:
    """What ``export`` writes: ``master`` (high-precision weights + plan), ``int4-packed`` (real INT4 codes, other
    layers' master weights) or ``auto`` (``int4-packed`` when the plan has INT4 layers, else ``master``)."""

    weights: str = field(default="master", metadata=_choices(*EXPORT_WEIGHTS))
    merge_lora: bool = False


@dataclass(frozen=True)
class Recipe:
    """A named training configuration; see the module docstring."""

    name: str
    description: str = ""
    method: str = field(default="full", metadata=_choices(*METHODS))
    precision: PrecisionSection = field(default_factory=PrecisionSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    lora: LoraSection = field(default_factory=LoraSection)
    data: DataSection = field(default_factory=DataSection)
    export: ExportSection = field(default_factory=ExportSection)
    source: str = field(default="", compare=False, metadata={"internal": True})

    def __post_init__(self):
        if not self.name or self.name != Path(self.name).name or self.name in (".", ".."):
            # it names the default output folder, runs/<name>: a path there wrote the run anywhere
            raise ValueError(f"'name' must be a plain name (no folders), got {self.name!r}")
        fixed_format = not (self.precision.is_auto or self.precision.is_file)
        if self.method == "int4-lora":
            self._check_int4_lora_precision(fixed_format)
        if self.training.activation_storage != "none" and self.method != "int4-lora":
            raise ValueError(
                f"training.activation_storage {self.training.activation_storage!r} applies to method 'int4-lora'; "
                "use 'none'"
            )
        if self.training.return_freed_memory and self.method != "int4-lora":
            raise ValueError("training.return_freed_memory applies to method 'int4-lora'; use false")
        if self.method == "full" and self.precision.rounding not in FP8_ROUNDINGS:
            raise ValueError(
                f"precision.rounding {self.precision.rounding!r} applies to method 'int4-lora'; method 'full' rounds "
                f"its FP8 weights by one of {', '.join(FP8_ROUNDINGS)}"
            )
        if self.method == "full" and self.precision.learn_steps:
            raise ValueError(
                "precision.learn_steps applies to method 'int4-lora' (a frozen INT4 base); method 'full' trains its "
                "INT4 layers' steps already"
            )
        if self.method == "int4-lora" and self.export.weights != "int4-packed":
            raise ValueError(
                f"export.weights {self.export.weights!r} applies to method 'full'; method 'int4-lora' exports its "
                "packed base with its adapters: 'int4-packed' (export.merge_lora: true merges them into it)"
            )
        if self.method == "full" and self.export.merge_lora:
            raise ValueError("export.merge_lora applies to method 'int4-lora' (its adapters); method 'full' has none")
        if self.method == "full" and (changed := _changed_fields(self.lora, "lora")):
            raise ValueError(
                f"{', '.join(changed)}: LoRA applies to method 'int4-lora' (adapters on a frozen INT4 base); method "
                "'full' trains the weights themselves; leave the lora settings out, or use an int4-lora recipe"
            )
        floating = [f for f in self.precision.formats if FormatSpec.parse(f).family not in ("int4", "int8")]
        if self.method == "int4-lora" and self.precision.is_auto and floating:
            raise ValueError(
                "method 'int4-lora' with plan 'auto' chooses among int4/int8 formats (e.g. int4-g64-asym, int8), "
                f"not {floating}"
            )

    def _check_int4_lora_precision(self, fixed_format: bool) -> None:
        """``ValueError`` for precision settings method ``int4-lora`` would not honour: a format its packed base
        does not store, kept layers other than the output head (which it keeps itself, int8 or bf16 by size), a scan
        method other than the one its ``auto`` plan scans with."""
        from hf_lowprec.ondevice.planning import base_holds

        if fixed_format:
            spec = FormatSpec.parse(self.precision.plan)
            if spec.family != "int4" or not base_holds(spec):
                stored = [n for n in EXAMPLE_NAMES if n.startswith("int4") and base_holds(FormatSpec.parse(n))]
                raise ValueError(
                    f"precision.plan {self.precision.plan!r}: method 'int4-lora' packs its frozen base in INT4; "
                    f"choose an INT4 format it stores (e.g. {', '.join(stored)}), 'auto' or a plan file"
                )
        if not self.precision.is_file and list(self.precision.keep) != ["lm_head"]:
            raise ValueError(
                f"precision.keep {list(self.precision.keep)}: method 'int4-lora' keeps the output head out of INT4 "
                "itself (int8 or bf16 by its size) and no other layer; name other formats per layer in a plan file "
                "(precision.plan: plan.yaml)"
            )
        if self.precision.scan_method not in ("auto", "fisher"):
            raise ValueError(
                f"precision.scan_method {self.precision.scan_method!r}: method 'int4-lora' scans its 'auto' plan with "
                "Fisher scores on the packed model; use 'auto'"
            )

    @property
    def summary(self) -> str:
        """The first sentence of the description."""
        return self.description.partition(". ")[0].strip().rstrip(".")

    # ------------------------------------------------------------------------------- conversion
    @classmethod
    def from_dict(cls, data: Mapping, source: str = "<dict>") -> "Recipe":
        """Build and check a recipe; ``source`` (a file name) appears in every error. An ``int4-lora`` recipe that
        names no plan gets that method's default format, not full training's ``fp8``, trains with 8-bit AdamW and
        exports ``int4-packed`` weights (its packed base), not ``master``."""
        try:
            recipe = _build(cls, _with_method_defaults(data), "", source)
        except ValueError as e:
            if "method" in data or "method '" not in str(e):
                raise
            # a setting another method's: the defaulted method is what is missing (not the setting that is wrong)
            methods = ", ".join(METHODS)
            raise ValueError(f"{e} (the recipe names no method, so it is 'full'; one of {methods})") from None
        return dataclasses.replace(recipe, source=source)

    def to_dict(self) -> dict:
        """Plain data (YAML-able), without the ``source`` field."""
        out = {}
        for f in dataclasses.fields(self):
            if f.metadata.get("internal"):
                continue
            out[f.name] = _plain(getattr(self, f.name))
        return out

    def to_yaml(self) -> str:
        """The recipe as a file would hold it (:func:`as_shown`)."""
        return yaml.safe_dump(as_shown(self.to_dict()), sort_keys=False, width=100)

    def with_overrides(
        self, overrides: Mapping[str, object], source: str = "command line", set_none: bool = False
    ) -> "Recipe":
        """A copy with dotted keys replaced (``{"training.max_steps": 10}``); ``None`` values are ignored (options
        not given), or set where ``set_none`` (``key=null`` arguments: checked as a recipe file's null is)."""
        data = self.to_dict()
        for key, value in overrides.items():
            if value is None and not set_none:
                continue
            node = data
            *parents, leaf = key.split(".")
            for p in parents:
                if not isinstance(node.get(p), dict):
                    sections = [k for k, v in node.items() if isinstance(v, dict)]
                    raise ValueError(
                        f"{source}: unknown recipe key {key!r}{_close_match(p, sections)}; {p!r} is no section here, "
                        f"the sections are {', '.join(sections)}"
                    )
                node = node[p]
            leaf = _RENAMED.get(".".join(parents), {}).get(leaf, leaf)
            if leaf not in node and ".".join(parents) not in OPEN_MAPPINGS:
                section = ".".join(parents)
                hint = _close_match(leaf, node, f"{section}." if parents else "")
                where = f"allowed keys in {section} are" if parents else "allowed keys are"
                raise ValueError(f"{source}: unknown recipe key {key!r}{hint}; {where} {', '.join(node)}")
            node[leaf] = list(value) if isinstance(value, tuple) else value
        return dataclasses.replace(
            _build(Recipe, data, "", f"{self.source or self.name} + {source}"), source=self.source
        )


_RENAMED = {"training": TrainingSection.RENAMED, "lora": LoraSection.RENAMED}  # by section, for with_overrides
# mappings whose keys a dotted override may add (checked when the recipe is built: budget_from names the allowed ones)
OPEN_MAPPINGS = ("precision.budget",)


def _plain(value):
    if dataclasses.is_dataclass(value):
        return {
            f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value) if not f.metadata.get("internal")
        }
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true/false", str: "a string"}


def _build(cls, data, prefix: str, source: str):
    """Construct dataclass ``cls`` from ``data``, checking keys, types and choices; errors name ``source``."""
    where = f"recipe {source!r}"
    section = prefix.rstrip(".") or "the recipe"  # for messages
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: {section} must be a mapping of keys, got {type(data).__name__}")
    data = _renamed_keys(cls, data, prefix, where)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise ValueError(
            f"{where}: unknown key {prefix + str(unknown[0])!r}{_close_match(str(unknown[0]), fields, prefix)}; "
            f"allowed keys in {section} are {', '.join(fields)}"
        )
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in data.items():
        key = prefix + name
        kwargs[name] = _check_value(value, hints[name], key, source)
        choices = fields[name].metadata.get("choices")
        if choices and kwargs[name] not in choices:
            allowed = ", ".join(map(_spelled, choices))
            raise ValueError(f"{where}: {key!r} is {value!r}; allowed values are {allowed}")
    try:
        return cls(**kwargs)
    except ValueError as e:
        text = str(e)
        own = text.split("'")[1] if text.startswith("'") else None
        if prefix and own in fields:  # a section's check names its key as the recipe spells it: 'training.seed'
            raise ValueError(f"{where}: '{prefix}{text[1:]}") from None
        raise ValueError(f"{where}: {prefix.rstrip('.') + ': ' if prefix else ''}{text}") from None


def _with_method_defaults(data):
    """``data`` with the ``int4-lora`` method's defaults where it leaves them out: its base's format (not full
    training's ``fp8``), 8-bit AdamW (not ``adamw_torch``) and ``int4-packed`` export weights (not ``master``);
    anything else as it is (``_build`` refuses what is malformed)."""
    if not isinstance(data, Mapping) or data.get("method") != "int4-lora":
        return data
    from hf_lowprec.ondevice.planning import DEFAULT_FORMAT

    # 8-bit AdamW: the adapters are bf16 where the CPU computes in bf16, and torch's AdamW rounds their updates to
    # nearest (those below half a bf16 step are lost); 8-bit AdamW rounds stochastically
    defaults = {
        "precision": {"plan": DEFAULT_FORMAT},
        "training": {"optim": "adamw_torch_8bit"},
        "export": {"weights": "int4-packed"},
    }
    given = {section: data.get(section, {}) for section in defaults}
    return {**data, **{k: {**defaults[k], **v} for k, v in given.items() if isinstance(v, Mapping)}}


def _changed_fields(section, prefix: str) -> list[str]:
    """``prefix.key value`` for each field of dataclass ``section`` that differs from its default."""
    fields = dataclasses.fields(section)
    return [f"{prefix}.{f.name} {getattr(section, f.name)!r}" for f in fields if getattr(section, f.name) != f.default]


def _close_match(key: str, allowed, prefix: str = "") -> str:
    """`` (did you mean 'x'?)`` for the allowed key closest to ``key``, named with its section's ``prefix``
    (``training.``: a bare ``max_steps`` is refused again), or nothing."""
    close = difflib.get_close_matches(key, list(allowed), n=1)
    return f" (did you mean {prefix + close[0]!r}?)" if close else ""


def _renamed_keys(cls, data: Mapping, prefix: str, where: str) -> dict:
    """``data`` with ``cls.RENAMED`` keys under their current names (each use logged as deprecated)."""
    renamed = getattr(cls, "RENAMED", {})
    out = {}
    for key, value in data.items():
        new = renamed.get(key)
        if new is None:
            out[key] = value
            continue
        if new in data:
            raise ValueError(
                f"{where}: {prefix + key!r} and {prefix + new!r} name the same setting; keep {prefix + new!r}"
            )
        logger.warning(
            "%s: %r is deprecated; use %r (its name in transformers/PEFT)", where, prefix + key, prefix + new
        )
        out[new] = value
    return out


def _check_value(value, hint, key: str, source: str):
    """``value`` converted to ``hint`` (dataclass, tuple[str, ...], Mapping[str, float], optional scalar)."""
    where = f"recipe {source!r}"
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, key + ".", source)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for one in inner[:-1]:  # bool | str: the first type the value is
            if isinstance(value, one):
                return _check_value(value, one, key, source)
        if len(inner) > 1 and not isinstance(value, inner[-1]):
            names = " or ".join(_TYPE_NAMES.get(a, a.__name__) for a in inner)
            raise ValueError(f"{where}: {key!r} must be {names}, got {value!r}")
        return _check_value(value, inner[-1], key, source)
    if origin is tuple:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) for v in items):
            raise ValueError(f"{where}: {key!r} must be a list of strings, got {value!r}")
        return tuple(items)
    if origin is Mapping:
        if not isinstance(value, Mapping):
            raise ValueError(f"{where}: {key!r} must be a mapping, got {type(value).__name__}")
        return {str(k): _check_value(v, args[1], f"{key}.{k}", source) for k, v in value.items()}
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):  # YAML reads 1e-4 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ValueError(f"{where}: {key!r} must be {_TYPE_NAMES.get(hint, hint.__name__)}, got {value!r}")
    return value


# ------------------------------------------------------------------------------------- catalogue
def _packaged() -> dict[str, Traversable]:
    root = shipped_folder("recipes")
    return {p.name.removesuffix(".yaml"): p for p in root.iterdir() if p.name.endswith(".yaml")}


def list_recipes() -> list[Recipe]:
    """The built-in recipes, sorted by name."""
    return [load_recipe(name) for name in sorted(_packaged())]


def as_shown(data: Mapping) -> dict:
    """A recipe's plain data (``Recipe.to_dict()``, a run record's ``recipe``) without the settings its method has no
    use for (method ``full``: ``lora``, ``precision.learn_steps``, ``export.merge_lora``, at their defaults): what a
    recipe file and a model card show."""
    shown = {k: dict(v) if isinstance(v, Mapping) else v for k, v in data.items()}
    if shown.get("method") == "full":
        shown.pop("lora", None)
        shown.get("precision", {}).pop("learn_steps", None)
        shown.get("export", {}).pop("merge_lora", None)
    return shown


def load_recipe(name_or_path: str | Path) -> Recipe:
    """A built-in recipe by name (``fp8-train``) or a recipe YAML file by path."""
    text_source = str(name_or_path)
    packaged = _packaged()
    path = Path(name_or_path)
    if text_source in packaged:
        text, source = packaged[text_source].read_text(), f"{text_source}.yaml"
    elif path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            what = "is a folder, not a YAML file" if path.is_dir() else "does not exist"
            raise ValueError(f"recipe file {text_source!r} {what}")
        try:
            text, source = path.read_text(encoding="utf-8"), text_source
        except UnicodeDecodeError as e:
            raise ValueError(f"recipe file {text_source!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    else:
        raise ValueError(
            f"unknown recipe {text_source!r}; built-in recipes are {', '.join(sorted(packaged))} (or pass a .yaml file)"
        )
    try:
        data = read_yaml(text)
    except yaml.YAMLError as e:
        raise ValueError(f"recipe {source!r} is not valid YAML: {describe_yaml_error(e)}") from None
    if not isinstance(data, Mapping):
        raise ValueError(
            f"recipe {source!r} must be a YAML mapping with keys "
            f"{', '.join(f.name for f in dataclasses.fields(Recipe) if f.name != 'source')}"
        )
    if "name" not in data:
        data = {"name": Path(source).stem, **data}
    return Recipe.from_dict(data, source=source)
