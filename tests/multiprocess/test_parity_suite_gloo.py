"""The parity suite on 4 gloo processes: 1D, HSDP and 2D (dp x tp) meshes over real gloo."""

import pytest
import torch

from reffsdp.testing import FSDPTest
from reffsdp.testing.parity_suite import format_report, run_scenarios

pytestmark = pytest.mark.multiprocess


class TestParitySuiteOverGloo(FSDPTest):
    timeout_s = 300.0

    @property
    def world_size(self) -> int:
        return 4

    def test_every_applicable_scenario_passes(self):
        outcomes = run_scenarios(torch.device("cpu"))
        report = format_report(outcomes, "gloo, world size 4")
        ran = {o.name for o in outcomes if o.status != "skip"}
        self.assertTrue({"mlp/1d/reshard", "mlp/hsdp", "mlp/dp-tp"} <= ran, report)
        self.assertTrue(all(o.status in ("pass", "skip") for o in outcomes), report)
