"""Learned steps of the frozen INT4 base: each packed layer's group steps and zero points train with the LoRA
adapters (PEQA, arXiv:2305.14152, which learns the steps; here the zero points too), through a gain and a shift per
group (:meth:`~hf_lowprec.modules.packed.PackedLinear.learn_steps`); the INT4 codes stay frozen and the export holds
the steps and zero points with them folded in. ``learn_steps="zero_points"`` learns the shifts alone: their gradient
is the output gradient times the inputs' group sums, no weight-gradient GEMM (SmolLM2-135M, 100 steps, 3 seeds:
1.005x ± 0.011 bf16 LoRA's held-out perplexity against 1.003x ± 0.010 with the steps too, 1.079x with neither).

They train with their own learning rates, ``LR_SCALES`` times the adapters', without weight decay (which would pull a
gain towards zero, not towards one).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import types
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from torch import nn

from hf_lowprec.modules.packed import PackedInt4Linear, PackedLinear

logger = logging.getLogger(__name__)
_FOLDED_IN = contextvars.ContextVar("hf_lowprec_learned_steps_folded_in", default=False)
LEARNED_STEPS_FILE = "hf_lowprec_learned_steps.safetensors"  # a checkpoint's step gains and zero shifts, by name

# learning rates over the adapters' (AdamW moves a parameter by about lr per step). A gain of 1 + 1e-3 moves a weight
# by up to 15 x 1e-3 of its step (|code - zero| <= 15), a zero shift of 1e-3 by 1e-3 of it: the shifts take a 10x
# rate. SmolLM2-135M, every linear int4-g64-asym, LoftQ, 100 steps of 4x256 tokens, seed 0, held-out perplexity (bf16
# LoRA 37.24; no learned steps 40.17): gains and shifts at 5x / 50x the adapters' 2e-4 37.38 (a prototype of this
# module), 5x / 5x 38.15, gains alone at 5x 38.26
LR_SCALES = {"step_gain": 5.0, "zero_shift": 50.0}


LEARN_STEPS = (False, True, "zero_points")
"""What a frozen base may learn: nothing, its steps and zero points, or its zero points alone (``learn_steps``)."""


def check_learn_steps(value) -> None:
    """Raise ``ValueError`` naming the allowed values unless ``value`` is one of :data:`LEARN_STEPS`."""
    if not isinstance(value, bool) and value != "zero_points":  # not `in LEARN_STEPS`: 1 == True, 0 == False
        raise ValueError(f"learn_steps must be false, true or 'zero_points', got {value!r}")


def learned_kinds(learn_steps) -> str:
    """What a ``learn_steps`` value makes the base learn, in words (``""`` for ``False``)."""
    return {True: "steps and zero points", "zero_points": "zero points"}.get(learn_steps, "")


def learn_base_steps(model: nn.Module, steps: bool = True) -> list[nn.Parameter]:
    """Make the steps and zero points of every packed INT4 linear of ``model`` trainable (``steps=False``: the zero
    points alone, whose gradient needs no weight-gradient GEMM); returns the new parameters (gains and shifts,
    ``[N, G]``: gains fp32, shifts in the zero points' dtype). int8 layers keep theirs: 255 levels leave a step
    little to learn, and a large output head's (Llama-3.2-1B: 263M weights, called once per chunk of the loss) would
    cost a weight-gradient pass over the whole head per chunk: 3x the step time and 0.6 GB more at 1x256 when it
    learned them too."""
    return [p for m in model.modules() if isinstance(m, PackedInt4Linear) for p in m.learn_steps(steps)]


def learned_steps(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """The trainable step gains and zero shifts of ``model``'s packed linears by kind (``step_gain``, ``zero_shift``;
    empty lists unless they learn their steps)."""
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    return {kind: [p for m in packed if (p := getattr(m, kind)) is not None and p.requires_grad] for kind in LR_SCALES}


def keep_learned_steps_with_adapters(model: PeftModel) -> None:
    """Have ``model``'s ``save_pretrained`` (PEFT's; the one every trainer's checkpoints and ``save_model`` call) write
    the step gains and zero shifts its base learns beside the adapters (``LEARNED_STEPS_FILE``), and its
    ``load_adapter`` (what a Trainer resuming a checkpoint or loading the best one calls) read them back and keep the
    dtype of the adapters it reloads (PEFT casts bf16 ones to fp32). Without them a checkpoint resumed, or the best
    one loaded at the end, ran with the last step's zero points (or none) beside its adapters, silently. A fresh
    ``PeftModel.from_pretrained`` does not read the file: said, once, at the first save."""
    model.save_pretrained = types.MethodType(_save_pretrained_with_learned_steps, model)
    model.load_adapter = types.MethodType(_load_adapter_keeping_learned_steps, model)


def checkpoints_read_back(model: nn.Module) -> None:
    """Leave unsaid, at ``model``'s saves, that a ``PeftModel.from_pretrained`` on another base would not read its
    learned steps: its checkpoints are read back by the trainer that writes them (``ChunkedLossTrainer``: a resumed
    run, the best checkpoint loaded at the end)."""
    model.__dict__["_hf_lowprec_told"] = True


def learned_steps_by_name(model: nn.Module) -> dict[str, nn.Parameter]:
    """``model``'s trainable step gains and zero shifts (:func:`learned_steps`) by parameter name."""
    learned = {id(p) for params in learned_steps(model).values() for p in params}
    return {n: p for n, p in model.named_parameters() if id(p) in learned}


