"""Fine-tuning quality on the pretrained checkpoint: bf16 vs FP8 vs an auto plan vs on-device INT4 LoRA.

SmolLM2-135M-Instruct, the same Shakespeare blocks in the same order for every run (two plays held
out for evaluation), side by side in one process:

- ``bf16``: full fine-tuning, bf16 autocast with fp32 master weights (the baseline);
- ``fp8``: the same with every linear but the output head in FP8 (E4M3/E5M2, tensorwise, emulated on a CPU; the
  ``fp8-train`` recipe's plan until 2026-12-03);
- ``fp8 (e4m3 grads)``: the same with the output gradients in E4M3 (one more mantissa bit, less range) instead of E5M2;
- ``fp8 (exact weights)``: an analysis, not a format: ``fp8`` whose weights are not quantized (inputs and gradients
  are), to tell how much of the gap the 3-bit-mantissa weights make;
- ``fp8 (gptq)``: the same as ``fp8``, its master weights first moved to the FP8 grid points GPTQ chooses on 16 training blocks
  (``round_fp8_weights``; a recipe's ``rounding: gptq``);
- ``fp8 (scan)``: the ``fp8-train`` recipe's plan, read from the recipe: the sensitivity scan over its candidates
  (plain/rotated/MX FP8) on its calibration batches of the training blocks, then the allocator's choice under its
  budget (>= 90% of the linears' parameters, ``lm_head`` kept, in FP8);
- ``auto plan``: the ``auto-mixed`` recipe's plan, read from the recipe as for ``fp8 (scan)``: FP8/INT4 per layer
  within its predicted loss budget (until 2026-12-03: a Fisher scan and INT4 on half the parameters);
- ``auto plan (steps 10x)``: an ablation, the same with the INT4 layers' learned (LSQ) steps at 10x the rate
  (2026-12-03, 200 steps, seed 0, vs bf16 of that seed: served 1.033x, INT4 packed 1.023x, against 1.025x and 1.020x
  at one rate; ``results/finetune_quality_steps_lr.json``);
- ``int4 LoRA``: a packed INT4 base (int4-g64-asym, GPTQ rounding; the ``int4-ondevice-lora`` recipe's of
  2026-12-02, which now rounds to nearest with LoftQ and learned zero points) + LoRA r=16 on every linear; only the adapters train (10x the full fine-tuning learning rate,
  as usual for LoRA).

Reports held-out perplexity before and after ``--steps`` steps and the gap to bf16; for the full fine-tuning runs in low
precision also that of their trained master weights served in bf16 (the layers reverted): what the training itself
left, apart from the format's error at evaluation. With several ``--seeds`` (the
training blocks' order; LoRA's initialization) each run is repeated per seed and the table gives means and standard
deviations, the gap to bf16 paired by seed. Writes benchmarks/results/finetune_quality.json (or ``--out``).

    python benchmarks/finetune_quality.py [--steps 30]
    python benchmarks/finetune_quality.py --steps 200 --batch 1 --seeds 0 1 2 --only bf16 fp8 "fp8 (gptq)" \
        --out finetune_quality_200steps.json
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from contextlib import nullcontext

import torch
from _train_step import train_step
from _util import RESULTS, lm_batches, machine, mean_std, write_json
from ondevice import _data
from outliers import exact_operand

from hf_lowprec import PrecisionPlan, apply_plan, freeze, revert
from hf_lowprec.checkpoints import default_checkpoint, load_pretrained
from hf_lowprec.convert import packs_when_frozen
from hf_lowprec.ondevice import evaluate_loss, prepare_int4_lora
from hf_lowprec.ondevice.calibration.fp8 import round_fp8_weights
from hf_lowprec.recipe import load_recipe
from hf_lowprec.sensitivity import allocate, scan

BATCH, BLOCK, SEED, EVAL_BLOCKS = 4, 256, 0, 16  # BATCH and SEED: the defaults of --batch and --seeds
LR_FULL, LR_LORA = 2e-5, 2e-4
RUNS = ("bf16", "fp8", "fp8 (e4m3 grads)", "fp8 (exact weights)", "fp8 (gptq)", "fp8 (scan)", "auto plan",
        "auto plan (steps 10x)", "int4 LoRA")
SCANNED = {"fp8 (scan)": load_recipe("fp8-train"), "auto plan": load_recipe("auto-mixed"),
           "auto plan (steps 10x)": load_recipe("auto-mixed")}  # runs whose recipe scans
STEP_LR_SCALE = {"auto plan (steps 10x)": 10.0}  # the INT4 layers' learned steps train at this times the rate


def prepare(name: str, model, train: torch.Tensor, seed: int) -> tuple[torch.nn.Module, list, float, dict]:
    """``(model, trainable parameters, learning rate, notes)`` for one run."""
    if name == "bf16":
        return model, list(model.parameters()), LR_FULL, {}
    if name in ("fp8", "fp8 (e4m3 grads)", "fp8 (exact weights)", "fp8 (gptq)"):
        grads = torch.float8_e4m3fn if name == "fp8 (e4m3 grads)" else torch.float8_e5m2
        report = apply_plan(model, PrecisionPlan.uniform("fp8", keep=("lm_head",)), grad_dtype=grads)
        notes = {"plan_fractions": report.fractions()}
        if name == "fp8 (gptq)":
            with torch.autocast("cpu", torch.bfloat16):
                notes["rounding"] = round_fp8_weights(model, train[: 4 * BATCH])
        return model, list(model.parameters()), LR_FULL, notes
    if name in SCANNED:
        t = time.perf_counter()
        recipe = SCANNED[name]
        p = recipe.precision
        calib = lm_batches(train, recipe.training.per_device_train_batch_size, p.calibration_batches)
        with torch.autocast("cpu", torch.bfloat16):
            result = scan(model, calib, formats=p.formats, method=p.scan_method, seed=seed)
        plan = allocate(result, keep=p.keep, **p.budget)
        report = apply_plan(model, plan)
        params = list(model.parameters())  # learned INT4 steps included
        return model, params, LR_FULL, {"plan_fractions": report.fractions(), "scan_seconds": time.perf_counter() - t}
    from peft import LoraConfig

    t = time.perf_counter()
    model = model.to(torch.bfloat16)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
    peft_model, report = prepare_int4_lora(model, lora, rounding="gptq", calibration=train[: 4 * BATCH])
    params = [p for p in peft_model.parameters() if p.requires_grad]
    return peft_model, params, LR_LORA, {"plan_fractions": report.fractions(), "calibration": report.calibration, "prepare_seconds": time.perf_counter() - t}


def train_steps(model, params, lr: float, train: torch.Tensor, steps: int, batch: int, seed: int, amp,
                step_lr_scale: float = 1.0):
    """``steps`` AdamW steps on blocks of ``train`` in the seed's order, the INT4 layers' learned steps at
    ``step_lr_scale`` times ``lr``; ``(losses, seconds)``."""
    faster = set()
    if step_lr_scale != 1.0:
        faster = {id(p) for n, p in model.named_parameters() if n.endswith("weight_quantizer.step")}
    groups = [{"params": [p for p in params if id(p) not in faster]}]
    if faster:
        groups.append({"params": [p for p in params if id(p) in faster], "lr": lr * step_lr_scale})
    opt = torch.optim.AdamW(groups, lr=lr, weight_decay=0.0)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))
    losses, t = [], time.perf_counter()
    model.train()
    for step in range(steps):
        ids = train[order[step * batch : (step + 1) * batch]]

        def loss_fn(ids=ids):
            with amp():
                return model(input_ids=ids, labels=ids).loss

        losses.append(train_step(loss_fn, opt, params))
    return losses, time.perf_counter() - t


def run(name: str, steps: int, seed: int = SEED, batch: int = BATCH) -> dict:
    folder, gguf = default_checkpoint()
    torch.manual_seed(seed)
    model, tok = load_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
    model.config.use_cache = False
    train, evals = _data(tok, steps * batch, EVAL_BLOCKS)
    autocast = name != "int4 LoRA"  # the INT4 LoRA model computes in bf16 itself
    amp = (lambda: torch.autocast("cpu", torch.bfloat16)) if autocast else nullcontext
    with amp():
        base_eval = evaluate_loss(model, evals, BATCH)  # the unquantized checkpoint, for reference
    model, params, lr, notes = prepare(name, model, train, seed)
    with exact_operand(model, "weight") if name == "fp8 (exact weights)" else nullcontext():
        with amp():
            eval_before = evaluate_loss(model, evals, BATCH)
        losses, seconds = train_steps(model, params, lr, train, steps, batch, seed, amp, STEP_LR_SCALE.get(name, 1.0))
        with amp():
            eval_after = evaluate_loss(model, evals, BATCH)
    if name not in ("bf16", "int4 LoRA"):
        if any(packs_when_frozen(m) for m in model.modules()):  # what export 'int4-packed' writes
            packed = copy.deepcopy(model)
            freeze(packed)  # INT4 layers as their packed codes ...
            revert(packed)  # ... the others with their master weights
            with amp():
                notes["ppl_after_int4_packed"] = math.exp(evaluate_loss(packed, evals, BATCH))
            del packed
        revert(model)  # the trained master weights, served in bf16 (the low-precision layers reverted)
        with amp():
            notes["ppl_after_master"] = math.exp(evaluate_loss(model, evals, BATCH))
    return {"checkpoint_ppl": math.exp(base_eval), "ppl_before": math.exp(eval_before), "ppl_after": math.exp(eval_after),
            "eval_loss_after": eval_after, "losses": losses, "train_seconds": seconds, "lr": lr,
            "trainable_params": sum(p.numel() for p in params), **notes}  # fmt: skip


def summarize(per_seed: dict[str, list[dict]]) -> dict[str, dict]:
    """Per run: the per-seed results, and the means (with ``_std``) of the perplexities and of the gap to bf16 of
    the same seed."""
    out = {}
    for name, runs in per_seed.items():
        r = {"per_seed": runs}
        for key in ("ppl_before", "ppl_after"):
            r[key], r[f"{key}_std"] = mean_std([x[key] for x in runs])
        if "bf16" in per_seed:
            ratios = [x["ppl_after"] / b["ppl_after"] for x, b in zip(runs, per_seed["bf16"])]
            r["ppl_after_vs_bf16"], r["ppl_after_vs_bf16_std"] = mean_std(ratios)
            if all("ppl_after_master" in x for x in runs):
                ratios = [x["ppl_after_master"] / b["ppl_after"] for x, b in zip(runs, per_seed["bf16"])]
                r["master_in_bf16_vs_bf16"], r["master_in_bf16_vs_bf16_std"] = mean_std(ratios)
            if all("ppl_after_int4_packed" in x for x in runs):
                ratios = [x["ppl_after_int4_packed"] / b["ppl_after"] for x, b in zip(runs, per_seed["bf16"])]
                r["int4_packed_vs_bf16"], r["int4_packed_vs_bf16_std"] = mean_std(ratios)
        r["plan_fractions"] = runs[0].get("plan_fractions", {})
        out[name] = r
    return out


def kept_runs(path, args) -> dict[str, list[dict]]:
    """The per-seed runs of an earlier result file that this invocation does not rerun; ``ValueError`` if that file was
    made with other steps, batch or seeds."""
    old = json.loads(path.read_text())
    settings = {"steps": args.steps, "batch": args.batch, "seeds": args.seeds}
    if {k: old[k] for k in settings} != settings:
        raise ValueError(f"--merge: {path} has {({k: old[k] for k in settings})}, this run {settings}")
    return {name: r["per_seed"] for name, r in old["results"].items() if name not in (args.only or RUNS)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=BATCH)
    ap.add_argument("--seeds", type=int, nargs="+", default=[SEED])
    ap.add_argument("--only", nargs="*", choices=RUNS)
    ap.add_argument("--out", default="finetune_quality.json")
    ap.add_argument("--merge", action="store_true", help="keep the --out file's other runs (same steps, batch, seeds)")
    args = ap.parse_args()
    per_seed: dict[str, list[dict]] = {}
    if args.merge:
        per_seed = kept_runs(RESULTS / args.out, args)
    for seed in args.seeds:
        for name in args.only or RUNS:
            r = run(name, args.steps, seed, args.batch)
            per_seed.setdefault(name, []).append(r)
            print(f"seed {seed} {name:<10} ppl {r['ppl_before']:.2f} -> {r['ppl_after']:.2f}  ({r['train_seconds']:.0f} s)", flush=True)
    write_json(args.out, {"steps": args.steps, "batch": args.batch, "block": BLOCK, "seeds": args.seeds, "eval_blocks": EVAL_BLOCKS,
                          **machine(), "results": summarize(per_seed)})  # fmt: skip


if __name__ == "__main__":
    main()
