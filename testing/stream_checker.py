"""A happens-before checker for the simulated streams: every read, write and free, per storage.

[Note: what the checker sees]
Each rank thread runs a ``TorchDispatchMode`` while the simulation runs. For every op it
takes the current logical stream (see [Note: logical streams] in ``logical_streams``),
or the host when the op touches host memory only (an optimizer stepping offloaded
parameters), stamps the op there, and reads the schema: an argument whose alias
information says ``is_write`` is written, an argument that a view merely aliases is not
touched, every other tensor argument is read, and an output with no alias is new memory,
allocated on that stream. Collectives are seen where the core issues them
(``reffsdp/core/comms.py``): on their ``comm`` stream, the input read and the output
written. Tensors are tracked by storage (a tensor subclass such as DTensor by its local
tensors), whole storages at a time.

[Note: hazards]
For each storage the checker keeps the last write and, per stream, the last read since.

* A read, on stream B, of data last written on stream A with no happens-before edge from
  the write to B: B may read the old data.
* A write, on B, to data that A may still read or write: A may see the new data, or
  overwrite it.
* A free (the storage's Python object is preserved while the storage lives, so a
  ``weakref.finalize`` on it fires when it is freed; ``UntypedStorage.resize_`` to zero
  bytes is wrapped while the simulation runs) while a stream other than the one that
  allocated it may still use it. The CUDA caching allocator hands a freed block to the next
  allocation on the stream that allocated it, with no wait of any kind; so the free is
  checked at that next allocation, against what the allocating stream is ordered after by
  then (a stream that waits before it allocates, as rule 3 does, is safe).

[Note: host memory]
On CPU every tensor is in the same memory; the checker tells host memory from device memory
as a GPU run would have it. Memory an op allocates is the device's (the op runs on a
stream), unless the op touches host memory only. Memory no op allocated, made before the
simulation or outside the dispatcher (``torch.tensor(0.0)``, an optimizer's step count, a
NumPy array), is the host's, as it is on a GPU when no device is named; so are the copies
``to_host`` makes. Ops touching host memory only run on the host; the rest on the current
stream, which reads host memory as a copy from the host does.

Each finding names the op (and where in reffsdp it was issued), the tensor (where it was
allocated: a group member's name, or the group's), both streams, and the rule of
[Note: why all-gathers get their own stream] in ``reffsdp/core/streams.py`` that prevents
it (:func:`rule_for`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from .stream_trace import OpCost
from .stream_types import RankStreams, SimStream
from .torch_private import TorchDispatchMode, is_traceable_wrapper_subclass

RULES = {
    1: "rule 1: the all-gather stream waits for the compute stream (or the post-optimizer "
    "event) before it reads the shards",
    2: "rule 2: copy-out waits for the all-gather's event",
    3: "rule 3: the all-gather buffer is kept until the all-gather stream has waited for "
    "its copy-out",
    4: "rule 4: work on another stream reads only what that stream is ordered after (a "
    "reduction is issued from the stream that produced its input, its result read after its "
    "work is waited for; run_on_stream's stream waits for the current one, and back)",
    5: "rule 5: a reduce-scatter's input is kept until the collective has completed",
    6: "rule 6: the host touches offloaded memory only after the device is done with it (the "
    "end of backward synchronizes the event behind the gradients' copies to the host)",
}
_REDUCTIONS = ("reduce-scatter", "all-reduce")
# Ops whose result the host reads (a Python number or bool): the host waits for the data.
_HOST_READS = frozenset({"_local_scalar_dense", "equal", "is_nonzero"})


@dataclasses.dataclass(frozen=True)
class Access:
    """One op's use of a storage: the stream, its tick there, and what the op was."""

    stream: SimStream
    tick: int
    op: str

    def before(self, stream: SimStream) -> bool:
        """Whether this access happens before the next op on ``stream``."""
        return stream is self.stream or stream.clock.get(self.stream.id, 0) >= self.tick


@dataclasses.dataclass
class StorageUse:
    name: str  # where it was allocated (see _provenance)
    alloc: SimStream | None  # None: allocated before we saw it
    write: Access | None = None
    reads: dict[int, Access] = dataclasses.field(default_factory=dict)  # stream id -> last

    def accesses(self) -> Iterator[Access]:
        if self.write is not None:
            yield self.write
        yield from self.reads.values()


