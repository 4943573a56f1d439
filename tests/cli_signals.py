"""Interrupting a command-line program the way a person does, for the CLIs' tests.

:func:`interrupt` starts a command in a session of its own, waits for a line that shows it
is at work, then sends SIGINT to its process alone (``kill PID``) or to its whole process
group (Ctrl-C in a terminal), and reports how it ended and whether any of its rank
processes outlived it.

A command must end within :data:`DEADLINE_S` of the signal. Part of any exit is the
interpreter tearing torch down, which the command does not control and which, on a 2-core
machine shared with other work, alone takes seconds: :func:`deadline_s` adds what that
takes here, now.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 5.0  # a command must end this soon after Ctrl-C


@functools.cache
def deadline_s() -> float:
    """:data:`DEADLINE_S`, plus how long a process that has imported torch takes to exit
    on this machine (measured once)."""
    code = "import sys, torch; sys.stdout.write('imported\\n'); sys.stdout.flush()"
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    process.stdout.readline()
    start = time.monotonic()
    process.wait()
    return DEADLINE_S + time.monotonic() - start


def ctrl_c_as_in_a_terminal() -> None:
    """``preexec_fn`` for a command these tests interrupt: SIGINT acts by default in it, as
    in a terminal, even when this test process was started with SIGINT ignored (a
    background job of a shell without job control is), which the command would inherit."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@dataclasses.dataclass
class Interrupted:
    returncode: int
    seconds: float  # from the signal to the end of the process
    stdout: str
    stderr: str
    ranks_left: list[int]  # rank processes still running after the command ended


def interrupt(args: list[str], ready: str, how: str, timeout_s: float = 240.0) -> Interrupted:
    """Run ``python -m ARGS``; once a line of its output starts with ``ready``, send SIGINT
    to the process (``how="pid"``) or to its process group (``how="group"``)."""
    with tempfile.TemporaryFile("w+") as errors:
        process = subprocess.Popen(
            [sys.executable, "-m", *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            start_new_session=True,
            preexec_fn=ctrl_c_as_in_a_terminal,
        )
        try:
            lines = _read_until(process, ready, time.monotonic() + timeout_s)
            ranks = _rank_processes(process.pid)
            sent = time.monotonic()
            if how == "pid":
                os.kill(process.pid, signal.SIGINT)
            else:
                os.killpg(process.pid, signal.SIGINT)
            rest, _ = process.communicate(timeout=60)
            seconds = time.monotonic() - sent
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        errors.seek(0)
        stderr = errors.read()
    return Interrupted(
        process.returncode, seconds, "".join(lines) + rest, stderr, _still_running(ranks)
    )


def _read_until(process: subprocess.Popen, ready: str, deadline: float) -> list[str]:
    assert process.stdout is not None
    lines = []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            raise AssertionError(f"the command ended before printing {ready!r}:\n{''.join(lines)}")
        lines.append(line)
        if line.startswith(ready):
            return lines
    raise AssertionError(f"no line starting with {ready!r} in time:\n{''.join(lines)}")


def _rank_processes(parent: int) -> list[int]:
    """The spawned rank processes (multiprocessing's, not its resource tracker) of
    ``parent``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and "spawn_main" in command:
            found.append(int(entry.name))
    return found


def _still_running(pids: list[int], wait_s: float = 2.0) -> list[int]:
    deadline = time.monotonic() + wait_s
    while True:
        alive = [pid for pid in pids if _alive(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
