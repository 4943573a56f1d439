"""``fully_shard`` state dicts, meta-device initialization and dtype casts, checked by training.

A state dict holds the sharded DTensors themselves; loading one (in place or with
``assign=True``), materializing a model built on the meta device, or casting the model's
dtype after sharding must all leave a model that trains exactly like DDP.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from reffsdp import fully_shard
from reffsdp.testing.build import reference_and_model, shard_bottom_up
from reffsdp.testing.inputs import random_inputs, random_tokens
from reffsdp.testing.models import (
    MLP,
    MLPStack,
    ModelArgs,
    Transformer,
    init_deterministic,
)
from reffsdp.testing.multithread import FSDPTestMultiThread
from reffsdp.testing.parity import check_state_dict_parity, check_train_parity

pytestmark = pytest.mark.multithread


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _buffered_stack(dim: int, device: torch.device | str | None = None) -> nn.Sequential:
    return nn.Sequential(
        MLP(dim, device, with_buffer=True), MLP(dim, device), MLP(dim, device, with_buffer=True)
    )


class StateDictChecks:
    """A test body that the gloo suite runs too (``tests/multiprocess/test_fully_shard_gloo.py``,
    in one test with others, since each of its tests pays for starting the rank processes)."""

    def check_load_state_dict_of_shards(self, meta_init: bool):
        """Load the reference's tensors, cut as shards, into a model with other weights."""
        ref_model = init_deterministic(_buffered_stack(5))  # live ReLUs, whatever the RNG
        self.sync_module_states(ref_model)  # the buffers
        if meta_init:
            with torch.device("meta"):
                model = _buffered_stack(5)
            shard_bottom_up(model, model)
            self.assertEqual(model[0].in_proj.weight.device, torch.device("meta"))
            model.to_empty(device="cpu")
        else:
            model = _buffered_stack(5)  # unsynchronized weights
            shard_bottom_up(model, model)
        sharded = {
            name: distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
            for (name, value), param in zip(ref_model.named_parameters(), model.parameters())
        }
        model.load_state_dict({**sharded, **dict(ref_model.named_buffers())})
        check_train_parity(self, ref_model, model, random_inputs(2, 5), num_steps=3)
        check_state_dict_parity(self, ref_model, model)


