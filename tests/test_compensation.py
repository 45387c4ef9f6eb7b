"""Error compensation: sub-ulp updates, bf16 weights without a master copy, error feedback for
grid-stored weights, chunked fp32 accumulation of FP8 dot products, low-bit optimizer states,
state_dict round trips."""

import copy
import math
import pickle

import pytest
import torch
from conftest import tiny_llama
from text_batches import text_batches

from hf_lowprec.formats import E4M3, FormatSpec, fake_quantize_int, fp8_scale, int_steps, quantize_fp8
from hf_lowprec.training.compensation import (
    CompensatedOptimizer,
    chunked_scaled_mm,
    emulated_accumulation_matmul,
    make_optimizer,
    optimizer_state_bytes,
    round_mantissa,
    stochastic_round,
)
from hf_lowprec.training.new_parameters import add_new_parameters

ULP = 2.0**-7  # bf16 spacing in [1, 2)


# ----------------------------------------------------------------------------- sub-ulp updates


def _sub_ulp_run(method: str, steps: int = 200, n: int = 4096, update: float = 0.1) -> torch.Tensor:
    """SGD on weights in [1, 2) (bf16-representable) with every update ``update`` ulp; returns the final weights."""
    w0 = (1 + torch.rand(n, generator=torch.Generator().manual_seed(0))).bfloat16().float()
    p = torch.nn.Parameter(w0.clone() if method == "fp32" else w0.bfloat16())
    inner = torch.optim.SGD([p], lr=1.0)
    opt = inner if method in ("fp32", "plain") else CompensatedOptimizer(inner, method)
    for _ in range(steps):
        p.grad = torch.full_like(p, update * ULP)
        opt.step()
    return p.detach().float()


def test_kahan_keeps_updates_far_below_its_buffers_own_resolution():
    """Updates of 1/2000 ulp (3.9e-6 on weights in [1, 2); AdamW at lr ~4e-6 moves a weight about that much): a bf16
    buffer rounded to nearest stopped growing once its own spacing passed twice the update (at ~1e-3), and the
    weights never moved (fp32: 4 ulp in 8,000 steps). Stored by stochastic rounding it sums them as fp32 does."""
    start, ref = _sub_ulp_run("fp32", 0, 256), _sub_ulp_run("fp32", 8000, 256, update=5e-4)
    kahan = _sub_ulp_run("kahan", 8000, 256, update=5e-4)
    moved, expected = ((start - kahan) / ULP).mean().item(), ((start - ref) / ULP).mean().item()
    assert expected == pytest.approx(4.0, rel=0.02) and moved == pytest.approx(expected, rel=0.05)


def test_sub_ulp_updates_vanish_in_bf16_and_are_kept_by_kahan_and_stochastic_rounding():
    start = _sub_ulp_run("fp32", steps=0)
    ref = _sub_ulp_run("fp32")  # moved 200 x 0.1 = 20 ulp
    assert ((start - ref) / ULP).mean().item() == pytest.approx(20.0, rel=1e-4)
    plain = _sub_ulp_run("plain")
    assert torch.equal(plain, start)  # every update rounded away: not one weight moved
    kahan = _sub_ulp_run("kahan")
    # Kahan: the stored weight is the nearest bf16 value to weight + compensation (<= 1/2 ulp), and the
    # compensation itself is kept in bf16 (relative error 2^-9 of at most 1/2 ulp per step, 200 steps:
    # <= 0.2 ulp in the worst case, far less in practice)
    assert ((kahan - ref).abs() / ULP).max().item() <= 0.6
    stochastic = _sub_ulp_run("stochastic")
    err = (stochastic - ref) / ULP
    # stochastic rounding is unbiased; each step adds an independent error of variance 0.1 * 0.9 ulp^2,
    # so after 200 steps one weight is off by sigma = sqrt(18) = 4.2 ulp and the mean of 4096 weights
    # by 4.2 / 64 = 0.066 ulp: assert 5 sigma
    assert abs(err.mean().item()) < 5 * 0.066
    assert err.abs().max().item() < 6 * math.sqrt(200 * 0.09)
    assert ((start - stochastic) / ULP).mean().item() == pytest.approx(20.0, abs=0.33)


