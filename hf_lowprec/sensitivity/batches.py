"""Calibration batches of a scan: validated, merged up to a token budget, and run through the model as
``(logits, labels)`` of the predicted tokens, or as the decoder's output there where the head can run in chunks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from hf_lowprec.chunked_loss import chunkable_head
from hf_lowprec.labels import IGNORE_INDEX


def _check_batches(batches: Iterable[Mapping], model: nn.Module) -> list[dict]:
    """``batches`` as dicts the scan runs: padding labelled ``-100``; an encoder-decoder's ``decoder_input_ids`` made
    from its labels where a batch has none (as the model does when it computes its own loss: the scan's forward
    takes the labels out)."""
    seq2seq = getattr(getattr(model, "config", None), "is_encoder_decoder", False)
    out = []
    for i, batch in enumerate(batches):
        if not isinstance(batch, Mapping) or "input_ids" not in batch:
            raise ValueError(f"batch {i}: each batch must be a dict with 'input_ids' and 'labels' tensors")
        if "labels" not in batch:
            raise ValueError("batches need a 'labels' key (causal LM: labels=input_ids)")
        batch = dict(batch)
        mask = batch.get("decoder_attention_mask" if seq2seq else "attention_mask")
        if torch.is_tensor(mask) and torch.is_tensor(batch["labels"]) and mask.shape == batch["labels"].shape:
            # padding is no token to score (labels=input_ids labels it too), as the training loss ignores it
            batch["labels"] = batch["labels"].masked_fill(mask == 0, IGNORE_INDEX)
        if seq2seq and not {"decoder_input_ids", "decoder_inputs_embeds"} & set(batch):
            if not hasattr(model, "prepare_decoder_input_ids_from_labels"):
                raise ValueError(
                    f"batch {i}: {type(model).__name__} is an encoder-decoder without "
                    "prepare_decoder_input_ids_from_labels; give each batch its 'decoder_input_ids'"
                )
            batch["decoder_input_ids"] = model.prepare_decoder_input_ids_from_labels(labels=batch["labels"])
        out.append(batch)
    if not out:
        raise ValueError("scan needs at least one calibration batch")
    return out


def _merge(batches: list[dict], max_tokens: int) -> list[dict]:
    """Concatenate consecutive batches of the same layout along dim 0, up to ``max_tokens`` per batch.

    Fewer, larger forwards: every low-precision twin quantizes its weight once per forward, which
    for a 135M model costs as much as the matmuls of a few hundred tokens.
    """
    out: list[dict] = []
    for batch in batches:
        last = out[-1] if out else None
        if (
            last is not None
            and _same_layout(last, batch)
            and last["input_ids"].numel() + batch["input_ids"].numel() <= max_tokens
        ):
            out[-1] = {k: torch.cat([last[k], v]) if torch.is_tensor(v) else v for k, v in batch.items()}
        else:
            out.append(batch)
    return out


def _same_layout(a: Mapping, b: Mapping) -> bool:
    if a.keys() != b.keys():
        return False
    for k, v in b.items():
        w = a[k]
        if torch.is_tensor(v) != torch.is_tensor(w):
            return False
        if torch.is_tensor(v) and (v.dim() == 0 or v.shape[1:] != w.shape[1:] or v.dtype != w.dtype):
            return False
        if not torch.is_tensor(v) and v != w:
            return False
    return True


def _shifts_labels(model: nn.Module, labels: torch.Tensor) -> bool:
    """Whether ``labels`` are next-token targets (causal LM) rather than per-position or per-sequence classes."""
    if labels.is_floating_point():
        raise ValueError(
            "scan needs class or token labels (integer tensors); regression labels (float) are not supported"
        )
    return labels.dim() == 2 and getattr(model, "loss_type", "ForCausalLM") == "ForCausalLM"


def _label_count(model: nn.Module, batch: Mapping) -> int:
    """Positions the loss scores: next tokens for a causal LM, labels as they are for classification."""
    labels = batch["labels"]
    return int(((labels[:, 1:] if _shifts_labels(model, labels) else labels) != IGNORE_INDEX).sum())


def _inputs(model: nn.Module, batch: Mapping, device) -> dict:
    """The model's inputs of ``batch`` (all but ``labels``) on ``device``, without a KV cache (less memory, and blocks
    can be replayed)."""
    inputs = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items() if k != "labels"}
    if getattr(getattr(model, "config", None), "use_cache", None) is not None:
        inputs.setdefault("use_cache", False)
    return inputs


def _forward(model: nn.Module, batch: Mapping, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits at label positions [T, C] fp32, labels [T])`` of one batch.

    Causal LM: next-token logits and labels (``T`` tokens, ``C`` = vocabulary). Token
    classification: one row per labelled token. Sequence classification (logits ``[B, C]``,
    labels ``[B]``): one row per sequence.
    """
    logits = model(**_inputs(model, batch, device)).logits
    labels = batch["labels"].to(device)
    if _shifts_labels(model, labels):
        logits, labels = logits[:, :-1], labels[:, 1:]
    if logits.shape[: labels.dim()] != labels.shape:
        raise ValueError(
            f"labels of shape {tuple(batch['labels'].shape)} do not fit logits of shape {tuple(logits.shape)} "
            f"({type(model).__name__})"
        )
    valid = labels != IGNORE_INDEX
    return logits[valid].float(), labels[valid]


def _decoder_rows(model: nn.Module, batch: Mapping, device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(decoder output [T, H], labels [T])`` at the rows whose head output :func:`_forward` returns as logits, for a
    causal LM whose logits are its head's output (:func:`hf_lowprec.chunked_loss.chunkable_head`) and a batch of
    ``input_ids``, ``attention_mask`` and ``labels``; else ``None``. The head can then run a chunk of tokens at a
    time: the ``[T, vocabulary]`` logits, fp32 in :func:`_forward` (403 MB at 2048 tokens and a 49k vocabulary),
    never exist whole."""
    labels = batch["labels"]
    if not _shifts_labels(model, labels) or chunkable_head(model) is None:
        return None
    if set(batch) - {"input_ids", "attention_mask", "labels"}:
        return None  # e.g. position_ids: the decoder runs here on input_ids and attention_mask only
    hidden = model.get_decoder()(**_inputs(model, batch, device)).last_hidden_state[:, :-1]
    labels = labels.to(device)[:, 1:]
    valid = labels != IGNORE_INDEX
    return hidden[valid], labels[valid]
