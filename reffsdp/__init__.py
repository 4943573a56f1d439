"""reffsdp: a readable reference implementation of PyTorch Fully Sharded Data Parallel.

Import-compatible with ``torch.distributed.fsdp``: swap ``from torch.distributed.fsdp
import X`` for ``from reffsdp import X``.

[Note: process-wide state]
Almost all state lives on modules, parameters and the per-root contexts. Nine things are
module globals, each safe when every rank is a thread of one process (the threaded test
harness):

* ``per_param/sharded_param.py`` ``_uids``: a counter whose numbers are stamped on original
  parameters (``_reffsdp_original_uid``) so two ``fully_shard`` calls can tell a shared
  parameter from a new one that reuses a freed ``id``. The stamp lives as long as the
  parameter; ``next()`` on the counter is atomic, so ranks never get the same number.
* ``core/comms.py`` ``_interceptors``: collectives tests route elsewhere, keyed by
  (collective, global rank), added and removed by ``intercept()`` under a lock. Each rank
  sees only its own entries; empty outside such a test.
* ``core/comms.py`` ``_separate_groups``: the second process group made once per group for
  reduce-scatters, weakly keyed, so it lives as long as the original group. Each rank's
  group is its own object, so ranks never share an entry.
* ``core/comms.py`` ``_REDUCE_OPS``: the reduce ops each backend carries out, by backend
  name; ``register_reduce_ops()`` adds a backend defined outside torch (a test harness's)
  for the process. Every rank registers the same entry.
* ``per_param/fully_shard.py`` ``_fsdp_classes``: the ``FSDP<Module>`` class made for each
  module class, kept for the process. Two ranks racing to make one class at worst make two
  equivalent classes, both subclasses of ``FSDPModule`` and the module class.
* ``core/streams.py`` ``_cpu``: the stream backend CPU work runs through (see [Note: stream
  backends] there): the host's, or a simulated one that ``reffsdp.testing.simulated_streams()``
  installs for its block and takes out again. The simulated backend keeps each rank
  thread's streams apart itself, so ranks share it safely; two blocks may not nest.
* ``core/profiling.py`` ``_observer``: while simulated streams trace a run, the function
  that names each phase (copy-in, all-gather, ...) for them; installed and removed with
  the simulation, and it keeps no state of its own (each rank thread's phases live with that
  thread's streams).
* ``wrap.py`` ``_wrap_context``: the ``enable_wrap`` settings, a context variable and so
  per thread.
* ``wrapper/dcp_support.py`` ``_entered`` and ``_originals``: while a call of
  ``reffsdp.checkpoint`` (or a ``with reffsdp.checkpoint.recognize_wrappers()`` block) runs,
  two module-level names of ``torch.distributed.checkpoint.state_dict`` (its ``FSDP`` class
  and ``_get_module_fsdp_state_if_fully_sharded_module``) hold stand-ins that send this
  package's wrappers to their own state-dict functions and everything else to torch's
  objects. A count under a lock puts torch's objects back when the last such call, of any
  thread, ends; meanwhile other threads see the stand-ins, which act as torch's objects for
  every model without this package's wrappers. Building a wrapper leaves DCP's module as
  it was.

Besides these, the first ``fully_shard`` call or wrapper built replaces the hook methods of
the core's iteration driver (``core/driver.py``) with dynamo-disabled versions, once, and the
first wrapper built those of its own class (``core/compile_support.py``).
``FSDPModule.set_symm_mem_for_comm(backend)`` chooses torch's symmetric-memory backend for
the process, as torch's own method does ([Note: symmetric memory] in ``per_param/symm_mem.py``).
``python -m reffsdp.swap`` rebinds the public names of torch's FSDP modules to this
package's objects, for good, in the process it runs a program in ([Note: the swap] in
``swap.py``); importing reffsdp never does.
Every private torch API reffsdp calls is in ``core/torch_internals.py`` (overrides of
private methods in subclasses aside: see [Note: private torch APIs] there).
"""

from . import wrap as wrap  # ``reffsdp.wrap`` after ``import reffsdp``, as torch's
from .api import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from .fully_sharded_data_parallel import FullyShardedDataParallel, OptimStateKeyType
from .per_param import (
    CPUOffloadPolicy,
    DataParallelMeshDims,
    FSDPModule,
    GradientReductionHandle,
    MixedPrecisionPolicy,
    OffloadPolicy,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from .wrapper import FlatParameter as FlatParameter

# FlatParameter is importable from here as from torch's package, but not in __all__ (nor
# is it in torch's).
__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "GradientReductionHandle",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]