@dataclasses.dataclass(frozen=True)
class Finding:
    """One hazard (see [Note: hazards])."""

    rank: str
    kind: str  # "read", "write" or "reuse"
    op: str  # the op that would race, and where reffsdp issued it
    tensor: str
    stream: str
    other_op: str  # the earlier use it is not ordered after
    other_stream: str
    rule: str

    def __str__(self) -> str:
        what = {
            "read": "reads data last written by",
            "write": "writes data still in use by",
            "reuse": "reuses freed memory still in use by",
        }[self.kind]
        return (
            f"{self.rank}: {self.op} on stream {self.stream!r} {what} {self.other_op} on "
            f"stream {self.other_stream!r}, with no event or wait between them; tensor: "
            f"{self.tensor}. Prevented by {self.rule}."
        )


def rule_for(kind: str, stream: SimStream, other: Access, op: str) -> str:
    """Which documented rule an unordered pair of uses breaks (see the table below).

    ===========  ==========================  ============================  ======
    kind         on stream                   earlier use                   rule
    ===========  ==========================  ============================  ======
    read, write  host                        any stream                    6
    read, write  all-gather                  any other stream              1
    read, write  compute                     all-gather (stream or comm)   2
    read, write  any other pair with a comm or user stream                 4
    reuse        all-gather                  compute, comm                 3
    reuse        compute                     comm (a reduction)            5
    ===========  ==========================  ============================  ======
    """
    mine, theirs = _role(stream), _role(other.stream)
    if kind == "reuse":
        if mine == "all-gather":
            return RULES[3]
        if mine == "compute" and theirs == "comm" and other.op.startswith(_REDUCTIONS):
            return RULES[5]
    elif mine == "host":
        return RULES[6]
    elif mine == "all-gather":
        return RULES[1]
    elif mine == "compute" and (theirs == "all-gather" or other.op.startswith("all-gather")):
        return RULES[2]
    elif "comm" in (mine, theirs) or "user" in (mine, theirs):
        return RULES[4]
    return "none of the documented rules (a new one is needed)"


def _role(stream: SimStream) -> str:
    if stream.name in ("host", "compute", "all-gather"):
        return stream.name
    return "comm" if stream.name.startswith("comm") else "user"


class Findings:
    """Every rank's findings, each once, with how often it happened."""

    def __init__(self) -> None:
        self.counts: collections.Counter[Finding] = collections.Counter()
        self._lock = threading.Lock()

    def add(self, finding: Finding) -> None:
        with self._lock:
            self.counts[finding] += 1

    def __iter__(self) -> Iterator[Finding]:
        return iter(list(self.counts))

    def __len__(self) -> int:
        return len(self.counts)

    def describe(self) -> str:
        if not self.counts:
            return "no stream hazards"
        return "\n".join(f"{f} ({n}x)" for f, n in self.counts.items())


