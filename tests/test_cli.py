"""The hf-lowprec command line, end to end on a tiny local model and a local text file."""

import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

import datasets
import pytest
import torch
from cli_invoke import cli, one_error_line, workspace
from conftest import on_dequant_backend, tiny_bert, with_loud_channels
from huggingface_hub import ModelCard
from safetensors import safe_open
from tiny_assets import (
    HubStandIn,
    corpus_text,
    save_tiny_model,
    tensorboard_scalars,
    tiny_tokenizer,
    validate_card_metadata,
)
from transformers import AutoModelForCausalLM, AutoTokenizer, default_data_collator

from hf_lowprec.data import prepare_lm_data, read_source
from hf_lowprec.export import CARD_FILE, RUN_FILE, export_model, load_exported
from hf_lowprec.export.folder import LEARNED_STATE_FILE
from hf_lowprec.export.records import evaluation_numerics
from hf_lowprec.metrics import causal_lm_loss
from hf_lowprec.modules import PackedInt4Linear, PackedInt8Linear
from hf_lowprec.modules.kernels.cpp import cpu_kernels
from hf_lowprec.modules.kernels.cpu import cpu_info
from hf_lowprec.ondevice import load_int4_lora
from hf_lowprec.plan import PLAN_FILE, PrecisionPlan

COMMANDS = ("recipes", "scan", "finetune", "eval", "export", "push", "env")
FAST = ["--block-size", "32", "--batch-size", "2", "--eval-blocks", "4", "--dtype", "fp32", "--save-steps", "1000"]


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return workspace(tmp_path_factory.mktemp("cli"), 60_000)


def held_out(ws, tokenizer, blocks=4):
    """The held-out blocks finetune evaluates on (same data, same split rule)."""
    return prepare_lm_data(*read_source(ws / "corpus.txt"), tokenizer, 32, train_sequences=1, eval_sequences=blocks)


def test_env_prints_the_cpu_the_dtype_choice_and_measured_throughput():
    result = cli("env", "--tokens", "8")
    assert result.exit_code == 0, result.output
    cpu = cpu_info()
    assert cpu.cpu_class in result.output and "compute " in result.output
    packed = ("packed dequant",) + (("packed tiled",) if cpu_kernels() else ())
    if cpu.has("amx_int8") and cpu_kernels() and cpu_kernels().amx_ready():  # the int8 backend with and without AMX
        packed += ("packed int8", "packed int8 _int_mm")
    for kernel in ("fp32", "bf16", *packed, *(f"{k} bf16" for k in packed)):  # packed backends on fp32 and bf16 inputs
        assert f"│ {kernel} " in result.output, kernel  # a row of the throughput table
    assert "Llama-3.2-1B" in result.output and "GFLOP/s" in result.output
    usable = re.search(r"memory +│ ([\d.]+) GB usable.*?above ([\d.]+) GB", result.output)  # auto's line: half
    assert usable and abs(float(usable[2]) - float(usable[1]) / 2) <= 0.1, result.output


def test_a_value_error_from_inside_a_library_also_offers_its_traceback(monkeypatch, capsys):
    """Bad input hf-lowprec's own checks find is one line, exit 2; a ValueError raised inside a library it called
    (not always the input's fault) says how to see its traceback too, and HF_LOWPREC_DEBUG=1 shows either's."""
    import typer
    from hf_lowprec.cli import ui

    from hf_lowprec.formats import FormatSpec

    ours, theirs = ui.guarded(lambda: FormatSpec.parse("int3")), ui.guarded(lambda: json.loads("{"))
    for command, hint in ((ours, False), (theirs, True)):
        with pytest.raises(typer.Exit) as stopped:
            command()
        line = capsys.readouterr().err.strip()
        assert stopped.value.exit_code == 2 and line.count("\n") == 0 and line.startswith("error: "), line
        assert line.endswith("(set HF_LOWPREC_DEBUG=1 for the traceback)") == hint, line
    monkeypatch.setenv("HF_LOWPREC_DEBUG", "1")
    for command, message in ((ours, "int3"), (theirs, "Expecting property name")):  # raised as it was, not wrapped
        with pytest.raises(ValueError, match=message):
            command()


def test_library_logs_come_once_and_a_file_datasets_cannot_parse_is_one_error_line(tmp_path):
    """huggingface_hub's and datasets' own handlers and ours printed each of their records (a Hub request's retries)
    twice; datasets' ERROR about a file it cannot parse came twice more before the CLI's own line."""
    code = ("from hf_lowprec.cli import ui; ui.setup_logging(); import logging; "
            "logging.getLogger('huggingface_hub.utils._http').warning('Retrying in 1s [Retry 1/5].')")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr.count("Retrying in 1s [Retry 1/5].") == 1, done.stderr
    (tmp_path / "broken.jsonl").write_text('{"text": "a"}\n{bad\n')
    command = "from hf_lowprec.cli.app import app; app()"
    done = subprocess.run([sys.executable, "-c", command, "eval", str(tmp_path), "--data",  # a folder: read after the data
                           str(tmp_path / "broken.jsonl")], capture_output=True, text=True, timeout=120)  # fmt: skip
    lines = [line for line in done.stderr.splitlines() if not line.startswith(("…", "✓"))]  # progress lines
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: could not read data"), done.stderr


