"""``fully_shard`` behaves as torch's does, in one process (fake process group or world size 1).

Where torch is the reference, each check runs torch's own ``fully_shard`` on a copy of the
same module and compares. Where torch fails opaquely (an ``AttributeError`` deep inside) or
silently accepts nonsense, reffsdp raises an error that names the argument or parameter;
those checks say so. The grouped-call collective counts need real peers and live in
``tests/multithread/test_fully_shard_conformance.py``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard

from reffsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from reffsdp.testing.fake_pg import fake_process_group
from reffsdp.testing.models import MLP

from .conftest import Net


def raises_stating(exc: type[Exception], facts: tuple[str, ...], call) -> str:
    """Run ``call``, expect ``exc``, check its message states each fact; return the message."""
    with pytest.raises(exc) as info:
        call()
    message = str(info.value)
    for fact in facts:
        assert fact in message, message
    return message


@pytest.fixture
def mesh1():
    """A 1-rank world: shards are whole tensors, so values can be checked."""
    with fake_process_group(1, rank=0):
        yield init_device_mesh("cpu", (1,))


def sharded_net(mesh, **kwargs) -> Net:
    net = Net()
    for block in net.blocks:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(net, mesh=mesh, **kwargs)
    return net


def assert_no_module_repr(message: str) -> None:
    """Errors name modules by path or class, never by their multi-line repr."""
    assert "in_features=" not in message and "\n  (" not in message, message


# -- b. shard dims from shard_placement_fn -----------------------------------------------


@pytest.mark.parametrize(
    "dim, bad_param, normalized",
    [
        (5, "weight", 5),  # was taken modulo 2: Shard(1)
        (2, "weight", 2),  # was taken modulo 2: Shard(0)
        (1, "bias", 1),  # a 1-D bias has no dim 1 (was Shard(0))
        (-3, "weight", -1),  # -3 + 2 is still negative
        (-2, "bias", -1),  # fine for the weight (dim 0), not for the bias
    ],
)
def test_shard_dim_out_of_range_names_param_and_dim(mesh, dim, bad_param, normalized):
    """torch raises AssertionError; ours is a ValueError and an AssertionError, so code that
    catches either sees it."""
    lin = nn.Linear(8, 8)
    with pytest.raises(AssertionError):  # torch rejects the same dims
        torch_fully_shard(copy.deepcopy(lin), mesh=mesh, shard_placement_fn=lambda p: Shard(dim))
    with pytest.raises(AssertionError) as info:
        fully_shard(lin, mesh=mesh, shard_placement_fn=lambda p: Shard(dim))
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    ndim = lin.get_parameter(bad_param).dim()
    assert f"Shard dim {dim} is invalid for {ndim}D tensor" in message, message
    assert f"Shard({dim})" in message and bad_param in message, message
    assert_no_module_repr(message)
    assert not isinstance(lin, FSDPModule)
    assert not any(isinstance(p, DTensor) for p in lin.parameters())  # left as it was


def test_shard_dim_1_of_a_bias_is_refused_as_torch(mesh):
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 8))
    raises_as_torch(
        AssertionError,
        "Shard dim 1 is invalid for 1D tensor",
        lambda: torch_fully_shard(
            copy.deepcopy(model), mesh=mesh, shard_placement_fn=lambda p: Shard(1)
        ),
        lambda: fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: Shard(1)),
        ("'0.bias' (Linear)", "(16,)", "shard_placement_fn"),
    )


@pytest.mark.parametrize("dim", [-1, 0])
def test_negative_shard_dim_is_normalized_as_torch_does(mesh, dim):
    lin = nn.Linear(8, 8)
    ref = torch_fully_shard(copy.deepcopy(lin), mesh=mesh, shard_placement_fn=lambda p: Shard(dim))
    fully_shard(lin, mesh=mesh, shard_placement_fn=lambda p: Shard(dim))
    for (name, param), ref_param in zip(lin.named_parameters(), ref.parameters()):
        assert param.placements == ref_param.placements, name
        assert param.to_local().shape == ref_param.to_local().shape, name


# -- c. gradient divide factor -------------------------------------------------------------


@pytest.mark.parametrize("factor", [0.0, 0, -1.0, math.inf, -math.inf, math.nan])
@pytest.mark.parametrize(
    "method", ["set_gradient_divide_factor", "set_reduce_scatter_divide_factor"]
)
def test_gradient_divide_factor_must_be_positive_and_finite(mesh, method, factor):
    net = sharded_net(mesh)
    deprecated = method == "set_reduce_scatter_divide_factor"
    with pytest.warns(FutureWarning) if deprecated else contextlib.nullcontext():
        with pytest.raises(ValueError, match="factor"):
            getattr(net, method)(factor)


@pytest.mark.parametrize("factor", ["2", None, True])
def test_gradient_divide_factor_must_be_a_number(mesh, factor):
    net = sharded_net(mesh)
    with pytest.raises(TypeError, match="factor"):
        net.set_gradient_divide_factor(factor)


def test_gradient_divide_factor_accepts_positive_numbers(mesh):
    net = sharded_net(mesh)
    net.set_gradient_divide_factor(2)
    net.set_gradient_divide_factor(0.5)


# -- d. parameters replaced after fully_shard ----------------------------------------------


def test_plain_param_replaced_before_first_forward_is_sharded(mesh1):
    lin = fully_shard(nn.Linear(4, 3), mesh=mesh1)
    new_weight = torch.randn(3, 4)
    lin.weight = nn.Parameter(new_weight.clone())
    x = torch.randn(2, 4)
    expected = F.linear(x, new_weight, lin.bias.to_local())
    out = lin(x)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    lin.reshard()  # the root keeps its parameters unsharded after forward
    assert isinstance(lin.weight, DTensor)
    assert lin.weight.placements == (Shard(0),)
    torch.testing.assert_close(lin.weight.to_local(), new_weight)
    assert isinstance(lin.weight.grad, DTensor)
    torch.testing.assert_close(lin.weight.grad.to_local(), torch.ones(2, 3).t() @ x)


def test_dtensor_param_replaced_before_first_forward_as_torch(mesh1):
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    ref = copy.deepcopy(lin)
    fully_shard(lin, mesh=mesh1)
    torch_fully_shard(ref, mesh=mesh1)
    new_weight = torch.randn(3, 4)
    # from_local, not distribute_tensor: no collective, whose numbers are fake here.
    lin.weight = nn.Parameter(DTensor.from_local(new_weight.clone(), mesh1, [Shard(0)]))
    ref.weight = nn.Parameter(DTensor.from_local(new_weight.clone(), mesh1, [Shard(0)]))
    x = torch.randn(2, 4)
    expected = F.linear(x, new_weight, ref.bias.to_local())
    out, ref_out = lin(x), ref(x)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    ref_out.sum().backward()
    lin.reshard()
    ref.reshard()
    torch.testing.assert_close(lin.weight.grad.to_local(), ref.weight.grad.to_local())


def test_frozen_replacement_keeps_requires_grad(mesh1):
    lin = fully_shard(nn.Linear(4, 3), mesh=mesh1)
    lin.weight = nn.Parameter(torch.randn(3, 4), requires_grad=False)
    lin(torch.randn(2, 4)).sum().backward()
    lin.reshard()
    assert isinstance(lin.weight, DTensor)
    assert not lin.weight.requires_grad and lin.weight.grad is None
    assert lin.bias.grad is not None


def test_replacement_of_wrong_size_names_the_param(mesh):
    net = sharded_net(mesh)
    net.blocks[1].in_proj.weight = nn.Parameter(torch.randn(5, 4))
    with pytest.raises(ValueError, match=r"blocks\.1\.in_proj\.weight") as info:
        net(torch.randn(2, 4))
    assert "(5, 4)" in str(info.value) and "(16, 4)" in str(info.value)
    assert_no_module_repr(str(info.value))


def test_param_replaced_after_first_forward_is_an_error(mesh):
    net = sharded_net(mesh)
    net(torch.randn(2, 4))
    net.blocks[0].out_proj.weight = nn.Parameter(torch.randn(4, 16))
    with pytest.raises(RuntimeError, match="replaced") as info:
        net(torch.randn(2, 4))
    message = str(info.value)
    assert "blocks.0.out_proj.weight" in message and "Linear" in message, message
    assert_no_module_repr(message)


def test_load_state_dict_assign_after_first_forward_is_not_a_replacement(mesh):
    net = sharded_net(mesh)
    net(torch.randn(2, 4))
    net.load_state_dict(copy.deepcopy(net.state_dict()), assign=True)
    net(torch.randn(2, 4))


class Tied(nn.Module):
    """An embedding and an output layer sharing one weight, as in a language model."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(6, 4)
        self.out = nn.Linear(4, 6, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(tokens))


