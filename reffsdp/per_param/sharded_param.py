"""One parameter's two forms: the sharded DTensor the optimizer sees, and the unsharded
tensor the module computes with.

[Note: tensor lifecycle]
For each original parameter we keep:

* ``padded_shard`` (1D, ``layout.padded_shard_numel``): this rank's rows, zero-padded so all
  ranks contribute equally to collectives. The sharded parameter's local tensor is a view
  of its first ``local_shard_numel`` elements, so optimizer steps write straight into it.
  Each parameter owns this storage, its local tensor at offset 0: packing a group's shards
  end to end in one buffer would save the all-gather's copy-in, but a DTensor whose local
  tensor starts inside a larger storage cannot be deep-copied (``copy.deepcopy`` of a
  state dict fails in torch 2.13).
* ``sharded_param``: an ``nn.Parameter`` wrapping a ``DTensor`` with the original global
  size. This is what ``module.parameters()`` and ``state_dict()`` show between iterations.
* ``gathered`` (1D, ``world_size * padded_shard_numel``, compute dtype): the all-gather's
  destination. Allocated on first unshard; afterwards its *storage* is freed
  (``resize_(0)``) on reshard and re-grown on unshard. The tensor object stays the same
  from one unshard to the next (it is replaced only when the compute dtype or the shard
  storage changes: ``reset_sharded_param``), so tensors autograd saved in forward still
  point at it when backward re-gathers.
* ``unsharded_param``: an ``nn.Parameter`` viewing ``gathered`` (dim 0 sharding; for other
  dims, a separate buffer the rank blocks are concatenated into). Built once.

With ``keep_unsharded_storage`` (``FSDPModule.set_keep_unsharded_storage``) resharding keeps
the storage of ``gathered`` (and of the dim > 0 buffer): the next unshard gathers into the
same memory, so the unsharded parameter's data pointer never changes (what CUDA graph
capture needs), at the cost of holding the unsharded bytes between uses.

Writes into ``gathered`` go through ``.data``: that alias has its own version counter, so
re-gathering in backward does not make autograd reject tensors it saved in forward.

A parameter whose local tensor defines the all-gather extension hooks has no ``gathered``:
its :class:`~reffsdp.per_param.extensions.AllGatherExtension` holds the gathered outputs and
the post hook builds ``unsharded_param`` (see [Note: all-gather extensions] in
``extensions``).

[Note: the pending gradient]
With gradient sync off (``set_requires_gradient_sync(False)``) a backward reduces nothing:
its gradient stays where autograd put it, ``unsharded_param.grad``, and later backwards add
to it. Between backwards the parameter is resharded (its data freed), but the gradient
stays on the unsharded parameter object, so ``unshard()`` shows it as ``weight.grad``, and
whatever a user does to it (scale it, zero it, replace it) is what the next synced backward
reduces, as with torch's ``fully_shard``. It is kept in the reduce dtype
(``MixedPrecisionPolicy.reduce_dtype``, else the dtype it was computed in): when that is
wider than the compute dtype it is upcast once, and the parameter's ``grad_dtype`` tells
autograd to add later gradients in that dtype; the reduction restores the parameter's own.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..core import torch_internals
from ..core.compat import fully_shard_default_reduce_dtype
from ..core.member import PaddedShardMember, resolve_dtypes
from ..core.mesh import MeshInfo
from ..core.sharding import ShardLayout, contiguous_strides, shard_tensor, unshard_from_gathered
from ..core.streams import backend_for
from .api import MixedPrecisionPolicy
from .extensions import AllGatherExtension, ParamFacts, defines_extension
from .mesh import TensorParallelSpec, sharded_spec


@dataclass(frozen=True)
class ParamRef:
    """Where a parameter is registered: ``getattr(module, name)``."""

    module: nn.Module
    name: str

    def set(self, param: nn.Parameter) -> None:
        # Writing the dict directly skips nn.Module.__setattr__'s checks: this is a swap
        # of one registered parameter for another, on the hot path of every unshard.
        torch_internals.registered_parameters(self.module)[self.name] = param


def _local_tensor(dtensor: DTensor) -> torch.Tensor:
    """The local tensor of a DTensor itself (not an autograd view of it, nor a functorch
    wrapper of it: see ``torch_internals.dtensor_local``)."""
    return torch_internals.dtensor_local(dtensor)


_uids = itertools.count()


def _original_uid(param: nn.Parameter) -> int:
    """A number that identifies ``param`` for as long as any call may see it.

    ``id()`` is not enough: once an earlier call replaced a parameter, the original can be
    freed and its id reused by a later parameter, which would look "shared". The number is
    stamped on the original parameter, which FSDP replaces and never manages itself.
    """
    uid = param.__dict__.get("_reffsdp_original_uid")
    if uid is None:
        uid = next(_uids)
        param.__dict__["_reffsdp_original_uid"] = uid
    return uid


# [Note: replaced parameters]
# A user may register a new parameter under a sharded one's name between fully_shard and
# the first forward (``module.weight = nn.Parameter(...)``, e.g. to load values). Lazy init
# adopts it through ``reset_sharded_param``: a DTensor with our sharding is taken as is,
# a plain tensor of the original size is sharded as the original was (each rank keeps its
# rows, so every rank must pass the same full tensor). ``load_state_dict(assign=True)``
# registers new DTensors the same way, at any time, and its post-hook adopts them. After
# lazy init a plain replacement would be silently ignored (FSDP keeps gathering the old
# shards, which the optimizer may hold), so ``check_registered`` refuses it instead.
#
# A tied parameter (one tensor under several names, e.g. an output layer reusing the
# embedding table) is one sharded parameter, so its names must keep one tensor:
# 1. The new tensors under its names may be several objects (``load_state_dict(assign=
#    True)`` registers one per state-dict key) if they hold the same values: the first,
#    in the order of the names, is adopted and every name is tied to it again.
# 2. Outside a load, every name must be replaced: replacing some names only would untie
#    them, which one sharded parameter cannot do. A load may leave some names as they were,
#    since a state dict may hold a tied tensor once, and a grouped call's load hooks
#    run as each of its modules finishes loading.
# 3. A name may not be removed.


class ShardedParam(PaddedShardMember):
    """Shards one parameter over ``mesh_info`` and swaps it between its two forms."""

    def __init__(
        self,
        param: nn.Parameter,
        refs: list[ParamRef],
        mesh_info: MeshInfo,
        device: torch.device,
        shard_dim: int = 0,
        *,
        name: str | None = None,
        offload: bool = False,
        pin_memory: bool = False,
        param_dtype_override: torch.dtype | None = None,
        mp_policy: MixedPrecisionPolicy | None = None,
    ) -> None:
        self.refs = refs
        # The fully_shard call's policy: what an all-gather extension's pre hook is told.
        self.mp_policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
        # How messages name the parameter: its path under the module given to fully_shard,
        # until the root's lazy init sets its name under the root (``root_fqn``).
        self.name = name if name is not None else refs[0].name
        self.root_fqn: str | None = None
        _check_shardable(param, shard_dim, mesh_info.shard_size, self.fqn, self.description)
        # Identity of the original parameter, to catch one tensor sharded by two groups.
        self.orig_param_uid = _original_uid(param)
        self.mesh_info = mesh_info
        self.device = device
        self.shard_dim = shard_dim
        if mesh_info.spmd is not None:
            mesh_info.spmd.check_param(param, self.shard_dim, self.description)
        self._init_layout(param)
        self._init_dtypes_and_forms(param.dtype, param_dtype_override)
        self._init_shard(param, offload, pin_memory)
        # Refuse a tensor with one extension hook of the two now; the hooks themselves are
        # looked up at each unshard (see [Note: all-gather extensions]).
        defines_extension(_local_tensor(self.sharded_param), self.description)

    def _init_layout(self, param: nn.Parameter) -> None:
        """Where this rank's rows are, and the spec the sharded DTensor carries."""
        # A DTensor parameter (tensor parallel): FSDP shards its local shard.
        self.tp_spec: TensorParallelSpec | None = None
        if isinstance(param, DTensor):
            self.tp_spec = TensorParallelSpec(param.device_mesh, tuple(param.placements))
        self.global_size = param.size()
        self.spec_mesh, self.spec_placements = sharded_spec(
            self.mesh_info, self.shard_dim, self.tp_spec
        )
        self._dtensor_specs: dict[torch.dtype, Any] = {}  # see _to_dtensor
        local_size = param.to_local().size() if isinstance(param, DTensor) else param.size()
        self.layout = ShardLayout(
            local_size, self.shard_dim, self.mesh_info.shard_size, self.mesh_info.shard_rank
        )

    def _init_dtypes_and_forms(
        self, orig_dtype: torch.dtype, param_dtype_override: torch.dtype | None
    ) -> None:
        """The dtypes (set at lazy init) and the unsharded form's slots, all empty."""
        self.orig_dtype = orig_dtype
        # What ``MixedPrecisionPolicy.param_dtype_override_fn`` chose for this parameter
        # instead of the policy's ``param_dtype`` (None: the policy's).
        self.param_dtype_override = param_dtype_override
        self.param_dtype: torch.dtype | None = None
        self.reduce_dtype: torch.dtype | None = None
        # Resharding keeps the unsharded storage (see [Note: tensor lifecycle]).
        self.keep_unsharded_storage = False
        self.gathered: torch.Tensor | None = None
        self.unsharded_param: nn.Parameter | None = None
        self._unsharded_data: torch.Tensor | None = None
        # reshard_after_forward=k: this rank's block of ``gathered`` between fwd and bwd.
        self.post_forward_shard: torch.Tensor | None = None
        # Set at the first unshard through the local tensor's extension hooks.
        self.extension: AllGatherExtension | None = None

    def _init_shard(self, param: nn.Parameter, offload: bool, pin_memory: bool) -> None:
        """Cut this rank's padded shard out of ``param`` and register it as a DTensor."""
        local_param = param.to_local() if isinstance(param, DTensor) else param
        on_device = local_param.detach()
        if on_device.device != self.device and on_device.device.type != "meta":
            on_device = on_device.to(self.device)
        padded = shard_tensor(on_device, self.layout)
        # CPU offload: the shard (hence grads and optimizer state) lives on the host; a CPU
        # compute device makes this a no-op (unless simulated streams give it memory of its
        # own: see [Note: stream backends] in core/streams). Pinned memory lets copies
        # overlap compute.
        self.offload = offload and backend_for(self.device).separate_host_memory
        self.pin_memory = pin_memory and self.offload
        if self.offload:
            padded = self._to_host(padded)
        self._set_padded_shard(padded)
        self.sharded_param = nn.Parameter(
            self._to_dtensor(self._local_view()), requires_grad=param.requires_grad
        )
        # nn.Parameter wraps a detached DTensor, which holds a local tensor of its own
        self._installed_local = _local_tensor(self.sharded_param)

    # -- the sharded form ---------------------------------------------------------------

    def _set_padded_shard(self, padded: torch.Tensor) -> None:
        """Own ``padded`` (this rank's padded shard, in the parameter's shape) as the shard.

        The shaped tensor is kept next to its 1D view: a parameter tensor subclass (torchao's
        NF4) may flatten with ``view(-1)`` but not take its shape back.
        """
        self._padded_shard_shaped = padded
        self.padded_shard = padded.view(-1)

    def _local_view(self) -> torch.Tensor:
        return self._rows_of(self._padded_shard_shaped)

    def _rows_of(self, padded: torch.Tensor) -> torch.Tensor:
        """The rows of a padded shard this rank owns (``padded`` itself where none is padding,
        so a subclass that cannot be sliced needs no slice)."""
        if self.layout.local_rows == padded.size(self.shard_dim):
            return padded
        return padded.narrow(self.shard_dim, 0, self.layout.local_rows)

    def _to_dtensor(self, local: torch.Tensor) -> DTensor:
        """Wrap a local shard (of the parameter or its gradient) with the sharded spec.

        Built on a spec made once per dtype rather than with ``DTensor.from_local``, which
        runs an autograd function and builds a new spec on every call (about 15x slower, and
        gradients are wrapped once per parameter per step), and which would move a host
        shard (CPU offload on an accelerator mesh) to the mesh's device.
        """
        spec = self._dtensor_specs.get(local.dtype)
        if spec is None:
            spec = torch_internals.dtensor_spec(
                self.spec_mesh,
                tuple(self.spec_placements),
                self.global_size,
                contiguous_strides(self.global_size),
                local.dtype,
            )
            self._dtensor_specs[local.dtype] = spec
        return torch_internals.dtensor_from_spec(local, spec)

    def reset_sharded_param(self, *, loading: bool = False) -> None:
        """Re-read the registered parameter and re-pad its local tensor if it changed.

        Runs at lazy init, after ``.to(dtype)``/``to_empty`` and after
        ``load_state_dict(assign=True)`` (``loading``). The registered parameter may be a new
        one (see [Note: replaced parameters]); and ``nn.Module._apply`` swaps each DTensor's
        local tensor for a converted copy that no longer views ``padded_shard``. Either way,
        copy the local tensor into a padded buffer of its dtype and device so all-gathers and
        the optimizer keep sharing storage.
        """
        self._adopt_replacement(loading)
        local = _local_tensor(self.sharded_param)
        if self._views_padded_shard(local):
            return
        padded = local.new_zeros(self.layout.padded_shard_size)
        if local.device.type != "meta":
            self._rows_of(padded).copy_(local)
        self._set_padded_shard(padded)
        self.orig_dtype = local.dtype
        if self.offload and local.device.type not in ("cpu", "meta"):
            raise RuntimeError(
                f"{self.fqn}: with CPU offload, sharded parameters must be on the CPU, got "
                f"{local.device}; load a CPU state dict or use to_empty(device='cpu')"
            )
        # A view of our padded buffer in place of the local tensor ``module.to(...)`` or
        # ``to_empty`` made: the parameter object stays the same.
        self._installed_local = self._local_view()
        torch_internals.set_dtensor_local(self.sharded_param, self._installed_local)
        self.gathered = None
        self.unsharded_param = None
        self._unsharded_data = None
        self.extension = None

    def _views_padded_shard(self, local: torch.Tensor) -> bool:
        """Whether the sharded parameter's local tensor still is (a view of) ``padded_shard``,
        so all-gathers read what the optimizer writes.

        The tensor installed last always is. Another plain tensor is if it shares the
        storage, dtype and device. A tensor subclass that wraps others (an fp8 or NF4
        weight) has no storage of its own to compare, so for it only the installed tensor
        counts: anything else is copied into a new padded buffer.
        """
        if local is self._installed_local:
            return True
        if type(local) is not torch.Tensor or type(self.padded_shard) is not torch.Tensor:
            return False
        padded = self.padded_shard
        return (
            local.untyped_storage().data_ptr() == padded.untyped_storage().data_ptr()
            and local.dtype == padded.dtype
            and local.device == padded.device
        )

    def _adopt_replacement(self, loading: bool) -> None:
        """Take over a parameter registered in place of ours (see [Note: replaced parameters])."""
        # The registered parameters, not getattr: only a registered parameter counts, not a
        # plain attribute or property of the same name.
        registered = [
            torch_internals.registered_parameters(ref.module).get(ref.name) for ref in self.refs
        ]
        if all(p is self.sharded_param for p in registered):
            return
        kept = any(p is self.sharded_param for p in registered)
        if any(p is None for p in registered) or (kept and not loading):  # rules 3 and 2
            raise ValueError(
                f"{self.description} is registered under several names ({self._ref_names()}) "
                "and some were replaced or removed; replace all of them with the same parameter"
            )
        replacements = {id(p): p for p in registered if p is not self.sharded_param}
        new = [self._as_sharded(p) for p in replacements.values()]
        self._check_same_values(new)  # rule 1
        self.sharded_param = new[0]
        for ref in self.refs:
            ref.set(new[0])

    def _ref_names(self) -> str:
        return ", ".join(f"{ref.name!r} of {type(ref.module).__name__}" for ref in self.refs)

    def _as_sharded(self, new: nn.Parameter) -> nn.Parameter:
        """A replacement as our sharded parameter: a DTensor checked, a plain tensor cut."""
        if not isinstance(new, DTensor):
            return self._shard_replacement(new)
        if new.placements != self.sharded_param.placements or new.size() != self.global_size:
            raise ValueError(
                f"{self.description} was replaced by a DTensor of size "
                f"{tuple(new.size())} with placements {new.placements}; fully_shard needs "
                f"size {tuple(self.global_size)} and placements {self.spec_placements}"
            )
        return new

    def _check_same_values(self, new: list[nn.Parameter]) -> None:
        """Refuse tensors that a tied parameter's names would hold with different values."""
        locals_ = [_local_tensor(p) for p in new]
        if any(t.device.type == "meta" for t in locals_):
            return
        if any(not torch.equal(t.to(locals_[0].device), locals_[0]) for t in locals_[1:]):
            raise ValueError(
                f"{self.description} is one parameter registered under several names "
                f"({self._ref_names()}), which were given tensors with different values; "
                "fully_shard shards it as one tensor, so give every name the same values "
                "(or untie the names before fully_shard)"
            )

    def _shard_replacement(self, param: nn.Parameter) -> nn.Parameter:
        """This rank's rows of a plain (full) replacement, as a sharded parameter."""
        if self.tp_spec is not None or self.mesh_info.spmd is not None:
            raise ValueError(
                f"{self.description} is a DTensor parameter and was replaced by a plain "
                f"tensor; replace it with a DTensor with placements {self.spec_placements}"
            )
        if param.size() != self.global_size:
            raise ValueError(
                f"{self.description} was replaced by a tensor of size {tuple(param.size())}, "
                f"but fully_shard sharded a parameter of size {tuple(self.global_size)}"
            )
        rows = param.detach().narrow(
            self.shard_dim, self.layout.local_offset, self.layout.local_rows
        )
        if rows.device.type != "meta":
            rows = rows.to("cpu" if self.offload else self.device)
        rows = rows.clone(memory_format=torch.contiguous_format)
        return nn.Parameter(self._to_dtensor(rows), requires_grad=param.requires_grad)

    def check_registered(self) -> None:
        """Refuse a parameter replaced after lazy init (see [Note: replaced parameters])."""
        for ref in self.refs:
            # see _adopt_replacement
            current = torch_internals.registered_parameters(ref.module).get(ref.name)
            if current is None or (
                current is not self.sharded_param and current is not self.unsharded_param
            ):
                raise RuntimeError(
                    f"parameter {self.fqn!r} of {type(ref.module).__name__} was replaced or "
                    "removed after fully_shard initialized it at the first forward (or "
                    "unshard()); FSDP would ignore the new tensor. Replace parameters before "
                    "the first forward, or change values in place (param.copy_(...) or "
                    "load_state_dict)."
                )

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        return backend_for(self.device).to_host(tensor, pin=self.pin_memory)

    def lazy_init(self, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None):
        """Re-pad the shard if something replaced it, then resolve mixed precision (see
        [Note: mixed precision] in ``param_group``).

        ``param_dtype`` and ``reduce_dtype`` are the policy's. This parameter computes in
        its override, if it has one; without a policy ``reduce_dtype`` it reduces in the
        installed torch's default (entry 5 of [Note: torch versions] in ``compat``). Casts
        that would be no-ops are dropped.
        """
        self.reset_sharded_param()
        self.orig_dtype = self.padded_shard.dtype
        if self.param_dtype_override is not None:
            param_dtype = self.param_dtype_override
        if reduce_dtype is None:
            compute_cast, _ = resolve_dtypes(self.orig_dtype, param_dtype, None)
            reduce_dtype = fully_shard_default_reduce_dtype(compute_cast, self.orig_dtype)
        self.param_dtype, self.reduce_dtype = resolve_dtypes(
            self.orig_dtype, param_dtype, reduce_dtype
        )

    @property
    def is_materialized(self) -> bool:
        return self.padded_shard.device.type != "meta"

    @property
    def shard_numel(self) -> int:
        return self.layout.padded_shard_numel

    @property
    def requires_grad(self) -> bool:
        return self.sharded_param.requires_grad

    @property
    def fqn(self) -> str:
        """The parameter's name under the root module (before lazy init: its path under the
        module given to ``fully_shard``)."""
        return self.root_fqn if self.root_fqn is not None else self.name

    @property
    def description(self) -> str:
        """``'blocks.0.in_proj.weight' (Linear)``: the name and the owning module's class."""
        return f"{self.fqn!r} ({type(self.refs[0].module).__name__})"

    # -- all-gather input and output (see PaddedShardMember) -----------------------------

    def _padded_shard(self) -> torch.Tensor:
        return self.padded_shard

    @property
    def _gathered_numel(self) -> int:
        return self.layout.world_size * self.layout.padded_shard_numel

    def _forget_unsharded(self) -> None:
        self.unsharded_param = None

    def all_gather_inputs(self) -> list[torch.Tensor]:
        """The padded shard in the compute dtype, or what the local tensor's extension hook
        hands over (see [Note: all-gather extensions])."""
        local = _local_tensor(self.sharded_param)
        if not defines_extension(local, self.description):
            if self.extension is not None:  # the hooks went away: gather plainly again
                self.extension = None
                self.unsharded_param = None
            return [self.all_gather_input()]
        if self.extension is None:
            self.extension = AllGatherExtension(self._extension_facts())
            self.unsharded_param = None  # the post hook builds it from now on
        if self.offload or local.device != self.device:  # rule 1: the compute device's copy
            local = backend_for(self.device).to_device(local, self.device, non_blocking=True)
        return self.extension.all_gather_inputs(local)

    def _extension_facts(self) -> ParamFacts:
        return ParamFacts(
            description=self.description,
            mesh_info=self.mesh_info,
            outer_size=self.layout.global_size,
            padded_shard_size=self.layout.padded_shard_size,
            module=self.refs[0].module,
            mp_policy=self.mp_policy,
        )

    def all_gather_outputs(self) -> list[torch.Tensor]:
        if self.extension is not None:
            return self.extension.output_buffers()
        return [self.all_gather_output()]

    def keep_post_forward_shard(self, rank: int, world_size: int) -> None:
        """Keep this rank's ``1/world_size`` of ``gathered`` for a cheaper backward all-gather.

        With ``reshard_after_forward=k``, rank ``j`` of a ``k``-rank subgroup keeps the
        ``j``-th block of ``gathered``; gathering the blocks over the subgroup rebuilds it.
        """
        gathered = self.gathered
        if self.extension is not None:  # rule 4 of [Note: all-gather extensions]
            gathered = self.extension.post_forward_source(self.fqn)
        assert gathered is not None
        self.post_forward_shard = gathered.detach().chunk(world_size)[rank].clone()

    def post_forward_all_gather_input(self) -> torch.Tensor:
        if self.extension is not None:  # rule 4 of [Note: all-gather extensions]
            raise NotImplementedError(
                f"{self.description} gathers itself through fsdp_pre_all_gather, which cannot "
                "run on the block an int reshard_after_forward kept after forward; use "
                "reshard_after_forward=True or False for modules with such parameters"
            )
        assert self.post_forward_shard is not None
        shard, self.post_forward_shard = self.post_forward_shard, None
        return shard

    def finish_unshard(self) -> None:
        """After copy-out: build (once) or refresh the unsharded parameter."""
        if self.extension is not None:
            self._finish_extension_unshard()
            return
        assert self.gathered is not None
        if self.shard_dim != 0:
            full = unshard_from_gathered(self.gathered.data, self.layout)
            if self._unsharded_data is None or self._unsharded_data.dtype != full.dtype:
                self._unsharded_data = torch.empty_like(full)
                self.unsharded_param = None
            elif self._unsharded_data.untyped_storage().size() == 0:
                self._unsharded_data.untyped_storage().resize_(full.numel() * full.element_size())
            self._unsharded_data.data.copy_(full)
        if self.unsharded_param is None:
            data = self._unsharded_data
            if data is None:
                data = unshard_from_gathered(self.gathered, self.layout)
            self.unsharded_param = self._as_unsharded_param(data)
        if self.unsharded_param.requires_grad != self.requires_grad:
            self.unsharded_param.requires_grad_(self.requires_grad)

    def _finish_extension_unshard(self) -> None:
        """The post hook builds the unsharded parameter (first time) or refills it."""
        assert self.extension is not None
        local = _local_tensor(self.sharded_param)
        if self.unsharded_param is None:
            data = self.extension.build(local, self.compute_dtype)
            self.unsharded_param = self._as_unsharded_param(data)
        else:
            self.extension.refill(local, self.compute_dtype, out=self.unsharded_param)
        if self.unsharded_param.requires_grad != self.requires_grad:
            self.unsharded_param.requires_grad_(self.requires_grad)

    def _as_unsharded_param(self, data: torch.Tensor) -> nn.Parameter:
        """``data`` (this rank's whole local parameter) as the parameter the module computes
        with: a DTensor again for a tensor-parallel parameter."""
        if self.tp_spec is not None:
            data = DTensor.from_local(
                data,
                self.tp_spec.mesh,
                self.tp_spec.placements,
                run_check=False,
                shape=self.global_size,
                stride=contiguous_strides(self.global_size),
            )
        return nn.Parameter(data, requires_grad=self.requires_grad)

    def free_unsharded(self) -> None:
        """Release the unsharded storage; the tensor objects stay for the next unshard."""
        for tensor in (self.gathered, self._unsharded_data):
            if tensor is not None:
                tensor.untyped_storage().resize_(0)
        if self.extension is not None:
            self.extension.free()

    @contextlib.contextmanager
    def in_orig_dtype(self) -> Iterator[None]:
        aside = (self.gathered, self.unsharded_param, self._unsharded_data, self.param_dtype)
        self.gathered = self.unsharded_param = self._unsharded_data = self.param_dtype = None
        try:
            yield
        finally:
            self.gathered, self.unsharded_param, self._unsharded_data, self.param_dtype = aside

    # -- registration -------------------------------------------------------------------

    def to_sharded(self) -> None:
        for ref in self.refs:
            ref.set(self.sharded_param)
        if not self.keep_unsharded_storage:
            self.free_unsharded()
        self.post_forward_shard = None

    def to_sharded_post_forward(self, rank: int, world_size: int) -> None:
        if self.tp_spec is not None:
            raise NotImplementedError(
                f"{self.fqn}: an int reshard_after_forward is not supported for DTensor "
                "(tensor-parallel) parameters"
            )
        self._to_sharded_post_forward(rank, world_size)

    def _to_sharded_post_forward(self, rank: int, world_size: int) -> None:
        """Register the sharded parameter but keep a larger block for backward's all-gather.

        The registered tensor is the ordinary sharded parameter, so the module always shows
        a correct sharded view; only the all-gather source differs.
        """
        self.keep_post_forward_shard(rank, world_size)
        for ref in self.refs:
            ref.set(self.sharded_param)
        if not self.keep_unsharded_storage:
            self.free_unsharded()

    def to_unsharded(self) -> None:
        assert self.unsharded_param is not None, "to_unsharded() before an all-gather finished"
        for ref in self.refs:
            ref.set(self.unsharded_param)

    # -- gradients ----------------------------------------------------------------------

    def take_grad_for_reduce(self, zeros_if_unused: bool) -> torch.Tensor | None:
        """Pop the unsharded gradient (this backward's, plus any pending from backwards with
        sync off), laid out so dim 0 splits into the rank chunks."""
        grad = self._pop_unsharded_grad()
        if grad is None and zeros_if_unused:
            size, dtype = self.layout.global_size, self.compute_dtype
            grad = torch.zeros(size, dtype=dtype, device=self.device)
        if grad is None or self.shard_dim == 0:
            return grad
        # Sharded on dim d > 0: chunk r along d becomes block r along dim 0.
        world_size = self.layout.world_size
        chunks = grad.chunk(world_size, dim=self.shard_dim)
        return torch.cat([chunk.contiguous().view(-1) for chunk in chunks]).view(
            world_size * self.layout.padded_shard_size[0], -1
        )

    def _pop_unsharded_grad(self) -> torch.Tensor | None:
        param = self.unsharded_param
        if param is None or param.grad is None:
            return None
        grad = self._local_unsharded_grad()
        self.discard_grads()
        return grad

    def keep_unsharded_grad(self) -> None:
        """Gradient sync is off: leave the gradient on the unsharded parameter, in the
        reduce dtype (see [Note: the pending gradient])."""
        param = self.unsharded_param
        if param is None or param.grad is None:
            return
        grad = param.grad
        dtype = self.reduce_dtype or grad.dtype
        if grad.dtype != dtype:
            param.grad = None  # torch lets grad_dtype change only with no gradient there
            param.grad_dtype = dtype
            param.grad = grad.to(dtype)

    def _local_unsharded_grad(self) -> torch.Tensor:
        """The unsharded gradient as a plain tensor: for TP, in the parameter's own layout.

        A TP gradient may arrive with other placements (e.g. ``Partial``); redistributing
        it to the parameter's spec first makes its local tensor line up with our shards. On
        an SPMD mesh a ``Partial`` on a data-parallel dim stays for our own reduction.
        """
        assert self.unsharded_param is not None and self.unsharded_param.grad is not None
        grad = self.unsharded_param.grad
        if self.tp_spec is None or not isinstance(grad, DTensor):
            return grad
        placements = self.tp_spec.placements
        if self.mesh_info.spmd is not None:
            placements = self.mesh_info.spmd.grad_placements(tuple(grad.placements), placements)
        return grad.redistribute(self.tp_spec.mesh, placements).to_local()

    def accept_reduced_grad(self, shard: torch.Tensor) -> bool:
        """Add this rank's reduced chunk into the sharded parameter's DTensor ``.grad``.

        ``shard`` is the padded shard's worth of elements; the padding rows are dropped.

        Returns whether a non-blocking device-to-host copy is still in flight (CPU offload
        with pinned memory): the caller must synchronize before the optimizer reads it. The
        copy may only stay in flight when nothing on the CPU reads the gradient now: no
        existing gradient to add to, no hook to run.
        """
        layout = self.layout
        local_grad = shard.narrow(0, 0, layout.local_shard_numel).view(layout.local_shard_size)
        local_grad = local_grad.to(self.orig_dtype)
        param = self.sharded_param
        # Reduced gradients bypass AccumulateGrad, so we run the hooks it would have run
        # (e.g. an optimizer stepping inside backward).
        hooks = torch_internals.post_accumulate_grad_hooks(param)
        in_flight = self.offload and self.pin_memory and param.grad is None and not hooks
        if self.offload:
            local_grad = backend_for(self.device).to_host(local_grad, non_blocking=in_flight)
        if param.grad is None:
            param.grad = self._to_dtensor(local_grad)
        else:
            _local_tensor(param.grad).add_(local_grad)
        for hook in hooks:
            hook(param)
        return in_flight

    def discard_grads(self) -> None:
        param = self.unsharded_param
        if param is None:
            return
        param.grad = None
        if param.grad_dtype != param.dtype:  # see [Note: the pending gradient]
            param.grad_dtype = param.dtype


