"""LowPrecisionPlugin in Accelerate loops (one process; tests/test_distributed.py runs several)."""

import logging

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from conftest import autocast_states, lm_batches, tiny_llama
from torch import nn
from torchao.float8.float8_linear import Float8Linear

from hf_lowprec.export.records import plan_record
from hf_lowprec.layers import unconverted_layers
from hf_lowprec.modules import LOW_PRECISION_TYPES, FP8Linear, Int4Linear
from hf_lowprec.plan import PLAN_FILE, PrecisionPlan
from hf_lowprec.training.accelerate import OPTIONS_FILE, LowPrecisionPlugin
from hf_lowprec.training.new_parameters import orphaned_parameters

PLAN = {"default": "fp8", "layers": {"*.mlp.down_proj": "int4-g64", "lm_head": "bf16"}}


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """Each test builds its own Accelerator (mixed precision is process-global state in Accelerate)."""
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def one_step(model, optimizer, accelerator, batch, loss_factor: float = 1.0) -> dict[str, torch.Tensor]:
    """Snapshot every trainable parameter, run one optimizer step; returns the snapshot."""
    before = {n: p.detach().clone() for n, p in accelerator.unwrap_model(model).named_parameters() if p.requires_grad}
    loss = model(**batch).loss * loss_factor
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return before


def unchanged(model, before) -> list[str]:
    return [n for n, p in model.named_parameters() if n in before and torch.equal(before[n], p.detach())]


def test_accelerate_fp8_alone_leaves_weights_untrained():
    """The hazard the plugin exists for (accelerate 1.15 + torchao 0.18): prepare(model, optimizer) with
    mixed_precision="fp8" swaps Linear weights after the optimizer captured them."""
    accelerator = Accelerator(cpu=True, mixed_precision="fp8")
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    orphans = orphaned_parameters(model, optimizer)
    assert len(orphans) == 13 and sum(p.requires_grad for p in model.parameters()) == 21
    before = one_step(model, optimizer, accelerator, lm_batches(1, batch=4)[0])
    assert sorted(unchanged(model, before)) == sorted(orphans)


def test_plugin_with_accelerate_fp8_trains_every_parameter():
    """mixed_precision="fp8": the plan is torchao's module filter; every parameter (learned steps too) trains."""
    accelerator = Accelerator(cpu=True, mixed_precision="fp8")
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lowprec = LowPrecisionPlugin(PLAN)
    model, optimizer = lowprec.prepare(accelerator, model, optimizer)
    layer = model.model.layers[0]
    # exactly the plan's tensorwise FP8 layers run in torchao (Accelerate's own filter would skip the first one)
    assert type(layer.self_attn.q_proj) is Float8Linear and type(layer.mlp.up_proj) is Float8Linear
    assert type(layer.mlp.down_proj) is Int4Linear and type(model.lm_head) is nn.Linear
    assert len(lowprec.torchao_layers) == 12 and not lowprec.report.not_applied
    # what records and cards read counts them as FP8 (they were unconverted layers: 'bf16 100%', no FP8 FLOPs)
    rows, _ = plan_record(model, model.hf_lowprec_plan)
    formats = {row["name"]: row["format"] for row in rows}
    assert formats["model.layers.0.self_attn.q_proj"] == formats["model.layers.0.mlp.up_proj"] == "fp8"
    assert not unconverted_layers(model) and lowprec.telemetry()["lowprec/flops_fp8"] > 0.5
    assert orphaned_parameters(model, optimizer) == []
    before = one_step(model, optimizer, accelerator, lm_batches(1, batch=4)[0])
    assert len(before) == 21 + 2 and unchanged(model, before) == []


