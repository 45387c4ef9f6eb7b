"""`make bench`: run every CPU benchmark in sequence, then rebuild results/REPORT.md.

Each script runs in its own process (fresh memory high-water marks); a failing one is reported and
the others still run. Measured on the 2-core reference machine (AVX512-BF16), seconds: kernel_speed 66, layers 12,
memory 605, scan 154, ondevice 599, finetune_quality 575, outliers 895, the two convergence sweeps about 1,650 and
1,050 (from their results): about 93 minutes, over the 60-minute budget; trimming it is open work.

    python benchmarks/run_all.py [--skip NAME ...]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
SEEDED_SETUPS = ("bf16", "fp8 (dynamic)", "fp8-mx", "int4 everywhere, LSQ", "int4 attention only")  # x 3 seeds
STEPS = {  # name -> arguments (sized for the 45-minute budget; each script's --help says more)
    "kernel_speed": ["kernel_speed.py", "--repeats", "3"],
    "layers": ["layers.py", "--repeat", "7"],
    "memory": ["memory.py"],
    "scan": ["scan.py"],
    "ondevice": ["ondevice.py", "speed", "--steps", "6", "--warmup", "2"],
    "finetune_quality": ["finetune_quality.py", "--steps", "30", "--only", "bf16", "fp8", "auto plan", "int4 LoRA"],
    "outliers": ["outliers.py"],
    "convergence": ["convergence.py", "--steps", "400", "--seeds", "0", "1", "2", "--only", *SEEDED_SETUPS],
    "convergence_smollm2": ["convergence.py", "--arch", "smollm2-135m", "--steps", "64", "--seeds", "0", "1", "2",
                            "--only", "bf16", "fp8 (dynamic)"],
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip", nargs="*", default=[], choices=list(STEPS))
    args = ap.parse_args()
    failed = []
    for name, argv in STEPS.items():
        if name in args.skip:
            continue
        t = time.perf_counter()
        print(f"== {name}: {' '.join(argv)}", flush=True)
        rc = subprocess.call([sys.executable, *argv], cwd=HERE)
        print(f"== {name}: exit {rc} after {time.perf_counter() - t:.0f} s", flush=True)
        if rc:
            failed.append(name)
    subprocess.check_call([sys.executable, "report.py"], cwd=HERE)
    if failed:
        sys.exit(f"benchmarks that failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
