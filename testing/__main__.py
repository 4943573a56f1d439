"""``python -m reffsdp.testing``: run the parity suite (see :mod:`reffsdp.testing.parity_suite`)."""

from __future__ import annotations

import argparse
import sys
import time

from .parity_suite import SuiteOptions, run_self_test, run_suite


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m reffsdp.testing",
        description="Train reffsdp-sharded models next to DDP and check they agree.",
    )
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument(
        "--backend",
        choices=("gloo", "nccl", "threaded"),
        default="threaded",
        help="threaded: one thread per rank; gloo/nccl: one process per rank",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="device for the threaded backend (gloo is CPU, nccl CUDA)",
    )
    parser.add_argument("--only", action="append", default=[], help="glob on scenario names")
    parser.add_argument("--self-test", action="store_true", help="plant bugs; each must be caught")
    args = parser.parse_args(argv)
    options = SuiteOptions(
        backend=args.backend,
        device=args.device,
        world_size=args.world_size,
        only=tuple(args.only),
    )
    start = time.perf_counter()
    if args.self_test:
        results = run_self_test(
            options,
            lambda r: print(f"  {r.api:<12} {r.bug:<45} {'caught' if r.caught else 'MISSED'}"),
        )
        ok = all(r.caught for r in results)
    else:
        results = run_suite(
            options, lambda r: print(f"  {r.name:<45} {r.status:<7} {r.message}".rstrip())
        )
        ok = not any(r.status == "failed" for r in results)
    print(f"parity suite took {time.perf_counter() - start:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
