"""layers.py: eligible layers and their PEFT-free names, the one swap loop, dense views of packed layers."""

import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from conftest import tiny_llama
from hf_lowprec import Int4Linear, apply_plan, freeze
from hf_lowprec.layers import canonical_name, dense_views, eligible_layers, swap_layers
from hf_lowprec.plan import PrecisionPlan


def test_names_are_the_same_with_and_without_peft():
    plain = set(eligible_layers(tiny_llama()))
    peft = get_peft_model(tiny_llama(), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    assert set(eligible_layers(peft)) == plain  # adapters left out, wrappers removed
    assert canonical_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer") == "model.layers.0.self_attn.q_proj"
    assert "lm_head" in plain and "model.embed_tokens" in plain and len(plain) == 2 * 7 + 2


def test_swap_layers_replaces_exactly_what_make_layer_returns_and_keeps_parameters():
    model = tiny_llama()
    before = dict(model.named_parameters())
    seen = []

    def make(name, fqn, module):
        seen.append(name)
        if name.endswith("mlp.up_proj"):
            return Int4Linear.from_linear(module, "int4-g64", learn_scales=False)
        return module if name.endswith("down_proj") else None  # the same module or None: nothing swapped

    assert swap_layers(model, make) == 2
    assert seen == list(eligible_layers(tiny_llama()))  # every eligible layer once, in model order
    assert [type(l.mlp.up_proj) for l in model.model.layers] == [Int4Linear, Int4Linear]
    for name, p in before.items():  # swapped layers keep the original Parameter objects
        assert dict(model.named_parameters())[name] is p


def test_dense_views_count_packed_layers_as_the_dense_layers_they_were():
    model = tiny_llama()
    dense = {n: m.weight.numel() for n, m in eligible_layers(model).items()}
    plan = PrecisionPlan({"lm_head": "bf16"}, default="int4-g64")
    apply_plan(model, plan, learn_scales=False)
    freeze(model)
    views = dense_views(model)
    assert {n: m.weight.numel() for n, m in views.items()} == dense
    assert all(m.weight.device.type == "meta" for n, m in views.items() if n.endswith("_proj"))
    rows = {r["format"]: r for r in plan.summary(model)}
    assert rows["int4-g64"]["params"] == sum(n for name, n in dense.items() if name.endswith("_proj"))
    assert isinstance(views["lm_head"], nn.Linear) and views["lm_head"].weight.device.type != "meta"
    assert torch.isclose(torch.tensor(sum(r["fraction"] for r in rows.values())), torch.tensor(1.0))
