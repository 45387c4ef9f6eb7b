"""What the ``fp8-train`` recipe's scan costs and what its plan is worth, by how it computes and how many tokens a
forward runs.

SmolLM2-135M-Instruct (offline GGUF, fp32 weights), the recipe's candidates (plain, rotated and MX FP8) and budget
(FP8 on >= 90% of the convertible parameters, ``lm_head`` kept), method ``auto``, 4 calibration batches of 4 x 256
Shakespeare tokens (``--sets`` disjoint sets of them). Configurations, each scan in a fresh process (its peak RSS is
the process's, model and data included):

- ``autocast``: under bf16 autocast, as the recipe's training computes and the callback scans since 2026-12-05;
- ``fp32``: without autocast, as the callback scanned until then;
- forwards of ``2048`` (the scan's default, two batches merged) or ``1024`` tokens (``max_batch_tokens``).

Each plan converts the model (no training), whose held-out perplexity on 16 blocks of two unseen plays under bf16
autocast is reported over the unconverted model's.

    .venv/bin/python benchmarks/scan_cost.py [--sets 2]   # writes results/scan_cost.json and scan_cost.png
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _util import RESULTS, lm_batches, machine, peak_rss_mb, write_json  # noqa: E402
from ondevice import _data  # noqa: E402

from hf_lowprec import apply_plan, revert  # noqa: E402
from hf_lowprec.checkpoints import default_checkpoint, load_pretrained  # noqa: E402
from hf_lowprec.ondevice import evaluate_loss  # noqa: E402
from hf_lowprec.recipe import load_recipe  # noqa: E402
from hf_lowprec.sensitivity import allocate, scan  # noqa: E402

CONFIGS = {"autocast 2048": (True, 2048), "autocast 1024": (True, 1024), "fp32 2048": (False, 2048)}
EVAL_BLOCKS, MARK = 16, "RESULT "


def child(config: str, calibration_set: int) -> dict:
    """Scan, allocate and convert in this process: seconds, peak RSS (MB) and the plan's perplexity ratio."""
    autocast, tokens = CONFIGS[config]
    p = load_recipe("fp8-train").precision
    batch, count = 4, p.calibration_batches
    folder, gguf = default_checkpoint()
    model, tok = load_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
    train, evals = _data(tok, (calibration_set + 1) * batch * count, EVAL_BLOCKS)
    calibration = lm_batches(train[calibration_set * batch * count :], batch, count)

    def perplexity() -> float:
        with torch.autocast("cpu", torch.bfloat16):
            return math.exp(evaluate_loss(model, evals, batch))

    base = perplexity()
    start = time.perf_counter()
    with torch.autocast("cpu", torch.bfloat16) if autocast else contextlib.nullcontext():
        result = scan(model, calibration, formats=p.formats, method=p.scan_method, seed=0, max_batch_tokens=tokens)
    seconds, peak = time.perf_counter() - start, peak_rss_mb()
    plan = allocate(result, keep=p.keep, **p.budget)
    fractions = apply_plan(model, plan, learn_scales=False).fractions()
    ratio = perplexity() / base
    revert(model)
    return {"scan_s": round(seconds, 1), "peak_rss_mb": round(peak), "ppl_ratio": ratio, "base_ppl": base,
            "plan_fractions": {k: round(v, 4) for k, v in fractions.items()}}  # fmt: skip


def run_child(config: str, calibration_set: int) -> dict:
    cmd = [sys.executable, __file__, "child", "--config", config, "--set", str(calibration_set)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith(MARK)), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"{config}, set {calibration_set} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[len(MARK) :])


def plot(rows: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, ppl) = plt.subplots(1, 2, figsize=(10, 3.8))
    for i, (config, runs) in enumerate(rows.items()):
        mem.scatter([i] * len(runs), [r["peak_rss_mb"] for r in runs], color="C0")
        ppl.scatter([i] * len(runs), [r["ppl_ratio"] for r in runs], color="C1")
    for ax, label in ((mem, "scan peak RSS (MB, whole process)"), (ppl, "converted ppl / unconverted ppl")):
        ax.set_xticks(range(len(rows)), list(rows))
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.suptitle("fp8-train recipe's scan, SmolLM2-135M, one point per calibration set")
    fig.tight_layout()
    fig.savefig(RESULTS / "scan_cost.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", nargs="?", default="parent", choices=("parent", "child"))
    ap.add_argument("--config", choices=list(CONFIGS))
    ap.add_argument("--set", type=int, default=0)
    ap.add_argument("--sets", type=int, default=2)
    args = ap.parse_args()
    if args.mode == "child":
        print(MARK + json.dumps(child(args.config, args.set)), flush=True)
        return
    rows: dict[str, list] = {c: [] for c in CONFIGS}
    for calibration_set in range(args.sets):
        for config in CONFIGS:
            rows[config].append(run_child(config, calibration_set))
            print(config, f"set {calibration_set}:", rows[config][-1], flush=True)
    write_json("scan_cost.json", {**machine(), "recipe": "fp8-train", "model": "SmolLM2-135M-Instruct (fp32 weights)",
                                  "calibration": "4 batches x 4 x 256 tokens per set", "eval_blocks": EVAL_BLOCKS,
                                  "runs": rows})  # fmt: skip
    plot(rows)


if __name__ == "__main__":
    main()
