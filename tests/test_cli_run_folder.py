"""The finetune run folder: resuming after a kill (SIGTERM, a half-written checkpoint), what --overwrite may replace,
and what --resume says when the options changed."""

import json
import shutil
import signal

import pytest
from cli_invoke import cli, one_error_line, workspace
from hf_lowprec.cli import run as run_module
from transformers import TrainingArguments

from hf_lowprec.export import RUN_FILE
from hf_lowprec.plan import PLAN_FILE, PrecisionPlan

# a tiny model, short blocks, a checkpoint after every step
QUICK = ["--block-size", "32", "--batch-size", "2", "--eval-blocks", "2", "--dtype", "fp32", "--save-steps", "1"]


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return workspace(tmp_path_factory.mktemp("cli_run_folder"), 20_000)


def finetune_args(ws, out, recipe="int4-ondevice-lora", steps=3):
    return ["finetune", ws / "tiny", "--data", ws / "corpus.txt", "--recipe", recipe, "--max-steps", steps, *QUICK,
            "-o", out]  # fmt: skip


def interrupt_at_step_2(monkeypatch):
    """In this process: every checkpoint kept (no rotation) and a SIGTERM arriving during step 2."""
    step_end = run_module.StopOnInterrupt.on_step_end

    def terminated_at_2(self, args, state, control, **kwargs):
        if state.global_step == 2 and not self.requested:
            self._handle(signal.SIGTERM, None)
        return step_end(self, args, state, control, **kwargs)

    monkeypatch.setattr(run_module.KeepOneCompleteCheckpoint, "on_save", lambda *args, **kwargs: None)
    monkeypatch.setattr(run_module.StopOnInterrupt, "on_step_end", terminated_at_2)


def cut_as_a_kill_leaves_it(checkpoint, keep):
    """``checkpoint`` as a kill while it is written leaves it: only the files in ``keep``, the last one cut short."""
    for f in checkpoint.iterdir():
        if f.name not in keep:
            f.unlink()
    last = checkpoint / keep[-1]
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])


@pytest.mark.parametrize(
    "recipe, kept",
    [
        # the Trainer died writing the optimizer state: no trainer_state.json yet
        ("int4-ondevice-lora", ["adapter_config.json", "adapter_model.safetensors", "optimizer.pt"]),
        # died after trainer_state.json, writing the low-precision callback's state (saved last, in on_save)
        ("fp8-train", ["config.json", "model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth",
                       "trainer_state.json", "hf_lowprec_plan.json"]),
    ],
)  # fmt: skip
def test_resume_skips_a_half_written_checkpoint(ws, tmp_path, monkeypatch, recipe, kept):
    out = tmp_path / "run"
    args = finetune_args(ws, out, recipe)
    with monkeypatch.context() as patched:
        interrupt_at_step_2(patched)
        stopped = cli(*args)
    assert stopped.exit_code == 143, stopped.output[-2000:]
    checkpoints = tmp_path / "run.incomplete" / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    cut_as_a_kill_leaves_it(checkpoints / "checkpoint-2", kept)
    assert run_module.RunFolder(out).latest_checkpoint() == checkpoints / "checkpoint-1"

    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    resumed = cli(*args, "--resume")
    assert resumed.exit_code == 0, resumed.output[-3000:]
    assert "skipping checkpoint-2" in resumed.output and "resuming from checkpoint-1 (step 1)" in resumed.output
    record = json.loads((out / RUN_FILE).read_text())
    assert record["training"]["resumed_from_step"] == 1 and record["training"]["steps"] == 3
    assert record["training"]["train_loss_over_steps"] == "2-3"  # the Trainer averages the resumed session only
    assert not (tmp_path / "run.incomplete").exists()
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers  # handlers put back