def test_help_of_the_program_and_every_command():
    proc = subprocess.run([sys.executable, "-m", "hf_lowprec.cli.app", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and all(c in proc.stdout for c in COMMANDS)
    for command in COMMANDS:
        result = cli(command, "--help")
        assert result.exit_code == 0 and "Usage" in result.output and command in result.output
        assert "…" not in result.output, result.output  # 80 columns (no terminal): no word longer than its cell
    listing = cli("recipes")
    assert listing.exit_code == 0 and all(r in listing.output for r in ("fp8-train", "auto-mixed", "int4-ondevice-lora", "qat-int4"))
    shown = cli("recipes", "qat-int4")
    assert shown.exit_code == 0 and "weights: int4-packed" in shown.output


def test_finetune_eval_export_reload_fp8(ws):
    out, pub = ws / "run-fp8", ws / "pub-fp8"
    args = ["--recipe", "fp8-train", "--rounding", "gptq", "--max-steps", "6", "--lr", "3e-3", *FAST]
    result = cli("finetune", ws / "tiny", "--data", ws / "corpus.txt", *args, "-o", out)
    assert result.exit_code == 0, result.output
    assert "Fine-tuning summary" in result.output and str(out) in result.output
    assert "scanning 4 batches for the plan, then rounding the FP8 weights by gptq" in " ".join(result.output.split())
    record = json.loads((out / RUN_FILE).read_text())
    f = record["training"]
    assert f["steps"] == 6 and f["loss_final"] < f["loss_start"] and f["peak_rss_mb"] > 0 and f["tokens_per_second"] > 0
    assert not (ws / "run-fp8.incomplete").exists()
    assert record["compute"]["dtype"] == "float32" and record["compute"]["reason"] == "compute fp32: as requested"  # FAST: fp32
    assert record["compute"]["packed_kernels"] == {}  # full FP8 training: no packed layers
    assert all(f"step {i}/6 (" in result.output for i in range(1, 7))  # no terminal: a plain line per step
    assert record["hardware"]["cpu"]["class"] == cpu_info().cpu_class
    rounding = record["fp8_rounding"]  # GPTQ rounding of the FP8 master weights
    assert rounding["rounding"] == "gptq" and rounding["output_error_median"] < rounding["output_error_nearest_median"]

    # the exported master weights, with the plan re-applied, are the trained model: same held-out loss
    # (same batches too: FP8 tensorwise scales follow each batch's amax)
    model, tok = load_exported(out, apply_plan_numerics=True)
    loss = causal_lm_loss(model, held_out(ws, tok).eval, default_data_collator, batch_size=2)["loss"]
    assert loss == pytest.approx(f["loss_final"], abs=1e-6)

    # eval: perplexity of the export, checked against transformers' own loss on the same blocks
    result = cli("eval", out, "--data", ws / "corpus.txt", "--block-size", "32", "--max-sequences", "6")
    assert result.exit_code == 0, result.output
    plain = AutoModelForCausalLM.from_pretrained(out).eval()
    shares = {r["format"]: r["params"] for r in PrecisionPlan.load(out / PLAN_FILE).summary(plain)}  # the scan's plan
    scanned = sum(shares.values()) - plain.lm_head.weight.numel()  # the recipe keeps lm_head
    assert sum(n for f, n in shares.items() if f.startswith("fp8")) >= 0.9 * scanned  # its budget: >= 90% in FP8
    blocks = prepare_lm_data(*read_source(ws / "corpus.txt"), tok, 32, eval_sequences=6, eval_only=True).eval
    ids = torch.tensor(blocks["input_ids"])
    with torch.no_grad():
        expected = torch.exp(plain(input_ids=ids, labels=ids).loss).item()
    printed = float(re.search(r"perplexity\s*│\s*([0-9.]+)", result.output).group(1))
    assert printed == pytest.approx(expected, abs=2e-4)  # the same up to the fp32 summation order and 4 printed decimals

    a_file = out.with_name("notes.txt")
    a_file.write_text("x")
    under_a_file = one_error_line(cli("export", out, "--out", a_file / "pub"))  # exit 2, not a FileExistsError's 1
    assert under_a_file == f"error: --out '{a_file / 'pub'}': '{a_file}' is a file, not a folder to write in"
    bad = one_error_line(cli("export", out, "--out", pub, "--repo-id", "bad id!!"))  # it would go into the card
    assert "repo id 'bad id!!': Repo id must use alphanumeric chars" in bad and not pub.exists()
    result = cli("export", out, "--out", pub, "--repo-id", "me/tiny-fp8")
    assert result.exit_code == 0, result.output
    assert not (pub / "log_history.json").exists() and (pub / "hf_lowprec_plan.json").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(pub).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, plain(ids).logits)
    card = ModelCard.load(pub / CARD_FILE)
    assert validate_card_metadata(card.content) == [] and {"fp8", "hf-lowprec"} <= set(card.data.tags)
    assert 'from_pretrained("me/tiny-fp8")' in card.text and "fp8-train" in card.text

    with HubStandIn() as hub:
        env = {"HF_TOKEN": "hf_cliSECRET0123456789abcdef", "HF_ENDPOINT": hub.endpoint}
        import huggingface_hub.constants as hc

        old = hc.ENDPOINT
        hc.ENDPOINT = hub.endpoint
        try:
            result = cli("push", pub, "me/tiny-fp8", env=env)
        finally:
            hc.ENDPOINT = old
    assert result.exit_code == 0, result.output
    assert "commit:" in result.output and env["HF_TOKEN"] not in result.output
    assert set(hub.files["me/tiny-fp8"]) == {p.name for p in pub.iterdir()}


def test_qat_int4_run_exports_packed_weights_that_reproduce_the_trained_model(ws):
    out = ws / "run-qat"
    result = cli("finetune", ws / "tiny", "--data", ws / "corpus.txt", "--recipe", "qat-int4", "--max-steps", "4", "--lr", "3e-3", *FAST, "-o", out)
    assert result.exit_code == 0, result.output
    record = json.loads((out / RUN_FILE).read_text())
    assert record["export"]["weights"] == "int4-packed" and "int4" in ModelCard.load(out / CARD_FILE).data.tags
    model, tok = load_exported(out, backend="dequant")
    loss = causal_lm_loss(model, held_out(ws, tok).eval, default_data_collator, batch_size=2)["loss"]
    assert loss == pytest.approx(record["training"]["loss_final"], abs=1e-5)


def test_int4_lora_run_with_a_smoothed_plan_calibrates_on_the_first_batches_and_reloads(ws):
    """A fixed ``-sq`` plan: the CLI hands the first training batches to the packing, whose smoothing the export keeps.
    W4A8 (``-a8``) is refused before training: the packed kernels compute weight-only INT4 (it ran so under its
    name)."""
    out = ws / "run-sq"
    args = ["--recipe", "int4-ondevice-lora", "--rounding", "nearest", "--max-steps", "2", *FAST]
    a8 = ["--plan", "int4-g32-a8-sq", "-o", ws / "run-a8"]
    refused = one_error_line(cli("finetune", ws / "tiny", "--data", ws / "corpus.txt", *args, *a8))
    assert "precision.plan 'int4-g32-a8-sq': method 'int4-lora' packs its frozen base in INT4; choose an INT4 format " \
        "it stores (e.g. int4, " in refused and not (ws / "run-a8").exists()
    result = cli("finetune", ws / "tiny", "--data", ws / "corpus.txt", *args, "--plan", "int4-g32-sq", "-o", out)
    assert result.exit_code == 0, result.output
    record = json.loads((out / RUN_FILE).read_text())
    assert "int4-g32-sq" in {row["format"] for row in record["plan_rows"]}
    model, tok = load_exported(out, backend="dequant")
    smoothed = [m for m in model.modules() if isinstance(m, PackedInt4Linear) and m.spec.smooth]
    assert smoothed and all(bool((m.input_scale != 1).any()) for m in smoothed)
    loss = causal_lm_loss(model, held_out(ws, tok).eval, default_data_collator, batch_size=2)["loss"]
    assert loss == pytest.approx(record["training"]["loss_final"], abs=1e-4)


@pytest.mark.parametrize("override, per_group", [("precision.learn_steps=true", 2), (None, 1)])
def test_int4_lora_run_that_learns_the_base_steps_exports_what_it_evaluated(ws, override, per_group):
    """``precision.learn_steps``: the packed base's steps and zero points (``true``) or its zero points alone (the
    recipe's ``zero_points``) train with the adapters; the export holds them (the reloaded model's loss is the run's
    final loss) and its card says the adapters belong with that base."""
    out = ws / f"run-steps-{per_group}"
    args = ["--recipe", "int4-ondevice-lora", "--plan", "int4-g64-asym", "--max-steps", "3", "--lr", "1e-2", *FAST]
    result = cli("finetune", ws / "tiny", "--data", ws / "corpus.txt", *args, "-o", out, *filter(None, [override]))
    assert result.exit_code == 0, result.output
    assert ("its zero points learned" in result.output) == (per_group == 1)
    record = json.loads((out / RUN_FILE).read_text())
    groups = sum(m.step.numel() for m in load_exported(out)[0].modules() if isinstance(m, PackedInt4Linear))
    assert record["adapter"]["learned_steps"] == per_group * groups  # a zero shift (and a gain) per group
    assert "belong with it" in (out / CARD_FILE).read_text()
    model, tok = load_exported(out, backend="dequant")
    loss = causal_lm_loss(model, held_out(ws, tok).eval, default_data_collator, batch_size=2)["loss"]
    assert loss == pytest.approx(record["training"]["loss_final"], abs=1e-4)


def test_int4_lora_run_packs_a_large_output_head_in_int8_as_the_library_does(ws, monkeypatch):
    """The recipe's format-name plan leaves the output head to the library's rule (``int4_plan``): per-channel int8
    above ``HEAD_INT8_MIN_PARAMS`` weights (a 128k vocabulary's 263M), not the bf16 its ``keep: [lm_head]`` would
    give it (525 MB with its tied embedding at Llama-3.2-1B); the export reloads what the run evaluated."""
    monkeypatch.setattr("hf_lowprec.ondevice.planning.HEAD_INT8_MIN_PARAMS", 0)  # this tiny head counts as large
    out = ws / "run-int8-head"
    args = ["--recipe", "int4-ondevice-lora", "--max-steps", "2", *FAST, "precision.learn_steps=false"]
    result = cli("finetune", ws / "tiny", "--data", ws / "corpus.txt", "-o", out, *args)
    assert result.exit_code == 0, result.output
    record = json.loads((out / RUN_FILE).read_text())
    assert {row["format"] for row in record["plan_rows"]} == {"int4-g64-asym", "int8"}
    model, tok = load_exported(out)  # the kernels the run measured for its layers (the int8 head's may be the int8 GEMM)
    assert isinstance(model.get_output_embeddings(), PackedInt8Linear)
    loss = causal_lm_loss(model, held_out(ws, tok).eval, default_data_collator, batch_size=2)["loss"]
    assert loss == pytest.approx(record["training"]["loss_final"], abs=1e-4)


def test_the_base_loss_is_the_unquantized_checkpoints_whatever_the_lora_init(ws, tmp_path):
    """With round-to-nearest codes and no LoftQ no step reads the dense weights back, but "loss, base model" must
    still be the checkpoint's, not the INT4 base's (it was, labelled as the base model's)."""
    out = tmp_path / "run"
    result = cli("finetune", ws / "tiny", "--data", ws / "corpus.txt", "--lora-init", "default", "--max-steps", "1",
                 *FAST, "-o", out)  # fmt: skip
    assert result.exit_code == 0, result.output
    record = json.loads((out / RUN_FILE).read_text())
    dense = AutoModelForCausalLM.from_pretrained(ws / "tiny", dtype=torch.float32)
    base = causal_lm_loss(dense, held_out(ws, AutoTokenizer.from_pretrained(ws / "tiny")).eval, default_data_collator, batch_size=2)
    assert record["training"]["loss_base"] == pytest.approx(base["loss"], abs=1e-4)
    assert record["training"]["loss_start"] != pytest.approx(base["loss"], abs=1e-4)  # the INT4 base: another loss


def test_a_model_folder_without_tokenizer_fails_before_loading(ws, tmp_path):
    AutoModelForCausalLM.from_pretrained(ws / "tiny").save_pretrained(tmp_path / "no-tokenizer")
    result = cli("finetune", tmp_path / "no-tokenizer", "--data", ws / "corpus.txt", "-o", tmp_path / "run", *FAST)
    text = one_error_line(result)
    assert "has no tokenizer files; save the tokenizer next to the model" in text and "loading" not in text
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def lora_run(ws):
    """An int4-ondevice-lora run (AWQ scales + GPTQ rounding, LoftQ init, learned steps) of the tiny model with a few
    loud channels (so that AWQ scales some inputs): ``(folder, CLI result)``, made once."""
    out, loud = ws / "run-lora", ws / "tiny-loud"
    with_loud_channels(AutoModelForCausalLM.from_pretrained(ws / "tiny")).save_pretrained(loud)
    AutoTokenizer.from_pretrained(ws / "tiny").save_pretrained(loud)
    args = ["--recipe", "int4-ondevice-lora", "--max-steps", "4", "--lr", "1e-2", "--block-size", "32", "--batch-size", "2", "--eval-blocks", "4",
            "--rounding", "awq+gptq", "--lora-init", "loftq"]  # fmt: skip
    return out, cli("finetune", loud, "--data", ws / "corpus.txt", *args, "-o", out)


def test_int4_lora_run_exports_adapters(ws, lora_run):
    out, result = lora_run
    assert result.exit_code == 0, result.output
    record = json.loads((out / RUN_FILE).read_text())
    assert record["recipe"]["method"] == "int4-lora" and record["adapter"]["trainable_params"] > 0
    assert record["recipe"]["precision"]["rounding"] == "awq+gptq" and record["recipe"]["lora"]["init"] == "loftq"
    assert "awq+gptq: 14 of 14 layers calibrated" in result.output  # the calibration's progress, a line per tenth
    assert {row["format"] for row in record["plan_rows"]} == {"int4-g64-asym", "bf16"}  # the recipe's plan: the head kept
    assert record["adapter"]["learned_steps"] > 0  # the recipe learns the base's steps and zero points
    assert record["base_layers_packed_while_loading"] >= 4  # the INT4 layers: the dense model never sat in memory
    dtype = getattr(torch, record["compute"]["dtype"])  # loss_base: the checkpoint's, its weights read back one by one
    dense = AutoModelForCausalLM.from_pretrained(ws / "tiny-loud", dtype=dtype)
    base = causal_lm_loss(dense, held_out(ws, AutoTokenizer.from_pretrained(ws / "tiny")).eval, default_data_collator, batch_size=2)
    assert record["training"]["loss_base"] == pytest.approx(base["loss"], abs=1e-3)
    card = ModelCard.load(out / CARD_FILE)  # hf-lowprec's; PEFT's own, which named the local base folder, left out
    assert {"int4", "lora"} <= set(card.data.tags) and str(ws) not in card.content
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] is None
    model, tok = load_exported(out, backend="dequant")  # packed base + adapters; exact kernels, as trained (learned steps)
    int4 = sum(isinstance(m, PackedInt4Linear) for m in model.modules())
    assert int4 == 14
    kernels = record["compute"]["packed_kernels"]  # every packed layer ran a measured or the only runnable kernel
    assert sum(kernels.values()) == 14  # exact forwards (the base learns its steps); the grad-input may run int8:
    assert {k.removesuffix("/int8") for k in kernels} <= {"tiled", "dequant"}  # which, is for this CPU's timing
    stats = record["calibration"]  # AWQ + GPTQ on the INT4 layers
    assert stats["rounding"] == "awq+gptq" and stats["layers"] == int4 and stats["output_error_median"] < stats["output_error_nearest_median"]
    assert any(bool((m.input_scale != 1).any()) for m in model.modules() if isinstance(m, PackedInt4Linear))  # AWQ scales reloaded
    loss = causal_lm_loss(model, held_out(ws, tok).eval, default_data_collator, batch_size=2)["loss"]
    assert loss == pytest.approx(record["training"]["loss_final"], abs=1e-4)
    whole = on_dequant_backend(AutoModelForCausalLM.from_pretrained(out))  # transformers applies the adapters itself
    assert list(whole.peft_config) == ["default"]
    whole_loss = causal_lm_loss(whole, held_out(ws, tok).eval, default_data_collator, batch_size=2)["loss"]
    assert whole_loss == pytest.approx(loss, abs=1e-5)


