"""FP8 training speed and memory on a CUDA GPU: bf16 vs hf-lowprec's FP8 plans vs torchao's recipes.

A Llama of ~1.1B parameters built from a config (TinyLlama's shape), batch 4 x 2048 tokens,
fused AdamW, median step of 10 after 5 warm-up steps, each configuration in a fresh model in this
process (peak memory reset between them). Run by benchmarks/gpu.sh on a lent H100/H200:

    python benchmarks/gpu_fp8.py --out benchmarks/results/gpu.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _train_step import train_step  # noqa: E402

from hf_lowprec import PrecisionPlan, apply_plan  # noqa: E402

CONFIG = dict(
    hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
    vocab_size=32000, max_position_embeddings=2048,
)  # fmt: skip


def build(name: str):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).to("cuda", torch.bfloat16)
    if name.startswith("hf-lowprec"):
        fmt = name.split(" ")[1]
        report = apply_plan(model, PrecisionPlan.uniform(fmt, keep=("lm_head",)))
        note = str(report).splitlines()[0]
    elif name.startswith("torchao"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        recipe = name.split(" ")[1]
        convert_to_float8_training(
            model, config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=lambda m, fqn: fqn != "lm_head"
        )
        note = f"torchao {recipe}"
    else:
        note = "bf16"
    return model, note


def run(name: str, steps: int, warmup: int, batch: int, seq: int) -> dict:
    model, note = build(name)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, CONFIG["vocab_size"], (batch, seq), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        loss = train_step(lambda m=model: m(input_ids=ids, labels=ids).loss, opt, None, max_grad_norm=None)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t)
            losses.append(loss)
    out = {"step_s": statistics.median(times), "peak_GB": torch.cuda.max_memory_allocated() / 1e9, "loss_last": losses[-1], "params": params, "note": note}
    del model, opt
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/gpu.json")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    args = ap.parse_args()
    names = ["bf16", "hf-lowprec fp8", "hf-lowprec fp8-rowwise", "torchao tensorwise", "torchao rowwise", "hf-lowprec fp8-block"]
    results = {}
    for name in names:
        try:
            results[name] = run(name, args.steps, args.warmup, args.batch, args.seq)
        except Exception as e:  # report the failure of one configuration, keep measuring the others
            results[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
        r = results[name]
        print(name, json.dumps(r), flush=True)
    base = results["bf16"]
    for r in results.values():
        if "step_s" in r and "step_s" in base:
            r["time_vs_bf16"] = r["step_s"] / base["step_s"]
            r["memory_vs_bf16"] = r["peak_GB"] / base["peak_GB"]
    data = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "config": CONFIG,
        "batch": args.batch, "seq": args.seq, "results": results,
    }  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
