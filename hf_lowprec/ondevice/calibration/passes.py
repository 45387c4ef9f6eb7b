"""Calibration passes: each group of layers' input Hessians (and inputs), gathered one decoder block at a time.

Sequential calibration (GPTQ's) rounds layers in model order, each on the inputs that the already-rounded layers
before it give. Only a bounded number of ``[K, K]`` Hessians fit in memory at once (:func:`hessian_groups`), so the
layers are taken in groups, one pass over the calibration tokens per group. Running the whole model for each group
costs a forward of every block up to the group's: quadratic in depth (Llama-3.2-1B's 16 blocks, two groups each: 272
block forwards per batch). Here the hidden states entering the current decoder block are kept (one ``[B, T, hidden]``
tensor per batch), so a group inside block ``i`` costs a forward of block ``i`` alone, and moving on one more: 64
block forwards at 1B (16 to record each block's own arguments, 32 partial, 16 whole). Layers outside the decoder
blocks (an INT4 output head) are calibrated after them, by whole-model passes.

Written here because the GPTQ implementations that do this (AutoGPTQ, llm-compressor's sequential pipeline) are
CUDA-only or quantize to their own formats; see :mod:`hf_lowprec.ondevice.calibration.gptq`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import torch
from torch import nn

HESSIAN_BUDGET_BYTES = 128 * 2**20  # fp32 Hessians alive at once (a 1536-input layer needs 9.4 MB; kept inputs add
# at most half as much again: _HessianHooks)


class _GroupDone(Exception):
    """Raised inside the forward once every layer of the group has seen its input: the rest is not needed."""


class _HessianHooks:
    """Forward pre-hooks accumulating ``X^T X`` (fp32 ``[K, K]``) of each listed Linear's input, and keeping ``X``
    itself (fp32 ``[T, K]``) where the ``tokens`` of the calibration are at most half its width ``K`` (a fraction of
    the output errors' cost, at most half the Hessian's memory); :meth:`run` stops the forward as soon as all of them
    have run."""

    def __init__(self, modules: dict[str, nn.Module], tokens: int):
        self.hessians = {  # on the layer's device: a GPU's inputs into a CPU Hessian failed (FP8 GPTQ on a GPU)
            name: torch.zeros(m.in_features, m.in_features, device=_device_of(m)) for name, m in modules.items()
        }
        self.inputs: dict[str, list[torch.Tensor]] = {n: [] for n, m in modules.items() if 2 * tokens <= m.in_features}
        self._seen: set[str] = set()
        self._handles = [m.register_forward_pre_hook(self._hook(name)) for name, m in modules.items()]

    def _hook(self, name: str):
        def hook(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            self.hessians[name].addmm_(x.T, x)
            if name in self.inputs:
                self.inputs[name].append(x.clone() if x.data_ptr() == args[0].data_ptr() else x)  # not a view: kept
            self._seen.add(name)
            if len(self._seen) == len(self.hessians):
                raise _GroupDone

        return hook

    def run(self, forward) -> None:
        """Call ``forward()`` (one batch through the model or a block), stopped once every layer has its input."""
        self._seen.clear()
        try:
            forward()
        except _GroupDone:
            pass

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def pop(self, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(hessian [K, K], inputs [T, K] or None)`` of layer ``name``, released from the hooks."""
        inputs = self.inputs.pop(name, None)
        return self.hessians.pop(name), None if inputs is None else torch.cat(inputs)


def _device_of(module: nn.Module) -> torch.device:
    """Where ``module``'s weights (parameters or packed buffers) lie."""
    tensor = next(itertools.chain(module.parameters(), module.buffers()), None)
    return torch.device("cpu") if tensor is None else tensor.device


def hessian_groups(sizes: dict[str, int], budget_bytes: int = HESSIAN_BUDGET_BYTES) -> list[list[str]]:
    """Consecutive layer names (model order) split so each group's ``K^2`` fp32 Hessians fit ``budget_bytes``."""
    groups: list[list[str]] = [[]]
    used = 0
    for name, k in sizes.items():
        need = 4 * k * k
        if groups[-1] and used + need > budget_bytes:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += need
    return groups


def decoder_blocks(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """``(fqn, blocks)``: the model's decoder blocks, the ``nn.ModuleList`` of modules of one type holding the most
    parameters (``model.layers`` of a transformers causal LM); ``None`` when it has none."""
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(set(map(type, m))) == 1]
    return max(lists, key=lambda item: sum(p.numel() for p in item[1].parameters()), default=None)


