"""LoftQ initialisation: LoRA adapters that start as the truncated SVD of each INT4 layer's quantization residual.

Written here, not PEFT's: its ``LoftQConfig`` quantizes with PEFT's own NF4/uniform quantizer, and
``replace_lora_weights_loftq`` takes bitsandbytes' 4-bit layers, while the residual has to be the one of the codes
this package packs (its groups, zero points and calibrated roundings), read one dense weight at a time from the
checkpoint."""

from __future__ import annotations

import contextlib
import logging
import math

import torch
import torch.nn.functional as F
from peft import LoraConfig
from torch import nn

from hf_lowprec.allocator import freed_memory_returned
from hf_lowprec.convert import canonical_name
from hf_lowprec.modules.int4 import Int4Linear
from hf_lowprec.modules.packed import PackedInt4Linear, compact_steps
from hf_lowprec.ondevice.calibration.gptq import damped_cholesky

logger = logging.getLogger(__name__)


# the exact SVD up to this smaller dimension; above it the randomized one (Halko et al. 2011, torch.svd_lowrank), whose
# cost grows with the rank, not the width: one core, Llama-3.2-1B's 8192x2048 MLP weight, 5.0 s exact (15.5 s for the
# 2048x8192 one, 2.3 s for 2048x2048), 0.23 s randomized. With 4 power iterations it keeps 98.8% of the exact top-16
# residual energy on SmolLM2-135M's down_proj (99.9-100% on the other linears), and leaves a remaining error 1.0008x the
# exact one on the random-weight 1B shape, whose white residual is its worst case (measured by hand, this commit)
EXACT_SVD_MAX_DIM = 1024
LOWRANK_OVERSAMPLE, LOWRANK_ITERATIONS = 10, 4
RESIDUAL_ROWS = 512  # rows of a checkpoint weight read and dequantized at once (16 MB of fp32 at 8192 columns)


@torch.no_grad()
def loftq_factors(
    residual: torch.Tensor, rank: int, scaling: float, hessian: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """LoRA ``(A [r, K], B [N, r])`` with ``scaling * B @ A`` the best rank-``r`` approximation of ``residual [N, K]``
    (exact up to ``EXACT_SVD_MAX_DIM`` rows or columns, randomized above; deterministic either way).

    LoftQ (Li et al., 2023), one alternation: the adapters start as the truncated SVD of the
    quantization residual ``W - dequant(Q(W))``, so the INT4 model starts where the full-precision one was.

    With ``hessian [K, K]`` (``X^T X`` of the layer's calibration inputs, as the calibrated roundings gather it) the
    correction ``L = scaling * B @ A`` minimises the layer's output error ``tr((R - L) H (R - L)^T)`` instead of
    ``|R - L|``: the best rank-``r`` approximation of ``R C`` mapped back by ``C^-1``, ``H = C C^T`` (Cholesky, damped
    as GPTQ damps it; CLoQ, Deng et al., 2025). AWQ's residual is largest on the inputs that barely fire, where the
    plain SVD spent the adapters' rank (SmolLM2-135M, AWQ + LoftQ: held-out loss 4.0525 at the start, against 4.0235
    with round-to-nearest + LoftQ).
    """
    if hessian is None:
        return _truncated_svd(residual.float(), rank, scaling)
    c = damped_cholesky(hessian)
    a, b = _truncated_svd(residual.float() @ c, rank, scaling)
    return torch.linalg.solve_triangular(c, a, upper=False, left=False).contiguous(), b


def _truncated_svd(r: torch.Tensor, rank: int, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A [rank, K], B [N, rank])`` with ``scaling * B @ A`` the rank-``rank`` truncated SVD of ``r [N, K]``; a rank
    above ``min(N, K)`` (PEFT allows one: r=48 on a 32-row k_proj) pads zero rows and columns, the residual then whole
    in the first ``min(N, K)``."""
    if min(r.shape) <= EXACT_SVD_MAX_DIM:
        wide = r.shape[0] < r.shape[1]  # LAPACK is several times faster on the tall orientation
        u, s, vh = torch.linalg.svd(r.T if wide else r, full_matrices=False)
        u, vh = (vh.T, u.T) if wide else (u, vh)
    else:
        with torch.random.fork_rng():  # its random projections leave the caller's generators alone
            torch.manual_seed(0)
            u, s, v = torch.svd_lowrank(r, q=min(rank + LOWRANK_OVERSAMPLE, *r.shape), niter=LOWRANK_ITERATIONS)
        vh = v.T
    root = s[:rank].sqrt() / math.sqrt(scaling)
    a, b = root.unsqueeze(1) * vh[:rank], u[:, :rank] * root
    missing = rank - len(root)
    return F.pad(a, (0, 0, 0, missing)).contiguous(), F.pad(b, (0, missing)).contiguous()


def _checkpoint_residual(layer: PackedInt4Linear, dense_weights, name: str) -> torch.Tensor:
    """``checkpoint weight - dequantized layer``, fp32 ``[N, K]``, built ``RESIDUAL_ROWS`` rows at a time: whole, the
    checkpoint's copy, its fp32 cast and the dequantized weight were 160 MB at once for a 1B-size MLP weight."""
    residual = torch.empty(layer.out_features, layer.in_features)
    for rows, weight in dense_weights.row_blocks(name, RESIDUAL_ROWS):
        index = torch.arange(rows.start, rows.stop)
        residual[rows] = weight.float().sub_(layer.dequantized_rows(index, torch.float32))
    return residual


def lora_scaling(config: LoraConfig) -> float:
    return config.lora_alpha / (math.sqrt(config.r) if config.use_rslora else config.r)


def loftq_for_targets(
    model: nn.Module, config: LoraConfig, dense_weights=None
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """LoftQ factors for every LoRA target that the plan put in int4 (called before ``freeze``); a layer packed while
    loading takes its residual against the checkpoint weight ``dense_weights("<layer>.weight")`` reads, within
    :func:`~hf_lowprec.allocator.freed_memory_returned` (its fp32 copies, 64 MB each for a 1B-size MLP weight, would
    otherwise stay in glibc's heap: with the residual subtracted in place, ``prepare_int4_lora``'s peak at the
    Llama-3.2-1B shape went from 1,678 MB to 1,561)."""
    scaling = lora_scaling(config)
    out = {}
    with freed_memory_returned() if dense_weights is not None else contextlib.nullcontext():
        for fqn in sorted(config.target_modules):  # a set: its order changes from process to process
            module = model.get_submodule(fqn)
            if not isinstance(module, (Int4Linear, PackedInt4Linear)) or module.spec.family != "int4":
                continue
            if isinstance(module, PackedInt4Linear):
                if dense_weights is None:
                    raise ValueError(
                        f"LoftQ of {fqn!r} (packed while loading) needs its checkpoint weight: dense_weights="
                    )
                residual = _checkpoint_residual(module, dense_weights, f"{fqn}.weight")
            else:  # against the grid the frozen base will hold (steps compacted), not the fake-quantized one
                grid = compact_steps(module.freeze()).dequantized_weight(torch.float32)
                residual = module.weight.detach().float() - grid
            out[canonical_name(fqn)] = loftq_factors(residual, config.r, scaling)
    return out
