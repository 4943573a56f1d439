"""``FSDPModule.set_symm_mem_for_comm``: all-gathers into symmetric memory, as torch's does
([Note: symmetric memory] in ``reffsdp/per_param/symm_mem.py``).

On the threaded CPU process group what happens depends on the torch build, and reffsdp does
what torch's own method does on the installed one (compared where torch has the method,
from 2.12): a CPU build has no symmetric-memory backend, so the call raises
``RuntimeError`` and training goes on with ordinary all-gathers; a CUDA build accepts it
(one barrier) and the first all-gather raises ``RuntimeError``, the pool having no CPU
backend. The symmetric path itself needs a GPU; its logic (buffers from the pool, a
rendezvous before each gather) is checked here with a recording stand-in for the memory.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from reffsdp import fully_shard
from reffsdp.core import comms
from reffsdp.core.comms import Collective
from reffsdp.core.compat import TORCH_FULLY_SHARD_HAS_PER_PARAM_MESHES
from reffsdp.per_param.symm_mem import SymmMemAllGather
from reffsdp.testing.comm_counter import CommCounter
from reffsdp.testing.multithread import FSDPTestMultiThread

pytestmark = pytest.mark.multithread

DIM = 8


def outcome(call: Callable[[], Any]) -> tuple[type[BaseException] | None, str]:
    """``(exception type, message)`` of ``call``, ``(None, "")`` if it returns."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 (the outcome is what is compared)
        return type(error), str(error)
    return None, ""


def sharded_mlp(shard: Callable, mesh, model: nn.Module | None = None) -> nn.Module:
    """``model`` (by default a new one) sharded per layer and at the root."""
    if model is None:
        model = nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU(), nn.Linear(DIM, DIM))
    shard(model[0], mesh=mesh)
    shard(model[2], mesh=mesh)
    return shard(model, mesh=mesh)


class CountingAllGather(comms.AllGather):
    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        return comms.all_gather(output_tensor, input_tensor, group, async_op=async_op)


class CountingReduceScatter(comms.ReduceScatter):
    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        return comms.reduce_scatter(output_tensor, input_tensor, group, op=op, async_op=async_op)


