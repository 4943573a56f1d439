"""The parity suite (``python -m reffsdp.testing``) passes on 8 threaded ranks, where every
scenario applies: 1D, HSDP, 2D (dp x tp) and 3D (replicate x shard x tp) meshes.

:class:`ParitySuiteTests` also runs over 4 gloo processes
(``tests/multiprocess/test_parity_suite_gloo.py``), where the 3D scenario is skipped.
"""

import pytest
import torch
import torch.distributed as dist

from reffsdp.testing import FSDPTestMultiThread
from reffsdp.testing.parity_suite import format_report, run_scenarios, scenarios

pytestmark = pytest.mark.multithread


class ParitySuiteTests:
    """Every scenario that applies to the world size runs and passes; the others skip."""

    timeout_s = 300.0

    def test_every_applicable_scenario_passes(self):
        outcomes = run_scenarios(torch.device("cpu"))
        header = f"{dist.get_backend()}, world size {self.world_size}"
        report = format_report(outcomes, header)
        all_scenarios = scenarios("cpu")
        self.assertEqual([o.name for o in outcomes], [s.name for s in all_scenarios])
        ran = [o.name for o in outcomes if o.status != "skip"]
        applicable = [s.name for s in all_scenarios if s.applies_to(self.world_size)]
        self.assertEqual(ran, applicable, report)
        self.assertTrue({"mlp/1d/reshard", "mlp/hsdp", "mlp/dp-tp"} <= set(ran), report)
        self.assertTrue(all(o.status == "pass" for o in outcomes if o.name in ran), report)


class TestParitySuite(ParitySuiteTests, FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 8
