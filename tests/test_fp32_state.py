"""Learned quantization state (LSQ steps, activation steps, smoothing scales, scale statistics, packed step gains)
stays fp32 through model casts: ``model.to(torch.bfloat16)`` rounded a step to bf16, whose ulp is larger than an
AdamW update of it, and the step stopped learning."""

import torch
from conftest import tiny_llama
from text_batches import text_batches

from hf_lowprec import PrecisionPlan, apply_plan
from hf_lowprec.modules import Int4Linear
from hf_lowprec.scaling import make_policy_factory

PLAN = PrecisionPlan({"model.layers.0.mlp.up_proj": "int4-g32", "model.layers.0.mlp.down_proj": "int4-g64-a8-sq",
                      "model.layers.1.mlp.up_proj": "fp8"}, default="bf16")  # fmt: skip
KEPT = (".step", ".zero", ".scale", ".amax_history", ".running_amax")


def _kept_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict(keep_vars=True).items() if k.endswith(KEPT) and v.is_floating_point()}


def test_a_cast_model_keeps_its_learned_steps_and_statistics_fp32_with_their_values_and_gradients():
    model = tiny_llama()
    apply_plan(model, PLAN, fp8_backend="emulated", policy_factory=make_policy_factory("delayed"))
    (batch,) = text_batches(1)
    model(**batch).loss.backward()
    before = {k: (v, v.detach().clone(), None if v.grad is None else v.grad.clone()) for k, v in _kept_state(model).items()}
    assert {k.rsplit(".", 1)[-1] for k in before} == {"step", "scale", "amax_history"}
    assert any(v.grad is not None for v, _, _ in before.values())  # learned steps with their gradients
    model.to(torch.bfloat16)
    after = _kept_state(model)
    assert after.keys() == before.keys()
    for name, (obj, value, grad) in before.items():
        assert after[name] is obj or not isinstance(obj, torch.nn.Parameter), name  # an optimizer's Parameter
        assert after[name].dtype == torch.float32 and torch.equal(after[name].detach(), value), name
        assert (grad is None and after[name].grad is None) or torch.equal(after[name].grad, grad), name
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16  # the rest of the model was cast
    model.zero_grad()
    model(**batch).loss.backward()  # the bf16 model trains with its fp32 steps
    assert model.model.layers[0].mlp.up_proj.weight_quantizer.step.grad.dtype == torch.float32


def test_a_cast_packed_layer_keeps_its_learned_step_gain_fp32():
    torch.manual_seed(0)
    layer = Int4Linear.from_linear(torch.nn.Linear(128, 96), "int4-g32-asym", learn_scales=False).freeze()
    learned_gain, shift = layer.learn_steps()
    with torch.no_grad():
        learned_gain.mul_(1 + 1e-3 * torch.rand(layer.step.shape))  # after some steps: apart by less than a bf16 ulp
    gain = learned_gain.detach().clone()
    x = torch.randn(4, 128)
    layer(x).sum().backward()
    grad = layer.step_gain.grad.clone()
    layer.to(torch.bfloat16)
    assert layer.step_gain is learned_gain and torch.equal(learned_gain.detach(), gain)
    assert torch.equal(layer.step_gain.grad, grad) and shift.dtype == layer.zero.dtype
    assert layer(x.bfloat16()).dtype == torch.bfloat16


def test_layers_built_on_the_meta_device_materialize_with_to_empty():
    """``to_empty`` (FSDP's ``param_init_fn``, meta-device loading) moves fp32 state to the device without copying it:
    keeping its value copied a meta tensor and raised."""
    with torch.device("meta"):
        layer = Int4Linear.from_linear(torch.nn.Linear(64, 32), "int4-g32-a8-sq", learn_activation_scales=True)
    layer.to_empty(device="cpu")
    state = layer.state_dict()
    assert all(t.device.type == "cpu" for t in state.values())
    assert state["weight_quantizer.step"].dtype == state["input_quantizer.step"].dtype == torch.float32
