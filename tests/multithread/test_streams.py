"""Logical CUDA streams on CPU: under ``reffsdp.testing.simulated_streams()`` a CPU run takes
the calls the CUDA branch of ``reffsdp/core/streams.py`` takes, on threaded ranks, and the
checker (``reffsdp.testing.stream_checker``) orders every read, write and free.

Both APIs on 1-D and HSDP meshes, with prefetching, resharding choices, explicit unsharding,
gradient accumulation, mixed precision, hooks on their own streams, the post-optimizer event
and a state-dict round trip, run with no finding; with each rule of [Note: why all-gathers
get their own stream] undone in turn, the checker reports it, naming the rule.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from reffsdp import (
    BackwardPrefetch,
    CPUOffload,
    CPUOffloadPolicy,
    FullyShardedDataParallel,
    MixedPrecisionPolicy,
    ShardingStrategy,
    StateDictType,
    fully_shard,
)
from reffsdp.bench.cli import parser, resolve, run_config
from reffsdp.bench.stream_traces import write_stream_traces
from reffsdp.core import collectives, comms, streams
from reffsdp.core.param_group import ParamGroup
from reffsdp.core.runtime import CommContext
from reffsdp.core.torch_internals import dtensor_local
from reffsdp.testing import logical_streams
from reffsdp.testing.logical_streams import StreamObserver, current_rank, start_trace
from reffsdp.testing.models import MLP, MLPBlocks, init_deterministic
from reffsdp.testing.multithread import run_threaded
from reffsdp.testing.stream_checker import RULES
from reffsdp.wrap import ModuleWrapPolicy
from tests.multithread.extension_tensors import Int8RowsGathered, log, wrap_weights

pytestmark = [pytest.mark.streams, pytest.mark.multithread]
pytest_plugins = ["reffsdp.testing.pytest_plugin"]

CPU = torch.device("cpu")
DIM = 8
STEPS = 3


def _backend() -> streams.StreamBackend:
    return streams.backend_for(CPU)


# -- building the sharded model --------------------------------------------------------------


def _mesh(shape: tuple[int, ...]):
    if len(shape) == 1:
        return init_device_mesh("cpu", shape)
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def _fully_shard(model: MLPBlocks, shape=(2,), **kwargs) -> MLPBlocks:
    mesh = _mesh(shape)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def _prefetching(model: MLPBlocks) -> MLPBlocks:
    layers = list(model.layers)
    for i, layer in enumerate(layers):
        layer.set_modules_to_forward_prefetch(layers[i + 1 : i + 2])
        layer.set_modules_to_backward_prefetch(layers[max(i - 1, 0) : i][::-1])
    return model


def _hook_on_own_stream(model: MLPBlocks) -> MLPBlocks:
    stream = _backend().new_stream(CPU, name="hook")
    model.set_all_reduce_hook(lambda grad: grad.mul_(1.0), stream=stream)
    return model


def _wrapper(model: MLPBlocks, shape=(2,), **kwargs) -> FullyShardedDataParallel:
    if len(shape) > 1:
        kwargs.update(device_mesh=_mesh(shape), sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({MLP}), **kwargs)


@dataclasses.dataclass(frozen=True)
class Config:
    build: Callable[[MLPBlocks], nn.Module]
    world_size: int = 2
    microbatches: int = 1  # gradient accumulation: all but the last without sync
    async_unshard: bool = False  # model.unshard(async_op=True) before each forward
    post_optim_event: bool = False
    reload: bool = False  # from the second step, a fresh model loaded from the state dict


CONFIGS: dict[str, Config] = {
    "fully_shard": Config(_fully_shard),
    "fully_shard/prefetch": Config(lambda m: _prefetching(_fully_shard(m))),
    "fully_shard/no-reshard": Config(lambda m: _fully_shard(m, reshard_after_forward=False)),
    "fully_shard/reshard-to-2": Config(
        lambda m: _fully_shard(m, (4,), reshard_after_forward=2), world_size=4
    ),
    "fully_shard/async-unshard": Config(_fully_shard, async_unshard=True),
    "fully_shard/no-sync": Config(_fully_shard, microbatches=2),
    "fully_shard/post-optim-event": Config(_fully_shard, post_optim_event=True),
    "fully_shard/bf16": Config(
        lambda m: _fully_shard(m, mp_policy=MixedPrecisionPolicy(torch.bfloat16, torch.float32))
    ),
    "fully_shard/hook-stream": Config(lambda m: _hook_on_own_stream(_fully_shard(m))),
    "fully_shard/offload": Config(lambda m: _fully_shard(m, offload_policy=CPUOffloadPolicy())),
    "fully_shard/offload-no-sync": Config(
        lambda m: _fully_shard(m, offload_policy=CPUOffloadPolicy()), microbatches=2
    ),
    "fully_shard/load-state-dict": Config(_fully_shard, reload=True),
    # weights that gather themselves (int8 rows and fp32 scales: see extension_tensors)
    "fully_shard/extension": Config(lambda m: _fully_shard(wrap_weights(m, Int8RowsGathered))),
    "fully_shard/extension-offload": Config(
        lambda m: _fully_shard(wrap_weights(m, Int8RowsGathered), offload_policy=CPUOffloadPolicy())
    ),
    "fully_shard/hsdp": Config(lambda m: _fully_shard(m, (2, 2)), world_size=4),
    "fully_shard/hsdp-prefetch-no-sync": Config(
        lambda m: _prefetching(_fully_shard(m, (2, 2))), world_size=4, microbatches=2
    ),
    "wrapper": Config(
        lambda m: _wrapper(
            m, backward_prefetch=BackwardPrefetch.BACKWARD_PRE, forward_prefetch=True
        )
    ),
    "wrapper/backward-post": Config(
        lambda m: _wrapper(m, backward_prefetch=BackwardPrefetch.BACKWARD_POST)
    ),
    "wrapper/shard-grad-op": Config(
        lambda m: _wrapper(m, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP)
    ),
    "wrapper/no-sync": Config(_wrapper, microbatches=2),
    "wrapper/offload": Config(lambda m: _wrapper(m, cpu_offload=CPUOffload(offload_params=True))),
    "wrapper/load-state-dict": Config(_wrapper, reload=True),
    "wrapper/hybrid": Config(
        lambda m: _wrapper(m, (2, 2), backward_prefetch=BackwardPrefetch.BACKWARD_PRE),
        world_size=4,
    ),
}


# -- training ------------------------------------------------------------------------------


def train(config: Config) -> list[float]:
    """``STEPS`` steps of AdamW on this rank; the losses. The trace shows the last step."""
    model = config.build(init_deterministic(MLPBlocks(DIM, (2, 3))))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(torch.distributed.get_rank())
    losses = []
    for step in range(STEPS):
        if config.reload and step == 1:
            model = _reloaded(model, config.build(init_deterministic(MLPBlocks(DIM, (2, 3)))))
            optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if step == STEPS - 1:
            start_trace()
        for micro in range(config.microbatches):
            with _gradient_sync(model, micro == config.microbatches - 1):
                if config.async_unshard:
                    model.unshard(async_op=True)  # the forward waits for it
                loss = model(torch.randn(4, DIM, generator=generator)).square().mean()
                loss.backward()
        optim.step()
        if config.post_optim_event:
            model.set_post_optim_event(_backend().current_stream(CPU).record_event())
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def _reloaded(model: nn.Module, fresh: nn.Module) -> nn.Module:
    """``fresh`` with ``model``'s full (wrapper) or sharded (``fully_shard``) state dict."""
    if not isinstance(model, FullyShardedDataParallel):
        fresh.load_state_dict(model.state_dict())
        return fresh
    full = StateDictType.FULL_STATE_DICT
    with FullyShardedDataParallel.state_dict_type(model, full):
        state = model.state_dict()
    with FullyShardedDataParallel.state_dict_type(fresh, full):
        fresh.load_state_dict(state)
    return fresh


