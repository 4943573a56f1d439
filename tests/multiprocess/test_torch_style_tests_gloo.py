"""The torch-style checks of ``tests/multithread/test_torch_style_tests.py`` on gloo
processes: a ``parameterized.expand`` method runs on every rank process by its generated
name, and tensors compare in ``assertEqual``."""

from __future__ import annotations

import pytest

from reffsdp.testing import FSDPTest
from tests.multithread.test_torch_style_tests import TensorComparisons

pytestmark = pytest.mark.multiprocess


class TestTorchStyleOnProcesses(TensorComparisons, FSDPTest):
    @property
    def world_size(self) -> int:
        return 2
