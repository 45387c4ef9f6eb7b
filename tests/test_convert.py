"""apply_plan / revert / freeze on HF models, PEFT-wrapped ones and tied embeddings."""

import pytest
import torch
from conftest import VOCAB, lm_batches, tiny_llama
from peft import LoraConfig, get_peft_model
from torch import nn

from hf_lowprec import (
    FP8Linear,
    Int4Embedding,
    Int4Linear,
    PackedInt4Linear,
    PackedInt8Linear,
    PrecisionPlan,
    apply_plan,
    freeze,
    revert,
)
from hf_lowprec.convert import eligible_layers
from hf_lowprec.modules import FROZEN_TYPES, LOW_PRECISION_TYPES, PackedLinear


def test_swap_keeps_parameter_objects_so_an_earlier_optimizer_still_trains_them(llama):
    params_before = {n: p for n, p in llama.named_parameters()}
    opt = torch.optim.SGD(llama.parameters(), lr=0.1)
    report = apply_plan(llama, PrecisionPlan({"*.mlp.*": "int4-g64"}, default="fp8"))
    assert isinstance(llama.model.layers[0].self_attn.q_proj, FP8Linear)
    assert isinstance(llama.model.layers[0].mlp.up_proj, Int4Linear)
    for n, p in llama.named_parameters():
        if n in params_before:
            assert p is params_before[n], n
        else:
            assert n in report.new_parameters and n.endswith("weight_quantizer.step")
    snapshot = {n: p.detach().clone() for n, p in params_before.items()}
    batch = lm_batches(1)[0]
    llama(**batch).loss.backward()
    opt.step()
    unchanged = [n for n, p in params_before.items() if torch.equal(p, snapshot[n])]
    assert unchanged == []


def test_apply_plan_is_idempotent_and_revertible(llama):
    plan = PrecisionPlan({"*.mlp.*": "int4-g64"}, default="fp8")
    apply_plan(llama, plan)
    modules = {n: m for n, m in llama.named_modules()}
    again = apply_plan(llama, plan)
    assert all(r.reason == "unchanged" for r in again.swapped)
    assert again.new_parameters == {}
    assert all(modules[n] is m for n, m in llama.named_modules() if n in modules)
    weight = llama.lm_head.weight
    assert revert(llama) == 15
    assert type(llama.lm_head) is nn.Linear and llama.lm_head.weight is weight
    assert not hasattr(llama, "hf_lowprec_plan")


@pytest.mark.parametrize("fmt", ["fp8", "int4-g32"])
def test_a_swapped_layer_keeps_its_training_mode_and_hooks_both_ways(llama, fmt):
    """Conversion and revert carry the layer's training mode, its forward hooks and the attributes they read over (a
    swapped layer came back in training mode after ``model.eval()``, and a hook registered on it was no longer called,
    or failed); the hook's handle still removes it from the layer in its place."""
    llama.eval()
    calls = []
    handle = llama.model.layers[0].mlp.up_proj.register_forward_hook(lambda m, *_: calls.append(m.noise_alpha))
    llama.model.layers[0].mlp.up_proj.noise_alpha = 5.0  # what a hook reads (transformers' NEFTune sets one)
    llama.model.layers[0].mlp.up_proj.hf_lowprec_kept_dense = True  # a marker of hf-lowprec's: not carried
    ids = torch.randint(0, 256, (1, 8))
    apply_plan(llama, fmt)
    up = llama.model.layers[0].mlp.up_proj
    assert isinstance(up, LOW_PRECISION_TYPES) and not up.training and not any(m.training for m in llama.modules())
    assert not hasattr(up, "hf_lowprec_kept_dense")
    up.noise_scale = 0.5  # set on the converted layer: carried on too
    llama(input_ids=ids)
    revert(llama)
    plain = llama.model.layers[0].mlp.up_proj
    assert type(plain) is torch.nn.Linear and not plain.training and plain.noise_scale == 0.5
    assert not hasattr(plain, "spec")  # the attributes others set come back, none of the low-precision layer's own
    llama(input_ids=ids)
    assert calls == [5.0, 5.0]
    handle.remove()
    llama(input_ids=ids)
    assert len(calls) == 2


