"""The scan passes (:func:`scan`: unquantized, Fisher, measured) and :func:`measure_plan` of a whole plan."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from hf_lowprec.checkpoints import public_name
from hf_lowprec.chunked_loss import chunk_rows, chunkable_head, cross_entropy_into_grad_, summed_chunked_loss
from hf_lowprec.convert import eligible_layers
from hf_lowprec.formats import FormatSpec
from hf_lowprec.layers import swap_layers
from hf_lowprec.modules import LOW_PRECISION_TYPES, Int4Linear, TiedQuantizers
from hf_lowprec.modules.packed import PackedLinear
from hf_lowprec.plan import PrecisionPlan, check_convertible, resolve_plan
from hf_lowprec.sensitivity.batches import _check_batches, _decoder_rows, _forward, _label_count, _merge
from hf_lowprec.sensitivity.reference import BaseOutputs, base_loss, loss_and_kl
from hf_lowprec.sensitivity.replay import Progress, _BlockReplay
from hf_lowprec.sensitivity.results import KEEP, ScanResult
from hf_lowprec.sensitivity.units import _select, _twins, _Unit, _units, unscored
from hf_lowprec.training.activations import row_blocks

METHODS = ("auto", "measured", "fisher")
DEFAULT_FORMATS = ("fp8", "int4-g64")
# tokens a forward of the scan runs at most (merged batches): fewer forwards, and FP8 tensorwise activation scales over
# more tokens; the Fisher pass keeps every block's activations for its backward. The fp8-train recipe's scan of
# SmolLM2-135M (benchmarks/scan_cost.py: 4 batches of 4x256, fp32 weights under bf16 autocast, two sets of calibration
# batches, 2-core AVX512-BF16 EPYC): 2048 tokens a forward peaked at 4,947 and 4,920 MB in 237 and 231 s, 1024 at 3,586
# and 3,537 MB in 325 and 281 s, and the plans of 1024 converted the model at 1.0001x and 0.9970x bf16's held-out
# perplexity against 0.9984x and 0.9927x
MAX_BATCH_TOKENS = 2048


@contextmanager
def _scanning(model: nn.Module, seed: int):
    """Eval mode, frozen parameters, a forked and seeded RNG, and hooks removed afterwards, whatever happens."""
    modes = [(m, m.training) for m in model.modules()]
    trainable = [p for p in model.parameters() if p.requires_grad]
    hooks: list = []
    device = next(model.parameters()).device
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            model.eval()
            for p in trainable:  # the passes need activation gradients only
                p.requires_grad_(False)
            yield hooks
    finally:
        for p in trainable:
            p.requires_grad_(True)
        for h in hooks:
            h.remove()
        for m, mode in modes:
            m.training = mode


class _Tracker:
    def __init__(self, progress: Progress | None, total: int):
        self.progress, self.total, self.done = progress, total, 0

    def step(self, description: str) -> None:
        self.done += 1
        if self.progress is not None:
            self.progress(self.done, self.total, description)


def scan(
    model: nn.Module,
    batches: Iterable[Mapping],
    formats: Sequence[str] = DEFAULT_FORMATS,
    method: str = "auto",
    *,
    progress: Progress | None = None,
    seed: int = 0,
    measure_top_fraction: float = 0.05,
    layers: Sequence[str] | None = None,
    max_batch_tokens: int = MAX_BATCH_TOKENS,
    fp8_backend: str = "auto",
    dense_weights: Callable[[str], torch.Tensor] | None = None,
) -> ScanResult:
    """Score every eligible layer of ``model`` for every format in ``formats``.

    Args:
        batches: dicts with ``input_ids`` ``[B, T]``, optional ``attention_mask``, and ``labels``
            (causal LM: ``labels=input_ids``; token classification ``[B, T]``; sequence
            classification ``[B]``; ``-100`` ignored). Consumed once.
        formats: low-precision formats to score (``bf16`` — keeping the layer — is always the baseline).
        method: ``auto``, ``measured`` or ``fisher`` (see the module docstring).
        progress: ``progress(done, total, description)`` after each step.
        seed: seeds a forked RNG for the scan (the global RNG is left as it was).
        measure_top_fraction: ``auto`` only: fraction of (layer, format) pairs measured after the
            Fisher pass, those with the highest predicted Δloss per byte saved.
        layers: names or globs of the layers to scan (default: every eligible layer).
        max_batch_tokens: consecutive batches of one shape run as one forward up to this many
            tokens (FP8 tensorwise activation scales then span the merged batch).
        fp8_backend: passed to the FP8 layers (as in :func:`hf_lowprec.convert.apply_plan`).
        dense_weights: for a model whose linears were packed while loading: ``reader("<layer>.weight")`` gives a
            packed layer's checkpoint weight. Method ``fisher`` then scores the packed layers too, reading one dense
            weight at a time: each format's output error is taken against the dense layer's output, with the loss
            gradients of the packed model.

    The model is left exactly as it was (modules, parameters, gradients, train/eval mode), also when
    interrupted. Raises ``ValueError`` for a model without eligible layers, an already converted
    model, or batches without labels.
    """
    specs = _checked_formats(formats, method, max_batch_tokens, measure_top_fraction)
    check_convertible(model)
    if dense_weights is not None and method != "fisher":
        raise ValueError(f"a scan of packed layers (dense_weights=) runs method 'fisher', not {method!r}")
    names = [s.name for s in specs]
    units = _units(model, specs, packed=dense_weights is not None)
    if layers is not None:
        units = _select(units, [layers] if isinstance(layers, str) else layers)
    batches = _merge(_check_batches(batches, model), max_batch_tokens)
    scores = [unscored(u) for u in units]
    model_id = public_name(getattr(getattr(model, "config", None), "name_or_path", None))  # the plan's "model"
    tokens = _labelled_tokens(model, batches)
    result = ScanResult(scores, tuple(names), method, tokens=tokens, seed=seed, model=model_id)
    with _checkpointing_off(model):
        _run_passes(model, batches, units, scores, result, progress, measure_top_fraction, fp8_backend, dense_weights)
    return result


@contextmanager
def _checkpointing_off(model: nn.Module):
    """``model`` inside the block as without transformers' gradient checkpointing, as it was after: its layers'
    checkpointing off (the scan's hooks read each layer's forward once; checkpointing runs it again in backward) and
    the embedding output detached, whatever hooks make it require grad (``enable_input_require_grads``, which
    checkpointing, PEFT and TRL each call: the embedding output a leaf that requires grad, with which every
    gradient-based score came out 0, so TRL's SFTConfig, checkpointing by default, got an all-INT4 auto plan;
    ``disable_input_require_grads`` removed the last of two such hooks only)."""
    checkpointed = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for m in checkpointed:
        m.gradient_checkpointing = False
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # a model without transformers' accessor: no such hooks either
        embeddings = None
    detach = None if embeddings is None else embeddings.register_forward_hook(lambda m, args, out: out.detach())
    try:
        yield
    finally:
        for m in checkpointed:
            m.gradient_checkpointing = True
        if detach is not None:
            detach.remove()


def _labelled_tokens(model: nn.Module, batches: list[Mapping]) -> int:
    """Labelled positions in ``batches``; raises ``ValueError`` when there are none."""
    tokens = sum(_label_count(model, b) for b in batches)
    if tokens == 0:
        raise ValueError(
            "the calibration batches have no labelled positions (all labels are -100, or causal-LM sequences of "
            "length 1)"
        )
    return tokens


def _checked_formats(formats, method: str, max_batch_tokens: int, measure_top_fraction: float) -> list[FormatSpec]:
    """The scan's formats, parsed, after checking them and the other options of :func:`scan`."""
    if method not in METHODS:
        raise ValueError(f"unknown scan method {method!r}; choose one of {', '.join(METHODS)}")
    if max_batch_tokens < 1:
        raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
    if not 0.0 <= measure_top_fraction <= 1.0:
        raise ValueError(f"measure_top_fraction must be in [0, 1], got {measure_top_fraction}")
    return check_formats(formats)


