"""Sensitivity scan and budgeted allocation on a tiny Llama with one layer made sensitive on purpose."""

import copy
import importlib
import itertools
import math
import pydoc_data.topics

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy.stats import spearmanr
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from hf_lowprec.convert import apply_plan
from hf_lowprec.modules import LOW_PRECISION_TYPES
from hf_lowprec.plan import PrecisionPlan
from hf_lowprec.sensitivity import (
    Budget,
    LayerScore,
    ScanResult,
    allocate,
    check_budget,
    measure_plan,
    predict_plan,
    scan,
)

SENSITIVE = "model.layers.0.mlp.down_proj"
INT4 = "int4-g64"


def tiny_llama(tied: bool = False, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tied)  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


TEXT = torch.tensor(list("".join(pydoc_data.topics.topics.values()).encode("latin-1", "replace")))
"""Python's own documentation as bytes (vocabulary 256): a real corpus that is always installed."""


def batches(n: int = 2, seed: int = 1, rows: int = 2, length: int = 64) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        starts = torch.randint(0, len(TEXT) - length, (rows,), generator=g)
        ids = torch.stack([TEXT[s : s + length] for s in starts])
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    return out


def trained_llama(steps: int = 300) -> LlamaForCausalLM:
    """A tiny Llama trained briefly on TEXT (loss ~5.5 -> ~1.8): near a minimum, so quantizing a
    layer raises the loss as in a pretrained model instead of moving it at random."""
    model = tiny_llama().train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small trains ~10x faster on one thread when the CPU is shared
    try:
        for step in range(steps):
            b = batches(1, seed=100 + step, rows=8)[0]
            model(input_ids=b["input_ids"], labels=b["labels"]).loss.backward()
            opt.step()
            opt.zero_grad()
    finally:
        torch.set_num_threads(threads)
    return model.eval()


def make_sensitive(model: LlamaForCausalLM, factor: float = 300.0) -> None:
    """Give down_proj of layer 0 outlier input columns without changing the function.

    SwiGLU: ``down(act(gate(x)) * up(x))`` — dividing row j of ``up`` by ``factor`` and multiplying
    column j of ``down`` by it leaves the output as it was, but each INT4 group of ``down`` (two
    groups of 64 per row) now spans an outlier, so its other weights round to zero. Layer 0, not 1: its
    error passes through every later layer, so the diagonal-Fisher estimate ranks it ~11x above the runner-up
    (``lm_head``) on AVX2 and AVX-512 alike; in layer 1 the two were within 3% and their order followed the
    CPU's floating-point summation order.
    """
    mlp = model.model.layers[0].mlp
    with torch.no_grad():
        for j in (5, 69):
            mlp.up_proj.weight[j] /= factor
            mlp.down_proj.weight[:, j] *= factor


def mean_loss(model, data) -> float:
    """Token-weighted next-token loss, computed from scratch (reference)."""
    nll, count = 0.0, 0
    with torch.no_grad():
        for b in data:
            logits = model(input_ids=b["input_ids"]).logits[:, :-1]
            nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), b["labels"][:, 1:].reshape(-1), reduction="sum").item()
            count += b["labels"][:, 1:].numel()
    return nll / count


@pytest.fixture(scope="module")
def sensitive_model():
    model = trained_llama()
    reference = copy.deepcopy(model)
    make_sensitive(model)
    data = batches()
    assert mean_loss(model, data) == pytest.approx(mean_loss(reference, data), abs=1e-4)  # same function
    assert mean_loss(model, data) < 3.0  # trained: uniform guessing would be ln 256 = 5.5
    return model


@pytest.fixture(scope="module")
def measured(sensitive_model):
    return scan(sensitive_model, batches(), method="measured")


@pytest.fixture(scope="module")
def fisher(sensitive_model):
    return scan(sensitive_model, batches(), method="fisher")


def test_scan_ranks_the_outlier_layer_most_sensitive(measured, fisher):
    assert measured.ranking(INT4)[0] == SENSITIVE
    assert fisher.ranking(INT4)[0] == SENSITIVE
    sensitive = measured[SENSITIVE]
    others = [u.measured[INT4] for u in measured.layers if u.name != SENSITIVE]
    assert sensitive.measured[INT4] > 3 * max(others)
    assert sensitive.kl[INT4] > 0
    # every eligible layer is a candidate, embedding and output head included
    assert {"model.embed_tokens", "lm_head"} <= {u.name for u in measured.layers}
    assert len(measured.layers) == 2 * 7 + 2


def test_measured_delta_loss_matches_apply_plan(sensitive_model, measured):
    """Reference: convert a copy with apply_plan and compute its loss from scratch."""
    data = batches()
    base = mean_loss(sensitive_model, data)
    assert measured.base_loss == pytest.approx(base, rel=1e-5)
    for name, fmt in [(SENSITIVE, INT4), ("model.layers.0.self_attn.q_proj", "fp8"), ("lm_head", INT4), ("model.embed_tokens", "fp8")]:
        converted = copy.deepcopy(sensitive_model)
        apply_plan(converted, PrecisionPlan({name: fmt}))
        expected = mean_loss(converted, data) - base
        assert measured[name].measured[fmt] == pytest.approx(expected, rel=1e-3, abs=1e-6), (name, fmt)


def test_scan_scores_rotation_and_the_allocator_picks_it_where_it_pays(sensitive_model):
    """Layer 0's down_proj has outlier input columns that ruin its INT4 groups; rotated (``-rht``) they are spread over
    the 128 columns of a rotation block. The scan's Δloss is that of a copy converted by apply_plan."""
    rotated = INT4 + "-rht"
    data = batches()
    result = scan(sensitive_model, data, formats=(INT4, rotated), method="measured")
    sensitive = result[SENSITIVE].measured
    assert sensitive[rotated] < 0.2 * sensitive[INT4], sensitive
    converted = copy.deepcopy(sensitive_model)
    apply_plan(converted, PrecisionPlan({SENSITIVE: rotated}))
    expected = mean_loss(converted, data) - mean_loss(sensitive_model, data)
    assert sensitive[rotated] == pytest.approx(expected, rel=1e-3, abs=1e-6)
    plan = allocate(result, min_fp8_fraction=1.0)  # everything in 4 bits: each layer gets its better variant
    assert plan.resolve(SENSITIVE).name == rotated
    assert {plan.resolve(u.name).name for u in result.layers if u.name != SENSITIVE} <= {INT4, rotated}
    assert plan.resolve("model.embed_tokens").name == INT4  # an embedding cannot rotate: not scanned with -rht
    assert rotated not in result["model.embed_tokens"].predicted | result["model.embed_tokens"].measured


