"""What an exported folder holds besides its weights: the file names, the run record (hardware, per-layer plan
record) and reading and writing it with the card.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

import torch
from torch import nn

from hf_lowprec.checkpoints import TOKENIZER_FILES
from hf_lowprec.export.card import render_model_card
from hf_lowprec.folders import RUN_FILE
from hf_lowprec.layers import canonical_name, dense_views, eligible_layers
from hf_lowprec.modules import LOW_PRECISION_TYPES, FP8Linear
from hf_lowprec.modules.kernels.cpu import cpu_info
from hf_lowprec.modules.packed_embedding import tied_head_names
from hf_lowprec.ondevice.export import ADAPTER_CONFIG, adapter_folder
from hf_lowprec.plan import PLAN_FILE, PrecisionPlan  # noqa: F401  (re-exported: the folder's file names)

CARD_FILE = "README.md"
WEIGHTS_FILE, WEIGHTS_INDEX = "model.safetensors", "model.safetensors.index.json"
CARD_SHA256 = "card_sha256"  # the run record's key for the SHA-256 of the card written with it
TOKENIZER_KEY = "tokenizer_files"  # the run record's list of the tokenizer's files the folder holds
TOKENIZER_EXTRAS = ("merges.txt", "chat_template.jinja")  # tokenizer files besides TOKENIZER_FILES a load reads
# files a run folder holds that an export does not publish
RUN_ONLY = ("checkpoints", "log_history.json")
# never published (pushed or copied into an export): hidden files and folders (.DS_Store, .ipynb_checkpoints, .cache),
# unfinished writes (an interrupted run's folder, huggingface_hub's downloads)
UNPUBLISHED_SUFFIXES = (".tmp", ".partial", ".incomplete")


def evaluation_numerics(record: Mapping) -> tuple[torch.dtype | None, int, str]:
    """How a run computed its held-out loss: ``(autocast dtype or None, batch size, description)``. Full training
    evaluates with its plan's low-precision layers in place, under bf16 autocast where it trained in bf16; tensorwise
    FP8 scales span the whole batch, so the batch size is part of the figure too."""
    recipe = record.get("recipe", {})
    batch = recipe.get("training", {}).get("per_device_train_batch_size", 4)
    dtype = record.get("compute", {}).get("dtype", "float32")
    if recipe.get("method") != "full":
        return None, batch, f"the packed base with its LoRA adapters in {dtype}, batch {batch}"
    autocast = torch.bfloat16 if dtype == "bfloat16" else None
    return autocast, batch, f"the plan's numerics{', bf16 autocast' if autocast else ''}, batch {batch}"


def hardware_info() -> dict:
    """What the run ran on: device, its name, CPU cores and capabilities, torch version, whether FP8 tensor cores
    exist."""
    info = {
        "device": "cpu",
        "name": cpu_info().model,
        "cpu_cores": os.cpu_count(),
        "torch": torch.__version__,
        "cpu": cpu_info().to_dict(),
    }
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        info.update(
            device="cuda",
            name=torch.cuda.get_device_name(),
            compute_capability=f"{cap[0]}.{cap[1]}",
            gpus=torch.cuda.device_count(),
        )
        info["fp8_tensor_cores"] = cap >= (8, 9)
    else:
        info["fp8_tensor_cores"] = False
    return info


# ------------------------------------------------------------------------------ plan records
def plan_record(model: nn.Module, plan: PrecisionPlan) -> tuple[list[dict], list[dict]]:
    """``(per-layer [{name, format, params}], PrecisionPlan.summary rows)`` of what ``model``'s layers run under
    ``plan`` (frozen packed layers counted as the dense layers they were); a layer left as it was (``bf16``/``fp32``
    formats) also has ``stored``, the dtype its weight is kept in. A layer that could not run its planned
    format (a ``-rht`` one whose width no rotation block divides) is recorded in the format it runs, with
    ``planned``. An output head tied to the input embedding holds no parameters of its own: its row has ``params`` 0
    and ``tied_to``, the embedding's name, so the rows add up to the model's. An FP8 linear's row has ``backend``
    (``torchao``, ``emulated``: read from the layer as it is now, not from the plan's report, made before the model
    moved to its GPU) and, emulated, ``emulated_because``."""
    layers = dense_views(model)
    live = eligible_layers(model)
    assigned = plan.assign(layers)
    ran = {n: live[n].spec if isinstance(live[n], LOW_PRECISION_TYPES) else s for n, s in assigned.items()}
    tied = tied_head_names(model)
    head, embedding = (canonical_name(n) for n in tied) if tied else (None, None)
    per_layer = []
    for name, spec in ran.items():
        row = {"name": name, "format": spec.name, "params": 0 if name == head else layers[name].weight.numel()}
        row.update({"tied_to": embedding} if name == head else {})
        row.update({"planned": assigned[name].name} if assigned[name] != spec else {})
        row.update({"stored": _short_dtype(layers[name].weight.dtype)} if spec.is_high_precision else {})
        if isinstance(live[name], FP8Linear):  # its backend on the device it is on now, where it trained
            row["backend"] = live[name].backend
            if row["backend"] == "emulated":
                row["emulated_because"] = live[name].torchao_blocker() or "as asked (fp8_backend emulated)"
        per_layer.append(row)
    return per_layer, PrecisionPlan({n: s.name for n, s in ran.items()}).summary(layers)


def kept_layers_stored_in(run: dict, dtype: torch.dtype) -> None:
    """Make ``run``'s per-layer rows say its kept layers are stored in ``dtype`` (an export cast them: the card's
    per-layer "kept (fp32)" named the trained weights' dtype, not the folder's). The plan rows stay the training's."""
    for row in run.get("layers", []):
        if "stored" in row:
            row["stored"] = _short_dtype(dtype)


