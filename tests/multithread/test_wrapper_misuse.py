"""``FullyShardedDataParallel`` misuse: errors that name the problem, raised on every rank.

Where torch's wrapper raises too, the test checks that it raises the same exception type
(torch's wrapper runs here with ``device_id=cpu``). Where torch accepts the misuse or fails
with an unrelated error (an ``AttributeError`` deep inside, a hang), reffsdp raises a
clear ``TypeError`` / ``ValueError`` instead; the comments say which.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
from torch.distributed.fsdp import ShardingStrategy as TorchShardingStrategy
from torch.distributed.optim import _apply_optimizer_in_backward

from reffsdp import (
    BackwardPrefetch,
    CPUOffload,
    FullyShardedDataParallel,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from reffsdp.core.comms import Collective
from reffsdp.testing.comm_counter import CommCounter
from reffsdp.testing.multithread import FSDPTestMultiThread
from reffsdp.wrap import ModuleWrapPolicy

pytestmark = pytest.mark.multithread

_TORCH_CPU = {"device_id": torch.device("cpu")}  # torch's wrapper needs it on a CPU machine
HYBRID_SHARD = ShardingStrategy.HYBRID_SHARD


def _nested(wrapper_cls=FullyShardedDataParallel, **kwargs) -> nn.Module:
    inner = wrapper_cls(nn.Linear(4, 4), **kwargs)
    return wrapper_cls(nn.Sequential(inner, nn.Linear(4, 4)), **kwargs)


class TestWrapperMisuse(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_wrapping_an_instance_again(self):
        instance = FullyShardedDataParallel(nn.Linear(4, 4))
        # torch accepts this and builds an outer instance with nothing to shard.
        with pytest.raises(ValueError, match="already a FullyShardedDataParallel"):
            FullyShardedDataParallel(instance)
        # A parent of instances is how nesting is done by hand: fine without a policy...
        FullyShardedDataParallel(nn.Sequential(instance, nn.Linear(4, 4)))
        # ...but auto wrapping refuses a tree that holds instances already, as torch does,
        # in its words.
        for wrapper_cls, extra in ((FullyShardedDataParallel, {}), (TorchFSDP, _TORCH_CPU)):
            for nested, path in ((False, "0"), (True, "0.1")):
                inner = wrapper_cls(nn.Linear(4, 4), **extra)
                child = nn.Sequential(nn.Linear(4, 4), inner) if nested else inner
                parent = nn.Sequential(child, nn.Linear(4, 4))
                with pytest.raises(
                    ValueError,
                    match="FSDP auto wrapping requires modules to not already have FSDP "
                    f"applied but found {path} in",
                ):
                    wrapper_cls(parent, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), **extra)

    def test_no_sync_on_a_non_root(self):
        for wrapper_cls, extra in ((FullyShardedDataParallel, {}), (TorchFSDP, _TORCH_CPU)):
            model = _nested(wrapper_cls, **extra)
            model(torch.ones(2, 4))
            inner = model.module[0]
            with pytest.raises(RuntimeError, match="root"):
                with inner.no_sync():
                    pass

    def test_hybrid_needs_a_2d_mesh_or_a_group_pair(self):
        world = dist.group.WORLD
        cases = [
            ({"device_mesh": init_device_mesh("cpu", (2,))}, "2-D device_mesh"),
            ({"process_group": world}, r"\(shard_group, replicate_group\)"),
            ({"process_group": (world, world, world)}, r"\(shard_group, replicate_group\)"),
        ]
        for kwargs, message in cases:
            with self.subTest(kwargs=kwargs):
                with pytest.raises(ValueError, match=message):
                    FullyShardedDataParallel(
                        nn.Linear(4, 4), sharding_strategy=HYBRID_SHARD, **kwargs
                    )
                with pytest.raises(ValueError):
                    TorchFSDP(
                        nn.Linear(4, 4),
                        sharding_strategy=TorchShardingStrategy.HYBRID_SHARD,
                        **kwargs,
                        **_TORCH_CPU,
                    )
        # One group where a hybrid strategy needs two: torch's test passes a policy too.
        for wrapper_cls, strategies, extra in (
            (FullyShardedDataParallel, ShardingStrategy, {}),
            (TorchFSDP, TorchShardingStrategy, _TORCH_CPU),
        ):
            with pytest.raises(ValueError, match="Expected process_group to be passed in"):
                wrapper_cls(
                    nn.Sequential(nn.Linear(4, 4)),
                    process_group=world,
                    sharding_strategy=strategies.HYBRID_SHARD,
                    auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                    **extra,
                )
        # Wrapped by hand, each instance would build its own groups.
        for wrapper_cls, strategies, extra in (
            (FullyShardedDataParallel, ShardingStrategy, {}),
            (TorchFSDP, TorchShardingStrategy, _TORCH_CPU),
        ):
            for strategy in (strategies.HYBRID_SHARD, strategies._HYBRID_SHARD_ZERO2):
                with pytest.raises(
                    ValueError, match="requires explicit specification of process group"
                ):
                    wrapper_cls(nn.Linear(4, 4), sharding_strategy=strategy, **extra)
        # torch accepts these two pairs silently; neither tiles two ranks.
        with pytest.raises(ValueError, match="must cover the world"):
            FullyShardedDataParallel(
                nn.Linear(4, 4), sharding_strategy=HYBRID_SHARD, process_group=(world, world)
            )
        with pytest.raises(TypeError, match="process_group must be a ProcessGroup"):
            FullyShardedDataParallel(
                nn.Linear(4, 4), sharding_strategy=HYBRID_SHARD, process_group=(world, "all")
            )

    def test_sync_module_states_with_different_shapes(self):
        """A clear error on every rank before any broadcast (not a hang, not a wrong copy)."""
        for module in (nn.Linear(4, 4 + self.rank), nn.Linear(4, 4).to(self._dtype_of_rank())):
            with CommCounter() as counter:
                with pytest.raises(ValueError, match=r"sync_module_states=True needs the same"):
                    FullyShardedDataParallel(module, sync_module_states=True)
            self.assertEqual(counter.get_comm_counts()[Collective.BROADCAST], 0)
        FullyShardedDataParallel(nn.Linear(4, 4), sync_module_states=True)  # same: fine

    def _dtype_of_rank(self) -> torch.dtype:
        return torch.float32 if self.rank == 0 else torch.float64

    def test_argument_types(self):
        """torch fails on most of these with an AttributeError far from the cause (or takes
        them silently); reffsdp names the argument."""
        cases = [
            ({"sharding_strategy": "FULL_SHARD"}, "sharding_strategy must be a reffsdp"),
            ({"sharding_strategy": TorchShardingStrategy.FULL_SHARD}, "reffsdp.ShardingStrategy"),
            ({"cpu_offload": True}, "cpu_offload must be a reffsdp.CPUOffload"),
            ({"mixed_precision": {"param_dtype": torch.float16}}, "mixed_precision must be"),
            ({"backward_prefetch": "BACKWARD_PRE"}, "backward_prefetch must be"),
            # torch fails deep inside: "argument 'dtype' must be torch.dtype, not str" or
            # "Invalid device string", depending on the field.
            (
                {"mixed_precision": MixedPrecision(param_dtype="bfloat16")},
                "param_dtype must be torch.dtype .* got str 'bfloat16'",
            ),
            ({"mixed_precision": MixedPrecision(reduce_dtype=16)}, "reduce_dtype must be"),
            ({"mixed_precision": MixedPrecision(buffer_dtype="fp32")}, "buffer_dtype must be"),
            ({"process_group": 3}, "process_group must be a ProcessGroup"),
            ({"device_mesh": "cpu"}, "device_mesh must be a torch.distributed"),
        ]
        for kwargs, message in cases:
            with self.subTest(kwargs=kwargs):
                with pytest.raises(TypeError, match=message):
                    FullyShardedDataParallel(nn.Linear(4, 4), **kwargs)
        with pytest.raises(TypeError, match="module must be an nn.Module, got torch.Tensor"):
            FullyShardedDataParallel(torch.ones(4))
        # The right types still pass.
        FullyShardedDataParallel(
            nn.Linear(4, 4),
            sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
            cpu_offload=CPUOffload(),
            mixed_precision=MixedPrecision(),
            backward_prefetch=BackwardPrefetch.BACKWARD_POST,
        )


class TestWrapperHybridGroups(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 4

    def test_group_pair_must_tile_the_world(self):
        # Every rank creates every group, in the same order.
        rows = {ranks: dist.new_group(list(ranks)) for ranks in [(0, 1), (2, 3)]}
        columns = {ranks: dist.new_group(list(ranks)) for ranks in [(0, 2), (1, 3)]}
        shard = next(g for ranks, g in rows.items() if self.rank in ranks)
        replicate = next(g for ranks, g in columns.items() if self.rank in ranks)
        model = FullyShardedDataParallel(
            nn.Linear(4, 4), sharding_strategy=HYBRID_SHARD, process_group=(shard, replicate)
        )
        self.assertEqual(model.world_size, 2)
        # Sizes multiply to the world, but the "replicas" are the shard group itself.
        with pytest.raises(ValueError, match="must tile the world"):
            FullyShardedDataParallel(
                nn.Linear(4, 4), sharding_strategy=HYBRID_SHARD, process_group=(shard, shard)
            )


class TestWrapperIgnoredArguments(FSDPTestMultiThread):
    """``ignored_modules`` / ``ignored_states`` are checked as torch's wrapper checks them,
    with torch's wording (its tests match it) and what to do instead."""

    @property
    def world_size(self) -> int:
        return 2

    def _model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))

    def test_wrong_kinds_of_ignored_things(self):
        for wrapper_cls, extra in ((FullyShardedDataParallel, {}), (TorchFSDP, _TORCH_CPU)):
            model = self._model()
            params = list(model[1].parameters())
            modules = list(model[1].children())
            cases = [
                ({"ignored_modules": params}, r"ignored_modules expects nn.Module list elements"),
                (
                    {"ignored_modules": modules, "ignored_states": params},
                    "Cannot pass both ignored_modules and ignored_states at the same time",
                ),
                (
                    {"ignored_states": [modules[0], *params]},
                    r"ignored_states expects all nn.Parameter or all nn.Module list elements "
                    r"but got types \[<class 'torch.nn.modules.linear.Linear'>, "
                    r"<class 'torch.nn.parameter.Parameter'>\]",
                ),
            ]
            for kwargs, message in cases:
                with self.subTest(wrapper=wrapper_cls.__name__, kwargs=list(kwargs)):
                    with pytest.raises(ValueError, match=message):
                        wrapper_cls(model, **kwargs, **extra)
        with pytest.raises(TypeError, match="ignored_modules must be an iterable"):
            FullyShardedDataParallel(self._model(), ignored_modules=3)


