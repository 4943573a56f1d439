"""Misuse of ``fully_shard`` raises torch's exception type, and a message that contains the
key phrase of torch's own (with reffsdp's own detail around it).

Each case runs reffsdp's ``fully_shard`` and, where the installed torch has the feature,
torch's own on the same kind of input, in one process on a fake 4-rank process group, and
checks that both raise the same type and state the phrase. Where torch's error comes from
deep inside (a ``DeviceMesh`` slicing, say), the phrase is its one fact that holds for the
user's mistake too, and reffsdp's error is of torch's type as well as a ``ValueError``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from reffsdp import DataParallelMeshDims, fully_shard
from reffsdp.core.compat import TORCH_FULLY_SHARD_HAS_PER_PARAM_MESHES


def raised(call: Callable[[], Any]) -> BaseException:
    with pytest.raises(Exception) as info:
        call()
    return info.value


def check_like_torch(
    error: type[BaseException],
    phrase: str,
    ours: Callable[[], Any],
    theirs: Callable[[], Any] | None,
    *,
    torch_says: str | None = None,
) -> None:
    """``ours`` raises ``error`` stating ``phrase``; so does ``theirs`` (torch's), if given,
    stating ``torch_says`` where torch's message is incidental and ours says otherwise."""
    mine = raised(ours)
    assert isinstance(mine, error), repr(mine)
    assert phrase in str(mine), str(mine)
    if theirs is not None:
        reference = raised(theirs)
        assert type(reference) is error, repr(reference)
        assert (torch_says or phrase) in str(reference), str(reference)


def torch_dims(**names: Any) -> Any:
    from torch.distributed.fsdp import DataParallelMeshDims as TorchDataParallelMeshDims

    return TorchDataParallelMeshDims(**names)


# -- applying fully_shard ------------------------------------------------------------------


def test_applied_twice(mesh):
    def twice(shard):
        return lambda: shard(shard(nn.Linear(4, 4), mesh=mesh), mesh=mesh)

    check_like_torch(
        AssertionError,
        "fully_shard has already been applied",
        twice(fully_shard),
        twice(torch_fully_shard),
    )


def test_applied_twice_in_two_statements(mesh):
    """Sharding a module that is already sharded, in a second statement, states torch's
    phrase for any composable API applied twice."""

    def again(shard):
        def call():
            module = nn.Linear(4, 4)
            shard(module, mesh=mesh)
            shard(module, mesh=mesh)

        return call

    check_like_torch(
        AssertionError,
        "Each distinct composable distributed API can only be applied to a module once.",
        again(fully_shard),
        again(torch_fully_shard),
    )


@pytest.mark.parametrize("container", [nn.ModuleList, nn.ModuleDict])
def test_container_without_forward(mesh, container):
    def build() -> nn.Module:
        if container is nn.ModuleList:
            return nn.ModuleList([nn.Linear(4, 4)])
        return nn.ModuleDict({"a": nn.Linear(4, 4)})

    check_like_torch(
        ValueError,
        "fully_shard does not support containers that do not implement forward",
        lambda: fully_shard(build(), mesh=mesh),
        lambda: torch_fully_shard(build(), mesh=mesh),
    )
    mine = raised(lambda: fully_shard(build(), mesh=mesh))
    assert container.__name__ in str(mine)  # ours names the class, not the module's repr
    assert "in_features=" not in str(mine)


def test_deepcopy(mesh):
    check_like_torch(
        AssertionError,
        "FSDP does not support deepcopy",
        lambda: copy.deepcopy(fully_shard(nn.Linear(4, 4), mesh=mesh)),
        lambda: copy.deepcopy(torch_fully_shard(nn.Linear(4, 4), mesh=mesh)),
    )


@pytest.mark.parametrize("result", [Replicate(), 0, "Shard(0)"])
def test_invalid_shard_placement_fn_result(mesh, result):
    """torch says so from 2.12; before, it fails reading the result's ``dim``. Ours is a
    ``ValueError`` and an ``AttributeError``, so code written against either catches it."""

    def shard_with(shard):
        return lambda: shard(nn.Linear(4, 4), mesh=mesh, shard_placement_fn=lambda p: result)

    phrase = "Invalid shard_placement_fn result"
    if TORCH_FULLY_SHARD_HAS_PER_PARAM_MESHES:
        check_like_torch(ValueError, phrase, shard_with(fully_shard), shard_with(torch_fully_shard))
    else:
        check_like_torch(
            AttributeError,
            phrase,
            shard_with(fully_shard),
            shard_with(torch_fully_shard),
            torch_says="has no attribute 'dim'",
        )
    mine = raised(shard_with(fully_shard))
    assert isinstance(mine, ValueError) and isinstance(mine, AttributeError)


# -- dp_mesh_dims --------------------------------------------------------------------------


def spmd_linear(mesh: DeviceMesh) -> nn.Linear:
    """A linear layer whose parameters are DTensors replicated on every dim of ``mesh``."""
    module = nn.Linear(4, 4)
    for name, param in list(module.named_parameters()):
        placements = [Replicate()] * mesh.ndim
        dtensor = DTensor.from_local(param.detach().clone(), mesh, placements)
        setattr(module, name, nn.Parameter(dtensor))
    return module


@pytest.fixture
def dp_tp(mesh) -> DeviceMesh:
    """A named ``(dp=2, tp=2)`` mesh of the fake 4-rank world."""
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def shard_spmd(mesh: DeviceMesh, names: dict[str, Any], **kwargs: Any) -> None:
    dims = DataParallelMeshDims(**names)
    fully_shard(spmd_linear(mesh), mesh=mesh, dp_mesh_dims=dims, **kwargs)


def check_dp_mesh_dims_like_torch(mesh, names, error, phrase, torch_says=None, **kwargs):
    def theirs():
        dims = torch_dims(**names)
        torch_fully_shard(spmd_linear(mesh), mesh=mesh, dp_mesh_dims=dims, **kwargs)

    check_like_torch(
        error,
        phrase,
        lambda: shard_spmd(mesh, names, **kwargs),
        theirs if TORCH_FULLY_SHARD_HAS_PER_PARAM_MESHES else None,
        torch_says=torch_says,
    )


def test_spmd_param_on_an_equal_but_different_mesh(mesh):
    """torch compares the parameter's mesh with the one passed by identity, not equality.

    (The parameters' mesh may even be an equal mesh of an earlier test: wrapping a DTensor
    in ``nn.Parameter`` runs ``detach``, whose cached sharding hands back the mesh of the
    first equal spec it saw. Never ``passed``, which no DTensor op has seen.)
    """
    own = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ours, theirs = spmd_linear(own), spmd_linear(own)
    passed = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    assert ours.weight.device_mesh == passed and ours.weight.device_mesh is not passed

    def torch_call():
        torch_fully_shard(theirs, mesh=passed, dp_mesh_dims=torch_dims(shard="dp"))

    check_like_torch(
        ValueError,
        "Expected param's DTensor mesh to be the same mesh passed to fully_shard",
        lambda: fully_shard(ours, mesh=passed, dp_mesh_dims=DataParallelMeshDims(shard="dp")),
        torch_call if TORCH_FULLY_SHARD_HAS_PER_PARAM_MESHES else None,
    )


def test_spmd_param_sharded_on_a_data_parallel_dim(dp_tp):
    """A parameter already sharded on a data-parallel dim is refused: FSDP shards it there."""

    def sharded_on_dp() -> nn.Linear:
        module = spmd_linear(dp_tp)
        weight = module.weight.detach().full_tensor()
        module.weight = nn.Parameter(DTensor.from_local(weight[:2], dp_tp, [Shard(0), Replicate()]))
        return module

    dims = dict(shard="dp")
    check_like_torch(
        ValueError,
        "Expected Replicate",
        lambda: fully_shard(sharded_on_dp(), mesh=dp_tp, dp_mesh_dims=DataParallelMeshDims(**dims)),
        (lambda: torch_fully_shard(sharded_on_dp(), mesh=dp_tp, dp_mesh_dims=torch_dims(**dims)))
        if TORCH_FULLY_SHARD_HAS_PER_PARAM_MESHES
        else None,
    )


def test_spmd_plain_tensor_param(dp_tp):
    dims = dict(shard="dp")
    check_like_torch(
        ValueError,
        "must be DTensors",
        lambda: fully_shard(nn.Linear(4, 4), mesh=dp_tp, dp_mesh_dims=DataParallelMeshDims(**dims)),
        (lambda: torch_fully_shard(nn.Linear(4, 4), mesh=dp_tp, dp_mesh_dims=torch_dims(**dims)))
        if TORCH_FULLY_SHARD_HAS_PER_PARAM_MESHES
        else None,
    )


def test_data_parallel_mesh_dims_names_nothing():
    check_like_torch(
        ValueError,
        "At least one of shard or replicate must be set in DataParallelMeshDims",
        lambda: DataParallelMeshDims(),
        torch_dims if TORCH_FULLY_SHARD_HAS_PER_PARAM_MESHES else None,
    )


def test_mesh_without_dim_names(mesh):
    unnamed = init_device_mesh("cpu", (2, 2))
    check_dp_mesh_dims_like_torch(
        unnamed,
        dict(shard="dp"),
        ValueError,
        "mesh must have mesh_dim_names when dp_mesh_dims is provided",
    )


def test_unknown_dim_name(dp_tp):
    check_dp_mesh_dims_like_torch(
        dp_tp, dict(shard="x"), ValueError, "Mesh dim name 'x' not found in mesh.mesh_dim_names"
    )


def test_dim_names_out_of_mesh_order(dp_tp):
    check_dp_mesh_dims_like_torch(
        dp_tp,
        dict(shard=("tp", "dp")),
        KeyError,
        "Mesh dim indices should be in ascending order",
    )
    mine = raised(lambda: shard_spmd(dp_tp, dict(shard=("tp", "dp"))))
    assert isinstance(mine, ValueError)
    assert not str(mine).startswith("'")  # not quoted, as a KeyError's message would be


@pytest.mark.parametrize(
    "names",
    [dict(shard=("dp", "dp")), dict(shard="dp", replicate="dp")],
    ids=["a name twice", "a name in both roles"],
)
def test_overlapping_dim_names(dp_tp, names):
    check_dp_mesh_dims_like_torch(dp_tp, names, RuntimeError, "overlapping")
    assert isinstance(raised(lambda: shard_spmd(dp_tp, names)), ValueError)


def test_no_dim_named(dp_tp):
    """``shard=()`` passes the "at least one" check; torch then fails flattening no dims
    (``RuntimeError``, an incidental message), reffsdp says what is missing."""
    check_dp_mesh_dims_like_torch(
        dp_tp, dict(shard=()), RuntimeError, "names no mesh dim", torch_says="Cannot flatten"
    )


def test_int_reshard_after_forward_with_dp_mesh_dims(dp_tp):
    for value in (1, 2):
        check_dp_mesh_dims_like_torch(
            dp_tp,
            dict(shard="dp"),
            NotImplementedError,
            "reshard_after_forward as int is not yet supported with SPMD mesh (dp_mesh_dims)",
            reshard_after_forward=value,
        )


# -- per-parameter meshes (placement results) ----------------------------------------------


needs_torch_placement_results = pytest.mark.skipif(
    not TORCH_FULLY_SHARD_HAS_PER_PARAM_MESHES,
    reason="torch's fully_shard has no ShardPlacementResult before 2.12 (compat entry 8)",
)


def torch_common() -> Any:
    from torch.distributed.fsdp._fully_shard import _fsdp_common

    return _fsdp_common


class Experts(nn.Module):
    """A shared linear layer and a stacked expert weight."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.experts = nn.Parameter(torch.randn(4, 4, 4))

    def forward(self, x):
        return self.shared(x) + self.experts.sum(0)[0]


def experts_on(result_for_experts: Callable[[], Any]) -> Callable[[nn.Parameter], Any]:
    """A placement function putting ``Experts.experts`` where ``result_for_experts()`` says."""
    return lambda param: result_for_experts() if param.dim() == 3 else None


def check_placement_like_torch(mesh, result: Callable[[], Any], error, phrase, **kwargs):
    def shard_with(shard):
        return lambda: shard(Experts(), mesh=mesh, shard_placement_fn=experts_on(result), **kwargs)

    check_like_torch(error, phrase, shard_with(fully_shard), shard_with(torch_fully_shard))


@pytest.fixture
def rep_ep(mesh) -> DeviceMesh:
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "ep"))


@needs_torch_placement_results
def test_placement_result_with_a_placement_other_than_shard(mesh, rep_ep):
    common = torch_common()
    ep = common.FSDPMeshInfo(rep_ep["ep"], shard_mesh_dim=0)
    result = lambda: common.ShardPlacementResult(Replicate(), ep)  # noqa: E731
    check_placement_like_torch(mesh, result, AttributeError, "")
    mine = raised(lambda: fully_shard(Experts(), mesh=mesh, shard_placement_fn=experts_on(result)))
    assert isinstance(mine, ValueError) and "must be None or a Shard" in str(mine)


@needs_torch_placement_results
@pytest.mark.parametrize("what", ["a DeviceMesh", "a DDPMeshInfo"])
def test_placement_result_without_a_shard_dim(mesh, rep_ep, what):
    """torch reads ``shard_process_group`` off what it was given: ``AttributeError``."""
    common = torch_common()
    if what == "a DeviceMesh":
        description = rep_ep["ep"]
    else:
        description = common.DDPMeshInfo(rep_ep["rep"], replicate_mesh_dim=0)
    result = lambda: common.ShardPlacementResult(Shard(0), description)  # noqa: E731
    check_placement_like_torch(mesh, result, AttributeError, "")
    mine = raised(lambda: fully_shard(Experts(), mesh=mesh, shard_placement_fn=experts_on(result)))
    assert isinstance(mine, ValueError) and "must describe a DeviceMesh to shard over" in str(mine)


@needs_torch_placement_results
def test_one_mesh_description_per_process_group(mesh, rep_ep):
    """Rule 2: a second description of the experts' mesh, or one restating fully_shard's."""
    common = torch_common()
    for description in (
        lambda: common.FSDPMeshInfo(rep_ep["ep"], shard_mesh_dim=0),  # a new one per call
        lambda: common.FSDPMeshInfo(mesh, shard_mesh_dim=0),
    ):

        def place(param: nn.Parameter, description=description):
            return common.ShardPlacementResult(Shard(0), description()) if param.dim() else None

        def shard_with(shard, place=place):
            module = nn.Module()
            module.a, module.b = nn.Parameter(torch.randn(4, 2)), nn.Parameter(torch.randn(4))
            module.forward = lambda x: x
            return lambda: shard(module, mesh=mesh, shard_placement_fn=place)

        check_like_torch(
            ValueError,
            "Params sharing the same process group must use the same FSDPMeshInfo object",
            shard_with(fully_shard),
            shard_with(torch_fully_shard),
        )


@needs_torch_placement_results
def test_shard_dim_out_of_range_on_a_mesh_of_its_own(mesh, rep_ep):
    common = torch_common()
    ep = common.FSDPMeshInfo(rep_ep["ep"], shard_mesh_dim=0)
    result = lambda: common.ShardPlacementResult(Shard(3), ep)  # noqa: E731
    check_placement_like_torch(mesh, result, AssertionError, "Shard dim 3 is invalid for 3D tensor")


@needs_torch_placement_results
def test_int_reshard_after_forward_must_divide_every_group(mesh, rep_ep):
    """Rule 3: 4 divides the 4-rank mesh but not the experts' 2 ranks."""
    common = torch_common()
    ep = common.FSDPMeshInfo(rep_ep["ep"], shard_mesh_dim=0)
    result = lambda: common.ShardPlacementResult(Shard(0), ep)  # noqa: E731
    check_placement_like_torch(
        mesh, result, ValueError, "", reshard_after_forward=4
    )  # torch: "should be a factor of 2, not 4"
    mine = raised(
        lambda: fully_shard(
            Experts(), mesh=mesh, shard_placement_fn=experts_on(result), reshard_after_forward=4
        )
    )
    assert "reshard_after_forward=4 must divide the shard size 2" in str(mine)


@needs_torch_placement_results
def test_no_placement_function_with_replicate_only_dp_mesh_dims(dp_tp):
    check_dp_mesh_dims_like_torch(
        dp_tp,
        dict(replicate="dp"),
        ValueError,
        "Per-param mesh via shard_placement_fn is not supported with DDPMeshInfo",
        shard_placement_fn=lambda param: None,
    )


def test_placement_result_of_any_object_of_that_shape(mesh, rep_ep):
    """On every torch: reffsdp reads the four fields, whatever the type."""

    class Info:
        def __init__(self, mesh, shard_mesh_dim, replicate_mesh_dim=None):
            self.mesh, self.shard_mesh_dim = mesh, shard_mesh_dim
            self.replicate_mesh_dim = replicate_mesh_dim

    class Result:
        def __init__(self, placement, mesh_info):
            self.placement, self.mesh_info = placement, mesh_info

    ep, hsdp = Info(rep_ep["ep"], 0), Info(rep_ep, 1, 0)
    for info, placements in ((ep, (Shard(1),)), (hsdp, (Replicate(), Shard(1)))):
        result = lambda info=info: Result(Shard(1), info)  # noqa: E731
        module = fully_shard(Experts(), mesh=mesh, shard_placement_fn=experts_on(result))
        assert module.experts.placements == placements
        assert module.experts.device_mesh == info.mesh
        assert module.shared.weight.device_mesh == mesh
        assert [len(g.members) for g in module._get_fsdp_state().groups] == [2, 1]

    class SpmdInfo(Info):
        dp_mesh_dims = "dp"

    result = lambda: Result(None, SpmdInfo(rep_ep["ep"], 0))  # noqa: E731
    with pytest.raises(NotImplementedError, match="with dp_mesh_dims"):
        fully_shard(Experts(), mesh=mesh, shard_placement_fn=experts_on(result))
