"""8-bit storage of saved activations (FP8 here; int8 in test_finetune): exact gradients from the FP8 copies,
parameters left alone, FP8Linear's own FP8 saves, and a tiny Llama's gradients close to the unpacked ones."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_int8_rows, tiny_llama
from text_batches import text_batches

from hf_lowprec import FP8Linear, apply_plan
from hf_lowprec.formats import E4M3, dequantize_fp8, fp8_amax, fp8_scale, quantize_fp8
from hf_lowprec.training.activations import ActivationStorage
from hf_lowprec.training.compensation import CompensatedOptimizer


def _fp8_rows(t: torch.Tensor) -> torch.Tensor:
    """The FP8 round trip the storage should apply: E4M3, one exact (not power-of-two) scale per row."""
    rows = t.reshape(-1, t.shape[-1])
    scale = fp8_scale(fp8_amax(rows, "row"), E4M3)
    return dequantize_fp8(quantize_fp8(rows, scale, E4M3), scale).reshape(t.shape)


def test_gradients_are_computed_from_the_fp8_copies():
    torch.manual_seed(0)
    x = torch.randn(8, 64, requires_grad=True)
    z = torch.randn(8, 64, requires_grad=True)
    with ActivationStorage(fmt="fp8", min_numel=1):
        y = F.silu(x) * z
    g = torch.randn(8, 64)
    y.backward(g)
    # reference: silu saves x, the product saves silu(x) and z; each is read back through FP8
    xd, zd = _fp8_rows(x.detach()), _fp8_rows(z.detach())
    sd = _fp8_rows(F.silu(x.detach()))
    sig = torch.sigmoid(xd)
    torch.testing.assert_close(z.grad, g * sd, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(x.grad, g * zd * sig * (1 + xd * (1 - sig)), rtol=1e-5, atol=1e-6)
    assert not torch.equal(xd, x.detach())  # the round trip really is lossy


def _weight_gradients(model, batches, storage=None, optimizer=None, autocast=False) -> list[torch.Tensor]:
    """Every parameter's gradient after each of ``batches`` (``optimizer`` stepping between them)."""
    grads = []
    for ids in batches:
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast), storage or contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads += [p.grad.clone() for p in model.parameters() if p.grad is not None]
        if optimizer is not None:
            optimizer.step()
        model.zero_grad()
    return grads


