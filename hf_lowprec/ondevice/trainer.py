"""``ChunkedLossTrainer``: a transformers ``Trainer`` with the on-device path's memory savings, for your own scripts.

It is what ``hf-lowprec finetune`` trains INT4+LoRA models with:

- the loss never materialises the ``[tokens, vocab]`` logits (:func:`~hf_lowprec.chunked_loss.chunked_causal_lm_loss`);
- the tensors autograd saves for backward are stored in 8 bits
  (:class:`~hf_lowprec.training.activations.ActivationStorage`; ``activation_storage=None`` keeps them as they are);
- glibc's heap returns the memory freed tensors leave at each decoder block's boundary while the process holds more
  than half of the memory it can use (``return_freed_memory="auto"``,
  :func:`~hf_lowprec.allocator.returning_freed_memory`; ``True``: always, a lower, steadier peak for a slower step;
  ``False``: never);
- ``optim="adamw_torch_8bit"`` (torchao's 8-bit AdamW) steps in one C++ pass on CPUs, same states and numerics
  (:class:`~hf_lowprec.training.adamw8bit.AdamW8bit`): 2.7x fp32 AdamW's time instead of 12x; bf16 adapters round
  its updates stochastically (torchao's ``bf16_stochastic_round``), as :func:`~hf_lowprec.ondevice.finetune_int4_lora`
  does.

A base that learns its steps (``prepare_int4_lora(..., learn_steps=True)``) trains its step gains and zero shifts in a
parameter group of their own (:mod:`~hf_lowprec.ondevice.learned_steps`); checkpoints hold them beside the adapters
(``LEARNED_STEPS_FILE``), and a resumed run, or the best checkpoint loaded at the end, reads them back.

Gradient accumulation follows transformers' convention: when the Trainer passes ``num_items_in_batch`` (the
targets of every batch of one optimizer step), the loss is their sum over it, so ``batch 4 x accumulation 1``
and ``batch 1 x accumulation 4`` give the same gradients. Padded positions (``attention_mask`` 0) are no targets,
whatever their labels say: the loss and that count both leave them out.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping

import torch
import torchao.optim
from transformers import Trainer

from hf_lowprec.allocator import check_return_freed_memory, returning_freed_memory
from hf_lowprec.chunked_loss import chunked_causal_lm_loss
from hf_lowprec.labels import IGNORE_INDEX
from hf_lowprec.ondevice.learned_steps import (
    LEARNED_STEPS_FILE,
    checkpoints_read_back,
    give_learned_steps_their_groups,
    learned_steps,
    learned_steps_by_name,
    trained_dtypes_kept,
)
from hf_lowprec.training.activations import FORMATS as ACTIVATION_FORMATS
from hf_lowprec.training.activations import ActivationStorage
from hf_lowprec.training.adamw8bit import AdamW8bit

logger = logging.getLogger(__name__)


class ChunkedLossTrainer(Trainer):
    """``Trainer`` whose causal-LM loss runs the output head in chunks and whose saved activations take 8 bits.

    Args (besides ``Trainer``'s):
        activation_storage: ``int8`` (default), ``fp8`` or ``None``.
        chunk_tokens: tokens per chunk of the output head and the loss.
        return_freed_memory: return the heap's free memory at each decoder block's boundary in training steps:
            ``"auto"`` while the process holds more than half of the memory it can use, ``True`` always, ``False``
            never.
    """

    def __init__(
        self,
        *args,
        activation_storage: str | None = "int8",
        chunk_tokens: int = 128,
        return_freed_memory: bool | str = "auto",
        **kwargs,
    ):
        if activation_storage is not None and activation_storage not in ACTIVATION_FORMATS:
            raise ValueError(
                f"activation_storage {activation_storage!r}: choose one of {', '.join(ACTIVATION_FORMATS)} or None"
            )
        check_return_freed_memory(return_freed_memory)
        super().__init__(*args, **kwargs)
        checkpoints_read_back(self.model)
        if self.args.label_smoothing_factor != 0 or self.compute_loss_func is not None:
            given = "compute_loss_func" if self.compute_loss_func is not None else "label_smoothing_factor"
            raise ValueError(
                f"{type(self).__name__} computes the next-token cross-entropy itself (its head in chunks) and would "
                f"ignore {given}: leave it unset, or train with transformers' Trainer"
            )
        self.activation_storage_format = activation_storage
        self.chunk_tokens = chunk_tokens
        self.return_freed_memory = return_freed_memory
        self.activation_storage: ActivationStorage | None = None  # made at the first step

    @staticmethod
    def get_optimizer_cls_and_kwargs(args, model=None):
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
        trainable = [] if model is None else [p for p in model.parameters() if p.requires_grad]
        bf16 = any(p.dtype is torch.bfloat16 for p in trainable)
        if cls is torchao.optim.AdamW8bit:
            return AdamW8bit, {**kwargs, "bf16_stochastic_round": bf16}
        if bf16:
            logger.warning(
                "bf16 trainable parameters (adapters, learned zero points) with optim=%r: its updates are rounded "
                "to nearest, and those below half a bf16 step are lost; use optim='adamw_torch_8bit' (rounds them "
                "stochastically)",
                getattr(args.optim, "value", args.optim),
            )
        return cls, kwargs

    def create_optimizer(self):
        optimizer = super().create_optimizer()
        give_learned_steps_their_groups(optimizer, learned_steps(self.model))
        return optimizer

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None):
        trained = self.model if model is None else model
        saved = os.path.join(resume_from_checkpoint, LEARNED_STEPS_FILE)
        if learned_steps_by_name(trained) and not os.path.exists(saved):
            raise FileNotFoundError(
                f"{resume_from_checkpoint} has no {LEARNED_STEPS_FILE}: it was not saved by a run that learned the "
                "base's steps; resume it with the settings it was trained with"
            )
        # a model from load_int4_lora reads the learned steps with its adapters (keep_learned_steps_with_adapters)
        with trained_dtypes_kept(trained):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self):
        with trained_dtypes_kept(self.model):
            super()._load_best_model()

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The Trainer's batches, padded positions' labels set to ``-100``: the loss ignores them, so the count of
        targets the Trainer divides by (``num_items_in_batch``) must not include them."""
        return super().get_batch_samples(map(_padding_ignored, epoch_iterator), num_batches, device)

    def training_step(self, model, inputs, num_items_in_batch=None):
        with returning_freed_memory(model, self.return_freed_memory):  # forward and backward both
            return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.activation_storage_format is not None and self.activation_storage is None:
            self.activation_storage = ActivationStorage(model, self.activation_storage_format)
        with self.activation_storage or contextlib.nullcontext():
            # the batch's other model inputs (a padding-free batch's position_ids); use_cache is the loss's to set
            taken = ("input_ids", "attention_mask", "labels", "use_cache")
            others = {k: v for k, v in inputs.items() if k not in taken}
            loss = chunked_causal_lm_loss(
                model,
                inputs["input_ids"],
                inputs.get("attention_mask"),
                self.chunk_tokens,
                labels=inputs.get("labels"),
                num_items_in_batch=num_items_in_batch,
                **others,
            )
        if num_items_in_batch is not None and self.args.average_tokens_across_devices:
            loss = loss * self.accelerator.num_processes  # num_items_in_batch counts every process's targets
        return (loss, {}) if return_outputs else loss  # no outputs: the logits never exist whole

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """``(loss, None, None)``: evaluation gives the chunked loss alone, batches with or without ``labels`` (as
        training takes them), the ``[tokens, vocab]`` logits never made (``compute_metrics`` gets none; evaluate such
        metrics with transformers' ``Trainer``)."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach().mean(), None, None


def _padding_ignored(batch):
    """``batch`` with ``labels`` set to ``-100`` where ``attention_mask`` is 0 (a new tensor; the rest as it is)."""
    if not isinstance(batch, Mapping) or "labels" not in batch or batch.get("attention_mask") is None:
        return batch
    labels = batch["labels"].masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)
    return {**batch, "labels": labels}
