"""``FullyShardedDataParallel`` state dicts of models that are not a plain tree of parameters.

* Tied weights (one parameter under two names, like a GPT-2's embedding and output layer),
  a module reachable under two names, and a parameter registered twice: every state-dict
  type must save each name, load each name, and return values that own their memory (a
  value viewing the gathered buffer is freed when the instance reshards: reading it later
  crashes the process or reads another tensor's bytes).
* Activation-checkpoint wrappers (torch's ``checkpoint_wrapper``) inside a wrapper instance,
  or put around modules after wrapping (``apply_activation_checkpointing``): the state dict
  names are the unwrapped model's, and loading works across models with and without them.
* Sharded state dicts saved where parameters are whole on every rank (``NO_SHARD``, which a
  world size of 1 implies) and loaded where they are sharded, or the reverse: a clear error.

Values are checked against an unsharded reference; names against torch's wrapper where it
runs on threads (see ``tests/multiprocess/test_wrapper_state_dict_gloo.py`` for gloo).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import StateDictType as TorchStateDictType
from torch.distributed.tensor import DTensor

from reffsdp import FullyShardedDataParallel as FSDP
from reffsdp.api import StateDictType
from reffsdp.testing.models import MLPBlocks, TiedMLPStack
from reffsdp.testing.multithread import run_threaded
from reffsdp.testing.parity import train_step
from tests.multithread.test_wrapper_state_dict import (
    DIM,
    NextToTorchsWrapper,
    adam,
    full_values,
    load,
    make_inputs,
    save,
    torch_wrap,
    wrap,
)

pytestmark = [pytest.mark.multithread, pytest.mark.filterwarnings("ignore::FutureWarning")]

FULL, LOCAL, SHARDED = (
    StateDictType.FULL_STATE_DICT,
    StateDictType.LOCAL_STATE_DICT,
    StateDictType.SHARDED_STATE_DICT,
)
TORCH_TYPES = dict(zip(StateDictType, TorchStateDictType))


class SharedModuleAndParameter(nn.Module):
    """``mix_again`` is ``mix`` (one module, two names) and ``scale_again`` is ``scale`` (one
    parameter registered twice on the root)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, 2 * DIM)
        self.mix = nn.Sequential(nn.Linear(2 * DIM, 2 * DIM), nn.Tanh())
        self.mix_again = self.mix
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 2 * DIM))
        self.scale_again = self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix_again(self.mix(self.embed(x)) * self.scale)


def tied_stack() -> TiedMLPStack:
    return TiedMLPStack(DIM)  # head.weight is proj.weight, in the root's flat parameter


def _owns_its_memory(value: torch.Tensor) -> bool:
    """A state-dict value is a tensor of its own, not a view into a larger buffer."""
    return value.untyped_storage().nbytes() == value.numel() * value.element_size()


def _check_owned(test, state: dict, kind: StateDictType, where: str) -> None:
    """Every parameter's value in a full or sharded ``state`` owns its memory: a view of the
    gathered buffer crashes the process when read after that buffer is freed, so check
    before reading. (Buffers stay the module's, and a local state dict views the shard that
    the instance keeps, as in torch.)"""
    if kind is LOCAL:
        return
    for name, value in state.items():
        if not name.endswith("buffer"):
            for local in _local_values(value):
                test.assertTrue(_owns_its_memory(local), f"{where}: {name}")


def _local_values(value) -> list[torch.Tensor]:
    if isinstance(value, ShardedTensor):
        return [shard.tensor for shard in value.local_shards()]
    if isinstance(value, DTensor):
        return [value.to_local()]
    return [value]


