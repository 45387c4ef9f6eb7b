"""The transformers quantizer ``quant_method: hf_lowprec``: config validation, empty shells, from_pretrained reload."""

import pytest
import torch
from conftest import tiny_llama
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hf_lowprec import apply_plan, freeze
from hf_lowprec.export.hf_quantizer import HfLowprecConfig, install_packed_shells, quantization_config_dict
from hf_lowprec.modules import PackedInt4Linear, PackedInt8Linear
from hf_lowprec.modules.packed import BASE_STEP_DTYPE, PackedLinear, compact_steps
from hf_lowprec.plan import PrecisionPlan

PLAN = PrecisionPlan({"lm_head": "bf16", "*.v_proj": "int8"}, default="int4-g64-asym")


def test_config_round_trips_the_plan_and_names_a_bad_one():
    model = tiny_llama()
    apply_plan(model, PLAN)  # learnable steps, untrained (as a post-training quantization): int8's forward allowed
    freeze(model)
    entry = quantization_config_dict(PLAN, model)
    assert entry == {"quant_method": "hf_lowprec", "plan": PLAN.to_dict(), "exact_kernels": False}
    assert HfLowprecConfig(**{k: v for k, v in entry.items() if k != "quant_method"}).to_dict() == entry
    next(m for m in model.modules() if isinstance(m, PackedInt4Linear)).learn_steps()  # steps fit to exact kernels
    assert quantization_config_dict(PLAN, model)["exact_kernels"] is True
    qat = tiny_llama()
    apply_plan(qat, PLAN)  # QAT: LSQ steps trained against the exact fake-quantized forward
    ids = torch.randint(0, 256, (2, 16))
    qat(input_ids=ids, labels=ids).loss.backward()
    torch.optim.SGD(qat.parameters(), lr=1e-3).step()
    freeze(qat)
    assert all(m.exact_kernels for m in qat.modules() if isinstance(m, PackedLinear))
    assert quantization_config_dict(PLAN, qat)["exact_kernels"] is True
    with pytest.raises(ValueError, match="quantization_config.plan: unknown plan key"):
        HfLowprecConfig({"defaults": "int4"})
    assert HfLowprecConfig.from_dict(entry).to_dict() == entry  # as transformers reads config.json
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['pln'\]; allowed: plan, exact_kernels"):
        HfLowprecConfig(pln="int4")  # a typo no longer loads with the default plan
    with pytest.raises(ValueError, match=r"\['bnb_4bit_compute_dtype', 'load_in_4bit'\]; .*\(HfLowprecConfig\(\) alone is the 4-bit load; from_pretrained\(dtype=...\) the compute dtype\)$"):
        HfLowprecConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16)  # a BitsAndBytesConfig's words
    with pytest.raises(ValueError, match=r"^HfLowprecConfig exact_kernels must be True or False, got 'no'$"):
        HfLowprecConfig(exact_kernels="no")  # bool("no") said True


def test_a_packed_models_missing_dense_weight_is_said_so(tmp_path):
    """resize_token_embeddings (adding a chat template's tokens) on a packed model failed on "'PackedInt4Linear' object
    has no attribute 'weight'"; it says why now. getattr(layer, "weight", None) still gives None."""
    from tiny_assets import save_tiny_model

    path = save_tiny_model(tmp_path / "tiny", tie_word_embeddings=False)
    plan = {"default": "int4-g64-asym", "layers": {"model.embed_tokens": "int8"}}
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=HfLowprecConfig(plan))
    for layer in (model.lm_head, model.get_input_embeddings()):
        assert getattr(layer, "weight", None) is None
    vocab = model.config.vocab_size
    with pytest.raises(AttributeError, match="holds its weight packed, no dense .weight .* need the model before"):
        model.lm_head.weight
    assert model.resize_token_embeddings(vocab) is model.get_input_embeddings()  # its own size: nothing to do
    with pytest.raises(ValueError, match=rf"^resize_token_embeddings\({vocab + 8}\): this model's input embedding "
                       rf"\(PackedEmbedding\) and output head \(PackedInt4Linear\) of {vocab} rows are hf-lowprec .* "
                       "resize before converting"):
        model.resize_token_embeddings(vocab + 8)
    model.lm_head.register_buffer("weight", torch.zeros(1))  # one registered under that name is what it reads
    assert torch.equal(model.lm_head.weight, torch.zeros(1))


