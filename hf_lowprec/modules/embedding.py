"""Building an embedding layer of another class in an ``nn.Embedding``'s place, sharing its ``weight`` Parameter."""

from __future__ import annotations

from torch import nn


def like_embedding(cls: type[nn.Embedding], emb: nn.Embedding, **kwargs) -> nn.Embedding:
    """A ``cls`` layer with ``emb``'s shape and options, built on the meta device (no memory) and given ``emb``'s
    ``weight`` Parameter; ``kwargs`` (e.g. ``spec``) go to ``cls``."""
    new = cls(
        emb.num_embeddings,
        emb.embedding_dim,
        padding_idx=emb.padding_idx,
        max_norm=emb.max_norm,
        norm_type=emb.norm_type,
        scale_grad_by_freq=emb.scale_grad_by_freq,
        sparse=emb.sparse,
        device="meta",
        **kwargs,
    )
    new.weight = emb.weight
    return new
