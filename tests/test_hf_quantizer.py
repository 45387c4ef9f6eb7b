"""The transformers quantizer ``quant_method: hf_lowprec``: config validation, empty shells, from_pretrained reload."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import tiny_llama
from hf_lowprec import apply_plan, freeze
from hf_lowprec.export.hf_quantizer import HfLowprecConfig, install_packed_shells, quantization_config_dict
from hf_lowprec.modules import PackedInt4Linear, PackedInt8Linear
from hf_lowprec.plan import PrecisionPlan

PLAN = PrecisionPlan({"lm_head": "bf16", "*.v_proj": "int8"}, default="int4-g64-asym")


def test_config_round_trips_the_plan_and_names_a_bad_one():
    entry = quantization_config_dict(PLAN)
    assert entry == {"quant_method": "hf_lowprec", "plan": PLAN.to_dict()}
    assert HfLowprecConfig(**{k: v for k, v in entry.items() if k != "quant_method"}).to_dict() == entry
    with pytest.raises(ValueError, match="quantization_config.plan: unknown plan key"):
        HfLowprecConfig({"defaults": "int4"})


def test_shells_replace_exactly_the_packed_formats():
    model = tiny_llama()
    assert install_packed_shells(model, PLAN) == 2 * 7 - 2 + 2  # every linear of 2 blocks but lm_head: 12 int4, 2 int8
    kinds = {n: type(m) for n, m in model.named_modules() if isinstance(m, (PackedInt4Linear, PackedInt8Linear))}
    assert sum(k is PackedInt8Linear for k in kinds.values()) == 2 and all(("v_proj" in n) == (k is PackedInt8Linear) for n, k in kinds.items())
    assert type(model.lm_head) is torch.nn.Linear


def test_from_pretrained_rebuilds_the_packed_model(tmp_path):
    model = tiny_llama()
    apply_plan(model, PLAN, learn_scales=False)
    freeze(model)
    model.config.quantization_config = quantization_config_dict(PLAN)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)  # transformers alone: the quantizer is registered on import
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)
    assert reloaded.hf_lowprec_plan.to_dict() == PLAN.to_dict()
    assert sum(isinstance(m, PackedInt4Linear) for m in reloaded.modules()) == 12
