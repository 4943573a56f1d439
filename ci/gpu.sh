#!/usr/bin/env bash
# GPU job: keep the machine's own CUDA torch (never install one here), install reffsdp
# without dependencies, run the CUDA tests (gpu and multiprocess markers on cuda), then
# the step-time benchmark.
# Usage: bash ci/gpu.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible'"
python -m pip install --quiet --disable-pip-version-check --no-deps -e .
python -m pip install --quiet --disable-pip-version-check pytest pytest-timeout parameterized coverage
python -m pytest -p no:cacheprovider --device cuda -m "gpu or multiprocess" "$@"
# Step time against torch's fully_shard and DDP on one GPU (prints ratios).
python tests/benchmarks/bench_step_time.py --backend nccl --world-size 1
