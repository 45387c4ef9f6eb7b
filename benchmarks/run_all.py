"""`make bench` (52 minutes, timed) and `make bench-full` (about 95): run the CPU benchmarks in sequence, then rebuild
results/REPORT.md.

`make bench` runs what the claims table rests on, sized to a 60-minute budget on the 2-core reference machine (AMD EPYC
Zen 5, AVX512-BF16). Timed end to end there on 2026-12-02 (a clone at 0957852, nothing else heavy running): 3,126 s,
i.e. 52 minutes: kernel_speed 73 s (a kernel rebuild included), layers 25, memory 129 (three configurations), scan 183,
ondevice speed 477 (without its int4-lora-plain ablation), the toy convergence sweep (three setups x 3 seeds) 653, the
SmolLM2-135M architecture's (two setups x 3 seeds) 1,576, the report 10. On 2026-12-01, with the machine slower
(bf16 LoRA's step 5.7 CPU-seconds instead of 3.2), the same steps took 119, 23, about 150, 234, 470, about 660 and
1,606 s: about 55 minutes.
`make bench-full` (`--full`) reruns memory with every configuration and peer (605 on a quiet machine), ondevice with its
ablation, the toy sweep with its int4-everywhere and fp8-mx setups (1,560), and adds the 30-step fine-tuning table (575)
and outliers.py (895). The longer runs the report also quotes (200-step fine-tuning, 600-step convergence, scale.py,
adapter_optimizer.py, ondevice.py quality,
scan_cost.py) are started by hand: each script's docstring says how.

Each script runs in its own process (fresh memory high-water marks); a failing one is reported and the others still
run. A step's results file holds that step's last run only, so a `make bench` after `make bench-full` drops the extra
rows of memory.json, ondevice.json's table and convergence.json until the next full run.

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
CLAIM_SETUPS = (*FP8_SETUPS, "int4 attention only")  # x 3 seeds; "INT4 is lossless on some layers" needs one
MORE_SETUPS = ("int4 everywhere, LSQ", "fp8-mx")
FINETUNE_RUNS = ("bf16", "fp8", "auto plan", "int4 LoRA")
MEMORY_CLAIMS = ("b_bf16_amp", "d_sr_8bit_fp8act", "d_sr_8bit_fp8act_fp8linear")
ONDEVICE_PEERS = ("fp32-lora", "bf16-lora", "bf16-lora-bf16ad", "bnb-nf4", "int4-lora")  # the goals' configurations
ONDEVICE = ("ondevice.py", "speed", "--steps", "6", "--warmup", "2")
# name -> (make bench's arguments or None, make bench-full's); each script's --help says more
STEPS = {
    "kernel_speed": (["kernel_speed.py", "--repeats", "3"],) * 2,
    "layers": (["layers.py", "--repeat", "7"],) * 2,
    "memory": (["memory.py", "--only", *MEMORY_CLAIMS], ["memory.py"]),
    "scan": (["scan.py"],) * 2,
    "ondevice": ([*ONDEVICE, "--configs", *ONDEVICE_PEERS], [*ONDEVICE]),
    "finetune_quality": (None, ["finetune_quality.py", "--steps", "30", "--only", *FINETUNE_RUNS]),
    "outliers": (None, ["outliers.py"]),
    "convergence": (["convergence.py", "--steps", "400", *SEEDS, "--only", *CLAIM_SETUPS],
                    ["convergence.py", "--steps", "400", *SEEDS, "--only", *CLAIM_SETUPS, *MORE_SETUPS]),
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
