"""Activation-aware input scaling for the frozen INT4 base (AWQ; Lin et al., 2024).

A few input channels of a transformer linear carry most of its activation energy, so rounding the
weight columns that multiply them costs the output most. Scaling those columns up by ``s[k]`` before
quantizing (and the inputs down by ``s[k]`` at run time, which
:class:`~hf_lowprec.modules.packed.PackedInt4Linear` does through its ``input_scale``) gives them
finer steps within their group at the expense of quiet channels. ``s = rms(x)^alpha`` (``rms`` from the
input Hessian's diagonal; the paper takes the mean ``|x|``) divided by ``sqrt(max(s) min(s))`` as AutoAWQ does,
with ``alpha`` searched on a grid per layer. The criterion is
the layer's output error on calibration tokens, computed from the input Hessian ``H = X^T X`` (``tr(E H
E^T)``, ``E`` the error of the effective weight) that the GPTQ pass accumulates anyway, so no
activations are kept. Dividing the inputs by ``s`` also flattens their outliers, which lowers the error
of the int8 backend's per-token activation quantization.

``s`` is rounded to powers of two: exact in every float dtype the layer may be cast to, and the
division by ``s`` adds no rounding.

Written here because torchao's AWQ (``torchao.prototype.awq``, 0.18) keeps every calibration input of
every layer, emits torchao's own INT4 tensor layout (not this project's packed codes with their
backward), and cannot be combined with GPTQ rounding; AutoAWQ is CUDA-only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hf_lowprec.formats import FormatSpec, dequantize_int, int_steps, quantize_int

ALPHAS = tuple(i / 20 for i in range(1, 21))  # alpha = 0 ("no scaling") is where the search starts: never worse than it


@dataclass
class InputScale:
    """The chosen ``scale [K]`` (fp32 powers of two), its exponent ``alpha`` and the relative output
    error ``tr(E H E^T) / tr(W H W^T)`` with it (``output_error``) and without it (``output_error_unscaled``)."""

    scale: torch.Tensor
    alpha: float
    output_error: float
    output_error_unscaled: float


def output_error(
    weight: torch.Tensor, hessian: torch.Tensor, inputs: torch.Tensor | None = None
) -> Callable[[torch.Tensor], float]:
    """``error(E) = tr(E H E^T) / tr(W H W^T)``, the relative output error of a weight error ``E [N, K]`` of
    ``weight [N, K]`` under the input Hessian ``hessian [K, K]``; the weight's term computed once (a search compares
    many E). ``inputs [T, K]``: the calibration inputs ``X`` themselves (``H = X^T X``), whose form ``|X E^T|^2`` costs
    ``T N K`` instead of ``N K^2``: less where ``T < K`` (1024 tokens, a 2048x8192 down_proj: an eighth)."""
    if inputs is not None:
        x = inputs.float()
        energy = lambda m: (x @ m.T).square().sum()  # noqa: E731
    else:
        h = hessian.float()
        energy = lambda m: ((m @ h) * m).sum()  # noqa: E731
    norm = energy(weight.float()).clamp(min=1e-30)
    return lambda err: float(energy(err) / norm)


def stored_steps(
    weight: torch.Tensor, spec: FormatSpec, step_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``int_steps`` of ``weight [N, K]`` rounded to ``step_dtype`` (as the packed layer stores them), as fp32 ``[N,
    G]``."""
    step, zero = int_steps(weight, spec)
    return step.to(step_dtype).float(), None if zero is None else zero.to(step_dtype).float()


def round_to_nearest(weight: torch.Tensor, spec: FormatSpec, step_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``weight [N, K]`` quantized to ``spec`` by rounding to nearest on :func:`stored_steps` and dequantized (fp32)."""
    step, zero = stored_steps(weight, spec, step_dtype)
    return dequantize_int(quantize_int(weight, spec, step, zero), spec, step, zero, torch.float32)


def power_of_two_scales(rms: torch.Tensor, alpha: float) -> torch.Tensor:
    """``rms^alpha`` over its geometric mean of max and min, rounded to powers of two (fp32 ``[K]``)."""
    s = rms.pow(alpha)
    s = s / (s.max() * s.min()).sqrt()
    return torch.exp2(torch.round(torch.log2(s)))


@torch.no_grad()
def search_input_scale(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    spec: FormatSpec,
    step_dtype: torch.dtype = torch.float32,
    alphas: tuple[float, ...] = ALPHAS,
    inputs: torch.Tensor | None = None,
) -> InputScale:
    """The input scale from ``alphas`` whose round-to-nearest quantization of ``weight [N, K] * s`` gives the
    lowest output error under ``hessian [K, K]`` (``X^T X`` of the layer's calibration inputs; the errors computed
    from those ``inputs [T, K]`` when given, see :func:`output_error`).

    Inputs that never fired (zero Hessian diagonal) are treated like the quietest live one.
    """
    w, h = weight.detach().float(), hessian.float()
    if h.shape != (w.shape[1], w.shape[1]):
        raise ValueError(
            f"search_input_scale: Hessian {tuple(h.shape)} does not match a weight with {w.shape[1]} inputs"
        )
    rms = torch.diag(h).clamp(min=0).sqrt()
    live = rms > 0
    rms = rms.clamp(min=float(rms[live].min()) if live.any() else 1.0)
    error = output_error(w, h, inputs)
    unscaled = error(round_to_nearest(w, spec, step_dtype) - w)
    best = InputScale(torch.ones_like(rms), 0.0, unscaled, unscaled)
    for alpha in alphas:
        s = power_of_two_scales(rms, alpha)
        err = error(round_to_nearest(w * s, spec, step_dtype) / s - w)
        if err < best.output_error:
            best = InputScale(s, alpha, err, unscaled)
    return best


__all__ = [
    "ALPHAS",
    "InputScale",
    "output_error",
    "power_of_two_scales",
    "round_to_nearest",
    "search_input_scale",
    "stored_steps",
]
