"""Moved to ``python -m reffsdp.bench`` (see docs/benchmarks.md); this forwards to it."""

import pathlib
import sys

# Run as a script, this folder (not the repository root) heads sys.path; the root must be
# there for the benchmark (and its rank processes) to find torch's builders in
# ``tests.benchmarks.torch_reference``.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from reffsdp.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
