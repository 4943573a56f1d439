"""Moved to ``python -m reffsdp.bench`` (see the README's "Benchmarks"); this forwards to it."""

import sys

from reffsdp.bench import main

if __name__ == "__main__":
    sys.exit(main())