class RecordingMemory:
    """A stand-in for torch's symmetric memory: plain memory, every use recorded."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []
        self.in_pool = False

    @contextlib.contextmanager
    def pool(self, device: torch.device) -> Iterator[None]:
        self.in_pool = True
        try:
            yield
        finally:
            self.in_pool = False

    def rendezvous(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
        self.events.append(("rendezvous", (tensor.data_ptr(), dist.get_world_size(group))))


class RecordingSymmMemAllGather(SymmMemAllGather):
    def allocate(self, size, *, dtype, device):
        tensor = super().allocate(size, dtype=dtype, device=device)
        self.memory.events.append(("allocate", tensor.data_ptr()))
        return tensor


class TestSymmMem(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 4

    def _x(self) -> torch.Tensor:
        return torch.randn(3, DIM, generator=torch.Generator().manual_seed(self.rank))

    def _try_symm_mem(self, shard: Callable) -> tuple[Any, dict, Any]:
        """The call's outcome and collectives, then a training step's outcome."""
        model = sharded_mlp(shard, init_device_mesh("cpu", (4,)))
        with CommCounter() as counter:
            called = outcome(lambda: model[0].set_symm_mem_for_comm())
        trained = outcome(lambda: model(self._x()).sum().backward())
        return called, dict(counter.get_comm_counts()), trained

    def test_on_this_build_as_torch(self):
        called, counts, trained = self._try_symm_mem(fully_shard)
        if called[0] is None:  # a build with the backend: the pool fails on a CPU mesh
            self.assertEqual(counts, {Collective.BARRIER: 1})
            self.assertIs(trained[0], RuntimeError)
            self.assertIn("no symmetric memory for the all-gather buffer on cpu", trained[1])
        else:  # a CPU build: refused at once, training goes on as before
            self.assertIs(called[0], RuntimeError)
            self.assertIn("set_symm_mem_for_comm('NCCL')", called[1])
            self.assertEqual(counts, {})
            self.assertEqual(trained, (None, ""))
        if not TORCH_FULLY_SHARD_HAS_PER_PARAM_MESHES:
            return  # torch's FSDPModule has no set_symm_mem_for_comm before 2.12
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        ref_called, ref_counts, ref_trained = self._try_symm_mem(torch_fully_shard)
        self.assertEqual(counts, ref_counts)
        for ours, theirs in ((called, ref_called), (trained, ref_trained)):
            self.assertIs(ours[0], theirs[0])
            self.assertIn(theirs[1], ours[1])  # torch's message, with reffsdp's around it

    def test_refused_after_another_comm_as_torch(self):
        """Rules 1 and 3 of [Note: symmetric memory], with torch's type and phrase: a custom
        reduce-scatter is found only after the backend, which a CPU build lacks."""
        probe = sharded_mlp(fully_shard, init_device_mesh("cpu", (4,)))
        has_backend = outcome(lambda: probe[0].set_symm_mem_for_comm())[0] is None
        shards: list[Callable] = [fully_shard]
        if TORCH_FULLY_SHARD_HAS_PER_PARAM_MESHES:
            from torch.distributed.fsdp import fully_shard as torch_fully_shard

            shards.append(torch_fully_shard)
        custom = {
            "all gather": lambda m: m.set_custom_all_gather(CountingAllGather()),
            "reduce scatter": lambda m: m.set_custom_reduce_scatter(CountingReduceScatter()),
            "process group": lambda m: m.set_allocate_memory_from_process_group_for_comm(True),
        }
        for shard in shards:
            for kind, install in custom.items():
                model = sharded_mlp(shard, init_device_mesh("cpu", (4,)))
                install(model[0])
                comm = "reduce scatter" if kind == "reduce scatter" else "all gather"
                error, phrase = AssertionError, f"cannot call set_symm_mem() when {comm} comm"
                if kind == "reduce scatter" and not has_backend:
                    error, phrase = RuntimeError, "does not find allocation backend NCCL"
                with self.subTest(torch=shard is not fully_shard, kind=kind):
                    raised = outcome(lambda model=model: model[0].set_symm_mem_for_comm())
                    self.assertIs(raised[0], error)
                    self.assertIn(phrase, raised[1])
        model = sharded_mlp(fully_shard, init_device_mesh("cpu", (4,)))
        self.assertIsNone(model[0]._get_fsdp_state().group.settings.all_gather_comm)
        model[0].set_custom_all_gather(SymmMemAllGather(RecordingMemory()))
        with self.assertRaisesRegex(
            AssertionError,
            "cannot call set_allocate_memory_from_process_group\\(\\) when all gather comm is "
            "custom: SymmMemAllGather",
        ):
            model[0].set_allocate_memory_from_process_group_for_comm(True)

    def test_buffers_come_from_the_pool_and_meet_before_each_gather(self):
        """Rule 4, with a stand-in memory: each all-gather buffer is allocated in the pool
        and rendezvoused over the group before the gather; results are the default's."""
        mesh = init_device_mesh("cpu", (4,))
        source = nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU(), nn.Linear(DIM, DIM))
        self.sync_module_states(source)  # threaded ranks share one RNG: rank 0's values
        model = sharded_mlp(fully_shard, mesh, copy.deepcopy(source))
        plain = sharded_mlp(fully_shard, mesh, copy.deepcopy(source))
        memory = RecordingMemory()
        model[0].set_custom_all_gather(RecordingSymmMemAllGather(memory))
        model[0].set_reshard_after_forward(True)
        for each in (model, plain):
            each(self._x()).sum().backward()
        # Forward and backward each gather once: allocate, then meet over all 4 ranks.
        allocations = [ptr for event, ptr in memory.events if event == "allocate"]
        self.assertEqual(len(allocations), 2)
        expected = [e for ptr in allocations for e in (("allocate", ptr), ("rendezvous", (ptr, 4)))]
        self.assertEqual(memory.events, expected)
        for (name, param), ref in zip(model.named_parameters(), plain.parameters()):
            torch.testing.assert_close(param.grad.to_local(), ref.grad.to_local(), msg=name)

    def test_every_group_of_a_call(self):
        """With per-parameter meshes, each group gets symmetric memory and meets once."""
        from .test_fully_shard_per_param_mesh import MoE, placement_result, shard_moe

        dp = init_device_mesh("cpu", (4,))
        rep_ep = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "ep"))
        model = shard_moe(fully_shard, MoE(), dp, placement_result(None, rep_ep["ep"], False))
        block = model.blocks[0]
        with CommCounter() as counter:
            called = outcome(lambda: block.set_symm_mem_for_comm())
        comms_set = [g.settings.all_gather_comm for g in block._get_fsdp_state().groups]
        if called[0] is None:
            self.assertEqual(dict(counter.get_comm_counts()), {Collective.BARRIER: 2})
            self.assertTrue(all(isinstance(c, SymmMemAllGather) for c in comms_set))
        else:
            self.assertIs(called[0], RuntimeError)
            self.assertEqual(comms_set, [None, None])
