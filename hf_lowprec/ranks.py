"""The default process group this process trains in: its rank and size (``(0, 1)`` without one)."""

from __future__ import annotations

import torch


def distributed() -> bool:
    """Whether a default process group is initialized."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def process_world() -> tuple[int, int]:
    """``(rank, world size)`` of the default process group (``(0, 1)`` when none)."""
    if distributed():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def on_main_process() -> bool:
    """Whether this process is rank 0 (or alone): the one that says what every rank decides alike."""
    return process_world()[0] == 0
