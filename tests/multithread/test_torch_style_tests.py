"""Tests written as torch's FSDP tests are run unchanged on both harnesses: tensors in
``assertEqual`` / ``assertNotEqual`` (see [Note: comparing tensors in assertEqual] in
``testing/common.py``) and methods parametrized with ``parameterized.expand``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from parameterized import parameterized

from reffsdp.testing import FSDPTestMultiThread

pytestmark = pytest.mark.multithread


class TensorComparisons:
    """Checks both harnesses run (here on threads; on processes in ``tests/multiprocess``)."""

    @parameterized.expand([("fp32", torch.float32), ("bf16", torch.bfloat16)])
    def test_all_reduced_tensors_compare_equal(self, _name: str, dtype: torch.dtype):
        tensor = torch.full((2, 3), float(self.rank + 1), dtype=dtype)
        dist.all_reduce(tensor)
        expected = sum(range(1, self.world_size + 1))
        self.assertEqual(tensor, torch.full((2, 3), float(expected), dtype=dtype))
        self.assertEqual(tensor, [[float(expected)] * 3] * 2)  # a list like the tensor
        self.assertEqual({"t": [tensor]}, {"t": [tensor.clone()]})  # nested
        self.assertNotEqual(tensor, tensor + 1)

    def test_tolerances_and_dtypes(self):
        a = torch.tensor([1.0, 2.0])
        self.assertEqual(a, a + 1e-7)  # within fp32's default tolerance
        self.assertNotEqual(a, a + 1e-3)
        self.assertEqual(a, a + 1e-3, atol=1e-2, rtol=0)
        self.assertNotEqual(a, a.double())  # dtypes must match ...
        self.assertEqual(a, a.double(), exact_dtype=False)  # ... unless told otherwise
        self.assertEqual(torch.tensor([1, 2]), torch.tensor([1, 2]))
        self.assertNotEqual(torch.tensor([1, 2]), torch.tensor([1, 3]))  # integers: exact
        with self.assertRaises(AssertionError) as caught:
            self.assertEqual(a, a + 1, msg="rank's step 3")
        self.assertIn("rank's step 3", str(caught.exception))
        self.assertIn("Mismatched elements", str(caught.exception))
        self.assertEqual((1, "x"), (1, "x"))  # no tensor: unittest's comparison


class TestTorchStyleOnThreads(TensorComparisons, FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_parameterized_makes_one_method_per_case(self):
        for name in ("compare_equal_0_fp32", "compare_equal_1_bf16"):
            self.assertTrue(callable(getattr(self, f"test_all_reduced_tensors_{name}")))
