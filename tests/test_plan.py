"""PrecisionPlan: rules, files, validation against a model, summaries."""

import json

import pytest

from hf_lowprec.formats import FormatSpec
from hf_lowprec.plan import PrecisionPlan


def test_exact_names_beat_patterns_and_first_pattern_wins():
    plan = PrecisionPlan(
        {"*.mlp.*": "int4-g64", "re:.*\\.(q|k)_proj": "fp8-rowwise", "*": "fp8", "model.layers.0.mlp.up_proj": "bf16"},
        default="fp8-block",
    )
    assert plan.resolve("model.layers.0.mlp.up_proj").name == "bf16"
    assert plan.resolve("model.layers.1.mlp.up_proj").name == "int4-g64"
    assert plan.resolve("model.layers.1.self_attn.q_proj").name == "fp8-rowwise"
    assert plan.resolve("lm_head").name == "fp8"
    assert PrecisionPlan(default="fp8").resolve("lm_head").name == "fp8"


def test_embeddings_change_format_only_when_named(llama):
    plan = PrecisionPlan(default="int4-g64")
    assigned = plan.assign(llama)
    assert assigned["model.embed_tokens"].name == "bf16"
    assert assigned["lm_head"].name == "int4-g64"
    assert PrecisionPlan({"model.embed_tokens": "int4-g32"}).assign(llama)["model.embed_tokens"].name == "int4-g32"


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_save_load_round_trip(tmp_path, suffix):
    plan = PrecisionPlan({"lm_head": "bf16", "*.mlp.*": "int4-g128-asym"}, default="fp8-rowwise", model="tiny")
    path = plan.save(tmp_path / f"plan{suffix}")
    again = PrecisionPlan.load(path)
    assert again == plan and list(again.layers) == list(plan.layers)
    assert not list(tmp_path.glob(".*tmp"))  # no temp files left behind


@pytest.mark.parametrize(
    "text,suffix,match",
    [
        ('{"layers": {"lm_head": "fp8"', ".json", "not valid JSON"),
        ("layers: [unclosed", ".yaml", "not valid YAML: line 1, column 18: expected ',' or ']'"),
        ('{"layer": {}}', ".json", "unknown plan key.*'layer'.*allowed keys are default, layers, model"),
        ('{"layers": ["lm_head"]}', ".json", "'layers' must map layer names to formats"),
        ("model: 2024\ndefault: fp8\n", ".yaml", "'model' must be the model's name or path \\(a string\\), got 2024"),
        ('{"layers": {"lm_head": "int3"}}', ".json", "plan entry 'lm_head': unknown format 'int3'.*choose one of"),
        ("[1, 2]", ".yaml", "a plan must be a mapping"),
        # a key written twice: the parsers keep the last one silently
        ('{"default": "fp8", "default": "int4"}', ".json", "not valid JSON: key 'default' is written twice"),
        ("layers:\n  lm_head: fp8\n  lm_head: int4\n", ".yaml", "line 3, column 3: key 'lm_head' is written twice"),
    ],
)
def test_malformed_plan_files_raise_one_line_errors(tmp_path, text, suffix, match):
    path = tmp_path / f"bad{suffix}"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as e:
        PrecisionPlan.load(path)
    assert "\n" not in str(e.value) and str(path) in str(e.value)


def test_yaml_anchors_and_merge_keys_still_read(tmp_path):
    """The duplicate-key check constructs each key itself: a merge key ("<<: *base") has no constructor of its own."""
    path = tmp_path / "plan.yaml"
    path.write_text("layers:\n  <<: {'*.mlp.*': int4-g64, lm_head: fp8}\n  lm_head: bf16\n")  # the explicit key wins
    assert PrecisionPlan.load(path).layers == {"*.mlp.*": FormatSpec.parse("int4-g64"), "lm_head": FormatSpec.parse("bf16")}


def test_missing_plan_file():
    with pytest.raises(ValueError, match="does not exist"):
        PrecisionPlan.load("/nonexistent/plan.json")


def test_unknown_layer_lists_close_matches(llama):
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.up_prj' is not a layer.*close matches: model.layers.0.mlp.up_proj") as e:
        PrecisionPlan({"model.layers.0.mlp.up_prj": "fp8"}).validate(llama)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"^plan entry 'transformer.h.0.attn.c_attn' is not a layer of this model; its layers are named like 'model.embed_tokens', 'model.layers.\d.\w+"):
        PrecisionPlan({"transformer.h.0.attn.c_attn": "fp8"}).validate(llama)  # a GPT-2 plan: no close match, examples


def test_non_linear_target_is_named_with_its_type(llama):
    with pytest.raises(ValueError, match="'model.norm' is a LlamaRMSNorm; only nn.Linear and nn.Embedding"):
        PrecisionPlan({"model.norm": "fp8"}).validate(llama)


