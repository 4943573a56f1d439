"""The parity suite's scenarios: what each one builds, and the matrix they form.

A scenario is one combination of API (``fully_shard`` or the ``FullyShardedDataParallel``
wrapper, and two ``naive`` ones), mesh, feature and model. :func:`build_scenario` builds it
on the calling rank, sharded by the implementation under test (reffsdp, torch's or another:
:mod:`reffsdp.testing.impls`; only reffsdp has ``naive``): the unsharded reference, the
sharded model, the inputs, the arguments for
:func:`~reffsdp.testing.parity.check_train_parity`, and the parameter groups the expected
collectives are computed from (see :mod:`reffsdp.testing.expected_comms`). The engine in
:mod:`reffsdp.testing.parity_suite` runs them.

[Note: the matrix]
Not the full cross product: every feature runs on every mesh of each API once, and the
models rotate over the features so each API trains each model several times.

=========  ==================================================================
mesh       ranks (W: the suite's world size)
=========  ==================================================================
``1d``     FSDP over all W ranks
``hsdp``   2 replicas of W/2-rank shard groups; on a launched world of several nodes,
           a replica per node, sharded inside it (nodes x ranks per node)
``2d``     FSDP over W/2 ranks times tensor parallelism over 2 (fully_shard)
``3d``     2 replicas x W/4-rank shard groups x tensor parallelism over 2 (8 ranks)
=========  ==================================================================

The wrapper runs only ``1d`` and ``hsdp``: like torch's ``FullyShardedDataParallel`` it
takes a 2-D ``device_mesh`` only for the hybrid strategies and has no tensor-parallel
composition, so its ``2d``/``3d`` cells do not exist. Tensor-parallel scenarios train MLP
models (the tensor-parallel plan is colwise/rowwise over each MLP block); their tied-weight
case is :class:`~reffsdp.testing.models.TiedMLPStack`.

Two more scenarios hold the reader's first page, :class:`reffsdp.naive.NaiveFSDP`, to the same
checks: ``naive/1d/fp32/mlp`` and ``naive/1d/accum/transformer``. Each parameter is one
all-gather per forward and one reduce-scatter per backward; ``NaiveFSDP`` has no way to skip a
reduction, so its ``accum`` scenario reduces both microbatches (against DDP doing the same)
and checks that the second reduced gradient is added to the first. ``naive`` is a suite
scenario only: :func:`~reffsdp.testing.parity_scenarios` offers ``APIS``, not it.

Features: ``fp32``; ``bf16`` (bf16 compute, fp32 reduction, against
:class:`~reffsdp.testing.parity.LowPrecisionCompute`); ``offload`` (CPU offload of the
shards); ``reshard`` (``reshard_after_forward`` an int on ``1d``, ``False`` elsewhere; the
wrapper's ``SHARD_GRAD_OP`` / ``_HYBRID_SHARD_ZERO2``); ``accum`` (two microbatches per step,
the first without gradient sync); ``ckpt`` (activation checkpointing); ``frozen`` (a frozen
middle block); ``tied`` (tied weights); ``orig-params`` (wrapper, ``use_orig_params=True``;
its other scenarios use ``False``); ``sd-full`` / ``sd-sharded`` (train, save a full or
sharded state dict, load it into a freshly built sharded model, train on; their models tie
a weight, which the state dict holds under both names, as a GPT-2's embedding and output
layer); ``fp8-gather`` (``fully_shard`` on ``1d`` and ``hsdp`` only: every linear weight a
:class:`~reffsdp.testing.low_precision.Float8GatherWeight`, all-gathered as fp8 data and
per-row scales through the all-gather extension hooks, against
:class:`~reffsdp.testing.low_precision.Float8GatherReference`; the bytes expected are the
hooks' inputs, about a quarter of fp32's for wide rows).

``fp8-gather`` takes the one-argument hook on ``1d``, whose MLP's 15- and 5-row weights
leave ranks with padding rows to quantize, and the five-argument hook on ``hsdp``, whose
transformer's rows divide evenly: on a rank that holds padding, torch's ``fully_shard``
wants every input of the five-argument hook in the padded shard's shape, which a per-row
scale (one column) cannot have, so that form is only usable where dim 0 divides.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from reffsdp.core.torch_internals import tree_map_only

from .build import build_seeded
from .expected_comms import CommUnit, StepShape, fully_shard_units, naive_units, wrapper_units
from .impls import Implementation
from .inputs import random_inputs, random_tokens
from .low_precision import Float8GatherReference, float8_weight_names, to_float8_gather
from .models import (
    MLP,
    CheckpointedMLPStack,
    ConvNet,
    MLPStack,
    ModelArgs,
    SmoothMLPStack,
    TiedMLPStack,
    Transformer,
    TransformerBlock,
    init_deterministic,
)
from .parity import (
    LowPrecisionCompute,
    Passthrough,
    broadcast_params_from_rank0,
    gradient_sync_off,
)
from .preflight import blocks_of, unsharded_blocks_message
from .tolerances import Tolerance

APIS = ("fully_shard", "wrapper")
SUITE_APIS = (*APIS, "naive")  # what the suite runs and selects by
MESHES = ("1d", "hsdp", "2d", "3d")
MODELS = ("mlp", "transformer", "convnet")
FEATURES = (
    "fp32",
    "bf16",
    "offload",
    "reshard",
    "accum",
    "ckpt",
    "frozen",
    "tied",
    "orig-params",
    "sd-full",
    "sd-sharded",
    "fp8-gather",
)
TP_MESHES = ("2d", "3d")
WRAPPER_MESHES = ("1d", "hsdp")
FP8_GATHER_MESHES = ("1d", "hsdp")  # fully_shard only
# The pre-all-gather hook form (its number of arguments) per mesh; see [Note: the matrix].
FP8_GATHER_HOOK_ARGUMENTS = {"1d": 1, "hsdp": 5}
# A user's model runs these by default, and may add the optional ones.
CUSTOM_FEATURES = ("fp32", "reshard", "accum", "offload", "sd-full", "sd-sharded")
CUSTOM_OPTIONAL_FEATURES = ("bf16", "orig-params")

MLP_DIM = 5  # 15-row layers: uneven shards on 2 and 4 ranks
TP_DIM = 8  # tensor parallelism splits the hidden widths in two
BF16 = torch.bfloat16

# Tensor parallelism sums partial products in another order than the unsharded reference,
# so fp32 results differ in the last bits (relative to values in the hundreds), and bf16
# ones by bf16 roundings of those sums; (fp32, bf16) tolerances for its scenarios.
TP_TOLERANCES = {
    False: {"rtol": 1e-5, "atol": 1e-4},
    True: {"rtol": 1e-2, "atol": 1e-2},
}

# The model each (mesh kind, feature) trains; see [Note: the matrix].
_MODEL_1D = {
    "fp32": "convnet",
    "bf16": "mlp",
    "offload": "transformer",
    "reshard": "mlp",
    "accum": "transformer",
    "ckpt": "transformer",
    "frozen": "mlp",
    "tied": "transformer",
    "orig-params": "transformer",
    "sd-full": "mlp",
    "sd-sharded": "transformer",
    "fp8-gather": "mlp",
}
_MODEL_HSDP = {
    "fp32": "mlp",
    "bf16": "convnet",
    "offload": "mlp",
    "reshard": "transformer",
    "accum": "mlp",
    "ckpt": "transformer",
    "frozen": "mlp",
    "tied": "transformer",
    "orig-params": "convnet",
    "sd-full": "transformer",
    "sd-sharded": "mlp",
    "fp8-gather": "transformer",
}


@dataclasses.dataclass(frozen=True)
class CustomModel:
    """A user's model for :func:`reffsdp.testing.parity_scenarios`: ``model_factory()``
    builds it unsharded (on the CPU; the scenario moves it and makes it rank 0's on every
    rank), ``make_inputs(iteration, rank)`` gives one forward's inputs (any nesting of
    tensors; moved to the scenario's device), and every module of ``block_types`` gets its
    own parameter group (``fully_shard``) or wrapper instance before the root.

    ``loss_fn``, ``optimizer_factory``, ``rtol`` and ``atol`` go to
    :func:`~reffsdp.testing.parity.check_train_parity` (``None``: the suite's optimizer,
    :class:`LocalSGD`, and the check's defaults).
    """

    model_factory: Callable[[], nn.Module]
    make_inputs: Callable[[int, int], Any]
    block_types: tuple[type[nn.Module], ...] = ()
    loss_fn: Callable[[Any], torch.Tensor] | None = None
    optimizer_factory: Callable[[Any], torch.optim.Optimizer] | None = None
    rtol: Tolerance = None
    atol: Tolerance = None

    def check_kwargs(self) -> dict[str, Any]:
        """The arguments of ``check_train_parity`` this model sets."""
        kwargs: dict[str, Any] = {"rtol": self.rtol, "atol": self.atol}
        if self.loss_fn is not None:
            kwargs["loss_fn"] = self.loss_fn
        if self.optimizer_factory is not None:
            kwargs["optimizer_factory"] = self.optimizer_factory
        return kwargs


@dataclasses.dataclass(frozen=True)
class ScenarioSpec:
    """One cell of the matrix; ``skip`` names a known bug that keeps it from running."""

    api: str
    mesh: str
    feature: str
    model: str
    skip: str = ""
    custom: CustomModel | None = None

    @property
    def name(self) -> str:
        return f"{self.api}/{self.mesh}/{self.feature}/{self.model}"

    def world_size(self, world_size: int, *, resize: bool) -> int:
        """Ranks this scenario runs on given the suite's ``world_size``; with ``resize``
        (threads) the 3-D mesh gets the 8 ranks it needs."""
        if self.mesh == "3d" and resize:
            return max(8, world_size - world_size % 4)
        return world_size

    def fits(self, world_size: int, *, nodes: int = 1) -> str:
        """Why ``world_size`` ranks on ``nodes`` nodes cannot hold this scenario's mesh (""
        if they can); see [Note: the matrix]."""
        if self.mesh == "hsdp" and nodes > 1 and world_size // nodes < 2:
            return (
                "the hsdp mesh shards inside a node: it needs at least 2 ranks per node, "
                f"the world has {world_size // nodes}"
            )
        if self.mesh in ("hsdp", "2d") and (world_size < 4 or world_size % 2):
            return f"the {self.mesh} mesh needs an even number of ranks, at least 4"
        if self.mesh == "3d" and (world_size < 8 or world_size % 4):
            return "the 3d mesh needs a multiple of 4 ranks, at least 8"
        if self.api == "naive" and world_size < 2:  # one rank still gathers; nothing expects it
            return "the naive scenarios shard over 2 ranks or more"
        if self.feature == "reshard" and self.mesh == "1d" and world_size % 2:
            return "reshard_after_forward=2 needs an even number of ranks"
        return ""


def _in_matrix(api: str, mesh: str, feature: str) -> bool:
    """Whether ``api`` runs ``feature`` on ``mesh``; see [Note: the matrix]."""
    if feature == "orig-params":
        return api == "wrapper"
    if feature == "fp8-gather":
        return api == "fully_shard" and mesh in FP8_GATHER_MESHES
    return True


def all_specs() -> list[ScenarioSpec]:
    """Every scenario of the suite, in run order; see [Note: the matrix]."""
    specs = []
    for api in APIS:
        meshes = MESHES if api == "fully_shard" else WRAPPER_MESHES
        for mesh in meshes:
            for feature in FEATURES:
                if not _in_matrix(api, mesh, feature):
                    continue
                if mesh in TP_MESHES:
                    model = "mlp"
                else:
                    model = (_MODEL_1D if mesh == "1d" else _MODEL_HSDP)[feature]
                specs.append(ScenarioSpec(api, mesh, feature, model))
    specs.append(ScenarioSpec("naive", "1d", "fp32", "mlp"))
    specs.append(ScenarioSpec("naive", "1d", "accum", "transformer"))
    return specs


# -- building one scenario ------------------------------------------------------------------


@dataclasses.dataclass
class BuiltScenario:
    """Everything one rank needs to run a scenario.

    ``reload`` (state-dict scenarios) saves the trained ``model``'s state dict, builds a
    fresh sharded model, loads it, and returns the fresh one.
    """

    ref_model: nn.Module
    model: nn.Module
    make_inputs: Callable[[int, int], Any]
    units: list[CommUnit]
    shape: StepShape
    check_kwargs: dict[str, Any]
    reload: Callable[[nn.Module], nn.Module] | None = None


@dataclasses.dataclass(frozen=True)
class _Mesh:
    """The meshes a scenario shards over, and its data-parallel sizes."""

    fsdp_mesh: Any  # what fully_shard takes (the data-parallel sub-mesh)
    tp_mesh: Any
    shard_size: int
    replicate_size: int
    wrapper_kwargs: dict[str, Any]


def _make_mesh(mesh: str, device_type: str, api: str, nodes: int) -> _Mesh:
    from .meshes import mesh_1d, mesh_dp_tp, mesh_hsdp, mesh_nd

    world_size = dist.get_world_size()
    if mesh == "1d":
        if api == "naive":  # the default group
            return _Mesh(None, None, world_size, 1, {})
        if api == "wrapper":  # the device as torch's users name it: CPU modules stay there
            return _Mesh(None, None, world_size, 1, {"device_id": torch.device(device_type)})
        return _Mesh(mesh_1d(device_type), None, world_size, 1, {})
    if mesh == "hsdp":
        replicas = nodes if nodes > 1 else 2
        hsdp = mesh_hsdp(replicas, world_size // replicas, device_type)
        return _Mesh(hsdp, None, world_size // replicas, replicas, {"device_mesh": hsdp})
    if mesh == "2d":
        full = mesh_dp_tp(world_size // 2, 2, device_type)
        return _Mesh(full["dp_shard"], full["tp"], world_size // 2, 1, {})
    full = mesh_nd(2, world_size // 4, 2, device_type)
    return _Mesh(full["dp_replicate", "dp_shard"], full["tp"], world_size // 4, 2, {})


def _same_on_every_rank(factory: Callable[[], nn.Module], seed: int, device) -> nn.Module:
    model = build_seeded(factory, seed).to(device)
    broadcast_params_from_rank0(model)  # a factory may still draw from elsewhere
    return model


# Features whose models tie a weight: state dicts save and load it under both names.
_TIED_FEATURES = ("tied", "sd-full", "sd-sharded")


def _new_model(spec: ScenarioSpec, device: torch.device, seed: int) -> nn.Module:
    """The unsharded model, identical on every rank and in every run (``seed`` varies it)."""
    tp = spec.mesh in TP_MESHES
    if spec.custom is not None:
        return _same_on_every_rank(spec.custom.model_factory, seed, device)
    tied = spec.feature in _TIED_FEATURES
    if spec.model == "mlp":
        dim = TP_DIM if tp else MLP_DIM
        if tied:
            model = TiedMLPStack(dim)
        elif spec.feature == "ckpt":
            model = CheckpointedMLPStack(dim)
        elif spec.feature == "bf16" and tp:  # default init: activations of order 1
            return _same_on_every_rank(lambda: SmoothMLPStack(dim), seed, device)
        else:
            model = MLPStack(dim)
        return init_deterministic(model, seed).to(device)
    if spec.model == "transformer":
        args = ModelArgs(
            weight_tying=tied,
            checkpoint_activations=spec.feature == "ckpt",
        )
        return _same_on_every_rank(lambda: Transformer(args), seed, device)
    return _same_on_every_rank(lambda: ConvNet(width=4), seed, device)


def _inputs(spec: ScenarioSpec, device: torch.device) -> Callable[[int, int], Any]:
    if spec.custom is not None:
        make_inputs = spec.custom.make_inputs
        to_device = lambda t: t.to(device)  # noqa: E731
        return lambda iteration, rank: tree_map_only(
            torch.Tensor, to_device, make_inputs(iteration, rank)
        )
    same_within = 2 if spec.mesh in TP_MESHES else 1  # a TP group sees one batch
    if spec.model == "mlp":
        dim = TP_DIM if spec.mesh in TP_MESHES else MLP_DIM
        return random_inputs(3, dim, device=device, same_within=same_within)
    if spec.model == "transformer":
        return random_tokens(ModelArgs().vocab_size, 2, 8, device=device)
    return random_inputs(2, 3, 6, 6, device=device)


def _blocks(model: nn.Module, spec: ScenarioSpec) -> list[nn.Module]:
    """The modules sharded (or wrapped) before the root."""
    model_kind = spec.model
    if spec.custom is not None:
        return blocks_of(model, spec.custom.block_types)
    if model_kind == "transformer":
        return list(model.layers)
    if model_kind == "convnet":
        return [model.conv1, model.conv2]
    return list(model.blocks) if isinstance(model, TiedMLPStack) else list(model)


def _wrap_classes(spec: ScenarioSpec) -> set[type[nn.Module]]:
    if spec.custom is not None:
        return set(spec.custom.block_types)
    return {"transformer": {TransformerBlock}, "convnet": {nn.Conv2d}}.get(spec.model, {MLP})


def _freeze(spec: ScenarioSpec, model: nn.Module) -> None:
    if spec.feature == "frozen":
        _blocks(model, spec)[1].requires_grad_(False)


def _apply_tensor_parallel(model: nn.Module, spec: ScenarioSpec, tp_mesh: Any) -> None:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()}
    for block in _blocks(model, spec):
        parallelize_module(block, tp_mesh, plan)


class Unsupported(Exception):
    """The implementation under test refused to set a scenario up: it raised while sharding
    or configuring the model. Its message is the implementation's own."""


