"""``FullyShardedDataParallel`` state dicts, optimizer state dicts and their settings.

Every state-dict type must round-trip: save, load into a model with other weights, and the
two models then train to the same losses, bit for bit. Names and tensor types are checked
against torch's wrapper on the same model and group; values against an unsharded reference.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import LocalStateDictConfig as TorchLocalConfig
from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
from torch.distributed.fsdp import ShardingStrategy as TorchShardingStrategy
from torch.distributed.fsdp import StateDictType as TorchStateDictType
from torch.distributed.fsdp._debug_utils import SimpleProfiler
from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchModuleWrapPolicy
from torch.distributed.optim import _NamedOptimizer
from torch.distributed.tensor import DTensor, Shard

from reffsdp import FullyShardedDataParallel as FSDP
from reffsdp.api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictSettings,
    StateDictType,
)
from reffsdp.testing.build import reference_and_model
from reffsdp.testing.inputs import random_inputs
from reffsdp.testing.models import MLP, MLPBlocks
from reffsdp.testing.multithread import FSDPTestMultiThread, run_threaded
from reffsdp.testing.parity import (
    check_state_dict_parity,
    local_data_parallel_step,
    sum_loss,
    train_step,
)
from reffsdp.wrap import ModuleWrapPolicy
from reffsdp.wrapper.state import state_of

# set_state_dict_type warns that torch deprecates it, as torch's does
pytestmark = [pytest.mark.multithread, pytest.mark.filterwarnings("ignore::FutureWarning")]

DIM = 8
FULL, LOCAL, SHARDED = (
    StateDictType.FULL_STATE_DICT,
    StateDictType.LOCAL_STATE_DICT,
    StateDictType.SHARDED_STATE_DICT,
)
NO_SHARD = ShardingStrategy.NO_SHARD
FULL_SHARD, SHARD_GRAD_OP = ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP
HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
BUFFERS = ("layers.0.buffer", "layers.1.buffer")
make_inputs = random_inputs(2, DIM)


def _blocks() -> MLPBlocks:
    return MLPBlocks(DIM, (3, 4), with_buffer=True)  # the root owns proj, one instance a block


def wrap(model: MLPBlocks, **kwargs) -> FSDP:
    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({MLP}), **kwargs)


def torch_wrap(base: MLPBlocks, **kwargs) -> TorchFSDP:
    """torch's wrapper over a copy of ``base``, wrapped as :func:`wrap` wraps ours."""
    return TorchFSDP(
        copy.deepcopy(base),
        auto_wrap_policy=TorchModuleWrapPolicy({MLP}),
        device_id=torch.device("cpu"),
        **kwargs,
    )


def trained_next_to_torch(base: MLPBlocks, rank: int, use_orig_params: bool):
    """(torch's wrapper, its optimizer, ours, its optimizer) over copies of ``base``, after
    one step on the same inputs."""
    torch_model = torch_wrap(base, use_orig_params=use_orig_params)
    model = wrap(copy.deepcopy(base), use_orig_params=use_orig_params)
    torch_optim, optim = adam(torch_model.parameters()), adam(model.parameters())
    train_step(torch_model, torch_optim, make_inputs(0, rank))
    train_step(model, optim, make_inputs(0, rank))
    return torch_model, torch_optim, model, optim


def adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


def trained(use_orig_params: bool, world_size: int, steps: int = 1, **kwargs):
    """(reference, its optimizer, wrapped model, its optimizer) after ``steps`` steps."""
    ref, model = reference_and_model(_blocks())
    model = wrap(model, use_orig_params=use_orig_params, **kwargs)
    ref_optim, optim = adam(ref.parameters()), adam(model.parameters())
    for step in range(steps):
        local_data_parallel_step(ref, ref_optim, make_inputs, step, world_size)
        train_step(model, optim, make_inputs(step, dist.get_rank()))
    return ref, ref_optim, model, optim