@contextlib.contextmanager
def _gradient_sync(model: nn.Module, sync: bool) -> Iterator[None]:
    """Reduce gradients in the enclosed backward or, with ``sync`` unset, accumulate them."""
    if isinstance(model, FullyShardedDataParallel):
        with contextlib.nullcontext() if sync else model.no_sync():
            yield
        return
    model.set_requires_gradient_sync(sync)
    yield


# -- the tests -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_no_stream_hazard(name, simulated_streams, thread_world):
    config = CONFIGS[name]
    thread_world(lambda rank: train(config), world_size=config.world_size)
    assert not simulated_streams.findings, simulated_streams.findings.describe()


class OwnStreamReduceScatter(comms.ReduceScatter):
    """A custom reduce-scatter issued from a stream of its own, which waits for the current
    stream (rule 4) only when ``waits`` is set."""

    def __init__(self, waits: bool) -> None:
        self.waits = waits
        self.stream = _backend().new_stream(CPU, name="reduce-scatter")

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if self.waits:
            self.stream.wait_stream(_backend().current_stream(CPU))
        with _backend().use_stream(self.stream):
            return comms.reduce_scatter(
                output_tensor, input_tensor, group, op=op, async_op=async_op
            )


def _own_stream_reduce_scatter(waits: bool) -> Config:
    def build(model: MLPBlocks) -> MLPBlocks:
        model = _fully_shard(model)
        for layer in model.layers:
            layer.set_custom_reduce_scatter(OwnStreamReduceScatter(waits))
        return model

    return Config(build)


