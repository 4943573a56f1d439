"""CommCounter and the patch helpers, in one process on the fake process group.

Real backends are covered in ``tests/multiprocess/test_comm_counter_gloo.py`` and the
threaded group in ``tests/multithread/test_comm_counter_threaded.py``.
"""

import threading
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from reffsdp.core import comms, compat
from reffsdp.core.comms import Collective
from reffsdp.testing.comm_counter import CommCounter, counted_op_names, record_collective
from reffsdp.testing.fake_pg import fake_process_group
from reffsdp.testing.patching import (
    patch_all_gather,
    patch_all_reduce,
    patch_broadcast,
    patch_reduce_scatter,
)

WORLD_SIZE = 4
FLOAT_BYTES = 4


@pytest.fixture
def group():
    with fake_process_group(WORLD_SIZE, rank=1) as world:
        yield world


def test_counted_op_names_exist_on_this_torch() -> None:
    names = counted_op_names()
    for name in ["c10d._allgather_base_", "c10d._reduce_scatter_base_", "c10d.allreduce_"]:
        assert name in names
    assert "_c10d_functional.all_gather_into_tensor" in names


def test_torch_distributed_calls(group) -> None:
    shard, full = torch.ones(3), torch.ones(3 * WORLD_SIZE)
    with CommCounter() as counter:
        compat.all_gather_single()(full, shard)
        with warnings.catch_warnings():  # the pre-2.13 names warn on torch 2.13
            warnings.simplefilter("ignore", FutureWarning)
            dist.all_gather_into_tensor(full, shard)
            dist.reduce_scatter_tensor(shard, full)
        dist.all_gather([torch.empty(3) for _ in range(WORLD_SIZE)], shard)
        compat.reduce_scatter_single()(shard, full)
        dist.all_reduce(shard)
        dist.broadcast(shard, src=0)
        dist.all_to_all_single(torch.empty(8), torch.ones(8))
        dist.barrier()
    assert counter.get_comm_counts() == {
        Collective.ALL_GATHER: 3,
        Collective.REDUCE_SCATTER: 2,
        Collective.ALL_REDUCE: 1,
        Collective.BROADCAST: 1,
        Collective.ALL_TO_ALL: 1,
        Collective.BARRIER: 1,
    }
    full_bytes = 3 * WORLD_SIZE * FLOAT_BYTES  # the unsharded side of AG and RS
    assert counter.get_comm_bytes() == {
        Collective.ALL_GATHER: 3 * full_bytes,
        Collective.REDUCE_SCATTER: 2 * full_bytes,
        Collective.ALL_REDUCE: 3 * FLOAT_BYTES,
        Collective.BROADCAST: 3 * FLOAT_BYTES,
        Collective.ALL_TO_ALL: 8 * FLOAT_BYTES,
    }
    assert counter.get_total_counts() == 9
    assert counter.get_comm_counts()[Collective.GATHER] == 0


def test_reffsdp_comms_and_functional_collectives(group) -> None:
    # torch 2.13 renames the functional reduce-scatter too (and deprecates the old name).
    reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
    with CommCounter() as counter:
        comms.all_gather(torch.empty(8, 2), torch.ones(2, 2), group)
        comms.reduce_scatter(torch.empty(2), torch.ones(8), group)
        comms.all_reduce(torch.ones(2), group)
        funcol.wait_tensor(funcol.all_reduce(torch.ones(5), "sum", group))
        funcol.wait_tensor(reduce_scatter(torch.ones(8), "sum", 0, group))
    assert counter.get_comm_counts() == {
        Collective.ALL_GATHER: 1,
        Collective.REDUCE_SCATTER: 2,
        Collective.ALL_REDUCE: 2,
    }
    assert counter.get_comm_bytes()[Collective.ALL_REDUCE] == (2 + 5) * FLOAT_BYTES


