"""Export, model cards and push: reloads give the same logits, cards parse and validate, the token never leaks."""

import copy
import dataclasses
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import time

import pytest
import torch
import yaml
from cli_invoke import cli, one_error_line, workspace
from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.repocard_data import model_index_to_eval_results
from safetensors import safe_open
from tiny_assets import HubStandIn, save_tiny_model, validate_card_metadata
from transformers import AutoModelForCausalLM

from hf_lowprec import Int4Linear, PackedInt4Linear, apply_plan, freeze, revert
from hf_lowprec.checkpoints import load_pretrained
from hf_lowprec.export import (
    CARD_FILE,
    PLAN_FILE,
    RUN_FILE,
    PushFailed,
    export_model,
    export_run,
    hardware_info,
    load_exported,
    push,
    render_model_card,
)
from hf_lowprec.export.publish import edited_card, push_preview
from hf_lowprec.export.records import CARD_SHA256
from hf_lowprec.folders import atomic_output_dir
from hf_lowprec.modules.kernels.cpu import cpu_info
from hf_lowprec.ondevice.export import NO_ADAPTER_LOOKUP
from hf_lowprec.plan import PrecisionPlan

TOKEN = "hf_standinSECRETtoken1234567890"


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("base") / "tiny")


def _trained(base_dir, fmt: str | PrecisionPlan, steps: int = 3):
    """The tiny model with ``fmt`` on every linear but the head (or with plan ``fmt``), trained a few AdamW steps."""
    model, tok = load_pretrained(base_dir)
    apply_plan(model, fmt if isinstance(fmt, PrecisionPlan) else PrecisionPlan.uniform(fmt, keep=("lm_head",)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval(), tok


def _run_record(**extra):
    return {
        "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct", "recipe": {"name": "qat-int4", "method": "full", "training": {"max_steps": 3}},
        "dataset": "shakespeare", "data_kind": "text", "training": {"steps": 3, "loss_base": 5.1, "loss_final": 4.2, "peak_rss_mb": 512.0},
        "eval": [{"dataset": "shakespeare", "split": "held-out", "metric": "perplexity", "value": 66.7}],
        "hardware": hardware_info(), **extra,
    }  # fmt: skip


IDS = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))


def test_master_export_reloads_with_transformers_and_with_plan_numerics(base_dir, tmp_path):
    model, tok = _trained(base_dir, "fp8")
    out = export_model(model, tok, tmp_path / "fp8", _run_record(), weights="master")
    reference = copy.deepcopy(model)
    revert(reference)
    plain = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        assert torch.equal(plain(IDS).logits, reference(IDS).logits)  # master weights, bit for bit
        again, _ = load_exported(out, apply_plan_numerics=True)
        assert torch.equal(again(IDS).logits, model(IDS).logits)  # the FP8 numerics it trained with
        assert not torch.equal(model(IDS).logits, reference(IDS).logits)
    assert json.loads((out / PLAN_FILE).read_text()) == model.hf_lowprec_plan.to_dict()


@pytest.mark.parametrize("weights, plan", [("master", "fp8"), ("int4-packed", "int4-g32")])
def test_an_exported_classifier_reloads_as_its_own_architecture(tmp_path, weights, plan):
    """A sequence classifier's export reloads as the class its config.json names, its trained head read back: it
    loaded as a causal LM whose head was new random weights (the classifier's dropped)."""
    from conftest import tiny_bert

    model = tiny_bert().eval()
    apply_plan(model, PrecisionPlan.uniform(plan, keep=("classifier",)))
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        trained = model(input_ids=ids).logits
    if weights == "int4-packed":
        freeze(model)  # packed codes: the export holds them as they are
    out = export_model(model, None, tmp_path / weights, {}, weights=weights)
    loaded, _ = load_exported(out, apply_plan_numerics=True, backend="dequant")
    assert type(loaded).__name__ == "BertForSequenceClassification"
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, trained, atol=1e-5)


@pytest.mark.parametrize("scaler", ["delayed", "gradient"])
def test_plan_numerics_reapply_the_training_sessions_scaler_and_compute_as_trained(base_dir, tmp_path, scaler, caplog):
    """A model trained by the callback or plugin with scaler='delayed' (its amax history sets the forward's scales):
    the plan was re-applied with dynamic scales (logits 0.06 off) and a warning blamed apply_plan's arguments. The
    record keeps the session's scaler options and plan numerics use them: the exact trained logits, nothing said."""
    from hf_lowprec.training.accelerate import LowPrecisionPlugin

    model, tok = load_pretrained(base_dir)
    LowPrecisionPlugin({"default": "fp8", "layers": {"lm_head": "bf16", "*.mlp.down_proj": "int4-g64"}}, scaler=scaler,
                       scaler_options={"history_len": 4} if scaler == "delayed" else {}).convert(model)  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(step))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    out = export_model(model, tok, tmp_path / scaler, _run_record(), weights="master")
    assert json.loads((out / RUN_FILE).read_text())["conversion_options"]["scaler"] == scaler
    with caplog.at_level("WARNING", logger="hf_lowprec.export.folder"):
        again, _ = load_exported(out, apply_plan_numerics=True)
    assert "entries the re-applied layers lack" not in caplog.text
    with torch.no_grad():
        assert torch.equal(again(IDS).logits, model(IDS).logits)


def test_plan_numerics_of_a_run_converted_with_other_options_say_they_are_not_the_runs(base_dir, tmp_path, caplog):
    """Learned activation steps (or a delayed scaling's history) have no place in the layers the plan is re-applied
    to with apply_plan's defaults: the numerics differ from the run's, which was logged at INFO only. The telemetry
    counters of the CLI's FP8 layers are no numerics: not exported, nothing said."""
    from hf_lowprec.scaling import make_policy_factory

    model, tok = load_pretrained(base_dir)
    apply_plan(model, PrecisionPlan.uniform("int4-g32-a8", keep=("lm_head",)), learn_activation_scales=True)
    out = export_model(model, tok, tmp_path / "a8", _run_record(), weights="master")
    with caplog.at_level("WARNING", logger="hf_lowprec.export.folder"):
        load_exported(out, apply_plan_numerics=True)
    assert "entries the re-applied layers lack" in caplog.text and "not exactly the run's" in caplog.text
    caplog.clear()
    plain, tok = load_pretrained(base_dir)  # the CLI's layers: the defaults, with telemetry counters
    apply_plan(plain, PrecisionPlan.uniform("fp8", keep=("lm_head",)), policy_factory=make_policy_factory())
    assert any(k.endswith("tele_casts") for k in plain.state_dict())
    with caplog.at_level("WARNING", logger="hf_lowprec.export.folder"):
        load_exported(export_model(plain, tok, tmp_path / "plain", _run_record(), weights="master"), apply_plan_numerics=True)
    assert "entries the re-applied layers lack" not in caplog.text  # nothing left over


