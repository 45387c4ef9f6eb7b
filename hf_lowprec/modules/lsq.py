"""Learned step quantizers (LSQ, Esser et al. 2020): the integer formats' steps as trained parameters, for weights
(group-wise) and activations (per tensor)."""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from hf_lowprec.formats import (
    FormatSpec,
    dequantize_nf4,
    fake_quantize_int,
    int_steps,
    quantize_nf4,
    round_ste,
)
from hf_lowprec.fp32_state import Fp32State
from hf_lowprec.once_flags import OnceFlags

logger = logging.getLogger(__name__)


class _ScaledGradient(torch.autograd.Function):
    """``x`` itself forward, its gradient times ``scale`` backward (LSQ's step-gradient scale). Written as a Function
    because the composed ``(x - x * scale).detach() + x * scale`` leaves fp32 rounding in the value: the weights a
    layer trained with then differ (by ~1e-7) from the ones its packed export computes with the step itself."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class LearnedStepQuantizer(Fp32State):
    """Fake-quantizes a weight ``[R, C]`` with per-group steps ``[R, G]`` that can be trained (LSQ).

    The step is initialised from the weight (``amax / qmax``, or min/max with a zero point when
    asymmetric). When ``learnable``, it is an ``nn.Parameter`` whose gradient is scaled by
    ``1 / sqrt(N * Qp)`` with ``N`` the group size (the number of weights sharing one step) and ``Qp``
    the largest code (Esser et al., 2020, "Learned Step Size Quantization"); otherwise steps are
    recomputed from the weight on every call (max calibration). NF4 has no integer grid and always uses
    the per-group absmax. Steps made after an optimizer was built must be added to it:
    :func:`hf_lowprec.training.new_parameters.add_new_parameters`.
    """

    def __init__(self, weight: torch.Tensor, spec: FormatSpec, learnable: bool = True):
        super().__init__()
        if spec.family not in ("int4", "int8", "nf4"):
            raise ValueError(f"LearnedStepQuantizer handles int4, int8 and nf4 formats, not {spec.name}")
        self.spec = spec
        self.learnable = learnable and spec.family != "nf4"
        cols = weight.shape[1]
        self.grad_scale = 1.0 / math.sqrt(min(spec.group_size or cols, cols) * max(spec.qrange[1], 1))
        if self.learnable:
            step, zero = int_steps(weight, spec)
            self.step = nn.Parameter(step.to(weight.device))
            self.register_buffer("zero", None if zero is None else zero.to(weight.device))

    @torch.no_grad()
    def reinitialize(self, weight: torch.Tensor) -> None:
        """Learned steps (and zero points) re-initialized in place from ``weight [R, C]``, as at construction (the
        weight the steps belong to changed basis, e.g. smoothing calibrated); the ``step`` Parameter stays the same
        object, so an optimizer holding it keeps working."""
        if self.learnable:
            step, zero = int_steps(weight, self.spec)
            self.step.copy_(step)
            if zero is not None:
                self.zero.copy_(zero)

    def forward(self, weight: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Quantize-dequantize ``weight`` (or only ``weight[rows]``, ``rows`` a 1-D index: ``[len(rows), C]``).

        Straight-through gradient to the weight, LSQ gradient to the step.
        """
        w = weight if rows is None else weight[rows]
        if self.spec.family == "nf4":
            idx, absmax = quantize_nf4(w, self.spec.group_size)
            q = dequantize_nf4(idx, absmax, self.spec.group_size, w.dtype)
            return w + (q - w).detach()
        if not self.learnable:
            step, zero = int_steps(w, self.spec)
            return fake_quantize_int(w, self.spec, step, zero)
        step, zero = self.step, self.zero
        if rows is not None:
            step, zero = step[rows], None if zero is None else zero[rows]
        step = _ScaledGradient.apply(step, self.grad_scale)  # same value, gradient scaled by grad_scale (LSQ)
        return fake_quantize_int(w, self.spec, step.abs().clamp(min=1e-8), zero)

    def steps(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The steps ``[R, G]`` (fp32, detached) and zero points in use for ``weight``."""
        if self.learnable:
            return self.step.detach().abs().clamp(min=1e-8).float(), self.zero
        return int_steps(weight, self.spec)

    def learned(self, weight: torch.Tensor) -> bool:
        """Whether the steps moved from those ``weight [R, C]`` starts them at (trained: QAT), not merely learnable."""
        if not self.learnable:
            return False
        start = int_steps(weight, self.spec)[0].abs().clamp(min=1e-8).float()  # as steps() gives them
        return not torch.equal(self.steps(weight)[0], start)

    def extra_repr(self) -> str:
        return f"{self.spec.name}, learnable={self.learnable}"


class LearnedActivationQuantizer(Fp32State, OnceFlags):
    """LSQ for activations: fake-quantize ``x`` (any shape) to a signed integer grid with one learned step.

    ``spec`` gives the grid (``int8``: codes -128..127, ``int4``: -8..7). The step is initialised on the
    first call to ``2 * mean|x| / sqrt(Qp)`` (Esser et al., 2020) and trained through the
    straight-through estimator, its gradient scaled by ``1 / sqrt(N * Qp)`` with ``N`` the number of
    elements quantized per call.
    """

    def __init__(self, spec: FormatSpec | str = "int8"):
        super().__init__()
        self.spec = FormatSpec.parse(spec)
        if self.spec.family not in ("int4", "int8") or not self.spec.symmetric:
            raise ValueError(f"LearnedActivationQuantizer needs a symmetric int4/int8 format, not {self.spec.name}")
        self.step = nn.Parameter(torch.ones(()))
        self.register_buffer("initialized", torch.zeros((), dtype=torch.bool))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qmin, qmax = self.spec.qrange
        if x.numel() == 0:  # no elements: nothing to quantize, and no mean to start the step from (it started NaN)
            return x
        if not self.flag_set("initialized"):
            with torch.no_grad():
                self.step.copy_((2 * x.detach().abs().float().mean() / math.sqrt(qmax)).clamp(min=1e-8))
                self.set_flag("initialized")
        grad_scale = 1.0 / math.sqrt(x.numel() * qmax)
        step = _ScaledGradient.apply(self.step, grad_scale).abs().clamp(min=1e-8)
        return (round_ste((x.float() / step).clamp(qmin, qmax)) * step).to(x.dtype)

    def extra_repr(self) -> str:
        return self.spec.name
