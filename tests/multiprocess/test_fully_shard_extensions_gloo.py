"""Parameters whose tensor subclass gathers itself, over real gloo processes: reffsdp's
``fully_shard`` trains them as torch's does, on 2 and 4 ranks, on 1-D and HSDP meshes, with
both forms of the pre hook (see ``tests/multithread/test_fully_shard_extensions.py``, whose
checks run here unchanged: equal losses, shards and gradients, and the same collectives and
bytes at every step)."""

from __future__ import annotations

import pytest

from reffsdp.testing.multiprocess import FSDPTest
from tests.multithread.test_fully_shard_extensions import ExtensionChecks

pytestmark = pytest.mark.multiprocess


class TestExtensionsOnTwoRanks(ExtensionChecks, FSDPTest):
    @property
    def world_size(self) -> int:
        return 2

    def test_1d(self):
        self.check_1d_and_hsdp()


class TestExtensionsOnFourRanks(ExtensionChecks, FSDPTest):
    @property
    def world_size(self) -> int:
        return 4

    def test_1d_and_hsdp(self):
        self.check_1d_and_hsdp()
