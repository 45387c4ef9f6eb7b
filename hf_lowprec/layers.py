"""Which layers of a model hf-lowprec works on, and their names: every ``nn.Linear`` / ``nn.Embedding`` (converted
or not) outside PEFT adapters, named without PEFT's wrappers; and the one helper that puts a module in a layer's place.
"""

from __future__ import annotations

import functools
import re

from torch import nn

from hf_lowprec.modules import LOW_PRECISION_TYPES, PackedEmbedding, PackedLinear

PEFT_PREFIX = "base_model.model."
# PEFT's adapters, and the frozen original a modules_to_save layer keeps beside the copy it trains and runs
ADAPTER_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector", "original_module")
_TRAINED_COPY = re.compile(r"\.modules_to_save\.[^.]+")  # PEFT's modules_to_save wrapper's copy, per adapter
WRAPPER_PARTS = ("base_layer", "_orig_mod")  # PEFT's wrapped layer, torch.compile's wrapped model


def canonical_name(fqn: str) -> str:
    """Module name without PEFT's wrappers (``base_model.model.`` prefix, ``.base_layer`` parts, the
    ``.modules_to_save.<adapter>`` of a layer PEFT trains whole: its trained copy is the layer) nor
    ``torch.compile``'s (``_orig_mod.``): a plan names a model's layers as the plain model names them."""
    if fqn.startswith(PEFT_PREFIX):
        fqn = fqn[len(PEFT_PREFIX) :]
    return ".".join(p for p in _TRAINED_COPY.sub("", fqn).split(".") if p not in WRAPPER_PARTS)


def _is_eligible(module: nn.Module) -> bool:
    """A layer a plan converts: an ``nn.Embedding`` (a scaled word embedding too, Gemma's or Bart's: its scale is
    read, ``embedding_scale``), an ``nn.Linear`` (or a subclass computing as it does), or one hf-lowprec converted. A
    subclass with a forward of its own computes something else (Llama-4's router returns scores and logits; Bart's and
    OPT's learned positions shift their indices, a normed embedding normalises its rows): a swapped layer would not,
    so it is left as it is (unconverted); torchao's ``Float8Linear`` (a plan's FP8 layer that the Accelerate plugin
    handed to torchao) computes as its plan says, so it counts."""
    if isinstance(module, LOW_PRECISION_TYPES):
        return True
    if isinstance(module, nn.Embedding):
        # rows times a scale, nothing more: no submodule (a norm) nor parameter (T5Gemma2's eoi_embedding) besides
        alone = not any(module.children()) and set(module._parameters) == {"weight"}
        scaled_rows = hasattr(module, "embed_scale") and alone
        return type(module).forward is nn.Embedding.forward or scaled_rows
    return isinstance(module, nn.Linear) and (type(module).forward is nn.Linear.forward or is_torchao_fp8(module))


def is_torchao_fp8(module: nn.Module) -> bool:
    """Whether ``module`` is torchao's ``Float8Linear`` (named, not imported: torchao loads in seconds)."""
    kind = type(module)
    return kind.__name__ == "Float8Linear" and kind.__module__.startswith("torchao.")


def wrapper_of(model: nn.Module) -> str | None:
    """What already wrapped or sharded ``model`` for several processes (DDP, DataParallel, FSDP), or ``None``: such a
    wrapper holds references to the parameters a conversion replaces (DDP's gradient buckets would leave a new step
    parameter unsynchronised), so a model is converted before it is wrapped."""
    if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        return type(model).__name__
    if any(type(m).__name__.startswith(("FSDP", "FullyShardedDataParallel")) for m in model.modules()):
        return "FSDP"
    return None


def walk_layers(model: nn.Module):
    """``(canonical name, full name, module)`` for every eligible layer outside PEFT adapters."""
    for fqn, module in model.named_modules():
        parts = fqn.split(".")
        if any(p in ADAPTER_PARTS for p in parts) or not _is_eligible(module):
            continue
        yield canonical_name(fqn), fqn, module


def eligible_layers(model: nn.Module) -> dict[str, nn.Module]:
    """``{canonical name: module}`` for every ``nn.Linear``/``nn.Embedding`` (converted or not)."""
    return {name: module for name, _, module in walk_layers(model)}


