#!/usr/bin/env bash
# GPU job: keep the machine's own CUDA torch (never install one here) and work offline:
# reffsdp is installed without dependencies or build isolation. Runs the CUDA tests (gpu
# and multiprocess markers on cuda; torch's CUDA stream sanitizer among them), the parity
# suite on nccl (one rank per GPU, world size 1: the 1-D scenarios), again under the
# sanitizer, and on threaded ranks sharing the GPU (world size 4), then the step-time
# benchmark. Every step runs even when an earlier one fails; the exit status is non-zero if
# any did. The parity suite's reports (parity-nccl.{json,xml}, parity-nccl-sanitized.json,
# parity-threaded-cuda.{json,xml}) go to $OUT when it is set, else build/ci-reports.
# Usage: bash ci/gpu.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-build/ci-reports}"
mkdir -p "$out"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible'"
# Installed from this checkout already (a caller may have done it): keep it, so that
# processes it started meanwhile never see a half-reinstalled package.
python -c "import pathlib, sys, reffsdp.testing
sys.exit(pathlib.Path(reffsdp.__file__).resolve().parents[1] != pathlib.Path.cwd().resolve())" 2>/dev/null ||
    python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
python -c "import numpy, pytest, pytest_timeout, rich" 2>/dev/null ||
    python -m pip install --quiet --disable-pip-version-check numpy pytest pytest-timeout rich

status=0
python -m pytest -p no:cacheprovider --device cuda -m "gpu or multiprocess" "$@" || status=1
python -m reffsdp.testing --backend nccl --world-size 1 \
    --json "$out/parity-nccl.json" --junit-xml "$out/parity-nccl.xml" || status=1
# The same scenarios under torch's CUDA stream sanitizer: a kernel touching memory that another
# stream may still use, with no event or stream wait ordering the two, fails the run.
TORCH_CUDA_SANITIZER=1 python -m reffsdp.testing --backend nccl --world-size 1 \
    --json "$out/parity-nccl-sanitized.json" || status=1
python -m reffsdp.testing --backend threaded --device cuda --world-size 4 \
    --json "$out/parity-threaded-cuda.json" --junit-xml "$out/parity-threaded-cuda.xml" || status=1
# Step time against torch's fully_shard and DDP on one GPU (prints ratios).
python tests/benchmarks/bench_step_time.py --backend nccl --world-size 1 || status=1
exit "$status"
