"""The one training step of the benchmarks' loops (torch only, so the GPU script can use it on a bare image)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def train_step(
    loss_fn: Callable[[], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    params,
    *,
    scheduler=None,
    max_grad_norm: float | None = 1.0,
    after_backward: Callable[[], None] | None = None,
) -> float:
    """One optimizer step shared by the benchmarks' training loops: forward (``loss_fn()``), backward, gradient
    clipping of ``params`` at ``max_grad_norm`` (``None``: none), the optimizer and scheduler steps, gradients
    freed. ``after_backward()`` runs between backward and the optimizer (memory accounting). Returns the loss."""
    loss = loss_fn()
    loss.backward()
    if after_backward is not None:
        after_backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()
