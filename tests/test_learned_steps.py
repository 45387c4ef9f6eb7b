"""Learned steps of a frozen packed base (``PackedLinear.learn_steps``): the gain's gradient against autograd through
the dequantized weight, every backend computing with the gained steps, and state dicts holding them folded."""

import os

import pytest
import torch
import torch.nn.functional as F
from conftest import needs_cpp, on_dequant_backend
from safetensors.torch import load_file

from hf_lowprec.formats import FormatSpec, dequantize_int
from hf_lowprec.modules import Int4Linear, PackedInt4Linear, PackedLinear
from hf_lowprec.modules.packed import int8_backend_available, packed_class
from hf_lowprec.ondevice.learned_steps import LEARNED_STEPS_FILE
from hf_lowprec.rotation import unrotate

needs_int8 = pytest.mark.skipif(not int8_backend_available(torch.device("cpu"))[0], reason="no int8 dot products here")
BACKENDS = ["dequant", pytest.param("tiled", marks=needs_cpp), pytest.param("int8", marks=needs_int8)]


def learning(spec: str, seed: int = 0) -> PackedLinear:
    """A packed 96x128 layer whose learned step gain (and zero shift, asymmetric) are away from their start (as after
    some optimizer steps)."""
    torch.manual_seed(seed)
    layer = Int4Linear.from_linear(torch.nn.Linear(128, 96), spec, learn_scales=False).freeze()
    with torch.no_grad():
        learned = layer.learn_steps()
        learned[0].mul_(1 + 0.2 * torch.rand(layer.step.shape) - 0.1)
        if len(learned) > 1:
            learned[1].add_(torch.rand(layer.step.shape) - 0.5)
    assert len(learned) == (1 if layer.zero is None else 2)
    return layer