def save(model, optim, kind, *configs) -> tuple[dict, dict]:
    with FSDP.state_dict_type(model, kind, *configs):
        return model.state_dict(), FSDP.optim_state_dict(model, optim)


def load(model, optim, states: tuple[dict, dict], kind, *configs) -> None:
    with FSDP.state_dict_type(model, kind, *configs):
        model.load_state_dict(states[0])
        FSDP.optim_state_dict_to_load(model, optim, states[1], load_directly=True)


def full_values(model) -> dict[str, torch.Tensor]:
    with FSDP.state_dict_type(model, FULL):
        return model.state_dict()


def _local_tensors(value) -> list[torch.Tensor]:
    if isinstance(value, ShardedTensor):
        return [shard.tensor for shard in value.local_shards()]
    if isinstance(value, DTensor):
        return [value.to_local()]
    return [value]


class NextToTorchsWrapper(FSDPTestMultiThread):
    """Two threaded ranks on which torch's wrapper can run as the reference."""

    @property
    def world_size(self) -> int:
        return 2

    def setUp(self) -> None:
        super().setUp()
        # torch's optimizer state dict times itself in a class-wide profiler that threads
        # sharing one process corrupt; the reference runs without it.
        patch = mock.patch.object(
            SimpleProfiler, "profile", classmethod(lambda cls, _: contextlib.nullcontext())
        )
        patch.start()
        self.addCleanup(patch.stop)