def _as_dtensors(values: dict[str, torch.Tensor], mesh) -> dict[str, nn.Parameter]:
    return {k: nn.Parameter(DTensor.from_local(v, mesh, [Shard(0)])) for k, v in values.items()}


def test_tied_param_loaded_with_assign_is_tied_again_as_torch(mesh1):
    weight = torch.randn(6, 4)
    models = [fully_shard(Tied(), mesh=mesh1), torch_fully_shard(Tied(), mesh=mesh1)]
    for model in models:
        values = {"emb.weight": weight.clone(), "out.weight": weight.clone()}
        model.load_state_dict(_as_dtensors(values, mesh1), assign=True)
        model(torch.tensor([0, 5])).sum().backward()
        assert model.out.weight is model.emb.weight
    ours, ref = models
    torch.testing.assert_close(ours.emb.weight.to_local(), weight)
    torch.testing.assert_close(ours.emb.weight.grad.to_local(), ref.emb.weight.grad.to_local())


def test_tied_param_loaded_once_with_assign_ties_the_other_name(mesh1):
    """A state dict may hold a tied tensor under one of its names only."""
    weight = torch.randn(6, 4)
    for loaded in ("emb.weight", "out.weight"):
        model = fully_shard(Tied(), mesh=mesh1)
        model.load_state_dict(
            _as_dtensors({loaded: weight.clone()}, mesh1), strict=False, assign=True
        )
        assert model.out.weight is model.emb.weight
        torch.testing.assert_close(model.emb.weight.to_local(), weight)
        model(torch.tensor([0, 5])).sum().backward()