@contextlib.contextmanager
def _set_up_by(impl: Implementation, call: str) -> Iterator[None]:
    """Turn whatever ``impl`` raises in ``call`` into :class:`Unsupported`."""
    try:
        yield
    except Exception as error:
        text = "".join(traceback.format_exception_only(type(error), error)).strip()
        raise Unsupported(f"{impl.name}'s {call} raised {text}") from error


def _shard_fully(
    model: nn.Module, spec: ScenarioSpec, mesh: _Mesh, impl: Implementation
) -> tuple[nn.Module, list]:
    """``fully_shard`` every block, then the root; returns the model and its groups."""
    api = impl.module
    kwargs: dict[str, Any] = {"mesh": mesh.fsdp_mesh}
    reshard = None
    if spec.feature == "reshard":
        reshard = 2 if spec.mesh == "1d" else False
        kwargs["reshard_after_forward"] = reshard
    param_dtype = reduce_dtype = None
    if spec.feature == "bf16":
        param_dtype, reduce_dtype = BF16, torch.float32
    with _set_up_by(impl, "MixedPrecisionPolicy"):
        mp_policy = api.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if spec.feature == "bf16":
        kwargs["mp_policy"] = mp_policy
    if spec.feature == "offload":
        with _set_up_by(impl, "CPUOffloadPolicy"):
            kwargs["offload_policy"] = api.CPUOffloadPolicy()
    if spec.feature == "fp8-gather":
        to_float8_gather(model, FP8_GATHER_HOOK_ARGUMENTS[spec.mesh])
    blocks = _blocks(model, spec)
    units = fully_shard_units(
        [*blocks, model],
        mesh.shard_size,
        reshard_after_forward=reshard,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        mp_policy=mp_policy,
        size_handshakes=impl.size_handshakes,
    )
    with _set_up_by(impl, "fully_shard"):
        for block in blocks:
            api.fully_shard(block, **kwargs)
        api.fully_shard(model, **kwargs)
    return model, units


