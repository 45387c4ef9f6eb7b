"""``ChunkedLossTrainer``: a transformers ``Trainer`` with the on-device path's memory savings, for your own scripts.

It is what ``hf-lowprec finetune`` trains INT4+LoRA models with:

- the loss never materialises the ``[tokens, vocab]`` logits (:func:`~hf_lowprec.chunked_loss.chunked_causal_lm_loss`);
- the tensors autograd saves for backward are stored in 8 bits
  (:class:`~hf_lowprec.training.activations.ActivationStorage`; ``activation_storage=None`` keeps them as they are);
- ``optim="adamw_torch_8bit"`` (torchao's 8-bit AdamW) steps in one C++ pass on CPUs, same states and numerics
  (:class:`~hf_lowprec.training.adamw8bit.AdamW8bit`): 2.7x fp32 AdamW's time instead of 12x; bf16 adapters round
  its updates stochastically (torchao's ``bf16_stochastic_round``), as :func:`~hf_lowprec.ondevice.finetune_int4_lora`
  does.

Gradient accumulation follows transformers' convention: when the Trainer passes ``num_items_in_batch`` (the
targets of every batch of one optimizer step), the loss is their sum over it, so ``batch 4 x accumulation 1``
and ``batch 1 x accumulation 4`` give the same gradients.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torchao.optim
from transformers import Trainer

from hf_lowprec.chunked_loss import chunked_causal_lm_loss
from hf_lowprec.training.activations import FORMATS as ACTIVATION_FORMATS
from hf_lowprec.training.activations import ActivationStorage
from hf_lowprec.training.adamw8bit import AdamW8bit

logger = logging.getLogger(__name__)


class ChunkedLossTrainer(Trainer):
    """``Trainer`` whose causal-LM loss runs the output head in chunks and whose saved activations take 8 bits.

    Args (besides ``Trainer``'s):
        activation_storage: ``int8`` (default), ``fp8`` or ``None``.
        chunk_tokens: tokens per chunk of the output head and the loss.
    """

    def __init__(self, *args, activation_storage: str | None = "int8", chunk_tokens: int = 128, **kwargs):
        if activation_storage is not None and activation_storage not in ACTIVATION_FORMATS:
            raise ValueError(
                f"activation_storage {activation_storage!r}: choose one of {', '.join(ACTIVATION_FORMATS)} or None"
            )
        super().__init__(*args, **kwargs)
        self.activation_storage_format = activation_storage
        self.chunk_tokens = chunk_tokens
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
                "bf16 adapters with optim=%r: its updates are rounded to nearest, and those below half a bf16 step "
                "are lost; use optim='adamw_torch_8bit' (rounds them stochastically) or adapter_dtype='fp32'",
                getattr(args.optim, "value", args.optim),
            )
        return cls, kwargs

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.activation_storage_format is not None and self.activation_storage is None:
            self.activation_storage = ActivationStorage(model, self.activation_storage_format)
        with self.activation_storage or contextlib.nullcontext():
            loss = chunked_causal_lm_loss(
                model,
                inputs["input_ids"],
                inputs.get("attention_mask"),
                self.chunk_tokens,
                labels=inputs.get("labels"),
                num_items_in_batch=num_items_in_batch,
            )
        if num_items_in_batch is not None and self.args.average_tokens_across_devices:
            loss = loss * self.accelerator.num_processes  # num_items_in_batch counts every process's targets
        return (loss, None) if return_outputs else loss
