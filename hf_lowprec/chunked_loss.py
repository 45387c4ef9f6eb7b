"""The chunked causal-LM loss: the output head and the cross-entropy run a block of tokens at a time, so the
``[tokens, vocab]`` logits never exist whole. The INT4+LoRA training path and the sensitivity scan's Fisher pass
use it.
"""

from __future__ import annotations

import ast
import functools
import inspect
import logging
import textwrap

import torch
import torch.nn.functional as F
from peft import PeftModel
from torch import nn

from hf_lowprec.labels import IGNORE_INDEX
from hf_lowprec.modules.packed import AUTOTUNE_OUTPUTS, compiled, consumable_gradient, native_kernels

# most logits of one chunk (tokens x vocabulary): 128 tokens of a 49k vocabulary; at a 128k vocabulary, 65 tokens,
# which keeps a chunk's logits, their fp32 loss and gradient near 100 MB instead of 200 (Llama-3.2-1B, scale.py)
CHUNK_LOGITS = AUTOTUNE_OUTPUTS  # the packed layers time a head this wide at the rows of one chunk
logger = logging.getLogger(__name__)


def cross_entropy_with_grad(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy of ``logits [C, V]`` against ``labels [C]`` (``-100`` ignored) and its gradient
    w.r.t. the logits (``softmax - onehot``, in the logits' dtype), computed in fp32 in one fused kernel.

    Hand-written because autograd's ``log_softmax`` + ``nll_loss`` make separate passes over the ``[C, V]``
    logits forward and backward; this is one fused pass when compiled.
    """
    x = logits.float()
    valid = labels != IGNORE_INDEX
    target = torch.where(valid, labels, 0).unsqueeze(1)
    lse = torch.logsumexp(x, -1, keepdim=True)
    weight = valid.unsqueeze(1).float()
    loss = ((lse - x.gather(1, target)) * weight).sum()
    # the one-hot as a comparison, not a scatter_add: torch 2.13's inductor corrupts the heap on 2+ threads when
    # fp32 logits (aliased by .float()) meet scatter_add with dynamic shapes; the comparison also fuses
    onehot = torch.arange(x.shape[1], device=x.device) == target
    grad = (torch.exp(x - lse) - onehot.float()) * weight
    return loss, grad.to(logits.dtype)


def cross_entropy_into_grad_(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of ``logits [C, V]`` against ``labels [C]`` (fp32 scalar); overwrites ``logits`` with
    the gradient :func:`cross_entropy_with_grad` gives. One buffer instead of two: the C++ kernel
    (``modules/kernels/cpp.py``) on CPUs where it builds, else the compiled function and a copy."""
    ext = native_kernels(logits)
    if ext is not None and logits.is_contiguous():
        return ext.cross_entropy_(logits, labels.contiguous(), IGNORE_INDEX)
    loss, grad = compiled(cross_entropy_with_grad)(logits, labels.contiguous())
    logits.copy_(grad)
    return loss


class _ChunkedLMLoss(torch.autograd.Function):
    """Summed cross-entropy of ``head(hidden)`` against ``labels``, ``chunk`` tokens at a time.

    The gradient w.r.t. ``hidden`` is computed chunk by chunk during the forward (the loss is a
    scalar, so it only needs rescaling later); only one chunk's ``[chunk, vocab]`` logits exist at a
    time, overwritten by their gradient, and nothing is recomputed. transformers computes the full fp32
    logits (201 MB for 1024 tokens x 49k vocabulary, plus their gradient); no library offers this for an
    arbitrary head module.
    """

    @staticmethod
    def forward(ctx, hidden, labels, head, chunk):
        grad = torch.empty_like(hidden) if hidden.requires_grad else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for i in range(0, hidden.shape[0], chunk):
            with torch.enable_grad():
                h = hidden[i : i + chunk].detach().requires_grad_(grad is not None)
                logits = head(h)
            grad_logits = logits.detach()  # the head saves its input, not its output: its buffer takes the gradient
            total += cross_entropy_into_grad_(grad_logits, labels[i : i + chunk])
            if grad is not None:
                with consumable_gradient(grad_logits):  # dropped after: a packed head quantizes it in place
                    (grad[i : i + chunk],) = torch.autograd.grad(logits, h, grad_logits)
            del logits, grad_logits  # before the next chunk's head runs: two chunks' logits were the forward's peak
        ctx.save_for_backward(grad)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        (grad,) = ctx.saved_tensors
        # scaled in fp32, rounded once: bf16(1/count) scaled every gradient by up to 1 + 2^-9 (count 3: 1.002)
        return (grad.float() * grad_total).to(grad.dtype), None, None, None


def chunked_causal_lm_loss(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    chunk_tokens: int = 128,
    *,
    labels: torch.Tensor | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    **model_inputs,
) -> torch.Tensor:
    """Next-token cross-entropy of a causal LM (PEFT-wrapped or not), ``input_ids [B, T]``; ``model_inputs`` (a
    padding-free batch's ``position_ids``, ...) go to the model with them.

    ``labels [B, T]`` (default ``input_ids``; ``-100`` and padded positions ignored) are shifted inside, as in
    transformers. The loss is the mean over this batch's targets, or their sum over ``num_items_in_batch`` (the
    targets of all the batches of one optimizer step, as the ``Trainer`` passes it for gradient accumulation); 0
    for a batch without targets.

    Runs the decoder, then the output head and the loss over ``chunk_tokens`` tokens at a time, fewer where the
    vocabulary would make a chunk's logits exceed ``CHUNK_LOGITS`` (see
    :class:`_ChunkedLMLoss`). Falls back to the model's full logits when the model has no ``get_decoder``, makes
    its logits otherwise than by its head alone (scaled, capped: :func:`chunkable_head`), or when its head trains.
    """
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    targets = (input_ids if labels is None else labels)[:, 1:]
    if attention_mask is not None:
        targets = targets.masked_fill(attention_mask[:, 1:] == 0, IGNORE_INDEX)
    flat = targets.reshape(-1)
    head = chunkable_head(base)
    no_cache = {"use_cache": False} if getattr(getattr(base, "config", None), "use_cache", None) is not None else {}
    if head is None:  # the model's logits as it computes them (scaled, capped), the loss as transformers' in fp32
        outputs = model(input_ids=input_ids, attention_mask=attention_mask, **no_cache, **model_inputs)
        logits = outputs.logits[:, :-1]
        logits = logits.float().reshape(flat.numel(), -1)
        total = F.cross_entropy(logits, flat, ignore_index=IGNORE_INDEX, reduction="sum")
    else:
        decoded = base.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, **no_cache, **model_inputs)
        hidden = decoded.last_hidden_state
        total = summed_chunked_loss(hidden[:, :-1].reshape(-1, hidden.shape[-1]), flat, head, chunk_tokens)
    count = (flat != IGNORE_INDEX).sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch)
    return total / count.clamp(min=1)  # a step without targets: loss 0 and gradients 0, not 0/0 (NaN weights)


