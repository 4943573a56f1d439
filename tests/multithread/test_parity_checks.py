"""The parity checkers pass on correct models and fail on planted bugs.

``fully_shard`` plays no part here: the sharded side is built by hand, so a failure of these
tests points at the checkers. ``check_sharded_parity`` meets parameters cut with
``distribute_tensor`` and gradients set by hand; ``check_train_parity`` meets small
hand-written data-parallel wrappers that average gradients with an explicit all-reduce, with
knobs that plant the bugs a real implementation could have.
"""

import contextlib
import copy
import unittest

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from reffsdp.testing.models import MLP, DoubleLinear, init_deterministic
from reffsdp.testing.multithread import FSDPTestMultiThread
from reffsdp.testing.parity import (
    VacuousParityWarning,
    broadcast_params_from_rank0,
    check_sharded_parity,
    check_train_parity,
)

pytestmark = pytest.mark.multithread


def _synced(model: nn.Module) -> nn.Module:
    """``model`` with the same, live weights on every rank (threads share one RNG)."""
    return init_deterministic(model)


def _inputs(iteration: int, rank: int, dim: int = 5) -> torch.Tensor:
    """Different inputs per rank and per iteration, independent of the shared global RNG."""
    generator = torch.Generator().manual_seed(100 * iteration + rank)
    return torch.randn(3, dim, generator=generator)


def _shard_by_hand(model: nn.Module, mesh, placements=None) -> nn.Module:
    """A deep copy of ``model`` whose parameters are DTensors cut by ``distribute_tensor``."""
    placements = placements or (Shard(0),)
    sharded = copy.deepcopy(model)
    for module in sharded.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            dtensor = distribute_tensor(param.detach(), mesh, placements, src_data_rank=None)
            module.register_parameter(name, nn.Parameter(dtensor))
    return sharded


def _copy_grads_as_shards(ref_model: nn.Module, sharded_model: nn.Module) -> None:
    for ref_param, param in zip(ref_model.parameters(), sharded_model.parameters()):
        if ref_param.grad is not None:
            param.grad = distribute_tensor(
                ref_param.grad, param.device_mesh, param.placements, src_data_rank=None
            )


