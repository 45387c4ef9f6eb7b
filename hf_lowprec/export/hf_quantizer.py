"""transformers integration, ``quant_method: hf_lowprec``: ``from_pretrained`` of folders whose linears are packed
INT4, and quantize-on-load of dense checkpoints.

A folder saved by :func:`hf_lowprec.ondevice.export_int4_lora` holds ``qweight``/``step``/``zero``
tensors for the packed layers and, in ``config.json``::

    "quantization_config": {"quant_method": "hf_lowprec", "plan": {"default": "int4-g64", "layers": {...}}}

Importing ``hf_lowprec`` registers this method with transformers (``register_quantization_config`` /
``register_quantizer``; see :mod:`hf_lowprec.integrations`), so ``AutoModelForCausalLM.from_pretrained(folder)``
builds the model with empty packed layers where the plan says ``int4`` (or per-channel ``int8``) and loads the
codes into them. Without ``import hf_lowprec`` transformers warns "Unknown quantization type" and would start the
packed layers from random weights; the one-byte ``weight`` each packed layer also stores (:func:`with_load_guards`)
makes it stop with a size-mismatch error instead. Folders written before those guards load as well.

A dense checkpoint is packed as it loads::

    AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, quantization_config=HfLowprecConfig())

transformers reads one tensor at a time when a quantizer packs on the fly; each weight the plan packs is
rounded to nearest as it arrives (:meth:`~hf_lowprec.modules.PackedLinear.from_weight`) and its dense copy is
dropped, its pages in transformers' memory map of the file too (:mod:`hf_lowprec.file_pages`), so the dense model
never exists whole: peak memory is near the packed model plus one weight.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Collection

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING
from transformers.utils.quantization_config import QuantizationConfigMixin

from hf_lowprec.allocator import freed_memory_returned
from hf_lowprec.file_pages import file_mappings, release_file_bytes
from hf_lowprec.formats import FormatSpec
from hf_lowprec.layers import canonical_name, set_module, swap_layers
from hf_lowprec.modules.packed import KEPT_DENSE, PackedLinear, PackedWeightRead, compact_steps, packed_class
from hf_lowprec.modules.packed_embedding import (
    PackedEmbedding,
    TiedPackedEmbedding,
    drop_tie_record,
    embedding_scale,
    share_packed_head,
    tied_head_names,
)
from hf_lowprec.plan import PrecisionPlan, is_auto, resolve_plan
from hf_lowprec.pread_safetensors import read_safetensors

logger = logging.getLogger(__name__)

QUANT_METHOD = "hf_lowprec"
LOAD_GUARD = "weight"  # a one-byte tensor under this name per packed layer in a packed folder: see with_load_guards


class HfLowprecConfig(QuantizationConfigMixin):
    """``quantization_config`` of hf_lowprec's packed base: the precision plan that says which linears are packed.

    ``plan``: in a packed folder's ``config.json``, the plan it was packed with. Passed to ``from_pretrained`` of a
    dense checkpoint, what to pack while loading: ``None`` (every Linear in ``int4-g64-asym`` but the output head,
    as :func:`hf_lowprec.ondevice.int4_plan`), a format name, a :class:`PrecisionPlan`, its dict, or a plan file. Only
    formats that pack (int4; per-channel ``int8``) and high precision can be applied while loading.

    ``exact_kernels``: in a packed folder's ``config.json``, that its steps were learned with exact kernels
    (``learn_steps``): its packed layers' ``backend="auto"`` then never picks ``int8``'s forward; passed for a dense
    checkpoint, the layers packed while loading compute so (as the folder they save to says).
    """

    def __init__(
        self, plan: "PrecisionPlan | dict | str | os.PathLike | None" = None, exact_kernels: bool = False, **kwargs
    ):
        unknown = sorted(set(kwargs) - {"quant_method"})  # config.json's quant_method comes back as a keyword
        if unknown or kwargs.get("quant_method", QUANT_METHOD) != QUANT_METHOD:
            bnb_words = any(k.startswith(("bnb_", "load_in_")) for k in unknown)  # a BitsAndBytesConfig's
            bnb = " (HfLowprecConfig() alone is the 4-bit load; from_pretrained(dtype=...) the compute dtype)"
            raise ValueError(
                f"HfLowprecConfig got unknown option(s) {unknown or kwargs}; allowed: plan, exact_kernels"
                f" (quant_method: {QUANT_METHOD!r})" + (bnb if bnb_words else "")
            )
        if not isinstance(exact_kernels, bool):  # bool("no") is True
            raise ValueError(f"HfLowprecConfig exact_kernels must be True or False, got {exact_kernels!r}")
        self.quant_method = QUANT_METHOD
        self.plan = _plan_argument(plan)
        self.exact_kernels = exact_kernels

    def to_dict(self) -> dict:
        return {"quant_method": QUANT_METHOD, "plan": self.plan, "exact_kernels": self.exact_kernels}


def _plan_argument(plan) -> "dict | str | None":
    """``plan`` as ``HfLowprecConfig`` keeps it: a plan dict, or ``None``/a format name (resolved against the model,
    whose output head they keep dense, when it is built)."""
    if plan is None or isinstance(plan, FormatSpec):
        return None if plan is None else plan.name
    if is_auto(plan):
        raise ValueError(
            "quantization_config plan 'auto' needs calibration tokens for its sensitivity scan; use "
            "hf_lowprec.load_int4_lora(path, plan='auto', calibration=...)"
        )
    if isinstance(plan, dict):
        return PrecisionPlan.from_dict(plan, source="quantization_config.plan").to_dict()
    resolved = resolve_plan(plan)  # a plan, a file or folder, or a format name (checked here)
    return plan if isinstance(plan, str) and resolved == PrecisionPlan.uniform(plan) else resolved.to_dict()


class HfLowprecQuantizer(HfQuantizer):
    """Loads packed folders (empty packed shells filled from the codes) and packs dense checkpoints while loading."""

    requires_calibration = False  # a dense checkpoint is rounded to nearest; calibrated roundings: load_int4_lora

    def __init__(self, quantization_config: HfLowprecConfig, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.to_pack: dict[str, FormatSpec] = {}  # full module name -> format, for a dense checkpoint
        self.tied: tuple[str, str] | None = None  # (head, embedding) when the plan packs a head tied to the embedding
        self.sources: dict = {}  # checkpoint key -> where its bytes lie in a safetensors file (a PreadSlice)
        self._mappings: list | None = None  # this load's mappings of those files, read at the first release
        self._earlier_mappings: set = set()  # mappings the process held before this load (other models' files)
        self.compute_dtype: torch.dtype | None = None  # the packed layers' steps: the dtype the model loads in

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        if self.pre_quantized:
            plan = PrecisionPlan.from_dict(self.quantization_config.plan)
            stored = set(_safetensors_index(checkpoint_files))
            install_packed_shells(model, plan, self.quantization_config.exact_kernels, stored)
            for module in model.modules():  # what the plan keeps dense; their adapters reload in fp32, as trained
                if type(module) is nn.Linear:
                    setattr(module, KEPT_DENSE, True)
            guards = {rf"(^|\.){re.escape(key)}$" for key in with_load_guards(model, {})}  # expected: skipped quietly
            model._keys_to_ignore_on_load_unexpected = set(model._keys_to_ignore_on_load_unexpected or ()) | guards
        else:
            plan = packing_plan(model, self.quantization_config.plan)
            self.quantization_config.plan = plan.to_dict()  # the folder's config.json says what was packed
            self.to_pack = _packed_layers(model, plan)
            tied = tied_head_names(model)
            if tied is not None and tied[1] in self.to_pack and self.to_pack[tied[1]] != self.to_pack.get(tied[0]):
                kept = "kept dense"  # (a packed head alone: the embedding reads its table, below)
                formats = [getattr(self.to_pack.get(name), "name", kept) for name in tied]
                raise ValueError(
                    f"{tied[0]!r} is tied to {tied[1]!r} (one table): the plan gives them {formats[0]} and "
                    f"{formats[1]}; give both one format"
                )
            if tied is not None and tied[0] in self.to_pack:  # the checkpoint holds the table as the embedding's
                self.tied, self.to_pack[tied[1]] = tied, self.to_pack[tied[0]]
                drop_tie_record(model, tied[0])  # tied through the codes instead
            self.sources = _safetensors_index(checkpoint_files)
            self._earlier_mappings = set(file_mappings() or [])
            self.compute_dtype = model.dtype  # the dtype asked for: the skeleton is made in it
            if self.compute_dtype == torch.float32:
                _read_packed_weights_as_stored(model, self.to_pack)
            logger.info("packing %d linears while loading (%s)", len(self.to_pack), plan.format_summary(model))
        model.hf_lowprec_plan = plan
        _guard_inits(model)

    def _process_model_after_weight_loading(self, model, **kwargs):
        """Pack the planned linears whose weight the checkpoint does not hold (an output head tied to the embedding);
        the layers packed while loading take ``exact_kernels`` (the shells of a packed folder have it already)."""
        for fqn in self.to_pack:
            linear = model.get_submodule(fqn)
            if isinstance(linear, nn.Linear):
                _pack(model, fqn, linear.weight, self.to_pack[fqn], self.compute_dtype)
        if self.to_pack:
            for module in model.modules():
                if isinstance(module, PackedLinear):
                    module.exact_kernels = self.quantization_config.exact_kernels
        for module in model.modules():  # initialised: their own _init_weights again
            vars(module).pop("_init_weights", None)
        return model

    def checkpoint_mappings(self) -> list:
        """This load's memory mappings of the checkpoint's files: transformers maps every file before it converts the
        first weight, so they are read from ``/proc/self/maps`` once, not once per packed weight. A mapping the process
        held before the load is another model's (a dense copy of the same checkpoint loaded earlier): releasing its
        pages would revert those it wrote to (trained or edited weights) to the file's bytes, so it is left alone."""
        if self._mappings is None:
            files = {os.path.realpath(s.path) for s in self.sources.values()}
            now = file_mappings() or []
            self._mappings = [m for m in now if m.path in files and m not in self._earlier_mappings]
        return self._mappings

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        module_name, _, tensor = param_name.rpartition(".")
        return tensor == "weight" and module_name in self.to_pack

    def get_quantize_ops(self):
        return PackOnLoad(self)

    def is_serializable(self) -> bool:
        return True

    def get_state_dict_and_metadata(self, model):
        """``save_pretrained``'s state dict: the model's, with the load guards (:func:`with_load_guards`)."""
        return with_load_guards(model, model.state_dict()), {}

    @property
    def is_trainable(self) -> bool:
        return True  # the base stays frozen; adapters (PEFT) train on top, gradients pass through the codes

    @torch.no_grad()
    def _dequantize(self, model, dtype=None):
        """``model.dequantize()``: every packed linear and embedding, in place, as the plain ``nn.Linear`` /
        ``nn.Embedding`` holding its dequantized weight in ``dtype`` (default the model's), ties kept. Refused under
        PEFT adapters (their layers wrap the packed ones: merge them with ``export_int4_lora(..., merge=True,
        merged_dtype=...)``) and for an embedding that scales its rows (Gemma's class cannot be rebuilt here)."""
        kinds = (PackedLinear, PackedEmbedding, TiedPackedEmbedding)
        packed = {n: m for n, m in model.named_modules() if isinstance(m, kinds)}
        if any(".base_layer" in n for n in packed):
            raise ValueError(
                "dequantize() the base before adding LoRA adapters; to fold trained adapters into dense weights use "
                "hf_lowprec.export_int4_lora(model, out, merge=True, merged_dtype='bf16')"
            )
        scaled = [n for n, m in packed.items() if not isinstance(m, PackedLinear) and m.scale is not None]
        if scaled:
            raise ValueError(f"cannot dequantize the scaled packed embedding {scaled[0]!r}; load the checkpoint dense")
        dtype = dtype or model.dtype
        for fqn, m in packed.items():
            if isinstance(m, PackedLinear):
                dense = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
                dense.weight = nn.Parameter(m.dequantized_weight(dtype))  # trainable, as a dense load's
                if m.bias is not None:
                    dense.bias = nn.Parameter(m.bias.detach().to(dtype))
                set_module(model, fqn, dense)
        heads = {id(m): n for n, m in packed.items() if isinstance(m, PackedLinear)}  # a tied embedding's table
        for fqn, m in packed.items():
            if not isinstance(m, PackedLinear):
                table = model.get_submodule(heads[id(m.table)]).weight if id(m.table) in heads else None
                weight = table if table is not None else nn.Parameter(m.dequantized_weight(dtype))
                dense = nn.Embedding(m.num_embeddings, m.embedding_dim, getattr(m, "padding_idx", None), device="meta")
                dense.weight = weight
                set_module(model, fqn, dense)
        vars(model).pop("hf_lowprec_plan", None)  # a dense model now: no plan its layers compute
        for m in model.modules():
            vars(m).pop(KEPT_DENSE, None)
        return model


