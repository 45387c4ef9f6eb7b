"""SwiGLU's product as one autograd node (training/gated_mlp.py): values and gradients against fp64 autograd, the
product rebuilt from the 8-bit copies of its inputs under ActivationStorage, and the MLPs of a tiny Llama fused."""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_llama
from torch import nn

from hf_lowprec.modules.packed import dequantize_rows, quantize_rows
from hf_lowprec.training import gated_mlp
from hf_lowprec.training.activations import ActivationStorage
from hf_lowprec.training.gated_mlp import fuse_swiglu_mlps, is_swiglu_mlp, silu_mul, silu_mul_values


def _int8_round_trip(t: torch.Tensor) -> torch.Tensor:
    """What the storage gives back for ``t``: int8 per row, one step per row."""
    rows = t.detach().reshape(-1, t.shape[-1])
    return dequantize_rows(*quantize_rows(rows), None, t.dtype).reshape(t.shape)


def test_silu_mul_values_and_gradients_match_fp64_autograd(monkeypatch):
    monkeypatch.setattr(gated_mlp, "_SLICE", 100)  # several row blocks of a [6, 40, 48] tensor
    gen = torch.Generator().manual_seed(0)
    gate = (torch.randn(6, 40, 48, generator=gen) * 3).requires_grad_()
    up = torch.randn(6, 40, 48, generator=gen).requires_grad_()
    grad = torch.randn(6, 40, 48, generator=gen)
    out = silu_mul(gate, up)
    out.backward(grad)
    g64, u64 = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    ref = F.silu(g64) * u64
    ref.backward(grad.double())
    assert torch.equal(out, F.silu(gate.detach()) * up.detach())  # fp32: the same operations
    torch.testing.assert_close(gate.grad, g64.grad.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(up.grad, u64.grad.float(), rtol=1e-5, atol=1e-6)
    gb, ub = gate.detach().bfloat16(), up.detach().bfloat16()
    bf, exact = silu_mul_values(gb, ub), F.silu(gb.double()) * ub.double()
    assert bf.dtype == torch.bfloat16
    # rounded once to bf16 (8 significant bits): within half a unit in the last place of the exact product
    assert ((bf.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-30).all()


def _mlp_step(fused: bool, min_numel: int | None, x: torch.Tensor):
    """A SwiGLU MLP's forward/backward (its activations in int8 unless ``min_numel`` is None):
    ``(down.weight.grad, gate, up, output grad, storage)``."""
    torch.manual_seed(1)
    gate_proj, up_proj, down_proj = nn.Linear(64, 96), nn.Linear(64, 96), nn.Linear(96, 64)
    grad_out = torch.randn(32, 64)
    storage = None
    if min_numel is not None:
        storage = ActivationStorage(nn.ModuleList([gate_proj, up_proj, down_proj]), "int8", min_numel=min_numel)
    with storage if storage is not None else torch.enable_grad():
        g, u = gate_proj(x), up_proj(x)
        y = down_proj(silu_mul(g, u) if fused else F.silu(g) * u)
    y.backward(grad_out)
    return down_proj.weight.grad, g.detach(), u.detach(), grad_out, storage


def test_the_product_is_rebuilt_from_the_stored_gate_and_up_instead_of_stored():
    x = torch.randn(32, 64)
    *_, plain = _mlp_step(False, 1, x)
    grad, g, u, grad_out, fused = _mlp_step(True, 1, x)
    row = lambda cols: 32 * (cols + 4)  # noqa: E731  int8 codes + one fp32 step per row
    # x once (gate and up share it), gate and up; not silu(gate), not the product (both stored by the unfused MLP)
    assert fused.stored_bytes == row(64) + 2 * row(96)
    assert plain.stored_bytes == row(64) + 4 * row(96)
    assert fused.original_bytes == plain.original_bytes - 32 * 96 * 4  # silu(gate) no longer saved at all
    # the down projection's weight gradient reads the product rebuilt from the int8 copies of gate and up
    rebuilt = silu_mul_values(_int8_round_trip(g), _int8_round_trip(u))
    torch.testing.assert_close(grad, grad_out.t() @ rebuilt, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(rebuilt, silu_mul_values(g, u), rtol=1e-4, atol=1e-5)  # the round trip is lossy


def test_the_product_is_saved_as_it_is_when_its_inputs_were_not_stored():
    """Inputs below ``min_numel`` are saved as they are: nothing to rebuild from, the product is saved exactly."""
    x = torch.randn(32, 64)
    exact, *_ = _mlp_step(False, None, x)
    grad, *_, storage = _mlp_step(True, 1 << 20, x)
    assert storage.stored_bytes == 0
    torch.testing.assert_close(grad, exact, rtol=1e-6, atol=1e-6)


def test_fusing_a_tiny_llamas_mlps_keeps_its_outputs_and_gradients():
    model = tiny_llama(num_hidden_layers=3)
    fused = copy.deepcopy(model)
    assert fuse_swiglu_mlps(fused) == 3
    assert fuse_swiglu_mlps(fused) == 0  # already fused
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    ref, got = model(input_ids=ids, labels=ids), fused(input_ids=ids, labels=ids)
    assert torch.equal(ref.logits, got.logits)
    ref.loss.backward()
    got.loss.backward()
    for (name, p), q in zip(model.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert fused.state_dict().keys() == model.state_dict().keys()


@pytest.mark.parametrize("change", ["gelu", "another forward"])
def test_mlps_of_another_kind_are_not_fused(change):
    mlp = tiny_llama().model.layers[0].mlp
    assert is_swiglu_mlp(mlp)
    if change == "gelu":
        mlp.act_fn = nn.GELU()
    else:

        class DroppedMLP(type(mlp)):
            def forward(self, x):
                return self.down_proj(F.dropout(self.act_fn(self.gate_proj(x)) * self.up_proj(x), 0.1))

        mlp.__class__ = DroppedMLP
    assert not is_swiglu_mlp(mlp) and fuse_swiglu_mlps(mlp) == 0