class HandDataParallel(nn.Module):
    """Data parallelism by hand: each grad is averaged over ranks once backward has built it.

    The keyword arguments plant bugs: ``divide=False`` sums instead of averaging,
    ``all_reduce=False`` keeps each rank's local gradient, ``scale_grad_on_rank`` doubles
    the averaged gradient on one rank and ``shift_output_on_rank`` adds 1 to one rank's
    output (a wrong loss with right gradients).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        divide: bool = True,
        all_reduce: bool = True,
        scale_grad_on_rank: int | None = None,
        shift_output_on_rank: int | None = None,
    ) -> None:
        super().__init__()
        self.module = module
        self.divide, self.all_reduce = divide, all_reduce
        self.scale_grad_on_rank = scale_grad_on_rank
        self.shift_output_on_rank = shift_output_on_rank
        self.require_sync = True
        for param in module.parameters():
            param.register_post_accumulate_grad_hook(self._sync_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.module(x)
        return out + 1 if dist.get_rank() == self.shift_output_on_rank else out

    @contextlib.contextmanager
    def no_sync(self):
        self.require_sync = False
        try:
            yield
        finally:
            self.require_sync = True

    @torch.no_grad()
    def _sync_grad(self, param: torch.Tensor) -> None:
        if not self.require_sync:
            return
        local_grad = param.grad
        if self.all_reduce:
            dist.all_reduce(local_grad)  # gloo has no ReduceOp.AVG, so SUM then divide
        if self.divide and self.all_reduce:
            local_grad.div_(dist.get_world_size())
        if dist.get_rank() == self.scale_grad_on_rank:
            local_grad.mul_(2)


class HandShardedMLP(nn.Module):
    """An MLP whose parameters are ``Shard(0)`` DTensors, gathered whole for each forward.

    Forward all-gathers each parameter (``Shard(0) -> Replicate``) and marks the gradient of
    the gathered tensor as ``Partial``: every rank holds its own contribution. Backward then
    turns ``Partial`` into ``Shard(0)`` with a reduce-scatter (a sum), and a hook divides by
    the world size: the averaged, sharded gradient that FSDP produces. ``scale_grad_on_rank``
    plants a bug by doubling one rank's gradient shard.
    """

    def __init__(self, mlp: MLP, mesh, *, scale_grad_on_rank: int | None = None) -> None:
        super().__init__()
        self.mlp = _shard_by_hand(mlp, mesh)
        self.scale_grad_on_rank = scale_grad_on_rank
        for param in self.mlp.parameters():
            param.register_post_accumulate_grad_hook(self._average_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gathered = {
            name: param.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])
            for name, param in self.mlp.named_parameters()
        }
        return torch.func.functional_call(self.mlp, gathered, (x,))

    @torch.no_grad()
    def _average_grad(self, param: DTensor) -> None:
        local_grad = param.grad.to_local()
        local_grad.div_(dist.get_world_size())
        if dist.get_rank() == self.scale_grad_on_rank:
            local_grad.mul_(2)


def _ref_and_sharded(test: unittest.TestCase, model: nn.Module | None = None):
    """A reference that has run backward and its hand-sharded twin with matching grads."""
    ref_model = _synced(model or MLP(5))  # out_proj has 5 rows: shards of 3 and 2
    sharded_model = _shard_by_hand(ref_model, init_device_mesh("cpu", (test.world_size,)))
    out = ref_model(_inputs(0, test.rank))
    sum(o.sum() for o in (out if isinstance(out, tuple) else (out,))).backward()
    _copy_grads_as_shards(ref_model, sharded_model)
    return ref_model, sharded_model


def _train(test: unittest.TestCase, make_model=None, prefix="module.", **kwargs) -> list[float]:
    """``check_train_parity`` of ``make_model(copy of an MLP)`` (default: hand DDP)."""
    make_model = make_model or HandDataParallel
    ref_model = _synced(MLP(5))
    model = make_model(copy.deepcopy(ref_model))
    return check_train_parity(
        test, ref_model, model, _inputs, prefixes_to_ignore=(prefix,), **kwargs
    )


class ParityCheckTests:
    """The checkers' main cases: a right answer passes, planted bugs fail on every rank.

    Also run over gloo processes (``tests/multiprocess/test_parity_gloo.py``), where the
    collectives, DDP and the checkers' verdict all-reduce run on a real backend.
    """

    def test_hand_data_parallel_matches_ddp(self):
        losses = _train(self, num_steps=3)
        self.assertEqual(len(losses), 3)

    def test_catches_sum_instead_of_average(self):
        with self.assertRaisesRegex(AssertionError, "step 0 after backward: .*\n.*grad of"):
            _train(self, make_model=lambda m: HandDataParallel(m, divide=False))

    def test_catches_a_grad_scaled_on_one_rank(self):
        make_model = lambda m: HandDataParallel(m, scale_grad_on_rank=1)
        expected = "rank 1: max abs diff" if self.rank == 1 else r"failed on rank\(s\) \[1\]"
        with self.assertRaisesRegex(AssertionError, expected):
            _train(self, make_model=make_model)

    def test_catches_a_grad_shard_scaled_on_one_rank(self):
        self.run_subtests(
            {"bad_rank": [0, 1], "param_name": ["in_proj.weight", "out_proj.bias"]},
            self._check_grad_shard_scaled_on_one_rank,
        )

    def _check_grad_shard_scaled_on_one_rank(self, bad_rank: int, param_name: str):
        ref_model, sharded_model = _ref_and_sharded(self)
        check_sharded_parity(self, ref_model, sharded_model)
        if self.rank == bad_rank:
            sharded_model.get_parameter(param_name).grad.to_local().mul_(2)
            expected = rf"grad of '{param_name}' on rank {bad_rank}: max abs diff"
        else:
            expected = rf"failed on rank\(s\) \[{bad_rank}\]; rank {self.rank} matched"
        with self.assertRaisesRegex(AssertionError, expected):
            check_sharded_parity(self, ref_model, sharded_model)


class TestParityChecks(ParityCheckTests, FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2


class TestCheckShardedParity(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_passes_on_matching_params_and_grads(self):
        ref_model = _synced(MLP(5))
        sharded_model = _shard_by_hand(ref_model, init_device_mesh("cpu", (self.world_size,)))
        check_sharded_parity(self, ref_model, sharded_model)  # no grads on either side
        ref_model, sharded_model = _ref_and_sharded(self)
        check_sharded_parity(self, ref_model, sharded_model)

    def test_passes_when_an_unused_param_has_no_grad_on_both_sides(self):
        ref_model, sharded_model = _ref_and_sharded(self, DoubleLinear(5, use_second_linear=False))
        self.assertIsNone(sharded_model.lin2.weight.grad)
        check_sharded_parity(self, ref_model, sharded_model)

    def test_catches_a_wrong_param_slice(self):
        ref_model = _synced(MLP(4))
        mesh = init_device_mesh("cpu", (self.world_size,))
        sharded_model = _shard_by_hand(ref_model, mesh)
        # Every rank holds the rows of the reference rolled by one: right shape, wrong rows.
        rolled = torch.roll(ref_model.in_proj.weight.detach(), shifts=1, dims=0)
        sharded_model.in_proj.weight = nn.Parameter(distribute_tensor(rolled, mesh, [Shard(0)]))
        with self.assertRaisesRegex(AssertionError, rf"param 'in_proj.weight' on rank {self.rank}"):
            check_sharded_parity(self, ref_model, sharded_model)

    def test_catches_a_missing_grad(self):
        ref_model, sharded_model = _ref_and_sharded(self)
        sharded_model.out_proj.bias.grad = None
        expected = "grad of 'out_proj.bias' .*: None but the reference's is set"
        with self.assertRaisesRegex(AssertionError, expected):
            check_sharded_parity(self, ref_model, sharded_model)

    def test_rejects_plain_tensor_params(self):
        ref_model = _synced(MLP(4))
        with self.assertRaisesRegex(AssertionError, "'in_proj.weight' is a Parameter, expected"):
            check_sharded_parity(self, ref_model, copy.deepcopy(ref_model))

    def test_rejects_shard0_shard0(self):
        ref_model = _synced(MLP(4))
        mesh = init_device_mesh("cpu", (self.world_size, 1))
        sharded_model = _shard_by_hand(ref_model, mesh, placements=(Shard(0), Shard(0)))
        with self.assertRaisesRegex(ValueError, r"\(Shard\(0\), Shard\(0\)\)"):
            check_sharded_parity(self, ref_model, sharded_model)

    def test_prefixes_to_ignore(self):
        ref_model, sharded_model = _ref_and_sharded(self)
        wrapped = nn.ModuleDict({"wrapped": sharded_model})
        with self.assertRaisesRegex(AssertionError, "parameter names differ"):
            check_sharded_parity(self, ref_model, wrapped)
        check_sharded_parity(self, ref_model, wrapped, prefixes_to_ignore=("wrapped.",))

    def test_without_a_test_case_raises_assertion_error(self):
        ref_model, sharded_model = _ref_and_sharded(self)
        sharded_model.out_proj.weight.grad.to_local().add_(0.5)
        pattern = rf"grad of 'out_proj.weight' on rank {self.rank}: max abs diff 0.5 "
        with self.assertRaisesRegex(AssertionError, pattern):
            check_sharded_parity(None, ref_model, sharded_model)


class TestCheckTrainParity(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_gradient_accumulation(self):
        def run(use_no_sync: bool):
            no_sync = (lambda model: model.no_sync()) if use_no_sync else None
            _train(self, num_steps=2, num_microbatches=2, no_sync=no_sync)

        self.run_subtests({"use_no_sync": [False, True]}, run)

    def test_catches_a_skipped_all_reduce(self):
        with self.assertRaisesRegex(AssertionError, "step 0 after backward: .*\n.*grad of"):
            _train(self, make_model=lambda m: HandDataParallel(m, all_reduce=False))

    def test_catches_a_wrong_loss(self):
        make_model = lambda m: HandDataParallel(m, shift_output_on_rank=0)
        expected = (
            "step 0 losses: .*\n.*loss of microbatch 0 on rank 0" if self.rank == 0 else r"\[0\]"
        )
        with self.assertRaisesRegex(AssertionError, expected):
            _train(self, make_model=make_model)

    def test_catches_unsynchronized_initial_params(self):
        def perturb_on_rank_1(model: nn.Module) -> nn.Module:
            if self.rank == 1:
                with torch.no_grad():
                    model.in_proj.weight.add_(1e-3)
            return HandDataParallel(model)

        with self.assertRaisesRegex(AssertionError, "before training"):
            _train(self, make_model=perturb_on_rank_1)

    def test_dtensor_params_match_ddp(self):
        mesh = init_device_mesh("cpu", (self.world_size,))
        _train(self, make_model=lambda m: HandShardedMLP(m, mesh), prefix="mlp.")

    def test_catches_a_dtensor_grad_shard_scaled_on_one_rank(self):
        mesh = init_device_mesh("cpu", (self.world_size,))
        make_model = lambda m: HandShardedMLP(m, mesh, scale_grad_on_rank=0)
        expected = "rank 0: max abs diff" if self.rank == 0 else r"failed on rank\(s\) \[0\]"
        with self.assertRaisesRegex(AssertionError, expected):
            _train(self, make_model=make_model, prefix="mlp.")


class TestVacuousCheckWarns(FSDPTestMultiThread):
    # One rank: warning filters and registries are process-global, so ranks sharing a
    # process would see each other's warnings.
    @property
    def world_size(self) -> int:
        return 1

    def test_warns_when_every_gradient_is_zero(self):
        def dead_relu_mlp() -> MLP:
            model = MLP(5)
            with torch.no_grad():
                model.out_proj.bias.fill_(-1e3)  # every output of the final ReLU is 0
            return model

        ref_model = dead_relu_mlp()
        broadcast_params_from_rank0(ref_model)
        model = HandDataParallel(copy.deepcopy(ref_model))
        with pytest.warns(VacuousParityWarning, match="prove nothing"):
            check_train_parity(self, ref_model, model, _inputs, prefixes_to_ignore=("module.",))
