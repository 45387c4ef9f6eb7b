"""Outlier handling on the pretrained checkpoint: what Hadamard rotation (``-rht``), smoothing (``-sq``) and MXFP8 scales
(``fp8-mx``) do to quality, what they cost, and what the scan chooses.

SmolLM2-135M-Instruct, held-out perplexity on ``EVAL_BLOCKS`` blocks of two unseen plays, no training; every linear
but ``lm_head`` converted; all runs (the baseline too) under bf16 autocast with fp32 master weights, as training
runs them. Sections (``quality``, ``smoothing`` and ``cost`` can run alone):

- ``formats``: each FP8 scale granularity and INT4 format, plain and rotated, and FP8 with its master weights
  GPTQ-rounded onto the grid (``round_fp8_weights`` on ``CALIBRATION_BATCHES`` training batches); rotated runs are
  repeated over ``ROTATION_SEEDS`` (the random signs of the rotation) and give mean and standard deviation; the
  others are deterministic.
- ``fp8_error``: tensorwise FP8 with the weights, or the activations, left exact: which operand costs the perplexity.
- ``fp8_by_projection``: one projection type in FP8 at a time.
- ``scan``: the sensitivity scan over plain and rotated candidates, then the allocator: the ``fp8-train`` recipe's
  plan (its candidates and budget: FP8 on >= 90% of the convertible parameters, the rest kept), and INT4 on all of
  them.
- ``smoothing``: ``SMOOTHED_FORMATS`` smoothed (``-sq``, calibrated on the first training batch; ``formats`` has them
  plain), and the scan choosing per layer between W4A8 plain and smoothed.
- ``cost``: forward+backward time of one layer per format on SmolLM2-135M's shapes, against the bf16 layer and the
  same format without its outlier option, side by side in one process (fastest of ``REPEATS`` interleaved rounds).

    python benchmarks/outliers.py [quality|smoothing|cost]   # writes benchmarks/results/outliers.json and outliers.png
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from contextlib import contextmanager

import torch
from _util import RESULTS, lm_batches, machine, write_json
from ondevice import _data

import hf_lowprec.modules.fp8 as fp8_module
import hf_lowprec.rotation as rotation
from hf_lowprec import PrecisionPlan, apply_plan, revert
from hf_lowprec.checkpoints import default_checkpoint, load_pretrained
from hf_lowprec.modules import FP8Linear, Int4Linear
from hf_lowprec.modules.kernels.autotune import time_calls
from hf_lowprec.ondevice import evaluate_loss
from hf_lowprec.ondevice.calibration.fp8 import round_fp8_weights
from hf_lowprec.recipe import load_recipe
from hf_lowprec.sensitivity import allocate, scan
from hf_lowprec.smoothing import calibrate_smoothed_layers

EVAL_BLOCKS, CALIBRATION_BATCHES, BATCH = 16, 4, 4
ROTATION_SEEDS = (0, 1, 2)
FP8_FORMATS = ("fp8", "fp8-rowwise", "fp8-block", "fp8-mx")
INT4_FORMATS = ("int4-g64-asym", "int4-g64-a8")
SMOOTHED_FORMATS = ("fp8", "fp8-rowwise", "int4-g64-asym", "int4-g64-a8")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHAPES = {"attention 576->576": (576, 576), "mlp up 576->1536": (576, 1536), "mlp down 1536->576": (1536, 576)}
TOKENS, REPEATS = 512, 15
KEEP = ("lm_head",)


@contextmanager
def rotation_seed(seed: int):
    """Rotations drawn with ``seed`` (the library fixes one seed so that saved layers reload; a benchmark may vary it)."""
    old = rotation.ROTATION_SEED
    rotation.ROTATION_SEED = seed
    rotation._block_matrix.cache_clear()
    try:
        yield
    finally:
        rotation.ROTATION_SEED = old
        rotation._block_matrix.cache_clear()


@contextmanager
def exact_operand(model: torch.nn.Module, role: str):
    """FP8 layers of ``model`` leave their ``role`` operand (``input`` or ``weight``) unquantized: an analysis of
    where FP8's error comes from, not a format (patches the FP8 cast, restored on exit)."""
    policies = {id(m.scaling[role]) for m in model.modules() if isinstance(m, FP8Linear)}
    cast = fp8_module.cast_fp8

    def patched(x, policy, dtype, granularity, dim=-1, block=None):
        if id(policy) in policies:
            return x.float(), torch.ones((), device=x.device)
        return cast(x, policy, dtype, granularity, dim, block)

    fp8_module.cast_fp8 = patched
    try:
        yield
    finally:
        fp8_module.cast_fp8 = cast