def test_a_full_run_keeps_its_last_checkpoint_until_the_next_is_complete(ws, tmp_path, monkeypatch):
    """The low-precision callback writes a ``full`` checkpoint's plan and state after the Trainer has written the
    rest (and, with ``save_total_limit``, rotated the older checkpoints away): a write refused there keeps the
    previous checkpoint, which --resume continues from; a complete one replaces it."""
    from hf_lowprec.training.callback import LowPrecisionCallback

    on_save = LowPrecisionCallback.on_save

    def refused_at_2(self, args, state, control, **kwargs):
        if state.global_step == 2:
            raise OSError(28, "No space left on device")
        return on_save(self, args, state, control, **kwargs)

    args = finetune_args(ws, tmp_path / "run", "fp8-train")
    with monkeypatch.context() as patched:
        patched.setattr(LowPrecisionCallback, "on_save", refused_at_2)
        failed = cli(*args)
    assert failed.exit_code == 1, failed.output
    assert failed.output.strip().endswith("--resume continues from checkpoint-1 once there is room"), failed.output
    checkpoints = tmp_path / "run.incomplete" / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert run_module.RunFolder(tmp_path / "run").latest_checkpoint() == checkpoints / "checkpoint-1"
    resumed = cli(*args, "--resume")
    assert resumed.exit_code == 0, resumed.output[-3000:]
    assert "skipping checkpoint-2" in resumed.output and "resuming from checkpoint-1 (step 1)" in resumed.output
    assert json.loads((tmp_path / "run" / RUN_FILE).read_text())["training"]["steps"] == 3


def test_an_export_the_plan_cannot_give_is_refused_before_training(ws, tmp_path):
    """qat-int4 exports packed INT4 codes: a plan without INT4 layers stops once the plan is known, before the
    training (it stopped after it, with a hint --resume refused)."""
    text = one_error_line(cli(*finetune_args(ws, tmp_path / "run", "qat-int4"), "--plan", "fp8"))
    assert "export.weights 'int4-packed' needs int4 (or per-channel int8) layers in the plan, and this plan" in text
    assert text.endswith("pass export.weights=master (or auto), or a plan with int4 layers")
    assert not (tmp_path / "run").exists() and not (tmp_path / "run.incomplete").exists()


def test_resume_with_only_a_half_written_checkpoint_says_so(ws, tmp_path):
    checkpoint = tmp_path / "run.incomplete" / "checkpoints" / "checkpoint-1"
    checkpoint.mkdir(parents=True)
    (checkpoint / "adapter_model.safetensors").write_bytes(b"\0" * 10)
    text = one_error_line(cli(*finetune_args(ws, tmp_path / "run"), "--resume"))
    assert "no complete checkpoint" in text and "half-written" in text
    assert "pass --overwrite instead to start over" in text
    text = one_error_line(cli(*finetune_args(ws, tmp_path / "new"), "--resume"))  # nothing there: nothing to overwrite
    assert "no interrupted run to resume" in text and text.endswith("run without --resume to start one")


