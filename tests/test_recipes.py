"""Recipes: the built-ins load and check; bad files and overrides fail with errors naming key, file and allowed values."""

import pytest
import yaml
from conftest import tiny_llama

from hf_lowprec import apply_plan
from hf_lowprec.formats import FormatSpec
from hf_lowprec.recipe import Recipe, list_recipes, load_recipe

REQUIRED = {"fp8-train", "auto-mixed", "int4-ondevice-lora", "qat-int4"}


def test_builtin_recipes_load_and_round_trip():
    recipes = {r.name: r for r in list_recipes()}
    assert REQUIRED <= set(recipes)
    for r in recipes.values():
        assert r.description and r.summary and len(r.summary) < len(r.description)
        assert Recipe.from_dict(yaml.safe_load(r.to_yaml()), "again") == r
    fp8 = recipes["fp8-train"]
    assert fp8.method == "full" and fp8.precision.is_auto and fp8.precision.budget == {"min_fp8_fraction": 0.9}
    assert {FormatSpec.parse(f).family for f in fp8.precision.formats} == {"fp8"}
    assert recipes["auto-mixed"].precision.is_auto and recipes["auto-mixed"].precision.budget
    assert recipes["int4-ondevice-lora"].method == "int4-lora"
    assert recipes["qat-int4"].export.weights == "int4-packed"


def test_fixed_plan_of_a_recipe_applies_to_a_model():
    model = tiny_llama()
    report = apply_plan(model, load_recipe("qat-int4").precision.fixed_plan())
    applied = {r.name: r.applied for r in report.layers}
    assert applied["lm_head"] == "bf16" and applied["model.layers.0.mlp.up_proj"] == "int4-g64"
    with pytest.raises(ValueError, match=r"^precision\.plan 'auto' has no fixed plan; it is found by a sensitivity scan$"):
        load_recipe("auto-mixed").precision.fixed_plan()