def quality(parts: tuple[str, ...] = ("conversions", "smoothing")) -> dict:
    """The ``conversions`` sections (formats, fp8_error, fp8_by_projection, scan) and/or ``smoothing``."""
    folder, gguf = default_checkpoint()
    model, tok = load_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
    train, evals = _data(tok, CALIBRATION_BATCHES * BATCH, EVAL_BLOCKS)

    original = {k: v.clone() for k, v in model.state_dict().items()}

    def perplexity(plan=None, gptq: bool = False, **options) -> float:
        if plan is not None:
            apply_plan(model, plan, **options)
        with torch.autocast("cpu", torch.bfloat16):
            calibrate_smoothed_layers(model, train[:BATCH])  # '-sq' layers: on a training batch, not an eval one
            if gptq:
                round_fp8_weights(model, train)
            loss = evaluate_loss(model, evals, BATCH)
        revert(model)
        model.load_state_dict(original)  # the rounding moved the weights
        return math.exp(loss)

    base = perplexity()
    print(f"bf16 baseline: ppl {base:.3f}", flush=True)
    out: dict = {"baseline_ppl": base}

    def record(section: dict, label: str, values: list[float]) -> None:
        ratios = [v / base for v in values]
        section[label] = {"ppl": values, "ratio_mean": statistics.fmean(ratios),
                          "ratio_std": statistics.stdev(ratios) if len(ratios) > 1 else 0.0}  # fmt: skip
        std = f" ± {section[label]['ratio_std']:.4f}" if len(ratios) > 1 else ""
        print(f"{label:<28} {section[label]['ratio_mean']:.4f}x{std}", flush=True)

    calibration = lm_batches(train, BATCH, CALIBRATION_BATCHES)

    def scan_plan(section: dict, family: str, candidates: tuple[str, ...], share: float):
        """The scan over ``candidates`` and the allocator's plan with ``share`` of the convertible parameters in them,
        its perplexity recorded in ``section``; returns the plan."""
        start = time.perf_counter()
        with torch.autocast("cpu", torch.bfloat16):
            result = scan(model, calibration, formats=candidates, method="auto", seed=0)
        plan = allocate(result, keep=KEEP, min_fp8_fraction=share)  # a share of the parameters KEEP leaves free
        seconds = time.perf_counter() - start
        fractions = apply_plan(model, plan, learn_scales=False).fractions()
        revert(model)
        label = f"scan: {family} on {share:.0%} of convertible params"
        record(section, label, [perplexity(plan, learn_scales=False)])
        section[label].update({"candidates": candidates, "fractions": fractions, "scan_seconds": seconds})
        print(f"  plan: {', '.join(f'{k} {v:.1%}' for k, v in fractions.items())}", flush=True)
        return plan

    if "smoothing" in parts:
        out["smoothing"] = {}
        for fmt in SMOOTHED_FORMATS:
            learn = {"learn_scales": False} if fmt.startswith("int") else {}
            record(out["smoothing"], fmt + "-sq", [perplexity(PrecisionPlan.uniform(fmt + "-sq", keep=KEEP), **learn)])
        scan_plan(out["smoothing"], "int4-a8", ("int4-g64-a8", "int4-g64-a8-sq"), 1.0)
    if "conversions" not in parts:
        return out

    out.update(formats={}, fp8_error={}, fp8_by_projection={}, scan={})
    for fmt in FP8_FORMATS + INT4_FORMATS:
        learn = {"learn_scales": False} if fmt.startswith("int") else {}
        record(out["formats"], fmt, [perplexity(PrecisionPlan.uniform(fmt, keep=KEEP), **learn)])
        rotated = []
        for seed in ROTATION_SEEDS:
            with rotation_seed(seed):
                rotated.append(perplexity(PrecisionPlan.uniform(fmt + "-rht", keep=KEEP), **learn))
        record(out["formats"], fmt + "-rht", rotated)
        if fmt.startswith("fp8"):
            record(out["formats"], fmt + " (gptq weights)", [perplexity(PrecisionPlan.uniform(fmt, keep=KEEP), gptq=True)])

    for role in ("input", "weight"):
        apply_plan(model, PrecisionPlan.uniform("fp8", keep=KEEP))
        with exact_operand(model, role), torch.autocast("cpu", torch.bfloat16):
            ppl = math.exp(evaluate_loss(model, evals, BATCH))
        revert(model)
        record(out["fp8_error"], f"fp8, {role}s exact", [ppl])
    for proj in PROJECTIONS:
        record(out["fp8_by_projection"], proj, [perplexity(PrecisionPlan({f"*.{proj}": "fp8"}))])

    fp8 = load_recipe("fp8-train").precision  # the recipe's candidates and budget
    for family, candidates, share in (("fp8", fp8.formats, fp8.budget["min_fp8_fraction"]),
                                      ("int4", ("int4-g64-asym", "int4-g64-asym-rht"), 1.0)):  # fmt: skip
        plan = scan_plan(out["scan"], family, candidates, share)
        if family == "fp8":
            record(out["scan"], f"scan: {family} on {share:.0%} of convertible params (gptq weights)",
                   [perplexity(plan, gptq=True)])  # fmt: skip
    return out


