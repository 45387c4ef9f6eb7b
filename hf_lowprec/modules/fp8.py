"""FP8 training layers: ``FP8Linear`` (the three GEMMs of a linear in FP8) and ``FP8Embedding``.

Numerics (``backend="emulated"``, every device): the input and weight are cast to E4M3 and the
output gradient to E5M2 (configurable) with fp32 scales of the spec's granularity, then each GEMM
multiplies the FP8 *values* with fp32 accumulation and applies the scales afterwards, exactly as
``torch._scaled_mm`` does. FP8 values are exactly representable in bf16, so the GEMM itself runs
as a bf16 matmul (fp32 accumulation) when the output is bf16 and the CPU has fast bf16 GEMMs, in fp32
otherwise: the fastest exact way to compute an FP8 GEMM on each CPU (``torch._scaled_mm`` on CPU is slower than
an fp32 GEMM; ``benchmarks/layers.py``).

``fp8-mx`` (MXFP8) scales 1x32 blocks along each GEMM's contraction dimension with power-of-two (E8M0)
scales, so every operand is quantized once per GEMM orientation, as torchao's ``MXLinear`` does; its scale
(the largest power of two keeping the block in range) is torchao's ``RCEIL`` mode. ``-rht`` formats multiply the
input and the weight by a randomized block Hadamard matrix along the input dimension before quantizing
(:mod:`hf_lowprec.rotation`); autograd rotates the input gradient back.

``backend="torchao"`` runs torchao's ``Float8Linear`` autograd function (real ``_scaled_mm``
kernels on CUDA SM89+); ``backend="auto"`` picks it there for tensorwise/rowwise scaling and the
emulation everywhere else. A parity test holds the two together.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hf_lowprec.formats import (
    E4M3,
    E5M2,
    MX_BLOCK,
    FormatSpec,
    block_shape,
    dequantize_fp8,
    fp8_amax,
    fp8_quantize_dequantize,
    quantize_fp8,
)
from hf_lowprec.modules.embedding import like_embedding
from hf_lowprec.modules.kernels.autotune import compute_dtype
from hf_lowprec.rotation import layer_rotation, rotate
from hf_lowprec.scaling import DynamicScaling, ScalePolicy, casts_of
from hf_lowprec.smoothing import InputSmoothing

FP8_BACKENDS = ("auto", "emulated", "torchao")


def fp8_hardware_available(device: torch.device) -> bool:
    """True on CUDA devices with FP8 tensor cores (compute capability 8.9 or newer)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _compute_dtype(out_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The GEMM dtype of the emulation: bf16 and fp32 both hold FP8 values exactly and accumulate in fp32, so
    bf16 when the output is bf16 and the device multiplies bf16 fast (on a CPU: measured, see
    :func:`~hf_lowprec.modules.kernels.autotune.compute_dtype`), fp32 otherwise (an AVX2 CPU emulates bf16
    GEMMs 25-80x slower than fp32)."""
    if out_dtype != torch.bfloat16:
        return torch.float32
    return torch.bfloat16 if device.type != "cpu" or compute_dtype(device)[0] == torch.bfloat16 else torch.float32


def scaled_mm_emulated(a_q, a_scale, b_q, b_scale, out_dtype):
    """``(a_q @ b_q) / (a_scale * b_scale)`` with FP8 operands ``a_q [M, K]``, ``b_q [K, N]``.

    Scales are 0-dim (tensorwise) or ``[M, 1]`` / ``[1, N]`` (rowwise); fp32 accumulation, the scales applied in
    fp32 as ``torch._scaled_mm`` applies them (in bf16, a tensorwise scale's inverse rounded to bf16 scaled every
    output and gradient by one common factor up to 0.4% off). A bf16 GEMM (bf16 output, a CPU that multiplies bf16
    fast) returns its fp32 sums rounded to bf16 before the scales apply (CPU ``torch.mm`` has no fp32 output for bf16
    inputs): with scales not powers of two, outputs are rounded twice, at most 1 bf16 ulp off the fp32 result instead
    of ``_scaled_mm``'s ½ (a quarter of the outputs of a 256x512x256 GEMM differ by one ulp); power-of-two scales
    round once.
    """
    compute = _compute_dtype(out_dtype, a_q.device)
    out = torch.mm(a_q.to(compute), b_q.to(compute)).float()
    return out.mul_(a_scale.float().reciprocal()).mul_(b_scale.float().reciprocal()).to(out_dtype)


def cast_fp8(x, policy: ScalePolicy, dtype, granularity: str, dim: int = -1, block=None):
    """Quantize a 2-D ``x`` with ``policy``'s scale: ``(q, scale)``; the policy may observe the cast."""
    scale = policy.scale(fp8_amax(x, granularity, dim, block or (1, 1)), dtype)
    q = quantize_fp8(x, scale, dtype, block)
    if policy.observes:
        policy.observe(x, q, scale, block)
    return q, scale


def _mx_mm(a, a_policy, a_dtype, b, b_policy, b_dtype, out_dtype):
    """``a [M, K] @ b [K, N]`` with both operands in MXFP8: 1x32 blocks along ``K`` (``b``'s columns of 32),
    power-of-two scales, fp32 accumulation."""
    compute = _compute_dtype(out_dtype, a.device)
    aq, sa = cast_fp8(a, a_policy, a_dtype, "mx", block=(1, MX_BLOCK))
    bq, sb = cast_fp8(b, b_policy, b_dtype, "mx", block=(MX_BLOCK, 1))
    ad = dequantize_fp8(aq, sa, compute, (1, MX_BLOCK))
    bd = dequantize_fp8(bq, sb, compute, (MX_BLOCK, 1))
    return torch.mm(ad, bd).to(out_dtype)


class _FP8LinearFunction(torch.autograd.Function):
    """``y = x @ W^T`` with all three GEMMs in FP8; ``x`` is 2-D ``[T, K]``, ``W`` is ``[N, K]``."""

    @staticmethod
    def forward(ctx, x, weight, layer: "FP8Linear"):
        out_dtype = x.dtype
        gran, pol = layer.spec.granularity, layer.scaling
        ctx.layer, ctx.out_dtype = layer, out_dtype
        if gran == "mx":
            ctx.save_for_backward(x, weight)  # re-quantized along the backward GEMMs' contraction dims
            return _mx_mm(x, pol["input"], E4M3, weight.t(), pol["weight"], E4M3, out_dtype)
        if gran == "block":
            bx, bw = block_shape(gran, "input"), block_shape(gran, "weight")
            xq, sx = cast_fp8(x, pol["input"], E4M3, "block", block=bx)
            wq, sw = cast_fp8(weight, pol["weight"], E4M3, "block", block=bw)
            ctx.save_for_backward(xq, sx, wq, sw)
            compute = _compute_dtype(out_dtype, xq.device)
            xd, wd = dequantize_fp8(xq, sx, compute, bx), dequantize_fp8(wq, sw, compute, bw)
            return torch.mm(xd, wd.t()).to(out_dtype)
        if gran == "tensor":
            xq, sx = cast_fp8(x, pol["input"], E4M3, "tensor")
            wq, sw = cast_fp8(weight, pol["weight"], E4M3, "tensor")
            # tensorwise: the same FP8 copies serve the backward GEMMs, so only 1 byte/elem is saved
            ctx.save_for_backward(xq, sx, wq, sw)
            return scaled_mm_emulated(xq, sx, wq.t(), sw, out_dtype)
        # rowwise: per-token input scales, per-output-channel weight scales (torchao's "rowwise")
        xq, sx = cast_fp8(x, pol["input"], E4M3, "row", dim=-1)
        wq, sw = cast_fp8(weight, pol["weight"], E4M3, "row", dim=-1)
        ctx.save_for_backward(x, weight)  # re-scaled along the other axis for the backward GEMMs
        return scaled_mm_emulated(xq, sx, wq.t(), sw.t(), out_dtype)

    @staticmethod
    def backward(ctx, grad_out):
        layer, out_dtype = ctx.layer, ctx.out_dtype
        gran, gdt, pol = layer.spec.granularity, layer.grad_dtype, layer.scaling
        g = grad_out.to(out_dtype)
        if gran == "mx":
            x, weight = ctx.saved_tensors
            grad_x = _mx_mm(g, pol["grad"], gdt, weight, pol["weight"], E4M3, out_dtype)  # [T, N] @ [N, K]
            with pol["grad"].recast():  # the same gradient: judged once (GradientScaling)
                grad_w = _mx_mm(g.t(), pol["grad"], gdt, x, pol["input"], E4M3, out_dtype)  # [N, T] @ [T, K]
            return grad_x, grad_w, None
        if gran == "block":
            xq, sx, wq, sw = ctx.saved_tensors
            compute = _compute_dtype(out_dtype, xq.device)
            bg = block_shape(gran, "grad")
            gq, sg = cast_fp8(g, pol["grad"], gdt, "block", block=bg)
            gd = dequantize_fp8(gq, sg, compute, bg)
            xd = dequantize_fp8(xq, sx, compute, block_shape(gran, "input"))
            wd = dequantize_fp8(wq, sw, compute, block_shape(gran, "weight"))
            return torch.mm(gd, wd).to(out_dtype), torch.mm(gd.t(), xd).to(out_dtype), None
        if gran == "tensor":
            xq, sx, wq, sw = ctx.saved_tensors
            gq, sg = cast_fp8(g, pol["grad"], gdt, "tensor")
            grad_x = scaled_mm_emulated(gq, sg, wq, sw, out_dtype)
            grad_w = scaled_mm_emulated(gq.t(), sg, xq, sx, out_dtype)
            return grad_x, grad_w, None
        x, weight = ctx.saved_tensors
        # grad_x [T, K] = g [T, N] @ W [N, K]: g per token, W per input channel
        gq, sg = cast_fp8(g, pol["grad"], gdt, "row", dim=-1)
        wq, sw = cast_fp8(weight, pol["weight"], E4M3, "row", dim=0)
        grad_x = scaled_mm_emulated(gq, sg, wq, sw, out_dtype)
        # grad_W [N, K] = g^T [N, T] @ x [T, K]: both scaled per column (over tokens)
        with pol["grad"].recast():  # the same gradient: judged once (GradientScaling)
            gq_c, sg_c = cast_fp8(g, pol["grad"], gdt, "row", dim=0)
        xq_c, sx_c = cast_fp8(x, pol["input"], E4M3, "row", dim=0)
        grad_w = scaled_mm_emulated(gq_c.t(), sg_c.t(), xq_c, sx_c, out_dtype)
        return grad_x, grad_w, None


class FP8Linear(nn.Linear):
    """``nn.Linear`` whose forward, grad-input and grad-weight GEMMs run in FP8.

    Args:
        spec: an ``fp8*`` :class:`FormatSpec` (granularity ``tensor``, ``row``, ``block`` or ``mx``; ``-rht`` to
            rotate the input dimension).
        backend: ``auto``, ``emulated`` or ``torchao`` (see the module docstring).
        grad_dtype: FP8 dtype of the output gradient (E5M2 by default; torchao's rowwise recipe uses E4M3).
        policies: scale policy per role (``input``, ``weight``, ``grad``); dynamic amax by default,
            power-of-two for rowwise, blockwise and MX scales (MX requires them).
    """

    def __init__(
        self,
        in_features,
        out_features,
        bias=True,
        *,
        spec: FormatSpec | str = "fp8",
        backend: str = "auto",
        grad_dtype: torch.dtype = E5M2,
        policies: dict[str, ScalePolicy] | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.spec = FormatSpec.parse(spec)
        if self.spec.family != "fp8":
            raise ValueError(f"FP8Linear needs an fp8 format, got {self.spec.name!r}")
        if backend not in FP8_BACKENDS:
            raise ValueError(f"unknown FP8 backend {backend!r}; choose one of {', '.join(FP8_BACKENDS)}")
        if grad_dtype not in (E4M3, E5M2):
            raise ValueError(f"grad_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {grad_dtype}")
        self.requested_backend = backend
        self.grad_dtype = grad_dtype
        pow2 = self.spec.granularity != "tensor"
        policies = dict(policies or {})
        self.scaling = nn.ModuleDict(
            {r: policies.pop(r, None) or DynamicScaling(power_of_two=pow2) for r in ("input", "weight", "grad")}
        )
        if policies:
            raise ValueError(f"unknown scale policy roles {sorted(policies)}; choose from input, weight, grad")
        if self.spec.granularity == "mx" and not all(p.power_of_two for p in self.scaling.values()):
            raise ValueError("fp8-mx scales are powers of two (E8M0); pass scale policies with power_of_two=True")
        others = sorted({type(p).__name__ for p in self.scaling.values() if type(p) is not DynamicScaling})
        if backend == "torchao" and others:  # its kernels compute their own dynamic scales: these would not run
            raise ValueError(
                f"backend='torchao' scales dynamically; {', '.join(others)} would be ignored: use backend='emulated' "
                "(or 'auto', which picks it for them)"
            )
        self.rotation_block = layer_rotation(self.spec, in_features, f"FP8Linear({self.spec.name})")
        self.smoothing = InputSmoothing(in_features, device) if self.spec.smooth else None
        self._torchao_config = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, spec: FormatSpec | str = "fp8", **kwargs) -> "FP8Linear":
        """Wrap an existing ``nn.Linear``, keeping its ``weight``/``bias`` Parameter objects."""
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, spec=spec, device="meta", **kwargs)
        new.weight, new.bias = linear.weight, linear.bias
        if new.smoothing is not None:
            new.smoothing.to(linear.weight.device)
        new.scaling.to(linear.weight.device)  # the policies' statistics beside the weight (built on the CPU)
        return new

    @property
    def backend(self) -> str:
        """The backend in use for the weight's current device (``emulated`` or ``torchao``)."""
        if self.requested_backend != "auto":
            return self.requested_backend
        return "torchao" if self.torchao_blocker() is None else "emulated"

    def torchao_blocker(self) -> str | None:
        """Why torchao's FP8 kernels cannot run this layer on its weight's device (``None``: they can)."""
        if not fp8_hardware_available(self.weight.device):
            return f"{self.weight.device.type} has no FP8 tensor cores"
        if self.spec.granularity not in ("tensor", "row"):
            return f"torchao's kernels do not cover {self.spec.name}"
        if not all(type(p) is DynamicScaling for p in self.scaling.values()):
            return "torchao's kernels do not cover its scale policies"
        if self.in_features % 16 or self.out_features % 16:  # torch._scaled_mm's rule for both weight dimensions
            return f"torch._scaled_mm needs weight dimensions divisible by 16, not {self.out_features}x{self.in_features}"
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        weight = self.weight.to(x.dtype)
        shape = x.shape
        x2d = x.reshape(-1, shape[-1])
        if x2d.shape[0] == 0:  # no tokens: nothing to cast, and no amax (a max over no element) to scale from
            out = (x2d @ weight.t()).reshape(*shape[:-1], weight.shape[0])
            return out if self.bias is None else out + self.bias.to(out.dtype)
        if self.smoothing is not None:
            self.smoothing.calibrate(x2d, weight)
            x2d, weight = self.smoothing.inputs(x2d), self.smoothing.weights(weight)
        if self.rotation_block is not None:
            x2d, weight = rotate(x2d, self.rotation_block), rotate(weight, self.rotation_block)
        if self.backend == "torchao":
            out = self._torchao_matmul(x2d, weight)
        else:
            # run inside backward: activation checkpointing recomputing it (the first run's scales replayed); an
            # evaluation is eval mode with autograd off (a model trained in eval mode, dropout off, records as training)
            if torch._C._current_graph_task_id() != -1:
                forward = "replaying"
            else:
                forward = "evaluating" if not self.training and not torch.is_grad_enabled() else "training"
            with casts_of(forward):
                out = _FP8LinearFunction.apply(x2d, weight, self)
        out = out.reshape(*shape[:-1], out.shape[-1])
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def _torchao_matmul(self, x2d, weight):
        # torchao's Float8Linear.forward is these lines; calling its autograd function keeps our
        # module (and the parameter names in state_dict) while running its kernels.
        from torchao.float8.config import CastConfig, Float8LinearConfig, ScalingGranularity
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
        from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

        if self._torchao_config is None:
            if self.spec.granularity == "tensor":
                config = Float8LinearConfig(cast_config_grad_output=CastConfig(target_dtype=self.grad_dtype))
            elif self.spec.granularity == "row":
                axis = ScalingGranularity.AXISWISE
                config = Float8LinearConfig(
                    cast_config_input=CastConfig(scaling_granularity=axis, target_dtype=E4M3),
                    cast_config_weight=CastConfig(scaling_granularity=axis, target_dtype=E4M3),
                    cast_config_grad_output=CastConfig(scaling_granularity=axis, target_dtype=self.grad_dtype),
                    round_scales_to_power_of_2=True,
                )
            else:
                raise ValueError(f"backend='torchao' supports fp8 and fp8-rowwise, not {self.spec.name}")
            emulate = not fp8_hardware_available(self.weight.device) and self.weight.device.type == "cuda"
            gemms = (config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight)

            def mm_configs(pad: bool) -> LinearMMConfig:  # as Float8Linear.__init__ builds them (fast-accumulating
                # output GEMM), padding when asked: F.pad copies both operands even when there is nothing to pad
                return LinearMMConfig(*(ScaledMMConfig(emulate, g.use_fast_accum, False, pad) for g in gemms))

            self._torchao_config = ({pad: mm_configs(pad) for pad in (False, True)}, config)
        mm_configs, config = self._torchao_config
        # the weight gradient's inner dimension is the token count, which need not divide by 16 (_scaled_mm's rule)
        mm_config = mm_configs[x2d.shape[0] % 16 != 0]
        return matmul_with_hp_or_float8_args.apply(x2d, weight.t(), mm_config, config)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, format={self.spec.name}, backend={self.backend}"