class StreamChecker(TorchDispatchMode):
    """One rank thread's view of every storage it touches (see the module notes)."""

    def __init__(self, rank: RankStreams, findings: Findings) -> None:
        super().__init__()
        self.rank = rank
        self.findings = findings
        self.uses: dict[int, StorageUse] = {}  # by storage (its StorageImpl's address)
        self.host_memory: set[int] = set()
        self.freed: dict[int, list[tuple[StorageUse, list[Access]]]] = {}  # by stream id
        self._frees: collections.deque[int] = collections.deque()  # from finalizers
        self._finalizers: list[weakref.finalize] = []
        self._paused = 0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Ops in the block are not the rank's own (a collective backend's copies)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    # -- ops -------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self._paused:
            self._on_op(func, args, kwargs, out)
        return out

    def _on_op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        self.drain_frees()
        name = func._overloadpacket.__name__
        reads, writes = _accesses(func._schema, args, kwargs)
        news = _new_outputs(func._schema, out)
        if not writes and not news and name not in _HOST_READS:
            return  # metadata only (sizes, flags): no data touched
        touched = [t for t in [*reads, *writes] if self._use(t) is not None]
        host = bool(touched) and all(_key(t) in self.host_memory for t in touched)
        stream = self.rank.host if host else self.rank.current
        cost = OpCost(_flops(func, args, kwargs, out), _nbytes([*touched, *news]))
        self.rank.launch(stream, f"aten.{name}", reads, writes, cost)
        for tensor in news:
            self.allocated(tensor, stream, host=host, op=f"aten.{name}")
        if name in _HOST_READS:
            self._host_reads(reads)

    def _host_reads(self, reads: list[torch.Tensor]) -> None:
        """The host reads a result (``.item()``): it waits for the writes of what it reads.

        CUDA makes the host wait for the whole stream there; waiting for the data only
        orders less, so the checker never takes an order for granted that a GPU run whose
        ``.item()`` reads a CPU tensor (an optimizer's step count) would not have.
        """
        for tensor in reads:
            use = self._use(tensor)
            if use is not None and use.write is not None:
                write = use.write
                self.rank.host_waits({write.stream.id: write.tick}, write.stream)

    def on_launch(self, stream: SimStream, tick: int, op: str, reads, writes, cost) -> None:
        """Check what an op queued on ``stream`` reads and writes (see [Note: hazards])."""
        if self.rank.phases and self.rank.phases[-1] != op:
            op = f"{op} ({self.rank.phases[-1]})"
        for tensor in reads:
            self._read(self._use(tensor), Access(stream, tick, op))
        for tensor in writes:
            self._write(self._use(tensor), Access(stream, tick, op))

    def on_wait(self, stream: SimStream, clock, source: SimStream | None) -> None:
        pass

    def _read(self, use: StorageUse | None, access: Access) -> None:
        if use is None:
            return
        if use.write is not None and not use.write.before(access.stream):
            self._report("read", access, use, use.write)
        use.reads[access.stream.id] = access

    def _write(self, use: StorageUse | None, access: Access) -> None:
        if use is None:
            return
        for other in use.accesses():
            if not other.before(access.stream):
                self._report("write", access, use, other)
        use.write = access
        use.reads.clear()

    # -- memory ----------------------------------------------------------------------------

    def _use(self, tensor: torch.Tensor) -> StorageUse | None:
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            return None
        key = storage._cdata
        use = self.uses.get(key)
        if use is None:  # made where no op allocated it: host memory (see [Note: host memory])
            use = self.uses[key] = StorageUse(_provenance(), alloc=None)
            self.host_memory.add(key)
            self._watch(storage, key)
        return use

    def allocated(self, tensor: torch.Tensor, stream: SimStream, *, host: bool, op: str) -> None:
        """``tensor``'s storage is new, allocated on ``stream`` by ``op`` (host memory if
        ``host``); unless ``op`` is an ``empty``, it wrote the storage too."""
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self.uses:  # an output that shares an input's storage
            return
        if host:
            self.host_memory.add(key)
        else:
            self.reuse_check(stream)
        use = self.uses[key] = StorageUse(_provenance(), alloc=None if host else stream)
        if "empty" not in op:
            use.write = Access(stream, stream.clock[stream.id], op)
        self._watch(storage, key)

    def mark_host(self, tensor: torch.Tensor) -> None:
        """``tensor``'s storage is host memory (a copy ``to_host`` made)."""
        key = _key(tensor)
        self.host_memory.add(key)
        use = self.uses.get(key)
        if use is not None:
            use.alloc = None

    def resized(self, storage: torch.UntypedStorage, old: int, new: int) -> None:
        """``UntypedStorage.resize_`` from ``old`` to ``new`` bytes: a free, then (if
        ``new``) an allocation on the current stream."""
        self.drain_frees()
        key = storage._cdata
        if old:
            self.free(key)
        if new:
            stream = self.rank.current
            self.reuse_check(stream)
            self.uses[key] = StorageUse(_provenance(), alloc=stream)
            self._watch(storage, key)

    def free(self, key: int) -> None:
        """The storage is freed: remember the uses its allocation stream is not yet ordered
        after, to check at that stream's next allocation (see [Note: hazards])."""
        use = self.uses.pop(key, None)
        self.host_memory.discard(key)
        if use is None or use.alloc is None:
            return
        pending = [a for a in use.accesses() if not a.before(use.alloc)]
        if pending:
            self.freed.setdefault(use.alloc.id, []).append((use, pending))

    def reuse_check(self, stream: SimStream) -> None:
        """An allocation on ``stream`` may get any block freed there: check those."""
        for use, pending in self.freed.pop(stream.id, []):
            for other in pending:
                if not other.before(stream):
                    here = Access(stream, stream.clock[stream.id], "an allocation")
                    self._report("reuse", here, use, other)

    def _watch(self, storage: torch.UntypedStorage, key: int) -> None:
        self._finalizers.append(weakref.finalize(storage, self._frees.append, key))
        if len(self._finalizers) > 4096:  # forget those that fired
            self._finalizers = [f for f in self._finalizers if f.alive]

    def drain_frees(self) -> None:
        """Handle the frees finalizers reported since (they may run inside an op)."""
        while self._frees:
            self.free(self._frees.popleft())

    def close(self) -> None:
        for finalizer in self._finalizers:
            finalizer.detach()
        self._finalizers.clear()

    # -- findings --------------------------------------------------------------------------

    def _report(self, kind: str, access: Access, use: StorageUse, other: Access) -> None:
        self.findings.add(
            Finding(
                rank=self.rank.label,
                kind=kind,
                op=f"{access.op} in {_where()}",
                tensor=use.name,
                stream=access.stream.name,
                other_op=other.op,
                other_stream=other.stream.name,
                rule=rule_for(kind, access.stream, other, access.op),
            )
        )