def check_formats(formats) -> list[FormatSpec]:
    """The formats a scan compares, parsed; ``ValueError`` for none, a high-precision one or a duplicate."""
    specs = [FormatSpec.parse(f) for f in formats]
    if not specs:
        raise ValueError("scan needs at least one format, e.g. formats=('fp8', 'int4-g64')")
    for s in specs:
        if s.is_high_precision:
            raise ValueError(
                f"format {s.name!r} is high precision: scan low-precision formats (fp8, int4-g64, ...); {KEEP} is "
                "always the baseline"
            )
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"formats contain duplicates: {names}")
    return specs


def _run_passes(
    model, batches, units, scores, result: ScanResult, progress, measure_top_fraction, fp8_backend, dense_weights=None
) -> None:
    """The passes of ``result.method`` over ``batches``, filling ``scores`` and ``result``'s base loss and seconds."""
    method, device = result.method, next(model.parameters()).device
    start = time.perf_counter()
    with _scanning(model, result.seed) as hooks:
        if method == "measured":
            pairs = [(i, f) for i, u in enumerate(units) for f in u.formats]
            tracker = _Tracker(progress, len(batches) + len(pairs))
            replay = _BlockReplay(model, units, hooks)
            base = _base_pass(model, batches, device, tracker, replay)
            result.base_loss = base[0]
            _measure(model, batches, device, units, pairs, scores, base, hooks, tracker, fp8_backend, replay)
        else:
            measure = method == "auto" and measure_top_fraction > 0
            tracker = _Tracker(progress, len(batches))
            replay = _BlockReplay(model, units, hooks) if measure else None
            twins_of = _TwinSource(units, fp8_backend, dense_weights)
            base = _fisher_pass(model, batches, device, units, scores, hooks, tracker, twins_of, replay)
            result.base_loss = base[0]
            result.seconds["fisher"] = time.perf_counter() - start
            if measure:
                pairs = _boundary_pairs(units, scores, measure_top_fraction)
                tracker.total += len(pairs)
                _measure(model, batches, device, units, pairs, scores, base, hooks, tracker, fp8_backend, replay)
    result.seconds["total"] = time.perf_counter() - start
    if method != "fisher":
        result.seconds["measured"] = result.seconds["total"] - result.seconds.get("fisher", 0.0)


