"""`make bench` (about 50 minutes) and `make bench-full` (about 95): run the CPU benchmarks in sequence, then rebuild
results/REPORT.md.

`make bench` runs what the claims table rests on, sized to a 60-minute budget on the 2-core reference machine (AMD EPYC
Zen 5, AVX512-BF16); measured seconds per step there: kernel_speed 66, layers 12, memory (its five claim
configurations) about 220, scan 154, ondevice 599, the toy convergence sweep (four setups x 3 seeds) 945, the
SmolLM2-135M architecture's (two setups x 3 seeds) 880 to 1,280 as the machine's load varied. `make bench-full`
(`--full`) reruns memory with every configuration and peer (605), the toy sweep with the fp8-mx setup too (1,560), and
adds the 30-step fine-tuning table (575) and outliers.py (895). The longer runs the report also quotes (200-step
fine-tuning, 600-step convergence, scale.py, adapter_optimizer.py, ondevice.py quality) are started by hand: each
script's docstring says how.

Each script runs in its own process (fresh memory high-water marks); a failing one is reported and the others still
run. A step's results file holds that step's last run only, so a `make bench` after `make bench-full` drops the extra
rows of memory.json and convergence.json until the next full run.

    python benchmarks/run_all.py [--full] [--skip NAME ...]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
SEEDS = ("--seeds", "0", "1", "2")
FP8_SETUPS = ("bf16", "fp8 (dynamic)")
CLAIM_SETUPS = (*FP8_SETUPS, "int4 everywhere, LSQ", "int4 attention only")  # x 3 seeds
FINETUNE_RUNS = ("bf16", "fp8", "auto plan", "int4 LoRA")
MEMORY_CLAIMS = ("a_fp32", "b_bf16_amp", "d_sr_8bit_fp8act", "d_sr_8bit_fp8act_fp8linear", "peer_torchao_float8")
# name -> (make bench's arguments or None, make bench-full's); each script's --help says more
STEPS = {
    "kernel_speed": (["kernel_speed.py", "--repeats", "3"],) * 2,
    "layers": (["layers.py", "--repeat", "7"],) * 2,
    "memory": (["memory.py", "--only", *MEMORY_CLAIMS], ["memory.py"]),
    "scan": (["scan.py"],) * 2,
    "ondevice": (["ondevice.py", "speed", "--steps", "6", "--warmup", "2"],) * 2,
    "finetune_quality": (None, ["finetune_quality.py", "--steps", "30", "--only", *FINETUNE_RUNS]),
    "outliers": (None, ["outliers.py"]),
    "convergence": (["convergence.py", "--steps", "400", *SEEDS, "--only", *CLAIM_SETUPS],
                    ["convergence.py", "--steps", "400", *SEEDS, "--only", *CLAIM_SETUPS, "fp8-mx"]),
    "convergence_smollm2": (["convergence.py", "--arch", "smollm2-135m", "--steps", "64", *SEEDS,
                             "--only", *FP8_SETUPS],) * 2,
}  # fmt: skip


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="make bench-full: every configuration, and the extra steps")
    ap.add_argument("--skip", nargs="*", default=[], choices=list(STEPS))
    args = ap.parse_args()
    failed = []
    for name, (quick, full) in STEPS.items():
        argv = full if args.full else quick
        if argv is None or name in args.skip:
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
