"""Parameters whose tensor subclass gathers itself (``fsdp_pre_all_gather`` /
``fsdp_post_all_gather``), under reffsdp's ``fully_shard`` next to torch's.

See [Note: all-gather extensions] in ``reffsdp/per_param/extensions.py`` for the contract.
Each comparison trains copies of one model, one sharded by each API, on the same inputs:
losses, shards and gradients must be equal bit for bit, and each step must issue the same
collectives with the same bytes (the threaded group reports every collective to
:class:`~reffsdp.testing.comm_counter.CommCounter`, whoever issued it).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import reffsdp
from reffsdp.core.comms import Collective
from reffsdp.core.compat import EXTENSIONS_MAY_RELEASE_OUTPUTS
from reffsdp.core.torch_internals import dtensor_local
from reffsdp.testing.comm_counter import CommCounter
from reffsdp.testing.multithread import FSDPTestMultiThread
from tests.multithread.extension_tensors import (
    Bf16Gathered,
    Bf16GatheredOldForm,
    Fp32Held,
    Int8RowsGathered,
    log,
    wrap_weights,
)

pytestmark = pytest.mark.multithread

AG = Collective.ALL_GATHER
OURS = SimpleNamespace(
    name="reffsdp", fully_shard=reffsdp.fully_shard, mp=reffsdp.MixedPrecisionPolicy
)
THEIRS = SimpleNamespace(
    name="torch", fully_shard=torch_fsdp.fully_shard, mp=torch_fsdp.MixedPrecisionPolicy
)


def mlp_stack(dims: tuple[int, ...] = (8, 16, 8)) -> nn.Sequential:
    """Linear blocks ``dims[0] -> dims[1] -> ...`` with ReLUs between them."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(dims) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def shard(api: SimpleNamespace, model: nn.Sequential, mesh, **kwargs) -> nn.Module:
    """``api.fully_shard`` on every Linear, then on the model, with the same arguments."""
    if "param_dtype" in kwargs:
        kwargs["mp_policy"] = api.mp(param_dtype=kwargs.pop("param_dtype"))
    for layer in model:
        if isinstance(layer, nn.Linear):
            api.fully_shard(layer, mesh=mesh, **kwargs)
    return api.fully_shard(model, mesh=mesh, **kwargs)


def inputs(step: int, rank: int, dim: int = 8) -> torch.Tensor:
    return torch.randn(3, dim, generator=torch.Generator().manual_seed(100 * step + rank))


def local_value(param: torch.Tensor) -> torch.Tensor:
    """A sharded parameter's (or gradient's) local values as a plain tensor."""
    local = param.to_local()
    return local._data if isinstance(local, Fp32Held) else local