def _short_dtype(dtype: torch.dtype) -> str:
    """``fp32``, ``bf16``, ``fp16`` (as the plan's formats and :func:`~hf_lowprec.plan.row_label` name them), else
    torch's name."""
    short = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    return short.get(dtype) or str(dtype).removeprefix("torch.")


def read_run(folder: str | os.PathLike, whole: bool = True) -> dict:
    """The run record of an exported/run folder; ``ValueError`` if it is not one, or (``whole``) lacks a file the
    record names (:func:`missing_files`; ``whole=False`` for what reads the record alone)."""
    path = Path(folder) / RUN_FILE
    if not Path(folder).is_dir():
        raise ValueError(f"{str(folder)!r} is not a folder")
    if not path.is_file():
        raise ValueError(f"{str(folder)!r} is not an hf-lowprec run or export folder (no {RUN_FILE})")
    try:
        run = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{str(path)!r} is not a valid run record ({e}); export the run again") from None
    if not isinstance(run, dict):
        raise ValueError(f"{str(path)!r} is not a valid run record (a JSON object expected); export the run again")
    if whole and (missing := missing_files(Path(folder), run)):
        raise ValueError(
            f"{str(folder)!r} lacks {', '.join(missing)}, which its run record says it holds: copy the folder whole, "
            "or export the run again"
        )
    return run


def missing_files(folder: Path, run: Mapping) -> list[str]:
    """The files the run record ``run`` says ``folder`` holds and it does not: the model's config and weights (every
    shard an index names), the plan of packed or master weights, the LoRA adapters, the tokenizer's files (without
    them an export pushed and its card's loading snippet failed); a GGUF export's files as listed.
    (An export of a folder without its adapters said it held them, and a push uploaded it.)"""
    export = run.get("export") or {}
    if "files" in export:  # GGUF: what it wrote
        wanted = list(export["files"])
    else:
        index = folder / WEIGHTS_INDEX
        try:
            mapped = json.loads(index.read_text()).get("weight_map", {}) if index.is_file() else {}
        except (ValueError, AttributeError):  # not JSON, or not a mapping
            return [f"{WEIGHTS_INDEX} (unreadable)"]
        shards = sorted(set(mapped.values()))
        weights = shards or ([WEIGHTS_FILE] if not (folder / "pytorch_model.bin").is_file() else [])
        wanted = ["config.json", *weights]
        planned = export.get("weights") in ("int4-packed", "master") and export.get("loader") != "compressed-tensors"
        if run.get("plan") and planned:  # what hf-lowprec loads packed layers, or re-applies FP8 (--plan-numerics), by
            wanted.append(PLAN_FILE)
        if isinstance(adapter := run.get("adapter"), Mapping):  # where they are (older exports: adapter/)
            where = adapter_folder(folder) or folder / (adapter.get("folder") or ".")
            sub = PurePosixPath(os.path.relpath(where, folder))
            wanted += [str(sub / name) for name in (ADAPTER_CONFIG, "adapter_model.safetensors")]
    wanted += run.get(TOKENIZER_KEY, [])  # (exports made before 2026-12-08 list none)
    return [name for name in wanted if not (folder / name).exists()]


def write_record(
    folder: Path, run: Mapping, repo_id: str | None, extra_files: Mapping[str, str | bytes] | None
) -> None:
    """Run record, extra files and model card into ``folder`` (a temporary folder renamed into place as a whole).

    An extra file's name may hold sub-folders (``runs/<run>/events.out.tfevents...``)."""
    card = render_model_card(run, repo_id).content.encode()
    run = {**run, TOKENIZER_KEY: sorted(f for f in (*TOKENIZER_FILES, *TOKENIZER_EXTRAS) if (folder / f).is_file())}
    (folder / RUN_FILE).write_text(record_text(run, card))
    for name, data in (extra_files or {}).items():
        path = folder / relative_file_name(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data) if isinstance(data, bytes) else path.write_text(data)
    (folder / CARD_FILE).write_bytes(card)


def relative_file_name(name: str) -> str:
    """``name`` if it names a file inside a folder (relative, no ``..``), else ``ValueError``: a run record's file
    names (its ``loss_curve``) are read and written relative to a run or export folder, never outside it."""
    path = PurePosixPath(str(name).replace("\\", "/"))
    if path.is_absolute() or not path.parts or ".." in path.parts:
        raise ValueError(f"file name {name!r} of a run record leaves its folder: a relative name inside it expected")
    return str(name)


def record_text(run: Mapping, card: bytes) -> str:
    """The run record ``run`` as written beside ``card``: with the card's SHA-256, by which push tells a card edited
    by hand (uploaded as it is) from hf-lowprec's (re-rendered for the repo)."""
    return json.dumps({**run, CARD_SHA256: hashlib.sha256(card).hexdigest()}, indent=2, default=str) + "\n"


def published(path: Path, folder: Path) -> bool:
    """Whether ``path`` (a file in ``folder``) belongs to the published model: not hidden, not an unfinished write,
    not run-only (:data:`RUN_ONLY`)."""
    parts = path.relative_to(folder).parts
    return not any(p.startswith(".") or p.endswith(UNPUBLISHED_SUFFIXES) for p in parts) and parts[0] not in RUN_ONLY


def card_edited(folder: Path, run: Mapping) -> bool:
    """Whether ``folder``'s model card differs from the one hf-lowprec wrote with ``run`` (its ``CARD_SHA256``): edited
    by hand since (exports made before 2026-12-06 hold no hash: taken as unedited)."""
    card = Path(folder) / CARD_FILE
    written = run.get(CARD_SHA256)
    return written is not None and card.is_file() and hashlib.sha256(card.read_bytes()).hexdigest() != written