def test_stochastic_round_is_unbiased_and_lands_on_neighbours():
    for dtype, ulp in ((torch.bfloat16, ULP), (torch.float16, 2.0**-10)):
        x = torch.full((100_000,), 1.0 + 0.3 * ulp)
        r = stochastic_round(x.clone(), dtype, torch.Generator().manual_seed(0)).float()
        assert set(r.unique().tolist()) == {1.0, 1.0 + ulp}
        assert (r == 1.0 + ulp).float().mean().item() == pytest.approx(0.3, abs=0.01)  # 7 sigma for n=1e5


def _lm_run(mode: str, steps: int = 200, lr: float = 3e-4) -> float:
    """Tiny Llama on real text: ``fp32`` master weights with bf16 autocast, or bf16 weights (plain / kahan)."""
    model = tiny_llama(num_hidden_layers=1)
    if mode != "fp32":
        model = model.to(torch.bfloat16)
    inner = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    opt = inner if mode in ("fp32", "plain") else CompensatedOptimizer(inner, mode)
    batches = text_batches(50)
    for i in range(steps):
        with torch.autocast("cpu", torch.bfloat16, enabled=mode == "fp32"):
            loss = model(**batches[i % len(batches)]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        return sum(model(**b).loss.float().item() for b in text_batches(4, 8, 64, held_out=True)) / 4


def test_bf16_weights_with_kahan_match_fp32_master_weights_on_a_tiny_llama():
    """200 AdamW steps at lr 3e-4: most updates are below bf16's ulp for weights near 1 (norms) and many
    elsewhere; the fp32-master run (bf16 autocast) is the reference."""
    master = _lm_run("fp32")
    kahan = _lm_run("kahan")
    plain = _lm_run("plain")
    assert abs(kahan - master) / master < 0.005
    assert plain > master * 1.01  # measurably worse: ~2.7% here
    assert plain - master > 5 * abs(kahan - master)


# ----------------------------------------------------------------------------- error feedback


@pytest.mark.parametrize("residual_dtype", [torch.float32, torch.bfloat16])
def test_error_feedback_keeps_updates_far_below_its_residual(residual_dtype):
    """Updates of 1e-4 against an INT4 step of 4/7: the residual, up to half a step, has a bf16 ulp above 1e-4, so a
    bf16 residual rounded to nearest kept none of them (0.03 moved of 1.0). fp32 (the default) keeps them exactly,
    a bf16 one stochastically rounded keeps them on average."""
    spec = FormatSpec.parse("int4-g64")
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)).clamp(-2, 2)
    w[:, 0] = 4.0  # pins each row's amax: the grid stays put
    w0 = fake_quantize_int(w, spec, *int_steps(w, spec))
    p = torch.nn.Parameter(w0.clone())
    sgd = torch.optim.SGD([p], lr=1.0)
    opt = CompensatedOptimizer(sgd, "none", error_feedback={p: spec}, residual_dtype=residual_dtype)
    grad = torch.full_like(w0, -1e-4)
    grad[:, 0] = 0.0
    for _ in range(2000):
        p.grad = grad.clone()
        opt.step()
    moved = (p.detach() - w0 + opt.buffers[id(p)].float())[:, 1:]  # on the grid plus what the residual holds
    assert opt.buffers[id(p)].dtype == residual_dtype
    assert moved.mean().item() == pytest.approx(0.2, rel=1e-3 if residual_dtype == torch.float32 else 0.02)
    with pytest.raises(ValueError, match="residual_dtype torch.int8: choose torch.float32, torch.bfloat16 or"):
        CompensatedOptimizer(torch.optim.SGD([p], lr=1.0), error_feedback={p: spec}, residual_dtype=torch.int8)


