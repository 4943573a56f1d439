#!/usr/bin/env bash
# CPU job: install reffsdp with a pinned CPU torch, then run the whole test suite
# (threaded and multi-process harnesses over gloo). Usage: bash ci/cpu.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check "torch==2.13.0" -e ".[test]"
python -m pytest -p no:cacheprovider --durations=15 "$@"
