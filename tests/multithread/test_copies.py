"""Copies the core and the front ends leave out, checked by where bytes land.

* A group of one member (a wrapper instance, or a ``fully_shard`` call on a module with one
  parameter) all-gathers straight into the member's own buffer on CPU: the collective's
  output *is* that buffer, so there is no copy-in and no copy-out.
* The wrapper shows the original parameters as pieces of one ``split`` of the unsharded flat
  parameter, so backward builds the flat gradient in one node.
* A group of one member whose gradient needs no padding reduce-scatters that gradient itself.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn as nn

from reffsdp import FullyShardedDataParallel, ShardingStrategy, fully_shard
from reffsdp.testing.build import wrap_blocks
from reffsdp.testing.models import MLP, MLPBlocks
from reffsdp.testing.multithread import FSDPTestMultiThread
from reffsdp.testing.patching import observe_all_gathers, observe_reduce_scatters

pytestmark = pytest.mark.multithread


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class OneMemberGroupTest(FSDPTestMultiThread):
    world_size = 2

    def _gathered_into(self, model: nn.Module, inp: torch.Tensor) -> list[int]:
        """The storages the all-gathers of one forward write into."""
        outputs: list[int] = []
        with observe_all_gathers(lambda output, input, group: outputs.append(_storage(output))):
            model(inp)
        return outputs

    def test_wrapper_gathers_into_flat_buffer(self):
        torch.manual_seed(0)
        # SHARD_GRAD_OP keeps every instance unsharded after forward, so the buffers the
        # all-gathers wrote into are still allocated when we look at them.
        model = wrap_blocks(
            MLPBlocks(4, (2, 3)), {MLP}, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP
        )
        outputs = self._gathered_into(model, torch.randn(2, 4))
        handles = [m._handle for m in model.modules() if isinstance(m, FullyShardedDataParallel)]
        self.assertEqual(len(outputs), len(handles))
        self.assertEqual(sorted(outputs), sorted(_storage(h.gathered) for h in handles))

    def test_fully_shard_one_parameter_gathers_into_its_buffer(self):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6, bias=False), nn.ReLU(), nn.Linear(6, 4))
        fully_shard(model[0], reshard_after_forward=False)  # one parameter
        fully_shard(model, reshard_after_forward=False)  # two: copied in and out
        outputs = self._gathered_into(model, torch.randn(2, 4))
        one = model[0]._get_fsdp_state().group.members[0]
        self.assertEqual(len(outputs), 2)
        self.assertIn(_storage(one.gathered), outputs)
        root_members = model._get_fsdp_state().group.members
        self.assertNotIn(_storage(root_members[0].gathered), outputs)


class WrapperViewsTest(FSDPTestMultiThread):
    world_size = 2

    def test_views_come_from_one_split(self):
        torch.manual_seed(0)
        mlp = MLP(4, dim_multiplier=2)
        model = FullyShardedDataParallel(
            mlp, use_orig_params=True, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP
        )
        model(torch.randn(2, 4))  # without resharding after forward, the views stay shown
        for name, param in mlp.named_parameters():
            view = param.grad_fn
            self.assertIsNotNone(view, name)
            piece = view.next_functions[0][0]
            self.assertEqual(type(piece).__name__, "SplitWithSizesBackward0", name)


class OneMemberReduceScatterTest(FSDPTestMultiThread):
    world_size = 2

    def _input_is_gradient(self, model: nn.Module, leaf: Callable[[], torch.Tensor]) -> bool:
        """Whether backward's reduce-scatter reads ``leaf()``'s gradient itself (no copy)."""
        inp = torch.randn(2, 4)
        model(inp).sum().backward()  # the first iteration builds the unsharded tensors
        grads: list[int] = []
        leaf().register_hook(lambda grad: grads.append(_storage(grad)))
        inputs: list[int] = []

        def observe(output, input, op, group):
            inputs.append(_storage(input))

        with observe_reduce_scatters(observe):
            model(inp).sum().backward()
        self.assertEqual((len(grads), len(inputs)), (1, 1))
        return grads == inputs

    def test_wrapper_reduce_scatters_the_flat_gradient(self):
        torch.manual_seed(0)
        model = FullyShardedDataParallel(MLP(4, dim_multiplier=2))  # 76 elements: no padding
        self.assertTrue(self._input_is_gradient(model, lambda: model._handle.unsharded))

    def test_one_parameter_without_padding(self):
        torch.manual_seed(0)
        model = nn.Linear(4, 6, bias=False)  # 6 rows: 3 per rank
        fully_shard(model)
        self.assertTrue(self._input_is_gradient(model, lambda: _unsharded(model)))

    def test_padding_needs_a_copy(self):
        torch.manual_seed(0)
        model = nn.Linear(4, 5, bias=False)  # 5 rows: padded to 6
        fully_shard(model)
        self.assertFalse(self._input_is_gradient(model, lambda: _unsharded(model)))


def _unsharded(model: nn.Module) -> torch.Tensor:
    (member,) = model._get_fsdp_state().group.members
    return member.unsharded_param
