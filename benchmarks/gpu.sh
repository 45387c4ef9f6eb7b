#!/usr/bin/env bash
# The GPU column of the report: run on a lent H100/H200 through the device tool, from the repo root.
#   Prepare here once (/.whl/ is ignored by .gitignore):
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
#       torchao==0.18.0 transformers==5.24.0 peft==0.21.2
#   Then: run(command="bash benchmarks/gpu.sh", carry=[".whl"], timeout_s=480); afterwards copy the results in:
#     cp <files_at>/gpu.json <files_at>/gpu.log benchmarks/results/ && python benchmarks/report.py
# The image (KINDS.md) has python3 3.12 with torch 2.11 (CUDA 13), accelerate, safetensors and huggingface_hub 1.33;
# its transformers (5.17) and peft are older than this project's, so they travel as wheels with torchao. A smoke check
# of torchao's FP8 kernels runs first (seconds); the whole run, compiles included, is sized for < 7 minutes, and the
# JSON is rewritten after each configuration.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
out=${OUT:-benchmarks/results}
timeout 420 python3 benchmarks/gpu_fp8.py --out "$out/gpu.json" 2>&1 | tee "$out/gpu.log"
