"""GGUF export: the packed INT4 base as Q4_1 blocks holding the trained codes, the LoRA adapters as llama.cpp's adapter
file; checked against gguf's own decoder, transformers' GGUF loader and the PEFT adapters, computed independently."""

import gguf
import numpy as np
import pytest
import torch
from cli_invoke import cli, one_error_line
from peft import LoraConfig
from tiny_assets import save_tiny_model, validate_card_metadata
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_lowprec import load_int4_lora
from hf_lowprec.export import RUN_FILE
from hf_lowprec.export.gguf import ADAPTER_FILE, MODEL_FILE, _q4_1_blocks, export_gguf
from hf_lowprec.modules import PackedLinear

HEADS = {"q_proj": 4, "k_proj": 2}  # the tiny model's query and key heads


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny INT4 + LoRA model as training leaves it: learned steps and zero points moved, adapters non-zero."""
    folder = save_tiny_model(tmp_path_factory.mktemp("gguf") / "tiny")
    torch.manual_seed(0)
    model, tokenizer, _ = load_int4_lora(str(folder), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"), learn_steps=True, backend="dequant", dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
            elif "step_gain" in name:
                p.uniform_(0.9, 1.1)
            elif "zero_shift" in name:
                p.uniform_(-0.3, 0.3)
    out = tmp_path_factory.mktemp("gguf-out")
    return model, tokenizer, out, export_gguf(model, tokenizer, out, "tiny")


def llama_cpp_rows(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's ``permute`` of a query/key projection, as it writes it (rows regrouped per head)."""
    return tensor.reshape(heads, 2, tensor.shape[0] // heads // 2, *tensor.shape[1:]).swapaxes(1, 2).reshape(tensor.shape)


def test_the_q4_1_blocks_decode_to_the_trained_weights(trained):
    model, _, out, written = trained
    reader = gguf.GGUFReader(out / MODEL_FILE)
    stored = {t.name: t for t in reader.tensors}
    packed = {n.removeprefix("base_model.model.").replace(".base_layer", ""): m for n, m in model.named_modules() if isinstance(m, PackedLinear)}
    assert written["tensor_types"]["Q4_1"] == len(packed) == 14
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    for name, layer in packed.items():
        tensor = stored[names.get_name(f"{name}.weight", try_suffixes=(".weight",))]
        assert tensor.tensor_type == gguf.GGMLQuantizationType.Q4_1
        decoded = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy())
        expected = layer.dequantized_weight(torch.float32).detach()  # the learned steps and zero points applied
        kind = name.rsplit(".", 1)[-1]
        if kind in HEADS:
            expected = llama_cpp_rows(expected, HEADS[kind])
        step = layer.effective_step().detach().float().max()
        assert (decoded - expected).abs().max() <= 0.01 * step, name  # d and m rounded to fp16, nothing else
    assert 0 < written["max_scale_error"] < 0.01


