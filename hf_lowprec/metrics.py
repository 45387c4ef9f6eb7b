"""Evaluation figures: causal-LM loss/perplexity and classification accuracy.

Perplexity is computed here (exp of the token-weighted mean negative log-likelihood) because
``evaluate``'s ``perplexity`` metric reloads a model by hub id and cannot score an in-memory or
packed-INT4 model. Accuracy is the share of correct argmax predictions (``evaluate``'s accuracy metric computes
the same through scikit-learn and a Hub download, neither of which this needs).
"""

from __future__ import annotations

import contextlib
import math
import resource
from collections.abc import Callable

import torch
from torch import nn

from hf_lowprec.labels import IGNORE_INDEX


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, MiB (2^20 bytes; ``ru_maxrss``: Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _autocast(dtype: torch.dtype | None, device: torch.device):
    """Autocast to ``dtype`` for one evaluation batch, without its cache of weight casts: it would keep a ``dtype`` copy
    of every trainable fp32 weight (also under ``torch.no_grad``) for a batch that uses each weight once."""
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype, cache_enabled=False)


@torch.no_grad()
def causal_lm_loss(
    model: nn.Module,
    dataset,
    collator,
    *,
    batch_size: int = 4,
    autocast_dtype: torch.dtype | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> dict:
    """Token-weighted mean next-token loss over ``dataset`` (rows with ``input_ids``/``labels``).

    Returns ``{"loss", "perplexity", "tokens"}``; ``on_batch(rows)`` is called after every batch.
    """
    from hf_lowprec.data import collated_batches  # data.py imports datasets: only when evaluating

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    try:
        for batch in collated_batches(dataset, collator, batch_size):
            batch = {k: v.to(device) for k, v in batch.items()}
            labels = batch.pop("labels")
            mask = batch.get("attention_mask")
            targets = labels[:, 1:] if mask is None else labels[:, 1:].masked_fill(mask[:, 1:] == 0, IGNORE_INDEX)
            with _autocast(autocast_dtype, device):
                total += _summed_loss(model, batch, targets)
            count += int((targets != IGNORE_INDEX).sum())
            if on_batch is not None:
                on_batch(len(labels))
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("the evaluation data has no tokens to score")
    loss = total / count
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": count}


def _summed_loss(model: nn.Module, batch: dict, targets: torch.Tensor) -> float:
    """Summed cross-entropy of one batch's next-token ``targets [B, T-1]`` (under ``torch.no_grad``): by the chunked
    loss where the model allows it (:func:`~hf_lowprec.chunked_loss.chunkable_head`; the ``[tokens, vocab]`` logits
    never exist whole: at a 128k vocabulary, batch 4x128, 263 MB each in fp32, and the loss made three such copies),
    else from the full logits."""
    from peft import PeftModel

    from hf_lowprec.chunked_loss import chunkable_head, chunked_causal_lm_loss  # imports peft: only when evaluating

    base = model.get_base_model() if isinstance(model, PeftModel) else model
    if chunkable_head(base) is not None and set(batch) <= {"input_ids", "attention_mask"}:
        labels = torch.cat((batch["input_ids"][:, :1], targets), 1)  # shifted inside; the first column is not read
        ids, mask = batch["input_ids"], batch.get("attention_mask")
        return chunked_causal_lm_loss(model, ids, mask, labels=labels, num_items_in_batch=1).item()
    logits = model(**batch).logits[:, :-1].float()
    mask = targets != IGNORE_INDEX
    return nn.functional.cross_entropy(logits[mask], targets[mask], reduction="sum").item()


@torch.no_grad()
def classification_accuracy(model: nn.Module, dataset, collator, *, batch_size: int = 16, on_batch=None) -> dict:
    """Accuracy of ``model`` (a sequence classifier) on rows with ``labels``: ``{"accuracy", "rows"}``."""
    from hf_lowprec.data import collated_batches  # data.py imports datasets: only when evaluating

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    predictions, references = [], []
    try:
        for batch in collated_batches(dataset, collator, batch_size):
            batch = {k: v.to(device) for k, v in batch.items()}
            labels = batch.pop("labels")
            predictions += model(**batch).logits.argmax(-1).tolist()
            references += labels.tolist()
            if on_batch is not None:
                on_batch(len(labels))
    finally:
        model.train(was_training)
    accuracy = sum(p == r for p, r in zip(predictions, references)) / max(len(references), 1)
    return {"accuracy": float(accuracy), "rows": len(references)}