def test_finetune_and_scan_refuse_a_quantized_checkpoint_naming_the_one_it_came_from(ws, lora_run, tmp_path):
    """An export's packed layers are no dense weights to start from (finetune failed deep in its first forward with a
    size mismatch): one line naming the checkpoint it was made from, nothing written; a checkpoint another library
    quantized gets the same refusal with its method; the API refuses alike."""
    out, run = lora_run
    assert run.exit_code == 0, run.output
    for args in (["finetune", out, *FAST, "-o", tmp_path / "again"], ["scan", out]):
        line = one_error_line(cli(*args, "--data", ws / "corpus.txt"))
        assert f"{str(out)!r} is an hf-lowprec export with packed INT4 weights" in line, line
        assert "give the checkpoint it was made from (tiny-loud)" in line and "hf-lowprec eval" in line
    assert not (tmp_path / "again").exists()
    assert cli("export", out, "--out", tmp_path / "ct", "--format", "compressed-tensors").exit_code == 0
    line = one_error_line(cli("finetune", tmp_path / "ct", "--data", ws / "corpus.txt", *FAST, "-o", tmp_path / "c"))
    assert "is quantized already (quant_method 'compressed-tensors')" in line and "made from (tiny-loud)" in line
    bnb = shutil.copytree(ws / "tiny", tmp_path / "bnb")
    config = json.loads((bnb / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (bnb / "config.json").write_text(json.dumps(config))
    line = one_error_line(cli("finetune", bnb, "--data", ws / "corpus.txt", *FAST, "-o", tmp_path / "b"))
    assert "is quantized already (quant_method 'bitsandbytes')" in line and "give the unquantized checkpoint" in line
    with pytest.raises(ValueError, match="is an hf-lowprec export with packed INT4 weights"):
        load_int4_lora(out)


def test_finetune_scan_and_the_api_refuse_a_checkpoint_that_is_no_causal_lm_before_the_data(ws, tmp_path):
    """A sequence classifier was loaded as ``BertLMHeadModel`` (its classifier dropped, a random LM head trained, exit
    0); an encoder-decoder failed in transformers' "Unrecognized configuration class". One line naming the class and
    what to use instead, before the data (which does not exist here) and nothing written."""
    from transformers import T5Config, T5ForConditionalGeneration

    bert = tmp_path / "bert"
    tiny_bert().save_pretrained(bert)
    t5 = tmp_path / "t5"
    T5ForConditionalGeneration(T5Config(vocab_size=256, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2)).save_pretrained(t5)
    for folder in (bert, t5):
        for f in (ws / "tiny").glob("tokenizer*"):
            shutil.copy(f, folder / f.name)
    wanted = "as a causal language model (AutoModelForCausalLM); train this one with transformers' Trainer"
    for folder, what in ((bert, "is a BertForSequenceClassification, a model for SequenceClassification: loaded as"),
                         (t5, "is a T5ForConditionalGeneration (model type 't5'), which has no causal LM class")):  # fmt: skip
        for args in (["finetune", folder, *FAST, "-o", tmp_path / "out"], ["scan", folder]):
            line = one_error_line(cli(*args, "--data", tmp_path / "no.txt"))
            assert what in line and wanted in line, line
        assert not (tmp_path / "out").exists()
        with pytest.raises(ValueError, match=re.escape(what)):
            load_int4_lora(folder)


def test_finetune_refuses_a_block_longer_than_the_model_before_reading_the_data(ws, tmp_path):
    """The block size is checked against the checkpoint's config first: here the data does not exist, and the block
    size is what the one line names (it came after the data was read and tokenized and the model loaded)."""
    for recipe in ("fp8-train", "int4-ondevice-lora"):
        line = one_error_line(cli("finetune", ws / "tiny", "--recipe", recipe, "--data", tmp_path / "no.txt",
                                  "--block-size", "512", "-o", tmp_path / recipe))  # fmt: skip
        assert line.endswith("block size 512 exceeds the model's max_position_embeddings 256; lower --block-size")
        assert not (tmp_path / recipe).exists()


def test_finetune_refuses_a_plan_file_naming_no_layer_before_reading_the_data(ws, tmp_path):
    """A plan file's unknown layer is checked against the checkpoint's config first, for full training as for
    int4-lora: here the data does not exist, and the plan entry is what the one line names (full training named it
    after loading the model and evaluating it)."""
    plan = PrecisionPlan({"model.layers.99.mlp.up_proj": "int4-g32"}, default="fp8").save(tmp_path / "plan.json")
    for recipe in ("qat-int4", "fp8-train", "int4-ondevice-lora"):
        line = one_error_line(cli("finetune", ws / "tiny", "--recipe", recipe, "--plan", plan, "--data",
                                  tmp_path / "no.txt", "-o", tmp_path / recipe))  # fmt: skip
        assert "plan entry 'model.layers.99.mlp.up_proj' is not a layer of this model; close matches: " in line, line
        assert not (tmp_path / recipe).exists()
    (tmp_path / "empty.json").write_text("{}")  # a plan of no rule and a high-precision default
    for recipe in ("qat-int4", "fp8-train"):  # said after loading the model and evaluating it
        line = one_error_line(cli("finetune", ws / "tiny", "--recipe", recipe, "--plan", tmp_path / "empty.json",
                                  "--data", tmp_path / "no.txt", "-o", tmp_path / recipe))  # fmt: skip
        assert line.endswith("the plan (default bf16; rules none) puts no layer of LlamaForCausalLM in low precision")


def test_finetune_refuses_a_kept_name_that_is_no_layer_before_reading_the_data(ws, tmp_path):
    """A misspelt ``precision.keep`` name was refused after loading and evaluating the model (and, for a scanned plan,
    the scan): now from the config, before the data (which does not exist here), with its close matches."""
    for recipe in ("fp8-train", "qat-int4"):  # (int4-lora takes no keep: it chooses its head's format itself)
        line = one_error_line(cli("finetune", ws / "tiny", "--recipe", recipe, "precision.keep=[lm_haed]", "--data",
                                  tmp_path / "no.txt", "-o", tmp_path / recipe))  # fmt: skip
        assert line.endswith("precision.keep entry 'lm_haed' is not a layer of this model; close matches: lm_head"), line
        assert not (tmp_path / recipe).exists()


def test_finetune_names_an_unsupported_architecture_before_reading_the_data(tmp_path):
    """GPT-2 multiplies in ``Conv1D`` layers: int4-lora said "no Linear layer besides its output head ... LoRA and INT4
    have nothing to work on", not why; it names the architecture as apply_plan does, from the config."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = tiny_tokenizer()
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=4)).save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    for recipe in ("int4-ondevice-lora", "qat-int4"):
        line = one_error_line(cli("finetune", tmp_path / "m", "--recipe", recipe, "--data", tmp_path / "no.txt",
                                  "-o", tmp_path / recipe))  # fmt: skip
        assert "GPT2LMHeadModel multiplies 53% of its matrix weights in 8 Conv1D layers" in line, line
        assert line.endswith("so this architecture is not supported") and not (tmp_path / recipe).exists()


@pytest.mark.slow
def test_finetune_of_the_gguf_default_refuses_a_plan_file_naming_no_layer_before_evaluating_it(tmp_path):
    """The default checkpoint is a GGUF file, whose config is known once it loads: the plan file is checked then,
    before the base model's evaluation (it was checked as the Trainer was built)."""
    plan = PrecisionPlan({"model.layers.99.mlp.up_proj": "int4-g32"}, default="bf16").save(tmp_path / "plan.json")
    result = cli("finetune", "--recipe", "qat-int4", "--plan", plan, "--block-size", "32", "-o", tmp_path / "run")
    line = one_error_line(result)
    assert "plan entry 'model.layers.99.mlp.up_proj' is not a layer of this model; close matches: " in line, line
    assert "evaluating the base model" not in result.output and not (tmp_path / "run").exists()


def test_a_merge_into_int4_that_rounds_the_fine_tuning_away_warns(ws, tmp_path):
    """Adapters that changed the weights by less than the INT4 rounding (here: two steps at a learning rate of 1e-5
    from PEFT's zero start) do not survive a merge into the INT4 codes: the export says so and names the two ways
    that keep them."""
    run = tmp_path / "run"
    done = cli("finetune", ws / "tiny", "--data", ws / "corpus.txt", "--recipe", "int4-ondevice-lora", "--max-steps",
               "2", "--lr", "1e-5", *FAST, "-o", run, "lora.init=default")  # fmt: skip
    assert done.exit_code == 0, done.output
    result = cli("export", run, "--out", tmp_path / "merged", "--merge")
    said = " ".join(result.output.split())
    merge = json.loads((tmp_path / "merged" / RUN_FILE).read_text())["merge"]
    assert result.exit_code == 0 and merge["error_vs_delta_median"] >= 0.5
    assert "most of what LoRA learned is gone" in said and "--merge-into bf16" in said
    assert "export without --merge" in said


def test_export_merge_folds_lora_into_the_int4_base(ws, lora_run, tmp_path):
    (out, run), merged = lora_run, ws / "merged-lora"
    assert run.exit_code == 0, run.output
    model, tok = load_exported(out)
    loss = causal_lm_loss(model, held_out(ws, tok).eval, default_data_collator, batch_size=2)["loss"]
    result = cli("export", out, "--out", merged, "--merge")
    said = " ".join(cli("eval", merged, "--plan-numerics", "--data", ws / "corpus.txt").output.split())
    assert "here its LoRA adapters are merged into the packed base" in said  # not only "with its LoRA adapters"
    assert result.exit_code == 0, result.output
    assert "merge error" in result.output and not (merged / "adapter_config.json").exists()
    said = " ".join(result.output.split())
    assert "(merging LoRA into an int4 base)" in said
    lost = json.loads((merged / RUN_FILE).read_text())["merge"]["error_vs_delta_median"] >= 0.5
    assert ("most of what LoRA learned is gone" in said) == lost, said  # warned exactly when the rounding ate it
    tags = ModelCard.load(merged / CARD_FILE).data.tags  # trained with LoRA; no PEFT files in the repository
    assert "lora" in tags and "peft" not in tags
    merged_model, _ = load_exported(merged)
    merged_loss = causal_lm_loss(merged_model, held_out(ws, tok).eval, default_data_collator, batch_size=2)["loss"]
    assert merged_loss == pytest.approx(loss, abs=0.05)  # a second rounding: close to, not equal to, the trained model

    dense = ws / "merged-dense"
    result = cli("export", out, "--out", dense, "--merge", "--merge-into", "bf16")
    assert result.exit_code == 0, result.output
    assert "quantization_config" not in json.loads((dense / "config.json").read_text())
    assert not (dense / "adapter_config.json").exists()
    assert ModelCard.load(dense / CARD_FILE).data.library_name == "transformers"
    plain = AutoModelForCausalLM.from_pretrained(dense)  # transformers alone: a dense bf16 model
    assert not any(isinstance(m, PackedInt4Linear) for m in plain.modules())
    dense_loss = causal_lm_loss(plain, held_out(ws, tok).eval, default_data_collator, batch_size=2)["loss"]
    assert dense_loss == pytest.approx(loss, abs=0.02)  # only bf16 rounding of dequantized weight + delta
    kept = [row for row in json.loads((dense / RUN_FILE).read_text())["layers"] if "stored" in row]
    assert kept and {row["stored"] for row in kept} == {"bf16"} and "`lm_head` | kept (bf16)" in (dense / CARD_FILE).read_text()
    bad = cli("export", out, "--out", tmp_path / "x", "--merge", "--merge-into", "int3")
    assert bad.exit_code != 0 and "choose one of int4, bf16, fp32" in bad.output


def test_eval_accuracy_of_a_classifier(ws, tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    tok = tiny_tokenizer()
    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=len(tok),
                     max_position_embeddings=64, num_labels=2, pad_token_id=tok.pad_token_id)  # fmt: skip
    model = BertForSequenceClassification(cfg).eval()
    model.save_pretrained(tmp_path / "bert")
    tok.save_pretrained(tmp_path / "bert")
    rows = [{"sentence": corpus_text(4000)[i * 37 : i * 37 + 60], "label": i % 2} for i in range(30)]
    (tmp_path / "cls.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    result = cli("eval", tmp_path / "bert", "--data", tmp_path / "cls.jsonl", "--block-size", "32")
    assert result.exit_code == 0, result.output
    with torch.no_grad():
        enc = tok([r["sentence"] for r in rows], truncation=True, max_length=32, padding=True, return_tensors="pt")
        predicted = model(**enc).logits.argmax(-1).tolist()
    expected = sum(p == r["label"] for p, r in zip(predicted, rows)) / len(rows)
    assert f"{expected:.4f}" in result.output and "accuracy" in result.output
    no_labels = cli("eval", tmp_path / "bert", "--data", tmp_path / "cls.jsonl", "--label-column", "stars")
    assert "has no label column 'stars'" in one_error_line(no_labels) and "loading" not in no_labels.output


def test_scan_writes_a_plan_that_fits_the_model(ws):
    out = ws / "scan" / "plan.json"
    result = cli("scan", ws / "tiny", "--data", ws / "corpus.txt", "--block-size", "32", "--batches", "2", "--budget", "target_bits_per_param=12,score=after-training", "--out", out)
    assert result.exit_code == 0, result.output
    assert "score=after-training" in result.output
    said = " ".join(result.output.split())  # the scores are after-training ones, not measured or predicted conversion
    assert "after training (the scan's curvature term)" in said and "predicted Δloss (after training)" in said
    assert "* measured, else predicted" not in said
    assert "kept (fp32)" in result.output  # the plan table: the fp32 head left as it is, 4 bytes a weight
    from hf_lowprec.plan import PrecisionPlan

    PrecisionPlan.load(out).validate(AutoModelForCausalLM.from_pretrained(ws / "tiny"))
    assert out.with_suffix(".png").stat().st_size > 1000 and "measured Δloss" in result.output
    # a second scan to the same --out replaces nothing unasked (a hand-edited plan there is the user's)
    before = out.read_bytes()
    again = one_error_line(cli("scan", ws / "tiny", "--data", ws / "corpus.txt", "--out", out))
    assert again == f"error: --out: {out}, {out.with_suffix('.png')}, {out.with_name('plan.scores.json')} already exist(s); pass --overwrite to replace, or choose another --out"
    assert out.read_bytes() == before
    a_file = out.with_name("notes.txt")
    a_file.write_text("x")
    under_a_file = one_error_line(cli("scan", ws / "tiny", "--data", ws / "corpus.txt", "--out", a_file / "plan.json"))
    assert under_a_file == f"error: --out '{a_file / 'plan.json'}': '{a_file}' is a file, not a folder to write in"
    out = out.with_name("errors.json")
    assert one_error_line(cli("scan", ws / "tiny", "--data", ws / "corpus.txt", "--budget", "bits=4", "--out", out))
    wrong_score = one_error_line(cli("scan", ws / "tiny", "--data", ws / "corpus.txt", "--budget", "score=trained", "--out", out))
    assert "budget score must be one of conversion, after-training, got 'trained'" in wrong_score
    # a budget no plan can meet fails before the scan (the fp32 head kept: 32 bits for its share of the parameters)
    unmeetable = one_error_line(cli("scan", ws / "tiny", "--data", ws / "corpus.txt", "--budget", "target_bits_per_param=4", "--out", out))
    assert "target_bits_per_param=4 cannot be met: the fewest bits per parameter reachable" in unmeetable
    assert "a kept layer counts the bits of its weights' dtype: 32 in an fp32-loaded model" in " ".join(unmeetable.split())
    assert "scanning" not in unmeetable
    # the default budget (1% of the calibration loss) is printed to 4 significant digits, not as 0.10789930555555556
    default = cli("scan", ws / "tiny", "--data", ws / "corpus.txt", "--block-size", "32", "--batches", "1", "--out", ws / "scan" / "default.json")
    assert default.exit_code == 0, default.output
    budget = re.search(r"max_loss_increase=([0-9.e+-]+)", default.output).group(1)
    assert len(budget.replace(".", "").lstrip("0")) <= 4, budget
    sensitivity = default.output.split("Precision plan")[0]
    assert "kept " in sensitivity and " bf16 " not in default.output  # the head kept, named as the plan's rows name it
    plan = json.loads((ws / "scan" / "default.json").read_text())
    head = sum(row["bytes"] for row in PrecisionPlan.from_dict(plan).summary(
        AutoModelForCausalLM.from_pretrained(ws / "tiny")) if row["format"] == "bf16")  # fmt: skip
    assert "weight MiB" in default.output and f"{head / 2**20:.2f}" in default.output  # MiB as the model card's


def test_scan_replaces_its_three_files_together_or_not_at_all(ws, tmp_path, monkeypatch):
    """A folder where a file goes is refused before the scan (it failed after it, the plan replaced, the scores not);
    a write that fails leaves the earlier set as it was, no temporary file beside it."""
    from hf_lowprec.sensitivity.results import ScanResult

    out = tmp_path / "plan.json"
    args = ["scan", ws / "tiny", "--data", ws / "corpus.txt", "--block-size", "32", "--batches", "1", "--overwrite"]
    assert cli(*args, "--out", out).exit_code == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert sorted(before) == ["plan.json", "plan.png", "plan.scores.json"]
    out.with_suffix(".png").unlink()
    out.with_suffix(".png").mkdir()
    text = one_error_line(cli(*args, "--out", out))
    png = out.with_suffix(".png")
    assert text.endswith(f"--out: {png} is a folder, where the scan writes a file; choose another --out")
    out.with_suffix(".png").rmdir()
    out.with_suffix(".png").write_bytes(before["plan.png"])

    def disk_full(self, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ScanResult, "save", disk_full)
    assert cli(*args, "--out", out, "--formats", "fp8").exit_code != 0
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_scan_refuses_what_needs_no_model_before_loading_it(ws, tmp_path):
    """An unknown --method, format or budget key was refused after the data was read and the model loaded."""
    base = ["scan", ws / "tiny", "--data", ws / "corpus.txt", "--out", tmp_path / "p.json"]
    for args, expected in ((["--method", "bogus"], "--method 'bogus': choose one of auto, measured, fisher"),
                           (["--formats", "int3"], "unknown format 'int3'"),
                           (["--formats", ","], "--formats ',': name at least one format"),
                           (["--budget", "foo=1"], "unknown budget argument(s) ['foo']; choose from"),
                           (["--formats", "fp8,fp8"], "formats contain duplicates: ['fp8', 'fp8']"),
                           (["--formats", "fp8,bf16"], "format 'bf16' is high precision"),
                           (["--budget", "target_bits_per_param=6,target_bits_per_param=8"],
                            "'target_bits_per_param' is given twice"),
                           (["--method", "measured", "--budget", "score=after-training,max_loss_increase=0.01"],
                            "score 'after-training' needs the scan's Taylor terms, which method 'measured' takes")):  # fmt: skip
        refused = cli(*base, *args)
        assert expected in one_error_line(refused) and "reading data" not in refused.output, refused.output
    # a score alone scores the default budget (1% of the calibration loss), as allocate(score=...) does: it was refused
    # for naming no limit
    scored = cli(*base, "--budget", "score=after-training", "--batches", "1", "--block-size", "32", "--method", "fisher")
    assert scored.exit_code == 0, scored.output
    assert json.loads((tmp_path / "p.scores.json").read_text())["allocation"]["budget"]["score"] == "after-training"
    # data too short for the batches asked: said (it scanned on fewer, unsaid)
    short = cli(*base, "--batches", "200", "--batch-size", "4", "--block-size", "64", "--overwrite")
    said = " ".join(short.output.split())
    assert short.exit_code == 0 and "warning: --batches 200: data" in said, short.output
    assert "calibration sequences of 64 tokens, not 200 batches of 4: the scan uses those" in said


def test_scan_reads_chat_rows_from_the_column_messages_column_names(ws, tmp_path):
    """A chat column of another name: the error said "name one with --text-column or --messages-column", and scan had
    no --messages-column."""
    turn = [{"role": "user", "content": "Speak, what of the king?"}, {"role": "assistant", "content": "He sleeps."}]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"dialogue": turn}) + "\n" for _ in range(40)))
    base = ["scan", ws / "tiny", "--data", tmp_path / "chat.jsonl", "--block-size", "32", "--batches", "1",
            "--formats", "fp8", "--method", "fisher", "--budget", "max_loss_increase=10", "--out", tmp_path / "p.json"]  # fmt: skip
    assert one_error_line(cli(*base)).endswith("name one with --text-column or --messages-column")
    scanned = cli(*base, "--messages-column", "dialogue")
    assert scanned.exit_code == 0, scanned.output
    plan = PrecisionPlan.load(tmp_path / "p.json")
    assert "fp8" in {spec.name for spec in (plan.default, *plan.layers.values())}


