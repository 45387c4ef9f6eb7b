"""On-device LoRA fine-tuning at real sizes: load time, peak memory and step time against parameter count (issue 18).

Checkpoints of the SmolLM2-135M, SmolLM2-360M and Llama-3.2-1B architectures (``--sizes llama-3.2-3b`` adds the 3B)
are built from their configs with random weights (normal, std 0.02) and saved once as bf16 safetensors under
``--work`` (default ``~/.cache/hf_lowprec/scale``, or ``$HF_LOWPREC_CACHE/scale``). Each configuration then loads a checkpoint as a user would, in
a fresh process of its own, and trains LoRA (r=16, alpha 32, every linear) on random tokens with its own default
AdamW (8-bit states for hf-lowprec and NF4 QLoRA since 2026-12-02, fp32 for the dense peers; ``_optimizer``):

- ``int4-lora``: hf-lowprec's defaults, ``load_int4_lora(path, lora)``: every linear but the output head packed
  int4-g64-asym while loading (a head of more than 134M weights in int8, the tied embedding reading its rows),
  compute dtype chosen for this CPU, chunked loss, int8-stored activations (SwiGLU products and RMSNorm outputs
  rebuilt from them in backward since 2026-12-02: rows measured earlier stored them); ``int4-lora-gc``: the same with
  gradient checkpointing instead of the 8-bit activations; ``int4-lora-recipe-zeros``: the ``int4-ondevice-lora``
  recipe's base (the CLI default since 2026-12-05): the defaults with LoftQ (each dense weight read back at a time) and
  the base learning its zero points (``learn_steps="zero_points"``: a shift per group of 64, bf16 since 2026-12-06
  (fp32 before), its gradient from the inputs' group sums, its 8-bit AdamW states; an exact forward);
  ``int4-lora-recipe-zeros-gc`` (opt-in): the same with gradient checkpointing instead of the 8-bit activations (the
  recipe's ``training.gradient_checkpointing: true``); ``int4-lora-recipe`` (opt-in since 2026-12-05, the
  recipe's base until then): the steps learned too (``learn_steps=True``: a gain per group more, from a
  weight-gradient GEMM per layer); until 2026-12-03 the recipe scanned an int4/int8 plan at 6.25 bits/param instead;
  ``int4-lora-recipe-gptq`` (opt-in: ``--configs int4-lora-recipe-gptq``): the ``int4-lora-recipe`` base with GPTQ rounding
  (``rounding="gptq"``) calibrated on 4x256 random tokens, the LoftQ factors minimising each layer's output error;
- ``int4-lora-bf16-embedding``: the defaults with an untied input embedding kept bf16, as before the default plan
  packed it (``--sizes llama-3.2-1b-untied``: the 1B shape with its own embedding table, as Llama-3.1-8B has; the
  fits and the plot leave untied sizes out);
- ``fp32-lora`` / ``bf16-lora``: ``from_pretrained`` in fp32 / bf16 + PEFT (fp32 adapters), transformers' loss;
- ``nf4-qlora`` / ``nf4-qlora-gc``: bitsandbytes NF4 (double quant, bf16 compute) + PEFT, without / with gradient
  checkpointing.

The packed layers' kernel choices are measured once per machine and kept (``~/.cache/hf_lowprec/autotune.json``):
a configuration's first run on a machine measures them in its warm-up step, later runs read them; rows measured
with them read (a fresh cache adds the measuring to the first run's peak: ``HF_LOWPREC_CACHE`` elsewhere shows it).

Each configuration's process imports what its own install has: bitsandbytes only for the NF4 rows (``child_imports``).
Per configuration: load seconds, peak RSS while loading (``VmHWM``, imports included), then for batch 1x256 and
4x256 one warm-up and ``--steps`` timed steps with the peak reset before each (``/proc/self/clear_refs``): peak RSS
while training and the median step time. Each configuration runs twice: peak RSS is read where glibc serves blocks
of 64 KiB or more by mmap (``MALLOC_MMAP_THRESHOLD_``, so freed tensors leave RSS), times (and glibc's own peaks,
``*_glibc``) with glibc's default allocator, whose page faults are fewer (see ``run_config``). hf-lowprec's loading
sets the first itself while it packs (``hf_lowprec.allocator``, since 2026-12-02), so its ``*_glibc`` load
peaks are the mmap ones; its training runs on glibc's defaults. The plot shows peak
RSS and step time against parameter count, one line per configuration; a least-squares line per configuration
gives bytes per parameter above a fixed overhead.

    python benchmarks/scale.py [--sizes smollm2-135m smollm2-360m llama-3.2-1b] [--configs ...] [--steps 2]

Writes benchmarks/results/scale.json and scale.png (after every run, so an interrupted sweep keeps what it measured);
on a CPU of another class than the one scale.json was measured on, ``scale-<class>.json`` and ``.png`` instead, and
``scale-<class>-emulated`` where ``HF_LOWPREC_CPU_CLASS`` reproduces a class on a larger CPU (``results_stem``), so the
classes' rows, and real and reproduced ones, never mix.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _train_step import train_step
from _util import RESULTS, cpu_info, machine, proc_status_bytes, reset_peak_rss, write_json

from hf_lowprec.checkpoints import cache_root

MARK = "@@RESULT@@"
BLOCK = 256
BATCHES = (1, 4)
STEPS = 2  # timed steps per batch size (--steps)
CALIBRATION_BLOCKS = 4  # the recipe's calibration_batches at batch 1
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_theta": 500000.0}  # fmt: skip
SIZES = {  # the shapes of the published configs (config.json of each Hub checkpoint); weights random
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192),
    "smollm2-360m": dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15,
                         num_key_value_heads=5, vocab_size=49152, max_position_embeddings=8192),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
                         rope_parameters=LLAMA3_ROPE),
    "llama-3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                         rope_parameters=LLAMA3_ROPE),
}  # fmt: skip
UNTIED = "-untied"  # a size's shape with its own input embedding (Llama-3.1-8B, Qwen2.5-7B are untied); not in the fits
SIZES["llama-3.2-1b" + UNTIED] = {**SIZES["llama-3.2-1b"], "tie_word_embeddings": False}
DEFAULT_SIZES = ("smollm2-135m", "smollm2-360m", "llama-3.2-1b")
CONFIGS = {
    "int4-lora": "hf-lowprec INT4+LoRA defaults (int4-g64-asym packed on load, chunked loss, int8-stored activations, "
                 "8-bit AdamW)",
    "int4-lora-gc": "hf-lowprec INT4+LoRA defaults, gradient checkpointing instead of int8-stored activations",
    "int4-lora-returned": "hf-lowprec INT4+LoRA defaults, glibc's heap returning freed memory at each decoder block's "
                          "boundary (return_freed_memory=True)",
    "int4-lora-bf16-embedding": "hf-lowprec INT4+LoRA defaults with an untied input embedding left bf16 (the default "
                                "before PackedEmbedding)",
    "int4-lora-recipe": "hf-lowprec int4-ondevice-lora recipe's base until 2026-12-05: packed on load, LoftQ from the "
                        "checkpoint's residuals, the base learning its steps and zero points",
    "int4-lora-recipe-zeros": "hf-lowprec int4-ondevice-lora recipe's base (the CLI default): packed on load, LoftQ from "
                              "the checkpoint's residuals, the base learning its zero points (learn_steps='zero_points')",
    "int4-lora-recipe-zeros-gc": "the int4-lora-recipe-zeros base with gradient checkpointing instead of int8-stored "
                                 "activations (the recipe's training.gradient_checkpointing: true)",
    "int4-lora-recipe-gptq": "the int4-lora-recipe base (steps and zero points learned) with GPTQ rounding (--rounding gptq), calibrated on "
                             f"{CALIBRATION_BLOCKS}x{BLOCK} random tokens, its LoftQ factors minimising each layer's "
                             "output error (CLoQ); not in the default sweep",
    "int4-hf-quantizer": "transformers' own from_pretrained(quantization_config=HfLowprecConfig()) + PEFT's "
                         "get_peft_model and the model's own loss, as the NF4 QLoRA peer (no chunked loss, no 8-bit "
                         "activations), 8-bit AdamW",
    "fp32-lora": "fp32 LoRA (PEFT)",
    "bf16-lora": "bf16 LoRA (PEFT, fp32 adapters)",
    "nf4-qlora": "bnb NF4 QLoRA (double quant, bf16 compute)",
    "nf4-qlora-gc": "bnb NF4 QLoRA + gradient checkpointing",
}
# measured when named (--configs): minutes at 1B
OPT_IN = ("int4-lora-bf16-embedding", "int4-lora-recipe", "int4-lora-recipe-zeros-gc", "int4-lora-recipe-gptq")
NEEDS_BITSANDBYTES = ("nf4-qlora", "nf4-qlora-gc")  # the others run as an install without it (see child_imports)


# ------------------------------------------------------------------------------------- checkpoints
def checkpoint(work: Path, size: str) -> Path:
    """The bf16 safetensors folder of ``size`` under ``work``, built once (in a child process: its memory is freed)."""
    folder = work / size
    if not (folder / "config.json").is_file():
        proc = subprocess.run([sys.executable, __file__, "build", "--size", size, "--work", str(work)], text=True)
        if proc.returncode:
            raise RuntimeError(f"building the {size} checkpoint failed")
    return folder


def build(size: str, work: Path) -> None:
    """Save a random-weight ``size`` checkpoint (bf16; embeddings tied unless the size says not) atomically into
    ``work / size``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{"tie_word_embeddings": True, **SIZES[size]}, rms_norm_eps=1e-5)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(torch.bfloat16).to_empty(device="cpu")  # bf16 on the meta device first: a 3B model in fp32 is 13 GB
    model.tie_weights()  # to_empty gives the head its own storage
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.02)
    tmp = work / f".{size}.tmp"
    model.save_pretrained(tmp)
    tmp.replace(work / size)


