"""Faults planted in the process group are caught over gloo processes, under reffsdp's FSDP
and torch's, on both APIs.

The threaded tests (``tests/multithread/test_planted_faults.py``) plant each fault in the
threaded group; here the group is gloo's, a C++ ``ProcessGroup`` whose collectives run on
threads of their own (each fault waits for the real collective before it tampers with the
result). Each rank process enters the fault itself.
"""

import pytest

from reffsdp.testing.multiprocess import FSDPTest
from tests.multithread.test_planted_faults import (
    APIS,
    FAULTS,
    FIRST_SEEN,
    IMPLS,
    PARITY_FAILED,
    train_next_to_ddp,
)

pytestmark = pytest.mark.multiprocess


class TestPlantedFaultsOverGloo(FSDPTest):
    @property
    def world_size(self) -> int:
        return 2

    def test_every_fault_is_caught_under_every_implementation(self):
        for impl in IMPLS:
            for api in APIS:
                train_next_to_ddp(impl, api)  # passes without a fault
                for fault, plant in FAULTS.items():
                    with self.subTest(impl=impl, api=api, fault=fault):
                        with plant(), self.assertRaises(AssertionError) as caught:
                            train_next_to_ddp(impl, api)
                        if impl == "torch" and api == "wrapper":
                            expected = "losses differ from DDP's"
                        else:
                            expected = f"check_train_parity, {FIRST_SEEN[fault]}: {PARITY_FAILED}"
                        self.assertIn(expected, str(caught.exception))