@pytest.mark.parametrize("floor", [1e-12, 1e-8, 3e-8, 1e-7])
@pytest.mark.parametrize("zero_points", [False, True])
def test_the_reported_scale_error_is_the_decoded_weights_and_an_all_zero_block_decodes_exactly(zero_points, floor):
    """An all-zero group (transformers' padding row of an embedding) has a floor step (1e-12; 1e-8 for an INT4 embedding
    trained with the pad row's zeros), which fp16 flushes to 0: its weights still decode to 0 exactly (at 1e-8, the
    offset -8 d stayed -6e-8 in fp16, and an export card said "6 of a step off"), but the fp16 rounding of ``d``
    relative to ``d`` was reported as 8 steps. The error reported is the decoded weights', in units of each block's
    step, as gguf's own decoder reads them."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0 if zero_points else -8, 16 if zero_points else 8, (3, 64), generator=g, dtype=torch.int16)
    step = torch.rand(3, 2, generator=g) * 0.02 + 1e-3
    zero = torch.randint(0, 16, (3, 2), generator=g).float() if zero_points else None
    codes[0], step[0] = (zero[0, 0].long() if zero_points else 0), floor  # the padding row: every weight 0
    if zero_points:
        zero[0] = zero[0, 0]
    blocks, error = _q4_1_blocks(codes, step, zero, group=32)
    decoded = torch.from_numpy(gguf.quants.dequantize(blocks.reshape(-1), gguf.GGMLQuantizationType.Q4_1).copy())
    trained = (codes.double() - (0 if zero is None else zero.double().repeat_interleave(32, 1))) * step.double().repeat_interleave(32, 1)
    assert torch.equal(decoded.reshape(3, 64)[0], torch.zeros(64))
    per_step = ((decoded.reshape(3, 64).double() - trained).abs() / step.double().repeat_interleave(32, 1)).max().item()
    assert error == pytest.approx(per_step, rel=1e-3, abs=1e-6) and error < 0.01


def assert_transformers_computes_the_packed_base(model, folder):
    """transformers' GGUF loader reads ``folder``'s model.gguf into logits within fp16 block scales of the packed base's
    (the adapters off); returns the loaded model."""
    ids = torch.tensor([[1, 5, 9, 22, 40, 77, 100, 3]])
    with torch.no_grad(), model.disable_adapter():
        base = model(input_ids=ids).logits.float()
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=MODEL_FILE, dtype=torch.float32)
    with torch.no_grad():
        assert (loaded(input_ids=ids).logits - base).abs().max() <= 2e-3 * base.abs().max()
    return loaded


def test_transformers_reads_the_gguf_base_as_the_packed_base_computes(trained):
    model, tokenizer, out, _ = trained
    loaded = assert_transformers_computes_the_packed_base(model, out)  # the rotary order undone
    assert loaded.config.num_key_value_heads == 2 and loaded.config.vocab_size == len(tokenizer)


def test_the_adapter_file_holds_the_peft_adapters_in_llama_cpp_order(trained):
    model, _, out, _ = trained
    reader = gguf.GGUFReader(out / ADAPTER_FILE)
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith(("adapter.", "general.type"))}
    assert fields == {"general.type": "adapter", "adapter.type": "lora", "adapter.lora.alpha": 8.0}
    stored = {t.name: torch.from_numpy(np.array(t.data)).reshape(*reversed([int(d) for d in t.shape])) for t in reader.tensors}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    checked = 0
    for fqn, module in model.named_modules():
        if not fqn.endswith(("proj",)) or not hasattr(module, "lora_A"):
            continue
        name = fqn.removeprefix("base_model.model.")
        key = names.get_name(f"{name}.weight", try_suffixes=(".weight",))
        a, b = module.lora_A["default"].weight.detach(), module.lora_B["default"].weight.detach()
        kind = name.rsplit(".", 1)[-1]
        if kind in HEADS:
            b = llama_cpp_rows(b, HEADS[kind])
        assert torch.equal(stored[f"{key}.lora_a"], a) and torch.equal(stored[f"{key}.lora_b"], b), name
        checked += 1
    assert checked == 14


def test_the_cli_exports_a_run_to_gguf_and_refuses_what_gguf_cannot_hold(tmp_path):
    tiny = save_tiny_model(tmp_path / "tiny")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(f"line {i} of the little corpus." for i in range(400)))
    fast = ["--block-size", "32", "--batch-size", "2", "--eval-blocks", "2", "--max-steps", "2"]
    assert cli("finetune", tiny, "--data", corpus, *fast[:-1], "6", "-o", tmp_path / "run").exit_code == 0  # a logged loss: a curve
    result = cli("export", tmp_path / "run", "--out", tmp_path / "gguf", "--format", "gguf")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "gguf").iterdir()) == sorted(["README.md", RUN_FILE, MODEL_FILE, ADAPTER_FILE, "loss_curve.png"])
    card = (tmp_path / "gguf" / "README.md").read_text()
    assert "llama-completion -m model.gguf --lora adapter.gguf -no-cnv -p" in card and "ADAPTER ./adapter.gguf" in card
    assert "library_name: gguf" in card and "PeftModel" not in card and "](loss_curve.png)" in card
    assert "llama.cpp computes `model.gguf` with its own" in " ".join(card.split())  # whose evaluation the table is
    assert validate_card_metadata(card) == []  # what the Hub checks when the folder is pushed
    refused = one_error_line(cli("eval", tmp_path / "gguf", "--data", corpus))
    assert "is a GGUF export, which llama.cpp runs (llama-completion -m model.gguf --lora adapter.gguf)" in refused
    base_only = cli("eval", tmp_path / "gguf" / MODEL_FILE, "--data", corpus, "--block-size", "32", "--max-sequences", "2")
    assert base_only.exit_code == 0 and "note: adapter.gguf beside model.gguf is not applied" in " ".join(base_only.output.split())
    # a rope scaling llama.cpp's llama layout has no place for here: one line, nothing written
    scaled = save_tiny_model(tmp_path / "scaled", rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert cli("finetune", scaled, "--data", corpus, *fast, "-o", tmp_path / "run-scaled").exit_code == 0
    no_rope = one_error_line(cli("export", tmp_path / "run-scaled", "--out", tmp_path / "gguf2", "--format", "gguf"))
    assert "GGUF export writes no rope scaling but Llama 3's, not 'linear'" in no_rope and not (tmp_path / "gguf2").exists()


def test_llama3_rope_scaling_goes_in_as_the_divisors_transformers_applies(tmp_path):
    """Llama 3.x checkpoints scale their rotary frequencies; llama.cpp reads the divisors from ``rope_freqs``, which
    must be the ratio of transformers' default frequencies to its llama3 ones."""
    from transformers.modeling_rope_utils import _compute_llama3_parameters

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    folder = save_tiny_model(tmp_path / "llama3", rope_scaling=rope)
    model, tokenizer, _ = load_int4_lora(str(folder), LoraConfig(r=4, target_modules="all-linear"), backend="dequant", dtype=torch.float32)
    export_gguf(model, tokenizer, tmp_path, "llama3")
    stored = {t.name: t for t in gguf.GGUFReader(tmp_path / MODEL_FILE).tensors}
    factors = torch.from_numpy(np.array(stored["rope_freqs.weight"].data))
    scaled, _ = _compute_llama3_parameters(model.config, "cpu")
    plain = 1.0 / (model.config.rope_parameters["rope_theta"] ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    assert torch.allclose(factors, plain / scaled, rtol=1e-5) and factors.max() == 8.0 and factors.min() < 8.0


def test_int8_layers_and_a_tied_packed_head_are_q8_0_blocks_of_their_codes(tmp_path):
    """Per-channel int8 layers (a plan's sensitive ones; the head of a large vocabulary) keep their codes as Q8_0
    blocks with the row's step; a packed head tied to the embedding is stored once, as llama.cpp's token table."""
    from hf_lowprec.plan import PrecisionPlan

    folder = save_tiny_model(tmp_path / "tied", tie_word_embeddings=True)
    plan = PrecisionPlan({"lm_head": "int8", "*.down_proj": "int8"}, default="int4-g64-asym")
    model, tokenizer, _ = load_int4_lora(str(folder), LoraConfig(r=4, target_modules="all-linear"), plan=plan, backend="dequant", dtype=torch.float32)
    written = export_gguf(model, tokenizer, tmp_path, "tied")
    assert written["tensor_types"] == {"F32": 5, "Q4_1": 12, "Q8_0": 3}  # norms; 12 INT4 linears; 2 down_proj + the table
    stored = {t.name: t for t in gguf.GGUFReader(tmp_path / MODEL_FILE).tensors}
    assert "output.weight" not in stored  # llama.cpp reads the head from token_embd
    layers = {"token_embd.weight": model.base_model.model.lm_head, "blk.1.ffn_down.weight": model.base_model.model.model.layers[1].mlp.down_proj.base_layer}
    for key, layer in layers.items():
        assert stored[key].tensor_type == gguf.GGMLQuantizationType.Q8_0
        decoded = torch.from_numpy(gguf.quants.dequantize(stored[key].data, stored[key].tensor_type).copy())
        expected = (layer.base_layer if hasattr(layer, "base_layer") else layer).dequantized_weight(torch.float32).detach()
        assert (decoded - expected).abs().max() <= 1e-3 * expected.abs().max(), key  # the row step in fp16
    assert_transformers_computes_the_packed_base(model, tmp_path)


def test_a_short_last_group_a_wide_head_and_a_padded_vocabulary_are_written_as_llama_cpp_reads_them(tmp_path):
    """A 96-wide model in int4-g64 (each row's last group 32 weights: its blocks were 64 and the reshape failed), heads
    of 32 beside a hidden size of 96 (llama.cpp takes hidden / heads = 24 without attention.key_length), and an
    embedding padded 16 rows past the tokenizer (llama.cpp sizes the table by the token list: [PAD] tokens, unused)."""
    from tiny_assets import tiny_tokenizer

    vocab = len(tiny_tokenizer()) + 16
    folder = save_tiny_model(tmp_path / "odd", hidden_size=96, head_dim=32, vocab_size=vocab)
    model, tokenizer, _ = load_int4_lora(str(folder), LoraConfig(r=4, target_modules="all-linear"), backend="dequant", dtype=torch.float32)
    export_gguf(model, tokenizer, tmp_path, "odd")
    reader = gguf.GGUFReader(tmp_path / MODEL_FILE)
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    assert field("llama.attention.key_length") == field("llama.attention.value_length") == 32
    tokens, types = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.token_type")
    assert len(tokens) == len(types) == vocab and tokens[-1] == f"[PAD{vocab - 1}]"
    assert types[-16:] == [gguf.TokenType.UNUSED] * 16 and gguf.TokenType.UNUSED not in types[:-16]
    assert_transformers_computes_the_packed_base(model, tmp_path)  # the 96-wide layers' blocks decode right


def test_adapters_of_per_layer_scales_are_refused_before_anything_is_written(tmp_path):
    """llama.cpp's adapter file holds one alpha: a per-layer alpha is refused before model.gguf is written."""
    folder = save_tiny_model(tmp_path / "tiny")
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", alpha_pattern={"q_proj": 16})
    model, tokenizer, _ = load_int4_lora(str(folder), lora, backend="dequant", dtype=torch.float32)
    (tmp_path / "out").mkdir()
    with pytest.raises(ValueError, match=r"q_proj: its LoRA scale is not alpha / r \(a per-layer rank or alpha"):
        export_gguf(model, tokenizer, tmp_path / "out", "tiny")
    assert not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize("targets, refusal", [
    (["q_proj", "embed_tokens"], "model.embed_tokens: an embedding's LoRA, which this GGUF export does not write"),
    (["q_proj", "lm_head"], "lm_head: a LoRA on the output head tied to the token embedding; GGUF holds the two as one"),
])  # fmt: skip
def test_adapters_gguf_cannot_hold_are_refused_before_anything_is_written(tmp_path, targets, refusal):
    """An embedding's LoRA was left out of adapter.gguf without a word; a tied head's was written for an output.weight
    model.gguf does not hold (GGUF keeps the tied pair as token_embd), which llama.cpp refuses to load."""
    from peft import get_peft_model

    from hf_lowprec import HfLowprecConfig

    folder = save_tiny_model(tmp_path / "tiny", tie_word_embeddings=True)
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, quantization_config=HfLowprecConfig())
    model = get_peft_model(base, LoraConfig(r=4, target_modules=targets, init_lora_weights=False))
    (tmp_path / "out").mkdir()
    with pytest.raises(ValueError, match=rf"^{refusal}"):
        export_gguf(model, AutoTokenizer.from_pretrained(folder), tmp_path / "out", "tiny")
    assert not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize("table_format, block_type", [("int8", "Q8_0"), ("int4-g32-asym", "Q4_1")])
