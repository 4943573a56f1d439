"""``python -m reffsdp.testing``: run the parity suite (see :mod:`reffsdp.testing.parity_suite`)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from .parity_suite import run_in_processes, run_in_threads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m reffsdp.testing",
        description="Train reffsdp-sharded models next to DDP and check they agree.",
    )
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument(
        "--backend",
        choices=("gloo", "nccl", "threaded"),
        default="gloo",
        help="gloo/nccl: one process per rank; threaded: one thread per rank",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="device for the threaded backend (gloo is CPU, nccl CUDA)",
    )
    parser.add_argument("--only", default=None, help="run scenarios whose name contains this")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        args.result_path = os.path.join(tmp, "result.txt")
        start = time.perf_counter()
        if args.backend == "threaded":
            run_in_threads(args)
        else:
            run_in_processes(args)
        with open(args.result_path) as file:
            report = file.read()
    *lines, verdict = report.strip().splitlines()
    print("\n".join(lines))
    print(f"parity suite took {time.perf_counter() - start:.1f} s")
    return 0 if verdict == "OK" else 1


if __name__ == "__main__":
    sys.exit(main())
