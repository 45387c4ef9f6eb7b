"""GEMM throughput per CPU kernel on SmolLM2-135M and Llama-3.2-1B linear shapes, as ratios to the fp32 GEMM.

Kernels: dense fp32 / bf16 / int8 ``torch._int_mm`` (where the CPU has int8 dot products), torch's weight-only
``_weight_int4pack_mm_for_cpu`` / ``_weight_int8pack_mm``, and the packed INT4 layer's backends (forward and
grad-input), all in this process one after the other (``hf_lowprec.modules.throughput``). Results go to
``results/kernels-<CPU class>[-<tokens>tok][-emulated].json`` and ``.png``, so each CPU class (and token count other
than 256, and a class reproduced on a larger CPU with ``HF_LOWPREC_CPU_CLASS``) keeps its own file.

    python benchmarks/kernel_speed.py [--tokens 256] [--repeats 5]

(Not kernels.py: benchmark scripts run from this folder, where that name would shadow the PyPI package
``kernels`` that bitsandbytes imports.)
"""

from __future__ import annotations

import argparse
import os

import torch
from _util import RESULTS, machine, write_json

from hf_lowprec.modules.kernels.cpu import cpu_info
from hf_lowprec.modules.throughput import kernel_throughput

SHAPES = {  # name -> (in_features K, out_features N)
    "SmolLM2 q/o 576x576": (576, 576),
    "SmolLM2 k/v 576->192": (576, 192),
    "SmolLM2 gate/up 576->1536": (576, 1536),
    "SmolLM2 down 1536->576": (1536, 576),
    "Llama-1B q/o 2048x2048": (2048, 2048),
    "Llama-1B k/v 2048->512": (2048, 512),
    "Llama-1B gate/up 2048->8192": (2048, 8192),
    "Llama-1B down 8192->2048": (8192, 2048),
}


def plot(results: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kernels = [k for k in next(iter(results.values())) if k != "fp32"]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(kernels)
    for i, kernel in enumerate(kernels):
        ratios = [results[s].get(kernel, {}).get("vs_fp32", 0.0) for s in results]
        ax.bar([j + i * width for j in range(len(results))], ratios, width, label=kernel)
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(results))], list(results), rotation=20, ha="right", fontsize=8)
    ax.set(ylabel="throughput / fp32 GEMM (log)", yscale="log", title=f"CPU kernels, {cpu_info().cpu_class} ({cpu_info().model})")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256, help="rows of the activations (batch x sequence)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    results = {}
    for name, (k, n) in SHAPES.items():
        results[name] = kernel_throughput(args.tokens, k, n, args.repeats)
        print(name, "  ".join(f"{kernel} {r['vs_fp32']:.2f}x" for kernel, r in results[name].items()), flush=True)
    stem = f"kernels-{cpu_info().cpu_class}" + ("" if args.tokens == 256 else f"-{args.tokens}tok")
    stem += "-emulated" if cpu_info().restricted_to else ""  # never over a real CPU of the class's file
    write_json(f"{stem}.json", {"tokens": args.tokens, "machine": machine(), "shapes": SHAPES,
                                "results": results})  # fmt: skip
    plot(results, RESULTS / f"{stem}.png")
    print(f"wrote results/{stem}.json and .png")


if __name__ == "__main__":
    main()
