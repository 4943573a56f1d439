#!/usr/bin/env bash
# The oldest and newest supported torch, beside the pinned one that ci/cpu.sh tests.
# For each requirements file (ci/torch/oldest.txt, ci/torch/newest.txt), in a brand-new
# virtual environment under build/torch-venvs/: the parity suite on threaded ranks, then on
# gloo processes, then `pytest tests/unit tests/multithread` (and the comparison of the 2.15
# additions with torch's own fully_shard). Prints one line per torch
# version with each step's counts and the minutes it took; every step runs even after a
# failure, and the exit status is non-zero if any failed.
#
# The installs are downloads (a CUDA build of torch from PyPI, ~3 minutes each) and run side
# by side; pip's download cache is shared. `--install-only` stops after them and `--no-install`
# tests the environments already there, so .ci/run can overlap the downloads with other work.
# pip runs with PIP_CONFIG_FILE=/dev/null: a machine-wide pip configuration may cap torch
# below the newest release.
# Usage: bash ci/versions.sh [--install-only | --no-install]
set -uo pipefail
cd "$(dirname "$0")/.."
mode="${1:-all}"
files=(ci/torch/oldest.txt ci/torch/newest.txt)
root=build/torch-venvs

venv_of() { echo "$root/$(basename "$1" .txt)"; }

install() {  # requirements file -> a fresh venv with that torch and reffsdp[test]
    local venv; venv=$(venv_of "$1")
    python3 -m venv --clear "$venv" &&
        PIP_CONFIG_FILE=/dev/null "$venv/bin/pip" install --quiet --disable-pip-version-check \
            -r "$1" -e ".[test]"
}

STEP_LIMIT_S=${STEP_LIMIT_S:-1800}  # per step; the slowest takes about 15 minutes on 2 cores

summary() {  # the last line of a log that has the counts ("N passed ...")
    grep -E '[0-9]+ (passed|failed)' "$1" | tail -n 1 | sed -E 's/^=+ //; s/ =+$//'
}

step() {  # version, title, log stem, command...: run it, show its tail, echo its summary
    local version=$1 title=$2 log=$3.log; shift 3
    echo "== torch $version: $title" >&2
    # A deadlock that holds the GIL stops pytest-timeout too: this limit ends the step.
    timeout --signal=KILL "$STEP_LIMIT_S" "$@" > "$log" 2>&1
    local rc=$?
    [ "$rc" = 137 ] && echo "(killed after ${STEP_LIMIT_S} s: no end in sight)" >> "$log"
    if [ "$rc" = 0 ]; then
        tail -n 3 "$log" >&2
        summary "$log"
    else
        tail -n 30 "$log" >&2
        echo "FAILED (exit $rc): $(summary "$log")"
        touch "$root/failed"
    fi
}

status=0
if [ "$mode" != --no-install ]; then
    mkdir -p "$root"
    for file in "${files[@]}"; do
        venv=$(venv_of "$file")
        (install "$file" > "$venv.install.log" 2>&1 || { tail -n 20 "$venv.install.log"; exit 1; }) &
    done
    for job in $(jobs -p); do wait "$job" || status=1; done
    [ "$mode" = --install-only ] && exit "$status"
fi

lines=()
rm -f "$root/failed"
for file in "${files[@]}"; do
    venv=$(venv_of "$file")
    py="$venv/bin/python"
    if ! version=$("$py" -c 'import torch, reffsdp; print(torch.__version__)' 2>/dev/null); then
        lines+=("$(basename "$file" .txt): no working environment at $venv (install failed?)")
        status=1
        continue
    fi
    start=$(date +%s)
    threaded=$(step "$version" "parity suite, threaded" "$venv.threaded" "$py" -m reffsdp.testing)
    gloo=$(step "$version" "parity suite, gloo" "$venv.gloo" "$py" -m reffsdp.testing --backend gloo)
    # and the comparison with torch's own fully_shard of what 2.15 added (gloo processes)
    tests=$(step "$version" "pytest tests/unit tests/multithread" "$venv.pytest" \
        "$py" -m pytest -p no:cacheprovider -q tests/unit tests/multithread \
        tests/multiprocess/test_fully_shard_2_15_gloo.py)
    minutes=$(awk "BEGIN { printf \"%.1f\", ($(date +%s) - $start) / 60 }")
    lines+=("torch $version: parity threaded $threaded; gloo $gloo; tests $tests; $minutes min")
done
echo
printf '%s\n' "${lines[@]}"
if [ -e "$root/failed" ]; then status=1; fi
exit "$status"