class TestSharedParameters(NextToTorchsWrapper):
    def _round_trip(self, factory, kind: StateDictType, use_orig_params: bool) -> None:
        """Train a step, save, load into a model of other weights, train on together."""
        where = f"{kind}, use_orig_params={use_orig_params}"
        base = factory()
        self.sync_module_states(base)
        model = wrap(copy.deepcopy(base), use_orig_params=use_orig_params)
        optim = adam(model.parameters())
        train_step(model, optim, make_inputs(0, self.rank))
        states = save(model, optim, kind)
        if kind is not LOCAL:
            self.assertEqual(list(states[0]), list(base.state_dict()), where)
        _check_owned(self, states[0], kind, where)
        other = wrap(factory(), use_orig_params=use_orig_params)  # other weights
        other_optim = adam(other.parameters())
        load(other, other_optim, states, kind)
        for step in (1, 2):
            inputs = make_inputs(step, self.rank)
            loss = train_step(model, optim, inputs)
            self.assertEqual(train_step(other, other_optim, inputs), loss, where)
        expected = full_values(model)
        for name, value in full_values(other).items():
            self.assertTrue(torch.equal(value, expected[name]), f"{where}: {name}")

    def test_tied_weights_round_trip(self):
        """A SHARDED load failed on the second name of a tied weight (its ShardedTensor was
        copied into a Parameter as it was)."""
        self.run_subtests(
            {"kind": [FULL, SHARDED, LOCAL], "use_orig_params": [False, True]},
            self._round_trip,
            tied_stack,
        )

    def test_shared_module_and_parameter_round_trip(self):
        self.run_subtests(
            {"kind": [FULL, SHARDED, LOCAL], "use_orig_params": [False, True]},
            self._round_trip,
            SharedModuleAndParameter,
        )

    def test_values_outlive_the_state_dict_call(self):
        """Every value owns its memory once ``state_dict()`` returned: a shared module's
        parameters under its second name viewed the gathered buffer, freed on reshard (a
        crash on clone, save or load)."""
        self.run_subtests(
            {"kind": [FULL, SHARDED], "use_orig_params": [False, True]},
            self._check_values_outlive,
        )

    def _check_values_outlive(self, kind: StateDictType, use_orig_params: bool) -> None:
        base = SharedModuleAndParameter()
        self.sync_module_states(base)
        model = wrap(copy.deepcopy(base), use_orig_params=use_orig_params)
        with FSDP.state_dict_type(model, kind):
            state = model.state_dict()
        reference = base.state_dict()
        self.assertEqual(list(state), list(reference))
        _check_owned(self, state, kind, str(kind))
        for name, value in state.items():  # safe to read now
            local = _local_values(value)[0].clone()
            expected = reference[name]
            if isinstance(value, ShardedTensor):
                expected = expected.chunk(self.world_size)[self.rank]
            self.assertTrue(torch.equal(local, expected), f"{kind}: {name}")
        torch.save(state, io.BytesIO())
        for name, again in (("scale", "scale_again"), ("mix.0.weight", "mix_again.0.weight")):
            self.assertTrue(
                torch.equal(_local_values(state[again])[0], _local_values(state[name])[0])
            )
        with FSDP.state_dict_type(model, kind):
            model.load_state_dict(state)

    def test_sharded_names_and_types_match_torch(self):
        """Each name of a tied weight or shared module is a ShardedTensor of its own in a
        sharded state dict, as in torch's; both load back."""
        for use_orig_params in (False, True):
            base = SharedModuleAndParameter()
            self.sync_module_states(base)
            theirs = torch_wrap(base, use_orig_params=use_orig_params)
            ours = wrap(copy.deepcopy(base), use_orig_params=use_orig_params)
            with TorchFSDP.state_dict_type(theirs, TorchStateDictType.SHARDED_STATE_DICT):
                expected = theirs.state_dict()
                theirs.load_state_dict(expected)
            with FSDP.state_dict_type(ours, SHARDED):
                state = ours.state_dict()
                ours.load_state_dict(state)
            self.assertEqual(list(state), list(expected))
            for name, value in expected.items():
                if isinstance(value, ShardedTensor):  # torch leaves mix_again.* whole
                    self.assertIsInstance(state[name], ShardedTensor, name)


# -- activation-checkpoint wrappers ---------------------------------------------------------

CHECKPOINTING = ("none", "inside", "around", "after")
# (saved from, loaded into): each kind of wrapping to and from none, and into itself
CROSSINGS = [(how, "none") for how in CHECKPOINTING[1:]] + [
    *(("none", how) for how in CHECKPOINTING[1:]),
    *((how, how) for how in CHECKPOINTING[1:]),
]


def _blocks_checkpointed(base: MLPBlocks, how: str, **kwargs) -> FSDP:
    """A copy of ``base`` wrapped per MLP block and at the root, with torch's
    ``checkpoint_wrapper``: ``inside`` each wrapped block (``FSDP(checkpoint_wrapper(block))``),
    ``around`` the blocks and the whole model before wrapping, ``after`` wrapping around
    every ``nn.Linear`` (``apply_activation_checkpointing``), or ``none``."""
    model = copy.deepcopy(base)
    if how == "none":
        return wrap(model, **kwargs)
    if how == "after":
        wrapped = wrap(model, **kwargs)
        apply_activation_checkpointing(wrapped, check_fn=lambda m: isinstance(m, nn.Linear))
        return wrapped
    for i, layer in enumerate(model.layers):
        model.layers[i] = FSDP(checkpoint_wrapper(layer), **kwargs)
    return FSDP(checkpoint_wrapper(model) if how == "around" else model, **kwargs)


def _linear_checkpointed_after_wrapping(base: nn.Linear, **kwargs) -> FSDP:
    """``FSDP(linear)`` whose wrapped module itself is then put in a checkpoint wrapper."""
    model = FSDP(copy.deepcopy(base), **kwargs)
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, nn.Linear))
    assert type(model._fsdp_wrapped_module).__name__ == "CheckpointWrapper"
    return model


