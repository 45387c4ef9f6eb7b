"""PEFT LoRA on a frozen packed base (:class:`PackedInt4Linear`, :class:`PackedInt8Linear`; the pattern
of ``peft/tuners/lora/bnb.py``).

PEFT picks a LoRA layer by the type of the layer it wraps; a packed linear is none of the types it
knows, so :func:`register_int4_lora` maps ``PackedLinear`` (both classes) to ``PackedLoraLinear`` in a
``LoraConfig`` through PEFT's custom-module API (``LoraConfig._register_custom_module``), and
:func:`register_peft_dispatch` does it for every config PEFT wraps a packed layer with, also one read from an
``adapter_config.json`` by ``PeftModel.from_pretrained``, and makes ``target_modules="all-linear"`` include packed
layers (PEFT matches ``nn.Linear`` and ``Conv1D`` only).

The forward keeps LoRA's numbers but not its elementwise passes: adapter weights (fp32 master copies, like PEFT's
default ``autocast_adapter_dtype=True``, or bf16: ``prepare_int4_lora(adapter_dtype=...)``) are cast to the
activation dtype for the two small matmuls, and ``scaling * (x A^T) B^T`` is added to the base output inside one
``addmm`` instead of a separate multiply and add over the ``[tokens, out_features]`` output; backward keeps the
adapters, not their casts (:class:`_LoraDelta`).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from peft import LoraConfig
from peft.tuners import tuners_utils
from peft.tuners.lora.layer import Linear as LoraLinear
from peft.tuners.lora.model import LoraModel
from peft.tuners.tuners_utils import BaseTunerLayer, check_adapters_to_merge

from hf_lowprec.modules.packed import KEPT_DENSE, PackedLinear

SUPPORTED_INITS = (True, False, "gaussian")


class _LoraDelta(torch.autograd.Function):
    """``out + scaling * (x A^T) B^T`` for ``out [T, N]``, ``x [T, K]``, adapters ``A [r, K]``, ``B [N, r]`` cast to
    ``x``'s dtype for the two matmuls (autograd's numbers). Saves ``x``, ``x A^T`` and the adapters themselves and casts
    them again in backward: autograd would keep the cast copies (on Llama-3.2-1B, 1.1 MB a layer in bf16, whatever the
    batch) and 8-bit activation storage would round them."""

    @staticmethod
    def forward(ctx, out, x, a, b, scaling):
        xa = F.linear(x, a.to(x.dtype))
        ctx.save_for_backward(x, xa, a, b)
        ctx.scaling = scaling
        return torch.addmm(out, xa, b.to(x.dtype).t(), alpha=scaling)

    @staticmethod
    def backward(ctx, grad):
        x, xa, a, b = ctx.saved_tensors
        needs_x, needs_a, needs_b = ctx.needs_input_grad[1:4]
        grad_xa = grad.mm(b.to(grad.dtype)) * ctx.scaling if needs_x or needs_a else None
        grad_x = grad_xa.mm(a.to(grad.dtype)) if needs_x else None
        grad_a = grad_xa.t().mm(x.to(grad.dtype)).to(a.dtype) if needs_a else None
        grad_b = (grad.t().mm(xa.to(grad.dtype)) * ctx.scaling).to(b.dtype) if needs_b else None
        return grad, grad_x, grad_a, grad_b, None


class PackedLoraLinear(LoraLinear):
    """``lora.Linear`` whose base is a :class:`PackedLinear`; merging re-quantizes the base, unmerging restores it.

    Vanilla LoRA only: DoRA and the other variants, ``lora_bias`` and initialisations that read a dense
    base weight (PiSSA, OLoRA, PEFT's own LoftQ ...) raise ``ValueError`` (use
    ``hf_lowprec.ondevice.prepare_int4_lora(loftq_init=True)`` for LoftQ on the INT4 base), for the first adapter
    and for every one added or loaded later. Steps and zero points learned with the adapters
    (:meth:`PackedLinear.learn_steps`) belong to the base: they stay with the adapters disabled.
    """

    def __init__(self, base_layer, adapter_name: str, config: LoraConfig, **kwargs):
        if config.fan_in_fan_out:  # as PEFT does for an nn.Linear base: a packed one stores [out, in] too
            warnings.warn(
                "fan_in_fan_out is set to True but the target module is a packed linear, stored [out, in] as "
                "torch.nn.Linear. Setting fan_in_fan_out to False.",
                UserWarning,
                stacklevel=2,
            )
            config.fan_in_fan_out = False
        super().__init__(base_layer, adapter_name, config=config, **kwargs)
        self.merge_errors: list[dict] = []
        self._before_merge: dict[str, torch.Tensor] = {}

    def update_layer(self, adapter_name: str, r: int, lora_alpha: int, config: LoraConfig, **kwargs) -> None:
        """PEFT's, after refusing what a packed base cannot take: every adapter comes through here (the first from
        ``__init__``, later ones from ``add_adapter`` / ``load_adapter``), before any of its weights exist."""
        init = config.init_lora_weights
        if init not in SUPPORTED_INITS:
            raise ValueError(
                f"init_lora_weights={init!r} is not supported on a packed base; choose one of {SUPPORTED_INITS}"
                + (" (LoftQ: hf_lowprec.ondevice.prepare_int4_lora(loftq_init=True))" if init == "loftq" else "")
            )
        if config.lora_bias:
            raise ValueError("lora_bias=True is not supported on a packed base (it could not be merged into the codes)")
        variant = self.resolve_lora_variant(config=config)  # reads only the config and the class's variant table
        if variant is not None:
            raise ValueError(
                f"LoRA variant {type(variant).__name__} (e.g. DoRA) is not supported on a packed base; use plain LoRA"
            )
        super().update_layer(adapter_name, r, lora_alpha, config=config, **kwargs)

    def _get_in_out_features(self, module):
        return module.in_features, module.out_features

    # -------------------------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs or self.disable_adapters or self.merged:
            return super().forward(x, *args, **kwargs)  # mixed adapter batches, disabled or merged adapters
        result = self.base_layer(x)
        out = result.reshape(-1, self.out_features)
        x2d = x.reshape(-1, self.in_features)
        for name in self.active_adapters:
            if name not in self.lora_A:
                continue
            a, b = self.lora_A[name].weight, self.lora_B[name].weight
            out = _LoraDelta.apply(out, self.lora_dropout[name](x2d), a, b, self.scaling[name])
        return out.reshape(result.shape)

    # ---------------------------------------------------------------------------------- merge
    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Add the adapters' delta to the dequantized base and re-quantize it (lossy: see ``merge_errors``)."""
        adapter_names = check_adapters_to_merge(self, adapter_names)
        adapter_names = [n for n in adapter_names if n in self.lora_A]
        if not adapter_names:
            return
        # as PEFT warns for bitsandbytes 4-bit merges; once per call site (merge_and_unload merges every layer)
        warnings.warn(
            "merging LoRA into a packed INT4 base re-quantizes its codes: most of the adapters' change is smaller "
            "than half a step and is lost (SmolLM2-135M after 30 steps: held-out loss back to the base's); to keep it, "
            "merge into dense weights: export_int4_lora(model, out, merge=True, merged_dtype='bf16') or "
            "`hf-lowprec export RUN --merge --merge-into bf16`",
            UserWarning,
            stacklevel=2,
        )
        base: PackedLinear = self.get_base_layer()
        weight = base.dequantized_weight(torch.float32)
        delta = sum(lora_delta(self, n) for n in adapter_names)
        merged = weight + delta
        if safe_merge and not torch.isfinite(merged).all():
            raise ValueError(f"NaNs detected in the merged weights; adapters {adapter_names} seem to be broken")
        if not self.merged:  # what unmerge restores (a second rounding would move the base for good): a copy
            self._before_merge = {n: t.detach().clone() for n, t in _stored_tensors(base).items()}
        stats = requantize_merged(base, merged, delta)
        stats.update(
            adapters=list(adapter_names),
        )
        self.merge_errors.append(stats)
        self.merged_adapters.extend(adapter_names)

    @torch.no_grad()
    def unmerge(self) -> None:
        """Put back the base as it was before the first merge (codes, steps, zero points and what they learned),
        exactly: subtracting the adapters and re-quantizing would round a second time."""
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.")
            return
        base: PackedLinear = self.get_base_layer()
        for name, tensor in _stored_tensors(base).items():
            tensor.copy_(self._before_merge.pop(name))
        base._cache.clear()
        self.merged_adapters.clear()