@pytest.mark.parametrize("scaler", ["gradient", "delayed"])
def test_plugin_with_accelerate_fp8_refuses_a_scaler_torchaos_layers_would_not_run(scaler):
    """torchao's Float8Linear scales dynamically: the FP8 layers the plugin handed it dropped scaler="gradient" (spike
    detection and skips) or "delayed" without a word. Refused before anything is converted; with
    mixed_precision="no" the same plugin runs them in its own FP8 layers with that scaler."""
    model = tiny_llama()
    plugin = LowPrecisionPlugin(PLAN, scaler=scaler)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    message = rf"^scaler='{scaler}' does not run in the 12 FP8 layers Accelerate's torchao backend converts"
    with pytest.raises(ValueError, match=message):
        plugin.prepare(Accelerator(cpu=True, mixed_precision="fp8"), model, optimizer)
    assert not any(isinstance(m, LOW_PRECISION_TYPES + (Float8Linear,)) for m in model.modules())
    AcceleratorState._reset_state(reset_partial_state=True)  # an Accelerator's mixed precision outlives it
    model, optimizer = plugin.prepare(Accelerator(cpu=True), model, optimizer)
    policy = type(model.model.layers[0].self_attn.q_proj.scaling["grad"]).__name__
    assert policy == {"gradient": "GradientScaling", "delayed": "DelayedScaling"}[scaler]


def test_plugin_loop_trains_logs_and_checkpoints(tmp_path):
    accelerator = Accelerator(cpu=True)
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = lm_batches(6, batch=4)
    loader = torch.utils.data.DataLoader([{k: v[i] for k, v in b.items()} for b in batches for i in range(4)], batch_size=4)
    lowprec = LowPrecisionPlugin(PLAN)
    model, optimizer, loader = lowprec.prepare(accelerator, model, optimizer, loader)
    assert isinstance(model.model.layers[1].self_attn.o_proj, FP8Linear)
    assert len(optimizer.param_groups[0]["params"]) == 21 + 2  # learned steps joined their weights' group
    with torch.no_grad():
        start = model(**batches[0]).loss.item()
    for batch in loader:
        before = one_step(model, optimizer, accelerator, batch)
        assert unchanged(model, before) == []
    with torch.no_grad():
        assert model(**batches[0]).loss.item() < start - 0.1
    logs = lowprec.telemetry()
    assert logs["lowprec/params_int4-g64"] > 0 and logs["lowprec/flops_fp8"] > 0 and logs["lowprec/steps_skipped"] == 0
    assert logs["lowprec/params_kept"] > 0 and "lowprec/params_bf16" not in logs  # lm_head, in fp32 as the card says
    assert {"lowprec/fp8/input_saturation", "lowprec/fp8/grad_underflow"} <= set(logs)

    accelerator.save_state(str(tmp_path / "state"))  # the plugin is registered for checkpointing

    def restored(plan, **options):
        """A fresh model, optimizer and plugin prepared with ``plan`` and loaded from the saved state."""
        acc = Accelerator(cpu=True)
        plugin = LowPrecisionPlugin(plan, **options)
        m = tiny_llama(seed=1)
        m, o = plugin.prepare(acc, m, torch.optim.AdamW(m.parameters(), lr=3e-3))
        acc.load_state(str(tmp_path / "state"))
        return m

    again = restored(PLAN)
    saved = accelerator.unwrap_model(model).state_dict()
    assert all(torch.equal(v, saved[k]) for k, v in again.state_dict().items() if k.endswith(("weight", "step")))
    with pytest.raises(ValueError, match="another plan"):  # same parameters, other formats: refused
        restored({**PLAN, "default": "fp8-rowwise"})
    # other parameters (no learned INT4 steps): refused by the plugin, before Accelerate lists the weights' keys
    with pytest.raises(ValueError, match=r"another plan: .*resume with LowPrecisionPlugin\(plan=<the state folder>\)"):
        restored("fp8")
    # other options (scale histories, learned steps): refused in one line, not by safetensors' list of keys
    with pytest.raises(ValueError, match=r"^the saved state was trained with scaler='dynamic' \(this run: 'delayed'\), learn_scales=True \(this run: False\): resume with the options it was saved with$"):
        restored(PLAN, scaler="delayed", learn_scales=False)