class PackOnLoad(ConversionOps):
    """transformers' loading op for one weight the plan packs: puts a packed layer holding its round-to-nearest codes
    in the ``nn.Linear``'s place (its bias, loaded or not yet, moves along) and keeps nothing dense."""

    def __init__(self, quantizer: HfLowprecQuantizer):
        self.quantizer = quantizer

    def convert(
        self, input_dict: dict, model=None, full_layer_name: str | None = None, missing_keys=None, source_patterns=(),
        **kwargs,
    ):  # fmt: skip
        (value,) = input_dict.values()
        weight = value[0] if isinstance(value, list) else value
        module_name = full_layer_name.rpartition(".")[0]
        tied = self.quantizer.tied
        head = tied[0] if tied is not None and module_name == tied[1] else module_name  # a tied table packs the head
        # the packing's temporaries go back to the system: glibc otherwise fragments them between the packed codes
        # (Llama-3.2-1B shape: load peak 1.29 GB in 3 runs, against 1.29-1.67 GB in 7 without; 12 s of loading, not 6)
        with freed_memory_returned():
            _pack(model, head, weight, self.quantizer.to_pack[module_name], self.quantizer.compute_dtype)
        for key in source_patterns:  # a renamed weight's checkpoint key (a converter's are patterns: not in the index)
            source = self.quantizer.sources.get(key)
            if source is not None:  # read through transformers' memory map: its pages are not needed any more
                release_file_bytes(source.path, source.offset, source.nbytes, self.quantizer.checkpoint_mappings())
        if head != module_name:
            share_packed_head(model, tied)
        if missing_keys is not None:
            missing_keys.difference_update({full_layer_name, f"{head}.weight"})
        return {}


