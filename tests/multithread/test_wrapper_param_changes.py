"""``FullyShardedDataParallel`` when the user changes parameters after wrapping.

Freezing parameters, moving the model to another dtype, assigning to an original
parameter's ``.data`` or replacing it, reading gradients inside ``no_sync()``: each is
checked against ``DistributedDataParallel`` or an unsharded copy changed the same way, and
against torch's own wrapper (``device_id=cpu``) where it supports the change; the tests
say where torch's wrapper fails or behaves otherwise.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchScaler
from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy
from torch.nn.parallel import DistributedDataParallel as DDP

from reffsdp import FullyShardedDataParallel, ShardingStrategy
from reffsdp.sharded_grad_scaler import ShardedGradScaler
from reffsdp.testing.build import reference_and_model, wrap_blocks
from reffsdp.testing.inputs import random_inputs
from reffsdp.testing.models import MLP, MLPBlocks, init_deterministic
from reffsdp.testing.multithread import FSDPTestMultiThread
from reffsdp.testing.parity import check_train_parity, sgd_with_momentum

pytestmark = pytest.mark.multithread

DIM = 5
make_inputs = random_inputs(3, DIM)
S = ShardingStrategy
STRATEGIES = [S.FULL_SHARD, S.SHARD_GRAD_OP, S.NO_SHARD]


def blocks_model() -> MLPBlocks:
    return init_deterministic(MLPBlocks(DIM))


def torch_wrapped(model: nn.Module, strategy: ShardingStrategy, **kwargs) -> TorchFSDP:
    """``model`` wrapped by torch's wrapper, an instance per MLP block, on the CPU."""
    return TorchFSDP(
        model,
        auto_wrap_policy=TorchPolicy({MLP}),
        sharding_strategy=TorchStrategy[strategy.name],
        device_id=torch.device("cpu"),
        **kwargs,
    )


