"""Build benchmarks/results/REPORT.md from the benchmark JSON files: the research's claims, tested.

Reads whatever results exist (convergence, layers, memory, finetune_quality, ondevice, gpu)
and says "not measured" for the rest — never an estimate in place of a measurement.

    python benchmarks/report.py
"""

from __future__ import annotations

import json
import re

from _util import RESULTS, mean_std
from ondevice import INT4_DEFAULT, _bits, _quality_key, default_quality_key, parse_variant

from hf_lowprec.ondevice.learned_steps import learned_kinds


def load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def pct(x: float) -> str:
    return f"{x:+.2%}"


def pm_pct(x: float, std: float | None) -> str:
    """``x`` as a signed percentage, with ``± std`` when several seeds gave one."""
    return pct(x) + (f" ± {std:.2%}" if std else "")


def _seeds_text(seeds: list) -> str:
    return f"{len(seeds)} seeds ({', '.join(map(str, seeds))})" if len(seeds) > 1 else f"one seed ({seeds[0]})"


SMOLLM2_HEAD_SHARE = 49152 * 576 / 134_479_872  # the tied output head's share of SmolLM2-135M's linear parameters


def fp8_share(fractions: dict[str, float]) -> float:
    """The FP8 formats' share of the SmolLM2-135M parameters a plan that keeps the output head scanned:
    ``fractions`` (format -> share of all eligible parameters) counts the head as ``bf16``."""
    return sum(v for k, v in fractions.items() if k.startswith("fp8")) / (1 - SMOLLM2_HEAD_SHARE)


VERDICTS = ("holds", "undecided: the seeds' spread covers the target", "holds partly", "does not hold here")


def verdict_within(gap: float, std: float, target: float) -> str:
    """``holds`` when the gap is within the target by one standard deviation of the seeds (``gap + std <= target``:
    a gap inside a wide spread no longer passes), ``undecided`` when that one-deviation band holds the target, ``holds
    partly`` within four times the target, else ``does not hold here`` (:data:`VERDICTS`, best first)."""
    if gap + std <= target:
        return VERDICTS[0]
    if gap - std <= target:
        return VERDICTS[1]
    return VERDICTS[2] if gap <= 4 * target else VERDICTS[3]


LONGER_RUN = "convergence_600steps"  # convergence.py --steps 600 --seeds 0 1 2 --only fp32 bf16 "fp8 (dynamic)" --out ...
# the offline checkpoint's quantization block before it was dequantized (Q4_1): INT4 groups of this size line up with it
CHECKPOINT_Q4_BLOCK = 32
LONG_FINETUNE = "finetune_quality_200steps"  # finetune_quality.py --steps 200 --batch 1 --seeds 0 1 2 --only ...


ARCH_RUN = "convergence_smollm2-135m"  # convergence.py --arch smollm2-135m (make bench runs it)
MIN_SEEDS = 3  # a quality figure is evidence for a claim when it is a mean over at least this many seeds


def _model_text(conv: dict) -> str:
    m = conv["model"]
    if conv.get("arch", "toy") == "toy":
        return f"4-layer Llama (hidden {m['hidden_size']}, BPE vocabulary {m['vocab_size']})"
    return (f"SmolLM2-135M's architecture ({m['num_hidden_layers']} layers, hidden {m['hidden_size']}, tied embeddings; the "
            f"BPE vocabulary of {m['vocab_size']} tokens, so {conv['params'] / 1e6:.0f}M parameters), at lr {conv['lr']:g}; "
            f"sized to `make bench`: {conv['steps'] * conv['batch'] * conv['seq']:,} training tokens, so an early stage of "
            "training (the 4-layer model above sees 819,200),")  # fmt: skip


def convergence_section(conv: dict | None, title: str = "Convergence from scratch") -> tuple[list[str], dict]:
    if not conv:
        return [f"## {title}\n", "not measured\n"], {}
    res, toy = conv["results"], conv.get("arch", "toy") == "toy"
    seeds = conv.get("seeds", [conv.get("seed")])
    lines = [
        f"## {title}\n",
        f"{_model_text(conv)} trained from "
        f"scratch for {conv['steps']} steps of {conv['batch']}x{conv['seq']} tokens of the Shakespeare texts, "
        f"{_seeds_text(seeds)} (each seed: its own initialization and data order, the same for every run); eval on held-out "
        "plays. bf16 = autocast with fp32 master weights. Figures are means ± standard deviation over the seeds; the gap "
        "to bf16 is paired by seed.\n",
        "| run | final train loss | eval loss | eval gap vs bf16 | seconds |",
        "|---|---|---|---|---|",
    ]
    for name, r in res.items():
        gap = pm_pct(r["eval_gap_vs_bf16"], r.get("eval_gap_vs_bf16_std")) if "eval_gap_vs_bf16" in r else "—"
        loss = f"{r['eval_loss']:.4f}" + (f" ± {r['eval_loss_std']:.4f}" if len(seeds) > 1 else "")
        lines.append(f"| {name} | {r['final_train_loss']:.4f} | {loss} | {gap} | {r['seconds']:.0f} |")
    if "fp32" in res and "eval_gap_vs_bf16" in res["fp32"]:
        lines += ["", f"Noise floor: fp32 and bf16 differ by {pct(res['fp32']['eval_gap_vs_bf16'])} here — gaps of that size are the "
                  "numerics' run-to-run scatter (rounding changes the trajectory), not an effect of the format."]  # fmt: skip
    longer = load(LONGER_RUN) if toy else None
    if longer and longer["steps"] != conv["steps"]:
        gaps = ", ".join(f"{n} {pm_pct(r['eval_gap_vs_bf16'], r.get('eval_gap_vs_bf16_std'))}"
                         for n, r in longer["results"].items() if n != "bf16")  # fmt: skip
        seeds = _seeds_text(longer.get("seeds", [longer.get("seed", 0)]))
        lines += ["", f"The same sweep at {longer['steps']} steps, {seeds} (results/convergence_{longer['steps']}steps.json), "
                  f"eval gap vs bf16 paired by seed: {gaps}."]  # fmt: skip
    plot = "convergence.png" if toy else f"convergence_{conv['arch']}.png"
    lines += ["", f"![loss curves]({plot})", ""]
    return lines, res


def layers_section(layers: dict | None) -> list[str]:
    if not layers:
        return ["## One linear layer, per format\n", "not measured\n"]
    lines = [
        "## One linear layer, per format\n",
        f"2048x2048 linear, {layers['shape']['tokens'][0]}x{layers['shape']['tokens'][1]} tokens, forward+backward, "
        f"median of {layers['repeat']} interleaved runs, {_cpu(layers)}. Saved activations = bytes autograd keeps for "
        "backward.\n",
        "| format | step ms | vs bf16 | saved activations vs bf16 |",
        "|---|---|---|---|",
    ]
    for name, r in layers["results"].items():
        lines.append(f"| {name} | {r['step_s'] * 1e3:.1f} | {r['time_vs_bf16']:.2f}x | {r['activation_vs_bf16']:.2f}x |")
    return lines + [""]


MEMORY_D = "d_sr_8bit_fp8act"  # (d): bf16 weights + stochastic rounding + 8-bit AdamW states + FP8-stored activations


def memory_ratio(memory: dict | None, config: str = MEMORY_D) -> float | None:
    """Peak RSS of ``config`` (default (d)) over (b) in benchmarks/memory.py's results."""
    if not memory:
        return None
    peaks = {r["config"]: r["peak_rss_mb"] for r in memory.get("results", []) if "peak_rss_mb" in r}
    return peaks[config] / peaks["b_bf16_amp"] if {config, "b_bf16_amp"} <= peaks.keys() else None


