"""LowPrecisionCallback inside an unmodified transformers.Trainer: real tiny models, real training."""

import copy
import json
import logging
import re

import pytest
import torch
from conftest import autocast_states, cls_batches, lm_batches, tiny_bert, tiny_llama
from safetensors.torch import load_file, save_file
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_lowprec.convert import revert
from hf_lowprec.modules import LOW_PRECISION_TYPES
from hf_lowprec.plan import PLAN_FILE, PrecisionPlan
from hf_lowprec.training.callback import STATE_FILE, TELEMETRY_KEYS, LowPrecisionCallback, low_precision_state
from hf_lowprec.training.new_parameters import orphaned_parameters

MIXED_PLAN = {"default": "fp8", "layers": {"*.mlp.*": "int4-g64", "lm_head": "bf16"}}
AUTO_ONLY = r"plan='auto' \(the sensitivity scan\),"  # budget=, formats=, scan_method= with a fixed plan


def lm_rows(batches: int = 4, batch: int = 8, seed: int = 1) -> list[dict]:
    rows = torch.cat([b["input_ids"] for b in lm_batches(n=batches, batch=batch, seq=32, seed=seed)])
    return [{"input_ids": r, "labels": r} for r in rows]


def cls_rows(batches: int = 4) -> list[dict]:
    return [{"input_ids": i, "labels": l} for b in cls_batches(n=batches) for i, l in zip(b["input_ids"], b["labels"])]


def arguments(out, **overrides) -> TrainingArguments:
    kw = dict(use_cpu=True, report_to=[], disable_tqdm=True, logging_steps=1, save_strategy="no", learning_rate=3e-3,
              per_device_train_batch_size=8, max_steps=10, seed=0)  # fmt: skip
    kw.update(overrides)
    return TrainingArguments(str(out), **kw)


class StepOneProbe(TrainerCallback):
    """Records which trainable parameters did not change in the first ``at_step`` optimizer steps."""

    def __init__(self, at_step: int = 1):
        self.at_step = at_step

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.at_step:
            now = dict(model.named_parameters())
            self.unchanged = [n for n, p in self.before.items() if torch.equal(p, now[n].detach())]


