"""Input embeddings stored as packed integer codes: no dense table in memory.

At a 128k vocabulary the embedding table is 263M of Llama-3.2-1B's 1.24B parameters (525 MB in bf16) and 525M of
Llama-3.1-8B's 8B (1.05 GB). Both kinds here dequantize, per call, only the rows of the tokens they are given, and stay
frozen, as the base of LoRA fine-tuning is:

- :class:`TiedPackedEmbedding`: most small LLMs tie the output projection to the input embedding. When a plan packs a
  tied head (``{"lm_head": "int8"}``: 263 MB; an int4 format: about 150 MB), the embedding reads the rows of the head's
  codes. The head alone owns (and saves) them; a reload rebuilds the tie (:func:`share_packed_head`).
- :class:`PackedEmbedding`: an untied embedding the plan packs (``{"model.embed_tokens": "int8"}``) owns its codes,
  in the layout of a packed linear of shape ``[vocabulary, hidden]`` (``qweight``, ``step``, ``zero``, ``input_scale``).
"""

from __future__ import annotations

import torch
from torch import nn

from hf_lowprec.formats import FormatSpec
from hf_lowprec.modules.packed import NoDenseWeight, PackedLinear, packed_class


class _PackedRows(NoDenseWeight, nn.Module):
    """``input_ids [...] -> embeddings [..., H]``: the rows of the packed ``[V, H]`` layer ``self.table``, times
    ``scale`` when the embedding it replaces scaled them (Gemma's ``embed_scale``, see :func:`embedding_scale`)."""

    table: PackedLinear

    def __init__(self, table: PackedLinear, scale: float | None = None):
        super().__init__()
        self.__dict__["table"] = table  # not a submodule: walks over the model must not see it as a linear layer
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features
        self.scale = scale

    @property
    def spec(self) -> FormatSpec:
        return self.table.spec

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.scaled(self.table.dequantized_rows(input_ids, self.table.dtype))

    def scaled(self, rows: torch.Tensor) -> torch.Tensor:
        """Table rows ``[..., H]`` as this embedding returns them: times ``scale``, rounded to their dtype as Gemma
        rounds it."""
        return rows if self.scale is None else rows * torch.tensor(self.scale).to(rows.dtype)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole dense table ``[V, H]``, unscaled (exports that write a dense embedding)."""
        return self.table.dequantized_weight(dtype)


class TiedPackedEmbedding(_PackedRows):
    """The input embedding of a model whose packed output head ``head`` is tied to it: reads the head's rows."""

    def extra_repr(self) -> str:
        scaled = "" if self.scale is None else f", scale={self.scale:g}"
        return f"{self.num_embeddings}, {self.embedding_dim}, rows of the packed output head ({self.spec.name}){scaled}"


class PackedEmbedding(_PackedRows):
    """An untied input embedding holding its ``[V, H]`` table as packed codes: ``table``, a packed layer of that shape
    (int4 formats; per-row ``int8``), which it owns.

    Its buffers are its table's (one dictionary: the state dict, ``.to()`` and transformers' loading all reach the
    tensors the table reads), so a state dict holds ``qweight``, ``step``, ``zero`` and ``input_scale`` as a packed
    linear's does. Build one with :meth:`from_weight`, or :meth:`empty` (a shell to load codes into).
    """

    def __init__(self, table: PackedLinear, padding_idx: int | None = None, scale: float | None = None):
        check_embedding_format(table.spec)
        super().__init__(table, scale)
        self._buffers = table._buffers
        self.padding_idx = padding_idx  # frozen: kept for code that reads it

    @classmethod
    def empty(cls, num_embeddings: int, embedding_dim: int, spec: FormatSpec | str, dtype: torch.dtype, device=None,
              padding_idx: int | None = None, scale: float | None = None) -> "PackedEmbedding":  # fmt: skip
        """A ``[num_embeddings, embedding_dim]`` table of zero codes in ``spec``, its rows returned in ``dtype``."""
        spec = check_embedding_format(spec)
        return cls(packed_class(spec)(embedding_dim, num_embeddings, spec, False, dtype, device), padding_idx, scale)

    @classmethod
    def from_weight(
        cls,
        weight: torch.Tensor,
        spec: FormatSpec | str,
        padding_idx: int | None = None,
        scale: float | None = None,
        dtype: torch.dtype | None = None,
    ) -> "PackedEmbedding":
        """Round-to-nearest codes of a dense table ``weight [V, H]`` (a slice of rows at a time), its rows returned in
        ``dtype`` (default: the table's)."""
        spec = check_embedding_format(spec)
        return cls(packed_class(spec).from_weight(weight, spec, dtype=dtype), padding_idx, scale)

    def _apply(self, fn, recurse=True):
        self.table._apply(fn, recurse=False)  # the table's buffers are this module's: converted once, by the table
        return self

    def _load_from_state_dict(self, *args, **kwargs):
        self.table._cache.clear()
        return super()._load_from_state_dict(*args, **kwargs)

    def extra_repr(self) -> str:
        scaled = "" if self.scale is None else f", scale={self.scale:g}"
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.spec.name}, packed{scaled}"