@pytest.mark.parametrize("fmt", ["int4-g64", "fp8"])
def test_error_feedback_keeps_sub_step_updates_of_grid_stored_weights(fmt):
    spec = FormatSpec.parse(fmt)
    g = torch.Generator().manual_seed(0)
    if spec.family == "fp8":  # values in [1, 2), amax 4: scale 112, E4M3 spacing 8/112 or 16/112 there
        w = 1 + torch.rand(16, 128, generator=g)
        finest, coarsest = 8 / 112, 16 / 112
    else:  # every group's amax is 4: INT4 step 4/7 everywhere
        w = torch.randn(16, 128, generator=g).clamp(-2, 2)  # stays inside ±4 while it moves by 1.7
        finest = coarsest = 4 / 7
    fixed = [0, 64]
    w[:, fixed] = 4.0  # pins each group's amax, so the grid stays put while the other weights move
    if spec.family == "fp8":
        scale = fp8_scale(w.abs().amax(), E4M3)
        w0 = quantize_fp8(w, scale, E4M3).float() / scale
    else:
        w0 = fake_quantize_int(w, spec, *int_steps(w, spec))
    lr = 0.05 * finest  # every update is a twentieth of the finest grid step
    grad = torch.ones_like(w0)
    grad[:, fixed] = 0.0
    steps = 60
    exact = w0 - steps * lr * grad

    p = torch.nn.Parameter(w0.clone())
    opt = CompensatedOptimizer(torch.optim.SGD([p], lr=lr), "none", error_feedback={p: spec})
    plain = w0.clone()
    for _ in range(steps):
        p.grad = grad.clone()
        opt.step()
        # without feedback: round onto the same grid after each update (reference computed directly)
        moved = plain - lr * grad
        if spec.family == "fp8":
            plain = quantize_fp8(moved, scale, E4M3).float() / scale
        else:
            plain = fake_quantize_int(moved, spec, *int_steps(moved, spec))
    assert torch.equal(plain, w0)  # small updates are rounded away every time
    assert ((w0 - p.detach()).abs() > 0)[:, 1:64].float().mean() > 0.9
    # with feedback the stored weight stays within one grid step of the exact trajectory
    assert ((p.detach() - exact).abs() <= coarsest * (1 + 1e-5)).all()
    assert p.detach()[:, fixed].eq(4.0).all()


# ------------------------------------------------------------------------------ accumulation


def test_round_mantissa_truncates_and_rounds():
    x = torch.tensor([1.0 + 2**-10 + 2**-12, -(1.0 + 2**-10 + 2**-12)])
    assert round_mantissa(x, 10, "truncate").tolist() == [1.0 + 2**-10, -(1.0 + 2**-10)]
    assert round_mantissa(x, 11, "nearest").tolist() == [1.0 + 2**-10 + 2**-11, -(1.0 + 2**-10 + 2**-11)]
    assert torch.equal(round_mantissa(x, 23), x)