class TestWrapperWarningsOnOneRank(FSDPTestMultiThread):
    """Warnings, checked on one rank: ranks in threads share the process's warning filters,
    so two ranks catching warnings at once can each undo the other's filter. With
    ``pytest.warns``: unittest's ``assertWarns`` reads every imported module's
    ``__warningregistry__``, which makes a lazily loading package (transformers, imported by
    the integration tests) import submodules whose dependencies are not installed."""

    @property
    def world_size(self) -> int:
        return 1

    def test_ignoring_the_root_module_warns(self):
        for wrapper_cls, extra in ((FullyShardedDataParallel, {}), (TorchFSDP, _TORCH_CPU)):
            model = nn.Sequential(nn.Linear(4, 4))
            with pytest.warns(
                UserWarning,
                match="Trying to ignore the top-level module passed into the FSDP constructor "
                "itself will result in all parameters being ignored",
            ):
                wrapper_cls(model, ignored_modules=[model], **extra)


class TestWrapperArgumentValues(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_param_init_fn_must_be_callable(self):
        for wrapper_cls, extra in ((FullyShardedDataParallel, {}), (TorchFSDP, _TORCH_CPU)):
            with pytest.raises(ValueError, match="to be callable"):
                wrapper_cls(nn.Linear(4, 4, device="meta"), param_init_fn=42, **extra)
        # torch takes it silently when nothing is on the meta device; it is wrong anyway.
        with pytest.raises(ValueError, match="Expected param_init_fn to be callable but got int"):
            FullyShardedDataParallel(nn.Linear(4, 4), param_init_fn=42)

    def test_optimizer_in_backward_needs_use_orig_params(self):
        for wrapper_cls, extra in ((FullyShardedDataParallel, {}), (TorchFSDP, _TORCH_CPU)):
            model = wrapper_cls(
                nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)),
                auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                **extra,
            )
            _apply_optimizer_in_backward(
                torch.optim.SGD, model.parameters(), {"lr": 0.1}, register_hook=False
            )
            with pytest.raises(RuntimeError, match="only supported with use_orig_params=True"):
                model(torch.ones(2, 4))
        # torch steps these optimizers in its post-backward; ours would never step them.
        model = FullyShardedDataParallel(nn.Linear(4, 4), use_orig_params=True)
        _apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.1})
        with pytest.raises(NotImplementedError, match="optimizer that steps in backward"):
            model(torch.ones(2, 4))

    def test_an_auto_wrap_policy_must_be_one(self):
        # torch calls whatever it is given: "'str' object is not callable", deep inside.
        for wrapper_cls, extra in ((FullyShardedDataParallel, {}), (TorchFSDP, _TORCH_CPU)):
            with pytest.raises(TypeError):
                wrapper_cls(nn.Sequential(nn.Linear(4, 4)), auto_wrap_policy="size", **extra)
        with pytest.raises(
            TypeError, match=r"auto_wrap_policy must be a policy object .* got str 'size'"
        ):
            FullyShardedDataParallel(nn.Sequential(nn.Linear(4, 4)), auto_wrap_policy="size")

    def test_mixed_precision_dtypes_must_be_floating_point(self):
        """torch's wrapper takes integer dtypes and fails in the first forward (param_dtype:
        "only floating point tensors can require gradients") or backward (reduce_dtype:
        casting into it) with a RuntimeError; reffsdp refuses them when built, naming the
        field, with an error that is a ValueError and a RuntimeError."""
        for name in ("param_dtype", "reduce_dtype"):
            with self.subTest(name=name):
                theirs = TorchFSDP(
                    nn.Linear(4, 4),
                    mixed_precision=TorchMixedPrecision(**{name: torch.int64}),
                    **_TORCH_CPU,
                )
                with pytest.raises(RuntimeError):
                    theirs(torch.ones(2, 4)).sum().backward()
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            for error in (ValueError, RuntimeError):
                with pytest.raises(
                    error,
                    match=f"MixedPrecision's {name} must be a floating-point dtype .* got "
                    "torch.int64",
                ):
                    FullyShardedDataParallel(
                        nn.Linear(4, 4), mixed_precision=MixedPrecision(**{name: torch.int64})
                    )

    def test_on_off_arguments_take_true_or_false(self):
        # torch's wrapper takes any value and reads it as true or false: "yes" and -1 are on.
        TorchFSDP(nn.Linear(4, 4), limit_all_gathers="yes", **_TORCH_CPU)
        TorchFSDP(nn.Linear(4, 4), limit_all_gathers=-1, **_TORCH_CPU)
        for name in ("sync_module_states", "forward_prefetch", "limit_all_gathers"):
            with pytest.raises(TypeError, match=f"{name} must be True or False, got str 'yes'"):
                FullyShardedDataParallel(nn.Linear(4, 4), **{name: "yes"})
            with pytest.raises(ValueError, match=f"{name} is on or off, True or False; got -1"):
                FullyShardedDataParallel(nn.Linear(4, 4), **{name: -1})
        with pytest.raises(TypeError, match="use_orig_params must be True or False, got NoneType"):
            FullyShardedDataParallel(nn.Linear(4, 4), use_orig_params=None)
        with pytest.raises(TypeError, match="MixedPrecision's cast_forward_inputs must be True"):
            FullyShardedDataParallel(
                nn.Linear(4, 4), mixed_precision=MixedPrecision(cast_forward_inputs="no")
            )
        model = FullyShardedDataParallel(nn.Linear(4, 4), limit_all_gathers=0)  # 0 / 1 pass
        self.assertFalse(model.limit_all_gathers)

    def test_device_id_names_a_device(self):
        for device_id, error, message in [
            (-1, ValueError, "device_id must be a device index"),
            ("gpu:0", ValueError, "device_id 'gpu:0' names no device"),
            (1.5, TypeError, "device_id must be an int"),
            (True, TypeError, "device_id must be an int"),
        ]:
            with self.subTest(device_id=device_id):
                with pytest.raises(error, match=message):
                    FullyShardedDataParallel(nn.Linear(4, 4), device_id=device_id)