def chunk_rows(head: nn.Module, chunk_tokens: int = 128) -> int:
    """Tokens per chunk of ``head``'s logits: ``chunk_tokens``, fewer where a chunk's logits would exceed
    ``CHUNK_LOGITS`` elements (a 128k vocabulary: 65 tokens a chunk)."""
    return max(1, min(chunk_tokens, CHUNK_LOGITS // head.out_features))


def summed_chunked_loss(hidden: torch.Tensor, labels: torch.Tensor, head: nn.Module, chunk_tokens: int = 128):
    """Summed cross-entropy (fp32 scalar, differentiable w.r.t. ``hidden``) of ``head(hidden [N, H])`` against
    ``labels [N]`` (``-100`` ignored), :func:`chunk_rows` tokens at a time (:class:`_ChunkedLMLoss`). ``head``
    gets no gradient: a trainable one is refused (compute its logits whole)."""
    if torch.is_grad_enabled() and any(p.requires_grad for p in head.parameters()):
        raise ValueError(
            "summed_chunked_loss gives gradients to the hidden states only, and this head has trainable parameters: "
            "compute its logits whole (chunked_causal_lm_loss does so for such a head)"
        )
    return _ChunkedLMLoss.apply(hidden, labels, head, chunk_rows(head, chunk_tokens))


def chunkable_head(base: nn.Module) -> nn.Module | None:
    """The output head when the loss may run it in chunks, else ``None``: when it is frozen (or under
    ``torch.no_grad``: its weight gradient is the one thing the chunks do not give) and its output is the model's
    logits (:func:`_head_alone_gives_logits`)."""
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if head is None or head is not getattr(base, "lm_head", None) or not hasattr(base, "get_decoder"):
        return None
    if torch.is_grad_enabled() and any(p.requires_grad for p in head.parameters()):
        return None
    model = _innermost(base)
    skipped = _head_alone_gives_logits(type(model))
    if skipped is None or any(_attribute(model, path) is not None for path in skipped):
        return None
    return head


def _innermost(model: nn.Module) -> nn.Module:
    """The transformers model inside ``torch.compile``'s and PEFT's wrappers, whose forward makes the logits."""
    while True:
        if isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        elif isinstance(model, PeftModel):
            model = model.get_base_model()
        else:
            return model


_NO_HEAD_LINE = "the model's forward computes its logits otherwise than by its output head alone"


@functools.cache
def _head_alone_gives_logits(cls: type) -> tuple[tuple[str, ...], ...] | None:
    """How ``cls.forward`` turns the decoder's last hidden state into logits, read from its source: ``None`` unless
    by its output head alone (``logits = self.lm_head(hidden_states[...])``, ``.float()`` and such allowed);
    else the attribute paths of the ``if self.<path> is not None:`` blocks in between (Gemma's
    ``config.final_logit_softcapping``), each of which must be ``None`` for the head alone to give the logits.

    Read from the code, not from config fields: transformers' models scale or cap their logits under many names
    (Granite divides by ``config.logits_scaling``, FalconH1 multiplies by ``lm_head_multiplier``, MiniCPM3 scales
    the hidden state, Cohere by ``logit_scale``), and a model this does not recognise computes its logits whole."""
    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(cls.forward))).body[0].body
    except (OSError, TypeError, SyntaxError, IndexError, AttributeError) as e:
        logger.info("%s: %s (source unreadable: %s); its loss runs on its full logits", cls.__name__, _NO_HEAD_LINE, e)
        return None
    start = next((i for i, s in enumerate(body) if _assigns(s, "hidden_states") and "outputs" in ast.unparse(s)), None)
    end = None if start is None else next((i for i in range(start + 1, len(body)) if _starts_loss(body[i])), None)
    if end is None:
        others = ["no decoder output or loss found in it"]
    else:
        skipped, others = [], []
        for statement in body[start + 1 : end]:
            if not (_is_head_call(statement) or _is_slicing(statement)):
                path = _none_test(statement)
                (skipped if path is not None else others).append(path or ast.unparse(statement))
    if others:
        logger.info("%s: %s (%s); its loss runs on its full logits", cls.__name__, _NO_HEAD_LINE, others[0][:80])
        return None
    return tuple(skipped)


