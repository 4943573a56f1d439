"""The parity suite on 4 gloo processes: 1D, HSDP and 2D (dp x tp) meshes over real gloo."""

import pytest

from reffsdp.testing import FSDPTest
from tests.multithread.test_parity_suite import ParitySuiteTests

pytestmark = pytest.mark.multiprocess


class TestParitySuiteOverGloo(ParitySuiteTests, FSDPTest):
    @property
    def world_size(self) -> int:
        return 4