def test_a_packed_untied_embedding_is_the_token_table_in_its_codes(tmp_path, table_format, block_type):
    """An untied embedding packed while loading (Llama-3.1-8B's 128k-row table) is written as its codes' blocks, its
    rows in their order: they decode to its dequantized table, and transformers' GGUF loader computes the logits."""
    from hf_lowprec.plan import PrecisionPlan

    folder = save_tiny_model(tmp_path / "untied")
    plan = PrecisionPlan({"model.embed_tokens": table_format}, default="int4-g64-asym")
    model, tokenizer, _ = load_int4_lora(str(folder), LoraConfig(r=4, target_modules="all-linear"), plan=plan, backend="dequant", dtype=torch.float32)
    embedding = model.get_base_model().get_input_embeddings()
    assert type(embedding).__name__ == "PackedEmbedding"
    export_gguf(model, tokenizer, tmp_path, "untied")
    stored = {t.name: t for t in gguf.GGUFReader(tmp_path / MODEL_FILE).tensors}
    table = stored["token_embd.weight"]
    assert table.tensor_type == getattr(gguf.GGMLQuantizationType, block_type) and "output.weight" in stored
    decoded = torch.from_numpy(gguf.quants.dequantize(table.data, table.tensor_type).copy())
    expected = embedding.dequantized_weight(torch.float32)
    assert (decoded - expected).abs().max() <= 2e-3 * expected.abs().max()  # d and m rounded to fp16
    assert_transformers_computes_the_packed_base(model, tmp_path)


