"""On-device LoRA fine-tuning of SmolLM2-135M-Instruct on a CPU: hf-lowprec INT4 LoRA against its peers.

Same data (Shakespeare, batch 4 x 256 tokens, two plays held out), same seed, LoRA r=16 / alpha 32 on
all linear layers, AdamW lr 2e-4, side by side; every configuration runs in a fresh subprocess so its
peak RSS (``ru_maxrss``, loading included) is its own.

    python benchmarks/ondevice.py speed [--steps 10 --warmup 3 --repeats 2]   # step time + peak RSS
    python benchmarks/ondevice.py quality [--steps 100] [--configs ...] [--int4-variants awq+gptq+loftq keep20+loftq]  # perplexity after N steps
    python benchmarks/ondevice.py demo [--steps 50]                            # the CLI default, end to end
    python benchmarks/ondevice.py plot                                         # PNG from the JSON

Configurations (``speed`` runs each with and without gradient checkpointing = "equal settings", each with its own
default optimizer: 8-bit AdamW for hf-lowprec, torch's AdamW for the peers; its own default is marked): fp32 LoRA, bf16 LoRA with PEFT's fp32 adapters and with bf16 adapters, bnb NF4
QLoRA (double quant, bf16 compute), hf-lowprec INT4 LoRA (``INT4_DEFAULT``: the int4-ondevice-lora recipe's
base, every linear but lm_head int4-g64-asym with its zero points learned; LoftQ; chunked loss; int8-stored
activations unless checkpointing). Peers compute their loss the way
transformers does (full logits). ``--int4-variants`` name other INT4 settings (see ``parse_variant``).

Writes benchmarks/results/ondevice.json and ondevice.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _train_step import train_step
from _util import machine

from hf_lowprec.modules.kernels.cpu import cpu_info

RESULTS = Path(__file__).parent / "results"
MARK = "@@RESULT@@"
HELD_OUT = ("hamlet_gut", "tempest_gut")
BATCH, BLOCK, LR = 4, 256, 2e-4
SEED = 0  # adapter init and data order; set by --seed
CALIBRATION_BLOCKS = 16  # calibration blocks (x BLOCK tokens) for --rounding gptq / awq / awq+gptq
THREADS = 2  # set by --threads
RESULTS_FILE = "ondevice.json"  # set by --results-file (e.g. quality runs on another CPU class, kept apart)
# name: (description, default gradient checkpointing)
CONFIGS = {
    "fp32-lora": ("fp32 LoRA", False),
    "bf16-lora": ("bf16 LoRA, fp32 adapters (PEFT default)", False),
    "bf16-lora-bf16ad": ("bf16 LoRA, bf16 adapters", False),
    "bnb-nf4": ("bnb NF4 QLoRA", False),
    "int4-lora": ("hf-lowprec INT4 LoRA (int8-stored activations unless checkpointing)", False),
    "int4-lora-plain": ("hf-lowprec INT4 LoRA without int8-stored activations (ablation)", False),
}
# what int4-lora* runs: the int4-ondevice-lora recipe's base (every linear int4-g64-asym, its steps and zero points learned),
# LoftQ init, 8-bit AdamW (see parse_variant); until 2026-12-03 "auto+loftq+adam8" (a scanned plan, half int8)
INT4_DEFAULT = "loftq+adam8+zeros"
GC_VARIANTS = {"int4-lora-plain": (False,)}  # the plain ablation with checkpointing is int4-lora+gc


# ------------------------------------------------------------------------------------- child
def _data(tokenizer, n_train: int, n_eval: int):
    from hf_lowprec.checkpoints import shakespeare_files
    from hf_lowprec.ondevice import token_blocks

    files = shakespeare_files()
    read = lambda fs: [p.read_text(encoding="latin-1") for p in fs]  # noqa: E731
    train = token_blocks(tokenizer, read([p for p in files if p.stem not in HELD_OUT]), BLOCK, n_train)
    evals = token_blocks(tokenizer, read([p for p in files if p.stem in HELD_OUT]), BLOCK, n_eval) if n_eval else None
    return train, evals


def _build(config: str, loftq: bool, rounding: str, gc: bool, budget_bits: float = 0.0, kept_format: str = "int8", backend: str = "auto",
           rotate: bool = False, int4_format: str = "int4-g64-asym", adapter_dtype: str = "fp32", learn_steps: bool | str = False):  # fmt: skip
    """``(model, tokenizer, loss_fn(batch) -> loss, notes)`` for one configuration."""
    import torch
    from peft import LoraConfig, get_peft_model

    from hf_lowprec.checkpoints import default_checkpoint, load_pretrained
    from hf_lowprec.ondevice import chunked_causal_lm_loss

    folder, gguf = default_checkpoint()
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
    hf_loss = lambda m: (lambda b: m(input_ids=b, labels=b).loss)  # noqa: E731
    torch.manual_seed(SEED)
    if config.startswith("int4-lora"):
        from hf_lowprec.ondevice import load_int4_lora
        from hf_lowprec.training.activations import ActivationStorage

        scanned = bool(budget_bits) or rotate
        # budget_bits: the product's scanned plan (int4_format, the most sensitive layers kept_format); 0: every Linear int4
        # rotate: the scan also scores int4_format-rht and chooses per layer (with budget_bits 0: every Linear one of the two)
        int4 = (int4_format, f"{int4_format}-rht") if rotate else (int4_format,)
        budget = {"target_bits_per_param": budget_bits} if budget_bits else {"min_fp8_fraction": 1.0}
        auto = {"budget": budget, "auto_formats": int4 + ((kept_format,) if kept_format != "bf16" and budget_bits else ())}
        first_blocks = (lambda tok: _data(tok, CALIBRATION_BLOCKS, 0)[0]) if rounding != "nearest" or scanned else None  # the first training blocks
        # the product's path: packed while loading, the scan, calibration and LoftQ reading the dense weights back
        model, tok, report = load_int4_lora(folder, lora, "auto" if scanned else int4_format, gguf_file=gguf, loftq_init=loftq, rounding=rounding,
                                            calibration=first_blocks, backend=backend, adapter_dtype=adapter_dtype, learn_steps=learn_steps,
                                            **(auto if scanned else {}))  # fmt: skip
        storage = ActivationStorage(model, "int8") if config == "int4-lora" and not gc else None

        def loss_fn(b):
            if storage is None:
                return chunked_causal_lm_loss(model, b)
            with storage:
                return chunked_causal_lm_loss(model, b)

        from hf_lowprec.modules.packed import OUTLIER_COLUMNS

        return model, tok, loss_fn, {"plan_fractions": report.fractions(), "activation_storage": "int8" if storage is not None else None,
                                     "calibration": report.calibration, "int8_outlier_columns": OUTLIER_COLUMNS}  # fmt: skip
    if config == "bnb-nf4":
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig

        from hf_lowprec.checkpoints import cache_gguf

        _, tok = load_pretrained(folder, gguf_file=gguf, dtype=torch.bfloat16)  # also makes the bf16 cache
        bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                 bnb_4bit_compute_dtype=torch.bfloat16)  # fmt: skip
        base = AutoModelForCausalLM.from_pretrained(cache_gguf(folder, gguf, torch.bfloat16), quantization_config=bnb, dtype=torch.bfloat16)
        torch.manual_seed(SEED)
        model = get_peft_model(base, lora)
        return model, tok, hf_loss(model), {}
    dtype = torch.float32 if config == "fp32-lora" else torch.bfloat16
    base, tok = load_pretrained(folder, gguf_file=gguf, dtype=dtype)
    torch.manual_seed(SEED)
    model = get_peft_model(base, lora, autocast_adapter_dtype=config != "bf16-lora-bf16ad")
    return model, tok, hf_loss(model), {}


def _unpack_bnb_cpu_weights(model) -> None:
    """Undo bitsandbytes' CPU inference repacking before training.

    bitsandbytes 0.50 on an AVX512-BF16 CPU: the first no-grad forward of a ``Linear4bit`` in eval mode
    repacks its weight for the CPU inference kernel (``packing_format_for_cpu``) and nothing packs it back
    when the model trains again. Forwards then run an op with no gradient to the input, so every LoRA
    adapter below the last layer gets no gradient (measured: ``x.grad`` is ``None`` after one
    ``evaluate_loss``), and the quality run diverged (held-out ppl 64.6 -> 122.7) until this was undone.
    """
    from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

    for m in model.modules():
        w = getattr(m, "weight", None)
        if getattr(getattr(w, "quant_state", None), "packing_format_for_cpu", False):
            w.data, w.quant_state = _convert_weight_packed_for_cpu_inverse(w.data, w.quant_state)


def child(args) -> dict:
    import resource

    import psutil
    import torch
    from transformers import get_scheduler

    from hf_lowprec.ondevice import backend_counts, evaluate_loss
    from hf_lowprec.ondevice.learned_steps import fold_learned_steps, learned_steps
    from hf_lowprec.ondevice.train import OPTIMIZERS, adapter_optimizer

    t0 = time.perf_counter()
    model, tok, loss_fn, notes = _build(args.config, args.loftq, args.rounding, bool(args.gc), args.budget_bits, args.kept_format, args.backend,
                                        args.rotate, args.int4_format, args.adapter_dtype, args.learn_steps)  # fmt: skip
    load_s = time.perf_counter() - t0
    rss_loaded = psutil.Process().memory_info().rss / 2**20
    steps = args.warmup + args.steps
    train, evals = _data(tok, steps * BATCH, args.eval_blocks)
    base = model.get_base_model()
    if args.gc:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base.config.use_cache = False
    eval_before = evaluate_loss(model, evals, BATCH) if args.eval_blocks else None
    if args.config == "bnb-nf4":
        _unpack_bnb_cpu_weights(model)
    if args.frozen_lora:  # the adapters keep their initial values (LoftQ's, or B = 0)
        for name, p in model.named_parameters():
            p.requires_grad_(p.requires_grad and "lora_" not in name)
    params = [p for p in model.parameters() if p.requires_grad]
    # torch's and torchao's AdamW share their defaults (weight decay 0.01); the peers' optimizers as PEFT users make them
    opt = adapter_optimizer(params, args.optim, learned_steps(model), lr=LR) if args.config.startswith("int4-lora") else OPTIMIZERS[args.optim](params, lr=LR)
    sched = get_scheduler("linear", opt, num_warmup_steps=min(10, steps // 10), num_training_steps=steps)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(SEED))
    model.train()
    wall, cpu, losses = [], [], []
    for step in range(steps):
        batch = train[order[step * BATCH : (step + 1) * BATCH]]
        w, c = time.perf_counter(), time.process_time()
        loss = train_step(lambda batch=batch: loss_fn(batch), opt, params, scheduler=sched)
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
        losses.append(loss)
    fold_learned_steps(model)  # learned steps rounded as an export holds them (as finetune_int4_lora does)
    eval_after = evaluate_loss(model, evals, BATCH) if args.eval_blocks else None
    if args.eval_blocks and args.config.startswith("int4-lora"):  # what the trained base (its learned steps) does alone
        with model.disable_adapter():
            notes["eval_loss_after_without_adapters"] = evaluate_loss(model, evals, BATCH)
    if args.merge_eval:  # the honest cost of merging LoRA into the INT4 base (re-quantization)
        import tempfile

        from transformers import AutoModelForCausalLM

        from hf_lowprec.ondevice import MERGE_FILE, export_int4_lora, load_int4_model

        with tempfile.TemporaryDirectory() as tmp:
            export_int4_lora(model, Path(tmp) / "merged", merge=True)
            merged, _ = load_int4_model(Path(tmp) / "merged")
            notes["eval_loss_merged"] = evaluate_loss(merged, evals, BATCH)
            notes["ppl_merged"] = math.exp(notes["eval_loss_merged"])
            notes["merge_summary"] = json.loads((Path(tmp) / "merged" / MERGE_FILE).read_text())["summary"]
            export_int4_lora(model, Path(tmp) / "dense", merge=True, merged_dtype=torch.bfloat16)  # the lossless alternative
            dense = AutoModelForCausalLM.from_pretrained(Path(tmp) / "dense")
            notes["ppl_merged_dense"] = math.exp(evaluate_loss(dense, evals, BATCH))
    timed_wall, timed_cpu = wall[args.warmup :], cpu[args.warmup :]
    return {
        "config": args.config, "gradient_checkpointing": bool(args.gc), "loftq": bool(args.loftq), "rounding": args.rounding,
        "budget_bits": args.budget_bits, "kept_format": args.kept_format, "backend": args.backend, "rotate": args.rotate, "optim": args.optim, "seed": SEED,
        "int4_format": args.int4_format, "adapter_dtype": args.adapter_dtype, "learn_steps": args.learn_steps, "frozen_lora": args.frozen_lora,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "rss_after_load_mb": rss_loaded,
        "load_s": load_s, "step_s_median": statistics.median(timed_wall), "step_cpu_s_median": statistics.median(timed_cpu),
        "step_s": timed_wall, "losses": losses, "eval_loss_before": eval_before, "eval_loss_after": eval_after,
        "ppl_before": math.exp(eval_before) if eval_before is not None else None,
        "ppl_after": math.exp(eval_after) if eval_after is not None else None,
        "trainable_params": sum(p.numel() for p in params), "backends": backend_counts(model),
        "threads": torch.get_num_threads(), "loadavg": os.getloadavg(), **notes,
    }  # fmt: skip


# ------------------------------------------------------------------------------------ parent
def run_child(config: str, gc: bool, steps: int, warmup: int, eval_blocks: int = 0, loftq: bool = False, merge_eval: bool = False,
              rounding: str = "nearest", budget_bits: float = 0.0, kept_format: str = "int8", backend: str = "auto", rotate: bool = False,
              int4_format: str = "int4-g64-asym", optim: str = "adamw_torch", adapter_dtype: str = "fp32", learn_steps: bool | str = False, frozen_lora: bool = False) -> dict:  # fmt: skip
    flags = [f for f, on in (("--loftq", loftq), ("--merge-eval", merge_eval), ("--rotate", rotate), ("--learn-steps", learn_steps is True),
                             ("--frozen-lora", frozen_lora)) if on]  # fmt: skip
    flags += ["--learn-steps", learn_steps] if learn_steps == "zero_points" else []
    flags += ["--rounding", rounding, "--budget-bits", str(budget_bits), "--kept-format", kept_format, "--backend", backend, "--seed", str(SEED),
              "--int4-format", int4_format, "--optim", optim, "--adapter-dtype", adapter_dtype]
    cmd = [sys.executable, __file__, "child", "--config", config, "--gc", str(int(gc)), "--steps", str(steps),
           "--warmup", str(warmup), "--eval-blocks", str(eval_blocks), *flags]  # fmt: skip
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(THREADS), "MKL_NUM_THREADS": str(THREADS)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith(MARK)), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"{config} (gc={gc}) failed:\n{proc.stderr[-3000:]}")
    result = json.loads(line[len(MARK) :])
    print(f"  {config:<18} gc={int(gc)} loftq={int(loftq)} {rounding}  peak {result['peak_rss_mb']:7.0f} MB  step {result['step_s_median']:.2f} s"
          + (f"  ppl {result['ppl_before']:.2f} -> {result['ppl_after']:.2f}" if eval_blocks else ""), flush=True)  # fmt: skip
    return result


def _load_results() -> dict:
    path = RESULTS / RESULTS_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def _save(data: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    tmp = RESULTS / f"{RESULTS_FILE}.tmp"
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(RESULTS / RESULTS_FILE)


def speed(args) -> None:
    runs = []
    for rep in range(args.repeats):
        print(f"pass {rep + 1}/{args.repeats}", flush=True)
        for config in args.configs:
            for gc in GC_VARIANTS.get(config, (False, True)):
                runs.append(run_child(config, gc, args.steps, args.warmup, **_options(config)))
    table = {}
    for config in args.configs:
        for gc in GC_VARIANTS.get(config, (False, True)):
            mine = [r for r in runs if r["config"] == config and r["gradient_checkpointing"] == gc]
            table[f"{config}{'+gc' if gc else ''}"] = {
                "config": config, "description": CONFIGS[config][0], "gradient_checkpointing": gc,
                "own_default": CONFIGS[config][1] == gc,
                "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in mine),
                "step_s": statistics.median(r["step_s_median"] for r in mine),
                "step_cpu_s": statistics.median(r["step_cpu_s_median"] for r in mine),
                "runs": len(mine),
            }  # fmt: skip
    data = _load_results()
    complete = all(k in table for k in ("int4-lora", "int4-lora+gc", "fp32-lora", "bnb-nf4", "bnb-nf4+gc"))
    key = f"{cpu_info().cpu_class}/{THREADS}_threads"
    data.setdefault("speed", {})[key] = {
        "settings": {"batch": BATCH, "block": BLOCK, "lora_r": 16, "steps_timed": args.steps, "warmup": args.warmup,
                     "repeats": args.repeats, "threads": THREADS, "loadavg_end": os.getloadavg()},
        "machine": machine(), "table": table, "runs": runs,
        "goals": goals(table) if complete else {}, "goals_wall": goals(table, "step_s") if complete else {},
    }  # fmt: skip
    _save(data)
    print_table(table, data["speed"][key]["goals"])


def goals(t: dict, key: str = "step_cpu_s") -> dict:
    """The issue's goals, met or not (INT4 defaults = int4-lora: int8-stored activations, no checkpointing).

    Step times compare ``key``: ``step_cpu_s`` (process CPU time; with one thread it is the time the step
    takes on an idle core, and it barely moves when other processes share the cores) or ``step_s`` (wall).
    """
    ours, ours_gc = t["int4-lora"], t["int4-lora+gc"]
    fp32_default = t["fp32-lora"]
    bnb, bnb_gc = t["bnb-nf4"], t["bnb-nf4+gc"]
    peers = {k: v for k, v in t.items() if not k.startswith("int4")}
    fastest = min(peers, key=lambda k: peers[k][key])
    leanest = min(peers, key=lambda k: peers[k]["peak_rss_mb"])
    r = lambda a, b: round(a / b, 3)  # noqa: E731
    out = {
        "time_measure": key,
        "rss_defaults_vs_fp32_defaults": r(ours["peak_rss_mb"], fp32_default["peak_rss_mb"]), "rss_goal_<=": 0.40,
        "rss_vs_bnb_equal_nogc": r(ours["peak_rss_mb"], bnb["peak_rss_mb"]),
        "rss_vs_bnb_equal_gc": r(ours_gc["peak_rss_mb"], bnb_gc["peak_rss_mb"]), "rss_vs_bnb_goal_<=": 0.9,
        "step_vs_bnb_equal_nogc": r(ours[key], bnb[key]),
        "step_vs_bnb_equal_gc": r(ours_gc[key], bnb_gc[key]), "step_vs_bnb_goal_<=": 0.8,
        "fastest_peer": fastest, "step_defaults_vs_fastest_peer": r(ours[key], peers[fastest][key]), "step_vs_fastest_goal_<=": 1.0,
        "leanest_peer": leanest, "rss_defaults_vs_leanest_peer": r(ours["peak_rss_mb"], peers[leanest]["peak_rss_mb"]),
    }  # fmt: skip
    out["moonshot_defaults"] = out["step_defaults_vs_fastest_peer"] < 1 and out["rss_defaults_vs_leanest_peer"] < 1
    return out


def report(_args) -> None:
    """Print the saved tables and goals (CPU time and wall), and the quality summary."""
    data = _load_results()
    for name, run in data.get("speed", {}).items():
        print(f"\n== {name}")
        print_table(run["table"], run["goals"])
        print(json.dumps(run["goals_wall"], indent=1))
    if "quality" in data:
        print(json.dumps(data["quality"]["summary"], indent=1))


def print_table(table: dict, goal: dict) -> None:
    print(f"\n{'configuration':<22}{'gc':>4}{'default':>9}{'peak RSS MB':>13}{'step s':>9}{'cpu s':>8}")
    for k, v in table.items():
        print(f"{v['config']:<22}{int(v['gradient_checkpointing']):>4}{'*' if v['own_default'] else '':>9}{v['peak_rss_mb']:>13.0f}{v['step_s']:>9.2f}{v['step_cpu_s']:>8.2f}")
    print(json.dumps(goal, indent=1))


def _quality_key(r: dict) -> str:
    fmt = next((f.removesuffix("-rht") for f in r.get("plan_fractions", {}) if f.startswith("int4")), None)
    keep = f"+{round(100 * _kept_fraction(r['budget_bits'], r['kept_format'], r.get('int4_format', 'int4-g64-asym')))}% sensitive {r['kept_format']}" if r.get("budget_bits") else ""
    backend = f" [{r['backend']} backend]" if r.get("backend", "auto") != "auto" else ""
    rounding = r.get("rounding") or ("gptq" if r.get("gptq_rounding") else "nearest")  # older runs stored a GPTQ flag
    return (r["config"] + (f" ({fmt})" if fmt else "") + ("+rht scanned" if r.get("rotate") else "") + keep
            + ("+8-bit adamw" if r.get("optim", "adamw_torch") != "adamw_torch" else "") + ("+bf16 adapters" if r.get("adapter_dtype", "fp32") == "bf16" else "") + (f"+{rounding}" if rounding != "nearest" else "")
            + ("+loftq" if r["loftq"] else "") + {True: "+learned steps", "zero_points": "+learned zero points"}.get(r.get("learn_steps"), "") + ("+frozen adapters" if r.get("frozen_lora") else "") + backend + (f" [seed {r['seed']}]" if r.get("seed") else ""))  # fmt: skip


def _bits(fmt: str) -> float:
    from hf_lowprec.formats import FormatSpec

    return 8 * FormatSpec.parse(fmt).bytes_per_param(576)  # SmolLM2-135M's hidden size


def _kept_fraction(budget_bits: float, kept_format: str, int4_format: str = "int4-g64-asym") -> float:
    """The share of linear weights a plan of ``budget_bits`` bits/param can keep in ``kept_format`` (the rest int4_format)."""
    return (budget_bits - _bits(int4_format)) / (_bits(kept_format) - _bits(int4_format))


def default_quality_key() -> str:
    """The quality-table name of ``int4-lora`` run with ``INT4_DEFAULT``."""
    return _quality_key({"config": "int4-lora", "plan_fractions": {"int4-g64-asym": 1.0}, **parse_variant(INT4_DEFAULT)})


def _options(config: str) -> dict:
    """The child options of ``config`` as the benchmark runs it by default."""
    return parse_variant(INT4_DEFAULT) if config.startswith("int4-lora") else {}


def parse_variant(variant: str) -> dict:
    """``int4-lora`` options from a ``+``-joined variant name: ``loftq``, ``gptq``, ``awq``, ``dequant`` or ``int8``
    (that backend for every packed layer), ``keepNN``
    (a scanned plan keeping NN% of the linear weights, the most sensitive, in bf16) or ``keepNN-int8`` (in int8), ``auto``
    (the product's default scanned plan), ``rht`` (the scan also scores ``int4-g64-asym-rht`` and picks per layer),
    ``gNN`` / ``gNN-sym`` (the int4 format ``int4-gNN-asym`` / ``int4-gNN`` instead of int4-g64-asym), ``adam8`` (the
    adapters' AdamW with 8-bit states, ``finetune_int4_lora``'s default; else fp32 states like the other configurations),
    ``bf16ad`` (bf16 adapter weights, their updates rounded stochastically; else fp32), ``steps`` (the base learns its
    steps and zero points, ``learn_steps=True``), ``zeros`` (its zero points alone, ``learn_steps="zero_points"``),
    ``frozenlora`` (the adapters keep their initial values: with ``steps``,
    only the steps and zero points train);
    e.g. ``keep20+awq+gptq+loftq``, ``g32+loftq``. No keep part: every Linear int4."""
    from hf_lowprec.ondevice import AUTO_BUDGET

    parts = [x for x in variant.split("+") if x]  # "": every Linear int4, nearest rounding, default LoRA init
    kept = [m for m in map(re.compile(r"keep(\d+)(?:-(int8))?").fullmatch, parts) if m]
    group = [m for m in map(re.compile(r"g(\d+)(-sym)?").fullmatch, parts) if m]
    int4 = f"int4-g{group[0][1]}{'' if group[0][2] else '-asym'}" if group else "int4-g64-asym"
    unknown = [x for x in parts if x not in ("loftq", "gptq", "awq", "dequant", "int8", "auto", "rht", "adam8", "bf16ad", "steps", "zeros", "frozenlora") and not any(m.string == x for m in kept + group)]
    if unknown:
        raise SystemExit(f"--int4-variants {variant!r}: unknown part(s) {unknown}; use loftq, gptq, awq, dequant, int8, auto, rht, adam8, bf16ad, steps, zeros, frozenlora, keepNN, keepNN-int8, gNN, gNN-sym joined by '+'")
    rounding = "+".join(x for x in ("awq", "gptq") if x in parts) or "nearest"
    kept_format, bits = "int8", AUTO_BUDGET["target_bits_per_param"] if "auto" in parts else 0.0
    if kept:
        kept_format = kept[0][2] or "bf16"
        bits = _bits(int4) + int(kept[0][1]) / 100 * (_bits(kept_format) - _bits(int4))
    return {"loftq": "loftq" in parts, "rounding": rounding, "budget_bits": bits, "kept_format": kept_format,
            "backend": next((b for b in ("dequant", "int8") if b in parts), "auto"), "rotate": "rht" in parts, "int4_format": int4,
            "optim": "adamw_torch_8bit" if "adam8" in parts else "adamw_torch", "adapter_dtype": "bf16" if "bf16ad" in parts else "fp32",
            "learn_steps": "zero_points" if "zeros" in parts else "steps" in parts, "frozen_lora": "frozenlora" in parts}


def quality(args) -> None:
    """Perplexity on the held-out plays before and after ``--steps`` steps; merged with earlier quality runs."""
    variants = [(c, _options(c)) for c in args.configs] + [("int4-lora", parse_variant(v)) for v in args.int4_variants]
    new = [run_child(c, CONFIGS[c][1], args.steps, 0, args.eval_blocks, merge_eval=c == "int4-lora" and not options.get("loftq"), **options)
           for c, options in variants]  # fmt: skip
    data = _load_results()
    old = data.get("quality", {}).get("runs", [])
    runs = list({_quality_key(r): r for r in old + new}.values())  # a re-run replaces the earlier one
    refs = {r.get("seed", 0): r for r in runs if r["config"] == "bf16-lora-bf16ad"}  # each run against bf16 LoRA of its seed
    summary = {}
    for r in runs:
        ref = refs.get(r.get("seed", 0))
        summary[_quality_key(r)] = {
            "ppl_before": r["ppl_before"], "ppl_after": r["ppl_after"], "ppl_merged": r.get("ppl_merged"),
            "ppl_after_without_adapters": math.exp(r["eval_loss_after_without_adapters"]) if "eval_loss_after_without_adapters" in r else None,
            "ppl_merged_dense": r.get("ppl_merged_dense"),
            "merge_summary": r.get("merge_summary"), "loss_step1": r["losses"][0],
            "loss_last10_mean": statistics.mean(r["losses"][-10:]),
            "ppl_after_vs_bf16_lora": None if ref is None else round(r["ppl_after"] / ref["ppl_after"], 4),
        }  # fmt: skip
    data["quality"] = {"settings": {"steps": args.steps, "eval_blocks": args.eval_blocks, "block": BLOCK, "held_out": HELD_OUT,
                                    "threads": THREADS}, "summary": summary, "runs": runs}  # fmt: skip
    _save(data)
    print(json.dumps(summary, indent=1))


def demo(args) -> None:
    """The INT4 default (``INT4_DEFAULT``) through the Python API, timed end to end in this process: load and pack
    (and scan, for a scanned plan), train, evaluate, export."""
    import tempfile

    import torch
    from peft import LoraConfig

    from hf_lowprec.checkpoints import default_checkpoint
    from hf_lowprec.ondevice import finetune_int4_lora, load_int4_lora

    t0 = time.perf_counter()
    folder, gguf = default_checkpoint()
    options = parse_variant(INT4_DEFAULT)
    scanned = {"calibration": lambda t: _data(t, CALIBRATION_BLOCKS, 0)[0], "budget": {"target_bits_per_param": options["budget_bits"]}}
    model, tok, report = load_int4_lora(folder, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"),
                                        "auto" if options["budget_bits"] else options["int4_format"], gguf_file=gguf,
                                        loftq_init=options["loftq"], learn_steps=options["learn_steps"],
                                        **(scanned if options["budget_bits"] else {}))  # fmt: skip
    train, evals = _data(tok, args.steps * BATCH, args.eval_blocks)
    t_load = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as out:
        result = finetune_int4_lora(model, tok, train, steps=args.steps, lr=LR, batch_size=BATCH, eval_blocks=evals,
                                    output_dir=Path(out) / "run",
                                    progress=lambda s, n, m: print(f"  step {s}/{n} loss {m['loss']:.3f}", flush=True) if s % 10 == 0 else None)  # fmt: skip
    total = time.perf_counter() - t0
    data = _load_results()
    data["demo"] = {"steps": args.steps, "batch": BATCH, "block": BLOCK, "threads": torch.get_num_threads(), "total_s": total,
                    "load_and_data_s": t_load, "train_s": result.train_seconds, "median_step_s": result.median_step_seconds,
                    "eval_loss_before": result.eval_loss_before, "eval_loss_after": result.eval_loss_after,
                    "peak_rss_mb": result.peak_rss_mb, "plan_fractions": report.fractions(), "loadavg": os.getloadavg()}  # fmt: skip
    _save(data)
    print(json.dumps(data["demo"], indent=1))


def plot(_args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = _load_results()
    speed = next((r for r in data["speed"].values() if r.get("goals")), next(iter(data["speed"].values())))
    table = speed["table"]
    names = list(table)
    panels = 3 if "quality" in data else 2
    fig, axes = plt.subplots(1, panels, figsize=(24, 7), gridspec_kw={"width_ratios": [1, 1, 1.3][:panels]})
    colors = ["tab:green" if k.startswith("int4") else "tab:gray" for k in names]
    names_shown = [("* " if table[k]["own_default"] else "") + k for k in names]
    threads = speed["settings"]["threads"]
    for ax, key, label in ((axes[0], "peak_rss_mb", "peak RSS (MB)"), (axes[1], "step_cpu_s", f"median step, CPU s ({threads} thread)")):
        ax.barh(names_shown, [table[k][key] for k in names], color=colors)
        ax.set_xlabel(label)
        ax.invert_yaxis()
    axes[0].set_title("SmolLM2-135M, LoRA r=16, batch 4x256 (* = own default)")
    if "quality" in data:
        q = {k: v for k, v in data["quality"]["summary"].items() if v["ppl_after_vs_bf16_lora"]}
        ratios = [v["ppl_after_vs_bf16_lora"] for v in q.values()]
        shown = [min(r, 1.3) for r in ratios]  # a diverged run would flatten the rest: clipped, value printed
        default = default_quality_key()
        labels = [("* " if k == default else "") + k.replace(" (int4-g64-asym)", "").replace(" sensitive", "") for k in q]
        axes[2].barh(labels, [r - 1 for r in shown], left=1,
                     color=["tab:green" if k.startswith("int4") else "tab:gray" for k in q])  # fmt: skip
        for y, r in enumerate(ratios):
            axes[2].text(min(r, 1.3) + 0.003, y, f"{r:.3f}", va="center", fontsize=8)
        axes[2].axvline(1.03, color="tab:red", ls="--", lw=1, label="goal: within 3%")
        axes[2].set_xlim(0.98, 1.36)
        axes[2].set_xlabel(f"held-out perplexity after {data['quality']['settings']['steps']} steps / bf16 LoRA's")
        axes[2].legend(loc="lower right")
        axes[2].invert_yaxis()
    fig.tight_layout()
    fig.savefig(RESULTS / "ondevice.png", dpi=80)
    print(RESULTS / "ondevice.png")


def main() -> None:
    global THREADS, SEED, RESULTS_FILE
    from hf_lowprec.ondevice.calibration import ROUNDINGS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("speed", "quality", "demo", "report", "plot", "child"))
    p.add_argument("--config", choices=tuple(CONFIGS))
    p.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=tuple(CONFIGS))
    p.add_argument("--gc", type=int, default=0)
    p.add_argument("--loftq", action="store_true", help="child: LoftQ initialisation")
    p.add_argument("--rounding", default="nearest", choices=ROUNDINGS, help=f"child: INT4 rounding (calibrated on {CALIBRATION_BLOCKS} training blocks)")
    p.add_argument("--budget-bits", type=float, default=0.0, help="child: bits/param of the scanned plan (0: every Linear int4)")
    p.add_argument("--kept-format", default="int8", choices=("bf16", "int8"), help="child: what the scanned plan keeps sensitive layers in")
    p.add_argument("--backend", default="auto", choices=("auto", "int8", "tiled", "dequant"), help="child: backend of the packed layers")
    p.add_argument("--int4-variants", nargs="*", default=[], help="quality: also run int4-lora with these options (see parse_variant)")
    p.add_argument("--rotate", action="store_true", help="child: the scan also scores int4-g64-asym-rht per layer")
    p.add_argument("--int4-format", default="int4-g64-asym", help="child: the base's int4 format")
    p.add_argument("--optim", default="adamw_torch", choices=("adamw_torch", "adamw_torch_8bit"), help="child: the adapters' optimizer")
    p.add_argument("--adapter-dtype", default="fp32", choices=("fp32", "bf16"), help="child: int4-lora's adapter weights (bf16: stochastically rounded updates)")
    p.add_argument("--merge-eval", action="store_true", help="child: also evaluate the merged, re-quantized export")
    p.add_argument("--learn-steps", nargs="?", const=True, default=False, type=lambda v: v, choices=(True, "zero_points"),
                   help="child: the INT4 base learns its steps and zero points (zero_points: those alone)")
    p.add_argument("--frozen-lora", action="store_true", help="child: the adapters keep their initial values")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--eval-blocks", type=int, default=16)
    p.add_argument("--threads", type=int, default=2, help="torch/OpenMP threads per configuration")
    p.add_argument("--seed", type=int, default=0, help="adapter init and data order (quality runs of another seed get their own rows)")
    p.add_argument("--results-file", default=RESULTS_FILE, help="JSON file under results/ to merge into (quality runs on another CPU class: their own file)")
    args = p.parse_args()
    THREADS, SEED, RESULTS_FILE = args.threads, args.seed, args.results_file
    if args.mode == "child":
        print(MARK + json.dumps(child(args)), flush=True)
        return
    if args.steps is None:
        args.steps = {"speed": 10, "quality": 100, "demo": 50}.get(args.mode, 0)
    {"speed": speed, "quality": quality, "demo": demo, "report": report, "plot": plot}[args.mode](args)


if __name__ == "__main__":
    main()