def _wrapper_strategy(spec: ScenarioSpec, impl: Implementation) -> Any:
    ShardingStrategy = impl.module.ShardingStrategy

    if spec.mesh == "hsdp":
        if spec.feature == "reshard":
            return ShardingStrategy._HYBRID_SHARD_ZERO2
        return ShardingStrategy.HYBRID_SHARD
    if spec.feature == "reshard":
        return ShardingStrategy.SHARD_GRAD_OP
    return ShardingStrategy.FULL_SHARD


def _wrap(
    model: nn.Module, spec: ScenarioSpec, mesh: _Mesh, impl: Implementation, device: torch.device
) -> tuple[nn.Module, list]:
    """``FullyShardedDataParallel`` over every block (auto-wrap policy) and the root."""
    from .build import wrap_blocks

    api = impl.module
    ShardingStrategy = api.ShardingStrategy
    strategy = _wrapper_strategy(spec, impl)
    kwargs: dict[str, Any] = {**mesh.wrapper_kwargs, **impl.wrapper_kwargs(device)}
    use_orig_params = spec.feature == "orig-params"
    param_dtype = reduce_dtype = None
    if spec.feature == "bf16":
        param_dtype, reduce_dtype = BF16, torch.float32
        with _set_up_by(impl, "MixedPrecision"):
            kwargs["mixed_precision"] = api.MixedPrecision(
                param_dtype=BF16, reduce_dtype=torch.float32
            )
    if spec.feature == "offload":
        with _set_up_by(impl, "CPUOffload"):
            kwargs["cpu_offload"] = api.CPUOffload(offload_params=True)
    classes = _wrap_classes(spec)
    wrapped_modules = [m for m in model.modules() if isinstance(m, tuple(classes))]
    units = wrapper_units(
        [*wrapped_modules, model],
        mesh.shard_size,
        reshard_after_forward=strategy
        in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD),
        use_orig_params=use_orig_params,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
    )
    with _set_up_by(impl, "FullyShardedDataParallel"):
        wrapped = wrap_blocks(
            model,
            classes,
            impl=impl,
            sharding_strategy=strategy,
            use_orig_params=use_orig_params,
            **kwargs,
        )
    return wrapped, units


