"""Measured choices, cached per machine: the compute dtype, and the kernel of each packed-layer shape.

A choice is made the first time it is needed, by timing each candidate this CPU can run (a few ms each), and
kept in ``~/.cache/hf_lowprec/autotune.json`` (``HF_LOWPREC_CACHE`` names another folder) under a key of the
CPU model, its flags, the torch version and the thread count, so a machine of another CPU class, or the same
one with another torch, measures again. Nothing is assumed from the CPU's name: a kernel that its instructions
make possible still has to win the timing.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from hf_lowprec.folders import atomic_write_text
from hf_lowprec.modules.kernels.cpu import cpu_info

logger = logging.getLogger(__name__)

CACHE_ENV = "HF_LOWPREC_CACHE"
BF16_MIN_SPEEDUP = 1.2  # bf16 compute only where its GEMM beats fp32 by this much (it also rounds more)
DTYPE_PROBE_SHAPE = (128, 512, 512)  # M, K, N: small enough that an emulated bf16 GEMM takes < 0.1 s
# the dtype probe's cache entry; "1-thread cpu time": measured since 2026-12-03 on one thread's CPU time (earlier
# wall-clock entries, which another process's load could decide, are measured again)
DTYPE_KEY = "compute-dtype:1-thread cpu time"
_lock = threading.Lock()
_memory: dict[str, dict] = {}


@dataclass(frozen=True)
class Choice:
    """What was chosen, why (one line), and what each candidate measured (``{name: seconds per call}``)."""

    value: str
    reason: str
    seconds: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"value": self.value, "reason": self.reason, "seconds": self.seconds}


def machine_key() -> str:
    """The key measurements are cached under: CPU model and flags, torch version, intra-op threads."""
    cpu = cpu_info()
    # "timing 2": choices timed by the interleaved rounds of time_calls (earlier ones are measured again); "kernels 2":
    # the int8 backend multiplies through AMX tiles where it can (kernels/amx.py; earlier choices timed torch._int_mm);
    # "kernels 3": it runs on AVX2 CPUs too (kernels/avx2_int8.py; earlier choices there never timed it)
    threads = torch.get_num_threads()
    return f"{cpu.model}|{','.join(cpu.flags)}|torch {torch.__version__}|{threads} threads|timing 2|kernels 3"


def cache_path() -> Path:
    root = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "hf_lowprec"
    return Path(root) / "autotune.json"


def time_calls(
    calls: dict[str, Callable[[], object]], repeats: int = 5, clock: Callable[[], float] | None = None
) -> dict[str, float]:
    """``{name: seconds}``: the fastest of ``repeats`` calls of each of ``calls``, taken in interleaved rounds after
    one warm-up call each, on ``clock`` (wall time, ``time.perf_counter``, unless given).

    Interleaved, and the fastest rather than the median: load from another process slows the calls it overlaps,
    not one candidate's whole measurement. Timed one candidate after the other (medians of 3), this CPU once cached
    bf16 GEMMs at 1.14x fp32 (so fp32 compute) where they run 3x, a 2-thread job having run beside the probe.
    """
    clock = clock or time.perf_counter
    for call in calls.values():
        call()
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(repeats):
        for name, call in calls.items():
            start = clock()
            call()
            best[name] = min(best[name], clock() - start)
    return best


@contextmanager
def one_thread():
    """torch's intra-op threads set to one for the block (restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def fastest(
    key: str,
    candidates: dict[str, Callable[[], object]],
    why: Callable[[str, dict[str, float]], str],
    clock: Callable[[], float] | None = None,
) -> Choice:
    """The candidate of ``candidates`` (``{name: call}``) that runs fastest on ``clock`` (:func:`time_calls`),
    measured once per machine and ``key``.

    ``why(winner, seconds)`` words the reason. A cached winner that is no longer a candidate is measured again.
    """
    cached = _entries().get(key)
    if cached is not None and cached["value"] in candidates:
        return Choice(cached["value"], cached["reason"], cached["seconds"])
    with torch.no_grad():
        seconds = time_calls(candidates, clock=clock)
    winner = min(seconds, key=seconds.get)
    choice = Choice(winner, why(winner, seconds), {k: round(v, 6) for k, v in seconds.items()})
    _store(key, choice)
    logger.info("autotune %s: %s (%s)", key, choice.value, choice.reason)
    return choice


