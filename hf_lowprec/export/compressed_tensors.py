"""Export of a packed INT4 model to the compressed-tensors "pack-quantized" layout, which transformers (with the
``compressed-tensors`` package) loads without hf-lowprec; it is the layout vLLM reads.

Layout per INT4 linear (compressed-tensors' own names): ``weight_packed`` int32 ``[N, K/8]`` (eight 4-bit codes per
word, the first in the lowest bits, each stored as ``code + 8``), ``weight_scale`` ``[N, K/group]`` in the model
dtype, ``weight_shape`` int64 ``[2]``, and for asymmetric formats ``weight_zero_point`` int32 ``[N/8, K/group]``
(packed along the output dimension). Codes and zero points are signed: ``w = (q - zero) * scale``.

The packing is written here (a few lines) so that exporting needs no compressed-tensors; whoever loads the folder
needs it. What compressed-tensors 0.20 loads correctly on CPU decides the rest:

- one INT4 format per model (one config group; every other linear is listed in ``ignore``);
- ``"dequantize": true``: transformers decompresses the weights while loading (its packed path mis-sizes asymmetric
  zero points, and its dequantizing path decodes every group with the first group's scheme), so the layers come
  back as plain ``nn.Linear`` — and PEFT adapters load onto them the standard way;
- per-channel int8 layers are written as dense weights in the model dtype (exact: code times step, one rounding): as
  a second config group they would load wrong, since transformers decodes every dense layer with one group's scheme.

A layer with input scales (AWQ, smoothing ``-sq``) or a Hadamard rotation (``-rht``) is re-quantized on the plain
grid first (a second rounding; its error is returned). Learned zero points are not integers: a layer with a LoRA adapter
keeps its codes and steps, stores its zero points rounded into 0..15, and its adapter carries the rest exactly (see
:func:`add_zero_residuals`); one without is re-quantized.
"""

from __future__ import annotations

import copy
import json
import math
import os
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from peft import PeftModel, PeftType
from peft.tuners.lora import LoraLayer
from peft.utils import CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME
from safetensors.torch import load_file, save_file
from torch import nn

from hf_lowprec.folders import atomic_output_dir, check_output_dir
from hf_lowprec.formats import FormatSpec
from hf_lowprec.layers import canonical_name
from hf_lowprec.modules.packed import PackedInt4Linear, PackedInt8Linear, PackedLinear
from hf_lowprec.modules.packed_embedding import with_dense_tables
from hf_lowprec.ondevice.export import adapterless_state, save_adapters, without_hf_quantizer

QUANT_METHOD = "compressed-tensors"
CT_FORMAT = "pack-quantized"
PEFT_PREFIX = "base_model.model."  # of every key in a saved LoRA adapter, before the layer's name
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # what vLLM's --max-lora-rank takes (MaxLoRARanks)


