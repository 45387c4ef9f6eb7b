"""On-device fine-tuning of pretrained checkpoints: a frozen packed-INT4 base with PEFT LoRA adapters.

The PEFT way, with the base in INT4::

    from peft import LoraConfig
    from hf_lowprec.ondevice import load_int4_lora, finetune_int4_lora, export_int4_lora

    model, tokenizer, report = load_int4_lora("path/or/hub-id", LoraConfig(r=16, target_modules="all-linear"))
    result = finetune_int4_lora(model, tokenizer, blocks, steps=50, lr=2e-4, batch_size=4, output_dir="run")

The base linears go through the precision plan (``convert.apply_plan`` then ``convert.freeze``), so a
plan may keep sensitive layers in int8/bf16; everything a plan puts in ``int4`` becomes a
:class:`~hf_lowprec.modules.PackedInt4Linear` (0.5 byte/parameter + steps), per-channel ``int8`` a
:class:`~hf_lowprec.modules.PackedInt8Linear` (1 byte/parameter), whose forward and grad-input run from
the codes (int8 ``_int_mm`` on CPUs; see ``modules/packed.py``).
Only the LoRA adapters train, so optimizer states exist for them only.

Activation memory, which dominates at this model size, is cut by storing the tensors saved for backward
in 8 bits (default; or gradient checkpointing), by SwiGLU MLPs and RMSNorms that save less for backward
(:mod:`~hf_lowprec.training.fused_blocks`: two ``[tokens, intermediate]`` tensors instead of four) and by a chunked loss that never materialises the
``[tokens, vocab]`` fp32 logits.
"""

from hf_lowprec.chunked_loss import chunked_causal_lm_loss, cross_entropy_with_grad
from hf_lowprec.ondevice.export import MERGE_DTYPES, MERGE_FILE, export_int4_lora, load_int4_model
from hf_lowprec.ondevice.learned_steps import fold_learned_steps
from hf_lowprec.ondevice.loftq import loftq_factors
from hf_lowprec.ondevice.loss import evaluate_loss, token_blocks
from hf_lowprec.ondevice.planning import (
    AUTO_BUDGET,
    AUTO_FORMATS,
    DEFAULT_FORMAT,
    int4_plan,
    resolve_target_modules,
    scan_int4_plan,
)
from hf_lowprec.ondevice.prepare import checkpoint_weights, load_int4_base, load_int4_lora, prepare_int4_lora
from hf_lowprec.ondevice.train import METRICS_FILE, FinetuneResult, backend_counts, finetune_int4_lora, peak_rss_mb


def __getattr__(name: str):
    # transformers' Trainer imports datasets and pandas (~90 MB resident): loaded when first asked for
    if name == "ChunkedLossTrainer":
        from hf_lowprec.ondevice.trainer import ChunkedLossTrainer

        return ChunkedLossTrainer
    raise AttributeError(f"module 'hf_lowprec.ondevice' has no attribute {name!r}")


__all__ = [
    "ChunkedLossTrainer",
    "AUTO_BUDGET",
    "AUTO_FORMATS",
    "DEFAULT_FORMAT",
    "FinetuneResult",
    "MERGE_DTYPES",
    "MERGE_FILE",
    "METRICS_FILE",
    "backend_counts",
    "checkpoint_weights",
    "chunked_causal_lm_loss",
    "cross_entropy_with_grad",
    "evaluate_loss",
    "export_int4_lora",
    "finetune_int4_lora",
    "fold_learned_steps",
    "int4_plan",
    "load_int4_base",
    "load_int4_lora",
    "load_int4_model",
    "loftq_factors",
    "peak_rss_mb",
    "prepare_int4_lora",
    "resolve_target_modules",
    "scan_int4_plan",
    "token_blocks",
]