def test_shells_replace_exactly_the_packed_formats():
    model = tiny_llama()
    assert install_packed_shells(model, PLAN) == 2 * 7 - 2 + 2  # every linear of 2 blocks but lm_head: 12 int4, 2 int8
    kinds = {n: type(m) for n, m in model.named_modules() if isinstance(m, (PackedInt4Linear, PackedInt8Linear))}
    assert sum(k is PackedInt8Linear for k in kinds.values()) == 2 and all(("v_proj" in n) == (k is PackedInt8Linear) for n, k in kinds.items())
    assert type(model.lm_head) is torch.nn.Linear


def test_from_pretrained_rebuilds_the_packed_model(tmp_path):
    model = tiny_llama()
    apply_plan(model, PLAN, learn_scales=False)
    freeze(model)
    model.config.quantization_config = quantization_config_dict(PLAN, model)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)  # transformers alone: the quantizer is registered on import
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)
    assert reloaded.hf_lowprec_plan.to_dict() == PLAN.to_dict()
    assert sum(isinstance(m, PackedInt4Linear) for m in reloaded.modules()) == 12


def compact_reference_steps(model) -> None:
    """A base packed on load keeps its INT4 steps compact, whatever its dtype: so does the reference it meets."""
    for module in model.modules():
        if isinstance(module, PackedLinear):
            compact_steps(module)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_on_load_packs_as_apply_plan_does(tmp_path, dtype):
    """A dense folder loaded with ``HfLowprecConfig`` holds the same codes as loading it dense, then apply_plan + freeze,
    and saves/reloads as a packed folder."""
    tiny_llama().save_pretrained(tmp_path / "dense")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", dtype=dtype)
    apply_plan(reference, PLAN, learn_scales=False)
    freeze(reference)
    compact_reference_steps(reference)
    packed = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", dtype=dtype, quantization_config=HfLowprecConfig(PLAN))
    expected, got = reference.state_dict(), packed.state_dict()
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)
    assert packed.config.quantization_config.to_dict() == quantization_config_dict(PLAN, reference)
    packed.save_pretrained(tmp_path / "packed")
    saved = load_file(tmp_path / "packed" / "model.safetensors")
    guards = {k for k, v in saved.items() if k.endswith(".weight") and v.shape == (1,)}  # with_load_guards
    assert guards == {f"{n}.weight" for n, m in packed.named_modules() if isinstance(m, PackedLinear)} != set()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "packed")
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=0, atol=0)


def test_an_opt_model_packs_on_load_and_reloads_with_its_learned_positions_dense(tmp_path):
    """OPT's positions are an ``nn.Embedding`` subclass computing more than a lookup, which no plan converts: packing
    on load and reloading a packed OPT folder raised ``KeyError: 'model.decoder.embed_positions'`` (a qat-int4 run's
    export could not be loaded)."""
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    config = OPTConfig(vocab_size=256, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                       word_embed_proj_dim=64, max_position_embeddings=64)  # fmt: skip
    OPTForCausalLM(config).save_pretrained(tmp_path / "dense")
    plan = PrecisionPlan({"lm_head": "bf16"}, default="int4-g32")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "dense")
    apply_plan(reference, plan, learn_scales=False)
    freeze(reference)
    compact_reference_steps(reference)
    packed = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", quantization_config=HfLowprecConfig(plan))
    assert type(packed.model.decoder.embed_positions).__name__ == "OPTLearnedPositionalEmbedding"
    assert isinstance(packed.model.decoder.layers[0].fc1, PackedInt4Linear)
    packed.save_pretrained(tmp_path / "packed")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "packed")
    ids = torch.randint(0, 256, (2, 16))
    for layer in (m for model in (packed, reloaded, reference) for m in model.modules() if isinstance(m, PackedLinear)):
        layer.backend = "dequant"  # the codes' exact values (int8 rounds the activations)
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        for model in (packed, reloaded):
            torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=0, atol=0)