def test_scan_scores_smoothed_formats_as_the_layer_calibrated_on_the_first_batch(sensitive_model):
    """A ``-sq`` candidate calibrates its smoothing on the scan's first batch, as the converted layer does on its first
    forward: the scan's Δloss is that of a copy converted by apply_plan and run on the same batch."""
    smoothed = "int4-g32-a8-sq"
    data = batches(n=1, rows=4)  # one batch: the scan regroups batches, and each consumer calibrates on its first
    result = scan(sensitive_model, data, formats=("int4-g32-a8", smoothed), method="measured")
    converted = copy.deepcopy(sensitive_model)
    apply_plan(converted, PrecisionPlan({SENSITIVE: smoothed}))
    expected = mean_loss(converted, data) - mean_loss(sensitive_model, data)
    assert result[SENSITIVE].measured[smoothed] == pytest.approx(expected, rel=1e-3, abs=1e-6)
    assert smoothed not in result["model.embed_tokens"].measured  # an embedding has no input to smooth


def test_a_tied_head_no_candidate_fits_is_left_unscored():
    """Tied embedding + head under activation-quantizing candidates only (an embedding has no input to quantize): the
    unit has no format to score and the Fisher pass skips it instead of failing."""
    result = scan(tiny_llama(tied=True), batches(n=1), formats=("int4-g32-a8", "int4-g32-a8-sq"), method="fisher")
    tied = next(u for u in result.layers if "lm_head" in u.names)
    assert not tied.predicted and all(u.predicted for u in result.layers if u is not tied)


@pytest.mark.parametrize("fmt", ["fp8", INT4])
def test_predicted_and_measured_rank_correlation(measured, fisher, fmt):
    predicted = [u.predicted[fmt] for u in fisher.layers]
    actual = [u.measured[fmt] for u in measured.layers]
    rho = spearmanr(predicted, actual).statistic
    assert rho >= 0.7, f"Spearman {rho:.3f} for {fmt}"


def test_allocator_keeps_the_sensitive_layer_out_of_int4(measured):
    plan = allocate(measured, target_bits_per_param=6.0)
    formats = {name: spec.name for name, spec in plan.layers.items()}
    assert formats[SENSITIVE] != INT4
    assert sum(f == INT4 for f in formats.values()) >= 5  # the budget does use INT4 elsewhere
    assert set(formats) == {n for u in measured.layers for n in u.names}  # explicit entry per layer
    assert measured.allocation["bits_per_param"] <= 6.0
    assert measured.chosen()[SENSITIVE] == formats[SENSITIVE]


def test_budget_forbidding_int4_gives_no_int4(measured):
    plan = allocate(measured, Budget(target_bits_per_param=8.0, int4_fraction=0.0))
    assert all(spec.name != INT4 for spec in plan.layers.values())
    assert measured.allocation["fractions"] == {"fp8": pytest.approx(1.0)}  # 8 bits on fp32 weights: all FP8


def test_loss_budget_and_keep_force(measured):
    cap = measured[SENSITIVE].measured[INT4] / 2
    plan = allocate(measured, max_loss_increase=cap, keep=["lm_head"], force={"*.q_proj": "fp8"})
    assert plan.layers["lm_head"].name == "bf16"
    assert all(plan.layers[n].name == "fp8" for n in plan.layers if n.endswith("q_proj"))
    assert plan.layers[SENSITIVE].name != INT4
    assert measured.allocation["predicted_delta_loss"] <= cap
    assert measured.allocation["solver"] == "ilp"


def test_fractions_count_the_layers_keep_leaves_free(measured):
    """min_fp8_fraction=1 with a kept head puts every other layer in low precision; the kept head is not counted."""
    plan = allocate(measured, min_fp8_fraction=1.0, keep=["lm_head"])
    kept = next(u for u in measured.layers if "lm_head" in u.names)
    assert all(plan.layers[n].name == "bf16" for n in kept.names)
    free = [n for u in measured.layers if u is not kept for n in u.names]
    assert free and all(plan.layers[n].name != "bf16" for n in free)
    plan = allocate(measured, max_loss_increase=1.0, int4_fraction=0.0, keep=["lm_head"])
    assert all(fmt.bits > 4 for fmt in plan.layers.values())


def test_unmeetable_budget_names_the_best_reachable_value(measured):
    with pytest.raises(ValueError, match=r"target_bits_per_param=2 cannot be met: the fewest bits per parameter reachable .* is 4\.25"):
        allocate(measured, target_bits_per_param=2.0)
    with pytest.raises(ValueError, match="lowest predicted Δloss reachable with target_bits_per_param=4.25"):
        allocate(measured, target_bits_per_param=4.25, max_loss_increase=1e-9)
    with pytest.raises(ValueError, match="'lm_haed' is not a scanned layer; close matches: lm_head"):
        allocate(measured, target_bits_per_param=8, keep=["lm_haed"])
    allocate(measured, target_bits_per_param=12, keep=["lm_head", "*norm*"])  # the example: norms are never scanned
    with pytest.raises(ValueError, match=r"keep \['\*'\] covers every scanned layer \(\d+\), which leaves nothing to allocate"):
        allocate(measured, max_loss_increase=1.0, keep=["*"])  # a plan of kept layers only: nothing to train with
    with pytest.raises(ValueError, match="was not scanned"):
        allocate(measured, target_bits_per_param=8, force={"lm_head": "nf4-g64"})
    with pytest.raises(ValueError, match=r"^force entry 'lm_head': unknown format 'int3'"):
        allocate(measured, target_bits_per_param=8, force={"lm_head": "int3"})