def unconverted_layers(model: nn.Module) -> dict[str, nn.Module]:
    """``{canonical name: module}`` of the layers outside PEFT adapters that multiply by matrices of their own but are
    no layer a plan converts (:func:`_is_eligible`): transformers' ``Conv1D`` in GPT-2 (weight ``[in, out]``), an MoE's
    fused experts (``[experts, out, in]`` parameters), an ``nn.Linear`` subclass with a forward of its own (a router).
    hf-lowprec converts none of them, so a plan cannot put them in a low-precision format. Convolutions (a vision
    tower's patch embedding) and lookup tables it leaves as they are (learned positions) are not counted."""
    found = {}
    layers = {fqn for fqn, module in model.named_modules() if _is_eligible(module)}
    for fqn, module in model.named_modules():
        parts = fqn.split(".")
        if any(p in ADAPTER_PARTS for p in parts) or any(".".join(parts[:i]) in layers for i in range(1, len(parts))):
            continue  # adapters; the parts of a layer a plan converts (a converted layer's step quantizers)
        left_alone = isinstance(module, (nn.modules.conv._ConvNd, nn.Embedding))  # convolutions, lookup tables
        if not (_is_eligible(module) or left_alone) and matrix_parameters(module):
            found[canonical_name(fqn)] = module  # its own matrices, not its children's
    return found


def matrix_parameters(module: nn.Module) -> list[nn.Parameter]:
    """``module``'s own parameters of two dimensions or more (its matrices), biases and norms' scales left out, and
    tensors added by broadcasting, whose first dimension is 1 (ViT's ``cls_token`` ``[1, 1, hidden]``, its position
    embeddings ``[1, patches + 1, hidden]``): no matrix multiplies by them."""
    return [p for p in module.parameters(recurse=False) if p.dim() >= 2 and p.shape[0] > 1]


