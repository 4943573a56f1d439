"""CommCounter and the patch helpers over real gloo processes (NCCL with ``--device cuda``)."""

import pytest

from reffsdp.testing.multiprocess import FSDPTest
from tests.multithread.test_comm_counter_threaded import CommCounterTests

pytestmark = pytest.mark.multiprocess


class TestCommCounterGloo(CommCounterTests, FSDPTest):
    pass