def _cpu(data: dict) -> str:
    """The CPU a results file ran on, as the report names it (files written before the scripts recorded it: so
    said)."""
    if "cpu_class" not in data:
        return "CPU not recorded (an older results file)"
    return f"{data['machine']} ({data['cpu_class']})"


def memory_section(memory: dict | None) -> list[str]:
    lines = ["## Training memory (benchmarks/memory.py)\n"]
    if not memory:
        return lines + ["not measured\n"]
    lines += [f"SmolLM2-135M's architecture (random weights), batch 4x256, one measured step after a warm-up, one thread, "
              f"{memory.get('allocator', 'default')} allocator, {_cpu(memory)}. (b) = bf16 autocast with fp32 master "
              "weights and AdamW; the step times are one step each on a shared machine: rough.\n",
              "| configuration | peak RSS MiB | vs (b) | state bytes/param | step s | vs (b) |", "|---|---|---|---|---|---|"]  # fmt: skip
    rows = [r for r in memory.get("results", []) if "peak_rss_mb" in r]
    base = next((r for r in rows if r["config"] == "b_bf16_amp"), None)
    for r in rows:
        peak = f"{r['peak_rss_mb'] / base['peak_rss_mb']:.2f}x" if base else "—"
        step = f"{r['step_s'] / base['step_s']:.2f}x" if base else "—"
        lines.append(f"| {r['description']} | {r['peak_rss_mb']:.0f} | {peak} | {r.get('state_bytes_per_param', float('nan')):.2f} | {r['step_s']:.1f} | {step} |")
    return lines + [""]


def ondevice_speed(ondevice: dict | None) -> dict:
    """The first on-device speed run that compared every peer (has goals), else the first one saved."""
    runs = (ondevice or {}).get("speed", {})
    return next((r for r in runs.values() if r.get("goals")), next(iter(runs.values()), {}))


def ondevice_other_cpus(ondevice: dict | None) -> list[str]:
    """One table per further speed run (another CPU class, or a subset of the configurations)."""
    lines, main = [], ondevice_speed(ondevice)
    for key, run in (ondevice or {}).get("speed", {}).items():
        if run is main:
            continue
        emulated = run.get("machine", {}).get("cpu", {}).get("restricted_to")
        name = run.get("machine", {}).get("machine")
        where = (" (AVX2 class reproduced on an AVX-512 CPU: HF_LOWPREC_CPU_CLASS=avx2, oneDNN/MKL limited to AVX2)"
                 if emulated else f" ({name}, a CPU of this class)" if name
                 else " (CPU not recorded: an older run, its int4 configuration an earlier default's)")
        lines += [f"Speed on `{key}`{where}:\n",
                  "| configuration | peak RSS MiB | step s (CPU time) | step s (wall) |", "|---|---|---|---|"]  # fmt: skip
        lines += [f"| {name} | {r['peak_rss_mb']:.0f} | {r['step_cpu_s']:.2f} | {r['step_s']:.2f} |" for name, r in run["table"].items()]
        lines.append("")
    for path in sorted(RESULTS.glob("ondevice_quality_*.json")):  # quality runs on another CPU class
        quality, cpu = json.loads(path.read_text())["quality"], path.stem.removeprefix("ondevice_quality_")
        cpu = (f"{cpu.removesuffix('-emulated')} class reproduced on an AVX-512 CPU (HF_LOWPREC_CPU_CLASS=avx2: fp32 compute)"
               if cpu.endswith("-emulated") else f"{cpu} CPU")  # fmt: skip
        lines += [f"Quality on the {cpu} ({path.name}; {quality['settings']['steps']} steps, the settings above):\n",
                  "| run | seed | ppl before | ppl after |", "|---|---|---|---|"]  # fmt: skip
        lines += [f"| {_quality_key(r)} | {r.get('seed', 0)} | {r['ppl_before']:.2f} | {r['ppl_after']:.2f} |" for r in quality["runs"]]
        groups: dict[str, list[float]] = {}
        for r in quality["runs"]:
            groups.setdefault(re.sub(r" \[seed \d+\]$", "", _quality_key(r)), []).append(r["ppl_after"])
        for name, ppls in groups.items():
            if len(ppls) > 1:
                mean, std = mean_std(ppls)
                lines.append(f"| {name} | mean of {len(ppls)} | | {mean:.2f} ± {std:.2f} |")
        lines.append("")
    return lines


