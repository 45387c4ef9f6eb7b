"""Checkpoint and export loading: a mistyped local path is named as a missing folder, not as a bad or unreachable
hub repo id."""

import re

import huggingface_hub
import pytest
import torch
from huggingface_hub.errors import LocalEntryNotFoundError
from tiny_assets import HubStandIn, save_tiny_model

from hf_lowprec.checkpoints import check_causal_lm, is_hub_id, load_pretrained, offline_hint, public_name
from hf_lowprec.export import load_exported


@pytest.fixture
def offline_here(tmp_path, monkeypatch):
    """A working folder without 'runs/', the Hub offline and an empty Hub cache: nothing can be fetched."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return tmp_path


def test_is_hub_id_tells_a_repo_id_from_a_local_path():
    assert is_hub_id("gpt2") and is_hub_id("org/model-1.5B") and is_hub_id("runs/typo")
    for path in ("/tmp/run", "./run", "../run", "~/run", "runs/a/b", "a..b", "run/"):
        assert not is_hub_id(path), path


@pytest.fixture
def hub_here(offline_here, monkeypatch):
    """The Hub online, answered by a local stand-in that records every request (404 for every model)."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    with HubStandIn() as hub:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.endpoint)
        yield hub


@pytest.mark.parametrize("path", ["/no/such/export", "./runs/typo", "../typo", "runs/typo/export"])
def test_load_exported_names_a_missing_local_folder_without_asking_the_hub(hub_here, path):
    with pytest.raises(ValueError) as info:
        load_exported(path)
    assert str(info.value) == f"export folder {path!r} does not exist (and is not a hub id such as 'org/model')"
    assert hub_here.requests == []  # before: an HFValidationError about the repo id's format, from the Hub client


def test_load_exported_of_a_file_says_it_is_a_file(offline_here):
    (offline_here / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=r"^'notes\.txt' is a file; pass an exported folder or a Hub repo id$"):
        load_exported("notes.txt")


def test_load_exported_of_a_possible_hub_id_says_no_local_folder_and_why_the_hub_failed(offline_here, monkeypatch):
    with pytest.raises(ValueError) as offline:  # huggingface_hub's own offline error
        load_exported("runs/typo")
    expected = ("cannot load checkpoint 'runs/typo': no local folder 'runs/typo' here, and the Hub could not be "
                "reached: ")
    assert str(offline.value).startswith(expected) and "\n" not in str(offline.value)

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(ValueError) as no_network:
        load_exported("runs/typo")
    assert str(no_network.value).startswith(expected) and "\n" not in str(no_network.value)
    with HubStandIn() as hub:  # a Hub that has no such repository
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.endpoint)
        with pytest.raises(ValueError) as not_found:
            load_exported("runs/typo")
    assert str(not_found.value).startswith("cannot load checkpoint 'runs/typo': no local folder 'runs/typo' here, and ")
    assert "runs/typo" in str(not_found.value).split("here, and ")[1] and "\n" not in str(not_found.value)
    assert hub.requests and all("runs/typo" in r["path"] for r in hub.requests)


def test_load_pretrained_of_a_missing_folder_says_there_is_none_here(offline_here):
    """``hf-lowprec finetune runs/typo``: 'runs/typo' could be a hub id, so it is tried there; the error says first
    that no such local folder exists (it used to give only the Hub's connection error)."""
    with pytest.raises(ValueError) as info:
        load_pretrained("runs/typo")
    message = str(info.value)
    assert message.startswith(
        "cannot load checkpoint 'runs/typo': no local folder 'runs/typo' here, and the Hub could not be reached: "
    )
    assert "\n" not in message
    with pytest.raises(ValueError, match=r"^checkpoint path '\./runs/typo' does not exist \(and is not a hub id"):
        load_pretrained("./runs/typo")


def test_an_unreachable_hub_suggests_offline_mode_unless_it_is_on(monkeypatch):
    """Without a network and without HF_HUB_OFFLINE, huggingface_hub retries each file for ~25 s before failing: the
    error says how to skip that; with offline mode on (or another error) it adds nothing."""
    
    unreachable = LocalEntryNotFoundError("We couldn't connect to 'https://huggingface.co' to load the files")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    assert "set HF_HUB_OFFLINE=1" in offline_hint(unreachable)
    assert "set HF_HUB_OFFLINE=1" in offline_hint(ValueError("Couldn't reach 'wikitext' on the Hub (ConnectionError)"))
    assert offline_hint(ValueError("Repository Not Found")) == ""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert offline_hint(unreachable) == ""


def test_a_local_folder_that_fails_to_load_keeps_the_plain_message(offline_here):
    path = save_tiny_model(offline_here / "runs" / "broken")
    for weights in path.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(ValueError, match=r"^cannot load checkpoint 'runs/broken': ") as info:
        load_pretrained("runs/broken")
    assert "no local folder" not in str(info.value)