def test_a_plan_whose_measured_loss_exceeds_its_budget_gets_a_note():
    """The allocator adds per-layer Δloss; the whole plan's, measured on held-out data, can exceed the budget (1.7x on
    SmolLM2-135M, seen by a user): past 1.25x the scan says so and what to do, not below it or without that budget."""
    from hf_lowprec.cli.app import over_budget_note

    note = over_budget_note({"max_loss_increase": 0.0319, "score": "conversion"}, 0.0556)
    assert note.startswith("the plan's measured Δloss 0.0556 is 1.7x the budget's max_loss_increase 0.0319")
    assert note.endswith("scan again with a smaller max_loss_increase")
    assert over_budget_note({"max_loss_increase": 0.0319}, 0.0398) is None  # within 1.25x
    assert over_budget_note({"target_bits_per_param": 6.0}, 0.5) is None  # a bits budget promises no Δloss


def test_scan_suggests_the_recipe_its_plan_trains_with(ws):
    """The command ``scan`` ends with runs as printed, one line however long: the INT4 base + LoRA default for a plan of
    int4/int8 layers, full training (``auto-mixed``) for one with FP8 layers, which the INT4 base refuses."""
    base = ("--data", ws / "corpus.txt", "--block-size", "32", "--batches", "1")
    for formats, recipe in (("int4-g32-asym,int8", ""), ("fp8", "--recipe auto-mixed ")):
        out = ws / "scan" / f"{formats.split(',')[0]}-suggested.json"
        result = cli("scan", ws / "tiny", *base, "--formats", formats, "--budget", "max_loss_increase=10", "--out", out)
        assert result.exit_code == 0, result.output
        suggested = result.output.strip().splitlines()[-1]
        assert suggested == f"train with it: hf-lowprec finetune {ws / 'tiny'} {recipe}--plan {out}"
        command = shlex.split(suggested.removeprefix("train with it: hf-lowprec "))
        run = cli(*command, "--data", ws / "corpus.txt", "--max-steps", "2", *FAST, "-o", out.with_suffix(""))
        assert run.exit_code == 0, run.output
    refused = cli("finetune", ws / "tiny", "--plan", out, "--data", ws / "corpus.txt", "-o", ws / "x")
    assert "in fp8, which no packed layer stores" in one_error_line(refused) and "--recipe auto-mixed" in refused.output
    assert "reading data" not in refused.output  # before the data and the model (it came after the base's evaluation)


def test_a_master_export_keeps_what_int4_layers_learned(ws, tmp_path):
    """Full training with INT4 layers (learned steps), exported as master weights: the plan re-applied on load computes
    as the trained model did (the steps come back from the export, not fresh from the weights)."""
    recipe = tmp_path / "int4-master.yaml"
    recipe.write_text("method: full\nprecision: {plan: int4-g64, keep: [lm_head]}\nexport: {weights: master}\n")
    out = ws / "run-int4-master"
    result = cli("finetune", ws / "tiny", "--data", ws / "corpus.txt", "--recipe", recipe, "--max-steps", "8", "--lr", "3e-3", *FAST, "-o", out)
    assert result.exit_code == 0, result.output
    assert (out / LEARNED_STATE_FILE).exists()
    model, tok = load_exported(out, apply_plan_numerics=True)
    loss = causal_lm_loss(model, held_out(ws, tok).eval, default_data_collator, batch_size=2)["loss"]
    assert loss == pytest.approx(json.loads((out / RUN_FILE).read_text())["training"]["loss_final"], abs=1e-6)
    (out / LEARNED_STATE_FILE).unlink()  # without it the steps start again from the weights: another model
    model, _ = load_exported(out, apply_plan_numerics=True)
    fresh = causal_lm_loss(model, held_out(ws, tok).eval, default_data_collator, batch_size=2)["loss"]
    assert abs(fresh - loss) > 1e-4


def test_an_fp8_runs_reported_loss_comes_back_from_its_export(ws, tmp_path):
    """Full FP8 training under bf16 autocast reports its held-out loss computed as it trained (the plan's FP8 layers,
    bf16 autocast, its batch size: tensorwise scales span a batch), says so in the summary and the card, and ``eval
    --plan-numerics`` of the export computes that way, so the figure comes back from the published folder."""
    recipe = tmp_path / "fp8-master.yaml"
    recipe.write_text("method: full\nprecision: {plan: fp8, keep: [lm_head]}\nexport: {weights: master}\n")
    out = ws / "run-fp8-bf16"
    fast_bf16 = [*FAST[:-4], "--dtype", "bf16", *FAST[-2:]]
    result = cli("finetune", ws / "tiny", "--data", ws / "corpus.txt", "--recipe", recipe, "--max-steps", "6", "--lr", "3e-3", *fast_bf16, "-o", out)
    assert result.exit_code == 0, result.output
    assert "losses computed with │ the plan's numerics, bf16 autocast, batch 2 │" in " ".join(result.output.split())
    record = json.loads((out / RUN_FILE).read_text())
    autocast, batch, computed = evaluation_numerics(record)
    card = (out / CARD_FILE).read_text()
    assert (autocast, batch) == (torch.bfloat16, 2) and f"| {computed}; " in card and " tokens scored |" in card
    assert "| kept (fp32) | 2 |" in card and "plan │ fp8 64.3%, kept (fp32) 35.7%" in " ".join(result.output.split())
    assert json.loads((out / "config.json").read_text())["use_cache"] is True  # training turned it off
    model, tok = load_exported(out, apply_plan_numerics=True)
    blocks = held_out(ws, tok).eval
    again = causal_lm_loss(model, blocks, default_data_collator, batch_size=batch, autocast_dtype=autocast)["loss"]
    assert again == pytest.approx(record["training"]["loss_final"], abs=1e-6)
    plain = causal_lm_loss(model, blocks, default_data_collator, batch_size=batch)["loss"]
    assert abs(plain - again) > 1e-4  # bf16 autocast is part of the figure
    # what the card's first snippet loads, plain transformers in fp32, has its own figure in the record and card
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    as_loaded = causal_lm_loss(loaded, blocks, default_data_collator, batch_size=batch)["loss"]
    assert as_loaded == pytest.approx(record["training"]["loss_exported_weights"], abs=1e-6)
    rows = {r["computed"].split(" (")[0]: r["value"] for r in record["eval"] if r["metric"] == "loss"}
    assert rows == {computed.split(" (")[0]: round(again, 4), "the run's master weights in fp32 without the plan": round(as_loaded, 4)}
    assert "loss, exported weights │" in " ".join(result.output.split())

    evaluated = cli("eval", out, "--data", ws / "corpus.txt", "--block-size", "32", "--max-sequences", "4", "--plan-numerics")
    assert "computing as the run evaluated: the plan's numerics, bf16 autocast, batch 2" in evaluated.output
    rows = prepare_lm_data(*read_source(ws / "corpus.txt"), tok, 32, eval_sequences=4, eval_only=True).eval
    expected = causal_lm_loss(model, rows, default_data_collator, batch_size=2, autocast_dtype=torch.bfloat16)["loss"]
    assert f"loss (nats/token) │ {expected:.4f} │" in " ".join(evaluated.output.split())
    # --held-out: the run's own blocks of its data, so both reported figures come back from the command line
    for numerics, key in (["--plan-numerics"], "loss_final"), ([], "loss_exported_weights"):
        evaluated = " ".join(cli("eval", out, "--data", ws / "corpus.txt", "--held-out", *numerics).output.split())
        assert f"loss (nats/token) │ {record['training'][key]:.4f} │" in evaluated
        assert f"the run's held-out rows: {len(blocks)} sequences" in evaluated
        assert ("computing with the plan off: the exported weights in their dtype" in evaluated) == (not numerics)
        assert "INT4 layers" not in evaluated  # master weights: no INT4 note (an FP8 run's eval spoke of them)