def compute_dtype(device: torch.device | str = "cpu") -> tuple[torch.dtype, str]:
    """``(dtype, reason)``: the dtype a model computes in on ``device`` when the user asks for ``"auto"``.

    CUDA: bf16. CPU: bf16 only where this CPU has native bf16 *and* its bf16 GEMM measured at least
    ``BF16_MIN_SPEEDUP`` x fp32's; fp32 otherwise (an AVX2 CPU emulates bf16 GEMMs 25-80x slower than fp32).
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16, "compute bf16: CUDA"
    if device.type != "cpu":
        return torch.float32, f"compute fp32: no measured choice for {device.type}"
    return _cpu_compute_dtype()


@functools.cache
def _cpu_compute_dtype() -> tuple[torch.dtype, str]:
    cpu = cpu_info()
    if not cpu.native_bf16:
        return torch.float32, f"compute fp32: this CPU has no native bf16 ({cpu.cpu_class})"
    m, k, n = DTYPE_PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    xb, wb = x.bfloat16(), w.bfloat16()
    candidates = {"bf16": lambda: F.linear(xb, wb), "fp32": lambda: F.linear(x, w)}
    # a property of the cores' instructions, so timed on one thread's CPU time: a 2-thread GEMM this small waits at
    # its barrier for a thread another process holds off the core, so that a 2-core AMX Xeon beside a 2-thread job
    # measured both dtypes at its scheduler's 8 ms (bf16 1.07x fp32, so fp32 compute) where one thread measures 3.1x
    with one_thread():
        choice = fastest(DTYPE_KEY, candidates, _dtype_reason, clock=time.thread_time)
    return (torch.bfloat16 if _bf16_wins(choice.seconds) else torch.float32), choice.reason


def _bf16_wins(seconds: dict[str, float]) -> bool:
    """Whether bf16 measured at least ``BF16_MIN_SPEEDUP`` x fp32 (``seconds``: per candidate)."""
    return seconds["fp32"] / max(seconds["bf16"], 1e-12) >= BF16_MIN_SPEEDUP


def _dtype_reason(winner: str, seconds: dict[str, float]) -> str:
    ratio = seconds["fp32"] / max(seconds["bf16"], 1e-12)
    chosen = "bf16" if _bf16_wins(seconds) else "fp32"
    return f"compute {chosen}: bf16 GEMM measured {ratio:.2f}x fp32 on this CPU ({cpu_info().cpu_class})"


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device | str = "cpu") -> tuple[torch.dtype, str]:
    """``(torch dtype, reason)`` for a user's ``dtype``: ``"auto"``/``None`` measured (:func:`compute_dtype`),
    ``"bf16"``/``"fp32"``/``torch.bfloat16``/``torch.float32`` as asked."""
    if dtype is None or dtype == "auto":
        return compute_dtype(device)
    dtype = named_dtype(dtype)
    return dtype, f"compute {'bf16' if dtype == torch.bfloat16 else 'fp32'}: as requested"


def named_dtype(dtype: torch.dtype | str, what: str = "dtype") -> torch.dtype:
    """``torch.bfloat16`` or ``torch.float32`` for ``"bf16"``/``"bfloat16"``/``"fp32"``/``"float32"`` or that dtype;
    anything else raises ``ValueError`` naming ``what`` and the allowed values (``auto`` is the caller's to resolve)."""
    named = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}
    if isinstance(dtype, str):
        if dtype not in named:
            raise ValueError(f"{what} {dtype!r}: choose one of auto, bf16, fp32")
        dtype = named[dtype]
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"{what} {dtype}: choose one of auto, torch.bfloat16, torch.float32")
    return dtype


def measured() -> dict[str, dict]:
    """Every choice this machine has measured so far (``{key: Choice.to_dict()}``)."""
    return dict(_entries())


# ----------------------------------------------------------------------------- the cache file
def _entries() -> dict[str, dict]:
    """This machine's cached choices; entries not of :meth:`Choice.to_dict`'s shape (a file edited or written by
    something else) are measured again."""
    mk = machine_key()
    if mk not in _memory:
        entries = _cache_file().get(mk)
        entries = entries if isinstance(entries, dict) else {}
        _memory[mk] = {k: v for k, v in entries.items() if _is_choice(v)}
    return _memory[mk]


def _is_choice(entry) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("value"), str)
        and isinstance(entry.get("reason"), str)
        and isinstance(entry.get("seconds"), dict)
    )


def _cache_file() -> dict:
    """The cache file's contents: ``{machine key: {choice key: choice}}``; ``{}`` when absent or not JSON of that
    shape (its next write replaces it)."""
    try:
        everything = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return everything if isinstance(everything, dict) else {}


def _store(key: str, choice: Choice) -> None:
    """Record ``choice`` in memory and in the cache file (never half-written)."""
    with _lock:
        _entries()[key] = choice.to_dict()
        path = cache_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            everything = _cache_file()
            everything[machine_key()] = _entries()
            atomic_write_text(path, json.dumps(everything, indent=1))
        except OSError as e:  # a read-only home: keep the choice for this process only
            logger.warning("could not write the autotune cache %s (%s); measuring again next run", path, e)