# -- reading an op's schema ------------------------------------------------------------------


def _accesses(schema: Any, args: tuple, kwargs: dict) -> tuple[list, list]:
    """The tensors an op reads and writes (see [Note: what the checker sees])."""
    reads: list[torch.Tensor] = []
    writes: list[torch.Tensor] = []
    positional = (a for a in schema.arguments if not a.kwarg_only)
    named = ((a, kwargs[a.name]) for a in schema.arguments if a.name in kwargs)
    for argument, value in itertools.chain(zip(positional, args), named):
        info = argument.alias_info
        if info is not None and not info.is_write:
            continue  # a view of it is made: no data is touched
        (writes if info is not None else reads).extend(_plain(value))
    return reads, writes


def _new_outputs(schema: Any, out: Any) -> list[torch.Tensor]:
    """The outputs that alias no input: new memory."""
    outs = out if isinstance(out, (tuple, list)) and len(schema.returns) > 1 else (out,)
    new: list[torch.Tensor] = []
    for ret, value in zip(schema.returns, outs):
        if ret.alias_info is None:
            new.extend(_plain(value))
    return new


def _plain(value: Any) -> Iterator[torch.Tensor]:
    """The plain tensors with storage in ``value`` (a subclass's inner tensors)."""
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _plain(item)
    elif isinstance(value, torch.Tensor):
        if is_traceable_wrapper_subclass(value):
            attrs, _ = value.__tensor_flatten__()
            for attr in attrs:
                yield from _plain(getattr(value, attr))
        elif value.layout == torch.strided and value.device.type == "cpu":
            yield value


def _flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """The op's floating-point operations, where torch's flop counter knows them (matrix
    products, convolutions, attention); 0 otherwise."""
    formula = flop_registry.get(func._overloadpacket)
    if formula is None:
        return 0
    try:
        return int(formula(*args, out_val=out, **kwargs))
    except Exception:  # a formula that does not take these arguments: count nothing
        return 0


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


# -- naming ----------------------------------------------------------------------------------

_SKIP = (
    "/torch/",
    "/testing/logical_streams.py",
    "/testing/stream_checker.py",
    "/reffsdp/core/comms.py",  # name the code that asked for the collective or buffer
)
_OURS = ("/reffsdp/core/", "/reffsdp/per_param/", "/reffsdp/wrapper/")


def _where() -> str:
    """The function that issued the current op: the first frame outside torch and us."""
    frame = sys._getframe(1)
    while frame is not None and any(part in frame.f_code.co_filename for part in _SKIP):
        frame = frame.f_back
    if frame is None:
        return "?"
    code = frame.f_code
    return f"{getattr(code, 'co_qualname', code.co_name)} ({_short(code.co_filename)})"


def _provenance() -> str:
    """Where the current op runs, and for which group member or group of reffsdp."""
    where = _where()
    frame = sys._getframe(1)
    for _ in range(40):
        if frame is None:
            break
        if any(part in frame.f_code.co_filename for part in _OURS):
            owner = _owner(frame.f_locals.get("self"))
            if owner:
                return f"allocated in {where}, for {owner}"
        frame = frame.f_back
    return f"allocated in {where}"


def _owner(obj: Any) -> str | None:
    if obj is None:
        return None
    if hasattr(obj, "all_gather_input") and hasattr(obj, "fqn"):
        return f"member {obj.fqn!r}"
    if hasattr(obj, "members") and hasattr(obj, "name"):
        return f"group {obj.name!r}"
    return None


def _short(filename: str) -> str:
    for root in ("/reffsdp/", "/testing/", "/tests/"):
        if root in filename:
            return root.strip("/") + "/" + filename.split(root, 1)[1]
    return filename.rsplit("/", 1)[-1]