def test_auto_plan_scans_the_loader_without_moving_the_random_streams():
    accelerator = Accelerator(cpu=True)
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rows = [{k: v[i] for k, v in b.items()} for b in lm_batches(2, batch=4) for i in range(4)]
    loader = torch.utils.data.DataLoader(rows, batch_size=4, shuffle=True)
    rng = torch.random.get_rng_state()
    lowprec = LowPrecisionPlugin(calibration_batches=1, scan_method="fisher")
    model, optimizer, loader = lowprec.prepare(accelerator, model, optimizer, loader)
    assert torch.equal(torch.random.get_rng_state(), rng)  # the scan's batches did not consume training randomness
    assert lowprec.plan.layers and lowprec.scan_seconds > 0 and lowprec.report.swapped
    before = one_step(model, optimizer, accelerator, next(iter(loader)))
    assert unchanged(model, before) == []


def test_an_auto_plan_resumes_from_the_state_folder_without_scanning(tmp_path):
    """``save_state`` writes the scan's plan beside the weights; ``LowPrecisionPlugin(plan=<state folder>)`` converts
    with it (no scan, no calibration data) and ``load_state`` restores every weight and learned step."""
    accelerator = Accelerator(cpu=True)
    model = tiny_llama()
    rows = [{k: v[i] for k, v in b.items()} for b in lm_batches(2, batch=4) for i in range(4)]
    loader = torch.utils.data.DataLoader(rows, batch_size=4)
    lowprec = LowPrecisionPlugin(calibration_batches=1, scan_method="fisher", formats=("fp8", "int4-g64"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer, loader = lowprec.prepare(accelerator, model, optimizer, loader)
    one_step(model, optimizer, accelerator, next(iter(loader)))
    accelerator.save_state(str(tmp_path / "state"))
    AcceleratorState._reset_state(reset_partial_state=True)

    acc = Accelerator(cpu=True)
    again = LowPrecisionPlugin(str(tmp_path / "state"))
    fresh = tiny_llama(seed=1)
    fresh, _ = again.prepare(acc, fresh, torch.optim.AdamW(fresh.parameters(), lr=3e-3))  # no loader: nothing to scan
    acc.load_state(str(tmp_path / "state"))
    assert again.plan.to_dict() == lowprec.plan.to_dict() and again.scan_seconds == lowprec.scan_seconds
    saved = accelerator.unwrap_model(model).state_dict()
    assert set(fresh.state_dict()) == set(saved)
    assert all(torch.equal(v, saved[k]) for k, v in fresh.state_dict().items())


def test_convert_with_an_accelerator_keeps_the_plan_in_its_saved_state(tmp_path):
    """The ``convert`` path (the loop prepares or wraps the model itself) saves and checks the plan and options as
    ``prepare`` does."""
    accelerator = Accelerator(cpu=True)
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    LowPrecisionPlugin(PLAN).convert(model, optimizer, accelerator=accelerator)
    model, optimizer = accelerator.prepare(model, optimizer)
    one_step(model, optimizer, accelerator, lm_batches(1, batch=2)[0])
    accelerator.save_state(str(tmp_path / "state"))
    assert PrecisionPlan.load(tmp_path / "state" / PLAN_FILE).to_dict() == PrecisionPlan.from_dict(PLAN).to_dict()
    assert (tmp_path / "state" / OPTIONS_FILE).is_file()
    AcceleratorState._reset_state(reset_partial_state=True)

    acc = Accelerator(cpu=True)
    fresh = tiny_llama(seed=1)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=3e-3)
    LowPrecisionPlugin({**PLAN, "default": "fp8-rowwise"}).convert(fresh, fresh_optimizer, accelerator=acc)
    acc.prepare(fresh, fresh_optimizer)
    with pytest.raises(ValueError, match="another plan"):
        acc.load_state(str(tmp_path / "state"))


def test_smoothed_layers_calibrate_on_the_prepared_dataloader_before_training(caplog):
    """'-sq' layers calibrate on the loader's first batches in ``prepare`` (before DDP would wrap the model); ``convert``
    without calibration data says they will calibrate on their first forward."""
    plan = {"default": "bf16", "layers": {"*.mlp.down_proj": "int4-g64-sq"}}
    model = tiny_llama()
    rows = [{k: v[i] for k, v in b.items()} for b in lm_batches(2, batch=4) for i in range(4)]
    loader = torch.utils.data.DataLoader(rows, batch_size=4)
    model, _, _ = LowPrecisionPlugin(plan).prepare(Accelerator(cpu=True), model, torch.optim.AdamW(model.parameters()), loader)
    assert [bool(layer.mlp.down_proj.smoothing.calibrated) for layer in model.model.layers] == [True, True]
    other = tiny_llama()
    with caplog.at_level(logging.WARNING, logger="hf_lowprec"):
        LowPrecisionPlugin(plan).convert(other)
    assert "'-sq' layers (model.layers.0.mlp.down_proj, model.layers.1.mlp.down_proj) calibrate on their first forward" in caplog.text
    assert not other.model.layers[0].mlp.down_proj.smoothing.calibrated


def test_calibrating_on_a_shuffling_dataloader_leaves_its_order_as_it_was():
    """Reading a DataLoader's first batches to calibrate '-sq' layers (or to scan) drew from the generator it shuffles
    with: training then saw another order than a run without calibration (same seed, different data order)."""
    plan = {"default": "bf16", "layers": {"*.mlp.down_proj": "int4-g64-sq"}}
    rows = [{k: v[i] for k, v in b.items()} for b in lm_batches(4, batch=4) for i in range(4)]

    def order(calibrated: bool) -> list[torch.Tensor]:
        loader = torch.utils.data.DataLoader(rows, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0))
        model = tiny_llama()
        LowPrecisionPlugin(plan).convert(model, calibration_data=loader if calibrated else None)
        assert bool(model.model.layers[0].mlp.down_proj.smoothing.calibrated) == calibrated
        return [batch["input_ids"] for batch in loader]

    assert all(torch.equal(a, b) for a, b in zip(order(True), order(False), strict=True))