def test_blocks_made_a_few_rows_at_a_time_are_the_blocks_made_whole(trained, monkeypatch):
    """A large head is turned into blocks in row chunks (bounded memory); chunk edges change no byte, in the rotary
    row order too."""
    import hf_lowprec.export.gguf as gguf_export

    model = trained[0]
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    order = gguf_export._rotary_order("model.layers.0.self_attn.q_proj", q_proj.out_features, HEADS)
    whole = gguf_export._packed_blocks(q_proj, order)[0]
    monkeypatch.setattr(gguf_export, "CHUNK_ROWS", 5)  # 64 rows: 13 chunks, the last one short
    assert np.array_equal(gguf_export._packed_blocks(q_proj, order)[0], whole)


@pytest.mark.slow
def test_the_demo_run_as_gguf_reads_back_with_its_tokenizer_and_weights(tmp_path):
    """The README's demo (SmolLM2-135M-Instruct, 2 steps) exported to GGUF: transformers' GGUF reader rebuilds its
    tokenizer (49,152 tokens, merges, special tokens, chat template) and its packed base from model.gguf."""
    from transformers import AutoTokenizer

    from hf_lowprec.data import default_corpus
    from hf_lowprec.export import load_exported

    run, out = tmp_path / "demo", tmp_path / "gguf"
    assert cli("finetune", "--output-dir", run, "--max-steps", "2", "--eval-blocks", "2").exit_code == 0
    assert cli("export", run, "--out", out, "--format", "gguf").exit_code == 0
    model, tokenizer = load_exported(run, dtype=torch.float32, backend="dequant")
    again = AutoTokenizer.from_pretrained(out, gguf_file=MODEL_FILE)
    text = default_corpus()[0]["text"][0][20_000:24_000]  # prose, verse, numbers, contractions, newlines
    assert again(text)["input_ids"] == tokenizer(text)["input_ids"] and len(again) == len(tokenizer) == 49152
    assert again.eos_token == tokenizer.eos_token and again.chat_template == tokenizer.chat_template
    ids = torch.tensor([tokenizer(text)["input_ids"][:64]])
    with torch.no_grad(), model.disable_adapter():
        base = model(input_ids=ids).logits
    loaded = AutoModelForCausalLM.from_pretrained(out, gguf_file=MODEL_FILE, dtype=torch.float32)
    with torch.no_grad():
        assert (loaded(input_ids=ids).logits - base).abs().max() <= 2e-3 * base.abs().max()