# ------------------------------------------------------------------------------------- child
def _load(config: str, folder: Path):
    """``(model, loss_fn(batch) -> loss, notes)`` for one configuration, loaded from ``folder``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    lora = LoraConfig(**LORA)
    torch.manual_seed(0)
    if config.startswith("int4-lora"):
        import contextlib

        from hf_lowprec.allocator import freed_memory_returned_per_block
        from hf_lowprec.ondevice import chunked_causal_lm_loss, load_int4_lora
        from hf_lowprec.training.activations import ActivationStorage

        options = {}
        if config.startswith("int4-lora-recipe"):
            options = dict(loftq_init=True, learn_steps="zero_points" if "-zeros" in config else True)
        if config == "int4-lora-recipe-gptq":
            vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
            tokens = torch.randint(0, vocab, (CALIBRATION_BLOCKS, BLOCK), generator=torch.Generator().manual_seed(1))
            options.update(rounding="gptq", calibration=tokens)
        if config == "int4-lora-bf16-embedding":
            from hf_lowprec.plan import PrecisionPlan

            options = dict(plan=PrecisionPlan({"lm_head": "int8"}, default="int4-g64-asym"))
        model, _, report = load_int4_lora(folder, lora, **options)
        model.get_base_model().config.use_cache = False
        if config.endswith("-gc"):  # checkpointing instead of 8-bit saved activations
            model.get_base_model().activation_checkpointing_enable({"use_reentrant": False})
        storage = contextlib.nullcontext() if config.endswith("-gc") else ActivationStorage(model, "int8")
        returned = freed_memory_returned_per_block(model) if config.endswith("-returned") else contextlib.nullcontext()
        returned.__enter__()  # its hooks stay while loss_fn (which holds it) lives: forward and backward of every step

        def loss_fn(batch, returned=returned):
            with storage:
                return chunked_causal_lm_loss(model, batch)

        head = {r.name: r.applied for r in report.layers}.get("lm_head")
        return model, loss_fn, {"plan_fractions": report.fractions(), "compute": report.compute, "head_format": head}
    if config.startswith("nf4-qlora"):
        bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                 bnb_4bit_compute_dtype=torch.bfloat16)  # fmt: skip
        base = AutoModelForCausalLM.from_pretrained(folder, quantization_config=bnb, dtype=torch.bfloat16)
    elif config == "int4-hf-quantizer":
        from hf_lowprec import HfLowprecConfig

        base = AutoModelForCausalLM.from_pretrained(folder, quantization_config=HfLowprecConfig(), dtype=torch.bfloat16)
    else:
        base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32 if config == "fp32-lora" else torch.bfloat16)
    if config.endswith("-gc"):
        base.activation_checkpointing_enable({"use_reentrant": False})
    base.config.use_cache = False
    model = get_peft_model(base, lora)  # "all-linear" includes packed layers (hf_lowprec.modules.int4_lora)
    return model, lambda batch: model(input_ids=batch, labels=batch).loss, {}


def _optimizer(config: str, params: list):
    """Each configuration's own default AdamW: 8-bit states for hf-lowprec (``finetune_int4_lora``'s default) and
    for NF4 QLoRA (bitsandbytes' ``AdamW8bit``, QLoRA's paged optimizer without paging on a CPU), fp32 states for
    the dense peers (transformers' default)."""
    import torch

    if config.startswith("int4-"):
        from hf_lowprec.training.adamw8bit import AdamW8bit

        return AdamW8bit(params, lr=1e-4, weight_decay=0.0)
    if config.startswith("nf4-qlora"):
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=1e-4, weight_decay=0.0)
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)