def _guard_inits(model: nn.Module) -> None:
    """Have the ``_init_weights`` of ``model`` and its sub-models pass over a module whose initialisation reads a
    packed child's dense weight (:class:`PackedWeightRead`) while transformers initialises what the checkpoint did
    not hold: T5's initialises its attention's ``q``/``k``/``v``/``o`` from the attention module, whose tied keys
    started it, and the packed load failed. Packed layers themselves are initialised (``_is_hf_initialized``);
    :meth:`HfLowprecQuantizer._process_model_after_weight_loading` takes the guards off."""
    from transformers import PreTrainedModel  # here: at import, modeling_utils' import hook registers this module

    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            module._init_weights = functools.partial(_init_unless_packed, module._init_weights)


def _init_unless_packed(init_weights, module: nn.Module) -> None:
    try:
        init_weights(module)
    except PackedWeightRead:  # the packed children hold the checkpoint's codes, which no initialisation replaces
        logger.debug("%s: its initialisation reads a packed layer's weight; passed over", type(module).__name__)


def _pack(model: nn.Module, fqn: str, weight, spec: FormatSpec, dtype: torch.dtype | None) -> None:
    """Put in the place of ``model``'s ``nn.Linear`` (its bias moves along) or ``nn.Embedding`` ``fqn`` a packed layer
    of ``weight`` (as the checkpoint stores it) computing in ``dtype`` (default: the weight's), its steps
    a frozen base's (``compact_steps``)."""
    module = model.get_submodule(fqn)
    if isinstance(module, nn.Embedding):
        packed = PackedEmbedding.from_weight(weight, spec, module.padding_idx, embedding_scale(module), dtype)
        compact_steps(packed)
    else:
        packed = compact_steps(packed_class(spec).from_weight(weight, spec, dtype=dtype))
        packed.bias = module.bias
    packed._is_hf_initialized = True  # transformers initialises the weights of modules without it
    set_module(model, fqn, packed)