class _BlockInputs:
    """Per calibration batch, the hidden states entering the current decoder block, and each block's own keyword
    arguments (attention masks, which may differ between blocks, position embeddings), recorded in one forward."""

    def __init__(self, model: nn.Module, blocks: nn.ModuleList, batches: Sequence[torch.Tensor]):
        self.blocks, self.hidden = blocks, []
        self.kwargs: list[list[dict]] = [[] for _ in blocks]

        def record(index: int):
            def hook(module, args, kwargs):
                kwargs = dict(kwargs)
                if index == 0:
                    self.hidden.append(args[0] if args else kwargs["hidden_states"])
                kwargs.pop("hidden_states", None)
                self.kwargs[index].append(kwargs)
                if index == len(blocks) - 1:
                    raise _GroupDone  # the last block's arguments are known: its forward and the head are not needed

            return hook

        handles = [b.register_forward_pre_hook(record(i), with_kwargs=True) for i, b in enumerate(blocks)]
        try:
            for ids in batches:
                try:
                    model(input_ids=ids, use_cache=False)
                except _GroupDone:
                    pass
        finally:
            for h in handles:
                h.remove()

    def forward(self, index: int, batch: int):
        """Block ``index`` on batch ``batch``'s hidden states (those of block ``index``: see :meth:`advance`)."""
        out = self.blocks[index](self.hidden[batch], **self.kwargs[index][batch])
        return out[0] if isinstance(out, tuple) else out  # transformers < 4.54 returns (hidden_states, ...)

    def advance(self, index: int) -> None:
        """Replace the hidden states entering block ``index`` by those it gives (its layers rounded by now)."""
        self.hidden = [self.forward(index, b) for b in range(len(self.hidden))]
        self.kwargs[index] = []


def _gathered(modules: dict[str, nn.Module], tokens: int, forwards) -> _HessianHooks:
    """The Hessians (and kept inputs) of ``modules`` over ``forwards`` (callables, one per batch), hooks removed."""
    hooks = _HessianHooks(modules, tokens)
    try:
        for forward in forwards:
            hooks.run(forward)
    finally:
        hooks.remove()
    return hooks


@torch.no_grad()
def calibration_passes(
    model: nn.Module,
    layers: dict[str, nn.Module],
    batches: Sequence[torch.Tensor],
    budget_bytes: int = HESSIAN_BUDGET_BYTES,
) -> Iterator[tuple[list[str], _HessianHooks]]:
    """For each group of ``layers`` (fqn → Linear, model order) whose Hessians fit ``budget_bytes``: ``(names,
    hooks)`` after one pass over the token ``batches`` (``hooks.pop(name)`` gives a layer's Hessian and inputs).

    The caller rounds and replaces the group's layers before asking for the next group: later groups see the
    replaced layers' outputs. Layers inside the decoder blocks go block by block from each block's kept inputs;
    the others (and every layer of a model without decoder blocks) by whole-model passes, after them. The model runs
    in eval mode on its own device meanwhile (its mode restored after).
    """
    device = next(model.parameters()).device
    batches = [b.to(device) for b in batches]
    tokens = sum(b.numel() for b in batches)
    found = decoder_blocks(model)
    prefix, blocks = (f"{found[0]}.", found[1]) if found else ("", [])
    block_of = {}
    for name in layers:
        index = name.removeprefix(prefix).split(".", 1)[0] if found and name.startswith(prefix) else None
        block_of[name] = int(index) if index is not None and index.isdigit() else None
    inside = [n for n in layers if block_of[n] is not None]
    was_training = model.training
    model.eval()
    try:
        if inside:
            cache, last = _BlockInputs(model, blocks, batches), max(block_of[n] for n in inside)
            for index in range(last + 1):
                in_block = {n: layers[n].in_features for n in inside if block_of[n] == index}
                for group in hessian_groups(in_block, budget_bytes) if in_block else []:
                    forwards = [lambda b=b: cache.forward(index, b) for b in range(len(batches))]
                    yield group, _gathered({n: layers[n] for n in group}, tokens, forwards)
                if index < last:
                    cache.advance(index)
            del cache
        outside = {n: layers[n].in_features for n in layers if block_of[n] is None}
        for group in hessian_groups(outside, budget_bytes) if outside else []:
            forwards = [lambda ids=ids: model(input_ids=ids, use_cache=False) for ids in batches]
            yield group, _gathered({n: layers[n] for n in group}, tokens, forwards)
    finally:
        model.train(was_training)


__all__ = ["HESSIAN_BUDGET_BYTES", "calibration_passes", "decoder_blocks", "hessian_groups"]