def test_a_layer_peft_trains_whole_is_planned_by_its_own_name_and_converts_its_trained_copy(llama):
    """``modules_to_save=["lm_head"]``: PEFT trains and runs a copy of the head, keeping the original frozen beside it.
    The plan names it ``lm_head`` (refused before: a ModulesToSaveWrapper) and converts the copy that runs; the
    unused original is no layer of the plan (it was converted and reported as ``lm_head.original_module``)."""
    model = get_peft_model(llama, LoraConfig(target_modules=["q_proj"], modules_to_save=["lm_head"]))
    wrapper = model.base_model.model.lm_head
    assert [n for n in eligible_layers(model) if "lm_head" in n] == ["lm_head"]
    apply_plan(model, PrecisionPlan({"lm_head": "int4-g32"}, default="bf16"))
    assert isinstance(wrapper.modules_to_save["default"], Int4Linear) and type(wrapper.original_module) is nn.Linear
    ids = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        hidden = model.base_model.model.model(input_ids=ids).last_hidden_state
        torch.testing.assert_close(logits, wrapper.modules_to_save["default"](hidden))  # the copy computed them
    revert(model)
    assert type(wrapper.modules_to_save["default"]) is nn.Linear


@pytest.mark.parametrize("tables", [{"lm_head": "fp8"}, {"lm_head": "int8"}, {"model.embed_tokens": "int4-g64"}])
def test_a_converted_vocabulary_table_refuses_a_resize_until_reverted(tables):
    """resize_token_embeddings (a chat template's new tokens) put a dense nn.Linear in a converted head's place (its
    planned FP8 gone, the plan still saying fp8) or, with a packed head, resized the embedding and then failed: the
    model half-resized. It refuses now, touching nothing, and resizes once the tables are plain again."""
    model = tiny_llama()
    apply_plan(model, PrecisionPlan(tables, default="bf16"), learn_scales=False)
    freeze(model)  # an int8 head is packed
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(ValueError, match=rf"^resize_token_embeddings\({VOCAB + 8}\): this model's .* is an hf-lowprec layer"):
        model.resize_token_embeddings(VOCAB + 5, pad_to_multiple_of=8)
    assert {n: type(m) for n, m in model.named_modules()} == before
    assert model.get_input_embeddings().num_embeddings == model.config.vocab_size == VOCAB
    assert model.resize_token_embeddings(VOCAB) is model.get_input_embeddings()
    if any(isinstance(m, FROZEN_TYPES) for m in model.modules()):
        return  # a packed layer has no dense weight to revert to
    revert(model)
    model.resize_token_embeddings(VOCAB + 8)
    assert model.lm_head.out_features == model.get_input_embeddings().num_embeddings == model.config.vocab_size == VOCAB + 8


def test_revert_through_a_peft_wrapper(llama):
    """A PeftModel forwards attribute reads to the model it wraps: revert finds the plan there, not on the wrapper."""
    apply_plan(llama, PrecisionPlan({"*.mlp.*": "int4-g64"}, default="fp8"))
    peft_model = get_peft_model(llama, LoraConfig(r=4, target_modules=["q_proj"]))
    assert hasattr(peft_model, "hf_lowprec_plan")
    assert revert(peft_model) == 15  # the LoRA-wrapped q_proj's base layers among them
    assert not hasattr(peft_model, "hf_lowprec_plan") and not hasattr(llama, "hf_lowprec_plan")
    assert not any(isinstance(m, (FP8Linear, Int4Linear)) for m in llama.modules())


def test_replanning_a_converted_layer_changes_its_format(llama):
    apply_plan(llama, "fp8")
    apply_plan(llama, PrecisionPlan({"lm_head": "int4-g32"}))
    assert isinstance(llama.lm_head, Int4Linear)
    assert type(llama.model.layers[0].self_attn.q_proj) is nn.Linear


