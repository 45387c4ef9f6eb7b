"""Helpers shared by the benchmark scripts: timing, memory, result files."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import torch

from hf_lowprec.metrics import peak_rss_mb  # noqa: F401  (the benchmarks' peak-RSS helper)
from hf_lowprec.modules.kernels.cpu import cpu_info

RESULTS = Path(__file__).parent / "results"


def lm_batches(blocks: torch.Tensor, size: int, count: int) -> list[dict]:
    """The first ``count`` batches of ``size`` token blocks ``[N, T]``, as causal-LM inputs with their labels."""
    return [{"input_ids": b, "labels": b} for b in blocks[: size * count].split(size)]


def saved_tensor_bytes(fn) -> int:
    """Bytes of the distinct tensor storages autograd saves for backward while ``fn()`` runs forward."""
    seen: dict[int, int] = {}

    def pack(t):
        if t.device.type != "meta":
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def proc_status_bytes(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in bytes."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> None:
    """Set this process's peak RSS mark (``VmHWM``) to its current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value) of per-seed figures."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


# the variables that reproduce a CPU class on a larger CPU (``make test-avx2-emulated``), recorded with each result
EMULATION_ENV = ("HF_LOWPREC_CPU_CLASS", "ATEN_CPU_CAPABILITY", "TORCHINDUCTOR_CPP_MARCH", "ONEDNN_MAX_CPU_ISA",
                 "MKL_ENABLE_INSTRUCTIONS")  # fmt: skip


def machine() -> dict:
    """The CPU a result was measured on (model, class, flags), threads, torch version and, where a class is reproduced
    on a larger CPU, the variables that did it (``emulated_by``)."""
    cpu = cpu_info()
    emulation = {v: os.environ[v] for v in EMULATION_ENV if v in os.environ}
    return {"machine": cpu.model, "cpu_class": cpu.cpu_class, "cpu": cpu.to_dict(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "emulated_by": emulation or None}  # fmt: skip


def write_json(name: str, data: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
    return path