def _write(tmp_path, data, name="r.yaml"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return str(path)


@pytest.mark.parametrize(
    "data, expected",
    [
        ({"training": {"max_stepz": 3}}, r"unknown key 'training\.max_stepz' \(did you mean 'training\.max_steps'\?\); allowed keys in training are max_steps, learning_rate"),
        ({"trainig": {}}, r"unknown key 'trainig' \(did you mean 'training'\?\); allowed keys in the recipe are name, description, method"),
        ({"training": {"max_steps": "ten"}}, r"'training\.max_steps' must be an integer, got 'ten'"),
        ({"training": {"gradient_checkpointing": "yes"}}, r"'training\.gradient_checkpointing' must be true/false"),
        ({"training": {"dtype": "fp16"}}, r"'training\.dtype' is 'fp16'; allowed values are auto, fp32, bf16"),
        ({"method": "qlora"}, r"'method' is 'qlora'; allowed values are full, int4-lora"),
        ({"precision": {"rounding": "rtn"}}, r"'precision\.rounding' is 'rtn'; allowed values are nearest, gptq, awq, awq\+gptq"),
        ({"precision": {"plan": "int3"}}, r"'precision\.plan' must be 'auto', a plan file .* or a format: unknown format 'int3'.*choose one of"),
        ({"precision": {"keep": [1, 2]}}, r"'precision\.keep' must be a list of strings"),
        ({"precision": {"budget": {"target_bits_per_param": "many"}}}, r"'precision\.budget\.target_bits_per_param' must be a number"),
        ({"precision": {"score": "trained"}}, r"'precision\.score' is 'trained'; allowed values are conversion, after-training"),
        # a fixed plan's recipe keeps a budget for --plan auto: a misspelt key is caught then too
        ({"method": "int4-lora", "precision": {"plan": "int4-g64-asym", "budget": {"target_bits": 6.25}}}, r"precision: unknown budget argument\(s\) \['target_bits'\] \(did you mean 'target_bits_per_param'\?\); choose from"),
        ({"training": {"max_steps": 0}}, r"'training\.max_steps' must be >= 1, got 0"),
        ({"training": {"block_size": 4}}, r"'training\.block_size' must be >= 8 tokens, got 4"),  # as --block-size
        # checked at load, not by transformers/PyTorch/PEFT after the model has loaded (or under their own names)
        ({"training": {"warmup_steps": -3}}, r"'training\.warmup_steps' must be a finite number >= 0, got -3"),
        ({"training": {"weight_decay": -0.1}}, r"'training\.weight_decay' must be a finite number >= 0, got -0\.1"),
        ({"training": {"weight_decay": float("nan")}},
         r"'training\.weight_decay' must be a finite number >= 0, got nan"),
        ({"training": {"learning_rate": 0}}, r"'training\.learning_rate' must be a finite number > 0, got 0"),
        ({"training": {"learning_rate": float("inf")}},
         r"'training\.learning_rate' must be a finite number > 0, got inf"),
        ({"training": {"learning_rate": float("nan")}},
         r"'training\.learning_rate' must be a finite number > 0, got nan"),
        ({"training": {"seed": -1}}, r"'training\.seed' must be in \[0, 2\*\*32\), got -1"),
        ({"lora": {"lora_dropout": 1.5}}, r"'lora\.lora_dropout' must be in \[0, 1\), got 1\.5"),
        ({"lora": {"lora_dropout": -0.1}}, r"'lora\.lora_dropout' must be in \[0, 1\), got -0\.1"),
        ({"lora": {"r": 0}}, r"'lora\.r' must be >= 1, got 0"),
        ({"lora": {"lora_alpha": -8}}, r"'lora\.lora_alpha' must be a finite number > 0, got -8"),
        ({"data": {"eval_fraction": 1.0}}, r"'data\.eval_fraction' must be in \(0, 1\), got 1\.0"),
        ({"data": {"eval_fraction": 0}}, r"'data\.eval_fraction' must be in \(0, 1\), got 0\.0: a run evaluates on held-out rows"),
        ({"method": "int4-lora", "precision": {"plan": "fp8"}}, r"precision\.plan 'fp8': method 'int4-lora' packs its frozen base in INT4; choose an INT4 format it stores \(e\.g\. int4, .*int4-g64-asym.*\), 'auto' or a plan file"),
        ({"method": "int4-lora", "precision": {"plan": "nf4"}}, r"precision\.plan 'nf4': method 'int4-lora' packs its frozen base in INT4"),
        ({"method": "int4-lora", "precision": {"keep": []}}, r"precision\.keep \[\]: method 'int4-lora' keeps the output head out of INT4 itself"),
        ({"method": "int4-lora", "precision": {"plan": "auto", "scan_method": "measured"}}, r"precision\.scan_method 'measured': method 'int4-lora' scans its 'auto' plan with Fisher scores"),
        ({"method": "int4-lora", "precision": {"plan": "auto"}}, r"method .int4-lora. with plan .auto. chooses among int4/int8 formats .* not \[.fp8.\]"),
        ({"method": "int4-lora", "precision": {"plan": "int4-g64", "keep": ["lm_head", "*.mlp.*"]}}, r"precision\.keep \['lm_head', '\*\.mlp\.\*'\]: method 'int4-lora' keeps the output head out of INT4 itself \(int8 or bf16 by its size\) and no other layer; name other"),
        # a recipe without method: full's, said (the message blamed the int4-lora setting alone)
        ({"training": {"activation_storage": "int8"}}, r"training\.activation_storage 'int8' applies to method 'int4-lora'; use 'none' \(the recipe names no method, so it is 'full'; one of full, int4-lora\)$"),
        ({"training": {"return_freed_memory": True}}, r"training\.return_freed_memory applies to method 'int4-lora'; use false"),
        ({"training": {"return_freed_memory": "auto"}}, r"training\.return_freed_memory applies to method 'int4-lora'; use false"),
        ({"method": "int4-lora", "precision": {"plan": "int4-g64-asym"}, "training": {"return_freed_memory": "often"}}, r"'training\.return_freed_memory' is 'often'; allowed values are false, true, auto"),
        ({"precision": {"rounding": "awq"}}, r"precision\.rounding 'awq' applies to method 'int4-lora'; method 'full' rounds its FP8 weights by one of nearest, gptq"),
        ({"method": "int4-lora", "training": {"activation_storage": "int4"}}, r"'training\.activation_storage' is 'int4'; allowed values are none, int8, fp8, fp8-e5m2"),
        ({"training": []}, r"training must be a mapping"),
        ({"precision": {"learn_steps": True}}, r"precision\.learn_steps applies to method 'int4-lora' \(a frozen INT4 base\)"),
        ({"method": "int4-lora", "precision": {"plan": "int4-g64-asym", "learn_steps": "zeros"}}, r"'precision\.learn_steps' is 'zeros'; allowed values are false, true, zero_points"),
        ({"method": "int4-lora", "precision": {"plan": "int4-g64-asym", "learn_steps": 1}}, r"'precision\.learn_steps' must be true/false or a string, got 1"),
        # each failed after the model's load and evaluation (or, the columns, read the messages one unsaid)
        ({"precision": {"plan": "auto", "formats": []}}, r"'precision\.formats' is empty: name the formats an auto plan"),
        ({"method": "int4-lora", "lora": {"target_modules": []}}, r"'lora\.target_modules' is empty: name the layers to adapt"),
        ({"data": {"text_column": "a", "messages_column": "b"}}, r"'data\.text_column' 'a' and 'messages_column' 'b': data is read as text or as chat messages; set one"),
        # the default output folder is runs/<name>: a path there wrote the run anywhere
        ({"name": "../../elsewhere"}, r"'name' must be a plain name \(no folders\), got '\.\./\.\./elsewhere'"),
    ],
)
def test_bad_recipe_files_name_key_file_and_allowed_values(tmp_path, data, expected):
    path = _write(tmp_path, data)
    with pytest.raises(ValueError, match=expected) as info:
        load_recipe(path)
    assert path in str(info.value) and "\n" not in str(info.value)


def test_malformed_yaml_unknown_name_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match=r"recipe '.*bad\.yaml' is not valid YAML: line 2, column 1: expected ','"):
        load_recipe(_write(tmp_path, "training: {max_steps: 3\n", "bad.yaml"))
    with pytest.raises(ValueError, match=r"is not valid YAML: line 3, column 2: .*\(while parsing a block mapping\)$"):
        load_recipe(_write(tmp_path, "lora:\n  r: 8\n lora_alpha: 16\n", "indent.yaml"))  # where, not only what
    with pytest.raises(ValueError, match=r"must be a YAML mapping"):
        load_recipe(_write(tmp_path, "- a\n- b\n", "list.yaml"))
    twice = "training:\n  max_steps: 5\nlora:\n  r: 8\ntraining:\n  warmup_steps: 2\n"  # PyYAML keeps the last
    with pytest.raises(ValueError, match=r"twice\.yaml' is not valid YAML: line 5, column 1: key 'training' is written"):
        load_recipe(_write(tmp_path, twice, "twice.yaml"))
    with pytest.raises(ValueError, match=r"unknown recipe 'fp9-train'; built-in recipes are auto-mixed, fp8-train, int4-ondevice-lora, qat-int4"):
        load_recipe("fp9-train")
    with pytest.raises(ValueError, match=r"recipe file '.*nope\.yaml' does not exist"):
        load_recipe(str(tmp_path / "nope.yaml"))
    (tmp_path / "folder.yaml").mkdir()  # it said "does not exist"
    with pytest.raises(ValueError, match=r"recipe file '.*folder\.yaml' is a folder, not a YAML file$"):
        load_recipe(str(tmp_path / "folder.yaml"))
    (tmp_path / "latin.yaml").write_bytes(b"name: caf\xe9\n")
    with pytest.raises(ValueError, match=r"recipe file '.*latin\.yaml' is not UTF-8 text \(invalid continuation byte"):
        load_recipe(str(tmp_path / "latin.yaml"))