def reference_weight(layer: PackedLinear, gain: torch.Tensor, shift: torch.Tensor | None) -> torch.Tensor:
    """The weight ``[N, K]`` the codes stand for at steps ``step x gain`` and zero points ``zero + shift``, by torch
    ops autograd can follow."""
    zero = None if layer.zero is None else layer.zero.float() + shift
    grid = dequantize_int(layer.codes(), layer.spec, layer.step.float() * gain, zero)
    weight = grid / layer.input_scale
    return weight if layer.rotation_block is None else unrotate(weight, layer.rotation_block)


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("spec", ["int4-g64-asym", "int4-g32", "int4-g64-asym-rht", "int8"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_learned_gradients_and_outputs_match_autograd_through_the_dequantized_weight(spec, backend):
    layer = learning(spec)
    layer.backend = backend
    x = torch.randn(3, 21, 128, requires_grad=True)
    g = torch.randn(3, 21, 96)
    layer(x).backward(g)
    gain = layer.step_gain.detach().clone().requires_grad_()
    shift = None if layer.zero_shift is None else layer.zero_shift.detach().clone().requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    y_ref = F.linear(x_ref, reference_weight(layer, gain, shift), layer.bias)
    y_ref.backward(g)
    y = layer(x.detach())
    tol = 0.02 if backend == "int8" else 1e-5  # the int8 backend re-rounds inputs and weight to int8 per row
    assert rel(y, y_ref) < tol and rel(x.grad, x_ref.grad) < max(tol, 0.025 * (backend == "int8"))
    # the learned gradients come from the exact weight gradient whatever the backend's forward
    assert rel(layer.step_gain.grad, gain.grad) < 1e-5
    assert layer.step_gain.grad.abs().min() > 0  # every group's step gets a gradient
    if shift is not None:
        assert rel(layer.zero_shift.grad, shift.grad) < 1e-5 and layer.zero_shift.grad.abs().min() > 0


@pytest.mark.parametrize("spec", ["int4-g64-asym", "int4-g32-asym", "int4-g64-asym-sq"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_points_learned_alone_get_the_gradient_of_the_dequantized_weight(spec, dtype, backend):
    """Zero points learned alone (no gain): their gradient from the group sums of the inputs, without the weight
    gradient, equals autograd's through the dequantized weight."""
    torch.manual_seed(0)
    dense = Int4Linear.from_linear(torch.nn.Linear(128, 96), spec, learn_scales=False)
    dense(torch.randn(64, 128) * torch.linspace(0.1, 4, 128))  # -sq: calibrates the smoothing
    layer = dense.freeze().to(dtype)
    layer.backend = backend
    (shift,) = layer.learn_steps(steps=False)
    assert layer.step_gain is None and layer.learns_steps and layer.exact_kernels
    with torch.no_grad():
        shift.add_(torch.rand(layer.step.shape) - 0.5)
    x, g = torch.randn(3, 21, 128, dtype=dtype), torch.randn(3, 21, 96, dtype=dtype)
    y = layer(x)
    y.backward(g)
    shift_ref = shift.detach().clone().requires_grad_()
    gain = torch.ones(layer.step.shape, dtype=torch.float64)
    y_ref = F.linear(x.double(), reference_weight(layer, gain, shift_ref.double()).double(), layer.bias.double())
    y_ref.backward(g.double())
    assert rel(y, y_ref) < (0.02 if backend == "int8" else 1e-5 if dtype == torch.float32 else 1e-2)
    assert shift.grad.abs().min() > 0  # from the exact weight whatever the backend's forward
    assert rel(shift.grad, shift_ref.grad) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_optimizer_step_on_the_gain_changes_what_every_backend_computes(backend):
    layer = learning("int4-g64-asym")
    layer.backend = backend
    x = torch.randn(17, 128)
    before = layer(x).detach()
    opt = torch.optim.SGD([layer.step_gain], lr=1.0)
    layer.step_gain.grad = -0.5 * layer.step_gain.detach()  # every step x 1.5: outputs (less the bias) too
    opt.step()
    after = layer(x).detach()
    bias = layer.bias.detach()
    assert rel(after - bias, 1.5 * (before - bias)) < (0.02 if backend == "int8" else 1e-5)


@pytest.mark.parametrize("spec", ["int4-g64-asym", "int8"])
def test_state_dicts_hold_steps_and_zero_points_with_what_was_learned_folded_in(spec):
    layer = learning(spec)
    state = layer.state_dict()
    assert "step_gain" not in state and "zero_shift" not in state
    assert torch.equal(state["step"], layer.effective_step().to(layer.step.dtype))
    if layer.zero is not None:
        assert torch.equal(state["zero"], layer.effective_zero().to(layer.zero.dtype))
        assert not torch.equal(state["zero"], state["zero"].round())  # zero points off the integers now
    x = torch.randn(5, 128)
    cls = packed_class(FormatSpec.parse(spec))
    plain = cls(128, 96, spec, bias=True, dtype=torch.float32)
    plain.load_state_dict(state)  # a loader that knows nothing of learned steps
    learner = cls(128, 96, spec, bias=True, dtype=torch.float32)
    learner.learn_steps()
    learner.load_state_dict(state)  # strict: the folded steps stand for the gain, which restarts at one
    for other in (plain, learner):
        other.backend = layer.backend = "dequant"
        assert torch.equal(other(x), layer(x))
    assert torch.equal(learner.step_gain, torch.ones_like(learner.step_gain))
    if learner.zero_shift is not None:
        assert torch.equal(learner.zero_shift, torch.zeros_like(learner.zero_shift))


def test_requantizing_restarts_the_gain_with_the_fresh_steps():
    layer = learning("int4-g64-asym")
    dense = torch.randn(96, 128) * 0.05
    layer.requantize_(dense)
    fresh = PackedInt4Linear.from_weight(dense, "int4-g64-asym", dtype=torch.float32)
    assert torch.equal(layer.step_gain, torch.ones_like(layer.step_gain)) and not layer.zero_shift.any()
    assert torch.equal(layer.dequantized_weight(), fresh.dequantized_weight())


# ------------------------------------------------------------------------------------------ on-device training
LORA = dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear")


def prepared(path, learn_steps: bool = True):
    from peft import LoraConfig

    from hf_lowprec.ondevice import load_int4_lora

    torch.manual_seed(0)
    return load_int4_lora(path, LoraConfig(**LORA), "int4-g64-asym", dtype=torch.float32, learn_steps=learn_steps)


def test_a_base_that_learns_its_steps_trains_them_at_their_rate_and_exports_them(tmp_path, monkeypatch):
    from tiny_assets import corpus_text, save_tiny_model

    import hf_lowprec.ondevice.train as train_module
    from hf_lowprec.ondevice import export_int4_lora, finetune_int4_lora, load_int4_model, token_blocks
    from hf_lowprec.ondevice.learned_steps import LR_SCALES, learned_steps

    path = save_tiny_model(tmp_path / "tiny", initializer_range=0.1)
    model, tokenizer, _ = prepared(path)
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    gains = [m.step_gain for m in packed]
    learned = learned_steps(model)
    assert len(learned["step_gain"]) == len(learned["zero_shift"]) == len(packed) == 14  # int4-g64-asym: both
    made = []  # the optimizer finetune_int4_lora makes (a spy: the real function runs)
    real = train_module.adapter_optimizer
    monkeypatch.setattr(train_module, "adapter_optimizer", lambda *a, **kw: made.append(real(*a, **kw)) or made[-1])
    blocks = token_blocks(tokenizer, [corpus_text(20_000)], 64)
    unlearned_grid = [m.dequantized_weight() for m in packed]
    finetune_int4_lora(model, tokenizer, blocks[:-4], steps=12, lr=1e-2, batch_size=4, output_dir=tmp_path / "run")
    adapters, *groups = made[0].param_groups
    assert [[id(p) for p in g["params"]] for g in groups] == [[id(p) for p in learned[k]] for k in LR_SCALES]
    rates = [(0.0, scale * adapters["initial_lr"]) for scale in LR_SCALES.values()]  # no weight decay
    assert [(g["weight_decay"], g["initial_lr"]) for g in groups] == rates
    learned_grid = [m.dequantized_weight() for m in packed]
    assert all(rel(w, u) > 1e-3 for w, u in zip(learned_grid, unlearned_grid))  # the steps and zero points moved

    assert all(torch.equal(g, torch.ones_like(g)) for g in gains)  # folded into the steps after training
    ids = blocks[-4:]
    reloaded, _ = load_int4_model(tmp_path / "run")  # a plain packed base: steps and zero points folded
    assert not any(p.requires_grad for p in reloaded.parameters())
    reloaded_packed = [m for m in reloaded.modules() if isinstance(m, PackedLinear)]
    assert len(reloaded_packed) == 14 and all(m.exact_kernels for m in reloaded_packed)  # the folder's config says so
    with torch.no_grad():
        reloaded(input_ids=ids)  # backend auto: the exact kernels the steps were learned with, never int8
        assert all(m.last_backend.split("/")[0] in ("tiled", "dequant") for m in reloaded_packed)
        again, trained = on_dequant_backend(reloaded)(input_ids=ids), on_dequant_backend(model)(input_ids=ids)
        assert torch.equal(again.logits, trained.logits)
    export_int4_lora(model, tmp_path / "merged", merge=True)  # merging re-quantizes: fresh steps, gains back at one
    assert all(torch.equal(g, torch.ones_like(g)) for g in gains)


def test_a_folded_model_computes_what_its_packed_export_reloads_to_and_the_export_leaves_it_as_it_is(tmp_path):
    """A Trainer's model (not folded at the end, as finetune_int4_lora folds it) exported with learned zero points: the
    folder holds them rounded into its zero points, the model in memory exact. The export leaves the model as it is (a
    fold in place broke the checkpoints a Trainer saved before it: they hold shifts from the unfolded zero points);
    fold_learned_steps(model) at the end makes it the export's model."""
    from tiny_assets import save_tiny_model

    from hf_lowprec.ondevice import export_int4_lora, fold_learned_steps, load_int4_model

    model, _, _ = prepared(save_tiny_model(tmp_path / "tiny"), learn_steps="zero_points")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "zero_shift" in name:
                p.uniform_(-0.3, 0.3)
            elif "lora_B" in name:
                p.normal_(0, 0.05)
    ids = torch.randint(3, 300, (2, 16))
    with torch.no_grad():
        trained = model(input_ids=ids).logits
    export_int4_lora(model, tmp_path / "out")
    reloaded, _ = load_int4_model(tmp_path / "out")
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, trained)  # the export changed nothing
        again = reloaded(input_ids=ids).logits
        fold_learned_steps(model)
        after = model(input_ids=ids).logits
    assert torch.equal(after, again) and not torch.equal(after, trained)  # the zero points' rounding, now in both
    assert (after - trained).abs().max() < 0.1 * trained.abs().max()


def test_the_trainer_checkpoints_the_learned_steps_and_a_resumed_run_reads_them(tmp_path, caplog):
    import datasets
    from tiny_assets import save_tiny_model
    from transformers import TrainingArguments, default_data_collator

    from hf_lowprec import ChunkedLossTrainer
    from hf_lowprec.ondevice.learned_steps import LR_SCALES, learned_steps

    path = save_tiny_model(tmp_path / "tiny", initializer_range=0.1)
    rows = torch.randint(3, 300, (16, 16), generator=torch.Generator().manual_seed(3)).tolist()
    data = datasets.Dataset.from_dict({"input_ids": rows, "labels": rows})
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=4, save_steps=2, learning_rate=1e-2, per_device_train_batch_size=4,
        report_to="none", use_cpu=True, disable_tqdm=True,
    )

    def trainer(learn_steps: bool = True):
        model, _, _ = prepared(path, learn_steps)
        return ChunkedLossTrainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator)

    first = trainer()
    with caplog.at_level("WARNING", logger="hf_lowprec.ondevice.learned_steps"):
        first.train()
    assert "save_pretrained writes" not in caplog.text  # its checkpoints hold the learned steps, which it reads back
    adapters, *groups = first.optimizer.param_groups
    rates = [(0.0, scale * adapters["initial_lr"]) for scale in LR_SCALES.values()]  # no weight decay
    assert [(g["weight_decay"], g["initial_lr"]) for g in groups] == rates
    final = [p.detach().clone() for p in learned_steps(first.model)["step_gain"]]
    assert (tmp_path / "out" / "checkpoint-4" / LEARNED_STEPS_FILE).exists()
    resumed = trainer()
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-4"))  # at max_steps: loads, trains nothing
    assert (final[0] != 1).any()
    assert all(torch.equal(a, b) for a, b in zip(learned_steps(resumed.model)["step_gain"], final))
    (tmp_path / "out" / "checkpoint-4" / LEARNED_STEPS_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="settings it was trained with"):
        trainer().train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-4"))


def _zero_point_learning_run(tmp_path, trainer_class: str, learn_steps, **arguments):
    """``run(out, resume=None) -> (trainer, trainable parameters)``: a tiny packed base with bf16 adapters (and zero
    points learned if asked), trained 4 steps of batch 4 by transformers' ``Trainer`` or ``ChunkedLossTrainer``."""
    import datasets
    from peft import LoraConfig
    from tiny_assets import save_tiny_model
    from transformers import Trainer, TrainingArguments, default_data_collator

    from hf_lowprec import ChunkedLossTrainer
    from hf_lowprec.ondevice import load_int4_lora

    path = save_tiny_model(tmp_path / "tiny", initializer_range=0.1)
    rows = torch.randint(3, 300, (24, 16), generator=torch.Generator().manual_seed(3)).tolist()
    data = datasets.Dataset.from_dict({"input_ids": rows, "labels": rows})
    kind = {"Trainer": Trainer, "ChunkedLossTrainer": ChunkedLossTrainer}[trainer_class]

    def run(out: str, resume: str | None = None):
        torch.manual_seed(0)
        model, _, _ = load_int4_lora(path, LoraConfig(**LORA), "int4-g64-asym", dtype=torch.float32,
                                     adapter_dtype="bf16", learn_steps=learn_steps)  # fmt: skip
        args = TrainingArguments(output_dir=str(tmp_path / out), max_steps=4, save_steps=2, learning_rate=1e-2,
                                 per_device_train_batch_size=4, optim="adamw_torch_8bit", report_to="none",
                                 use_cpu=True, disable_tqdm=True, **arguments)  # fmt: skip
        trainer = kind(model=model, args=args, train_dataset=data.select(range(16)), eval_dataset=data.select(range(16, 24)),
                       data_collator=default_data_collator)  # fmt: skip
        trainer.train(resume_from_checkpoint=resume)
        return trainer, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    return run


@pytest.mark.parametrize("learn_steps", [False, "zero_points"])
@pytest.mark.parametrize("trainer_class", ["Trainer", "ChunkedLossTrainer"])
def test_a_resumed_run_keeps_bf16_adapters_and_ends_where_an_uninterrupted_one_does(tmp_path, trainer_class, learn_steps):
    """The Trainer loads a checkpoint's adapters with PEFT's ``load_adapter``, which casts bf16 ones to fp32, and
    PEFT's save held no learned zero points (transformers' Trainer resumed with the shifts at zero and Adam moments
    for them: losses 3.6e-3 off): a run resumed at step 2 of 4 must still train bf16 adapters and end with the
    uninterrupted run's weights, zero points included."""
    run = _zero_point_learning_run(tmp_path, trainer_class, learn_steps)
    _, whole = run("whole")
    _, resumed = run("resumed", resume=str(tmp_path / "whole" / "checkpoint-2"))
    assert {p.dtype for p in resumed.values()} == {torch.bfloat16}
    assert any("zero_shift" in n for n in whole) == bool(learn_steps)
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[n], resumed[n]) for n in whole)