class TestWrapperStateDict(NextToTorchsWrapper):
    def _check_round_trip(self, kind: StateDictType, *configs, **kwargs) -> None:
        for use_orig_params in (False, True):
            _, _, model, optim = trained(use_orig_params, self.world_size, **kwargs)
            states = save(model, optim, kind, *configs)
            other = wrap(_blocks(), use_orig_params=use_orig_params, **kwargs)  # other weights
            other_optim = adam(other.parameters())
            load(other, other_optim, states, kind, *configs)
            for step in (1, 2):
                inputs = make_inputs(step, self.rank)
                loss = train_step(model, optim, inputs)
                self.assertEqual(train_step(other, other_optim, inputs), loss, use_orig_params)
            for name, value in full_values(model).items():
                self.assertTrue(torch.equal(full_values(other)[name], value), name)

    def test_round_trip_full(self):
        self._check_round_trip(FULL)

    def test_round_trip_sharded(self):
        self._check_round_trip(SHARDED)
        dtensors = (ShardedStateDictConfig(_use_dtensor=True), ShardedOptimStateDictConfig())
        self._check_round_trip(SHARDED, *dtensors)

    def test_round_trip_local(self):
        self._check_round_trip(LOCAL)

    def test_sharded_values_are_chunked_on_dim_0(self):
        ref, _, model, optim = trained(False, self.world_size)
        configs = (ShardedStateDictConfig(_use_dtensor=True), ShardedOptimStateDictConfig())
        model_state, optim_state = save(model, optim, SHARDED, *configs)
        for name, value in model_state.items():
            if name.endswith("buffer"):
                continue
            self.assertIsInstance(value, DTensor, name)
            self.assertEqual(value.placements, (Shard(0),), name)
        with FSDP.state_dict_type(model, SHARDED, *configs):
            check_state_dict_parity(self, ref, model)  # gathers the DTensors
        exp_avg = optim_state["state"]["layers.0.in_proj.weight"]["exp_avg"]
        self.assertIsInstance(exp_avg, ShardedTensor)  # the optimizer config's own choice
        self.assertEqual(exp_avg.local_shards()[0].tensor.shape, (12, DIM))  # 24 rows / 2

    def test_full_state_dict_configs(self):
        mixed = MixedPrecision(param_dtype=torch.bfloat16, cast_forward_inputs=True)
        ref, _, model, _ = trained(True, self.world_size, steps=0, mixed_precision=mixed)
        with torch.no_grad():
            model(make_inputs(0, self.rank))  # the root stays gathered, in bf16
        config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, FULL, config):
            state = model.state_dict()
        if self.rank != 0:
            self.assertEqual(state, {})
            return
        self.assertEqual(list(state), list(ref.state_dict()))
        for name, value in state.items():  # full precision, whole, on CPU
            self.assertEqual(value.device, torch.device("cpu"))
            torch.testing.assert_close(value, ref.state_dict()[name], msg=name)
        param = model.module.proj.weight  # a 1-D shard view (use_orig_params=True)
        self.assertNotEqual(state["proj.weight"].data_ptr(), param.data_ptr())

    def test_full_optim_state_matches_reference(self):
        for use_orig_params in (False, True):
            ref, ref_optim, model, optim = trained(use_orig_params, self.world_size, steps=2)
            _, optim_state = save(model, optim, FULL, None, FullOptimStateDictConfig())
            names = [name for name, _ in ref.named_parameters()]
            self.assertEqual(sorted(optim_state["state"]), sorted(names))  # order: as torch's
            self.assertEqual(optim_state["param_groups"][0]["params"], names)
            for index, name in enumerate(names):
                ref_state = ref_optim.state_dict()["state"][index]
                for key in ("exp_avg", "exp_avg_sq"):
                    torch.testing.assert_close(
                        optim_state["state"][name][key], ref_state[key], msg=f"{name} {key}"
                    )
                self.assertEqual(float(optim_state["state"][name]["step"]), 2.0)
            config = FullOptimStateDictConfig(rank0_only=True)
            _, rank0_state = save(model, optim, FULL, None, config)
            self.assertEqual(rank0_state == {}, self.rank != 0)

    def test_orig_params_step_comes_from_ranks_holding_a_piece(self):
        """With ``use_orig_params=True`` a rank may hold an empty piece of a parameter, and a
        named optimizer keeps its own state for it when loading (as torch's does): a saved
        ``step`` must come from the ranks holding a piece, as torch's wrapper takes it, not
        from that stale state."""
        results = {}
        for which, wrapper, kwargs in (
            ("torch", TorchFSDP, {"device_id": torch.device("cpu")}),
            ("ours", FSDP, {}),
        ):
            torch.manual_seed(0)
            model = wrapper(MLP(DIM), use_orig_params=True, **kwargs)
            optim = _NamedOptimizer(model.named_parameters(), torch.optim.Adam, lr=1e-2)
            for param in model.parameters():  # state for every parameter, pieces empty or not
                param.grad = torch.zeros_like(param)
            for step in range(5):
                if step == 2:
                    saved = wrapper.optim_state_dict(model, optim)
                optim.step()
                model(make_inputs(step, self.rank)).sum().backward()
            optim.load_state_dict(
                wrapper.optim_state_dict_to_load(model, optim, saved, is_named_optimizer=True)
            )
            results[which] = {
                name: float(values["step"])
                for name, values in wrapper.optim_state_dict(model, optim)["state"].items()
            }
        self.assertEqual(set(results["ours"].values()), {2.0})  # as saved
        self.assertEqual(results["ours"], results["torch"])

    def test_loading_inconsistent_flat_parameter_state_raises_like_torch(self):
        """The originals flattened into one flat parameter must name the same states and
        share one ``step``: a state dict that breaks either raises torch's ``ValueError``,
        whose wording torch's tests (and users' code) match, on both wrappers."""
        cases = {
            "no state for one original": (
                lambda state: state.pop("1.bias"),
                "^All unflattened parameters comprising a single flat parameter must have "
                "scalar state with the same value and dtype",
            ),
            "one original lacks a state name": (
                lambda state: state["1.bias"].pop("exp_avg"),
                "^Differing optimizer state names for the unflattened parameters",
            ),
        }
        for wrapper, kwargs in ((TorchFSDP, {"device_id": torch.device("cpu")}), (FSDP, {})):
            torch.manual_seed(0)
            model = wrapper(torch.nn.Sequential(MLP(DIM), torch.nn.Linear(DIM, DIM)), **kwargs)
            optim = torch.optim.Adam(model.parameters(), lr=1e-2)
            model(make_inputs(0, self.rank)).sum().backward()
            optim.step()
            for case, (edit, message) in cases.items():
                saved = wrapper.optim_state_dict(model, optim)
                edit(saved["state"])
                with self.assertRaisesRegex(ValueError, message, msg=f"{wrapper}: {case}"):
                    wrapper.optim_state_dict_to_load(model, optim, saved)

    def test_names_and_types_match_torch(self):
        for use_orig_params in (False, True):
            base = _blocks()
            self.sync_module_states(base)
            torch_model, torch_optim, model, optim = trained_next_to_torch(
                base, self.rank, use_orig_params
            )
            for kind, torch_kind in zip(StateDictType, TorchStateDictType):
                with TorchFSDP.state_dict_type(torch_model, torch_kind):
                    expected = torch_model.state_dict()
                    expected_optim = TorchFSDP.optim_state_dict(torch_model, torch_optim)
                state, optim_state = save(model, optim, kind)
                where = f"{kind}, use_orig_params={use_orig_params}"
                self.assertEqual(list(state), list(expected), where)
                for name, value in state.items():
                    self.assertIs(type(value), type(expected[name]), f"{where}: {name}")
                    for mine, theirs in zip(_local_tensors(value), _local_tensors(expected[name])):
                        torch.testing.assert_close(mine, theirs, msg=f"{where}: {name}")
                self.assertEqual(list(optim_state["state"]), list(expected_optim["state"]), where)
                self.assertEqual(optim_state["param_groups"], expected_optim["param_groups"])
                for name, values in optim_state["state"].items():
                    self.assertEqual(list(values), list(expected_optim["state"][name]), where)
                    for key, value in values.items():
                        theirs = expected_optim["state"][name][key]
                        self.assertIs(type(value), type(theirs), f"{where}: {name} {key}")

    def test_tied_weights_are_saved_under_both_names_like_torch(self):
        """A weight tied into one flat parameter is a value of its own under each name (it
        was a view of the freed gathered buffer under its second name)."""
        from tests.multithread.test_wrapper_training import TiedStack

        for use_orig_params in (False, True):
            base = TiedStack()
            self.sync_module_states(base)
            ours = wrap(copy.deepcopy(base), use_orig_params=use_orig_params)
            theirs = torch_wrap(base, use_orig_params=use_orig_params)
            for kind, torch_kind in (
                (FULL, TorchStateDictType.FULL_STATE_DICT),
                (SHARDED, TorchStateDictType.SHARDED_STATE_DICT),
            ):
                where = f"{kind}, use_orig_params={use_orig_params}"
                with TorchFSDP.state_dict_type(theirs, torch_kind):
                    expected = theirs.state_dict()
                with FSDP.state_dict_type(ours, kind):
                    state = ours.state_dict()
                self.assertEqual(list(state), list(expected), where)
                for name, value in state.items():
                    for mine, theirs_local in zip(
                        _local_tensors(value), _local_tensors(expected[name])
                    ):
                        self.assertEqual(
                            mine.untyped_storage().nbytes(),
                            mine.numel() * mine.element_size(),
                            f"{where}: {name}",
                        )
                        torch.testing.assert_close(mine.clone(), theirs_local, msg=name)

    def test_set_and_get_state_dict_type(self):
        model = wrap(_blocks())
        self.assertEqual(
            FSDP.get_state_dict_type(model),
            StateDictSettings(FULL, FullStateDictConfig(), FullOptimStateDictConfig()),
        )
        with pytest.warns(FutureWarning, match="state_dict_type"):
            previous = FSDP.set_state_dict_type(model, SHARDED)
        self.assertEqual(previous.state_dict_type, FULL)
        self.assertEqual(FSDP.get_state_dict_type(model).state_dict_type, SHARDED)
        self.assertIsInstance(
            FSDP.get_state_dict_type(model).optim_state_dict_config, ShardedOptimStateDictConfig
        )
        with FSDP.state_dict_type(model, LOCAL):
            self.assertEqual(FSDP.get_state_dict_type(model).state_dict_type, LOCAL)
        self.assertEqual(FSDP.get_state_dict_type(model).state_dict_type, SHARDED)
        with self.assertRaisesRegex(RuntimeError, "LocalStateDictConfig"):
            FSDP.set_state_dict_type(model, LOCAL, FullStateDictConfig())
        # The phrase torch's test_wrong_state_dict_config matches, from both wrappers.
        torch_model = TorchFSDP(MLP(DIM), device_id=torch.device("cpu"))
        for wrapper_cls, wrapped, kind, config in (
            (FSDP, model, FULL, LocalStateDictConfig()),
            (TorchFSDP, torch_model, TorchStateDictType.FULL_STATE_DICT, TorchLocalConfig()),
        ):
            with self.assertRaisesRegex(RuntimeError, "Expected state_dict_config of type"):
                with wrapper_cls.state_dict_type(wrapped, kind, config):
                    pass
        disagreeing = state_of(model.layers[0])  # an instance whose type differs
        disagreeing.state_dict_settings = dataclasses.replace(
            disagreeing.state_dict_settings, state_dict_type=FULL
        )
        with self.assertRaisesRegex(AssertionError, "share one state-dict"):
            FSDP.get_state_dict_type(model)

    def test_strict_reports_original_names_like_torch(self):
        base = _blocks()
        torch_model = torch_wrap(base)
        for kind, torch_kind in ((FULL, TorchStateDictType.FULL_STATE_DICT), (
            SHARDED, TorchStateDictType.SHARDED_STATE_DICT
        )):  # fmt: skip
            model = wrap(copy.deepcopy(base))
            with FSDP.state_dict_type(model, kind):
                state = model.state_dict()
            del state["layers.0.in_proj.weight"]
            state["extra"] = torch.zeros(1)
            with FSDP.state_dict_type(model, kind):
                with self.assertRaisesRegex(
                    RuntimeError, r'Missing key.*"layers.0.in_proj.weight"'
                ):
                    model.load_state_dict(state)
                result = model.load_state_dict(state, strict=False)
            with TorchFSDP.state_dict_type(torch_model, torch_kind):
                torch_state = torch_model.state_dict()
                del torch_state["layers.0.in_proj.weight"]
                torch_state["extra"] = torch.zeros(1)
                expected = torch_model.load_state_dict(torch_state, strict=False)
            self.assertEqual(result.missing_keys, expected.missing_keys)
            self.assertEqual(result.unexpected_keys, expected.unexpected_keys)
            self.assertEqual(result.missing_keys, ["layers.0.in_proj.weight"])

    def test_load_with_another_type_active_raises(self):
        _, _, model, optim = trained(False, self.world_size)
        full_state, _ = save(model, optim, FULL)
        sharded_state, _ = save(model, optim, SHARDED)
        with FSDP.state_dict_type(model, SHARDED):
            with self.assertRaisesRegex(ValueError, "SHARDED_STATE_DICT.*got a plain Tensor"):
                model.load_state_dict(full_state)
        with self.assertRaisesRegex(
            ValueError, "FULL_STATE_DICT.*got a ShardedTensor in 2 shards.*over 2 ranks"
        ):
            model.load_state_dict(sharded_state)  # FULL_STATE_DICT is the default
        unsharded = wrap(_blocks(), sharding_strategy=NO_SHARD)
        with self.assertRaisesRegex(ValueError, "uses NO_SHARD on 2 ranks.*ShardedTensor"):
            unsharded.load_state_dict(sharded_state)
        with FSDP.state_dict_type(model, LOCAL, LocalStateDictConfig()):
            with self.assertRaisesRegex(RuntimeError, "Missing key.*_flat_param"):
                model.load_state_dict(full_state)

    def test_no_shard_gives_full_state_dicts(self):
        for use_orig_params in (False, True):
            ref, _, model, optim = trained(
                use_orig_params, self.world_size, sharding_strategy=NO_SHARD
            )
            with pytest.warns(UserWarning, match="NO_SHARD"):
                model_state, optim_state = save(model, optim, SHARDED)
            for name, value in model_state.items():
                self.assertIs(type(value), torch.Tensor, name)
                torch.testing.assert_close(value, ref.state_dict()[name], msg=name)
            exp_avg = optim_state["state"]["proj.weight"]["exp_avg"]
            self.assertEqual((type(exp_avg), exp_avg.shape), (torch.Tensor, (DIM, DIM)))
            other = wrap(_blocks(), sharding_strategy=NO_SHARD, use_orig_params=use_orig_params)
            other_optim = adam(other.parameters())
            with pytest.warns(UserWarning, match="NO_SHARD"):
                load(other, other_optim, (model_state, optim_state), SHARDED)
            inputs = make_inputs(1, self.rank)
            self.assertEqual(
                train_step(other, other_optim, inputs), train_step(model, optim, inputs)
            )

    def test_buffers_keep_their_dtype_under_mixed_precision(self):
        """``buffer_dtype`` casts buffers at the first forward; full and sharded state dicts
        hold them in their own dtype again, local ones as cast: as torch's do."""
        base = _blocks()
        self.sync_module_states(base)
        mixed = dict(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
        torch_model = torch_wrap(base, mixed_precision=TorchMixedPrecision(**mixed))
        model = wrap(copy.deepcopy(base), mixed_precision=MixedPrecision(**mixed))
        inputs = make_inputs(0, self.rank)
        torch_model(inputs), model(inputs)
        self.assertEqual(model.module.layers[0].module.buffer.dtype, torch.bfloat16)
        for kind, torch_kind in zip(StateDictType, TorchStateDictType):
            with TorchFSDP.state_dict_type(torch_model, torch_kind):
                expected = torch_model.state_dict()
            with FSDP.state_dict_type(model, kind):
                state = model.state_dict()
            for name in BUFFERS:
                dtype = torch.bfloat16 if kind is LOCAL else torch.float32
                self.assertEqual(state[name].dtype, expected[name].dtype, f"{kind}: {name}")
                self.assertEqual(state[name].dtype, dtype, f"{kind}: {name}")
                rounded = base.get_buffer(name).to(torch.bfloat16).to(dtype)
                self.assertTrue(torch.equal(state[name], rounded), f"{kind}: {name}")
        self.assertEqual(model.module.layers[0].module.buffer.dtype, torch.bfloat16)

    def test_state_dict_between_forward_and_backward_under_mixed_precision(self):
        """Between forward and backward the state dict opens the summon window: full
        precision values, and the backward that follows is the one it would have been."""
        self.run_subtests(
            {"strategy": [FULL_SHARD, SHARD_GRAD_OP], "use_orig_params": [False, True]},
            self._test_state_dict_in_forward_backward,
        )

    def _test_state_dict_in_forward_backward(self, strategy, use_orig_params) -> None:
        base = _blocks()
        self.sync_module_states(base)
        kwargs = dict(
            sharding_strategy=strategy,
            use_orig_params=use_orig_params,
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, cast_forward_inputs=True),
        )
        model, twin = wrap(copy.deepcopy(base), **kwargs), wrap(copy.deepcopy(base), **kwargs)
        optim, twin_optim = adam(model.parameters()), adam(twin.parameters())
        inputs = make_inputs(0, self.rank)
        loss, twin_loss = sum_loss(model(inputs)), sum_loss(twin(inputs))
        for kind in (FULL, SHARDED):
            with FSDP.state_dict_type(model, kind):
                state = model.state_dict()
            self.assertEqual(list(state), list(base.state_dict()), kind)
            for name, value in base.state_dict().items():
                saved = _local_tensors(state[name])[0]
                if isinstance(state[name], ShardedTensor):
                    value = value.chunk(self.world_size)[self.rank]
                self.assertEqual(saved.dtype, torch.float32, f"{kind}: {name}")
                self.assertTrue(torch.equal(saved, value), f"{kind}: {name}")
        loss.backward(), twin_loss.backward()
        optim.step(), twin_optim.step()
        for step in (1, 2):
            step_inputs = make_inputs(step, self.rank)
            expected = train_step(twin, twin_optim, step_inputs)
            self.assertEqual(train_step(model, optim, step_inputs), expected)
        twin_values = full_values(twin)
        for name, value in full_values(model).items():
            self.assertTrue(torch.equal(value, twin_values[name]), name)

    def test_local_state_dict_of_an_unsharded_orig_params_group(self):
        """SHARD_GRAD_OP keeps forward's full-size views until backward: a local state dict
        then holds them beside the flat shard, like torch's, and the backward is unchanged."""
        base = _blocks()
        self.sync_module_states(base)
        torch_model = torch_wrap(
            base, use_orig_params=True, sharding_strategy=TorchShardingStrategy.SHARD_GRAD_OP
        )
        kwargs = dict(use_orig_params=True, sharding_strategy=SHARD_GRAD_OP)
        model, twin = wrap(copy.deepcopy(base), **kwargs), wrap(copy.deepcopy(base), **kwargs)
        optim, twin_optim = adam(model.parameters()), adam(twin.parameters())
        inputs = make_inputs(0, self.rank)
        loss, twin_loss = sum_loss(model(inputs)), sum_loss(twin(inputs))
        torch_model(inputs)
        self.assertEqual(model.module.proj.weight.shape, (DIM, DIM))  # unsharded
        with TorchFSDP.state_dict_type(torch_model, TorchStateDictType.LOCAL_STATE_DICT):
            expected = torch_model.state_dict()
        with FSDP.state_dict_type(model, LOCAL):
            state = model.state_dict()
        self.assertEqual(list(state), list(expected))
        for name, value in state.items():
            self.assertIs(type(value), type(expected[name]), name)
            for mine, theirs in zip(_local_tensors(value), _local_tensors(expected[name])):
                self.assertEqual(mine.shape, theirs.shape, name)
                self.assertTrue(torch.equal(mine, theirs), name)
        loss.backward(), twin_loss.backward()
        optim.step(), twin_optim.step()
        step_inputs = make_inputs(1, self.rank)
        expected_loss = train_step(twin, twin_optim, step_inputs)
        self.assertEqual(train_step(model, optim, step_inputs), expected_loss)

    def test_dcp_model_state_dict_functions(self):
        """``get_model_state_dict``/``set_model_state_dict`` call ``state_dict`` and
        ``load_state_dict``: under SHARDED_STATE_DICT they round-trip DTensors."""
        ref, _, model, _ = trained(True, self.world_size)
        FSDP.set_state_dict_type(model, SHARDED, ShardedStateDictConfig(_use_dtensor=True))
        state = get_model_state_dict(model)
        self.assertEqual(list(state), list(ref.state_dict()))
        other = wrap(_blocks(), use_orig_params=True)
        FSDP.set_state_dict_type(other, SHARDED, ShardedStateDictConfig(_use_dtensor=True))
        set_model_state_dict(other, state)
        check_state_dict_parity(self, ref, other)


