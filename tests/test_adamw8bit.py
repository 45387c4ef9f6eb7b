"""AdamW8bit: torchao's 8-bit AdamW (states, numerics, state_dict) with a one-pass C++ step on CPUs."""

import io

import pytest
import torch
import torchao.optim
from conftest import needs_cpp, tiny_llama
from torchao.optim.adam import single_param_adam
from torchao.optim.subclass_8bit import OptimState8bit

import hf_lowprec.training.adamw8bit as adamw8bit_module
from hf_lowprec.training.adamw8bit import AdamW8bit

# LoRA-like shapes (8-bit states: >= 4096 elements) and one small tensor torchao keeps in fp32
SHAPES = [(16, 2048), (2048, 16), (8, 1024), (4, 100)]


class EagerTorchaoAdamW8bit(torchao.optim.AdamW8bit):
    """The reference: torchao's own initialisation and ``single_param_adam``, run eagerly (its step compiles it)."""

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state.update(step=torch.tensor(0.0), exp_avg=self._new_buffer(p, True),
                                 exp_avg_sq=self._new_buffer(p, False))  # fmt: skip
                state["step"] += 1
                m, v = state["exp_avg"], state["exp_avg_sq"]
                stochastic = self.bf16_stochastic_round and p.dtype is torch.bfloat16
                single_param_adam(p.detach(), p.grad, state["step"], m, v, None, group["lr"], *group["betas"],
                                  group["weight_decay"], group["eps"], True, stochastic)  # fmt: skip


def _run(optimizers, steps: int, seed: int = 0):
    """Step every optimizer of ``optimizers`` (each over its own copy of the same parameters) on the same gradients:
    large ones every 5th step, so that the block scales move both ways."""
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        grads = [torch.randn(s, generator=gen) * (1e-1 if step % 5 == 0 else 1e-3) for s in SHAPES]
        for opt in optimizers:
            for p, g in zip(opt.param_groups[0]["params"], grads):
                p.grad = g.to(p.dtype)
            opt.step()


def _params(seed: int = 1, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.02).to(dtype)) for s in SHAPES]


def _assert_same_states(ours, ref, atol: float):
    for p, q in zip(ours.param_groups[0]["params"], ref.param_groups[0]["params"]):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=atol)
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = ours.state[p][key], ref.state[q][key]
            assert type(a) is type(b)
            if isinstance(a, OptimState8bit):
                assert torch.equal(a.codes, b.codes), key
                torch.testing.assert_close(a.scale, b.scale, rtol=1e-6, atol=0)
            else:
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-12)


@needs_cpp
def test_one_pass_step_matches_torchao_update():
    ours = AdamW8bit(_params(), lr=1e-3, weight_decay=0.01)
    ref = EagerTorchaoAdamW8bit(_params(), lr=1e-3, weight_decay=0.01)
    _run([ours, ref], steps=12)
    assert isinstance(ours.state[ours.param_groups[0]["params"][0]]["exp_avg"], OptimState8bit)
    # the same codes and scales; the weights within fp32 rounding of a 1e-3 step (a step moves them ~1e-3)
    _assert_same_states(ours, ref, atol=1e-7)
    moved = (ours.param_groups[0]["params"][0] - _params()[0]).abs().max().item()
    assert moved > 1e-3  # the comparison is over real updates


@needs_cpp
def test_one_pass_step_of_bf16_weights_matches_torchao_update():
    ours = AdamW8bit(_params(dtype=torch.bfloat16), lr=1e-3, weight_decay=0.01)
    ref = EagerTorchaoAdamW8bit(_params(dtype=torch.bfloat16), lr=1e-3, weight_decay=0.01)
    _run([ours, ref], steps=12)
    # the same codes and scales; each weight the same fp32 update rounded to nearest once: equal, or one bf16 step
    # apart where fp32 arithmetic in another order lands on the other side of a rounding boundary
    _assert_same_states(ours, ref, atol=2e-4)
    p, q = ours.param_groups[0]["params"][0], ref.param_groups[0]["params"][0]
    assert p.dtype is torch.bfloat16 and (p == q).float().mean() > 0.99


def _constant_descent(optimizer_cls, dtype: torch.dtype, stochastic: bool, steps: int = 100) -> torch.Tensor:
    """How far weights in [1, 1.5) move in ``steps`` AdamW steps on a constant gradient, each step a tenth of a bf16
    step there (2^-7): ``[64, 1024]`` fp32."""
    start = 1 + torch.rand(64, 1024, generator=torch.Generator().manual_seed(0)) / 2
    p = torch.nn.Parameter(start.to(dtype, copy=True))
    opt = optimizer_cls([p], lr=2**-7 / 10, weight_decay=0.0, bf16_stochastic_round=stochastic)
    torch.manual_seed(0)
    for _ in range(steps):
        p.grad = torch.full_like(p, 1e-2)
        opt.step()
    return p.detach().float() - start.to(dtype).float()


@needs_cpp
def test_stochastic_rounding_keeps_updates_below_a_bf16_step():
    fp32 = _constant_descent(AdamW8bit, torch.float32, False).mean().item()
    assert fp32 == pytest.approx(-100 * 2**-7 / 10, rel=0.02)  # Adam's step on a constant gradient is lr
    assert _constant_descent(AdamW8bit, torch.bfloat16, False).abs().max() == 0  # to nearest, each update is lost
    ours = _constant_descent(AdamW8bit, torch.bfloat16, True)
    torchao_sr = _constant_descent(EagerTorchaoAdamW8bit, torch.bfloat16, True)
    # unbiased: the mean movement is fp32's (the rounding noise averages out over 65k weights: ~0.1%)
    assert ours.mean().item() == pytest.approx(fp32, rel=0.01)
    assert torchao_sr.mean().item() == pytest.approx(fp32, rel=0.01)
    # and spread alike: a random walk of 100 roundings of a tenth of a step, sqrt(100 * 0.1 * 0.9) = 3 steps
    assert (ours.std() / torchao_sr.std()).item() == pytest.approx(1.0, abs=0.05)