class FP8Embedding(nn.Embedding):
    """``nn.Embedding`` whose table is read through E4M3 with one scale per row (token).

    The lookup has no GEMM, so only the weight is quantized; its gradient passes straight through
    to the high-precision table.
    """

    def __init__(
        self,
        num_embeddings,
        embedding_dim,
        *,
        spec: FormatSpec | str = "fp8-rowwise",
        device=None,
        dtype=None,
        **kwargs,
    ):
        super().__init__(num_embeddings, embedding_dim, device=device, dtype=dtype, **kwargs)
        self.spec = FormatSpec.parse(spec)
        if self.spec.family != "fp8":
            raise ValueError(f"FP8Embedding needs an fp8 format, got {self.spec.name!r}")
        if self.spec.rotate or self.spec.smooth:
            raise ValueError(f"an embedding has no input to rotate or smooth; drop '-rht'/'-sq' from {self.spec.name!r}")

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, spec: FormatSpec | str = "fp8-rowwise") -> "FP8Embedding":
        """Wrap an existing ``nn.Embedding``, keeping its ``weight`` Parameter."""
        new = like_embedding(cls, emb, spec=spec)
        return new

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(
            ids, self.weight, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse
        )
        if self.spec.granularity == "block":  # 128x128 blocks span many rows: quantize the table
            table = fp8_quantize_dequantize(self.weight.detach(), E4M3, "block", role="weight")
            q = F.embedding(ids, table)
        else:  # row scales depend on the row only, a tensor scale on the table's amax: quantize the rows read
            flat = rows.detach().reshape(-1, self.embedding_dim)
            amax = self.weight.detach().abs().amax().float() if self.spec.granularity == "tensor" else None
            q = fp8_quantize_dequantize(flat, E4M3, self.spec.granularity, amax=amax).reshape(rows.shape)
        return rows + (q - rows.detach())  # straight-through to the high-precision table

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, format={self.spec.name}"
