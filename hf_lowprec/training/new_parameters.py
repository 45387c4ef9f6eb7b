"""Parameters a conversion adds after the optimizer exists (learned INT4 steps), and getting them trained.

``apply_plan`` may create new ``nn.Parameter`` objects (LSQ steps); an optimizer built earlier never
sees them. Two ways to hand them over, for two kinds of caller:

- :func:`add_new_parameters`: one new param group (weight decay 0), the LR scheduler extended, for
  plain training loops;
- :func:`insert_new_parameters`: into the group of their layer's weight (its twin without weight decay, where
  there is one), in the model's parameter order — the layout ``Trainer`` builds for an already converted model
  (:func:`without_learned_parameters` keeps them out of its decayed group), so optimizer state saved by either loads
  into the other (the callback and the Accelerate plugin use it).

:func:`align_new_parameters` makes each train exactly when its layer's weight does, and
:func:`orphaned_parameters` names anything trainable that no optimizer group holds.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from hf_lowprec.modules import LOW_PRECISION_TYPES
from hf_lowprec.ranks import on_main_process

logger = logging.getLogger(__name__)


def _owner_weights(model: nn.Module) -> dict[int, nn.Parameter]:
    """``id(extra parameter) -> weight`` for parameters a low-precision layer adds (learned steps)."""
    owners = {}
    for module in model.modules():
        if isinstance(module, LOW_PRECISION_TYPES):
            for name, p in module.named_parameters():
                if name not in ("weight", "bias"):
                    owners[id(p)] = module.weight
    return owners


def align_new_parameters(model: nn.Module, params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    """Make each new parameter train exactly when its layer's weight does; returns the trainable ones."""
    owners = _owner_weights(model)
    trainable = []
    for p in params:
        weight = owners.get(id(p))
        if weight is None:
            raise ValueError("a new parameter does not belong to a low-precision layer of this model")
        p.requires_grad_(weight.requires_grad)
        if p.requires_grad:
            trainable.append(p)
    return trainable


def insert_new_parameters(optimizer: torch.optim.Optimizer, model: nn.Module, params: Iterable[nn.Parameter]) -> int:
    """Put each new parameter into the optimizer group that holds its layer's weight; returns how many.

    Each touched group is re-ordered to the model's parameter order, which is the layout the Trainer
    builds for a model converted before it (so optimizer state saved by either loads into the other).
    A parameter whose weight is in no group is frozen (its layer does not train).
    """
    owners = _owner_weights(model)
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    order = {id(p): i for i, p in enumerate(model.parameters())}
    touched, decayed, count = [], set(), 0
    for p in params:
        if id(p) in group_of:
            continue  # already there: never twice
        group = group_of.get(id(owners.get(id(p))))
        if group is None:
            logger.info("a learned step's layer weight is not in the optimizer; the step stays fixed")
            p.requires_grad_(False)
            continue
        group = _without_decay(optimizer, group)
        if group.get("weight_decay"):
            decayed.add(group["weight_decay"])
        group["params"].append(p)
        group_of[id(p)] = group
        touched.append(group)
        count += 1
    for group in {id(g): g for g in touched}.values():
        group["params"].sort(key=lambda q: order.get(id(q), len(order)))
    if decayed and on_main_process():  # once per call, not per learned step (nor per rank)
        logger.warning(
            "learned steps join their weights' param group, with its weight_decay %s (it shrinks them each step): "
            "give the optimizer a group of the same settings and weight_decay 0 for them, or pass learn_scales=False",
            " / ".join(f"{d:g}" for d in sorted(decayed)),
        )
    return count


def _without_decay(optimizer: torch.optim.Optimizer, group: dict) -> dict:
    """``group``, or where it decays weights, the group of the same other hyperparameters without decay (the
    Trainer's second group, where :func:`without_learned_parameters` has it put them), if there is one: decay pulls
    learned steps toward 0 (a finer grid, more clipping) every step. Else ``group`` (the caller warns)."""
    if not group.get("weight_decay"):
        return group

    def others(g: dict) -> dict:
        return {k: v for k, v in g.items() if k not in ("params", "weight_decay")}

    for candidate in optimizer.param_groups:
        try:
            if not candidate.get("weight_decay") and others(candidate) == others(group):
                return candidate
        except RuntimeError:  # a tensor-valued hyperparameter (capturable lr): not compared
            continue
    return group


def without_learned_parameters(decayed: list[str], model: nn.Module) -> list[str]:
    """``decayed`` (parameter names, as ``Trainer.get_decay_parameter_names`` gives them) without the parameters
    low-precision layers add (learned steps), which the Trainer would otherwise decay."""
    owned = _owner_weights(model)
    learned = {n for n, p in model.named_parameters() if id(p) in owned}
    return [n for n in decayed if n not in learned]


def orphaned_parameters(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Names of trainable parameters of ``model`` that no optimizer group holds."""
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    return [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in held]


def add_new_parameters(
    optimizer: torch.optim.Optimizer,
    params: Mapping[str, nn.Parameter] | Iterable[nn.Parameter],
    lr: float | None = None,
    weight_decay: float = 0.0,
    scheduler=None,
) -> int:
    """Add the parameters not yet in ``optimizer`` as one new param group; returns how many were added.

    For learned steps made after the optimizer (``apply_plan(...).new_parameters``). ``lr``: the group's
    learning rate (default: the optimizer's default); ``weight_decay`` 0 (decay would shrink steps).
    ``scheduler``: an LR scheduler built on ``optimizer`` (``LambdaLR`` family) to extend, so the new
    group follows the same schedule.
    """
    params = list(params.values()) if isinstance(params, Mapping) else list(params)
    known = {id(p) for group in optimizer.param_groups for p in group["params"]}
    new, seen = [], set()
    for p in params:
        if p.requires_grad and id(p) not in known and id(p) not in seen:
            new.append(p)
            seen.add(id(p))
    if not new:
        return 0
    group = {"params": new, "weight_decay": weight_decay}
    if lr is not None:
        group["lr"] = lr
    optimizer.add_param_group(group)
    if scheduler is not None:
        added = optimizer.param_groups[-1]
        base_lr = added["lr"]
        added.setdefault("initial_lr", base_lr)
        scheduler.base_lrs.append(base_lr)
        if hasattr(scheduler, "lr_lambdas"):
            scheduler.lr_lambdas.append(scheduler.lr_lambdas[0])
        if hasattr(scheduler, "_last_lr"):
            factor = scheduler._last_lr[0] / scheduler.base_lrs[0] if scheduler.base_lrs[0] else 1.0
            added["lr"] = base_lr * factor
            scheduler._last_lr.append(added["lr"])
    return len(new)


__all__ = [
    "add_new_parameters",
    "align_new_parameters",
    "insert_new_parameters",
    "orphaned_parameters",
    "without_learned_parameters",
]
