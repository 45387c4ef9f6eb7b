"""Budgeted allocation: :func:`allocate` turns a :class:`ScanResult` and a :class:`Budget` into an explicit
:class:`~hf_lowprec.plan.PrecisionPlan` (a multiple-choice knapsack, ILP or greedy); :func:`predict_plan`;
:func:`check_budget` before a scan.
"""

from __future__ import annotations

import difflib
import fnmatch
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np
from torch import nn

from hf_lowprec.formats import FormatSpec
from hf_lowprec.plan import PrecisionPlan, check_convertible, resolve_plan
from hf_lowprec.sensitivity.results import AFTER_TRAINING, CONVERSION, KEEP, SCORES, ScanResult
from hf_lowprec.sensitivity.units import _select, _units, unscored

logger = logging.getLogger(__name__)

DEFAULT_RELATIVE_LOSS_INCREASE = 0.01
"""Budget used by :func:`allocate` when none is given: Δloss ≤ 1% of the calibration loss."""
SOLVERS = ("auto", "ilp", "greedy")
ILP_MAX_VARIABLES = 20000  # beyond this many (unit, choice) pairs the greedy solver is used
_AN_EMBEDDING = nn.Embedding(1, 1)  # PrecisionPlan.resolve looks at a module's type only


@dataclass(frozen=True)
class Budget:
    """What an allocation must respect (give at least one).

    Attributes:
        max_loss_increase: predicted Δloss of the whole plan (sum over layers), nats/token.
        target_bits_per_param: mean stored bits per eligible weight, scales included (a layer kept
            as it is counts its own dtype: 32 for fp32, 16 for bf16).
        min_fp8_fraction: at least this fraction of the free parameters (those of the scanned layers that
            ``keep`` does not hold) in FP8 or lower precision.
        int4_fraction: at most this fraction of the free parameters in 4-bit formats (0 forbids INT4).
        score: which Δloss each choice costs, ``conversion`` or ``after-training`` (the curvature term only; needs a
            scan with Taylor terms): see :meth:`~hf_lowprec.sensitivity.LayerScore.score`.

    With ``target_bits_per_param`` or ``min_fp8_fraction`` the allocator minimizes the predicted
    Δloss; otherwise it minimizes memory within ``max_loss_increase`` and ``int4_fraction``.
    """

    max_loss_increase: float | None = None
    target_bits_per_param: float | None = None
    min_fp8_fraction: float | None = None
    int4_fraction: float | None = None
    score: str = CONVERSION

    def __post_init__(self):
        _check_score(self.score)
        values = {k: v for k, v in asdict(self).items() if k in _CONSTRAINTS}
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


def _check_score(score) -> None:
    if score not in SCORES:
        raise ValueError(f"budget score must be one of {', '.join(SCORES)}, got {score!r}")


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
    free_params: float  # of the units keep does not hold: the fractions' denominator


_SAID_UNMATCHED: set[tuple] = set()  # (what, pattern, the layers' names) of the unmatched patterns warned of