def claims(conv_res: dict, layers: dict | None, memory: dict | None, ondevice: dict | None, gpu: dict | None,
           memory_default_malloc: dict | None = None) -> list[str]:  # fmt: skip
    """The four claims → measured figure → verdict."""
    rows = []
    bf16 = conv_res.get("bf16")
    fp8 = conv_res.get("fp8 (dynamic)")
    if bf16 and fp8:
        gap, std = fp8["eval_gap_vs_bf16"], fp8.get("eval_gap_vs_bf16_std", 0.0)
        text = f"from scratch (4-layer Llama): FP8 eval loss {pm_pct(gap, std)} vs bf16 (target within 0.25%)"
        verdicts = [verdict_within(gap, std, 0.0025)]  # lower than bf16 counts as holding; every run must hold
        longer_run = load(LONGER_RUN) or {}
        longer = longer_run.get("results", {}).get("fp8 (dynamic)")
        if longer:
            verdicts.append(verdict_within(longer["eval_gap_vs_bf16"], longer.get("eval_gap_vs_bf16_std", 0.0), 0.0025))
            text += f"; {pm_pct(longer['eval_gap_vs_bf16'], longer.get('eval_gap_vs_bf16_std'))} in the {longer_run['steps']}-step run"
        arch_run = load(ARCH_RUN) or {}
        arch = arch_run.get("results", {}).get("fp8 (dynamic)")
        if arch and "eval_gap_vs_bf16" in arch:
            gap, std = arch["eval_gap_vs_bf16"], arch.get("eval_gap_vs_bf16_std", 0.0)
            verdicts.append(verdict_within(gap, std, 0.0025))
            text += (f"; SmolLM2-135M's architecture from scratch, {arch_run['steps']} steps, {len(arch_run['seeds'])} seeds: "
                     f"{pm_pct(gap, std)}")  # fmt: skip
        ft = load(LONG_FINETUNE) or {}
        runs = ft.get("results", {})
        recipe = runs.get("fp8 (scan)")  # the fp8-train recipe's scanned plan (finetune_quality.py reads the recipe)
        if recipe:
            ratio, rstd = recipe["ppl_after_vs_bf16"], recipe.get("ppl_after_vs_bf16_std", 0.0)
            text += (f"; the fp8-train recipe (its scanned plan, {fp8_share(recipe['plan_fractions']):.0%} of the linears "
                     f"but the head in FP8) fine-tuning SmolLM2-135M {ft['steps']} steps, {len(ft['seeds'])} seeds: held-out ppl ")  # fmt: skip
            if "master_in_bf16_vs_bf16" in recipe:  # what the recipe exports (its master weights), served in bf16
                master, mstd = recipe["master_in_bf16_vs_bf16"], recipe["master_in_bf16_vs_bf16_std"]
                verdicts.append(verdict_within(master - 1, mstd, 0.005))
                text += (f"of its exported weights {master:.4f}x ± {mstd:.4f} bf16's (target ≤ 1.005x), served in FP8 "
                         f"(the plan re-applied) {ratio:.4f}x ± {rstd:.4f}")  # fmt: skip
            else:
                verdicts.append(verdict_within(ratio - 1, rstd, 0.005))
                text += f"{ratio:.4f}x ± {rstd:.4f} bf16's (target ≤ 1.005x)"
            others = "; ".join(f"{n} {r['ppl_after_vs_bf16']:.4f}x" + (f" (exported {exported(r):.4f}x)"
                               if exported(r) else "")
                               for n, r in runs.items() if r is not recipe and n != "bf16")  # fmt: skip
            text += f" (other runs served as trained: {others})"
        quality = (load("outliers") or {}).get("quality") or {}
        formats, scanned = quality.get("formats", {}), quality.get("scan", {})
        converted = next((r for label, r in scanned.items() if label.startswith("scan: fp8 on") and "gptq" not in label), None)
        if converted:
            verdicts.append(verdict_within(converted["ratio_mean"] - 1, 0.0, 0.01))
            text += (f"; SmolLM2-135M converted by the recipe's scanned plan, no training: {converted['ratio_mean']:.4f}x "
                     f"(target ≤ 1.01x)")  # fmt: skip
            if "fp8" in formats:
                text += (f"; every linear in FP8: {formats['fp8']['ratio_mean']:.4f}x, "
                         f"{formats.get('fp8 (gptq weights)', formats['fp8'])['ratio_mean']:.4f}x with GPTQ-rounded weights")
        verdict = max(verdicts, key=VERDICTS.index)
        rows.append(("FP8 can replace BF16 as the training format", text, verdict,
                     "from scratch: all linears but the output head in FP8 E4M3/E5M2, tensorwise dynamic scales; "
                     "fine-tuning: the fp8-train recipe, judged on what it exports (master weights; a model served with "
                     "its FP8 plan is further off, as the figure says); 'holds' needs every run within its target by one "
                     "standard deviation of its seeds"))  # fmt: skip
    else:
        rows.append(("FP8 can replace BF16 as the training format", "not measured", "—", ""))
    lossless = [(n, r["eval_gap_vs_bf16"], r.get("eval_gap_vs_bf16_std", 0.0)) for n, r in conv_res.items() if n.startswith("int4")]
    if lossless:
        figs = "; ".join(f"{n}: {pm_pct(g, s)}" for n, g, s in lossless)
        verdict = min((verdict_within(g, s, 0.0025) for _, g, s in lossless), key=VERDICTS.index)  # "some layers": the best
        rows.append(("INT4 is lossless on some layers", figs + " (eval vs bf16; lossless = within 0.25% by one standard deviation)", verdict,
                     "a 1.4M-parameter model trained from scratch, where INT4's noise may regularise (a loss below bf16's "
                     "is no gain to expect at scale): no loss measured here, not evidence of none on large models"))  # fmt: skip
    else:
        rows.append(("INT4 is lossless on some layers", "not measured", "—", ""))
    speed = []
    if layers:
        speed.append(f"CPU FP8 linear {layers['results']['fp8 (tensorwise)']['time_vs_bf16']:.2f}x bf16 time")
    goals = ondevice_speed(ondevice).get("goals", {})
    if goals.get("step_defaults_vs_fastest_peer") is not None:
        speed.append(f"CPU INT4+LoRA step {goals['step_defaults_vs_fastest_peer']:.2f}x the fastest bf16 LoRA, "
                     f"{goals['step_vs_bnb_equal_nogc']:.2f}x bnb NF4 QLoRA")  # fmt: skip
    gpu_fast = None
    if gpu and "time_vs_bf16" in gpu.get("results", {}).get("hf-lowprec fp8", {}):
        gpu_fast = gpu["results"]["hf-lowprec fp8"]["time_vs_bf16"]
        speed.append(f"{gpu['device']} FP8 step {gpu_fast:.2f}x bf16")
    else:
        speed.append("GPU: not measured (no GPU lent to the session that ran this)")
    cpu_best = goals.get("step_defaults_vs_fastest_peer")
    cpu = "holds on this CPU" if cpu_best is not None and cpu_best <= 0.7 else "does not hold on this CPU"
    gpu_verdict = "GPU not measured" if gpu_fast is None else ("holds on the GPU" if gpu_fast <= 0.7 else "does not hold on the GPU")
    verdict = f"{cpu}; {gpu_verdict}"
    rows.append(("Training ≥30% faster", "; ".join(speed), verdict, "CPUs have no FP8 units: FP8 is emulated on bf16 units, so its speed claim needs the GPU column"))
    # the verdict is the FP8 training's, (d) with its linears in FP8, under the allocator users get (glibc's default)
    mem, fp8_linears = [], f"{MEMORY_D}_fp8linear"
    by_allocator = [(name, data) for name, data in (("glibc's default", memory_default_malloc), ("mmap", memory)) if data]
    ratio = next((r for _, data in by_allocator if (r := memory_ratio(data, fp8_linears)) is not None), None)
    for name, data in by_allocator:
        with_fp8, without = memory_ratio(data, fp8_linears), memory_ratio(data)
        if with_fp8 is not None and without is not None:
            mem.append(f"{name} allocator: (d) with its linears in FP8 {with_fp8:.2f}x, without them {without:.2f}x")
    if mem:
        mem.insert(0, f"full training peak RSS vs (b) bf16 AMP (fp32 master weights, fp32 AdamW), SmolLM2-135M shape, "
                      f"{_cpu(by_allocator[0][1])} (claim ≤ 0.6x): (d) = bf16 weights with stochastic rounding, 8-bit "
                      "AdamW states, FP8-stored activations; the saving is theirs, the FP8 linears add memory here "
                      "(their casts)")  # fmt: skip
    if goals.get("rss_defaults_vs_fp32_defaults") is not None:
        mem.append(f"INT4+LoRA fine-tuning peak RSS {goals['rss_defaults_vs_fp32_defaults']:.2f}x fp32 LoRA, "
                   f"{goals['rss_vs_bnb_equal_nogc']:.2f}x bnb NF4 QLoRA (hf-lowprec's defaults: chunked loss, int8-saved "
                   "activations, 8-bit AdamW; the peers as PEFT and bitsandbytes run them"
                   + (f"; {goals['rss_defaults_vs_leanest_peer']:.2f}x the leanest peer measured, bf16 LoRA with bf16 "
                      "adapters and gradient checkpointing" if goals.get("rss_defaults_vs_leanest_peer") else "") + ")")  # fmt: skip
    scale_goals = (load("scale") or {}).get("goals", {}).get("int4-lora")
    if scale_goals is not None:
        mem.append(f"Llama-3.2-1B shape, INT4+LoRA API defaults, batch 1x256, loading included (scale.py): peak RSS "
                   f"{scale_goals['glibc_peak_rss_mb']:,.0f} MiB under glibc's default allocator (what a process gets), "
                   f"{scale_goals['glibc_peak_vs_nf4_qlora']:.2f}x bnb NF4 QLoRA; {scale_goals['peak_rss_mb']:,.0f} MiB, "
                   f"{scale_goals['peak_vs_nf4_qlora']:.2f}x, with MALLOC_MMAP_THRESHOLD_=65536 (freed blocks of 64 KiB "
                   "or more returned, a slower step)")  # fmt: skip
    verdict = "—" if ratio is None else ("holds" if ratio <= 0.6 else ("holds partly" if ratio <= 0.8 else "does not hold here"))
    rows.append(("≥40% less memory", "; ".join(mem) or "not measured", verdict, ""))
    lines = ["## The claims, tested\n", "| claim | measured | verdict | note |", "|---|---|---|---|"]
    lines += [f"| {c} | {m} | {v} | {n} |" for c, m, v, n in rows]
    return lines + [""]