def _stored_tensors(layer: PackedLinear) -> dict[str, torch.Tensor]:
    """What a merge re-quantizes in ``layer``: its codes, steps and zero points, and the gain and shift it learned."""
    names = ("qweight", "step", "zero", "step_gain", "zero_shift")
    return {n: getattr(layer, n).data for n in names if getattr(layer, n, None) is not None}


def lora_delta(module: LoraLinear, adapter: str) -> torch.Tensor:
    """``scaling * B A`` of ``module``'s ``adapter`` in fp32 (``[out, in]``; transposed for ``fan_in_fan_out``):
    PEFT's ``get_delta_weight`` rounds it to the adapters' dtype, bf16 for bf16 adapters."""
    a, b = module.lora_A[adapter].weight.float(), module.lora_B[adapter].weight.float()
    delta = (b @ a) * module.scaling[adapter]
    return delta.T if module.fan_in_fan_out else delta


@torch.no_grad()
def requantize_merged(layer: PackedLinear, merged: torch.Tensor, delta: torch.Tensor) -> dict:
    """Store ``merged`` (its dequantized weight plus an adapter ``delta``, fp32 ``[N, K]``) in ``layer``'s format, in
    place: ``requantize_``'s ``rel_error`` plus ``delta_norm`` and the rounding error relative to it."""
    stats = layer.requantize_(merged)
    err = (layer.dequantized_weight(torch.float32) - merged).norm()
    stats.update(delta_norm=delta.norm().item(), error_vs_delta=(err / delta.norm().clamp(min=1e-12)).item())
    return stats