def losses(trainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def assert_every_parameter_trains(trainer, probe):
    model = trainer.model
    assert orphaned_parameters(model, trainer.optimizer) == []
    held = [id(p) for g in trainer.optimizer.param_groups for p in g["params"]]
    assert len(held) == len(set(held)), "a parameter is in the optimizer twice"
    assert probe.unchanged == [], f"trainable parameters unchanged after step 1: {probe.unchanged}"


def assert_telemetry(trainer, fractions_of):
    logs = [h for h in trainer.state.log_history if "loss" in h]
    for log in logs:
        for key in TELEMETRY_KEYS:
            assert f"lowprec/{key}" in log
        params = {k: v for k, v in log.items() if k.startswith("lowprec/params_")}
        # layers the plan leaves as they are count as "kept", as the card calls them, whatever their dtype
        labels = {k: "kept" if k in ("bf16", "fp32") else k for k in fractions_of}
        assert params == {f"lowprec/params_{labels[k]}": v for k, v in fractions_of.items()}
        assert abs(sum(v for k, v in log.items() if k.startswith("lowprec/flops_")) - 1) < 1e-9
        for fmt in fractions_of:
            if fmt.startswith("fp8"):  # FP8 scale policies count saturated and flushed elements per role
                assert {f"lowprec/{fmt}/{r}_{w}" for r in ("input", "weight", "grad") for w in ("saturation", "underflow")} <= set(log)


def test_llama_trains_with_default_callback(tmp_path):
    """plan='auto': scan on the first training batches at on_train_begin, then every parameter trains."""
    model, probe, cb = tiny_llama(), StepOneProbe(), LowPrecisionCallback()
    trainer = Trainer(model=model, args=arguments(tmp_path, max_steps=12), train_dataset=lm_rows(), callbacks=[cb, probe])
    trainer.train()
    assert model.hf_lowprec_plan is cb.plan and cb.report.swapped
    assert any(isinstance(m, LOW_PRECISION_TYPES) for m in model.modules())
    assert cb.scan_seconds > 0
    assert_every_parameter_trains(trainer, probe)
    assert_telemetry(trainer, cb.report.fractions())
    curve = list(losses(trainer).values())
    assert sum(curve[-3:]) / 3 < sum(curve[:3]) / 3 - 0.1, curve
    assert PrecisionPlan.load(tmp_path / PLAN_FILE) == cb.plan  # next to the final model
    assert cb.plan.to_dict()["layers"]["lm_head"] == "bf16"  # the default keep: the scan's allocation leaves the output head out


def test_neftune_noise_reaches_an_embedding_the_auto_plan_converts_after_the_trainer_hooked_it(tmp_path):
    """``neftune_noise_alpha``: the Trainer sets ``neftune_noise_alpha`` on the input embedding and hooks it before
    on_train_begin, where an ``auto`` plan converts; the new layer took the hook, not the attribute it reads
    (AttributeError on the first step). It now trains with the noise, and the Trainer takes both off after."""
    runs = {}
    for alpha in (None, 5.0):
        model = tiny_llama()
        trainer = Trainer(model=model, args=arguments(tmp_path / str(alpha), max_steps=3, neftune_noise_alpha=alpha),
                          train_dataset=lm_rows(), callbacks=[LowPrecisionCallback()])  # fmt: skip
        trainer.train()
        embedding = model.get_input_embeddings()
        assert isinstance(embedding, LOW_PRECISION_TYPES)
        assert not hasattr(embedding, "neftune_noise_alpha") and not embedding._forward_hooks
        runs[alpha] = losses(trainer)
    assert runs[None][1] != runs[5.0][1]  # the same model, data and seed: the noise moved the first step's loss


def test_resuming_under_another_plan_names_the_checkpoints_plan_to_pass(tmp_path):
    """A checkpoint trained with the head in FP8 (``keep=()``, or the default before it kept the head), resumed with a
    plan that keeps it: one error naming both plans and the argument that continues with the checkpoint's."""
    args = dict(max_steps=2, save_strategy="steps", save_steps=2)
    Trainer(model=tiny_llama(), args=arguments(tmp_path, **args), train_dataset=lm_rows(),
            callbacks=[LowPrecisionCallback("fp8", keep=())]).train()  # fmt: skip
    checkpoint = str(tmp_path / "checkpoint-2")
    args["max_steps"] = 3
    other = Trainer(model=tiny_llama(), args=arguments(tmp_path, **args), train_dataset=lm_rows(),
                    callbacks=[LowPrecisionCallback("fp8")])  # fmt: skip
    hint = re.escape(f"To continue with the checkpoint's plan, pass LowPrecisionCallback(plan={checkpoint!r})")
    with pytest.raises(ValueError, match=f"another plan: .*{hint}"):
        other.train(resume_from_checkpoint=checkpoint)
    same = Trainer(model=tiny_llama(), args=arguments(tmp_path, **args), train_dataset=lm_rows(),
                   callbacks=[LowPrecisionCallback(checkpoint)])  # fmt: skip
    same.train(resume_from_checkpoint=checkpoint)
    assert same.state.global_step == 3


def test_a_format_plan_leaves_the_output_head_unless_keep_says_otherwise(tmp_path):
    """A format name without ``keep=`` converts every Linear but the output head (``get_output_embeddings()``), as the
    CLI's recipes and torchtitan's FP8 recipe do; ``keep=()`` converts the head too; a classifier keeps its own head
    (``classifier``, ``config.num_labels`` outputs: it was converted with the rest, no word said)."""
    from hf_lowprec.modules import FP8Linear

    kept, converted, classifier = tiny_llama(tie=True), tiny_llama(), tiny_bert()
    callbacks = [LowPrecisionCallback("fp8"), LowPrecisionCallback("fp8", keep=()), LowPrecisionCallback("fp8")]
    for i, (model, callback) in enumerate(zip((kept, converted, classifier), callbacks)):
        Trainer(model=model, args=arguments(tmp_path / str(i)), callbacks=[callback])
    assert callbacks[0].plan.to_dict()["layers"] == {"lm_head": "bf16"}
    assert type(kept.lm_head) is torch.nn.Linear and kept.lm_head.weight is kept.model.embed_tokens.weight
    assert isinstance(kept.model.layers[0].mlp.down_proj, FP8Linear)
    assert isinstance(converted.lm_head, FP8Linear)
    assert type(classifier.classifier) is torch.nn.Linear and callbacks[2].plan.to_dict()["layers"] == {"classifier": "bf16"}
    assert isinstance(classifier.bert.pooler.dense, FP8Linear)


def test_bert_classifier_trains_with_default_callback(tmp_path):
    """plan='auto' on a sequence classifier: the scan scores the classes ([B] labels), then every parameter trains."""
    model, probe, cb = tiny_bert(), StepOneProbe(), LowPrecisionCallback()
    rows = cls_rows(6)
    trainer = Trainer(model=model, args=arguments(tmp_path, max_steps=8, learning_rate=5e-3), train_dataset=rows, callbacks=[cb, probe])
    trainer.train()
    assert cb.report.swapped and cb.scan_seconds > 0
    assert_every_parameter_trains(trainer, probe)
    assert_telemetry(trainer, cb.report.fractions())
    curve = list(losses(trainer).values())
    assert sum(curve[-3:]) / 3 < sum(curve[:3]) / 3 - 0.05, curve


def test_bert_classifier_with_accumulation_and_eval(tmp_path):
    model, probe = tiny_bert(), StepOneProbe()
    cb = LowPrecisionCallback("fp8", keep=("classifier",))
    args = arguments(tmp_path, per_device_train_batch_size=8, gradient_accumulation_steps=2, max_steps=6, learning_rate=5e-3,
                     eval_strategy="steps", eval_steps=3, per_device_eval_batch_size=32)  # fmt: skip
    rows = cls_rows(6)
    trainer = Trainer(model=model, args=args, train_dataset=rows[:64], eval_dataset=rows[64:], callbacks=[cb, probe])
    trainer.train()
    assert_every_parameter_trains(trainer, probe)
    assert_telemetry(trainer, cb.report.fractions())
    assert type(model.classifier) is torch.nn.Linear
    assert [h["step"] for h in trainer.state.log_history if "eval_loss" in h] == [3, 6]
    curve = list(losses(trainer).values())
    assert sum(curve[-3:]) / 3 < sum(curve[:3]) / 3 - 0.05, curve


def test_peft_lora_on_low_precision_base(tmp_path):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(), LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"]))
    probe, cb = StepOneProbe(at_step=2), LowPrecisionCallback(MIXED_PLAN)  # lora_B starts at 0: lora_A moves at step 2
    trainer = Trainer(model=model, args=arguments(tmp_path, max_steps=8, learning_rate=1e-2, save_strategy="steps", save_steps=8),
                      train_dataset=lm_rows(), callbacks=[cb, probe])  # fmt: skip
    trainer.train()
    base = model.base_model.model.model.layers[0]
    assert isinstance(base.self_attn.q_proj.base_layer, LOW_PRECISION_TYPES)  # LoRA sits on a converted layer
    assert isinstance(base.mlp.up_proj.base_layer, LOW_PRECISION_TYPES)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)  # frozen base: its learned steps stay fixed too
    assert_every_parameter_trains(trainer, probe)
    curve = list(losses(trainer).values())
    assert curve[-1] < curve[0] - 0.05, curve
    # PEFT checkpoints hold only the adapters; the low-precision state travels in our own file
    assert (tmp_path / "checkpoint-8" / STATE_FILE).is_file() and (tmp_path / "checkpoint-8" / PLAN_FILE).is_file()


def test_user_optimizer_gets_learned_steps(tmp_path):
    """optimizers=(...) passed in: learned steps join the group of their layer's weight, in model order."""
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    n_before = len(optimizer.param_groups[0]["params"])
    probe, cb = StepOneProbe(), LowPrecisionCallback(MIXED_PLAN)
    trainer = Trainer(model=model, args=arguments(tmp_path, max_steps=2), train_dataset=lm_rows(1), callbacks=[cb, probe],
                      optimizers=(optimizer, None))  # fmt: skip
    steps = list(cb.report.new_parameters.values())
    assert len(steps) == 6 and len(optimizer.param_groups) == 1
    assert len(optimizer.param_groups[0]["params"]) == n_before + len(steps)
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
    trainer.train()
    assert_every_parameter_trains(trainer, probe)