class TestWrapperHybridStateDict(FSDPTestMultiThread):
    """HYBRID_SHARD and _HYBRID_SHARD_ZERO2 on 2 replicas of 2 shards: every state-dict type
    round-trips, and full state dicts hold the reference's values."""

    @property
    def world_size(self) -> int:
        return 4

    def _groups(self) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        return mesh.get_group("shard"), mesh.get_group("replicate")

    def test_round_trips(self):
        groups = self._groups()
        for strategy in HYBRID:
            kwargs = dict(sharding_strategy=strategy, process_group=groups)
            for kind in (FULL, SHARDED, LOCAL):
                with self.subTest(strategy=strategy, kind=kind):
                    TestWrapperStateDict._check_round_trip(self, kind, **kwargs)

    def test_full_values_and_sharded_layout(self):
        groups = self._groups()
        for strategy in HYBRID:
            for use_orig_params in (False, True):
                ref, ref_optim, model, optim = trained(
                    use_orig_params, 4, steps=2, sharding_strategy=strategy, process_group=groups
                )
                state, optim_state = save(model, optim, FULL)
                for name, value in ref.state_dict().items():
                    torch.testing.assert_close(state[name], value, msg=name)
                ref_state = ref_optim.state_dict()["state"]
                for index, (name, _) in enumerate(ref.named_parameters()):
                    torch.testing.assert_close(
                        optim_state["state"][name]["exp_avg"], ref_state[index]["exp_avg"]
                    )
                state, _ = save(model, optim, SHARDED)
                weight = state["layers.0.in_proj.weight"]  # 24 rows over 2 shard ranks, nested
                self.assertEqual(weight.local_shards()[0].tensor.shape, (12, DIM))
                shard_rank = self.rank % 2
                expected = ref.state_dict()["layers.0.in_proj.weight"].chunk(2)[shard_rank]
                torch.testing.assert_close(weight.local_shards()[0].tensor, expected)


