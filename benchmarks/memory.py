"""Training-state bytes per parameter and peak memory of one training step, four ways (issue 4).

(a) fp32 weights, fp32 math, AdamW;
(b) bf16 autocast with fp32 master weights and AdamW (the usual mixed precision);
(c) bf16 weights, no master copy, 8-bit AdamW states (torchao), compensated by Kahan buffers
    (hf_lowprec.training.compensation.CompensatedOptimizer) or by stochastic rounding (torchao's own);
(d) (c) with every activation saved for backward stored in FP8 (hf_lowprec.training.activations, fp8); a
    variant also runs every Linear but the output head as FP8Linear (tensorwise: it saves its own
    input and weight in FP8).
Optimizer-state variants of (c) (bitsandbytes 8-bit, torchao FP8 / 4-bit, fp32) are measured too, and
the peers at (b)'s settings (fp32 master weights, AdamW, bf16 autocast, output head left alone):
torchao ``convert_to_float8_training``, Accelerate ``mixed_precision="fp8"`` (model prepared before
the optimizer is built: a one-call ``prepare(model, optimizer)`` would orphan the swapped weights), and
torchao QAT with int4 group-64 fake-quantized weights (``QATConfig(weight_config=IntxFakeQuantizeConfig)``).

Each configuration runs in a fresh subprocess (one intra-op thread): build the model (SmolLM2-135M's
architecture from its config, random weights), one warm-up step (torchao's optimizers compile there),
then the peak-RSS mark is reset (``/proc/self/clear_refs``) and one measured step runs; its peak is
``VmHWM``. By default glibc is told to serve every block of 64 KiB or more by mmap
(``MALLOC_MMAP_THRESHOLD_``), so freed tensors leave RSS and the peak follows live memory rather than
what the allocator kept from the warm-up; ``--allocator default`` measures glibc's own behaviour.
Reported per config: peak RSS (and per phase: forward+backward, optimizer step), peak minus the RSS
right after the imports, bytes of training state per parameter (weights + grads + optimizer states +
compensation buffers, counted from the tensors), and the measured step's time (one step on a shared
2-core machine: a rough figure).

Usage: ``python benchmarks/memory.py [--quick] [--only NAME ...] [--allocator mmap|default]``
(``--quick``: 4 layers, batch 2x128). Writes benchmarks/results/memory[_quick][_default_malloc].json and .png.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
# name: (description, weights, optimizer states, compensation, FP8 linears, FP8-stored activations[, peer conversion])
CONFIGS = {
    "a_fp32": ("fp32 weights + AdamW", "fp32", "fp32", None, False, False),
    "b_bf16_amp": ("bf16 autocast, fp32 master weights + AdamW", "amp", "fp32", None, False, False),
    "c_kahan_8bit": ("bf16 weights + Kahan + torchao 8-bit AdamW", "bf16", "8bit", "kahan", False, False),
    "c_sr_8bit": ("bf16 weights + stochastic rounding + torchao 8-bit AdamW", "bf16", "8bit", "stochastic", False, False),
    "d_kahan_8bit_fp8act": ("(c Kahan) + FP8-stored activations", "bf16", "8bit", "kahan", False, True),
    "d_sr_8bit_fp8act": ("(c stochastic) + FP8-stored activations", "bf16", "8bit", "stochastic", False, True),
    "d_sr_8bit_fp8act_fp8linear": ("(d stochastic) with FP8 linears (lm_head bf16)", "bf16", "8bit", "stochastic", True, True),
    "c_kahan_bnb8bit": ("bf16 weights + Kahan + bitsandbytes 8-bit AdamW", "bf16", "bnb-8bit", "kahan", False, False),
    "c_kahan_fp8states": ("bf16 weights + Kahan + torchao FP8-state AdamW", "bf16", "fp8", "kahan", False, False),
    "c_kahan_4bit": ("bf16 weights + Kahan + torchao 4-bit AdamW", "bf16", "4bit", "kahan", False, False),
    "c_kahan_fp32states": ("bf16 weights + Kahan + fp32-state AdamW", "bf16", "fp32", "kahan", False, False),
    "peer_torchao_float8": ("peer: torchao convert_to_float8_training, (b) settings", "amp", "fp32", None, False, False, "torchao-float8"),
    "peer_accelerate_fp8": ("peer: Accelerate mixed_precision='fp8', (b) settings", "fp32", "fp32", None, False, False, "accelerate-fp8"),
    "peer_torchao_qat_int4": ("peer: torchao QAT int4-g64 weights, (b) settings", "amp", "fp32", None, False, False, "torchao-qat-int4"),
}  # fmt: skip


def convert_peer(model, peer: str):
    """Apply a peer library's own conversion to ``model`` (every Linear but ``lm_head``); returns the model."""
    import torch

    not_head = lambda m, fqn: isinstance(m, torch.nn.Linear) and fqn != "lm_head"  # noqa: E731
    if peer == "torchao-float8":
        from torchao.float8 import convert_to_float8_training

        return convert_to_float8_training(model, module_filter_fn=not_head)
    if peer == "torchao-qat-int4":
        from torchao.quantization import quantize_
        from torchao.quantization.qat import IntxFakeQuantizeConfig, QATConfig

        weights = IntxFakeQuantizeConfig(torch.int4, group_size=64, is_symmetric=True)
        quantize_(model, QATConfig(weight_config=weights, step="prepare"), filter_fn=not_head)
        return model
    if peer == "accelerate-fp8":
        from accelerate import Accelerator

        return Accelerator(mixed_precision="fp8", cpu=True).prepare(model)  # converts and wraps forward in bf16 autocast
    raise ValueError(f"unknown peer {peer!r}")


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def run_one(name: str, quick: bool) -> dict:
    """One configuration, in this process: returns its measurements."""
    import gc

    import torch
    from _train_step import train_step
    from _util import proc_status_bytes, reset_peak_rss
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_lowprec import PrecisionPlan, apply_plan
    from hf_lowprec.training.activations import ActivationStorage
    from hf_lowprec.training.compensation import make_optimizer, optimizer_state_bytes

    torch.set_num_threads(1)  # two threads on two shared cores oversubscribe; memory does not depend on it
    rss_imports = proc_status_bytes("VmRSS")
    layers, batch, seq = (4, 2, 128) if quick else (30, 4, 256)
    cfg = LlamaConfig(  # SmolLM2-135M's architecture
        hidden_size=576, intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=9, num_key_value_heads=3,
        vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True, rms_norm_eps=1e-5,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    _, weights, states, compensation, fp8_linears, fp8_activations, *peer = CONFIGS[name]
    if peer:
        model = convert_peer(model, peer[0])
    if weights == "bf16":
        model = model.to(torch.bfloat16)
    if fp8_linears:  # the output head stays bf16, as in DeepSeek-V3 and torchao's recipes
        apply_plan(model, PrecisionPlan({"lm_head": "bf16"}, default="fp8"), fp8_backend="emulated")
    converted = sum(type(m).__name__ in ("Float8Linear", "FakeQuantizedLinear", "FP8Linear") for m in model.modules())
    if compensation is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        optimizer = make_optimizer(model.parameters(), states=states, compensation=compensation, lr=1e-4)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    n_params = sum(p.numel() for p in model.parameters())
    accounting = {}

    def forward():
        with torch.autocast("cpu", torch.bfloat16, enabled=weights == "amp"):
            with ActivationStorage(model, "fp8", min_numel=4096) if fp8_activations else contextlib.nullcontext():
                return model(input_ids=ids, labels=ids).loss

    def after_backward():
        accounting["peak_forward_backward"] = proc_status_bytes("VmHWM")
        reset_peak_rss()
        accounting["weights"] = _tensor_bytes(model.parameters())
        accounting["grads"] = _tensor_bytes(p.grad for p in model.parameters())

    def step():
        reset_peak_rss()
        loss = train_step(forward, optimizer, model.parameters(), max_grad_norm=None, after_backward=after_backward)
        accounting["peak_optimizer_step"] = proc_status_bytes("VmHWM")
        accounting["optimizer"] = optimizer_state_bytes(optimizer)
        return loss

    step()  # warm-up: optimizer states exist, torchao has compiled
    gc.collect()
    rss_before = proc_status_bytes("VmRSS")
    start = time.perf_counter()
    loss = step()
    seconds = time.perf_counter() - start
    phases = {"forward_backward": accounting.pop("peak_forward_backward") / 2**20,
              "optimizer_step": accounting.pop("peak_optimizer_step") / 2**20}  # fmt: skip
    peak = max(phases.values()) * 2**20
    state = accounting["weights"] + accounting["grads"] + accounting["optimizer"]
    return {
        "config": name, "description": CONFIGS[name][0], "params": n_params, "loss": loss, "step_s": seconds,
        "peak_rss_mb": peak / 2**20, "rss_imports_mb": rss_imports / 2**20, "rss_before_step_mb": rss_before / 2**20,
        "peak_above_imports_mb": (peak - rss_imports) / 2**20, "peak_rss_by_phase_mb": phases,
        "state_bytes_per_param": state / n_params,
        "state_breakdown_bytes_per_param": {k: v / n_params for k, v in accounting.items()},
        "torch_threads": torch.get_num_threads(), "low_precision_linears": converted,
    }  # fmt: skip


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["config"] for r in results]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.2))
    ax1.barh(names, [r["peak_rss_mb"] for r in results], label="peak RSS", color="#9ecae1")
    ax1.barh(names, [r["peak_above_imports_mb"] for r in results], label="peak minus RSS after imports", color="#3182bd")
    base = next((r for r in results if r["config"] == "b_bf16_amp"), None)
    if base is not None:
        ax1.axvline(0.55 * base["peak_rss_mb"], color="#de2d26", linestyle="--", label="goal: 0.55 x (b) peak RSS")
    ax1.set_xlabel("MB during one training step")
    ax1.invert_yaxis()
    ax1.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, fontsize=8)
    left = [0.0] * len(results)
    for part, color in (("weights", "#31a354"), ("grads", "#fd8d3c"), ("optimizer", "#756bb1")):
        vals = [r["state_breakdown_bytes_per_param"][part] for r in results]
        ax2.barh(names, vals, left=left, label=part if part != "optimizer" else "optimizer states + compensation", color=color)
        left = [a + b for a, b in zip(left, vals)]
    ax2.set_xlabel("training-state bytes per parameter")
    ax2.invert_yaxis()
    ax2.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=90)
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 layers, batch 2x128")
    parser.add_argument("--only", nargs="*", choices=list(CONFIGS), help="run these configurations only")
    parser.add_argument("--allocator", choices=["mmap", "default"], default="mmap",
                        help="mmap: glibc serves every block >= 64 KiB by mmap and returns it on free, so RSS "
                             "follows live tensors; default: glibc's own thresholds (freed memory may stay resident)")
    parser.add_argument("--child", choices=list(CONFIGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_one(args.child, args.quick)))
        return
    results = []
    for name in args.only or CONFIGS:
        cmd = [sys.executable, __file__, "--child", name] + (["--quick"] if args.quick else [])
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
        if args.allocator == "mmap":
            env["MALLOC_MMAP_THRESHOLD_"] = "65536"
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        results.append(r)
        print(f"{name:26s} peak {r['peak_rss_mb']:7.0f} MB  above imports {r['peak_above_imports_mb']:7.0f} MB  "
              f"(fwd+bwd {r['peak_rss_by_phase_mb']['forward_backward']:6.0f}, optimizer {r['peak_rss_by_phase_mb']['optimizer_step']:6.0f})  "
              f"state {r['state_bytes_per_param']:5.2f} B/param  step {r['step_s']:6.1f} s  loss {r['loss']:.3f}  "
              f"low-precision linears {r['low_precision_linears']}", flush=True)  # fmt: skip
    by = {r["config"]: r for r in results}
    ratios = {}
    if "b_bf16_amp" in by:
        base = by["b_bf16_amp"]
        for r in results:
            ratios[r["config"]] = {
                "peak_rss_vs_b": r["peak_rss_mb"] / base["peak_rss_mb"],
                "peak_above_imports_vs_b": r["peak_above_imports_mb"] / base["peak_above_imports_mb"],
                "state_bytes_vs_b": r["state_bytes_per_param"] / base["state_bytes_per_param"],
            }
        print("\nratios to (b) bf16 AMP + fp32 master:")
        for name, rr in ratios.items():
            print(f"  {name:26s} peak RSS {rr['peak_rss_vs_b']:.3f}x  peak above imports {rr['peak_above_imports_vs_b']:.3f}x  "
                  f"state {rr['state_bytes_vs_b']:.3f}x")  # fmt: skip
    from _util import machine, write_json  # imports torch: not before the children ran

    suffix = ("_quick" if args.quick else "") + ("_default_malloc" if args.allocator == "default" else "")
    out = {"quick": args.quick, "allocator": args.allocator, **machine(), "threads": 1, "results": results,
           "ratios_to_b": ratios, "goal": "(d) peak <= 0.55x (b) peak"}  # fmt: skip
    write_json(f"memory{suffix}.json", out)
    shape = "4 layers, batch 2x128" if args.quick else "batch 4x256"
    plot(results, RESULTS / f"memory{suffix}.png", f"SmolLM2-135M architecture ({shape}), one training step, CPU, {args.allocator} allocator")


if __name__ == "__main__":
    main()
