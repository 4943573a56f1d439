"""The parity checkers over real gloo processes: right answers pass, planted bugs fail.

The threaded suite (``tests/multithread/test_parity_checks.py``) covers every planted bug;
these are its main cases, where collectives, DDP and the checkers' verdict all-reduce run on
a real backend, one process per rank.
"""

import pytest

from reffsdp.testing.multiprocess import FSDPTest
from tests.multithread.test_parity_checks import ParityCheckTests

pytestmark = pytest.mark.multiprocess


class TestParityOverGloo(ParityCheckTests, FSDPTest):
    @property
    def world_size(self) -> int:
        return 2
