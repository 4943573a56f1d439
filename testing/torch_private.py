"""Every private torch API the testing package uses, and the torch versions it must tell apart.

[Note: the harness's private torch APIs]
The harnesses reach further into torch than reffsdp does: they stand in a thread-local c10d
world for the process-wide one, complete works from Python, build torch's C++ fake group and
free a thread's DTensor cache by hand. Each such use lives here, in one function (or one
named constant) whose docstring says why the harness needs it, so that a new torch release is
checked for the testing package in this file, as for reffsdp in
``reffsdp/core/torch_internals.py``. What reffsdp itself needs (pytrees, the backward query)
the testing package takes from ``torch_internals``; nothing here is used by ``reffsdp/``.
``tests/unit/test_private_torch_uses.py`` fails on a private torch name anywhere else.

Not here: ``testing/impls/torch_fsdp.py``, which presents torch's own FSDP as an
implementation under test and so uses what torch's FSDP is made of.

[Note: torch versions of the harness]
What differs between supported torch releases only for the harness; entries 1-8 of
[Note: torch versions] in ``reffsdp.core.compat`` are reffsdp's (its entries 3, 4 and 6
moved here as entries H1, H2 and H3).

====  =================================================================  =======  =======
 #    difference                                                         before   from
====  =================================================================  =======  =======
 H1   DTensor serializes its fake-tensor propagation through a lock a   --       2.12
      threaded run can switch on (``ShardingPropagator._fake_mode_lock``);
      on 2.11 a CUDA build with no GPU crashes threads that enter a fake
      mode while others compute, unless the CUDA guard is set up first
 H2   ``init_process_group`` attaches a flight-recorder hook to every   --       2.15
      new group, which a Python-only group cannot take
 H3   the C++ ``FakeProcessGroup``'s reduce-scatter writes this rank's   --       2.13
      chunk of the input to the output (before, the output is left as
      it was)
====  =================================================================  =======  =======
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _python_dispatch

from reffsdp.core.compat import TORCH_VERSION

_c10d = dist.distributed_c10d

# -- H1. DTensor's sharding propagation under threads -----------------------------------------


def _ensure_cuda_device_guard_set() -> None:
    """Register the CUDA device guard a fake-tensor mode registers on entry, before rank
    threads race to (entry H1)."""
    torch._C._ensureCUDADeviceGuardSet()


@contextlib.contextmanager
def _fake_mode_lock(lock: threading.Lock) -> Iterator[None]:
    """Serialize DTensor's fake-tensor shape propagation with ``lock``, through the class
    attribute DTensor reads for that (torch 2.12 on); no public setting."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    saved = ShardingPropagator.__dict__["_fake_mode_lock"]
    ShardingPropagator._fake_mode_lock = lock
    try:
        yield
    finally:
        ShardingPropagator._fake_mode_lock = saved


