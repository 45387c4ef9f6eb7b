"""FP8 training speed and memory on a CUDA GPU: bf16 vs hf-lowprec's FP8 plans vs torchao's recipes.

A Llama of ~1.1B parameters built from a config (TinyLlama's shape), batch 4 x 2048 tokens, fused AdamW, median step of
10 after 5 warm-up steps, each configuration in a fresh model in this process (peak memory reset between them). Every
configuration but the eager rows compiles each decoder layer (``layer.compile()``: torchao's FP8 casts are fast only
fused, and identical layers share one compilation); the emulated fp8-block runs eager. A smoke check runs first (one
FP8 layer per torchao format on torchao's kernels, against the emulation), so a broken setup fails in seconds. The JSON
is rewritten after each configuration: a run cut short keeps what it measured. Run by benchmarks/gpu.sh:

    python benchmarks/gpu_fp8.py --out benchmarks/results/gpu.json
"""

from __future__ import annotations

import argparse
import collections
import copy
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _train_step import train_step  # noqa: E402

from hf_lowprec import FP8Linear, PrecisionPlan, apply_plan  # noqa: E402

CONFIG = dict(
    hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
    vocab_size=32000, max_position_embeddings=2048,
)  # fmt: skip
# (name, compiled): "bf16" (compiled) is the baseline every ratio divides by
RUNS = [
    ("bf16", True), ("hf-lowprec fp8", True), ("torchao tensorwise", True), ("hf-lowprec fp8-rowwise", True),
    ("torchao rowwise", True), ("bf16 (eager)", False), ("hf-lowprec fp8 (eager)", False),
    ("hf-lowprec fp8-block", False),
]  # fmt: skip
ON_TORCHAO = ("fp8", "fp8-rowwise")  # hf-lowprec formats torchao's kernels run: refused if a layer runs emulated


def smoke() -> dict:
    """One FP8Linear per format torchao's kernels run, forward and backward on CUDA in bf16: its backend ``torchao``,
    its output within 2% (relative norm) of the emulation's. Raises otherwise."""
    out = {}
    for fmt in ON_TORCHAO:
        torch.manual_seed(0)
        linear = nn.Linear(512, 1024, device="cuda", dtype=torch.bfloat16)
        fast = FP8Linear.from_linear(copy.deepcopy(linear), fmt)
        if fast.backend != "torchao":
            raise RuntimeError(f"{fmt}: backend {fast.backend} ({fast.torchao_blocker()})")
        emulated = FP8Linear.from_linear(copy.deepcopy(linear), fmt, backend="emulated")
        x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
        a, b = fast(x), emulated(x)
        a.float().square().sum().backward()
        rel = float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())
        if not rel < 0.02 or not torch.isfinite(fast.weight.grad).all():
            raise RuntimeError(f"{fmt}: torchao's output {rel:.3g} off the emulation's, or a non-finite gradient")
        out[fmt] = {"backend": fast.backend, "rel_vs_emulated": rel}
    return out


def build(name: str, compiled: bool):
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**CONFIG)).to(torch.bfloat16)
    note: dict = {"compiled": compiled}
    if name.startswith("hf-lowprec"):
        fmt = name.split(" ")[1]
        report = apply_plan(model, PrecisionPlan.uniform(fmt, keep=("lm_head",)))
        backends = collections.Counter(r.backend for r in report.layers if r.backend)
        note |= {"plan": str(report).splitlines()[0], "backends": dict(backends)}
        if fmt in ON_TORCHAO and set(backends) != {"torchao"}:
            raise RuntimeError(f"{fmt} layers ran {dict(backends)}, not torchao's kernels alone")
    elif name.startswith("torchao"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        recipe = name.split(" ")[1]
        convert_to_float8_training(
            model, config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=lambda m, fqn: fqn != "lm_head"
        )
        note["plan"] = f"torchao {recipe}"
    if compiled:
        for layer in model.model.layers:
            layer.compile()
    return model, note


def run(name: str, compiled: bool, steps: int, warmup: int, batch: int, seq: int) -> dict:
    model = opt = None
    try:
        started = time.perf_counter()
        model, note = build(name, compiled)
        params = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        ids = torch.randint(0, CONFIG["vocab_size"], (batch, seq), device="cuda")
        torch.cuda.reset_peak_memory_stats()
        times, losses = [], []
        for i in range(warmup + steps):  # the warm-up steps compile
            torch.cuda.synchronize()
            t = time.perf_counter()
            loss = train_step(lambda m=model: m(input_ids=ids, labels=ids).loss, opt, None, max_grad_norm=None)
            torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - t)
                losses.append(loss)
        return {
            "step_s": statistics.median(times), "peak_GB": torch.cuda.max_memory_allocated() / 1e9,
            "loss_first": losses[0], "loss_last": losses[-1], "params": params,
            "seconds_with_build_and_compile": time.perf_counter() - started, **note,
        }  # fmt: skip
    finally:
        del model, opt
        gc.collect()
        torch.cuda.empty_cache()


def write(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/gpu.json")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    args = ap.parse_args()
    import torchao

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "torchao": torchao.__version__,
        "transformers": transformers.__version__, "config": CONFIG, "batch": args.batch, "seq": args.seq,
        "steps": args.steps, "warmup": args.warmup, "smoke": smoke(), "results": {},
    }  # fmt: skip
    print("smoke", json.dumps(data["smoke"]), flush=True)
    results = data["results"]
    for name, compiled in RUNS:
        try:
            results[name] = run(name, compiled, args.steps, args.warmup, args.batch, args.seq)
        except Exception as e:  # report the failure of one configuration, keep measuring the others
            results[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
        base = results.get("bf16", {})
        for r in results.values():
            if "step_s" in r and "step_s" in base:
                r["time_vs_bf16"] = r["step_s"] / base["step_s"]
                r["memory_vs_bf16"] = r["peak_GB"] / base["peak_GB"]
        print(name, json.dumps(results[name]), flush=True)
        write(out, data)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