def test_an_adapter_saved_in_a_subfolder_reads_the_steps_saved_at_the_top(tmp_path):
    """PEFT saves an adapter not named "default" into a subfolder of its name, and a Trainer resumes it from there; the
    learned steps (the base's) are saved once at the top: they were not read back, and the load warned."""
    from peft import LoraConfig
    from tiny_assets import save_tiny_model

    from hf_lowprec.ondevice.learned_steps import learned_steps_by_name

    model, _, _ = prepared(save_tiny_model(tmp_path / "tiny"))
    model.add_adapter("b", LoraConfig(**LORA))
    model.set_adapter("b")
    model.delete_adapter("default")
    learned = learned_steps_by_name(model)
    with torch.no_grad():
        for p in learned.values():
            p.add_(0.01)
    trained = {n: p.detach().clone() for n, p in learned.items()}
    model.save_pretrained(tmp_path / "saved")
    assert (tmp_path / "saved" / LEARNED_STEPS_FILE).is_file() and (tmp_path / "saved" / "b" / "adapter_config.json").is_file()
    with torch.no_grad():
        for p in learned.values():
            p.zero_()
    model.load_adapter(tmp_path / "saved" / "b", "b", is_trainable=True)  # as Trainer._load_from_checkpoint does
    assert all(torch.equal(learned[n], v) for n, v in trained.items())


