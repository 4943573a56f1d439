#!/usr/bin/env bash
# GPU job: keep the machine's own CUDA torch (never install one here) and work offline:
# reffsdp is installed without dependencies or build isolation. Runs the CUDA tests (gpu
# and multiprocess markers on cuda), the parity suite on nccl (one rank per GPU, world size
# 1) and on threaded ranks sharing the GPU (world size 4), then the step-time benchmark.
# Every step runs even when an earlier one fails; the exit status is non-zero if any did.
# The parity suite's reports (parity-nccl.{json,xml}, parity-threaded-cuda.{json,xml}) go
# to $OUT when it is set, else build/ci-reports.
# Usage: bash ci/gpu.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-build/ci-reports}"
mkdir -p "$out"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible'"
python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
python -c "import numpy, pytest, pytest_timeout, rich" 2>/dev/null ||
    python -m pip install --quiet --disable-pip-version-check numpy pytest pytest-timeout rich

status=0
python -m pytest -p no:cacheprovider --device cuda -m "gpu or multiprocess" "$@" || status=1
python -m reffsdp.testing --backend nccl --world-size 1 \
    --json "$out/parity-nccl.json" --junit-xml "$out/parity-nccl.xml" || status=1
python -m reffsdp.testing --backend threaded --device cuda --world-size 4 \
    --json "$out/parity-threaded-cuda.json" --junit-xml "$out/parity-threaded-cuda.xml" || status=1
# Step time against torch's fully_shard and DDP on one GPU (prints ratios).
python tests/benchmarks/bench_step_time.py --backend nccl --world-size 1 || status=1
exit "$status"