def test_qat_int4_export_is_real_packed_int4_and_reloads_the_same_logits(base_dir, tmp_path):
    model, tok = _trained(base_dir, "int4-g64")
    layer = model.model.layers[0].mlp.up_proj
    learned = layer.weight_quantizer.steps(layer.weight)[0].detach().clone()  # the trained LSQ steps, as the quantizer uses them
    calibrated = layer.weight.detach().abs().amax(-1, keepdim=True) / 7
    out = export_model(model, tok, tmp_path / "int4", _run_record(), weights="int4-packed")
    assert isinstance(model.model.layers[0].mlp.up_proj, Int4Linear)  # the in-memory model is left as it was
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        qweight = f.get_tensor("model.layers.0.mlp.up_proj.qweight")
        step = f.get_tensor("model.layers.0.mlp.up_proj.step")
        guard = f.get_tensor("model.layers.0.mlp.up_proj.weight")  # one byte: no dense copy (with_load_guards)
    assert qweight.dtype == torch.uint8 and qweight.shape == (128, 32)  # [out, in/2]: two codes a byte
    assert guard.shape == (1,) and "lm_head.weight" in keys
    assert torch.equal(step, learned.to(step.dtype)) and not torch.allclose(step, calibrated)  # learned, not re-calibrated
    # the dequant backend computes exactly what the codes represent (the int8 backend adds activation
    # rounding and compiles kernels on first use; its numerics are tested with the layer itself)
    loaded, _ = load_exported(out, backend="dequant")
    assert isinstance(loaded.model.layers[1].self_attn.q_proj, PackedInt4Linear)
    frozen = copy.deepcopy(model)
    freeze(frozen)
    via_transformers = AutoModelForCausalLM.from_pretrained(out)  # `import hf_lowprec` registered the quantizer
    for m in list(frozen.modules()) + list(via_transformers.modules()):
        if isinstance(m, PackedInt4Linear):
            m.backend = "dequant"
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, frozen(IDS).logits)  # the same codes as the in-memory freeze
        assert torch.equal(via_transformers(IDS).logits, loaded(IDS).logits)
        # = the QAT model, up to fp32 summation order (the codes dequantize to the fake-quantized weights)
        torch.testing.assert_close(loaded(IDS).logits, model(IDS).logits, rtol=0, atol=1e-5)
    # the steps were learned against an exact forward: reloaded with backend="auto", no layer may pick int8's (its
    # per-token int8 activations moved a 2-step QAT run's SmolLM2-135M loss from 4.060 to 4.091)
    auto = AutoModelForCausalLM.from_pretrained(out)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["exact_kernels"] is True
    assert all(m.exact_kernels for m in auto.modules() if isinstance(m, PackedInt4Linear))
    with torch.no_grad():
        torch.testing.assert_close(auto(IDS).logits, model(IDS).logits, rtol=0, atol=1e-4)
    again = export_model(loaded, tok, tmp_path / "again", _run_record(), weights="int4-packed")  # packed already
    with safe_open(again / "model.safetensors", "pt") as f:
        assert torch.equal(f.get_tensor("model.layers.0.mlp.up_proj.qweight"), qweight)
    with pytest.raises(ValueError, match=r"needs int4 \(or per-channel int8\) layers"):
        export_model(_trained(base_dir, "fp8", 0)[0], tok, tmp_path / "none", _run_record(), weights="int4-packed")


def test_auto_export_packs_the_int4_layers_of_a_mixed_plan_and_writes_master_weights_without_them(base_dir, tmp_path):
    mixed = PrecisionPlan({"lm_head": "bf16", "*.mlp.*": "int4-g64"}, default="fp8")
    model, tok = _trained(base_dir, mixed)
    out = export_model(model, tok, tmp_path / "mixed", _run_record(), weights="auto")
    assert json.loads((out / RUN_FILE).read_text())["export"]["weights"] == "int4-packed"
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert isinstance(loaded.model.layers[0].mlp.up_proj, PackedInt4Linear)
    assert type(loaded.model.layers[0].self_attn.q_proj) is torch.nn.Linear  # FP8 layers: their master weights
    reference = copy.deepcopy(model)
    freeze(reference)  # INT4 layers as trained, as codes ...
    revert(reference)  # ... the FP8 ones back to plain layers
    for m in list(reference.modules()) + list(loaded.modules()):
        if isinstance(m, PackedInt4Linear):
            m.backend = "dequant"
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, reference(IDS).logits)
    fp8, _ = _trained(base_dir, "fp8", 0)
    out = export_model(fp8, tok, tmp_path / "fp8", _run_record(), weights="auto")
    assert json.loads((out / RUN_FILE).read_text())["export"]["weights"] == "master"


def test_model_card_metadata_and_body(base_dir, tmp_path):
    model, tok = _trained(base_dir, "int4-g64", 1)
    out = export_model(model, tok, tmp_path / "card", _run_record(), weights="int4-packed", repo_id="me/tiny-qat")
    card = ModelCard.load(out / CARD_FILE)
    data = card.data
    assert data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct" and data.library_name == "hf-lowprec"
    assert {"hf-lowprec", "int4", "qat"} <= set(data.tags) and data.datasets is None and data.metrics == ["perplexity"]
    results = data.eval_results
    assert results[0].metric_type == "perplexity" and results[0].metric_value == 66.7 and results[0].dataset_name == "shakespeare"
    # the metadata validates: the YAML block parses, the model-index parses back, and ModelCardData accepts every field strictly
    front = yaml.safe_load(card.content.split("---")[1])
    name, parsed = model_index_to_eval_results(front["model-index"])
    assert name == "tiny-qat" and parsed[0].metric_value == 66.7
    ModelCardData(**front, ignore_metadata_errors=False)
    assert validate_card_metadata(card.content) == []
    assert validate_card_metadata(card.content.replace("value: 66.7", "valu: 66.7")) != []  # the check can fail
    body = card.text
    assert "load_exported(\"me/tiny-qat\")" in body and "real packed INT4" in body
    assert re.search(r"\| int4-g64 \| 14 \| 73,728 \| 64\.3% \|", body)  # the plan table with fractions
    assert "`model.layers.1.mlp.down_proj` | int4-g64" in body and "`lm_head` | kept (fp32)" in body  # per-layer list
    assert "name: qat-int4" in body and "peak rss (MiB) | 512" in body and "cpu cores" in body
    cpu = cpu_info()
    assert f"class: {cpu.cpu_class}, flags: {' '.join(cpu.flags)}" in body and "{'" not in body  # not a Python dict
    assert "| shakespeare | perplexity | 66.7 |" in body


def test_fp8_card_says_transformers_loads_it():
    card = render_model_card({**_run_record(), "plan_rows": [{"format": "fp8", "layers": 2, "params": 10, "bytes": 10, "fraction": 1.0}],
                              "export": {"loader": "transformers", "dtype": "float32", "library_name": "transformers"}}, "me/m")  # fmt: skip
    assert card.data.library_name == "transformers" and "fp8" in card.data.tags and "qat" not in card.data.tags
    assert 'AutoModelForCausalLM.from_pretrained("me/m")' in card.text and "emulated FP8" in card.text


