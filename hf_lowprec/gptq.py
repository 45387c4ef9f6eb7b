"""GPTQ rounding for the frozen INT4 base: codes chosen to preserve each layer's output, not its weight.

Round-to-nearest picks each code independently. GPTQ (Frantar et al., 2023, Algorithm 1) quantizes
a weight ``W [N, K]`` one input column at a time and spreads each column's rounding error over the
columns not yet quantized, weighted by the inverse of the layer's input Hessian ``H = X^T X
[K, K]`` from calibration tokens, so that ``||X W^T - X Q^T||`` rather than ``||W - Q||`` is small.

The grid is the layer's own format (:func:`~hf_lowprec.formats.int_steps` of the original weight,
"static groups"), so the result packs into :class:`~hf_lowprec.modules.int4_packed.PackedInt4Linear`
unchanged and loads like any other export. Layers are processed a few decoder blocks at a time and
packed as they go: later layers see the inputs of the already-quantized ones (sequential GPTQ), and
only a bounded number of Hessians exist at once.

Written here because torchao's GPTQ (``torchao.prototype.gptq``, 0.18) runs on CUDA only and
produces its own int4 tensor layout; no kept library quantizes to this format on a CPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from hf_lowprec.formats import FormatSpec

logger = logging.getLogger(__name__)

HESSIAN_BUDGET_BYTES = 128 * 2**20  # fp32 Hessians alive at once (a 1536-input layer needs 9.4 MB)


@dataclass
class GPTQResult:
    """Codes ``[N, K]`` (int8 symmetric / uint8 asymmetric), their grid ``step``/``zero`` ``[N, G]`` fp32,
    and the calibration output error ``tr(E H E^T) / tr(W H W^T)`` of GPTQ and of round-to-nearest."""

    codes: torch.Tensor
    step: torch.Tensor
    zero: torch.Tensor | None
    output_error: float
    output_error_nearest: float


def _per_column(t: torch.Tensor | None, group: int | None, cols: int) -> torch.Tensor | None:
    """``[N, G]`` per-group values → ``[N, K]`` per-column."""
    if t is None:
        return None
    return t.repeat_interleave(group or cols, dim=1)[:, :cols]


def _round(w: torch.Tensor, step: torch.Tensor, zero: torch.Tensor | None, qmin: int, qmax: int):
    """``(codes, dequantized)`` of columns ``w`` on the grid ``step``/``zero`` (same shape)."""
    q = torch.round(w / step + (0 if zero is None else zero)).clamp(qmin, qmax)
    return q, (q - (0 if zero is None else zero)) * step


def _relative_output_error(err: torch.Tensor, w: torch.Tensor, hessian: torch.Tensor) -> float:
    return float(((err @ hessian) * err).sum() / ((w @ hessian) * w).sum().clamp(min=1e-30))


@torch.no_grad()
def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    spec: FormatSpec,
    step: torch.Tensor,
    zero: torch.Tensor | None = None,
    *,
    block: int = 128,
    percdamp: float = 0.01,
) -> GPTQResult:
    """GPTQ codes of ``weight [N, K]`` on the grid ``step``/``zero`` ``[N, G]`` given ``hessian [K, K]`` (``X^T X``).

    ``percdamp``: fraction of the mean Hessian diagonal added to it (numerical stability, as in the
    paper). Inputs that never fire (zero diagonal) keep round-to-nearest codes.
    """
    w = weight.detach().float()
    rows, cols = w.shape
    if hessian.shape != (cols, cols):
        raise ValueError(f"gptq_quantize: Hessian {tuple(hessian.shape)} does not match a weight with {cols} inputs")
    qmin, qmax = spec.qrange
    col_step = _per_column(step.float(), spec.group_size, cols)
    col_zero = _per_column(None if zero is None else zero.float(), spec.group_size, cols)
    h = hessian.float().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    h.diagonal().add_(percdamp * torch.diag(h).mean())
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    work, codes = w.clone(), torch.empty_like(w)
    for i1 in range(0, cols, block):
        i2 = min(i1 + block, cols)
        chunk, errors, hinv_chunk = work[:, i1:i2].clone(), torch.empty(rows, i2 - i1), hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            z = None if col_zero is None else col_zero[:, i1 + i]
            q, deq = _round(chunk[:, i], col_step[:, i1 + i], z, qmin, qmax)
            codes[:, i1 + i] = q
            err = (chunk[:, i] - deq) / hinv_chunk[i, i]
            chunk[:, i:] -= err[:, None] * hinv_chunk[i, i:][None, :]
            errors[:, i] = err
        work[:, i2:] -= errors @ hinv[i1:i2, i2:]
    deq = (codes - (0 if col_zero is None else col_zero)) * col_step
    _, nearest = _round(w, col_step, col_zero, qmin, qmax)
    hessian = hessian.float()
    return GPTQResult(
        codes.to(torch.int8 if spec.symmetric else torch.uint8), step.float(), None if zero is None else zero.float(),
        _relative_output_error(deq - w, w, hessian), _relative_output_error(nearest - w, w, hessian),
    )  # fmt: skip


class _GroupDone(Exception):
    """Raised inside the forward once every layer of the group has seen its input: the rest is not needed."""


class _HessianHooks:
    """Forward pre-hooks accumulating ``X^T X`` (fp32 ``[K, K]``) of each listed Linear's input;
    :meth:`run` stops the forward as soon as all of them have run."""

    def __init__(self, modules: dict[str, nn.Module]):
        self.hessians = {name: torch.zeros(m.in_features, m.in_features) for name, m in modules.items()}
        self._seen: set[str] = set()
        self._handles = [m.register_forward_pre_hook(self._hook(name)) for name, m in modules.items()]

    def _hook(self, name: str):
        def hook(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            self.hessians[name].addmm_(x.T, x)
            self._seen.add(name)
            if len(self._seen) == len(self.hessians):
                raise _GroupDone

        return hook

    def run(self, model: nn.Module, input_ids: torch.Tensor) -> None:
        self._seen.clear()
        try:
            model(input_ids=input_ids, use_cache=False)
        except _GroupDone:
            pass

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def hessian_groups(sizes: dict[str, int], budget_bytes: int = HESSIAN_BUDGET_BYTES) -> list[list[str]]:
    """Consecutive layer names (model order) split so each group's ``K^2`` fp32 Hessians fit ``budget_bytes``."""
    groups: list[list[str]] = [[]]
    used = 0
    for name, k in sizes.items():
        need = 4 * k * k
        if groups[-1] and used + need > budget_bytes:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += need
    return groups