def check_embedding_format(spec: FormatSpec | str) -> FormatSpec:
    """``spec`` parsed, or ``ValueError`` unless a packed embedding stores it (int4 formats, per-row ``int8``; no
    ``-a8``, ``-rht`` or ``-sq``: an embedding has no input to quantize, rotate or smooth)."""
    spec = FormatSpec.parse(spec)
    if packed_class(spec) is None or spec.rotate or spec.smooth:  # packed_class stores no -a8 format
        raise ValueError(
            f"a packed embedding stores int4 formats (without -a8, -rht, -sq) and per-row int8, got {spec.name!r}"
        )
    return spec


def embedding_scale(embedding: nn.Module) -> float | None:
    """The factor a scaled word embedding multiplies its rows by (Gemma's ``embed_scale``, ``sqrt(hidden)``; Bart's),
    ``None`` for a plain one. Gemma keeps it as a buffer, which is still on the meta device while transformers loads,
    and as the Python float ``scalar_embed_scale`` read here."""
    if isinstance(embedding, _PackedRows):
        return embedding.scale
    scale = getattr(embedding, "scalar_embed_scale", getattr(embedding, "embed_scale", None))
    if torch.is_tensor(scale):
        if scale.is_meta:
            raise ValueError(f"cannot read the embedding scale of {type(embedding).__name__} on the meta device")
        scale = float(scale)
    return None if scale is None or scale == 1.0 else float(scale)


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
    from hf_lowprec.layers import set_module  # layers imports this module's classes (hf_lowprec.modules)

    head_name, embedding_name = names
    head = model.get_submodule(head_name)
    if not isinstance(head, PackedLinear):
        return False
    set_module(model, embedding_name, TiedPackedEmbedding(head, embedding_scale(model.get_submodule(embedding_name))))
    drop_tie_record(model, head_name)
    return True


def drop_tie_record(model: nn.Module, head_name: str) -> None:
    """Drop transformers' record that the head ``head_name``'s weight is tied to the embedding's: a packed head holds
    codes, no ``weight`` (transformers would tie one to the embedding's table, or to one that no longer exists)."""
    getattr(model, "all_tied_weights_keys", {}).pop(f"{head_name}.weight", None)


def with_dense_tables(state: dict, model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``state`` (``model``'s state dict, PEFT wrappers stripped from the keys) with each packed embedding written as
    its dense ``<embedding>.weight`` in ``dtype`` and without the codes an untied one owned: what an export in a
    dense-embedding layout writes."""
    from hf_lowprec.layers import canonical_name

    out = dict(state)
    for fqn, module in model.named_modules():
        if isinstance(module, _PackedRows):
            name = canonical_name(fqn)
            for buffer in PackedLinear.BUFFERS if isinstance(module, PackedEmbedding) else ():
                out.pop(f"{name}.{buffer}", None)
            out[f"{name}.weight"] = module.dequantized_weight(dtype)
    return out
