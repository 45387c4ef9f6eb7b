"""Quantization-aware training layers for the weight-only integer formats: INT4 (and INT8, NF4).

``Int4Linear`` / ``Int4Embedding`` fake-quantize their weight on every forward through a
:class:`~hf_lowprec.modules.lsq.LearnedStepQuantizer` (group-wise steps, learned with LSQ by default,
straight-through gradient to the weight). ``Int4Linear`` can also fake-quantize its input to int8
per token (``-a8`` formats). ``Int4Linear.freeze()`` returns a :class:`PackedInt4Linear` (or, for per-channel
``int8``, a :class:`PackedInt8Linear`) holding the weight as real integer codes.

Modules that share one weight ``Parameter`` (tied input/output embeddings) must share one
quantizer, so both read the same quantized table: pass ``quantizer=`` (``convert.apply_plan`` does).

``-rht`` formats quantize ``W R`` and multiply it by ``x R`` (``R`` the randomized block Hadamard rotation of
:mod:`hf_lowprec.rotation`): the quantizer's steps belong to the rotated weight, and ``freeze()`` packs its codes.
``-sq`` formats quantize ``W diag(s)`` and multiply it by ``x / s`` (``s`` the smoothing of
:mod:`hf_lowprec.smoothing`, calibrated by the first forward, which also re-initializes the steps); ``freeze()`` packs
the codes with ``s`` as the packed layer's ``input_scale``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hf_lowprec.formats import FormatSpec, fake_quantize_per_token_int8, quantize_int
from hf_lowprec.modules.embedding import like_embedding
from hf_lowprec.modules.lsq import LearnedActivationQuantizer, LearnedStepQuantizer
from hf_lowprec.modules.packed import PackedLinear, packed_class
from hf_lowprec.modules.packed_embedding import PackedEmbedding, check_embedding_format
from hf_lowprec.rotation import layer_rotation, rotate, unrotate
from hf_lowprec.smoothing import InputSmoothing

INT_FAMILIES = ("int4", "int8", "nf4")


def _check_spec(spec: FormatSpec | str, owner: str) -> FormatSpec:
    spec = FormatSpec.parse(spec)
    if spec.family not in INT_FAMILIES:
        raise ValueError(f"{owner} needs one of the formats {', '.join(INT_FAMILIES)}, got {spec.name!r}")
    return spec


class Int4Linear(nn.Linear):
    """``nn.Linear`` trained with a fake-quantized weight (``int4-gN``, ``int8``, ``nf4-gN`` ...).

    Args:
        spec: the weight format; ``-a8`` variants also quantize the input to int8 (per token, dynamic).
        learn_scales: train the group steps with LSQ (otherwise recompute them from the weight).
        quantizer: an existing quantizer to share (tied weights).
        learn_activation_scales: ``-a8`` only: quantize the input with one LSQ-trained step
            (:class:`~hf_lowprec.modules.lsq.LearnedActivationQuantizer`) instead of dynamic per-token scales.
            :meth:`freeze` keeps the weight codes only; the packed layer quantizes inputs per token.
    """

    def __init__(
        self,
        in_features,
        out_features,
        bias=True,
        *,
        spec: FormatSpec | str = "int4-g64",
        learn_scales: bool = True,
        quantizer: LearnedStepQuantizer | None = None,
        learn_activation_scales: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.spec = _check_spec(spec, "Int4Linear")
        if learn_activation_scales and not self.spec.act_int8:
            raise ValueError(
                "learn_activation_scales needs a format that quantizes activations (e.g. int4-g32-a8), not "
                f"{self.spec.name!r}"
            )
        self.input_quantizer = LearnedActivationQuantizer("int8") if learn_activation_scales else None
        self.rotation_block = layer_rotation(self.spec, in_features, f"Int4Linear({self.spec.name})")
        self.smoothing = InputSmoothing(in_features, self.weight.device) if self.spec.smooth else None
        if quantizer is not None and self.spec.smooth:
            raise ValueError(f"{self.spec.name!r}: a smoothed layer cannot share its quantizer (tied weights); drop '-sq'")
        if self.weight.device.type != "meta":
            weight = self.weight_operand(self.weight)
            self.weight_quantizer = quantizer or LearnedStepQuantizer(weight, self.spec, learn_scales)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        spec: FormatSpec | str = "int4-g64",
        learn_scales: bool = True,
        quantizer: LearnedStepQuantizer | None = None,
        learn_activation_scales: bool = False,
    ) -> "Int4Linear":
        """Wrap an existing ``nn.Linear``, keeping its ``weight``/``bias`` Parameter objects."""
        new = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            spec=spec,
            quantizer=quantizer,
            learn_activation_scales=learn_activation_scales,
            device="meta",
        )
        for part in (new.input_quantizer, new.smoothing):
            if part is not None:
                part.to(linear.weight.device)
        new.weight, new.bias = linear.weight, linear.bias
        new.weight_quantizer = quantizer or LearnedStepQuantizer(new.weight_operand(linear.weight), new.spec, learn_scales)
        return new

    def weight_operand(self, w: torch.Tensor) -> torch.Tensor:
        """``w [N, K]`` as the GEMM sees it: ``W diag(s)`` for ``-sq``, ``W R`` for ``-rht``, else ``w`` itself."""
        if self.smoothing is not None:
            return self.smoothing.weights(w)
        return w if self.rotation_block is None else rotate(w, self.rotation_block)

    def input_operand(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` as the GEMM sees it: ``x / s`` for ``-sq``, ``x R`` for ``-rht``, else ``x`` itself."""
        if self.smoothing is not None:
            return self.smoothing.inputs(x)
        return x if self.rotation_block is None else rotate(x, self.rotation_block)

    def quantized_weight(self) -> torch.Tensor:
        """The weight as the format represents it (differentiable; :meth:`weight_operand` quantized)."""
        return self.weight_quantizer(self.weight_operand(self.weight))

    def dequantized_weight(self) -> torch.Tensor:
        """The weight the layer computes with, in its input's basis (:meth:`quantized_weight` rotated back for ``-rht``,
        divided by ``s`` for ``-sq``), ``[N, K]``, differentiable."""
        w = self.quantized_weight()
        if self.smoothing is not None:
            return w / self.smoothing.scale.to(w.dtype)
        return w if self.rotation_block is None else unrotate(w, self.rotation_block)

    def calibrate_smoothing(self, x: torch.Tensor) -> None:
        """``-sq``: calibrate ``s`` on input ``x [..., K]`` unless done (see :class:`InputSmoothing`), re-initializing
        the steps for the smoothed weight; what the first forward does."""
        if self.smoothing is not None and self.smoothing.calibrate(x, self.weight):
            self.weight_quantizer.reinitialize(self.weight_operand(self.weight.detach()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calibrate_smoothing(x)
        x = self.input_operand(x)
        if self.input_quantizer is not None:
            x = self.input_quantizer(x)
        elif self.spec.act_int8:
            x = fake_quantize_per_token_int8(x)
        from hf_lowprec.training.activations import ActivationStorage  # here: it imports hf_lowprec.modules

        w = self.quantized_weight().to(x.dtype)
        ActivationStorage.keep_weight(w)  # F.linear saves it for the input gradient: not an activation
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))

    @torch.no_grad()
    def freeze(self) -> PackedLinear:
        """A frozen packed layer holding this layer's codes (int4 formats and per-channel ``int8``; see
        ``packed_class``); its ``exact_kernels`` is set where the steps were trained (QAT): they fit an exact forward,
        which int8's per-token activation rounding would not compute."""
        cls = packed_class(self.spec)
        if cls is None:
            a8 = ", whose int8 inputs (-a8) no packed kernel computes" if self.spec.act_int8 else ""
            raise ValueError(
                f"freeze() packs weight-only int4 formats and per-channel symmetric int8; this layer is "
                f"{self.spec.name}{a8}"
            )
        weight = self.weight_operand(self.weight.detach())
        step, zero = self.weight_quantizer.steps(weight)
        codes = quantize_int(weight, self.spec, step, zero)
        scale = None if self.smoothing is None else self.smoothing.scale
        packed = cls.from_codes(codes, step, zero, self.spec, self.bias, self.weight.dtype, input_scale=scale)
        packed.exact_kernels = self.weight_quantizer.learned(weight)
        return packed

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, format={self.spec.name}"


