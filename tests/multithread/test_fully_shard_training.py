"""``fully_shard`` on a 1D mesh trains exactly like DDP: the model zoo and the sharding knobs.

Every test builds a model, copies it as the reference, shards the original bottom-up (blocks
first, then the root) and runs :func:`check_train_parity`, which compares losses, gradients
and parameters with a DDP copy at every step, in fp32. The same tests run on 2 and on 4
ranks; 4 ranks add ``reshard_after_forward=2`` and parameters of which some ranks own no rows.
"""

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from reffsdp import FSDPModule, fully_shard
from reffsdp.core.sharding import rank_rows
from reffsdp.testing.inputs import random_inputs, random_tokens
from reffsdp.testing.models import MLP, ConvNet, MLPStack, ModelArgs, Transformer
from reffsdp.testing.multithread import FSDPTestMultiThread
from reffsdp.testing.parity import check_train_parity

pytestmark = pytest.mark.multithread


def _vectors(dim: int, batch: int = 2):
    return random_inputs(batch, dim)


def _tokens(vocab_size: int, seq_len: int = 8, batch: int = 2):
    return random_tokens(vocab_size, batch, seq_len)


_images = random_inputs(2, 3, 6, 6)


def _logsumexp_loss(logits: torch.Tensor) -> torch.Tensor:
    # Nonlinear in the logits, so the output layer's gradient depends on its weights.
    return logits.logsumexp(dim=-1).sum()