def test_chunked_fp32_accumulation_removes_the_low_precision_accumulator_error():
    """K=4096 dot products of E4M3 values: a 14-bit truncating accumulator (Hopper's, per DeepSeek-V3)
    loses ~2% (normalized max error); promoting every 128 products to fp32 removes >10x of it."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(24, 4096, generator=g), torch.randn(4096, 24, generator=g)
    aq = quantize_fp8(a, fp8_scale(a.abs().amax(), E4M3), E4M3).float()
    bq = quantize_fp8(b, fp8_scale(b.abs().amax(), E4M3), E4M3).float()
    exact = aq.double() @ bq.double()

    def err(out):
        return ((out.double() - exact).abs().max() / exact.abs().max()).item()

    single = err(emulated_accumulation_matmul(aq, bq, mantissa_bits=14))
    chunked = err(emulated_accumulation_matmul(aq, bq, mantissa_bits=14, chunk=128))
    assert 0.005 < single < 0.05  # DeepSeek-V3: "a maximum relative error of nearly 2%"
    assert single >= 10 * chunked
    assert err(torch.mm(aq, bq)) < chunked  # a full fp32 accumulator is better still


def test_chunked_scaled_mm_matches_the_exact_fp8_product():
    g = torch.Generator().manual_seed(0)
    a, w = torch.randn(32, 512, generator=g), torch.randn(48, 512, generator=g)
    sa, sw = fp8_scale(a.abs().amax(), E4M3), fp8_scale(w.abs().amax(), E4M3)
    aq, wq = quantize_fp8(a, sa, E4M3), quantize_fp8(w, sw, E4M3)
    exact = (aq.double() / sa.double()) @ (wq.double() / sw.double()).t()
    out = chunked_scaled_mm(aq, sa, wq.t(), sw, chunk=128)
    assert ((out.double() - exact).abs().max() / exact.abs().max()).item() < 1e-6  # fp32 rounding only
    with pytest.raises(ValueError, match="multiple of 16"):
        chunked_scaled_mm(aq, sa, wq.t(), sw, chunk=100)


# ------------------------------------------------------------------ state, schedulers, states


def _wrapped(method: str, seed: int = 0):
    model = tiny_llama(seed=seed, num_hidden_layers=1).to(torch.bfloat16)
    ef = {model.model.layers[0].mlp.up_proj.weight: "int4-g64"} if method == "error_feedback" else None
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, CompensatedOptimizer(inner, "none" if ef else method, error_feedback=ef, max_chunk_numel=20_000)


@pytest.mark.parametrize("method", ["kahan", "stochastic", "error_feedback"])
def test_compensated_optimizer_round_trips_through_state_dict(method):
    batches = text_batches(6)
    model, opt = _wrapped(method)

    def step(m, o, batch):
        m(**batch).loss.backward()
        o.step()
        o.zero_grad()

    for batch in batches[:3]:
        step(model, opt, batch)
    twin, twin_opt = _wrapped(method, seed=1)
    twin.load_state_dict(model.state_dict())
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    lifted = [p for p in twin.parameters() if twin_opt._mode(p)]
    assert lifted and all(twin_opt.state[p]["exp_avg"].dtype == torch.float32 for p in lifted)  # not cast to bf16
    if method != "stochastic":
        assert len(twin_opt.buffers) == len(opt.buffers) > 0
    for batch in batches[3:]:
        step(model, opt, batch)
        step(twin, twin_opt, batch)
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(a, b), name
    for k, v in opt.buffers.items():
        idx = [id(p) for p in model.parameters()].index(k)
        assert torch.equal(v, twin_opt.buffers[id(list(twin.parameters())[idx])])


@pytest.mark.parametrize("method", ["kahan", "stochastic"])
def test_a_step_a_pre_hook_skips_leaves_every_chunk_unchanged(method):
    """A gradient spike under spike_action="skip" clears every gradient in a step pre-hook of the inner optimizer
    (LowPrecisionPlugin's), which runs once per step, before any chunk of parameters is lifted: no weight moves, not
    its stored value (lowering a lifted weight with its Kahan buffer again rounded anew: 91 bf16 values moved after a
    skipped step), nor its buffer, nor the inner optimizer's states."""
    params = [torch.nn.Parameter(torch.randn(4, 8).bfloat16()) for _ in range(3)]
    inner = torch.optim.AdamW(params, lr=0.1)
    opt = CompensatedOptimizer(inner, method, max_chunk_numel=32)  # one parameter a chunk
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt.step()  # buffers of what bf16 could not store

    calls = []

    def skip(optimizer, args, kwargs):
        calls.append([type(p) for g in optimizer.param_groups for p in g["params"]])
        for p in params:
            p.grad = None

    handle = inner.register_step_pre_hook(skip)
    for p in params:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in params]
    buffers = {k: v.clone() for k, v in opt.buffers.items()}
    states = copy.deepcopy(inner.state_dict()["state"])
    opt.step()
    assert calls == [[torch.nn.Parameter] * 3]  # once, seeing the parameters themselves
    assert all(torch.equal(p, b) for p, b in zip(params, before)) and all(p.grad is None for p in params)
    assert opt.buffers.keys() == buffers.keys() and all(torch.equal(opt.buffers[k], v) for k, v in buffers.items())
    after = inner.state_dict()["state"]
    assert after.keys() == states.keys() and all(
        torch.equal(after[i][k], v) for i, state in states.items() for k, v in state.items())  # fmt: skip
    handle.remove()
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()  # a step nothing skips moves every chunk
    assert not any(torch.equal(p, b) for p, b in zip(params, before))
    assert all(set(inner.state[p]) == {"step", "exp_avg", "exp_avg_sq"} for p in params)  # keyed by the parameters