def test_fp16_arguments_on_cpu_are_reported(tmp_path, caplog):
    """Accelerate turns fp16 autocast + GradScaler on only for accelerators: on CPU the run is fp32, unscaled.

    The callback says so, and the loss curve is the one of the same run without fp16.
    """
    curves = {}
    for fp16 in (False, True):
        with caplog.at_level(logging.WARNING, logger="hf_lowprec.training.callback"):
            trainer = Trainer(model=tiny_llama(), args=arguments(tmp_path / str(fp16), fp16=fp16, max_steps=3),
                              train_dataset=lm_rows(1), callbacks=[LowPrecisionCallback("fp8")])  # fmt: skip
            trainer.train()
        assert trainer.accelerator.scaler is None
        assert all("lowprec/loss_scale" not in h for h in trainer.state.log_history)
        curves[fp16] = losses(trainer)
    assert sum("no GradScaler is active" in r.message for r in caplog.records) == 1
    assert curves[True] == curves[False]


def test_kill_and_resume_continues_the_same_curve(tmp_path):
    """20 steps with checkpoints at 10 and 20 vs. a new Trainer resumed from step 10.

    Resuming restores weights, learned steps, optimizer moments, scheduler, RNG and data position, and
    CPU kernels are deterministic for equal shapes and threads, so the resumed losses must equal the
    uninterrupted ones bit for bit; anything else means state was lost. 1e-6 (two fp32 ulps at loss
    ~5) only absorbs printing/accumulation order, not a lost state (which moves losses by >1e-3).
    """
    data = lm_rows(5, batch=4)
    args = dict(max_steps=20, per_device_train_batch_size=4, save_strategy="steps", save_steps=10)
    cb = LowPrecisionCallback(calibration_batches=2)
    full = Trainer(model=tiny_llama(), args=arguments(tmp_path / "full", **args), train_dataset=data, callbacks=[cb])
    full.train()
    ckpt = tmp_path / "full" / "checkpoint-10"
    assert (ckpt / PLAN_FILE).is_file() and (ckpt / STATE_FILE).is_file()
    saved = json.loads((ckpt / "trainer_state.json").read_text())["stateful_callbacks"]["LowPrecisionCallback"]
    assert saved["args"]["plan"] == cb.plan.to_dict()

    # the plan the run saved; the Trainer also rebuilds the callback from trainer_state.json (its ExportableState)
    resumed = Trainer(model=tiny_llama(), args=arguments(tmp_path / "resumed", restore_callback_states_from_checkpoint=True, **args),
                      train_dataset=data, callbacks=[LowPrecisionCallback(ckpt)])  # fmt: skip
    resumed.train(resume_from_checkpoint=str(ckpt))
    a = losses(full)
    b = {s: v for s, v in losses(resumed).items() if s > 10}  # steps 1-10 come from the checkpoint's history
    assert sorted(b) == list(range(11, 21))
    assert max(abs(a[s] - b[s]) for s in b) <= 1e-6, [(a[s], b[s]) for s in b]
    restored = next(c for c in resumed.callback_handler.callbacks if isinstance(c, LowPrecisionCallback))
    assert restored.plan == cb.plan and restored.scan_seconds == saved["attributes"]["scan_seconds"] > 0


def test_a_checkpoint_saved_before_the_gradient_scalers_level_streaks_resumes(tmp_path):
    """A gradient-scaler checkpoint written before ``level_streak`` existed (its state file without those keys): the
    resume was refused ("does not match this model's low-precision layers"); it resumes, with no streak under way."""
    data = lm_rows(2, batch=4)
    args = dict(max_steps=2, per_device_train_batch_size=4, save_strategy="steps", save_steps=2)
    plan = {"default": "fp8", "layers": {"lm_head": "bf16"}}
    first = Trainer(model=tiny_llama(), args=arguments(tmp_path / "run", **args), train_dataset=data,
                    callbacks=[LowPrecisionCallback(plan, scaler="gradient")])  # fmt: skip
    first.train()
    state = tmp_path / "run" / "checkpoint-2" / STATE_FILE
    tensors = load_file(state)
    assert any(k.endswith(".level_streak") for k in tensors)
    save_file({k: v for k, v in tensors.items() if not k.endswith(".level_streak")}, state)
    resumed = Trainer(model=tiny_llama(), args=arguments(tmp_path / "run", **{**args, "max_steps": 3}), train_dataset=data,
                      callbacks=[LowPrecisionCallback(plan, scaler="gradient")])  # fmt: skip
    resumed.train(resume_from_checkpoint=str(state.parent))
    assert resumed.state.global_step == 3