class TestCheckpointWrappers(NextToTorchsWrapper):
    def test_names_are_the_unwrapped_models(self):
        """Keys as the model without any wrapper has them, values its values, as torch's
        (a SHARDED state dict raised KeyError '_checkpoint_wrapped_module...', and a FULL
        one held views of freed memory under the checkpointed names)."""
        self.run_subtests(
            {"how": list(CHECKPOINTING), "kind": [FULL, SHARDED], "use_orig_params": [False, True]},
            self._check_names,
        )

    def _check_names(self, how: str, kind: StateDictType, use_orig_params: bool) -> None:
        base = MLPBlocks(DIM, (3, 4), with_buffer=True)
        self.sync_module_states(base)
        model = _blocks_checkpointed(base, how, use_orig_params=use_orig_params)
        with FSDP.state_dict_type(model, kind):
            state = model.state_dict()
        reference = base.state_dict()
        self.assertEqual(list(state), list(reference))
        _check_owned(self, state, kind, str(kind))
        for name, value in state.items():
            local = _local_values(value)[0]
            expected = reference[name]
            if isinstance(value, ShardedTensor):
                expected = expected.chunk(self.world_size)[self.rank]
            self.assertTrue(torch.equal(local, expected), name)

    def test_load_across_checkpointing(self):
        """A state dict saved with or without checkpoint wrappers loads into a model with or
        without them (strict), and the loaded model shows the saved values."""
        self.run_subtests(
            {"kind": [FULL, SHARDED, LOCAL], "use_orig_params": [False, True]},
            self._check_load_across,
        )

    def _check_load_across(self, kind: StateDictType, use_orig_params: bool) -> None:
        base = MLPBlocks(DIM, (3, 4), with_buffer=True)
        self.sync_module_states(base)
        expected = base.state_dict()
        for source, dest in CROSSINGS:
            where = f"{kind}, {source} -> {dest}, use_orig_params={use_orig_params}"
            model = _blocks_checkpointed(base, source, use_orig_params=use_orig_params)
            with FSDP.state_dict_type(model, kind):
                state = model.state_dict()
            _check_owned(self, state, kind, where)
            other = _blocks_checkpointed(
                MLPBlocks(DIM, (3, 4), with_buffer=True), dest, use_orig_params=use_orig_params
            )
            with FSDP.state_dict_type(other, kind):
                other.load_state_dict(state)
            for name, value in full_values(other).items():
                self.assertTrue(torch.equal(value, expected[name]), f"{where}: {name}")

    def test_checkpoint_wrapper_put_around_the_wrapped_module(self):
        """``apply_activation_checkpointing`` on ``FSDP(linear)`` replaces the wrapped module
        itself: summoned, the model shows the linear's two parameters and not the flat
        parameter too (it showed three), and state dicts round-trip, as torch's."""
        for use_orig_params in (False, True):
            base = nn.Linear(DIM, DIM)
            self.sync_module_states(base)
            model = _linear_checkpointed_after_wrapping(base, use_orig_params=use_orig_params)
            theirs = TorchFSDP(
                copy.deepcopy(base), device_id=torch.device("cpu"), use_orig_params=use_orig_params
            )
            apply_activation_checkpointing(theirs, check_fn=lambda m: isinstance(m, nn.Linear))
            with FSDP.summon_full_params(model), TorchFSDP.summon_full_params(theirs):
                names = [name for name, _ in model.named_parameters()]
                self.assertEqual(names, [name for name, _ in theirs.named_parameters()])
                self.assertEqual(len(names), 2, names)
            for kind in (FULL, SHARDED, LOCAL):
                with TorchFSDP.state_dict_type(theirs, TORCH_TYPES[kind]):
                    expected = theirs.state_dict()
                with FSDP.state_dict_type(model, kind):
                    state = model.state_dict()
                self.assertEqual(list(state), list(expected), kind)
                other = _linear_checkpointed_after_wrapping(
                    nn.Linear(DIM, DIM), use_orig_params=use_orig_params
                )
                with FSDP.state_dict_type(other, kind):
                    other.load_state_dict(state)
                for name, value in full_values(other).items():
                    self.assertTrue(torch.equal(value, base.state_dict()[name]), f"{kind} {name}")


# -- sharded state dicts across NO_SHARD (rank threads of two runs share memory) ------------


@pytest.mark.parametrize(
    ("saved_on", "loaded_on", "message"),
    [
        (1, 2, r"whole on every rank \(NO_SHARD.*shards its parameters over 2 ranks \(FULL_SHARD"),
        (2, 1, r"uses NO_SHARD on 1 rank.*ShardedTensor in 2 shards.*saved by a model that"),
    ],
)
@pytest.mark.filterwarnings("ignore:.*NO_SHARD")
def test_sharded_state_dict_across_no_shard_says_what_differs(saved_on, loaded_on, message):
    """A SHARDED_STATE_DICT of one rank (where FULL_SHARD runs as NO_SHARD: plain tensors)
    loaded on two, or the reverse: the error says how the two models shard (it blamed
    "another StateDictType", which both used)."""
    torch.manual_seed(0)
    base = MLPBlocks(DIM, (3, 4), with_buffer=True)
    saved: dict[int, dict] = {}

    def save_sharded(rank: int) -> None:
        model = wrap(copy.deepcopy(base))
        with FSDP.state_dict_type(model, SHARDED):
            saved[rank] = model.state_dict()

    def load_sharded(rank: int) -> None:
        model = wrap(copy.deepcopy(base))
        with FSDP.state_dict_type(model, SHARDED):
            with pytest.raises(ValueError, match=message):
                model.load_state_dict(saved[rank % saved_on])

    run_threaded(save_sharded, saved_on)
    run_threaded(load_sharded, loaded_on)
