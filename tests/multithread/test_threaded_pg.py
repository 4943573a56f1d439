"""The threaded process group: same results as gloo, groups and meshes, DDP, and no hangs.

``test_collectives_match_gloo`` runs one table of collectives twice: in two gloo processes
(this file run as a script, see the bottom) and on two threads of the threaded group, and
compares every output tensor exactly. Inputs are small integers, so every dtype represents
every sum exactly and the comparison needs no tolerance.
"""

from __future__ import annotations

import copy
import functools
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

from reffsdp.core import compat
from reffsdp.core.comms import Collective
from reffsdp.testing import comm_counter
from reffsdp.testing.multithread import FSDPTestMultiThread, RankFailure, run_threaded

pytestmark = pytest.mark.multithread

# The torch 2.13 collectives, or their torch 2.11 spellings.
all_gather_single = compat.all_gather_single()
reduce_scatter_single = compat.reduce_scatter_single()

ReduceOp = dist.ReduceOp
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool]
_ALL_REDUCE_OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]


def _data(rank: int, shape: tuple[int, ...], dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Small integers that differ per rank and per element, in ``dtype``."""
    numel = 1
    for size in shape:
        numel *= size
    values = (torch.arange(numel) * (rank + 2) + 3 * rank + salt) % 7 + 1
    if dtype == torch.bool:
        values = values % 2
    return values.to(dtype).reshape(shape)


# Each case runs one collective on the default group and returns what this rank received.
def _all_reduce(op: str, dtype: torch.dtype, rank: int, ws: int) -> list[torch.Tensor]:
    tensor = _data(rank, (2, 3), dtype)
    dist.all_reduce(tensor, getattr(ReduceOp, op))
    return [tensor]


def _reduce_scatter_single(op: str, dtype: torch.dtype, rank: int, ws: int) -> list[torch.Tensor]:
    output = torch.empty(3, dtype=dtype)
    reduce_scatter_single(output, _data(rank, (ws * 3,), dtype), getattr(ReduceOp, op))
    return [output]


def _reduce_scatter_list(rank: int, ws: int) -> list[torch.Tensor]:
    output = torch.empty(2, 2)
    dist.reduce_scatter(output, [_data(rank, (2, 2), torch.float32, dest) for dest in range(ws)])
    return [output]


def _all_gather_single(dtype: torch.dtype, rank: int, ws: int) -> list[torch.Tensor]:
    output = torch.empty(ws * 2, 3, dtype=dtype)
    all_gather_single(output, _data(rank, (2, 3), dtype))
    return [output]


def _all_gather_list(dtype: torch.dtype, rank: int, ws: int) -> list[torch.Tensor]:
    outputs = [torch.empty(4, dtype=dtype) for _ in range(ws)]
    dist.all_gather(outputs, _data(rank, (4,), dtype))
    return outputs


def _all_reduce_coalesced(rank: int, ws: int) -> list[torch.Tensor]:
    tensors = [_data(rank, (3,), torch.float32), _data(rank, (2, 2), torch.float32, 1)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated, still supported
        dist.all_reduce_coalesced(tensors)
    return tensors


def _broadcast(rank: int, ws: int) -> list[torch.Tensor]:
    tensor = _data(rank, (5,), torch.float16)
    dist.broadcast(tensor, src=ws - 1)
    return [tensor]


def _all_to_all_list(rank: int, ws: int) -> list[torch.Tensor]:
    outputs = [torch.empty(3) for _ in range(ws)]
    dist.all_to_all(outputs, [_data(rank, (3,), torch.float32, dest) for dest in range(ws)])
    return outputs


def _all_to_all_single_uneven(rank: int, ws: int) -> list[torch.Tensor]:
    # rank r sends r + d + 1 rows to rank d, so it receives r + s + 1 rows from rank s
    input_splits = [rank + dest + 1 for dest in range(ws)]
    output_splits = [rank + src + 1 for src in range(ws)]
    output = torch.empty(sum(output_splits), 2, dtype=torch.int64)
    data = _data(rank, (sum(input_splits), 2), torch.int64)
    dist.all_to_all_single(output, data, output_splits, input_splits)
    return [output]


def _all_to_all_single_even(rank: int, ws: int) -> list[torch.Tensor]:
    output = torch.empty(ws * 2)
    dist.all_to_all_single(output, _data(rank, (ws * 2,), torch.float32))
    return [output]


def _gather(rank: int, ws: int) -> list[torch.Tensor]:
    outputs = [torch.empty(3) for _ in range(ws)] if rank == 0 else None
    dist.gather(_data(rank, (3,), torch.float32), outputs, dst=0)
    return outputs or []


def _scatter(rank: int, ws: int) -> list[torch.Tensor]:
    output = torch.empty(3)
    inputs = [_data(rank, (3,), torch.float32, dest) for dest in range(ws)]
    dist.scatter(output, inputs if rank == ws - 1 else None, src=ws - 1)
    return [output]


def _reduce(rank: int, ws: int) -> list[torch.Tensor]:
    tensor = _data(rank, (4,), torch.float32)
    dist.reduce(tensor, dst=ws - 1, op=ReduceOp.MAX)
    return [tensor] if rank == ws - 1 else []  # other ranks' tensors are scratch on gloo


def _barrier(rank: int, ws: int) -> list[torch.Tensor]:
    dist.barrier()
    return []


def _collective_cases() -> dict[str, Callable[[int, int], list[torch.Tensor]]]:
    cases: dict[str, Callable[[int, int], list[torch.Tensor]]] = {}
    for op in _ALL_REDUCE_OPS:
        for dtype in [*_DTYPES, torch.complex64]:
            cases[f"all_reduce {op} {dtype}"] = functools.partial(_all_reduce, op, dtype)
    for op in ["SUM", "AVG", "PRODUCT", "MIN", "MAX"]:
        for dtype in [torch.float32, torch.bfloat16, torch.int64]:
            cases[f"reduce_scatter_single {op} {dtype}"] = functools.partial(
                _reduce_scatter_single, op, dtype
            )
    for dtype in [torch.float32, torch.int64, torch.bool]:
        cases[f"all_gather_single {dtype}"] = functools.partial(_all_gather_single, dtype)
        cases[f"all_gather {dtype}"] = functools.partial(_all_gather_list, dtype)
    for case in [
        _reduce_scatter_list,
        _all_reduce_coalesced,
        _broadcast,
        _all_to_all_list,
        _all_to_all_single_uneven,
        _all_to_all_single_even,
        _gather,
        _scatter,
        _reduce,
        _barrier,
    ]:
        cases[case.__name__.lstrip("_")] = case
    return cases


def _run_cases(rank: int, world_size: int) -> dict[str, list[torch.Tensor] | str]:
    """Every case's outputs on this rank, or ``"error"`` where the backend refused it, or
    ``"unsupported"`` where the backend lacks the collective (gloo's list all-to-all
    before torch 2.12)."""
    results: dict[str, list[torch.Tensor] | str] = {}
    for name, case in _collective_cases().items():
        try:
            results[name] = case(rank, world_size)
        except (RuntimeError, ValueError) as error:
            results[name] = "unsupported" if "does not support" in str(error) else "error"
    return results


def _gloo_results(tmp_path, world_size: int) -> list[dict]:
    """``_run_cases`` on every rank of a real gloo group: one process per rank."""
    store_file, outs = tmp_path / "store", [tmp_path / f"rank{r}.pt" for r in range(world_size)]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(r), str(world_size), str(store_file), str(outs[r])],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(world_size)
    ]
    for rank, proc in enumerate(procs):
        output, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"gloo rank {rank} failed:\n{output.decode()}"
    return [torch.load(out) for out in outs]


@pytest.mark.timeout(180)
def test_collectives_match_gloo(tmp_path):
    world_size = 2
    expected = _gloo_results(tmp_path, world_size)
    got: list[dict] = [{} for _ in range(world_size)]
    run_threaded(lambda rank: got[rank].update(_run_cases(rank, world_size)), world_size)
    differences = []
    for rank in range(world_size):
        assert got[rank].keys() == expected[rank].keys()
        for name, want in expected[rank].items():
            have = got[rank][name]
            if want == "unsupported":  # nothing to compare the threaded result with
                continue
            same = (
                have == want
                if isinstance(want, str) or isinstance(have, str)
                else len(have) == len(want)
                and all(h.dtype == w.dtype and torch.equal(h, w) for h, w in zip(have, want))
            )
            if not same:
                differences.append(f"rank {rank} {name}: threaded {have} vs gloo {want}")
    assert not differences, "\n".join(differences)
    refused = [r for r in expected[0].values() if r in ("error", "unsupported")]
    assert len(refused) < len(expected[0]) // 3


def _expected_reduction(op: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    combine = {
        "SUM": torch.add,
        "AVG": torch.add,
        "PRODUCT": torch.mul,
        "MIN": torch.minimum,
        "MAX": torch.maximum,
        "BAND": torch.bitwise_and,
        "BOR": torch.bitwise_or,
        "BXOR": torch.bitwise_xor,
    }[op]
    result = functools.reduce(combine, tensors)
    return result / len(tensors) if op == "AVG" else result


class TestReductionsAgainstMath(FSDPTestMultiThread):
    """Four ranks, every reduction, compared with the result computed from all inputs."""

    @property
    def world_size(self) -> int:
        return 4

    def _everyone(self, shape, dtype, salt=0) -> list[torch.Tensor]:
        return [_data(r, shape, dtype, salt) for r in range(self.world_size)]

    def test_all_reduce_every_op(self):
        for op in _ALL_REDUCE_OPS:
            dtype = torch.int64 if op.startswith("B") else torch.float64
            tensor = _data(self.rank, (2, 3), dtype)
            dist.all_reduce(tensor, getattr(ReduceOp, op))
            expected = _expected_reduction(op, self._everyone((2, 3), dtype)).to(dtype)
            self.assertTrue(torch.equal(tensor, expected), f"{op}: {tensor} vs {expected}")

    def test_premul_sum(self):
        """``PREMUL_SUM`` scales every rank's input by the factor before summing."""
        if not compat.PREMUL_SUM_FACTOR_READABLE:
            # The factor is out of Python's reach on this torch: a clear refusal.
            tensor = torch.ones(2)
            with self.assertRaisesRegex(NotImplementedError, "PREMUL_SUM.*torch 2.13"):
                dist.all_reduce(tensor, dist._make_nccl_premul_sum(0.5))
            return
        factors = [0.25, torch.tensor([0.5])]  # a Python scalar or a one-element tensor
        ws, inputs = self.world_size, self._everyone((self.world_size * 2,), torch.float32)
        for factor in factors:
            scale = float(factor)
            op = dist._make_nccl_premul_sum(factor)
            tensor = inputs[self.rank].clone()
            dist.all_reduce(tensor, op)
            self.assertTrue(torch.equal(tensor, sum(inputs) * scale))
            shard = torch.empty(2)
            reduce_scatter_single(shard, inputs[self.rank], op)
            self.assertTrue(
                torch.equal(shard, (sum(inputs) * scale)[2 * self.rank : 2 * self.rank + 2])
            )
            chunks = [list(t.chunk(ws)) for t in inputs]
            dist.reduce_scatter(shard, chunks[self.rank], op)
            self.assertTrue(torch.equal(shard, sum(c[self.rank] for c in chunks) * scale))
        # As in NCCL, each rank scales its own input by its own factor.
        tensor = inputs[self.rank].clone()
        dist.all_reduce(tensor, dist._make_nccl_premul_sum(0.5 * (self.rank + 1)))
        expected = sum(x * 0.5 * (r + 1) for r, x in enumerate(inputs))
        self.assertTrue(torch.equal(tensor, expected))
        if compat.TORCH_VERSION >= (2, 13):  # the spelling of 2.13 on
            tensor = inputs[self.rank].clone()
            dist.all_reduce(tensor, ReduceOp.PREMUL_SUM(0.5))
            self.assertTrue(torch.equal(tensor, sum(inputs) * 0.5))

    def test_reduce_scatter_avg_and_coalesced(self):
        ws = self.world_size
        inputs = [self._everyone((ws * 3,), torch.float32, salt) for salt in range(2)]
        outputs = [torch.empty(3), torch.empty(3)]
        mine = [per_rank[self.rank] for per_rank in inputs]
        work = self.process_group.reduce_scatter_single_coalesced(outputs, mine, _rs_opts("AVG"))
        work.wait()
        for output, per_rank in zip(outputs, inputs):
            expected = (sum(per_rank) / ws)[3 * self.rank : 3 * self.rank + 3]
            self.assertTrue(torch.equal(output, expected))


def _rs_opts(op: str) -> dist.ReduceScatterOptions:
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = getattr(ReduceOp, op)
    return opts


class TestGroupsAndMeshes(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 8

    def test_new_group_pairs(self):
        pairs = [dist.new_group([r, r + 1]) for r in range(0, self.world_size, 2)]
        mine = pairs[self.rank // 2]
        tensor = torch.tensor([float(self.rank)])
        dist.all_reduce(tensor, group=mine)
        self.assertEqual(tensor.item(), 2 * (self.rank // 2) * 2 + 1)
        self.assertEqual(dist.get_rank(mine), self.rank % 2)
        other = pairs[(self.rank // 2 + 1) % len(pairs)]
        self.assertEqual(dist.get_rank(other), -1)  # not a member

    def test_meshes_1d_2d_3d(self):
        for shape in [(8,), (4, 2), (2, 2, 2)]:
            mesh = init_device_mesh("cpu", shape)
            for dim, size in enumerate(shape):
                coordinate = torch.tensor([float(mesh.get_coordinate()[dim])])
                dist.all_reduce(coordinate, group=mesh.get_group(dim))
                self.assertEqual(coordinate.item(), sum(range(size)), f"{shape} dim {dim}")
            _check_dtensor_ops(mesh)

    def test_mesh_with_dim_names(self):
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
        flat = mesh["dp", "cp"]._flatten() if hasattr(mesh, "_flatten") else mesh["dp"]
        tensor = torch.ones(1)
        dist.all_reduce(tensor, group=flat.get_group())
        self.assertEqual(tensor.item(), flat.size())
        _check_dtensor_ops(mesh["cp", "tp"])


class TestMesh2x2(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 4

    def test_mesh_2x2_dtensor(self):
        _check_dtensor_ops(init_device_mesh("cpu", (2, 2)))


def _check_dtensor_ops(mesh) -> None:
    """Sharding, gathering, redistributing and a matmul on ``mesh`` give the plain results."""
    full = torch.arange(64.0).reshape(8, 8)
    dtensor = distribute_tensor(full, mesh, [Shard(d % 2) for d in range(mesh.ndim)])
    assert torch.equal(dtensor.full_tensor(), full)
    moved = dtensor.redistribute(mesh, [Replicate()] * (mesh.ndim - 1) + [Shard(0)])
    assert torch.equal(moved.full_tensor(), full)
    torch.testing.assert_close((dtensor @ dtensor.T).full_tensor(), full @ full.T)


class TestDDPAndAsync(FSDPTestMultiThread):
    def test_ddp_gradients_are_the_rank_average(self):
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        self.sync_module_states(model)
        reference = copy.deepcopy(model)
        ddp = DistributedDataParallel(model, bucket_cap_mb=0.0001)  # several buckets
        ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
        ddp_optim = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(3):
            generator = torch.Generator().manual_seed(10 * step + self.rank)
            batch = torch.randn(5, 4, generator=generator)
            ddp(batch).square().sum().backward()
            reference(batch).square().sum().backward()
            for param, ref_param in zip(ddp.parameters(), reference.parameters()):
                dist.all_reduce(ref_param.grad, ReduceOp.AVG)  # what DDP should have done
                torch.testing.assert_close(param.grad, ref_param.grad)
            for optim in (ddp_optim, ref_optim):
                optim.step()
                optim.zero_grad()
        for param, ref_param in zip(ddp.parameters(), reference.parameters()):
            torch.testing.assert_close(param, ref_param)

    def test_ddp_builtin_fp16_hook_reads_the_future_in_cpp(self):
        model = nn.Linear(4, 3)
        self.sync_module_states(model)
        reference = copy.deepcopy(model)
        ddp = DistributedDataParallel(model)
        ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
        batch = torch.randn(5, 4, generator=torch.Generator().manual_seed(self.rank))
        ddp(batch).sum().backward()
        reference(batch).sum().backward()
        for param, ref_param in zip(ddp.parameters(), reference.parameters()):
            dist.all_reduce(ref_param.grad, ReduceOp.AVG)
            torch.testing.assert_close(param.grad, ref_param.grad, atol=1e-2, rtol=1e-3)

    def test_async_work_and_futures(self):
        tensor = torch.full((3,), float(self.rank + 1))
        work = dist.all_reduce(tensor, async_op=True)
        self.assertTrue(work.wait())
        self.assertTrue(work.is_completed())
        self.assertTrue(torch.equal(work.get_future().wait()[0], torch.full((3,), 3.0)))
        chained = work.get_future().then(lambda fut: fut.value()[0] * 2)
        self.assertTrue(torch.equal(chained.wait(), torch.full((3,), 6.0)))
        all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
        gathered = all_gather(torch.tensor([self.rank]), 0, dist.group.WORLD)
        self.assertEqual(funcol.wait_tensor(gathered).tolist(), [0, 1])


class TestErrors(FSDPTestMultiThread):
    @pytest.mark.timeout(30)
    def test_mismatched_kinds_raise_on_every_rank(self):
        tensor = torch.ones(4)
        with self.assertRaisesRegex(RuntimeError, r"mismatched(.|\n)*all_reduce(.|\n)*broadcast"):
            if self.rank == 0:
                dist.all_reduce(tensor)
            else:
                dist.broadcast(tensor, src=0)
        dist.all_reduce(tensor)  # the group still works
        self.assertTrue(torch.equal(tensor, torch.full((4,), 2.0)))

    @pytest.mark.timeout(30)
    def test_mismatched_shapes_and_dtypes_raise_on_every_rank(self):
        with self.assertRaisesRegex(RuntimeError, "mismatched"):
            dist.all_reduce(torch.ones(4 + self.rank))
        with self.assertRaisesRegex(RuntimeError, "mismatched"):
            dist.all_reduce(torch.ones(4, dtype=torch.float32 if self.rank else torch.float64))
        output = torch.empty(4 if self.rank == 0 else 6)
        with self.assertRaisesRegex(RuntimeError, "rank 1: all_gather_single output #0"):
            all_gather_single(output, torch.ones(2))
        with self.assertRaisesRegex(RuntimeError, "cannot split evenly"):
            reduce_scatter_single(torch.empty(1), torch.ones(3))


@pytest.mark.timeout(30)
def test_failing_rank_is_reported_and_peers_do_not_hang():
    def explode_on_rank_1(rank: int) -> None:
        dist.barrier()
        if rank == 1:
            raise ValueError("boom on purpose")
        dist.all_reduce(torch.ones(1))  # rank 1 never joins: must not wait for the timeout

    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_threaded(explode_on_rank_1, 2)
    message = str(info.value)
    assert "rank 1 failed" in message and "explode_on_rank_1" in message
    assert "ValueError: boom on purpose" in message
    assert "ranks [0] stopped with CollectiveAborted" in message
    assert time.monotonic() - start < 10


@pytest.mark.timeout(30)
def test_rank_that_left_the_group_fails_its_peers_fast():
    def rank_0_leaves(rank: int) -> None:
        if rank == 1:
            time.sleep(0.2)
            dist.all_reduce(torch.ones(1))

    with pytest.raises(RankFailure, match=r"ranks \[0\] destroyed the group"):
        run_threaded(rank_0_leaves, 2)


@pytest.mark.timeout(30)
def test_collective_timeout_aborts_instead_of_hanging():
    def rank_1_stalls(rank: int) -> None:
        group = dist.new_group([0, 1], timeout=timedelta(seconds=0.5))
        if rank == 0:
            dist.all_reduce(torch.ones(1), group=group)
        else:
            threading.Event().wait(1.5)  # past the group's timeout, then leave

    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_threaded(rank_1_stalls, 2, timeout_s=20.0)
    message = str(info.value)
    assert "rank 0 failed" in message and "rank 1 failed" not in message
    assert "timed out after 0.5s; ranks [1] never joined" in message
    assert time.monotonic() - start < 10


def test_every_collective_reports_to_the_comm_counter(monkeypatch):
    seen: list[tuple[int, Collective, int]] = []
    monkeypatch.setattr(
        comm_counter,
        "record_collective",
        lambda kind, nbytes, group=None: seen.append((dist.get_rank(), kind, nbytes)),
    )

    def issue(rank: int) -> None:
        all_gather_single(torch.empty(8), torch.ones(4))
        reduce_scatter_single(torch.empty(2), torch.ones(4))
        dist.all_reduce(torch.ones(3, dtype=torch.float64))
        dist.broadcast(torch.ones(5, dtype=torch.int32), src=0)
        dist.barrier()

    run_threaded(issue, 2)
    per_rank = [[(kind, nbytes) for r, kind, nbytes in seen if r == rank] for rank in range(2)]
    expected = [
        (Collective.ALL_GATHER, 32),  # the gathered output: 8 float32
        (Collective.REDUCE_SCATTER, 16),  # the full input: 4 float32
        (Collective.ALL_REDUCE, 24),
        (Collective.BROADCAST, 20),
        (Collective.BARRIER, 0),
    ]
    assert per_rank == [expected, expected]


class _RecordOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_dispatch_modes_see_no_c10d_op_for_threaded_collectives():
    """The comm counter's dispatch path cannot double count ``torch.distributed`` calls.

    Functional collectives are still dispatched (as ``_c10d_functional.*``) before they
    reach the group; the counter ignores the hook's report while such an op runs.
    """
    seen: dict[int, list[str]] = {}

    def issue(rank: int) -> None:
        with _RecordOps() as recorder:
            all_gather_single(torch.empty(4), torch.ones(2))
            reduce_scatter_single(torch.empty(1), torch.ones(2))
            dist.all_reduce(torch.ones(2))
            dist.broadcast(torch.ones(2), src=0)
        plain = list(recorder.ops)
        with _RecordOps() as recorder:
            funcol.wait_tensor(funcol.all_reduce(torch.ones(2), "sum", dist.group.WORLD))
        seen[rank] = [plain, recorder.ops]

    run_threaded(issue, 2)
    for plain, functional in seen.values():
        # Only the test's own tensor factories: no c10d op, and not even the group's copies.
        assert set(plain) == {"aten.empty.memory_format", "aten.ones.default"}, plain
        assert "_c10d_functional.all_reduce.default" in functional


def test_threaded_run_restores_c10d_state():
    world, hook = dist.distributed_c10d._world, sys.excepthook
    run_threaded(lambda rank: dist.barrier(), 2)
    assert dist.distributed_c10d._world is world and sys.excepthook is hook
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        tensor = torch.ones(2)
        dist.all_reduce(tensor)
        assert tensor.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()


def _gloo_main(rank: int, world_size: int, store_path: str, out_path: str) -> None:
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size
    )
    try:
        torch.save(_run_cases(rank, world_size), out_path)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _gloo_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
