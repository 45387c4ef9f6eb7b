"""GPTQ rounding for the frozen INT4 base: codes chosen to preserve each layer's output, not its weight.

Round-to-nearest picks each code independently. GPTQ (Frantar et al., 2023, Algorithm 1) quantizes
a weight ``W [N, K]`` one input column at a time and spreads each column's rounding error over the
columns not yet quantized, weighted by the inverse of the layer's input Hessian ``H = X^T X
[K, K]`` from calibration tokens, so that ``||X W^T - X Q^T||`` rather than ``||W - Q||`` is small.

The grid is the layer's own format (:func:`~hf_lowprec.formats.int_steps` of the original weight,
"static groups"), so the result packs into :class:`~hf_lowprec.modules.packed.PackedInt4Linear`
unchanged and loads like any other export. :mod:`hf_lowprec.ondevice.calibration` runs it over a model, a decoder
block at a time (sequential GPTQ).

Written here because torchao's GPTQ (``torchao.prototype.gptq``, 0.18) runs on CUDA only and
produces its own int4 tensor layout; no kept library quantizes to this format on a CPU.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from hf_lowprec.formats import FormatSpec, dequantize_int, quantize_int
from hf_lowprec.ondevice.calibration.awq import output_error


@dataclass
class GPTQResult:
    """Codes ``[N, K]`` (int8 symmetric / uint8 asymmetric), their grid ``step``/``zero`` ``[N, G]`` fp32,
    and the calibration output error ``tr(E H E^T) / tr(W H W^T)`` of GPTQ and of round-to-nearest."""

    codes: torch.Tensor
    step: torch.Tensor
    zero: torch.Tensor | None
    output_error: float
    output_error_nearest: float


def _round(w: torch.Tensor, step: torch.Tensor, zero: torch.Tensor | None, qmin: int, qmax: int):
    """``(codes, dequantized)`` of columns ``w`` on the grid ``step``/``zero`` (same shape)."""
    q = torch.round(w / step + (0 if zero is None else zero)).clamp(qmin, qmax)
    return q, (q - (0 if zero is None else zero)) * step


@contextmanager
def full_precision():
    """No autocast inside (CPU or CUDA): GPTQ's error propagation needs fp32 matmuls, also when called in a bf16 run."""
    with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
        yield


def damped_cholesky(hessian: torch.Tensor, percdamp: float = 0.01) -> torch.Tensor:
    """Lower Cholesky factor ``C`` of ``hessian [K, K]`` damped as GPTQ damps it (inputs that never fired get a unit
    diagonal, then every diagonal entry ``percdamp`` of the mean), fp32."""
    h = hessian.float().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    h.diagonal().add_(percdamp * torch.diag(h).mean())
    return torch.linalg.cholesky(h)


@torch.no_grad()
@full_precision()
def gptq_columns(weight: torch.Tensor, hessian: torch.Tensor, round_column, *, block: int = 128, percdamp=0.01):
    """GPTQ's loop (Frantar et al., 2023, Algorithm 1) on any grid: ``weight [N, K]`` rounded one input column at a
    time by ``round_column(i, values [N]) -> rounded values [N]``, each column's rounding error spread over the columns
    not yet rounded through the inverse of ``hessian [K, K]`` (``X^T X``). Returns the rounded weight ``[N, K]`` (a
    transposed view).

    ``percdamp``: fraction of the mean Hessian diagonal added to it (numerical stability, as in the paper). Inputs that
    never fire (zero diagonal) get no error from the others.
    """
    rows, cols = weight.shape
    if hessian.shape != (cols, cols):
        raise ValueError(f"GPTQ: Hessian {tuple(hessian.shape)} does not match a weight with {cols} inputs")
    # each step replaces h, so at most two [K, K] matrices exist besides the Hessian (268 MB each at K = 8192)
    h = damped_cholesky(hessian, percdamp)
    h = torch.cholesky_inverse(h)
    hinv = torch.linalg.cholesky(h, upper=True)
    del h
    # the weight transposed, so that each input column is one contiguous row: the loop reads and updates a column per
    # step, which in [N, K] order touches a cache line per element (2-core EPYC, the 1B shape's 8192x2048 gate_proj:
    # this function 2.5 s -> 0.5 s; its 2048x8192 down_proj 9.2 s -> 6.8 s, most of it now the three factorizations)
    work = weight.detach().float().T.contiguous()
    rounded = torch.empty_like(work)
    for i1 in range(0, cols, block):
        i2 = min(i1 + block, cols)
        chunk, hinv_chunk, errors = work[i1:i2], hinv[i1:i2, i1:i2], work.new_empty(i2 - i1, rows)
        for i in range(i2 - i1):
            rounded[i1 + i] = round_column(i1 + i, chunk[i])
            torch.div(chunk[i] - rounded[i1 + i], hinv_chunk[i, i], out=errors[i])
            chunk[i + 1 :].addr_(hinv_chunk[i, i + 1 :], errors[i], alpha=-1)
        work[i2:].addmm_(hinv[i1:i2, i2:].T, errors, alpha=-1)
    return rounded.T


@torch.no_grad()
@full_precision()
def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    spec: FormatSpec,
    step: torch.Tensor,
    zero: torch.Tensor | None = None,
    *,
    block: int = 128,
    percdamp: float = 0.01,
    inputs: torch.Tensor | None = None,
) -> GPTQResult:
    """GPTQ codes of ``weight [N, K]`` on the integer grid ``step``/``zero`` ``[N, G]`` given ``hessian [K, K]``
    (see :func:`gptq_columns`); the output errors computed from the calibration ``inputs [T, K]`` when given
    (:func:`~hf_lowprec.ondevice.calibration.awq.output_error`)."""
    w = weight.detach().float()
    rows, cols = w.shape
    qmin, qmax = spec.qrange
    group = spec.group_size or cols
    step_t = step.float().T.contiguous()  # [G, N]: a column's steps are one contiguous row
    zero_t = None if zero is None else zero.float().T.contiguous()
    codes_t = torch.empty(cols, rows, dtype=torch.int8 if spec.symmetric else torch.uint8, device=w.device)

    def round_column(i: int, values: torch.Tensor) -> torch.Tensor:
        q, deq = _round(values, step_t[i // group], None if zero_t is None else zero_t[i // group], qmin, qmax)
        codes_t[i] = q
        return deq

    deq = gptq_columns(w, hessian, round_column, block=block, percdamp=percdamp)
    codes = codes_t.T.contiguous()
    nearest = dequantize_int(quantize_int(w, spec, step, zero), spec, step, zero)
    error = output_error(w, hessian, inputs)
    return GPTQResult(codes, step.float(), None if zero is None else zero.float(), error(deq - w), error(nearest - w))


__all__ = ["GPTQResult", "damped_cholesky", "full_precision", "gptq_columns", "gptq_quantize"]
