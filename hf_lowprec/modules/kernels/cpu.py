"""What this CPU can do: its model name and the instruction-set extensions the kernels care about, read once.

The capabilities only say which kernels *can* run; which one runs is measured (:mod:`.autotune`).

``HF_LOWPREC_CPU_CLASS=avx2`` makes hf-lowprec treat the CPU as AVX2-only (no AVX-512, VNNI, native bf16 or
AMX; its C++ kernels built for ``x86-64-v3``), to reproduce the AVX2 class on a larger CPU; pair it with torch's own
``ATEN_CPU_CAPABILITY=avx2``, ``TORCHINDUCTOR_CPP_MARCH=x86-64-v3``, ``ONEDNN_MAX_CPU_ISA=AVX2`` and
``MKL_ENABLE_INSTRUCTIONS=AVX2`` so that torch's kernels follow (``make test-avx2-emulated``). Without the inductor
target, torch 2.13 builds its AVX2 code ``-march=native``, and on an AVX-512 EPYC that code's sums came out wrong
(the chunked loss's compiled cross-entropy: 402 against 904).
"""

from __future__ import annotations

import functools
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

CLASS_ENV = "HF_LOWPREC_CPU_CLASS"
# the flags (as /proc/cpuinfo spells them) that decide which kernels can run
X86_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
)
ARM_FLAGS = ("asimd", "asimddp", "i8mm", "bf16", "sve")
_CLASSES = {"avx2": ("avx2", "fma")}  # what each HF_LOWPREC_CPU_CLASS value keeps


@dataclass(frozen=True)
class CpuInfo:
    """The CPU's model name, architecture, the relevant flags it has, and torch's own dispatch level."""

    model: str
    arch: str
    flags: tuple[str, ...]
    torch_capability: str
    restricted_to: str | None = None

    def has(self, flag: str) -> bool:
        return flag in self.flags

    @property
    def native_bf16(self) -> bool:
        """bf16 dot products in hardware (AVX512-BF16, AMX-BF16, Arm BF16)."""
        return any(self.has(f) for f in ("avx512_bf16", "amx_bf16", "bf16"))

    @property
    def int8_dot(self) -> bool:
        """int8 dot products in hardware (AVX512-VNNI, AVX-VNNI, AMX-INT8, Arm dot product / i8mm)."""
        return any(self.has(f) for f in ("avx512_vnni", "avx_vnni", "amx_int8", "asimddp", "i8mm"))

    @property
    def cpu_class(self) -> str:
        """A short name of the class: ``AMX``, ``AVX512-BF16``, ``AVX512``, ``AVX2``, ``Arm``, or ``baseline``."""
        if self.has("amx_tile"):
            return "AMX"
        if self.has("avx512f"):
            return "AVX512-BF16" if self.has("avx512_bf16") else "AVX512"
        if self.has("avx2"):
            return "AVX2"
        return "Arm" if self.arch in ("aarch64", "arm64") else "baseline"

    def summary(self) -> str:
        """One line for logs and bug reports: ``AMD EPYC (AVX2: avx2 fma; torch AVX2)``."""
        restricted = f", restricted by {CLASS_ENV}={self.restricted_to}" if self.restricted_to else ""
        flags = " ".join(self.flags) or "none"
        return f"{self.model} ({self.cpu_class}: {flags}; torch {self.torch_capability}{restricted})"

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "arch": self.arch,
            "class": self.cpu_class,
            "flags": list(self.flags),
            "torch_capability": self.torch_capability,
            "native_bf16": self.native_bf16,
            "int8_dot": self.int8_dot,
            "restricted_to": self.restricted_to,
        }


@functools.cache
def cpu_info() -> CpuInfo:
    """This machine's :class:`CpuInfo` (``/proc/cpuinfo`` where it exists, torch's probes elsewhere)."""
    model, flags = _read_proc_cpuinfo()
    arch = platform.machine().lower()
    if not flags:  # no /proc (macOS, Windows): torch's own probes cover the x86 flags that matter
        probes = {
            "avx2": torch.cpu._is_avx2_supported,
            "avx512f": torch.cpu._is_avx512_supported,
            "avx512_vnni": torch.cpu._is_vnni_supported,
            "avx512_bf16": torch.cpu._is_avx512_bf16_supported,
            "amx_tile": torch.cpu._is_amx_tile_supported,
        }
        flags = {name for name, probe in probes.items() if probe()}
    known = X86_FLAGS if arch in ("x86_64", "amd64") else ARM_FLAGS
    present = tuple(f for f in known if f in flags)
    restricted = os.environ.get(CLASS_ENV, "").strip().lower() or None
    if restricted is not None:
        if restricted not in _CLASSES:
            raise ValueError(f"{CLASS_ENV}={restricted!r}: choose one of {', '.join(_CLASSES)}")
        present = tuple(f for f in present if f in _CLASSES[restricted])
    return CpuInfo(
        model or platform.processor() or arch, arch, present, torch.backends.cpu.get_cpu_capability(), restricted
    )


def cores_busy_elsewhere(seconds: float = 0.25) -> float | None:
    """How many of this machine's cores other processes kept busy over the next ``seconds`` (``/proc/stat``'s busy
    time less this process's own, in cores); ``None`` off Linux. Why it matters: torch's OpenMP threads meet at a
    barrier after every parallel region, so one thread sharing its core with another process's makes each region
    wait for that core's time slice (:func:`contention_warning` says what that cost)."""
    stat = Path("/proc/stat")
    if not stat.is_file():
        return None

    def busy_ticks() -> int:
        fields = [int(v) for v in stat.read_text().split("\n", 1)[0].split()[1:]]  # the "cpu" line, in clock ticks
        return sum(fields[:8]) - fields[3] - (fields[4] if len(fields) > 4 else 0)  # all but idle and iowait

    busy0, own0 = busy_ticks(), time.process_time()
    time.sleep(seconds)
    busy1, own1 = busy_ticks(), time.process_time()
    busy = (busy1 - busy0) / os.sysconf("SC_CLK_TCK") - (own1 - own0)
    return max(0.0, min(float(os.cpu_count() or 1), busy / seconds))


def contention_warning(threads: int | None = None) -> str | None:
    """One line when other processes leave fewer idle cores than torch's ``threads`` (default its intra-op count),
    naming the thread count that fits; ``None`` otherwise (and off Linux)."""
    threads = threads or torch.get_num_threads()
    if threads == 1:  # nothing to wait for (and nothing to measure)
        return None
    busy = cores_busy_elsewhere()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    idle = max(1, round(cores - busy)) if busy is not None else threads
    if idle >= threads:
        return None
    return (
        f"other processes keep {busy:.1f} of this machine's {cores} cores busy and torch runs {threads} threads, so "
        f"every parallel step waits for a busy core's time slice (a short demo run on a 2-core EPYC with one core busy "
        f"elsewhere: 57 s a step, 1.3 s with one thread); stop them, or run with OMP_NUM_THREADS={idle}"
    )


def build_tag() -> str:
    """What ``-march=native`` code depends on: the CPU model and every flag it has (never restricted)."""
    model, flags = _read_proc_cpuinfo()
    return f"{model or platform.machine()}|{' '.join(sorted(flags))}"


def _read_proc_cpuinfo() -> tuple[str, set[str]]:
    path = Path("/proc/cpuinfo")
    if not path.is_file():
        return "", set()
    model, flags = "", set()
    for line in path.read_text(errors="replace").splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model name", "Hardware") and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return model, flags