def test_eval_without_data_needs_a_run_that_names_its_data(ws, tmp_path):
    """``eval RUN`` alone means the run's held-out rows: it needs the run's recipe and, unless the run trained on the
    offline corpus, its data again; each missing piece is one line naming the option."""
    out = ws / "run-heldout"
    assert cli("finetune", ws / "tiny", "--data", ws / "corpus.txt", "--max-steps", "1", *FAST, "-o", out).exit_code == 0
    assert "trained on 'corpus.txt', which its record names only; pass it again: --data" in one_error_line(cli("eval", out))
    other = tmp_path / "other.txt"
    other.write_text((ws / "corpus.txt").read_text())
    refused = one_error_line(cli("eval", out, "--data", other, "--held-out"))
    assert f"--held-out: '{out}' trained on 'corpus.txt', not '{other}'; its held-out rows are that data's" in refused
    (tmp_path / "elsewhere").mkdir()  # a file of the run's name with other content: its rows were named the run's
    edited = tmp_path / "elsewhere" / "corpus.txt"
    edited.write_text((ws / "corpus.txt").read_text()[:20_000])
    differs = one_error_line(cli("eval", out, "--data", edited, "--held-out"))
    assert f"--held-out: '{edited}' is not the 'corpus.txt' '{out}' trained on (its content differs" in differs
    clash = one_error_line(cli("eval", out, "--data", ws / "corpus.txt", "--held-out", "--block-size", "16"))
    assert clash.startswith("error: --block-size: the held-out rows are a causal-LM run's own")
    for loading in (["--revision", "v2"], ["--gguf-file", "model.gguf", "--trust-remote-code"]):  # not silently ignored
        text = one_error_line(cli("eval", out, "--data", ws / "corpus.txt", "--held-out", *loading))
        flags = ", ".join(flag for flag in loading if flag.startswith("--"))
        assert text.endswith(f"{flags} apply to checkpoints; '{out}' is an hf-lowprec run or export folder, which "
                             "loads as it was saved")
    not_a_run = one_error_line(cli("eval", ws / "tiny", "--held-out", "--data", ws / "corpus.txt"))
    assert not_a_run.endswith("is not an hf-lowprec run or export folder (no hf_lowprec_run.json), so it has no held-out rows to evaluate: pass --data <file, folder or Hub name> without --held-out")
    assert one_error_line(cli("eval", ws / "tiny")).endswith("to evaluate: pass --data <file, folder or Hub name>")
    plain = one_error_line(cli("eval", ws / "tiny", "--block-size", "64"))  # not "the held-out rows are a run's own"
    assert plain.endswith("to evaluate: pass --data <file, folder or Hub name>"), plain
    too_long = one_error_line(cli("eval", ws / "tiny", "--data", ws / "corpus.txt", "--block-size", "512"))
    assert too_long.endswith("block size 512 exceeds the model's max_position_embeddings 256; lower --block-size")
    missing = one_error_line(cli("eval", tmp_path / "nope" / "model"))  # a mistyped path, not a model without rows
    assert f"model '{tmp_path / 'nope' / 'model'}' does not exist" in missing and "held-out" not in missing
    exported = tmp_path / "api-export"  # written by the Python API: a record without a recipe
    model, tok = load_exported(out)
    export_model(model, tok, exported, {})
    assert "was not written by `hf-lowprec finetune` (its record holds no recipe)" in one_error_line(cli("eval", exported))
    # the int4-lora run's reported figure comes back too (the packed base, fp32, no plan to apply)
    record = json.loads((out / RUN_FILE).read_text())
    evaluated = " ".join(cli("eval", out, "--data", ws / "corpus.txt", "--held-out").output.split())
    assert f"loss (nats/token) │ {record['training']['loss_final']:.4f} │" in evaluated


def test_small_data_is_said_and_counted_as_it_trains(ws, tmp_path):
    """Data smaller than a batch, or than the held-out blocks asked for: the run says so, and tokens/s counts what
    each step had."""
    few = tmp_path / "few.txt"
    few.write_text((ws / "corpus.txt").read_text()[:1000])
    out = tmp_path / "run"
    result = cli("finetune", ws / "tiny", "--data", few, "--max-steps", "2", *FAST[:2], "--batch-size", "64", "--eval-blocks", "500", *FAST[6:], "-o", out)
    assert result.exit_code == 0, result.output
    record = json.loads((out / RUN_FILE).read_text())
    output = " ".join(result.output.split())
    rows = re.search(r"training data: (\d+) sequences, fewer than a batch of 64: each step trains on those", output)
    assert rows and re.search(r"held-out data: \d+ sequences \(eval_blocks 500: the held-out rows hold no more\)", output)
    t = record["training"]
    assert t["train_tokens"] == 2 * int(rows.group(1)) * 32  # what ran, not the nominal batch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ws / "tiny")
    for size in range(100, 1000, 10):  # text of an odd number of blocks under 3 batches of 2
        few.write_text((ws / "corpus.txt").read_text()[:size])
        try:
            blocks = len(prepare_lm_data(*read_source(few), tokenizer, 32, eval_fraction=0.3).train)
        except ValueError:  # no block to train or to evaluate on yet
            continue
        if blocks in (3, 5):
            break
    assert blocks in (3, 5)
    run = cli("finetune", ws / "tiny", "--data", few, "--max-steps", "3", *FAST, "-o", out, "--overwrite",
              "data.eval_fraction=0.3")  # fmt: skip
    assert run.exit_code == 0, run.output
    epoch = [2] * (blocks // 2) + [1]  # an epoch's last batch is short: counted as it ran (it was 2 blocks a step)
    steps = (epoch * 3)[:3]
    assert json.loads((out / RUN_FILE).read_text())["training"]["train_tokens"] == sum(steps) * 32


@pytest.mark.parametrize("rows, batch, accumulation, steps", [(7, 2, 2, 5), (5, 2, 1, 3), (9, 4, 3, 4), (8, 2, 2, 3)])
def test_rows_trained_are_the_rows_the_trainer_counts(ws, tmp_path, rows, batch, accumulation, steps):
    """The host-side count of full blocks (the Trainer's own syncs the device every micro-batch) against the Trainer's
    count on the same data: short last micro-batches and accumulation steps of an epoch included."""
    from hf_lowprec.cli.run import rows_trained
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments, default_data_collator

    ids = torch.randint(0, 100, (rows, 8))
    args = TrainingArguments(tmp_path, max_steps=steps, per_device_train_batch_size=batch, use_cpu=True,
                             gradient_accumulation_steps=accumulation, include_num_input_tokens_seen="all",
                             report_to=[], save_strategy="no", disable_tqdm=True)  # fmt: skip
    data = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    trainer = Trainer(model=AutoModelForCausalLM.from_pretrained(ws / "tiny"), args=args, train_dataset=data,
                      data_collator=default_data_collator)  # fmt: skip
    trainer.train()
    assert trainer.state.num_input_tokens_seen == 8 * rows_trained(rows, batch, accumulation, steps)


def test_chat_data_trains_on_completions_and_counts_the_tokens_it_had(ws, tmp_path, caplog):
    """Chat rows are padded to each batch's longest, not to --block-size: tokens/s counts the rows' own tokens. Rows
    with no assistant turn are left out, and the run says how many."""
    turn = [{"role": "user", "content": "what is it?"}, {"role": "assistant", "content": "it is so."}]
    rows = ([turn] * 4 + [turn[:1]]) * 10
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps({"messages": m}) for m in rows))
    tok = AutoTokenizer.from_pretrained(ws / "tiny")
    length = len(tok.apply_chat_template(turn, tokenize=True)["input_ids"])
    assert length < 32
    out = tmp_path / "run"
    result = cli("finetune", ws / "tiny", "--data", tmp_path / "chat.jsonl", "--train-on", "completions",
                 "--max-steps", "3", *FAST, "-o", out)  # fmt: skip
    assert result.exit_code == 0, result.output
    said = r"\d+ of the \d+ chat rows read left out, with no assistant token within their first 32 tokens"
    assert re.search(said, caplog.text), caplog.text  # the CLI shows library warnings on stderr
    record = json.loads((out / RUN_FILE).read_text())
    assert record["data_kind"] == "chat" and record["recipe"]["data"]["train_on"] == "completions"
    t = record["training"]
    assert t["train_tokens"] == 3 * 2 * length  # the rows' tokens, not full blocks of 32
    assert math.isfinite(t["loss_final"])
    # the held-out figure is over the assistant's tokens of its rows: the record and the card say how many
    prompt = len(tok.apply_chat_template(turn[:1], tokenize=True, add_generation_prompt=True)["input_ids"])
    scored = {row["tokens_scored"] for row in record["eval"]}
    assert len(scored) == 1 and (n := scored.pop()) > 0 and n % (length - prompt) == 0, (n, length, prompt)
    assert f"{n:,} tokens scored, the assistant's turns only" in (out / CARD_FILE).read_text()


def test_eval_of_new_chat_data_scores_the_tokens_the_run_trained_on(ws, tmp_path):
    """A run that trained on the completions is evaluated on other chat data over the assistant's turns too (it scored
    every token: a figure unlike the run's); ``--score-on`` chooses, and is refused with --held-out."""
    turn = [{"role": "user", "content": "what is it?"}, {"role": "assistant", "content": "it is so."}]
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps({"messages": turn}) for _ in range(40)))
    other = [{"role": "user", "content": "and now?"}, {"role": "assistant", "content": "now it is not."}]
    (tmp_path / "new.jsonl").write_text("\n".join(json.dumps({"messages": other}) for _ in range(3)))
    out = tmp_path / "run"
    trained = cli("finetune", ws / "tiny", "--data", tmp_path / "chat.jsonl", "--train-on", "completions",
                  "--max-steps", "1", *FAST, "-o", out)  # fmt: skip
    assert trained.exit_code == 0, trained.output
    tok = AutoTokenizer.from_pretrained(ws / "tiny")
    length = len(tok.apply_chat_template(other, tokenize=True)["input_ids"])
    prompt = len(tok.apply_chat_template(other[:1], tokenize=True, add_generation_prompt=True)["input_ids"])
    tokens = lambda r: int(re.search(r"tokens\s*│?\s*([\d,]+)", r.output).group(1).replace(",", ""))  # noqa: E731
    args = ["eval", out, "--data", tmp_path / "new.jsonl", "--block-size", "32"]
    default, every = cli(*args), cli(*args, "--score-on", "all")
    assert default.exit_code == 0 and every.exit_code == 0, default.output + every.output
    assert "scoring the assistant's turns only, as" in default.output
    assert tokens(default) == 3 * (length - prompt) and tokens(every) == 3 * (length - 1), (length, prompt)
    assert tokens(cli(*args, "--score-on", "completions")) == tokens(default)
    assert "--score-on 'turns': choose one of auto, all, completions" in one_error_line(cli(*args, "--score-on", "turns"))
    held = cli("eval", out, "--data", tmp_path / "chat.jsonl", "--held-out", "--score-on", "all")
    assert held.exit_code != 0 and "--score-on: the held-out rows are a causal-LM run's own" in one_error_line(held)


def test_a_data_folder_with_a_validation_split_is_held_out_by_finetune_and_eval(ws, tmp_path):
    text = (ws / "corpus.txt").read_text()
    rows = [text[i : i + 400] for i in range(0, 24_000, 400)]
    folder = tmp_path / "splits"
    folder.mkdir()
    (folder / "train.jsonl").write_text("\n".join(json.dumps({"text": r}) for r in rows[:50]))
    (folder / "validation.jsonl").write_text("\n".join(json.dumps({"text": r}) for r in rows[50:]))
    out = tmp_path / "run"
    result = cli("finetune", ws / "tiny", "--data", folder, "--max-steps", "2", *FAST, "-o", out)
    assert result.exit_code == 0, result.output
    assert "held-out data: the validation split's rows (10)" in result.output
    record = json.loads((out / RUN_FILE).read_text())
    evaluated = " ".join(cli("eval", out, "--data", folder, "--held-out").output.split())
    assert f"loss (nats/token) │ {record['training']['loss_final']:.4f} │" in evaluated
    # a saved DatasetDict keeps its own split names: its "valid" split is held out, and eval --held-out reads it
    import datasets

    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": rows[:50]}),
                          "valid": datasets.Dataset.from_dict({"text": rows[50:]})}).save_to_disk(saved)  # fmt: skip
    result = cli("finetune", ws / "tiny", "--data", saved, "--max-steps", "2", *FAST, "-o", tmp_path / "run-saved")
    assert result.exit_code == 0 and "held-out data: the validation split's rows (10)" in result.output, result.output
    record = json.loads((tmp_path / "run-saved" / RUN_FILE).read_text())
    losses = {}
    for recorded in (True, False):  # a record from before the aliases held out train's last rows: read as it ran
        if not recorded:
            del record["held_out_split_aliases"]
            (tmp_path / "run-saved" / RUN_FILE).write_text(json.dumps(record))
        evaluated = " ".join(cli("eval", tmp_path / "run-saved", "--data", saved, "--held-out").output.split())
        losses[recorded] = re.search(r"loss \(nats/token\) │ ([0-9.]+) │", evaluated)[1]
    assert losses[True] == f"{record['training']['loss_final']:.4f}" != losses[False]


def test_every_builtin_full_recipe_trains_the_tiny_model(ws):
    """The scanned recipes' budgets can be met on a model with fp32 master weights and its head kept; the eval command
    the summary suggests gives its loss back, a packed export's FP8 layers (auto-mixed) computing as they trained."""
    for recipe in ("auto-mixed", "fp8-train", "qat-int4"):
        out = ws / f"run-{recipe}"
        result = cli("finetune", ws / "tiny", "--data", ws / "corpus.txt", "--recipe", recipe, "--max-steps", "2", *FAST, "-o", out)
        assert result.exit_code == 0, result.output
        assert (out / PLAN_FILE).exists() and "Fine-tuning summary" in result.output
        again = f"next: hf-lowprec eval {out} --data <the same data> --held-out --plan-numerics (the loss above again)"
        assert again in " ".join(result.output.split())
        record = json.loads((out / RUN_FILE).read_text())
        evaluated = cli("eval", out, "--data", ws / "corpus.txt", "--held-out", "--plan-numerics").output
        assert f"loss (nats/token) │ {record['training']['loss_final']:.4f} │" in " ".join(evaluated.split()), recipe
        scanned = re.search(r"plan scan │ ([0-9.]+) s \(before training; not in its time\)", " ".join(result.output.split()))
        assert (scanned is not None) == (recipe != "qat-int4")  # the scanned recipes name the scan's seconds apart
        assert (scanned and float(scanned[1])) == record["training"].get("plan_scan_seconds")
        if recipe == "auto-mixed":  # what the allocation met, and that it is not the loss at conversion
            assert "budget │ max_loss_increase=0.05 (the loss predicted after training" in " ".join(result.output.split())