def cost() -> dict:
    """Forward+backward seconds per layer, bf16 autocast, and the ratios to the bf16 layer and to plain FP8."""
    out = {}
    for label, (k, n) in SHAPES.items():
        torch.manual_seed(0)
        dense = torch.nn.Linear(k, n, bias=False)
        x = torch.randn(TOKENS, k)
        layers = {"bf16": dense}
        for fmt in FP8_FORMATS:
            layers[fmt] = FP8Linear.from_linear(dense, fmt)
            layers[fmt + "-rht"] = FP8Linear.from_linear(dense, fmt + "-rht")
        layers["fp8-sq"] = FP8Linear.from_linear(dense, "fp8-sq")
        for fmt in ("int4-g64-asym", "int4-g64-asym-rht", "int4-g64-a8", "int4-g64-a8-sq"):
            layers[fmt] = Int4Linear.from_linear(dense, fmt)

        def step(layer):
            xi = x.clone().requires_grad_()
            with torch.autocast("cpu", torch.bfloat16):
                y = layer(xi)
            y.float().sum().backward()
            dense.weight.grad = None

        seconds = time_calls({name: (lambda layer=layer: step(layer)) for name, layer in layers.items()}, REPEATS)
        out[label] = {name: {"seconds": s, "vs_bf16": s / seconds["bf16"],
                             "vs_plain": s / seconds[name.removesuffix("-rht").removesuffix("-sq")]}
                      for name, s in seconds.items()}  # fmt: skip
        print(label, ", ".join(f"{name} {r['vs_bf16']:.2f}x" for name, r in out[label].items()), flush=True)
    return out


def plot(data: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(k, v) for section in ("formats", "smoothing", "scan") for k, v in data["quality"].get(section, {}).items()]
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(rows) + 1.6))
    labels = [k for k, _ in rows]
    means = [v["ratio_mean"] for _, v in rows]
    stds = [v["ratio_std"] for _, v in rows]
    colors = ["tab:purple" if "gptq" in k else "tab:orange" if k.endswith("-rht") else "tab:red" if k.endswith("-sq")
              else "tab:green" if k.startswith("scan") else "tab:blue" for k in labels]  # fmt: skip
    ax.barh(range(len(rows)), [m - 1 for m in means], xerr=stds, left=1, color=colors)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(1.01, color="gray", linestyle="--", linewidth=0.8)
    ax.set_xlim(left=min(0.99, min(means) - 0.01))
    ax.set_xlabel("held-out perplexity / bf16's (dashed: 1.01x). Blue: plain; orange: rotated, mean ± std of 3 rotation "
                  "seeds;\nred: smoothed (-sq); purple: GPTQ-rounded FP8 weights; green: the scan's per-layer choice", fontsize=8)  # fmt: skip
    ax.set_title(f"SmolLM2-135M-Instruct converted, no training ({data['cpu_class']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(RESULTS / "outliers.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("only", nargs="?", choices=("quality", "smoothing", "cost"))
    args = ap.parse_args()
    path = RESULTS / "outliers.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    data.update(machine())
    data["settings"] = {"eval_blocks": EVAL_BLOCKS, "calibration_batches": CALIBRATION_BATCHES, "batch": BATCH,
                        "rotation_seeds": list(ROTATION_SEEDS), "tokens_timed": TOKENS, "repeats": REPEATS}  # fmt: skip
    if args.only in (None, "quality"):
        data["quality"] = quality()
    if args.only == "smoothing":  # its rows beside the committed conversions
        data.setdefault("quality", {}).update(quality(("smoothing",)))
    if args.only in (None, "cost"):
        data["cost"] = cost()
    write_json("outliers.json", data)
    if "quality" in data:
        plot(data)


if __name__ == "__main__":
    main()
