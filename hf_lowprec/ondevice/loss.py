"""Token blocks and held-out evaluation of the INT4+LoRA path (its loss: :mod:`hf_lowprec.chunked_loss`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from hf_lowprec.chunked_loss import chunked_causal_lm_loss


@torch.no_grad()
def evaluate_loss(model: nn.Module, blocks: torch.Tensor, batch_size: int = 4, chunk_tokens: int = 128) -> float:
    """Mean next-token loss over ``blocks [n, T]`` (token-weighted; ``exp`` of it is the perplexity)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for i in range(0, len(blocks), batch_size):
            batch = blocks[i : i + batch_size]
            tokens = batch.shape[0] * (batch.shape[1] - 1)
            total += chunked_causal_lm_loss(model, batch, chunk_tokens=chunk_tokens).item() * tokens
            count += tokens
    finally:
        model.train(was_training)
    return total / max(count, 1)


def token_blocks(tokenizer, texts: Sequence[str], block_size: int, max_blocks: int | None = None) -> torch.Tensor:
    """Tokenize ``texts``, join them with EOS and cut the stream into ``[n, block_size]`` blocks (tail dropped)."""
    if block_size < 2:
        raise ValueError(f"block_size must be at least 2 tokens, got {block_size}")
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"] + eos)
        if max_blocks is not None and len(ids) >= max_blocks * block_size:
            break
    n = len(ids) // block_size if max_blocks is None else min(len(ids) // block_size, max_blocks)
    if n == 0:
        raise ValueError(f"the texts give {len(ids)} tokens, fewer than one block of {block_size}")
    return torch.tensor(ids[: n * block_size], dtype=torch.long).view(n, block_size)
