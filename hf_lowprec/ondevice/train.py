"""The training loop of :func:`finetune_int4_lora` (AdamW with 8-bit states on the adapters, warm-up, clipping,
8-bit saved activations) and what it reports.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from peft import PeftModel
from torch import nn
from transformers import get_scheduler

from hf_lowprec.allocator import check_return_freed_memory, returning_freed_memory
from hf_lowprec.chunked_loss import chunked_causal_lm_loss
from hf_lowprec.folders import check_output_dir
from hf_lowprec.metrics import peak_rss_mb
from hf_lowprec.modules.packed import PackedLinear
from hf_lowprec.ondevice.export import export_int4_lora
from hf_lowprec.ondevice.learned_steps import fold_learned_steps, give_learned_steps_their_groups, learned_steps
from hf_lowprec.ondevice.loss import evaluate_loss
from hf_lowprec.training.activations import ActivationStorage
from hf_lowprec.training.adamw8bit import AdamW8bit
from hf_lowprec.training.compensation import make_optimizer

logger = logging.getLogger(__name__)


ProgressFn = Callable[[int, int, dict], None]
METRICS_FILE = "finetune_metrics.json"
# ``optim`` values, under transformers' ``TrainingArguments.optim`` names: fp32 states, or torchao's 8-bit states
# stepped in one C++ pass on CPUs (``training/adamw8bit.py``)
OPTIMIZERS = {"adamw_torch": torch.optim.AdamW, "adamw_torch_8bit": AdamW8bit}


def adapter_optimizer(
    params: list[nn.Parameter],
    optim: str = "adamw_torch_8bit",
    learned: Mapping[str, list[nn.Parameter]] | None = None,
    **kwargs,
) -> torch.optim.Optimizer:
    """AdamW over the adapters, ``optim`` one of :data:`OPTIMIZERS` (``kwargs``: ``lr``, ``weight_decay``...).
    ``learned``: the base's learned steps among ``params`` (:func:`~hf_lowprec.ondevice.learned_steps.learned_steps`),
    put in groups of their own (:func:`~hf_lowprec.ondevice.learned_steps.give_learned_steps_their_groups`).

    bf16 adapters (no fp32 master copy) round each update stochastically, so that updates below half a bf16 step
    are kept on average instead of lost: 8-bit states through torchao's ``bf16_stochastic_round`` (in the one-pass
    step), fp32 states through :class:`~hf_lowprec.training.compensation.CompensatedOptimizer`
    (:func:`~hf_lowprec.training.compensation.make_optimizer` builds either).
    """
    _check_optim(optim)
    rounding = "stochastic" if any(p.dtype is torch.bfloat16 for p in params) else None
    optimizer = make_optimizer(params, "8bit" if optim == "adamw_torch_8bit" else "fp32", rounding, **kwargs)
    give_learned_steps_their_groups(optimizer, learned or {})
    return optimizer


def _check_optim(optim: str) -> None:
    if optim not in OPTIMIZERS:
        raise ValueError(f"optim {optim!r} is not supported; choose from {', '.join(OPTIMIZERS)}")


def backend_counts(model: nn.Module) -> dict[str, int]:
    """How many packed layers ran each backend in their last forward (``never run`` before the first)."""
    counts: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, PackedLinear):
            key = m.last_backend or "never run"
            counts[key] = counts.get(key, 0) + 1
    return counts


@dataclass
class FinetuneResult:
    """What :func:`finetune_int4_lora` did; ``to_dict()`` is JSON-ready."""

    steps: int
    losses: list[float]
    step_seconds: list[float]
    train_seconds: float
    peak_rss_mb: float
    eval_loss_before: float | None = None
    eval_loss_after: float | None = None
    plan_fractions: dict[str, float] = field(default_factory=dict)
    backends: dict[str, int] = field(default_factory=dict)
    trainable_params: int = 0
    output_dir: str | None = None

    @property
    def perplexity_before(self) -> float | None:
        return None if self.eval_loss_before is None else math.exp(self.eval_loss_before)

    @property
    def perplexity_after(self) -> float | None:
        return None if self.eval_loss_after is None else math.exp(self.eval_loss_after)

    @property
    def median_step_seconds(self) -> float:
        s = sorted(self.step_seconds)
        return s[len(s) // 2] if s else float("nan")

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(
            perplexity_before=self.perplexity_before,
            perplexity_after=self.perplexity_after,
            median_step_seconds=self.median_step_seconds,
        )
        return out


def finetune_int4_lora(
    model: PeftModel,
    tokenizer,
    train_blocks: torch.Tensor,
    *,
    steps: int,
    lr: float = 2e-4,
    batch_size: int = 4,
    output_dir: str | os.PathLike | None = None,
    eval_blocks: torch.Tensor | None = None,
    progress: ProgressFn | None = None,
    seed: int = 0,
    activation_storage: str | None = "int8",
    gradient_checkpointing: bool = False,
    return_freed_memory: bool | str = "auto",
    chunk_tokens: int = 128,
    warmup_steps: int | None = None,
    weight_decay: float = 0.0,
    max_grad_norm: float = 1.0,
    optim: str = "adamw_torch_8bit",
    merge: bool = False,
    overwrite: bool = False,
) -> FinetuneResult:
    """Train the LoRA adapters of ``model`` (from :func:`prepare_int4_lora`) on ``train_blocks [n, T]``.

    AdamW on the trainable parameters (the base's steps and zero points, if it learns them, at their own rate:
    :mod:`~hf_lowprec.ondevice.learned_steps`), linear warm-up (default ``steps // 10``, ≤ 10) and decay, clipping.
    ``optim``: ``adamw_torch_8bit`` (default; 8-bit states, 2 bytes per adapter parameter instead of 8) or
    ``adamw_torch`` (fp32 states).

    Activation memory: ``activation_storage`` (``int8``, ``fp8`` or ``None``) keeps what autograd saves
    in 8 bits (:class:`~hf_lowprec.training.activations.ActivationStorage`; a few % of gradient error);
    ``gradient_checkpointing`` (``True``, or every ``n`` layers) recomputes layers instead (exact, slower).
    ``return_freed_memory``: ``True``: glibc's heap returns the memory freed tensors leave at each decoder block's
    boundary (:func:`~hf_lowprec.allocator.freed_memory_returned_per_block`; Llama-3.2-1B shape at 1x256 under glibc's
    default allocator: peak 1.42 GB instead of 1.60 for 1.14x the step on an AVX-512 CPU, 1.45 instead of 2.31 for
    1.05x on the AVX2 class); ``"auto"`` (default): there only while the process holds more than half of the memory
    it can use (:func:`~hf_lowprec.allocator.returning_freed_memory`); ``False``: never.

    ``progress(step, steps, metrics)`` is called after every step with ``loss``, ``lr``, ``step_seconds``,
    ``peak_rss_mb`` (and with ``eval_loss`` after the last). With ``output_dir`` the
    result is exported there (:func:`export_int4_lora`; adapters kept, or merged with ``merge``) along with
    ``finetune_metrics.json``. Raises ``ValueError`` for an output folder that exists (unless ``overwrite``).
    """
    _check_optim(optim)
    check_return_freed_memory(return_freed_memory)
    if not (math.isfinite(lr) and lr > 0):  # torch's optimizer refuses <= 0 and nan, after the evaluation
        raise ValueError(f"lr must be a finite number > 0, got {lr}")
    params = _checked_parameters(model, train_blocks, steps, batch_size, output_dir, overwrite, eval_blocks)
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    eval_before = evaluate_loss(model, eval_blocks, batch_size, chunk_tokens) if eval_blocks is not None else None
    learned = learned_steps(model)
    optimizer, scheduler = _optimizer_and_schedule(optim, params, learned, lr, weight_decay, steps, warmup_steps)
    returned = returning_freed_memory(model, return_freed_memory)
    with _activation_memory(model, base, activation_storage, gradient_checkpointing) as storage, returned:
        step = functools.partial(_step, model, params, optimizer, scheduler, storage, chunk_tokens, max_grad_norm)
        losses, times, train_seconds = _run_steps(step, scheduler, train_blocks, steps, batch_size, seed, progress)
    model.eval()
    fold_learned_steps(model)  # what the export will hold, evaluated
    eval_after = _final_eval(model, eval_blocks, batch_size, chunk_tokens, progress, steps, losses[-1])
    result = FinetuneResult(
        steps=steps,
        losses=losses,
        step_seconds=times,
        train_seconds=train_seconds,
        peak_rss_mb=peak_rss_mb(),
        eval_loss_before=eval_before,
        eval_loss_after=eval_after,
        plan_fractions=_plan_fractions(base),
        backends=backend_counts(model),
        trainable_params=sum(p.numel() for p in params),
    )
    if output_dir is not None:
        metrics = {METRICS_FILE: json.dumps(result.to_dict(), indent=2) + "\n"}
        options = {"tokenizer": tokenizer, "merge": merge, "overwrite": overwrite, "extra_files": metrics}
        result.output_dir = str(export_int4_lora(model, output_dir, **options))
    return result


@contextlib.contextmanager
def _activation_memory(model: nn.Module, base: nn.Module, storage: str | None, checkpointing: bool | int):
    """Training mode for memory: every module in training mode (``from_pretrained`` leaves the base in eval mode,
    where transformers' checkpointing does nothing), no KV cache; checkpoint every ``checkpointing`` layers while
    inside; yields the per-step context that stores saved activations in ``storage`` (``int8``/``fp8``; a no-op
    context for ``None``)."""
    model.train()
    config = getattr(base, "config", None)
    use_cache = getattr(config, "use_cache", None)
    if config is not None:
        config.use_cache = False  # a KV cache is of no use in training and costs memory
    if checkpointing:
        base.activation_checkpointing_enable({"use_reentrant": False}, every_n_layers=int(checkpointing))
    try:
        yield ActivationStorage(model, storage) if storage else contextlib.nullcontext()
    finally:
        if checkpointing:
            base.activation_checkpointing_disable()
        if config is not None:  # generating after training uses the cache again
            config.use_cache = use_cache


def _final_eval(model, eval_blocks, batch_size: int, chunk_tokens: int, progress, steps: int, last_loss: float):
    """Held-out loss after training (``None`` without ``eval_blocks``), reported through ``progress`` too."""
    if eval_blocks is None:
        return None
    eval_loss = evaluate_loss(model, eval_blocks, batch_size, chunk_tokens)
    if progress is not None:
        progress(steps, steps, {"loss": last_loss, "eval_loss": eval_loss, "peak_rss_mb": peak_rss_mb()})
    return eval_loss


def _optimizer_and_schedule(
    optim: str, params, learned, lr: float, weight_decay: float, steps: int, warmup_steps: int | None
):
    """Optimizer ``optim`` over ``params`` (:func:`adapter_optimizer`; ``learned``: the learned steps among them) and a
    linear schedule: warm-up (default
    ``steps // 10``, at most 10), then decay.

    8-bit states by default, by measurement (``benchmarks/adapter_optimizer.py``, 2-core AVX512-BF16 CPU, LoRA r=16 on
    every linear of the Llama-3.2-1B shape): they save 64 MB, 4% of the fine-tuning peak; the one-pass step takes
    2.7x fp32 AdamW's time, +1% of the training step (torchao's compiled step: 12x, +8%).
    """
    optimizer = adapter_optimizer(params, optim, learned, lr=lr, weight_decay=weight_decay)
    warmup = min(10, steps // 10) if warmup_steps is None else warmup_steps
    return optimizer, get_scheduler("linear", optimizer, num_warmup_steps=warmup, num_training_steps=steps)


def _plan_fractions(base: nn.Module) -> dict[str, float]:
    """Fraction of the plan's parameters per format (empty for a model without a plan)."""
    plan = getattr(base, "hf_lowprec_plan", None)
    return {r["format"]: r["fraction"] for r in plan.summary(base)} if plan is not None else {}


def _vocab_size(model: nn.Module) -> int | None:
    """Rows of ``model``'s input embedding (the token ids it can look up); None where it has none."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return getattr(embeddings, "num_embeddings", None)


def _check_blocks(blocks, name: str, vocab: int | None) -> None:
    """``ValueError`` (one line, naming ``name``) unless ``blocks`` is a non-empty int64 ``[n, T >= 2]`` tensor of ids
    the model's embedding holds, as :func:`~hf_lowprec.ondevice.loss.token_blocks` returns."""
    expected = f"{name} must be a LongTensor [n_blocks >= 1, block_size >= 2] of token ids (see token_blocks)"
    if not isinstance(blocks, torch.Tensor):
        raise ValueError(f"{expected}, got {type(blocks).__name__}")
    if blocks.dim() != 2 or blocks.shape[0] < 1 or blocks.shape[1] < 2:
        raise ValueError(f"{expected}, got shape {list(blocks.shape)}")
    if blocks.dtype != torch.long:
        raise ValueError(f"{expected}, got dtype {blocks.dtype}")
    low, high = int(blocks.min()), int(blocks.max())
    if vocab is not None and (low < 0 or high >= vocab):
        raise ValueError(
            f"{name} holds token ids from {low} to {high}; the model's vocabulary takes ids in [0, {vocab}) "
            "(blocks tokenized by another tokenizer?)"
        )


def _checked_parameters(
    model: nn.Module, train_blocks, steps: int, batch_size: int, output_dir, overwrite: bool, eval_blocks=None
):
    """The parameters that train (the adapters), after checking the arguments of :func:`finetune_int4_lora`."""
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps and batch_size must be positive, got steps={steps}, batch_size={batch_size}")
    vocab = _vocab_size(model)
    _check_blocks(train_blocks, "train_blocks", vocab)
    if eval_blocks is not None:
        _check_blocks(eval_blocks, "eval_blocks", vocab)
    if output_dir is not None:
        check_output_dir(Path(output_dir), overwrite, getattr(model, "name_or_path", None))
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters; build it with prepare_int4_lora / load_int4_lora")
    return params


def _step(model, params, optimizer, scheduler, storage, chunk_tokens: int, max_grad_norm: float, batch) -> float:
    """One optimizer step on ``batch [B, T]``; returns its loss."""
    with storage:
        loss = chunked_causal_lm_loss(model, batch, chunk_tokens=chunk_tokens)
    loss.backward()
    if max_grad_norm:
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def _run_steps(step, scheduler, train_blocks: torch.Tensor, steps: int, batch_size: int, seed: int, progress):
    """``steps`` calls of ``step(batch)`` on shuffled blocks (reshuffled each epoch): ``(losses, seconds per step,
    seconds in all)``."""
    if len(train_blocks) < batch_size:
        logger.warning("%d training blocks, fewer than a batch of %d: each step trains on those", len(train_blocks),
                       batch_size)  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    order, cursor = torch.randperm(len(train_blocks), generator=gen), 0
    losses, times = [], []
    start = time.perf_counter()
    for i in range(1, steps + 1):
        if cursor + batch_size > len(order):
            order, cursor = torch.randperm(len(train_blocks), generator=gen), 0
        batch = train_blocks[order[cursor : cursor + batch_size]]
        cursor += batch_size
        t0 = time.perf_counter()
        losses.append(step(batch))
        times.append(time.perf_counter() - t0)
        if not math.isfinite(losses[-1]):
            lr = scheduler.base_lrs[0]
            raise FloatingPointError(f"loss became {losses[-1]} at step {i}; lower the learning rate (now {lr})")
        if progress is not None:
            lr = scheduler.get_last_lr()[0]
            progress(i, steps, {"loss": losses[-1], "lr": lr, "step_seconds": times[-1], "peak_rss_mb": peak_rss_mb()})
    return losses, times, time.perf_counter() - start