def test_a_t5_model_packs_on_load_whose_attention_initialises_its_children(tmp_path):
    """T5's ``_init_weights`` initialises ``q``/``k``/``v``/``o`` from the attention module, which transformers visits
    for the tied keys the checkpoint does not hold: reading a packed child's weight failed the load. It loads with
    the codes apply_plan + freeze make, and its own initialisation is back afterwards."""
    from transformers import AutoModelForSeq2SeqLM, T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4)
    T5ForConditionalGeneration(config).save_pretrained(tmp_path / "dense")
    kept = ("lm_head", "shared", "*embed_tokens", "*.wo")  # (T5's feed-forward reads wo.weight's dtype in its forward)
    plan = PrecisionPlan(dict.fromkeys(kept, "bf16"), default="int4-g32")
    reference = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "dense")
    apply_plan(reference, plan, learn_scales=False)
    freeze(reference)
    compact_reference_steps(reference)
    packed = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "dense", quantization_config=HfLowprecConfig(plan))
    assert isinstance(packed.encoder.block[0].layer[0].SelfAttention.q, PackedInt4Linear)
    assert "_init_weights" not in vars(packed)
    ids = torch.randint(0, 256, (2, 12))
    for layer in (m for model in (packed, reference) for m in model.modules() if isinstance(m, PackedLinear)):
        layer.backend = "dequant"
    with torch.no_grad():
        expected = reference(input_ids=ids, decoder_input_ids=ids).logits
        torch.testing.assert_close(packed(input_ids=ids, decoder_input_ids=ids).logits, expected, rtol=0, atol=0)


def test_an_fp32_load_packs_a_bf16_checkpoint_as_stored_with_the_same_codes(tmp_path, monkeypatch):
    """Loading in fp32, transformers hands each weight it packs over as the checkpoint stores it (bf16), not cast to
    fp32 whole first (a 128k-vocabulary table: 1 GB); the codes and steps are those of the fp32 dense path (INT4 steps
    in bf16, as a frozen base keeps them), and the tied table's rows come out in fp32."""
    import hf_lowprec.export.hf_quantizer as quantizer_module

    tiny_llama(tie=True).to(torch.bfloat16).save_pretrained(tmp_path / "dense")
    received = []
    pack = quantizer_module._pack
    spy = lambda model, fqn, w, *a: received.append(w.dtype) or pack(model, fqn, w, *a)  # noqa: E731
    monkeypatch.setattr(quantizer_module, "_pack", spy)
    plan = {"default": "int4-g32", "layers": {"*.v_proj": "int8"}}
    config = HfLowprecConfig(plan)
    packed = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", dtype=torch.float32, quantization_config=config)
    assert received and set(received) == {torch.bfloat16}  # the table and every linear as stored
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", dtype=torch.float32)
    apply_plan(reference, PrecisionPlan.from_dict(plan), learn_scales=False)
    freeze(reference)
    compact_reference_steps(reference)
    got, expected = packed.state_dict(), reference.state_dict()
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.v_proj", "lm_head"):
        for buffer in ("qweight", "step"):
            torch.testing.assert_close(got[f"{name}.{buffer}"], expected[f"{name}.{buffer}"], rtol=0, atol=0)
    assert packed.lm_head.dtype == torch.float32 and packed.model.norm.weight.dtype == torch.float32
    assert packed.lm_head.step.dtype == BASE_STEP_DTYPE  # INT4 group steps compact whatever the compute dtype
    assert packed.model.layers[1].self_attn.v_proj.step.dtype == torch.float32  # int8 rows keep theirs
    assert packed.get_input_embeddings()(torch.tensor([[1, 2]])).dtype == torch.float32