def _problem(result: ScanResult, keep: Sequence[str], force: Mapping[str, str], score: str) -> _Problem:
    units = [u for u in result.layers]
    if not units or not any(u.params for u in units):
        raise ValueError(
            "the scan has no layers with weights to allocate (the model had no eligible nn.Linear / nn.Embedding "
            "layers)"
        )
    all_names = [n for u in units for n in u.names]
    rules: dict[int, str] = {}

    def match(pattern: str, what: str) -> list[int]:
        hits = [i for i, u in enumerate(units) if any(fnmatch.fnmatchcase(n, pattern) for n in u.names)]
        if not hits and any(c in pattern for c in "*?["):  # e.g. "*norm*": norms are never quantized anyway
            if (what, pattern, tuple(all_names)) not in _SAID_UNMATCHED:  # once: the check before the scan said it
                _SAID_UNMATCHED.add((what, pattern, tuple(all_names)))
                logger.warning(
                    "%s pattern %r matches no scanned layer (only nn.Linear / nn.Embedding are scanned)", what, pattern
                )
        elif not hits:
            close = difflib.get_close_matches(pattern, all_names, n=3, cutoff=0.6)
            hint = f"; close matches: {', '.join(close)}" if close else f" (e.g. {all_names[0]!r})"
            raise ValueError(f"{what} entry {pattern!r} is not a scanned layer{hint}")
        return hits

    for pattern in keep:
        for i in match(pattern, "keep"):
            rules[i] = KEEP
    if keep and len(rules) == len(units):
        raise ValueError(
            f"keep {list(keep)} covers every scanned layer ({len(units)}), which leaves nothing to allocate; keep "
            "fewer layers (the callback's and the CLI's default keeps the output head alone)"
        )
    for pattern, fmt in (force or {}).items():
        try:
            spec = FormatSpec.parse(fmt)
        except ValueError as e:
            raise ValueError(f"force entry {pattern!r}: {e}") from None
        name = KEEP if spec.is_high_precision else spec.name
        for i in match(pattern, "force"):
            if name != KEEP and name not in units[i].bytes:
                allowed = ", ".join([KEEP, *units[i].formats])
                raise ValueError(
                    f"force entry {pattern!r}: format {name!r} was not scanned for {units[i].name!r}; choose one "
                    f"of {allowed}"
                )
            if rules.get(i, name) != name:
                raise ValueError(
                    f"layer {units[i].name!r} (with its tied twins {list(units[i].tied)}) gets both {rules[i]} and "
                    f"{name} from keep/force"
                )
            rules[i] = name
    rows = [(i, c) for i, u in enumerate(units) for c in [KEEP, *u.formats]]
    loss = [units[i].score(c, score) for i, c in rows]
    if broken := next(((units[i].name, c, v) for (i, c), v in zip(rows, loss) if not math.isfinite(v)), None):
        raise ValueError(
            f"layer {broken[0]!r} in {broken[1]}: its Δloss score is {broken[2]}, which no budget can weigh (a scan "
            "that overflowed, or an edited scores file); scan again, in fp32"
        )
    negative = sum(1 for v in loss if v < 0)
    if negative:
        logger.info(
            "%d (layer, format) scores are negative (quantizing lowered the calibration loss); counted as 0", negative
        )
    return _Problem(
        unit=np.array([i for i, _ in rows]),
        choice=[c for _, c in rows],
        loss=np.maximum(np.array(loss), 0.0),
        nbytes=np.array([units[i].bytes[c] for i, c in rows]),
        params=np.array([float(units[i].params) for i, _ in rows]),
        low=np.array([0.0 if c == KEEP else 1.0 for _, c in rows]),
        four_bit=np.array([1.0 if c != KEEP and FormatSpec.parse(c).bits <= 4 else 0.0 for _, c in rows]),
        fixed=np.array([i in rules and rules[i] != c for i, c in rows]),
        n_units=len(units),
        total_params=float(sum(u.params for u in units)),
        free_params=float(sum(u.params for i, u in enumerate(units) if rules.get(i) != KEEP)) or 1.0,
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
        out.append((p.low * p.params / p.free_params, budget.min_fp8_fraction - 1e-12, np.inf))
    if budget.int4_fraction is not None and skip != "int4_fraction":
        out.append((p.four_bit * p.params / p.free_params, -np.inf, budget.int4_fraction + 1e-12))
    return out


def _solve_ilp(p: _Problem, objective: np.ndarray, limits, tiebreak: np.ndarray | None = None) -> np.ndarray | None:
    """Exact 0/1 solution (HiGHS branch and bound via scipy) minimizing ``objective``; None if infeasible.

    An ILP rather than a DP: the budget can constrain loss, memory and two fractions at once, which a
    one-dimensional knapsack DP cannot express.
    """
    from scipy.optimize import LinearConstraint

    n = len(p.unit)
    onehot = np.zeros((p.n_units, n))
    onehot[p.unit, np.arange(n)] = 1.0
    constraints = [LinearConstraint(onehot, 1.0, 1.0)]
    for a, lo, hi in limits:
        divisor = _row_scale(lo, hi)
        constraints.append(LinearConstraint(a[None, :] / divisor, lo / divisor, hi / divisor))
    # a choice over a bound on its own is in no plan: with a loss budget of 0, every one of Δloss > 0, which HiGHS's
    # absolute tolerance (~1e-7 where a bound is 0) let in below it
    upper = np.where(p.fixed, 0.0, 1.0)
    for a, _, hi in limits:
        if math.isfinite(hi) and (a >= 0).all():
            upper[a > hi] = 0.0
    x = _minimize(objective, upper, constraints)
    if x is None or tiebreak is None:
        return x
    # among optimal solutions, the best by the second criterion
    best = float(objective @ x)
    if best > 0:  # within 1e-9 of the optimum, relative to it: unscaled, HiGHS's absolute tolerance (~1e-7) let a
        # higher loss in, which the tiebreak then took for fewer bytes
        optimal, tied_upper = [LinearConstraint(objective[None, :] / best, -np.inf, 1.0 + 1e-9)], upper
    else:  # objectives are >= 0: an optimum of 0 takes no row above 0
        optimal, tied_upper = [], np.where(objective > 0, 0.0, upper)
    tied = _minimize(tiebreak, tied_upper, [*constraints, *optimal])
    return x if tied is None else tied


def _minimize(objective: np.ndarray, upper: np.ndarray, constraints: list) -> np.ndarray | None:
    """The 0/1 vector under ``upper`` meeting ``constraints`` of least ``objective``, or None if infeasible.

    HiGHS stops within an absolute gap (1e-6) of the optimum. The objective is divided by its largest entry a plan
    can take (a row ``upper`` forbids, e.g. a kept head's INT4 Δloss, left out: beside it, the other layers' Δloss
    fell under the gap and the plan came back up to 100x the optimum), then, where the optimum is far smaller than
    that entry, solved again divided by the optimum found: the gap is then relative to the optimum."""
    from scipy.optimize import Bounds, milp

    n = len(objective)
    bounds = Bounds(np.zeros(n), upper)
    options = {"time_limit": 60.0, "mip_rel_gap": 1e-9}
    # where every entry a plan can take is 0, by the largest entry (not by a tiny number: HiGHS takes costs over 1e20
    # as infinite)
    scale = float(np.abs(objective[upper > 0]).max(initial=0.0)) or float(np.abs(objective).max(initial=0.0)) or 1.0
    x = None
    while True:
        res = milp(objective / scale, integrality=np.ones(n), bounds=bounds, constraints=constraints, options=options)
        if res.x is None:
            return x
        if res.status != 0:
            logger.warning("allocation ILP stopped before proving optimality (%s); using its best solution", res.message)
        x = np.round(res.x)
        value = float(objective @ x)
        if not 0 < value < 1e-3 * scale:
            return x
        scale = value


def _row_scale(lo: float, hi: float) -> float:
    """A constraint row's divisor: its finite bound's size, so that HiGHS's feasibility tolerance (which it applies to
    its own scaling of each row) is relative to the bound: unscaled, a loss budget of 0.02 came back exceeded by 1e-4
    of itself, and was refused as unmeetable."""
    bound = hi if math.isfinite(hi) else lo
    return abs(bound) if math.isfinite(bound) and bound != 0 else 1.0


def _solve_greedy(p: _Problem, budget: Budget) -> np.ndarray:
    """Greedy for problems too large for the ILP: start from each unit's lowest-Δloss choice (with an INT4 share
    to keep under, its lowest-Δloss choice in more than 4 bits: moves only save bytes, so a start in INT4 could not
    leave it), then repeatedly take the feasible move with the least Δloss per byte saved."""
    allowed = ~p.fixed
    state = np.zeros(p.n_units, dtype=int)
    four_bit_last = p.four_bit if budget.int4_fraction is not None else np.zeros_like(p.four_bit)
    for u in range(p.n_units):
        rows = np.flatnonzero((p.unit == u) & allowed)
        state[u] = rows[np.lexsort((p.nbytes[rows], p.loss[rows], four_bit_last[rows]))[0]]
    loss_cap = math.inf if budget.minimizes_loss or budget.max_loss_increase is None else budget.max_loss_increase
    int4_cap = math.inf if budget.int4_fraction is None else budget.int4_fraction * p.free_params + 1e-9
    while True:
        cur = state[p.unit]
        t = _totals(p, np.bincount(state, minlength=len(p.unit)).astype(float))
        if budget.minimizes_loss and not _violations_of(t, budget, ("target_bits_per_param", "min_fp8_fraction")):
            break
        saved = p.nbytes[cur] - p.nbytes
        ok = allowed & (saved > 0)
        ok &= t["max_loss_increase"] + p.loss - p.loss[cur] <= loss_cap
        ok &= t["int4_fraction"] * p.free_params + (p.four_bit - p.four_bit[cur]) * p.params <= int4_cap
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
        "min_fp8_fraction": float((p.low * p.params) @ x) / p.free_params,
        "int4_fraction": float((p.four_bit * p.params) @ x) / p.free_params,
    }