def test_pattern_matching_nothing_is_an_error(llama):
    with pytest.raises(ValueError, match=r"'\*.conv.\*' matches no eligible layer"):
        PrecisionPlan({"*.conv.*": "fp8"}).validate(llama)


def test_summary_counts_params_and_bytes(llama):
    plan = PrecisionPlan({"*.mlp.*": "int4-g64"}, default="fp8")
    rows = {r["format"]: r for r in plan.summary(llama)}
    mlp = sum(m.weight.numel() for n, m in llama.named_modules() if ".mlp." in n and hasattr(m, "weight"))
    assert rows["int4-g64"]["params"] == mlp and rows["int4-g64"]["layers"] == 6
    assert rows["int4-g64"]["bytes"] == int(mlp * (0.5 + 2 / 64))
    assert abs(sum(r["fraction"] for r in rows.values()) - 1) < 1e-9
    est = plan.memory_estimate(llama)
    assert 0.2 < est["ratio"] < 0.5  # fp32 weights → mostly 1 byte / 0.53 byte, embeddings kept
    assert "int4-g64" in plan.format_summary(llama)


def test_plan_dict_round_trip_is_json_serialisable():
    plan = PrecisionPlan.uniform("fp8", keep=("lm_head",))
    data = json.loads(json.dumps(plan.to_dict()))
    assert PrecisionPlan.from_dict(data) == plan
    assert plan.default == FormatSpec.parse("fp8")


def test_resolve_plan_reads_every_kind_of_plan_argument(tmp_path, monkeypatch):
    from hf_lowprec.plan import PLAN_FILE, is_auto, resolve_plan

    plan = PrecisionPlan({"lm_head": "bf16", "*.mlp.*": "int4-g64"}, default="fp8")
    plan.save(tmp_path / "plan.yaml")
    (tmp_path / "ckpt").mkdir()
    plan.save(tmp_path / "ckpt" / PLAN_FILE)
    for source in (plan, plan.to_dict(), tmp_path / "plan.yaml", str(tmp_path / "plan.yaml"), tmp_path / "ckpt", str(tmp_path / "ckpt")):
        assert resolve_plan(source).to_dict() == plan.to_dict(), source
    uniform = resolve_plan("int4-g64", keep=("lm_head",))
    assert uniform.resolve("model.layers.0.mlp.up_proj").name == "int4-g64" and uniform.resolve("lm_head").name == "bf16"
    assert is_auto("auto") and not is_auto("fp8") and not is_auto(plan)
    (tmp_path / "int4-g64").mkdir()  # an earlier run's `-o int4-g64` in the working folder: the name is the format's
    plan.save(tmp_path / "int4-g64" / PLAN_FILE)
    monkeypatch.chdir(tmp_path)
    assert resolve_plan("int4-g64", keep=("lm_head",)).to_dict() == uniform.to_dict()
    assert resolve_plan("./int4-g64").to_dict() == plan.to_dict()  # the folder, by a path
    with pytest.raises(ValueError, match="keep= applies to a format-name plan"):
        resolve_plan(plan, keep=("lm_head",))
    with pytest.raises(ValueError, match="plan must be 'auto', a plan file or folder, or a format name: .*int3"):
        resolve_plan("int3")
    with pytest.raises(ValueError, match="plan must be 'auto', a plan file or folder, or a format name: "):
        resolve_plan("")  # not the working folder
    with pytest.raises(ValueError, match=f"holds no {PLAN_FILE}"):
        resolve_plan(tmp_path)
    for missing in ("out/checkpoint-500", tmp_path / "gone" / "plan.json"):  # a path, not an unknown format name
        with pytest.raises(ValueError, match=rf"^plan '{missing}' does not exist \(a plan .json/.yaml file, or a"):
            resolve_plan(missing)
    with pytest.raises(ValueError, match="got int"):
        resolve_plan(3)


def test_a_plan_in_a_message_is_one_short_line():
    """Errors name a plan by its default and first rules, not its whole dict (hundreds of entries on a real model)."""
    plan = PrecisionPlan({f"model.layers.{i}.mlp.down_proj": "int8" for i in range(30)}, default="int4-g64")
    assert plan.brief() == (
        "(default int4-g64; rules model.layers.0.mlp.down_proj: int8, model.layers.1.mlp.down_proj: int8, "
        "model.layers.2.mlp.down_proj: int8, and 27 more)"
    )
    assert PrecisionPlan(default="fp8").brief() == "(default fp8; rules none)"


def test_a_plan_made_for_another_model_says_so(caplog):
    from conftest import tiny_llama

    model = tiny_llama()
    model.config.name_or_path = "/models/other-model"
    PrecisionPlan({"lm_head": "bf16"}, default="fp8", model="me/tiny").validate(model)
    assert "the plan was made for 'me/tiny' and is applied to '/models/other-model'" in caplog.text
    caplog.clear()
    PrecisionPlan(default="fp8", model="/elsewhere/other-model").validate(model)  # the same model, moved: no word
    assert caplog.text == ""