def _save_pretrained_with_learned_steps(self: PeftModel, save_directory, *args, **kwargs):
    saved = type(self).save_pretrained(self, save_directory, *args, **kwargs)
    learned = learned_steps_by_name(self)
    if not learned or _FOLDED_IN.get() or not kwargs.get("is_main_process", True):
        return saved  # an export folds them into the base's steps and zero points, which it writes
    path = os.path.join(save_directory, LEARNED_STEPS_FILE)
    save_file({n: p.detach().contiguous() for n, p in learned.items()}, path + ".tmp")
    os.replace(path + ".tmp", path)
    if not self.__dict__.get("_hf_lowprec_told"):
        self.__dict__["_hf_lowprec_told"] = True
        kinds = " and ".join(kind.replace("_", " ") + "s" for kind, params in learned_steps(self).items() if params)
        logger.warning(
            "save_pretrained writes the %s the INT4 base learned beside the LoRA adapters (%s): this model's "
            "load_adapter and a Trainer resuming it read them, a PeftModel.from_pretrained on another base does not; "
            "export_int4_lora (hf-lowprec export) writes a folder that reloads whole",
            kinds, LEARNED_STEPS_FILE,
        )  # fmt: skip
    return saved


@contextlib.contextmanager
def trained_dtypes_kept(model: nn.Module) -> Iterator[None]:
    """Within: a reload of ``model``'s adapters (PEFT's ``load_adapter``, which casts bf16 ones to fp32); after it,
    each trainable parameter that was there before has its dtype back (a resumed run trained other numerics, slower,
    than the run it continued)."""
    dtypes = {name: p.dtype for name, p in model.named_parameters() if p.requires_grad}
    yield
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in dtypes and p.dtype != dtypes[name]:
                p.data = p.data.to(dtypes[name])


def _load_adapter_keeping_learned_steps(self: PeftModel, model_id, adapter_name, *args, **kwargs):
    with trained_dtypes_kept(self):
        loaded = type(self).load_adapter(self, model_id, adapter_name, *args, **kwargs)
    learned = learned_steps_by_name(self)
    folder = Path(model_id)
    # beside the adapters, or one folder up for an adapter PEFT saved into a subfolder of its name (not "default"):
    # the steps, the base's, are saved once at the top, and a Trainer resumes such an adapter from its subfolder
    places = [folder, folder.parent] if folder.name == adapter_name else [folder]
    path = next((p / LEARNED_STEPS_FILE for p in places if (p / LEARNED_STEPS_FILE).is_file()), None)
    with torch.no_grad():
        if learned and path:
            for name, saved in load_file(path).items():
                learned[name].copy_(saved)
        elif learned:
            logger.warning(
                "%s holds no %s: the INT4 base keeps the step gains and zero shifts it has (it was saved by a run that "
                "did not learn them, or by PEFT alone)", model_id, LEARNED_STEPS_FILE,
            )  # fmt: skip
    return loaded


@contextlib.contextmanager
def learned_steps_folded_in() -> Iterator[None]:
    """Within: a ``save_pretrained`` whose caller folded the learned steps into the base it writes (an export): no
    file of them beside the adapters, nothing said."""
    token = _FOLDED_IN.set(True)
    try:
        yield
    finally:
        _FOLDED_IN.reset(token)


def fold_learned_steps(model: nn.Module) -> None:
    """Round what ``model``'s packed linears learned into their stored steps and zero points
    (:meth:`~hf_lowprec.modules.packed.PackedLinear.fold_learned_steps`), so that the model evaluated after training is
    the one its export holds."""
    for m in model.modules():
        if isinstance(m, PackedLinear):
            m.fold_learned_steps()


def give_learned_steps_their_groups(optimizer: torch.optim.Optimizer, learned: Mapping[str, list]) -> None:
    """Move ``learned`` (:func:`learned_steps`) out of ``optimizer``'s parameter groups into a group per kind: the
    first group's options, the learning rate ``LR_SCALES[kind]`` times its, no weight decay. Call before the first
    step (and before a learning rate scheduler is made, which then scales every group alike)."""
    ids = {id(p) for params in learned.values() for p in params}
    if not ids:
        return
    first = optimizer.param_groups[0]
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) not in ids]
    optimizer.param_groups = [g for g in optimizer.param_groups if g["params"]]
    options = {k: v for k, v in first.items() if k != "params"}
    for kind, params in learned.items():
        if params:
            lr = first["lr"] * LR_SCALES[kind]
            optimizer.add_param_group({**options, "params": params, "lr": lr, "weight_decay": 0.0})
