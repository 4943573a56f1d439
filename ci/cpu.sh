#!/usr/bin/env bash
# CPU job: README's test command. Builds a brand-new virtual environment (no system
# site-packages, so a dependency missing from pyproject.toml fails here as it would on a
# new machine), installs reffsdp as README's first command does, with the pinned CPU
# torch, and runs the whole suite: unit, threaded and multi-process (gloo) tests plus
# the doctests in reffsdp/.
# Usage: bash ci/cpu.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv --clear .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0" -e ".[test,integration,lowbit]"
# A deadlock that holds the GIL stops pytest-timeout too: this limit ends the run (about
# 20 minutes on 2 cores; SUITE_LIMIT_S to change it).
exec timeout --signal=KILL "${SUITE_LIMIT_S:-3600}" \
    .venv/bin/python -m pytest -p no:cacheprovider --durations=15 "$@"
