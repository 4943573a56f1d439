#!/usr/bin/env bash
# GPU job: keep the machine's own CUDA torch (never install one here) and work offline:
# reffsdp is installed without dependencies or build isolation. Runs the CUDA tests (gpu
# and multiprocess markers on cuda), then the step-time benchmark.
# Usage: bash ci/gpu.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible'"
python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
python -c "import numpy, pytest, pytest_timeout" 2>/dev/null ||
    python -m pip install --quiet --disable-pip-version-check numpy pytest pytest-timeout
python -m pytest -p no:cacheprovider --device cuda -m "gpu or multiprocess" "$@"
# Step time against torch's fully_shard and DDP on one GPU (prints ratios).
python tests/benchmarks/bench_step_time.py --backend nccl --world-size 1