def test_learn_steps_takes_true_false_or_zero_points(tmp_path):
    for value in (True, False, "zero_points"):
        data = {"method": "int4-lora", "precision": {"plan": "int4-g64-asym", "learn_steps": value}}
        assert load_recipe(_write(tmp_path, data)).precision.learn_steps == value
    overridden = load_recipe("int4-ondevice-lora").with_overrides({"precision.learn_steps": "zero_points"})
    assert overridden.precision.learn_steps == "zero_points"


def test_a_recipe_file_takes_its_name_from_the_file_and_defaults_the_rest(tmp_path):
    r = load_recipe(_write(tmp_path, {"precision": {"plan": "int4-g64"}}, "mine.yaml"))
    assert r.name == "mine" and r.training == Recipe("x").training and r.precision.plan == "int4-g64"


def test_an_int4_lora_recipe_without_a_plan_gets_that_methods_default_format(tmp_path):
    """Full training's default plan is fp8, which an INT4 base cannot hold: a user's int4-lora recipe that names no
    plan was refused for a value it never wrote."""
    from hf_lowprec.ondevice import DEFAULT_FORMAT

    for data in ({"method": "int4-lora"}, {"method": "int4-lora", "precision": {"learn_steps": True}}):
        recipe = load_recipe(_write(tmp_path, data))
        assert recipe.precision.plan == DEFAULT_FORMAT and recipe.export.weights == "int4-packed"  # what it writes
    with pytest.raises(ValueError, match="export.weights 'master' applies to method 'full'; method 'int4-lora' exports"):
        load_recipe(_write(tmp_path, {"method": "int4-lora", "export": {"weights": "master"}}))
    assert load_recipe(_write(tmp_path, {"method": "full"})).precision.plan == "fp8"
    assert load_recipe(_write(tmp_path, {"method": "int4-lora"})).training.optim == "adamw_torch_8bit"
    with pytest.raises(ValueError, match="precision.plan 'fp8': method 'int4-lora' packs its frozen base in INT4"):
        load_recipe(_write(tmp_path, {"method": "int4-lora", "precision": {"plan": "fp8"}}))