def child_imports(config: str) -> None:
    """Make this process import what ``config``'s own install has: bitsandbytes only for the NF4 configurations.

    PEFT imports bitsandbytes whenever it is installed (``peft/helpers.py``): 35 MB of imports (500 modules) in every
    process, measured on this benchmark's environment, which has it for the NF4 peer. hf-lowprec installs it only with
    the ``[bnb]`` extra, and the dense peers do not need it either, so their processes see it as not installed
    (``sys.modules`` entry ``None``: imports raise ``ImportError``, ``importlib.util.find_spec`` returns ``None``).
    Rows record whether it was importable (``bitsandbytes_importable``); rows without that key (measured before
    2026-12-03) imported it in every configuration."""
    if config not in NEEDS_BITSANDBYTES:
        assert "bitsandbytes" not in sys.modules, "imported before the child could leave it out"
        sys.modules["bitsandbytes"] = None


def child(args) -> dict:
    """One configuration at one size, in this process."""
    import torch

    from hf_lowprec.ondevice import backend_counts

    rss_imports = proc_status_bytes("VmRSS") / 2**20
    start = time.perf_counter()
    model, loss_fn, notes = _load(args.config, Path(args.folder))
    load_s = time.perf_counter() - start
    load_peak, rss_loaded = proc_status_bytes("VmHWM") / 2**20, proc_status_bytes("VmRSS") / 2**20
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = _optimizer(args.config, params)
    vocab = model.get_base_model().config.vocab_size
    gen = torch.Generator().manual_seed(0)
    model.train()
    per_batch = {}
    for batch_size in BATCHES:
        reset_peak_rss()
        times, losses = [], []
        for _ in range(1 + args.steps):  # one warm-up step (autotuning, optimizer states), then the timed ones
            batch = torch.randint(0, vocab, (batch_size, BLOCK), generator=gen)
            t0 = time.perf_counter()
            losses.append(train_step(lambda: loss_fn(batch), optimizer, params))
            times.append(time.perf_counter() - t0)
        per_batch[f"{batch_size}x{BLOCK}"] = {
            "peak_rss_mb": proc_status_bytes("VmHWM") / 2**20, "step_s_median": statistics.median(times[1:]), "step_s": times,
            "losses": losses,
        }  # fmt: skip
    return {
        "size": args.size, "config": args.config, "description": CONFIGS[args.config],
        "params": checkpoint_params(Path(args.folder)),
        "checkpoint_mb": sum(f.stat().st_size for f in Path(args.folder).glob("*.safetensors")) / 2**20,
        "load_s": load_s, "load_peak_rss_mb": load_peak, "rss_after_load_mb": rss_loaded, "rss_imports_mb": rss_imports,
        "train": per_batch, "peak_rss_mb": max([load_peak] + [b["peak_rss_mb"] for b in per_batch.values()]),
        "trainable_params": sum(p.numel() for p in params), "backends": backend_counts(model),
        "threads": torch.get_num_threads(), "loadavg": os.getloadavg(),
        "optimizer": f"{type(optimizer).__module__}.{type(optimizer).__name__}",
        "bitsandbytes_importable": sys.modules.get("bitsandbytes", False) is not None, **notes,
    }  # fmt: skip


