"""The README's "Hugging Face round trip" snippets, run as written (paths and the model swapped for tiny ones)."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from cli_invoke import cli
from tiny_assets import corpus_text, save_tiny_model, tensorboard_scalars

README = Path(__file__).resolve().parents[1] / "README.md"
FAST = ["--block-size", "32", "--batch-size", "2", "--eval-blocks", "4", "--dtype", "fp32", "--save-steps", "1000"]


def _section_blocks(language: str) -> list[str]:
    text = README.read_text()
    section = text.split("### The Hugging Face round trip", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    d = tmp_path_factory.mktemp("readme")
    save_tiny_model(d / "tiny")
    (d / "my-data.jsonl").write_text("\n".join(json.dumps({"text": corpus_text(3000)[i::7]}) for i in range(7)))
    return d


def _localized(text: str, ws: Path) -> str:
    for name in ("runs/demo", "exports/demo-ct", "my-data.jsonl"):
        text = text.replace(name, str(ws / name))
    return text.replace("path/to/checkpoint", str(ws / "tiny"))


@pytest.fixture(scope="module")
def cli_lines(ws):
    """Run the README's CLI lines in order; ``finetune`` gets the tiny model and small sizes besides its arguments."""
    results = []
    for line in _section_blocks("bash")[0].strip().splitlines():
        args = shlex.split(_localized(line, ws))
        assert args[0] == "hf-lowprec"
        if args[1] == "finetune":
            args = [args[1], str(ws / "tiny"), *args[2:], "--data", str(ws / "my-data.jsonl"), *FAST]
        else:
            args = args[1:]
        results.append(cli(*args))
        assert results[-1].exit_code == 0, (line, results[-1].output)
    return results


def test_cli_lines_run_and_do_what_the_readme_says(ws, cli_lines):
    record = json.loads((ws / "runs/demo/hf_lowprec_run.json").read_text())
    assert record["training"]["steps"] == 10 and record["adapter"]["r"] == 8
    assert "train/loss" in tensorboard_scalars(ws / "runs/demo/runs")
    config = json.loads((ws / "exports/demo-ct/config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert "perplexity" in cli_lines[2].output


@pytest.mark.parametrize("index", [0, 1, 2, 3])
def test_python_snippets_run_in_a_fresh_interpreter(ws, cli_lines, index):
    code = _localized(_section_blocks("python")[index], ws)
    if "ChunkedLossTrainer" in code:  # the reader's own model, arguments and data
        code = code.replace("trainer.train()", "trainer.args.max_steps = 1\ntrainer.train()")
        code = PRELUDE.format(base=str(ws / "tiny"), out=str(ws / "trainer")) + code
    if "hf_lowprec" not in code:  # the compressed-tensors load: hf-lowprec must not be needed
        code += "\nassert not any(m.startswith('hf_lowprec') for m in sys.modules)\n"
    # what the snippet made, and its LoRA adapters (a PeftModel's, or those transformers applied from the folder)
    code = "import sys\n" + code + (
        "\nmade = model if 'model' in dir() else trainer.model\n"
        "print(type(model).__name__ if 'model' in dir() else type(trainer).__name__, list(made.peft_config))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    made, adapters = done.stdout.strip().splitlines()[-1].split(" ", 1)
    assert made in ("LlamaForCausalLM", "PeftModelForCausalLM", "PeftModel", "ChunkedLossTrainer")
    assert adapters == "['default']"


PRELUDE = """
import datasets, torch
from peft import LoraConfig
from transformers import TrainingArguments
from hf_lowprec import load_int4_lora
model, _, _ = load_int4_lora({base!r}, LoraConfig(r=4, target_modules="all-linear"))
rows = torch.randint(3, 256, (8, 16)).tolist()
dataset = datasets.Dataset.from_dict({{"input_ids": rows, "labels": rows}})
args = TrainingArguments({out!r}, per_device_train_batch_size=4, report_to="none", use_cpu=True, save_strategy="no")
"""