@pytest.mark.parametrize("trainer_class", ["Trainer", "ChunkedLossTrainer"])
def test_the_best_checkpoint_loaded_at_the_end_brings_its_zero_points(tmp_path, trainer_class):
    """``load_best_model_at_end`` reloaded the best checkpoint's adapters beside the last step's zero points: the
    model evaluated worse than the best logged score (5.7758 for a logged 5.7471). It is that checkpoint's model now.
    (The lower or the higher eval loss is the best, whichever makes the first of the two checkpoints the best.)"""
    for greater_is_better in (False, True):
        run = _zero_point_learning_run(tmp_path / str(greater_is_better), trainer_class, "zero_points",
                                       eval_strategy="steps", eval_steps=2, load_best_model_at_end=True,
                                       metric_for_best_model="eval_loss", greater_is_better=greater_is_better)  # fmt: skip
        trainer, final = run("out")
        best = trainer.state.best_model_checkpoint
        if best.endswith("checkpoint-2"):
            break
    assert best.endswith("checkpoint-2")
    saved = load_file(os.path.join(best, LEARNED_STEPS_FILE))
    assert saved and all(torch.equal(final[n], saved[n]) for n in saved)
    assert {p.dtype for p in final.values()} == {torch.bfloat16}
    assert trainer.evaluate()["eval_loss"] == pytest.approx(trainer.state.best_metric, rel=1e-6)