def checkpoint_params(folder: Path) -> int:
    """Parameters of the checkpoint in ``folder`` (its safetensors' shapes; the tied table once), the x axis: counted
    from the model, a packed or NF4 layer would count its bytes."""
    from safetensors import safe_open

    total = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                total += math.prod(f.get_slice(name).get_shape())
    return total


# ------------------------------------------------------------------------------------ parent
def run_child(size: str, config: str, folder: Path, steps: int, mmap_allocator: bool) -> dict:
    """One configuration in a fresh process; ``mmap_allocator``: glibc returns every freed block of 64 KiB or more."""
    cmd = [sys.executable, __file__, "child", "--size", size, "--config", config, "--folder", str(folder),
           "--steps", str(steps)]  # fmt: skip
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if mmap_allocator:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith(MARK)), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"{size} {config} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[len(MARK) :])


def run_config(size: str, config: str, folder: Path, steps: int) -> dict:
    """Memory from a run with the mmap allocator (RSS follows the live tensors), times (and glibc's own peaks) from a
    run with glibc's default one: the mmap allocator's page faults double some step times (measured at the 1B shape:
    INT4+LoRA 2.0 -> 4.2 s, bf16 LoRA 2.25 -> 3.8 s), and not all configurations alike."""
    memory = run_child(size, config, folder, steps, mmap_allocator=True)
    speed = run_child(size, config, folder, steps, mmap_allocator=False)
    for batch, row in memory["train"].items():
        timed = speed["train"][batch]
        row.update(step_s_median=timed["step_s_median"], step_s=timed["step_s"], peak_rss_mb_glibc=timed["peak_rss_mb"],
                   step_s_median_mmap_allocator=row["step_s_median"])  # fmt: skip
    memory.update(load_s=speed["load_s"], load_peak_rss_mb_glibc=speed["load_peak_rss_mb"])
    steps_text = "  ".join(f"{k} {v['step_s_median']:6.2f} s, peak {v['peak_rss_mb']:6.0f} MB" for k, v in memory["train"].items())
    print(f"{size:13s} {config:13s} load {memory['load_s']:5.1f} s, peak {memory['load_peak_rss_mb']:6.0f} MB | {steps_text}",
          flush=True)  # fmt: skip
    return memory


