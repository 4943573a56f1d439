"""Misuse of ``fully_shard`` and ``FSDPModule`` raises what SPEC section 5 says, clearly.

Every check runs in one process on a fake process group of 4 ranks (no peer is needed: the
errors are raised before or at the first forward, where collectives only fill buffers).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from reffsdp import (
    FSDPModule,
    fully_shard,
    register_fsdp_forward_method,
    share_comm_ctx,
)

from .conftest import Net


def sharded_net(mesh, device: str | None = None) -> Net:
    net = Net(device)
    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def x() -> torch.Tensor:
    return torch.randn(2, 4)


# -- fully_shard arguments ---------------------------------------------------------------


def test_fully_shard_twice_on_one_module(mesh):
    lin = fully_shard(nn.Linear(4, 4), mesh=mesh)
    with pytest.raises(AssertionError, match="already been applied"):
        fully_shard(lin, mesh=mesh)


@pytest.mark.parametrize("container", [nn.ModuleList, nn.ModuleDict])
def test_container_without_forward(mesh, container):
    module = container([nn.Linear(4, 4)] if container is nn.ModuleList else {"a": nn.Linear(4, 4)})
    with pytest.raises(ValueError, match=container.__name__):
        fully_shard(module, mesh=mesh)


def test_container_with_forward_is_accepted(mesh):
    class Blocks(nn.ModuleList):
        def forward(self, x):
            for block in self:
                x = block(x)
            return x

    fully_shard(Blocks([nn.Linear(4, 4)]), mesh=mesh)


@pytest.mark.parametrize("value", ["2", 2.0, [2]])
def test_reshard_after_forward_not_bool_or_int(mesh, value):
    with pytest.raises(ValueError, match="bool or int"):
        fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=value)


@pytest.mark.parametrize("value", [0, -2, 3, 5, 8])
def test_reshard_after_forward_int_out_of_range_or_not_dividing(mesh, value):
    with pytest.raises(ValueError, match=f"reshard_after_forward={value}"):
        fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=value)


def test_reshard_after_forward_one_warns_and_means_false(mesh):
    net = Net()
    with pytest.warns(UserWarning, match="reshard_after_forward=1"):
        fully_shard(net, mesh=mesh, reshard_after_forward=1)
    net(x())
    assert not isinstance(net.proj.weight, DTensor)  # still unsharded


def test_scalar_param(mesh):
    module = nn.Module()
    module.scale = nn.Parameter(torch.tensor(1.0))
    with pytest.raises(ValueError, match="scalar"):
        fully_shard(module, mesh=mesh)


def test_non_contiguous_param(mesh):
    module = nn.Module()
    module.weight = nn.Parameter(torch.randn(4, 3).t())
    with pytest.raises(NotImplementedError, match="contiguous"):
        fully_shard(module, mesh=mesh)


@pytest.mark.parametrize("result", [Replicate(), 0, "Shard(0)"])
def test_shard_placement_fn_returns_something_else(mesh, result):
    with pytest.raises(ValueError, match="shard_placement_fn"):
        fully_shard(nn.Linear(4, 4), mesh=mesh, shard_placement_fn=lambda param: result)


def test_shard_placement_fn_uneven_dim_1(mesh):
    with pytest.raises(NotImplementedError, match="evenly"):
        fully_shard(nn.Linear(6, 8), mesh=mesh, shard_placement_fn=lambda param: Shard(1))


def test_shard_placement_fn_even_dim_1_is_accepted(mesh):
    lin = fully_shard(nn.Linear(8, 6), mesh=mesh, shard_placement_fn=lambda p: Shard(p.dim() - 1))
    assert lin.weight.placements == (Shard(1),)
    assert lin.weight.to_local().shape == (6, 2)


def test_top_down_application(mesh):
    """torch fails here with an opaque TypeError; reffsdp says what to do."""
    net = Net()
    fully_shard(net, mesh=mesh)
    with pytest.raises(ValueError, match="bottom-up"):
        fully_shard(net.blocks[0], mesh=mesh)


def test_deepcopy(mesh):
    net = sharded_net(mesh)
    with pytest.raises(AssertionError, match="deepcopy"):
        copy.deepcopy(net)
    with pytest.raises(AssertionError, match="deepcopy"):
        copy.deepcopy(net.blocks[0])


# -- lazy init at the first forward --------------------------------------------------------


def test_meta_params_at_first_forward_name_the_fqn(mesh):
    net = sharded_net(mesh, device="meta")
    with pytest.raises(RuntimeError, match=r"meta device.*proj\.weight"):
        net(x())


def test_meta_params_of_a_block_name_the_fqn(mesh):
    net = sharded_net(mesh)
    net.blocks[1].to_empty(device="meta")
    with pytest.raises(RuntimeError, match=r"blocks\.1\.in_proj\.weight"):
        net(x())


def test_non_root_forwarded_before_root(mesh):
    net = sharded_net(mesh)
    net.blocks[0](x())
    with pytest.raises(RuntimeError, match="run forward through the root"):
        net(x())


def test_grouped_root(mesh):
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    fully_shard([a, b], mesh=mesh)
    with pytest.raises(RuntimeError, match="cannot be the root"):
        a(x())


def test_mixed_trainable_orig_dtypes_in_one_group(mesh):
    module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).double())
    fully_shard(module, mesh=mesh)
    with pytest.raises(AssertionError, match="orig_dtype"):
        module(x())


def test_mixed_orig_dtypes_allowed_when_frozen(mesh):
    module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).double().requires_grad_(False))
    fully_shard(module, mesh=mesh)
    module.unshard()  # lazy init of the group passes
    module.reshard()


def test_tied_param_split_across_two_calls(mesh):
    net = Net()
    net.blocks[1].in_proj.weight = net.blocks[0].in_proj.weight
    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    with pytest.raises(ValueError, match=r"fully_shard\(\[module_a, module_b\]\)"):
        net(x())


# -- FSDPModule methods --------------------------------------------------------------------


def test_reset_iter_state_on_non_root(mesh):
    net = sharded_net(mesh)
    net(x())
    with pytest.raises(RuntimeError, match="root"):
        net.blocks[0].reset_iter_state()
    net.reset_iter_state()  # fine on the root


@pytest.mark.parametrize("value", [1, None, "False"])
def test_set_reshard_after_forward_not_bool(mesh, value):
    net = sharded_net(mesh)
    with pytest.raises(ValueError, match="bool"):
        net.set_reshard_after_forward(value)


@pytest.mark.parametrize(
    "setter", ["set_modules_to_forward_prefetch", "set_modules_to_backward_prefetch"]
)
def test_prefetch_targets_must_be_fsdp_modules(mesh, setter):
    net = sharded_net(mesh)
    with pytest.raises(ValueError, match="FSDPModule"):
        getattr(net.blocks[0], setter)([net.blocks[1], nn.Linear(4, 4)])


def test_share_comm_ctx_needs_fsdp_modules(mesh):
    net = sharded_net(mesh)
    with pytest.raises(ValueError, match="FSDPModule"):
        share_comm_ctx([net, nn.Linear(4, 4)])
    share_comm_ctx([])  # no-op


def test_register_fsdp_forward_method_missing(mesh):
    net = sharded_net(mesh)
    with pytest.raises(ValueError, match="generate"):
        register_fsdp_forward_method(net, "generate")
    register_fsdp_forward_method(nn.Linear(4, 4), "generate")  # no-op off FSDP modules


@pytest.mark.parametrize(
    "value, error", [(1.5, TypeError), (True, TypeError), ("2", TypeError), (0, ValueError)]
)
def test_set_reduce_scatter_max_input_buffers(mesh, value, error):
    net = sharded_net(mesh)
    with pytest.raises(error, match="max_input_buffers"):
        net.set_reduce_scatter_max_input_buffers(value)
    net.set_reduce_scatter_max_input_buffers(2)


def test_get_fsdp_state_without_state():
    with pytest.raises(AssertionError, match="no fully_shard state"):
        FSDPModule._get_fsdp_state(nn.Linear(4, 4))


def test_view_output_warns(mesh):
    class ViewOut(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).view(-1)

    model = fully_shard(ViewOut(), mesh=mesh)
    with pytest.warns(UserWarning, match="returned a view tensor"):
        model(torch.randn(2, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fully_shard(nn.Linear(4, 4), mesh=mesh)(torch.randn(2, 4))  # not a view: silent