def test_a_reduce_scatter_on_its_own_stream_that_waits_is_clean(simulated_streams, thread_world):
    thread_world(lambda rank: train(_own_stream_reduce_scatter(waits=True)))
    assert not simulated_streams.findings, simulated_streams.findings.describe()


def _run_on_stream_without_waiting(stream, fn, tensor) -> None:
    """``streams.run_on_stream`` with its first wait (rule 4) left out."""
    with _backend().use_stream(stream):
        fn(tensor)
    _backend().current_stream(CPU).wait_stream(stream)


def _undo(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> None:
    monkeypatch.setattr(owner, name, lambda *args, **kwargs: None)


def _gather_without_waiting_after_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ParamGroup.unshard`` as if called in the forward's order, even when it is not."""
    unshard = ParamGroup.unshard

    def unshard_in_order(group: ParamGroup, *, async_op: bool = False, **_: bool) -> None:
        unshard(group, async_op=async_op)

    monkeypatch.setattr(ParamGroup, "unshard", unshard_in_order)


# rule undone -> (how to undo it, the configuration that needs it, the rule reported)
PLANTS: dict[str, tuple[Callable[[pytest.MonkeyPatch], None], Config, int]] = {
    "rule 1 (no wait for the compute stream)": (
        lambda mp: _undo(mp, streams.AllGatherStream, "wait_for_compute"),
        CONFIGS["fully_shard"],
        1,
    ),
    # With a collective, copy-out is ordered after it by waiting for its work; with one rank
    # there is none, and the all-gather stream's event is all that orders copy-out.
    "rule 2 (copy-out does not wait)": (
        lambda mp: _undo(mp, collectives, "wait_event_on_current_stream"),
        Config(lambda m: _fully_shard(m, (1,)), world_size=1),
        2,
    ),
    "rule 3 (the all-gather buffer dropped at copy-out)": (
        lambda mp: _undo(mp, streams.AllGatherStream, "consumed"),
        CONFIGS["fully_shard"],
        3,
    ),
    "rule 3 (wrapper)": (
        lambda mp: _undo(mp, streams.AllGatherStream, "consumed"),
        CONFIGS["wrapper"],
        3,
    ),
    "rule 4 (the reduce-scatter does not wait for the gradients)": (
        lambda mp: None,
        _own_stream_reduce_scatter(waits=False),
        4,
    ),
    "rule 4 (the hook's stream does not wait)": (
        lambda mp: mp.setattr(collectives, "run_on_stream", _run_on_stream_without_waiting),
        CONFIGS["fully_shard/hook-stream"],
        4,
    ),
    "rule 6 (the host reads offloaded gradients before their copies land)": (
        lambda mp: _undo(mp, CommContext, "_wait_for_host_copies"),
        CONFIGS["fully_shard/offload"],
        6,
    ),
    # The race torch's CUDA sanitizer found on a GPU (a gather for a state-dict load that
    # read shards the compute stream had just written), found again here on CPU.
    "rule 1 (a state-dict load's gather does not wait for the compute stream)": (
        _gather_without_waiting_after_compute,
        CONFIGS["wrapper/load-state-dict"],
        1,
    ),
    "rule 5 (the reduce-scatter input dropped at issue)": (
        lambda mp: _undo(mp, collectives, "_held_input"),
        CONFIGS["fully_shard"],
        5,
    ),
}


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_an_undone_rule_is_reported(plant, monkeypatch, simulated_streams, thread_world):
    undo, config, rule = PLANTS[plant]
    undo(monkeypatch)
    thread_world(lambda rank: train(config), world_size=config.world_size)
    rules = {finding.rule for finding in simulated_streams.findings}
    assert RULES[rule] in rules, simulated_streams.findings.describe()


# -- the trace ----------------------------------------------------------------------------


def test_the_trace_shows_collectives_overlapping_compute(tmp_path, simulated_streams, thread_world):
    """HSDP on 2 x 2 ranks: a row per stream, the core's phases and the collectives as
    slices, waits as arrows; all-gathers overlap forward compute, reduce-scatters backward."""
    config = CONFIGS["fully_shard/hsdp-prefetch-no-sync"]
    thread_world(lambda rank: train(config), world_size=config.world_size)
    path = tmp_path / "streams.json"
    trace = simulated_streams.write_trace(str(path))
    assert json.loads(path.read_text()) == trace
    events = trace["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    ranks = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert ranks == {"rank 0", "rank 1", "rank 2", "rank 3"}  # the main thread ran nothing
    slices = [e for e in events if e["ph"] == "X"]
    kinds = {(names[e["pid"], e["tid"]].split(" ")[0], e["name"]) for e in slices}
    assert {
        ("all-gather", "copy-in"),
        ("comm", "all-gather"),
        ("compute", "copy-out"),
        ("compute", "compute"),
        ("compute", "backward"),
        ("compute", "reduce-scatter"),
        ("comm", "reduce-scatter"),
        ("comm", "all-reduce"),
    } <= kinds
    starts = [e for e in events if e["ph"] == "s"]
    assert starts and {e["id"] for e in starts} == {e["id"] for e in events if e["ph"] == "f"}
    for pid in range(4):
        rows = {e["tid"]: names[pid, e["tid"]].split(" ")[0] for e in slices if e["pid"] == pid}
        on = {
            key: [e for e in slices if e["pid"] == pid and (rows[e["tid"]], e["name"]) == key]
            for key in kinds
        }
        assert _overlap(on["comm", "all-gather"], on["compute", "compute"]) > 0
        assert _overlap(on["comm", "reduce-scatter"], on["compute", "backward"]) > 0


def test_the_benchmark_writes_a_trace_per_reffsdp_implementation(tmp_path):
    """``python -m reffsdp.bench --profile DIR`` on CPU: ``DIR/streams-<impl>.json``."""
    command = ["--model", "mlp", "--size", "tiny", "--backend", "threaded"]
    command += ["--profile", str(tmp_path), "--impl", "reffsdp_fully_shard", "reffsdp_fsdp"]
    paths = write_stream_traces(run_config(resolve(parser().parse_args(command))))
    assert paths == [
        str(tmp_path / f"streams-{name}.json") for name in ("reffsdp_fully_shard", "reffsdp_fsdp")
    ]
    for path in paths:
        events = json.loads(open(path).read())["traceEvents"]
        assert {"copy-in", "all-gather", "copy-out", "reduce-scatter"} <= {
            e["name"] for e in events
        }


def test_readmes_streams_section_holds():
    """The rules README lists are the note's, the configurations are counted right, and the
    command is one the benchmark takes."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## Streams") : readme.index("## More documentation")]
    for number in RULES:
        assert f"\n{number}. " in streams.__doc__ and f"({number})" in section
    clean = len(CONFIGS) + 1  # and the custom reduce-scatter that waits
    assert f"in {clean}\nconfigurations" in section or f"in {clean} configurations" in section
    (command,) = re.findall(r"python -m reffsdp\.bench (.*)", section)
    args = resolve(parser().parse_args(command.split()))
    assert args.profile == "traces/" and args.device == "cpu"


def _overlap(these: list[dict], those: list[dict]) -> float:
    """Microseconds during which a slice of ``these`` and one of ``those`` both run."""
    return sum(
        max(0.0, min(a["ts"] + a["dur"], b["ts"] + b["dur"]) - max(a["ts"], b["ts"]))
        for a in these
        for b in those
    )


# -- the checker on its own -----------------------------------------------------------------


def test_a_read_on_another_stream_needs_a_wait(simulated_streams):
    backend = _backend()
    side = backend.new_stream(CPU, name="side")
    data = torch.zeros(4)  # written on the compute stream
    with backend.use_stream(side):
        data.sum()
    (finding,) = simulated_streams.findings
    assert (finding.kind, finding.stream, finding.other_stream) == ("read", "side", "compute")
    assert finding.op.startswith("aten.sum in ") and finding.other_op == "aten.zeros"
    assert "test_a_read_on_another_stream_needs_a_wait" in finding.op
    side.wait_stream(backend.current_stream(CPU))
    with backend.use_stream(side):
        data.sum()
    assert len(simulated_streams.findings) == 1  # ordered now


def test_memory_freed_while_read_is_reported_when_reused(simulated_streams):
    backend = _backend()
    compute, side = backend.current_stream(CPU), backend.new_stream(CPU, name="side")
    with backend.use_stream(side):
        data = torch.ones(4)
    compute.wait_stream(side)
    data.sum()  # read on compute
    del data  # its block goes back to the side stream's pool
    with backend.use_stream(side):
        torch.empty(4)  # may get that block while compute still reads it
    (finding,) = simulated_streams.findings
    assert (finding.kind, finding.stream, finding.other_stream) == ("reuse", "side", "compute")
    with backend.use_stream(side):
        data = torch.ones(4)
    compute.wait_stream(side)
    data.sum()
    data.untyped_storage().resize_(0)  # a free too; this time the side stream waits first
    side.wait_stream(compute)
    with backend.use_stream(side):
        torch.empty(4)
    assert len(simulated_streams.findings) == 1


# -- the streams themselves ------------------------------------------------------------------


class Launches(StreamObserver):
    """Which stream each op and collective was queued on (with the core's phase), and which
    stream waited for which."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, str]] = set()
        self.waits: set[tuple[str, str]] = set()

    def on_launch(self, stream, tick, op, reads, writes, cost) -> None:
        phases = stream.rank.phases
        self.seen.add((stream.name, phases[-1] if phases else op))

    def on_wait(self, stream, clock, source) -> None:
        self.waits.add((stream.name, source.name if source is not None else "?"))


def test_events_and_waits_order_streams(simulated_streams):
    backend = _backend()
    compute, side = backend.current_stream(CPU), backend.new_stream(CPU, name="side")
    rank = current_rank()
    tick = rank.launch(compute, "an op")
    assert side.clock.get(compute.id, 0) < tick  # nothing orders the side stream after it
    event = compute.record_event()
    rank.launch(compute, "a later op")
    side.wait_event(event)
    assert side.clock[compute.id] == tick  # after the event's op, not the later one
    assert rank.host.clock.get(compute.id, 0) < tick
    event.synchronize()
    assert rank.host.clock[compute.id] == tick
    with backend.use_stream(side):
        assert backend.current_stream(CPU) is side
        side_tick = rank.launch(backend.current_stream(CPU), "on the side")
    compute.wait_stream(side)
    assert compute.clock[side.id] == side_tick


def test_a_run_takes_the_cuda_branch_and_computes_the_same():
    """Copy-in runs on the side stream, all-gathers are issued from it (rule 1 orders it
    after compute) and run on the group's comm stream, as do reduce-scatters, issued from
    the compute stream; copy-out waits (rule 2). The losses are those of a run without
    streams."""
    seen: dict[int, Launches] = {}
    losses: dict[int, list[float]] = {}

    def on_rank(rank: int) -> None:
        seen[rank] = Launches()
        current_rank().observers.append(seen[rank])
        losses[rank] = train(CONFIGS["fully_shard"])

    with logical_streams.simulated_streams() as report:
        run_threaded(on_rank, 2)
    simulated = dict(losses)
    run_threaded(lambda rank: losses.__setitem__(rank, train(CONFIGS["fully_shard"])), 2)
    assert simulated == losses
    assert sorted(rank.label for rank in report.ranks) == ["main", "rank 0", "rank 1"]
    for rank in (0, 1):
        assert {
            ("all-gather", "copy-in"),
            ("comm [0, 1]", "all-gather"),
            ("comm [0, 1]", "reduce-scatter"),
            ("compute", "copy-out"),
        } <= seen[rank].seen
        assert {
            ("all-gather", "compute"),  # rule 1
            ("comm [0, 1]", "all-gather"),  # issued from the side stream
            ("comm [0, 1]", "compute"),  # reduce-scatters, from the compute stream
            ("compute", "comm [0, 1]"),  # the work waited
            ("compute", "all-gather"),  # rule 2
        } <= seen[rank].waits
    assert streams.backend_for(CPU) is streams.HOST  # taken out again


def test_offloaded_extension_hook_gets_the_compute_device_copy(simulated_streams, thread_world):
    # With host memory of its own (simulated streams), an offloaded shard is copied to the
    # compute device for each all-gather, and the pre hook runs on that copy (rule 1 of
    # [Note: all-gather extensions]), never on the host shard the optimizer updates.
    def run(rank: int) -> None:
        model = CONFIGS["fully_shard/extension-offload"].build(
            init_deterministic(MLPBlocks(DIM, (2, 3)))
        )
        log().clear()
        model(torch.ones(4, DIM)).sum().backward()
        host_locals = {id(dtensor_local(param)) for param in model.parameters()}
        seen = [facts["self"] for hook, facts in log() if hook == "pre"]
        assert seen and not any(id(local) in host_locals for local in seen)
        assert all(local.device == torch.device("cpu") for local in seen)

    thread_world(run, world_size=2)