def peak_mb(r: dict, batch: str) -> float:
    """Peak RSS of a configuration training at ``batch`` (e.g. ``1x256``), loading included, MB."""
    return max(r["load_peak_rss_mb"], r["train"][batch]["peak_rss_mb"])


def fit(results: list[dict]) -> dict:
    """Per configuration and batch, peak RSS (MB, loading included) ~ overhead + slope x parameters, least squares
    over the sizes measured."""
    out = {}
    for config in sorted({r["config"] for r in results}):
        rows = [r for r in results if r["config"] == config and not r["size"].endswith(UNTIED)]
        if len(rows) < 2:
            continue
        for batch in rows[0]["train"]:
            slope, intercept = statistics.linear_regression([r["params"] for r in rows], [peak_mb(r, batch) * 2**20 for r in rows])
            out.setdefault(config, {})[batch] = {"bytes_per_param": slope, "overhead_mb": intercept / 2**20, "sizes": len(rows)}
    return out


def goals(results: list[dict]) -> dict:
    """The issue's targets at the Llama-3.2-1B shape, batch 1x256, as ratios measured in this run: peak RSS with the
    mmap allocator beside step time with glibc's default one (each allocator's best figure), and, so that no figure
    mixes the two, both again from one allocator (``glibc_*``: default glibc; ``mmap_step_vs_fastest_peer``)."""
    batch = f"1x{BLOCK}"
    at = {r["config"]: r for r in results if r["size"] == "llama-3.2-1b"}
    peers = {c: r for c, r in at.items() if not c.startswith("int4-")}

    def glibc_peak(r: dict) -> float:
        return max(r["load_peak_rss_mb_glibc"], r["train"][batch]["peak_rss_mb_glibc"])

    def step_vs_fastest(ours: dict, key: str) -> tuple[float, str]:
        """Against the fastest peer measured the same day (the machine's speed drifts between days)."""
        same_day = [r for r in peers.values() if r.get("measured") == ours.get("measured")] or list(peers.values())
        fastest = min(same_day, key=lambda r: r["train"][batch][key])
        return ours["train"][batch][key] / fastest["train"][batch][key], fastest["config"]

    out = {}
    for config in ("int4-lora", "int4-lora-gc", "int4-lora-returned", "int4-lora-recipe", "int4-lora-recipe-zeros",
                   "int4-lora-recipe-zeros-gc"):
        ours = at.get(config)
        if ours is None:
            continue
        peak = peak_mb(ours, batch)
        row = {"peak_rss_mb": peak, "peak_rss_goal_mb": 0.6 * ours["checkpoint_mb"], "peak_vs_checkpoint": peak / ours["checkpoint_mb"],
               "peak_vs_checkpoint_goal": 0.6, "glibc_peak_rss_mb": glibc_peak(ours)}  # fmt: skip
        if "nf4-qlora" in peers:
            row["peak_vs_nf4_qlora"] = peak / peak_mb(peers["nf4-qlora"], batch)
            row["glibc_peak_vs_nf4_qlora"] = glibc_peak(ours) / glibc_peak(peers["nf4-qlora"])
        if peers:
            row["step_vs_fastest_peer"], row["fastest_peer"] = step_vs_fastest(ours, "step_s_median")
            row["mmap_step_vs_fastest_peer"], row["mmap_fastest_peer"] = step_vs_fastest(ours, "step_s_median_mmap_allocator")
        out[config] = row
    return out