def pack_int32(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed ``codes [R, C]`` (C a multiple of ``32 / bits``) as int32 words ``[R, C * bits / 32]``, as
    compressed-tensors' ``pack_to_int32``: each code stored as ``code + 2^(bits-1)``, the first in the lowest bits."""
    per_word = 32 // bits
    rows, cols = codes.shape
    unsigned = (codes.to(torch.int32) + (1 << (bits - 1))).view(rows, cols // per_word, per_word)
    shifts = bits * torch.arange(per_word, dtype=torch.int32, device=codes.device)
    return (unsigned << shifts).sum(-1, dtype=torch.int32)


def _packed_by_name(base: nn.Module) -> dict[str, PackedLinear]:
    """``{canonical name: packed layer}`` of ``base`` (PEFT wrappers seen through)."""
    found = {}
    for fqn, module in base.named_modules():
        if isinstance(module, PackedLinear):
            found[canonical_name(fqn)] = module
    return found


def _int4_format(layers: dict[str, PackedLinear]):
    """The one INT4 format of ``layers``; ``ValueError`` for none, several, or a shape compressed-tensors refuses."""
    plain = (replace(m.spec, rotate=False, smooth=False) for m in layers.values() if isinstance(m, PackedInt4Linear))
    specs = {spec.name: spec for spec in plain}  # rotated and smoothed layers are written on the plain grid
    if not specs:
        raise ValueError(
            "compressed-tensors export needs packed INT4 layers; this model has none (export 'native' or 'bf16')"
        )
    if len(specs) > 1:
        raise ValueError(
            f"compressed-tensors export takes one INT4 format per model, this one has {', '.join(sorted(specs))}; "
            "re-plan with one int4 format"
        )
    spec = next(iter(specs.values()))
    for name, m in layers.items():
        if isinstance(m, PackedInt4Linear) and (
            m.in_features % (spec.group_size or m.in_features) or (not spec.symmetric and m.out_features % 8)
        ):
            raise ValueError(
                f"layer {name!r} ({m.out_features}x{m.in_features}): compressed-tensors needs in_features divisible "
                f"by the group size {spec.group_size} (and out_features by 8 for zero points)"
            )
    return spec


def _on_plain_grid(layer: PackedInt4Linear, residual_carried: bool) -> tuple[PackedInt4Linear, float | None]:
    """``layer``, or a copy re-quantized without input scales and with integer zero points; the relative weight
    error of that second rounding (``None`` when none was needed). ``residual_carried``: fractional zero points need
    none (the adapter carries what their rounding leaves, :func:`zero_residual`)."""
    zero = layer.effective_zero()  # learned steps' zero points (modules/packed.py) need not be integers
    integral_zero = zero is None or residual_carried or bool(torch.equal(zero, stored_zero(zero, layer.spec).float()))
    if layer.inverse_input_scale() is None and integral_zero and layer.rotation_block is None:
        return layer, None
    spec = replace(layer.spec, rotate=False, smooth=False)
    plain = PackedInt4Linear(layer.in_features, layer.out_features, spec, layer.bias is not None, layer.dtype)
    if layer.bias is not None:
        plain.bias.data.copy_(layer.bias)
    return plain, plain.requantize_(layer.dequantized_weight(torch.float32))["rel_error"]


def rerounded(errors: dict[str, float], int4_layers: int) -> str:
    """What re-rounding onto the plain grid did to the weights, one phrase: how many of the ``int4_layers`` INT4 layers,
    and the median and worst of ``errors`` (``{layer: relative weight error}``, non-empty), in percent."""
    values = list(errors.values())
    median, worst = 100 * statistics.median(values), 100 * max(values)
    return (
        f"{len(values)} of {int4_layers} INT4 layers re-rounded to the plain grid compressed-tensors stores (integer "
        f"zero points, no input scales or rotation), relative weight error median {median:.3g}%, max {worst:.3g}%"
    )


def _int4_tensors(layer: PackedInt4Linear, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """compressed-tensors' tensors of one INT4 layer (see the module docstring)."""
    codes = layer.codes().to(torch.int32)
    out = {
        "weight_scale": layer.effective_step().to(dtype).contiguous(),
        "weight_shape": torch.tensor([layer.out_features, layer.in_features], dtype=torch.int64),
    }
    if layer.zero is None:
        out["weight_packed"] = pack_int32(codes, 4)
    else:  # unsigned codes 0..15 with zero z become signed codes and zero points: shift both by 8
        out["weight_packed"] = pack_int32(codes - 8, 4)
        zero = stored_zero(layer.effective_zero(), layer.spec) - 8
        out["weight_zero_point"] = pack_int32(zero.t().contiguous(), 4).t().contiguous()
    return out


def stored_zero(zero: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    """The zero points the layout stores for a layer's ``zero`` fp32 ``[N, G]`` (``effective_zero``), int32: rounded
    into ``spec``'s code range (0..15). Learned shifts make them fractional and can carry one past that range, which
    four bits cannot hold (a 16 spilled into the next zero point's bits)."""
    return zero.round().clamp(*spec.qrange).to(torch.int32)


def zero_residual(layer: PackedInt4Linear) -> torch.Tensor | None:
    """``D`` fp32 ``[N, G]``: what the stored zero points ``z'`` (:func:`stored_zero`) leave out of ``layer``'s
    weights, one value per group: ``w = (q - z) s = (q - z') s + D`` with ``D = (z' - z) s``; ``None`` when they are
    its zero points (or it has none)."""
    zero = layer.effective_zero()
    if zero is None or bool(torch.equal(zero, stored := stored_zero(zero, layer.spec).float())):
        return None
    return (stored - zero) * layer.effective_step()


def add_zero_residuals(adapter_dir: Path, residuals: dict[str, torch.Tensor], group_size: int | None) -> int:
    """Add ``residuals`` (``{layer: D [N, G]}``, :func:`zero_residual`) to the saved LoRA adapter in ``adapter_dir``
    as extra ranks, exactly: ``x @ E.T`` with ``E[n, k] = D[n, k // group_size]`` is ``(x @ P.T) @ D.T`` where ``P``
    ``[G, K]`` sums each group's inputs, i.e. a LoRA pair ``A = P``, ``B = D / scaling`` of rank ``G``. Every adapted
    layer gets the same rank ``r + max G`` (zero rows where it has fewer groups or no residual), with ``lora_alpha``
    scaled so that ``scaling`` is unchanged, so the config stays one ``r`` (PEFT, vLLM); ``group_size`` ``None``: one
    group a row (per-row formats). Returns the new rank.

    PEFT has no API to grow a saved adapter's rank, hence the file rewrite."""
    config_path, weights_path = adapter_dir / CONFIG_NAME, adapter_dir / SAFETENSORS_WEIGHTS_NAME
    config = json.loads(config_path.read_text())
    weights = load_file(weights_path)
    r, alpha, rslora = config["r"], config["lora_alpha"], config.get("use_rslora", False)
    scaling = alpha / (math.sqrt(r) if rslora else r)
    extra = max(d.shape[1] for d in residuals.values())
    for key_a in [k for k in weights if k.endswith(".lora_A.weight")]:
        key_b, name = key_a.replace(".lora_A.", ".lora_B."), key_a[len(PEFT_PREFIX) : -len(".lora_A.weight")]
        a, b = weights[key_a], weights[key_b]
        sums, d = torch.zeros(extra, a.shape[1]), torch.zeros(b.shape[0], extra)
        if name in residuals:
            groups = residuals[name].shape[1]
            k = torch.arange(a.shape[1])
            sums[k // (group_size or a.shape[1]), k] = 1.0
            d[:, :groups] = residuals[name] / scaling
        weights[key_a] = torch.cat([a, sums.to(a.dtype)]).contiguous()
        weights[key_b] = torch.cat([b, d.to(b.dtype)], dim=1).contiguous()
    rank = r + extra
    config["r"], config["lora_alpha"] = rank, scaling * (math.sqrt(rank) if rslora else rank)
    save_file(weights, weights_path, metadata={"format": "pt"})
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True))
    return rank


def vllm_serving(rank: int) -> str:
    """How vLLM serves an adapter of ``rank``: the smallest ``--max-lora-rank`` it takes that holds it."""
    fits = [r for r in VLLM_MAX_LORA_RANKS if r >= rank]
    if not fits:
        return f"above vLLM's largest --max-lora-rank ({VLLM_MAX_LORA_RANKS[-1]}), so vLLM cannot serve it"
    return f"vLLM serves it with --max-lora-rank {fits[0]}"


def residual_carriers(model: nn.Module) -> set[str]:
    """Canonical names of the layers whose LoRA adapter can carry their zero residual exactly: those of a PEFT model's
    one LoRA adapter, with one rank and alpha for every layer (no ``rank_pattern``/``alpha_pattern``), no DoRA (whose
    weight norm the residual would change) and no embedding adapter (whose rank would have to grow too)."""
    if not isinstance(model, PeftModel) or len(model.peft_config) != 1:
        return set()
    config = next(iter(model.peft_config.values()))
    if config.peft_type != PeftType.LORA or config.use_dora or config.rank_pattern or config.alpha_pattern:
        return set()
    adapted = {canonical_name(fqn): m for fqn, m in model.get_base_model().named_modules() if isinstance(m, LoraLayer)}
    return set() if any(not m.lora_A for m in adapted.values()) else set(adapted)


def compressed_tensors_state(
    base: nn.Module, carriers: set[str] = frozenset()
) -> tuple[dict[str, torch.Tensor], dict, dict[str, float], dict[str, torch.Tensor]]:
    """``(state dict, quantization_config, {layer: re-quantization error}, {layer: zero residual})`` of ``base`` (a
    model with packed layers, adapters excluded) in the pack-quantized layout; the layers in ``carriers`` keep codes
    and steps with fractional zero points, whose residual (:func:`zero_residual`) their adapter is to carry."""
    layers = _packed_by_name(base)
    spec = _int4_format(layers)
    dtype = next(iter(layers.values())).dtype  # the compute dtype (a packed embedding leaves a LoRA matrix first)
    state, errors = with_dense_tables(adapterless_state(base), base, dtype), {}  # the layout has no packed embedding
    residuals = {}
    for name, layer in layers.items():
        for buffer in PackedLinear.BUFFERS:
            state.pop(f"{name}.{buffer}", None)
        if isinstance(layer, PackedInt8Linear):
            state[f"{name}.weight"] = layer.dequantized_weight(dtype)
            continue
        plain, error = _on_plain_grid(layer, residual_carried=name in carriers)
        if error is not None:
            errors[name] = error
        elif name in carriers and (residual := zero_residual(layer)) is not None:
            residuals[name] = residual
        state.update({f"{name}.{key}": value for key, value in _int4_tensors(plain, dtype).items()})
    linears = [
        canonical_name(n) for n, m in base.named_modules() if isinstance(m, (nn.Linear, PackedLinear)) and ".lora_" not in n
    ]  # a packed int8 layer is written dense (ignored), as the kept ones
    ignore = sorted(n for n in linears if not isinstance(layers.get(n), PackedInt4Linear))
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": spec.symmetric,
        "strategy": "channel" if spec.group_size is None else "group",  # per-row INT4: one step per output channel
        "group_size": spec.group_size,
        "dynamic": False,
        "actorder": None,
        "observer": None,
    }
    config = {
        "quant_method": QUANT_METHOD,
        "format": CT_FORMAT,
        "quantization_status": "compressed",
        "dequantize": True,
        "ignore": ignore,
        "kv_cache_scheme": None,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": CT_FORMAT,
            }
        },
    }
    return state, config, errors, residuals