def test_tied_param_loaded_with_different_values_is_refused(mesh1):
    """torch keeps the first name's tensor and drops the other's values silently."""
    model = fully_shard(Tied(), mesh=mesh1)
    values = {"emb.weight": torch.randn(6, 4), "out.weight": torch.randn(6, 4)}
    message = raises_stating(
        ValueError,
        ("emb.weight", "'weight' of Embedding", "'weight' of Linear", "different values"),
        lambda: model.load_state_dict(_as_dtensors(values, mesh1), assign=True),
    )
    assert_no_module_repr(message)


def test_tied_param_replaced_under_one_name_only_is_refused(mesh1):
    """Outside a load, a new tensor under one name would untie what FSDP shards as one."""
    model = fully_shard(Tied(), mesh=mesh1)
    model.out.weight = nn.Parameter(torch.randn(6, 4))
    raises_stating(
        ValueError,
        ("emb.weight", "'weight' of Embedding", "'weight' of Linear", "replace all of them"),
        lambda: model(torch.tensor([0, 5])),
    )


# -- e. casting inside dataclasses ---------------------------------------------------------


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    mask: torch.Tensor
    scale: float = 1.0


@dataclasses.dataclass(frozen=True)
class Output:
    y: torch.Tensor
    extras: list


class DataclassIO(nn.Module):
    """Takes a :class:`Batch` and returns an :class:`Output`; records what dtypes it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: list[torch.dtype] = []

    def forward(self, batch: Batch, *, extra: Batch) -> Output:
        self.seen = [batch.x.dtype, batch.mask.dtype, extra.x.dtype]
        y = self.lin(batch.x) * batch.scale
        return Output(y=y, extras=[y.detach().float(), batch.mask])


def _run_dataclass_io(shard, mesh, mp_policy):
    module = DataclassIO()
    shard(module, mesh=mesh, mp_policy=mp_policy)
    batch = Batch(torch.randn(2, 4), torch.ones(2, dtype=torch.long), scale=2.0)
    extra = Batch(torch.randn(2, 4), torch.ones(2, dtype=torch.long))
    out = module(batch, extra=extra)
    return module.seen, out


def test_forward_inputs_in_dataclasses_are_cast_as_torch(mesh):
    policy = dict(param_dtype=torch.bfloat16, output_dtype=torch.float16)
    seen, out = _run_dataclass_io(fully_shard, mesh, MixedPrecisionPolicy(**policy))
    ref_seen, ref_out = _run_dataclass_io(
        torch_fully_shard, mesh, TorchMixedPrecisionPolicy(**policy)
    )
    assert seen == ref_seen == [torch.bfloat16, torch.long, torch.bfloat16]
    assert isinstance(out, Output)
    assert out.y.dtype == ref_out.y.dtype == torch.float16
    assert [t.dtype for t in out.extras] == [t.dtype for t in ref_out.extras]


def test_dataclass_output_gets_the_pre_backward_unshard(mesh1):
    """Without a hook on a dataclass output, backward would run on freed parameters."""

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> Output:
            return Output(y=self.lin(x), extras=[])

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = Head()
            self.out = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.head(x).y)

    model = Model()
    ref = copy.deepcopy(model)
    fully_shard(model.head, mesh=mesh1, reshard_after_forward=True)
    fully_shard(model, mesh=mesh1)
    x = torch.randn(2, 4, requires_grad=True)
    model(x).sum().backward()
    ref(x.detach()).sum().backward()
    for (name, param), ref_param in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(param.grad.to_local(), ref_param.grad, msg=name)


# -- f. argument types ---------------------------------------------------------------------


@pytest.mark.parametrize("module", ["abc", None, [nn.Linear(2, 2), 3], (nn.Linear(2, 2),)])
def test_fully_shard_needs_modules(mesh, module):
    with pytest.raises(TypeError, match="module"):
        fully_shard(module, mesh=mesh)


def test_fully_shard_of_empty_list(mesh):
    with pytest.raises(ValueError, match="at least one module"):
        fully_shard([], mesh=mesh)


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        (dict(mesh="cpu"), "mesh"),
        (dict(mesh=torch.device("cpu")), "mesh"),
        (dict(mp_policy=torch.bfloat16), "mp_policy"),
        (dict(offload_policy=torch.bfloat16), "offload_policy"),
        (dict(offload_policy=CPUOffloadPolicy), "offload_policy"),  # the class, not an instance
        (dict(shard_placement_fn=Shard(0)), "shard_placement_fn"),
        (dict(ignored_params=3), "ignored_params"),
        (dict(ignored_params={torch.zeros(1)}), "ignored_params"),
        (dict(dp_mesh_dims="dp"), "dp_mesh_dims"),
        (dict(mp_policy=None), "mp_policy"),
        (dict(offload_policy=None), "offload_policy"),
    ],
)
def test_fully_shard_argument_types(mesh, kwargs, argument):
    lin = nn.Linear(4, 4)
    kwargs.setdefault("mesh", mesh)
    with pytest.raises(TypeError, match=argument) as info:
        fully_shard(lin, **kwargs)
    assert_no_module_repr(str(info.value))
    assert not isinstance(lin, FSDPModule)


def test_default_policies_are_accepted(mesh):
    fully_shard(nn.Linear(4, 4), mesh=mesh, mp_policy=MixedPrecisionPolicy())
    fully_shard(nn.Linear(4, 4), mesh=mesh, offload_policy=OffloadPolicy())
    fully_shard(nn.Linear(4, 4), mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    lin = nn.Linear(4, 4)
    fully_shard(lin, mesh=mesh, ignored_params={lin.bias})
    assert not isinstance(lin.bias, DTensor)


@pytest.mark.parametrize("value", [2.0, "2", -2, 0, 3])
def test_reshard_after_forward_names_the_argument(mesh, value):
    with pytest.raises(ValueError, match="reshard_after_forward"):
        fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=value)


BOOL_SETTERS = [
    ("set_requires_gradient_sync", "requires_gradient_sync"),
    ("set_requires_all_reduce", "requires_all_reduce"),
    ("set_reshard_after_backward", "reshard_after_backward"),
    ("set_is_last_backward", "is_last_backward"),
    ("set_unshard_in_backward", "unshard_in_backward"),
    ("set_reduce_scatter_unused_params", "reduce_scatter_unused_params"),
    ("set_force_sum_reduction_for_comms", "enable"),
    ("set_separate_reduce_scatter_group", "enable"),
    ("set_allocate_memory_from_process_group_for_comm", "enable"),
    ("_set_unshard_async_op", "async_op"),
    ("unshard", "async_op"),
]


@pytest.mark.parametrize("method, argument", BOOL_SETTERS)
@pytest.mark.parametrize("value", ["no", 0, None])
def test_bool_flags_must_be_bool(mesh, method, argument, value):
    net = sharded_net(mesh)
    with pytest.raises(TypeError, match=argument):
        getattr(net, method)(value)


@pytest.mark.parametrize(
    "method",
    [
        "set_requires_gradient_sync",
        "set_requires_all_reduce",
        "set_reshard_after_backward",
        "set_reduce_scatter_unused_params",
    ],
)
def test_recurse_must_be_bool(mesh, method):
    net = sharded_net(mesh)
    with pytest.raises(TypeError, match="recurse"):
        getattr(net, method)(True, recurse="no")


def test_set_requires_gradient_sync_no_is_refused_not_taken_as_true(mesh):
    net = sharded_net(mesh)
    with pytest.raises(TypeError, match="requires_gradient_sync"):
        net.set_requires_gradient_sync("no")
    net.set_requires_gradient_sync(False)
    net.set_requires_gradient_sync(True, recurse=False)


# -- g. the facts in error messages --------------------------------------------------------
#
# Where torch raises, reffsdp raises the same type with the phrase torch's own tests match
# (test_fully_shard_init.py), and states its own facts besides.


def raises_as_torch(exc: type[Exception], phrase: str, torch_call, call, facts=()) -> str:
    """torch's call and ours raise ``exc`` matching ``phrase``; ours also states ``facts``."""
    with pytest.raises(exc, match=phrase):
        torch_call()
    message = raises_stating(exc, facts, call)
    assert re.search(phrase, message), message
    return message