def summary(results: list[dict], steps: int = STEPS) -> dict:
    """What scale.json holds: the machine, the settings (``steps``: the timed steps of this sweep; each row names its
    own), every run, the fits and the goals."""
    return {"machine": machine(), "steps": steps, "lora": LORA, "block": BLOCK, "results": results, "fit": fit(results),
            "goals": goals(results)}  # fmt: skip


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = data["results"]
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for config in CONFIGS:
        rows = [r for r in results if r["config"] == config and not r["size"].endswith(UNTIED)]
        rows.sort(key=lambda r: r["params"])
        if not rows:
            continue
        x = [r["params"] / 1e9 for r in rows]
        ax_mem.plot(x, [peak_mb(r, f"1x{BLOCK}") / 1024 for r in rows], "o-", label=config)
        ax_time.plot(x, [r["train"][f"1x{BLOCK}"]["step_s_median"] for r in rows], "o-", label=config)
    ax_mem.set(xlabel="parameters (billions)", ylabel=f"peak RSS, loading and training 1x{BLOCK} (GB)", title="peak memory")
    ax_time.set(xlabel="parameters (billions)", ylabel=f"step time, batch 1x{BLOCK} (s)", title="step time")
    for ax in (ax_mem, ax_time):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"LoRA fine-tuning on {data['machine']['machine']} ({data['machine']['cpu_class']})", fontsize=10)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=90)
    os.replace(tmp, path)