def test_report_fractions_and_emulation_notes(llama):
    report = apply_plan(llama, PrecisionPlan({"*.mlp.*": "int4-g64"}, default="fp8"))
    fr = report.fractions()
    assert set(fr) == {"fp8", "int4-g64", "bf16"} and abs(sum(fr.values()) - 1) < 1e-9
    fp8_rows = [r for r in report.layers if r.applied == "fp8"]
    assert fp8_rows and all(r.backend == "emulated" and "no FP8 tensor cores" in r.reason for r in fp8_rows)
    assert "layers in low precision" in str(report)
    # the layers the plan leaves high precision keep their own dtype (fp32 here): said "kept", not "bf16"
    assert f"kept {fr['bf16']:.1%}" in str(report).splitlines()[0] and "bf16" not in str(report).splitlines()[0]


def test_tied_embeddings_share_one_weight_and_one_quantizer():
    model = tiny_llama(tie=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    apply_plan(model, PrecisionPlan({"model.embed_tokens": "int4-g32", "lm_head": "int4-g32"}))
    assert isinstance(model.model.embed_tokens, Int4Embedding)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight_quantizer is model.model.embed_tokens.weight_quantizer
    ids = torch.arange(10)
    table = model.lm_head.quantized_weight()
    assert torch.equal(model.model.embed_tokens(ids), table[ids])


def test_tied_weight_counts_once_in_fractions_and_summary():
    model = tiny_llama(tie=True)
    plan = PrecisionPlan({"model.embed_tokens": "bf16", "lm_head": "bf16"}, default="int4-g64")
    report = apply_plan(model, plan)
    unique = {id(m.weight): m.weight.numel() for m in eligible_layers(model).values()}
    embed = model.model.embed_tokens.weight.numel()
    assert [r.tied_to for r in report.layers if r.name == "lm_head"] == ["model.embed_tokens"]
    assert report.fractions()["bf16"] == pytest.approx(embed / sum(unique.values()))
    rows = {r["format"]: r for r in plan.summary(model)}
    assert rows["bf16"]["layers"] == 2 and rows["bf16"]["params"] == embed  # two layers, one weight
    assert sum(r["params"] for r in rows.values()) == sum(unique.values())


def test_tied_embeddings_with_two_integer_formats_are_refused():
    model = tiny_llama(tie=True)
    with pytest.raises(ValueError, match="tied embeddings.*lm_head.*int4-g64"):
        apply_plan(model, PrecisionPlan({"model.embed_tokens": "int4-g32", "lm_head": "int4-g64"}))


def test_peft_lora_model_converts_base_layers_and_keeps_adapters(llama):
    peft_model = get_peft_model(llama, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    names = set(eligible_layers(peft_model))
    assert "model.layers.0.self_attn.q_proj" in names and not any("lora" in n for n in names)
    apply_plan(peft_model, PrecisionPlan({"model.layers.0.self_attn.q_proj": "fp8", "*.mlp.*": "int4-g64"}))
    wrapper = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(wrapper.base_layer, FP8Linear)
    assert type(wrapper.lora_A["default"]) is nn.Linear
    batch = lm_batches(1)[0]
    peft_model(**batch).loss.backward()
    assert wrapper.lora_B["default"].weight.grad.abs().sum() > 0


def test_freeze_packs_int4_and_int8_layers_and_keeps_outputs(llama):
    apply_plan(llama, PrecisionPlan({"*.mlp.*": "int4-g64", "*.q_proj": "int8", "*.k_proj": "int8-g32"}))
    batch = lm_batches(1)[0]
    with torch.no_grad():
        before = llama(**batch).logits
    assert freeze(llama) == 8  # int8-g32 has no packed layer: it stays fake-quantized
    packed = [m for m in llama.modules() if isinstance(m, PackedLinear)]
    assert sum(isinstance(m, PackedInt4Linear) for m in packed) == 6 and isinstance(llama.model.layers[1].mlp.down_proj, PackedInt4Linear)
    assert isinstance(llama.model.layers[1].self_attn.q_proj, PackedInt8Linear) and isinstance(llama.model.layers[1].self_attn.k_proj, Int4Linear)
    for m in packed:  # the dequantizing backend computes exactly what the QAT layers computed
        m.backend = "dequant"
    with torch.no_grad():
        assert torch.allclose(llama(**batch).logits, before, atol=1e-4)
    for m in packed:  # the int8 backend adds int8 per-token activations: close, not equal
        m.backend = "auto"
    with torch.no_grad():
        fast = llama(**batch).logits
    assert (fast - before).norm() / before.norm() < 0.02
    with pytest.raises(ValueError, match=r"is packed int8 \(frozen codes, no dense weight\) and cannot change to bf16: .* load the checkpoint dense"):
        apply_plan(llama, PrecisionPlan({"*.mlp.*": "fp8"}))


def test_model_without_eligible_layers_is_refused():
    model = nn.Sequential(nn.LayerNorm(8), nn.ReLU())
    with pytest.raises(ValueError, match="Sequential has no eligible layers"):
        apply_plan(model, "fp8")
    with pytest.raises(ValueError, match="^apply_plan converts a torch nn.Module .*, got str$"):  # a path, say
        apply_plan("model", "fp8")


def test_a_model_wrapped_for_several_processes_is_refused_before_any_layer_changes(llama):
    """DataParallel/DDP hold the parameters they were given (DDP's gradient buckets): a learned step a conversion adds
    inside one would train unsynchronised, so the plain model is converted first; the wrapper is named."""
    wrapped = nn.DataParallel(llama)
    with pytest.raises(ValueError, match=r"^apply_plan got a model already wrapped by DataParallel; convert the plain model first"):
        apply_plan(wrapped, "int4-g32")
    assert not any(isinstance(m, LOW_PRECISION_TYPES) for m in llama.modules())
    from hf_lowprec import LowPrecisionPlugin

    with pytest.raises(ValueError, match="^the model is already wrapped by DataParallel; pass the plain model"):
        LowPrecisionPlugin("fp8").convert(wrapped, torch.optim.AdamW(llama.parameters()))
    assert not any(isinstance(m, LOW_PRECISION_TYPES) for m in llama.modules())


def test_lookup_tables_computing_more_than_a_lookup_are_left_as_they_are_and_a_plan_naming_one_is_refused():
    """Bart's learned positions shift their indices (as OPT's do), a normed embedding normalises its rows: a swapped
    table would compute neither (it crashed on Bart's float positions, or read the wrong rows), so they are no layer
    a plan converts nor one that refuses the model; Bart's scaled word embedding is (its scale is read)."""
    from transformers import BartConfig, BartForConditionalGeneration

    bart = BartForConditionalGeneration(BartConfig(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=64, max_position_embeddings=32))
    layers = eligible_layers(bart)
    assert "model.shared" in layers and not any("embed_positions" in name for name in layers)
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        before = bart.eval()(input_ids=ids, labels=ids).logits
    apply_plan(bart, PrecisionPlan({"model.shared": "int8"}, default="fp8"))
    assert type(bart.model.encoder.embed_positions).__name__ == "BartLearnedPositionalEmbedding"
    with torch.no_grad():
        after = bart(input_ids=ids, labels=ids).logits
    assert (after - before).norm() / before.norm() < 0.1  # the same model in low precision, positions as they were
    with pytest.raises(ValueError, match="^plan entry 'model.encoder.embed_positions' is a BartLearnedPositionalEmbedding, an embedding whose forward computes more than a lookup .*: hf-lowprec leaves it as it is"):
        apply_plan(bart, PrecisionPlan({"model.encoder.embed_positions": "fp8"}))

    class NormedEmbedding(nn.Embedding):
        def __init__(self):
            super().__init__(16, 8)
            self.embed_norm = nn.LayerNorm(8)

        def forward(self, ids):
            return self.embed_norm(super().forward(ids))

    class ScaledWithAnExtraRow(nn.Embedding):  # T5Gemma2's: a scale, and a row of its own swapped in
        def __init__(self):
            super().__init__(16, 8)
            self.embed_scale = 2.0
            self.eoi_embedding = nn.Parameter(torch.zeros(8))

        def forward(self, ids):
            return torch.where((ids == 3)[..., None], self.eoi_embedding, super().forward(ids)) * self.embed_scale

    model = nn.Sequential(NormedEmbedding(), ScaledWithAnExtraRow(), nn.Linear(8, 8))
    assert list(eligible_layers(model)) == ["2"]


def test_broadcast_added_tensors_are_no_matrices_that_refuse_a_model():
    """ViT adds its cls token ``[1, 1, hidden]`` and position embeddings ``[1, patches + 1, hidden]``: no layer
    multiplies by them, so its Linears convert (the whole architecture was refused) and train."""
    from transformers import ViTConfig, ViTForImageClassification

    vit = ViTForImageClassification(ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=16, patch_size=8, num_labels=3))
    report = apply_plan(vit, "fp8")
    assert len(report.layers) == 7 and not report.not_applied and isinstance(vit.classifier, LOW_PRECISION_TYPES)
    loss = vit(pixel_values=torch.randn(2, 3, 16, 16), labels=torch.tensor([0, 2])).loss
    loss.backward()
    assert torch.isfinite(loss) and vit.vit.layers[0].attention.q_proj.weight.grad.abs().sum() > 0


def test_a_model_of_layers_hf_lowprec_cannot_convert_is_refused_not_half_converted():
    """GPT-2 multiplies in transformers' ``Conv1D`` (weight ``[in, out]``), which is no ``nn.Linear``: a low-precision
    plan or scan is refused naming them, instead of converting the head alone while reporting the plan's format."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_lowprec import sensitivity

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=32))
    refusal = r"GPT2LMHeadModel multiplies 89% of its matrix weights in 8 Conv1D layers \(e.g. 'transformer.h.0.attn.c_attn'\), which hf-lowprec does not convert"
    for plan in ("fp8", "int4-g32", PrecisionPlan({"lm_head": "fp8"}, default="bf16")):
        with pytest.raises(ValueError, match=refusal):
            apply_plan(gpt2, plan)
    assert not any(isinstance(m, LOW_PRECISION_TYPES) for m in gpt2.modules())
    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(ValueError, match=refusal):
        sensitivity.scan(gpt2, [{"input_ids": ids, "labels": ids}], formats=("fp8",))
    apply_plan(gpt2, "bf16")  # a plan of high-precision formats only names what the layers are
    kept_head = PrecisionPlan.uniform("fp8", keep=("lm_head",))  # LowPrecisionCallback("fp8")'s: no layer converted
    with pytest.raises(ValueError, match=refusal):  # the same refusal (it said the plan put no layer in low precision)
        apply_plan(gpt2, kept_head)
    from hf_lowprec.ondevice.planning import check_quantizable

    with pytest.raises(ValueError, match=refusal):  # a packed INT4 base (HfLowprecConfig, load_int4_lora)
        check_quantizable(gpt2, PrecisionPlan.uniform("int4-g32", keep=("lm_head",)))


def test_mixture_of_experts_models_are_refused_counting_their_fused_experts_and_routers():
    """An MoE's experts are fused ``[experts, out, in]`` parameters and its router may be an ``nn.Linear`` subclass
    with a forward of its own (Llama-4's returns scores and logits): neither is converted, so the model is refused,
    its share counting the experts' matrices (Llama-4's router was swapped for an FP8Linear, reported as 60% FP8 with
    the experts left out, and the first forward failed; Mixtral's share counted the routers alone, 1%)."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig, MixtralConfig, MixtralForCausalLM

    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, num_local_experts=4)  # fmt: skip
    llama4 = Llama4ForCausalLM(Llama4TextConfig(**shape, intermediate_size_mlp=128, head_dim=16, num_experts_per_tok=1))
    mixtral = MixtralForCausalLM(MixtralConfig(**shape))
    for model, name, share, kinds in ((llama4, "Llama4ForCausalLM", 65, "Llama4Router/Llama4TextExperts"),
                                      (mixtral, "MixtralForCausalLM", 77, "MixtralExperts/MixtralTopKRouter")):  # fmt: skip
        refusal = rf"{name} multiplies {share}% of its matrix weights in 4 {kinds} layers"
        with pytest.raises(ValueError, match=refusal):
            apply_plan(model, PrecisionPlan({"lm_head": "bf16"}, default="fp8"))
        assert not any(isinstance(m, LOW_PRECISION_TYPES) for m in model.modules())
    experts = sum(p.numel() for n, p in mixtral.named_parameters() if ".experts." in n or ".gate." in n)
    matrices = experts + sum(p.numel() for n, p in mixtral.named_parameters() if p.dim() == 2 and ".gate." not in n)
    assert round(100 * experts / matrices) == 77  # the refusal's share, counted here from the parameters' names


def test_plan_given_as_path_dict_or_format_name(tmp_path, llama):
    path = PrecisionPlan({"lm_head": "int4-g64"}).save(tmp_path / "p.yaml")
    assert isinstance(apply_plan(llama, str(path)) and llama.lm_head, Int4Linear)
    apply_plan(llama, {"default": "fp8"})
    assert isinstance(llama.lm_head, FP8Linear)
    apply_plan(llama, "bf16")
    assert type(llama.lm_head) is nn.Linear
    with pytest.raises(ValueError, match="unknown format 'fp7'"):
        apply_plan(llama, "fp7")


def test_a_scaled_embedding_is_refused_a_low_precision_format_and_its_tied_head_is_not(caplog):
    """Gemma's embedding multiplies its rows by sqrt(hidden); the fake-quantized embeddings would drop that factor, so a
    plan naming it fails with one line, while its tied output head still converts and the embedding's rows stay exact."""
    from transformers import GemmaConfig, GemmaForCausalLM

    config = GemmaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=256, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    model = GemmaForCausalLM(config)
    ids = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        rows = model.get_input_embeddings()(ids)
    for fmt in ("fp8", "int4-g32"):
        with pytest.raises(ValueError, match=r"multiplies its rows by 8 \(embed_scale\).*leave it out of the plan \(it keeps the model's dtype"):
            apply_plan(model, PrecisionPlan({"model.embed_tokens": fmt}))
    with caplog.at_level("WARNING", logger="hf_lowprec.convert"):
        report = apply_plan(model, PrecisionPlan({"lm_head": "int4-g32"}))
    head = {r.name: r for r in report.layers}["lm_head"]
    assert head.applied == "int4-g32" and head.tied_to == "model.embed_tokens"
    # one weight in two formats: said in the log and the report (the report counted it as bf16 alone)
    said = "shares its weight with 'model.embed_tokens', which runs bf16: counted there"
    assert said in head.reason and f"lm_head runs int4-g32 and {said}" in caplog.text
    from hf_lowprec.training.session import coverage

    assert coverage(model, report)["flops_int4-g32"] > 0.25  # the head multiplies: its FLOPs count (params 0 here)
    with torch.no_grad():
        torch.testing.assert_close(model.get_input_embeddings()(ids), rows, rtol=0, atol=0)


def test_a_compiled_model_is_planned_by_the_plain_models_layer_names():
    """torch.compile wraps the model as ``_orig_mod``: a plan naming layer '0' was refused ('not a layer'), and one
    saved from the compiled model named '_orig_mod.0', which the plain model has not."""
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32))
    compiled = torch.compile(model, backend="eager")
    report = apply_plan(compiled, PrecisionPlan({"0": "bf16"}, default="fp8"))
    assert {r.name: r.applied for r in report.layers} == {"0": "bf16", "2": "fp8"}
    assert type(model[2]).__name__ == "FP8Linear" and type(model[0]) is nn.Linear