def test_resuming_with_an_older_checkpoint_as_the_plan_restores_the_resumed_checkpoints_state(tmp_path):
    """A launch script's fixed plan folder (the first checkpoint), the run resumed from the latest: the learned steps
    and scale buffers are the latest checkpoint's, as the weights the Trainer loaded are (the plan folder's older
    ones replaced them without a word)."""
    data = lm_rows(3, batch=4)
    args = dict(per_device_train_batch_size=4, save_strategy="steps", save_steps=3)
    Trainer(model=tiny_llama(), args=arguments(tmp_path / "run", max_steps=6, **args), train_dataset=data,
            callbacks=[LowPrecisionCallback(calibration_batches=2)]).train()  # fmt: skip
    older, newer = tmp_path / "run" / "checkpoint-3", tmp_path / "run" / "checkpoint-6"
    seen = {}

    class Probe(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            seen.update({k: v.detach().clone() for k, v in low_precision_state(model).items()})

    resumed = Trainer(model=tiny_llama(), args=arguments(tmp_path / "run", max_steps=7, **args), train_dataset=data,
                      callbacks=[LowPrecisionCallback(older), Probe()])  # fmt: skip
    resumed.train(resume_from_checkpoint=str(newer))
    saved, stale = load_file(newer / STATE_FILE), load_file(older / STATE_FILE)
    assert any(not torch.equal(saved[k], stale[k]) for k in saved)  # the two checkpoints' states differ
    assert set(seen) == set(saved) and all(torch.equal(seen[k], saved[k]) for k in saved)


@pytest.mark.slow
def test_torch_compile_trains_like_eager(tmp_path):
    """TrainingArguments(torch_compile=True): the converted model compiles (~40-70 s here) and follows
    the eager curve; compiled kernels reorder fp32 sums, so 1e-3 (measured 3e-4 after 6 steps)."""
    curves = []
    for compile_ in (False, True):
        trainer = Trainer(model=tiny_llama(), args=arguments(tmp_path / str(compile_), max_steps=6, torch_compile=compile_),
                          train_dataset=lm_rows(), callbacks=[LowPrecisionCallback(MIXED_PLAN)])  # fmt: skip
        trainer.train()
        curves.append(losses(trainer))
    assert max(abs(curves[0][s] - curves[1][s]) for s in curves[0]) <= 1e-3, curves


def test_bf16_weights_with_kahan_compensation_resume_exactly(tmp_path):
    """compensation="kahan" wraps the Trainer's optimizer; checkpoints keep the Trainer's optimizer.pt
    loadable by a plain optimizer and the buffers (and fp32 moments) are restored through the wrapper."""
    from hf_lowprec.training.compensation import CompensatedOptimizer

    data = lm_rows(2, batch=4)
    args = dict(max_steps=8, per_device_train_batch_size=4, save_strategy="steps", save_steps=4, bf16=True)
    full = Trainer(model=tiny_llama().to(torch.bfloat16), args=arguments(tmp_path / "full", **args), train_dataset=data,
                   callbacks=[LowPrecisionCallback(MIXED_PLAN, compensation="kahan")])  # fmt: skip
    full.train()
    assert isinstance(full.optimizer.optimizer, CompensatedOptimizer) and full.optimizer.optimizer.compensation_bytes() > 0
    ckpt = tmp_path / "full" / "checkpoint-4"
    assert set(torch.load(ckpt / "optimizer.pt", weights_only=True)) == {"state", "param_groups"}
    # resumed into another output folder: the plan given as the checkpoint folder, as a format name (the checkpoint
    # train() resumes is where the compensation buffers are: a format name was refused, "pass plan=<checkpoint
    # folder>"), or the callback rebuilt by transformers from trainer_state.json (which holds the plan, not the folder:
    # it was refused saying to do what had been done)
    for name, plan, more in (("folder", ckpt, {}), ("named", MIXED_PLAN, {}),
                             ("rebuilt", ckpt, {"restore_callback_states_from_checkpoint": True})):  # fmt: skip
        resumed = Trainer(model=tiny_llama().to(torch.bfloat16), args=arguments(tmp_path / name, **args, **more),
                          train_dataset=data, callbacks=[LowPrecisionCallback(plan, compensation="kahan")])  # fmt: skip
        resumed.train(resume_from_checkpoint=str(ckpt))
        a, b = losses(full), {s: v for s, v in losses(resumed).items() if s > 4}
        assert sorted(b) == [5, 6, 7, 8] and all(a[s] == b[s] for s in b), (name, a, b)


def test_a_checkpoint_without_optimizer_state_resumes_saying_the_optimizer_restarts(tmp_path, caplog):
    """save_only_model=True writes no optimizer.pt: with compensation= the resume crashed on the missing
    hf_lowprec_compensation.pt (FileNotFoundError); now it resumes, the scale state restored and the optimizer (and
    its compensation buffers) restarting, as transformers restarts it, and says so."""
    data = lm_rows(2, batch=4)
    args = dict(max_steps=6, per_device_train_batch_size=4, save_strategy="steps", save_steps=3, bf16=True,
                save_only_model=True)  # fmt: skip
    full = Trainer(model=tiny_llama().to(torch.bfloat16), args=arguments(tmp_path / "full", **args), train_dataset=data,
                   callbacks=[LowPrecisionCallback(MIXED_PLAN, scaler="delayed", compensation="kahan")])  # fmt: skip
    full.train()
    ckpt = tmp_path / "full" / "checkpoint-3"
    assert not (ckpt / "optimizer.pt").exists()
    resumed = Trainer(model=tiny_llama().to(torch.bfloat16), args=arguments(tmp_path / "full", **args), train_dataset=data,
                      callbacks=[LowPrecisionCallback(MIXED_PLAN, scaler="delayed", compensation="kahan")])  # fmt: skip
    with caplog.at_level("WARNING", logger="hf_lowprec.training.callback"):
        resumed.train(resume_from_checkpoint=str(ckpt))
    assert "holds no optimizer.pt (saved with save_only_model=True): the optimizer and its compensation buffers restart" in caplog.text
    a, b = losses(full), losses(resumed)
    assert a[4] == b[4]  # the first step after the checkpoint: weights and scale histories restored, moments unused yet


def test_a_second_train_counts_its_own_skipped_steps(tmp_path):
    """train() twice on one Trainer: the second run's lowprec/steps_skipped started at the first run's count."""
    callback = LowPrecisionCallback("fp8")
    trainer = Trainer(model=tiny_llama(), args=arguments(tmp_path, max_steps=2), train_dataset=lm_rows(1),
                      callbacks=[callback])  # fmt: skip
    trainer.train()
    callback.steps_skipped = 3  # as if the first run had skipped three spiking steps
    trainer.train()
    assert [h["lowprec/steps_skipped"] for h in trainer.state.log_history if "loss" in h] == [0.0, 0.0]


class OutOfMemoryOnce(TrainerCallback):
    """Raises the error Accelerate's find_executable_batch_size retries on, once, after the first backward."""

    def __init__(self):
        self.raised = False

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if not self.raised:
            self.raised = True
            raise RuntimeError("CUDA out of memory. (raised by the test)")


@pytest.mark.parametrize("scaler", ["delayed", "gradient"])
def test_a_batch_size_retry_after_out_of_memory_trains_as_a_run_at_that_size(tmp_path, scaler):
    """auto_find_batch_size: after an out-of-memory error the Trainer runs its loop again, at a smaller batch, on the
    same model; the aborted attempt's forward and backward stayed in the scale statistics (an extra amax recorded,
    losses 1e-3 apart). The retry starts from the statistics the first attempt started from."""
    runs = {}
    for retry in (False, True):
        callbacks = [LowPrecisionCallback(MIXED_PLAN, scaler=scaler)] + ([OutOfMemoryOnce()] if retry else [])
        args = arguments(tmp_path / str(retry), max_steps=3, auto_find_batch_size=True,
                         per_device_train_batch_size=8 if retry else 7)  # fmt: skip
        trainer = Trainer(model=tiny_llama(), args=args, train_dataset=lm_rows(2), callbacks=callbacks)
        trainer.train()
        assert trainer._train_batch_size == 7
        runs[retry] = losses(trainer), low_precision_state(trainer.model)
    assert runs[True][0] == runs[False][0]
    for key, value in runs[False][1].items():
        torch.testing.assert_close(runs[True][1][key], value, rtol=0, atol=0, equal_nan=True, msg=key)


def test_a_skipped_spike_step_is_said_and_leaves_the_lr_schedule_and_the_weights_where_they_were(tmp_path, caplog):
    """spike_action="skip" drops a step: a warning says so (it was an info line), and the Trainer's LR schedule does
    not advance over it, as for an fp16 overflow (Accelerate's step_was_skipped); the parameters do not move."""

    class SpikeAtStep3(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            loss = super().compute_loss(model, inputs, return_outputs, **kwargs)
            return loss * 1e4 if self.state.global_step == 2 else loss

    class Snapshots(TrainerCallback):
        def __init__(self):
            self.weights, self.skipped = [], []

        def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
            self.weights.append(model.model.layers[0].mlp.up_proj.weight.detach().clone())
            self.skipped.append(optimizer.step_was_skipped)  # what any callback sees at the step's end

    callback, snapshots = LowPrecisionCallback("fp8", scaler="gradient", scaler_options={"spike_action": "skip"}), Snapshots()
    trainer = SpikeAtStep3(model=tiny_llama(), args=arguments(tmp_path, max_steps=5, lr_scheduler_type="linear"),
                           train_dataset=lm_rows(1), callbacks=[callback, snapshots])  # fmt: skip
    with caplog.at_level("WARNING", logger="hf_lowprec"):
        trainer.train()
    assert [h["lowprec/steps_skipped"] for h in trainer.state.log_history if "loss" in h] == [0.0, 0.0, 1.0, 1.0, 1.0]
    assert "optimizer step skipped" in caplog.text and torch.equal(snapshots.weights[2], snapshots.weights[1])
    assert trainer.lr_scheduler.last_epoch == 4  # five steps, one skipped
    assert snapshots.skipped == [False, False, True, False, False] and not trainer.optimizer.step_was_skipped


@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
def test_a_skipped_spike_step_under_an_fp16_grad_scaler_holds_the_lr_schedule(tmp_path, max_grad_norm):
    """Under fp16 (Accelerate's optimizer with a GradScaler: the CPU has none in the Trainer, so its step is replayed
    here in the Trainer's order) a skipped spike step says it was skipped once the optimizer has stepped: the scaler's
    step had set step_was_skipped from the loss scale (False), and the Trainer advanced the LR schedule over it."""
    from accelerate.optimizer import AcceleratedOptimizer

    model = tiny_llama()
    callback = LowPrecisionCallback("fp8", scaler="gradient", scaler_options={"spike_action": "skip", "warmup": 1})
    args = arguments(tmp_path, max_steps=4, max_grad_norm=max_grad_norm)
    Trainer(model=model, args=args, train_dataset=lm_rows(1), callbacks=[callback])  # converts; an Accelerator
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    optimizer = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), device_placement=False, scaler=scaler)
    skipped, weights = [], []
    for step, batch in enumerate(lm_batches(n=4, batch=4, seq=32, seed=1)):
        callback.on_step_begin(args, None, None, optimizer=optimizer)
        scaler.scale(model(**batch).loss * (1e4 if step == 2 else 1)).backward()
        scaler.unscale_(optimizer.optimizer)  # the Trainer's accelerator.clip_grad_norm_, to clip or measure
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm or float("inf"))
        callback.on_pre_optimizer_step(args, None, None, model=model, optimizer=optimizer)
        before = model.model.layers[0].mlp.up_proj.weight.detach().clone()
        optimizer.step()
        callback.on_optimizer_step(args, None, None, optimizer=optimizer)
        skipped.append(optimizer.step_was_skipped)  # the Trainer's test before lr_scheduler.step() reads it
        weights.append(torch.equal(before, model.model.layers[0].mlp.up_proj.weight))
        optimizer.zero_grad()
    assert skipped == [False, False, True, False] and weights == skipped and callback.steps_skipped == 1