def finetune_quality_section(fq: dict | None, title: str = "Fine-tuning quality on the pretrained checkpoint") -> list[str]:
    lines = [f"## {title} (benchmarks/finetune_quality.py)\n"]
    if not fq:
        return lines + ["not measured\n"]
    seeds = fq.get("seeds", [fq.get("seed")])
    master_measured = any("master_in_bf16_vs_bf16" in r for r in fq["results"].values())
    packed_measured = any("int4_packed_vs_bf16" in r for r in fq["results"].values())
    lines += [
        f"SmolLM2-135M-Instruct, {fq['steps']} steps of {fq['batch']}x{fq['block']} Shakespeare tokens, {_seeds_text(seeds)} "
        f"(data order; LoRA initialization), held-out perplexity on {fq['eval_blocks']} blocks of two unseen plays. Full "
        "fine-tuning at lr 2e-5; INT4 LoRA trains only its adapters (lr 2e-4). Means ± standard deviation over the seeds; "
        "the ratio to bf16 is paired by seed." + (" 'Weights in bf16': the run's trained master weights evaluated with "
        "its low-precision layers reverted (what the fp8-train recipe exports), against bf16's run." if master_measured else "")
        + (" 'INT4 packed': its INT4 layers as their packed codes, the others' master weights (what the auto-mixed "
           "recipe exports). The 'auto plan' rows are the auto-mixed recipe before 2026-12-03 (its budget scored at "
           "conversion); the current recipe (scored after training) is measured in the INT4 section below."
           if packed_measured else "")
        + "\n",
        "| run | ppl before | ppl after | vs bf16 |" + (" weights in bf16 vs bf16 |" if master_measured else "")
        + (" INT4 packed vs bf16 |" if packed_measured else "") + " plan |",
        "|---|---|---|---|" + ("---|" if master_measured else "") + ("---|" if packed_measured else "") + "---|",
    ]
    for name, r in fq["results"].items():
        plan = ", ".join(f"{k} {v:.0%}" for k, v in r.get("plan_fractions", {}).items()) or "—"
        vs = f"{r['ppl_after_vs_bf16']:.4f}x" if "ppl_after_vs_bf16" in r else "—"
        if r.get("ppl_after_vs_bf16_std"):
            vs += f" ± {r['ppl_after_vs_bf16_std']:.4f}"
        after = f"{r['ppl_after']:.2f}" + (f" ± {r['ppl_after_std']:.2f}" if r.get("ppl_after_std") else "")
        master = ""
        if master_measured:
            master = " — |" if "master_in_bf16_vs_bf16" not in r else \
                f" {r['master_in_bf16_vs_bf16']:.4f}x ± {r['master_in_bf16_vs_bf16_std']:.4f} |"
        if packed_measured:
            master += " — |" if "int4_packed_vs_bf16" not in r else \
                f" {r['int4_packed_vs_bf16']:.4f}x ± {r['int4_packed_vs_bf16_std']:.4f} |"
        lines.append(f"| {name} | {r['ppl_before']:.2f} | {after} | {vs} |{master} {plan} |")
    return lines + [""]


def exported(run: dict) -> float | None:
    """A full fine-tuning run's ratio to bf16 as its recipe exports it: INT4 layers packed and the rest master weights
    (export ``auto`` with INT4 layers in the plan), else master weights; ``None`` when not measured."""
    return run.get("int4_packed_vs_bf16", run.get("master_in_bf16_vs_bf16"))


def outliers_section(data: dict | None) -> list[str]:
    lines = ["## Outlier handling: Hadamard rotation, smoothing and MXFP8 scales (benchmarks/outliers.py)\n"]
    quality = (data or {}).get("quality")
    if not quality:
        return lines + ["not measured\n"]
    st = data["settings"]
    lines += [
        f"SmolLM2-135M-Instruct converted without training (every linear but `lm_head`), held-out perplexity on "
        f"{st['eval_blocks']} blocks of 256 tokens of two unseen plays, all under bf16 autocast; ratio to the unconverted "
        f"model's {quality['baseline_ppl']:.2f} (also bf16 autocast). `-rht` rows: mean ± std over rotation seeds "
        f"{st['rotation_seeds']}; the others are deterministic. `-sq` rows: smoothing calibrated on the first training "
        f"batch. CPU class {data['cpu_class']}.\n",
        "| conversion | ppl vs bf16 |",
        "|---|---|",
    ]
    for section in ("formats", "smoothing", "fp8_error", "fp8_by_projection", "scan"):
        for label, r in quality.get(section, {}).items():
            if section == "fp8_by_projection":
                label = f"fp8 on `{label}` only"
            std = f" ± {r['ratio_std']:.4f}" if r["ratio_std"] else ""
            extra = ""
            if "fractions" in r:
                extra = " (" + ", ".join(f"{k} {v:.0%}" for k, v in r["fractions"].items()) + ")"
            lines.append(f"| {label}{extra} | {r['ratio_mean']:.4f}x{std} |")
    for shape, row in (data.get("cost") or {}).items():
        if shape == list(data["cost"])[0]:
            lines += ["", f"Cost on the {data['cpu_class']} CPU ({data['machine']}, {data['threads']} threads), "
                      f"forward+backward of one layer ({st['tokens_timed']} tokens, bf16 autocast, fastest of "
                      f"{st['repeats']} interleaved calls), time vs the bf16 layer / vs the same format without `-rht` or `-sq`:\n",
                      "| shape | " + " | ".join(row) + " |", "|---|" + "---|" * len(row)]  # fmt: skip
        lines.append(f"| {shape} | " + " | ".join(f"{r['vs_bf16']:.2f}x / {r['vs_plain']:.2f}x" for r in row.values()) + " |")
    return lines + ["", "![outliers](outliers.png)", ""]


def scan_section(data: dict | None) -> list[str]:
    """The sensitivity scan's predictions against measured losses, and its plans against hand-written ones (scan.py)."""
    lines = ["## Does the sensitivity scan rank layers right? (benchmarks/scan.py)\n"]
    if not data:
        return lines + ["not measured\n"]
    m, rho = data["machine"], data["spearman"]
    lines += [f"{m.get('machine', '?')} ({m.get('cpu_class', '?')}), {m['threads']} threads. {data['model']}, "
              f"{data['calibration']}; {data['units']} layers. Peak RSS {data['peak_rss_mb']:,} MiB.\n",
              "Spearman rank correlation of the scan's predicted Δloss with each layer's measured Δloss (the layer "
              "alone in the format, the rest unquantized): "
              + "; ".join(f"{f} {rho[f]['spearman_predicted_vs_measured_delta_loss']:.3f}" for f in data["formats"])
              + f"; the `auto` method's measured pairs {rho['auto_measured_pairs']['spearman_predicted_vs_measured_delta_loss']:.3f}.\n",
              "| scan method | wall s | CPU s |", "|---|---|---|"]  # fmt: skip
    for name, r in data["methods"].items():
        run = r["repeats"][0] if "repeats" in r else r
        extra = f" ({r['pairs']} pairs, measured one by one: {r['s_per_pair']} s each)" if name == "measured" else ""
        lines.append(f"| {name}{extra} | {run['wall_s']} | {run['cpu_s']} |")
    lines += ["", "Plans measured on held-out text (Δloss over the unquantized model's, nats/token):\n",
              "| plan | bits/param | held-out Δloss | formats |", "|---|---|---|---|"]  # fmt: skip
    for name, r in data["plans"].items():
        shares = ", ".join(f"{f} {v:.0%}" for f, v in r["fractions"].items())
        lines.append(f"| {name} | {r['bits_per_param']:.2f} | {r['held_out_delta_loss']:.4f} | {shares} |")
    return lines + [""]


