"""The once-per-machine work of a first run, done at install time by ``make setup``: ``python -m hf_lowprec.machine_setup``.

A first ``hf-lowprec finetune`` on a new machine otherwise spends about 90 s (2-core AVX2 CPU) before its first step
on work that later runs skip: compiling the CPU kernels (~45 s, :mod:`hf_lowprec.modules.kernels.cpp`; cached under
``~/.cache/torch_extensions``) and dequantizing the offline default checkpoint's GGUF file (~40 s; cached under
``~/.cache/hf_lowprec/gguf``) in the dtype this CPU computes in (measured once, cached with the kernel choices). Each
step is skipped when its cache is already there, so running this again costs a few seconds.
"""

from __future__ import annotations

import logging
import time

from hf_lowprec.checkpoints import cache_gguf, default_checkpoint
from hf_lowprec.modules.kernels.autotune import compute_dtype
from hf_lowprec.modules.kernels.cpp import cpu_kernels


def prepare_machine() -> list[str]:
    """Build the CPU kernels, measure the compute dtype and cache the default checkpoint in it; one line per step."""
    lines = []
    start = time.perf_counter()
    built = cpu_kernels() is not None
    lines.append(f"CPU kernels {'ready' if built else 'not built (packed layers use torch ops)'} "
                 f"({time.perf_counter() - start:.0f} s)")  # fmt: skip
    dtype, reason = compute_dtype("cpu")
    lines.append(reason)
    start = time.perf_counter()
    folder, gguf = default_checkpoint()
    cache_gguf(folder, gguf, dtype)  # a bf16 copy is made from the fp32 one, which full training's master weights load
    lines.append(f"default checkpoint {gguf} cached ({time.perf_counter() - start:.0f} s)")
    return lines


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for line in prepare_machine():
        print(line, flush=True)


if __name__ == "__main__":
    main()