@pytest.mark.parametrize("fp16", [False, True])
def test_gradient_spike_skips_the_step_and_holds_the_lr_schedule(fp16):
    """scaler="gradient", spike_action="skip": a 1000x gradient spike leaves every parameter as it was, and
    Accelerate's optimizer says the step was skipped, so its scheduler leaves the LR where it is (it advanced over
    the skip). fp16: Accelerate's GradScaler, which it makes on accelerators only, given to the CPU's Accelerator."""
    accelerator = Accelerator(cpu=True)
    if fp16:
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)  # as on a GPU under mixed_precision="fp16"
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    lowprec = LowPrecisionPlugin(PLAN, scaler="gradient", scaler_options={"spike_action": "skip"})
    model, optimizer, schedule = lowprec.prepare(accelerator, model, optimizer, schedule)
    assert (optimizer.scaler is not None) == fp16
    batch = lm_batches(1, batch=4)[0]
    skipped, rates = [], []
    for step in range(5):
        before = one_step(model, optimizer, accelerator, batch, loss_factor=1000.0 if step == 3 else 1.0)
        skipped.append(optimizer.step_was_skipped)
        schedule.step()
        rates.append(schedule.get_last_lr()[0])
        if step == 3:
            assert sorted(unchanged(model, before)) == sorted(before)
    assert lowprec.steps_skipped == 1 and skipped == [False, False, False, True, False]
    assert rates == pytest.approx([3e-3 / k for k in (2, 3, 4, 4, 5)])
    assert lowprec.telemetry()["lowprec/spikes"] >= 1