def _read_packed_weights_as_stored(model: nn.Module, to_pack: dict) -> None:
    """Have transformers hand the weights it packs over in the checkpoint's dtype, not cast to fp32 first (for a model
    loading in fp32: the cast is exact, so the codes are the same).

    Packing reads a weight a slice of rows at a time in fp32 (``from_weight``); a whole cast beforehand made an fp32
    model's load peak a 1 GB copy of a 128k-vocabulary table (Llama-3.2-1B shape: 1.91 GB, ``benchmarks/scale.py``
    with the AVX2 class's fp32 compute). transformers casts each checkpoint tensor to the dtype
    of the model's dtype plan (``_get_dtype_plan``: glob patterns -> dtype, made for ``_keep_in_fp32_modules``) and
    to the model's dtype otherwise; ``None`` there keeps the tensor's own. Written as an instance override of that
    method because transformers offers a quantizer no say in it."""
    keep = {f"{name}.weight": None for name in to_pack}
    dtype_plan = model._get_dtype_plan
    model._get_dtype_plan = lambda dtype: {**keep, **dtype_plan(dtype)}


def _safetensors_index(checkpoint_files) -> dict:
    """``{checkpoint key: PreadSlice}`` (where each tensor's bytes lie) of the ``.safetensors`` among
    ``checkpoint_files`` (none for a ``state_dict`` loaded from elsewhere); nothing is read but the headers."""
    index = {}
    for file in checkpoint_files or ():
        if str(file).endswith(".safetensors"):
            index.update(read_safetensors(file))
    return index


