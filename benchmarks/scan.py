"""Sensitivity scan on SmolLM2-135M-Instruct (offline GGUF, fp32) with Shakespeare calibration text.

One process, side by side:
- wall time of each scan method (``fisher`` for every layer, ``auto``, and ``measured`` on a
  stratified sample of layers, extrapolated to all of them), with CPU time and the load average so
  the noise of this shared 2-core machine shows;
- Spearman rank correlation of the Fisher/Taylor prediction with the measured Δloss per layer;
- plans allocated from the ``auto`` scan against hand-written baselines at the same bits per
  parameter (uniform FP8, uniform INT4-g64, INT4 with the first and last linear kept — Accelerate's
  rule), each measured on held-out batches: the fp8/int4/bf16 fractions and Δloss of each.

INT4 uses group 64: the checkpoint was Q4_1 at group 32, which INT4-g32 would reproduce almost exactly.
Writes benchmarks/results/scan.json and scan_heatmap.png.

    .venv/bin/python benchmarks/scan.py [--batches 4] [--tokens 256] [--sample 40]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from scipy.stats import spearmanr

sys.path.insert(0, str(Path(__file__).parent))
from _util import RESULTS, machine, peak_rss_mb, write_json  # noqa: E402

from hf_lowprec.checkpoints import default_checkpoint, load_pretrained, shakespeare_files  # noqa: E402
from hf_lowprec.plan import PrecisionPlan  # noqa: E402
from hf_lowprec.sensitivity import allocate, measure_plan, predict_plan, scan  # noqa: E402

FORMATS = ("fp8", "int4-g64")
SKIP_CHARS = 5000  # past the Gutenberg header


def shakespeare_batches(tokenizer, n: int, tokens: int, held_out: bool) -> list[dict]:
    """``n`` batches of one ``tokens``-long window each; calibration and held-out come from different plays."""
    files = shakespeare_files()
    plays = files[-n:] if held_out else files[:n]
    out = []
    for path in plays:
        text = path.read_text(encoding="latin-1")[SKIP_CHARS : SKIP_CHARS + 8 * tokens]
        ids = torch.tensor([tokenizer(text)["input_ids"][:tokens]])
        if ids.shape[1] < tokens:
            raise ValueError(f"{path.name}: fewer than {tokens} tokens in the window")
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    return out


class Clock:
    """Wall and CPU seconds and the 1-minute load average around a block."""

    def __enter__(self):
        self.load0, self.wall0, self.cpu0 = os.getloadavg()[0], time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.wall0
        self.cpu = time.process_time() - self.cpu0
        self.load = (self.load0, os.getloadavg()[0])

    def record(self) -> dict:
        return {"wall_s": round(self.wall, 2), "cpu_s": round(self.cpu, 2), "cpu_per_wall": round(self.cpu / self.wall, 2),
                "load_avg_1min_before_after": [round(x, 2) for x in self.load]}  # fmt: skip


def spearman(pairs: list[tuple[float, float]]) -> float | None:
    return None if len(pairs) < 3 else round(float(spearmanr([a for a, _ in pairs], [b for _, b in pairs]).statistic), 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--sample", type=int, default=20, help="layers measured one by one as the Spearman reference")
    ap.add_argument("--fisher-repeats", type=int, default=1)
    ap.add_argument("--out", default="scan")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)

    with Clock() as load_clock:
        folder, gguf = default_checkpoint()
        model, tokenizer = load_pretrained(folder, gguf_file=gguf)
    calib = shakespeare_batches(tokenizer, args.batches, args.tokens, held_out=False)
    held_out = shakespeare_batches(tokenizer, args.batches, args.tokens, held_out=True)
    print(f"loaded SmolLM2-135M-Instruct in {load_clock.wall:.1f} s; {args.batches} x {args.tokens} tokens calibration + held-out")

    def progress_printer(name):
        last = [0.0]

        def progress(done, total, description):
            if time.perf_counter() - last[0] > 20 or done == total:
                last[0] = time.perf_counter()
                print(f"  {name}: {done}/{total} {description}", flush=True)

        return progress

    runs = {}
    fisher_times = []
    for r in range(args.fisher_repeats):
        with Clock() as c:
            fisher = scan(model, calib, FORMATS, method="fisher", progress=progress_printer("fisher"))
        fisher_times.append(c.record())
    runs["fisher"] = {"repeats": fisher_times, "median_wall_s": statistics.median(t["wall_s"] for t in fisher_times)}
    print(f"fisher: {runs['fisher']['median_wall_s']:.1f} s (median of {args.fisher_repeats})")

    with Clock() as c:
        auto = scan(model, calib, FORMATS, method="auto", progress=progress_printer("auto"))
    measured_pairs = sum(len(u.measured) for u in auto.layers)
    runs["auto"] = {**c.record(), "measured_pairs": measured_pairs, "pairs": sum(len(u.formats) for u in auto.layers),
                    "phases_s": {k: round(v, 2) for k, v in auto.seconds.items()}}  # fmt: skip
    print(f"auto: {c.wall:.1f} s ({measured_pairs} pairs measured)")

    # reference: measured Δloss on a stratified sample of units (every k-th in model order, plus the head)
    names = [u.name for u in fisher.layers]
    step = max(1, len(names) // args.sample)
    sample = sorted(set(names[::step][: args.sample]) | {names[0], fisher["lm_head"].name})
    with Clock() as c:
        reference = scan(model, calib, FORMATS, method="measured", layers=sample, progress=progress_printer("measured"))
    pairs = sum(len(u.formats) for u in reference.layers)
    per_pair = c.wall / pairs
    all_pairs = runs["auto"]["pairs"]
    runs["measured"] = {**c.record(), "layers": len(sample), "pairs": pairs, "s_per_pair": round(per_pair, 2),
                        "extrapolated_all_layers_s": round(per_pair * all_pairs, 1)}  # fmt: skip
    print(f"measured: {c.wall:.1f} s for {pairs} pairs ({per_pair:.2f} s/pair; all {all_pairs} pairs ≈ {per_pair * all_pairs / 60:.1f} min)")

    corr = {}
    for fmt in FORMATS:
        rows = [(fisher[u.name].predicted[fmt], u.measured[fmt]) for u in reference.layers]
        corr[fmt] = {
            "spearman_predicted_vs_measured_delta_loss": spearman(rows),
            "spearman_second_order_vs_measured_kl": spearman([(fisher[u.name].second_order[fmt], u.kl[fmt]) for u in reference.layers]),
            "spearman_first_order_only": spearman([(fisher[u.name].first_order[fmt], u.measured[fmt]) for u in reference.layers]),
            "spearman_second_order_only": spearman([(fisher[u.name].second_order[fmt], u.measured[fmt]) for u in reference.layers]),
        }
    pooled = [(fisher[u.name].predicted[f], u.measured[f]) for u in reference.layers for f in FORMATS]
    corr["pooled_both_formats"] = {"spearman_predicted_vs_measured_delta_loss": spearman(pooled)}
    corr["auto_measured_pairs"] = {"spearman_predicted_vs_measured_delta_loss": spearman(
        [(u.predicted[f], u.measured[f]) for u in auto.layers for f in u.measured])}  # fmt: skip
    print("spearman:", corr)

    # plans: baselines vs allocations at the same bits per parameter, all measured on held-out batches
    first_linear = next(u.name for u in auto.layers if u.kind == "Linear")
    baselines = {
        "uniform fp8 (head kept)": PrecisionPlan.uniform("fp8", keep=("lm_head",)),
        "int4-g64, first+last linear kept (Accelerate's rule)": PrecisionPlan.uniform("int4-g64", keep=("lm_head", first_linear)),
    }
    plans = {}

    def evaluate(label, plan, allocated=False):
        with Clock() as c:
            held = measure_plan(model, plan, held_out)
        pred = predict_plan(auto, plan)
        plans[label] = {"allocated": allocated, "fractions": {k: round(v, 4) for k, v in pred["fractions"].items()},
                        "bits_per_param": round(pred["bits_per_param"], 3), "predicted_delta_loss": pred["predicted_delta_loss"],
                        "held_out_delta_loss": held["delta_loss"], "held_out_kl": held["kl"], "held_out_base_loss": held["base_loss"],
                        "measure_s": round(c.wall, 1)}  # fmt: skip
        print(f"{label:55s} bits {pred['bits_per_param']:6.2f}  predicted Δ {pred['predicted_delta_loss']:.4f}  held-out Δ {held['delta_loss']:.4f}  {plans[label]['fractions']}")
        return pred

    for label, plan in baselines.items():
        pred = evaluate(label, plan)
        if "fp8" not in label:
            allocated = allocate(auto, target_bits_per_param=pred["bits_per_param"], keep=("lm_head",))
            evaluate(f"allocated at {pred['bits_per_param']:.2f} bits (head kept)", allocated, allocated=True)
    default_plan = allocate(auto)  # no budget: predicted Δloss ≤ 1% of the calibration loss
    evaluate(f"allocated, default budget (Δloss ≤ {auto.allocation['budget']['max_loss_increase']:.4f})", default_plan, allocated=True)
    no_int4 = allocate(auto, int4_fraction=0.0, max_loss_increase=0.05)
    evaluate("allocated, int4_fraction=0 (no INT4)", no_int4, allocated=True)
    heat_plan = allocate(auto, target_bits_per_param=6.0)
    evaluate("allocated at 6 bits/param (head free)", heat_plan, allocated=True)

    heatmap = auto.save_heatmap(RESULTS / f"{args.out}_heatmap.png", title="SmolLM2-135M: per-layer Δloss, auto scan; boxes: plan at 6 bits/param")
    auto.save(RESULTS / f"{args.out}_scores.json")
    data = {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to fp32)", "formats": FORMATS,
        "calibration": f"{args.batches} batches x 1 x {args.tokens} tokens, Shakespeare (first {args.batches} plays); held-out: last {args.batches} plays",
        "base_loss_calibration": auto.base_loss, "units": len(auto.layers), "machine": machine(), "load_s": round(load_clock.wall, 1),
        "methods": runs, "spearman": corr, "plans": plans, "peak_rss_mb": round(peak_rss_mb()),
        "noise": "shared 2-core machine (other jobs ran throughout): cpu_per_wall 2.0 would mean both cores were ours; "
                 "on an idle machine a run's wall time would lie between cpu_s / 2 and cpu_s",
        "files": {"heatmap": heatmap.name, "scores": f"{args.out}_scores.json"},
    }  # fmt: skip
    path = write_json(f"{args.out}.json", data)
    print(f"wrote {path} and {heatmap}")


if __name__ == "__main__":
    main()
