"""Throughput of each CPU kernel on one linear shape, as GFLOP/s and as a ratio to the fp32 GEMM.

What ``hf-lowprec env`` prints and ``benchmarks/kernel_speed.py`` records per shape: the dense GEMMs (fp32, bf16,
int8 ``torch._int_mm``), torch's own weight-only int4/int8 CPU kernels, the packed layers' backends on fp32 and on bf16
inputs (the int8 backend also through ``torch._int_mm`` where it runs AMX tile kernels), forward (``y = x W^T``) and
grad-input (``g W``) timed separately, and the gradient of learned steps (a weight-gradient GEMM reduced to per-group
sums: the C++ kernel, and torch ops), one after the other in one process.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from hf_lowprec.formats import FormatSpec, int_steps, quantize_int
from hf_lowprec.modules import packed as packed_module
from hf_lowprec.modules.kernels.autotune import time_calls
from hf_lowprec.modules.kernels.cpu import cpu_info
from hf_lowprec.modules.packed import KERNELS, PackedInt4Linear, _learned_grads, _learned_sums_torch

SPEC = "int4-g64-asym"


def kernel_candidates(m: int, k: int, n: int, torch_int4: bool = True) -> dict[str, Callable[[], object]]:
    """``{kernel: call}`` for ``x [m, k] @ W^T [k, n]`` and the packed backends' grad-input (``.../grad``).

    ``torch_int4``: include torch's ``_weight_int4pack_mm_for_cpu`` / ``_weight_int8pack_mm`` (made for a few
    tokens; slow at training sizes).
    """
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) * 0.02
    g = torch.randn(m, n, generator=gen)
    xb, wb = x.bfloat16(), w.bfloat16()
    calls: dict[str, Callable[[], object]] = {"fp32": lambda: F.linear(x, w), "bf16": lambda: F.linear(xb, wb)}
    if cpu_info().int8_dot:  # an emulated _int_mm is 30-150x slower than fp32: timing it tells nothing new
        a8, b8 = (torch.randint(-127, 128, shape, dtype=torch.int8) for shape in ((m, k), (k, n)))
        calls["int8 _int_mm"] = lambda: torch._int_mm(a8, b8)
    spec = FormatSpec.parse(SPEC)
    step, zero = int_steps(w, spec)
    codes = quantize_int(w, spec, step, zero)
    layer = PackedInt4Linear.from_codes(codes, step, zero, spec, None, torch.float32)
    if torch_int4:
        packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        scales_zeros = torch.stack([step, (8 - zero) * step], -1).transpose(0, 1).contiguous()  # [G, N, 2]
        calls["torch int4pack_mm"] = lambda: torch._weight_int4pack_mm_for_cpu(x, packed, spec.group_size, scales_zeros)
        w8, row = torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n)
        calls["torch int8pack_mm"] = lambda: torch._weight_int8pack_mm(x, w8, row)
    learning = PackedInt4Linear.from_codes(codes, step, zero, spec, None, torch.float32)
    learning.learn_steps()  # the weight-gradient GEMM and per-group sums its learned steps take per call
    calls["learned steps/grad"] = lambda: _learned_grads(g, x, learning, True, True)
    calls["learned steps/grad torch ops"] = lambda: _learned_sums_torch(g, x, learning, None, True, spec.group_size)
    # fp32 inputs, and bf16 ones (the compute dtype where bf16 GEMMs are fast: dtype="auto" measures that per CPU)
    layer_bf16, gb = PackedInt4Linear.from_codes(codes, step, zero, spec, None, torch.bfloat16), g.bfloat16()
    for dtype, packed_layer, xd, gd in (("", layer, x, g), (" bf16", layer_bf16, xb, gb)):
        for backend in packed_layer.runnable_backends(xd):
            forward, grad_input = KERNELS[backend]
            # a new version of x per call, as in training: the int8 backend's rows of the last call are not reused
            calls[f"packed {backend}{dtype}"] = lambda f=forward, p=packed_layer, xd=xd: f(xd.mul_(1.0), p)
            calls[f"packed {backend}{dtype}/grad"] = lambda f=grad_input, p=packed_layer, gd=gd: f(gd, p)
            # and without the tile kernels, where torch._int_mm runs at int8 speed (not emulated)
            if backend == "int8" and cpu_info().int8_dot and packed_module.int8_tile_kernels(packed_layer) is not None:
                name = f"packed int8 _int_mm{dtype}"
                calls[name] = lambda f=forward, p=packed_layer, x=xd: _int_mm_path(f, x.mul_(1.0), p)
                calls[f"{name}/grad"] = lambda f=grad_input, p=packed_layer, g=gd: _int_mm_path(f, g, p)
    return calls


def _int_mm_path(kernel: Callable, *args):
    """``kernel(*args)`` with the int8 backend multiplying through ``torch._int_mm`` (``USE_TILE_KERNELS`` off)."""
    tiles, packed_module.USE_TILE_KERNELS = packed_module.USE_TILE_KERNELS, False
    try:
        return kernel(*args)
    finally:
        packed_module.USE_TILE_KERNELS = tiles


def kernel_throughput(m: int, k: int, n: int, repeats: int = 5, torch_int4: bool = True) -> dict[str, dict]:
    """``{kernel: {"seconds", "gflops", "vs_fp32"}}`` on one shape (see :func:`kernel_candidates`)."""
    flops = 2.0 * m * k * n
    seconds = time_calls(kernel_candidates(m, k, n, torch_int4), repeats)
    fp32 = seconds["fp32"]
    return {
        name: {"seconds": round(t, 6), "gflops": round(flops / t / 1e9, 2), "vs_fp32": round(fp32 / t, 3)}
        for name, t in seconds.items()
    }