class TestFullyShardStateDict(StateDictChecks, FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_state_dict_holds_the_sharded_params(self):
        self.run_subtests(
            {"reshard_after_forward": [True, False]}, self._test_state_dict_holds_sharded
        )

    def _test_state_dict_holds_sharded(self, reshard_after_forward: bool):
        ref_model, model = reference_and_model(_buffered_stack(5))
        shard_bottom_up(model, model, reshard_after_forward=reshard_after_forward)
        # Between forward and backward (unsharded parameters registered without resharding)
        # the state dict still holds the sharded parameters.
        loss = model(random_inputs(2, 5)(0, self.rank)).sum()
        state_dict = model.state_dict()
        ref_state_dict = ref_model.state_dict()
        self.assertEqual(list(state_dict), list(ref_state_dict))  # original FQNs, no prefix
        params = dict(model.named_parameters())
        for name, value in state_dict.items():
            if name in params:
                self.assertIsInstance(value, DTensor, name)
                self.assertEqual(value.placements, params[name].placements, name)
                self.assertTrue(_same_storage(value.to_local(), params[name].to_local()), name)
                torch.testing.assert_close(value.full_tensor(), ref_state_dict[name])
            else:  # buffers are not sharded
                self.assertNotIsInstance(value, DTensor, name)
                torch.testing.assert_close(value, ref_state_dict[name])
        loss.backward()  # backward still works after the state dict resharded mid-iteration

    def test_load_state_dict_from_another_sharded_model(self):
        self.run_subtests({"assign": [False, True]}, self._test_load_state_dict)

    def _test_load_state_dict(self, assign: bool):
        ref_model, source = reference_and_model(MLPStack(5))
        shard_bottom_up(source, source)
        target = MLPStack(5)  # different (and unsynchronized) weights
        shard_bottom_up(target, target)
        params_before = list(target.parameters())
        target.load_state_dict(source.state_dict(), assign=assign)
        for (name, param), before, source_param in zip(
            target.named_parameters(), params_before, source.parameters()
        ):
            self.assertIsInstance(param, nn.Parameter, name)
            self.assertIsInstance(param, DTensor, name)
            self.assertEqual(param.placements, source_param.placements, name)
            # Loaded in place, or assigned and then re-padded into storage of its own.
            self.assertEqual(param is before, not assign, name)
            self.assertFalse(_same_storage(param.to_local(), source_param.to_local()), name)
        check_train_parity(self, ref_model, target, random_inputs(2, 5), num_steps=3)

    def test_load_state_dict_of_shards(self):
        self.run_subtests({"meta_init": [True, False]}, self.check_load_state_dict_of_shards)

    @pytest.mark.filterwarnings("ignore:DTensor random operators may not have complete support")
    def test_assign_load_into_tied_meta_model(self):
        self.run_subtests({"grouped": [False, True]}, self._test_assign_load_into_tied_meta_model)

    def _test_assign_load_into_tied_meta_model(self, grouped: bool):
        """A meta-device model whose output layer reuses the embedding table gets its weights
        from ``load_state_dict(assign=True)``, which registers a parameter of its own under
        each of the two names; the tie must hold again, and the model train as unsharded."""
        args = ModelArgs(weight_tying=True)
        ref_model, _ = reference_and_model(Transformer(args))
        with torch.device("meta"):
            model = Transformer(args)
        if grouped:  # the tie spans the two modules of one call: two load hooks see it
            fully_shard([model.tok_embeddings, model.output])
        shard_bottom_up(model, model.layers)
        full = ref_model.state_dict()
        sharded = {
            name: nn.Parameter(
                distribute_tensor(
                    full[name], value.device_mesh, value.placements, src_data_rank=None
                )
            )
            for name, value in model.state_dict().items()
        }
        self.assertIsNot(sharded["output.weight"], sharded["tok_embeddings.weight"])
        model.load_state_dict(sharded, assign=True)
        self.assertIs(model.output.weight, model.tok_embeddings.weight)
        check_train_parity(
            self, ref_model, model, random_tokens(args.vocab_size, 2, 8), num_steps=3
        )
        self.assertIs(model.output.weight, model.tok_embeddings.weight)

    def test_meta_device_init_then_reset_parameters(self):
        with torch.device("meta"):
            model = _buffered_stack(5)
        shard_bottom_up(model, model)
        model.to_empty(device="cpu")
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
        for name, param in model.named_parameters():
            self.assertEqual(param.device, torch.device("cpu"), name)
            self.assertIsInstance(param, DTensor, name)
        # Ranks draw initial values independently; the reference takes what they drew.
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)
        ref_model = _buffered_stack(5, "meta").to_empty(device="cpu")
        ref_model.load_state_dict(
            {
                name: value.full_tensor() if isinstance(value, DTensor) else value
                for name, value in model.state_dict().items()
            }
        )
        check_train_parity(self, ref_model, model, random_inputs(8, 5), num_steps=3)

    def test_first_forward_on_meta_raises(self):
        with torch.device("meta"):
            model = MLPStack(5)
        shard_bottom_up(model, model)
        with self.assertRaisesRegex(RuntimeError, "meta"):
            model(random_inputs(2, 5)(0, self.rank))

    def test_dtype_cast_after_sharding(self):
        self.run_subtests({"cast": ["double", "to"]}, self._test_dtype_cast_after_sharding)

    def _test_dtype_cast_after_sharding(self, cast: str):
        ref_model, model = reference_and_model(MLPStack(5))
        shard_bottom_up(model, model)
        for m in (ref_model, model):
            if cast == "double":
                m.double()
            else:
                m.to(torch.float64)
        for name, param in model.named_parameters():
            self.assertIsInstance(param, DTensor, name)
            self.assertEqual(param.dtype, torch.float64, name)
            self.assertEqual(param.to_local().dtype, torch.float64, name)
        make_inputs = random_inputs(2, 5, dtype=torch.float64)
        check_train_parity(self, ref_model, model, make_inputs, num_steps=3)
        for name, param in model.named_parameters():
            self.assertEqual(param.grad.dtype, torch.float64, name)


class TestFullyShardStateDictWorldSize4(TestFullyShardStateDict):
    @property
    def world_size(self) -> int:
        return 4
