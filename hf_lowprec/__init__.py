"""hf-lowprec: train and fine-tune Hugging Face models in FP8 and INT4, layer by layer."""

from hf_lowprec.convert import ConversionReport, apply_plan, eligible_layers, freeze, revert
from hf_lowprec.formats import FormatSpec
from hf_lowprec.modules import FP8Embedding, FP8Linear, Int4Embedding, Int4Linear, PackedInt4Linear
from hf_lowprec.plan import PrecisionPlan

__version__ = "0.1.0"

__all__ = [
    "ConversionReport",
    "FP8Embedding",
    "FP8Linear",
    "FormatSpec",
    "Int4Embedding",
    "Int4Linear",
    "PackedInt4Linear",
    "PrecisionPlan",
    "apply_plan",
    "eligible_layers",
    "freeze",
    "revert",
]