def test_dtensor_redistribution_and_implicit_collectives(group) -> None:
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    rows = DTensor.from_local(torch.ones(2, 8), mesh, [Shard(0)])
    with CommCounter() as counter:
        replicated = rows.redistribute(mesh, [Replicate()])
    assert replicated.to_local().shape == (2 * WORLD_SIZE, 8)
    assert counter.get_comm_counts() == {Collective.ALL_GATHER: 1}
    assert counter.get_comm_bytes() == {Collective.ALL_GATHER: 2 * WORLD_SIZE * 8 * FLOAT_BYTES}

    # mm(Shard(0), Shard(0)) must all-gather the right operand inside DTensor's dispatch,
    # which the counter sees only because it lets DTensor handle its own ops first.
    right = DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)])
    with CommCounter() as counter:
        product = torch.mm(rows, right)
    assert product.placements == (Shard(0),)
    assert counter.get_comm_counts() == {Collective.ALL_GATHER: 1}


def test_reset_on_enter_nesting_and_threads(group) -> None:
    counter = CommCounter()
    with counter:
        dist.all_reduce(torch.ones(1))
    with counter:  # counts start again from zero
        dist.broadcast(torch.ones(1), src=0)
        with CommCounter() as inner:
            dist.all_reduce(torch.ones(1))
            record_collective(Collective.ALL_GATHER, 40)  # as a Python process group would
    assert counter.get_comm_counts() == {
        Collective.BROADCAST: 1,
        Collective.ALL_REDUCE: 1,
        Collective.ALL_GATHER: 1,
    }
    assert inner.get_comm_counts() == {Collective.ALL_REDUCE: 1, Collective.ALL_GATHER: 1}
    assert inner.get_comm_bytes()[Collective.ALL_GATHER] == 40

    with counter:  # another thread's collectives and reports are not ours
        other = threading.Thread(
            target=lambda: (
                dist.all_reduce(torch.ones(1)),
                record_collective(Collective.ALL_REDUCE, 4),
            )
        )
        other.start()
        other.join()
    assert counter.get_total_counts() == 0
    record_collective(Collective.ALL_REDUCE, 4)  # no counter open: nothing to do


def test_patches_see_and_alter_reffsdp_collectives(group) -> None:
    calls = []

    def doubled_all_gather(output, input, group=None, async_op=False):
        calls.append(("all_gather", tuple(output.shape), tuple(input.shape)))
        work = compat.all_gather_single()(output, input, group=group, async_op=async_op)
        output.mul_(2)
        return work

    def zero_reduce_scatter(output, input, op=None, group=None, async_op=False):
        calls.append(("reduce_scatter", op))
        output.zero_()

    def recording_all_reduce(tensor, op=None, group=None, async_op=False):
        calls.append(("all_reduce", op))
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)

    def recording_broadcast(tensor, src, group=None, async_op=False):
        calls.append(("broadcast", src))

    output = torch.empty(8)
    scattered = torch.ones(2)
    with (
        patch_all_gather(doubled_all_gather),
        patch_reduce_scatter(zero_reduce_scatter),
        patch_all_reduce(recording_all_reduce),
        patch_broadcast(recording_broadcast),
        CommCounter() as counter,
    ):
        comms.all_gather(output, torch.ones(2), group)
        comms.reduce_scatter(scattered, torch.ones(8), group, op=dist.ReduceOp.AVG)
        comms.all_reduce(torch.ones(2), group, op=dist.ReduceOp.MAX)
        comms.broadcast(torch.ones(2), 0, group)
        dist.all_reduce(torch.ones(2))  # a plain torch call is not redirected
    assert calls == [
        ("all_gather", (8,), (2,)),
        ("reduce_scatter", dist.ReduceOp.AVG),
        ("all_reduce", dist.ReduceOp.MAX),
        ("broadcast", 0),
    ]
    assert torch.equal(output, torch.full((8,), 2.0))
    assert torch.equal(scattered, torch.zeros(2))
    # only the calls that were let through reached a process group
    assert counter.get_comm_counts() == {Collective.ALL_GATHER: 1, Collective.ALL_REDUCE: 2}

    comms.all_gather(output, torch.ones(2), group)  # unpatched again on exit
    assert torch.equal(output, torch.ones(8)) and len(calls) == 4
