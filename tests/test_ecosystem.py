"""The Hugging Face round trip as users meet it: the model card's snippets run as written in a fresh interpreter
(only ``import hf_lowprec``, transformers and PEFT), and give the trained model's logits."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import on_dequant_backend, randomize_adapters
from peft import LoraConfig
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tiny_assets import HubStandIn, save_tiny_model, tensorboard_scalars
from transformers import TrainerCallback

from hf_lowprec.export import CARD_FILE, export_model, hardware_info, load_exported, push
from hf_lowprec.ondevice import load_int4_lora

BASE_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
IDS = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))


def _adapted_model(base_dir: Path, dtype="auto", adapter_dtype="auto", plan=None):
    """The tiny model with a packed INT4 base and LoRA adapters whose ``B`` is non-zero (so they change the logits)."""
    torch.manual_seed(0)  # PEFT draws A at random
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    model, tokenizer, _ = load_int4_lora(base_dir, lora, plan=plan, dtype=dtype, adapter_dtype=adapter_dtype)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return model.eval(), tokenizer


def _record() -> dict:
    return {
        "base_model": BASE_ID,
        "recipe": {"name": "int4-ondevice-lora", "method": "int4-lora"},
        "dataset": "shakespeare",
        "eval": [{"dataset": "shakespeare", "split": "held-out", "metric": "perplexity", "value": 50.0}],
        "hardware": hardware_info(),
    }


def _card_snippets(card: str) -> list[str]:
    """The python code blocks of a model card."""
    return re.findall(r"```python\n(.*?)```", card, flags=re.S)


def _run_snippet(code: str, tmp_path: Path) -> torch.Tensor:
    """Run ``code`` in a fresh interpreter, then save ``model``'s logits on :data:`IDS`; return them."""
    torch.save(IDS, tmp_path / "ids.pt")
    out = tmp_path / "logits.pt"
    epilogue = (
        "\nimport torch\n"
        f"with torch.no_grad():\n    torch.save(model(torch.load({str(tmp_path / 'ids.pt')!r})).logits, {str(out)!r})\n"
    )
    # one thread, as conftest sets for this process: the same autotune key, so the same cached kernel choices (with
    # two threads the child measured its own and could pick another backend: bf16 logits 0.006 apart, seen under AVX2)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code + epilogue], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    base_dir = save_tiny_model(tmp_path_factory.mktemp("base") / "tiny")
    model, tokenizer = _adapted_model(base_dir)
    out = export_model(model, tokenizer, tmp_path_factory.mktemp("export") / "run", _record(), repo_id="me/tiny-int4")
    with torch.no_grad():
        logits = model(IDS).logits
    return out, logits


def test_card_snippets_reload_the_trained_model_in_a_fresh_interpreter(exported, tmp_path):
    """Each loading snippet of the card (``load_exported``; transformers' ``from_pretrained`` after ``import
    hf_lowprec``, which applies the adapters stored beside the weights) and ``pipeline``, which the card names, give
    the trained model's logits."""
    folder, trained_logits = exported
    card = (folder / CARD_FILE).read_text()
    snippets = [s for s in _card_snippets(card) if "import hf_lowprec" in s or "from hf_lowprec" in s]
    assert len(snippets) == 2 and any("AutoModelForCausalLM.from_pretrained" in s for s in snippets), snippets
    pipe = "import hf_lowprec\nfrom transformers import pipeline\n"
    pipe += f"model = pipeline('text-generation', model={str(folder)!r}).model\n"
    for code in [s.replace("me/tiny-int4", str(folder)) for s in snippets] + [pipe]:
        # the same packed codes and adapters, the same kernels (the autotune cache is shared): the same numbers
        torch.testing.assert_close(_run_snippet(code, tmp_path), trained_logits, rtol=0, atol=1e-5, msg=code)


LOAD_BASE = """
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({folder!r})
"""