def register_int4_lora(config: LoraConfig) -> LoraConfig:
    """Teach ``config`` (in place; also returned) to wrap packed layers in LoRA."""
    config._register_custom_module({PackedLinear: PackedLoraLinear})
    return config


def register_peft_dispatch() -> None:
    """Let PEFT wrap packed layers under any ``LoraConfig`` (once; :mod:`hf_lowprec.integrations` calls it when PEFT
    is imported).

    PEFT's only hook for new layer types is the per-config mapping of :func:`register_int4_lora`, which a config read
    from disk does not carry; so ``LoraModel._create_new_module`` is wrapped to add that mapping whenever the layer
    to wrap is packed. A linear a packed folder's plan keeps dense (marked :data:`KEPT_DENSE` as it loads) gets its
    adapters in fp32, as they trained (``prepare_int4_lora``): transformers' own ``load_adapter``, which loads the
    adapters stored beside an export's weights, would make them the layer's bf16. Every other layer is PEFT's.
    """
    create = LoraModel._create_new_module
    if getattr(create, "hf_lowprec_dispatch", False):
        return

    def create_new_module(lora_config, adapter_name, target, **kwargs):
        base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
        if isinstance(base, PackedLinear):
            register_int4_lora(lora_config)
        module = create(lora_config, adapter_name, target, **kwargs)
        if getattr(base, KEPT_DENSE, False) and adapter_name in getattr(module, "lora_A", {}):
            for p in (*module.lora_A[adapter_name].parameters(), *module.lora_B[adapter_name].parameters()):
                p.data = p.data.float()
        return module

    create_new_module.hf_lowprec_dispatch = True
    LoraModel._create_new_module = staticmethod(create_new_module)
    _include_packed_in_all_linear()


def _include_packed_in_all_linear() -> None:
    """Wrap PEFT's ``all-linear`` expansion (``tuners_utils._maybe_include_all_linear_layers``, which LoRA's tuner
    looks up in its module) to add the packed layers, the output head excepted as PEFT excepts it (a model loaded with
    ``HfLowprecConfig`` has no ``nn.Linear`` left to match). Layers already wrapped by an adapter PEFT finds itself."""
    include = tuners_utils._maybe_include_all_linear_layers
    if getattr(include, "hf_lowprec_dispatch", False):
        return

    def include_all_linear(peft_config, model):
        targets = getattr(peft_config, "target_modules", None)
        wants_all = isinstance(targets, str) and targets.lower() == tuners_utils.INCLUDE_LINEAR_LAYERS_SHORTHAND
        peft_config = include(peft_config, model)
        if not wants_all:
            return peft_config
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        wrapped = {id(m) for t in model.modules() if isinstance(t, BaseTunerLayer) for m in t.modules()}
        packed = {
            name
            for name, module in model.named_modules()
            if isinstance(module, PackedLinear) and module is not head and id(module) not in wrapped
        }
        peft_config.target_modules = set(peft_config.target_modules) | packed
        return peft_config

    include_all_linear.hf_lowprec_dispatch = True
    tuners_utils._maybe_include_all_linear_layers = include_all_linear
