"""TRL's ``SFTTrainer``, the Trainer most fine-tuning scripts use, with hf-lowprec's two entry points: a packed INT4
base loaded the transformers way plus ``peft_config=``, and ``LowPrecisionCallback`` for full fine-tuning."""

from __future__ import annotations

import math

import datasets
import pytest
import torch
import trl
from peft import LoraConfig, PeftModel
from tiny_assets import corpus_text, save_tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_lowprec import HfLowprecConfig, LowPrecisionCallback
from hf_lowprec.modules import FP8Linear, PackedLinear


def _chats(n: int = 32) -> datasets.Dataset:
    """Conversational rows (``messages``), TRL's most common dataset format."""
    lines = [line for line in corpus_text(20_000).splitlines() if len(line) > 40]
    chats = [[{"role": "user", "content": "Go on."}, {"role": "assistant", "content": line}] for line in lines[:n]]
    return datasets.Dataset.from_dict({"messages": chats})


def _config(out, **overrides) -> "trl.SFTConfig":
    """As a user on a CPU writes it: SFTConfig's own defaults (gradient checkpointing included) but bf16."""
    options = dict(output_dir=str(out), max_steps=6, per_device_train_batch_size=4, max_length=64, logging_steps=1,
                   learning_rate=1e-2, bf16=False, report_to=[], save_strategy="no", disable_tqdm=True)  # fmt: skip
    return trl.SFTConfig(**{**options, **overrides})


def _losses(trainer) -> list[float]:
    return [row["loss"] for row in trainer.state.log_history if "loss" in row]


def test_sft_trainer_trains_lora_on_the_packed_base_and_its_adapter_reloads_exactly(tmp_path):
    """``from_pretrained(quantization_config=HfLowprecConfig())`` then ``SFTTrainer(peft_config=...)``: LoRA wraps the
    packed layers, their codes stay frozen, the loss falls, and the saved adapter on a freshly packed base gives the
    trained model's logits exactly (the packing is deterministic)."""
    base_dir = save_tiny_model(tmp_path / "base")
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16, quantization_config=HfLowprecConfig())
    codes = {n: m.qweight.clone() for n, m in model.named_modules() if isinstance(m, PackedLinear)}
    assert len(codes) == 14  # every Linear but the head
    torch.manual_seed(0)
    trainer = trl.SFTTrainer(
        model=model, args=_config(tmp_path / "out", max_steps=8), train_dataset=_chats(),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=4, target_modules="all-linear"),
    )  # fmt: skip
    trainer.train()
    tuned = trainer.model.eval()
    assert isinstance(tuned, PeftModel) and tuned.is_gradient_checkpointing
    wrapped = {n.removeprefix("base_model.model.").replace(".base_layer", ""): m for n, m in tuned.named_modules()
               if isinstance(m, PackedLinear)}  # fmt: skip
    assert wrapped.keys() == codes.keys() and all(torch.equal(wrapped[n].qweight, c) for n, c in codes.items())
    losses = _losses(trainer)  # a random 2-layer base: r=4 adapters move it slowly
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.1, losses
    trainer.save_model(str(tmp_path / "adapter"))

    ids = tokenizer("The quick brown fox", return_tensors="pt").input_ids
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16, quantization_config=HfLowprecConfig())
    reloaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, tuned(input_ids=ids).logits, rtol=0, atol=0)


def test_sft_trainer_with_the_callback_trains_in_fp8(tmp_path):
    """``LowPrecisionCallback("fp8")`` in ``SFTTrainer``'s callbacks: every Linear but the output head runs FP8, the
    loss falls, and the ``lowprec/*`` telemetry joins TRL's own logged values."""
    base_dir = save_tiny_model(tmp_path / "base")
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    callback = LowPrecisionCallback("fp8")
    trainer = trl.SFTTrainer(
        model=model, args=_config(tmp_path / "out", learning_rate=3e-3), train_dataset=_chats(),
        processing_class=AutoTokenizer.from_pretrained(base_dir), callbacks=[callback],
    )  # fmt: skip
    trainer.train()
    assert sum(isinstance(m, FP8Linear) for m in model.modules()) == 14 and type(model.lm_head) is torch.nn.Linear
    losses = _losses(trainer)
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.3, losses
    logged = trainer.state.log_history[0]
    assert "mean_token_accuracy" in logged
    assert logged["lowprec/params_fp8"] == pytest.approx(callback.coverage["params_fp8"])


def test_sft_trainer_batches_feed_an_auto_plans_scan(tmp_path):
    """``plan="auto"`` scans SFTTrainer's own first batches (its collator's ``input_ids``/``labels``/padding) at
    ``on_train_begin``, keeps the output head, and the converted model trains."""
    base_dir = save_tiny_model(tmp_path / "base")
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    callback = LowPrecisionCallback("auto", budget={"int4_fraction": 0.3})
    trainer = trl.SFTTrainer(
        model=model, args=_config(tmp_path / "out", max_steps=4, learning_rate=3e-3), train_dataset=_chats(),
        processing_class=AutoTokenizer.from_pretrained(base_dir), callbacks=[callback],
    )  # fmt: skip
    trainer.train()
    formats = callback.plan.to_dict()["layers"]
    assert callback.scan_seconds > 0 and formats["lm_head"] == "bf16"
    assert {"fp8", "int4-g64"} <= set(formats.values()) and callback.coverage["params_int4-g64"] <= 0.3
    assert all(math.isfinite(loss) for loss in _losses(trainer))
