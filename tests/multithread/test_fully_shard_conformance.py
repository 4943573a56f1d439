"""``fully_shard`` matches torch's on the threaded process group: grouped-call collective
counts and gradients, parameters replaced between ``fully_shard`` and the first forward, and
a first forward run inside ``torch.func.jvp``.

Each check runs torch's own ``fully_shard`` on a copy of the same model, counted the same way
(:class:`~reffsdp.testing.comm_counter.CommCounter` sees both: the threaded group reports
every collective, whoever issued it).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from reffsdp import MixedPrecisionPolicy, fully_shard
from reffsdp.core.comms import Collective
from reffsdp.core.compat import TORCH_VERSION
from reffsdp.testing.comm_counter import CommCounter
from reffsdp.testing.models import ModelArgs, Transformer
from reffsdp.testing.multithread import FSDPTestMultiThread

pytestmark = pytest.mark.multithread

AG, RS = Collective.ALL_GATHER, Collective.REDUCE_SCATTER
DIM = 6


class GroupedInTheMiddle(nn.Module):
    """``proj -> a -> mid -> b -> head``, where ``a`` and ``b`` are sharded by one call.

    The root owns ``proj``, ``mid`` and ``head``, so an iteration has two groups: the
    root's and ``[a, b]``'s.
    """

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.a = nn.Linear(DIM, DIM)
        self.mid = nn.Linear(DIM, DIM)
        self.b = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.a(self.proj(x)))
        return self.head(self.b(torch.relu(self.mid(x))))


class TiedEnds(nn.Module):
    """An embedding and an output layer sharing one weight, as in a language model.

    ``fully_shard([emb, out])`` opens the group at ``emb``, whose integer inputs need no
    gradient, so the group's reduce-scatter waits for the end of backward (as in torch).
    """

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, DIM)
        self.block = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, 10, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.block(self.emb(tokens))))


def _shard_grouped(shard: Callable, model: nn.Module, mesh, reshard_after_forward):
    kwargs = dict(mesh=mesh, reshard_after_forward=reshard_after_forward)
    if isinstance(model, TiedEnds):
        shard(model.block, **kwargs)
        shard([model.emb, model.out], **kwargs)
    else:
        shard([model.a, model.b], **kwargs)
    shard(model, **kwargs)


def _inputs(model: nn.Module, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if isinstance(model, TiedEnds):
        return torch.randint(0, 10, (3,), generator=generator)
    return torch.randn(3, DIM, generator=generator)


def _counts_per_step(model: nn.Module, rank: int, num_steps: int = 2) -> list[tuple[dict, dict]]:
    """``(forward counts, backward counts)`` of each training step."""
    counts = []
    for step in range(num_steps):
        x = _inputs(model, 10 * step + rank)
        with CommCounter() as forward:
            loss = model(x).sum()
        with CommCounter() as backward:
            loss.backward()
        counts.append((dict(forward.get_comm_counts()), dict(backward.get_comm_counts())))
    return counts


class TestGroupedFullyShardLikeTorch(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def _models(self, model_cls: type[nn.Module]) -> tuple[nn.Module, nn.Module]:
        model = model_cls()
        self.sync_module_states(model)
        return model, copy.deepcopy(model)

    def test_one_all_gather_and_reduce_scatter_per_group_in_backward(self):
        self.run_subtests(
            {
                "model_cls": [GroupedInTheMiddle, TiedEnds],
                "reshard_after_forward": [True, False, None],
            },
            self._check_grouped_counts,
        )

    def _check_grouped_counts(self, model_cls, reshard_after_forward):
        mesh = init_device_mesh("cpu", (self.world_size,))
        model, ref_model = self._models(model_cls)
        _shard_grouped(fully_shard, model, mesh, reshard_after_forward)
        _shard_grouped(torch_fully_shard, ref_model, mesh, reshard_after_forward)
        # Two groups with parameters. Backward re-gathers those resharded after forward:
        # both for True, none for False, for None all but the root's own parameters.
        backward_ag = {True: 2, False: 0, None: 1}[reshard_after_forward]
        if model_cls is TiedEnds and reshard_after_forward is None:
            backward_ag = 2  # the root has no parameters of its own
        expected = {AG: backward_ag, RS: 2} if backward_ag else {RS: 2}
        ref_counts = _counts_per_step(ref_model, self.rank)
        self.assertEqual(ref_counts, [({AG: 2}, expected)] * 2)  # torch, as measured
        self.assertEqual(_counts_per_step(model, self.rank), ref_counts)

    def test_gradients_match_torch(self):
        self.run_subtests(
            {
                "model_cls": [GroupedInTheMiddle, TiedEnds],
                "reshard_after_forward": [True, False],
            },
            self._check_grouped_grads,
        )

    def _check_grouped_grads(self, model_cls, reshard_after_forward):
        mesh = init_device_mesh("cpu", (self.world_size,))
        model, ref_model = self._models(model_cls)
        _shard_grouped(fully_shard, model, mesh, reshard_after_forward)
        _shard_grouped(torch_fully_shard, ref_model, mesh, reshard_after_forward)
        for step in range(2):
            x = _inputs(model, step + 10 * self.rank)
            model(x).sum().backward()
            ref_model(x).sum().backward()
        for (name, param), ref_param in zip(model.named_parameters(), ref_model.parameters()):
            self.assertIsInstance(param.grad, DTensor)
            torch.testing.assert_close(param.grad.to_local(), ref_param.grad.to_local(), msg=name)


class TestReplacedParamsLikeTorch(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_plain_replacement_is_sharded_at_lazy_init(self):
        mesh = init_device_mesh("cpu", (self.world_size,))
        model = nn.Sequential(nn.Linear(DIM, 5), nn.ReLU(), nn.Linear(5, DIM))
        self.sync_module_states(model)
        ref = copy.deepcopy(model)
        fully_shard(model, mesh=mesh)
        new_weight = torch.arange(5.0 * DIM).view(5, DIM) / 10  # the same on every rank
        model[0].weight = nn.Parameter(new_weight.clone())
        ref[0].weight = nn.Parameter(new_weight.clone())
        x = torch.randn(3, DIM, generator=torch.Generator().manual_seed(self.rank))
        out = model(x)
        torch.testing.assert_close(out, ref(x))
        out.sum().backward()
        model.reshard()  # the root keeps its parameters unsharded after forward
        weight = model[0].weight
        self.assertIsInstance(weight, DTensor)
        self.assertEqual(weight.placements, (Shard(0),))
        rows = new_weight.chunk(self.world_size)[self.rank]  # 3 rows, then 2
        torch.testing.assert_close(weight.to_local(), rows)
        torch.testing.assert_close(weight.full_tensor(), new_weight)
        self.assertIsInstance(weight.grad, DTensor)
        self.assertEqual(weight.grad.to_local().shape, rows.shape)

    def test_dtensor_replacement_matches_torch(self):
        mesh = init_device_mesh("cpu", (self.world_size,))
        model = nn.Sequential(nn.Linear(DIM, 5), nn.ReLU(), nn.Linear(5, DIM))
        self.sync_module_states(model)
        ref = copy.deepcopy(model)
        fully_shard(model, mesh=mesh)
        torch_fully_shard(ref, mesh=mesh)
        new_weight = torch.arange(5.0 * DIM).view(5, DIM) / 10
        for module in (model, ref):
            module[0].weight = nn.Parameter(distribute_tensor(new_weight, mesh, [Shard(0)]))
        x = torch.randn(3, DIM, generator=torch.Generator().manual_seed(self.rank))
        out, ref_out = model(x), ref(x)
        torch.testing.assert_close(out, ref_out)
        out.sum().backward()
        ref_out.sum().backward()
        for (name, param), ref_param in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(param.grad.to_local(), ref_param.grad.to_local(), msg=name)

    def test_assign_load_of_tied_weights_matches_torch(self):
        self.run_subtests({"grouped": [False, True]}, self._check_assign_load_of_tied_weights)

    def _check_assign_load_of_tied_weights(self, grouped: bool):
        """``load_state_dict(assign=True)`` into a meta-device model whose output layer reuses
        the embedding table (one new parameter per name), then training, as torch does."""
        args = ModelArgs(weight_tying=True)
        source = Transformer(args)
        self.sync_module_states(source)
        full = source.state_dict()
        mesh = init_device_mesh("cpu", (self.world_size,))
        models = []
        for shard in (fully_shard, torch_fully_shard):
            with torch.device("meta"):
                model = Transformer(args)
            if grouped:
                shard([model.tok_embeddings, model.output], mesh=mesh)
            for layer in model.layers:
                shard(layer, mesh=mesh)
            shard(model, mesh=mesh)
            sharded = {
                name: nn.Parameter(
                    distribute_tensor(full[name], mesh, value.placements, src_data_rank=None)
                )
                for name, value in model.state_dict().items()
            }
            model.load_state_dict(sharded, assign=True)
            models.append(model)
        model, ref = models
        optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
        for step in range(3):
            tokens = torch.randint(
                0,
                args.vocab_size,
                (2, 8),
                generator=torch.Generator().manual_seed(10 * step + self.rank),
            )
            losses = [m(tokens).sum() for m in models]
            torch.testing.assert_close(losses[0], losses[1])
            for loss, optim in zip(losses, optims):
                loss.backward()
                optim.step()
                optim.zero_grad()
        self.assertIs(model.output.weight, model.tok_embeddings.weight)
        for (name, param), ref_param in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(param.to_local(), ref_param.to_local(), msg=name)


class TestFirstForwardUnderJvpLikeTorch(FSDPTestMultiThread):
    """Lazy init may run inside a functorch transform: nothing ran a forward before
    ``torch.func.jvp`` called the model, so the parameters are first gathered there."""

    @property
    def world_size(self) -> int:
        return 2

    def test_jvp_without_a_warm_up_forward_matches_torch(self):
        mesh = init_device_mesh("cpu", (self.world_size,))
        torch.manual_seed(0)
        weights = (torch.randn(DIM, 4), torch.randn(5, DIM))  # the same on every rank
        results = []
        implementations = [(fully_shard, MixedPrecisionPolicy)]
        # torch's own fully_shard raises here before 2.13 (Cannot access storage of
        # TensorWrapper, in its all-gather copy-out): compare with it where it runs.
        if TORCH_VERSION >= (2, 13):
            implementations.append((torch_fully_shard, TorchMixedPrecisionPolicy))
        for shard, policy in implementations:
            with torch.device("meta"):
                encoder = nn.Linear(4, DIM, bias=False)
                decoder = nn.Linear(DIM, 5, bias=False)
            for module, weight in ((encoder, weights[0]), (decoder, weights[1])):
                shard(
                    module,
                    mesh=mesh,
                    reshard_after_forward=False,
                    mp_policy=policy(param_dtype=torch.bfloat16),
                )
                module.to_empty(device="cpu")
                with torch.no_grad():
                    module.weight.copy_(distribute_tensor(weight, mesh, [Shard(0)]))
            hidden = encoder(torch.ones(4))
            primal, tangent = torch.ones(3, requires_grad=True), torch.ones(3)
            # The function ignores its input: the tangent of the output is zero.
            run = lambda _, decoder=decoder, hidden=hidden: decoder(hidden)  # noqa: E731
            out, out_tangent = torch.func.jvp(run, (primal,), (tangent,))
            self.assertEqual(out.dtype, torch.bfloat16)
            results.append((out, out_tangent))
        (out, out_tangent), *reference = results
        torch.testing.assert_close(out_tangent, torch.zeros_like(out))
        for ref_out, ref_tangent in reference:
            torch.testing.assert_close(out, ref_out)
            torch.testing.assert_close(out_tangent, ref_tangent)
