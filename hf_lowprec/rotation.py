"""Randomized block Hadamard rotation of a linear's input dimension: outlier handling for the ``-rht`` formats.

For an orthogonal ``R``, ``y = x W^T = (x R)(W R)^T``: quantizing ``x R`` and ``W R`` in place of ``x`` and ``W``
changes nothing in exact arithmetic, while an outlier channel of ``x`` (or ``W``) is spread over the ``b``
channels of its block, so a tensor-, row- or group-wise scale no longer has to cover it (QuaRot, SpinQuant; the
NVFP4 training recipe's random Hadamard transforms). ``R = blockdiag(D H_b / sqrt(b), ...)`` with ``H_b`` the
Sylvester Hadamard matrix of the largest power of two ``b <= ROTATION_BLOCK`` dividing the input dimension
and ``D`` fixed random signs: rotating costs ``b`` multiply-adds per input element (a ``b``-wide batched
matmul), 11% of a 576x576 layer's GEMM at ``b = 64``, instead of the ``K`` of a full-dimension rotation.

``R`` depends on ``b`` alone (signs drawn on the CPU from ``ROTATION_SEED``), so a saved layer reloads with the
same rotation on any device without storing it. Written by hand: torchao's SpinQuant helpers build
full-dimension matrices and print to stdout on import; the ``b``-wide matmul is what a CPU runs fast.
"""

from __future__ import annotations

import functools

import torch

ROTATION_BLOCK = 128
"""Largest rotation block: 1x128 is also the FP8 block scale's width (DeepSeek-V3)."""
MIN_ROTATION_BLOCK = 16
"""Smallest block worth rotating (the NVFP4 recipe's 16x16 transform)."""
ROTATION_SEED = 0


def rotation_block(in_features: int) -> int | None:
    """The rotation block for an input dimension: the largest power of two ``<= ROTATION_BLOCK`` dividing it,
    or ``None`` when that is below ``MIN_ROTATION_BLOCK`` (the layer cannot be rotated)."""
    block = in_features & -in_features  # largest power of two dividing in_features
    block = min(block, ROTATION_BLOCK)
    return block if block >= MIN_ROTATION_BLOCK else None


def layer_rotation(spec, in_features: int, what: str) -> int | None:
    """The rotation block of a layer of format ``spec`` (a ``FormatSpec``) with ``in_features`` inputs: ``None`` when
    the format does not rotate, a ``ValueError`` naming ``what`` and the allowed input sizes when it cannot."""
    if not spec.rotate:
        return None
    block = rotation_block(in_features)
    if block is None:
        raise ValueError(
            f"{what}: cannot rotate an input of {in_features} features; '-rht' needs an input size divisible by "
            f"{MIN_ROTATION_BLOCK}"
        )
    return block


@functools.cache
def _block_matrix(block: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``D H_b / sqrt(b)`` ``[b, b]`` (orthogonal), drawn on the CPU and kept per device and dtype: every forward of a
    rotated layer reads it."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    gen = torch.Generator().manual_seed(ROTATION_SEED)
    signs = torch.randint(0, 2, (block,), generator=gen, dtype=torch.float64) * 2 - 1
    return (signs[:, None] * h / block**0.5).to(device=device, dtype=dtype)


def rotation_matrix(block: int, device=None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``[b, b]`` block of ``R`` (see the module docstring) on ``device`` in ``dtype``."""
    return _block_matrix(block, torch.device(device or "cpu"), dtype)


def rotate(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x R`` along the last dimension (differentiable; its gradient is ``g R^T``); keeps shape and dtype."""
    return _blockwise(x, rotation_matrix(block, x.device, _compute_dtype(x)))


def unrotate(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x R^T`` along the last dimension: the inverse of :func:`rotate`."""
    return _blockwise(x, rotation_matrix(block, x.device, _compute_dtype(x)).t())


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for 16-bit inputs on a CPU (an AVX2 CPU multiplies bf16 25-80x slower than fp32; the result is cast
    back), else ``x``'s dtype."""
    return torch.float32 if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16) else x.dtype


def _blockwise(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``x`` times ``blockdiag(r, r, ...)`` along the last dimension, in ``r``'s dtype, returned in ``x``'s."""
    shape, block = x.shape, r.shape[0]
    return (x.to(r.dtype).reshape(*shape[:-1], shape[-1] // block, block) @ r).reshape(shape).to(x.dtype)


def rotated_hessian(hessian: torch.Tensor, block: int) -> torch.Tensor:
    """``R^T H R``: the input Hessian ``X^T X`` ``[K, K]`` of a layer whose inputs are rotated to ``X R``."""
    return rotate(rotate(hessian, block).t(), block).t()