def _shard(
    spec: ScenarioSpec, model: nn.Module, mesh: _Mesh, impl: Implementation, device: torch.device
) -> tuple[nn.Module, list]:
    if spec.mesh in TP_MESHES:
        _apply_tensor_parallel(model, spec, mesh.tp_mesh)
    if spec.api == "fully_shard":
        return _shard_fully(model, spec, mesh, impl)
    if spec.api == "naive":  # reffsdp's alone (Implementation.not_applicable)
        from reffsdp.naive import NaiveFSDP

        units = naive_units(model, mesh.shard_size)  # from the unsharded shapes
        return NaiveFSDP(model), units
    return _wrap(model, spec, mesh, impl, device)


def _no_sync(spec: ScenarioSpec) -> Callable[[nn.Module], Any]:
    if spec.api == "fully_shard":
        return gradient_sync_off
    return lambda module: module.no_sync()


def _state_dict_reload(
    spec: ScenarioSpec, device: torch.device, seed: int, mesh: _Mesh, impl: Implementation
):
    """Save ``model``'s state dict, load it into a fresh sharded model, return that one."""
    full = spec.feature == "sd-full"

    def reload(model: nn.Module) -> nn.Module:
        fresh = _new_model(spec, device, seed + 1)  # other weights: loading must matter
        _freeze(spec, fresh)
        fresh, _ = _shard(spec, fresh, mesh, impl, device)
        if spec.api == "wrapper":
            FullyShardedDataParallel = impl.module.FullyShardedDataParallel
            StateDictType = impl.module.StateDictType
            kind = StateDictType.FULL_STATE_DICT if full else StateDictType.SHARDED_STATE_DICT
            with FullyShardedDataParallel.state_dict_type(model, kind):
                state = model.state_dict()
            with FullyShardedDataParallel.state_dict_type(fresh, kind):
                fresh.load_state_dict(state)
            return fresh
        if not full:
            fresh.load_state_dict(model.state_dict())
            return fresh
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            set_model_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(fresh, get_model_state_dict(model, options=options), options=options)
        return fresh

    return reload


