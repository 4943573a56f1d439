"""The parity suite (``python -m reffsdp.testing``) passes on 8 threaded ranks, where every
scenario applies: 1D, HSDP, 2D (dp x tp) and 3D (replicate x shard x tp) meshes."""

import pytest
import torch

from reffsdp.testing import FSDPTestMultiThread
from reffsdp.testing.parity_suite import format_report, run_scenarios, scenarios

pytestmark = pytest.mark.multithread


class TestParitySuite(FSDPTestMultiThread):
    timeout_s = 300.0

    @property
    def world_size(self) -> int:
        return 8

    def test_every_scenario_passes(self):
        outcomes = run_scenarios(torch.device("cpu"))
        report = format_report(outcomes, "threaded, world size 8")
        self.assertEqual([o.name for o in outcomes], [s.name for s in scenarios("cpu")])
        self.assertTrue(all(o.status == "pass" for o in outcomes), report)