def test_sigterm_before_the_first_step_leaves_no_run_folder(ws, tmp_path, monkeypatch):
    """A SIGTERM while the base model is evaluated (before training: loading, scanning, evaluating take minutes at
    real sizes) stops the command with status 143 and removes its work folder, which holds nothing to resume."""
    import os

    def evaluate_killed(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not stop the run")

    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(run_module, "_evaluate", evaluate_killed)
    killed = cli(*finetune_args(ws, tmp_path / "run"))
    assert killed.exit_code == 143, killed.output[-2000:]
    assert "no checkpoint was saved yet" in killed.output and "interrupted" in killed.output
    assert not (tmp_path / "run.incomplete").exists() and not (tmp_path / "run").exists()
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers

    (tmp_path / "left.incomplete").mkdir()  # as a kill -9 leaves it: settings, no checkpoint
    (tmp_path / "left.incomplete" / run_module.SETTINGS_FILE).write_text("{}")
    text = one_error_line(cli(*finetune_args(ws, tmp_path / "left")))
    assert text.endswith("it saved no checkpoint; pass --overwrite to start over"), text
    (tmp_path / "left").mkdir()  # beside the finished run it would replace: the interrupted one is still said first
    (tmp_path / "left" / RUN_FILE).write_text("{}")  # (only --overwrite was suggested, which would discard it)
    assert one_error_line(cli(*finetune_args(ws, tmp_path / "left"))) == text


def test_sigterm_after_training_says_where_resume_continues(ws, tmp_path, monkeypatch):
    """A SIGTERM in the final evaluation (after the training steps) keeps the checkpoints and says --resume continues
    from the last one (it said "interrupted" alone); --resume then evaluates and exports."""
    import os

    evaluate, calls = run_module._evaluate, []

    def killed_the_third_time(*args, **kwargs):  # the base model's, the start's, then the final one
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return evaluate(*args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(run_module, "_evaluate", killed_the_third_time)
        killed = cli(*finetune_args(ws, tmp_path / "run"))
    assert killed.exit_code == 143, killed.output[-2000:]
    checkpoints = tmp_path / "run.incomplete" / "checkpoints"
    assert f"--resume continues from checkpoint-3 in '{checkpoints}'" in " ".join(killed.output.split())
    resumed = cli(*finetune_args(ws, tmp_path / "run"), "--resume")
    assert resumed.exit_code == 0 and (tmp_path / "run" / RUN_FILE).is_file(), resumed.output[-2000:]


def test_overwrite_replaces_only_empty_folders_and_runs(ws, tmp_path, caplog):
    mine = tmp_path / "userdir"
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("precious")
    args = finetune_args(ws, mine, "fp8-train", steps=1)
    text = one_error_line(cli(*args, "--overwrite"))
    assert "--overwrite" in text and str(mine) in text and "not an hf-lowprec run" in text
    assert (mine / "notes.txt").read_text() == "precious" and (mine / "sub").is_dir()
    assert not (tmp_path / "userdir.incomplete").exists()
    under_a_file = one_error_line(cli(*finetune_args(ws, mine / "notes.txt" / "run", "fp8-train", steps=1)))
    assert under_a_file.endswith(f"'{mine / 'notes.txt'}' is a file, not a folder to write in")  # exit 1 before
    not_utf8 = one_error_line(cli(*finetune_args(ws, tmp_path / "run\udcff", "fp8-train", steps=1)))
    assert not_utf8.endswith("the name is not UTF-8, which the model writers need; choose another")  # after training
    assert not any(p.name.startswith("run") for p in tmp_path.iterdir())

    stray = tmp_path / "other.incomplete"  # a folder of the user's that happens to have a work folder's name
    stray.mkdir()
    (stray / "notes.txt").write_text("precious")
    text = one_error_line(cli(*finetune_args(ws, tmp_path / "other", "fp8-train", steps=1), "--overwrite"))
    assert str(stray) in text and "not an interrupted hf-lowprec run" in text
    assert (stray / "notes.txt").read_text() == "precious"

    empty = tmp_path / "empty"
    empty.mkdir()
    first = cli(*finetune_args(ws, empty, "fp8-train", steps=1), "--overwrite")
    assert first.exit_code == 0, first.output[-2000:]
    assert (empty / RUN_FILE).is_file()
    (empty / "stale.txt").write_text("from the old run")
    again = cli(*finetune_args(ws, empty, "fp8-train", steps=1), "--overwrite")  # a run folder: replaced
    assert again.exit_code == 0, again.output[-2000:]
    assert (empty / RUN_FILE).is_file() and not (empty / "stale.txt").exists()
    gone = [r.getMessage() for r in caplog.records if "gone with the old folder" in r.getMessage()]
    assert gone == [f"replaced {empty}; gone with the old folder: stale.txt"]  # what --overwrite removed, named
    # the run folder as the model of a new run and as its output: refused before loading (it trained, then the export
    # refused, the run left in .incomplete for a --resume that failed the same way)
    onto_itself = ["finetune", empty, "--data", ws / "corpus.txt", "--recipe", "qat-int4", *QUICK, "-o", empty]
    for flag in ("--overwrite", "--resume"):
        text = one_error_line(cli(*onto_itself, flag))
        assert f"--output-dir '{empty}' is the folder the model is loaded from, which is never replaced" in text
    assert not (tmp_path / "empty.incomplete").exists() and (empty / RUN_FILE).is_file()
    # a model inside the output folder: --overwrite replaced the folder with the model in it (the run record then
    # named a base that no longer existed)
    inner = shutil.copytree(ws / "tiny", empty / "inner")
    around = ["finetune", inner, "--data", ws / "corpus.txt", "--recipe", "qat-int4", *QUICK, "-o", empty]
    text = one_error_line(cli(*around, "--overwrite"))
    assert f"--output-dir '{empty}' holds the folder the model is loaded from ('{inner}'), which is never" in text
    assert (inner / "config.json").is_file() and (empty / RUN_FILE).is_file()


def test_an_interrupted_run_is_lost_to_no_bad_input_and_resumes_into_no_users_folder(ws, tmp_path, monkeypatch):
    """--overwrite with a plan file that does not exist: the interrupted run it would replace was already deleted when
    the new run stopped on it; it is now put back. --resume into an output folder the user filled meanwhile (their
    model, notes) replaced it at the export: refused, as a new run's --overwrite refuses it."""
    interrupt_at_step_2(monkeypatch)
    out = tmp_path / "run"
    assert cli(*finetune_args(ws, out)).exit_code == 143
    work = tmp_path / "run.incomplete"
    saved = sorted(p.name for p in (work / "checkpoints").iterdir())
    assert saved[-1] == "checkpoint-2"
    text = one_error_line(cli(*finetune_args(ws, out), "--overwrite", "--plan", tmp_path / "nosuch.json"))
    assert "nosuch.json" in text and "does not exist" in text
    assert sorted(p.name for p in (work / "checkpoints").iterdir()) == saved
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # nothing set aside left behind

    shutil.copytree(ws / "tiny", out)
    (out / "notes.txt").write_text("precious")
    text = one_error_line(cli(*finetune_args(ws, out), "--resume"))
    assert f"--resume: '{out}' exists and is not an hf-lowprec run or export folder" in text
    assert text.endswith("move that folder away, then resume")
    assert (out / "notes.txt").read_text() == "precious" and not (out / RUN_FILE).exists()


@pytest.mark.parametrize("moment", ["before its settings", "after its export"])
def test_overwrite_puts_the_interrupted_run_back_only_while_nothing_replaced_it(ws, tmp_path, monkeypatch, moment):
    """An interrupt right after --overwrite set the interrupted run aside (before the try that puts it back) left it
    hidden, for the next start to delete; one after the new run's export (its work folder removed) brought the old run
    back beside the finished one, for a --resume to overwrite it."""
    out, work = tmp_path / "run", tmp_path / "run.incomplete"
    with monkeypatch.context() as patched:
        interrupt_at_step_2(patched)
        assert cli(*finetune_args(ws, out)).exit_code == 143
    saved = sorted(p.name for p in (work / "checkpoints").iterdir())

    def interrupted(*args, **kwargs):
        if moment == "after its export":
            out.mkdir()
            (out / RUN_FILE).write_text("{}")
            shutil.rmtree(work)
        raise KeyboardInterrupt

    monkeypatch.setattr(run_module, "atomic_write_text" if moment == "before its settings" else "_train", interrupted)
    cli(*finetune_args(ws, out), "--overwrite")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    if moment == "before its settings":
        assert sorted(p.name for p in (work / "checkpoints").iterdir()) == saved
    else:
        assert not work.exists() and (out / RUN_FILE).is_file()


def test_the_set_aside_run_goes_once_the_new_run_saved_a_checkpoint(tmp_path):
    """Not at the end of the new run: its old checkpoints (optimizer states) held the disk for the whole run."""
    run = run_module.RunFolder(tmp_path / "run")
    checkpoint = run.checkpoints / "checkpoint-1"
    checkpoint.mkdir(parents=True)
    (checkpoint / "adapter_model.safetensors").write_bytes(b"x")
    (checkpoint / run_module.TRAINER_STATE).write_text("{}")
    run.set_aside.mkdir()
    args = TrainingArguments(output_dir=str(tmp_path / "x"), use_cpu=True, report_to=[])
    run_module.KeepOneCompleteCheckpoint(run).on_save(args, None, None)
    assert not run.set_aside.exists() and checkpoint.is_dir()


def test_a_run_interrupted_after_its_last_step_resumes_to_the_whole_runs_figures(ws, tmp_path, monkeypatch):
    """Stopped by a SIGTERM during its last step (2 of 2), the run saves checkpoint-2; --resume runs no step, and its
    Trainer's training loss (0) and speed (of no step) went into the record and the card as 'train loss 0'. Now the
    train loss is the logged losses' mean over steps 1-2, and no speed is claimed."""
    out = tmp_path / "run"
    args = [*finetune_args(ws, out, "fp8-train", steps=2), "training.logging_steps=1"]
    with monkeypatch.context() as patched:
        interrupt_at_step_2(patched)
        assert cli(*args).exit_code == 143
    resumed = cli(*args, "--resume")
    assert resumed.exit_code == 0, resumed.output[-2000:]
    training = json.loads((out / RUN_FILE).read_text())["training"]
    logged = [e["loss"] for e in json.loads((out / "log_history.json").read_text()) if "loss" in e]
    assert len(logged) == 2 and training["train_loss"] > 0 and training["train_loss"] == pytest.approx(sum(logged) / 2)
    assert training["train_loss_over_steps"] == "1-2" and training["resumed_from_step"] == 2
    assert "seconds_per_step" not in training and "tokens_per_second" not in training
    assert "no step left to run: resumed after the last one" in resumed.output


def test_resume_names_the_options_that_changed(ws, tmp_path, monkeypatch):
    out = tmp_path / "run"
    with monkeypatch.context() as patched:
        interrupt_at_step_2(patched)
        assert cli(*finetune_args(ws, out, "fp8-train")).exit_code == 143
    changed = finetune_args(ws, out, "fp8-train", steps=5)
    text = one_error_line(cli(*changed, "--learning-rate", "0.5", "--resume", "export.weights=auto"))
    assert "recipe.training.max_steps: 3 -> 5" in text and "recipe.training.learning_rate:" in text and "-> 0.5" in text
    assert "export" not in text  # what is written after training may change
    assert "run_settings.json" in text and "--overwrite" in text
    text = one_error_line(cli(*finetune_args(ws, out, "fp8-train"), "--revision", "v2", "--resume"))
    assert 'loading.revision: null -> "v2"' in text  # another revision of the model: other weights
    settings = json.loads((tmp_path / "run.incomplete" / "run_settings.json").read_text())
    training = settings["recipe"]["training"]
    training.update({k: "changed" for k in list(training)[:10]})  # many differences: the line stays short
    (tmp_path / "run.incomplete" / "run_settings.json").write_text(json.dumps(settings))
    line = one_error_line(cli(*changed, "--resume")).splitlines()[-1]
    assert line.startswith("error: --resume") and "more" in line and len(line) < 600, line
    shutil.rmtree(tmp_path / "run.incomplete")


def test_resume_refuses_data_whose_content_changed(ws, tmp_path, monkeypatch):
    """The data file is compared by content too: a resumed run trained its last steps on other text of the same name,
    and its record named the new text's digest."""
    data, out = tmp_path / "corpus.txt", tmp_path / "run"
    data.write_text((ws / "corpus.txt").read_text())
    args = [a if a != ws / "corpus.txt" else data for a in finetune_args(ws, out)]
    with monkeypatch.context() as patched:
        interrupt_at_step_2(patched)
        assert cli(*args).exit_code == 143
    data.write_text((ws / "corpus.txt").read_text()[::-1])
    said = one_error_line(cli(*args, "--resume"))
    assert "--resume: the options differ from the interrupted run's: data_sha256:" in said
    data.write_text((ws / "corpus.txt").read_text())  # the same content again: it resumes
    assert cli(*args, "--resume").exit_code == 0


def test_a_plan_file_or_folder_says_the_recipes_keep_does_not_apply(ws, tmp_path):
    """The recipe's ``keep: [lm_head]`` serves format-name and auto plans; a plan file's unnamed layers take its
    default, and the run says so (the recipe in its record still lists the keep). A run folder gives its plan."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"default": "int4-g64-asym"}))
    result = cli(*finetune_args(ws, tmp_path / "run", steps=1), "--plan", plan)
    assert result.exit_code == 0, result.output
    assert "precision.keep ['lm_head'] does not apply to the plan file" in result.output
    assert "take its default, int4-g64-asym" in result.output
    assert PrecisionPlan.load(tmp_path / "run" / PLAN_FILE).resolve("lm_head").name == "int4-g64-asym"
    plan.write_text(json.dumps({"default": "int4-g64-asym", "layers": {"lm_head": "bf16"}}))  # as a scan writes it
    result = cli(*finetune_args(ws, tmp_path / "named", steps=1), "--plan", plan)
    assert result.exit_code == 0 and "does not apply to the plan file" not in result.output, result.output
    result = cli(*finetune_args(ws, tmp_path / "again", steps=1), "--plan", tmp_path / "named")  # a run's plan
    assert result.exit_code == 0, result.output
    assert PrecisionPlan.load(tmp_path / "again" / PLAN_FILE).to_dict() == PrecisionPlan.load(plan).to_dict()


@pytest.mark.parametrize("limited_after_step", [1, 2])
def test_a_checkpoint_that_cannot_be_written_says_where_how_much_is_free_and_what_is_kept(
    ws, tmp_path, monkeypatch, limited_after_step
):
    """A write the file system refuses while a checkpoint is saved (here a file-size limit, as a full disk or a
    quota refuses one; torch's writer reports neither, only "unexpected pos") fails in one line, exit 1: where, the
    free space, and --resume from the last checkpoint, or, with none saved, that the work folder is gone."""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    step_end = run_module.StopOnInterrupt.on_step_end

    def limited(self, args, state, control, **kwargs):
        if state.global_step == limited_after_step:  # the checkpoint of this step is the first refused
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limit[1]))
        return step_end(self, args, state, control, **kwargs)

    monkeypatch.setattr(run_module.StopOnInterrupt, "on_step_end", limited)
    xfsz = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a refused write returns EFBIG instead of killing
    try:
        result = cli(*finetune_args(ws, tmp_path / "run"))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, xfsz)
    text = result.output.strip()
    assert result.exit_code == 1 and "Traceback" not in text and text.count("error:") == 1, text
    assert f"saving a checkpoint in '{tmp_path / 'run.incomplete' / 'checkpoints'}' failed (" in text
    assert " GiB free on that disk" in text and not (tmp_path / "run").exists()
    if limited_after_step == 1:
        assert text.endswith(f"nothing was saved: '{tmp_path / 'run.incomplete'}' removed")
        assert not (tmp_path / "run.incomplete").exists()
    else:
        assert text.endswith("--resume continues from checkpoint-1 once there is room")
        monkeypatch.setattr(run_module.StopOnInterrupt, "on_step_end", step_end)  # room again
        resumed = cli(*finetune_args(ws, tmp_path / "run"), "--resume")
        assert resumed.exit_code == 0, resumed.output[-2000:]
        assert "skipping checkpoint-2: it was only partly written" in resumed.output
        assert json.loads((tmp_path / "run" / RUN_FILE).read_text())["training"]["steps"] == 3