@needs_cpp
@pytest.mark.parametrize("optim", ["adamw_torch_8bit", "adamw_torch"])
def test_adapter_optimizer_keeps_small_updates_of_bf16_adapters(optim):
    from hf_lowprec.ondevice.train import adapter_optimizer

    def descent(dtype):
        return _constant_descent(lambda params, **kw: adapter_optimizer(params, optim, lr=kw["lr"]), dtype, None)

    fp32 = descent(torch.float32).mean().item()
    assert descent(torch.bfloat16).mean().item() == pytest.approx(fp32, rel=0.01)  # to nearest they would not move


@needs_cpp
def test_stochastic_rounding_lands_on_a_neighbour_of_the_fp32_update_whatever_the_threads():
    params = _params(dtype=torch.bfloat16)
    exact = AdamW8bit([torch.nn.Parameter(p.detach().float()) for p in params], lr=1e-2)
    _run([exact], steps=1)
    results = []
    threads = torch.get_num_threads()
    for n in (1, 2):
        opt = AdamW8bit([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-2, bf16_stochastic_round=True)
        torch.manual_seed(3)
        torch.set_num_threads(n)
        try:
            _run([opt], steps=1)
        finally:
            torch.set_num_threads(threads)
        results.append(opt.param_groups[0]["params"][0].detach().float())
    assert torch.equal(results[0], results[1])  # the random bits hash each element's index, not a thread's stream
    bits = exact.param_groups[0]["params"][0].detach().view(torch.int32) & -65536  # the fp32 update's high 16 bits
    toward_zero, away = bits.view(torch.float32), (bits + 65536).view(torch.float32)  # its two bf16 neighbours
    got = results[0]
    assert torch.all((got == toward_zero) | (got == away))
    assert 0.05 < (got == away).float().mean() < 0.95  # both happen


def test_fallback_without_cpp_kernels_is_torchao_update(monkeypatch):
    monkeypatch.setattr(adamw8bit_module, "native_kernels", lambda *tensors: None)  # as where no compiler exists
    ours = AdamW8bit(_params(), lr=1e-3, weight_decay=0.01)
    ref = EagerTorchaoAdamW8bit(_params(), lr=1e-3, weight_decay=0.01)
    _run([ours, ref], steps=6)
    _assert_same_states(ours, ref, atol=0)


def _saved_and_loaded(state_dict: dict) -> dict:
    """Through ``torch.save``/``torch.load(weights_only=True)``, as the Trainer's ``optimizer.pt``."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@needs_cpp
def test_state_dict_moves_to_torchao_and_back():
    ours = AdamW8bit(_params(), lr=1e-3)
    _run([ours], steps=3)
    theirs = torchao.optim.AdamW8bit([torch.nn.Parameter(p.detach().clone()) for p in ours.param_groups[0]["params"]])
    theirs.load_state_dict(_saved_and_loaded(ours.state_dict()))
    again = AdamW8bit([torch.nn.Parameter(p.detach().clone()) for p in ours.param_groups[0]["params"]])
    again.load_state_dict(_saved_and_loaded(theirs.state_dict()))
    assert isinstance(again.state[again.param_groups[0]["params"][0]]["exp_avg"], OptimState8bit)
    reference = EagerTorchaoAdamW8bit([torch.nn.Parameter(p.detach().clone()) for p in ours.param_groups[0]["params"]])
    reference.load_state_dict(_saved_and_loaded(ours.state_dict()))
    _run([again, reference], steps=3, seed=5)  # resumed from the loaded states, both continue alike
    _assert_same_states(again, reference, atol=1e-7)


def test_chunked_loss_trainer_steps_torchao_8bit_with_the_one_pass_class(tmp_path, caplog):
    from transformers import TrainingArguments

    from hf_lowprec.ondevice import ChunkedLossTrainer

    args = TrainingArguments(output_dir=str(tmp_path), optim="adamw_torch_8bit", learning_rate=1e-3, use_cpu=True,
                             report_to=[])  # fmt: skip
    for dtype in (torch.float32, torch.bfloat16):
        trainer = ChunkedLossTrainer(model=tiny_llama().to(dtype), args=args, activation_storage=None)
        optimizer = trainer.create_optimizer()
        optimizer = getattr(optimizer, "optimizer", optimizer)
        assert type(optimizer) is AdamW8bit
        assert optimizer.bf16_stochastic_round is (dtype is torch.bfloat16)  # bf16 weights keep their small updates
    args = TrainingArguments(output_dir=str(tmp_path), optim="adamw_torch", use_cpu=True, report_to=[])
    with caplog.at_level("WARNING", logger="hf_lowprec.ondevice.trainer"):
        ChunkedLossTrainer(model=tiny_llama().to(torch.bfloat16), args=args, activation_storage=None).create_optimizer()
    warned = "bf16 trainable parameters (adapters, learned zero points) with optim='adamw_torch': its updates are"
    assert f"{warned} rounded" in caplog.text


def test_finetune_rejects_an_unknown_optimizer():
    from hf_lowprec.ondevice import finetune_int4_lora

    with pytest.raises(ValueError, match="optim 'sgd' is not supported; choose from adamw_torch, adamw_torch_8bit"):
        finetune_int4_lora(tiny_llama(), None, torch.zeros(4, 8, dtype=torch.long), steps=1, optim="sgd")