def test_plugin_compensation_wraps_the_optimizer():
    from hf_lowprec.training.compensation import CompensatedOptimizer

    accelerator = Accelerator(cpu=True)
    model = tiny_llama().to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = LowPrecisionPlugin(PLAN, compensation="kahan").prepare(accelerator, model, optimizer)
    assert isinstance(optimizer.optimizer, CompensatedOptimizer)
    before = one_step(model, optimizer, accelerator, lm_batches(1, batch=4)[0])
    # an update below half a bf16 ulp (the norms' 1e-4 steps at 1.0) leaves the weight and waits in its buffer
    params = dict(model.named_parameters())
    still = unchanged(model, before)
    assert still and all("norm" in n for n in still)
    assert all(optimizer.optimizer.buffers[id(params[n])].abs().max() > 0 for n in still)
    with pytest.raises(ValueError, match="every trainable weight is fp32"):
        m = tiny_llama()
        LowPrecisionPlugin("fp8", compensation="kahan").prepare(accelerator, m, torch.optim.AdamW(m.parameters()))


def test_prepare_takes_the_list_accelerate_returns_under_fsdp2(monkeypatch):
    """Under FSDP2, ``Accelerator.prepare`` returns a list (``_prepare_fsdp2``), not a tuple: the plugin took the whole
    list for one object and failed on a bare StopIteration finding no model in it. FSDP needs an accelerator, so the
    CPU accelerator's result is handed back as that list."""
    accelerator = Accelerator(cpu=True)
    prepare = accelerator.prepare
    monkeypatch.setattr(accelerator, "prepare", lambda *objects: list(prepare(*objects)))
    model = tiny_llama()
    prepared = LowPrecisionPlugin(PLAN).prepare(accelerator, model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    model, optimizer = prepared
    assert isinstance(model, torch.nn.Module) and isinstance(optimizer, torch.optim.Optimizer)
    one_step(model, optimizer, accelerator, lm_batches(1, batch=4)[0])


def test_learned_steps_join_a_group_without_weight_decay_or_are_said_to_be_decayed(caplog):
    """The plugin puts learned steps in the no-decay twin of their weight's group (decay pulls them toward 0), or, in
    an optimizer with none, in the weight's group with a warning."""
    model = tiny_llama()
    decayed = [p for n, p in model.named_parameters() if n.endswith("proj.weight")]
    others = [p for n, p in model.named_parameters() if not n.endswith("proj.weight")]
    twin = torch.optim.AdamW([{"params": decayed, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}])
    LowPrecisionPlugin(PLAN).prepare(Accelerator(cpu=True), model, twin)
    steps = {id(p) for n, p in model.named_parameters() if n.endswith(".step")}
    assert steps and steps <= {id(p) for p in twin.param_groups[1]["params"]}
    model = tiny_llama()
    with caplog.at_level(logging.WARNING, logger="hf_lowprec"):
        optimizer = torch.optim.AdamW(model.parameters(), weight_decay=0.1)
        LowPrecisionPlugin(PLAN).prepare(Accelerator(cpu=True), model, optimizer)
    assert caplog.text.count("learned steps join their weights' param group, with its weight_decay 0.1 (") == 1  # not per step


def test_bad_input(monkeypatch):
    accelerator = Accelerator(cpu=True)
    model = tiny_llama()
    with pytest.raises(ValueError, match="one model"):
        LowPrecisionPlugin("fp8").prepare(accelerator, model, tiny_llama())
    partial = torch.optim.AdamW(model.model.layers.parameters(), lr=1e-3)  # the embedding and head left out
    with pytest.raises(ValueError, match="missing from the optimizer"):
        LowPrecisionPlugin("fp8").prepare(accelerator, model, partial)
    prepared = accelerator.prepare(tiny_llama())
    with pytest.raises(ValueError, match="already wrapped by Accelerate.s prepare; pass the plain model"):
        LowPrecisionPlugin("fp8").prepare(accelerator, prepared)
    with pytest.raises(ValueError, match="needs calibration_data"):
        LowPrecisionPlugin().prepare(accelerator, tiny_llama())
    with pytest.raises(ValueError, match="fp8_rounding='gptq': needs calibration_data"):
        LowPrecisionPlugin("fp8", fp8_rounding="gptq").prepare(accelerator, tiny_llama())
    with pytest.raises(ValueError, match="no eligible layers"):
        LowPrecisionPlugin("fp8").prepare(accelerator, nn.Sequential(nn.Conv1d(2, 2, 1)))
    with pytest.raises(ValueError, match="apply only to plan='auto'|applies only to plan='auto'"):
        LowPrecisionPlugin("fp8", budget={"target_bits_per_param": 8})
    # one of two launched processes whose Accelerator made no process group (a plain Accelerator() on a machine
    # without accelerators): each would train alone on all the data and write the same files
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"one of 2 launched processes \(WORLD_SIZE\), but its Accelerator runs alone"):
        LowPrecisionPlugin("fp8").prepare(accelerator, tiny_llama())