@pytest.mark.parametrize("scaler", ["delayed", "gradient"])
def test_the_best_checkpoint_of_a_peft_model_comes_back_with_its_low_precision_state(tmp_path, scaler):
    """load_best_model_at_end on a PEFT model: the Trainer reloads the best checkpoint's adapters alone; its learned
    steps and scale statistics (our state file) came from the last step, and the final evaluation was not the best
    one's (delayed scaling: 5.5350 against 5.5347)."""
    from peft import LoraConfig, get_peft_model

    class WorseAfterStep3(TrainerCallback):  # the best checkpoint is an early one
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step >= 3:
                with torch.no_grad():
                    for p in (p for p in model.parameters() if p.requires_grad):
                        p.add_(torch.randn_like(p) * 0.3 * p.abs().mean().clamp_min(1e-2))

    model = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"],
                                                    init_lora_weights=False))  # fmt: skip
    plan = PrecisionPlan({"lm_head": "bf16", "*.mlp.down_proj": "int4-g64"}, default="fp8")
    args = arguments(tmp_path, max_steps=5, per_device_train_batch_size=4, learning_rate=1e-2, eval_strategy="steps",
                     eval_steps=1, save_strategy="steps", save_steps=1, load_best_model_at_end=True,
                     metric_for_best_model="loss")  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=lm_rows(4), eval_dataset=lm_rows(1, seed=2),
                      callbacks=[LowPrecisionCallback(plan, scaler=scaler), WorseAfterStep3()])  # fmt: skip
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert not best.endswith("-5")
    saved, now = load_file(f"{best}/{STATE_FILE}"), low_precision_state(trainer.model)
    assert saved.keys() == now.keys()
    torch.testing.assert_close(now, saved, rtol=0, atol=0, equal_nan=True)  # an amax history's unfilled slots: NaN
    assert trainer.evaluate()["eval_loss"] == trainer.state.best_metric


