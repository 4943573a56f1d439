"""What both harnesses share: the test-facing interface of a distributed test case.

A test written against :class:`DistributedTestMixin` moves between the threaded harness
(:class:`~reffsdp.testing.FSDPTestMultiThread`) and the multi-process harness
(:class:`~reffsdp.testing.FSDPTest`) by changing its base class only.

[Note: comparing tensors in assertEqual]
Tests written the way torch's own FSDP tests are write ``self.assertEqual(tensor_a,
tensor_b)``, which a plain ``unittest.TestCase`` cannot answer ("Boolean value of Tensor with
more than one value is ambiguous"). Both harnesses compare as torch's test base does: when
either side holds a tensor (itself, or inside lists, tuples and dicts), the two are compared
with :func:`torch.testing.assert_close`: exactly for integer and bool tensors, within the
default tolerances of their dtype for floating ones (``atol``/``rtol`` override them, both
or neither), with equal dtypes required (``exact_dtype=False`` lifts that) and NaNs equal.
A number or list on one side and a tensor on the other are compared as a tensor of the
tensor's dtype. Anything without a tensor is compared by ``unittest`` as before.
``assertNotEqual`` passes exactly when ``assertEqual`` would fail.

>>> import unittest
>>> class Case(DistributedTestMixin, unittest.TestCase):
...     def runTest(self): ...
>>> case = Case()
>>> case.assertEqual(torch.tensor([1.0, 2.0]), [1.0, 2.0 + 1e-7])
>>> case.assertNotEqual(torch.tensor([1, 2]), torch.tensor([1, 3]))
>>> case.assertEqual({"w": torch.ones(2)}, {"w": torch.ones(2) + 0.01}, atol=0.1, rtol=0)
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .parity import broadcast_params_from_rank0


def device_type_under_test() -> str:
    """``"cuda"`` when the suite runs with ``--device cuda``, else ``"cpu"``."""
    return os.environ.get("REFFSDP_TEST_DEVICE", "cpu")


class DistributedTestMixin:
    """``world_size``, ``rank``, ``device`` and ``run_subtests`` for one rank of a test."""

    # Subclasses override this property (or set a class attribute) to pick a size.
    @property
    def world_size(self) -> int:
        return 2

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def device_type(self) -> str:
        return device_type_under_test()

    @property
    def device(self) -> torch.device:
        if self.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    def process_group(self) -> dist.ProcessGroup:
        return dist.group.WORLD

    def perThreadSetUp(self) -> None:  # noqa: N802 - unittest naming
        """Runs on each rank, with the process group up, before the test method."""

    def perThreadTearDown(self) -> None:  # noqa: N802 - unittest naming
        """Runs on each rank after the test method, even if it failed."""

    def sync_module_states(self, module: nn.Module) -> None:
        """Give ``module`` rank 0's parameters and buffers on every rank, before sharding.

        Threaded ranks share one RNG, so "the same" model built on each rank differs.
        """
        broadcast_params_from_rank0(module)

    def assertEqual(  # noqa: N802 - unittest naming
        self,
        first: Any,
        second: Any,
        msg: str | None = None,
        *,
        atol: float | None = None,
        rtol: float | None = None,
        exact_dtype: bool = True,
    ) -> None:
        """``unittest``'s, or tensors compared as torch's tests compare them (see
        [Note: comparing tensors in assertEqual])."""
        if not (_holds_tensor(first) or _holds_tensor(second)):
            super().assertEqual(first, second, msg)  # type: ignore[misc]
            return
        first, second = _as_tensor_pair(first, second)
        try:
            torch.testing.assert_close(
                first, second, atol=atol, rtol=rtol, equal_nan=True, check_dtype=exact_dtype
            )
        except AssertionError as error:
            raise self.failureException(f"{msg}\n{error}" if msg else str(error)) from None

    def assertNotEqual(  # noqa: N802 - unittest naming
        self,
        first: Any,
        second: Any,
        msg: str | None = None,
        *,
        atol: float | None = None,
        rtol: float | None = None,
        exact_dtype: bool = True,
    ) -> None:
        """Passes exactly when :meth:`assertEqual` with the same arguments fails."""
        if not (_holds_tensor(first) or _holds_tensor(second)):
            super().assertNotEqual(first, second, msg)  # type: ignore[misc]
            return
        try:
            self.assertEqual(first, second, atol=atol, rtol=rtol, exact_dtype=exact_dtype)
        except AssertionError:
            return
        raise self.failureException(msg or f"{first!r} == {second!r}")

    def run_subtests(
        self, config: dict[str, list[Any]], fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> None:
        """Call ``fn`` once per point of the cartesian product of ``config``'s values.

        Each call runs inside ``subTest`` with its keyword arguments, and all ranks meet at
        a barrier after it, so one rank cannot run ahead into the next configuration.
        """
        names = list(config)
        for values in itertools.product(*(config[name] for name in names)):
            subtest_kwargs = dict(zip(names, values))
            with self.subTest(**subtest_kwargs):  # type: ignore[attr-defined]
                fn(*args, **kwargs, **subtest_kwargs)
            dist.barrier()


def _holds_tensor(value: Any) -> bool:
    """Whether ``value`` is a tensor or a list, tuple or dict holding one, at any depth."""
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return False


def _as_tensor_pair(first: Any, second: Any) -> tuple[Any, Any]:
    """A number or list facing a tensor, as a tensor like it (dtype and device)."""
    if isinstance(first, torch.Tensor) and not isinstance(second, torch.Tensor):
        return first, torch.as_tensor(second, dtype=first.dtype, device=first.device)
    if isinstance(second, torch.Tensor) and not isinstance(first, torch.Tensor):
        return torch.as_tensor(first, dtype=second.dtype, device=second.device), second
    return first, second
