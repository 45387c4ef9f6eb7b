"""Trainable low-precision layers, one file per family, and the dispatcher that picks one.

``LOW_PRECISION_TYPES`` lists every class :func:`hf_lowprec.convert.apply_plan` may put in a model.
"""

from __future__ import annotations

from torch import nn

from hf_lowprec.formats import FormatSpec
from hf_lowprec.modules.fp8 import FP8Embedding, FP8Linear
from hf_lowprec.modules.int4 import Int4Embedding, Int4Linear
from hf_lowprec.modules.packed import PackedInt4Linear, PackedInt8Linear, PackedLinear
from hf_lowprec.modules.packed_embedding import PackedEmbedding, embedding_scale

LOW_PRECISION_TYPES = (FP8Linear, FP8Embedding, Int4Linear, Int4Embedding, PackedLinear, PackedEmbedding)
FROZEN_TYPES = (PackedLinear, PackedEmbedding)  # hold integer codes only: no weight to train or revert to


def low_precision_layer(module: nn.Module, spec: FormatSpec, options: dict, quantizer=None) -> nn.Module:
    """The low-precision replacement of an ``nn.Linear``/``nn.Embedding`` for ``spec``, sharing its parameters.

    ``options``: ``fp8_backend``, ``grad_dtype``, ``policies`` (FP8), ``learn_scales`` and
    ``learn_activation_scales`` (integer formats; the latter for ``-a8`` Linear formats only).
    ``quantizer``: an integer-format weight quantizer to share (tied weights). Raises ``ValueError`` for an embedding
    that scales its rows (Gemma's ``embed_scale``): the fake-quantized embeddings would drop the factor.
    """
    if isinstance(module, nn.Embedding) and (scale := embedding_scale(module)) is not None:
        raise ValueError(
            f"{type(module).__name__} multiplies its rows by {scale:g} (embed_scale), which hf_lowprec's FP8/INT4 "
            "embeddings do not; leave it out of the plan (it keeps the model's dtype; a tied output head may still "
            "be quantized: the embedding then reads its packed rows, scaled)"
        )
    if spec.family == "fp8":
        if isinstance(module, nn.Embedding):
            return FP8Embedding.from_embedding(module, spec)
        fp8_opts = {k: options[k] for k in ("grad_dtype", "policies") if options.get(k) is not None}
        return FP8Linear.from_linear(module, spec, backend=options.get("fp8_backend", "auto"), **fp8_opts)
    learn = options.get("learn_scales", True)
    if isinstance(module, nn.Embedding):
        return Int4Embedding.from_embedding(module, spec, learn, quantizer)
    learn_act = options.get("learn_activation_scales", False) and spec.act_int8
    return Int4Linear.from_linear(module, spec, learn, quantizer, learn_activation_scales=learn_act)


class TiedQuantizers:
    """Builds low-precision layers so that layers on one weight (tied input/output embeddings) share the first one's
    weight quantizer, and refuses to give them different integer formats."""

    def __init__(self):
        self._by_weight: dict[int, tuple[str, nn.Module]] = {}

    def build(self, name: str, module: nn.Module, spec: FormatSpec, options: dict) -> nn.Module:
        """:func:`low_precision_layer` of ``module`` (called ``name``) for ``spec``, sharing a tied twin's quantizer."""
        shared = self._by_weight.get(id(module.weight))
        if shared is not None and spec.family != "fp8" and shared[0] != spec.name:
            raise ValueError(
                f"layers sharing one weight (tied embeddings) need one integer format: {name!r} is planned "
                f"{spec.name} but its tied twin is {shared[0]}"
            )
        new = low_precision_layer(module, spec, options, None if shared is None else shared[1])
        if shared is None and hasattr(new, "weight_quantizer"):
            self._by_weight[id(module.weight)] = (spec.name, new.weight_quantizer)
        return new


__all__ = [
    "FP8Linear",
    "FP8Embedding",
    "Int4Linear",
    "Int4Embedding",
    "PackedEmbedding",
    "PackedInt4Linear",
    "PackedInt8Linear",
    "PackedLinear",
    "low_precision_layer",
]
