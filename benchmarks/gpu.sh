#!/usr/bin/env bash
# The GPU column of the report: run on a lent H100/H200 through the device tool, from the repo root.
#   Prepare here once:  echo /.whl/ >> .git/info/exclude
#                       python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#                         --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
#                         -d .whl torchao==0.18.0
#   Then: run(command="bash benchmarks/gpu.sh", carry=[".whl"], timeout_s=540)
# The image has torch, transformers, accelerate and peft; torchao travels as a wheel. Budget: < 8 min.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
out=${OUT:-benchmarks/results}
timeout 450 python3 benchmarks/gpu_fp8.py --out "$out/gpu.json" 2>&1 | tee "$out/gpu.log"
