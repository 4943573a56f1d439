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

from reffsdp import FSDPModule
from reffsdp.core.sharding import rank_rows
from reffsdp.testing.build import reference_and_model, shard_bottom_up
from reffsdp.testing.inputs import random_inputs, random_tokens
from reffsdp.testing.models import MLP, ConvNet, MLPStack, ModelArgs, Transformer
from reffsdp.testing.multithread import FSDPTestMultiThread
from reffsdp.testing.parity import check_train_parity, sgd_with_momentum

pytestmark = pytest.mark.multithread


_images = random_inputs(2, 3, 6, 6)


def _logsumexp_loss(logits: torch.Tensor) -> torch.Tensor:
    # Nonlinear in the logits, so the output layer's gradient depends on its weights.
    return logits.logsumexp(dim=-1).sum()


class TrainParityChecks:
    """Test bodies that the gloo suite runs too (``tests/multiprocess/test_fully_shard_gloo.py``,
    several in one test, since each of its tests pays for starting the rank processes)."""

    def check_reshard_after_forward(self, reshard_after_forward):
        ref_model, model = reference_and_model(MLPStack(8))
        shard_bottom_up(model, model, reshard_after_forward=reshard_after_forward)
        for name, param in model.named_parameters():
            self.assertIsInstance(param, DTensor, name)
        check_train_parity(self, ref_model, model, random_inputs(2, 8), num_steps=3)

    def check_uneven_sizes(self, dim: int, reshard_after_forward=None):
        # 3 * dim and dim rows rarely divide the world size; the 1-row head leaves every rank
        # but rank 0 without rows.
        ref_model, model = reference_and_model(nn.Sequential(*MLPStack(dim), nn.Linear(dim, 1)))
        shard_bottom_up(model, model[:3], reshard_after_forward=reshard_after_forward)
        for name, param in model.named_parameters():
            start, rows = rank_rows(param.size(0), self.world_size, self.rank)
            self.assertEqual(param.to_local().size(), (rows, *param.size()[1:]), name)
            self.assertTrue(param.to_local().is_contiguous(), name)
        self.assertEqual(model[3].weight.to_local().size(0), 1 if self.rank == 0 else 0)
        check_train_parity(self, ref_model, model, random_inputs(2, dim), num_steps=3)

    def check_transformer(self, weight_tying: bool, checkpoint_activations: bool):
        args = ModelArgs(
            n_layers=2,
            vocab_size=8,
            max_seq_len=8,
            dim=8,
            n_heads=2,
            weight_tying=weight_tying,
            checkpoint_activations=checkpoint_activations,
        )
        ref_model, model = reference_and_model(Transformer(args))
        shard_bottom_up(model, model.layers)
        for name, param in model.named_parameters():
            self.assertIsInstance(param, DTensor, name)
        if weight_tying:
            self.assertIs(model.output.weight, model.tok_embeddings.weight)
        make_tokens = random_tokens(args.vocab_size, 2, 8)
        check_train_parity(
            self, ref_model, model, make_tokens, num_steps=3, loss_fn=_logsumexp_loss
        )
        if weight_tying:  # still tied after training: one tensor, one gradient
            self.assertIs(model.output.weight, model.tok_embeddings.weight)

    def check_shard_placement_fn_dim_1(self):
        def shard_2d_on_dim_1(param: nn.Parameter) -> Shard | None:
            return Shard(1) if param.dim() == 2 else None

        ref_model, model = reference_and_model(MLPStack(8))  # every dim 1 is 8, 24 or 32
        shard_bottom_up(model, model, shard_placement_fn=shard_2d_on_dim_1)
        for name, param in model.named_parameters():
            expected = Shard(1) if param.dim() == 2 else Shard(0)
            self.assertEqual(param.placements, (expected,), name)
        check_train_parity(self, ref_model, model, random_inputs(2, 8), num_steps=3)


class TestFullyShardTrainParity(TrainParityChecks, FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_reshard_after_forward(self):
        values = [True, False, None] + ([2] if self.world_size == 4 else [])
        self.run_subtests({"reshard_after_forward": values}, self.check_reshard_after_forward)

    def test_uneven_sizes_with_padding(self):
        self.run_subtests({"dim": [5, 7]}, self.check_uneven_sizes)

    def test_transformer(self):
        self.run_subtests(
            {"weight_tying": [True, False], "checkpoint_activations": [False, True]},
            self.check_transformer,
        )

    def test_shard_placement_fn_dim_1(self):
        self.check_shard_placement_fn_dim_1()

    def test_convnet(self):
        ref_model, model = reference_and_model(ConvNet(width=4))
        shard_bottom_up(model, [model.conv1, model.conv2])
        self.assertEqual(model.conv2.weight.size(), (8, 4, 3, 3))
        check_train_parity(self, ref_model, model, _images, num_steps=3)

    def test_root_without_params_of_its_own(self):
        ref_model, model = reference_and_model(nn.Sequential(MLP(8), MLP(8)))
        shard_bottom_up(model, model)
        self.assertEqual(list(model.named_parameters(recurse=False)), [])
        check_train_parity(self, ref_model, model, random_inputs(2, 8), num_steps=3)

    def test_modules_without_params(self):
        model = nn.Sequential(MLP(8), nn.ReLU(), nn.Dropout(0.0), MLP(8))
        ref_model, model = reference_and_model(model)
        shard_bottom_up(model, model)  # also the parameter-free ReLU and Dropout
        self.assertIsInstance(model[1], FSDPModule)
        check_train_parity(self, ref_model, model, random_inputs(2, 8), num_steps=3)

    def test_buffers(self):
        model = nn.Sequential(MLP(8, with_buffer=True), MLP(8, with_buffer=True))
        ref_model, model = reference_and_model(model)
        shard_bottom_up(model, model)
        for name, buffer in model.named_buffers():
            self.assertNotIsInstance(buffer, DTensor, name)
            torch.testing.assert_close(buffer, ref_model.get_buffer(name), rtol=0, atol=0)
        check_train_parity(self, ref_model, model, random_inputs(2, 8), num_steps=3)


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
        shard_bottom_up(model, model, mesh=init_device_mesh("cpu", (1,)))
        ref_optim = sgd_with_momentum(ref_model.parameters())
        optim = sgd_with_momentum(model.parameters())
        make_inputs = random_inputs(2, 5)
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
