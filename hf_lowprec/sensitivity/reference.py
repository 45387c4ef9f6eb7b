"""What the scan's measured passes compare with: the unquantized model's outputs on each calibration batch, and the
loss and KL divergence of a (partly low-precision) model's outputs against them.

For a causal LM whose logits are its head's output (:func:`~hf_lowprec.sensitivity.batches._decoder_rows`) they are
kept as the decoder's output at the labelled positions, ``[T, H]``, and every measured pass applies the unquantized
head to them again, a chunk of tokens at a time (:func:`~hf_lowprec.chunked_loss.chunk_rows`), beside the measured
model's head: neither model's ``[T, vocabulary]`` log-probabilities exist whole, for one more GEMM of the head per
batch and pass. SmolLM2-135M, batches of 2048 tokens: 2.4 MB kept per batch instead of 403 MB of fp32
log-probabilities, and chunks of 25 MB instead of 403 MB copies. Elsewhere (classification, scaled or capped logits,
inputs besides ``input_ids`` and ``attention_mask``) the log-probabilities ``[T, C]`` fp32 are kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from hf_lowprec.chunked_loss import chunk_rows, chunkable_head
from hf_lowprec.sensitivity.batches import _decoder_rows, _forward


class _BatchReference(NamedTuple):
    hidden: torch.Tensor | None  # the decoder's output at the labelled positions [T, H] (the head: BaseOutputs.head)
    logp: torch.Tensor | None  # else the log-probabilities there [T, C] fp32


@dataclass
class BaseOutputs:
    """The unquantized model's outputs, one :class:`_BatchReference` per calibration batch, and its output head (the
    module object, which a measured pass may hook or :func:`~hf_lowprec.layers.swap_layers` replace)."""

    head: nn.Module | None = None
    batches: list[_BatchReference] = field(default_factory=list)

    def keep_hidden(self, hidden: torch.Tensor, head: nn.Module) -> None:
        self.head = head
        self.batches.append(_BatchReference(hidden.detach(), None))

    def keep_logits(self, logits: torch.Tensor) -> None:
        self.batches.append(_BatchReference(None, torch.log_softmax(logits.detach(), -1)))


@torch.no_grad()
def base_loss(model: nn.Module, batch, device, base: BaseOutputs) -> tuple[float, int]:
    """``(summed next-token loss, labelled positions)`` of the unquantized ``model`` on ``batch``; its outputs are
    appended to ``base``."""
    rows = _decoder_rows(model, batch, device)
    if rows is None:
        logits, labels = _forward(model, batch, device)
        base.keep_logits(logits)
        return -base.batches[-1].logp.gather(1, labels[:, None]).sum().item(), len(labels)
    hidden, labels = rows
    head = chunkable_head(model)
    base.keep_hidden(hidden, head)
    step, nll = chunk_rows(head), 0.0
    for i in range(0, len(labels), step):  # as loss_and_kl applies the head: the same logits, bit for bit
        logp = torch.log_softmax(head(hidden[i : i + step]).float(), -1)
        nll -= logp.gather(1, labels[i : i + step, None]).sum().item()
    return nll, len(labels)


@torch.no_grad()
def loss_and_kl(model: nn.Module, batch, device, reference: _BatchReference, base: BaseOutputs, head_whole: bool):
    """``(summed next-token loss, summed KL(base ‖ model), labelled positions)`` of ``model`` on ``batch`` against
    ``reference`` (``base``'s entry for it). ``head_whole``: the head runs once on all the rows, not a chunk at a time
    (a low-precision twin of the head then scales its activations over them all, as in training); it does whenever
    the model's head is not ``base``'s."""
    if reference.logp is not None:
        logits, labels = _forward(model, batch, device)
        return (*_terms(torch.log_softmax(logits, -1), reference.logp, labels), len(labels))
    hidden, labels = _decoder_rows(model, batch, device)
    head = chunkable_head(model)
    whole = head(hidden) if head_whole or head is not base.head else None
    step, nll, kl = chunk_rows(base.head), 0.0, 0.0
    for i in range(0, len(labels), step):
        rows = slice(i, i + step)
        logits = whole[rows] if whole is not None else head(hidden[rows])
        base_logits = base.head.forward(reference.hidden[rows])  # not __call__: no hook replaces this head's output
        chunk = _terms(torch.log_softmax(logits.float(), -1), torch.log_softmax(base_logits.float(), -1), labels[rows])
        nll, kl = nll + chunk[0], kl + chunk[1]
    return nll, kl, len(labels)


def _terms(logp: torch.Tensor, base_logp: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """``(summed next-token loss, summed KL(base ‖ model))`` of log-probabilities ``[T, C]`` against labels ``[T]``."""
    nll = -logp.gather(1, labels[:, None]).sum().item()
    return nll, F.kl_div(logp, base_logp, reduction="sum", log_target=True).item()
