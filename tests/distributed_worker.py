"""One rank of the distributed tests (run by ``torch.distributed.run``, or plainly for one process).

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed_worker.py trainer,plugin,fsdp2 OUT [--no-sync] [--fp32]

Trains a tiny Llama for ``STEPS`` optimizer steps with a global batch of ``GLOBAL_BATCH`` sequences
taken in order, so any world size sees the same batches. Modes: ``trainer`` (``transformers.Trainer``
+ ``LowPrecisionCallback``, fixed plan), ``trainer-auto`` (the same with a scan at ``on_train_begin``),
``trainer-smoothed`` (a fixed plan with '-sq' layers), ``plugin`` (an Accelerate loop + ``LowPrecisionPlugin``, DDP) and
``fsdp2`` (a plain loop, ``LowPrecisionPlugin.convert`` then torch's FSDP2 ``fully_shard``); ``spike-on-one-rank`` and
``nan-on-rank-1`` (the plugin's loop with one rank's gradient abnormal at step 3). Writes ``OUT/<mode>/losses.json`` (rank 0) and
``OUT/<mode>/rank<r>.safetensors`` (every rank's parameters after training). ``--fp32`` trains without the
callback (the reference for what a different world size alone changes); ``--no-sync`` turns off the
amax reduction over ranks.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest import lm_batches, tiny_llama  # noqa: E402

STEPS = 5
GLOBAL_BATCH = 8
MODE_HEADER = "=== distributed_worker mode: "
PLAN = {"default": "fp8", "layers": {"*.mlp.down_proj": "int4-g64", "lm_head": "bf16"}}
SMOOTHED_PLAN = {"default": "fp8", "layers": {"*.mlp.down_proj": "int4-g64-sq", "lm_head": "bf16"}}


def dataset_rows() -> list[list[int]]:
    ids = torch.cat([b["input_ids"] for b in lm_batches(n=STEPS, batch=GLOBAL_BATCH, seq=32, seed=3)])
    return ids.tolist()


def world() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def run_trainer(
    out: Path, sync: bool | None, fp32: bool, auto: bool = False, smoothed: bool = False, compensated: bool = False
) -> tuple[list[float], torch.nn.Module]:
    """``auto``: plan="auto" scanned on each rank's first batches after DDP wrapped the model (rank 0's plan
    is broadcast); the budget puts every Linear in FP8, so every world size ends with the same plan. ``smoothed``:
    ``SMOOTHED_PLAN``, whose '-sq' layers calibrate on each rank's own first batches after DDP wrapped the model.
    ``compensated``: bf16 weights, their updates Kahan-compensated (``compensation="kahan"``)."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    from hf_lowprec.training.callback import LowPrecisionCallback

    _, size = world()
    rows = dataset_rows()
    ds = Dataset.from_dict({"input_ids": rows, "labels": rows})
    args = TrainingArguments(
        str(out / "run"), use_cpu=True, max_steps=STEPS, per_device_train_batch_size=GLOBAL_BATCH // size,
        learning_rate=3e-3, logging_steps=1, report_to=[], save_strategy="no", train_sampling_strategy="sequential",
        ddp_backend="gloo" if size > 1 else None, disable_tqdm=True, seed=0,
    )  # fmt: skip
    model = tiny_llama().to(torch.bfloat16 if compensated else torch.float32)
    if auto:
        cb = LowPrecisionCallback(formats=("fp8",), budget={"min_fp8_fraction": 1.0}, calibration_batches=2, sync=sync)
    else:
        compensation = "kahan" if compensated else None
        cb = LowPrecisionCallback(SMOOTHED_PLAN if smoothed else PLAN, sync=sync, compensation=compensation)
    callbacks = [] if fp32 else [cb]
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=callbacks)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], model