def build_scenario(
    spec: ScenarioSpec,
    device: torch.device,
    impl: Implementation,
    *,
    seed: int = 0,
    nodes: int = 1,
) -> BuiltScenario:
    """Build ``spec`` on this rank, sharded by ``impl``; every rank of the default group
    calls it together. ``nodes``: those of a launched world, across which HSDP replicates.
    Raises :class:`Unsupported` when ``impl`` refuses to shard or configure the model."""
    mesh = _make_mesh(spec.mesh, device.type, spec.api, nodes)
    model = _new_model(spec, device, seed)
    _freeze(spec, model)
    ref_model = copy.deepcopy(model)
    model, units = _shard(spec, model, mesh, impl, device)
    check_kwargs: dict[str, Any] = {"optimizer_factory": LocalSGD}
    if spec.custom is not None:
        unsharded = unsharded_blocks_message(model, spec.custom.block_types, impl=impl)
        if unsharded:
            raise AssertionError(f"{spec.name}: {unsharded}")
        check_kwargs.update(spec.custom.check_kwargs())
    microbatches = 1
    # NaiveFSDP reduces every backward (see [Note: the matrix]): no no_sync for either side
    skips_sync = spec.feature == "accum" and spec.api != "naive"
    if spec.feature == "accum":
        microbatches = 2
        check_kwargs["num_microbatches"] = 2
    if skips_sync:
        check_kwargs["no_sync"] = _no_sync(spec)
    if spec.feature == "bf16":
        ref_model = LowPrecisionCompute(ref_model, BF16)
        model = Passthrough(model)
    if spec.feature == "fp8-gather":
        ref_model = Float8GatherReference(ref_model, float8_weight_names(ref_model))
        model = Passthrough(model)
    if spec.mesh in TP_MESHES:
        check_kwargs.update(TP_TOLERANCES[spec.feature == "bf16"])
    reload = None
    if spec.feature in ("sd-full", "sd-sharded"):
        reload = _state_dict_reload(spec, device, seed, mesh, impl)
    shape = StepShape(
        shard_size=mesh.shard_size,
        replicate_size=mesh.replicate_size,
        num_microbatches=microbatches,
        sync_every_microbatch=not skips_sync,
        # on one rank the wrapper runs FULL_SHARD as NO_SHARD, as torch's does
        no_shard=spec.api == "wrapper" and mesh.shard_size == 1 and mesh.replicate_size == 1,
    )
    return BuiltScenario(
        ref_model=ref_model,
        model=model,
        make_inputs=_inputs(spec, device),
        units=units,
        shape=shape,
        check_kwargs=check_kwargs,
        reload=reload,
    )