def packing_plan(model: nn.Module, plan: "dict | str | None") -> PrecisionPlan:
    """The plan :class:`HfLowprecConfig` applies while loading ``model`` (its layers still on the meta device); raises
    ``ValueError`` for a plan that packs nothing, a layer narrower than its group, or a format that cannot be packed."""
    from hf_lowprec.ondevice.planning import check_quantizable, int4_plan  # ondevice imports transformers' models

    plan = int4_plan(model, plan)
    check_quantizable(model, plan)
    dense_only = _unpacked_formats(plan.assign(model).values())
    if dense_only:
        raise ValueError(
            f"quantize-on-load packs int4 formats (without -sq) and per-channel int8; the plan also has "
            f"{', '.join(dense_only)}: load the model dense and apply_plan it, or use hf_lowprec.load_int4_lora"
        )
    return plan


def packs_on_load(plan) -> bool:
    """Whether :class:`HfLowprecConfig` can apply ``plan`` (any ``plan=`` argument) while loading: not ``auto``, and
    each low-precision format in it packs."""
    if plan is None:
        return True
    if is_auto(plan):
        return False
    resolved = resolve_plan(plan)
    return not _unpacked_formats([resolved.default, *resolved.layers.values()])


def _unpacked_formats(specs) -> list[str]:
    """The low-precision formats among ``specs`` that cannot be packed as the weights are read, by name: those no packed
    layer stores (fp8, nf4, grouped int8) and the smoothed ones (``-sq``: calibrated on activations)."""
    return sorted({s.name for s in specs if not s.is_high_precision and (packed_class(s) is None or s.smooth)})