def test_bitsandbytes_overrides_of_a_parameter_hold_for_its_stand_in():
    """bitsandbytes finds a parameter's overrides by ``id(param)`` (transformers' Trainer with ``adamw_bnb_8bit`` gives
    every embedding 32-bit states so): the fp32 stand-in stepped in its place carries them (8-bit states before),
    and the layer without one keeps 8-bit states."""
    import bitsandbytes as bnb

    emb = torch.nn.Embedding(256, 64).bfloat16()
    lin = torch.nn.Linear(64, 64, bias=False).bfloat16()
    manager = bnb.optim.GlobalOptimManager.get_instance()
    inner = bnb.optim.AdamW([emb.weight, lin.weight], lr=1e-3, optim_bits=8, min_8bit_size=16)
    manager.register_module_override(emb, "weight", {"optim_bits": 32})
    try:
        opt = CompensatedOptimizer(inner, "kahan", max_chunk_numel=64 * 64)  # one parameter a chunk
        for p in (emb.weight, lin.weight):
            p.grad = torch.randn_like(p) * 0.1
        opt.step()
        assert inner.state[emb.weight]["state1"].dtype == torch.float32
        assert inner.state[lin.weight]["state1"].dtype == torch.uint8
        assert set(manager.pid2config) >= {id(emb.weight)} and len(inner.state) == 2  # no stand-in left behind
    finally:  # the manager is the process's: later tensors may take the id, the module would be kept
        manager.pid2config.pop(id(emb.weight), None)
        manager.module_weight_config_triple.remove((emb, "weight", {"optim_bits": 32}))


def test_an_optimizer_accelerate_wrapped_steps_and_reloads_compensated():
    """Accelerate's ``AcceleratedOptimizer`` has no step hooks of its own (its optimizer has): wrapped, it stepped
    no more (an AttributeError); the hooks of the optimizer inside it run once per step, seeing the parameters."""
    from accelerate import Accelerator

    model = torch.nn.Linear(8, 4).bfloat16()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seen = []
    inner.register_step_pre_hook(lambda o, args, kwargs: seen.append([type(p) for g in o.param_groups for p in g["params"]]))
    opt = CompensatedOptimizer(Accelerator(cpu=True).prepare(inner), "kahan", max_chunk_numel=32)  # one tensor a chunk
    before = model.weight.detach().clone()
    model(torch.randn(2, 8).bfloat16()).sum().backward()
    opt.step()
    assert not torch.equal(model.weight, before)
    assert seen == [[torch.nn.Parameter] * 2]
    again = CompensatedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), "kahan")
    again.load_state_dict(opt.state_dict())
    assert torch.equal(again.optimizer.state[model.weight]["exp_avg"], opt.optimizer.state[model.weight]["exp_avg"])


def test_compensated_optimizer_works_with_schedulers_and_new_parameter_groups():
    model = tiny_llama(num_hidden_layers=1).to(torch.bfloat16)
    opt = CompensatedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), "kahan")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    extra = torch.nn.Parameter(torch.ones(4))
    assert add_new_parameters(opt, [extra], scheduler=sched) == 1
    model(**text_batches(1)[0]).loss.backward()
    extra.grad = torch.ones(4)
    opt.step()
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == [5e-4, 5e-4]
    assert not torch.equal(extra.detach(), torch.ones(4))  # fp32 parameter stepped, no compensation
    assert id(extra) not in opt.buffers


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_stochastic_rounding_with_low_bit_states_keeps_sub_ulp_updates_of_fp16_and_bf16_weights(dtype):
    """compensation="stochastic" with torchao-style states handed the weights to the optimizer's own
    bf16_stochastic_round, which rounds bf16 weights alone: fp16 ones took every update of 1/100 ulp to nearest and
    never moved. fp16 weights get the wrapper now; bf16 ones keep the optimizer's own rounding."""
    def drift(weight_dtype, compensation):
        p = torch.nn.Parameter(torch.full((64, 64), 1.125, dtype=weight_dtype))
        named = [{"params": iter([("weight", p)]), "weight_decay": 0.0}]  # a group of named parameters, read once
        opt = make_optimizer(named, states="8bit", compensation=compensation, lr=1e-5, weight_decay=0.0)
        for _ in range(300):
            p.grad = torch.ones_like(p)  # AdamW's update: lr per step, 1e-5 (fp16 ulp at 1.125: 9.8e-4, bf16: 7.8e-3)
            opt.step()
        return opt, (p.detach().float() - 1.125).mean().item()

    reference = drift(torch.float32, None)[1]
    assert reference == pytest.approx(-3e-3, rel=0.01)
    assert drift(dtype, None)[1] == 0.0  # every update rounded away
    opt, moved = drift(dtype, "stochastic")
    assert isinstance(opt, CompensatedOptimizer) == (dtype == torch.float16)
    assert moved == pytest.approx(reference, rel=0.1)