@torch.no_grad()
def _base_pass(model, batches, device, tracker, replay: "_BlockReplay | None" = None) -> tuple[float, BaseOutputs]:
    """Mean loss of the unquantized model and its outputs per batch (what the measured passes compare with)."""
    nll, count, base = 0.0, 0, BaseOutputs()
    for i, batch in enumerate(batches):
        loss_sum, tokens = base_loss(model, batch, device, base)
        nll, count = nll + loss_sum, count + tokens
        if replay is not None:
            replay.next_batch()
        tracker.step(f"unquantized pass, batch {i + 1}/{len(batches)}")
    if replay is not None:
        replay.stop()
    return nll / count, base


# output rows of a packed layer's dense weight quantized at once (x its input size: 1M elements, 4 MB in fp32), so that
# the quantization temporaries stay small: quantizing whole 1B-size weights (16.8M elements) once per layer and batch
# made the scan 330 of the 434 s of an auto-plan load of the Llama-3.2-1B shape, mostly page faults of their fresh
# 67 MB fp32 copies (cProfile, 2 threads; benchmarks/scale.py int4-lora-recipe)
PACKED_ROW_BLOCK_ELEMENTS = 1 << 20
ROW_LOCAL_FAMILIES = ("int4", "int8", "nf4")  # per-row or per-group weight steps: a block of rows quantizes alone


def _row_local(spec: FormatSpec) -> bool:
    """Whether a block of a layer's output rows quantizes alone in ``spec`` (not with ``-sq``: its ``s`` reads every
    row's weight)."""
    return spec.family in ROW_LOCAL_FAMILIES and not spec.smooth