def test_lora_settings_on_a_full_recipe_are_refused_and_not_shown():
    """Full training has no adapters: --lora-r/--lora-init there were silently ignored, and `recipes qat-int4`
    showed a lora block and learn_steps it has no use for."""
    qat = load_recipe("qat-int4")
    with pytest.raises(ValueError, match=r"lora.r 8, lora.init 'loftq': LoRA applies to method 'int4-lora'"):
        qat.with_overrides({"lora.r": 8, "lora.init": "loftq"})
    with pytest.raises(ValueError, match=r"export.merge_lora applies to method 'int4-lora'"):
        qat.with_overrides({"export.merge_lora": True})
    shown = yaml.safe_load(qat.to_yaml())
    assert "lora" not in shown and "learn_steps" not in shown["precision"] and "merge_lora" not in shown["export"]
    assert Recipe.from_dict(shown, "again") == qat
    assert "lora" in yaml.safe_load(load_recipe("int4-ondevice-lora").to_yaml())


def test_overrides_replace_values_and_are_checked_like_files():
    base = load_recipe("fp8-train")
    r = base.with_overrides({"training.max_steps": 7, "training.learning_rate": 1e-3, "precision.plan": "int4-g64", "lora.r": None})
    assert (r.training.max_steps, r.training.learning_rate, r.precision.plan, r.lora.r) == (7, 1e-3, "int4-g64", base.lora.r)
    assert base.training.max_steps != 7  # frozen: the original is unchanged
    with pytest.raises(ValueError, match=r"unknown recipe key 'training\.max_step' \(did you mean 'training\.max_steps'\?\); allowed keys in training are max_steps"):
        base.with_overrides({"training.max_step": 3})
    with pytest.raises(ValueError, match=r"unknown recipe key 'trainig\.seed' \(did you mean 'training'\?\); 'trainig' is no section here, the sections are precision, training, lora, data, export$"):
        base.with_overrides({"trainig.seed": 3})  # it named no section
    with pytest.raises(ValueError, match=r"'training\.dtype' is 'fp16'; allowed values are auto, fp32, bf16"):
        base.with_overrides({"training.dtype": "fp16"})
    with pytest.raises(ValueError, match=r"unknown format 'int3'"):
        base.with_overrides({"precision.plan": "int3"})
    with pytest.raises(ValueError, match=r"'lora\.lora_dropout' must be in \[0, 1\), got 1\.0$"):
        base.with_overrides({"lora.dropout": 1.0})  # an old name: the error names the key as it is now
    # a budget's keys are added one by one (refused as unknown recipe keys), checked as a budget
    mixed = load_recipe("auto-mixed").with_overrides({"precision.budget.target_bits_per_param": 6})
    assert mixed.precision.budget == {**load_recipe("auto-mixed").precision.budget, "target_bits_per_param": 6}
    with pytest.raises(ValueError, match=r"unknown budget argument\(s\) \['target_bits'\] \(did you mean"):
        load_recipe("auto-mixed").with_overrides({"precision.budget.target_bits": 6})


