"""HSDP over real gloo processes: a 2x2 ``(dp_replicate, dp_shard)`` mesh trains like DDP.

The threaded suite (``tests/multithread/test_fully_shard_hsdp.py``) covers more knobs and
mesh shapes; these are its core tests, where the collectives run on a real backend, one
process per rank.
"""

import pytest

from reffsdp.testing.multiprocess import FSDPTest
from tests.multithread.test_fully_shard_hsdp import HSDPTests

pytestmark = pytest.mark.multiprocess


class TestHSDPOverGloo(HSDPTests, FSDPTest):
    pass
