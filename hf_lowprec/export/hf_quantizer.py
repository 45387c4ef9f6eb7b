"""transformers integration: ``from_pretrained`` of folders whose linears are packed INT4 (``quant_method:
hf_lowprec``).

A folder saved by :func:`hf_lowprec.ondevice.export_int4_lora` holds ``qweight``/``step``/``zero``
tensors for the packed layers and, in ``config.json``::

    "quantization_config": {"quant_method": "hf_lowprec", "plan": {"default": "int4-g64", "layers": {...}}}

Importing ``hf_lowprec`` registers this method with transformers (``register_quantization_config`` /
``register_quantizer``; see :mod:`hf_lowprec.integrations`), so ``AutoModelForCausalLM.from_pretrained(folder)``
builds the model with empty packed layers where the plan says ``int4`` (or per-channel ``int8``) and loads the
codes into them. Without ``import hf_lowprec`` transformers warns "Unknown quantization type" and the packed layers
come back randomly initialised: always import hf_lowprec (or use ``load_int4_model``).
"""

from __future__ import annotations

from torch import nn
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING
from transformers.utils.quantization_config import QuantizationConfigMixin

from hf_lowprec.layers import swap_layers
from hf_lowprec.modules.packed import packed_class
from hf_lowprec.plan import PrecisionPlan

QUANT_METHOD = "hf_lowprec"


class HfLowprecConfig(QuantizationConfigMixin):
    """``quantization_config`` of a packed-INT4 folder: the precision plan that says which linears are packed."""

    def __init__(self, plan: dict | None = None, **kwargs):
        self.quant_method = QUANT_METHOD
        self.plan = PrecisionPlan.from_dict(plan or {}, source="quantization_config.plan").to_dict()

    def to_dict(self) -> dict:
        return {"quant_method": QUANT_METHOD, "plan": self.plan}


class HfLowprecQuantizer(HfQuantizer):
    """Swaps the plan's INT4 linears for empty packed shells before transformers loads the codes into them."""

    requires_calibration = True  # only pre-quantized folders load; quantizing at load time is apply_plan's job

    def _process_model_before_weight_loading(self, model, **kwargs):
        install_packed_shells(model, PrecisionPlan.from_dict(self.quantization_config.plan))
        model.hf_lowprec_plan = PrecisionPlan.from_dict(self.quantization_config.plan)

    def is_serializable(self) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return True  # the base stays frozen; adapters (PEFT) train on top, gradients pass through the codes


def install_packed_shells(model: nn.Module, plan: PrecisionPlan) -> int:
    """Replace each ``nn.Linear`` the plan puts in a packed format (int4; per-channel int8) by an empty packed
    layer of that format (same device/dtype)."""
    assignments = plan.assign(model)

    def shell(name: str, fqn: str, module: nn.Module) -> nn.Module | None:
        spec = assignments[name]
        cls = packed_class(spec)
        if cls is None or not isinstance(module, nn.Linear):
            return None
        w = module.weight
        return cls(module.in_features, module.out_features, spec, module.bias is not None, w.dtype, w.device)

    return swap_layers(model, shell)


def quantization_config_dict(plan: PrecisionPlan) -> dict:
    """The ``quantization_config`` entry for ``config.json`` of a packed folder made with ``plan``."""
    return HfLowprecConfig(plan.to_dict()).to_dict()


def register() -> None:
    """Make ``from_pretrained`` understand ``quant_method: hf_lowprec`` (once; :mod:`hf_lowprec.integrations` calls
    it when transformers is imported)."""
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(HfLowprecConfig)
        register_quantizer(QUANT_METHOD)(HfLowprecQuantizer)


register()