def test_a_pushed_export_loads_whole_from_its_repo_id(exported, tmp_path, monkeypatch):
    """From the Hub, ``from_pretrained(repo)`` finds the adapter config beside the weights, loads the base it names
    (the pushed repo itself: ``push`` writes it) and applies the adapters: the trained logits from a repo id; PEFT's
    ``AutoPeftModelForCausalLM`` loads that base, then the adapters over those transformers applied (replaced, not
    added twice). The pushed files are read back from a Hub cache, offline."""
    folder, trained_logits = exported
    with HubStandIn() as hub:
        monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", hub.endpoint)
        push(folder, "me/tiny-int4", token="hf_standinSECRETtoken1234567890")
    repo = tmp_path / "hub" / "models--me--tiny-int4"
    for name, data in hub.files["me/tiny-int4"].items():
        (repo / "snapshots" / ("1" * 40) / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / "snapshots" / ("1" * 40) / name).write_bytes(data)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("1" * 40)
    cache = f"import os\nos.environ['HF_HUB_CACHE'] = {str(tmp_path / 'hub')!r}\nimport hf_lowprec\n"
    code = (
        "from transformers import AutoModelForCausalLM\n"
        "model = AutoModelForCausalLM.from_pretrained('me/tiny-int4')\nassert list(model.peft_config) == ['default']\n"
    )
    peft_way = "from peft import AutoPeftModelForCausalLM as Auto\nmodel = Auto.from_pretrained('me/tiny-int4')\n"
    for snippet in (code, peft_way):
        torch.testing.assert_close(_run_snippet(cache + snippet, tmp_path), trained_logits, rtol=0, atol=1e-5)


def test_an_export_from_before_the_adapters_moved_still_loads(exported, tmp_path):
    """Exports written before 2026-12-06 keep their adapters in ``adapter/``: hf-lowprec's loaders still apply them."""
    folder, trained_logits = exported
    older = shutil.copytree(folder, tmp_path / "older")
    (older / "adapter").mkdir()
    for path in older.glob("adapter_*"):
        path.rename(older / "adapter" / path.name)
    model, _ = load_exported(older)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, trained_logits, rtol=0, atol=1e-5)