def test_fp8_rounding_calibrates_on_the_prepared_dataloader(caplog):
    """The plugin rounds the FP8 master weights on the first batches of the DataLoader it prepares: the same weights as
    rounding the converted model by hand on those batches."""
    from hf_lowprec import PrecisionPlan, apply_plan
    from hf_lowprec.ondevice.calibration.fp8 import round_fp8_weights

    batches = lm_batches(n=2, batch=8, seq=32, seed=1)
    loader = torch.utils.data.DataLoader([{"input_ids": r} for b in batches for r in b["input_ids"]], batch_size=8)
    model, by_hand = tiny_llama(), tiny_llama()
    plugin = LowPrecisionPlugin("fp8", fp8_rounding="gptq", calibration_batches=2)
    plugin.prepare(Accelerator(cpu=True), model, loader)
    apply_plan(by_hand, PrecisionPlan.uniform("fp8", keep=("lm_head",)))  # the plugin's default keep
    round_fp8_weights(by_hand, [b["input_ids"] for b in batches])
    assert plugin.session.rounding["layers"] == 14
    for (name, a), b in zip(model.named_parameters(), by_hand.parameters()):
        assert torch.equal(a, b), name
    # a plan without FP8 layers has no FP8 weight to round: refused (it rounded nothing, and said it had)
    with pytest.raises(ValueError, match=r"FP8 weight rounding 'gptq' .* but the plan .* puts no layer in FP8"):
        LowPrecisionPlugin("int4-g64", fp8_rounding="gptq", calibration_batches=2).prepare(Accelerator(cpu=True), tiny_llama(), loader)
    # a scanned plan that chose no FP8 layer: said, not refused after the scan's minutes
    scanned = LowPrecisionPlugin(formats=("int4-g64",), fp8_rounding="gptq", calibration_batches=2)
    labelled = torch.utils.data.DataLoader([{"input_ids": r, "labels": r} for b in batches for r in b["input_ids"]], batch_size=8)
    with caplog.at_level(logging.WARNING, logger="hf_lowprec"):
        scanned.prepare(Accelerator(cpu=True), tiny_llama(), labelled)
    assert "puts no layer in FP8 (the scan chose none): nothing to round" in caplog.text


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_auto_plan_scans_under_the_accelerators_autocast(mixed_precision):
    """The scan computes as the training steps will: under ``accelerator.autocast()`` (bf16 on a CPU), or without."""
    accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision)
    model = tiny_llama()
    states, handle = autocast_states(model.model)  # the decoder: the scan's chunked passes call it, not the model
    LowPrecisionPlugin(calibration_batches=1, scan_method="fisher").prepare(
        accelerator, model, calibration_data=lm_batches(1, batch=4)
    )
    handle.remove()
    assert states and set(states) == {(mixed_precision == "bf16", torch.bfloat16)}


def test_the_auto_scan_shows_its_progress_on_the_main_process(capsys):
    """The scan takes minutes on a CPU before the loop's first step: the plugin shows a bar (passes done, the layer
    being measured) on the local main process."""
    accelerator = Accelerator(cpu=True)
    plugin = LowPrecisionPlugin(calibration_batches=1)
    plugin.prepare(accelerator, tiny_llama(), calibration_data=lm_batches(1, batch=4))
    err = capsys.readouterr().err
    assert "hf-lowprec sensitivity scan" in err and "measured" in err, err[-500:]
