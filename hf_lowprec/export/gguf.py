"""GGUF export for llama.cpp (and what runs on it: Ollama, LM Studio): a trained INT4 base + LoRA run as the two
files llama.cpp takes, ``llama-completion -m model.gguf --lora adapter.gguf``.

- ``model.gguf``: the frozen base. Each packed INT4 layer's codes go into ``Q4_1`` blocks as they are: an
  asymmetric INT4 group ``w = step * (code - zero)`` of 32, 64 or 128 weights is one, two or four ``Q4_1`` blocks
  ``w = d * q + m`` with ``q = code``, ``d = step``, ``m = -step * zero`` (a symmetric code ``c`` in [-8, 7]: ``q =
  c + 8``, ``m = -8 * step``), the learned steps and zero points included; only ``d`` and ``m`` round, to fp16. A
  packed int8 layer (one step per row) is ``Q8_0`` blocks of its codes with the row's step. A packed embedding is the
  token table in its codes' blocks (a tied head's, or an untied table's own). Layers kept dense are stored in their
  dtype (bf16, or fp32 as f32); norms and biases (llama.cpp's optional ``attn_q.bias`` ... ``ffn_down.bias``; not
  read by transformers' GGUF loader) in f32.
- ``adapter.gguf``: the LoRA adapters as llama.cpp's LoRA adapter file (``A [r, in]``, ``B [out, r]`` in f32,
  ``alpha``), applied at load with llama.cpp's ``scale = alpha / r``, PEFT's.

Llama-architecture models with a byte-level BPE tokenizer (SmolLM2, Llama 3.x, ...), Llama 3's rope scaling included.
The rows of the query and key projections are reordered as llama.cpp's rotary embedding reads them (its converter's
``permute``), codes, steps and LoRA ``B`` alike. Written here because llama.cpp's converter reads dense checkpoints
and re-quantizes them, which would lose what the trained codes, steps and adapters hold; ``gguf`` (llama.cpp's
Python package) writes the file.
"""

from __future__ import annotations

import json
import logging
import math
import tempfile
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import nn

from hf_lowprec.layers import ADAPTER_PARTS, canonical_name, eligible_layers
from hf_lowprec.modules import PackedInt8Linear, PackedLinear
from hf_lowprec.modules.packed_embedding import PackedEmbedding, TiedPackedEmbedding, tied_head_names

logger = logging.getLogger(__name__)

MODEL_FILE, ADAPTER_FILE = "model.gguf", "adapter.gguf"
BLOCK = 32  # weights per Q4_1 / Q8_0 block
CHUNK_ROWS = 4096  # rows of a packed layer turned into blocks at a time
# Llama 3's split (its tiktoken pattern, as transformers' TikTokenConverter writes it): llama.cpp's llama-bpe type
LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# tokenizer.json pre-tokenizers as llama.cpp names them (tokenizer.ggml.pre); others get "default", with a warning
PRE_TOKENIZERS = {
    (("ByteLevel", True),): "gpt-2",
    (("Digits", True), ("ByteLevel", False)): "smollm",
    (("Split", LLAMA3_SPLIT), ("ByteLevel", False)): "llama-bpe",
}