def test_check_budget_raises_before_a_scan_what_allocate_raises_after_it(sensitive_model, measured):
    """The fp32 tiny Llama keeps lm_head at 32 bits: a bits budget below what that allows fails before any scan,
    with allocate's message (the fewest bits reachable is the same: scores do not change a plan's size)."""
    formats = list(measured.formats)
    with pytest.raises(ValueError) as after_scan:
        allocate(measured, target_bits_per_param=6.0, keep=["lm_head"])
    with pytest.raises(ValueError) as before_scan:
        check_budget(sensitive_model, formats, {"target_bits_per_param": 6.0}, keep=["lm_head"])
    assert "target_bits_per_param=6 cannot be met" in str(before_scan.value) and str(before_scan.value) == str(after_scan.value)
    with pytest.raises(ValueError) as with_loss:  # a loss limit is unknown before the scan: the message names none
        check_budget(sensitive_model, formats, {"target_bits_per_param": 6.0, "max_loss_increase": 1e-3}, keep=["lm_head"])
    assert str(with_loss.value) == str(before_scan.value)
    with pytest.raises(ValueError, match=r"target_bits_per_param=2 cannot be met: the fewest bits .* is 4\.25"):
        check_budget(sensitive_model, formats, Budget(target_bits_per_param=2.0))
    check_budget(sensitive_model, formats, {"target_bits_per_param": 6.0})  # reachable with the head converted
    check_budget(sensitive_model, formats, {"max_loss_increase": 1e-9}, keep=["lm_head"])  # a loss budget: keep all
    check_budget(sensitive_model, formats, None)
    check_budget(sensitive_model, formats, {"score": "after-training"})  # the default budget, scored after training
    with pytest.raises(ValueError, match="budget score must be one of"):
        check_budget(sensitive_model, formats, {"score": "trained"})
    # a mistyped keep is refused before the scan whatever the budget (the default's and a loss budget's came after it)
    for budget in (None, {"max_loss_increase": 1e-3}, {"score": "after-training"}):
        with pytest.raises(ValueError, match="keep entry 'lm_haed' is not a scanned layer; close matches: lm_head"):
            check_budget(sensitive_model, formats, budget, keep=["lm_haed"])
    assert all(not isinstance(m, tuple(LOW_PRECISION_TYPES)) for m in sensitive_model.modules())  # left as it was


def test_a_keep_pattern_matching_no_layer_is_warned_of_once(sensitive_model, measured, caplog):
    """Before the scan (check_budget allocates too) and after it: the same pattern was warned of two or three times."""
    with caplog.at_level("WARNING", logger="hf_lowprec.sensitivity.allocate"):
        check_budget(sensitive_model, list(measured.formats), {"target_bits_per_param": 8.0}, keep=["*norm_nowhere*"])
        allocate(measured, target_bits_per_param=8.0, keep=["*norm_nowhere*"])
    assert caplog.text.count("keep pattern '*norm_nowhere*' matches no scanned layer") == 1, caplog.text


def test_check_budget_names_an_unsupported_architecture_as_the_scan_does():
    """Falcon multiplies its weights in ``FalconLinear`` (an nn.Linear subclass no plan converts): with the head kept
    no layer was left to allocate, and check_budget's error said to keep fewer layers; it names the architecture as
    the scan and apply_plan do."""
    from transformers import FalconConfig, FalconForCausalLM

    torch.manual_seed(0)
    model = FalconForCausalLM(FalconConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4))
    message = r"^FalconForCausalLM multiplies \d+% of its matrix weights in 8 FalconLinear layers .* not supported$"
    with pytest.raises(ValueError, match=message):
        check_budget(model, ("fp8", "int4-g64"), {"target_bits_per_param": 6.0}, keep=["lm_head"])
    with pytest.raises(ValueError, match=message):
        scan(model, batches())


def test_bad_inputs_give_clear_errors():
    with pytest.raises(ValueError, match="no eligible layers"):
        scan(nn.Sequential(nn.ReLU(), nn.LayerNorm(4)), batches())
    with pytest.raises(ValueError, match=r"batches need a 'labels' key \(causal LM: labels=input_ids\)"):
        scan(tiny_llama(), [{"input_ids": torch.zeros(1, 8, dtype=torch.long)}])
    with pytest.raises(ValueError, match="unknown scan method"):
        scan(tiny_llama(), batches(), method="hessian")
    with pytest.raises(ValueError, match="high precision"):
        scan(tiny_llama(), batches(), formats=("bf16",))
    with pytest.raises(ValueError, match="at least one of"):
        Budget()
    with pytest.raises(ValueError, match=r"int4_fraction must be a fraction in \[0, 1\]"):
        Budget(int4_fraction=1.5)
    with pytest.raises(ValueError, match="no layers with weights to allocate"):
        allocate(ScanResult([], ("fp8",), "fisher"), target_bits_per_param=8)
    converted = tiny_llama()
    apply_plan(converted, "fp8")
    with pytest.raises(ValueError, match="unconverted model"):
        scan(converted, batches())


