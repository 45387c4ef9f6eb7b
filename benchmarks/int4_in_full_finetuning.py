"""How the auto plan's INT4 layers should train in full fine-tuning: an ablation (issue 17's auto-plan goal).

SmolLM2-135M-Instruct, the ``auto-mixed`` recipe's scanned plan (as ``finetune_quality.py``'s ``auto plan``), full
fine-tuning at lr 2e-5 for ``--steps`` steps of 1x256 Shakespeare tokens, one seed per invocation. What changes is
only how the plan's INT4 layers train:

- ``qat``: as the recipe does: fake-quantized with fp32 master weights and learned (LSQ) steps;
- ``frozen``: packed INT4 codes, nothing of them trained (what the layers contribute without training);
- ``frozen-steps``: the packed codes frozen, their group steps (and zero points when asymmetric) learned as the
  on-device recipe learns them (PEQA: gains at 1e-3, zero shifts at 1e-2);
- ``frozen-steps-lora``: the same plus a LoRA adapter (r=16, lr 2e-4) on each INT4 layer;
- ``keep-frozen``: a diagnostic, not a format: the plan's INT4 layers left in bf16 and frozen (what not training
  them costs without their INT4 error);
- ``bf16``: the baseline, no plan (``finetune_quality.py``'s ``bf16``).

Held-out perplexity on 16 blocks of two unseen plays: ``after`` as trained (FP8 layers in FP8) and ``exported``:
what the recipe's export (``weights: auto``) writes, the INT4 layers as packed codes and the FP8 layers' master
weights. ``--int4-format`` scans with that INT4 format instead of the recipe's. Appends one line per run to
``results/int4_in_full_finetuning.json`` (the plan of a seed and format is scanned once and kept in ``--work``).

    python benchmarks/int4_in_full_finetuning.py frozen-steps --seed 0 [--int4-format int4-g64-asym]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from _train_step import train_step
from _util import RESULTS, lm_batches, machine, write_json
from finetune_quality import BATCH, EVAL_BLOCKS, LR_FULL, SCANNED
from ondevice import _data

from hf_lowprec import PrecisionPlan, apply_plan, freeze, revert
from hf_lowprec.checkpoints import cache_root, default_checkpoint, load_pretrained
from hf_lowprec.modules.packed import PackedLinear
from hf_lowprec.ondevice import evaluate_loss
from hf_lowprec.ondevice.learned_steps import fold_learned_steps, learn_base_steps
from hf_lowprec.sensitivity import allocate, scan
from hf_lowprec.sensitivity.results import SCORES

VARIANTS = ("bf16", "qat", "frozen", "frozen-steps", "frozen-steps-lora", "keep-frozen")
LR_LORA, LR_GAIN, LR_SHIFT = 2e-4, 1e-3, 1e-2  # the on-device recipe's rates (adapters; ondevice.learned_steps)


def amp():
    return torch.autocast("cpu", torch.bfloat16)


def scanned_plan(
    model, train: torch.Tensor, seed: int, int4_format: str | None, budget: float | None, score: str | None, work: Path
) -> PrecisionPlan:
    """The auto-mixed recipe's plan for this seed (its formats, or fp8 + ``int4_format``; its loss budget, or
    ``budget`` nats/token, of its score or ``score``), scanned once and kept."""
    recipe = SCANNED["auto plan"]
    p = recipe.precision
    limits = dict(p.budget) | ({} if budget is None else {"max_loss_increase": budget})
    limits |= {} if score is None else {"score": score}
    path = work / (f"plan_seed{seed}_{int4_format or 'recipe'}{'' if budget is None else f'_budget{budget}'}"
                   f"{'' if score is None else f'_{score}'}.json")  # fmt: skip
    if not path.is_file():
        calib = lm_batches(train, recipe.training.per_device_train_batch_size, p.calibration_batches)
        with amp():
            result = scan(model, calib, formats=p.formats if int4_format is None else ["fp8", int4_format],
                          method=p.scan_method, seed=seed)  # fmt: skip
        work.mkdir(parents=True, exist_ok=True)
        allocate(result, keep=p.keep, **limits).save(path)
    return PrecisionPlan.load(path)


def prepare(variant: str, model, plan: PrecisionPlan):
    """``(model, optimizer parameter groups, conversion report)`` for one variant."""
    int4_layers = [k for k, f in plan.layers.items() if f.family == "int4"]
    if variant == "keep-frozen":
        kept = {k: "bf16" if k in int4_layers else f.name for k, f in plan.layers.items()}
        plan = PrecisionPlan(kept, default=plan.default)
    report = apply_plan(model, plan)
    if variant == "keep-frozen":
        for name, module in model.named_modules():
            if name in int4_layers:
                module.weight.requires_grad_(False)
    if variant in ("qat", "keep-frozen"):
        return model, [{"params": [q for q in model.parameters() if q.requires_grad]}], report
    freeze(model)  # the INT4 layers as packed codes
    if "steps" in variant:
        learn_base_steps(model)
    if "lora" in variant:
        from peft import LoraConfig, get_peft_model

        from hf_lowprec.modules.int4_lora import register_int4_lora

        targets = [n for n, m in model.named_modules() if isinstance(m, PackedLinear)]
        lora_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets)
        model = get_peft_model(model, register_int4_lora(lora_config))
        for n, q in model.named_parameters():  # PEFT froze the rest: full fine-tuning trains it
            if q.dtype.is_floating_point:
                q.requires_grad_(True)
    named = dict(model.named_parameters())
    lora = [q for n, q in named.items() if "lora_" in n]
    gain = [q for n, q in named.items() if n.endswith("step_gain")]
    shift = [q for n, q in named.items() if n.endswith("zero_shift")]
    special = {id(q) for q in lora + gain + shift}
    rest = [q for q in model.parameters() if q.requires_grad and id(q) not in special]
    groups = [{"params": rest}, {"params": lora, "lr": LR_LORA}, {"params": gain, "lr": LR_GAIN, "weight_decay": 0.0},
              {"params": shift, "lr": LR_SHIFT, "weight_decay": 0.0}]  # fmt: skip
    return model, [g for g in groups if g["params"]], report


def run(
    variant: str, seed: int, steps: int, int4_format: str | None, budget: float | None, score: str | None, work: Path
) -> dict:
    torch.manual_seed(seed)
    folder, gguf = default_checkpoint()
    model, tok = load_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
    model.config.use_cache = False
    train, evals = _data(tok, steps, EVAL_BLOCKS)
    if variant == "bf16":
        groups, report = [{"params": list(model.parameters())}], None
    else:
        plan = scanned_plan(model, train, seed, int4_format, budget, score, work)
        model, groups, report = prepare(variant, model, plan)
    with amp():
        before = math.exp(evaluate_loss(model, evals, BATCH))
    opt = torch.optim.AdamW(groups, lr=LR_FULL, weight_decay=0.0)
    params = [q for g in groups for q in g["params"]]
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))
    start, losses = time.perf_counter(), []
    model.train()
    for step in range(steps):
        ids = train[order[step : step + 1]]

        def loss_fn(ids=ids):
            with amp():
                return model(input_ids=ids, labels=ids).loss

        losses.append(train_step(loss_fn, opt, params))
    seconds = time.perf_counter() - start
    fold_learned_steps(model)
    with amp():
        after = math.exp(evaluate_loss(model, evals, BATCH))
    freeze(model)  # qat: its INT4 layers as packed codes ...
    revert(model)  # ... the FP8 layers' master weights: what the recipe's export (weights: auto) writes
    with amp():
        exported = math.exp(evaluate_loss(model, evals, BATCH))
    return {"variant": variant, "seed": seed, "int4_format": int4_format, "max_loss_increase": budget, "score": score,
            "steps": steps, "ppl_before": before, "ppl_after": after, "ppl_exported": exported,
            "train_seconds": seconds,
            "plan_fractions": report.fractions() if report else {}, "loss_last10": sum(losses[-10:]) / len(losses[-10:])}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variant", choices=VARIANTS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--int4-format", default=None, help="scan fp8 + this INT4 format (default: the recipe's)")
    ap.add_argument("--max-loss-increase", type=float, default=None, help="the allocator's budget (nats/token)")
    ap.add_argument("--score", default=None, choices=SCORES, help="the allocator's score (default: the recipe's)")
    ap.add_argument("--work", default=str(cache_root() / "int4_in_full_finetuning"), help="where plans are kept")
    args = ap.parse_args()
    row = run(args.variant, args.seed, args.steps, args.int4_format, args.max_loss_increase, args.score,
              Path(args.work))  # fmt: skip
    print(json.dumps(row), flush=True)
    path = RESULTS / "int4_in_full_finetuning.json"
    data = json.loads(path.read_text()) if path.is_file() else {"machine": machine(), "runs": []}
    data["runs"].append(row)
    write_json(path.name, data)


if __name__ == "__main__":
    main()