def test_a_compensated_optimizer_copies_pickles_and_takes_step_hooks():
    """copy.deepcopy (and pickle) of the wrapper failed on torch's Optimizer.__getstate__, which kept only the groups,
    and its __setstate__ patched ``step`` on the class itself: every wrapper in the process then failed to step. A
    copy now steps as the original does, its buffers keyed by its own parameters; step hooks registered on the wrapper
    (Accelerate registers one for FSDP2's float8 all-gather) run once per step."""
    model = tiny_llama(num_hidden_layers=1).to(torch.bfloat16)
    opt = CompensatedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), "kahan", max_chunk_numel=20_000)
    batches = text_batches(3)
    model(**batches[0]).loss.backward()
    opt.step()
    opt.zero_grad()
    twin, twin_opt = copy.deepcopy((model, opt))
    clone, clone_opt = pickle.loads(pickle.dumps((model, opt)))
    steps = []
    handles = [o.register_step_pre_hook(lambda *a: steps.append("pre")) for o in (opt, twin_opt, clone_opt)]
    handles += [o.register_step_post_hook(lambda *a: steps.append("post")) for o in (opt, twin_opt, clone_opt)]
    for m, o in ((model, opt), (twin, twin_opt), (clone, clone_opt)):
        assert len(o.buffers) == len(opt.buffers) > 0 and o.buffers.keys() <= {id(p) for p in m.parameters()}
        for batch in batches[1:]:
            m(**batch).loss.backward()
            o.step()
            o.zero_grad()
    assert steps == ["pre", "post"] * 6  # once per step, not per chunk
    for (name, a), b, c in zip(model.named_parameters(), twin.parameters(), clone.parameters()):
        assert torch.equal(a, b) and torch.equal(a, c), name
    for handle in handles:
        handle.remove()
    fresh = CompensatedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))], lr=1.0))
    fresh.param_groups[0]["params"][0].grad = torch.ones(2, dtype=torch.bfloat16)
    fresh.step()  # the class's step untouched
    assert fresh.param_groups[0]["params"][0].tolist() == [0.0, 0.0]


def test_make_optimizer_low_bit_states_are_smaller_and_train():
    """bitsandbytes' 8-bit AdamW keeps both moments in 1 byte each (+ block scales) for tensors >= 4096
    elements; torchao's 8-bit/FP8/4-bit variants are measured in benchmarks/memory.py (they compile)."""
    sizes = {}
    for states in ("fp32", "bnb-8bit"):
        model = tiny_llama(num_hidden_layers=1).to(torch.bfloat16)
        opt = make_optimizer(model.parameters(), states=states, compensation="kahan", lr=3e-3)
        losses = []
        for batch in text_batches(6):
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[-1] < losses[0]
        big = sum(p.numel() for p in model.parameters() if p.numel() >= 4096)
        sizes[states] = (optimizer_state_bytes(opt), big)
    fp32_bytes, big = sizes["fp32"]
    assert fp32_bytes - sizes["bnb-8bit"][0] > 0.7 * 6 * big  # 8 -> ~2 bytes per big parameter
    with pytest.raises(ValueError, match="unknown optimizer states 'int2'"):
        make_optimizer(model.parameters(), states="int2")
    with pytest.raises(ValueError, match="unknown compensation method 'magic'"):
        CompensatedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), "magic")
    with pytest.raises(ValueError, match=r"^CompensatedOptimizer wraps optimizers that update each parameter on its "
                       r"own \(SGD, .*\), not LBFGS$"):  # its step missed the closure LBFGS needs
        CompensatedOptimizer(torch.optim.LBFGS(model.parameters()))
    # torchao's own stochastic rounding has no error feedback or seed: refused, not dropped
    with pytest.raises(ValueError, match=r"^error_feedback, seed apply to the CompensatedOptimizer wrapper, which"):
        make_optimizer(model.parameters(), states="8bit", compensation="stochastic", seed=3, error_feedback={})