class TestWrapperMisuseAtRuntime(FSDPTestMultiThread):
    """Calls on a built model that torch's wrapper fails on deep inside; reffsdp says what
    was done wrong and what to do, with an error of a type that torch's is too."""

    @property
    def world_size(self) -> int:
        return 2

    def test_state_dict_type_must_be_the_enum(self):
        theirs = TorchFSDP(nn.Linear(4, 4), **_TORCH_CPU)
        with pytest.raises(KeyError):
            TorchFSDP.set_state_dict_type(theirs, "SHARDED_STATE_DICT")
        model = FullyShardedDataParallel(nn.Linear(4, 4))
        for error in (TypeError, KeyError):
            with pytest.raises(
                error,
                match=r"state_dict_type must be a reffsdp.StateDictType, got str "
                r"'SHARDED_STATE_DICT'; pass the member, such as "
                r"StateDictType.SHARDED_STATE_DICT",
            ):
                FullyShardedDataParallel.set_state_dict_type(model, "SHARDED_STATE_DICT")
        with pytest.raises(TypeError, match="such as StateDictType.LOCAL_STATE_DICT"):
            with FullyShardedDataParallel.state_dict_type(model, "LOCAL_STATE_DICT"):
                pass
        self.assertIs(
            FullyShardedDataParallel.get_state_dict_type(model).state_dict_type,
            StateDictType.FULL_STATE_DICT,  # unchanged
        )

    def test_optimizer_state_calls_take_the_model_first(self):
        theirs = TorchFSDP(nn.Linear(4, 4), **_TORCH_CPU)
        their_optim = torch.optim.Adam(theirs.parameters())
        with pytest.raises(AttributeError):
            TorchFSDP.optim_state_dict(their_optim, theirs)
        model = FullyShardedDataParallel(nn.Linear(4, 4))
        optim = torch.optim.Adam(model.parameters())
        calls = [
            ("optim_state_dict", lambda: FullyShardedDataParallel.optim_state_dict(optim, model)),
            (
                "optim_state_dict_to_load",
                lambda: FullyShardedDataParallel.optim_state_dict_to_load(optim, model, {}),
            ),
        ]
        for name, call in calls:
            for error in (TypeError, AttributeError):
                with pytest.raises(
                    error,
                    match=rf"{name}\(model, optim, ...\) takes the model first and the "
                    "optimizer second, got a Adam and then a FullyShardedDataParallel",
                ):
                    call()
        with pytest.raises(TypeError, match="optim must be the model's torch.optim.Optimizer"):
            FullyShardedDataParallel.optim_state_dict(model, model.parameters())
        FullyShardedDataParallel.optim_state_dict(model, optim)  # the right order works

    def test_forward_inside_summon_full_params(self):
        theirs = TorchFSDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), **_TORCH_CPU)
        with contextlib.suppress(AssertionError):  # torch's summon then fails on exit too
            with TorchFSDP.summon_full_params(theirs):
                with pytest.raises(RuntimeError):  # "setStorage: sizes [40] ..."
                    theirs(torch.ones(2, 4))
        model = FullyShardedDataParallel(
            nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)),
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        )
        model(torch.ones(2, 4)).sum().backward()
        # The whole tree summoned, or only a nested instance: the root refuses either way.
        for summoned in (model, model.module[1]):
            with FullyShardedDataParallel.summon_full_params(summoned):
                with pytest.raises(
                    RuntimeError,
                    match=r"cannot run forward inside summon_full_params .* leave the context "
                    "first",
                ):
                    model(torch.ones(2, 4))
        model(torch.ones(2, 4)).sum().backward()  # and after it, training goes on