def test_a_packed_export_of_a_mixed_plan_computes_its_fp8_layers_as_trained_with_plan_numerics(ws, tmp_path):
    """A full run with INT4 and FP8 layers exports its INT4 ones packed and its FP8 ones as master weights:
    --plan-numerics re-applies FP8 to those (it was refused for packed exports), so the run's loss comes back."""
    plan = tmp_path / "mixed.json"
    plan.write_text(json.dumps({"default": "fp8", "layers": {"*.mlp.*": "int4-g64", "lm_head": "bf16"}}))
    out = tmp_path / "mixed"
    result = cli("finetune", ws / "tiny", "--data", ws / "corpus.txt", "--recipe", "qat-int4", "--plan", plan,
                 "--max-steps", "2", *FAST, "-o", out)  # fmt: skip
    assert result.exit_code == 0, result.output
    record = json.loads((out / RUN_FILE).read_text())
    formats = {layer["format"] for layer in record["layers"]}
    assert record["export"]["weights"] == "int4-packed" and {"fp8", "int4-g64"} <= formats
    assert record["recipe"]["precision"]["plan"] == "mixed.json" and str(tmp_path) not in (out / CARD_FILE).read_text()
    assert not {"budget", "score", "formats", "scan_method"} & set(record["recipe"]["precision"])  # no scan ran
    losses = {}
    for numerics in ([], ["--plan-numerics"]):
        evaluated = " ".join(cli("eval", out, "--data", ws / "corpus.txt", "--held-out", *numerics).output.split())
        losses[bool(numerics)] = re.search(r"loss \(nats/token\) │ ([0-9.]+) │", evaluated)[1]
    assert losses[True] == f"{record['training']['loss_final']:.4f}" != losses[False]  # FP8 layers in fp32: another
    # its INT4 layers trained fake-quantized: as trained, they compute the codes' exact values, not int8 activations
    backends = {numerics: {m.backend for m in load_exported(out, apply_plan_numerics=numerics)[0].modules()
                           if isinstance(m, PackedInt4Linear)} for numerics in (True, False)}  # fmt: skip
    assert backends == {True: {"dequant"}, False: {"auto"}}
    card = " ".join((out / CARD_FILE).read_text().split())
    assert "Its FP8 layers (8 fp8) are stored as their high-precision master weights" in card
    assert '`load_exported("path/to/mixed", apply_plan_numerics=True)`' in card
    for fmt, loader in (("compressed-tensors", "compressed-tensors"), ("gguf", "llama.cpp")):  # no plan numerics there
        result = cli("export", out, "--out", tmp_path / fmt, "--format", fmt)
        assert result.exit_code == 0, result.output[-2000:]
        exported = json.loads((tmp_path / fmt / RUN_FILE).read_text())
        held = f"8 layers the plan computes in fp8 held as their dense master weights, which {loader} computes"
        assert f"{held} unquantized" in exported["export_changes"]
        assert all(row["computed"].startswith("the model as trained, before export") for row in exported["eval"])
    # a full run's GGUF holds no adapters: the way to run it names none
    refused = one_error_line(cli("eval", tmp_path / "gguf", "--data", ws / "corpus.txt"))
    assert "llama.cpp runs (llama-completion -m model.gguf);" in refused


def test_several_processes_are_refused_before_anything_is_written(ws, tmp_path):
    """Under accelerate launch / torchrun every process ran the whole command: two runs exported into one folder (the
    last renamer won, leaving no weights), or the second found the first's work folder and called it interrupted."""
    result = cli("finetune", ws / "tiny", "--data", ws / "corpus.txt", "-o", tmp_path / "out", env={"WORLD_SIZE": "2"})
    assert "hf-lowprec runs as one process, and this is one of 2 (WORLD_SIZE" in " ".join(one_error_line(result).split())
    assert not list(tmp_path.iterdir())
    module = subprocess.run([sys.executable, "-m", "hf_lowprec.cli", "--help"], capture_output=True, text=True, timeout=120)
    assert module.returncode == 0 and "finetune" in module.stdout  # `python -m hf_lowprec.cli` had no __main__


def test_bad_options_and_commands_fail_with_one_line():
    """typer's own refusals (a value out of an option's range, an unknown option or command) as the commands' own:
    one ``error:`` line and the --help to read (typer boxed them under the usage text), exit status 2."""
    out_of_range = one_error_line(cli("finetune", "--max-steps", "0"))
    assert out_of_range.endswith("Invalid value for '--max-steps': Input should be greater than or equal to 1 (see "
                                 "'hf-lowprec finetune --help')") and "Usage:" not in out_of_range  # fmt: skip
    assert "No such option: --bogus (see 'hf-lowprec eval --help')" in one_error_line(cli("eval", "--bogus", "x"))
    assert "No such command 'finetun'. Did you mean 'finetune'?" in one_error_line(cli("finetun"))
    assert "Missing argument 'model' (see 'hf-lowprec eval --help')" in one_error_line(cli("eval"))
    bare = cli()
    assert bare.exit_code == 2 and "Usage:" in bare.output and "error:" not in bare.output  # the help, as before