@contextlib.contextmanager
def _locked_tensor_meta_propagation(lock: threading.Lock) -> Iterator[None]:
    """Serialize DTensor's fake-tensor shape propagation with ``lock`` by wrapping the method
    that runs it, for releases without :func:`_fake_mode_lock`'s attribute."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    name = "_propagate_tensor_meta_non_cached"
    unlocked = ShardingPropagator.__dict__[name]

    def locked(self: Any, op_schema: Any) -> Any:
        with lock:
            return unlocked(self, op_schema)

    setattr(ShardingPropagator, name, locked)
    try:
        yield
    finally:
        setattr(ShardingPropagator, name, unlocked)


@contextlib.contextmanager
def serialized_sharding_propagation() -> Iterator[None]:
    """Make DTensor's shape propagation safe for several threads at once (entry H1).

    DTensor works out an op's output shape by running the op under a ``FakeTensorMode``.
    Two things in that step are not safe to run from several threads:

    * entering the mode registers a no-op device guard for CUDA when a CUDA build of torch
      runs without a GPU. On torch 2.11 that crashed threaded runs (SIGSEGV inside the
      registration while other rank threads computed), even with the step below serialized.
      Registering it here, before any rank thread starts, leaves the threads nothing to
      register.
    * two threads inside fake modes at once. From 2.12, DTensor reads an opt-in lock class
      attribute around the step; before, the step itself is wrapped. Only that step is
      serialized, not whole ops.

    Call it from the thread that starts the rank threads.
    """
    _ensure_cuda_device_guard_set()
    if TORCH_VERSION >= (2, 12):
        serialized = _fake_mode_lock
    else:
        serialized = _locked_tensor_meta_propagation
    with serialized(threading.Lock()):
        yield


# -- H2. The flight recorder ------------------------------------------------------------------


@contextlib.contextmanager
def no_flight_recorder_for(backend: str) -> Iterator[None]:
    """Keep torch 2.15's flight-recorder hook off groups of ``backend`` (entry H2).

    ``init_process_group`` attaches the hook to every new group unless all of the group's
    backends record for themselves. The hook files its entries under the group's C++ name,
    which a group implemented in Python does not have, so attaching it raises
    ``ProcessGroup name not set``. Listing ``backend`` in c10d's private set of
    self-recording backends (there is no public setting) skips the hook for its groups
    only. Earlier torch attaches no hook: nothing to do.
    """
    if TORCH_VERSION < (2, 15):
        yield
        return
    skip = _c10d._FR_SELF_RECORDING_BACKENDS
    added = backend not in skip
    skip.add(backend)
    try:
        yield
    finally:
        if added:
            skip.discard(backend)


# -- H3. The fake process group ---------------------------------------------------------------

FAKE_REDUCE_SCATTER_WRITES_OUTPUT = TORCH_VERSION >= (2, 13)
"""Whether the fake group's reduce-scatter fills its output (entry H3); it never reduces."""


def fake_process_group_class() -> Any:
    """torch's C++ ``FakeProcessGroup``, which only its private c10d module exports:
    ``RuntimeError`` on a build without distributed support."""
    try:
        from torch._C._distributed_c10d import FakeProcessGroup
    except ImportError as error:
        raise RuntimeError(
            "this torch build has no FakeProcessGroup (its C++ c10d module); "
            "fake process groups need a torch built with distributed support"
        ) from error
    return FakeProcessGroup


# -- c10d: the world, backends, works ----------------------------------------------------------

C10D_WORLD_BASE: type = _c10d._World
"""c10d's class of its process-wide group state, which a per-thread world subclasses so that
what torch derives from its fields keeps working."""


def c10d_world() -> Any:
    """The object c10d keeps its groups in now (a thread-local one inside a threaded run):
    a rank thread checks that the run's world is still installed before it tears down."""
    return _c10d._world


@contextlib.contextmanager
def c10d_world_installed(world: Any) -> Iterator[None]:
    """Make ``world`` c10d's group state for the block, and make c10d's C++ group-name
    registry (which functional collectives look groups up in) per thread; restore both, and
    the backend name and init method ``init_process_group`` writes as module globals, on
    exit. c10d has no public way to hold groups per thread."""
    saved = {
        name: getattr(_c10d, name) for name in ("_world", "_backend", "_default_pg_init_method")
    }
    _c10d._world = world
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    try:
        yield
    finally:
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        for name, value in saved.items():
            setattr(_c10d, name, value)


def registered_backend_creator(name: str) -> Callable[..., Any] | None:
    """The creator function registered for backend ``name``, or ``None``: registering twice
    raises, and ``dist.Backend`` lists its plugins only privately."""
    plugin = dist.Backend._plugins.get(name.upper())
    return None if plugin is None else plugin.creator_fn


def completed_work(outputs: list[torch.Tensor]) -> dist.Work:
    """A work that is already done; its future's value is the list of output tensors.

    C++ readers of the future, such as DDP's built-in FP16 compression hook, require the
    value to be a typed tensor list. A future completed from Python holds an opaque Python
    object instead, so a non-empty list goes through the private ``fork`` that
    ``torch.jit.fork`` calls (minus its deprecation warning), which outside TorchScript runs
    the function at once and stores its result with the inferred type. An empty list has
    no type to infer; nothing in C++ reads it. Only a private function wraps a future in a
    work.
    """
    if outputs:
        future = torch._C.fork(lambda: outputs)
    else:
        future = torch.futures.Future()
        future.set_result(outputs)
    return torch._C._distributed_c10d._create_work_from_future(future)


