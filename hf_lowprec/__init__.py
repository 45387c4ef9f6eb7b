"""hf-lowprec: train and fine-tune Hugging Face models in FP8 and INT4, layer by layer."""

from hf_lowprec.convert import ConversionReport, apply_plan, eligible_layers, freeze, revert
from hf_lowprec.formats import FormatSpec
from hf_lowprec.modules import FP8Embedding, FP8Linear, Int4Embedding, Int4Linear, PackedInt4Linear
from hf_lowprec.plan import PrecisionPlan

__version__ = "0.1.0"

_LAZY = {  # these import transformers/accelerate: loaded on first use
    "LowPrecisionCallback": "hf_lowprec.callback",
    "LowPrecisionPlugin": "hf_lowprec.accelerate_plugin",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hf_lowprec' has no attribute {name!r}")

__all__ = [
    "ConversionReport",
    "FP8Embedding",
    "FP8Linear",
    "FormatSpec",
    "Int4Embedding",
    "Int4Linear",
    "LowPrecisionCallback",
    "LowPrecisionPlugin",
    "PackedInt4Linear",
    "PrecisionPlan",
    "apply_plan",
    "eligible_layers",
    "freeze",
    "revert",
]