def export_gguf(model: nn.Module, tokenizer, folder: Path, name: str) -> dict:
    """Write ``model.gguf`` (and ``adapter.gguf`` for a PEFT model) into ``folder``; returns what was written:
    ``{"files", "tensor_types", "max_scale_error"}`` (the largest error of a decoded weight, its block's ``d``/``m``
    rounded to fp16, in units of the block's trained step: ``m`` makes up ``d``'s rounding at the middle of the block's
    codes, so an all-zero block decodes exactly whatever its step)."""
    peft = getattr(model, "peft_config", None) is not None
    base = model.get_base_model() if peft else model
    config = base.config
    layers = eligible_layers(base)
    _check_supported(base, model if peft else None, layers)
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    tied = tied_head_names(base)
    head, embedding = (canonical_name(n) for n in tied) if tied else (None, None)
    # an untied packed embedding's own codes are the token table's blocks, rows as they are
    packed = {n: m.table if isinstance(m, PackedEmbedding) else m for n, m in layers.items()
              if isinstance(m, (PackedLinear, PackedEmbedding, TiedPackedEmbedding))}  # fmt: skip
    writer = gguf.GGUFWriter(folder / MODEL_FILE, "llama", use_temp_file=True)  # each tensor leaves memory as added
    _write_metadata(writer, config, name)
    _write_tokenizer(writer, tokenizer, config.vocab_size)
    types: Counter[str] = Counter()
    for key, tensor in _dense_tensors(base, packed, head):
        kind = gguf.GGMLQuantizationType.BF16 if tensor.dtype == torch.bfloat16 and tensor.dim() > 1 else None
        stored = names.get_name(key, try_suffixes=(".weight", ".bias"))
        _add(writer, stored, _rotary(tensor.detach().float(), key, heads), kind, types)
    errors = [0.0]
    for layer_name, module in packed.items():
        if isinstance(module, TiedPackedEmbedding):
            continue  # it reads the tied head's codes, written below as the table
        blocks, kind, error = _packed_blocks(module, _rotary_order(layer_name, module.out_features, heads))
        stored = embedding if layer_name == head else layer_name  # a tied head: GGUF keeps one table, token_embd
        writer.add_tensor(names.get_name(f"{stored}.weight", try_suffixes=(".weight",)), blocks, raw_dtype=kind)
        types[kind.name] += 1
        errors.append(error)
    if (factors := _llama3_rope_factors(config)) is not None:
        _add(writer, gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", factors, None, types)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    _finish(writer)
    files = [MODEL_FILE]
    if peft:
        _write_adapter(model, folder / ADAPTER_FILE, names, heads, name)
        files.append(ADAPTER_FILE)
    return {"files": files, "tensor_types": dict(types), "max_scale_error": max(errors)}


def _dense_tensors(base: nn.Module, packed: dict, head: str | None):
    """``(key, tensor)`` of what is stored dense: every ``.weight`` and ``.bias`` of the state dict (PEFT wrappers
    stripped, adapters left out) but the packed layers' codes and steps and a tied head's weight. Biases (Llama's
    ``attention_bias``/``mlp_bias``), packed layers' included, are llama.cpp's optional ``*.bias`` tensors."""
    for key, tensor in base.state_dict().items():
        key = canonical_name(key)
        module, leaf = key.rsplit(".", 1)
        if any(part in ADAPTER_PARTS for part in key.split(".")):
            continue
        if leaf == "bias":
            yield key, tensor
        elif module not in packed and module != head:
            if leaf != "weight":
                raise ValueError(f"{key}: GGUF's llama layout has no place for it")
            yield key, tensor


def _check_supported(base: nn.Module, peft_model, layers: dict[str, nn.Module]) -> None:
    """``ValueError`` naming what this export cannot write: another architecture, rope scaling, LoRA variants, a LoRA on
    an embedding or on a tied head, a scaled packed embedding, codes of a rotated or rescaled weight, groups that are
    not whole blocks."""
    config = base.config
    if config.model_type != "llama":
        raise ValueError(
            f"GGUF export writes Llama-architecture models (model_type 'llama'), not {config.model_type!r}; export "
            "--format bf16 and convert that with llama.cpp's convert_hf_to_gguf.py"
        )
    if (rope := _rope(config)).get("rope_type", "default") not in ("default", "llama3"):
        raise ValueError(
            f"GGUF export writes no rope scaling but Llama 3's, not {rope['rope_type']!r}; export --format bf16 and "
            "convert that with llama.cpp's convert_hf_to_gguf.py"
        )
    if peft_model is not None:
        from peft.tuners.lora import LoraLayer

        for adapter in peft_model.peft_config.values():
            if getattr(adapter, "use_dora", False) or getattr(adapter, "use_rslora", False):
                raise ValueError("GGUF adapters hold plain LoRA (scale alpha / r): not DoRA or rsLoRA")
        alpha = next(iter(peft_model.peft_config.values())).lora_alpha
        tied = tied_head_names(base)
        for fqn, module in peft_model.named_modules():  # checked before model.gguf is written: no half export
            if isinstance(module, LoraLayer) and module.lora_embedding_A:  # it was left out of the adapter file
                raise ValueError(
                    f"{canonical_name(fqn)}: an embedding's LoRA, which this GGUF export does not write; export "
                    "--format native (or bf16 with the adapters merged), or target Linear layers only"
                )
            if isinstance(module, LoraLayer) and tied and canonical_name(fqn) == canonical_name(tied[0]):
                raise ValueError(
                    f"{canonical_name(fqn)}: a LoRA on the output head tied to the token embedding; GGUF holds the "
                    "two as one tensor, token_embd, and llama.cpp finds no output.weight to adapt; export --format "
                    "native (or bf16 with the adapters merged), or leave the head out of lora.target_modules"
                )
            rank = module.r.get("default") if isinstance(module, LoraLayer) else None
            if rank and module.scaling["default"] != alpha / rank:
                raise ValueError(
                    f"{canonical_name(fqn)}: its LoRA scale is not alpha / r (a per-layer rank or alpha pattern), "
                    "the one scale llama.cpp's adapter file holds"
                )
    for name, module in layers.items():
        if isinstance(module, PackedEmbedding):
            if module.scale is not None:
                raise ValueError(f"{name}: a scaled embedding (x{module.scale:g}) has no place in GGUF's llama layout")
            module = module.table  # its codes become the token table's blocks
        if not isinstance(module, PackedLinear):
            continue
        spec = module.spec
        if spec.rotate or not torch.all(module.input_scale == 1):
            kind = "a rotated (-rht)" if spec.rotate else "an activation-scaled (AWQ)"
            raise ValueError(
                f"{name}: {spec.name} codes of {kind} weight, which GGUF's blocks cannot hold; export --format bf16 "
                "and convert that with llama.cpp's convert_hf_to_gguf.py, or train with rounding nearest or gptq"
            )
        if spec.family == "int4" and (spec.group_size or module.in_features) % BLOCK or module.in_features % BLOCK:
            shape = f"{spec.name} groups of a {module.in_features}-input layer"
            raise ValueError(f"{name}: {shape} are not whole {BLOCK}-weight blocks")


def _rotary_order(module_name: str, rows: int, heads: dict[str, int]) -> torch.Tensor | None:
    """The row order llama.cpp reads a query/key projection of ``rows`` rows in (its converter's ``permute``: the two
    rotary halves of each head interleaved), else ``None``."""
    n = heads.get(module_name.rsplit(".", 1)[-1])
    if n is None:
        return None
    return torch.arange(rows).reshape(n, 2, rows // n // 2).transpose(1, 2).reshape(-1)


def _rotary(tensor: torch.Tensor, key: str, heads: dict[str, int]) -> torch.Tensor:
    order = _rotary_order(key.rsplit(".", 1)[0], tensor.shape[0], heads)
    return tensor if order is None else tensor[order]


def _add(writer, name: str, tensor: torch.Tensor, kind, types: Counter) -> None:
    """A dense tensor: bf16 as ``BF16``, everything else as ``F32``."""
    if kind == gguf.GGMLQuantizationType.BF16:
        data = tensor.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        writer.add_tensor(name, data, raw_shape=tuple(tensor.shape), raw_dtype=kind)
    else:
        kind = gguf.GGMLQuantizationType.F32
        writer.add_tensor(name, tensor.numpy().astype(np.float32))
    types[kind.name] += 1


def _packed_blocks(layer: PackedLinear, order) -> tuple[np.ndarray, gguf.GGMLQuantizationType, float]:
    """``(uint8 [N, K / 32 * bytes per block], its GGML type, largest fp16 rounding of d and m relative to d)`` of a
    packed layer's codes, its rows in ``order`` (``None``: as they are), made :data:`CHUNK_ROWS` rows at a time (a
    128k-row head's int32 temporaries whole would be gigabytes)."""
    kind = gguf.GGMLQuantizationType.Q8_0 if isinstance(layer, PackedInt8Linear) else gguf.GGMLQuantizationType.Q4_1
    n, k = layer.out_features, layer.in_features
    out = np.empty((n, k // BLOCK * gguf.GGML_QUANT_SIZES[kind][1]), dtype=np.uint8)
    order = torch.arange(n) if order is None else order
    step, zero, error = layer.effective_step().float(), layer.effective_zero(), 0.0
    for start in range(0, n, CHUNK_ROWS):
        rows = order[start : start + CHUNK_ROWS]
        codes = layer.codes(rows).to(torch.int16)
        if kind == gguf.GGMLQuantizationType.Q8_0:
            blocks, chunk_error = _q8_0_blocks(codes, step[rows])
        else:
            group = layer.spec.group_size or k
            blocks, chunk_error = _q4_1_blocks(codes, step[rows], None if zero is None else zero[rows].float(), group)
        out[start : start + len(rows)] = blocks
        error = max(error, chunk_error)
    return out, kind, error


def _q8_0_blocks(codes: torch.Tensor, step: torch.Tensor) -> tuple[np.ndarray, float]:
    """Q8_0 blocks (fp16 ``d``, 32 int8 codes) of int8 ``codes [n, K]`` with one ``step [n, 1]`` per row."""
    n, k = codes.shape
    d = step.reshape(n, 1).expand(n, k // BLOCK)
    d16 = d.half()
    payload = codes.to(torch.int8).reshape(n, k // BLOCK, BLOCK).numpy().view(np.uint8)
    head = d16.contiguous().numpy().view(np.uint8).reshape(n, k // BLOCK, 2)
    blocked = codes.reshape(n, k // BLOCK, BLOCK)
    error = _decoding_error(blocked.amin(-1), blocked.amax(-1), d, d16, torch.zeros_like(d), torch.zeros_like(d16))
    return np.concatenate([head, payload], axis=-1).reshape(n, -1), error


def _q4_1_blocks(codes: torch.Tensor, step: torch.Tensor, zero: torch.Tensor | None, group: int):
    """Q4_1 blocks (fp16 ``d``, fp16 ``m``, 32 nibbles) of INT4 ``codes [n, K]`` with ``step``/``zero`` ``[n, G]`` per
    group of ``group`` weights; and the largest error of a decoded weight in units of its block's step."""
    n, k = codes.shape
    n_blocks = k // BLOCK  # a last group narrower than the others (k not a multiple of group) has fewer blocks
    d = step.repeat_interleave(group // BLOCK, dim=1)[:, :n_blocks]
    if zero is None:  # symmetric codes in [-8, 7]
        q, m = codes + 8, -8 * d
    else:
        q, m = codes, -d * zero.repeat_interleave(group // BLOCK, dim=1)[:, :n_blocks]
    q = q.to(torch.uint8).reshape(n, n_blocks, 2, BLOCK // 2)
    low, high = q.amin((-2, -1)), q.amax((-2, -1))
    d16 = d.half()
    # m takes up d's fp16 rounding at the middle of the block's codes: a step that underflows or turns subnormal in
    # fp16 (an all-zero row's, clamped to 1e-8) left -8 d as -6e-8, 6 steps off for weights that are all 0
    m16 = (m - (d16.float() - d) * (low.float() + high.float()) / 2).half()
    error = _decoding_error(low, high, d, d16, m, m16)
    nibbles = (q[:, :, 0] | (q[:, :, 1] << 4)).numpy()  # byte j: weight j low, weight j + 16 high (block_q4_1)
    head = np.concatenate([d16.numpy()[..., None].view(np.uint8), m16.numpy()[..., None].view(np.uint8)], axis=-1)
    blocks = np.concatenate([head.reshape(n, n_blocks, 4), nibbles], axis=-1).reshape(n, -1)
    return blocks, error


def _decoding_error(low, high, d, d16, m, m16) -> float:
    """Largest ``|q d16 + m16 - (q d + m)|`` over the codes ``q`` of each block (``[n, blocks]``: ``low``/``high``
    their least and greatest, where this error, linear in ``q``, is largest), in units of the block's ``d``."""
    slope, offset = d16.float() - d, m16.float() - m
    error = torch.maximum((low.float() * slope + offset).abs(), (high.float() * slope + offset).abs())
    return float((error / d.abs().clamp_min(1e-30)).max())


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _rope(config) -> dict:
    """The config's rotary embedding parameters (``rope_parameters`` in transformers 5, ``rope_scaling`` before)."""
    return dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})


def _llama3_rope_factors(config) -> torch.Tensor | None:
    """Llama 3's rotary scaling as llama.cpp reads it, one divisor per rotary frequency (``rope_freqs``; transformers'
    ``_compute_llama3_parameters``: long wavelengths slowed by ``factor``, short ones kept, a smooth blend between);
    ``None`` without that scaling."""
    rope = _rope(config)
    if rope.get("rope_type") != "llama3":
        return None
    head_dim = _head_dim(config)
    theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    context = rope["original_max_position_embeddings"]
    wavelength = 2 * math.pi * theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    smooth = (context / wavelength - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    factors = torch.where(wavelength < context / high, 1.0, torch.where(wavelength > context / low, factor, blended))
    return factors.float()


def _write_metadata(writer, config, name: str) -> None:
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(_rope(config).get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_rope_dimension_count(_head_dim(config))
    writer.add_key_length(_head_dim(config))  # llama.cpp assumes hidden / heads without them (Llama 3.2 3B: 128)
    writer.add_value_length(_head_dim(config))
    writer.add_vocab_size(config.vocab_size)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _write_tokenizer(writer, tokenizer, vocab_size: int) -> None:
    """A byte-level BPE tokenizer as llama.cpp's ``gpt2`` model: tokens, their types, merges, special ids, chat
    template (``gguf.SpecialVocab`` reads those from the saved tokenizer, as llama.cpp's converter does). An
    embedding of ``vocab_size`` rows, more than the tokenizer has tokens (padded to a multiple), gets ``[PAD<id>]``
    tokens of type ``UNUSED`` for the rest, as llama.cpp's converter writes: llama.cpp sizes the token table by the
    token list."""
    with tempfile.TemporaryDirectory() as saved:
        tokenizer.save_pretrained(saved)
        spec = json.loads((Path(saved) / "tokenizer.json").read_text())
        if spec["model"]["type"] != "BPE" or "ByteLevel" not in json.dumps(spec.get("pre_tokenizer")):
            raise ValueError("GGUF export writes byte-level BPE tokenizers (GPT-2 style); this one is not")
        by_id = {i: t for t, i in tokenizer.get_vocab().items()}
        if max(by_id) >= vocab_size:
            raise ValueError(
                f"the tokenizer has ids up to {max(by_id)}, the model's embedding {vocab_size} rows: tokens past the "
                "table cannot be written to GGUF (resize_token_embeddings first)"
            )
        # the list is indexed by id: an id no token has (a gap) is a [PAD<id>] token, as llama.cpp's converter writes
        tokens = [by_id.get(i) for i in range(max(by_id) + 1)]
        padding = [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
        added_tokens = tokenizer.added_tokens_decoder.values()  # each one tokenizer.json marks special: a control one
        special = {t.content for t in added_tokens if t.special} | set(tokenizer.all_special_tokens)
        added = {t.content for t in added_tokens}
        writer.add_tokenizer_model("gpt2")
        cleans = tokenizer.clean_up_tokenization_spaces
        writer.add_tokenizer_pre(_pre_tokenizer(spec.get("pre_tokenizer"), [t for t in tokens if t], cleans))
        writer.add_token_list([f"[PAD{i}]" if t is None else t for i, t in enumerate(tokens)] + padding)
        kinds = gguf.TokenType
        writer.add_token_types(
            [kinds.UNUSED if t is None else kinds.CONTROL if t in special else kinds.USER_DEFINED if t in added
             else kinds.NORMAL for t in tokens] + [kinds.UNUSED] * len(padding)
        )  # fmt: skip
        gguf.SpecialVocab(saved, load_merges=True, n_vocab=vocab_size).add_to_gguf(writer)


def _pre_tokenizer(pre: dict | None, tokens: list[str], cleans_spaces: bool) -> str:
    """llama.cpp's name for a tokenizer.json ``pre_tokenizer`` (``default`` where none is known: llama.cpp then
    splits text its own default way, which may differ from the tokenizer's on digits or contractions).

    llama.cpp's ``gpt-2`` type also drops the space before punctuation when it turns tokens back into text; a
    tokenizer that keeps it (``clean_up_tokenization_spaces`` false) and holds digits one by one only (so splitting
    them apart first changes no token: SmolLM2's, once transformers has read it from a GGUF) is written as ``smollm``,
    GPT-2's split with digits apart and the spaces kept."""
    steps = pre.get("pretokenizers", [pre]) if pre else []
    key = tuple(_pre_tokenizer_step(s) for s in steps)
    name = PRE_TOKENIZERS.get(key)
    digits = set("0123456789")  # byte-level tokens spell ASCII digits as themselves
    if name == "gpt-2" and not cleans_spaces and not any(len(t) > 1 and digits & set(t) for t in tokens):
        name = "smollm"
    if name is None:
        logger.warning("GGUF export: pre-tokenizer %s has no llama.cpp name here; writing 'default'", json.dumps(pre))
    return name or "default"


def _pre_tokenizer_step(step: dict) -> tuple:
    """A tokenizer.json pre-tokenizer step as ``PRE_TOKENIZERS`` keys it: its type and what decides its split."""
    if step["type"] == "Split":
        return "Split", step["pattern"].get("Regex")
    return step["type"], step.get("individual_digits", step.get("use_regex", False))


def _write_adapter(model, path: Path, names, heads: dict[str, int], name: str) -> None:
    """llama.cpp's LoRA adapter file: per adapted layer ``<tensor>.lora_a`` ``[r, in]`` and ``.lora_b`` ``[out, r]``
    (f32), and ``adapter.lora.alpha``."""
    from peft.tuners.lora import LoraLayer

    config = next(iter(model.peft_config.values()))
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(name)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(config.lora_alpha))
    for fqn, module in model.named_modules():
        if not isinstance(module, LoraLayer) or "default" not in module.lora_A:
            continue
        layer = canonical_name(fqn)
        a = module.lora_A["default"].weight.detach().float()
        b = module.lora_B["default"].weight.detach().float()
        b = _rotary(b, f"{layer}.weight", heads)
        out = names.get_name(f"{layer}.weight", try_suffixes=(".weight",))
        writer.add_tensor(f"{out}.lora_a", a.numpy())
        writer.add_tensor(f"{out}.lora_b", b.numpy())
    _finish(writer)


def _finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