def test_folding_keeps_what_the_layer_computes_up_to_the_steps_rounding_and_restarts_the_gain():
    layer = learning("int4-g64-asym")
    layer.store_steps_in(torch.bfloat16)  # as a frozen base keeps them
    x = torch.randn(9, 128)
    layer.backend = "dequant"
    before = layer(x).detach()
    layer.fold_learned_steps()
    assert torch.equal(layer.step_gain, torch.ones_like(layer.step_gain)) and not layer.zero_shift.any()
    assert 0 < rel(layer(x).detach(), before) < 5e-3  # bf16 steps and zero points: a step moves by <= 2^-9 of itself
    state = layer.state_dict()
    assert torch.equal(state["step"], layer.step) and torch.equal(state["zero"], layer.zero)


@needs_int8
def test_auto_runs_an_exact_forward_for_a_layer_that_learns_its_steps():
    layer = learning("int4-g64-asym")
    x = torch.randn(64, 128)
    layer(x)
    forward, *grad_input = layer.last_backend.split("/")
    assert forward in ("tiled", "dequant")  # never int8 (its per-token rounding), whichever is faster here
    assert grad_input in ([], ["int8"])  # the grad-input may run int8's
    plain = Int4Linear.from_linear(torch.nn.Linear(128, 96), "int4-g64-asym", learn_scales=False).freeze()
    plain(x)
    assert plain.last_backend in plain.runnable_backends(x)


