"""``fully_shard`` state dicts, meta-device initialization and dtype casts, checked by training.

A state dict holds the sharded DTensors themselves; loading one (in place or with
``assign=True``), materializing a model built on the meta device, or casting the model's
dtype after sharding must all leave a model that trains exactly like DDP.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from reffsdp import fully_shard
from reffsdp.testing.inputs import random_inputs
from reffsdp.testing.models import MLP, MLPStack
from reffsdp.testing.multithread import FSDPTestMultiThread
from reffsdp.testing.parity import check_train_parity

pytestmark = pytest.mark.multithread


def _vectors(dim: int, batch: int = 2, dtype: torch.dtype = torch.float32):
    return random_inputs(batch, dim, dtype=dtype)


def _shard_stack(model: nn.Module, **kwargs) -> nn.Module:
    for block in model:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _buffered_stack(dim: int, device: torch.device | str | None = None) -> nn.Sequential:
    return nn.Sequential(
        MLP(dim, device, with_buffer=True), MLP(dim, device), MLP(dim, device, with_buffer=True)
    )


class TestFullyShardStateDict(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def _ref_and_model(self, model: nn.Module) -> tuple[nn.Module, nn.Module]:
        self.sync_module_states(model)
        return copy.deepcopy(model), _shard_stack(model)

    def test_state_dict_holds_the_sharded_params(self):
        self.run_subtests(
            {"reshard_after_forward": [True, False]}, self._test_state_dict_holds_sharded
        )

    def _test_state_dict_holds_sharded(self, reshard_after_forward: bool):
        model = _buffered_stack(5)
        self.sync_module_states(model)
        ref_model = copy.deepcopy(model)
        _shard_stack(model, reshard_after_forward=reshard_after_forward)
        # Between forward and backward (unsharded parameters registered without resharding)
        # the state dict still holds the sharded parameters.
        loss = model(_vectors(5)(0, self.rank)).sum()
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
        ref_model, source = self._ref_and_model(MLPStack(5))
        target = _shard_stack(MLPStack(5))  # different (and unsynchronized) weights
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
        check_train_parity(self, ref_model, target, _vectors(5), num_steps=3)

    def test_meta_device_init_then_load_state_dict(self):
        ref_model = _buffered_stack(5)
        self.sync_module_states(ref_model)
        with torch.device("meta"):
            model = _buffered_stack(5)
        _shard_stack(model)
        self.assertEqual(model[0].in_proj.weight.device, torch.device("meta"))
        model.to_empty(device="cpu")
        sharded = {
            name: distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
            for (name, value), param in zip(ref_model.named_parameters(), model.parameters())
        }
        model.load_state_dict({**sharded, **dict(ref_model.named_buffers())})
        check_train_parity(self, ref_model, model, _vectors(5), num_steps=3)

    @pytest.mark.filterwarnings("ignore:DTensor random operators may not have complete support")
    def test_meta_device_init_then_reset_parameters(self):
        with torch.device("meta"):
            model = _buffered_stack(5)
        _shard_stack(model)
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
        check_train_parity(self, ref_model, model, _vectors(5, batch=8), num_steps=3)

    def test_first_forward_on_meta_raises(self):
        with torch.device("meta"):
            model = MLPStack(5)
        _shard_stack(model)
        with self.assertRaisesRegex(RuntimeError, "meta"):
            model(_vectors(5)(0, self.rank))

    def test_dtype_cast_after_sharding(self):
        self.run_subtests({"cast": ["double", "to"]}, self._test_dtype_cast_after_sharding)

    def _test_dtype_cast_after_sharding(self, cast: str):
        ref_model, model = self._ref_and_model(MLPStack(5))
        for m in (ref_model, model):
            if cast == "double":
                m.double()
            else:
                m.to(torch.float64)
        for name, param in model.named_parameters():
            self.assertIsInstance(param, DTensor, name)
            self.assertEqual(param.dtype, torch.float64, name)
            self.assertEqual(param.to_local().dtype, torch.float64, name)
        check_train_parity(self, ref_model, model, _vectors(5, dtype=torch.float64), num_steps=3)
        for name, param in model.named_parameters():
            self.assertEqual(param.grad.dtype, torch.float64, name)


class TestFullyShardStateDictWorldSize4(TestFullyShardStateDict):
    @property
    def world_size(self) -> int:
        return 4