class LocalSGD(torch.optim.Optimizer):
    """The suite's optimizer: plain SGD, ``param -= lr * grad``, applied to each DTensor's
    local shard.

    Its update scales with the gradient, so a wrong gradient shows in the parameters, and
    the small default rate keeps ReLUs from dying within a few steps. Elementwise math on
    two DTensors of one placement is the same on the local shards; doing it there skips
    DTensor's sharding propagation, which on a 3-D mesh costs a fifth of a second for every
    parameter shape on every rank and would dominate the suite's run time.
    """

    def __init__(self, params: Any, lr: float = 1e-3) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        assert closure is None, "LocalSGD takes no closure"
        for group in self.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if isinstance(param, DTensor) and isinstance(grad, DTensor):
                    if grad.placements == param.placements:
                        param.to_local().add_(grad.to_local(), alpha=-group["lr"])
                        continue
                param.add_(grad, alpha=-group["lr"])


def select(
    specs: Sequence[ScenarioSpec],
    *,
    api: Sequence[str] = (),
    mesh: Sequence[str] = (),
    only: Sequence[str] = (),
    exclude: Sequence[str] = (),
) -> list[ScenarioSpec]:
    """``specs`` filtered: ``api``/``mesh`` (empty: all), then ``only``/``exclude``, fnmatch
    globs on the name (a glob without wildcards matches as a substring)."""
    import fnmatch

    def matches(name: str, pattern: str) -> bool:
        if not any(ch in pattern for ch in "*?["):
            return pattern in name
        return fnmatch.fnmatchcase(name, pattern)

    for value, allowed in ((api, SUITE_APIS), (mesh, MESHES)):
        unknown = sorted(set(value) - set(allowed))
        if unknown:
            raise ValueError(f"unknown choice(s) {unknown}; pick from {list(allowed)}")
    chosen = []
    for spec in specs:
        if api and spec.api not in api:
            continue
        if mesh and spec.mesh not in mesh:
            continue
        if only and not any(matches(spec.name, p) for p in only):
            continue
        if any(matches(spec.name, p) for p in exclude):
            continue
        chosen.append(spec)
    return chosen