def scan_cost_section(data: dict | None) -> list[str]:
    """The fp8-train recipe's scan: peak memory, time and plan quality by compute and forward size (scan_cost.py)."""
    lines = ["## What the fp8-train recipe's scan costs (benchmarks/scan_cost.py)\n"]
    if not data:
        return lines + ["not measured\n"]
    lines += [f"{data['machine']} ({data['cpu_class']}), {data['threads']} threads. {data['model']}, the recipe's candidates "
              f"and budget, {data['calibration']}; each scan in a fresh process (peak RSS: the whole process's). The "
              "plan converts the model without training; held-out perplexity under bf16 autocast over the unconverted "
              "model's. One value per calibration set.\n",
              "| scan computes in, tokens per forward | peak RSS MiB | scan s | converted ppl ratio |", "|---|---|---|---|"]  # fmt: skip
    for config, runs in data["runs"].items():
        cells = [", ".join(f"{r[key]:{fmt}}" for r in runs) for key, fmt in
                 (("peak_rss_mb", ","), ("scan_s", ".0f"), ("ppl_ratio", ".4f"))]  # fmt: skip
        lines.append(f"| {config} | {' | '.join(cells)} |")
    return lines + ["", "The callback and the Accelerate plugin scan under the run's autocast (bf16 for the recipe), with "
                    "forwards of up to 2048 tokens.", ""]


