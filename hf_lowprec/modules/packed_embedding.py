"""An input embedding that reads its rows from the packed output head it is tied to: one packed table, no dense copy.

Most small LLMs tie the output projection to the input embedding, and at a 128k vocabulary that one table is 263M of
Llama-3.2-1B's 1.24B parameters: 525 MB in bf16. When a plan packs a tied head (``{"lm_head": "int8"}``: 263 MB;
an int4 format: about 150 MB), :class:`TiedPackedEmbedding` takes the embedding's place and dequantizes the rows of
the tokens it is given from the head's codes; the dense table is freed. Both stay frozen, as the base of LoRA
fine-tuning is. The head alone owns (and saves) the codes; a reload rebuilds the tie (``share_packed_head``).
"""

from __future__ import annotations

import torch
from torch import nn

from hf_lowprec.layers import canonical_name, set_module
from hf_lowprec.modules.packed import PackedLinear


class TiedPackedEmbedding(nn.Module):
    """``input_ids [...] -> embeddings [..., H]``: the rows of a packed ``[V, H]`` output head, in its steps' dtype."""

    def __init__(self, head: PackedLinear):
        super().__init__()
        self.__dict__["head"] = head  # not a submodule: the head owns, moves and saves the codes
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head.dequantized_rows(input_ids, self.head.step.dtype)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole dense table ``[V, H]`` (exports that write a dense embedding)."""
        return self.head.dequantized_weight(dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows of the packed output head ({self.head.spec.name})"


def tied_head_names(model: nn.Module) -> tuple[str, str] | None:
    """``(output head, input embedding)`` full module names when ``model`` ties them (by config, or one Parameter
    shared), else ``None``."""
    get_head = getattr(model, "get_output_embeddings", None)
    get_embedding = getattr(model, "get_input_embeddings", None)
    head = get_head() if get_head is not None else None
    embedding = get_embedding() if get_embedding is not None else None
    if head is None or embedding is None:
        return None
    config = getattr(model, "config", None)
    tied_by_config = config is not None and getattr(config.get_text_config(), "tie_word_embeddings", False)
    tied = getattr(head, "weight", None) is not None and head.weight is getattr(embedding, "weight", None)
    if not (tied or tied_by_config):
        return None
    names = {id(m): n for n, m in model.named_modules()}
    return names[id(head)], names[id(embedding)]


def share_packed_head(model: nn.Module, names: tuple[str, str]) -> bool:
    """Put a :class:`TiedPackedEmbedding` of the packed head ``names[0]`` in the place of the input embedding
    ``names[1]`` (from :func:`tied_head_names`, read before the head was packed) and drop transformers' record of the
    tie; returns whether the head is packed (and the embedding now reads it)."""
    head_name, embedding_name = names
    head = model.get_submodule(head_name)
    if not isinstance(head, PackedLinear):
        return False
    set_module(model, embedding_name, TiedPackedEmbedding(head))
    tied = getattr(model, "all_tied_weights_keys", None)
    if tied is not None:  # transformers would tie lm_head.weight to an embedding weight that no longer exists
        tied.pop(f"{head_name}.weight", None)
    return True


def dense_tables(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``{"<embedding>.weight": dense table}`` of each :class:`TiedPackedEmbedding` of ``model`` (PEFT wrappers
    stripped from the names): what an export in a dense-embedding layout writes in its place."""
    return {
        f"{canonical_name(n)}.weight": m.dequantized_weight(dtype)
        for n, m in model.named_modules()
        if isinstance(m, TiedPackedEmbedding)
    }