def test_atomic_output_dir_refuses_and_never_half_writes(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    with pytest.raises(ValueError, match="holds no config.json or hf_lowprec_run.json, so it is not a model folder"):
        with atomic_output_dir(out, overwrite=True):  # a folder of someone's files: never replaced
            pass
    (out / "config.json").write_text("{}")  # a model folder: overwrite=True may replace it
    with pytest.raises(ValueError, match="already exists; pass overwrite=True to replace it"):
        with atomic_output_dir(out):
            pass
    with pytest.raises(RuntimeError):
        with atomic_output_dir(out, overwrite=True) as tmp:
            (tmp / "new.txt").write_text("half")
            raise RuntimeError("crash mid-export")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (out / "keep.txt").read_text() == "old"
    with atomic_output_dir(out, overwrite=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"] and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_atomic_output_dir_writes_through_a_link_and_an_interrupt_between_renames_loses_nothing(tmp_path, monkeypatch):
    """A link to the output folder (on another disk): the folder it points at is replaced and the link stays (it was
    replaced by a real folder, a dangling .old link left for good). An interrupt right after the old folder was moved
    aside put nothing back: the output folder was gone."""
    import hf_lowprec.folders as folders

    target = tmp_path / "disk" / "out"
    target.mkdir(parents=True)
    (target / "config.json").write_text('{"old": 1}')
    (tmp_path / "link").symlink_to(target)
    for version in (2, 3):
        with atomic_output_dir(tmp_path / "link", overwrite=True) as tmp:
            (tmp / "config.json").write_text(json.dumps({"new": version}))
    assert (tmp_path / "link").is_symlink() and json.loads((target / "config.json").read_text()) == {"new": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk", "link"] and os.listdir(tmp_path / "disk") == ["out"]

    replace = os.replace

    def interrupted_after_the_first(src, dst):
        replace(src, dst)
        if os.path.basename(dst).startswith(".out.old-"):
            raise KeyboardInterrupt

    monkeypatch.setattr(folders.os, "replace", interrupted_after_the_first)
    with pytest.raises(KeyboardInterrupt):
        with atomic_output_dir(target, overwrite=True) as tmp:
            (tmp / "config.json").write_text("{}")
    assert json.loads((target / "config.json").read_text()) == {"new": 3} and os.listdir(tmp_path / "disk") == ["out"]


KILLED_WRITER = """
import sys, time
from pathlib import Path
from hf_lowprec.folders import atomic_output_dir
out = Path(sys.argv[1])
if sys.argv[2] == "writing":
    with atomic_output_dir(out, overwrite=True) as tmp:
        (tmp / "config.json").write_text("{}")
        print("ready", flush=True)
        time.sleep(60)
else:  # killed between replace_dir's two renames: the old folder moved aside, the new one not yet in place
    import os
    os.replace(out, out.with_name(f".{out.name}.old-{os.getpid()}"))
    print("ready", flush=True)
    time.sleep(60)
"""


@pytest.mark.parametrize("moment", ["writing", "between-renames"])
def test_what_a_killed_writer_leaves_is_cleared_by_the_next_one(tmp_path, moment):
    """SIGKILL runs no cleanup: the next writer of the same folder removes the dead one's partial folder, and puts the
    previous folder back where the kill left it moved aside; the live writers' leftovers are not touched."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text('{"old": 1}')
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(out), moment], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "ready"
    writer.kill()
    writer.wait()
    leftover = [p.name for p in tmp_path.iterdir() if p.name != "out"]
    killed = f".out.{writer.pid}-" if moment == "writing" else f".out.old-{writer.pid}"
    assert len(leftover) == 1 and leftover[0].startswith(killed)  # what the kill left
    alive = tmp_path / f".out.{os.getpid()}-live.partial"  # a writer still running (this process)
    alive.mkdir()
    others = [tmp_path / f".out.v2.{writer.pid}-x.partial", tmp_path / f".out.v2.old-{writer.pid}"]  # out.v2's
    for other in others:
        other.mkdir()
        os.utime(other, (time.time() - 7200,) * 2)  # untouched for 2 h: an unnamed leftover of out's would go
    with pytest.raises(ValueError, match="already exists"):  # refused, yet the dead writer's leftovers are cleared
        with atomic_output_dir(out):
            pass
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", alive.name] + [p.name for p in others])
    assert json.loads((out / "config.json").read_text()) == {"old": 1}


def test_export_run_copies_publishable_files_only(base_dir, tmp_path):
    model, tok = _trained(base_dir, "fp8", 1)
    run = export_model(model, tok, tmp_path / "run", _run_record(), extra_files={"log_history.json": "[]", "recipe.yaml": "name: x\n"})
    (run / "checkpoints").mkdir()
    (run / "model.safetensors.incomplete").write_bytes(b"0")  # a stray unfinished write: no file of the model
    out = export_run(run, tmp_path / "pub", repo_id="me/pub")
    strays = ("checkpoints", "log_history.json", "model.safetensors.incomplete")
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in run.iterdir() if p.name not in strays)
    assert 'from_pretrained("me/pub")' in (out / CARD_FILE).read_text()
    with pytest.raises(ValueError, match="not an hf-lowprec run or export folder"):
        export_run(base_dir, tmp_path / "x")
    files = sorted(p.name for p in run.rglob("*"))
    for into in (run, run / "sub", tmp_path):  # itself, inside it, around it: it would replace what it reads
        with pytest.raises(ValueError, match="is the run folder .* itself, inside it or around it"):
            export_run(run, into, overwrite=True, weights_format="bf16")
    assert sorted(p.name for p in run.rglob("*")) == files


def test_push_uploads_every_file_and_never_leaks_the_token(base_dir, tmp_path, monkeypatch, capsys):
    model, tok = _trained(base_dir, "int4-g64", 1)
    out = export_model(model, tok, tmp_path / "pub", _run_record(), weights="int4-packed")
    with HubStandIn() as hub:
        monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", hub.endpoint)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        url = push(out, "me/tiny-int4", private=True)
        pr_url = push(out, "me/tiny-int4", create_pr=True)
    assert url.startswith(hub.endpoint) and pr_url.endswith("/discussions/1") and hub.pull_requests == ["me/tiny-int4"]
    assert hub.pr_files["refs/pr/1"] == hub.files["me/tiny-int4"]
    assert hub.repos["me/tiny-int4"]["visibility"] == "private"
    card = render_model_card(json.loads((out / RUN_FILE).read_text()), "me/tiny-int4").content
    assert hub.validated and hub.validated[-1] == card  # the client sent the card for validation
    local = {p.name: p.read_bytes() for p in out.iterdir()}
    uploaded = hub.files["me/tiny-int4"]
    assert set(uploaded) == set(local) and all(uploaded[n] == local[n] for n in local if n not in (CARD_FILE, RUN_FILE))
    assert uploaded[CARD_FILE] == card.encode() and b'load_exported("me/tiny-int4")' in uploaded[CARD_FILE]
    record = json.loads(uploaded[RUN_FILE])  # the record of the card uploaded, else as it is
    assert record.pop(CARD_SHA256) == hashlib.sha256(card.encode()).hexdigest()
    assert record == {k: v for k, v in json.loads(local[RUN_FILE]).items() if k != CARD_SHA256}
    assert b"me/tiny-int4" not in local[CARD_FILE]  # the card is rendered for the repo in the upload only
    # every repo request carried the token in its header (huggingface_hub also fetches its public
    # /api/agent-harnesses registry, without credentials)
    repo_requests = [r for r in hub.requests if r["path"] != "/api/agent-harnesses"]
    assert len(repo_requests) >= 6
    assert all({k.lower(): v for k, v in r["headers"].items()}.get("authorization") == f"Bearer {TOKEN}" for r in repo_requests)
    captured = capsys.readouterr()
    assert TOKEN not in captured.out + captured.err
    assert not any(TOKEN.encode() in p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())


def test_push_errors_are_one_line_and_token_free(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setattr("huggingface_hub.constants.HF_TOKEN_PATH", str(tmp_path / "hf_home" / "token"))
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "config.json").write_text("{}")  # a model folder
    with pytest.raises(ValueError, match="no Hugging Face token found"):
        push(tmp_path / "f", "me/x")
    with HubStandIn() as hub:
        monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", hub.endpoint)
        with pytest.raises(ValueError) as info:
            push(tmp_path / "f", "bad repo id with spaces", token=TOKEN)
        monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
        with pytest.raises(PushFailed) as unreachable:
            push(tmp_path / "f", "me/x", token=TOKEN)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        from_cli = cli("push", tmp_path / "f", "me/x")
    assert "repo id 'bad repo id with spaces': Repo id must use alphanumeric chars" in str(info.value) and TOKEN not in str(info.value)
    assert "push to 'me/x' failed" in str(unreachable.value) and TOKEN not in str(unreachable.value)
    assert len(str(unreachable.value).splitlines()) == 1
    # the Hub's failure, not bad input: exit 1 (2 is for arguments the CLI refuses), one line, no token
    assert from_cli.exit_code == 1 and "Traceback" not in from_cli.output and TOKEN not in from_cli.output
    assert from_cli.output.count("error:") == 1 and "error: push to 'me/x' failed" in from_cli.output


def test_a_repo_id_without_namespace_goes_under_the_user_and_the_card_names_it_whole(base_dir, tmp_path, monkeypatch):
    """``push(folder, "tiny-int4")`` creates ``<user>/tiny-int4`` (as ``create_repo`` does) and the uploaded card's
    snippets load ``<user>/tiny-int4``: ``from_pretrained("tiny-int4")`` would look for a local folder."""
    model, tok = _trained(base_dir, "int4-g64", 1)
    out = export_model(model, tok, tmp_path / "pub", _run_record(), weights="int4-packed")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_TOKEN_PATH", str(tmp_path / "no-token"))
    with HubStandIn() as hub:
        monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", hub.endpoint)
        url = push(out, "tiny-int4", token=TOKEN)
        preview = cli("push", out, "tiny-int4", "--dry-run")
    full = f"{HubStandIn.user}/tiny-int4"
    assert list(hub.files) == [full] and url.startswith(f"{hub.endpoint}/{full}/commit/")
    card = hub.files[full][CARD_FILE].decode()
    assert card == render_model_card(json.loads((out / RUN_FILE).read_text()), full).content
    assert f'load_exported("{full}")' in card and 'load_exported("tiny-int4")' not in card
    assert preview.exit_code == 0 and "has no namespace: the Hub creates it under the token's user" in preview.output
    shown = preview.output.split(f"{CARD_FILE} as uploaded:")[1]  # the card printed names the id the upload names
    assert 'load_exported("<user>/tiny-int4")' in shown and 'load_exported("tiny-int4")' not in shown


def test_a_failed_push_leaves_the_folder_byte_identical(base_dir, tmp_path, monkeypatch):
    """The card is re-rendered for the repo id in the upload only: an invalid repo id fails before any request, an
    unreachable Hub after, and neither (nor a successful push) touches a byte of the folder."""
    model, tok = _trained(base_dir, "fp8", 1)
    out = export_model(model, tok, tmp_path / "pub", _run_record())
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.rglob("*")}
    with HubStandIn() as hub:
        monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", hub.endpoint)
        with pytest.raises(ValueError, match=r"'bad repo id'.*Repo id must use alphanumeric chars"):
            push(out, "bad repo id", token=TOKEN)
        assert hub.requests == []  # validated before anything was sent
        assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.rglob("*")} == before
        push(out, "me/pub", token=TOKEN)
        monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
        with pytest.raises(PushFailed, match=r"push to 'someone/model' failed"):
            push(out, "someone/model", token=TOKEN)
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.rglob("*")} == before
    assert b'from_pretrained("me/pub")' in hub.files["me/pub"][CARD_FILE]


def test_push_private_refuses_an_existing_public_repo(base_dir, tmp_path, monkeypatch):
    """The Hub keeps an existing repo's visibility (``create_repo(private=True, exist_ok=True)`` ignores ``private``):
    ``--private`` into a public repo is refused before any file goes, and into a private one goes as asked."""
    model, tok = _trained(base_dir, "int4-g64", 1)
    out = export_model(model, tok, tmp_path / "pub", _run_record(), weights="int4-packed")
    with HubStandIn() as hub:
        monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", hub.endpoint)
        push(out, "me/public", token=TOKEN)
        pushed = dict(hub.files["me/public"])
        with pytest.raises(ValueError, match=r"me/public exists and is public: --private does not change"):
            push(out, "me/public", private=True, token=TOKEN)
        push(out, "me/secret", private=True, token=TOKEN)
        push(out, "me/secret", private=True, token=TOKEN)  # existing and private: goes
    assert hub.files["me/public"] == pushed and set(hub.files["me/secret"]) == set(pushed)


def test_push_keeps_an_edited_card_and_leaves_hidden_and_unfinished_files_local(base_dir, tmp_path, monkeypatch):
    """A card edited since the export (a license added, notes) is uploaded as it is, not re-rendered over; hidden
    files and folders and unfinished writes stay local; an unedited card is still rendered for the repo."""
    model, tok = _trained(base_dir, "int4-g64", 1)
    out = export_model(model, tok, tmp_path / "pub", _run_record(), weights="int4-packed")
    (out / ".DS_Store").write_bytes(b"\0")
    (out / ".ipynb_checkpoints").mkdir()
    (out / ".ipynb_checkpoints" / "README-checkpoint.md").write_text("old")
    (out / "model.safetensors.tmp").write_bytes(b"partial")
    (out / "model.safetensors.incomplete").write_bytes(b"partial")  # huggingface_hub's unfinished download
    (out / "sub.incomplete").mkdir()  # an interrupted run's folder
    (out / "sub.incomplete" / "x.bin").write_bytes(b"0")
    with HubStandIn() as hub:
        monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", hub.endpoint)
        push(out, "me/rendered", token=TOKEN)
        edited = (out / CARD_FILE).read_text().replace("---\n", "---\nlicense: apache-2.0\n", 1) + "\nMy own notes.\n"
        (out / CARD_FILE).write_text(edited)
        push(out, "me/edited", token=TOKEN)
        preview = cli("push", out, "me/edited", "--dry-run")
    local = {p.name for p in out.iterdir() if p.is_file()} - {".DS_Store", "model.safetensors.tmp", "model.safetensors.incomplete"}
    assert set(hub.files["me/rendered"]) == set(hub.files["me/edited"]) == local
    assert b'load_exported("me/rendered")' in hub.files["me/rendered"][CARD_FILE]
    assert hub.files["me/edited"][CARD_FILE] == edited.encode()
    assert ModelCard(edited).data.license == "apache-2.0"
    assert preview.exit_code == 0 and "README.md was edited since the export: uploaded as it is" in preview.output


def test_a_push_replaces_the_repos_model_files_and_a_downloaded_repo_pushes_as_unedited(base_dir, tmp_path, monkeypatch):
    """An earlier push's model files the folder does not hold are deleted (its adapters stayed and were applied to the
    next push's merged model); other files of the repo stay. A download of the repo, pushed to another, is rendered
    for that one (its record named the card of the folder pushed, so the uploaded card counted as edited and went
    naming the first repo). A folder lacking a tokenizer file its record lists is refused (its card's snippet
    failed)."""
    model, tok = _trained(base_dir, "int4-g64", 1)
    out = export_model(model, tok, tmp_path / "pub", _run_record(), weights="int4-packed")
    stale = {"adapter_config.json": b"{}", "adapter_model.safetensors": b"0", "model-00001-of-00002.safetensors": b"0",
             "finetune_metrics.json": b"{}"}  # fmt: skip
    with HubStandIn() as hub:
        monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", hub.endpoint)
        push(out, "me/m", token=TOKEN)
        others = {"LICENSE": b"mine", "eval_results.json": b"{}", "onnx/config.json": b"{}", "extra/model.gguf": b"0"}
        hub.files["me/m"].update({**stale, "runs/old/events": b"0", **others})
        push(out, "me/m", token=TOKEN, create_pr=True)  # deleted from the pull request, main as it was
        assert set(stale) | {"runs/old/events"} <= set(hub.files["me/m"])
        assert set(hub.pr_files["refs/pr/1"]) == {p.name for p in out.iterdir()} | set(others)
        push(out, "me/m", token=TOKEN)
        assert set(hub.files["me/m"]) == {p.name for p in out.iterdir()} | set(others)
        downloaded = tmp_path / "downloaded"
        downloaded.mkdir()
        for name, data in hub.files["me/m"].items():
            (downloaded / name).parent.mkdir(parents=True, exist_ok=True)
            (downloaded / name).write_bytes(data)
        assert not edited_card(downloaded)
        push(downloaded, "me/fork", token=TOKEN)
        assert b'load_exported("me/fork")' in hub.files["me/fork"][CARD_FILE] and b"me/m" not in hub.files["me/fork"][CARD_FILE]
    assert "tokenizer.json" in json.loads((out / RUN_FILE).read_text())["tokenizer_files"]
    (out / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=r"lacks tokenizer\.json, which its run record says it holds"):
        push_preview(out, "me/m")


def test_the_cards_training_losses_show_the_differences_the_evaluation_table_shows():
    """Losses to 4 decimals: to 4 figures the base, start and final losses 10.7752, 10.7751 and 10.7750 read 10.78,
    10.78, 10.77; other figures keep 4 figures."""
    layers = [{"name": "model.layers.0.mlp.up_proj", "format": "fp8", "params": 10}]
    rows = [{"format": "fp8", "layers": 1, "params": 10, "fraction": 1.0, "bytes": 10}]
    training = {"loss_base": 10.7752, "loss_start": 10.7751, "loss_final": 10.775, "tokens_per_second": 1234.567}
    card = render_model_card({"layers": layers, "plan_rows": rows, "name": "run", "training": training}).content
    assert all(f"| {figure} |" in card for figure in ("10.7752", "10.7751", "10.7750", "1235")), card


def test_a_card_without_recorded_hardware_claims_no_emulation_and_shows_no_empty_sections(tmp_path):
    """``export_model(..., run={})`` (the README's Python example) records no hardware: the card says nothing of
    FP8 emulation it does not know, and leaves out the Hardware and Recipe sections instead of empty ones; the eval
    command quotes a folder name with a space."""
    layers = [{"name": "model.layers.0.mlp.up_proj", "format": "fp8", "params": 10}]
    rows = [{"format": "fp8", "layers": 1, "params": 10, "fraction": 1.0, "bytes": 10}]
    unknown = render_model_card({"layers": layers, "plan_rows": rows, "name": "demo run"}).content
    assert "emulated" not in unknown and "## Hardware" not in unknown and "<summary>Recipe</summary>" not in unknown
    known = render_model_card({
        "layers": layers, "plan_rows": rows, "hardware": {"cpu": "x", "fp8_tensor_cores": False},
        "recipe": {"name": "fp8-train", "method": "full", "lora": {"r": 16}}, "export_changes": ["x"], "name": "demo run",
        "eval": [{"dataset": "d", "metric": "loss", "value": 1.0}],
    }).content  # fmt: skip
    assert "ran emulated FP8 numerics" in known and "## Hardware" in known and "<summary>Recipe</summary>" in known
    assert "method: full" in known and "lora:" not in known  # a full recipe's record holds LoRA defaults it never used
    assert "the same FP8 rounding, slower steps (FP8 tensor cores sum the products in their own order: not bit-identical)" in " ".join(known.split())  # it said "same numbers"
    assert "hf-lowprec eval 'path/to/demo run'" in known
    diverged = [{"dataset": "d", "metric": "loss", "value": float("nan")}, {"dataset": "d", "metric": "perplexity",
                                                                           "value": 9.5}]  # fmt: skip
    card = render_model_card({"layers": layers, "plan_rows": rows, "name": "run", "eval": diverged})
    front = yaml.safe_load(card.content.split("---")[1])
    assert [m["type"] for m in front["model-index"][0]["results"][0]["metrics"]] == ["perplexity"]  # no .nan value


def test_a_corrupt_run_record_is_named_in_one_line(base_dir, tmp_path):
    model, tok = _trained(base_dir, "int4-g64", 1)
    out = export_model(model, tok, tmp_path / "pub", _run_record(), weights="int4-packed")
    (out / RUN_FILE).write_text((out / RUN_FILE).read_text()[:100])
    for args in (("push", out, "me/x", "--dry-run"), ("export", out, "--out", tmp_path / "again")):
        line = one_error_line(cli(*args))
        assert f"{out / RUN_FILE}' is not a valid run record" in line and "export the run again" in line
    (out / RUN_FILE).write_text("[]")  # JSON, not a record (it failed on an AttributeError)
    assert "is not a valid run record (a JSON object expected)" in one_error_line(cli("push", out, "me/x", "--dry-run"))


@pytest.mark.parametrize("curve", ["../outside.png", "/tmp/outside.png"])
def test_a_run_records_file_names_never_leave_its_folder(base_dir, tmp_path, curve):
    """A record's loss_curve names a file of the run, which an export copies: one naming a path outside (edited, or
    written by something else) was read from there and written over a file outside the output folder."""
    model, tok = _trained(base_dir, "int4-g64", 1)
    out = export_model(model, tok, tmp_path / "pub" / "run", _run_record(), weights="int4-packed")
    record = json.loads((out / RUN_FILE).read_text())
    (out / RUN_FILE).write_text(json.dumps({**record, "loss_curve": curve}))
    line = one_error_line(cli("export", out, "--out", tmp_path / "pub" / "exp", "--format", "bf16"))
    assert f"file name {curve!r} of a run record leaves its folder" in line
    assert not (tmp_path / "pub" / "exp").exists()


def test_push_refuses_a_folder_that_is_not_an_export(tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text('{"text": "hello"}\n')
    with HubStandIn() as hub:
        monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", hub.endpoint)
        with pytest.raises(ValueError, match=r"'.*data' is not an hf-lowprec run or export folder \(no hf_lowprec_run\.json or config\.json\)"):
            push(data, "me/data", token=TOKEN)
    assert hub.requests == [] and hub.files == {}


def test_push_dry_run_shows_the_files_and_card_without_a_token_or_a_request(base_dir, tmp_path, monkeypatch):
    model, tok = _trained(base_dir, "int4-g64", 1)
    out = export_model(model, tok, tmp_path / "pub", _run_record(), weights="int4-packed")
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.rglob("*")}
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_TOKEN_PATH", str(tmp_path / "no-token"))
    with HubStandIn() as hub:
        monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", hub.endpoint)
        result = cli("push", out, "me/tiny-int4", "--dry-run")
        refused = cli("push", out, "bad repo id", "--dry-run")
        bracketed = cli("push", tmp_path / "out[/v2]", "me/x", "--dry-run")  # rich markup, not text, failed on it
    assert result.exit_code == 0, result.output
    assert bracketed.exit_code == 2 and "Traceback" not in bracketed.output
    assert f"'{tmp_path / 'out[/v2]'}' is not a folder to push" in bracketed.output
    shown = " ".join(result.output.split())
    assert all(f"{p.name} │ {p.stat().st_size:,} bytes" in shown for p in out.iterdir() if p.name != CARD_FILE)
    card = render_model_card(json.loads((out / RUN_FILE).read_text()), "me/tiny-int4").content
    assert " ".join(card.split()) in shown and 'load_exported("me/tiny-int4")' in shown
    assert refused.exit_code != 0 and "Repo id must use alphanumeric chars" in refused.output
    assert hub.requests == [] and {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.rglob("*")} == before


def test_the_record_and_card_name_the_format_a_layer_runs_not_the_one_it_could_not():
    """``fp8-rht`` on layers whose width no rotation block divides runs plain ``fp8`` (the log says so): the per-layer
    record, the plan rows and the card say ``fp8``, with the planned format beside it."""
    from conftest import tiny_llama

    from hf_lowprec.export.records import plan_record

    model = tiny_llama(hidden_size=64, intermediate_size=100)  # down_proj: 100 input features, no rotation block
    plan = PrecisionPlan({"lm_head": "bf16"}, default="fp8-rht")
    report = apply_plan(model, plan)
    fallen = {r.name for r in report.not_applied}
    assert fallen == {f"model.layers.{i}.mlp.down_proj" for i in range(2)}
    layers, rows = plan_record(model, plan)
    by_name = {r["name"]: r for r in layers}
    assert all(by_name[n]["format"] == "fp8" and by_name[n]["planned"] == "fp8-rht" for n in fallen)
    assert by_name["model.layers.0.mlp.up_proj"]["format"] == "fp8-rht" and "planned" not in by_name["model.layers.0.mlp.up_proj"]
    assert {r["format"]: r["layers"] for r in rows} == {"fp8-rht": 12, "fp8": 2, "bf16": 2}
    card = render_model_card({"layers": layers, "plan_rows": rows}).content
    assert "| `model.layers.0.mlp.down_proj` | fp8 (planned fp8-rht: could not run it) |" in card


@pytest.mark.parametrize("apply_plan_numerics", [False, True])
@pytest.mark.parametrize("embedding, rule", [("bf16", "model.embed_tokens"), ("int4-g64", "model.embed_tokens"),
                                             ("int4-g64", "*embed_tokens")])  # fmt: skip
def test_a_packed_head_tied_to_its_embedding_reloads_computing_as_trained(tmp_path, embedding, rule, apply_plan_numerics):
    """A tied model trained with a fake-quantized INT4 head, its embedding kept dense or INT4 too (one weight, read
    both ways). Kept dense, the int4-packed folder holds the head's codes and the embedding's table: the reload made the
    embedding read the head's INT4 rows (logits 0.09 off); it loads the table, untied. INT4 too, the folder held a dense
    table no layer reads, and re-applying the plan refused the embedding that reads the head's codes (by its name or
    a pattern)."""
    plan = PrecisionPlan({rule: embedding}, default="int4-g64")
    model, tok = _trained(save_tiny_model(tmp_path / "tied", tie_word_embeddings=True), plan)
    assert isinstance(model.lm_head, Int4Linear)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        trained = model(input_ids=ids).logits
    out = export_model(model, tok, tmp_path / "packed", _run_record(), weights="int4-packed")
    with safe_open(out / "model.safetensors", "pt") as f:
        assert ("model.embed_tokens.weight" in f.keys()) == (embedding == "bf16")
    again, _ = load_exported(out, dtype=torch.float32, apply_plan_numerics=apply_plan_numerics)
    kind = "Embedding" if embedding == "bf16" else "TiedPackedEmbedding"
    assert type(again.model.embed_tokens).__name__ == kind and isinstance(again.lm_head, PackedInt4Linear)
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, trained, rtol=0, atol=1e-5)


def test_the_per_layer_record_counts_a_tied_head_once():
    """A head tied to the embedding has no parameters of its own: its row says so, and the rows add up to the model's
    eligible parameters, as the plan summary counts them (the card's per-layer table reads these rows)."""
    from conftest import tiny_llama

    from hf_lowprec.export.records import plan_record

    model = tiny_llama(tie=True)
    plan = PrecisionPlan({"lm_head": "bf16", "model.embed_tokens": "bf16"}, default="fp8")
    apply_plan(model, plan)
    layers, rows = plan_record(model, plan)
    head = next(r for r in layers if r["name"] == "lm_head")
    assert head["params"] == 0 and head["tied_to"] == "model.embed_tokens"
    assert sum(r["params"] for r in layers) == sum(r["params"] for r in rows)
    card = render_model_card({"layers": layers, "plan_rows": rows}).content
    assert "| `lm_head` | kept (fp32) | tied to `model.embed_tokens` |" in card  # as the plan summary says


def test_an_export_of_an_empty_record_names_its_base_by_name_only_and_reloads_quietly(base_dir, tmp_path, caplog):
    """``export_model(model, tok, out, {})``, the README's Trainer snippet: the card starts from the checkpoint folder's
    name (never this machine's path, which ``push`` would publish) and names no empty recipe; a scan's plan records
    the folder's name too; the export's own plan re-applies without a note that it was made for another model."""
    from hf_lowprec import sensitivity

    model, tok = load_pretrained(base_dir)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    result = sensitivity.scan(model, [{"input_ids": ids, "labels": ids}], formats=("fp8",))
    assert result.model == base_dir.name  # was the full path, then written into the plan file of every export
    planned = dataclasses.replace(PrecisionPlan.uniform("fp8", keep=("lm_head",)), model=result.model)
    model, tok = _trained(base_dir, planned)
    out = export_model(model, tok, tmp_path / "exported", {})
    ours = {name: (out / name).read_text() for name in ("README.md", "hf_lowprec_run.json", PLAN_FILE)}
    assert not [name for name, text in ours.items() if str(base_dir.parent) in text]
    card = ours["README.md"]
    assert f"starting from the local checkpoint `{base_dir.name}`" in card
    assert "``" not in card.split("## How to load")[0]  # no empty recipe name
    with caplog.at_level("WARNING"):
        load_exported(out, apply_plan_numerics=True)
    assert "made for" not in caplog.text


FAST = ["--block-size", "32", "--batch-size", "2", "--eval-blocks", "4", "--dtype", "fp32", "--save-steps", "1000"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A workspace with three `hf-lowprec finetune` runs of the tiny model on ``corpus.txt``: ``lora``
    (int4-ondevice-lora, its learned zero points not integers), ``rotated`` (the same on a Hadamard-rotated plan) and
    ``full`` (fp8-train, fp32 master weights)."""
    ws = workspace(tmp_path_factory.mktemp("runs"), 20_000)
    lora = ["--recipe", "int4-ondevice-lora", "--lr", "1e-2", "--plan"]
    recipes = {"lora": [*lora, "int4-g64-asym"], "rotated": [*lora, "int4-g32-asym-rht"]}
    recipes["full"] = ["--recipe", "fp8-train"]
    for name, recipe in recipes.items():
        result = cli("finetune", ws / "tiny", "--data", ws / "corpus.txt", *recipe, "--max-steps", "2", *FAST, "-o", ws / name)
        assert result.exit_code == 0, result.output
    return ws


def test_the_packed_layer_count_includes_packed_embeddings(tmp_path):
    """An INT4 (or int8) input embedding is a packed layer as the plan lists it: the weights line counted linears
    alone (14 of a plan's 15 INT4 layers)."""
    from peft import LoraConfig

    from hf_lowprec import load_int4_lora
    from hf_lowprec.export.folder import _packed_layers

    plan = PrecisionPlan({"model.embed_tokens": "int8", "lm_head": "bf16"}, default="int4-g64")
    model, _, report = load_int4_lora(str(save_tiny_model(tmp_path / "tiny")), LoraConfig(r=4, target_modules="all-linear"), plan=plan, dtype=torch.float32)
    applied = [r.applied for r in report.layers]
    assert _packed_layers(model) == f"{applied.count('int4-g64')} layers as packed INT4 codes (two per byte), 1 as int8 codes"


def test_a_compressed_tensors_export_counts_an_int4_embedding_as_the_dense_table_it_writes(runs, tmp_path):
    """The layout packs no embedding: an INT4 input embedding goes in as its dense table, while the weights line (the
    card's, the export table's) counted it among the packed INT4 layers (15 of the 14 the file holds)."""
    base = save_tiny_model(tmp_path / "untied", tie_word_embeddings=False)
    plan = PrecisionPlan({"model.embed_tokens": "int4-g64", "lm_head": "bf16"}, default="int4-g64").save(tmp_path / "p.json")
    run = cli("finetune", base, "--data", runs / "corpus.txt", "--recipe", "qat-int4", "--plan", plan, "--max-steps", "1",
              *FAST, "-o", tmp_path / "run")  # fmt: skip
    assert run.exit_code == 0, run.output
    assert cli("export", tmp_path / "run", "--out", tmp_path / "ct", "--format", "compressed-tensors").exit_code == 0
    with safe_open(tmp_path / "ct" / "model.safetensors", "pt") as f:
        packed = sum(k.endswith(".weight_packed") for k in f.keys())
        assert "model.embed_tokens.weight" in f.keys()
    weights = json.loads((tmp_path / "ct" / RUN_FILE).read_text())["export"]["description"]
    assert weights.startswith(f"{packed} layers as packed INT4 codes (two per byte); the INT4 input embedding as a "
                              "dense table (the layout packs no embedding)"), weights  # fmt: skip
    assert packed == 14


def test_eval_of_the_runs_own_data_without_held_out_says_it_scores_the_trained_rows_too(runs, monkeypatch):
    """`eval <run> --data <the data it trained on>` scores every row, the trained ones too, without a word (the
    figure below the run's); it says so and names --held-out. Other data: nothing said."""
    monkeypatch.chdir(runs)
    whole = cli("eval", runs / "lora", "--data", "corpus.txt", "--max-sequences", "2")
    assert whole.exit_code == 0, whole.output
    said = " ".join(whole.output.split())
    assert "is the data" in said and "trained on: all of its rows are evaluated, the trained ones too; --held-out" in said
    (runs / "other.txt").write_text((runs / "corpus.txt").read_text()[:5000])
    other = cli("eval", runs / "lora", "--data", "other.txt", "--max-sequences", "2")
    assert other.exit_code == 0 and "trained on: all of its rows" not in " ".join(other.output.split())


def _evaluation(card: str) -> str:
    return card.split("## Evaluation")[1].split("## Hardware")[0]


def _measure_as_the_card_says(card: str, folder, ws, monkeypatch) -> float:
    """The held-out perplexity the card's ``hf-lowprec eval`` command prints for ``folder`` (the card's placeholder path
    replaced by it), run where the run's data lies."""
    command = re.search(r"^hf-lowprec eval (\S+) (.*)$", _evaluation(card), flags=re.M)
    assert command and command[1].startswith("path/to/"), _evaluation(card)
    monkeypatch.chdir(ws)
    result = cli("eval", folder, *command[2].split())
    assert result.exit_code == 0, result.output
    return float(re.search(r"perplexity\s*│\s*([0-9.]+)", result.output)[1])


def test_a_compressed_tensors_export_carries_learned_zero_points_in_the_adapter(runs, tmp_path, monkeypatch, caplog):
    """Learned zero points are not integers, the layout's are: the adapter carries what rounding them leaves, so
    nothing is re-rounded, the card's figures are this export's (measured by its own command) and the weights line
    gives the adapter's rank and the vLLM option it needs."""
    out = tmp_path / "ct"
    result = cli("export", runs / "lora", "--out", out, "--format", "compressed-tensors")
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())  # no repo id: the adapters name no base until push writes it
    assert "hub │ `hf-lowprec push" in said and "names the repo as the adapters' base" in said
    named = cli("export", runs / "lora", "--out", tmp_path / "named", "--format", "compressed-tensors",
                "--repo-id", "me/x")  # fmt: skip
    assert named.exit_code == 0 and "hub │" not in " ".join(named.output.split())
    assert json.loads((tmp_path / "named" / "adapter_config.json").read_text())["base_model_name_or_path"] == "me/x"
    native = cli("export", runs / "lora", "--out", tmp_path / "native", "--repo-id", "me/y")  # the run's files copied
    assert native.exit_code == 0 and "hub │" not in " ".join(native.output.split())
    native_config = json.loads((tmp_path / "native" / "adapter_config.json").read_text())
    assert native_config["base_model_name_or_path"] == "me/y"
    assert native_config["task_type"] == "CAUSAL_LM"  # it was null: a plain PeftModel, no pipeline tag for the Hub
    record = json.loads((out / RUN_FILE).read_text())
    rank = json.loads((out / "adapter_config.json").read_text())["r"]
    assert record["export"]["requantized_layers"] == {} and "export_changes" not in record
    assert not [r for r in caplog.records if r.levelname == "WARNING" and "compressed-tensors" in r.getMessage()]
    weights = record["export"]["description"]  # the card's and the export table's weights line
    assert f"rank {rank}: the run's rank 16 plus the fractional part of 14 layers' learned zero points" in weights
    assert rank == 18 and "vLLM serves it with --max-lora-rank 32" in weights  # the smallest size vLLM takes that fits
    # the adapters' base is this folder's packed model: unnamed here, the pushed repo's id once pushed (what
    # AutoPeftModelForCausalLM loads; the dense checkpoint would be the wrong base)
    local = json.loads((out / "adapter_config.json").read_text())
    assert local["task_type"] == "CAUSAL_LM"
    with HubStandIn() as hub:
        monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", hub.endpoint)
        push(out, "tiny-ct", token=TOKEN)
    uploaded = json.loads(hub.files["me/tiny-ct"]["adapter_config.json"])
    assert local["base_model_name_or_path"] is None and uploaded == {**local, "base_model_name_or_path": "me/tiny-ct"}
    preview = " ".join(cli("push", out, "me/tiny-ct", "--dry-run").output.split())  # what is uploaded, as uploaded
    assert f"adapter_config.json │ {len(hub.files['me/tiny-ct']['adapter_config.json']):,} bytes" in preview
    assert "adapter_config.json as uploaded names me/tiny-ct as the adapters' base" in preview
    card = (out / CARD_FILE).read_text()
    assert "as trained" not in _evaluation(card) and "re-rounded" not in card
    assert ModelCard.load(out / CARD_FILE).data.library_name == "transformers"  # the Hub's snippet loads it whole
    trained = [r["value"] for r in record["eval"] if r["metric"] == "perplexity"][0]
    monkeypatch.chdir(runs)
    measured = cli("eval", out, "--data", "corpus.txt", "--held-out")  # compressed-tensors and PEFT compute it
    assert measured.exit_code == 0, measured.output
    assert float(re.search(r"perplexity\s*│\s*([0-9.]+)", measured.output)[1]) == pytest.approx(trained, rel=1e-5)


def test_a_compressed_tensors_export_that_re_rounds_says_so_in_the_log_and_the_card(runs, tmp_path, monkeypatch, caplog):
    """A Hadamard-rotated plan is not the layout's grid: it re-rounds every INT4 layer. The export warns with how many
    and their error; the card keeps the run's figures, labeled as the trained model's, says what changed and gives the
    command that measures this export; the weights line names the adapters."""
    out = tmp_path / "ct"
    result = cli("export", runs / "rotated", "--out", out, "--format", "compressed-tensors")
    assert result.exit_code == 0, result.output
    record = json.loads((out / RUN_FILE).read_text())
    errors = record["export"]["requantized_layers"].values()
    median, worst = f"{100 * statistics.median(errors):.3g}%", f"{100 * max(errors):.3g}%"
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "compressed-tensors export" in r.getMessage()]
    assert len(warned) == 1 and "14 of 14 INT4 layers re-rounded" in warned[0] and f"median {median}, max {worst}" in warned[0]
    said = " ".join(result.output.split())
    assert re.search(r"weights │ 14 layers as packed INT4 codes .*LoRA adapters beside the weights \(PEFT format\)", said)
    card = (out / CARD_FILE).read_text()
    evaluation = " ".join(_evaluation(card).split())
    assert "14 of 14 INT4 layers re-rounded" in evaluation and f"relative weight error median {median}, max {worst}" in evaluation
    assert "not this export's" in evaluation
    rows = [line for line in _evaluation(card).splitlines() if line.startswith("| corpus.txt |")]
    assert len(rows) == 2 and all("| the model as trained, before export: " in row for row in rows)
    assert "hf-lowprec eval path/to/rotated --data corpus.txt --held-out" in card
    assert all("as trained" in r.metric_name for r in ModelCard(card).data.eval_results)
    trained = [r["value"] for r in record["eval"] if r["metric"] == "perplexity"][0]
    assert abs(_measure_as_the_card_says(card, out, runs, monkeypatch) - trained) > 1e-3  # the figure is not this export's


def test_the_compressed_tensors_card_loads_the_trained_model_first(runs, tmp_path):
    """Its first snippet is transformers' ``from_pretrained``, which applies the trained adapters stored beside the
    weights (what hf-lowprec loads); without PEFT it is the base without them, as one sentence says; no text says
    the adapters go onto a packed base."""
    out = export_run(runs / "lora", tmp_path / "ct", weights_format="compressed-tensors", repo_id="me/tiny-ct")
    card = (out / CARD_FILE).read_text()
    how = card.split("## How to load")[1].split("## Precision plan")[0]
    first = re.findall(r"```python\n(.*?)```", how, flags=re.S)[0]
    assert "AutoModelForCausalLM.from_pretrained" in first and "PeftModel" not in first and "packed base" not in how
    assert "Without `peft` installed, `from_pretrained` gives the base without the fine-tuning" in " ".join(how.split())
    namespace = {}
    exec(first.replace("me/tiny-ct", str(out)), namespace)
    trained = load_exported(out)[0]
    base = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, adapter_kwargs=NO_ADAPTER_LOOKUP)
    with torch.no_grad():
        assert torch.equal(namespace["model"](IDS).logits, trained(IDS).logits)
        assert not torch.allclose(base(IDS).logits, trained(IDS).logits, atol=1e-3)


def test_a_merge_into_the_int4_codes_or_bf16_is_said_on_the_card_a_merge_into_fp32_is_not(runs, tmp_path):
    merged = export_run(runs / "lora", tmp_path / "merged", merge=True, repo_id="me/tiny-merged")
    card = (merged / CARD_FILE).read_text()
    evaluation = " ".join(_evaluation(card).split())
    m = json.loads((merged / RUN_FILE).read_text())["merge"]
    assert "adapters merged into the INT4 codes: re-quantized" in evaluation and "not this export's" in evaluation
    assert f"{m['layers']} layers, relative weight error median {100 * m['rel_error_median']:.3g}%" in evaluation
    assert "hf download me/tiny-merged --local-dir tiny-merged\nhf-lowprec eval tiny-merged --data corpus.txt --held-out" in card
    bf16 = export_run(runs / "lora", tmp_path / "bf16", weights_format="bf16")
    assert "adapters merged into a dense bf16 model: weights cast to bf16" in " ".join(_evaluation((bf16 / CARD_FILE).read_text()).split())
    dense = export_run(runs / "lora", tmp_path / "fp32", merge=True, merged_dtype="fp32")
    evaluation = _evaluation((dense / CARD_FILE).read_text())
    assert "not this export's" not in evaluation and "as trained" not in evaluation


def test_a_bf16_export_of_fp32_master_weights_labels_the_figures_as_the_runs(runs, tmp_path, monkeypatch):
    """The run measured its fp32 master weights; the bf16 folder holds them rounded: the card no longer calls them the
    exported weights, says they were cast, and how to measure the bf16 ones; a copy of that export says it too."""
    out = export_run(runs / "full", tmp_path / "bf16", weights_format="bf16")
    card = (out / CARD_FILE).read_text()
    evaluation = " ".join(_evaluation(card).split())
    assert "exported master weights" not in card and "the run's master weights in fp32 without the plan" in evaluation
    assert "weights cast from float32 to bf16" in evaluation and "exported weights" not in card
    assert re.search(r"^\| perplexity run's master weights \| [0-9.]+ \|$", card, flags=re.M) and "not this export's" in evaluation
    assert "hf-lowprec eval path/to/full --data corpus.txt --held-out\n" in card  # no --plan-numerics: a dense model
    record = json.loads((out / RUN_FILE).read_text())
    plain = [r["value"] for r in record["eval"] if r["metric"] == "perplexity" and "master weights" in r["computed"]][0]
    assert round(_measure_as_the_card_says(card, out, runs, monkeypatch), 4) != plain  # bf16 rounding, 4 decimals
    planned = one_error_line(cli("eval", out, "--data", runs / "corpus.txt", "--held-out", "--plan-numerics"))
    assert "holds no precision plan (hf_lowprec_plan.json): its dense weights compute as they are" in planned
    copied = export_run(out, tmp_path / "copy")
    assert "not this export's" in (copied / CARD_FILE).read_text()
    native = export_run(runs / "full", tmp_path / "native")
    native_card = (native / CARD_FILE).read_text()
    assert "not this export's" not in native_card
    # the command that computes as the run did reads the run's held-out rows (it read every row, training ones too)
    assert "hf-lowprec eval path/to/full --data corpus.txt --held-out --plan-numerics\n" in native_card
    as_run = [r["value"] for r in record["eval"] if r["metric"] == "perplexity" and "plan" in r["computed"]][0]
    assert round(_measure_as_the_card_says(native_card, native, runs, monkeypatch), 4) == round(as_run, 4)


@pytest.mark.parametrize("dataset, listed", [("chat.jsonl", None), ("shakespeare", None), ("someone/chat-data", ["someone/chat-data"])])
def test_the_card_metadata_lists_hub_datasets_only(dataset, listed):
    """``datasets:`` takes Hub dataset ids; a local file or the offline corpus is named in the text instead."""
    card = render_model_card({**_run_record(), "dataset": dataset})
    assert card.data.datasets == listed and validate_card_metadata(card.content) == []
    training = card.text.split("## Training")[1]
    named = {"chat.jsonl": "`chat.jsonl` (local data", "shakespeare": "`shakespeare` (Shakespeare's plays from Project Gutenberg"}
    assert (f"[{dataset}](https://huggingface.co/datasets/{dataset})" if listed else named[dataset]) in training
    assert ("local data" in training) == (dataset == "chat.jsonl")


def test_the_card_links_the_project_homepage_from_the_package_metadata():
    import importlib.metadata
    from pathlib import Path

    from hf_lowprec.assets import shipped_folder

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the test extra's tomli, the same parser
        import tomli as tomllib

    urls = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["urls"]
    installed = dict(u.split(", ", 1) for u in importlib.metadata.metadata("hf-lowprec").get_all("Project-URL"))
    assert installed["Homepage"] == urls["Homepage"] == "https://github.com/hf-lowprec/hf-lowprec"
    assert "github.com" not in shipped_folder("model_cards").joinpath("model_card.md.jinja").read_text()
    assert f"Trained with [hf-lowprec]({urls['Homepage']})" in render_model_card(_run_record()).text


def test_the_record_and_card_say_which_fp8_layers_ran_emulated_on_fp8_hardware(monkeypatch):
    """The report's backend was fixed when the plan was applied, on the CPU before the model moved to its GPU, and the
    card said nothing of emulation on FP8 hardware, where layers torchao does not run (a width not divisible by 16,
    block scales) still emulate: the record reads each FP8 layer's backend as it is now."""
    import hf_lowprec.modules.fp8 as fp8_module
    from hf_lowprec.export.records import plan_record

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 24), torch.nn.Linear(24, 64))
    apply_plan(model, PrecisionPlan({"2": "fp8-block"}, default="fp8"))
    monkeypatch.setattr(fp8_module, "fp8_hardware_available", lambda device: True)  # as the model moved to an H100
    rows, summary = plan_record(model, model.hf_lowprec_plan)
    backends = {r["name"]: (r["backend"], r.get("emulated_because", "")) for r in rows}
    assert backends["0"] == ("torchao", "") and backends["1"][0] == backends["2"][0] == "emulated"
    assert "divisible by 16" in backends["1"][1] and "do not cover fp8-block" in backends["2"][1]
    card = render_model_card({"layers": rows, "plan_rows": summary, "name": "r",
                              "hardware": {"fp8_tensor_cores": True}}).content  # fmt: skip
    assert "2 of the 3 FP8 layers ran emulated FP8 numerics (" in " ".join(card.split())