def test_the_gguf_cache_takes_a_copy_made_meanwhile_clears_a_killed_ones_and_names_a_broken_one(
    trained, tmp_path, monkeypatch
):
    """Two first runs at once: the slower one's rename found the other's finished folder and failed; a run killed
    while caching left a partial copy (a whole model at real sizes) that nothing removed; a cached copy damaged
    since failed every load with a bare safetensors error."""
    import os
    import shutil

    import hf_lowprec.checkpoints as checkpoints
    from hf_lowprec.checkpoints import _gguf_cache_dir, cache_gguf, load_pretrained

    _, _, out, _ = trained
    monkeypatch.setenv("HF_LOWPREC_CACHE", str(tmp_path / "cache"))
    target = _gguf_cache_dir(str(out), MODEL_FILE, torch.float32)
    target.parent.mkdir(parents=True)
    killed = target.parent / f".{target.name}.999999999-abc.partial"  # a process that is gone
    (killed / "part").mkdir(parents=True)
    done_first = tmp_path / "other"
    mkdtemp = checkpoints.tempfile.mkdtemp

    def another_process_finishes_first(**kwargs):
        made = mkdtemp(**kwargs)
        shutil.copytree(done_first, target)  # the other run's rename lands between this one's check and its own
        return made

    cache_gguf(str(out), MODEL_FILE, torch.float32)  # the copy the other process makes
    shutil.move(target, done_first)
    monkeypatch.setattr(checkpoints.tempfile, "mkdtemp", another_process_finishes_first)
    assert cache_gguf(str(out), MODEL_FILE, torch.float32) == target and (target / "config.json").is_file()
    assert sorted(p.name for p in target.parent.iterdir()) == ["float32"]  # no partial copy left, the killed one gone
    monkeypatch.setattr(checkpoints.tempfile, "mkdtemp", mkdtemp)
    weights = target / "model.safetensors"
    os.truncate(weights, 1000)
    with pytest.raises(ValueError, match=rf"the cached copy of {MODEL_FILE} in '{target}' cannot be read \("):
        load_pretrained(str(out), gguf_file=MODEL_FILE)