def test_a_packed_folder_fails_loudly_without_hf_lowprec_and_loads_quietly_with_it(exported, tmp_path):
    """transformers without ``import hf_lowprec`` knows no packed layers: the one-byte ``weight`` each packed layer's
    state holds makes it stop at that shape, where it would otherwise start those layers from random weights. With
    the import the same folder loads with nothing unexpected; a folder written before the guards loads as well."""
    folder, trained_logits = exported
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    plain = subprocess.run([sys.executable, "-c", LOAD_BASE.format(folder=str(folder))], env=env, capture_output=True,
                           text=True, timeout=300)  # fmt: skip
    assert plain.returncode != 0 and "mismatch" in plain.stderr and ".weight" in plain.stderr, plain.stderr[-2000:]
    quiet = subprocess.run([sys.executable, "-c", "import hf_lowprec\n" + LOAD_BASE.format(folder=str(folder))],
                           env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert quiet.returncode == 0 and "UNEXPECTED" not in quiet.stderr, quiet.stderr[-2000:]

    older = tmp_path / "older"
    shutil.copytree(folder, older)
    weights = load_file(older / "model.safetensors")
    unguarded = {k: v for k, v in weights.items() if not (k.endswith(".weight") and v.dtype == torch.uint8)}
    assert len(weights) - len(unguarded) == 14  # every packed linear but the int8 head: 2 layers x 7
    save_file(unguarded, older / "model.safetensors", metadata={"format": "pt"})
    snippet = "import hf_lowprec\n" + LOAD_BASE.format(folder=str(older))  # the adapters beside it applied too
    torch.testing.assert_close(_run_snippet(snippet, tmp_path), trained_logits, rtol=0, atol=0)


def test_adapters_load_when_peft_is_imported_after_the_model(exported, tmp_path):
    """The notebook order: a packed base without adapters loads first (``from_pretrained`` probes for PEFT with
    ``find_spec`` without importing it), PEFT is imported afterwards; its LoRA dispatch must still know the packed
    layers."""
    folder, trained_logits = exported
    base_only = tmp_path / "base-only"
    shutil.copytree(folder, base_only, ignore=shutil.ignore_patterns("adapter_*"))
    code = (
        "import hf_lowprec\nfrom transformers import AutoModelForCausalLM\n"
        f"base = AutoModelForCausalLM.from_pretrained({str(base_only)!r})\n"
        "import sys\nassert 'peft' not in sys.modules\n"
        f"from peft import PeftModel\nmodel = PeftModel.from_pretrained(base, {str(folder)!r})\n"
    )
    torch.testing.assert_close(_run_snippet(code, tmp_path), trained_logits, rtol=0, atol=1e-5)


def test_a_plan_keeping_layers_dense_reloads_to_the_trained_logits(tmp_path):
    """A plan may keep some Linear layers in bf16; PEFT wraps those in its own LoRA layer, which computes in the
    adapters' dtype and reloads them in fp32 (``autocast_adapter_dtype``). Trained with bf16 adapters there, the
    reloaded model computed other logits (SmolLM2-135M: up to 2.1 apart); they train in fp32, as they reload."""
    base_dir = save_tiny_model(tmp_path / "base" / "tiny")
    plan = {"default": "int4-g64-asym", "layers": {"model.layers.0.self_attn.v_proj": "bf16", "lm_head": "bf16"}}
    model, tokenizer = _adapted_model(base_dir, dtype=torch.bfloat16, plan=plan)
    dense = model.base_model.model.model.layers[0].self_attn.v_proj
    assert type(dense.get_base_layer()) is torch.nn.Linear and dense.lora_A["default"].weight.dtype == torch.float32
    with torch.no_grad():
        trained = model(IDS).logits
    out = export_model(model, tokenizer, tmp_path / "run", _record(), repo_id="me/tiny-int4")
    card = (out / CARD_FILE).read_text()
    snippet = next(s for s in _card_snippets(card) if "AutoModelForCausalLM.from_pretrained" in s)  # adapters applied
    torch.testing.assert_close(_run_snippet(snippet.replace("me/tiny-int4", str(out)), tmp_path), trained,
                               rtol=0, atol=1e-5)  # fmt: skip


def test_adapters_name_their_packed_base_and_the_card_follows_the_embedded_adapter_convention(exported):
    """The adapters go onto the export's packed model, so their config names the export's repo (what transformers'
    ``from_pretrained(repo)`` and ``AutoPeftModelForCausalLM`` load as their base), not the dense checkpoint it was
    packed from nor this machine's cache path. The card's ``base_model`` keeps the checkpoint (the Hub's model tree)
    and its library is hf-lowprec, as for every packed export (``from_pretrained`` loads the model with its adapters
    after ``import hf_lowprec``), not peft: the Hub's peft snippet would put them onto the dense checkpoint. PEFT's
    own card is not written (the folder's card is ours)."""
    import json

    from huggingface_hub import ModelCard

    folder, _ = exported
    adapter_config = json.loads((folder / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == "me/tiny-int4" and not (folder / "adapter").exists()
    card = ModelCard.load(folder / CARD_FILE)
    assert card.data.library_name == "hf-lowprec" and card.data.base_model == BASE_ID and "peft" in card.data.tags
    assert "Framework versions" not in card.content and not list(folder.glob(".*"))  # no PEFT card, no staging left


def test_an_export_does_not_look_the_base_model_up_on_the_hub(tmp_path):
    """PEFT's adapter save looks the base's config up on the Hub to see whether the vocabulary was resized (a network
    call, two warnings offline); hf-lowprec never resizes it, so its exports skip the lookup."""
    import warnings

    model, tokenizer = _adapted_model(save_tiny_model(tmp_path / "base"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export_model(model, tokenizer, tmp_path / "run", _record(), repo_id="me/tiny-int4")
    lookups = [str(w.message) for w in caught if "config file" in str(w.message) or "fetch remote" in str(w.message)]
    assert lookups == [] and (tmp_path / "run" / "adapter_model.safetensors").is_file()


def test_import_registers_without_importing_transformers_or_peft():
    code = (
        "import sys, hf_lowprec\n"
        "assert 'transformers.modeling_utils' not in sys.modules and 'peft' not in sys.modules, 'imported eagerly'\n"
        "from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING\n"
        "import transformers.modeling_utils, peft\n"
        "from peft.tuners.lora.model import LoraModel\n"
        "assert 'hf_lowprec' in AUTO_QUANTIZATION_CONFIG_MAPPING\n"
        "assert LoraModel._create_new_module.hf_lowprec_dispatch\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


class GradientsBeforeStep(TrainerCallback):
    """Keeps a copy of the trainable parameters' gradients before the optimizer step."""

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _gradients_after_one_step(
    method: str, base_dir: Path, tmp_path: Path, batch: int, accumulation: int, padded_labels: str | None = None
) -> dict:
    """``padded_labels``: ``None`` (no padding), ``"tokens"`` (the last 5 positions of rows 1-3 padded, their labels
    the pad tokens) or ``"ignored"`` (the same padding, labels -100 there)."""
    import datasets
    from transformers import Trainer, TrainingArguments, default_data_collator

    from hf_lowprec import ChunkedLossTrainer, LowPrecisionCallback
    from hf_lowprec.checkpoints import load_pretrained

    g = torch.Generator().manual_seed(3)
    rows = torch.randint(3, 300, (4, 16), generator=g)
    columns = {"input_ids": rows.tolist(), "labels": rows.tolist()}
    if padded_labels:
        mask = torch.ones_like(rows)
        mask[1:, 11:] = 0
        pads = rows.masked_fill(mask == 0, 2)
        labels = pads if padded_labels == "tokens" else pads.masked_fill(mask == 0, -100)
        columns = {"input_ids": pads.tolist(), "attention_mask": mask.tolist(), "labels": labels.tolist()}
    data = datasets.Dataset.from_dict(columns)
    args = TrainingArguments(
        output_dir=str(tmp_path / f"{batch}x{accumulation}{padded_labels or ''}"),
        max_steps=1,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        max_grad_norm=0.0,  # no clipping: it would hide a scale error
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    probe = GradientsBeforeStep()
    common = {"args": args, "train_dataset": data, "data_collator": default_data_collator}
    if method == "int4-lora":
        # bf16 GEMMs round differently per batch shape, bf16 gradients once per micro-batch
        model, _ = _adapted_model(base_dir, torch.float32, adapter_dtype="fp32")
        on_dequant_backend(model)  # the int8 backend picks its outlier channels per call, i.e. per batch
        trainer = ChunkedLossTrainer(model=model.train(), activation_storage=None, callbacks=[probe], **common)
    else:
        model, _ = load_pretrained(base_dir)
        callbacks = [LowPrecisionCallback(plan={"default": "fp8-rowwise", "layers": {"lm_head": "bf16"}}), probe]
        trainer = Trainer(model=model, callbacks=callbacks, **common)
    trainer.train()
    return probe.grads


@pytest.mark.parametrize("method", ["int4-lora", "full"])
def test_gradient_accumulation_gives_the_gradients_of_one_large_batch(method, tmp_path):
    base_dir = save_tiny_model(tmp_path / "base")
    large = _gradients_after_one_step(method, base_dir, tmp_path, batch=4, accumulation=1)
    accumulated = _gradients_after_one_step(method, base_dir, tmp_path, batch=1, accumulation=4)
    assert large and large.keys() == accumulated.keys()
    for name, grad in large.items():
        torch.testing.assert_close(accumulated[name], grad, rtol=1e-4, atol=1e-7, msg=name)


def test_padded_positions_are_no_targets_for_the_loss_or_its_count(tmp_path):
    """Pads labelled with their tokens (``labels = input_ids``, as most collators make them) train exactly as pads
    labelled -100: the chunked loss leaves padded positions out, and so must the Trainer's count of targets (it
    divided by a count with the pads in: each batch's gradients shrank by its padding fraction)."""
    base_dir = save_tiny_model(tmp_path / "base")
    tokens = _gradients_after_one_step("int4-lora", base_dir, tmp_path, batch=2, accumulation=2, padded_labels="tokens")
    ignored = _gradients_after_one_step("int4-lora", base_dir, tmp_path, batch=2, accumulation=2, padded_labels="ignored")
    assert tokens and tokens.keys() == ignored.keys()
    for name, grad in ignored.items():
        torch.testing.assert_close(tokens[name], grad, rtol=1e-5, atol=1e-8, msg=name)


def test_telemetry_reaches_the_experiment_trackers(tmp_path):
    import datasets
    from transformers import Trainer, TrainingArguments, default_data_collator

    from conftest import tiny_llama
    from hf_lowprec import LowPrecisionCallback

    rows = torch.randint(3, 256, (16, 16), generator=torch.Generator().manual_seed(4)).tolist()
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=4,
        per_device_train_batch_size=4,
        logging_steps=2,
        report_to=["tensorboard"],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    plan = {"default": "fp8", "layers": {"lm_head": "bf16", "*.mlp.*": "int4-g64"}}
    Trainer(
        model=tiny_llama(),
        args=args,
        train_dataset=datasets.Dataset.from_dict({"input_ids": rows, "labels": rows}),
        data_collator=default_data_collator,
        callbacks=[LowPrecisionCallback(plan=plan)],
    ).train()
    scalars = tensorboard_scalars(tmp_path / "out")
    lowprec = {tag: values for tag, values in scalars.items() if "lowprec/" in tag}
    assert any("loss" in tag for tag in scalars)  # the tracker wrote the Trainer's own values
    assert lowprec and all(len(values) == 2 for values in lowprec.values()), sorted(scalars)  # at steps 2 and 4


LOAD_WITHOUT_HF_LOWPREC = """
import sys
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({folder!r}, dtype=torch.float32)  # PEFT applies the adapters beside it
assert list(model.peft_config) == ["default"], "the adapters were not applied"
assert not any(m.startswith("hf_lowprec") for m in sys.modules), "hf_lowprec was imported"
"""


@pytest.mark.parametrize("fmt", ["int4-g32-asym", "int4-g32", "int4-asym"])
def test_compressed_tensors_export_loads_without_hf_lowprec(fmt, tmp_path):
    """``from_pretrained`` with compressed-tensors (and PEFT for the adapters) gives the trained model's logits; a
    per-row format is its ``channel`` strategy (its export raised a TypeError)."""
    from hf_lowprec.export.compressed_tensors import export_compressed_tensors
    from hf_lowprec.plan import PrecisionPlan

    base_dir = save_tiny_model(tmp_path / "base")
    torch.manual_seed(0)
    plan = PrecisionPlan({"lm_head": "bf16", "*.v_proj": "int8"}, default=fmt)  # int8 layers travel dense
    model, _, _ = load_int4_lora(base_dir, LoraConfig(r=4, target_modules="all-linear"), plan, dtype=torch.float32)
    randomize_adapters(model, std=0.05)
    with torch.no_grad():
        trained = on_dequant_backend(model).eval()(IDS).logits  # the exact reference
    done = export_compressed_tensors(model, tmp_path / "ct", base_model_id=BASE_ID)
    assert done.requantized == {} and done.adapter_rank is None  # nearest rounding, integer zero points: nothing to do
    config = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "pack-quantized"
    weights = config["config_groups"]["group_0"]["weights"]
    assert (weights["strategy"], weights["group_size"]) == (("channel", None) if fmt == "int4-asym" else ("group", 32))
    assert config["ignore"] == ["lm_head", *(f"model.layers.{i}.self_attn.v_proj" for i in range(2))]  # dense
    loaded = _run_snippet(LOAD_WITHOUT_HF_LOWPREC.format(folder=str(tmp_path / "ct")), tmp_path)
    # the same dense weights; LoRA computed by PEFT's own layer instead of ours: fp32 summation order only
    torch.testing.assert_close(loaded, trained, rtol=0, atol=1e-4)
    assert _vllm_weight_files(tmp_path / "ct") == ["model.safetensors"]  # not the adapters' file beside it
    index = json.loads((tmp_path / "ct" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(load_file(tmp_path / "ct" / "model.safetensors"))


def test_a_compressed_tensors_export_lists_packed_int8_layers_as_ignored_and_keeps_the_model_dtype(tmp_path):
    """A packed int8 layer (here the tied output head, as the default plan makes it above 2^27 weights) is written
    dense, so the config lists it in ``ignore``: compressed-tensors' own reader then loads its weight (it read the
    layer as pack-quantized and left it at random); every tensor is in the model's bf16, not in the fp32 of the LoRA
    matrix that came first once the embedding was packed."""
    from compressed_tensors.quantization import QuantizationConfig

    from hf_lowprec.export.compressed_tensors import export_compressed_tensors
    from hf_lowprec.plan import PrecisionPlan

    base_dir = save_tiny_model(tmp_path / "base", tie_word_embeddings=True)
    plan = PrecisionPlan({"lm_head": "int8"}, default="int4-g64-asym")
    model, _, _ = load_int4_lora(base_dir, LoraConfig(r=4, target_modules="all-linear"), plan, dtype=torch.bfloat16)
    export_compressed_tensors(model, tmp_path / "ct", base_model_id=BASE_ID)
    config = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert config["ignore"] == ["lm_head"]
    assert QuantizationConfig.model_validate(config).ignore == ["lm_head"]  # as compressed-tensors reads it
    with safe_open(tmp_path / "ct" / "model.safetensors", "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()} & {"F32", "F16", "BF16"}  # not codes, shapes
    assert dtypes == {"BF16"}, dtypes


def _vllm_weight_files(folder: Path) -> list[str]:
    """The files vLLM's ``DefaultModelLoader`` reads as model weights from a local folder (load format ``auto``):
    every ``*.safetensors``, kept to those ``model.safetensors.index.json`` names when it exists
    (``filter_duplicate_safetensors_files``); vLLM itself needs CUDA, which this machine lacks."""
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    index = folder / "model.safetensors.index.json"
    return [f for f in files if f in json.loads(index.read_text())["weight_map"].values()] if index.is_file() else files


@pytest.mark.parametrize("use_rslora, fmt", [(False, "int4-g32-asym"), (True, "int4-g32-asym"), (False, "int4-asym")])
def test_learned_fractional_zero_points_reach_compressed_tensors_through_the_adapter(use_rslora, fmt, tmp_path):
    """Learned zero points are not integers, which the layout's zero points are: the export stores them rounded
    into 0..15, keeps every code and step, and adds ``(z' - z) x step`` per group to each layer's LoRA pair as extra
    ranks (one rank for all layers, scaling kept); compressed-tensors + PEFT, without hf-lowprec, give the trained
    logits (a per-row format's one group a row too: it raised a TypeError).
    Re-quantizing instead (a layer without an adapter) moves them by far more."""
    from hf_lowprec.export.compressed_tensors import export_compressed_tensors, vllm_serving
    from hf_lowprec.modules import PackedInt4Linear
    from hf_lowprec.plan import PrecisionPlan

    base_dir = save_tiny_model(tmp_path / "base")
    torch.manual_seed(0)
    plan = PrecisionPlan({"lm_head": "bf16"}, default=fmt)
    lora = LoraConfig(r=4, lora_alpha=8, use_rslora=use_rslora, target_modules="all-linear")
    model, _, _ = load_int4_lora(base_dir, lora, plan, dtype=torch.float32)
    randomize_adapters(model, std=0.05)
    packed = {n: m for n, m in model.named_modules() if isinstance(m, PackedInt4Linear)}
    for layer in packed.values():
        (shift,) = layer.learn_steps(steps=False)
        with torch.no_grad():
            shift.uniform_(-0.75, 0.75)  # past half a step too: rounds to the neighbouring integer
    edge = next(iter(packed.values()))  # zero points shifted past four bits' 0..15: stored clamped, the rest carried
    with torch.no_grad():
        edge.zero[:2].copy_(torch.tensor([[15.0], [0.0]]))
        edge.zero_shift[:2].copy_(torch.tensor([[0.75], [-0.75]]))
    with torch.no_grad():
        trained = on_dequant_backend(model).eval()(IDS).logits
    done = export_compressed_tensors(model, tmp_path / "ct", base_model_id=BASE_ID)
    groups = max(-(-m.in_features // (m.spec.group_size or m.in_features)) for m in packed.values())
    assert done.requantized == {} and done.residual_layers == len(packed) == 14 and done.adapter_rank == 4 + groups
    adapter = json.loads((tmp_path / "ct" / "adapter_config.json").read_text())
    scaling = adapter["lora_alpha"] / (adapter["r"] ** 0.5 if use_rslora else adapter["r"])
    assert adapter["r"] == done.adapter_rank and scaling == pytest.approx(8 / (4**0.5 if use_rslora else 4))
    loaded = _run_snippet(LOAD_WITHOUT_HF_LOWPREC.format(folder=str(tmp_path / "ct")), tmp_path)
    # the residuals travel in the adapters' bf16: within 2^-9 of themselves, a fraction of a step
    gap = (loaded - trained).abs().max().item()
    assert gap < 1e-3, gap  # re-quantizing every layer instead: 0.10 (logits up to 0.64)

    requantized = export_compressed_tensors(model.get_base_model(), tmp_path / "ct-base")  # no adapter to carry them
    assert len(requantized.requantized) == 14 and requantized.adapter_rank is None
    # vLLM takes a few --max-lora-rank sizes: the smallest that holds the grown rank, or none past 512
    assert vllm_serving(40).endswith("--max-lora-rank 64") and vllm_serving(64).endswith("--max-lora-rank 64")
    assert vllm_serving(600) == "above vLLM's largest --max-lora-rank (512), so vLLM cannot serve it"


def test_pack_int32_matches_compressed_tensors():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from hf_lowprec.export.compressed_tensors import pack_int32

    codes = torch.randint(-8, 8, (16, 64), generator=torch.Generator().manual_seed(5), dtype=torch.int8)
    assert torch.equal(pack_int32(codes, 4), pack_to_int32(codes, 4))
    assert torch.equal(pack_int32(codes.t().contiguous(), 4).t(), pack_to_int32(codes, 4, packed_dim=0))


def test_imports_print_nothing():
    code = "import hf_lowprec\nfrom hf_lowprec import load_int4_lora, LowPrecisionCallback\nimport hf_lowprec.ondevice\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "" and done.stderr == "", done.stderr[-2000:]


def test_the_on_device_training_path_does_not_import_datasets():
    """datasets (with pandas) costs ~90 MB of resident memory; a process that loads, packs and trains without reading
    data through it must not import it (the Trainer subclass and the data readers load it when used)."""
    code = (
        "import sys\nfrom hf_lowprec.ondevice import load_int4_lora, finetune_int4_lora, chunked_causal_lm_loss\n"
        "import hf_lowprec.training.activations\nprint(sorted(m for m in ('datasets', 'pandas') if m in sys.modules))\n"
        "from hf_lowprec.ondevice import ChunkedLossTrainer\nprint('datasets' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split("\n")[:2] == ["[]", "True"], done.stdout + done.stderr[-2000:]