# -- DTensor ----------------------------------------------------------------------------------


@contextlib.contextmanager
def dtensor_rng_tracker_restored() -> Iterator[None]:
    """Put DTensor's module-level RNG tracker back on exit: DTensor's random ops create one
    bound to the first caller's mesh, a rank's in a threaded run, and keep it privately."""
    from torch.distributed.tensor import _random as dtensor_random

    saved = dtensor_random._rng_tracker
    try:
        yield
    finally:
        dtensor_random._rng_tracker = saved


DTENSOR_REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"
"""The logger of DTensor's private redistribution module, which notes each two-step gather
(the suite quiets it)."""


# The key under which DTensor's C++ dispatch fast path keeps, in each thread's Python state,
# the object that frees that thread's sharding cache when the thread ends.
_DTENSOR_THREAD_CACHE_KEY = "__DTensor_fastpath_thread_cache_cleanup"
# CPython returns a borrowed reference: read it as an address, then take a new reference.
_thread_state_dict_address = ctypes.PYFUNCTYPE(ctypes.c_void_p)(
    ("PyThreadState_GetDict", ctypes.pythonapi)
)


def _thread_state_dict() -> dict[str, Any]:
    """This thread's Python state dict (``PyThreadState_GetDict``)."""
    return ctypes.cast(_thread_state_dict_address(), ctypes.py_object).value


def dtensor_thread_cache_held() -> bool:
    """Whether this thread holds a DTensor fast-path sharding cache (for tests)."""
    return _DTENSOR_THREAD_CACHE_KEY in _thread_state_dict()


def free_dtensor_thread_cache() -> None:
    """Free this thread's DTensor fast-path sharding cache now rather than when the thread
    ends: torch frees it under a process-wide C++ mutex while it lets go of the GIL, so
    threads that end together can deadlock there, and no public call frees it (see
    [Note: a rank thread's DTensor cache] in ``reffsdp.testing.thread_world``)."""
    _thread_state_dict().pop(_DTENSOR_THREAD_CACHE_KEY, None)


# -- dispatch modes and tensor subclasses ------------------------------------------------------

TorchDispatchMode = _python_dispatch.TorchDispatchMode
"""The base class of a mode that sees every aten op (the comm counter, the stream checker);
torch documents it but keeps it in a private module."""


def is_traceable_wrapper_subclass(value: Any) -> bool:
    """Whether ``value`` is a tensor subclass that wraps inner tensors (DTensor, a float8
    weight): a dispatch mode sees such an op again on the inner tensors."""
    return _python_dispatch.is_traceable_wrapper_subclass(value)


def is_traceable_wrapper_subclass_type(kind: type) -> bool:
    """:func:`is_traceable_wrapper_subclass` for a type, as ``__torch_dispatch__`` gets."""
    return _python_dispatch.is_traceable_wrapper_subclass_type(kind)


def disable_current_modes() -> contextlib.AbstractContextManager[Any]:
    """Leave every active dispatch mode for the block: the rank thread that completes a
    threaded collective computes the results of all ranks, which no rank's mode may see."""
    return _python_dispatch._disable_current_modes()


def make_wrapper_subclass(cls: type, like: torch.Tensor) -> torch.Tensor:
    """An instance of tensor subclass ``cls`` with ``like``'s metadata and no storage of its
    own: the way every wrapper subclass is built, through a private constructor."""
    return torch.Tensor._make_wrapper_subclass(
        cls,
        like.size(),
        strides=like.stride(),
        storage_offset=like.storage_offset(),
        dtype=like.dtype,
        layout=like.layout,
        device=like.device,
        requires_grad=like.requires_grad,
    )


DISABLED_TORCH_FUNCTION = torch._C._disabled_torch_function_impl
"""The ``__torch_function__`` that sends torch functions straight to ``__torch_dispatch__``,
as every wrapper subclass sets it."""


# -- processes ---------------------------------------------------------------------------------

DYNAMO_MODULE = "torch._dynamo"
"""Dynamo's (private) package, imported ahead by the multi-process fork server so that no
test process pays for it (see [Note: start-up cost] in ``reffsdp.testing.multiprocess``)."""