def test_only_int4_layers_learn_their_steps(tmp_path):
    from peft import LoraConfig
    from tiny_assets import save_tiny_model

    from hf_lowprec.ondevice import load_int4_lora
    from hf_lowprec.ondevice.learned_steps import learned_steps
    from hf_lowprec.plan import PrecisionPlan

    plan = PrecisionPlan({"lm_head": "int8", "*.v_proj": "int8"}, default="int4-g64-asym")
    path = save_tiny_model(tmp_path / "tiny")
    model, _, _ = load_int4_lora(path, LoraConfig(**LORA), plan, learn_steps=True, dtype=torch.float32)
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    int4 = [m for m in packed if isinstance(m, PackedInt4Linear)]
    assert len(packed) == 15 and len(int4) == 12  # 2 v_proj and the head in int8
    assert {id(p) for p in learned_steps(model)["step_gain"]} == {id(m.step_gain) for m in int4}
    assert all(m.step_gain is None for m in packed if m not in int4)


def test_a_base_that_learns_its_zero_points_alone_keeps_its_steps(tmp_path, caplog):
    from peft import LoraConfig
    from tiny_assets import corpus_text, save_tiny_model

    from hf_lowprec.ondevice import finetune_int4_lora, load_int4_lora, token_blocks
    from hf_lowprec.ondevice.learned_steps import learned_steps
    from hf_lowprec.plan import PrecisionPlan

    plan = PrecisionPlan({"lm_head": "int8", "*.v_proj": "int4-g64"}, default="int4-g64-asym")  # v_proj: no zero points
    path = save_tiny_model(tmp_path / "tiny", initializer_range=0.1)
    model, tokenizer, _ = load_int4_lora(path, LoraConfig(**LORA), plan, learn_steps="zero_points", dtype=torch.float32)
    int4 = [m for m in model.modules() if isinstance(m, PackedInt4Linear)]
    asym = [m for m in int4 if m.zero is not None]
    assert len(int4) == 14 and len(asym) == 12
    learned = learned_steps(model)
    assert learned["step_gain"] == [] and [id(p) for p in learned["zero_shift"]] == [id(m.zero_shift) for m in asym]
    assert all(m.step_gain is None for m in int4) and not any(m.learns_steps for m in int4 if m.zero is None)
    assert all(m.zero.dtype == m.zero_shift.dtype == torch.bfloat16 for m in asym)  # a frozen base's, fp32 compute too
    steps, zeros = [m.step.clone() for m in asym], [m.zero.clone() for m in asym]
    blocks = token_blocks(tokenizer, [corpus_text(20_000)], 64)
    with caplog.at_level("WARNING", logger="hf_lowprec.ondevice.learned_steps"):
        finetune_int4_lora(model, tokenizer, blocks[:-4], steps=6, lr=1e-2, batch_size=4, output_dir=tmp_path / "run")
        assert "save_pretrained writes" not in caplog.text  # its export folds the zero points into the base
        assert all(torch.equal(m.step, s) for m, s in zip(asym, steps))  # folded: the gains stayed at one
        assert all(rel(m.zero, z) > 1e-3 for m, z in zip(asym, zeros))  # the zero points moved
        # PEFT's own save (SFTTrainer.save_model calls it) writes the zero points beside the adapters, which another
        # base's PeftModel.from_pretrained does not read: said, once
        for folder in ("peft", "again"):
            model.save_pretrained(tmp_path / folder)
        told = "save_pretrained writes the zero shifts the INT4 base learned beside the LoRA adapters"
        assert caplog.text.count(told) == 1
        assert set(load_file(tmp_path / "peft" / LEARNED_STEPS_FILE)) == {n for n, p in model.named_parameters() if "zero_shift" in n}