def test_bad_inputs_fail_with_one_line(ws, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("training: {max_steps: 3\n")
    assert "not valid YAML" in one_error_line(cli("finetune", ws / "tiny", "--recipe", bad, "-o", tmp_path / "o1"))
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("training: {max_stepz: 3}\n")
    assert "unknown key 'training.max_stepz'" in one_error_line(cli("finetune", ws / "tiny", "--recipe", unknown, "-o", tmp_path / "o1"))
    assert "unknown recipe 'fp9'" in one_error_line(cli("finetune", ws / "tiny", "--recipe", "fp9", "-o", tmp_path / "o1"))
    assert "does not exist" in one_error_line(cli("finetune", ws / "tiny", "--data", tmp_path / "missing.txt", "-o", tmp_path / "o1"))
    numbers = tmp_path / "numbers.csv"
    numbers.write_text("a,b\n1,2\n")
    no_text = cli("finetune", ws / "tiny", "--data", numbers, "-o", tmp_path / "o1")
    assert "has no text column" in one_error_line(no_text) and "loading" not in no_text.output  # before the model
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o1.incomplete").exists()  # nothing left behind
    short = tmp_path / "short.txt"
    short.write_text("To be.\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"title": "no text here"}) + "\n")
    no_column = cli("eval", ws / "tiny", "--data", empty, "--text-column", "body")  # eval: before its model loads too
    assert "has no column 'body'" in one_error_line(no_column) and "loading" not in no_column.output
    too_short = cli("finetune", ws / "tiny", "--data", short, "-o", tmp_path / "o1")
    assert "gives no complete block of 128 tokens" in one_error_line(too_short) and "loading" not in too_short.output
    nulls = tmp_path / "nulls.jsonl"  # null rows are left out as empty ones are: the block size was blamed
    nulls.write_text("\n".join(json.dumps({"text": v}) for v in (None, "", None, " ")) + "\n")
    no_text_rows = one_error_line(cli("finetune", ws / "tiny", "--data", nulls, "-o", tmp_path / "o1"))
    assert re.search(r"nulls\.jsonl': column 'text' holds no text in its \d+ training rows \(each null or empty\)$", no_text_rows)
    # an FP8 rounding for a plan without FP8 layers: it rounded nothing, said it had, and recorded it
    no_fp8 = cli("finetune", ws / "tiny", "--data", ws / "corpus.txt", "--recipe", "qat-int4", "--rounding", "gptq",
                 "--max-steps", "1", *FAST, "-o", tmp_path / "o2")  # fmt: skip
    assert "FP8 weight rounding 'gptq'" in one_error_line(no_fp8) and not (tmp_path / "o2").exists()
    typo = cli("eval", tmp_path / "tinyy", "--data", "some-hub-dataset", env={"HF_HUB_OFFLINE": "1"})
    assert "tinyy' does not exist" in one_error_line(typo) and "reading data" not in typo.output  # not after the data
    eval_short = one_error_line(cli("eval", ws / "tiny", "--data", short))  # eval has no eval_fraction to raise
    assert eval_short.endswith("gives no complete block of 256 tokens to evaluate on; lower --block-size or add data")
    scan_short = cli("scan", ws / "tiny", "--data", short, "--out", tmp_path / "plan.json")
    assert "gives no complete block" in one_error_line(scan_short) and "loading" not in scan_short.output  # scan too
    assert "does not exist" in one_error_line(cli("finetune", tmp_path / "no-model", "-o", tmp_path / "o1"))
    assert "no interrupted run" in one_error_line(cli("finetune", ws / "tiny", "--resume", "-o", tmp_path / "o1"))
    assert "does not exist" in one_error_line(cli("eval", ws / "tiny", "--data", tmp_path / "missing.csv"))
    assert "not an hf-lowprec run" in one_error_line(cli("export", ws / "tiny", "--out", tmp_path / "e"))
    (tmp_path / "full-run").mkdir()
    (tmp_path / "full-run" / RUN_FILE).write_text(json.dumps({"recipe": {"method": "full"}}))
    incomplete = one_error_line(cli("export", tmp_path / "full-run", "--out", tmp_path / "e"))
    assert "lacks config.json, model.safetensors, which its run record says it holds" in incomplete  # it exported
    for name in ("config.json", "model.safetensors"):  # (existing is all the check reads)
        (tmp_path / "full-run" / name).write_text("{}")
    no_adapters = cli("export", tmp_path / "full-run", "--out", tmp_path / "e", "--merge")
    assert "has no LoRA adapters to merge" in one_error_line(no_adapters) and "merging" not in no_adapters.output
    for into in ("bf16", "int4"):  # --merge-into without --merge is not silently ignored
        alone = one_error_line(cli("export", tmp_path / "full-run", "--out", tmp_path / "e", "--merge-into", into))
        assert f"--merge-into {into} applies with --merge: add --merge" in alone
    assert not (tmp_path / "e").exists()

    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "mine.txt").write_text("keep me")
    args = ["finetune", ws / "tiny", "--data", ws / "corpus.txt", "--recipe", "fp8-train", "--max-steps", "1", *FAST, "-o", existing]
    for overwrite in ([], ["--overwrite"]):  # not a run: kept, and --overwrite is not suggested where it is refused
        refused = " ".join(one_error_line(cli(*args, *overwrite)).split())
        assert f"--output-dir: '{existing}' exists and is not an hf-lowprec run or export folder" in refused
        assert "(not even with --overwrite); choose another --output-dir" in refused
        assert [p.name for p in existing.iterdir()] == ["mine.txt"]
    export = ["export", tmp_path / "full-run", "--out", existing]
    for overwrite in ([], ["--overwrite"]):  # export: the same rule
        refused = " ".join(one_error_line(cli(*export, *overwrite)).split())
        assert "is not an hf-lowprec export" in refused and "choose another --out" in refused
        assert [p.name for p in existing.iterdir()] == ["mine.txt"]
    run_args = [*args[:-1], tmp_path / "full-run"]  # an hf-lowprec folder: replaced with --overwrite only
    refused = one_error_line(cli(*run_args))
    assert "already exists; pass --overwrite to replace it (it is replaced only when the new run finishes)" in refused
    assert "overwrite=True" not in refused
    export = ["export", tmp_path / "full-run", "--out", tmp_path / "full-run-copy"]
    shutil.copytree(tmp_path / "full-run", tmp_path / "full-run-copy")
    assert "already exists; pass --overwrite to replace it" in one_error_line(cli(*export))
    into_itself = one_error_line(cli("export", tmp_path / "full-run", "--out", tmp_path / "full-run", "--overwrite"))
    assert "is the run folder" in into_itself and "itself, inside it or around it" in into_itself
    assert sorted(p.name for p in (tmp_path / "full-run").iterdir()) == ["config.json", RUN_FILE, "model.safetensors"]
    other_run = tmp_path / "other-run"  # a finetune run's folder (its log): export --overwrite replaced it
    other_run.mkdir()
    (other_run / RUN_FILE).write_text("{}")
    (other_run / "log_history.json").write_text("[]")
    text = one_error_line(cli("export", tmp_path / "full-run", "--out", other_run, "--overwrite"))
    assert f"--out: '{other_run}' is a finetune run folder (it holds log_history.json), which export does not" in text
    assert sorted(p.name for p in other_run.iterdir()) == [RUN_FILE, "log_history.json"]


def test_empty_or_malformed_data_and_a_split_a_file_lacks_fail_with_one_line(ws, tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "bad.jsonl").write_text('{"text": "a b c"}\n{not json\n')
    args = ["finetune", ws / "tiny", "--max-steps", "2", *FAST, "-o", tmp_path / "run"]
    for name in ("empty.jsonl", "empty.txt"):  # an empty file crashed the error formatter (IndexError, exit 1)
        assert f"could not read data '{tmp_path / name}'" in one_error_line(cli(*args, "--data", tmp_path / name))
        assert "the file is empty" in one_error_line(cli(*args, "--data", tmp_path / name))
    assert "as json: line 2: Expecting property name" in one_error_line(cli(*args, "--data", tmp_path / "bad.jsonl"))
    assert not (tmp_path / "run").exists() and not (tmp_path / "run.incomplete").exists()

    # a single file has one split, train: another is an error, not the training rows under the other's name
    evaluate = ["eval", ws / "tiny", "--data", ws / "corpus.txt", "--block-size", "32", "--max-sequences", "2"]
    for split in ("bogus", "validation"):
        text = one_error_line(cli(*evaluate, "--split", split))
        assert f"has no split '{split}'; its splits are train" in " ".join(text.split()) and "perplexity" not in text
    default = cli(*evaluate)
    assert default.exit_code == 0 and "(train split)" in default.output, default.output


@pytest.fixture(scope="module")
def full_runs(ws):
    """Full-training runs (no LoRA) made under umask 022: ``{"fp8-train": folder, "qat-int4": folder}``."""
    runs, umask = {}, os.umask(0o022)
    try:
        for recipe in ("fp8-train", "qat-int4"):
            runs[recipe] = ws / f"full-{recipe}"
            result = cli("finetune", ws / "tiny", "--data", ws / "corpus.txt", "--recipe", recipe, "--max-steps", "2", "--lr", "3e-3", *FAST, "-o", runs[recipe])
            assert result.exit_code == 0, result.output
    finally:
        os.umask(umask)
    return runs


def test_full_runs_export_dense_bf16_and_name_their_formats(ws, full_runs, tmp_path):
    """``--format bf16`` on a full run: master weights cast (fp8-train), packed INT4 layers dequantized (qat-int4), a
    model plain transformers loads with the loss the run's weights give; a format a run lacks names those it has."""
    fp8, qat = full_runs["fp8-train"], full_runs["qat-int4"]
    wrong = one_error_line(cli("export", fp8, "--out", tmp_path / "ct", "--format", "compressed-tensors"))
    assert "--format compressed-tensors does not apply" in wrong and "choose one of native, bf16" in " ".join(wrong.split())
    merge = one_error_line(cli("export", fp8, "--out", tmp_path / "m", "--merge"))
    assert "has no LoRA adapters to merge" in merge and "its export formats are native, bf16" in " ".join(merge.split())
    tok = AutoTokenizer.from_pretrained(ws / "tiny")
    for run, backend in ((fp8, "auto"), (qat, "dequant")):
        dense = tmp_path / f"{run.name}-bf16"
        result = cli("export", run, "--out", dense, "--format", "bf16")
        assert result.exit_code == 0, result.output
        assert "(dense bf16 weights)" in result.output and "merging" not in result.output and "--merge" not in result.output
        config = json.loads((dense / "config.json").read_text())
        assert "quantization_config" not in config and config["dtype"] == "bfloat16"
        assert json.loads((dense / RUN_FILE).read_text())["export"]["weights"] == "dense"
        with safe_open(dense / "model.safetensors", "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
        plain = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
        assert not any(isinstance(m, (PackedInt4Linear, PackedInt8Linear)) for m in plain.modules())
        trained, _ = load_exported(run, backend=backend)  # master weights (fp8-train), packed codes (qat-int4)
        blocks = held_out(ws, tok).eval
        expected = causal_lm_loss(trained, blocks, default_data_collator, batch_size=2)["loss"]
        assert causal_lm_loss(plain, blocks, default_data_collator, batch_size=2)["loss"] == pytest.approx(expected, abs=0.02)
        card = (dense / CARD_FILE).read_text()
        assert validate_card_metadata(card) == []
        # the card describes what the folder holds: no master weights, no plan to re-apply
        assert "dequantized" in card if run is qat else "master weights cast to bf16" in card
        assert "apply_plan_numerics" not in card and not (dense / PLAN_FILE).exists()
        # the layers the plan kept are stored in bf16 here too: the card said "kept (fp32)", the trained weights' dtype
        kept = [row for row in json.loads((dense / RUN_FILE).read_text())["layers"] if "stored" in row]
        assert kept and {row["stored"] for row in kept} == {"bf16"} and "`lm_head` | kept (bf16)" in card
    assert cli("export", qat, "--out", tmp_path / "qat-ct", "--format", "compressed-tensors").exit_code == 0


def test_runs_and_exports_get_the_modes_of_the_umask(full_runs, tmp_path):
    """Folders 0755 and files 0644 under umask 022, as mkdir and open give: not mkdtemp's 0700 or safetensors' 0600,
    also where --overwrite replaces a folder."""

    def modes(folder):
        return {p.relative_to(folder.parent).as_posix(): oct(p.stat().st_mode & 0o777) for p in [folder, *folder.rglob("*")]}

    def wrong(folder):
        return {name: mode for name, mode in modes(folder).items() if mode != ("0o755" if (folder.parent / name).is_dir() else "0o644")}

    run = full_runs["qat-int4"]
    assert (run / "model.safetensors").is_file() and wrong(run) == {}
    umask = os.umask(0o022)
    try:
        pub = tmp_path / "pub"
        assert cli("export", run, "--out", pub).exit_code == 0
        assert wrong(pub) == {}
        result = cli("export", run, "--out", pub, "--format", "bf16", "--overwrite")  # replaces the folder
        assert result.exit_code == 0, result.output
        assert wrong(pub) == {} and json.loads((pub / RUN_FILE).read_text())["export"]["weights"] == "dense"
    finally:
        os.umask(umask)


@pytest.mark.parametrize("signum, status, overwrite", [(signal.SIGINT, 130, []), (signal.SIGTERM, 143, ["--overwrite"])])  # fmt: skip
def test_an_interrupt_leaves_a_resumable_checkpoint(ws, tmp_path, signum, status, overwrite):
    """Ctrl-C, or SIGTERM (timeout, Slurm, Kubernetes): the step finishes, a checkpoint is saved, the exit status is a
    shell's for that signal, and --resume (in place of --overwrite, which starts over) continues one loss curve."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "hf_lowprec.cli.app", "finetune", str(ws / "tiny"), "--data", str(ws / "corpus.txt"),
           "--recipe", "qat-int4", "--max-steps", "40", *FAST, "-o", str(out), *overwrite]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()
    deadline = time.time() + 120
    while not any(line.startswith("step ") for line in lines) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert any(line.startswith("step ") for line in lines), "".join(lines)
    proc.send_signal(signum)
    assert proc.wait(timeout=120) == status
    reader.join(timeout=10)
    stderr = "".join(lines)
    assert "checkpoint saved" in stderr and "Traceback" not in stderr
    instead = " instead of --overwrite" if overwrite else ""
    assert f"run the same command with --resume{instead} to continue" in " ".join(stderr.split()), stderr
    assert ("interrupt (SIGTERM)" in stderr) == (signum == signal.SIGTERM), stderr
    checkpoints = list((tmp_path / "run.incomplete" / "checkpoints").glob("checkpoint-*"))
    assert len(checkpoints) == 1 and not out.exists()
    stopped_at = int(checkpoints[0].name.split("-")[1])
    assert 0 < stopped_at < 40

    resumed = cli(*[a for a in cmd[3:] if a != "--overwrite"], "--resume")  # the same command, in this process
    assert resumed.exit_code == 0, resumed.output[-2000:]
    record = json.loads((out / RUN_FILE).read_text())
    assert record["training"]["resumed_from_step"] == stopped_at and record["training"]["steps"] == 40
    assert record["training"]["train_tokens"] == 40 * 2 * 32  # every step's tokens (batch 2 x 32), not this session's
    logged = [(e["step"], e["loss"]) for e in json.loads((out / "log_history.json").read_text()) if "loss" in e]
    # one loss curve across the interruption, with the loss of the steps before it (their window was lost: the resumed
    # run's first log averaged the steps after the checkpoint only)
    assert [step for step, _ in logged] == sorted({*range(5, 41, 5), stopped_at})
    starts = [0] + [step for step, _ in logged[:-1]]
    whole = sum(loss * (step - start) for (step, loss), start in zip(logged, starts)) / 40
    assert record["training"]["train_loss_over_steps"] == "1-40"  # the whole run's, as an uninterrupted run's
    assert record["training"]["train_loss"] == pytest.approx(whole, rel=1e-12)
    assert (out / "loss_curve.png").read_bytes()[:4] == b"\x89PNG" and "](loss_curve.png)" in (out / CARD_FILE).read_text()
    assert not (tmp_path / "run.incomplete").exists()


@pytest.mark.slow
def test_default_demo_on_the_offline_checkpoint(tmp_path):
    """The README's main job (`hf-lowprec finetune --output-dir runs/demo --overwrite`), shortened to 3 steps."""
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "hf_lowprec.cli.app", "finetune", "--output-dir", str(out), "--overwrite",
                           "--max-steps", "3", "--eval-blocks", "2"], capture_output=True, text=True, timeout=1200)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Fine-tuning summary" in proc.stdout and "int4-g64" in proc.stdout and str(out) in proc.stdout
    record = json.loads((out / RUN_FILE).read_text())
    assert record["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and record["dataset"] == "shakespeare"
    assert record["recipe"]["name"] == "int4-ondevice-lora" and record["training"]["steps"] == 3
    assert validate_card_metadata((out / CARD_FILE).read_text()) == []
    assert f"next: hf-lowprec eval {out} (the loss above again)" in proc.stdout
    again = subprocess.run([sys.executable, "-m", "hf_lowprec.cli.app", "eval", str(out)], capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"loss (nats/token) │ {record['training']['loss_final']:.4f} │" in " ".join(again.stdout.split())


def test_int4_lora_trainer_stores_what_backward_needs_in_int8(tmp_path):
    from hf_lowprec.cli.run import _trainer
    from peft import LoraConfig
    from transformers import TrainingArguments

    from hf_lowprec.ondevice import prepare_int4_lora
    from hf_lowprec.recipe import load_recipe

    recipe = load_recipe("int4-ondevice-lora")
    assert recipe.training.activation_storage == "int8" and not recipe.training.gradient_checkpointing
    model, _ = prepare_int4_lora(AutoModelForCausalLM.from_pretrained(save_tiny_model(tmp_path / "tiny")), LoraConfig(r=4, target_modules="all-linear"))
    ids = torch.randint(0, model.config.vocab_size, (16, 64))  # 512 tokens: the MLP activations pass the size threshold
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=8, use_cpu=True, report_to="none",
                             disable_tqdm=True, save_strategy="no")  # fmt: skip
    trainer = _trainer(recipe, model=model, args=args, train_dataset=[{"input_ids": row} for row in ids], data_collator=default_data_collator)
    trainer.train()
    storage = trainer.activation_storage
    # 1 byte per element (+ a 4-byte scale per row) in place of 4 (fp32 model): well under a third of the bytes
    assert storage is not None and 0 < storage.stored_bytes < storage.original_bytes / 3


def test_report_to_sends_trainer_and_lowprec_values_to_tensorboard_in_the_run_folder(ws):
    out = ws / "run-tb"
    result = cli("finetune", ws / "tiny", "--data", ws / "corpus.txt", "--recipe", "fp8-train", "--max-steps", "5",
                 "--report-to", "tensorboard", *FAST, "-o", out)  # fmt: skip
    assert result.exit_code == 0, result.output
    scalars = tensorboard_scalars(out / "runs")
    assert "train/loss" in scalars and any(tag.startswith("train/lowprec/") for tag in scalars), sorted(scalars)
    for fmt in ("native", "bf16"):  # every export format carries the traces (bf16's, gguf's, ct's did not)
        exported = cli("export", out, "--out", ws / f"tb-{fmt}", "--format", fmt)
        assert exported.exit_code == 0, exported.output
        assert tensorboard_scalars(ws / f"tb-{fmt}" / "runs") == scalars
    bad = cli("finetune", ws / "tiny", "--report-to", "tensorbored", "-o", ws / "run-bad")
    assert bad.exit_code != 0 and "'training.report_to' tensorbored: choose from none, all" in one_error_line(bad)


CT_HELD_OUT_LOSS = """
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({folder!r}, dtype=torch.float32)  # the adapters beside it applied by PEFT
assert list(model.peft_config) == ["default"] and not any(m.startswith("hf_lowprec") for m in sys.modules)
blocks = torch.load({blocks!r})
with torch.no_grad():
    print(sum(model(input_ids=b[None], labels=b[None]).loss.item() for b in blocks) / len(blocks))
"""


def test_export_formats_compressed_tensors_and_bf16(ws, lora_run, tmp_path):
    (out, run), ct = lora_run, tmp_path / "ct"
    assert run.exit_code == 0, run.output
    result = cli("export", out, "--out", ct, "--format", "compressed-tensors")
    assert result.exit_code == 0, result.output
    record = json.loads((ct / RUN_FILE).read_text())
    assert record["export"]["loader"] == "compressed-tensors" and record["export"]["requantized_layers"]  # AWQ layers
    int8 = sum(f == "int8" for f in json.loads((out / PLAN_FILE).read_text())["layers"].values())
    assert ("int8 layers as dense weights" in record["export"]["description"]) == (int8 > 0), record["export"]
    assert json.loads((ct / "config.json").read_text())["quantization_config"]["quant_method"] == "compressed-tensors"
    tok = AutoTokenizer.from_pretrained(out)
    blocks = torch.stack([torch.as_tensor(r["input_ids"]) for r in held_out(ws, tok).eval])
    torch.save(blocks, tmp_path / "blocks.pt")
    code = CT_HELD_OUT_LOSS.format(folder=str(ct), blocks=str(tmp_path / "blocks.pt"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    loss = float(done.stdout.strip().splitlines()[-1])
    # the trained model, up to the second rounding of the AWQ-scaled layers onto the plain grid: 0.057 apart where the
    # run's grad-inputs ran int8 (a modelled AVX2 CPU); the adapters left out, 0.18
    assert loss == pytest.approx(json.loads((out / RUN_FILE).read_text())["training"]["loss_final"], abs=0.1)
    # hf-lowprec's own eval of the folder loads its adapters as PEFT does (it evaluated the base alone until 2026-12-06)
    evaluated = " ".join(cli("eval", ct, "--data", ws / "corpus.txt", "--held-out").output.split())
    assert float(re.search(r"loss \(nats/token\) │ ([0-9.]+) │", evaluated)[1]) == pytest.approx(loss, abs=1e-4)
    numerics = one_error_line(cli("eval", ct, "--data", ws / "corpus.txt", "--held-out", "--plan-numerics"))
    assert "a compressed-tensors export computes with its quantized weights" in numerics
    again = one_error_line(cli("export", ct, "--out", tmp_path / "re", "--merge", "--merge-into", "bf16"))
    assert "not the packed INT4 base hf-lowprec merges adapters into; merge from the run folder" in again

    dense = cli("export", out, "--out", tmp_path / "bf16", "--format", "bf16")
    assert dense.exit_code == 0, dense.output
    assert "quantization_config" not in json.loads((tmp_path / "bf16" / "config.json").read_text())
    # the Hub's tags say what the folder stores: INT4 codes in compressed-tensors (untagged before), none in bf16
    assert "4-bit" in ModelCard.load(ct / CARD_FILE).data.tags
    assert "4-bit" not in ModelCard.load(tmp_path / "bf16" / CARD_FILE).data.tags
    bad = cli("export", out, "--out", tmp_path / "x", "--format", "gguf")  # AWQ-scaled codes: no GGUF block holds them
    refused = one_error_line(bad)
    assert "int4-g64-asym codes of an activation-scaled (AWQ) weight, which GGUF's blocks cannot hold" in refused
    assert "export --format bf16 and convert that with llama.cpp's convert_hf_to_gguf.py" in refused
    assert not (tmp_path / "x").exists()
    bad = cli("export", out, "--out", tmp_path / "x", "--format", "onnx")
    assert "choose one of native, compressed-tensors, bf16, gguf" in one_error_line(bad)


def finetune_freeing_memory(ws, out, returned: str):
    """The tiny model fine-tuned for 2 steps with ``training.return_freed_memory={returned}`` (and other dotted keys)."""
    result = cli("finetune", ws / "tiny", "training.max_steps=2", "lora.r=4", "training.logging_steps=1",
                 f"training.return_freed_memory={returned}", "--data", ws / "corpus.txt", *FAST, "-o", out)  # fmt: skip
    assert result.exit_code == 0, result.output


def test_recipe_keys_as_key_value_arguments(ws, tmp_path):
    out = tmp_path / "kv"
    finetune_freeing_memory(ws, out, "true")
    record = json.loads((out / RUN_FILE).read_text())
    assert record["training"]["steps"] == 2 and record["recipe"]["lora"]["r"] == 4 and record["adapter"]["r"] == 4
    assert record["recipe"]["training"]["return_freed_memory"] is True
    bad = cli("finetune", ws / "tiny", "training.max_step=2", "-o", tmp_path / "bad")
    assert "unknown recipe key 'training.max_step' (did you mean 'training.max_steps'?)" in one_error_line(bad)
    assert "key=value with a dotted key" in one_error_line(cli("finetune", ws / "tiny", "oops", "-o", tmp_path / "bad"))
    # an empty value was dropped without a word (the recipe's kept); null is checked as a recipe file's null is
    empty = one_error_line(cli("finetune", ws / "tiny", "training.block_size=", "-o", tmp_path / "bad"))
    assert empty.endswith("'training.block_size=': no value after '='; give one (key=null sets null)")
    null = one_error_line(cli("finetune", ws / "tiny", "training.block_size=null", "-o", tmp_path / "bad"))
    assert "'training.block_size' must be an integer, got None" in null
    unclosed = cli("finetune", ws / "tiny", "lora.target_modules=[q_proj", "-o", tmp_path / "bad")  # exit 1, parser's words
    assert "'lora.target_modules=[q_proj': the value is not valid YAML (while parsing a flow sequence)" in one_error_line(unclosed)
    assert not (tmp_path / "bad").exists()
    # a scan's settings with a fixed plan were accepted without a word, and left out of the run's record
    scan_keys = cli("finetune", ws / "tiny", "precision.budget.target_bits_per_param=5", "precision.score=after-training",
                    "--data", tmp_path / "missing.txt", "-o", tmp_path / "bad")  # fmt: skip
    assert ("note: precision.budget.target_bits_per_param, precision.score apply to plan 'auto' (a scan); the plan "
            "'int4-g64-asym' is fixed, so they play no part in this run") in " ".join(scan_keys.output.split())  # fmt: skip
    # checked on the model built on the meta device, before the data is read (each failed after the base model's
    # evaluation, or trained a full-rank adapter of hundreds of MB)
    for item, expected in (("lora.target_modules=[foo]", "target module 'foo' matches no Linear layer of this model"),
                           ("lora.r=100000", "lora.r 100000 exceeds the rank of every targeted layer (at most 64)")):
        refused = cli("finetune", ws / "tiny", "--data", ws / "corpus.txt", item, "-o", tmp_path / "bad")
        assert expected in one_error_line(refused) and "reading data" not in refused.output, refused.output


def test_the_evaluations_return_freed_memory_as_training_does(ws, tmp_path, counted_trims):
    """``training.return_freed_memory=true`` returns freed memory at each decoder block in the three evaluations as in
    training: 2 batches of the 4 held-out blocks per evaluation (forward) and 2 steps (forward and backward) make 10
    trims per block more than the same run with ``false`` (whose trims are loading's and exporting's)."""

    def trims(returned: str) -> int:
        counted_trims.clear()
        finetune_freeing_memory(ws, tmp_path / returned, returned)
        return len(counted_trims)

    added = trims("true") - trims("false")
    assert added == (3 * 2 + 2 * 2) * json.loads((ws / "tiny" / "config.json").read_text())["num_hidden_layers"]


def test_trust_remote_code_and_revision_reach_from_pretrained(ws, tmp_path):
    custom = tmp_path / "custom"
    shutil.copytree(ws / "tiny", custom)
    marker = tmp_path / "custom-code-ran"
    (custom / "modeling_custom.py").write_text(
        "from pathlib import Path\nfrom transformers import LlamaForCausalLM\n\n\nclass CustomLlama(LlamaForCausalLM):\n"
        f"    def __init__(self, config):\n        super().__init__(config)\n        Path({str(marker)!r}).touch()\n"
    )
    config = json.loads((custom / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomLlama"}
    (custom / "config.json").write_text(json.dumps(config))
    args = ["eval", custom, "--data", ws / "corpus.txt", "--block-size", "32", "--max-sequences", "2"]
    assert cli(*args).exit_code == 0 and not marker.exists()  # the repository's code is not run unasked
    trusted = cli(*args, "--trust-remote-code")
    assert trusted.exit_code == 0 and "perplexity" in trusted.output and marker.exists(), trusted.output
    revised = cli(*args, "--trust-remote-code", "--revision", "main")  # a local folder has no revisions: said
    assert revised.exit_code == 0 and f"--revision 'main' applies to Hub ids; '{custom}' is a local folder" in revised.output


def test_eval_defaults_to_the_validation_split(ws, tmp_path):
    folder = tmp_path / "splits"
    folder.mkdir()
    text = corpus_text(20000)
    (folder / "train.jsonl").write_text("\n".join(json.dumps({"text": text[i : i + 2000]}) for i in range(0, 10000, 2000)))
    (folder / "validation.jsonl").write_text(json.dumps({"text": "to be or not to be " * 60}))
    args = ["eval", ws / "tiny", "--data", folder, "--block-size", "32"]
    default, train = cli(*args), cli(*args, "--split", "train")
    flat = lambda r: " ".join(r.output.split())  # noqa: E731  (rich wraps long lines)
    assert default.exit_code == 0 and "(validation split)" in flat(default), default.output
    assert train.exit_code == 0 and "(train split)" in flat(train)
    tokens = lambda r: int(re.search(r"tokens\s*│?\s*([\d,]+)", r.output).group(1).replace(",", ""))  # noqa: E731
    assert tokens(default) < tokens(train)  # the one short validation row, not the five training rows
    assert "has no split 'test'" in one_error_line(cli(*args, "--split", "test"))


def test_eval_reads_the_offline_corpus_by_its_name(ws, tmp_path, monkeypatch):
    """``--data shakespeare`` (the name --help gives the offline corpus, as scan and finetune read it) is the corpus,
    not a Hub dataset of that name (eval asked the Hub for it: offline, an error)."""
    monkeypatch.chdir(tmp_path)  # no local path named shakespeare
    args = ["eval", ws / "tiny", "--data", "shakespeare", "--block-size", "32", "--max-sequences", "2"]
    result = cli(*args)
    assert result.exit_code == 0 and "(train split)" in " ".join(result.output.split()), result.output
    assert "split 'validation': the offline default corpus has one split, 'train'" in one_error_line(
        cli(*args, "--split", "validation"))


def test_eval_refuses_a_block_longer_than_the_model_takes_before_tokenizing(ws):
    """As finetune does (eval refused it after tokenizing and loading the model)."""
    limit = json.loads((ws / "tiny" / "config.json").read_text())["max_position_embeddings"]
    refused = cli("eval", ws / "tiny", "--data", ws / "corpus.txt", "--block-size", str(2 * limit))
    expected = f"block size {2 * limit} exceeds the model's max_position_embeddings {limit}; lower --block-size"
    assert one_error_line(refused).endswith(expected)
    assert "tokenizing" not in refused.output and "loading" not in refused.output


def test_same_seed_same_run(ws, tmp_path):
    """Two processes' worth of state aside, a run is a function of its recipe and seed: LoRA's random init included."""
    args = ["--data", ws / "corpus.txt", "--lora-init", "default", "--max-steps", "2", "--lr", "1e-2", *FAST]
    losses = []
    for name in ("a", "b"):
        torch.manual_seed(len(losses))  # whatever the global RNG holds before, the run seeds itself
        result = cli("finetune", ws / "tiny", *args, "-o", tmp_path / name)
        assert result.exit_code == 0, result.output
        losses.append(json.loads((tmp_path / name / RUN_FILE).read_text())["training"]["loss_final"])
    assert losses[0] == losses[1]


def test_a_run_that_diverges_publishes_nothing_and_fails(ws, tmp_path):
    """A finite but far too large learning rate: NaN weights after the first step that applies it. The run fails in
    one line naming the loss and the step the training loss was first not finite, and publishes no model (its card
    would say nan)."""
    out = tmp_path / "o"
    result = cli("finetune", ws / "tiny", "--data", ws / "corpus.txt", "--recipe", "qat-int4", "--max-steps", "3",
                 "--lr", "1e30", *FAST, "training.logging_steps=1", "-o", out)  # fmt: skip
    assert result.exit_code == 1 and result.output.count("error:") == 1, result.output[-2000:]
    text = " ".join(result.output.split("error:")[1].split())
    assert "step 3/3 loss nan" in result.output  # the progress shows it as it happens
    assert text.startswith("training diverged: the held-out loss after training is nan; the training loss logged at")
    assert "try a lower --lr" in text and "Traceback" not in result.output and not out.exists()
    for bad in ("inf", "nan"):
        text = one_error_line(cli("finetune", ws / "tiny", "--lr", bad, *FAST, "-o", tmp_path / bad))
        assert f"'training.learning_rate' must be a finite number > 0, got {bad}" in text
        assert not (tmp_path / bad).exists() and not (tmp_path / f"{bad}.incomplete").exists()
