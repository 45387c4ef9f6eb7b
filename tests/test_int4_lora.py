"""PackedLoraLinear: LoRA on a packed base against a dense reference, merge / unmerge, unsupported options."""

import pytest
import torch
from peft import LoftQConfig, LoraConfig, get_peft_model

from hf_lowprec.modules import Int4Linear
from hf_lowprec.modules.int4_lora import PackedLoraLinear, register_int4_lora


def packed_with_lora(**lora):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48))
    model[0] = Int4Linear.from_linear(model[0], "int4-g32-asym", learn_scales=False).freeze()
    model[0].backend = "dequant"  # the exact kernel, whichever is fastest here: compared with a dense reference
    config = register_int4_lora(LoraConfig(r=4, lora_alpha=8, target_modules=["0"], **lora))
    peft = get_peft_model(model, config)
    layer = peft.base_model.model[0]
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(0, 0.1)  # B starts at zero: make the adapter matter
    return peft, layer


def test_forward_and_grads_equal_a_dense_reference():
    peft, layer = packed_with_lora()
    assert isinstance(layer, PackedLoraLinear)
    base = layer.get_base_layer()
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    x = torch.randn(3, 5, 64, requires_grad=True)
    y = peft(x)
    g = torch.randn_like(y)
    y.backward(g)
    xr = x.detach().clone().requires_grad_()
    ar, br = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    w = base.dequantized_weight(torch.float32)
    ref = xr @ w.t() + base.bias + layer.scaling["default"] * (xr @ ar.t()) @ br.t()
    ref.backward(g)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    for ours, theirs in ((x.grad, xr.grad), (a.grad, ar.grad), (b.grad, br.grad)):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_bf16_activations_get_autograds_gradients_and_backward_keeps_the_fp32_adapters():
    """bf16 inputs, fp32 adapters: the gradients of autograd through the casts (PEFT's way), and the tensors saved for
    backward are the adapters themselves, not bf16 copies of them."""
    peft, layer = packed_with_lora()
    peft.to(torch.bfloat16)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    a.data, b.data = a.data.float(), b.data.float()
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = peft(x)
    g = torch.randn_like(y)
    y.backward(g)
    assert any(t is a for t in saved) and any(t is b for t in saved)
    assert not any(t.dtype == torch.bfloat16 and t.shape in (a.shape, b.shape) for t in saved)
    xr = x.detach().clone().requires_grad_()
    ar, br = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    base = layer.get_base_layer()
    x2d = xr.reshape(-1, 64)
    delta = torch.addmm(base(x2d), torch.nn.functional.linear(x2d, ar.to(torch.bfloat16)), br.to(torch.bfloat16).t(),
                        alpha=layer.scaling["default"])  # fmt: skip
    delta.reshape(y.shape).backward(g)
    torch.testing.assert_close(y, delta.reshape(y.shape).detach(), rtol=0, atol=0)
    for ours, theirs in ((x.grad, xr.grad), (a.grad, ar.grad), (b.grad, br.grad)):
        assert ours.dtype == theirs.dtype
        torch.testing.assert_close(ours, theirs, rtol=0.01, atol=1e-3)


def test_merge_requantizes_the_delta_and_reports_the_error():
    peft, layer = packed_with_lora()
    base = layer.get_base_layer()
    expected = base.dequantized_weight(torch.float32) + layer.get_delta_weight("default").float()
    with pytest.warns(UserWarning, match="re-quantizes its codes: .* merge into dense weights"):  # as PEFT for bnb
        layer.merge()
    stats = layer.merge_errors[-1]
    got = base.dequantized_weight(torch.float32)
    assert layer.merged and stats["adapters"] == ["default"] and stats["delta_norm"] > 0
    assert stats["rel_error"] == pytest.approx(((got - expected).norm() / expected.norm()).item(), rel=1e-4)
    x = torch.randn(4, 64)
    torch.testing.assert_close(peft(x), x @ got.t() + base.bias, rtol=1e-5, atol=1e-5)  # merged: the base alone
    layer.unmerge()
    assert not layer.merged


