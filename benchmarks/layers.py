"""Forward+backward time and memory of one 2048x2048 linear per format, as ratios to fp32 and bf16.

Input: batch 4 x 256 tokens (x: [4, 256, 2048]). Each format runs in this process, interleaved
round-robin so machine noise hits every format alike. Memory is the bytes autograd saves for the
backward pass (activations; deterministic) plus weight-side storage; peak RSS is too coarse for one layer.

    python benchmarks/layers.py [--repeat 7]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from _util import machine, saved_tensor_bytes, write_json
from torch import nn

from hf_lowprec.modules import FP8Linear, Int4Linear

D, TOKENS = 2048, (4, 256)


def configs(base: nn.Linear):
    """name -> (module, input dtype)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    bf16 = copy.deepcopy(base).to(torch.bfloat16)
    out = {
        "fp32": (copy.deepcopy(base), torch.float32),
        "bf16": (bf16, torch.bfloat16),
        "fp8 (tensorwise)": (FP8Linear.from_linear(copy.deepcopy(bf16), "fp8", backend="emulated"), torch.bfloat16),
        "fp8-rowwise": (FP8Linear.from_linear(copy.deepcopy(bf16), "fp8-rowwise", backend="emulated"), torch.bfloat16),
        "fp8-block": (FP8Linear.from_linear(copy.deepcopy(bf16), "fp8-block", backend="emulated"), torch.bfloat16),
        "torchao Float8Linear": (
            convert_to_float8_training(nn.Sequential(copy.deepcopy(bf16)), config=Float8LinearConfig())[0],
            torch.bfloat16,
        ),
        "int4-g64 (QAT)": (Int4Linear.from_linear(copy.deepcopy(bf16), "int4-g64"), torch.bfloat16),
        "int4-g64-a8 (QAT)": (Int4Linear.from_linear(copy.deepcopy(bf16), "int4-g64-a8"), torch.bfloat16),
        "int4-g64 packed (frozen)": (Int4Linear.from_linear(copy.deepcopy(bf16), "int4-g64").freeze(), torch.bfloat16),
    }
    return out


def step(module, x):
    y = module(x)
    y.float().pow(2).mean().backward()
    return y


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    torch.manual_seed(0)
    base = nn.Linear(D, D, bias=False)
    cfgs = configs(base)
    inputs = {name: torch.randn(*TOKENS, D).to(dt).requires_grad_() for name, (_, dt) in cfgs.items()}
    for name, (mod, _) in cfgs.items():  # warm up (and torchao's first-call setup)
        for _ in range(2):
            step(mod, inputs[name])
    times = {name: [] for name in cfgs}
    for _ in range(args.repeat):
        for name, (mod, _) in cfgs.items():
            t = time.perf_counter()
            step(mod, inputs[name])
            times[name].append(time.perf_counter() - t)
    rows = {}
    for name, (mod, _) in cfgs.items():
        saved, _ = saved_tensor_bytes(lambda: mod(inputs[name]))
        weight_bytes = sum(b.numel() * b.element_size() for b in list(mod.parameters()) + list(mod.buffers()))
        rows[name] = {"step_s": statistics.median(times[name]), "saved_activation_MB": saved / 1e6, "weight_MB": weight_bytes / 1e6}
    for name, r in rows.items():
        r["time_vs_fp32"] = r["step_s"] / rows["fp32"]["step_s"]
        r["time_vs_bf16"] = r["step_s"] / rows["bf16"]["step_s"]
        r["activation_vs_bf16"] = r["saved_activation_MB"] / max(rows["bf16"]["saved_activation_MB"], 1e-9)
    print(f"{'format':<26}{'step ms':>9}{'vs fp32':>9}{'vs bf16':>9}{'saved act MB':>14}{'act vs bf16':>12}{'weight MB':>11}")
    for name, r in rows.items():
        print(f"{name:<26}{r['step_s'] * 1e3:>9.1f}{r['time_vs_fp32']:>9.2f}{r['time_vs_bf16']:>9.2f}"
              f"{r['saved_activation_MB']:>14.1f}{r['activation_vs_bf16']:>12.2f}{r['weight_MB']:>11.1f}")  # fmt: skip
    path = write_json("layers.json", {"shape": {"in": D, "out": D, "tokens": TOKENS}, "repeat": args.repeat, **machine(), "results": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