def _check_shardable(
    param: torch.Tensor, shard_dim: int, shard_size: int, fqn: str, name: str
) -> None:
    """Refuse, with the facts a user needs, a parameter ``fully_shard`` cannot shard.

    ``shard_dim`` is already normalized (``0 <= shard_dim < param.dim()``) by the caller;
    ``name`` is the parameter's :attr:`ShardedParam.description`.
    """
    if param.dim() == 0:
        raise ValueError(
            f"fully_shard doesn't support scalar parameters, and {name} is a scalar (0-dim) "
            f"parameter. Change {fqn} to a 1D tensor with numel equal to 1. For example "
            "nn.Parameter(value.reshape(1)) broadcasts as the scalar did."
        )
    if not param.is_contiguous():
        raise NotImplementedError(
            f"FSDP does not support non-contiguous parameters yet: {name} has size "
            f"{tuple(param.size())} and stride {param.stride()}. Register a contiguous copy "
            "before calling fully_shard, e.g. module.weight = nn.Parameter(weight.contiguous())."
        )
    local = param.to_local() if isinstance(param, DTensor) else param
    if shard_dim > 0 and local.size(shard_dim) % shard_size != 0:
        raise NotImplementedError(
            f"FSDP does not support uneven sharding on dim {shard_dim}: {name} has "
            f"size {tuple(local.size())} and dim {shard_dim} ({local.size(shard_dim)}) does "
            f"not split evenly over world size {shard_size}. Shard it on dim 0 (uneven sizes "
            "are fine there) or on a dim that splits evenly."
        )


def unique_params(module_params: list[tuple[nn.Module, str, nn.Parameter]]):
    """Group ``(module, name, param)`` triples by parameter identity, keeping first-seen order."""
    refs: dict[int, tuple[nn.Parameter, list[ParamRef]]] = {}
    for module, name, param in module_params:
        entry = refs.setdefault(id(param), (param, []))
        entry[1].append(ParamRef(module, name))
    return list(refs.values())