def test_quantize_on_load_default_plan_and_a_tied_head(tmp_path):
    """No plan: every Linear in int4-g64-asym but the output head (a format name keeps it too). A plan that packs a
    tied head packs the table once, as the checkpoint's embedding arrives; the embedding then reads the head's rows,
    and a saved folder reloads the tie from the head's codes."""
    tiny_llama(tie=True).save_pretrained(tmp_path / "dense")
    default = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", quantization_config=HfLowprecConfig())
    assert default.hf_lowprec_plan.to_dict() == {"default": "int4-g64-asym", "layers": {"lm_head": "bf16"}}
    assert sum(isinstance(m, PackedInt4Linear) for m in default.modules()) == 14 and type(default.lm_head) is torch.nn.Linear
    packed_default = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", quantization_config=HfLowprecConfig("int4-g32"))
    assert packed_default.hf_lowprec_plan.layers
    config = HfLowprecConfig({"default": "int4-g32"})
    everything = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", quantization_config=config)
    assert isinstance(everything.lm_head, PackedInt4Linear)
    assert type(everything.get_input_embeddings()).__name__ == "TiedPackedEmbedding"
    table = default.get_input_embeddings().weight.detach()
    reference = compact_steps(PackedInt4Linear.from_weight(table, "int4-g32"))
    torch.testing.assert_close(everything.lm_head.dequantized_weight(), reference.dequantized_weight(), rtol=0, atol=0)
    # independently: symmetric int4 in groups of 32, step max|w| / 7 per group, so within half a step of every weight
    groups = lambda w: w.reshape(w.shape[0], -1, 32)  # noqa: E731
    half_step = groups(table).abs().amax(-1, keepdim=True) / 14
    off = (groups(everything.lm_head.dequantized_weight()) - groups(table)).abs() / half_step
    assert off.max() <= 1.03, off.max()  # its steps stored in bf16 (compact_steps): up to 7 codes x 2^-9 of a step more
    everything.save_pretrained(tmp_path / "packed")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "packed")
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, everything(input_ids=ids).logits, rtol=0, atol=0)
    # the default's dense head, tied (SmolLM2's): the folder holds their table once, under the embedding's name; the
    # head was untied on reload and started from random weights (logits 1.1 off; SmolLM2-135M generated gibberish)
    default.save_pretrained(tmp_path / "packed-default")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "packed-default")
    assert again.lm_head.weight is again.get_input_embeddings().weight
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, default(input_ids=ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize(
    "plan, message",
    [
        ("auto", "plan 'auto' needs calibration tokens"),
        ({"default": "int4-g64", "layers": {"*.v_proj": "fp8"}}, r"2 Linear layers .* in fp8, which no packed layer stores"),
        ({"default": "int4-g64", "layers": {"*.v_proj": "int4-g64-sq"}}, "the plan also has int4-g64-sq"),  # calibrated on activations
        ("int4-g999x", "plan must be 'auto', a plan file or folder, or a format name"),
    ],
)
def test_quantize_on_load_names_a_plan_it_cannot_apply(tmp_path, plan, message):
    tiny_llama().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=HfLowprecConfig(plan))


def test_a_tied_embedding_and_head_planned_in_two_formats_are_refused(tmp_path):
    """A tied embedding and head are one table: a plan packing the embedding in another format than the head is
    refused naming both (a dense head failed in transformers' tie_weights, an INT4 head silently took the int8
    embedding's table); a plan packing the head alone packs the table in its format."""
    tiny_llama(tie=True).save_pretrained(tmp_path)
    for layers, formats in (({"lm_head": "bf16", "model.embed_tokens": "int8"}, "kept dense and int8"),
                            ({"model.embed_tokens": "int8"}, "int4-g32 and int8")):  # fmt: skip
        with pytest.raises(ValueError, match=rf"'lm_head' is tied to 'model.embed_tokens' \(one table\): the plan "
                                             rf"gives them {formats}; give both one format"):  # fmt: skip
            config = HfLowprecConfig({"default": "int4-g32", "layers": layers})
            AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=config)
    head_only = HfLowprecConfig({"default": "int4-g32", "layers": {"lm_head": "int8"}})
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=head_only)
    assert isinstance(model.lm_head, PackedInt8Linear)
    assert type(model.get_input_embeddings()).__name__ == "TiedPackedEmbedding"


def test_exact_kernels_apply_to_the_layers_packed_while_loading(tmp_path):
    """``HfLowprecConfig(exact_kernels=True)`` for a dense checkpoint: the layers packed while loading compute with
    exact kernels, as the folder they save to says (they did not, and a reload did)."""
    tiny_llama().save_pretrained(tmp_path / "dense")
    config = HfLowprecConfig(PLAN, exact_kernels=True)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", quantization_config=config)
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert packed and all(m.exact_kernels for m in packed)
    model.save_pretrained(tmp_path / "packed")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "packed")
    assert all(m.exact_kernels for m in reloaded.modules() if isinstance(m, PackedLinear))
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", quantization_config=HfLowprecConfig(PLAN))
    assert not any(m.exact_kernels for m in plain.modules() if isinstance(m, PackedLinear))


def test_pread_loading_of_sharded_safetensors_matches_transformers_own(tmp_path):
    """load_pretrained reads a sharded folder's tensors by pread when quantizing on load: the same model as
    transformers' memory-mapped loading, the name recorded as from_pretrained(folder) records it."""
    from hf_lowprec.checkpoints import load_pretrained

    tiny_llama(tie=True).save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(list(tmp_path.glob("*.safetensors"))) > 2
    ours, _ = load_pretrained(tmp_path, quantization_config=HfLowprecConfig(PLAN))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=HfLowprecConfig(PLAN))
    expected = theirs.state_dict()
    assert ours.state_dict().keys() == expected.keys()
    assert all(torch.equal(ours.state_dict()[k], v) for k, v in expected.items())
    assert ours.name_or_path == str(tmp_path) and ours.hf_lowprec_plan.to_dict() == PLAN.to_dict()