def _snapshot(model):
    return {
        "modules": [(n, id(m), type(m)) for n, m in model.named_modules()],
        "params": [(n, id(p), p.requires_grad, p.detach().clone(), None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()],
        "training": [m.training for m in model.modules()],
        "hooks": [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()],
        "attrs": [sorted(vars(m)) for m in model.modules()],  # e.g. no forward left patched
        "rng": torch.get_rng_state(),
    }


def _assert_same(before, after):
    assert before["modules"] == after["modules"]
    assert before["training"] == after["training"] and before["hooks"] == after["hooks"]
    assert before["attrs"] == after["attrs"]
    assert torch.equal(before["rng"], after["rng"])
    for (n, i, rg, data, grad), (n2, i2, rg2, data2, grad2) in zip(before["params"], after["params"]):
        assert (n, i, rg) == (n2, i2, rg2)
        assert torch.equal(data, data2)
        assert (grad is None and grad2 is None) or torch.equal(grad, grad2)


def _prepared_model():
    model = tiny_llama()
    model.train()
    model.model.layers[0].mlp.gate_proj.weight.requires_grad_(False)
    model(**batches(1)[0]).loss.backward()  # leave gradients to check they survive
    return model


def test_scan_leaves_the_model_exactly_as_found_and_is_deterministic():
    model = _prepared_model()
    before = _snapshot(model)
    calls = []
    first = scan(model, batches(), method="auto", measure_top_fraction=0.2, progress=lambda d, t, s: calls.append((d, t)))
    _assert_same(before, _snapshot(model))
    second = scan(model, batches(), method="auto", measure_top_fraction=0.2)
    a, b = first.to_dict(), second.to_dict()
    a.pop("seconds"), b.pop("seconds")
    assert a == b
    measured_pairs = sum(len(u.measured) for u in first.layers)
    assert measured_pairs == int(np.ceil(0.2 * 2 * len(first.layers)))
    assert calls[-1][0] == calls[-1][1] == 1 + measured_pairs  # the 2 batches run as one forward, then the pairs
    assert [d for d, _ in calls] == list(range(1, len(calls) + 1))


@pytest.mark.parametrize("input_grad_hooks", [1, 2])
def test_gradient_checkpointing_changes_no_score_and_stays_on(input_grad_hooks):
    """TRL's SFTConfig turns gradient checkpointing on by default, and with it transformers' hook that makes the
    embedding output require grad, with which every gradient-based score was 0 (an auto plan came out all INT4): the
    scan runs without both and gives the scores it gives without checkpointing. PEFT's prepare_model_for_kbit_training
    and get_peft_model add a second hook, which disable_input_require_grads does not remove."""
    plain = scan(tiny_llama().train(), batches(), method="auto", measure_top_fraction=0.2).to_dict()
    model = tiny_llama()
    model.gradient_checkpointing_enable()
    for _ in range(input_grad_hooks - 1):
        model.enable_input_require_grads()
    model.train()
    checkpointed = scan(model, batches(), method="auto", measure_top_fraction=0.2).to_dict()
    plain.pop("seconds"), checkpointed.pop("seconds")
    assert checkpointed == plain
    assert model.is_gradient_checkpointing and all(layer.gradient_checkpointing for layer in model.model.layers)
    assert model._require_grads_hooks  # the embedding hook checkpointing added is back too


def test_padding_is_not_scored():
    """Right-padded calibration batches labelled ``labels=input_ids`` (as the docstrings say) score as the same
    batches with their padding labelled -100: padding is no token to predict, as the training loss ignores it."""
    padded = batches()
    for b in padded:
        b["attention_mask"][1, 40:] = 0
        b["input_ids"] = b["input_ids"].masked_fill(b["attention_mask"] == 0, 0)
        b["labels"] = b["input_ids"]
    ignored = [dict(b, labels=b["labels"].masked_fill(b["attention_mask"] == 0, -100)) for b in padded]
    model = tiny_llama()
    got, expected = scan(model, padded, method="fisher").to_dict(), scan(model, ignored, method="fisher").to_dict()
    got.pop("seconds"), expected.pop("seconds")
    assert got == expected and padded[0]["labels"][1, -1] == 0  # the caller's batches are left as they were


def test_merging_batches_does_not_change_weight_only_scores():
    """INT4 is weight-only, so running the two batches as one forward or two gives the same numbers."""
    model = tiny_llama()
    merged = scan(model, batches(), formats=(INT4,), method="fisher")
    separate = scan(model, batches(), formats=(INT4,), method="fisher", max_batch_tokens=128)
    assert len(merged.layers) == len(separate.layers) == 2 * 7 + 2  # every linear of both blocks, embedding, head
    for a, b in zip(merged.layers, separate.layers, strict=True):
        assert a.name == b.name and a.predicted[INT4] == pytest.approx(b.predicted[INT4], rel=1e-4, abs=1e-9)



def test_fisher_terms_match_output_gradients_taken_after_the_backward(sensitive_model):
    """The Fisher pass adds each layer's terms inside the backward, when its output gradient arrives; the reference
    keeps every output's gradient (``retain_grad``) and runs each twin afterwards: first order ``Σ g·δy`` and second
    order ``½ Σ (g·δy)²`` per labelled token, ``δy`` the weight-only twin's output minus the layer's. The output head
    is not scanned here, so the pass computes the loss in chunks of the head (the reference: whole logits)."""
    from hf_lowprec.sensitivity.units import _twins, _Unit

    model = copy.deepcopy(sensitive_model)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
    formats = (INT4, "int8")
    result = scan(model, batches(), formats=formats, method="fisher", layers=names, max_batch_tokens=128)
    first = {(n, f): 0.0 for n in names for f in formats}
    second = dict(first)
    count = 0
    for b in batches():
        seen = {}
        hooks = [model.get_submodule(n).register_forward_hook(
            lambda m, a, out, n=n: seen.__setitem__(n, (a[0].detach(), out)) or out.retain_grad()) for n in names]  # fmt: skip
        logits = model(input_ids=b["input_ids"]).logits[:, :-1].reshape(-1, 256)
        labels = b["labels"][:, 1:].reshape(-1)
        F.cross_entropy(logits.float(), labels, reduction="sum").backward()
        model.zero_grad()
        for h in hooks:
            h.remove()
        count += labels.numel()
        with torch.no_grad():
            for n in names:
                x, out = seen[n]
                for f in formats:
                    twin = _twins(_Unit(n, [(n, model.get_submodule(n))], [f]), f, "auto")[0][2]
                    gd = (twin(x) - out).double() * out.grad.double()
                    first[n, f] += gd.sum().item()
                    second[n, f] += 0.5 * (gd * gd).sum().item()
    for layer in result.layers:
        for f in formats:
            assert layer.first_order[f] == pytest.approx(first[layer.name, f] / count, rel=1e-3, abs=1e-7)
            assert layer.second_order[f] == pytest.approx(second[layer.name, f] / count, rel=1e-3, abs=1e-9)
    assert {layer.name for layer in result.layers} == set(names)

LATE_AND_EARLY = ("lm_head", "model.layers.1.mlp.down_proj", "model.layers.0.mlp.up_proj")


def test_measured_pass_replays_the_blocks_before_the_layer(sensitive_model, measured):
    """Blocks that finish before the quantized layer starts are replayed from the unquantized pass,
    not recomputed; the values equal a full recomputation (see also the apply_plan reference test)."""
    computed = []
    handle = sensitive_model.model.layers[0].self_attn.register_forward_pre_hook(lambda m, a: computed.append(1))
    try:
        result = scan(sensitive_model, batches(), formats=(INT4,), method="measured", layers=list(LATE_AND_EARLY))
    finally:
        handle.remove()
    # layer 0 runs in the unquantized pass and for layers.0.mlp.up_proj; the other two passes replay it
    assert len(computed) == 2
    for name in LATE_AND_EARLY:
        assert result[name].measured[INT4] == pytest.approx(measured[name].measured[INT4], rel=1e-5, abs=1e-9)


def test_a_layer_the_first_batch_does_not_run_is_measured_in_the_batches_that_run_it():
    """A layer some batches skip (an MoE expert no token of the first batch was routed to): its blocks were replayed
    from the unquantized pass in every batch, its Δloss exactly 0. Measured as when the first batch runs it."""
    model = tiny_llama()
    mlp = model.model.layers[1].mlp
    mlp.expert = nn.Linear(64, 64, bias=False)
    routed = type(mlp).forward
    mlp.forward = lambda x: routed(mlp, x) + mlp.expert(x) if x.shape[1] > 16 else routed(mlp, x)  # long batches only
    short, long = batches(1, length=16), batches(1, seed=2, length=24)  # two lengths: two forwards, not one merged
    name, found = "model.layers.1.mlp.expert", []
    for order in (short + long, long + short):
        found.append(scan(model, order, formats=(INT4,), method="measured", layers=[name])[name].measured[INT4])
    assert found[0] != 0 and found[0] == pytest.approx(found[1], rel=1e-4)


@pytest.mark.parametrize("where", ["progress", "forward"])
def test_interrupted_scan_restores_the_model(where):
    """Ctrl-C between steps, or in the middle of a measured forward (blocks being replayed)."""
    model = _prepared_model()
    before = _snapshot(model)
    seen = []

    def interrupt(*args):
        seen.append(1)
        if len(seen) == 3:
            raise KeyboardInterrupt

    handle = model.lm_head.register_forward_pre_hook(interrupt) if where == "forward" else None
    with pytest.raises(KeyboardInterrupt):
        scan(model, batches(), method="auto", measure_top_fraction=0.5, progress=interrupt if where == "progress" else None)
    if handle is not None:
        handle.remove()
    _assert_same(before, _snapshot(model))


def test_tied_embeddings_are_one_unit():
    model = tiny_llama(tied=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    result = scan(model, batches(), method="fisher")
    unit = result["lm_head"]
    assert unit.name == "model.embed_tokens" and unit.tied == ("lm_head",)
    assert len(result.layers) == 2 * 7 + 1
    plan = allocate(result, target_bits_per_param=4.25 + 1e-6)  # forces every unit into INT4
    assert plan.layers["lm_head"] == plan.layers["model.embed_tokens"]
    apply_plan(copy.deepcopy(model), plan)  # tied twins in one integer format: accepted
    with pytest.raises(ValueError, match="gets both"):
        allocate(result, target_bits_per_param=8, force={"lm_head": INT4, "model.embed_tokens": "fp8"})


def test_measure_plan_matches_a_converted_copy(sensitive_model, measured):
    plan = allocate(measured, target_bits_per_param=6.0)
    held_out = batches(seed=7)
    report = measure_plan(sensitive_model, plan, held_out)
    converted = copy.deepcopy(sensitive_model)
    apply_plan(converted, plan)
    assert report["plan_loss"] == pytest.approx(mean_loss(converted, held_out), rel=1e-4)
    assert report["base_loss"] == pytest.approx(mean_loss(sensitive_model, held_out), rel=1e-5)
    assert report["kl"] > 0


def test_measure_plan_leaves_the_model_as_it_was_also_on_error(monkeypatch):
    import sys

    from hf_lowprec.modules import LOW_PRECISION_TYPES

    scan_module = sys.modules["hf_lowprec.sensitivity.scan"]  # the package's `scan` names the function
    model = tiny_llama()
    before = dict(model.named_modules())
    measure_plan(model, {"default": "int4-g32", "layers": {"lm_head": "bf16"}}, batches(seed=3))
    assert dict(model.named_modules()) == before  # the same module objects, where they were

    def interrupted(model, *args, **kwargs):  # the measuring pass stops while the low-precision layers are in
        assert any(isinstance(m, LOW_PRECISION_TYPES) for m in model.modules())
        raise KeyboardInterrupt

    monkeypatch.setattr(scan_module, "_loss_and_kl", interrupted)
    with pytest.raises(KeyboardInterrupt):
        measure_plan(model, {"default": "fp8"}, batches(seed=3))
    assert dict(model.named_modules()) == before


def _synthetic(n_units: int, seed: int) -> ScanResult:
    rng = np.random.default_rng(seed)
    layers = []
    for i in range(n_units):
        params = int(rng.integers(1000, 50000))
        layers.append(LayerScore(f"layer{i}", params=params, bytes={"bf16": 2.0 * params, "fp8": 1.0 * params, INT4: 0.53 * params},
                                 predicted={"fp8": float(rng.exponential(1e-3)), INT4: float(rng.exponential(1e-2))}))  # fmt: skip
    return ScanResult(layers, ("fp8", INT4), "fisher", base_loss=3.0)


@pytest.mark.parametrize("budget", [Budget(target_bits_per_param=7.0), Budget(max_loss_increase=0.01),
                                    Budget(max_loss_increase=0.02, int4_fraction=0.3), Budget(min_fp8_fraction=0.6)])  # fmt: skip
def test_ilp_is_optimal_and_greedy_is_feasible(budget):
    """Brute force over all 3^7 plans is the reference for the exact solver."""
    result = _synthetic(7, seed=3)
    units = result.layers
    total = sum(u.params for u in units)
    best = None
    for combo in itertools.product(["bf16", "fp8", INT4], repeat=len(units)):
        loss = sum(u.score(c) for u, c in zip(units, combo))
        bits = 8 * sum(u.bytes[c] for u, c in zip(units, combo)) / total
        low = sum(u.params for u, c in zip(units, combo) if c != "bf16") / total
        four = sum(u.params for u, c in zip(units, combo) if c == INT4) / total
        ok = (budget.max_loss_increase is None or loss <= budget.max_loss_increase) and \
             (budget.target_bits_per_param is None or bits <= budget.target_bits_per_param) and \
             (budget.min_fp8_fraction is None or low >= budget.min_fp8_fraction) and \
             (budget.int4_fraction is None or four <= budget.int4_fraction)  # fmt: skip
        if ok:
            key = loss if budget.minimizes_loss else bits
            best = key if best is None else min(best, key)
    allocate(result, budget, solver="ilp")
    exact = result.allocation["predicted_delta_loss"] if budget.minimizes_loss else result.allocation["bits_per_param"]
    assert exact == pytest.approx(best, rel=1e-9)
    allocate(result, budget, solver="greedy")
    greedy = result.allocation["predicted_delta_loss"] if budget.minimizes_loss else result.allocation["bits_per_param"]
    assert greedy >= best - 1e-12


@pytest.mark.parametrize("kept", [False, True])
def test_ilp_is_optimal_when_the_scores_span_orders_of_magnitude(kept):
    """Δloss from 1e-8 to 1e-3 beside one of 5 nats (an output head in INT4, kept or not): HiGHS stops within an
    absolute gap of its optimum, and the objective divided by its largest entry returned plans up to 100x the
    optimum's Δloss. Brute force over the 4^5 plans is the reference."""
    rng = np.random.default_rng(1)
    formats, suboptimal, solved = ("fp8", INT4, "int8"), [], 0
    for trial in range(20):
        layers = []
        for i in range(5):
            params = int(rng.choice([64, 128, 256])) * 128
            layers.append(LayerScore(f"l{i}", params=params, bytes={"bf16": 2.0 * params, "fp8": 1.0 * params,
                                     INT4: 0.53 * params, "int8": 1.03 * params},
                                     predicted={f: float(10 ** rng.uniform(-8, -3)) for f in formats}))  # fmt: skip
        layers[0].predicted[INT4] = 5.0
        result = ScanResult(layers, formats, "fisher", base_loss=3.0)
        budget = Budget(target_bits_per_param=float(rng.uniform(7, 12)))
        total = sum(u.params for u in layers)
        choices = [["bf16"] if kept and u.name == "l0" else ["bf16", *formats] for u in layers]
        best = min(
            (sum(u.score(c) for u, c in zip(layers, combo, strict=True))
             for combo in itertools.product(*choices)
             if 8 * sum(u.bytes[c] for u, c in zip(layers, combo, strict=True)) / total <= budget.target_bits_per_param),
            default=None,
        )  # fmt: skip
        if best is None:  # the head kept in bf16 leaves too few bytes
            continue
        solved += 1
        allocate(result, budget, keep=["l0"] if kept else (), solver="ilp")
        if result.allocation["predicted_delta_loss"] > best * (1 + 1e-6):
            suboptimal.append((trial, result.allocation["predicted_delta_loss"] / best))
    assert not suboptimal and solved >= 10, (suboptimal, solved)


@pytest.mark.parametrize("solver", ["ilp", "greedy"])
def test_budgets_met_at_their_bound_are_allocated_not_refused(solver):
    """A loss budget met within a millionth of itself (HiGHS's tolerance applied to the unscaled row let 1e-4 of it
    through, then the 1e-9 check refused the plan), and an INT4 share under which INT4 scores as low as FP8 (greedy
    started every layer in INT4, whose moves only save bytes: it could not go back to FP8) are plans."""
    def unit(name, params, fp8, int4):
        return LayerScore(name, params=params, bytes={"bf16": 2.0 * params, "fp8": params, INT4: 0.53 * params},
                          predicted={"fp8": fp8, INT4: int4})  # fmt: skip

    pair = [unit("a", 1000, 0.02, 0.012), unit("b", 1000, 0.02, 0.008 * (1 + 1e-6))]  # INT4 sums to the budget
    tight = ScanResult(pair, ("fp8", INT4), "fisher")
    allocate(tight, max_loss_increase=0.02, solver=solver)
    assert tight.allocation["predicted_delta_loss"] <= 0.02 * (1 + 1e-6)
    assert solver == "greedy" or tight.allocation["fractions"][INT4] == 1  # the optimum: both layers in INT4
    ties = ScanResult([unit(f"l{i}", 1000, 0.0, 0.0) for i in range(4)], ("fp8", INT4), "fisher")
    plan = allocate(ties, max_loss_increase=0.05, int4_fraction=0.5, solver=solver)
    assert sorted(f.name for f in plan.layers.values()) == ["fp8", "fp8", INT4, INT4]
    # a budget of 0 with a layer just above it: the ILP let 3e-9 in under HiGHS's absolute tolerance, then refused
    # its plan as "cannot be met: the lowest reachable is 0"
    near_zero = ScanResult([unit("a", 1000, 3e-9, 3e-9), unit("b", 1000, 0.0, 0.01)], ("fp8", INT4), "fisher")
    plan = allocate(near_zero, max_loss_increase=0.0, solver=solver)
    assert near_zero.allocation["predicted_delta_loss"] == 0 and {n: f.name for n, f in plan.layers.items()} == {
        "a": "bf16", "b": "fp8"}


@pytest.mark.parametrize("score", [math.nan, math.inf])
def test_a_broken_score_or_layers_without_weights_are_named(score):
    """A NaN or inf score (an overflowed scan, an edited scores file): the ILP failed inside scipy naming no layer,
    the greedy solver accepted a plan of NaN Δloss. Layers of no parameters: a ZeroDivisionError."""
    def unit(name, params, int4):
        sizes = {"bf16": 2.0 * params, INT4: 0.53 * params}
        return LayerScore(name, params=params, bytes=sizes, predicted={INT4: int4})

    broken = ScanResult([unit("a", 1000, score), unit("b", 1000, 0.002)], (INT4,), "fisher")
    for solver in ("ilp", "greedy"):
        with pytest.raises(ValueError, match=rf"layer 'a' in {INT4}: its Δloss score is {score}, which no budget"):
            allocate(broken, max_loss_increase=0.005, solver=solver)
    with pytest.raises(ValueError, match="the scan has no layers with weights to allocate"):
        allocate(ScanResult([unit("a", 0, 0.001)], (INT4,), "fisher"), max_loss_increase=0.01)


def test_the_after_training_score_leaves_out_the_first_order_term(sensitive_model, fisher, measured):
    """A layer whose INT4 noise happens to point down the calibration gradient converts for free but keeps its
    curvature cost once training has taken that gradient: the conversion score puts it in INT4 under a tight loss
    budget, the after-training score puts the layer with the lower curvature there instead."""
    def unit(name, first, second):
        return LayerScore(name, params=1000, bytes={"bf16": 2000.0, INT4: 530.0}, predicted={INT4: first + second},
                          first_order={INT4: first}, second_order={INT4: second})  # fmt: skip

    result = ScanResult([unit("lucky", -0.02, 0.01), unit("steady", 0.001, 0.004)], (INT4,), "fisher", base_loss=3.0)
    assert [result["lucky"].score(INT4), result["steady"].score(INT4)] == pytest.approx([-0.01, 0.005])
    chosen = {n: f.name for n, f in allocate(result, max_loss_increase=0.005).layers.items()}
    assert chosen == {"lucky": INT4, "steady": INT4}  # at conversion: 0 (counted) + 0.005
    plan = allocate(result, max_loss_increase=0.005, score="after-training")
    assert {n: f.name for n, f in plan.layers.items()} == {"lucky": "bf16", "steady": INT4}
    assert result.allocation["budget"] == {"max_loss_increase": 0.005, "score": "after-training"}
    assert result.allocation["predicted_delta_loss"] == pytest.approx(0.004)
    assert predict_plan(result, plan, "after-training")["predicted_delta_loss"] == pytest.approx(0.004)
    assert "Δloss (after-training)" in result.format_table()
    # a real scan: the Taylor pass's curvature term; what the measured pass adds beyond the first-order term
    layer = fisher[SENSITIVE]
    assert layer.score(INT4, "after-training") == layer.second_order[INT4] != layer.score(INT4)
    auto = scan(sensitive_model, batches(), method="auto", measure_top_fraction=0.1)
    top = next(u for u in auto.layers if u.measured)
    fmt = next(iter(top.measured))
    assert top.score(fmt, "after-training") == pytest.approx(top.measured[fmt] - top.first_order[fmt])
    with pytest.raises(ValueError, match="needs the scan's Taylor terms.*method 'auto' or 'fisher'"):
        allocate(measured, max_loss_increase=0.01, score="after-training")
    with pytest.raises(ValueError, match="budget score must be one of conversion, after-training, got 'trained'"):
        Budget(max_loss_increase=0.01, score="trained")


def test_save_load_table_and_heatmap(measured, tmp_path):
    allocate(measured, target_bits_per_param=6.0)
    path = measured.save(tmp_path / "scan.json")
    loaded = ScanResult.load(path)
    assert loaded.to_dict() == measured.to_dict()
    rows = loaded.rows()
    assert rows[0].keys() >= {"layer", "params", "fp8", INT4, "chosen"}
    assert next(r for r in rows if r["layer"] == SENSITIVE)["chosen"] != INT4
    table = loaded.format_table()
    assert SENSITIVE in table and "chosen" in table
    png = loaded.save_heatmap(tmp_path / "scan.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size < 1_000_000
    with pytest.raises(ValueError, match="not a saved ScanResult"):
        ScanResult.load(PrecisionPlan().save(tmp_path / "plan.json"))


def test_predict_plan_agrees_with_allocate(measured):
    plan = allocate(measured, target_bits_per_param=6.0)
    predicted = predict_plan(measured, plan)
    assert predicted["predicted_delta_loss"] == pytest.approx(measured.allocation["predicted_delta_loss"])
    assert predicted["bits_per_param"] == pytest.approx(measured.allocation["bits_per_param"])
    uniform = predict_plan(measured, PrecisionPlan.uniform(INT4, keep=("lm_head",)))
    assert uniform["fractions"]["bf16"] == pytest.approx(2 * 16384 / sum(u.params for u in measured.layers))  # embedding + head
    with pytest.raises(ValueError, match="did not score"):
        predict_plan(measured, PrecisionPlan.uniform("nf4-g64"))


def test_scan_of_a_sequence_classifier_scores_its_classes():
    """[B] labels: the measured Δloss is the classifier's own mean cross-entropy change, computed on a converted copy."""
    from conftest import cls_batches, tiny_bert

    model, data = tiny_bert().eval(), cls_batches(n=2)
    result = scan(model, data, formats=("fp8", INT4), method="measured")
    assert result.tokens == sum(len(b["labels"]) for b in data)  # one scored position per sequence

    def loss(m):
        with torch.no_grad():
            return sum(m(**b).loss.item() * len(b["labels"]) for b in data) / result.tokens

    base = loss(model)
    assert result.base_loss == pytest.approx(base, rel=1e-5)
    for name in ("bert.encoder.layer.0.attention.self.query", "bert.encoder.layer.1.output.dense"):
        converted = copy.deepcopy(model)
        apply_plan(converted, PrecisionPlan({name: INT4}))
        assert result[name].measured[INT4] == pytest.approx(loss(converted) - base, rel=1e-3, abs=1e-6), name
    with pytest.raises(ValueError, match="regression labels"):
        scan(model, [{"input_ids": data[0]["input_ids"], "labels": torch.rand(16)}], method="fisher")


def test_layers_no_scanned_format_fits_are_named_in_a_warning_not_kept_silently(caplog):
    """An ``-a8`` scan cannot put an embedding in its format (no activation to quantize): the plan keeps it as it is,
    and the log says so at warning level (it was an info line); a layer another scanned format fits is not named."""
    model = tiny_llama()
    batches = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 256, (1, 2, 16))]
    with caplog.at_level("WARNING", logger="hf_lowprec"):
        result = scan(model, batches, formats=("int4-g32-a8",), method="fisher")
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "none of the scanned" in r.getMessage()]
    assert warned == ["1 layers take none of the scanned formats, so a plan from this scan keeps them as they are "
                      "(model.embed_tokens): an embedding has no activation to quantize nor input to rotate or smooth"]
    plan = allocate(result, {"int4_fraction": 1.0}, keep=())
    assert plan.assign(model)["model.embed_tokens"].name == "bf16" and plan.assign(model)["lm_head"].name == "int4-g32-a8"
    caplog.clear()
    with caplog.at_level("WARNING", logger="hf_lowprec"):
        scan(model, batches, formats=("int4-g32-a8", INT4), method="fisher")
    assert not [r for r in caplog.records if "none of the scanned" in r.getMessage()]


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_scan_of_an_encoder_decoder_scores_the_loss_it_trains_on(family):
    """A seq2seq batch of source ``input_ids`` (with their padding mask) and target ``labels``: the scan's decoder
    reads the labels shifted right, as the model's own loss does (Bart decoded the source; T5 crashed without
    ``decoder_input_ids``), and the source's mask does not mask the targets; one layer's measured Δloss is the
    model's own loss change with that layer converted."""
    from transformers import BartConfig, BartForConditionalGeneration, T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    if family == "bart":
        model = BartForConditionalGeneration(BartConfig(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=64, max_position_embeddings=32))
        layer = "model.decoder.layers.0.fc1"
    else:
        model = T5ForConditionalGeneration(T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16, vocab_size=64, decoder_start_token_id=0, pad_token_id=0))
        layer = "decoder.block.0.layer.2.DenseReluDense.wi"
    model.eval()
    source, target = torch.randint(3, 64, (2, 2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0  # the second source is 5 tokens long; its target all 8
    batch = {"input_ids": source, "attention_mask": mask, "labels": target}
    with torch.no_grad():
        own = model(**batch).loss.item()
    result = scan(model, [batch], formats=(INT4,), method="measured", layers=[layer])
    assert result.tokens == 16 and result.base_loss == pytest.approx(own, rel=1e-5)
    converted = copy.deepcopy(model)
    apply_plan(converted, PrecisionPlan({layer: INT4}))
    with torch.no_grad():
        assert result[layer].measured[INT4] == pytest.approx(converted(**batch).loss.item() - own, rel=1e-3, abs=1e-6)


@pytest.mark.parametrize("fmt", ["int4-g64-asym", "int8", "int4-g64-asym-rht", "int4-g32-a8", "int4-g32-a8-sq", "fp8"])
def test_a_packed_layers_output_errors_in_row_blocks_are_its_whole_twins(monkeypatch, fmt):
    """The packed scan's ``g * δy``, built a few output rows at a time (``δy = x (Q(W) - W)^T`` for weight-only
    formats), sums to the terms of the whole twin's output minus the dense layer's (fp32)."""
    from hf_lowprec.formats import FormatSpec
    from hf_lowprec.modules import Int4Linear
    scan_module = importlib.import_module("hf_lowprec.sensitivity.scan")  # the package exports its function `scan`
    from hf_lowprec.sensitivity.units import _twins, _Unit

    monkeypatch.setattr(scan_module, "PACKED_ROW_BLOCK_ELEMENTS", 3 * 128)  # blocks of 3 rows; the last one of 2
    torch.manual_seed(0)
    dense = nn.Linear(128, 200)
    packed = Int4Linear.from_linear(copy.deepcopy(dense), FormatSpec.parse("int4-g64-asym")).freeze()
    source = scan_module._TwinSource([_Unit("layer", [("layer", packed)], [fmt])], "auto", lambda _: dense.weight.detach())
    x, g = torch.randn(2, 40, 128), torch.randn(2, 40, 200)  # 80 tokens: enough to calibrate '-sq' smoothing
    with torch.no_grad():
        pieces = [gd for key, gd in source.output_errors(packed, x, g) if key == ("layer", fmt)]
        twin = _twins(_Unit("layer", [("layer", dense)], [fmt]), fmt, "auto")[0][2]
        expected = ((twin(x) - dense(x)) * g).flatten()
    whole = FormatSpec.parse(fmt).family == "fp8" or FormatSpec.parse(fmt).smooth  # scales that read every row
    assert len(pieces) == (1 if whole else 67)  # 200 rows, 3 at a time
    got = torch.cat([p.view(80, -1) for p in pieces], 1).flatten()  # blocks of output columns, token by token
    assert got.shape == expected.shape
    torch.testing.assert_close(got.sum(), expected.sum(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.dot(got), expected.dot(expected), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-5)


def test_decoder_rows_under_the_head_are_the_whole_logits_rows_or_declined():
    """The rows the scan runs the head on in chunks: the head on them gives exactly the logits (and labels) of the
    whole-logits path, on a padded batch whose padding is labelled too; ``None`` where the head's output is not the
    logits the model scores (inputs the decoder call would drop, a trainable head under gradients)."""
    from hf_lowprec.sensitivity.batches import _decoder_rows, _forward

    model = tiny_llama()
    for p in model.parameters():  # as the scan leaves them: a trainable head is not run in chunks
        p.requires_grad_(False)
    ids = batches(n=1)[0]["input_ids"]
    mask = torch.ones_like(ids)
    mask[1, 40:] = 0
    labels = ids.clone()
    labels[0, 10:20] = -100
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    with torch.no_grad():
        hidden, rows_labels = _decoder_rows(model, batch, "cpu")
        logits, expected_labels = _forward(model, batch, "cpu")
        torch.testing.assert_close(model.lm_head(hidden).float(), logits, rtol=1e-6, atol=1e-6)
    assert torch.equal(rows_labels, expected_labels) and len(rows_labels) == 2 * 63 - 10
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    assert _decoder_rows(model, {"input_ids": ids, "position_ids": positions, "labels": ids}, "cpu") is None
    model.lm_head.weight.requires_grad_(True)
    assert _decoder_rows(model, {"input_ids": ids, "labels": ids}, "cpu") is None


def _with_positions(batch_list: list[dict]) -> list[dict]:
    """The same batches with explicit ``position_ids`` (the default ones): the scan then takes its whole-logits path."""
    return [{**b, "position_ids": torch.arange(b["input_ids"].shape[1]).expand_as(b["input_ids"])} for b in batch_list]


@pytest.mark.parametrize("tied", [False, True])
def test_scan_scores_the_same_with_the_head_in_chunks_as_with_whole_logits(tied):
    """Every score of an ``auto`` scan that measures every pair (the head among them: its twin runs once on all rows)
    and of a ``measured`` one, from decoder outputs with the head applied a chunk at a time, equals the scan of the
    same batches through whole fp32 logits and kept log-probabilities (explicit ``position_ids`` take that path)."""
    model = trained_llama(steps=60)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    data = batches(n=3, rows=4, seed=5)
    for method in ("auto", "measured"):
        options = {"formats": ("fp8", INT4), "method": method, "measure_top_fraction": 1.0, "max_batch_tokens": 256}
        chunked, whole = scan(model, data, **options), scan(model, _with_positions(data), **options)
        assert chunked.base_loss == pytest.approx(whole.base_loss, rel=1e-5)
        assert "lm_head" in [n for s in chunked.layers for n in s.names]
        assert len(chunked.layers) == len(whole.layers) > 2 * 7
        for a, b in zip(chunked.layers, whole.layers, strict=True):
            for kind in ("measured", "kl") + (("predicted",) if method == "auto" else ()):
                got, expected = getattr(a, kind), getattr(b, kind)
                assert got.keys() == expected.keys() and got
                for fmt in got:
                    assert got[fmt] == pytest.approx(expected[fmt], rel=1e-3, abs=1e-6), (a.name, kind, fmt)


def test_measure_plan_with_the_head_in_chunks_equals_whole_logits():
    """``measure_plan`` (the head swapped for its FP8 layer: it runs once on all rows) gives the losses and KL of the
    whole-logits path; the unchanged model's KL is exactly zero."""
    model = trained_llama(steps=60)
    data = batches(n=2, rows=4, seed=6)
    plan = {"default": INT4, "layers": {"lm_head": "fp8"}}
    chunked, whole = measure_plan(model, plan, data), measure_plan(model, plan, _with_positions(data))
    for key in ("base_loss", "plan_loss", "delta_loss", "kl"):
        assert chunked[key] == pytest.approx(whole[key], rel=1e-4, abs=1e-7), key
    assert chunked["tokens"] == whole["tokens"] and chunked["kl"] > 1e-4
    unchanged = measure_plan(model, {"default": "bf16"}, data)
    assert unchanged["kl"] == 0.0 and unchanged["delta_loss"] == 0.0