class TestFullyShardTrainParity(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def _ref_and_model(self, model: nn.Module) -> tuple[nn.Module, nn.Module]:
        self.sync_module_states(model)
        return copy.deepcopy(model), model

    def test_reshard_after_forward(self):
        values = [True, False, None] + ([2] if self.world_size == 4 else [])
        self.run_subtests({"reshard_after_forward": values}, self._test_reshard_after_forward)

    def _test_reshard_after_forward(self, reshard_after_forward):
        ref_model, model = self._ref_and_model(MLPStack(8))
        for block in model:
            fully_shard(block, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        check_train_parity(self, ref_model, model, _vectors(8), num_steps=3)

    def test_uneven_sizes_with_padding(self):
        self.run_subtests({"dim": [5, 7]}, self._test_uneven_sizes)

    def _test_uneven_sizes(self, dim: int):
        # 3 * dim and dim rows rarely divide the world size; the 1-row head leaves every rank
        # but rank 0 without rows.
        model = nn.Sequential(*MLPStack(dim), nn.Linear(dim, 1))
        ref_model, model = self._ref_and_model(model)
        for block in model[:3]:
            fully_shard(block)
        fully_shard(model)
        for name, param in model.named_parameters():
            start, rows = rank_rows(param.size(0), self.world_size, self.rank)
            self.assertEqual(param.to_local().size(), (rows, *param.size()[1:]), name)
            self.assertTrue(param.to_local().is_contiguous(), name)
        self.assertEqual(model[3].weight.to_local().size(0), 1 if self.rank == 0 else 0)
        check_train_parity(self, ref_model, model, _vectors(dim), num_steps=3)

    def test_transformer(self):
        self.run_subtests(
            {"weight_tying": [True, False], "checkpoint_activations": [False, True]},
            self._test_transformer,
        )

    def _test_transformer(self, weight_tying: bool, checkpoint_activations: bool):
        args = ModelArgs(
            n_layers=2,
            vocab_size=8,
            max_seq_len=8,
            dim=8,
            n_heads=2,
            weight_tying=weight_tying,
            checkpoint_activations=checkpoint_activations,
        )
        ref_model, model = self._ref_and_model(Transformer(args))
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        if weight_tying:
            self.assertIs(model.output.weight, model.tok_embeddings.weight)
            self.assertIsInstance(model.output.weight, DTensor)
        check_train_parity(
            self, ref_model, model, _tokens(args.vocab_size), num_steps=3, loss_fn=_logsumexp_loss
        )
        if weight_tying:  # still tied after training: one tensor, one gradient
            self.assertIs(model.output.weight, model.tok_embeddings.weight)

    def test_convnet(self):
        ref_model, model = self._ref_and_model(ConvNet(width=4))
        fully_shard(model.conv1)
        fully_shard(model.conv2)
        fully_shard(model)
        self.assertEqual(model.conv2.weight.size(), (8, 4, 3, 3))
        check_train_parity(self, ref_model, model, _images, num_steps=3)

    def test_root_without_params_of_its_own(self):
        ref_model, model = self._ref_and_model(nn.Sequential(MLP(8), MLP(8)))
        for block in model:
            fully_shard(block)
        fully_shard(model)
        self.assertEqual(list(model.named_parameters(recurse=False)), [])
        check_train_parity(self, ref_model, model, _vectors(8), num_steps=3)

    def test_modules_without_params(self):
        model = nn.Sequential(MLP(8), nn.ReLU(), nn.Dropout(0.0), MLP(8))
        ref_model, model = self._ref_and_model(model)
        for block in model:
            fully_shard(block)  # also the parameter-free ReLU and Dropout
        fully_shard(model)
        self.assertIsInstance(model[1], FSDPModule)
        check_train_parity(self, ref_model, model, _vectors(8), num_steps=3)

    def test_buffers(self):
        model = nn.Sequential(MLP(8, with_buffer=True), MLP(8, with_buffer=True))
        ref_model, model = self._ref_and_model(model)
        for block in model:
            fully_shard(block)
        fully_shard(model)
        for name, buffer in model.named_buffers():
            self.assertNotIsInstance(buffer, DTensor, name)
            torch.testing.assert_close(buffer, ref_model.get_buffer(name), rtol=0, atol=0)
        check_train_parity(self, ref_model, model, _vectors(8), num_steps=3)

    def test_shard_placement_fn_dim_1(self):
        def shard_2d_on_dim_1(param: nn.Parameter) -> Shard | None:
            return Shard(1) if param.dim() == 2 else None

        ref_model, model = self._ref_and_model(MLPStack(8))  # every dim 1 is 8, 24 or 32
        for block in model:
            fully_shard(block, shard_placement_fn=shard_2d_on_dim_1)
        fully_shard(model, shard_placement_fn=shard_2d_on_dim_1)
        for name, param in model.named_parameters():
            expected = Shard(1) if param.dim() == 2 else Shard(0)
            self.assertEqual(param.placements, (expected,), name)
        check_train_parity(self, ref_model, model, _vectors(8), num_steps=3)


class TestFullyShardTrainParityWorldSize4(TestFullyShardTrainParity):
    @property
    def world_size(self) -> int:
        return 4


class TestFullyShardWorldSize1(FSDPTestMultiThread):
    """One rank: no collectives, yet DTensor parameters and gradients, and plain training."""

    @property
    def world_size(self) -> int:
        return 1

    def test_trains_like_a_local_model(self):
        ref_model = MLPStack(5)
        model = copy.deepcopy(ref_model)
        mesh = init_device_mesh("cpu", (1,))
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        ref_optim = torch.optim.SGD(ref_model.parameters(), lr=1e-2, momentum=0.9)
        optim = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        make_inputs = _vectors(5)
        for step in range(3):
            inputs = make_inputs(step, 0)
            losses = []
            for m, opt in ((ref_model, ref_optim), (model, optim)):
                opt.zero_grad()
                loss = m(inputs).sum()
                loss.backward()
                losses.append(loss.detach())
            torch.testing.assert_close(losses[1], losses[0])
            for (name, ref_param), param in zip(ref_model.named_parameters(), model.parameters()):
                self.assertIsInstance(param, DTensor, name)
                self.assertEqual(param.placements, (Shard(0),), name)
                self.assertEqual(param.device_mesh.size(), 1, name)
                self.assertIsInstance(param.grad, DTensor, name)
                self.assertEqual(param.grad.placements, (Shard(0),), name)
                torch.testing.assert_close(param.grad.to_local(), ref_param.grad)
            ref_optim.step()
            optim.step()
            for ref_param, param in zip(ref_model.parameters(), model.parameters()):
                torch.testing.assert_close(param.to_local(), ref_param.detach())