def ondevice_section(ondevice: dict | None) -> list[str]:
    lines = ["## On-device INT4 + LoRA fine-tuning (benchmarks/ondevice.py)\n"]
    speed = ondevice_speed(ondevice)
    if not speed:
        return lines + ["not measured\n"]
    st = speed["settings"]
    lines += [
        f"SmolLM2-135M-Instruct, LoRA r={st['lora_r']} on every linear, batch {st['batch']}x{st['block']}, {st['threads']} thread(s), "
        f"median of {st['steps_timed']} steps after {st['warmup']} warm-up; each configuration in its own process "
        "(peak RSS includes loading). `+gc` = gradient checkpointing; * = the configuration's own default.\n",
        "| configuration | peak RSS MiB | step s (CPU time) | step s (wall) |",
        "|---|---|---|---|",
    ]
    for name, r in speed["table"].items():
        lines.append(f"| {'* ' if r['own_default'] else ''}{name} | {r['peak_rss_mb']:.0f} | {r['step_cpu_s']:.2f} | {r['step_s']:.2f} |")
    run = next((r for r in speed.get("runs", []) if r["config"] == "int4-lora" and r.get("plan_fractions")), None)
    if run:
        packed = {f: v for f, v in run["plan_fractions"].items() if f.startswith(("int4", "int8"))}
        share = ", ".join(f"{f} {v / sum(packed.values()):.0%}" for f, v in packed.items())
        states = "8-bit" if run.get("optim") == "adamw_torch_8bit" else "fp32 (measured before the 8-bit default)"
        plan = (f"a plan scanned on the first training blocks ({share} of the packed linear weights; embeddings and head bf16)"
                if run.get("budget_bits") else f"every linear but the head {share.split()[0]}")
        learned = learned_kinds(run.get("learn_steps", False))
        learned = f", the base learning its {learned}" if learned else ""
        current = {k: v for k, v in run.items() if k in ("budget_bits", "loftq", "optim")} | {"learn_steps": run.get("learn_steps", False)}
        default = {k: v for k, v in parse_variant(INT4_DEFAULT).items() if k in current}
        then = "" if current == default else (f" These are the recipe's defaults of when they ran; its defaults now (`{INT4_DEFAULT}`) "
                                              "were not timed in this table.")
        lines += ["", f"The `int4-lora` rows ran {plan}, LoftQ-initialised adapters{learned}; their AdamW states {states}.{then}"]  # fmt: skip
    g = speed["goals"]
    lines += ["", f"Goals (CPU time): peak RSS of the INT4 default {g['rss_defaults_vs_fp32_defaults']:.2f}x fp32 LoRA (goal ≤ 0.40), "
              f"{g['rss_vs_bnb_equal_nogc']:.2f}x bnb NF4 at equal settings (≤ 0.9); step {g['step_vs_bnb_equal_nogc']:.2f}x bnb (≤ 0.8), "
              f"{g['step_defaults_vs_fastest_peer']:.2f}x the fastest bf16 LoRA `{g['fastest_peer']}` (≤ 1.0).", ""]  # fmt: skip
    lines += ondevice_other_cpus(ondevice)
    quality = (ondevice or {}).get("quality")
    if quality:
        q = quality["settings"]
        lines += [f"Held-out perplexity after {q['steps']} steps of {st['batch']}x{q['block']} tokens (`ondevice.py quality`, lr 2e-4, "
                  f"same data order), on {q['eval_blocks']} blocks of the held-out plays; goal: within 3% of bf16 LoRA. Rows with "
                  "several seeds (adapter init and data order) give mean ± std, the ratio paired with bf16 LoRA's run of the same "
                  "seed. `merged` = after `export --merge` (LoRA folded in, re-quantized to INT4); `merged bf16` = "
                  "`--merge-into bf16` (dense); both of seed 0. The offline checkpoint's linear weights were Q4_1 (4-bit, "
                  "asymmetric, blocks of 32) before it was dequantized: each block of 32 holds at most 16 values, so INT4 "
                  "groups of 32 (‡ rows) line up with its blocks and fit it far better than they would a bf16 checkpoint; "
                  "no ‡ row is evidence for that group size, and the other INT4 rows may be kinder than on a bf16 "
                  "checkpoint too.\n"]  # fmt: skip
        header = ["| run | seeds | ppl after | vs bf16 LoRA | merged | merged bf16 | training loss, step 1 → last 10 |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
        before_split = {_quality_key(r) for r in quality["runs"]
                        if r["config"].startswith("int4") and r.get("backend", "auto") != "dequant" and "int8_outlier_columns" not in r}
        groups = quality_by_variant(quality["summary"])
        evidence = {n: g for n, g in groups.items() if g["seeds"] >= MIN_SEEDS}
        exploratory = {n: g for n, g in groups.items() if g["seeds"] < MIN_SEEDS}
        lines += [f"Runs over {MIN_SEEDS} or more seeds:\n", *header]
        lines += [_ondevice_quality_row(n, g, before_split) for n, g in evidence.items()]
        if exploratory:
            lines += ["", f"Ablations with fewer seeds (exploratory: a figure here is not evidence for a claim, which needs "
                          f"{MIN_SEEDS} seeds):\n", *header]  # fmt: skip
            lines += [_ondevice_quality_row(n, g, before_split) for n, g in exploratory.items()]
        if before_split:
            lines += ["", "† measured before the int8 backend multiplied each call's loudest input channels apart (commit f94f9a2); "
                          "re-measured since: all-INT4 1.138x → 1.113x, all-INT4+LoftQ 1.097x → 1.079x, AWQ+GPTQ+LoftQ 1.103x → 1.106x, "
                          "30% int8 1.050x → 1.036x."]  # fmt: skip
        default = groups.get(default_quality_key())
        if default and default["ratio"]:
            options = parse_variant(INT4_DEFAULT)
            bits = options["budget_bits"] or _bits(options["int4_format"])
            lines += ["", f"Goal: the INT4 default (`{default_quality_key()}`, {bits:.2f} bits per linear weight) "
                          f"{default['ratio']:.3f}x ± {default['ratio_std']:.3f} bf16 LoRA's perplexity over {default['seeds']} "
                          "seed(s) (≤ 1.01 at ≤ 5 bits)."]  # fmt: skip
        all_int4 = {n: g for n, g in evidence.items() if n.startswith("int4-lora (int4-g64-asym)") and "sensitive" not in n and g["ratio"]}
        if all_int4:
            name, best = min(all_int4.items(), key=lambda item: item[1]["ratio"])
            lines += [f"Every linear but the head INT4 (int4-g64-asym), best of the runs over {MIN_SEEDS}+ seeds (`{name}`): "
                      f"{best['ratio']:.3f}x ± {best['ratio_std']:.3f} (goal ≤ 1.03)."]  # fmt: skip
        lines.append("")
    return lines


def _ondevice_quality_row(name: str, g: dict, before_split: set[str]) -> str:
    """One row of the on-device quality table for the seed group ``g`` of variant ``name``."""
    r = g["first"]
    vs = f"{g['ratio']:.3f}x" + (f" ± {g['ratio_std']:.3f}" if g["seeds"] > 1 else "") if g["ratio"] else "—"
    ppl = f"{g['ppl_after']:.2f}" + (f" ± {g['ppl_after_std']:.2f}" if g["seeds"] > 1 else "")
    name += (" †" if name in before_split else "") + (" ‡" if f"-g{CHECKPOINT_Q4_BLOCK}" in name else "")
    merged = f"{r['ppl_merged']:.2f}" if r.get("ppl_merged") else "—"
    dense = f"{r['ppl_merged_dense']:.2f}" if r.get("ppl_merged_dense") else "—"
    trend = f"{r['loss_step1']:.2f} → {r['loss_last10_mean']:.2f}" + (" (rose: diverged)" if r["loss_last10_mean"] > r["loss_step1"] else "")
    return f"| {name} | {g['seeds']} | {ppl} | {vs} | {merged} | {dense} | {trend} |"


def quality_by_variant(summary: dict) -> dict[str, dict]:
    """The on-device quality rows grouped over seeds (``name [seed N]`` rows join ``name``): per variant the number of
    seeds, mean ± std of the perplexity after training and of its ratio to bf16 LoRA's (None where no ratio), and the
    first seed's row."""
    rows: dict[str, list[dict]] = {}
    for name, r in summary.items():
        rows.setdefault(re.sub(r" \[seed \d+\]$", "", name), []).append(r)
    out = {}
    for name, runs in rows.items():
        ratios = [r["ppl_after_vs_bf16_lora"] for r in runs if r.get("ppl_after_vs_bf16_lora")]
        ratio, ratio_std = mean_std(ratios) if ratios else (None, None)
        ppl, ppl_std = mean_std([r["ppl_after"] for r in runs])
        out[name] = {"seeds": len(runs), "ppl_after": ppl, "ppl_after_std": ppl_std, "ratio": ratio, "ratio_std": ratio_std,
                     "first": runs[0]}  # fmt: skip
    return out


def kernels_section() -> list[str]:
    """One table per CPU class measured by kernel_speed.py: each kernel's throughput as a ratio to the fp32 GEMM."""
    lines = ["## CPU kernels per CPU class (benchmarks/kernel_speed.py)\n"]
    files = sorted(RESULTS.glob("kernels-*.json"))
    if not files:
        return lines + ["not measured\n"]
    for path in files:
        k = json.loads(path.read_text())
        m = k["machine"]
        m.setdefault("emulated_by", k.get("emulated_by"))  # a top-level key in files written before 2026-12-04
        how = f"; reproduced on an AVX-512 CPU with {reproduced_by(m)}" if m["emulated_by"] else ""
        if m["emulated_by"] and "TORCHINDUCTOR_CPP_MARCH" not in m["emulated_by"]:  # before 2026-12-04's evening
            how += "; hf-lowprec's kernels then built -march=native, so with that CPU's AVX-512 code"
        kernels = list(next(iter(k["results"].values())))
        lines += [f"**{m['cpu_class']}** ({m['machine']}, {m['threads']} threads, {k['tokens']} tokens{how}): throughput / fp32 GEMM\n",
                  "| shape | " + " | ".join(kernels) + " |", "|---|" + "---|" * len(kernels)]  # fmt: skip
        for shape, r in k["results"].items():
            lines.append(f"| {shape} | " + " | ".join(f"{r[x]['vs_fp32']:.2f}" if x in r else "" for x in kernels) + " |")
        lines += ["", f"![kernels]({path.stem}.png)", ""]
    return lines


def reproduced_by(machine: dict) -> str:
    """The variables that reproduced a result's CPU class on a larger CPU (recorded since 2026-12-04; before that,
    scale.py's runs set the three named here)."""
    env = machine.get("emulated_by")
    if not env:
        return "HF_LOWPREC_CPU_CLASS=avx2, oneDNN/MKL limited to AVX2"
    return ", ".join(f"{name}={value}" for name, value in env.items())


def scale_section(scale: dict | None, stem: str = "scale") -> list[str]:
    """Load and training memory and step time per model size and configuration (benchmarks/scale.py; ``stem``: the
    results file, ``scale-<class>`` for a CPU class other than the main one's)."""
    if not scale:
        return ["## Fine-tuning at real sizes (benchmarks/scale.py)\n",
                "not measured: run `python benchmarks/scale.py` (about 40 minutes on 2 cores; not part of `make bench`)\n"]  # fmt: skip
    m = scale["machine"]
    lines = ["## Fine-tuning at real sizes (benchmarks/scale.py)\n" if stem == "scale" else
             f"## Fine-tuning at real sizes on the {m['cpu_class']} CPU class (benchmarks/scale.py, results/{stem}.json)\n"]  # fmt: skip
    where = (f"{m['cpu_class']} class reproduced on the AVX-512 {m['machine']} ({reproduced_by(m)}: fp32 compute)"
             if m["cpu"].get("restricted_to") else f"{m['machine']} ({m['cpu_class']})")
    lines += [f"{where}, {m['threads']} threads; random-weight checkpoints of each architecture, "
              f"LoRA r={scale['lora']['r']} on every linear, {scale['steps']} timed steps after one warm-up; peak RSS from a run where "
              "glibc returns every freed block of 64 KiB or more, step times from a run with glibc's default allocator (the "
              "other one's page faults double some step times; hf-lowprec's loading returns freed blocks by itself since "
              "2026-12-02, so its load peaks are alike in both; the glibc peaks are that run's own, and the only ones "
              "`int4-lora-returned` changes: it leaves an allocator set by the environment as it is). Each configuration's "
              "process imports what its own install "
              "has: bitsandbytes only for the NF4 rows (PEFT imports it whenever installed, 35 MB; rows marked * imported it "
              "in every configuration). Rows measured on different days ran at different machine speeds (up to 1.7x apart "
              "here): compare step times within one day only.\n",
              "| size | configuration | optimizer states | params | load s | load peak MiB | peak MiB 1x256 | peak MiB 4x256 | glibc peak MiB 1x256 | glibc peak MiB 4x256 | step s 1x256 | step s 4x256 | measured |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    def glibc(batch: dict) -> str:  # the step-time run's own peak (rows before 2026-12-02 have none)
        return f"{batch['peak_rss_mb_glibc']:.0f}" if "peak_rss_mb_glibc" in batch else ""

    for r in sorted(scale["results"], key=lambda r: (r["params"], r["config"])):
        t1, t4 = r["train"]["1x256"], r["train"]["4x256"]
        states = "8-bit" if "8bit" in r.get("optimizer", "") else "fp32"  # rows before 2026-12-02: torch's AdamW
        lines.append(f"| {r['size']} | {r['config']} | {states} | {r['params'] / 1e6:.0f}M | {r['load_s']:.1f} | {r['load_peak_rss_mb']:.0f} | "
                     f"{t1['peak_rss_mb']:.0f} | {t4['peak_rss_mb']:.0f} | {glibc(t1)} | {glibc(t4)} | "
                     f"{t1['step_s_median']:.2f} | {t4['step_s_median']:.2f} | "
                     f"{r.get('measured', 'before 2026-12-02')}{'' if 'bitsandbytes_importable' in r else ' *'} |")  # fmt: skip
    fits = ", ".join(f"{c} {f['1x256']['bytes_per_param']:.2f} B/param + {f['1x256']['overhead_mb']:.0f} MiB" for c, f in scale["fit"].items())
    lines += ["", f"Peak RSS (loading included, batch 1x256) against parameters, least squares over the sizes: {fits}." if fits
              else "One size measured: no fit of peak RSS against parameters.", ""]  # fmt: skip
    def vs_nf4(ratio: float | None, goal: str = " (goal 0.7)") -> str:
        return "NF4 QLoRA not measured here" if ratio is None else f"{ratio:.2f}x bnb NF4 QLoRA's peak{goal}"

    for config, g in scale.get("goals", {}).items():
        lines.append(f"Llama-3.2-1B shape, `{config}`, batch 1x256: peak {g['peak_rss_mb']:.0f} MiB (goal {g['peak_rss_goal_mb']:.0f}), "
                     f"{g['peak_vs_checkpoint']:.3f}x the bf16 checkpoint on disk (goal {g['peak_vs_checkpoint_goal']}), "
                     f"{vs_nf4(g.get('peak_vs_nf4_qlora'))}; step "
                     f"{g.get('step_vs_fastest_peer', float('nan')):.2f}x the fastest peer's ({g.get('fastest_peer')}; goal 1.0). "
                     "Those pair each allocator's best figure; from one allocator: glibc's default, peak "
                     f"{g['glibc_peak_rss_mb']:.0f} MiB ({vs_nf4(g.get('glibc_peak_vs_nf4_qlora'), '')}) at that step; "
                     f"the mmap one, step {g.get('mmap_step_vs_fastest_peer', float('nan')):.2f}x the fastest peer's "
                     f"({g.get('mmap_fastest_peer')}) at that peak.\n")  # fmt: skip
    untied = {r["config"]: r for r in scale["results"] if r["size"].endswith("-untied")}
    if {"int4-lora", "int4-lora-bf16-embedding"} <= untied.keys():
        packed, dense = untied["int4-lora"], untied["int4-lora-bf16-embedding"]
        peak = {k: max(r["load_peak_rss_mb"], r["train"]["1x256"]["peak_rss_mb"]) for k, r in untied.items()}
        lines.append(f"Untied input embedding (`{packed['size']}`, {packed['params'] / 1e6:.0f}M parameters), batch 1x256, "
                     f"loading included: the defaults pack the table in int8, peak {peak['int4-lora']:.0f} MiB against "
                     f"{peak['int4-lora-bf16-embedding']:.0f} MiB with it left bf16; step {packed['train']['1x256']['step_s_median']:.2f} "
                     f"s against {dense['train']['1x256']['step_s_median']:.2f} s (a run of its own: compare these two rows with each "
                     "other; not in the fits).\n")  # fmt: skip
    return lines + [f"![scale]({stem}.png)", ""]


def adapter_optimizer_section(data: dict | None) -> list[str]:
    """The LoRA adapters' optimizer states: bytes saved against step time (benchmarks/adapter_optimizer.py)."""
    lines = ["## Adapter optimizer states (benchmarks/adapter_optimizer.py)\n"]
    if not data:
        return lines + ["not measured\n"]
    lines += [f"{data['machine']} ({data['cpu_class']}), {data['threads']} threads; LoRA r={data['lora']['r']} on every linear, "
              "random gradients, the optimizers stepping in turn; extra step time against scale.py's INT4+LoRA step at batch "
              "1x256 of the same shape.\n",
              "| shape | optimizer | states MB | saves MB | update ms | vs fp32 AdamW | extra step time |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for size, r in data["results"].items():
        for name, o in r["optimizers"].items():
            extra = f"+{o['extra_vs_int4_lora_step']:.0%}" if "extra_vs_int4_lora_step" in o else "—"
            lines.append(f"| {size} | {name} | {o['state_mb']:.1f} | {o['state_saved_mb']:.1f} | {o['step_ms']:.0f} | "
                         f"{o['time_vs_adamw']:.1f}x | {extra} |")  # fmt: skip
    return lines + ["", "The on-device default is `adamw_hf_lowprec_8bit` (since 2026-12-02; fp32 states before): torchao's 8-bit "
                    "states and numerics, its CPU step one C++ pass per block of 256.", ""]


def gguf_section(data: dict | None) -> list[str]:
    """A GGUF export run by llama.cpp against the run's own model (benchmarks/gguf_llamacpp.py)."""
    lines = ["## The GGUF export in llama.cpp (benchmarks/gguf_llamacpp.py)\n"]
    if not data:
        return lines + ["not measured (needs a Python with llama-cpp-python)\n"]
    m = data["machine"]
    return lines + [
        f"{m['machine']} ({m['cpu_class']}), {m['threads']} threads, llama-cpp-python {data['llama_cpp_python']}; {data['what']}. "
        "Mean held-out loss (nats/token):\n",
        "| model | loss |", "|---|---|",
        f"| before training | {data['loss_before_training']:.4f} |",
        f"| hf-lowprec, the run's model (fp32, exact kernels) | {data['loss_hf_lowprec']:.4f} |",
        f"| llama.cpp, model.gguf + adapter.gguf | {data['loss_llama_cpp']:.4f} |",
        f"| hf-lowprec without the adapters | {data['loss_hf_lowprec_without_adapters']:.4f} |",
        f"| llama.cpp, model.gguf alone | {data['loss_llama_cpp_without_adapter']:.4f} |",
        "", f"First block: top-1 agreement {data['first_block_top1_agreement']:.1%}, largest logit difference "
        f"{data['first_block_max_abs_logit_diff']:.2f} of {data['first_block_logit_scale']:.1f} (llama.cpp rounds activations "
        "to 8 bits for its Q4_1 products).", "",
    ] + tokenization_rows(data.get("tokenization_llama_cpp_vs_transformers")) + real_shape_rows(data.get("real_shape"))  # fmt: skip


def real_shape_rows(found: dict | None) -> list[str]:
    """llama.cpp's logits against hf-lowprec's on a real-size export (``gguf_llamacpp.py --shape``)."""
    if not found:
        return []
    m = found["machine"]
    return [
        f"At a real size ({m['machine']}, {m['cpu_class']}): {found['what']}. model.gguf {found['model_gguf_bytes'] / 1e6:,.0f} MB "
        f"({', '.join(f'{n} {k}' for k, n in found['tensor_types'].items())} tensors). llama.cpp's logits against hf-lowprec's: "
        f"correlation {found['logit_correlation']:.4f}, RMS difference {found['relative_rms_diff']:.1%} of the logits' spread, "
        f"largest {found['max_abs_logit_diff']:.2f} of {found['logit_scale']:.2f}, top-1 agreement {found['top1_agreement']:.1%} "
        "(random weights: small logit differences, so 8-bit activations move more of the top-1).", "",
    ]  # fmt: skip


def tokenization_rows(found: dict | None) -> list[str]:
    """llama.cpp's tokenization from a GGUF file's vocabulary against transformers' tokenizer, per export."""
    if not found:
        return []
    lines = ["llama.cpp tokenizing text from the GGUF file's vocabulary alone, against transformers' tokenizer "
             "(held-out passages and a line of numbers and contractions):\n",
             "| export | tokenizer.ggml.pre | texts tokenized identically | tokens |", "|---|---|---|---|"]  # fmt: skip
    for name, f in found.items():
        lines.append(f"| {name} | {f['tokenizer.ggml.pre']} | {f['identical_texts']} of {f['texts']} | {f['tokens']:,} |")
    return lines + [""]


def int4_training_section(data: dict | None) -> list[str]:
    """How the auto plan's INT4 layers train in full fine-tuning (benchmarks/int4_in_full_finetuning.py)."""
    lines = ["## INT4 layers in full fine-tuning: an ablation (benchmarks/int4_in_full_finetuning.py)\n"]
    if not data:
        return lines + ["not measured\n"]
    m, runs = data["machine"], data["runs"]
    bf16 = {r["seed"]: r["ppl_after"] for r in runs if r["variant"] == "bf16"}
    lines += [f"{m['machine']} ({m['cpu_class']}), {m['threads']} threads. SmolLM2-135M-Instruct, the auto-mixed recipe's "
              "scanned plan (its loss budget and score, or the ones named), full fine-tuning 200 steps of 1x256 tokens at "
              "lr 2e-5, one seed per row; only the training of the plan's INT4 layers changes. 'As trained': the FP8 "
              "layers in FP8; 'exported': what the recipe exports, the INT4 layers' packed codes and the FP8 layers' master "
              "weights. Each seed's plan comes from its own scan.\n",
              "| variant | seed | plan | ppl as trained | vs bf16 | ppl exported | vs bf16 | train loss, last 10 |",
              "|---|---|---|---|---|---|---|---|"]  # fmt: skip

    def vs(ppl, seed):
        return f"{ppl / bf16[seed]:.4f}x" if ppl is not None and seed in bf16 else "—"

    def label(r):
        named = [f"loss budget {r['max_loss_increase']}" if r.get("max_loss_increase") is not None else "",
                 f"scored {r['score']}" if r.get("score") else "", r.get("int4_format") or ""]  # fmt: skip
        named = ", ".join(n for n in named if n)
        return r["variant"] + (f" ({named})" if named else "")

    groups: dict[str, list[float]] = {}
    for r in runs:
        plan = ", ".join(f"{k} {v:.0%}" for k, v in sorted(r["plan_fractions"].items())) or "—"
        exported_ppl = r.get("ppl_exported")
        lines.append(f"| {label(r)} | {r['seed']} | {plan} | {r['ppl_after']:.2f} | {vs(r['ppl_after'], r['seed'])} | "
                     f"{'—' if exported_ppl is None else f'{exported_ppl:.2f}'} | {vs(exported_ppl, r['seed'])} | "
                     f"{r['loss_last10']:.3f} |")  # fmt: skip
        if exported_ppl is not None and r["seed"] in bf16 and r["variant"] != "bf16":
            groups.setdefault(label(r), []).append(exported_ppl / bf16[r["seed"]])
    for name, ratios in groups.items():
        if len(ratios) > 1:
            mean, std = mean_std(ratios)
            lines.append(f"\n{name}, exported vs bf16 over {len(ratios)} seeds: {mean:.4f}x ± {std:.4f}")
    return lines + [""]


def gpu_section(gpu: dict | None) -> list[str]:
    lines = ["## GPU column\n"]
    if not gpu:
        return lines + ["not measured: `benchmarks/gpu.sh` is prepared (Llama ~1.1B from a config, bf16 vs hf-lowprec FP8 plans vs torchao "
                        "tensorwise/rowwise, each decoder layer compiled, batch 4x2048) but no GPU was lent to the session that "
                        "produced this report.\n"]  # fmt: skip
    lines += [f"{gpu['device']}, torch {gpu['torch']}, torchao {gpu.get('torchao', '?')}; ratios to bf16 with each decoder layer "
              "compiled\n", "| run | step s | vs bf16 | peak GB | vs bf16 |", "|---|---|---|---|---|"]  # fmt: skip
    for name, r in gpu["results"].items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error']} | | | |")
        else:
            lines.append(f"| {name} | {r['step_s']:.3f} | {r.get('time_vs_bf16', 1):.2f}x | {r['peak_GB']:.1f} | {r.get('memory_vs_bf16', 1):.2f}x |")
    return lines + [""]


def main():
    conv, layers, gpu = load("convergence"), load("layers"), load("gpu")
    memory, ondevice, fq, memory_glibc = load("memory"), load("ondevice"), load("finetune_quality"), load("memory_default_malloc")
    conv_lines, conv_res = convergence_section(conv)
    conv_lines += convergence_section(load(ARCH_RUN), "Convergence from scratch, SmolLM2-135M's architecture")[0]
    out = ["# hf-lowprec benchmark report\n", "Regenerated by `make bench`. Machine: 2 CPU cores (AVX512-BF16, VNNI) unless a section names another CPU class; "
           "no GPU unless the GPU column says otherwise.\n"]
    out += claims(conv_res, layers, memory, ondevice, gpu, memory_glibc)
    out += conv_lines
    out += layers_section(layers)
    out += memory_section(memory)
    out += finetune_quality_section(fq)
    out += finetune_quality_section(load(LONG_FINETUNE), "Longer fine-tuning, several seeds")
    out += int4_training_section(load("int4_in_full_finetuning"))
    out += outliers_section(load("outliers"))
    out += scan_section(load("scan"))
    out += scan_cost_section(load("scan_cost"))
    out += ondevice_section(ondevice)
    out += scale_section(load("scale"))
    for path in sorted(RESULTS.glob("scale-*.json")):  # the other CPU classes'
        out += scale_section(load(path.stem), path.stem)
    out += adapter_optimizer_section(load("adapter_optimizer"))
    out += gguf_section(load("gguf_llamacpp"))
    out += kernels_section()
    out += gpu_section(gpu)
    path = RESULTS / "REPORT.md"
    path.write_text("\n".join(out) + "\n")
    update_readme(claims(conv_res, layers, memory, ondevice, gpu, memory_glibc))
    print(path.read_text())


def update_readme(claim_lines: list[str]) -> None:
    """Replace the claims table between the README's markers with the one just computed."""
    readme = RESULTS.parent.parent / "README.md"
    start, end = "<!-- claims:start -->", "<!-- claims:end -->"
    text = readme.read_text()
    if start not in text or end not in text:
        return
    table = "\n".join(line for line in claim_lines if line.startswith("|"))
    head, rest = text.split(start, 1)
    readme.write_text(f"{head}{start}\n{table}\n{end}{rest.split(end, 1)[1]}")


if __name__ == "__main__":
    main()
