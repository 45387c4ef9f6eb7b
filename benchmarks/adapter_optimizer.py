"""The LoRA adapters' optimizer states: memory saved against step time, fp32 AdamW vs 8-bit and 4-bit states.

The adapters of LoRA r=16 on every linear of the SmolLM2-135M and Llama-3.2-1B shapes (``scale.py``'s configs),
random gradients, each optimizer stepping them in this process in turn (interleaved repeats, median):

- ``adamw_torch``: ``torch.optim.AdamW``, fp32 states;
- ``adamw_torch_8bit`` / ``adamw_torch_4bit``: torchao's ``AdamW8bit`` / ``AdamW4bit`` (block-wise quantized
  states; transformers' ``optim`` names for the same classes);
- ``adamw_hf_lowprec_8bit``: ``hf_lowprec.training.adamw8bit.AdamW8bit``, torchao's 8-bit states and numerics with
  a one-pass C++ step on CPUs (what ``finetune_int4_lora`` uses);
- ``adamw_bnb_8bit``: bitsandbytes' ``AdamW8bit`` (QLoRA's optimizer; its paged variant is not paged on a CPU).

Per optimizer: the states' bytes and the median step time; ``scale.py``'s INT4+LoRA step at the same shape
(``results/scale.json``, batch 1x256) puts the time in proportion.

    python benchmarks/adapter_optimizer.py [--repeats 5]

Writes benchmarks/results/adapter_optimizer.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from _util import RESULTS, machine, write_json
from scale import LORA, SIZES

from hf_lowprec.training.compensation import optimizer_state_bytes

SHAPES = ("smollm2-135m", "llama-3.2-1b")


def adapter_shapes(size: str, r: int = LORA["r"]) -> list[tuple[int, int]]:
    """``[out, in]`` of every LoRA A ``[r, in]`` and B ``[out, r]`` on the linears of ``size``'s decoder layers."""
    c = SIZES[size]
    head_dim = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
    h, i, q, kv = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    linears = [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]  # q k v o gate up down: (out, in)
    return [shape for out, inp in linears for shape in ((r, inp), (out, r))] * c["num_hidden_layers"]


def optimizers() -> dict:
    import bitsandbytes as bnb
    from torchao.optim import AdamW4bit, AdamW8bit

    from hf_lowprec.training.adamw8bit import AdamW8bit as OnePassAdamW8bit

    return {"adamw_torch": torch.optim.AdamW, "adamw_torch_8bit": AdamW8bit, "adamw_torch_4bit": AdamW4bit,
            "adamw_bnb_8bit": bnb.optim.AdamW8bit, "adamw_hf_lowprec_8bit": OnePassAdamW8bit}  # fmt: skip


def measure(size: str, repeats: int) -> dict:
    shapes = adapter_shapes(size)
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
    grads = [torch.randn(s, generator=gen) * 1e-3 for s in shapes]
    runs = {}
    for name, cls in optimizers().items():
        params = [torch.nn.Parameter(p.clone()) for p in start]
        runs[name] = (params, cls(params, lr=1e-4))
    times: dict[str, list[float]] = {name: [] for name in runs}
    for rep in range(2 + repeats):  # two warm-up steps (state allocation, torchao's compilation)
        for name, (params, opt) in runs.items():
            for p, g in zip(params, grads):
                p.grad = g
            t = time.perf_counter()
            opt.step()
            if rep >= 2:
                times[name].append(time.perf_counter() - t)
    base_ms = statistics.median(times["adamw_torch"]) * 1e3
    base_bytes = optimizer_state_bytes(runs["adamw_torch"][1])
    out = {"adapter_params": sum(p.numel() for p in start), "optimizers": {}}
    for name, (_, opt) in runs.items():
        ms, nb = statistics.median(times[name]) * 1e3, optimizer_state_bytes(opt)
        out["optimizers"][name] = {"step_ms": ms, "state_mb": nb / 2**20, "time_vs_adamw": ms / base_ms,
                                   "state_saved_mb": (base_bytes - nb) / 2**20}  # fmt: skip
    scale = json.loads((RESULTS / "scale.json").read_text()) if (RESULTS / "scale.json").is_file() else {}
    step = next((r["train"]["1x256"]["step_s_median"] for r in scale.get("results", [])
                 if r["size"] == size and r["config"] == "int4-lora"), None)  # fmt: skip
    if step:
        out["int4_lora_step_s"] = step
        for r in out["optimizers"].values():
            r["extra_vs_int4_lora_step"] = (r["step_ms"] - base_ms) / 1e3 / step
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    results = {}
    for size in SHAPES:
        results[size] = measure(size, args.repeats)
        for name, r in results[size]["optimizers"].items():
            extra = f", +{r['extra_vs_int4_lora_step']:.0%} of the INT4+LoRA step" if "extra_vs_int4_lora_step" in r else ""
            print(f"{size:13s} {name:21s} {r['step_ms']:7.1f} ms ({r['time_vs_adamw']:.1f}x){extra}, states "
                  f"{r['state_mb']:6.1f} MB (saves {r['state_saved_mb']:5.1f})", flush=True)  # fmt: skip
    write_json("adapter_optimizer.json", {**machine(), "lora": LORA, "repeats": args.repeats, "results": results})


if __name__ == "__main__":
    main()