def test_a_folder_missing_what_its_record_names_is_refused_in_one_line(tmp_path):
    """export copied a run without its adapters (or plan) and push uploaded it; a record's ``"export": null``, a
    corrupt weight index or a ``pytorch_model.bin`` folder must not crash or be refused for the wrong file."""
    from hf_lowprec.export.records import missing_files, read_run

    run = {"plan": {"default": "fp8"}, "export": {"weights": "master", "loader": "transformers"},
           "adapter": {"r": 4, "folder": "./"}}  # fmt: skip
    (tmp_path / RUN_FILE).write_text(json.dumps(run))
    (tmp_path / "config.json").write_text("{}")
    assert missing_files(tmp_path, run) == ["model.safetensors", "hf_lowprec_plan.json", "adapter_config.json",
                                            "adapter_model.safetensors"]  # fmt: skip
    with pytest.raises(ValueError, match=r"lacks model\.safetensors, hf_lowprec_plan\.json, adapter_config\.json, "
                                         r"adapter_model\.safetensors, which its run record says it holds"):  # fmt: skip
        read_run(tmp_path)
    assert read_run(tmp_path, whole=False) == run  # reading the record alone (a card's edit check)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    assert missing_files(tmp_path, {"export": None}) == []
    (tmp_path / "model.safetensors.index.json").write_text("not json")
    assert missing_files(tmp_path, {}) == ["model.safetensors.index.json (unreadable)"]