class Int4Embedding(nn.Embedding):
    """``nn.Embedding`` whose table is fake-quantized per row in groups along the embedding dim."""

    def __init__(
        self,
        num_embeddings,
        embedding_dim,
        *,
        spec: FormatSpec | str = "int4-g64",
        learn_scales: bool = True,
        quantizer: LearnedStepQuantizer | None = None,
        device=None,
        dtype=None,
        **kwargs,
    ):
        super().__init__(num_embeddings, embedding_dim, device=device, dtype=dtype, **kwargs)
        self.spec = _check_spec(spec, "Int4Embedding")
        if self.spec.act_int8:
            raise ValueError(f"an embedding has no activation input to quantize; drop '-a8' from {self.spec.name!r}")
        if self.spec.rotate or self.spec.smooth:
            raise ValueError(f"an embedding has no input to rotate or smooth; drop '-rht'/'-sq' from {self.spec.name!r}")
        if self.weight.device.type != "meta":  # built to wrap a table (from_embedding): its quantizer made there
            self.weight_quantizer = quantizer or LearnedStepQuantizer(self.weight, self.spec, learn_scales)

    @classmethod
    def from_embedding(
        cls,
        emb: nn.Embedding,
        spec: FormatSpec | str = "int4-g64",
        learn_scales: bool = True,
        quantizer: LearnedStepQuantizer | None = None,
    ) -> "Int4Embedding":
        """Wrap an existing ``nn.Embedding``, keeping its ``weight`` Parameter."""
        new = like_embedding(cls, emb, spec=spec)
        new.weight_quantizer = quantizer or LearnedStepQuantizer(emb.weight, new.spec, learn_scales)
        return new

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.max_norm is not None or self.sparse:
            raise ValueError("Int4Embedding does not support max_norm or sparse gradients")
        # every row is quantized on its own, so only the rows looked up need quantizing
        unique, inverse = torch.unique(ids, return_inverse=True)
        rows = self.weight_quantizer(self.weight, unique)
        if self.padding_idx is not None:  # nn.Embedding never updates the padding row
            rows = torch.where((unique == self.padding_idx).unsqueeze(-1), rows.detach(), rows)
        return F.embedding(inverse, rows, None, scale_grad_by_freq=self.scale_grad_by_freq)

    @torch.no_grad()
    def freeze(self) -> PackedEmbedding:
        """A frozen :class:`PackedEmbedding` holding this table's codes (int4 formats and per-row ``int8``)."""
        spec = check_embedding_format(self.spec)
        weight = self.weight.detach()
        step, zero = self.weight_quantizer.steps(weight)
        codes = quantize_int(weight, spec, step, zero)
        table = packed_class(spec).from_codes(codes, step, zero, spec, None, weight.dtype)
        return PackedEmbedding(table, self.padding_idx)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, format={self.spec.name}"