def run_accelerate(
    out: Path, sync: bool | None, spike: str | None = None, compensated: bool = False
) -> tuple[list[float], torch.nn.Module]:
    """Accelerate + plugin; then a forward on rank 0 alone. ``spike``: gradient scaling that skips a step on a spike,
    one rank alone seeing one at step 3 and writing ``out/skipped<rank>.json``: ``"rank0"`` its loss x 1e4, each rank
    judging its own gradients (``sync=False``); ``"nan-rank1"`` a NaN loss, the amaxes synced (the default).
    ``compensated``: bf16 weights, their updates Kahan-compensated."""
    from accelerate import Accelerator

    from hf_lowprec.training.accelerate import LowPrecisionPlugin

    rank, size = world()
    accelerator = Accelerator(cpu=True)
    model = tiny_llama().to(torch.bfloat16 if compensated else torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rows = torch.tensor(dataset_rows())
    loader = torch.utils.data.DataLoader([{"input_ids": r, "labels": r} for r in rows], batch_size=GLOBAL_BATCH // size)
    skip_sync = False if spike == "rank0" else sync
    skipping = {"scaler": "gradient", "scaler_options": {"spike_action": "skip"}, "sync": skip_sync}
    spiked_rank, factor = (0, 1e4) if spike == "rank0" else (1, float("nan"))
    compensation = "kahan" if compensated else None
    lowprec = LowPrecisionPlugin(PLAN, **(skipping if spike else {"sync": sync}), compensation=compensation)
    model, optimizer, loader = lowprec.prepare(accelerator, model, optimizer, loader)
    losses = []
    for step, batch in enumerate(loader):
        loss = model(**batch).loss
        accelerator.backward(loss * (factor if spike and step == 3 and rank == spiked_rank else 1.0))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.gather(loss.detach()[None]).mean().item())
    (out / f"skipped{rank}.json").write_text(json.dumps(lowprec.steps_skipped))
    unwrapped = accelerator.unwrap_model(model)
    if accelerator.is_main_process:  # a forward on one rank alone, in eval mode: no collective (it waited for rank 1)
        with torch.no_grad():
            unwrapped.eval()(input_ids=rows[:2])
        unwrapped.train()
    accelerator.wait_for_everyone()
    return losses, unwrapped


def run_fsdp2(out: Path, sync: bool | None) -> tuple[list[float], torch.nn.Module]:
    """FSDP2 straight from torch (Accelerate enables FSDP only on accelerators, not for CPU processes)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from hf_lowprec.training.accelerate import LowPrecisionPlugin

    rank, size = world()
    if size > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    model = tiny_llama()
    LowPrecisionPlugin(PLAN, sync=sync).convert(model)  # before sharding
    if size > 1:
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)  # FSDP2: built on the sharded parameters
    rows = torch.tensor(dataset_rows())
    per = GLOBAL_BATCH // size
    losses = []
    for step in range(STEPS):
        ids = rows[step * GLOBAL_BATCH + rank * per : step * GLOBAL_BATCH + (rank + 1) * per]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        if size > 1:
            dist.all_reduce(mean)
        losses.append(mean.item() / size)
    if size > 1:  # shards are no model to export: said in one line (a deepcopy AssertionError from FSDP before)
        from hf_lowprec.export import export_model

        try:
            export_model(model, None, out / f"export{rank}", {})
        except ValueError as e:
            (out / f"export{rank}.txt").write_text(str(e))
    return losses, model


def refuse_smoothing_on_first_forwards(out: Path) -> None:
    """The plugin prepared with ``SMOOTHED_PLAN`` and a DataLoader of tuples, which cannot calibrate '-sq' layers: each
    rank would calibrate on its own first forward. Writes the refusal to ``out/refused<rank>.txt``."""
    from accelerate import Accelerator

    from hf_lowprec.training.accelerate import LowPrecisionPlugin

    rank, size = world()
    accelerator = Accelerator(cpu=True)
    model = tiny_llama()
    rows = torch.tensor(dataset_rows())
    loader = torch.utils.data.DataLoader([(r, r) for r in rows], batch_size=GLOBAL_BATCH // size)
    try:
        LowPrecisionPlugin(SMOOTHED_PLAN).prepare(accelerator, model, torch.optim.AdamW(model.parameters()), loader)
        refusal = ""
    except ValueError as e:
        refusal = str(e)
    (out / f"refused{rank}.txt").write_text(refusal)


def run(mode: str, out: Path, sync: bool | None = None, fp32: bool = False) -> None:
    """Train in ``mode`` and write ``out/losses.json`` (rank 0) and ``out/rank<r>.safetensors``."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    if mode == "smoothed-tuples":
        return refuse_smoothing_on_first_forwards(out)
    torch.manual_seed(0)
    torch.set_num_threads(1)  # as torch.distributed.run sets for each process: same kernels, same rounding
    if mode.startswith("trainer"):
        losses, model = run_trainer(out, sync, fp32, auto=mode == "trainer-auto", smoothed=mode == "trainer-smoothed",
                                    compensated=mode == "trainer-compensated")  # fmt: skip
    elif mode in ("plugin", "plugin-compensated"):
        losses, model = run_accelerate(out, sync, compensated=mode == "plugin-compensated")
    elif mode == "spike-on-one-rank":
        losses, model = run_accelerate(out, sync, spike="rank0")
    elif mode == "nan-on-rank-1":
        losses, model = run_accelerate(out, sync, spike="nan-rank1")
    else:
        losses, model = run_fsdp2(out, sync)
    rank, size = world()
    # FSDP2 parameters are DTensor shards: gather the full tensor on every rank
    sharded = any(hasattr(p, "full_tensor") for p in model.parameters())
    params = {n: getattr(p, "full_tensor", p.detach)().detach().float().contiguous().clone() for n, p in model.named_parameters()}
    save_file(params, str(out / f"rank{rank}.safetensors"))
    if rank == 0:
        plan = getattr(model, "hf_lowprec_plan", None)
        record = {"world": size, "losses": losses, "sharded": sharded, "plan": plan and plan.to_dict()}
        (out / "losses.json").write_text(json.dumps(record))


def main() -> None:
    modes, out = sys.argv[1].split(","), Path(sys.argv[2])
    sync = False if "--no-sync" in sys.argv else None
    for mode in modes:  # several modes share one launch (process start-up dominates the cost)
        if os.environ.get("RANK", "0") == "0":  # where its messages start in the launch's output
            print(f"{MODE_HEADER}{mode}", file=sys.stderr, flush=True)
        run(mode, out / mode, sync, fp32="--fp32" in sys.argv)
    if torch.distributed.is_initialized():  # left to interpreter exit, gloo's threads sometimes abort a rank (SIGABRT)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
