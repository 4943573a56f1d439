"""The wrapper API's optimizer-state calls next to torch's wrapper, over gloo.

Each call runs on both wrappers, over copies of one model trained on the same inputs, and
must return what torch's returns: the same keys in the same order, values, tensor types,
parameter groups and deprecation warnings. After loading, both models must train on to the
same losses. The model mixes what these calls must handle: a root that is no instance (so
parameters no instance manages), an instance nested in another, flat parameters of odd sizes
(padded), two parameter groups, and optimizers on odd ranks listing their parameters in
reverse, so that each rank keys a parameter differently. Loading goes into the model wrapped
another way, and in the 4-rank test into a 2-rank model.

First what torch's newer calls (``optim_state_dict``, ``optim_state_dict_to_load``) accept,
then torch's older calls (``full_optim_state_dict``, ``sharded_optim_state_dict``,
``shard_full_``/``scatter_full_``/``flatten_sharded_optim_state_dict``,
``rekey_optim_state_dict``). Each test method runs many cases in one launch of its ranks.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed._state_dict_utils import _gather_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullOptimStateDictConfig as TorchFullOptimStateDictConfig
from torch.distributed.fsdp import FullStateDictConfig as TorchFullStateDictConfig
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import ShardingStrategy as TorchShardingStrategy
from torch.distributed.fsdp import StateDictType as TorchStateDictType
from torch.distributed.fsdp.fully_sharded_data_parallel import (
    OptimStateKeyType as TorchOptimStateKeyType,
)
from torch.distributed.optim import _NamedOptimizer
from torch.distributed.tensor import DTensor

from reffsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    ShardingStrategy,
    StateDictType,
)
from reffsdp import FullyShardedDataParallel as FSDP
from reffsdp.fully_sharded_data_parallel import OptimStateKeyType
from reffsdp.testing.inputs import random_inputs
from reffsdp.testing.models import MLP
from reffsdp.testing.multiprocess import FSDPTest
from reffsdp.testing.parity import train_step

pytestmark = pytest.mark.multiprocess

CPU = torch.device("cpu")
make_inputs = random_inputs(4, 3)


@dataclasses.dataclass(frozen=True)
class Api:
    """One wrapper API: its class and the enums and configs its calls take."""

    name: str
    fsdp: Any
    strategy: Any
    key_type: Any
    state_dict_type: Any
    full_config: Any
    full_optim_config: Any


TORCH = Api(
    "torch",
    TorchFSDP,
    TorchShardingStrategy,
    TorchOptimStateKeyType,
    TorchStateDictType,
    TorchFullStateDictConfig,
    TorchFullOptimStateDictConfig,
)
OURS = Api(
    "reffsdp",
    FSDP,
    ShardingStrategy,
    OptimStateKeyType,
    StateDictType,
    FullStateDictConfig,
    FullOptimStateDictConfig,
)


# -- the model ------------------------------------------------------------------------------


class Nested(nn.Module):
    """``stem``, two :class:`MLP` blocks, then times ``scale``; odd sizes, so flat
    parameters pad on 2 and 4 ranks."""

    def __init__(self, width: int = 5) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(3, width)
        self.blocks = nn.Sequential(MLP(width, dim_multiplier=3), MLP(width, dim_multiplier=2))
        self.scale = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.stem(x)) * self.scale


def wrap(api: Api, model: Nested, layout: str, **kwargs: Any) -> nn.Module:
    """``nested``: the root is no instance (``stem`` and ``scale`` unmanaged); block 0 is
    one, holding another over its ``in_proj``; block 1 is one. ``rooted``: block 1 and the
    root (everything else) are instances."""

    def instance(module: nn.Module) -> nn.Module:
        return api.fsdp(module, device_id=CPU, **kwargs)

    if layout == "nested":
        block = model.blocks[0]
        block.in_proj = instance(block.in_proj)
        model.blocks[0] = instance(block)
        model.blocks[1] = instance(model.blocks[1])
        return model
    model.blocks[1] = instance(model.blocks[1])
    return instance(model)


@dataclasses.dataclass
class Run:
    """A model, its optimizer and what the optimizer was built from."""

    api: Api
    model: nn.Module
    optim: torch.optim.Optimizer
    optim_input: list[dict[str, Any]]


def build(
    api: Api,
    layout: str | None = "nested",
    *,
    strategy: str = "FULL_SHARD",
    reverse: bool = False,
    width: int = 5,
    **kwargs: Any,
) -> Run:
    """``Nested`` wrapped per ``layout`` (unwrapped for ``None``), and Adam over two
    parameter groups (block 1's parameters, the rest: so under any layout), each listed in
    reverse with ``reverse``."""
    model: nn.Module = Nested(width)
    if layout is not None:
        model = wrap(api, model, layout, sharding_strategy=api.strategy[strategy], **kwargs)
    first = list(model.blocks[1].parameters())
    groups = [first, [p for p in model.parameters() if all(p is not q for q in first)]]
    if reverse:
        groups = [group[::-1] for group in groups]
    optim_input = [{"params": groups[0]}, {"params": groups[1], "weight_decay": 0.01}]
    return Run(api, model, torch.optim.Adam(optim_input, lr=1e-2), optim_input)


def train(run: Run, steps: range) -> list[float]:
    return [train_step(run.model, run.optim, make_inputs(step, dist.get_rank())) for step in steps]


# -- comparing with torch's wrapper -----------------------------------------------------------


class OptimStateChecks:
    """Comparisons with torch's wrapper, for test classes of any world size."""

    def both(
        self,
        where: str,
        call: Callable[[Run], Any],
        runs: dict[Api, Run],
        expected: Callable[[dict], dict] = lambda osd: osd,  # torch's result as it should be
    ) -> dict:
        """``call`` on torch's run, then on ours: the same deprecations, and ours returns
        ``expected(torch's result)``, which stands for torch's from then on."""
        results, warned = {}, {}
        for api, run in runs.items():
            results[api], warned[api] = deprecations(lambda: call(run))  # noqa: B023
        self.assertEqual(warned[OURS], warned[TORCH], where)
        results[TORCH] = expected(results[TORCH])
        assert_same_osd(self, results[OURS], results[TORCH], where)
        return results

    def trained_pair(self, reverse_on_odd_ranks: bool = True, **kwargs: Any) -> dict[Api, Run]:
        reverse = reverse_on_odd_ranks and self.rank % 2 == 1
        runs = {api: build(api, reverse=reverse, **kwargs) for api in (TORCH, OURS)}
        losses = {api: train(run, range(2)) for api, run in runs.items()}
        torch.testing.assert_close(losses[OURS], losses[TORCH])
        return runs

    def check_training_on(self, runs: dict[Api, Run], loaded: dict[Api, Any]) -> None:
        for api, run in runs.items():
            run.optim.load_state_dict(_unshared(loaded[api]))
        losses = {api: train(run, range(2, 4)) for api, run in runs.items()}
        torch.testing.assert_close(losses[OURS], losses[TORCH])


def deprecations(fn: Callable[[], Any]) -> tuple[Any, list[tuple[str, str]]]:
    """``fn()`` and the deprecations it warned of: of the call, of ``optim_input``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    found = []
    for warning in caught:
        text = str(warning.message)
        if "is being deprecated" in text:
            found.append(("call", warning.category.__name__))
        elif "`optim_input` argument is deprecated" in text:
            found.append(("optim_input", warning.category.__name__))
    return result, sorted(found)


def assert_same_osd(test: Any, ours: dict, theirs: dict, where: str) -> None:
    test.assertEqual(list(ours), list(theirs), where)
    if "state" in theirs:
        test.assertEqual(list(ours["state"]), list(theirs["state"]), where)
        for key, values in theirs["state"].items():
            mine = ours["state"][key]
            test.assertEqual(sorted(mine), sorted(values), f"{where}: {key}")
            for name, value in values.items():
                assert_same_value(test, mine[name], value, f"{where}: {key} {name}")
    test.assertEqual(ours.get("param_groups"), theirs.get("param_groups"), where)


def assert_same_value(test: Any, mine: Any, theirs: Any, where: str) -> None:
    test.assertIs(type(mine), type(theirs), where)
    if isinstance(theirs, ShardedTensor):
        test.assertEqual(mine.size(), theirs.size(), where)
        pairs = list(zip(mine.local_shards(), theirs.local_shards(), strict=True))
        for a, b in pairs:
            test.assertEqual(a.metadata.shard_offsets, b.metadata.shard_offsets, where)
            torch.testing.assert_close(a.tensor, b.tensor, msg=lambda m: f"{where}: {m}")
    elif isinstance(theirs, DTensor):
        test.assertEqual(mine.placements, theirs.placements, where)
        torch.testing.assert_close(
            mine.to_local(), theirs.to_local(), msg=lambda m: f"{where}: {m}"
        )
    elif isinstance(theirs, torch.Tensor):
        torch.testing.assert_close(mine, theirs, msg=lambda m: f"{where}: {m}")
    else:
        test.assertEqual(mine, theirs, where)


def _unshared(osd: dict) -> dict:
    """``osd`` with a tensor of its own in each state entry. torch's full optimizer state
    dicts give all originals of a flat parameter one ``step`` tensor; an optimizer loading
    that (a plain model's, after rekeying) would count each step once per sharer."""
    state = {
        key: {name: v.clone() if isinstance(v, torch.Tensor) else v for name, v in values.items()}
        for key, values in osd["state"].items()
    }
    return {**osd, "state": state}


def state_dict_type(run: Run, kind: str, rank0_only: bool = False) -> Any:
    """``FULL_STATE_DICT`` (with ``offload_to_cpu=False``: see :func:`torch_full_values`)
    or ``SHARDED_STATE_DICT`` on ``run``'s model, for the duration of a ``with``."""
    api = run.api
    if kind == "sharded":
        return api.fsdp.state_dict_type(run.model, api.state_dict_type.SHARDED_STATE_DICT)
    config = api.full_optim_config(offload_to_cpu=False, rank0_only=rank0_only)
    full = api.state_dict_type.FULL_STATE_DICT
    return api.fsdp.state_dict_type(run.model, full, api.full_config(), config)


def saved(kind: str, rank0_only: bool = False) -> Callable[[Run], dict]:
    def save(run: Run) -> dict:
        with state_dict_type(run, kind, rank0_only):
            return run.api.fsdp.optim_state_dict(run.model, run.optim)

    return save


def torch_full_values(run: Run) -> dict:
    """torch's full optimizer state, copied. On CPU and with ``use_orig_params=True``, its
    calls that offload to CPU return every state tensor of a parameter as a view of one
    buffer, which holds the last state gathered (``exp_avg`` shows ``exp_avg_sq``'s
    values); without offloading they copy."""
    with state_dict_type(run, "full"):
        return TorchFSDP.optim_state_dict(run.model, run.optim)


# -- torch's newer calls ----------------------------------------------------------------------


class TestNewerOptimStateCallsGloo(OptimStateChecks, FSDPTest):
    """What torch's ``optim_state_dict``/``optim_state_dict_to_load`` accept."""

    @property
    def world_size(self) -> int:
        return 2

    def test_what_torch_accepts(self):
        self.run_subtests({"use_orig_params": [False, True]}, self._check_newer_calls)

    def _check_newer_calls(self, use_orig_params: bool) -> None:
        self._check_optimizers_in_other_orders(use_orig_params)
        self._check_named_optimizer(use_orig_params)
        self._check_without_param_groups(use_orig_params)
        self._check_another_shape(use_orig_params)

    def _check_optimizers_in_other_orders(self, use_orig_params: bool) -> None:
        """Odd ranks list parameters in reverse: collectives still follow one order."""
        runs = self.trained_pair(use_orig_params=use_orig_params)
        reverse = self.rank % 2 == 1
        for kind in ("full", "sharded"):
            osd = self.both(kind, saved(kind), runs)
            others = {
                api: build(api, "rooted", use_orig_params=use_orig_params, reverse=reverse)
                for api in (TORCH, OURS)
            }

            def to_load(run: Run, kind: str = kind, osd: dict = osd) -> dict:
                with state_dict_type(run, kind):
                    return run.api.fsdp.optim_state_dict_to_load(run.model, run.optim, osd[run.api])

            self.check_training_on(others, self.both(f"{kind} to load", to_load, others))

    def _check_named_optimizer(self, use_orig_params: bool) -> None:
        """A named optimizer keys its state by parameter names, as the model gives them."""
        runs = {api: build(api, use_orig_params=use_orig_params) for api in (TORCH, OURS)}
        for run in runs.values():
            named = _NamedOptimizer(run.model.named_parameters(), torch.optim.Adam, lr=1e-2)
            named.zero_grad = named._optimizer.zero_grad  # it lacks what Optimizer's needs
            run.optim = named
            train(run, range(2))
        osd = self.both("named", saved("full"), runs)
        loaded = self.both(
            "named to load",
            lambda r: r.api.fsdp.optim_state_dict_to_load(
                r.model, r.optim, osd[r.api], is_named_optimizer=True
            ),
            runs,
        )
        self.check_training_on(runs, loaded)

    def _check_without_param_groups(self, use_orig_params: bool) -> None:
        runs = self.trained_pair(reverse_on_odd_ranks=False, use_orig_params=use_orig_params)

        def save(run: Run) -> dict:
            osd = run.optim.state_dict()
            del osd["param_groups"]
            with state_dict_type(run, "full"):
                return run.api.fsdp.optim_state_dict(run.model, run.optim, optim_state_dict=osd)

        osd = self.both("no param groups", save, runs)
        loaded = self.both(
            "no param groups to load",
            lambda r: r.api.fsdp.optim_state_dict_to_load(r.model, r.optim, osd[r.api]),
            runs,
        )
        for api, run in runs.items():
            loaded[api]["param_groups"] = run.optim.state_dict()["param_groups"]
        self.check_training_on(runs, loaded)

    def _check_another_shape(self, use_orig_params: bool) -> None:
        """Loading state of a 5-wide model into a 6-wide one names the parameter and both
        shapes."""
        narrow = build(OURS, "rooted", use_orig_params=use_orig_params)
        train(narrow, range(1))
        osd = FSDP.optim_state_dict(narrow.model, narrow.optim)
        wide = build(OURS, "rooted", use_orig_params=use_orig_params, width=6)
        pattern = r"'scale' has shape \(5,\), but the parameter has shape \(6,\)"
        with self.assertRaisesRegex(ValueError, pattern):
            FSDP.optim_state_dict_to_load(wide.model, wide.optim, osd)

    def test_ranks_missing_rank0s_state_fail_together(self):
        """With flat parameters, a rank whose optimizer lacks state rank 0's has: an error
        on every rank, as torch's, not ranks left in mismatched collectives."""
        runs = {api: build(api) for api in (TORCH, OURS)}
        for run in runs.values():
            if self.rank == 1:  # rank 1 leaves block 1 out of its optimizer
                run.optim = torch.optim.Adam(run.model.blocks[0].parameters(), lr=1e-2)
            train(run, range(1))
        phrase = "some ranks are missing some of those states"  # torch's, which its tests match
        with self.assertRaisesRegex(RuntimeError, phrase):
            TorchFSDP.optim_state_dict(runs[TORCH].model, runs[TORCH].optim)
        with self.assertRaisesRegex(RuntimeError, phrase):
            FSDP.optim_state_dict(runs[OURS].model, runs[OURS].optim)
        with self.assertRaisesRegex(RuntimeError, r"(?s)rank 1: .*'blocks\.1\.in_proj\.weight'"):
            FSDP.optim_state_dict(runs[OURS].model, runs[OURS].optim)


# -- torch's older calls ----------------------------------------------------------------------


class OlderCallChecks(OptimStateChecks):
    def check_saving(self, runs: dict[Api, Run], no_shard: bool = False) -> dict:
        """The older saving calls, every way of calling them."""
        osd = {
            "sharded": self.both(
                "sharded",
                lambda r: r.api.fsdp.sharded_optim_state_dict(r.model, r.optim),
                runs,
                _gathered if no_shard else _as_is,  # NO_SHARD: whole, as the model's state
            )
        }
        # After the sharded call: torch's newer call, on a device mesh, would turn the
        # older call's ShardedTensors into DTensors from then on.
        values = torch_full_values(runs[TORCH])
        calls: dict[str, Callable[[Run], Any]] = {
            "full": lambda r: r.api.fsdp.full_optim_state_dict(r.model, r.optim, rank0_only=False),
            "full, optim_input": lambda r: r.api.fsdp.full_optim_state_dict(
                r.model, r.optim, r.optim_input, rank0_only=False
            ),
            "full on rank 0": lambda r: r.api.fsdp.full_optim_state_dict(r.model, r.optim),
        }
        for where, call in calls.items():
            osd[where] = self.both(where, call, runs, lambda osd: _with_values(osd, values))
        return osd

    def check_loading(
        self, osd: dict[str, dict[Api, Any]], runs: dict[Api, Run], group: Any = None
    ) -> None:
        """The older loading calls into ``runs`` (``scatter_full`` over ``group``); then
        both train on alike."""
        rank0 = dist.get_rank(group) == 0
        calls: dict[str, Callable[[Run], Any]] = {
            "shard_full": lambda r: r.api.fsdp.shard_full_optim_state_dict(
                osd["full"][r.api], r.model, optim=r.optim
            ),
            "shard_full, optim_input": lambda r: r.api.fsdp.shard_full_optim_state_dict(
                osd["full"][r.api], r.model, optim_input=r.optim_input
            ),
            "scatter_full": lambda r: r.api.fsdp.scatter_full_optim_state_dict(
                osd["full on rank 0"][r.api] if rank0 else None,
                r.model,
                optim=r.optim,
                group=group,
            ),
        }
        if "sharded" in osd:
            calls["flatten_sharded"] = lambda r: r.api.fsdp.flatten_sharded_optim_state_dict(
                osd["sharded"][r.api], r.model, r.optim
            )
        loaded = {where: self.both(where, call, runs) for where, call in calls.items()}
        self.check_training_on(runs, loaded["scatter_full"])


def _as_is(osd: dict) -> dict:
    return osd


def _gathered(osd: dict) -> dict:
    """``osd`` with whole tensors for sharded ones (collective)."""
    if "state" not in osd:
        return osd
    return {**osd, "state": {key: _gather_state_dict(v) for key, v in osd["state"].items()}}


def _with_values(osd: dict, values: dict) -> dict:
    """``osd``, its state's values taken from ``values`` (the same keys, in the same order)."""
    if "state" not in osd:
        return osd
    assert list(osd["state"]) == list(values["state"])
    state = {key: {n: values["state"][key][n] for n in v} for key, v in osd["state"].items()}
    return {**osd, "state": state}


class TestOlderOptimStateCallsGloo(OlderCallChecks, FSDPTest):
    @property
    def world_size(self) -> int:
        return 2

    def test_older_calls_match_torch(self):
        self.run_subtests(
            {"use_orig_params": [False, True], "strategy": ["FULL_SHARD", "NO_SHARD"]},
            self._check_older_calls,
        )

    def _check_older_calls(self, use_orig_params: bool, strategy: str) -> None:
        kwargs = {"strategy": strategy, "use_orig_params": use_orig_params}
        osd = self.check_saving(self.trained_pair(**kwargs), strategy == "NO_SHARD")
        reverse = self.rank % 2 == 1
        runs = {api: build(api, "rooted", reverse=reverse, **kwargs) for api in (TORCH, OURS)}
        self.check_loading(osd, runs)
        self._check_rekeying(osd["full"], runs)

    def _check_rekeying(self, full: dict[Api, Any], runs: dict[Api, Run]) -> None:
        """Full state to a plain model's ids, train the plain model, its state back to
        names, and into ``runs``' wrapped models."""
        plain = {api: build(api, None) for api in (TORCH, OURS)}

        def to_ids(run: Run) -> dict:
            key = run.api.key_type.PARAM_ID
            return run.api.fsdp.rekey_optim_state_dict(
                full[run.api], key, run.model, optim=run.optim
            )

        self.check_training_on(plain, self.both("rekey to ids", to_ids, plain))

        def to_names(run: Run) -> dict:
            key = run.api.key_type.PARAM_NAME
            osd = run.optim.state_dict()
            return run.api.fsdp.rekey_optim_state_dict(osd, key, run.model, run.optim_input)

        named = self.both("rekey to names", to_names, plain)
        self.both(
            "shard_full of rekeyed",
            lambda r: r.api.fsdp.shard_full_optim_state_dict(named[r.api], r.model, optim=r.optim),
            runs,
        )


class TestOlderOptimStateCallsHybridGloo(OlderCallChecks, FSDPTest):
    @property
    def world_size(self) -> int:
        return 4

    def test_hybrid_and_loading_on_two_ranks(self):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        pair = dist.new_group([0, 1])
        self.run_subtests(
            {"use_orig_params": [False, True]}, self._check_hybrid, mesh=mesh, pair=pair
        )

    def _check_hybrid(self, use_orig_params: bool, mesh: Any, pair: Any) -> None:
        hybrid = {"strategy": "HYBRID_SHARD", "use_orig_params": use_orig_params}
        runs = self.trained_pair(device_mesh=mesh, **hybrid)
        osd = self.check_saving(runs)
        newer = self.both("newer full on rank 0", saved("full", rank0_only=True), runs)
        reverse = self.rank % 2 == 1
        others = {
            api: build(api, "rooted", reverse=reverse, device_mesh=mesh, **hybrid)
            for api in (TORCH, OURS)
        }
        self.check_loading(osd, others)
        if self.rank >= 2:
            return
        # Another world size: the full dicts of 4 ranks into a model on 2.
        on_two = {
            api: build(api, "rooted", use_orig_params=use_orig_params, process_group=pair)
            for api in (TORCH, OURS)
        }
        del osd["sharded"]  # sharded state loads at the world size that saved it only
        self.check_loading(osd, on_two, pair)
        on_two = {
            api: build(api, "rooted", use_orig_params=use_orig_params, process_group=pair)
            for api in (TORCH, OURS)
        }

        def to_load(run: Run) -> dict:
            with state_dict_type(run, "full", rank0_only=True):
                return run.api.fsdp.optim_state_dict_to_load(
                    run.model, run.optim, newer[run.api], group=pair
                )

        self.check_training_on(on_two, self.both("newer load on 2 ranks", to_load, on_two))