class _TwinSource:
    """``twins_of.output_errors(module, x, g)``: ``g * δy`` (flattened, fp32) of every (unit, format) of a scanned
    layer, where ``δy`` is the format's output minus the layer's and ``g`` the loss gradient at the output.

    Twins of dense layers share their weights and are built once; ``δy`` is the twin's output minus the layer's,
    recomputed from its input when the gradient arrives (keeping every scanned layer's output from the forward until
    then held 1.26 GB: SmolLM2-135M in fp32, forwards of 2048 tokens).
    A packed layer's are built when asked, from its checkpoint weight read by ``dense_weights``, and dropped after
    use: one dense weight in memory at a time. For weight-only integer formats (row-local steps) they are built
    ``PACKED_ROW_BLOCK_ELEMENTS`` at a time and ``δy = x (Q(W) - W)^T`` is computed from the weight error itself: one
    GEMM per format instead of two, and no cancellation between two rounded outputs (in bf16 that rounding errs by
    30% of an int8 format's ``δy``, 2.5% of int4-g64-asym's: RMS on SmolLM2-135M's gate_proj and q_proj).
    """

    def __init__(self, units: list[_Unit], fp8_backend: str, dense_weights: Callable[[str], torch.Tensor] | None):
        self.fp8_backend, self.dense_weights = fp8_backend, dense_weights
        self.built: dict[int, list] = {}
        self.packed: dict[int, tuple[_Unit, str, PackedLinear]] = {}
        for u in units:
            name, first = u.members[0]
            if isinstance(first, PackedLinear):  # packed layers are never tied: one per unit
                self.packed[id(first)] = (u, name, first)
                continue
            for f in u.formats:
                for _, module, twin in _twins(u, f, fp8_backend):
                    self.built.setdefault(id(module), []).append(((u.name, f), twin))

    def output_errors(self, module: nn.Module, x: torch.Tensor, g: torch.Tensor):
        """Yield ``((unit, format), g * δy)`` pieces: blocks of rows (tokens), or of a packed layer's outputs."""
        if id(module) not in self.packed:
            out = module.forward(x)  # forward, not __call__: the scan's hook on it does not run again
            for key, twin in self.built[id(module)]:
                y = twin(x)
                for y_rows, out_rows, g_rows in row_blocks(y, out, g):  # fp32 a block at a time: a 49k-vocabulary
                    yield key, (y_rows.float() - out_rows.float()).mul_(g_rows.float()).flatten()  # head's: 403 MB
            return
        g = g.float()
        unit, name, module = self.packed[id(module)]
        weight = self.dense_weights(f"{name}.weight")
        local = [f for f in unit.formats if _row_local(FormatSpec.parse(f))]
        step = max(1, PACKED_ROW_BLOCK_ELEMENTS // module.in_features)
        for r0 in range(0, module.out_features, step):
            rows = slice(r0, r0 + step)
            yield from self._block_errors(unit, module.dense_linear(weight[rows], rows), local, x, g[..., rows])
        whole = [f for f in unit.formats if f not in local]  # e.g. tensorwise FP8: one scale for the whole weight
        if whole:
            yield from self._block_errors(unit, module.dense_linear(weight), whole, x, g)

    def _block_errors(self, unit: _Unit, dense: nn.Linear, formats: list[str], x, g):
        alone = _Unit(unit.name, [(unit.members[0][0], dense)], formats)
        ref = None
        for f in formats:
            twin = _twins(alone, f, self.fp8_backend)[0][2]
            if isinstance(twin, Int4Linear) and twin.input_quantizer is None and not twin.spec.act_int8:  # weight-only
                twin.calibrate_smoothing(x)
                w = dense.weight
                dy = F.linear(x, (twin.dequantized_weight().to(w.dtype).float() - w.float()).to(x.dtype)).float()
            else:  # the bias, if any, cancels
                ref = dense(x).float() if ref is None else ref
                dy = twin(x).float() - ref
            yield (unit.name, f), dy.mul_(g).flatten()


def _fisher_pass(model, batches, device, units, scores, hooks, tracker, twins_of, replay: "_BlockReplay | None"):
    """One forward/backward per batch: output-space Taylor estimate for every (unit, format).

    The forward keeps each scanned layer's input and hooks its output; when the backward (activation gradients only)
    reaches that output, each low-precision twin runs on the kept input to give ``δy`` and the layer's terms are added
    at once: the pass holds one output gradient at a time, not every layer's, and its twins run while the backward's
    buffers are warm (the make-demo scan: 45 s instead of 55 and 1,057 MB instead of 1,093 at peak; 2-core AVX2 CPU).
    """
    first = {(u.name, f): 0.0 for u in units for f in u.formats}
    second = dict(first)
    leaves: list[torch.Tensor] = []

    @torch.no_grad()
    def add_terms(module: nn.Module, x: torch.Tensor, g: torch.Tensor) -> None:
        for key, gd in twins_of.output_errors(module, x, g):
            first[key] += gd.sum().item()
            second[key] += 0.5 * torch.dot(gd, gd).item()

    def hook(module, args, out):
        if not out.requires_grad:  # the parameters are frozen here: make the output a leaf so gradients reach it
            out = out.detach().requires_grad_(True)
            leaves.append(out)
        x = args[0].detach()
        out.register_hook(lambda g, m=module: add_terms(m, x, g))
        return out

    for u in units:
        for _, module in u.members if u.formats else ():  # a unit no candidate fits (a tied head under '-a8') has no twins
            hooks.append(module.register_forward_hook(hook))
    head = chunkable_head(model)  # the parameters are frozen: any plain head
    head_scanned = head is not None and any(m is head for u in units for _, m in u.members)
    nll, count, base = 0.0, 0, BaseOutputs()
    for i, batch in enumerate(batches):
        leaves.clear()
        loss_sum, tokens, hidden, logits = _loss_backward(model, batch, device, head if head_scanned else None, leaves)
        nll, count = nll + loss_sum, count + tokens
        if replay is not None:
            if hidden is None:
                base.keep_logits(logits)
            else:
                base.keep_hidden(hidden, head)
            replay.next_batch()
        del hidden, logits
        tracker.step(f"fisher pass, batch {i + 1}/{len(batches)}")
    leaves.clear()
    if replay is not None:
        replay.stop()
    for h in hooks:
        h.remove()
    hooks.clear()
    for u, s in zip(units, scores):
        for f in u.formats:
            s.first_order[f] = first[u.name, f] / count
            s.second_order[f] = second[u.name, f] / count
            s.predicted[f] = s.first_order[f] + s.second_order[f]
    return nll / count, base


def _loss_backward(model, batch, device, scanned_head: nn.Module | None, leaves: list[torch.Tensor]):
    """The loss of one batch and its gradient w.r.t. ``leaves`` (which runs the scanned outputs' hooks):
    ``(summed loss, labelled positions, decoder output [T, H] or None, logits [T, V] or None)``, the latter two as
    :func:`~hf_lowprec.sensitivity.reference.BaseOutputs` keeps them. The head runs in chunks where it can; a scanned
    ``scanned_head`` once on every row (its hook's twins scale their activations over them all), the loss and its
    gradient then in chunks."""
    with torch.enable_grad():
        rows = _decoder_rows(model, batch, device)
        hidden, outputs, grads = None, None, None
        if rows is None:
            logits, labels = _forward(model, batch, device)
            loss_sum = F.cross_entropy(logits, labels, reduction="sum")
        else:
            (hidden, labels), logits = rows, None
            if scanned_head is None:
                loss_sum = summed_chunked_loss(hidden, labels, chunkable_head(model))
            else:
                outputs = scanned_head(hidden)
                grads = outputs.detach()  # a linear keeps its input, not its output: this buffer takes its gradient
                loss_sum = _chunked_loss_into_grad_(grads, labels, chunk_rows(scanned_head))
        if leaves:  # every scanned output lies on a path to a leaf
            if outputs is None:
                torch.autograd.grad(loss_sum, leaves, allow_unused=True)
            else:
                torch.autograd.grad(outputs, leaves, grads, allow_unused=True)
    return loss_sum.item(), len(labels), None if hidden is None else hidden.detach(), logits


def _chunked_loss_into_grad_(logits: torch.Tensor, labels: torch.Tensor, step: int) -> torch.Tensor:
    """Summed cross-entropy (fp32 scalar) of ``logits [T, V]`` against ``labels [T]``, ``step`` tokens at a time, each
    chunk overwritten with its gradient (:func:`~hf_lowprec.chunked_loss.cross_entropy_into_grad_`, as the chunked
    loss does): no fp32 copy of the whole logits, no second buffer."""
    total = torch.zeros((), dtype=torch.float32, device=logits.device)
    for i in range(0, len(labels), step):
        total += cross_entropy_into_grad_(logits[i : i + step], labels[i : i + step])
    return total


def _boundary_pairs(units, scores, fraction: float) -> list[tuple[int, str]]:
    """The top ``fraction`` of (unit, format) pairs by predicted Δloss per byte saved, in model order.

    These are the choices a budget keeps out of low precision first, so the ones whose estimate
    matters most; they are also the largest perturbations, where a Taylor estimate is least reliable.
    """
    pairs = [(i, f) for i, u in enumerate(units) for f in u.formats]
    n = math.ceil(fraction * len(pairs))

    def per_byte(pair):
        s = scores[pair[0]]
        return s.predicted[pair[1]] / max(s.bytes[KEEP] - s.bytes[pair[1]], 1.0)

    top = set(sorted(pairs, key=per_byte, reverse=True)[:n])
    return [pair for pair in pairs if pair in top]


@torch.no_grad()
def _measure(model, batches, device, units, pairs, scores, base, hooks, tracker, fp8_backend, replay: _BlockReplay):
    """Measured Δloss and KL for each (unit index, format) in ``pairs``, one at a time."""
    base_loss, outputs = base
    for i, fmt in pairs:
        unit, s = units[i], scores[i]
        handles = [
            module.register_forward_hook(_replace_output(twin)) for _, module, twin in _twins(unit, fmt, fp8_backend)
        ]
        hooks.extend(handles)
        head_whole = any(m is outputs.head for _, m in unit.members)
        try:
            with replay.replaying(replay.skippable(unit)):
                nll, kl, count = _loss_and_kl(model, batches, device, outputs, replay, head_whole)
        finally:
            for h in handles:
                h.remove()
                hooks.remove(h)
        s.measured[fmt] = nll / count - base_loss
        s.kl[fmt] = kl / count
        tracker.step(f"measured {unit.name} in {fmt}")


def _loss_and_kl(
    model, batches, device, base: BaseOutputs, replay: "_BlockReplay | None" = None, head_whole: bool = False
) -> tuple[float, float, int]:
    """Summed next-token loss, summed KL(base ‖ model) and token count over ``batches``
    (:func:`~hf_lowprec.sensitivity.reference.loss_and_kl`)."""
    nll, kl, count = 0.0, 0.0, 0
    for b, (batch, reference) in enumerate(zip(batches, base.batches)):
        if replay is not None:
            replay.batch = b
        batch_nll, batch_kl, tokens = loss_and_kl(model, batch, device, reference, base, head_whole)
        nll, kl, count = nll + batch_nll, kl + batch_kl, count + tokens
    return nll, kl, count


def _replace_output(twin: nn.Module):
    def hook(module, args, out):
        return twin(args[0])

    return hook


def measure_plan(
    model: nn.Module, plan: "PrecisionPlan | Mapping", batches: Iterable[Mapping], *, fp8_backend: str = "auto"
) -> dict:
    """Measure a whole plan's Δloss and KL on ``batches`` (held-out data), leaving ``model`` as it was.

    Every layer runs through the low-precision layer :func:`~hf_lowprec.convert.apply_plan` would
    install for its planned format. Returns ``base_loss``, ``plan_loss``, ``delta_loss``, ``kl``
    (nats/token) and ``tokens``.
    """
    plan = resolve_plan(plan)
    plan.validate(model)
    batches = _check_batches(batches, model)  # one forward per batch, as training would run them
    device = next(model.parameters()).device
    assignment = plan.assign(model)
    layers = eligible_layers(model)
    converted = [n for n, m in layers.items() if isinstance(m, LOW_PRECISION_TYPES)]
    if converted:
        raise ValueError(
            f"measure_plan needs an unconverted model ({converted[0]!r} is already low precision); call "
            "hf_lowprec.revert(model) first"
        )
    shared, originals = TiedQuantizers(), {}

    def twin(name: str, fqn: str, module: nn.Module) -> nn.Module | None:
        if assignment[name].is_high_precision:
            return None
        originals[fqn] = module
        return shared.build(name, module, assignment[name], {"fp8_backend": fp8_backend, "learn_scales": False})

    with _scanning(model, 0), torch.no_grad():
        base_loss, base = _base_pass(model, batches, device, _Tracker(None, 0))
        try:
            swap_layers(model, twin)  # the layers apply_plan would install, sharing the weights
            nll, kl, count = _loss_and_kl(model, batches, device, base)
        finally:
            swap_layers(model, lambda name, fqn, module: originals.get(fqn))
    plan_loss = nll / count
    return {
        "base_loss": base_loss,
        "plan_loss": plan_loss,
        "delta_loss": plan_loss - base_loss,
        "kl": kl / count,
        "tokens": count,
    }