@torch.no_grad()
def gptq_codes(
    model: nn.Module,
    layers: dict[str, nn.Module],
    blocks: torch.Tensor,
    replace,
    *,
    batch_size: int = 4,
    budget_bytes: int = HESSIAN_BUDGET_BYTES,
    progress=None,
) -> dict[str, GPTQResult]:
    """GPTQ for ``layers`` (fqn → ``Int4Linear`` in model order) calibrated on token ``blocks [n, T]``.

    Layers are handled in groups that fit ``budget_bytes`` of Hessians: one calibration pass per
    group, then each layer's codes are computed and ``replace(fqn, result)`` swaps it (so later groups
    see quantized inputs). ``progress(done, total)`` after each layer. Returns the results by name.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out: dict[str, GPTQResult] = {}
    try:
        for group in hessian_groups({n: m.in_features for n, m in layers.items()}, budget_bytes):
            hooks = _HessianHooks({n: layers[n] for n in group})
            try:
                for i in range(0, len(blocks), batch_size):
                    hooks.run(model, blocks[i : i + batch_size].to(device))
            finally:
                hooks.remove()
            for name in group:
                module = layers[name]
                step, zero = module.weight_quantizer.steps(module.weight)
                dtype = module.weight.dtype  # the packed layer keeps its steps in this dtype: round on that grid
                step = step.to(dtype).float()
                zero = None if zero is None else zero.to(dtype).float()
                out[name] = gptq_quantize(module.weight, hooks.hessians.pop(name), module.spec, step, zero)
                replace(name, out[name])
                if progress is not None:
                    progress(len(out), len(layers))
    finally:
        model.train(was_training)
    return out


def summary(results: dict[str, GPTQResult]) -> dict:
    """Median relative calibration output error of GPTQ and of round-to-nearest over the layers."""
    med = lambda xs: sorted(xs)[len(xs) // 2] if xs else 0.0  # noqa: E731
    return {"layers": len(results), "output_error_median": med([r.output_error for r in results.values()]),
            "output_error_nearest_median": med([r.output_error_nearest for r in results.values()])}  # fmt: skip


__all__ = ["GPTQResult", "gptq_codes", "gptq_quantize", "hessian_groups", "summary"]