def test_mesh_ndim_error_states_1d_or_2d(mesh):
    mesh_3d = init_device_mesh("cpu", (1, 2, 2))
    raises_as_torch(
        ValueError,
        r"fully\_shard expects a 1D or 2D DeviceMesh but got DeviceMesh",
        lambda: torch_fully_shard(nn.Linear(4, 4), mesh=mesh_3d),
        lambda: fully_shard(nn.Linear(4, 4), mesh=mesh_3d),
        ("3D", "(1, 2, 2)", "dp_mesh_dims"),
    )


def test_2d_mesh_without_names_mentions_mesh_dim_names(mesh):
    mesh_2d = init_device_mesh("cpu", (2, 2))
    raises_as_torch(
        AssertionError,
        "Please init the 2D mesh for HSDP with mesh_dim_names specified",
        lambda: torch_fully_shard(nn.Linear(4, 4), mesh=mesh_2d),
        lambda: fully_shard(nn.Linear(4, 4), mesh=mesh_2d),
        ("mesh_dim_names=('replicate', 'shard')", "DeviceMesh((2, 2)"),
    )


def _meta_mlps(shard, mesh) -> nn.Sequential:
    with torch.device("meta"):
        model = nn.Sequential(MLP(8, with_buffer=True), MLP(8))
    for module in (model[0], model[1], model):
        shard(module, mesh=mesh)
    return model