def _packed_layers(model: nn.Module, plan: PrecisionPlan) -> dict[str, FormatSpec]:
    """``{full module name: format}`` of the eligible ``nn.Linear`` and ``nn.Embedding`` layers ``plan`` packs (not
    an embedding subclass computing more than a lookup: OPT's learned positions)."""
    assigned = plan.assign(model)
    formats = {
        fqn: assigned.get(canonical_name(fqn))
        for fqn, m in model.named_modules()
        if isinstance(m, (nn.Linear, nn.Embedding))
    }
    return {fqn: spec for fqn, spec in formats.items() if spec is not None and packed_class(spec)}


def install_packed_shells(
    model: nn.Module, plan: PrecisionPlan, exact_kernels: bool = False, stored: Collection[str] = ()
) -> int:
    """Replace each ``nn.Linear`` the plan puts in a packed format (int4; per-channel int8) by an empty packed
    layer of that format (same device/dtype; ``exact_kernels`` as :class:`HfLowprecConfig` says). An embedding tied to
    a packed head reads the head's codes, unless the folder's tensors (``stored`` keys) hold its own dense table: a
    model trained with a fake-quantized head and a dense embedding on one weight, exported with both, loads untied."""
    packed = _packed_layers(model, plan)

    def shell(name: str, fqn: str, module: nn.Module) -> nn.Module | None:
        if fqn not in packed:
            return None
        w, spec = module.weight, packed[fqn]
        if isinstance(module, nn.Embedding):
            return PackedEmbedding.empty(*w.shape, spec, w.dtype, w.device, module.padding_idx, embedding_scale(module))
        shape = (module.in_features, module.out_features)
        layer = packed_class(spec)(*shape, spec, module.bias is not None, w.dtype, w.device)
        layer.exact_kernels = exact_kernels
        return layer

    tied = tied_head_names(model)
    count = swap_layers(model, shell)
    # a packed head beside the dense embedding's own table: the embedding keeps it (a dense head stays tied: the folder
    # holds their one table under the embedding's name, and untied, the head started from random weights)
    own_table = tied is not None and f"{canonical_name(tied[1])}.weight" in stored
    if own_table and tied[0] in packed and tied[1] not in packed:
        drop_tie_record(model, tied[0])
    elif tied is not None:
        share_packed_head(model, tied)  # a packed folder holds a tied table once, as the head's codes
    return count


def with_load_guards(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (a packed folder's tensors, keys without PEFT's wrappers) plus a one-byte ``<layer>.weight`` for each
    packed linear of ``model``. transformers without ``import hf_lowprec`` knows no packed layers and would start them
    from random weights with a warning; this tensor's shape makes it stop with a size-mismatch error instead. With the
    import, the loader skips these keys (they are in no model's state dict)."""
    names = {canonical_name(n) for n, m in model.named_modules() if isinstance(m, PackedLinear)}
    return {**state, **{f"{name}.{LOAD_GUARD}": torch.zeros(1, dtype=torch.uint8) for name in sorted(names)}}


def quantization_config_dict(plan: PrecisionPlan, model: nn.Module) -> dict:
    """The ``quantization_config`` entry for ``config.json`` of a packed folder made with ``plan`` from ``model``."""
    exact = any(isinstance(m, PackedLinear) and m.exact_kernels for m in model.modules())
    return HfLowprecConfig(plan.to_dict(), exact_kernels=exact).to_dict()


def register() -> None:
    """Make ``from_pretrained`` understand ``quant_method: hf_lowprec`` (once; :mod:`hf_lowprec.integrations` calls
    it when transformers is imported)."""
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(HfLowprecConfig)
        register_quantizer(QUANT_METHOD)(HfLowprecQuantizer)


register()