def _assigns(statement: ast.stmt, name: str) -> bool:
    targets = statement.targets if isinstance(statement, ast.Assign) else []
    return any(isinstance(t, ast.Name) and t.id == name for t in targets)


def _starts_loss(statement: ast.stmt) -> bool:
    return _assigns(statement, "loss") or (isinstance(statement, ast.If) and "labels" in ast.unparse(statement.test))


def _is_slicing(statement: ast.stmt) -> bool:
    """``slice_indices = ...`` or ``hidden_states = slice_logits_to_keep(...)`` (under an ``if`` too, as Gemma-4's):
    which positions get logits."""
    if isinstance(statement, ast.If):
        return not statement.orelse and all(_is_slicing(s) for s in statement.body)
    return ast.unparse(statement).startswith(("slice_indices = ", "hidden_states = slice_logits_to_keep("))


def _is_head_call(statement: ast.stmt) -> bool:
    """``logits = self.lm_head(hidden_states[...])`` (or ``lm_logits``; its input cast with ``.to``, its output
    with ``.float()`` / ``.contiguous()``)."""
    if not (_assigns(statement, "logits") or _assigns(statement, "lm_logits")):
        return False
    call = statement.value
    while _method_call(call, ("float", "contiguous")):
        call = call.func.value
    if not (isinstance(call, ast.Call) and ast.unparse(call.func) == "self.lm_head" and len(call.args) == 1):
        return False
    arg = call.args[0]
    if _method_call(arg, ("to",)):
        arg = arg.func.value
    return ast.unparse(arg.value if isinstance(arg, ast.Subscript) else arg) == "hidden_states"


def _method_call(node: ast.expr, names: tuple[str, ...]) -> bool:
    """Whether ``node`` is ``<expr>.<one of names>(...)``."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in names


def _none_test(statement: ast.stmt) -> tuple[str, ...] | None:
    """``("config", "x")`` for ``if self.config.x is not None: ...`` (no ``else``), else ``None``."""
    test = getattr(statement, "test", None)
    if not isinstance(statement, ast.If) or statement.orelse or not isinstance(test, ast.Compare):
        return None
    if [type(op) for op in test.ops] != [ast.IsNot] or ast.unparse(test.comparators[0]) != "None":
        return None
    path = ast.unparse(test.left).split(".")
    return tuple(path[1:]) if path[0] == "self" and len(path) > 1 and all(p.isidentifier() for p in path) else None


def _attribute(obj, path: tuple[str, ...]):
    """``obj.<path>``; ``...`` where an attribute is missing."""
    for name in path:
        obj = getattr(obj, name, ...)
    return obj