class ExtensionChecks:
    """Training next to torch's ``fully_shard``, for either harness (threads or processes)."""

    def twins(self, cls: type[Fp32Held], dims=(8, 16, 8)) -> tuple[nn.Module, nn.Module]:
        model = mlp_stack(dims)
        self.sync_module_states(model)
        wrap_weights(model, cls)
        return model, copy.deepcopy(model)

    def train_both(self, models, steps: int = 3, handshakes: int = 0, **shard_kwargs) -> None:
        """Train ``models`` (ours, theirs) side by side; every step equal, bit for bit.

        ``handshakes``: parameters that some ranks pad, for which reffsdp's first step
        issues one more all-gather of two int64 per rank (rule 2 of [Note: all-gather
        extensions]); nothing else may differ.
        """
        mesh = shard_kwargs.pop("mesh")
        ours = shard(OURS, models[0], mesh, **shard_kwargs)
        theirs = shard(THEIRS, models[1], mesh, **shard_kwargs)
        optims = [torch.optim.Adam(m.parameters(), lr=1e-2, foreach=True) for m in (ours, theirs)]
        for step in range(steps):
            x = inputs(step, self.rank, ours[0].in_features)
            results = []
            for model in (ours, theirs):
                with CommCounter() as counter:
                    loss = model(x).sum()
                    loss.backward()
                results.append((loss.item(), counter.get_comm_counts(), counter.get_comm_bytes()))
            if step == 0 and handshakes:
                _, counts, nbytes = results[0]
                counts[AG] -= handshakes
                nbytes[AG] -= handshakes * 2 * 8 * self.world_size
            self.assertEqual(results[0], results[1], f"step {step}: (loss, counts, bytes)")
            self.assert_same_shards(ours, theirs)
            for optim in optims:
                optim.step()
                optim.zero_grad(set_to_none=step % 2 == 0)
        self.assert_same_shards(ours, theirs)

    def assert_same_shards(self, ours: nn.Module, theirs: nn.Module) -> None:
        pairs = zip(ours.named_parameters(), theirs.named_parameters(), strict=True)
        for (name, param), (_, twin) in pairs:
            self.assertIs(type(param.to_local()), type(twin.to_local()), name)
            self.assertTrue(torch.equal(local_value(param), local_value(twin)), name)
            self.assertEqual(param.grad is None, twin.grad is None, name)
            if param.grad is not None:
                self.assertTrue(torch.equal(local_value(param.grad), local_value(twin.grad)))

    def check_1d_and_hsdp(self, classes=(Bf16Gathered, Bf16GatheredOldForm, Int8RowsGathered)):
        """Every extension class on a 1-D mesh of all ranks and, with 4 ranks or more, on a
        2 x (world size / 2) HSDP mesh; resharding after forward or not."""
        meshes = {"1d": init_device_mesh("cpu", (self.world_size,))}
        if self.world_size >= 4:
            meshes["hsdp"] = init_device_mesh(
                "cpu", (2, self.world_size // 2), mesh_dim_names=("replicate", "shard")
            )
        self.run_subtests(
            {
                "cls": list(classes),
                "mesh_name": list(meshes),
                "reshard_after_forward": [True, False],
            },
            lambda cls, mesh_name, reshard_after_forward: self.train_both(
                self.twins(cls), mesh=meshes[mesh_name], reshard_after_forward=reshard_after_forward
            ),
        )


class TestExtensionsTrainLikeTorch(ExtensionChecks, FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 4

    def test_1d_and_hsdp(self):
        self.check_1d_and_hsdp()

    def test_uneven_shards_padded_by_the_hook(self):
        # 6 and 5 rows over 4 ranks: ranks 2 and 3 pad; the 5-argument hook pads itself.
        mesh = init_device_mesh("cpu", (4,))
        self.train_both(self.twins(Bf16Gathered, dims=(8, 6, 5)), mesh=mesh, handshakes=2)

    def test_param_dtype_is_the_hooks_business(self):
        # FSDP hands the inputs over as the hook made them (int8 and fp32, not bf16) and
        # tells the post hook the param dtype, which builds the unsharded parameter in it.
        mesh = init_device_mesh("cpu", (4,))
        models = self.twins(Int8RowsGathered)
        log().clear()
        self.train_both(models, mesh=mesh, param_dtype=torch.bfloat16, steps=2)
        posts = [facts for hook, facts in log() if hook == "post"]
        self.assertTrue(posts)
        for facts in posts:
            self.assertEqual(facts["dtypes"], [torch.int8, torch.float32])
            self.assertEqual(facts["param_dtype"], torch.bfloat16)

    def test_cpu_offload(self):
        mesh = init_device_mesh("cpu", (4,))
        models = self.twins(Int8RowsGathered)
        ours = shard(
            OURS, models[0], mesh, offload_policy=reffsdp.CPUOffloadPolicy(pin_memory=False)
        )
        theirs = shard(
            THEIRS, models[1], mesh, offload_policy=torch_fsdp.CPUOffloadPolicy(pin_memory=False)
        )
        for step in range(2):
            x = inputs(step, self.rank)
            losses = [m(x).sum() for m in (ours, theirs)]
            for loss in losses:
                loss.backward()
            self.assertEqual(losses[0].item(), losses[1].item())
            self.assert_same_shards(ours, theirs)


class TestExtensionContract(ExtensionChecks, FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_mixed_dtype_inputs_travel_in_one_all_gather_as_bytes(self):
        mesh = init_device_mesh("cpu", (2,))
        model = shard(OURS, self.twins(Int8RowsGathered)[0], mesh, reshard_after_forward=True)
        with CommCounter() as counter:
            model(inputs(0, self.rank))
        # Three groups (two Linears and the root, whose own parameters are none): one
        # all-gather each for the Linears. Per rank: int8 rows plus one fp32 scale a row,
        # and the plain fp32 bias; bytes counted are the output's (world size x input).
        self.assertEqual(counter.get_comm_counts()[AG], 2)
        per_rank = [(8 * 8 + 8 * 4) + 8 * 4, (4 * 16 + 4 * 4) + 4 * 4]
        self.assertEqual(counter.get_comm_bytes()[AG], 2 * sum(per_rank))

    def test_post_hook_builds_once_then_refills_the_same_parameter(self):
        mesh = init_device_mesh("cpu", (2,))
        model = shard(OURS, self.twins(Bf16Gathered, dims=(8, 8))[0], mesh)  # one weight
        layer = model[0]
        log().clear()
        seen = []
        layer.register_forward_pre_hook(lambda module, args: seen.append(module.weight))
        for step in range(3):
            model(inputs(step, self.rank)).sum().backward()
        posts = [facts for hook, facts in log() if hook == "post"]
        self.assertIsNone(posts[0]["out"])  # the first call builds ...
        self.assertTrue(all(facts["out"] is seen[0] for facts in posts[1:]))  # ... then refills
        self.assertTrue(all(weight is seen[0] for weight in seen))
        self.assertEqual(seen[0].dtype, torch.float32)

    def test_reshard_frees_outputs_and_inner_tensors_and_unshard_regrows_them(self):
        mesh = init_device_mesh("cpu", (2,))
        for api in (OURS, THEIRS):
            layer = shard(api, self.twins(Bf16Gathered)[0], mesh)[0]
            log().clear()
            layer.unshard()
            weight = layer.weight
            (_, first), *_ = [entry for entry in log() if entry[0] == "post"]
            buffers = [*first["outputs"], *first["inner"]]
            self.assertTrue(all(t.untyped_storage().size() > 0 for t in buffers), api.name)
            layer.reshard()
            self.assertTrue(all(t.untyped_storage().size() == 0 for t in buffers), api.name)
            layer.unshard()
            self.assertIs(layer.weight, weight, api.name)
            self.assertTrue(all(t.untyped_storage().size() > 0 for t in buffers), api.name)

    def test_hooks_attached_to_a_plain_local_tensor_after_materializing(self):
        # As torch's own test does: meta init, to_empty, then the hooks set on each sharded
        # weight's local tensor as instance methods. They run, and the results match torch's.
        mesh = init_device_mesh("cpu", (2,))
        models = []
        for api in (OURS, THEIRS):
            with torch.device("meta"):
                model = mlp_stack()
            shard(api, model, mesh)
            model.to_empty(device="cpu")
            generator = torch.Generator().manual_seed(self.rank)  # the same shards for both
            for param in model.parameters():
                local = dtensor_local(param)
                local.copy_(torch.rand(local.shape, generator=generator) - 0.5)
            for name, param in model.named_parameters():
                if name.endswith("weight"):  # the DTensor's own local tensor, as torch's test
                    local = dtensor_local(param)
                    local.fsdp_pre_all_gather = _plain_pre.__get__(local)
                    local.fsdp_post_all_gather = _plain_post.__get__(local)
            models.append(model)
        log().clear()
        for step in range(2):
            x = inputs(step, self.rank)
            losses = [m(x).sum() for m in models]
            for loss in losses:
                loss.backward()
            self.assertEqual(losses[0].item(), losses[1].item())
        self.assertTrue(any(hook == "plain-pre" for hook, _ in log()))

    def test_hsdp_pre_hook_sees_the_shard_mesh(self):
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
        model = shard(OURS, self.twins(Bf16Gathered)[0], mesh)
        log().clear()
        model(inputs(0, self.rank))
        meshes = [facts["mesh"] for hook, facts in log() if hook == "pre"]
        self.assertTrue(meshes)
        for seen in meshes:
            self.assertEqual((seen.ndim, seen.size()), (1, 2))
            self.assertEqual(seen.mesh_dim_names, ("shard",))

    def test_one_hook_without_the_other_is_refused_like_torch(self):
        mesh = init_device_mesh("cpu", (2,))
        for api in (OURS, THEIRS):
            model = wrap_weights(mlp_stack(), _PreOnly)
            with self.assertRaises(AssertionError, msg=api.name) as caught:
                api.fully_shard(model, mesh=mesh)
            message = str(caught.exception)
            self.assertIn("Both fsdp_pre_all_gather and fsdp_post_all_gather should be", message)
            if api is OURS:
                self.assertIn("'0.weight'", message)  # names the parameter

    def test_pre_hook_of_another_arity_is_refused_like_torch(self):
        mesh = init_device_mesh("cpu", (2,))
        for api in (OURS, THEIRS):
            model = shard(api, wrap_weights(mlp_stack(), _ThreeArgPre), mesh)
            with self.assertRaises(AssertionError, msg=api.name) as caught:
                model(inputs(0, self.rank))
            self.assertIn("Invalid fsdp_pre_all_gather", str(caught.exception))


class TestMisuseOnFourRanks(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 4

    def test_every_rank_raises_instead_of_hanging(self):
        # 7 rows over 4 ranks: rank 3 has one row, and this hook does not pad it.
        mesh = init_device_mesh("cpu", (4,))
        model = shard(OURS, wrap_weights(mlp_stack((8, 7)), _UnpaddedBf16), mesh)
        with self.assertRaises(AssertionError) as caught:
            model(inputs(0, self.rank))
        message = str(caught.exception)
        self.assertIn("must return all-gather inputs with the padded sharded size (2, 8)", message)
        self.assertIn("shard ranks [3]", message)
        self.assertEqual("(here:" in message, self.rank == 3)

    def test_int_reshard_after_forward_is_refused_like_torch(self):
        # Two gathered outputs: refused when forward reshards; one output: refused when
        # backward would re-run the pre hook on the kept block. Same types as torch's.
        mesh = init_device_mesh("cpu", (4,))
        for cls, error in ((Int8RowsGathered, AssertionError), (Bf16Gathered, NotImplementedError)):
            for api in (OURS, THEIRS):
                model = shard(api, wrap_weights(mlp_stack(), cls), mesh, reshard_after_forward=2)
                with self.assertRaises(error, msg=f"{api.name}, {cls.__name__}"):
                    model(inputs(0, self.rank)).sum().backward()

    @pytest.mark.skipif(
        not EXTENSIONS_MAY_RELEASE_OUTPUTS, reason="torch asks extensions this from 2.15"
    )
    def test_releasing_outputs_with_int_reshard_after_forward_is_refused_like_torch(self):
        mesh = init_device_mesh("cpu", (4,))
        for api in (OURS, THEIRS):
            with self.assertRaises(NotImplementedError, msg=api.name) as caught:
                model = wrap_weights(mlp_stack(), _ReleasingInt8)
                shard(api, model, mesh, reshard_after_forward=2)
                model(inputs(0, self.rank)).sum().backward()
            self.assertIn("reshard_after_forward is an int", str(caught.exception))


@pytest.mark.skipif(
    not EXTENSIONS_MAY_RELEASE_OUTPUTS, reason="torch asks extensions this from 2.15"
)
class TestReleasingOutputsAfterThePostHook(ExtensionChecks, FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_outputs_are_freed_once_built_and_training_matches_torch(self):
        mesh = init_device_mesh("cpu", (2,))
        self.train_both(self.twins(_ReleasingInt8), mesh=mesh, reshard_after_forward=False)
        for api in (OURS, THEIRS):
            layer = shard(api, self.twins(_ReleasingInt8)[0], mesh)[0]
            log().clear()
            layer.unshard()
            (_, first), *_ = [entry for entry in log() if entry[0] == "post"]
            self.assertTrue(all(t.untyped_storage().size() == 0 for t in first["outputs"]))
            self.assertTrue(all(t.untyped_storage().size() > 0 for t in first["inner"]))

    def test_misuse_is_refused_like_torch(self):
        mesh = init_device_mesh("cpu", (2,))
        for api in (OURS, THEIRS):
            with self.assertRaises(AssertionError, msg=api.name) as caught:
                model = shard(api, wrap_weights(mlp_stack(), _ReleaseNotBool), mesh)
                model(inputs(0, self.rank)).sum().backward()
            self.assertIn("must return a bool", str(caught.exception))


# -- hooks for the misuse cases ------------------------------------------------------------


def _plain_pre(self, mesh, outer_size, outer_stride, module, mp_policy):
    log().append(("plain-pre", {}))
    return (self.to(torch.bfloat16),), None


@torch.no_grad()
def _plain_post(self, outputs, metadata, param_dtype, *, out=None):
    (gathered,) = outputs
    if out is not None:
        out.data.copy_(gathered)
        return None
    value = gathered.to(param_dtype)
    return value, (gathered, value)


class _PreOnly(Fp32Held):
    def fsdp_pre_all_gather(self, mesh):
        return (self._data,), None


class _ThreeArgPre(Bf16Gathered):
    def fsdp_pre_all_gather(self, mesh, outer_size, module):
        return (self._data.to(torch.bfloat16),), None


class _UnpaddedBf16(Bf16Gathered):
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return (self._data.to(torch.bfloat16),), None


class _ReleasingInt8(Int8RowsGathered):
    def fsdp_should_release_all_gather_outputs_after_post_all_gather(self) -> bool:
        return True


class _ReleaseNotBool(Int8RowsGathered):
    def fsdp_should_release_all_gather_outputs_after_post_all_gather(self):
        return 1