def test_unmerge_puts_back_the_base_of_before_the_merge_exactly_learned_shifts_too():
    """PEFT's merge_adapter / unmerge_adapter (and disable_adapter on a merged model, which unmerges): subtracting
    the adapters and re-quantizing rounded a second time, moving the frozen base for good (by a fifth of the
    adapters' own effect on logits); now the codes, steps, zero points and learned shift come back bit for bit."""
    peft, layer = packed_with_lora()
    base = layer.get_base_layer()
    base.learn_steps(steps=False)
    with torch.no_grad():
        base.zero_shift.normal_(0, 0.3)
    before = {n: t.clone() for n, t in base.state_dict(keep_vars=False).items()}
    shift = base.zero_shift.detach().clone()
    x = torch.randn(4, 64)
    with torch.no_grad():
        y0 = peft(x)
        with pytest.warns(UserWarning, match="re-quantizes"):
            peft.merge_adapter()
        assert not torch.equal(peft(x), y0)  # the merged codes, rounded
        peft.unmerge_adapter()
        assert torch.equal(peft(x), y0) and torch.equal(base.zero_shift, shift)
    assert all(torch.equal(t, before[n]) for n, t in base.state_dict().items())


@pytest.mark.parametrize("option, message", [(dict(use_dora=True), r"\(e\.g\. DoRA\) is not supported on a packed base"),
                                             (dict(lora_bias=True), "lora_bias=True is not supported on a packed base"),
                                             (dict(init_lora_weights="pissa"), "not supported on a packed base"),
                                             (dict(init_lora_weights="loftq", loftq_config=LoftQConfig()), r"prepare_int4_lora\(loftq_init=True\)")])
def test_unsupported_options_raise(option, message):
    with pytest.raises(ValueError, match=message):
        packed_with_lora(**option)


@pytest.mark.parametrize("option, message", [(dict(use_dora=True), r"\(e\.g\. DoRA\) is not supported on a packed base"),
                                             (dict(lora_bias=True), "lora_bias=True is not supported on a packed base"),
                                             (dict(init_lora_weights="olora"), "not supported on a packed base")])
def test_a_second_adapter_is_refused_what_the_first_is_before_any_of_it_exists(option, message, tmp_path):
    """add_adapter / load_adapter go through update_layer, not __init__: a lora_bias adapter loaded second was
    accepted and its bias ignored (logits off by the bias), DoRA failed on the packed weight half-made."""
    peft, layer = packed_with_lora()
    with pytest.raises(ValueError, match=message):
        peft.add_adapter("second", LoraConfig(r=2, target_modules=["0"], **option))
    assert list(peft.peft_config) == ["default"] and list(layer.lora_A) == ["default"]
    if option.get("lora_bias"):  # an adapter saved from a dense model, loaded onto the packed one
        dense = get_peft_model(torch.nn.Sequential(torch.nn.Linear(64, 48)), LoraConfig(r=2, target_modules=["0"], **option))
        dense.save_pretrained(tmp_path)
        with pytest.raises(ValueError, match=message):
            peft.load_adapter(tmp_path, adapter_name="loaded")


def test_fan_in_fan_out_is_turned_off_as_peft_turns_it_off_for_nn_linear():
    """A packed base is [out, in] as nn.Linear: with fan_in_fan_out kept, a merge added the transposed delta (a
    square layer merged silently wrong, others raised half way through the model)."""
    square = torch.nn.Sequential(torch.nn.Linear(64, 64))
    square[0] = Int4Linear.from_linear(square[0], "int4-g32-asym", learn_scales=False).freeze()
    square[0].backend = "dequant"
    with pytest.warns(UserWarning, match="Setting fan_in_fan_out to False"):
        peft = get_peft_model(square, register_int4_lora(LoraConfig(r=4, target_modules=["0"], fan_in_fan_out=True)))
    layer = peft.base_model.model[0]
    assert not layer.fan_in_fan_out and not peft.peft_config["default"].fan_in_fan_out
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(0, 0.5)
    x = torch.randn(4, 64)
    before = peft(x).detach()
    with pytest.warns(UserWarning, match="re-quantizes"):
        peft.merge_adapter()
    assert ((peft(x) - before).norm() / before.norm()).item() < 0.1  # one INT4 rounding of the merged weight