def test_a_missing_entry_of_an_existing_local_folder_is_a_local_typo_not_a_hub_id(offline_here, hub_here):
    """``runs/run-fp9`` beside a ``runs/`` folder: refused at once, naming the folder and its close entries, before
    any Hub request (which retries for seconds without a network)."""
    (offline_here / "runs" / "run-fp8").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"^checkpoint path 'runs/run-fp9' does not exist \(the folder 'runs' does; close matches there: run-fp8\)$"):
        load_pretrained("runs/run-fp9")
    with pytest.raises(ValueError, match=r"^export folder 'runs/run-fp9' does not exist \(the folder 'runs' does"):
        load_exported("runs/run-fp9")
    assert hub_here.requests == []


def test_a_gguf_checkpoint_is_named_by_its_file_not_its_cached_copys_dtype(tmp_path, monkeypatch, caplog):
    """A GGUF checkpoint loads from its dequantized copy in the cache, ``gguf/<file stem>-<key>/float32``: scanned
    plans and exported run records named it ``float32``, and a plan made for one GGUF model was applied to another
    without a word (both ``float32``)."""
    from conftest import tiny_llama
    from text_batches import text_batches

    from hf_lowprec.plan import PrecisionPlan
    from hf_lowprec.sensitivity import scan

    monkeypatch.setenv("HF_LOWPREC_CACHE", str(tmp_path / "cache"))
    cached = tmp_path / "cache" / "gguf" / "SmolLM2-135M-Instruct.Q4_1-0123456789abcdef" / "float32"
    cached.mkdir(parents=True)
    assert public_name(str(cached)) == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert public_name(str(tmp_path / "float32")) == "float32" and public_name("org/model") == "org/model"
    (tmp_path / "snapshot-abc").mkdir()
    (tmp_path / "my-llama").symlink_to(tmp_path / "snapshot-abc")  # a link is named by its own name
    assert public_name(str(tmp_path / "my-llama")) == "my-llama"
    model = tiny_llama()
    model.config.name_or_path = str(cached)
    assert scan(model, text_batches(1), formats=["fp8"], method="fisher").model == "SmolLM2-135M-Instruct.Q4_1.gguf"
    caplog.clear()
    PrecisionPlan(default="fp8", model="SmolLM2-135M-Instruct.Q4_1.gguf").validate(model)
    assert caplog.text == ""
    PrecisionPlan(default="fp8", model="Other.Q8_0.gguf").validate(model)
    assert "the plan was made for 'Other.Q8_0.gguf' and is applied to" in caplog.text


@pytest.mark.slow  # the real default checkpoint (24 s)
def test_load_tokenizer_of_a_gguf_file_reads_its_cached_folder():
    """The demo checkpoint's tokenizer, read from the plain folder its GGUF file is cached in (what the CLI loads before
    the model, to check the data first), tokenizes as transformers' own reading of the GGUF file does."""
    from transformers import AutoTokenizer

    from hf_lowprec.checkpoints import cache_gguf, default_checkpoint, load_tokenizer

    folder, gguf = default_checkpoint()
    cached = cache_gguf(folder, gguf, torch.float32)  # made by `make setup` (machine_setup); seconds if it is not
    tokenizer = load_tokenizer(folder, gguf_file=gguf)
    assert tokenizer.name_or_path == str(cached)
    direct = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    text = "To be, or not to be: that is the question.\nWhether 'tis nobler in the mind to suffer"
    assert tokenizer(text)["input_ids"] == direct(text)["input_ids"] and len(tokenizer) == len(direct)


def test_a_checkpoint_is_refused_only_when_it_is_no_causal_lm():
    """Checked from the config before anything loads: a head of another task, a base model whose LM head would be new
    and random, a model type without a causal LM class; what AutoModelForCausalLM loads whole passes (a multimodal
    ``*ForConditionalGeneration`` whose type maps to its causal LM, a base model whose head is its tied embedding)."""
    from transformers import BertConfig, Llama4Config, Qwen2Config, T5Config

    for config in (Qwen2Config(architectures=["Qwen2ForCausalLM"]), Qwen2Config(architectures=None),
                   Qwen2Config(architectures=["Qwen2Model"], tie_word_embeddings=True),
                   Qwen2Config(architectures=["ClassOfRemoteCode"]),
                   Llama4Config(architectures=["Llama4ForConditionalGeneration"])):  # fmt: skip
        check_causal_lm(config, "m")
    for config, said in ((BertConfig(architectures=["BertForSequenceClassification"]), "a model for SequenceClassification"),
                         (Qwen2Config(architectures=["Qwen2Model"], tie_word_embeddings=False), "a base model without an LM head"),
                         (T5Config(architectures=["T5ForConditionalGeneration"]), "(model type 't5'), which has no causal LM class")):  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(said)):
            check_causal_lm(config, "m")