# -- across world sizes (rank threads of two runs share memory) ---------------------------------


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_full_optim_state_saved_on_4_ranks_loads_on_2(use_orig_params):
    """Save full model and optimizer state on 4 ranks, load on 2, train on: the losses
    follow a reference that changed world size without a checkpoint."""
    torch.manual_seed(0)
    initial = _blocks()
    ref = copy.deepcopy(initial)
    ref_optim = adam(ref.parameters())
    for step in range(2):
        local_data_parallel_step(ref, ref_optim, make_inputs, step, 4)
    ref_losses = [local_data_parallel_step(ref, ref_optim, make_inputs, step, 2) for step in (2, 3)]
    saved: dict[int, tuple[dict, dict]] = {}

    def save_on_4(rank: int) -> None:
        model = wrap(copy.deepcopy(initial), use_orig_params=use_orig_params)
        optim = adam(model.parameters())
        for step in range(2):
            train_step(model, optim, make_inputs(step, rank))
        saved[rank] = save(model, optim, FULL)

    def load_on_2(rank: int) -> None:
        model = wrap(_blocks(), use_orig_params=use_orig_params)
        optim = adam(model.parameters())
        load(model, optim, saved[0], FULL)
        for step, losses in zip((2, 3), ref_losses):
            torch.testing.assert_close(
                train_step(model, optim, make_inputs(step, rank)), losses[rank]
            )
        with FSDP.state_dict_type(model, FULL):
            check_state_dict_parity(None, ref, model)

    run_threaded(save_on_4, 4)
    run_threaded(load_on_2, 2)


def test_local_state_dict_loads_only_at_its_world_size():
    torch.manual_seed(0)
    initial = _blocks()
    saved: dict[int, dict] = {}

    def save_on_4(rank: int) -> None:
        model = wrap(copy.deepcopy(initial))
        with FSDP.state_dict_type(model, LOCAL):
            saved[rank] = model.state_dict()

    def load_on_2(rank: int) -> None:
        model = wrap(copy.deepcopy(initial))
        with FSDP.state_dict_type(model, LOCAL):
            with pytest.raises(ValueError, match="saved by 4 ranks.*over 2 ranks"):
                model.load_state_dict(saved[rank])

    run_threaded(save_on_4, 4)
    run_threaded(load_on_2, 2)