def _violations(p: _Problem, x: np.ndarray, budget: Budget) -> list[str]:
    return _violations_of(_totals(p, x), budget, _CONSTRAINTS)


def _violations_of(t: dict, budget: Budget, keys: Sequence[str]) -> list[str]:
    """The budget constraints among ``keys`` that the totals ``t`` break, beyond the solver's tolerance (relative to
    the bound: :func:`_row_scale`)."""

    def tol(bound: float) -> float:
        return 1e-9 + 1e-6 * abs(bound)

    bad = []
    if (b := budget.max_loss_increase) is not None and t["max_loss_increase"] > b + tol(b):
        bad.append("max_loss_increase")
    if (b := budget.target_bits_per_param) is not None and t["target_bits_per_param"] > b + tol(b):
        bad.append("target_bits_per_param")
    if (b := budget.min_fp8_fraction) is not None and t["min_fp8_fraction"] < b - tol(b):
        bad.append("min_fp8_fraction")
    if (b := budget.int4_fraction) is not None and t["int4_fraction"] > b + tol(b):
        bad.append("int4_fraction")
    return [k for k in bad if k in keys]


_BEST = {  # how to optimize one budget quantity alone: (objective row, sign, wording)
    "max_loss_increase": (lambda p: p.loss, 1, "lowest predicted Δloss reachable"),
    "target_bits_per_param": (lambda p: p.nbytes * 8 / p.total_params, 1, "fewest bits per parameter reachable"),
    "min_fp8_fraction": (lambda p: p.low * p.params / p.free_params, -1, "largest FP8-or-lower fraction reachable"),
    "int4_fraction": (lambda p: p.four_bit * p.params / p.free_params, 1, "smallest INT4 fraction reachable"),
}