@dataclass
class CompressedTensorsExport:
    """What a compressed-tensors export changed: ``requantized`` ``{layer: relative weight error}`` of the layers
    re-rounded onto the plain grid; ``residual_layers`` how many layers' fractional zero points their adapter carries,
    at adapter rank ``adapter_rank`` (``None``: the run's own rank)."""

    requantized: dict[str, float] = field(default_factory=dict)
    residual_layers: int = 0
    adapter_rank: int | None = None


def export_compressed_tensors(
    model: nn.Module,
    out_dir: str | os.PathLike,
    *,
    tokenizer=None,
    overwrite: bool = False,
    base_model_id: str | None = None,
) -> CompressedTensorsExport:
    """Write ``model`` (packed INT4 layers, optionally a PEFT model with LoRA adapters) as a compressed-tensors folder
    at ``out_dir``, atomically; adapters go beside the weights in PEFT format. Returns :class:`CompressedTensorsExport`:
    the relative weight error of each layer that had to be re-quantized (see the module docstring; empty when none)
    and the adapter's rank when it carries fractional zero points.

    Load it without hf-lowprec (``pip install compressed-tensors``)::

        # with its adapters, when it has them and PEFT is installed
        model = AutoModelForCausalLM.from_pretrained(out_dir)
    """
    check_output_dir(Path(out_dir), overwrite, getattr(model, "name_or_path", None))
    with atomic_output_dir(out_dir, overwrite) as tmp:
        return write_compressed_tensors(model, tmp, tokenizer=tokenizer, base_model_id=base_model_id)


def write_compressed_tensors(
    model: nn.Module, folder: Path, *, tokenizer=None, base_model_id: str | None = None
) -> CompressedTensorsExport:
    """:func:`export_compressed_tensors` into an existing empty ``folder`` (not atomic)."""
    peft = isinstance(model, PeftModel)
    base = model.get_base_model() if peft else model
    state, quantization_config, errors, residuals = compressed_tensors_state(base, residual_carriers(model))
    config = copy.deepcopy(base.config)
    config.quantization_config = quantization_config
    config.use_cache = True
    with without_hf_quantizer(base):
        base.save_pretrained(folder, state_dict=state)
    config.save_pretrained(folder)
    done = CompressedTensorsExport(requantized=errors, residual_layers=len(residuals))
    if peft:
        save_adapters(model, folder, base_model_id)
        if residuals:
            group_size = quantization_config["config_groups"]["group_0"]["weights"]["group_size"]
            done.adapter_rank = add_zero_residuals(folder, residuals, group_size)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return done