def results_stem() -> str:
    """``scale`` where scale.json is missing or was measured on a CPU of this class, else ``scale-<this class>``;
    ``scale-<class>-emulated`` for a class reproduced on a larger CPU (``HF_LOWPREC_CPU_CLASS``)."""
    if cpu_info().restricted_to:
        return f"scale-{cpu_info().cpu_class}-emulated"
    main = RESULTS / "scale.json"
    if not main.is_file() or json.loads(main.read_text())["machine"]["cpu_class"] == cpu_info().cpu_class:
        return "scale"
    return f"scale-{cpu_info().cpu_class}"


def sweep(args) -> None:
    work = Path(args.work).expanduser()
    work.mkdir(parents=True, exist_ok=True)
    stem = results_stem()
    path = RESULTS / f"{stem}.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    done = {(r["size"], r["config"]): r for r in old.get("results", [])}  # earlier runs of other sizes/configs
    for size in args.sizes:
        folder = checkpoint(work, size)
        for config in args.configs:
            done[(size, config)] = {**run_config(size, config, folder, args.steps), "steps": args.steps,
                                    "measured": time.strftime("%Y-%m-%d")}  # fmt: skip
            data = summary(list(done.values()), args.steps)
            write_json(f"{stem}.json", data)
            plot(data, RESULTS / f"{stem}.png")
    print(json.dumps({"fit": data["fit"], "goals": data["goals"]}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", default="sweep", choices=["sweep", "child", "build", "plot"])
    parser.add_argument("--sizes", nargs="+", default=list(DEFAULT_SIZES), choices=list(SIZES))
    parser.add_argument("--configs", nargs="+", default=[c for c in CONFIGS if c not in OPT_IN], choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=STEPS, help="timed steps per batch size (after one warm-up)")
    parser.add_argument("--work", default=str(cache_root() / "scale"),
                        help="where the random-weight checkpoints are saved (built once)")  # fmt: skip
    parser.add_argument("--size", choices=list(SIZES), help=argparse.SUPPRESS)
    parser.add_argument("--config", choices=list(CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode == "child":
        child_imports(args.config)
        print(MARK + json.dumps(child(args)))
    elif args.mode == "build" and args.size:  # a sweep's child building one checkpoint
        build(args.size, Path(args.work))
    elif args.mode == "build":  # a user building --sizes ahead of a sweep (each once, in a child)
        for size in args.sizes:
            print(checkpoint(Path(args.work).expanduser(), size))
    elif args.mode == "plot":  # fits, goals and plot again from the runs in this CPU class's scale json
        stem = results_stem()
        old = json.loads((RESULTS / f"{stem}.json").read_text())
        for r in old["results"]:  # runs before the count read the checkpoint
            folder = Path(args.work) / r["size"]
            r["params"] = checkpoint_params(folder) if folder.is_dir() else r["params"]
        data = {**summary(old["results"]), "machine": old["machine"], "steps": old["steps"]}
        write_json(f"{stem}.json", data)
        plot(data, RESULTS / f"{stem}.png")
    else:
        sweep(args)


if __name__ == "__main__":
    main()