def _unmeetable(p: _Problem, budget: Budget, failed: list[str]) -> ValueError:
    """The error for a budget that cannot be met, naming the best reachable value of a failing constraint."""
    given = {k: v for k, v in asdict(budget).items() if v is not None and k in _CONSTRAINTS}
    for key in failed or list(given):
        row, sign, wording = _BEST[key]
        x = _solve_ilp(p, sign * row(p), _limits(p, budget, skip=key))
        if x is None:
            continue
        others = ", ".join(f"{k}={v:g}" for k, v in given.items() if k != key)
        kept = " (a kept layer counts the bits of its weights' dtype: 32 in an fp32-loaded model)"
        return ValueError(
            f"budget {key}={given[key]:g} cannot be met: the {wording}{' with ' + others if others else ''} "
            f"(and keep/force) is {float(row(p) @ x):.6g}{kept if key == 'target_bits_per_param' else ''}"
        )
    return ValueError(f"budget {given} cannot be met by any combination of the scanned formats with keep/force")


def predict_plan(result: ScanResult, plan: "PrecisionPlan | Mapping", score: str = CONVERSION) -> dict:
    """Predicted Δloss (the sum of per-layer scores of kind ``score``, negatives as 0), bits per parameter and format
    fractions of any ``plan`` over the scanned layers (e.g. a hand-written one, to compare with
    :func:`allocate`'s). Raises ``ValueError`` if the plan gives tied layers different formats or
    a format the scan did not score."""
    plan = resolve_plan(plan)
    total = sum(u.params for u in result.layers) or 1
    loss = nbytes = 0.0
    fractions: dict[str, float] = {}
    for u in result.layers:
        # the unit's first layer has kind u.kind; tied twins are output heads (Linear)
        specs = {plan.resolve(n, _AN_EMBEDDING if (n == u.name and u.kind == "Embedding") else None) for n in u.names}
        names = {KEEP if s.is_high_precision else s.name for s in specs}
        if len(names) > 1:
            raise ValueError(
                f"plan gives the tied layers {list(u.names)} different formats {sorted(names)}; the scan scored "
                "them as one unit"
            )
        fmt = names.pop()
        if fmt not in u.bytes:
            raise ValueError(
                f"plan puts {u.name!r} in {fmt}, which the scan did not score; scanned: {', '.join(result.formats)}"
            )
        loss += max(u.score(fmt, score), 0.0)
        nbytes += u.bytes[fmt]
        fractions[fmt] = fractions.get(fmt, 0.0) + u.params / total
    return {"predicted_delta_loss": loss, "bits_per_param": nbytes * 8 / total, "fractions": fractions}