def test_token_types_and_the_pre_tokenizer_are_as_llama_cpp_needs_them(trained):
    """Every token tokenizer.json marks special is a control token (llama.cpp warns of control-looking tokens
    otherwise); the pre-tokenizer name keeps llama.cpp's decoding of spaces as the tokenizer's."""
    from hf_lowprec.export.gguf import _pre_tokenizer

    _, tokenizer, out, _ = trained
    fields = gguf.GGUFReader(out / MODEL_FILE).fields
    tokens, kinds = fields["tokenizer.ggml.tokens"].contents(), fields["tokenizer.ggml.token_type"].contents()
    control = {t for t, k in zip(tokens, kinds) if k == gguf.TokenType.CONTROL}
    assert control == {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}  # <|im_end|> is neither bos, eos nor pad
    byte_level, digits_apart = {"type": "ByteLevel", "use_regex": True}, {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, {"type": "ByteLevel", "use_regex": False}]}
    assert _pre_tokenizer(digits_apart, ["a", "12"], cleans_spaces=True) == "smollm"
    assert _pre_tokenizer(byte_level, ["a", "Ġ1"], cleans_spaces=False) == "gpt-2"  # digits in longer tokens: GPT-2's split
    assert _pre_tokenizer(byte_level, ["a", "1", "Â¹"], cleans_spaces=False) == "smollm"  # digits one by one, spaces kept
    assert _pre_tokenizer(byte_level, ["a", "1"], cleans_spaces=True) == "gpt-2"
    assert _pre_tokenizer({"type": "Metaspace"}, ["a"], cleans_spaces=False) == "default"