@pytest.mark.parametrize("case", ["autocast", "int4 layers", "optimizer replacing .data"])
def test_weights_made_in_the_forward_are_saved_as_they_are(case):
    """Hidden 256 and 8 tokens: every activation is under min_numel, every weight matrix at it, so nothing may be
    stored in 8 bits. A trainable fp32 weight's bf16 autocast cast, an INT4 layer's fake-quantized weight, and
    parameters an optimizer moved to new memory after the storage was made (CompensatedOptimizer, each step) were;
    the gradients now equal those without storage."""
    def run(storage: bool):
        model = tiny_llama(hidden_size=256, intermediate_size=512, num_attention_heads=4)
        if case == "int4 layers":
            apply_plan(model, {"layers": {"*.mlp.*": "int4-g64"}})
        if case == "optimizer replacing .data":
            model.bfloat16()
        optimizer = CompensatedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), "kahan")
        made = ActivationStorage(model, "int8") if storage else None
        ids = [torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(i)) for i in range(3)]
        return _weight_gradients(model, ids, made, optimizer, autocast=case == "autocast"), made

    reference, _ = run(storage=False)
    grads, made = run(storage=True)
    assert made.stored_bytes == 0
    for got, expected in zip(grads, reference, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_parameters_and_fp8_tensors_are_saved_as_they_are():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64).bfloat16(), torch.nn.Linear(64, 64).bfloat16())
    seen = []
    storage = ActivationStorage(model, "fp8", min_numel=1)
    with storage:
        out = model(torch.randn(16, 64).bfloat16())
    out.float().sum().backward()
    assert storage.stored_bytes > 0
    # the weights were not copied: packed bytes are those of the two saved inputs (+ row scales) only
    assert storage.stored_bytes == 2 * (16 * 64 + 16 * 4)
    assert storage.original_bytes == 2 * 16 * 64 * 2
    layer = FP8Linear(64, 32, spec="fp8", backend="emulated")
    x = torch.randn(16, 64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        layer(x).sum().backward()
    # FP8Linear (tensorwise) saves its input and weight as FP8 itself: 1 byte per element
    big = [t for t in seen if t.numel() >= 16 * 32]
    assert big and all(t.dtype == E4M3 for t in big)


def test_tiny_llama_gradients_with_fp8_activations_stay_close():
    """E4M3 keeps 3 mantissa bits (relative rounding <= 2^-4 per element); errors are independent across
    elements, so gradient directions survive: cosine > 0.98 for every parameter."""
    batch = text_batches(1, batch=4, seq=64)[0]
    for plan in (None, "fp8"):
        model = tiny_llama().to(torch.bfloat16)
        if plan:
            apply_plan(model, plan, fp8_backend="emulated")
        model(**batch).loss.backward()
        ref = {n: p.grad.float().clone() for n, p in model.named_parameters()}
        model.zero_grad()
        storage = ActivationStorage(model, "fp8", min_numel=1024)
        with storage:
            loss = model(**batch).loss
        loss.backward()
        for n, p in model.named_parameters():
            cos = F.cosine_similarity(p.grad.float().flatten(), ref[n].flatten(), dim=0)
            assert cos > 0.98, (plan, n, cos.item())
        assert storage.stored_bytes < 0.6 * storage.original_bytes  # 1 byte + row scales vs bf16/fp32


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_a_padded_batch_keeps_its_attention_mask_and_finite_gradients(fmt):
    """Padding makes SDPA save an additive mask holding -inf; 8 bits cannot hold it (its copy came back NaN and so did
    every gradient). Such a tensor is saved as it is: the gradients stay finite and close to those without storage."""
    torch.manual_seed(0)
    batch = text_batches(1, batch=4, seq=64)[0]
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    batch["attention_mask"][1:, 40:] = 0  # three rows padded on the right
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    model = tiny_llama().to(torch.bfloat16)
    model(**batch).loss.backward()
    ref = {n: p.grad.float().clone() for n, p in model.named_parameters()}
    model.zero_grad()
    storage = ActivationStorage(model, fmt, min_numel=1024)
    with storage:
        loss = model(**batch).loss
    loss.backward()
    for n, p in model.named_parameters():
        assert torch.isfinite(p.grad).all(), n
        assert F.cosine_similarity(p.grad.float().flatten(), ref[n].flatten(), dim=0) > 0.98, n
    assert 0 < storage.stored_bytes < storage.original_bytes


def test_bad_storage_format():
    with pytest.raises(ValueError, match="choose one of int8, fp8, fp8-e5m2"):
        ActivationStorage(fmt="bf16")


def test_large_tensors_are_packed_in_slices_exactly_as_whole():
    """A tensor bigger than one slice (logits) round-trips as the per-row references do (fp8; int8, computed here in
    fp64), and within each format's error."""
    t = torch.randn(3000, 700, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 3000)[:, None]
    for fmt in ("fp8", "fp8-e5m2", "int8"):
        storage = ActivationStorage(fmt=fmt, min_numel=1)
        back = storage._unpack(storage._pack(t))
        if fmt == "fp8":
            torch.testing.assert_close(back, _fp8_rows(t), rtol=0, atol=0)
        if fmt == "int8":
            assert_int8_rows(back, t)
        rel = ((back - t).norm(dim=1) / t.norm(dim=1)).max().item()
        assert 0 < rel < {"fp8": 0.04, "fp8-e5m2": 0.08, "int8": 0.02}[fmt], (fmt, rel)


def test_a_view_of_stored_memory_in_another_layout_is_rebuilt_from_the_stored_copy():
    """SDPA stores its output ``[B, H, T, D]``, laid out as ``[B, T, H, D]`` like the query transformers gives it; the
    output projection saves the same memory again as ``[B x T, H x D]``: that view is rebuilt from the stored output,
    not stored a second time, and the gradients stay those of 8-bit storage."""
    torch.manual_seed(0)
    projected = torch.randn(1, 32, 64, requires_grad=True)  # [B, T, H x D], as q_proj returns it
    w = torch.randn(64, 8, requires_grad=True)

    def attention_then_projection(copy):
        q = projected.view(1, 32, 4, 16).transpose(1, 2)  # [B, H, T, D] over [B, T, H, D] memory
        o = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        return (copy(o).reshape(-1, 64) @ w).square().sum()  # the projection saves its [T, H x D] input

    def stored(copy) -> tuple[int, torch.Tensor, torch.Tensor]:
        storage = ActivationStorage(torch.nn.Linear(1, 1), min_numel=1)
        with storage:
            y = attention_then_projection(copy)
        projected.grad = w.grad = None
        y.backward()
        return storage.stored_bytes, projected.grad.clone(), w.grad.clone()

    viewed = stored(lambda o: o.transpose(1, 2).reshape(1, 32, 64))
    assert viewed[1].shape == projected.shape
    computed = stored(lambda o: o.transpose(1, 2).reshape(1, 32, 64) * 1.0)  # new memory: stored on its own
    assert computed[0] - viewed[0] == 32 * 64 + 32 * 4  # the [32, 64] int8 codes and their fp32 row scales
    exact = torch.autograd.grad(attention_then_projection(lambda o: o.transpose(1, 2).reshape(1, 32, 64)), (projected, w))
    for got, ref in zip(viewed[1:], exact):
        assert ((got - ref).norm() / ref.norm()).item() < 0.03


def test_a_tensor_saved_by_several_ops_is_rebuilt_once_for_all_of_them(monkeypatch):
    """q, k and v's projections (and their adapters) save one input: backward rebuilds its 8-bit copy once, shares it,
    and drops it after the last reader; walked again (retain_graph), the graph rebuilds it for each reader."""
    from hf_lowprec.training import activations

    rebuilt = []
    real = activations._Packed.unpack
    monkeypatch.setattr(activations._Packed, "unpack", lambda self: rebuilt.append(self) or real(self))
    torch.manual_seed(0)
    x = torch.randn(16, 64)
    weights = [torch.randn(32, 64, requires_grad=True) for _ in range(3)]
    storage = ActivationStorage(fmt="int8", min_numel=1)
    with storage:
        loss = sum((F.linear(x, w) * scale).sum() for w, scale in zip(weights, (1, 2, 3)))  # each saves x
    assert storage.stored_bytes == 16 * 64 + 16 * 4  # stored once
    loss.backward(retain_graph=True)
    assert len(rebuilt) == 1 and rebuilt[0].rebuilt is None  # one rebuild, released after the third reader
    copy = real(rebuilt[0])  # the int8 round trip of x
    assert_int8_rows(copy, x)
    first = [w.grad.clone() for w in weights]
    for scale, got in zip((1, 2, 3), first):
        torch.testing.assert_close(got, torch.full((32, 16), float(scale)) @ copy, rtol=1e-5, atol=1e-5)
    for w in weights:
        w.grad = None
    loss.backward()
    assert len(rebuilt) == 1 + 3 and all(torch.equal(w.grad, g) for w, g in zip(weights, first))  # once per reader


def test_only_a_tensor_rebuilt_for_one_reader_is_that_readers_to_overwrite():
    """``reader_owns``: a copy rebuilt for one backward alone is its to overwrite; one shared by several readers (q,
    k and v's input) is no reader's, and a second walk of the graph rebuilds it for each reader alone."""
    from hf_lowprec.training import activations

    class Rebuilt(activations._Stored):
        def unpack(self):
            return torch.zeros(4)

    single = Rebuilt()
    assert ActivationStorage.reader_owns(single.take())
    shared = Rebuilt()
    shared.uses = 3
    first = [shared.take() for _ in range(3)]
    assert first[0] is first[1] is first[2] and not ActivationStorage.reader_owns(first[0])
    again = shared.take()  # retain_graph: walked again
    assert again is not first[0] and ActivationStorage.reader_owns(again)
    assert not ActivationStorage.reader_owns(torch.zeros(4))  # saved as it was: the forward's own tensor