def test_meta_params_error_states_meta_device_fqns_and_fix(mesh):
    """The first group to initialize lists all its parameters still on the meta device."""
    raises_as_torch(
        RuntimeError,
        "FSDP parameters should be materialized from meta device before training, "
        "but the following were still on meta device: "
        r"\['0.in_proj.weight', '0.in_proj.bias', '0.out_proj.weight', '0.out_proj.bias'\]",
        lambda: _meta_mlps(torch_fully_shard, mesh)(torch.randn(4, 8)),
        lambda: _meta_mlps(fully_shard, mesh)(torch.randn(4, 8)),
        ("fully_shard group of MLP", "to_empty", "reset_parameters"),
    )


def test_uneven_sharding_error_states_dim_size_world_size_and_param(mesh):
    lin = nn.Linear(6, 8)
    message = raises_as_torch(
        NotImplementedError,
        "FSDP does not support uneven sharding on dim 1",
        lambda: torch_fully_shard(
            copy.deepcopy(lin), mesh=mesh, shard_placement_fn=lambda p: Shard(-1)
        ),
        lambda: fully_shard(lin, mesh=mesh, shard_placement_fn=lambda p: Shard(-1)),
        ("(8, 6)", "world size 4", "weight", "Linear"),
    )
    assert_no_module_repr(message)