def output_head_name(model: nn.Module) -> str | None:
    """Canonical name of the model's output projection (``get_output_embeddings()``, e.g. ``lm_head``), if it has
    one."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    if head is None:
        return None
    return next((canonical_name(n) for n, m in model.named_modules() if m is head), None)


def task_head_name(model: nn.Module) -> str | None:
    """Canonical name of the layer that makes ``model``'s outputs: its output projection (:func:`output_head_name`),
    else a classifier's head: its last ``nn.Linear``, when that makes ``config.num_labels`` outputs (BERT's
    ``classifier``, a decoder's ``score``, ``qa_outputs``; a bare encoder's last Linear is no head)."""
    head = output_head_name(model)
    labels = getattr(getattr(model, "config", None), "num_labels", None)
    if head is not None or not labels:
        return head
    linears = [(n, m) for n, m in dense_views(model).items() if isinstance(m, nn.Linear)]
    return linears[-1][0] if linears and linears[-1][1].out_features == labels else None


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks in order: the outermost children of its ``nn.ModuleList``s (a transformers model's
    decoder layers, a PEFT model's too)."""
    lists = [n for n, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    named = [(f"{n}.{i}" if n else str(i), b) for n in lists for i, b in enumerate(model.get_submodule(n))]
    return [b for n, b in named if not any(n.startswith(o + ".") for o, _ in named)]


def dense_view(module: nn.Module) -> nn.Module:
    """``module``, or for a frozen packed layer (which keeps no dense weight) a meta-device ``nn.Linear`` or
    ``nn.Embedding`` of its shape (no memory): what parameter counts and format rules read."""
    if isinstance(module, PackedLinear):
        return nn.Linear(module.in_features, module.out_features, bias=False, device="meta", dtype=module.dtype)
    if isinstance(module, PackedEmbedding):
        return nn.Embedding(module.num_embeddings, module.embedding_dim, device="meta", dtype=module.table.dtype)
    return module


def dense_views(model: nn.Module) -> dict[str, nn.Module]:
    """:func:`eligible_layers`, each seen through :func:`dense_view`."""
    return {name: dense_view(m) for name, m in eligible_layers(model).items()}


def swap_layers(model: nn.Module, make_layer) -> int:
    """Put ``make_layer(name, fqn, module)`` in the place of each eligible layer (canonical and full name) for which
    it returns a module other than the one there (``None``: keep it); returns how many were swapped. The one loop
    that replaces layers (as torchao's ``swap_linear_layers``, with the plan or a type test as the filter). The new
    layer takes the old one's training mode and its forward/backward hooks (:func:`carry_module_state`)."""
    count = 0
    # names first, each module looked up when its turn comes: a list of the modules kept every replaced one alive to
    # the end (re-planning half of a 1B model's weights to int8 held all their INT4 predecessors: +270 MB)
    for name, fqn in [(name, fqn) for name, fqn, _ in walk_layers(model)]:
        module = model.get_submodule(fqn)
        new = make_layer(name, fqn, module)
        if new is not None and new is not module:
            carry_module_state(module, new)
            set_module(model, fqn, new)
            count += 1
    return count


def guard_vocabulary_resize() -> None:
    """Make transformers' ``PreTrainedModel.resize_token_embeddings`` refuse, in one line, a new vocabulary size for a
    model whose input embedding or output head is an hf-lowprec layer (or torchao's ``Float8Linear`` in a model an
    hf-lowprec plan converted); its own size, or ``None``, returns the input embedding as transformers' does.
    Transformers' own put a dense ``nn.Embedding``/``nn.Linear`` in a converted table's place (its planned format
    silently gone) or, reading a packed table's ``.weight``, failed after resizing the other table. Once, on the class
    (:mod:`hf_lowprec.integrations` runs it when transformers' model code is imported): no state on the models, every
    conversion path covered."""
    from transformers import PreTrainedModel

    resize = PreTrainedModel.resize_token_embeddings
    if getattr(resize, "hf_lowprec_guard", False):
        return

    @functools.wraps(resize)
    def resize_token_embeddings(self, new_num_tokens=None, pad_to_multiple_of=None, *args, **kwargs):
        if converted := _converted_tables(self):
            _check_size_kept(self, converted, new_num_tokens, pad_to_multiple_of)
            return self.get_input_embeddings()
        return resize(self, new_num_tokens, pad_to_multiple_of, *args, **kwargs)

    resize_token_embeddings.hf_lowprec_guard = True
    PreTrainedModel.resize_token_embeddings = resize_token_embeddings


def _converted_tables(model: nn.Module) -> dict[str, nn.Module]:
    """``{"input embedding" / "output head": layer}`` of ``model``'s vocabulary tables that are hf-lowprec layers
    (or torchao's ``Float8Linear`` where an hf-lowprec plan converted the model)."""
    tables = {}
    planned = getattr(model, "hf_lowprec_plan", None) is not None
    for role, get in (("input embedding", "get_input_embeddings"), ("output head", "get_output_embeddings")):
        try:
            table = getattr(model, get)()
        except (AttributeError, NotImplementedError):  # transformers raises NotImplementedError for a model without
            continue
        table = getattr(table, "base_layer", table)  # PEFT's wrapper
        if isinstance(table, LOW_PRECISION_TYPES) or (planned and is_torchao_fp8(table)):
            tables[role] = table
    return tables


def _check_size_kept(model: nn.Module, converted: dict[str, nn.Module], new_num_tokens, pad_to_multiple_of) -> None:
    """Return when ``resize_token_embeddings(new_num_tokens, pad_to_multiple_of)`` keeps ``model``'s vocabulary size
    (its ``converted`` tables untouched), else raise ``ValueError`` saying why and what to do."""
    embedding = model.get_input_embeddings()
    rows = getattr(embedding, "base_layer", embedding).num_embeddings
    size = rows if new_num_tokens is None else new_num_tokens
    if pad_to_multiple_of:
        size = -(-size // pad_to_multiple_of) * pad_to_multiple_of
    head = converted.get("output head")
    if size == rows and (head is None or head.out_features == rows):
        return
    names = " and ".join(f"{role} ({type(t).__name__})" for role, t in converted.items())
    raise ValueError(
        f"resize_token_embeddings({size}): this model's {names} of {rows} rows "
        f"{'are hf-lowprec layers' if len(converted) > 1 else 'is an hf-lowprec layer'}, which transformers would "
        "replace by a dense one or fail to read; resize before converting: "
        "load the checkpoint dense, resize_token_embeddings, save_pretrained, then load that with HfLowprecConfig / "
        "load_int4_lora or apply_plan it"
    )


HOOK_DICTS = (
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks",
)  # fmt: skip


def carry_module_state(old: nn.Module, new: nn.Module) -> None:
    """``new`` takes ``old``'s training mode, its hook dictionaries themselves (so that the handles the hooks' owners
    hold still remove them), where ``new`` has none of its own, and the attributes others set on ``old`` that ``new``
    lacks (what those hooks read: transformers' NEFTune hook reads ``neftune_noise_alpha``); a swapped layer lost them
    all (``model.eval()`` undone for it, a forward hook no longer called, or failing). Others' attributes: public
    ones holding data (no module, parameter or bound method), not hf-lowprec's markers, and not among the
    attributes ``old`` had when made (recorded here as ``new``'s: ``spec`` stays off a reverted ``nn.Linear``; an
    hf-lowprec layer made elsewhere, whose own ones are unknown, carries none)."""
    new.train(old.training)
    for attr in HOOK_DICTS:
        if getattr(old, attr, None) and not getattr(new, attr, None):
            setattr(new, attr, getattr(old, attr))
    own = getattr(old, "_own_attributes", vars(old) if isinstance(old, LOW_PRECISION_TYPES) else ())
    made_with = frozenset(vars(new))
    for attr, value in list(vars(old).items()):
        if attr.startswith(("_", "hf_lowprec")) or attr in own or hasattr(new, attr):
            continue
        if not isinstance(value, (nn.Module, nn.Parameter)) and not callable(value):
            setattr(new, attr, value)
    new._own_attributes = made_with


def set_module(model: nn.Module, fqn: str, new: nn.Module) -> None:
    """Put ``new`` where ``model``'s submodule ``fqn`` (full name) is."""
    parent_name, _, attr = fqn.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
