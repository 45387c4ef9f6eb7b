"""SwiGLU's product and RMSNorm as autograd nodes (training/fused_blocks.py): values and gradients against fp64
autograd, outputs rebuilt from the 8-bit copies of their inputs under ActivationStorage, a tiny Llama fused."""

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_int8_rows, needs_cpp, tiny_llama
from torch import nn

from hf_lowprec.modules.packed import dequantize_rows, quantize_rows
from hf_lowprec.training import activations, fused_blocks
from hf_lowprec.training.activations import ActivationStorage
from hf_lowprec.training.fused_blocks import (
    fuse_blocks,
    is_rms_norm,
    is_swiglu_mlp,
    rms_norm,
    rms_norm_values,
    silu_mul,
    silu_mul_values,
)


def _int8_round_trip(t: torch.Tensor) -> torch.Tensor:
    """What the storage gives back for ``t``: int8 per row, one step per row (checked against the fp64 reference)."""
    rows = t.detach().reshape(-1, t.shape[-1])
    back = dequantize_rows(*quantize_rows(rows), None, t.dtype).reshape(t.shape)
    assert_int8_rows(back, t)
    return back


@pytest.mark.parametrize("kernel", [pytest.param("C++", marks=needs_cpp), "torch ops"])
def test_silu_mul_values_and_gradients_match_fp64_autograd(kernel, monkeypatch):
    if kernel == "torch ops":
        monkeypatch.setattr(fused_blocks, "native_kernels", lambda *tensors: None)
        monkeypatch.setattr(activations, "_SLICE", 100)  # several row blocks of a [6, 40, 48] tensor
    gen = torch.Generator().manual_seed(0)
    gate = (torch.randn(6, 40, 48, generator=gen) * 3).requires_grad_()
    up = torch.randn(6, 40, 48, generator=gen).requires_grad_()
    grad = torch.randn(6, 40, 48, generator=gen)
    out = silu_mul(gate, up)
    out.backward(grad)
    g64, u64 = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    ref = F.silu(g64) * u64
    ref.backward(grad.double())
    assert torch.equal(out, F.silu(gate.detach()) * up.detach())  # transformers' LlamaMLP, bit for bit
    torch.testing.assert_close(gate.grad, g64.grad.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(up.grad, u64.grad.float(), rtol=1e-5, atol=1e-6)
    gb, ub = gate.detach().bfloat16(), up.detach().bfloat16()
    assert torch.equal(silu_mul(gb, ub), F.silu(gb) * ub)  # bf16 too: SiLU rounded, then the product


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
    torch.testing.assert_close(rebuilt, F.silu(_int8_round_trip(g)) * _int8_round_trip(u), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, grad_out.t() @ rebuilt, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(rebuilt, silu_mul_values(g, u), rtol=1e-4, atol=1e-5)  # the round trip is lossy


def _swiglu_grads(dtype: torch.dtype, stored: bool):
    """A SwiGLU MLP's forward/backward in ``dtype``, its activations in int8 if ``stored``: ``(the input's and the
    projections' gradients, [gate, up] as backward left them, [gate, up] as the forward made them)``."""
    torch.manual_seed(1)
    mlp = nn.ModuleList([nn.Linear(64, 96), nn.Linear(64, 96), nn.Linear(96, 64)]).to(dtype)
    x = torch.randn(32, 64, dtype=dtype, requires_grad=True)
    with ActivationStorage(mlp, "int8", min_numel=1) if stored else contextlib.nullcontext():
        g, u = mlp[0](x), mlp[1](x)
        y = mlp[2](silu_mul(g, u))
    made = [g.detach().clone(), u.detach().clone()]
    y.backward(torch.randn(32, 64, dtype=dtype))
    return [x.grad, *(m.weight.grad for m in mlp)], [g.detach(), u.detach()], made


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_gradients_overwrite_its_rebuilt_inputs_with_the_same_bits(dtype, monkeypatch):
    """Under ActivationStorage, SwiGLU's backward gets gate and up rebuilt for it alone and writes its gradients over
    them (at the Llama-3.2-1B step's peak: 8 MB less in bf16, 16 in fp32): the same bits as into new tensors. Without
    the storage it reads the forward's own gate and up, and leaves them as they were."""
    in_place = []
    real = fused_blocks.silu_mul_grad
    monkeypatch.setattr(fused_blocks, "silu_mul_grad", lambda *args: in_place.append(args[3]) or real(*args))
    grads, *_ = _swiglu_grads(dtype, stored=True)
    with monkeypatch.context() as patch:
        patch.setattr(ActivationStorage, "reader_owns", staticmethod(lambda t: False))
        expected, *_ = _swiglu_grads(dtype, stored=True)
    assert in_place == [True, False]
    assert all(torch.equal(a, b) for a, b in zip(grads, expected))
    _, left, made = _swiglu_grads(dtype, stored=False)
    assert in_place[-1] is False and all(torch.equal(a, b) for a, b in zip(left, made))


def test_the_product_is_saved_as_it_is_when_its_inputs_were_not_stored():
    """Inputs below ``min_numel`` are saved as they are: nothing to rebuild from, the product is saved exactly."""
    x = torch.randn(32, 64)
    exact, *_ = _mlp_step(False, None, x)
    grad, *_, storage = _mlp_step(True, 1 << 20, x)
    assert storage.stored_bytes == 0
    torch.testing.assert_close(grad, exact, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_llamas_bit_for_bit_and_its_gradients_match_fp64_autograd(dtype, monkeypatch):
    monkeypatch.setattr(activations, "_SLICE", 200)  # several row blocks of [3, 50, 64]
    norm = tiny_llama().model.norm.to(dtype)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64, generator=gen) + 0.5)
    x = (torch.randn(3, 50, 64, generator=gen) * 4).to(dtype).requires_grad_()
    grad = torch.randn(3, 50, 64, generator=gen).to(dtype)
    expected = norm(x)  # transformers' LlamaRMSNorm
    expected.backward(grad)
    ref_x, ref_w = x.grad.clone(), norm.weight.grad.clone()
    x.grad, norm.weight.grad = None, None
    got = rms_norm(x, norm.weight, norm.variance_epsilon)
    assert torch.equal(got, expected)
    got.backward(grad)
    # against fp64 autograd of the same formula (no bf16 roundings in between)
    x64, w64 = x.detach().double().requires_grad_(), norm.weight.detach().double().requires_grad_()
    (w64 * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)).backward(grad.double())
    if dtype == torch.float32:
        torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(norm.weight.grad.double(), w64.grad, rtol=1e-5, atol=1e-5)
    # in either dtype, not much further from it than transformers' own gradients are (bf16: both round the same
    # forward; these sums run in another order)
    for ours, theirs, exact in ((x.grad, ref_x, x64.grad), (norm.weight.grad, ref_w, w64.grad)):
        assert (ours.double() - exact).norm() <= 1.5 * (theirs.double() - exact).norm() + 1e-9


