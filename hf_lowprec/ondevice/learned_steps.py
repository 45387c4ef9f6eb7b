"""Learned steps of the frozen INT4 base: each packed layer's group steps and zero points train with the LoRA
adapters (PEQA, arXiv:2305.14152, which learns the steps; here the zero points too), through a gain and a shift per
group (:meth:`~hf_lowprec.modules.packed.PackedLinear.learn_steps`); the INT4 codes stay frozen and the export holds
the steps and zero points with them folded in.

They train with their own learning rate, ``STEP_GAIN_LR_SCALE`` times the adapters', without weight decay (which
would pull a gain towards zero, not towards one).
"""

from __future__ import annotations

import torch
from torch import nn

from hf_lowprec.modules.packed import PackedLinear

# the gains' learning rate over the adapters' (AdamW: a gain moves by about lr per step, i.e. 0.1% of its step at the
# adapters' usual 2e-4): SmolLM2-135M, every linear int4-g64-asym, LoftQ, 100 steps of 4x256 tokens, seed 0 (prototype
# of this module): 5x: held-out perplexity 37.38 against 40.17 without learned steps, bf16 LoRA 37.24
STEP_GAIN_LR_SCALE = 5.0


def learn_base_steps(model: nn.Module) -> list[nn.Parameter]:
    """Make the steps and zero points of every packed linear of ``model`` trainable; returns the new parameters
    (gains and shifts, ``[N, G]`` fp32 each)."""
    return [p for m in model.modules() if isinstance(m, PackedLinear) for p in m.learn_steps()]


def learned_steps(model: nn.Module) -> list[nn.Parameter]:
    """The trainable step gains and zero shifts of ``model``'s packed linears (none unless they learn their steps)."""
    return [p for m in model.modules() if isinstance(m, PackedLinear) for p in (m.step_gain, m.zero_shift)
            if p is not None and p.requires_grad]  # fmt: skip


def fold_learned_steps(model: nn.Module) -> None:
    """Round what ``model``'s packed linears learned into their stored steps and zero points
    (:meth:`~hf_lowprec.modules.packed.PackedLinear.fold_learned_steps`), so that the model evaluated after training is
    the one its export holds."""
    for m in model.modules():
        if isinstance(m, PackedLinear):
            m.fold_learned_steps()


def give_learned_steps_their_group(optimizer: torch.optim.Optimizer, learned: list[nn.Parameter]) -> None:
    """Move ``learned`` (:func:`learned_steps`) out of ``optimizer``'s parameter groups into one of their own: the first
    group's options, the learning rate ``STEP_GAIN_LR_SCALE`` times its, no weight decay. Call before the first step
    (and before a learning rate scheduler is made, which then scales both groups alike)."""
    if not learned:
        return
    ids = {id(p) for p in learned}
    first = optimizer.param_groups[0]
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) not in ids]
    optimizer.param_groups = [g for g in optimizer.param_groups if g["params"]]
    options = {k: v for k, v in first.items() if k != "params"}
    group = {**options, "params": learned, "lr": first["lr"] * STEP_GAIN_LR_SCALE, "weight_decay": 0.0}
    optimizer.add_param_group(group)