# --------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("first, second", [(dict(scaler="dynamic"), dict(scaler="delayed")),
                                           (dict(plan=MIXED_PLAN), dict(plan=MIXED_PLAN, learn_scales=False))])  # fmt: skip
def test_a_second_callback_with_other_options_on_a_converted_model_is_refused(tmp_path, first, second):
    """A second Trainer on a model the first converted: its callback's other scaler (or learn_scales=False) was
    ignored, the layers kept the first's (dynamic scales; steps still learned) while its state said otherwise. The
    same options reuse the conversion; other ones are refused until the model is reverted."""
    model = tiny_llama()
    make = lambda options: Trainer(model=model, args=arguments(tmp_path), train_dataset=lm_rows(1),  # noqa: E731
                                   callbacks=[LowPrecisionCallback(**{"plan": "fp8", **options})])  # fmt: skip
    learned = lambda: [n for n, p in model.named_parameters() if n.endswith(".step") and p.requires_grad]  # noqa: E731
    make(first)
    make(first)
    assert bool(learned()) == ("learn_scales" in second)
    with pytest.raises(ValueError, match="^this model was converted with .*: its converted layers keep theirs; hf_lowprec.revert"):
        make(second)
    revert(model)
    trainer = make(second)
    if "scaler" in second:
        assert type(model.model.layers[0].self_attn.q_proj.scaling["input"]).__name__ == "DelayedScaling"
    else:
        assert learned() == [] and trainer.model is model


def test_plan_for_another_model_fails_at_init(tmp_path):
    path = PrecisionPlan({"bert.encoder.layer.0.attention.self.query": "fp8"}).save(tmp_path / "bert_plan.json")
    with pytest.raises(ValueError, match="is not a layer of this model"):
        Trainer(model=tiny_llama(), args=arguments(tmp_path), train_dataset=lm_rows(1), callbacks=[LowPrecisionCallback(path)])