def test_bf16_zero_shifts_learn_what_fp32_ones_learn():
    """A shift in a frozen base's bf16 zero points' dtype, stepped by 8-bit AdamW with stochastic rounding (as bf16
    adapters are) to a learning rate of zero, fits a known change of the zero points to bf16's resolution (2^-8 of
    it), as one in fp32 fits it exactly."""
    from hf_lowprec.training.adamw8bit import AdamW8bit

    torch.manual_seed(0)
    frozen = Int4Linear.from_linear(torch.nn.Linear(128, 96), "int4-g64-asym", learn_scales=False).freeze()
    frozen.store_steps_in(torch.bfloat16)
    change = torch.rand(frozen.step.shape) - 0.5  # of the zero points, in steps
    target = frozen.dequantized_weight(torch.float32) - (change * frozen.step.float()).repeat_interleave(64, dim=1)
    x, learned = torch.randn(256, 128), {}
    for dtype in (torch.bfloat16, torch.float32):
        layer = Int4Linear.from_linear(torch.nn.Linear(128, 96), "int4-g64-asym", learn_scales=False).freeze()
        layer.load_state_dict(frozen.state_dict())
        layer.store_steps_in(dtype)
        (shift,) = layer.learn_steps(steps=False)
        assert shift.dtype == dtype
        opt = AdamW8bit([shift], lr=2e-2, weight_decay=0.0, bf16_stochastic_round=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1 - i / 300)  # the last updates are tiny
        for _ in range(300):
            F.mse_loss(layer(x), F.linear(x, target, frozen.bias)).backward()
            opt.step(), sched.step(), opt.zero_grad()
        learned[dtype] = shift.detach().float()
    assert rel(learned[torch.float32], change) < 1e-5
    assert rel(learned[torch.bfloat16], change) < 2**-8


@pytest.mark.parametrize("value", ["steps", 1, None])
def test_learn_steps_other_than_its_values_is_refused_before_loading(tmp_path, value):
    from peft import LoraConfig
    from tiny_assets import save_tiny_model

    from hf_lowprec.ondevice import load_int4_lora

    with pytest.raises(ValueError, match="learn_steps must be false, true or 'zero_points'"):
        load_int4_lora(save_tiny_model(tmp_path / "tiny"), LoraConfig(**LORA), learn_steps=value)