def full_params(wrapper_cls: type, model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of ``model`` whole, by its original name (clones)."""
    with wrapper_cls.summon_full_params(model):
        return {
            name.replace("_fsdp_wrapped_module.", ""): param.detach().clone()
            for name, param in model.named_parameters()
        }


def train(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    num_steps: int,
    scaler=None,
    *,
    dtype: torch.dtype = torch.float32,
    first_step: int = 0,
) -> None:
    for step in range(first_step, first_step + num_steps):
        optim.zero_grad()
        loss = model(make_inputs(step, torch.distributed.get_rank()).to(dtype)).sum()
        if scaler is None:
            loss.backward()
            optim.step()
            continue
        scaler.scale(loss).backward()
        scaler.step(optim)
        scaler.update()


class TestFreezingAfterWrapping(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_frozen_block_stays_frozen_like_ddp_and_torch(self):
        """torch's test_freezing_weights(freeze_after_wrap_fsdp=True): ``requires_grad_(False)``
        on a wrapped block (its flat parameter, or its originals) after wrapping."""
        self.run_subtests(
            {"strategy": STRATEGIES, "use_orig_params": [False, True]}, self._check_frozen_block
        )

    def _check_frozen_block(self, strategy, use_orig_params):
        ref_model, model = reference_and_model(blocks_model())
        torch_model = torch_wrapped(copy.deepcopy(model), strategy, use_orig_params=use_orig_params)
        ref_model.layers[0].requires_grad_(False)
        wrapped = wrap_blocks(
            model, {MLP}, sharding_strategy=strategy, use_orig_params=use_orig_params
        )
        initial = full_params(FullyShardedDataParallel, wrapped)
        for module in (wrapped, torch_model):
            module.layers[0].requires_grad_(False)
        check_train_parity(self, ref_model, wrapped, make_inputs, num_steps=2)
        train(torch_model, sgd_with_momentum(torch_model.parameters()), 2)
        ours = full_params(FullyShardedDataParallel, wrapped)
        theirs = full_params(TorchFSDP, torch_model)
        for name, param in ours.items():
            torch.testing.assert_close(param, theirs[name], msg=name)
            frozen = name.startswith("layers.0.")
            self.assertEqual(torch.equal(param, initial[name]), frozen, name)

    def test_frozen_biases_in_one_flat_parameter_like_ddp(self):
        """torch's test_diff_trainability: biases frozen after wrapping with
        ``use_orig_params=True``, one flat parameter holding weights and biases, Adam."""
        self.run_subtests({"strategy": STRATEGIES}, self._check_frozen_biases)

    def _check_frozen_biases(self, strategy):
        ref_model, model = reference_and_model(blocks_model())
        for name, param in ref_model.named_parameters():
            param.requires_grad_("bias" not in name)
        wrapped = FullyShardedDataParallel(model, sharding_strategy=strategy, use_orig_params=True)
        self._assert_shard_holds_a_weight_and_a_bias(wrapped)
        for name, param in wrapped.named_parameters():
            param.requires_grad_("bias" not in name)
        check_train_parity(
            self,
            ref_model,
            wrapped,
            make_inputs,
            num_steps=3,
            optimizer_factory=lambda params: torch.optim.Adam(params, lr=1e-2),
        )

    def _assert_shard_holds_a_weight_and_a_bias(self, wrapped):
        held = [n for n, p in wrapped.named_parameters() if p.numel() > 0]
        self.assertTrue(any("bias" in n for n in held) and any("weight" in n for n in held))

    def test_frozen_biases_under_a_grad_scaler_like_ddp(self):
        """The same freezing, steps taken through ``ShardedGradScaler``; torch's wrapper and
        scaler land on DDP's parameters too."""
        ref_model, model = reference_and_model(blocks_model())
        torch_model = TorchFSDP(
            copy.deepcopy(model), use_orig_params=True, device_id=torch.device("cpu")
        )
        for name, param in ref_model.named_parameters():
            param.requires_grad_("bias" not in name)
        ddp = DDP(ref_model)
        wrapped = FullyShardedDataParallel(model, use_orig_params=True)
        for module in (wrapped, torch_model):
            for name, param in module.named_parameters():
                param.requires_grad_("bias" not in name)
        runs = [
            (ddp, torch.amp.GradScaler("cpu", init_scale=2.0**10)),
            (wrapped, ShardedGradScaler("cpu", init_scale=2.0**10)),
            (torch_model, TorchScaler("cpu", init_scale=2.0**10)),
        ]
        for module, scaler in runs:
            train(module, torch.optim.Adam(module.parameters(), lr=1e-2), 3, scaler)
        expected = {name: param.detach() for name, param in ref_model.named_parameters()}
        for wrapper_cls, module in ((FullyShardedDataParallel, wrapped), (TorchFSDP, torch_model)):
            for name, param in full_params(wrapper_cls, module).items():
                torch.testing.assert_close(param, expected[name], msg=f"{wrapper_cls}: {name}")


def data_parallel_step(model: nn.Module, optim: torch.optim.Optimizer, step: int, dtype) -> None:
    """One step of ``world_size`` ranks' data parallelism on one unsharded model: each
    rank's loss divided by the world size, so the gradient is the ranks' average."""
    world_size = torch.distributed.get_world_size()
    optim.zero_grad()
    for rank in range(world_size):
        (model(make_inputs(step, rank).to(dtype)).sum() / world_size).backward()
    optim.step()


class TestDtypeMovesAfterWrapping(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_half_or_double_before_the_first_forward_like_torch(self):
        """torch's test_basic_save_and_load_state_dict[fp16=True] calls ``model.half()`` on a
        wrapped model; the flat parameters take the new dtype, and an optimizer built before
        the move keeps training them."""
        self.run_subtests(
            {
                "dtype": [torch.float16, torch.float64],
                "use_orig_params": [False, True],
                "strategy": [S.FULL_SHARD, S.NO_SHARD],
            },
            self._check_move_before_forward,
        )

    def _check_move_before_forward(self, dtype, use_orig_params, strategy):
        _, model = reference_and_model(blocks_model())
        torch_model = torch_wrapped(copy.deepcopy(model), strategy, use_orig_params=use_orig_params)
        wrapped = wrap_blocks(
            model, {MLP}, sharding_strategy=strategy, use_orig_params=use_orig_params
        )
        for module in (wrapped, torch_model):
            optim = torch.optim.SGD(module.parameters(), lr=0.1)
            module.half() if dtype is torch.float16 else module.to(dtype)
            self.assertEqual({p.dtype for p in module.parameters()}, {dtype})
            train(module, optim, 2, dtype=dtype)
        theirs = full_params(TorchFSDP, torch_model)
        for name, param in full_params(FullyShardedDataParallel, wrapped).items():
            self.assertEqual(param.dtype, dtype, name)
            torch.testing.assert_close(param, theirs[name], msg=name)

    def test_double_after_training_like_data_parallel(self):
        """Between steps too (torch's wrapper fails there): the next forward computes in
        the new dtype and the optimizer steps the moved shards."""
        self.run_subtests(
            {"use_orig_params": [False, True], "strategy": [S.FULL_SHARD, S.SHARD_GRAD_OP]},
            self._check_move_after_training,
        )

    def _check_move_after_training(self, use_orig_params, strategy):
        ref_model, model = reference_and_model(blocks_model())
        wrapped = wrap_blocks(
            model, {MLP}, sharding_strategy=strategy, use_orig_params=use_orig_params
        )
        ref_optim = torch.optim.SGD(ref_model.parameters(), lr=0.1)
        optim = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        for step, dtype in enumerate((torch.float32, torch.float64, torch.float64)):
            if step == 1:
                ref_model.to(dtype)
                wrapped.to(dtype)
            data_parallel_step(ref_model, ref_optim, step, dtype)
            train(wrapped, optim, 1, dtype=dtype, first_step=step)
        expected = dict(ref_model.named_parameters())
        for name, param in full_params(FullyShardedDataParallel, wrapped).items():
            self.assertEqual(param.dtype, torch.float64, name)
            torch.testing.assert_close(param, expected[name].detach(), msg=name)

    def test_moving_to_another_device_is_refused(self):
        """The shard's device is the constructor's to choose; a move elsewhere would leave
        the shard and the compute device apart. The refused move leaves a working model."""
        for use_orig_params in (False, True):
            wrapped = FullyShardedDataParallel(nn.Linear(4, 4), use_orig_params=use_orig_params)
            with self.assertRaisesRegex(ValueError, r"FullyShardedDataParallel\(Linear\).*meta"):
                wrapped.to("meta")
            wrapped(torch.ones(2, 4)).sum().backward()
            self.assertEqual({p.device.type for p in wrapped.parameters()}, {"cpu"})

    @pytest.mark.gpu
    def test_a_refused_move_to_the_gpu_is_undone(self):
        """Unlike a move to meta, one to CUDA gives the flat parameter itself the moved data;
        refused, it is taken back."""
        for use_orig_params in (False, True):
            wrapped = FullyShardedDataParallel(
                nn.Linear(4, 4), use_orig_params=use_orig_params, device_id=torch.device("cpu")
            )
            with self.assertRaisesRegex(ValueError, r"FullyShardedDataParallel\(Linear\).*cuda"):
                wrapped.cuda()
            self.assertEqual({p.device.type for p in wrapped.parameters()}, {"cpu"})
            wrapped(torch.ones(2, 4)).sum().backward()


class TwoLinears(nn.Module):
    """torch's writeback model. With ``use_orig_params=True`` on two ranks rank 0 holds
    ``lin1`` and the first elements of ``lin2.weight``, rank 1 the rest of ``lin2``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(5, 5)
        self.lin2 = nn.Linear(5, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.relu(self.lin1(x)))


def twins(test: FSDPTestMultiThread) -> tuple[nn.Module, FullyShardedDataParallel, TorchFSDP]:
    """An unsharded reference and the same model wrapped by reffsdp and by torch
    (``use_orig_params=True``, one instance each)."""
    ref = TwoLinears()
    test.sync_module_states(ref)
    ours = FullyShardedDataParallel(copy.deepcopy(ref), use_orig_params=True)
    theirs = TorchFSDP(copy.deepcopy(ref), use_orig_params=True, device_id=torch.device("cpu"))
    return ref, ours, theirs


class TestOriginalParameterWriteback(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_new_data_or_in_place_edits_are_written_back_like_torch(self):
        """torch's test_param_writeback (``.data`` assigned) and in-place edits, before the
        first forward and after a step: later forwards and the shards see the new values."""
        self.run_subtests(
            {
                "name": ["lin1.weight", "lin2.weight"],
                "edit": ["data", "in_place"],
                "after_step": [False, True],
            },
            self._check_writeback,
        )

    def _check_writeback(self, name, edit, after_step):
        ref, ours, theirs = twins(self)
        optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ours, theirs)]
        steps = [0, 1] if after_step else [0]
        for step in steps[:-1]:
            self._step_all(ref, ours, theirs, optims, step)
        with torch.no_grad():
            ref.get_parameter(name).fill_(2.0)
            for module in (ours.module, theirs.module):
                param = module.get_parameter(name)
                if edit == "data":
                    param.data = torch.full_like(param, 2.0)
                else:
                    param.fill_(2.0)
        self._step_all(ref, ours, theirs, optims, steps[-1])
        expected = dict(ref.named_parameters())
        for wrapper_cls, module in ((FullyShardedDataParallel, ours), (TorchFSDP, theirs)):
            for key, param in full_params(wrapper_cls, module).items():
                torch.testing.assert_close(param, expected[key].detach(), msg=key)

    def _step_all(self, ref, ours, theirs, optims, step):
        data_parallel_step(ref, optims[0], step, torch.float32)
        for module, optim in zip((ours, theirs), optims[1:]):
            train(module, optim, 1, first_step=step)

    def test_writeback_of_another_shape_raises_like_torch(self):
        """torch's test_writeback_shape_mismatch: each rank replaces a weight it holds a
        piece of with a larger one before the first forward; and ``.data`` of another shape
        assigned after a forward."""
        self.run_subtests({"replace": [True, False]}, self._check_shape_mismatch)

    def _check_shape_mismatch(self, replace):
        _, ours, theirs = twins(self)
        name = "lin1.weight" if self.rank == 0 else "lin2.weight"
        shard_numel = ours.module.get_parameter(name).numel()
        for wrapper_cls, wrapped in ((FullyShardedDataParallel, ours), (TorchFSDP, theirs)):
            if not replace:
                wrapped(torch.ones(2, 5)).sum().backward()
            module_name, param_name = name.split(".")
            larger = torch.randn(6, 6) if replace else torch.randn(shard_numel + 1)
            owner = wrapped.module.get_submodule(module_name)
            if replace:
                setattr(owner, param_name, nn.Parameter(larger))
            else:
                owner.get_parameter(param_name).data = larger
            with self.assertRaisesRegex(RuntimeError, "Cannot writeback") as caught:
                with wrapper_cls.summon_full_params(wrapped):
                    pass
            if wrapper_cls is FullyShardedDataParallel:
                shape = r"\(6, 6\)" if replace else rf"\({shard_numel + 1},\)"
                expected = rf"{name}.*{shape}.*\({shard_numel},\)"
                self.assertRegex(str(caught.exception), expected)

    def test_a_parameter_replaced_before_the_first_forward_trains_like_torch(self):
        """torch's test_param_writeback with the parameter itself replaced: the new object
        is the one trained (and an optimizer built afterwards holds it)."""
        self.run_subtests({"name": ["lin1.weight", "lin2.weight"]}, self._check_replaced)

    def _check_replaced(self, name):
        ref, ours, theirs = twins(self)
        owner_name, attr = name.split(".")
        for module in (ref, ours.module, theirs.module):
            owner = module.get_submodule(owner_name)
            setattr(owner, attr, nn.Parameter(torch.full_like(getattr(owner, attr), 2.0)))
        replaced = ours.module.get_parameter(name)
        optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ours, theirs)]
        for step in range(2):
            self._step_all(ref, ours, theirs, optims, step)
        self.assertIs(ours.module.get_parameter(name), replaced)
        expected = dict(ref.named_parameters())
        for wrapper_cls, module in ((FullyShardedDataParallel, ours), (TorchFSDP, theirs)):
            for key, param in full_params(wrapper_cls, module).items():
                torch.testing.assert_close(param, expected[key].detach(), msg=key)

    def test_a_parameter_replaced_after_the_first_forward_is_refused(self):
        """torch's wrapper adopts it silently, while the optimizer goes on stepping the old
        object; reffsdp names the instance and the parameter."""
        _, ours, _ = twins(self)
        ours(torch.ones(2, 5)).sum().backward()
        ours.module.lin1.weight = nn.Parameter(torch.zeros_like(ours.module.lin1.weight))
        message = r"FullyShardedDataParallel\(TwoLinears\): lin1.weight was assigned a new"
        with self.assertRaisesRegex(RuntimeError, message):
            ours(torch.ones(2, 5))

    def test_replacing_one_name_of_a_shared_parameter_raises_like_torch(self):
        for wrapper_cls, extra in (
            (FullyShardedDataParallel, {}),
            (TorchFSDP, {"device_id": torch.device("cpu")}),
        ):
            model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
            model[1].weight = model[0].weight
            wrapped = wrapper_cls(model, use_orig_params=True, **extra)
            model[1].weight = nn.Parameter(torch.zeros_like(model[1].weight))
            with self.assertRaisesRegex(NotImplementedError, "shared"):
                with wrapper_cls.summon_full_params(wrapped):
                    pass


def four_linears(test: FSDPTestMultiThread, strategy: ShardingStrategy) -> dict:
    """``Linear(7, 1, bias=False)`` wrapped by reffsdp and by torch, with and without
    ``use_orig_params``, keyed ``(api, use_orig_params)``; the unsharded copy under
    ``"local"``."""
    local = nn.Linear(7, 1, bias=False)
    test.sync_module_states(local)
    models: dict = {"local": local}
    for use_orig_params in (False, True):
        models["reffsdp", use_orig_params] = FullyShardedDataParallel(
            copy.deepcopy(local), sharding_strategy=strategy, use_orig_params=use_orig_params
        )
        models["torch", use_orig_params] = TorchFSDP(
            copy.deepcopy(local),
            sharding_strategy=TorchStrategy[strategy.name],
            use_orig_params=use_orig_params,
            device_id=torch.device("cpu"),
        )
    return models


def shown_grad(model: nn.Module) -> torch.Tensor | None:
    """The one parameter's gradient, flattened, without flat padding."""
    (param,) = model.parameters()
    return None if param.grad is None else param.grad.reshape(-1)[:7]


class TestGradientsInsideNoSync(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def _inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.rank)
        return torch.randn(2, 7, generator=generator), torch.randn(2, 1, generator=generator)

    def test_gradients_after_a_backward_inside_no_sync_like_torch(self):
        """torch's test_no_sync_correctness: inside ``no_sync()`` the gradient shown is this
        rank's own, whole (sharded strategies too); the synced backward after it reduces
        both, so the shard shows twice a synced backward's gradient."""
        self.run_subtests({"strategy": STRATEGIES}, self._check_no_sync_grads)

    def _check_no_sync_grads(self, strategy):
        models = four_linears(self, strategy)
        inp, out_grad = self._inputs()
        local = models.pop("local")
        local(inp).backward(out_grad)
        synced = {}
        for key, model in models.items():
            model(inp).backward(out_grad)
            synced[key] = shown_grad(model).clone()
            torch.optim.AdamW(model.parameters()).zero_grad(set_to_none=True)
            with model.no_sync():
                model(inp).backward(out_grad)
            torch.testing.assert_close(shown_grad(model), local.weight.grad.reshape(-1), msg=key)
            model(inp).backward(out_grad)
            torch.testing.assert_close(shown_grad(model), 2 * synced[key], msg=key)
        for use_orig_params in (False, True):
            ours, theirs = synced["reffsdp", use_orig_params], synced["torch", use_orig_params]
            torch.testing.assert_close(ours, theirs)

    def test_a_step_right_after_no_sync_like_torch(self):
        """With no synced backward yet: under NO_SHARD the step takes this rank's own
        accumulated gradient (as DDP's ``no_sync()``); the sharded strategies hold it
        unsharded and the optimizer's step fails on the shapes, as with torch's wrapper. The
        parameters shown stay the shard's, as torch's."""
        self.run_subtests({"strategy": STRATEGIES}, self._check_step_after_no_sync)

    def _check_step_after_no_sync(self, strategy):
        models = four_linears(self, strategy)
        models.pop("local")
        inp, out_grad = self._inputs()
        stepped = {}
        for key, model in models.items():
            params = list(model.parameters())
            optim = torch.optim.SGD(params, lr=0.1)
            with model.no_sync():
                model(inp).backward(out_grad)
            self.assertEqual([id(p) for p in model.parameters()], [id(p) for p in params], key)
            if strategy is not S.NO_SHARD:
                with self.assertRaisesRegex(RuntimeError, "must match the size", msg=key):
                    optim.step()
                continue
            before = params[0].detach().clone()
            optim.step()
            self.assertFalse(torch.equal(before, params[0].detach()), key)
            stepped[key] = params[0].detach().clone()
        for use_orig_params in (False, True) if stepped else ():
            ours, theirs = stepped["reffsdp", use_orig_params], stepped["torch", use_orig_params]
            torch.testing.assert_close(ours, theirs)

    def test_zero_grad_inside_no_sync_clears_every_gradient_like_ddp(self):
        """``zero_grad()`` between microbatches inside ``no_sync()`` drops the kept gradient
        and the shard gradient of the earlier synced step: the synced backward that follows
        shows two backwards' worth, as DDP would. torch's wrapper agrees under NO_SHARD;
        under the sharded strategies it still adds the earlier step's shard gradient, which
        ``zero_grad()`` could not reach (three backwards' worth)."""
        self.run_subtests({"strategy": STRATEGIES}, self._check_zero_grad_inside_no_sync)

    def _check_zero_grad_inside_no_sync(self, strategy):
        models = four_linears(self, strategy)
        models.pop("local")
        inp, out_grad = self._inputs()
        grads = {}
        for key, model in models.items():
            model(inp).backward(out_grad)
            once = shown_grad(model).clone()
            optim = torch.optim.SGD(model.parameters(), lr=0.1)
            with model.no_sync():
                model(inp).backward(out_grad)
                optim.zero_grad()
                model(inp).backward(out_grad)
            model(inp).backward(out_grad)
            grads[key] = shown_grad(model)
            if key[0] == "reffsdp" or strategy is S.NO_SHARD:
                torch.testing.assert_close(grads[key], 2 * once, msg=key)