def test_model_without_eligible_layers_fails_at_init(tmp_path):
    class NoLinear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv1d(4, 4, 3)

        def forward(self, x, labels=None):
            return {"loss": self.conv(x).mean()}

    with pytest.raises(ValueError, match="no eligible layers"):
        Trainer(model=NoLinear(), args=arguments(tmp_path), callbacks=[LowPrecisionCallback("fp8")])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(plan="fp8", budget={"target_bits_per_param": 8}), rf"^budget= applies only to {AUTO_ONLY} not to plan="),
        (dict(plan="fp8", formats=["int4-g64"]), rf"^formats= applies only to {AUTO_ONLY} not to plan='fp8': drop it"),
        (dict(plan=MIXED_PLAN, scan_method="fisher"), r"^scan_method= applies only to plan='auto' .*to a fixed plan"),
        (dict(plan="fp8", budget={}, formats=("fp8",)), r"^budget=, formats= apply only to plan='auto' .*drop them or"),
        (dict(scan_method="magic"), r"^unknown scan_method 'magic'; choose one of auto, measured, fisher$"),
        (dict(plan="fp8", keep=["lm_head", 3]), r"^keep= takes a string or a list of strings, got \['lm_head', 3\]$"),
        (dict(plan="fp8", calibration_data=[{}]), r"^calibration_data= applies only to plan='auto', fp8_rounding='gptq' or a plan with '-sq' formats, not to plan='fp8'$"),
        (dict(plan="int3"), "unknown format"),
        (dict(plan="fp8", scaler="delayed-ish"), "unknown scaler"),
        (dict(plan="fp8", scaler="dynamic", scaler_options={"spike_action": "skip"}), "unknown options"),
        (dict(plan="fp8", scaler_options={"sync": True}), r"^scaler_options \['sync'\]: set for every scale by hf_"),
        (dict(plan="fp8", scaler="gradient", scaler_options={"warmup": 0}), r"^warmup must be >= 1, got 0$"),
        (dict(plan="fp8", scaler="delayed", scaler_options={"history_len": 0}), r"^history_len must be >= 1, got 0$"),
        # delayed scaling with a rowwise/block format: now, not after an auto plan's scan of the first batches
        (dict(plan="fp8-rowwise", scaler="delayed"), r"^scaler 'delayed' needs tensorwise fp8 .*, not fp8-rowwise"),
        (dict(scaler="delayed", formats=["fp8-block", "int4-g64"]), r"^scaler 'delayed' needs tensorwise .*fp8-block"),
        (dict(plan="fp8", calibration_batches=0), "calibration_batches"),
        (dict(plan=MIXED_PLAN, keep=("lm_head",)), "keep= applies"),
        (dict(plan="fp8", compensation="kahan-ish"), "unknown compensation"),
        # a scan's formats now, not when training starts (under DDP on every rank inside train())
        (dict(formats=["fp8", "bf16"]), r"^format 'bf16' is high precision: scan low-precision formats"),
        (dict(formats=["fp8", "fp8"]), r"^formats contain duplicates"),
        (dict(plan="fp8", fp8_rounding="gptq"), "needs calibration_data="),
        (dict(plan="fp8", fp8_rounding="awq", calibration_data=[{}]), "unknown fp8_rounding 'awq'; choose one of"),
        # the budget's keys and values when it is given, not after the first training batches were scanned
        (dict(budget={"int4_frac": 0.3}), r"unknown budget argument.* \['int4_frac'\] \(did you mean 'int4_fraction'"),
        (dict(budget={"int4_fraction": 1.5}), r"^budget int4_fraction must be a fraction in \[0, 1\], got 1.5$"),
        (dict(budget=0.3), r"^budget= takes a Budget or a dict of its fields \(max_loss_increase, .*\), got 0.3$"),
        (dict(budget={"score": "final"}), r"^budget score must be one of conversion, after-training, got 'final'$"),
        (dict(budget={"score": "after-training"}, scan_method="measured"),
         r"^score 'after-training' needs the scan's Taylor terms, which method 'measured' takes none of"),
    ],
)
def test_incompatible_options_fail_on_construction(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        LowPrecisionCallback(**kwargs)
    assert "\n" not in str(info.value)


def test_the_plugin_checks_its_options_as_the_callback_does():
    from hf_lowprec.training.accelerate import LowPrecisionPlugin

    for owner in (LowPrecisionCallback, LowPrecisionPlugin):  # a misspelt option: named, with the closest and all
        hint = r"\(did you mean 'budget'\?\); its options: plan, keep, budget, .*, seed"
        with pytest.raises(TypeError, match=rf"^{owner.__name__} got an unknown option 'budjet' {hint}"):
            owner("auto", budjet={"int4_fraction": 0.3})

    with pytest.raises(ValueError, match=r"^formats= applies only to plan='auto' .*not to plan='int4-g64'"):
        LowPrecisionPlugin("int4-g64", formats=["int4-g64"])  # was accepted and ignored
    with pytest.raises(ValueError, match=r"^scan_method= applies only to plan='auto'"):
        LowPrecisionPlugin("fp8", scan_method="fisher")


def test_keep_takes_one_name_as_a_string_as_peft_target_modules_does(tmp_path):
    """``keep="lm_head"`` is one layer name, not the names 'l', 'm', ... (callback and plugin alike)."""
    from hf_lowprec.training.accelerate import LowPrecisionPlugin

    model, callback = tiny_llama(), LowPrecisionCallback("fp8", keep="lm_head")
    Trainer(model=model, args=arguments(tmp_path), callbacks=[callback])
    assert callback.plan.to_dict()["layers"] == {"lm_head": "bf16"} and type(model.lm_head) is torch.nn.Linear
    plugin = LowPrecisionPlugin("fp8", keep="*.mlp.*")
    plugin.convert(model := tiny_llama())
    assert plugin.plan.to_dict()["layers"] == {"*.mlp.*": "bf16"}
    assert type(model.model.layers[0].mlp.up_proj) is torch.nn.Linear and type(model.lm_head) is not torch.nn.Linear
    auto = LowPrecisionCallback(keep="lm_head", formats="fp8")  # plan='auto': a string for formats= too
    assert (auto.session.keep, auto.session.formats) == (("lm_head",), ("fp8",))


def test_compensation_on_fp32_weights_fails_at_init(tmp_path):
    with pytest.raises(ValueError, match="every trainable weight of this model is fp32"):
        Trainer(model=tiny_llama(), args=arguments(tmp_path), callbacks=[LowPrecisionCallback("fp8", compensation="kahan")])


def test_learned_steps_are_not_weight_decayed(tmp_path):
    """Learned INT4 steps' names hold neither 'bias' nor 'norm', so the Trainer put them in its decayed group (and a
    late conversion in their weight's): AdamW's decay pulled them toward 0 every step. Now in the no-decay group,
    converted before the optimizer is made or after (the plugin: test_accelerate_plugin)."""

    def groups_of(optimizer) -> dict[str, float]:
        decay = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
        return {n: decay[id(p)] for n, p in trainer.model.named_parameters() if id(p) in decay}

    for callback in (LowPrecisionCallback(MIXED_PLAN), LowPrecisionCallback(calibration_batches=1)):  # before, after
        trainer = Trainer(model=tiny_llama(), args=arguments(tmp_path, weight_decay=0.1, max_steps=1),
                          train_dataset=lm_rows(1), callbacks=[callback])  # fmt: skip
        trainer.train()
        decay = groups_of(trainer.optimizer)
        steps = [n for n in decay if n.endswith(".step")]
        assert steps and all(decay[n] == 0.0 for n in steps)
        assert decay["model.layers.0.mlp.up_proj.weight"] == 0.1
    plain = Trainer(model=tiny_llama(), args=arguments(tmp_path), callbacks=[LowPrecisionCallback(MIXED_PLAN)])
    plain.create_optimizer()  # without weight decay the steps stay with their weights: earlier checkpoints load
    first = {id(p) for p in plain.optimizer.param_groups[0]["params"]}
    assert all(id(p) in first for n, p in plain.model.named_parameters() if n.endswith(".step"))


@pytest.mark.parametrize("plan", ["mixed", "checkpoint folder", "auto"])
def test_a_model_init_run_resumes_on_the_same_curve(tmp_path, plan):
    """``Trainer(model_init=...)`` makes a new model in train() and loads a resumed checkpoint into it before
    on_train_begin: its learned steps were dropped as unexpected keys, then the optimizer state failed to load. Each
    model model_init makes is now converted as made; with plan 'auto' and no plan yet, the load refuses clearly."""
    data = lm_rows(2, batch=4)
    args = dict(max_steps=6, per_device_train_batch_size=2, save_strategy="steps", save_steps=3)
    full = Trainer(model_init=lambda: tiny_llama(), args=arguments(tmp_path / "full", **args), train_dataset=data,
                   callbacks=[LowPrecisionCallback(MIXED_PLAN)])  # fmt: skip
    full.train()
    ckpt = tmp_path / "full" / "checkpoint-3"
    given = {"mixed": MIXED_PLAN, "checkpoint folder": str(ckpt), "auto": "auto"}[plan]
    resumed = Trainer(model_init=lambda: tiny_llama(), args=arguments(tmp_path / "resumed", **args), train_dataset=data,
                      callbacks=[LowPrecisionCallback(given)])  # fmt: skip
    if plan == "auto":
        with pytest.raises(ValueError, match=r"not converted yet: pass its plan, LowPrecisionCallback\(plan="):
            resumed.train(resume_from_checkpoint=str(ckpt))
        return
    resumed.train(resume_from_checkpoint=str(ckpt))
    a, b = losses(full), losses(resumed)
    assert [b[s] for s in range(4, 7)] == [a[s] for s in range(4, 7)]


def test_resuming_an_auto_run_without_its_plan_fails_before_training(tmp_path):
    data = lm_rows(1, batch=4)
    args = dict(max_steps=2, per_device_train_batch_size=4, save_strategy="steps", save_steps=1)
    Trainer(model=tiny_llama(), args=arguments(tmp_path, **args), train_dataset=data,
            callbacks=[LowPrecisionCallback(MIXED_PLAN)]).train()  # fmt: skip
    again = Trainer(model=tiny_llama(), args=arguments(tmp_path, **args), train_dataset=data, callbacks=[LowPrecisionCallback()])
    with pytest.raises(ValueError, match="pass its plan"):
        again.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert again.state.global_step == 0  # refused while loading the weights, before any step


def test_fp8_rounding_moves_the_master_weights_onto_their_grid_before_training(tmp_path):
    """``fp8_rounding="gptq"``: after the conversion the FP8 weights changed exactly where their cast changed, the
    logits moved toward the unquantized model's, and training runs from there."""
    from hf_lowprec.formats import E4M3, fp8_quantize_dequantize
    from hf_lowprec.modules import FP8Linear

    model = tiny_llama(hidden_size=128, intermediate_size=256)
    rows = lm_rows()
    calibration = lm_batches(n=4, batch=8, seq=32, seed=1)  # the rows' batches
    ids = calibration[0]["input_ids"]
    with torch.no_grad():
        reference = model(input_ids=ids).logits
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    nearest = copy.deepcopy(model)
    Trainer(model=nearest, args=arguments(tmp_path / "n"), callbacks=[LowPrecisionCallback("fp8")])
    callback = LowPrecisionCallback("fp8", fp8_rounding="gptq", calibration_data=calibration)
    trainer = Trainer(model=model, args=arguments(tmp_path / "g"), train_dataset=rows, callbacks=[callback])
    assert callback.session.rounding["layers"] == 2 * 7  # the default keep leaves lm_head in high precision
    cast = lambda w: fp8_quantize_dequantize(w, E4M3, "tensor", role="weight")  # noqa: E731
    for name, m in model.named_modules():
        if isinstance(m, FP8Linear):
            w, before = m.weight.detach(), original[f"{name}.weight"]
            assert torch.equal(w != before, cast(w) != cast(before)) and bool((w != before).any()), name
    with torch.no_grad():
        err = (model(input_ids=ids).logits - reference).norm()
        assert err < 0.9 * (nearest(input_ids=ids).logits - reference).norm()
    trainer.train()
    assert all(torch.isfinite(torch.tensor(v)) for v in losses(trainer).values())

@pytest.mark.parametrize("mixed", [{}, {"bf16": True}, {"fp16": True}])
def test_auto_plan_scans_under_the_trainers_autocast(tmp_path, mixed):
    """The scan at the Trainer's init computes as its steps will: bf16 autocast with ``bf16=True``; fp32 otherwise, also
    with ``fp16=True``, which Accelerate runs in fp32 on a CPU."""
    model = tiny_llama()
    states, handle = autocast_states(model.model)  # the decoder: the scan's chunked passes call it, not the model
    calibration = [{"input_ids": r["input_ids"][None], "labels": r["labels"][None]} for r in lm_rows(1)[:2]]
    Trainer(model=model, args=arguments(tmp_path, **mixed), train_dataset=lm_rows(1),
            callbacks=[LowPrecisionCallback(calibration_data=calibration, scan_method="fisher")])  # fmt: skip
    handle.remove()
    assert states and set(states) == {(bool(mixed.get("bf16")), torch.bfloat16)}


@pytest.mark.parametrize("disable_tqdm", [False, True])
def test_the_auto_scan_shows_its_progress_as_the_trainer_does(tmp_path, capsys, disable_tqdm):
    """The scan takes minutes on a CPU before the Trainer's bar moves: it shows a bar of its own (the passes done and
    the layer being measured), and none when the Trainer's are off."""
    calibration = [{"input_ids": r["input_ids"][None], "labels": r["labels"][None]} for r in lm_rows(1)[:2]]
    callback = LowPrecisionCallback(calibration_data=calibration)
    Trainer(model=tiny_llama(), args=arguments(tmp_path, disable_tqdm=disable_tqdm), train_dataset=lm_rows(1),
            callbacks=[callback])  # fmt: skip
    err = capsys.readouterr().err
    assert callback.plan is not None
    assert ("hf-lowprec sensitivity scan" in err) != disable_tqdm, err[-500:]
    if not disable_tqdm:
        assert "measured" in err or "fisher" in err, err[-500:]


def test_flops_coverage_counts_packed_layers_as_the_linears_they_are():
    """A frozen (packed) INT4 layer is no nn.Linear: its FLOPs counted as kept, 'flops_kept 1.0' beside
    'params_int4 0.8'."""
    from hf_lowprec.convert import apply_plan, freeze
    from hf_lowprec.training.session import coverage

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 32))
    plan = {"default": "int4-g32", "layers": {"2": "bf16"}}
    apply_plan(model, plan)
    freeze(model)
    shares = coverage(model, apply_plan(model, plan))
    assert shares["flops_int4-g32"] == pytest.approx(0.8) and shares["flops_kept"] == pytest.approx(0.2)


def test_kept_shares_add_up_whatever_high_precision_format_the_plan_names():
    """bf16 and fp32 entries are both 'kept' (the layer's own dtype): one share overwrote the other in coverage."""
    from hf_lowprec.convert import apply_plan
    from hf_lowprec.training.session import coverage

    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(3)))
    report = apply_plan(model, {"default": "int4-g32", "layers": {"0": "bf16", "1": "fp32"}})
    shares = coverage(model, report)
    assert shares["params_kept"] == pytest.approx(2 / 3) and shares["flops_kept"] == pytest.approx(2 / 3)
    assert "kept 66.7%" in str(report)