@needs_cpp
@pytest.mark.parametrize("spec", ["int4-g64-asym", "int4-g32", "int4-g16", "int4-g64-asym-sq"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpp_group_sums_match_torch_ops(spec, dtype):
    from hf_lowprec.modules.kernels.cpp import cpu_kernels
    from hf_lowprec.modules.packed import _learned_grads, _learned_sums_torch

    torch.manual_seed(0)
    dense = Int4Linear.from_linear(torch.nn.Linear(256, 200), spec, learn_scales=False)
    dense(torch.randn(64, 256) * torch.linspace(0.1, 4, 256))  # -sq: calibrates the smoothing
    layer = dense.freeze().to(dtype)
    inverse, size = layer.inverse_input_scale(), layer.spec.group_size
    assert (inverse is not None) == spec.endswith("-sq")
    g, x = torch.randn(45, 200, dtype=dtype), torch.randn(45, 256, dtype=dtype)
    codes = layer.qweight.view(torch.uint8)
    sums, products = cpu_kernels().learned_step_sums(g, x, codes, inverse, size, layer.spec.symmetric, 64)
    ref_sums, ref_products = _learned_sums_torch(g, x, layer, inverse, True, size)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: G is rounded to bf16 by either GEMM, summed in its own order
    assert rel(sums, ref_sums) < tol and rel(products, ref_products) < tol
    layer.learn_steps()
    with torch.enable_grad():  # as in a backward that recomputes under grad mode: inputs that require grad
        gain, _ = _learned_grads(g, x.clone().requires_grad_(), layer, True, layer.zero is not None)
    assert torch.equal(gain, _learned_grads(g, x, layer, True, layer.zero is not None)[0])


@needs_cpp
@needs_int8
def test_the_exact_forward_int8_grad_input_pair_runs_each_kernel_where_it_says():
    layer = learning("int4-g64-asym")
    x, g = torch.randn(3, 21, 128, requires_grad=True), torch.randn(3, 21, 96)
    runs = {}
    for backend in ("tiled", "int8", "tiled/int8"):
        layer.backend = "auto" if "/" in backend else backend
        layer._cache[("auto", x.device.type, x.dtype)] = backend  # as auto resolves a layer with an exact forward
        y = layer(x)
        y.backward(g)
        runs[backend] = (y.detach(), x.grad, layer.step_gain.grad, layer.zero_shift.grad)
        x.grad = layer.step_gain.grad = layer.zero_shift.grad = None
    y, grad_x, gain, shift = runs["tiled/int8"]
    assert torch.equal(y, runs["tiled"][0]) and torch.equal(grad_x, runs["int8"][1])
    assert not torch.equal(grad_x, runs["tiled"][1])
    assert torch.equal(gain, runs["tiled"][2]) and torch.equal(shift, runs["tiled"][3])  # from x and g alone


@pytest.mark.times_kernels
def test_auto_times_a_learning_layer_apart_and_never_picks_int8s_forward():
    from hf_lowprec.modules.kernels import autotune

    layer = learning("int4-g64-asym")
    x = torch.randn(4, 128)
    runnable = layer.runnable_backends(x)
    exact = {name for name in runnable if name != "int8"}
    exact |= {f"{name}/int8" for name in exact} if "int8" in runnable else set()  # forward exact, grad-input int8
    chosen = layer.resolve_backend(x)
    assert chosen in exact
    if len(exact) > 1:  # measured without int8, under a key of its own (an int8-capable CPU times int8 for the others)
        entry = autotune.measured()["packed:PackedInt4Linear:int4-g64-asym:96x128:float32:exact-forward"]
        assert entry["value"] == chosen and set(entry["seconds"]) == exact


@pytest.mark.parametrize("spec", ["int4-g64-asym", "int4-g32"])
def test_a_bf16_gradient_of_an_fp32_input_takes_the_torch_path_in_fp32(spec):
    """Under autocast a packed fp32 layer can get a bf16 output gradient: the learned-step gradients are those of the
    gradient widened to fp32 (the C++ kernel wants one dtype; torch's GEMM refused the mix)."""
    from hf_lowprec.modules.packed import _learned_grads

    layer = learning(spec)
    g, x = torch.randn(45, 96, dtype=torch.bfloat16), torch.randn(45, 128)
    gain, shift = _learned_grads(g, x, layer, True, layer.zero is not None)
    ref_gain, ref_shift = _learned_grads(g.float(), x, layer, True, layer.zero is not None)
    assert rel(gain, ref_gain) < 1e-5 and (shift is None) == (ref_shift is None) == (layer.zero is None)
    if shift is not None:
        assert rel(shift, ref_shift) < 1e-5