def test_largest_dim_placement_uneven_on_dim_1_is_refused_as_torch(mesh):
    """Sharding each parameter on its largest dim: ``1.weight`` (8 x 17) on 17 columns."""

    def largest_dim(param: nn.Parameter) -> Shard:
        return Shard(max(range(param.dim()), key=lambda dim: param.size(dim)))

    model = nn.Sequential(nn.Linear(16, 17), nn.Linear(17, 8))
    raises_as_torch(
        NotImplementedError,
        "FSDP does not support uneven sharding on dim 1",
        lambda: torch_fully_shard(copy.deepcopy(model), mesh=mesh, shard_placement_fn=largest_dim),
        lambda: fully_shard(model, mesh=mesh, shard_placement_fn=largest_dim),
        ("'1.weight' (Linear)", "(8, 17)", "world size 4"),
    )


def test_non_contiguous_error_states_shape_stride_and_param(mesh):
    module = nn.Module()
    module.weight = nn.Parameter(torch.randn(4, 3).t())
    raises_as_torch(
        NotImplementedError,
        "FSDP does not support non-contiguous parameters",
        lambda: torch_fully_shard(copy.deepcopy(module), mesh=mesh),
        lambda: fully_shard(module, mesh=mesh),
        ("(3, 4)", "(1, 3)", "weight", ".contiguous()"),
    )


def test_channels_last_conv_is_refused_as_non_contiguous(mesh):
    conv = nn.Conv2d(8, 8, 3).to(memory_format=torch.channels_last)
    raises_as_torch(
        NotImplementedError,
        "FSDP does not support non-contiguous parameters",
        lambda: torch_fully_shard(copy.deepcopy(conv), mesh=mesh),
        lambda: fully_shard(conv, mesh=mesh),
        ("'weight' (Conv2d)", "(8, 8, 3, 3)", "(72, 1, 24, 8)"),
    )


def test_scalar_param_error_names_param_and_fix(mesh):
    model = nn.Sequential(nn.Linear(4, 4))
    model.register_parameter("scalar_p", nn.Parameter(torch.tensor(1.0)))
    raises_as_torch(
        ValueError,
        "Change scalar_p to a 1D tensor with numel equal to 1.",
        lambda: torch_fully_shard(copy.deepcopy(model), mesh=mesh),
        lambda: fully_shard(model, mesh=mesh),
        ("scalar", "'scalar_p' (Sequential)", "reshape(1)"),
    )


def test_scalar_param_of_a_submodule_is_named_by_its_path(mesh):
    model = nn.Sequential(nn.Linear(4, 4), nn.Module())
    model[1].scale = nn.Parameter(torch.tensor(1.0))
    message = raises_stating(
        ValueError,
        ("scalar", "Change 1.scale to a 1D tensor with numel equal to 1."),
        lambda: fully_shard(model, mesh=mesh),
    )
    assert_no_module_repr(message)
    assert "Module()" not in message and "ParamRef" not in message, message


def test_param_in_two_groups_states_already_managed(mesh):
    net = Net()
    net.blocks[1].in_proj.weight = net.blocks[0].in_proj.weight
    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    message = raises_stating(
        ValueError,
        (
            "already managed by another",
            "in_proj.weight",
            "fully_shard([module_a, module_b])",
        ),
        lambda: net(torch.randn(2, 4)),
    )
    assert "'blocks.0'" in message and "'blocks.1'" in message, message


def test_all_reduce_hook_stream_under_hsdp_states_native_hsdp(mesh):
    """torch's test_custom_hook_custom_stream compares the whole message, so it is torch's."""
    mesh_2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    messages = []
    for shard in (torch_fully_shard, fully_shard):
        lin = shard(nn.Linear(4, 4), mesh=mesh_2d)
        with pytest.raises(ValueError) as info:
            lin.set_all_reduce_hook(lambda grad: None, stream=object())
        messages.append(str(info.value))
    assert messages == ["stream cannot be set when using native HSDP"] * 2