def test_keys_are_the_libraries_names_and_old_names_still_read(caplog):
    import dataclasses as dc

    from peft import LoraConfig
    from transformers import TrainingArguments

    from hf_lowprec.recipe import LoraSection, Recipe, TrainingSection

    ours = {"block_size", "dtype", "activation_storage", "return_freed_memory", "eval_blocks", "gradient_checkpointing"}
    training_args = {f.name for f in dc.fields(TrainingArguments)} | {"gradient_checkpointing"}
    assert {f.name for f in dc.fields(TrainingSection)} - ours <= training_args
    assert {f.name for f in dc.fields(LoraSection)} - {"init"} <= {f.name for f in dc.fields(LoraConfig)}
    base = {"name": "x", "method": "int4-lora", "precision": {"plan": "int4-g64"}}
    new = {**base, "training": {"per_device_train_batch_size": 2, "lr_scheduler_type": "linear"},
           "lora": {"lora_alpha": 8, "lora_dropout": 0.1}}  # fmt: skip
    old = {**base, "training": {"batch_size": 2, "lr_scheduler": "linear"}, "lora": {"alpha": 8, "dropout": 0.1}}
    with caplog.at_level("WARNING", logger="hf_lowprec.recipe"):
        assert Recipe.from_dict(old) == Recipe.from_dict(new)
    assert "'training.batch_size' is deprecated; use 'training.per_device_train_batch_size'" in caplog.text
    assert "'lora.alpha' is deprecated; use 'lora.lora_alpha'" in caplog.text
    with pytest.raises(ValueError, match="name the same setting"):
        Recipe.from_dict({**new, "training": {"batch_size": 2, "per_device_train_batch_size": 2}})
    assert Recipe.from_dict(new).with_overrides({"training.batch_size": 3}).training.per_device_train_batch_size == 3
    with pytest.raises(ValueError, match=r"unknown recipe key 'training.max_step' \(did you mean 'training.max_steps'\?\)"):
        Recipe.from_dict(new).with_overrides({"training.max_step": 3})


def test_a_tracker_that_is_not_installed_is_refused_before_anything_loads():
    from transformers.integrations.integration_utils import (
        INTEGRATION_TO_CALLBACK,
        get_available_reporting_integrations,
    )

    from hf_lowprec.recipe import UNCHECKED_TRACKERS

    installed = get_available_reporting_integrations()
    missing = [t for t in INTEGRATION_TO_CALLBACK if t not in (*installed, *UNCHECKED_TRACKERS)]
    if not missing:  # nothing to refuse; the project's install has tensorboard alone
        pytest.skip("every tracker transformers knows is installed here")
    with pytest.raises(ValueError, match=rf"'training\.report_to' {missing[0]}: not installed here; installed"):
        load_recipe("int4-ondevice-lora").with_overrides({"training.report_to": missing[0]})
    if installed:  # an installed one passes
        load_recipe("int4-ondevice-lora").with_overrides({"training.report_to": installed[0]})


def test_a_warm_up_as_long_as_the_run_is_noted_once_for_the_recipe_as_it_runs(tmp_path):
    """Said by finetune for the recipe with its overrides applied (logged while the recipe was still being built, it
    named a warm-up an override had set to 0, twice, and eval said it too)."""
    from cli_invoke import cli, workspace

    from hf_lowprec.recipe import TrainingSection

    assert TrainingSection(max_steps=10, warmup_steps=9).warm_up_note() is None
    note = TrainingSection(max_steps=10, warmup_steps=10, learning_rate=2e-4).warm_up_note()
    assert note == "training.warmup_steps (10) >= max_steps (10): the learning rate rises for the whole run and never reaches 0.0002"
    ws = workspace(tmp_path, 20_000)
    args = ["finetune", ws / "tiny", "--data", ws / "corpus.txt", "--recipe", "qat-int4", "--block-size", "32",
            "--batch-size", "2", "--eval-blocks", "2", "--dtype", "fp32"]  # fmt: skip
    said = cli(*args, "--max-steps", "3", "-o", tmp_path / "a").output  # the recipe's warm-up: 5 steps
    assert " ".join(said.split()).count("warning: training.warmup_steps (5) >= max_steps (3)") == 1
    assert "warmup_steps" not in cli(*args, "--max-steps", "3", "-o", tmp_path / "b", "training.warmup_steps=0").output
