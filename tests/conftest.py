"""Shared fixtures: tiny models built from configs and small, learnable token batches."""

import os
import shutil
import tempfile

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForCausalLM

VOCAB = 256

# Tiny models gain nothing from a second thread, and on a loaded 2-core machine OpenMP spinning
# makes a tiny matmul thousands of times slower; one thread keeps the suite fast and deterministic.
torch.set_num_threads(1)
# measured kernel choices (and the dequantized GGUF checkpoints, 0.5 GB) go to a folder of this run, not the user's
# cache (tests never depend on the winner); the worker processes that import this file share their run's folder, and
# the run removes it when it ends (left behind, every run added one under /tmp)
_OWN_CACHE = "HF_LOWPREC_TEST_CACHE" not in os.environ
if _OWN_CACHE:
    os.environ["HF_LOWPREC_TEST_CACHE"] = tempfile.mkdtemp(prefix="hf_lowprec_cache_")
os.environ["HF_LOWPREC_CACHE"] = os.environ["HF_LOWPREC_TEST_CACHE"]


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE:
        shutil.rmtree(os.environ["HF_LOWPREC_TEST_CACHE"], ignore_errors=True)


def _cpp_kernels_build() -> bool:
    from hf_lowprec.modules.kernels.cpp import cpu_kernels

    return cpu_kernels() is not None


# the C++ kernels need AVX2 and a compiler: they build on both CPU classes of these machines, so this skips only where
# neither exists (the torch-op fallbacks are tested beside them)
needs_cpp = pytest.mark.skipif(not _cpp_kernels_build(), reason="the C++ CPU kernels cannot be built here")


def tiny_llama(seed: int = 0, tie: bool = False, **overrides) -> LlamaForCausalLM:
    """A 2-layer Llama (hidden 64) in fp32."""
    cfg = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=tie,
    )  # fmt: skip
    cfg.update(overrides)
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**cfg))


def autocast_states(module: torch.nn.Module) -> tuple[list, object]:
    """``(states, handle)``: each forward of ``module`` appends ``(autocast on, its dtype)`` on the CPU to ``states``
    until ``handle.remove()``."""
    states = []

    def record(mod, args):
        states.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))

    return states, module.register_forward_pre_hook(record)


def on_dequant_backend(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every packed layer on the ``dequant`` backend: the exact reference, the same for every batch (the
    int8 backend picks its outlier channels per call)."""
    from hf_lowprec.modules import PackedLinear

    for m in model.modules():
        if isinstance(m, PackedLinear):
            m.backend = "dequant"
    return model


@torch.no_grad()
def randomize_adapters(model: torch.nn.Module, std: float) -> None:
    """Non-zero LoRA ``B`` matrices (normal, ``std``), so that every adapter changes the output: a stand-in for training."""
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.normal_(std=std)


@torch.no_grad()
def with_loud_channels(model: torch.nn.Module, channels: int = 4, gain: float = 20.0) -> torch.nn.Module:
    """``model`` with its first ``channels`` hidden channels made ``gain``x louder at every RMSNorm output, like
    the few massive activation channels of pretrained LLMs (random-init models have none)."""
    for name, module in model.named_modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.weight[:channels] *= gain
    return model


def exact_int_mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` of int8 matrices in int32, exactly: an fp64 matmul of their values (exact below 2^53). Stands in for
    ``torch._int_mm``, whose oneDNN AVX2 path saturates 16-bit pair sums."""
    product = (a.double() @ b.double()).to(torch.int32)
    return product if out is None else out.copy_(product)


def int8_rows_reference(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(t's symmetric int8 round trip per row, each row's step [..., 1])`` computed here in fp64: step =
    ``max|row| / 127``, codes rounded to nearest. The reference for the library's row quantizers, which compute in fp32
    (a code may differ by one where fp32 rounds a near-tie the other way)."""
    rows = t.detach().double()
    step = rows.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127
    return ((rows / step).round().clamp(-127, 127) * step).to(t.dtype), step


def assert_int8_rows(back: torch.Tensor, t: torch.Tensor) -> None:
    """``back`` is ``t``'s int8 round trip per row: every value within one step of :func:`int8_rows_reference`'s, and
    all but a few of them equal to it."""
    reference, step = int8_rows_reference(t)
    off = (back.double() - reference.double()).abs()
    assert (off <= step * 1.001).all(), off.max()
    assert (off > step * 1e-3).float().mean() < 1e-3, (off > step * 1e-3).float().mean()


def tiny_bert(seed: int = 0) -> BertForSequenceClassification:
    """A 2-layer BERT classifier (hidden 64, 2 labels) in fp32."""
    torch.manual_seed(seed)
    cfg = BertConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
        max_position_embeddings=64, num_labels=2,
    )  # fmt: skip
    return BertForSequenceClassification(cfg)


def lm_batches(n: int = 4, batch: int = 8, seq: int = 32, seed: int = 1) -> list[dict]:
    """Learnable causal-LM batches: each sequence repeats a short random motif."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        motif = torch.randint(0, VOCAB, (batch, 8), generator=g)
        ids = motif.repeat(1, seq // 8)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def markov_batches(n: int = 8, batch: int = 8, seq: int = 32, successors: int = 6, seed: int = 1) -> list[dict]:
    """Batches from a fixed random Markov chain: each token has ``successors`` likely next tokens.

    The achievable loss is the chain's conditional entropy (~1.5 nats), so losses converge to a
    level where relative comparisons between runs are meaningful.
    """
    g = torch.Generator().manual_seed(seed)
    nxt = torch.randint(0, VOCAB, (VOCAB, successors), generator=g)
    probs = torch.softmax(torch.randn(VOCAB, successors, generator=g), -1)
    out = []
    for _ in range(n):
        ids = torch.empty(batch, seq, dtype=torch.long)
        ids[:, 0] = torch.randint(0, VOCAB, (batch,), generator=g)
        for t in range(1, seq):
            choice = torch.multinomial(probs[ids[:, t - 1]], 1, generator=g).squeeze(1)
            ids[:, t] = nxt[ids[:, t - 1], choice]
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def cls_batches(n: int = 4, batch: int = 16, seq: int = 16, seed: int = 1) -> list[dict]:
    """Classification batches whose label is whether token 1 appears more often than token 2."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, 12, (batch, seq), generator=g)
        labels = torch.randint(0, 2, (batch,), generator=g)
        ids[:, 0] = 1 + labels  # the label is readable from the first token
        out.append({"input_ids": ids, "labels": labels})
    return out


@pytest.fixture
def llama():
    return tiny_llama()


@pytest.fixture
def bert():
    return tiny_bert()


@pytest.fixture
def counted_trims(monkeypatch) -> list[int]:
    """glibc's ``malloc_trim`` calls made through :mod:`hf_lowprec.allocator` (each runs), with glibc's defaults."""
    from hf_lowprec import allocator

    libc = allocator._glibc()
    if libc is None:
        pytest.skip("glibc's allocator only")
    for name in allocator.USER_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    trims = []

    class CountedTrims:
        def __getattr__(self, name):
            return getattr(libc, name)

        def malloc_trim(self, pad):
            trims.append(pad)
            return libc.malloc_trim(pad)

    monkeypatch.setattr(allocator, "_glibc", CountedTrims)
    return trims