def test_the_normalized_output_is_rebuilt_from_the_stored_input():
    norm, proj = nn.RMSNorm(64), nn.Linear(64, 48)  # proj saves the norm's output for its weight gradient
    weight = torch.rand(64) + 0.5
    x = torch.randn(32, 64) * 3
    grad_out = torch.randn(32, 48)
    storage = ActivationStorage(nn.ModuleList([norm, proj]), "int8", min_numel=1)
    with storage:
        y = proj(rms_norm(x.requires_grad_(), weight, 1e-5))
    y.backward(grad_out)
    row = lambda cols: 32 * (cols + 4)  # noqa: E731  int8 codes + one fp32 step per row
    assert storage.stored_bytes == row(64) + row(1)  # x and its rstd factors [32, 1]: the output is rebuilt
    rebuilt = rms_norm_values(_int8_round_trip(x), weight, 1e-5)
    stored = _int8_round_trip(x)
    torch.testing.assert_close(rebuilt, stored * torch.rsqrt(stored.square().mean(-1, keepdim=True) + 1e-5) * weight)
    torch.testing.assert_close(proj.weight.grad, grad_out.t() @ rebuilt, rtol=1e-5, atol=1e-5)


def test_fusing_a_tiny_llama_keeps_its_outputs_and_gradients():
    model = tiny_llama(num_hidden_layers=3)
    fused = copy.deepcopy(model)
    assert fuse_blocks(fused) == {"swiglu_mlp": 3, "rms_norm": 7}  # 2 norms a layer and the final one
    assert fuse_blocks(fused) == {"swiglu_mlp": 0, "rms_norm": 0}  # fused already
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
    assert not is_swiglu_mlp(mlp) and fuse_blocks(mlp)["swiglu_mlp"] == 0


def test_norms_of_another_kind_are_not_fused():
    """Gemma's RMSNorm scales by ``1 + weight``: another forward, left alone."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    assert is_rms_norm(tiny_llama().model.norm)
    assert not is_rms_norm(GemmaRMSNorm(64)) and not is_rms_norm(nn.RMSNorm(64))
    assert fuse_blocks(GemmaRMSNorm(64)) == {"swiglu_mlp": 0, "rms_norm": 0}
