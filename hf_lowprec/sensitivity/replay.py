"""Block replay: a measured pass replays the blocks that finished before its layer first runs, from the
unquantized pass, instead of computing them again.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import nn

from hf_lowprec.layers import decoder_blocks
from hf_lowprec.sensitivity.units import _Unit

Progress = Callable[[int, int, str], None]


class _BlockReplay:
    """Outputs of the model's blocks (:func:`~hf_lowprec.layers.decoder_blocks`: its decoder layers)
    recorded in the unquantized pass, so that a measured pass for one layer replays the blocks that
    finished before the layer first runs — their inputs are unchanged — instead of computing them.

    Recording hooks stay in ``hooks`` until :meth:`stop`; :meth:`replaying` swaps a block's
    ``forward`` for the recorded output and restores it afterwards (a block called more than once
    per forward, or returning something other than tensors, is always computed).
    """

    def __init__(self, model: nn.Module, units: list[_Unit], hooks: list):
        self.blocks = decoder_blocks(model)
        self.outputs: list[list] = [[] for _ in self.blocks]
        self.calls = [0] * len(self.blocks)
        self.end: list[int | None] = [None] * len(self.blocks)
        self.start: dict[int, int] = {}
        self.clock, self.batch, self.recorded = 0, 0, 0
        self._recording = [b.register_forward_hook(self._finished(k)) for k, b in enumerate(self.blocks)]
        self._recording += [m.register_forward_pre_hook(self._started) for u in units for _, m in u.members]
        hooks.extend(self._recording)
        self._hooks = hooks

    def _started(self, module, args):
        self.clock += 1
        if self.batch == 0:
            self.start.setdefault(id(module), self.clock)

    def _finished(self, k: int):
        def hook(module, args, out):
            self.clock += 1
            if self.batch == 0:
                self.calls[k] += 1
                self.end[k] = self.clock
            self.outputs[k].append(_detached(out))

        return hook

    def next_batch(self) -> None:
        self.recorded += 1
        self.batch = self.recorded

    def stop(self) -> None:
        """Stop recording (after the unquantized pass)."""
        for h in self._recording:
            h.remove()
            self._hooks.remove(h)
        self._recording = []

    def skippable(self, unit: _Unit) -> list[int]:
        starts = [self.start.get(id(m)) for _, m in unit.members]
        if None in starts:  # a layer the first batch never ran (an MoE expert no token went to): nothing replayed
            return []
        first = min(starts)
        return [
            k
            for k, end in enumerate(self.end)
            if end is not None
            and end < first
            and self.calls[k] == 1
            and len(self.outputs[k]) == self.recorded
            and all(o is not None for o in self.outputs[k])
        ]

    @contextmanager
    def replaying(self, blocks: list[int]):
        saved = [(self.blocks[k], self.blocks[k].__dict__.get("forward")) for k in blocks]
        try:
            for k in blocks:
                self.blocks[k].forward = self._replay(k)
            yield
        finally:
            for block, forward in saved:
                if forward is None:
                    del block.forward
                else:
                    block.forward = forward

    def _replay(self, k: int):
        def forward(*args, **kwargs):
            return _cloned(self.outputs[k][self.batch])

        return forward


def _detached(out):
    """A detached copy of a tensor or a tuple of tensors (None for anything else)."""
    if torch.is_tensor(out):
        return out.detach().clone()
    if isinstance(out, tuple) and all(torch.is_tensor(o) or o is None for o in out):
        return tuple(None if o is None else o.detach().clone() for o in out)
    return None


def _cloned(out):
    return out.clone() if torch.is_tensor(out) else tuple(None if o is None else o.clone() for o in out)