def allocate(
    result: ScanResult,
    budget: Budget | Mapping[str, float] | None = None,
    *,
    keep: Sequence[str] = (),
    force: Mapping[str, str] | None = None,
    solver: str = "auto",
    **budget_kwargs,
) -> PrecisionPlan:
    """Choose a format per layer under ``budget``; returns a plan naming every scanned layer.

    Args:
        result: a :class:`ScanResult`; each choice costs its Δloss of the budget's ``score`` (negative values count
            as 0).
        budget: a :class:`Budget`, or its fields as a mapping (a recipe's ``budget:``) or as keyword arguments.
            None of them: Δloss ≤ 1% of the calibration loss.
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
    budget = _budget_of(result, budget, budget_kwargs)
    p = _problem(result, keep, force or {}, budget.score)
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
    return _record(result, p, x, budget, keep, force, "ilp" if use_ilp else "greedy")


def check_budget(
    model: nn.Module,
    formats: Sequence[str],
    budget: Budget | Mapping[str, float] | None,
    *,
    keep: Sequence[str] = (),
    layers: Sequence[str] | None = None,
    packed: bool = False,
) -> None:
    """Raise the ``ValueError`` :func:`allocate` would raise after a scan of ``model`` over ``formats`` when no choice
    of formats meets the budget's size and share limits (bits per parameter, FP8 and INT4 fractions): before the
    minutes a scan takes. A loss budget is always met (by keeping every layer); ``None`` is one. ``layers``,
    ``packed``: as the scan will be given them (its ``layers``; ``dense_weights`` given). A model whose matrix weights
    sit mostly in layers no plan converts is refused first, as the scan would refuse it (Falcon's ``FalconLinear``:
    with the head kept, no layer was left, and the budget's error said to keep fewer)."""
    check_budget_fields(budget)
    check_convertible(model)
    scores = []
    units = _units(model, [FormatSpec.parse(f) for f in formats], packed=packed)
    for unit in units if layers is None else _select(units, layers):
        scores.append(unscored(unit))
        for terms in ("predicted", "first_order", "second_order"):  # every choice costs nothing: only the limits bind
            setattr(scores[-1], terms, dict.fromkeys(unit.formats, 0.0))
    result = ScanResult(scores, tuple(formats), "none")
    _problem(result, keep, {}, CONVERSION)  # keep's names, whatever the budget (a typo refused after the scan's minutes)
    if budget is None or isinstance(budget, Mapping) and not set(budget) - {"score"}:  # the default budget, a loss one
        return
    budget = _budget_of(None, budget, {})
    if budget.max_loss_increase is not None:  # met by keeping layers; unknown before the scan: the size limits alone
        if all(getattr(budget, k) is None for k in _CONSTRAINTS if k != "max_loss_increase"):
            return
        budget = replace(budget, max_loss_increase=None)
    allocate(result, budget, keep=keep)


def check_budget_fields(budget: Budget | Mapping[str, float] | None, method: str | None = None) -> None:
    """Raise the ``ValueError`` of a budget that is not a :class:`Budget`, a dict of its fields or ``None``, or whose
    keys, values or score are not allowed (``score`` alone: the default budget's), or whose score a scan of ``method``
    cannot give (``after-training`` needs Taylor terms, which ``measured`` takes none of): without a model, where the
    budget is given (a callback's constructor, the CLI's options), not when training starts or after the scan."""
    if isinstance(budget, Mapping):
        _check_score(budget.get("score", CONVERSION))
        if set(budget) - {"score"}:
            budget_from(budget)
    elif budget is not None and not isinstance(budget, Budget):
        fields = f"{', '.join(_CONSTRAINTS)}, score"
        raise ValueError(f"budget= takes a Budget or a dict of its fields ({fields}), got {budget!r}")
    score = budget.get("score", CONVERSION) if isinstance(budget, Mapping) else getattr(budget, "score", CONVERSION)
    if score == AFTER_TRAINING and method == "measured":
        raise ValueError(
            f"score {AFTER_TRAINING!r} needs the scan's Taylor terms, which method 'measured' takes none of: scan with "
            "method 'auto' or 'fisher'"
        )


def budget_from(values: Mapping) -> Budget:
    """The :class:`Budget` of ``{field: value}`` (a recipe's, the CLI's ``--budget``); ``ValueError`` naming unknown
    keys and the allowed ones."""
    unknown = sorted(set(values) - set(_CONSTRAINTS) - {"score"})
    if unknown:
        close = difflib.get_close_matches(unknown[0], [*_CONSTRAINTS, "score"], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown budget argument(s) {unknown}{hint}; choose from {', '.join(_CONSTRAINTS)}, score")
    return Budget(**values)


def _budget_of(result: ScanResult, budget: Budget | Mapping | None, budget_kwargs: dict) -> Budget:
    """The :class:`Budget` of an :func:`allocate` call: given, from a mapping or keywords, or Δloss ≤ 1% of the
    calibration loss."""
    if budget is not None and budget_kwargs:
        raise ValueError("pass either a Budget or budget keyword arguments, not both")
    if isinstance(budget, Mapping):  # {field: value}, checked as keywords are
        budget, budget_kwargs = None, dict(budget)
    if budget is not None:
        return budget
    if set(budget_kwargs) - {"score"}:
        return budget_from(budget_kwargs)
    _check_score(budget_kwargs.get("score", CONVERSION))
    if not math.isfinite(result.base_loss):
        raise ValueError("the scan has no calibration loss to derive a default budget from; pass a budget")
    budget = Budget(max_loss_increase=DEFAULT_RELATIVE_LOSS_INCREASE * result.base_loss, **budget_kwargs)
    logger.info("no budget given: max_loss_increase = %.4g (1%% of the calibration loss)", budget.max_loss_increase)
    return budget


def _record(result: ScanResult, p: _Problem, x: np.ndarray, budget: Budget, keep, force, solver: str) -> PrecisionPlan:
    """The plan of solution ``x``, recorded with its summary on ``result``."""
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
        "keep": list(keep),
        "force": dict(force or {}),
        "solver": solver,
        "predicted_delta_loss": totals["max_loss_increase"],
        "bits_per_param": totals["target_bits_per_param"],
        "fractions": fractions,
    }
    logger.info(
        "allocated: predicted Δloss %.4g, %.2f bits/param, %s",
        totals["max_loss_increase"],
        totals["target_bits_per_param"],
        ", ".join(f"{k} {v:.1%}" for k, v in fractions.items()),
    )
    return plan
