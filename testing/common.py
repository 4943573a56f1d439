"""What both harnesses share: the test-facing interface of a distributed test case.

A test written against :class:`DistributedTestMixin` moves between the threaded harness
(:class:`~reffsdp.testing.FSDPTestMultiThread`) and the multi-process harness
(:class:`~reffsdp.testing.FSDPTest`) by changing its base class only.
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
