"""hf-lowprec: train and fine-tune Hugging Face models in FP8 and INT4, layer by layer."""

from hf_lowprec.convert import ConversionReport, apply_plan, eligible_layers, freeze, revert
from hf_lowprec.formats import FormatSpec
from hf_lowprec.integrations import quiet_imports, register_integrations
from hf_lowprec.modules import FP8Embedding, FP8Linear, Int4Embedding, Int4Linear, PackedInt4Linear, PackedInt8Linear
from hf_lowprec.plan import PrecisionPlan

__version__ = "0.1.0"

register_integrations()  # quant_method "hf_lowprec" for transformers, packed layers for PEFT (when they are imported)

_LAZY = {  # these import transformers/accelerate: loaded on first use
    "LowPrecisionCallback": "hf_lowprec.training.callback",
    "LowPrecisionPlugin": "hf_lowprec.training.accelerate",
    "HfLowprecConfig": "hf_lowprec.export.hf_quantizer",  # quantization_config= of from_pretrained
    # on-device INT4 + LoRA fine-tuning
    "prepare_int4_lora": "hf_lowprec.ondevice",
    "ChunkedLossTrainer": "hf_lowprec.ondevice",
    "load_int4_lora": "hf_lowprec.ondevice",
    "finetune_int4_lora": "hf_lowprec.ondevice",
    "export_int4_lora": "hf_lowprec.ondevice",
    "load_int4_model": "hf_lowprec.ondevice",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        with quiet_imports():
            return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hf_lowprec' has no attribute {name!r}")


__all__ = [
    "ChunkedLossTrainer",
    "ConversionReport",
    "FP8Embedding",
    "FP8Linear",
    "FormatSpec",
    "HfLowprecConfig",
    "Int4Embedding",
    "Int4Linear",
    "LowPrecisionCallback",
    "LowPrecisionPlugin",
    "PackedInt4Linear",
    "PackedInt8Linear",
    "PrecisionPlan",
    "apply_plan",
    "eligible_layers",
    "export_int4_lora",
    "finetune_int4_lora",
    "freeze",
    "load_int4_lora",
    "load_int4_model",
    "prepare_int4_lora",
    "revert",
]