def test_llama_3s_pre_tokenizer_is_llama_cpps_llama_bpe():
    """Llama 3's split as the tokenizers library serialises it (the pattern transformers converts tiktoken files with)
    is llama.cpp's llama-bpe; another split regex, or digits split otherwise, is no named type."""
    import inspect
    import json

    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from hf_lowprec.export.gguf import _pre_tokenizer

    def serialised(pattern: str) -> dict:
        tokenizer = Tokenizer(models.BPE())
        split = pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        return json.loads(tokenizer.to_str())["pre_tokenizer"]

    llama3 = inspect.signature(TikTokenConverter.__init__).parameters["pattern"].default
    assert _pre_tokenizer(serialised(llama3), ["a"], cleans_spaces=True) == "llama-bpe"
    single_digits = llama3.replace(r"\p{N}{1,3}", r"\p{N}")  # Qwen2's split: a llama.cpp qwen2 model, not llama
    assert _pre_tokenizer(serialised(single_digits), ["a"], cleans_spaces=True) == "default"


def test_biases_are_written_beside_the_packed_codes_in_llama_cpp_order(tmp_path):
    """A Llama with attention and MLP biases: its packed layers' biases were left out without a word (the GGUF's logits
    165% off the packed base's); they are llama.cpp's optional ``*.bias`` tensors, query/key rows reordered."""
    folder = save_tiny_model(tmp_path / "biased", attention_bias=True, mlp_bias=True)
    model, tokenizer, _ = load_int4_lora(str(folder), LoraConfig(r=4, target_modules="all-linear"), backend="dequant",
                                         dtype=torch.float32)  # fmt: skip
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") and "lora" not in name:
                p.normal_(0, 0.5)
    export_gguf(model, tokenizer, tmp_path, "biased")
    stored = {t.name: torch.from_numpy(np.array(t.data)) for t in gguf.GGUFReader(tmp_path / MODEL_FILE).tensors}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    biased = {n.replace(".base_layer", ""): m for n, m in model.get_base_model().named_modules()
              if isinstance(m, PackedLinear) and m.bias is not None}  # fmt: skip
    assert len(biased) == 14  # 7 linears a block (transformers' GGUF loader reads no llama bias: llama.cpp does)
    for name, layer in biased.items():
        heads = HEADS.get(name.rsplit(".", 1)[-1])
        expected = layer.bias.detach() if heads is None else llama_cpp_rows(layer.bias.detach(), heads)
        assert torch.equal(stored[names.get_name(name + ".bias", try_suffixes=(".bias",))], expected), name


def test_an_id_no_token_has_is_a_pad_token_at_its_place(tmp_path):
    """The token list is indexed by id: a tokenizer with a gap in its ids (a token removed) shifted every later token
    one place down, each id above the gap decoded as its neighbour."""
    import json

    from transformers import PreTrainedTokenizerFast

    folder = save_tiny_model(tmp_path / "tiny")
    spec = json.loads((folder / "tokenizer.json").read_text())
    merged = {part for merge in spec["model"]["merges"] for part in (merge.split() if isinstance(merge, str) else merge)}
    vocab = spec["model"]["vocab"]
    gap = next(t for t, i in sorted(vocab.items(), key=lambda kv: kv[1]) if i > 50 and t not in merged)
    gap_id = vocab.pop(gap)
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    model, _, _ = load_int4_lora(str(folder), LoraConfig(r=4, target_modules="all-linear"), backend="dequant",
                                 dtype=torch.float32)  # fmt: skip
    export_gguf(model, tokenizer, tmp_path, "gap")
    reader = gguf.GGUFReader(tmp_path / MODEL_FILE)
    tokens, types = reader.fields["tokenizer.ggml.tokens"].contents(), reader.fields["tokenizer.ggml.token_type"].contents()
    assert tokens[gap_id] == f"[PAD{gap_id}]" and types[gap_id] == gguf.TokenType.UNUSED
    assert all(tokens[i] == t for t, i in tokenizer.get_vocab().items())