def test_packs_on_load_says_which_plans_load_packed():
    """load_int4_lora packs while loading exactly when every low-precision format of the plan packs."""
    from hf_lowprec.export.hf_quantizer import packs_on_load

    assert packs_on_load(None) and packs_on_load(PLAN) and packs_on_load("int4-g32") and packs_on_load(PLAN.to_dict())
    assert not packs_on_load("auto") and not packs_on_load("fp8") and not packs_on_load("int8-g128")
    assert not packs_on_load(PrecisionPlan({"*.v_proj": "nf4-g64"}, default="int4-g64"))


def test_peft_all_linear_wraps_the_packed_layers_but_the_head(tmp_path):
    """``get_peft_model(model, LoraConfig(target_modules="all-linear"))`` on a model packed on load wraps every packed
    layer (PEFT itself matches ``nn.Linear`` only), not the output head, packed or not: the same layers as
    ``load_int4_lora``'s own reading of ``all-linear``; a second adapter nests nothing."""
    from peft import LoraConfig, get_peft_model

    from hf_lowprec.modules.int4_lora import PackedLoraLinear
    from hf_lowprec.ondevice.planning import resolve_target_modules

    tiny_llama(tie=False).save_pretrained(tmp_path / "dense")
    for plan in (PLAN.to_dict(), {"default": "int4-g32"}):  # a bf16 head; a packed one
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", quantization_config=HfLowprecConfig(plan))
        expected = set(resolve_target_modules(model, "all-linear"))
        assert len(expected) == 14 and not any(isinstance(m, torch.nn.Linear) for m in model.model.modules())
        peft_model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
        wrapped = {n for n, m in model.named_modules() if isinstance(m, PackedLoraLinear)}
        assert wrapped == expected and not isinstance(model.lm_head, PackedLoraLinear)
        peft_model.add_adapter("second", LoraConfig(r=2, target_modules="all-linear"))
        assert {n for n, m in model.named_modules() if isinstance(m, PackedLoraLinear)} == expected
        assert all("second" in model.get_submodule(n).lora_A for n in expected)


@pytest.mark.parametrize("tie, plan", [(True, {"default": "int4-g32"}), (False, {"default": "int4-g32", "layers": {"model.embed_tokens": "int8"}})])
def test_dequantize_gives_plain_layers_computing_what_the_packed_ones_did(tmp_path, tie, plan):
    """transformers' ``model.dequantize()`` (it raised NotImplementedError): every packed linear and embedding becomes
    the plain layer holding its dequantized weight (a tied head and embedding one Parameter again), the logits those of
    the packed model on its exact kernel, and the saved folder a plain one transformers loads alone."""
    tiny_llama(tie=tie).save_pretrained(tmp_path / "dense")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", quantization_config=HfLowprecConfig(plan))
    for m in model.modules():
        if isinstance(m, PackedLinear):
            m.backend = "dequant"  # the codes' exact values, whichever kernel is fastest here
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        packed = model(input_ids=ids).logits
        model.dequantize()
        assert not any(isinstance(m, PackedLinear) or "Packed" in type(m).__name__ for m in model.modules())
        assert type(model.lm_head) is torch.nn.Linear and type(model.model.embed_tokens) is torch.nn.Embedding
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
        assert all(p.requires_grad for p in model.parameters()) and not hasattr(model, "hf_lowprec_plan")  # dense
        torch.testing.assert_close(model(input_ids=ids).logits, packed, rtol=1e-6, atol=1e-6)
    model.save_pretrained(tmp_path / "plain")
    import json

    assert "quantization_config" not in json.loads((tmp_path / "plain" / "config.json").read_text())
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(tmp_path / "plain")(input_ids=ids).logits, packed, rtol=1e-6, atol=1e-6)


def test_dequantize_under_adapters_points_to_the_merge_that_keeps_them(tmp_path):
    from peft import LoraConfig, get_peft_model

    tiny_llama().save_pretrained(tmp_path / "dense")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", quantization_config=HfLowprecConfig())
    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match=r"^dequantize\(\) the base before adding LoRA adapters; .*export_int4_lora\(model, out, merge=True"):
        model.dequantize()
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == 14  # nothing half-done
