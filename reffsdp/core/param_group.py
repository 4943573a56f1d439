"""A parameter group: the unit that is all-gathered and reduce-scattered together.

[Note: mixed precision]
At lazy init each parameter resolves its dtypes: ``param_dtype`` is dropped when it equals
the parameter's own dtype (or the parameter is not floating point) and ``reduce_dtype`` is
dropped when it equals the compute dtype. All-gathers run in the compute dtype (the cast
happens during copy-in), so the optimizer only ever sees the original-dtype shards.
Reductions run in ``reduce_dtype`` (or the gradient dtype) and the result is cast back to
the original dtype. Trainable parameters of one group must agree on both dtypes, since
they travel in one collective.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from . import collectives, comms
from .collectives import AllGatherResult
from .mesh import MeshInfo
from .runtime import CommContext
from .sharded_param import ShardedParam
from .states import ShardedState, TrainingState, check_state


class ParamGroup:
    """Unshards, reshards and reduces a list of :class:`ShardedParam` as one unit."""

    def __init__(
        self,
        params: list[ShardedParam],
        modules: tuple[nn.Module, ...],
        mesh_info: MeshInfo,
        device: torch.device,
        *,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        reshard_after_forward: bool = True,
        post_forward_mesh_info: MeshInfo | None = None,
    ) -> None:
        self.params = params
        self.modules = modules
        self.mesh_info = mesh_info
        self.device = device
        self._mp_dtypes = (param_dtype, reduce_dtype)
        self.reshard_after_forward = reshard_after_forward
        # reshard_after_forward=k: a mesh whose shard dim groups k ranks (see unshard()).
        self.post_forward_mesh_info = post_forward_mesh_info
        self.comm_ctx = CommContext()
        self.training_state = TrainingState.IDLE
        self.sharded_state = ShardedState.SHARDED
        self._all_gather: AllGatherResult | None = None
        self._post_forward_indices: list[int] = []
        self._partial_reduce = collectives.PartialReduce()
        self._initialized = False
        # Knobs set through FSDPModule methods.
        self.reduce_grads = True
        self.all_reduce_grads = True
        self.unshard_async_op = False
        self.reshard_after_backward = True
        self.unshard_in_backward = True
        self.gradient_divide_factor: float | None = None
        self.force_sum_reduction = False
        self.reduce_scatter_unused_params = False
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        self.all_gather_comm: comms.AllGather | None = None
        self.reduce_scatter_comm: comms.ReduceScatter | None = None
        self.reduce_scatter_group: dist.ProcessGroup | None = None  # None: the shard group

    def __repr__(self) -> str:
        names = ", ".join(type(m).__name__ for m in self.modules)
        return f"ParamGroup({names}, rank {self.mesh_info.mesh.get_rank()})"

    # -- lazy init ----------------------------------------------------------------------

    def lazy_init(self) -> None:
        """Once, at the first forward: re-pad shards and resolve mixed precision."""
        if self._initialized:
            return
        self._initialized = True
        for param in self.params:
            param.reset_sharded_param()
        meta = [p.fqn for p in self.params if p.padded_shard.device.type == "meta"]
        if meta:
            raise RuntimeError(
                f"fully_shard parameters are still on the meta device at the first forward: "
                f"{meta}. Materialize them first, e.g. module.to_empty(device=...) followed "
                "by reset_parameters()."
            )
        for param in self.params:
            param.init_dtypes(*self._mp_dtypes)
        trainable = [p for p in self.params if p.requires_grad]
        for attr in ("orig_dtype", "reduce_dtype"):
            values = {getattr(p, attr) for p in trainable}
            if len(values) > 1:
                raise AssertionError(
                    f"trainable parameters of one fully_shard group must share {attr}, got "
                    f"{sorted(map(str, values))}; shard them in separate fully_shard calls"
                )

    # -- unshard / reshard --------------------------------------------------------------

    def unshard(self, async_op: bool = True) -> None:
        """Start the group's all-gather unless it is unsharded or already gathering."""
        if self._all_gather is not None or self.sharded_state is ShardedState.UNSHARDED:
            return
        self.lazy_init()
        stream = self.comm_ctx.all_gather_stream(self.device)
        mesh_info = self.mesh_info
        if self.sharded_state is ShardedState.SHARDED_POST_FORWARD:
            mesh_info = self.post_forward_mesh_info
            assert mesh_info is not None
            stream.wait_for_compute()  # the post-forward shards were cloned there
        with stream.issuing():
            if self.sharded_state is ShardedState.SHARDED_POST_FORWARD:
                inputs = [p.post_forward_all_gather_input() for p in self.params]
            else:
                inputs = [p.all_gather_input() for p in self.params]
            self._all_gather = collectives.foreach_all_gather(
                inputs,
                mesh_info.shard_group,
                mesh_info.shard_size,
                mesh_info.shard_rank,
                async_op=async_op,
                comm=self.all_gather_comm,
            )
            self._all_gather.event = stream.record()

    def wait_for_unshard(self) -> None:
        """Finish a started all-gather and register the unsharded parameters."""
        if self._all_gather is None:
            return
        result, self._all_gather = self._all_gather, None
        collectives.foreach_all_gather_copy_out(result, self.params)
        self.comm_ctx.all_gather_stream(self.device).consumed(result.output)
        for param in self.params:
            param.to_unsharded()
        self.sharded_state = ShardedState.UNSHARDED

    def reshard(self) -> None:
        """Register the sharded parameters and free the unsharded storage."""
        if self._all_gather is not None:  # an unconsumed prefetch
            self._all_gather.wait()
            self._all_gather = None
        if self.sharded_state is ShardedState.SHARDED:
            return
        for param in self.params:
            param.to_sharded()
        self.sharded_state = ShardedState.SHARDED

    def _reshard_post_forward(self) -> None:
        if self.sharded_state is not ShardedState.UNSHARDED:
            return
        info = self.post_forward_mesh_info
        assert info is not None
        for param in self.params:
            param.to_sharded_post_forward(info.shard_rank, info.shard_size)
        self.sharded_state = ShardedState.SHARDED_POST_FORWARD

    @property
    def is_unsharded(self) -> bool:
        return self.sharded_state is ShardedState.UNSHARDED

    # -- forward ------------------------------------------------------------------------

    def pre_forward(self) -> None:
        check_state(
            self.training_state,
            (TrainingState.IDLE, TrainingState.FORWARD),
            action="start forward",
            owner=repr(self),
        )
        self.training_state = TrainingState.FORWARD
        self.unshard()
        self.wait_for_unshard()

    def post_forward(self) -> None:
        if self.reshard_after_forward and self.post_forward_mesh_info is not None:
            self._reshard_post_forward()
        elif self.reshard_after_forward:
            self.reshard()
        self._post_forward_indices.append(len(self.comm_ctx.post_forward_order))
        self.comm_ctx.post_forward_order.append(self)
        self.training_state = TrainingState.IDLE

    # -- backward -----------------------------------------------------------------------

    def pre_backward(self, default_prefetch: bool) -> None:
        if self.training_state is TrainingState.PRE_BACKWARD:
            return
        self.training_state = TrainingState.PRE_BACKWARD
        if self.unshard_in_backward:
            self.unshard()
            self.wait_for_unshard()
        if default_prefetch:
            self._prefetch_previous()

    def _prefetch_previous(self) -> None:
        """Start the all-gather of the group whose forward ran just before ours."""
        if not self._post_forward_indices:
            return
        index = self._post_forward_indices.pop()
        if index > 0:
            target = self.comm_ctx.post_forward_order[index - 1]
            if target.unshard_in_backward:
                target.unshard()

    def post_backward(self) -> None:
        """Reduce-scatter this iteration's gradients (or keep them, with sync off)."""
        self.training_state = TrainingState.POST_BACKWARD
        if not self.reduce_grads:
            for param in self.params:
                param.accumulate_unsharded_grad()
            if self.reshard_after_backward:
                self.reshard()
            return
        params, grads = self._collect_grads()
        if self.reshard_after_backward:
            self.reshard()
        if not params:
            return
        reduce_dtype = params[0].reduce_dtype or grads[0].dtype
        dtypes = {g.dtype for g in grads}
        if len(dtypes) > 1 and params[0].reduce_dtype is None:
            raise AssertionError(
                f"{self!r}: gradients of one reduction must share a dtype, got "
                f"{sorted(map(str, dtypes))}"
            )
        plan = collectives.plan_reduction(
            self.mesh_info,
            reduce_dtype,
            divide_factor=self.gradient_divide_factor,
            force_sum=self.force_sum_reduction,
        )
        pending = collectives.foreach_reduce(
            params,
            grads,
            self.mesh_info,
            reduce_dtype,
            plan,
            async_op=True,
            all_reduce_hook=self.all_reduce_hook,
            all_reduce=self.all_reduce_grads,
            partial=self._partial_reduce,
            comm=self.reduce_scatter_comm,
            group=self.reduce_scatter_group,
        )
        self.comm_ctx.add_pending_reduce(pending)

    def _collect_grads(self) -> tuple[list[ShardedParam], list[torch.Tensor]]:
        params, grads = [], []
        for param in self.params:
            grad = param.take_unsharded_grad()
            if grad is None and self.reduce_scatter_unused_params and param.requires_grad:
                grad = torch.zeros(
                    param.layout.global_size, dtype=param.compute_dtype, device=self.device
                )
            if grad is not None:
                params.append(param)
                grads.append(grad)
        return params, grads

    def finalize_backward(self) -> None:
        """End of the last backward: drop unconsumed prefetches and forward bookkeeping."""
        if self._all_gather is not None:
            self._all_gather.wait()
            self._all_gather = None
        self._post_forward_indices.clear()

    def reset(self) -> None:
        """After an exception mid-iteration: back to sharded, idle, with no partial grads."""
        self.reshard()
        for param in self.params:
            param.discard_grads()
        self._partial_reduce = collectives.PartialReduce()
        self._post_forward_indices.clear()
        self.training_state = TrainingState.IDLE
