"""A parameter whose tensor subclass gathers itself: the all-gather extension contract.

[Note: all-gather extensions]
A sharded parameter's local tensor may define two methods, and then ``fully_shard`` lets it
decide what crosses the wire and how the unsharded parameter is rebuilt. This is how
low-precision training sends fp8 bytes instead of fp32 (torchao's float8 weights), or NF4's
packed data (QLoRA). Both methods, or neither:

* ``fsdp_pre_all_gather(mesh)`` or
  ``fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)`` returns
  ``(inputs, metadata)``: the tensors to all-gather (any number, any dtypes) and anything
  the post hook needs. The two forms are told apart by how many parameters the method
  takes. ``mesh`` is the mesh the parameter is sharded over (the shard dim alone on HSDP),
  ``outer_size`` / ``outer_stride`` the unsharded parameter's size and contiguous strides,
  ``module`` the module that owns the parameter, ``mp_policy`` the call's
  ``MixedPrecisionPolicy``. FSDP casts nothing: casting to ``param_dtype`` is the hook's
  business.
* ``fsdp_post_all_gather(outputs, metadata, param_dtype, *, out=None)`` receives every
  rank's inputs stacked (``outputs[i]`` has rank r's ``inputs[i]`` in its r-th block).
  The first call returns ``(unsharded, inner_tensors)``; ``unsharded`` becomes the
  unsharded parameter for the rest of training (its first ``prod(outer_size)`` elements, so
  padding at the end is cut off), and ``inner_tensors`` are the tensors it is built on,
  whose storage FSDP frees on reshard and regrows before the next call. Every later call
  gets ``out=`` that parameter and must refill it in place.

Worked example: a ``(4, 2)`` fp32 weight on two ranks, each holding two rows, whose
subclass sends fp8 data with one fp32 scale per row::

    rank 0: rows [[1., 2.], [3., 4.]]    pre hook -> inputs (fp8 [[.5, 1.], [.75, 1.]],
                                                             fp32 [2., 4.]), metadata None
    rank 1: rows [[8., 8.], [0., 2.]]    pre hook -> inputs (fp8 [[1., 1.], [0., 1.]],
                                                             fp32 [8., 2.]), metadata None

Each rank sends 4 bytes of data and 8 of scales (12 instead of fp32's 16; for wide rows the
data dominates and the saving nears 4x). The two inputs have different dtypes, so they
travel in one all-gather as bytes (see [Note: one collective per group] in
``core/collectives``) and come back as ``outputs = (fp8 [[.5, 1.], [.75, 1.], [1., 1.],
[0., 1.]], fp32 [2., 4., 8., 2.])``, from which the post hook rebuilds the ``(4, 2)``
weight in ``param_dtype``.

Rules FSDP keeps on its side:

1. Each unshard calls the pre hook on the sharded parameter's current local tensor (a user
   may attach the methods to it after ``fully_shard``, or ``to_empty`` may replace it);
   under CPU offload, on its copy on the compute device.
2. Inputs must be the same size on every rank. With the 5-argument form, on a parameter
   that does not split evenly (some ranks pad), every input must have the padded shard's
   size, as torch requires; a rank that pads is the only one that can see a wrong size, so
   at the parameter's first unshard the shard group agrees on the sizes in one small
   all-gather, and every rank raises the same error instead of the others waiting forever
   in an all-gather the failing rank never joins. A parameter that splits evenly needs no
   such exchange.
3. Resharding frees the storage of the gathered outputs and of the inner tensors (unless
   ``keep_unsharded_storage``); unsharding regrows it in place before the post hook runs.
   An extension may also say that its unsharded form no longer needs the outputs once
   built (``fsdp_should_release_all_gather_outputs_after_post_all_gather()``, where the
   installed torch asks it: entry 7 of [Note: torch versions] in ``core/compat``): they
   are then freed right after the post hook.
4. An int ``reshard_after_forward`` keeps a slice of a single gathered output only, and
   cannot re-run the pre hook on it: the post-forward reshard refuses an extension with
   several outputs, and the backward unshard one with a single output, as torch's does.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..core import comms
from ..core.compat import EXTENSIONS_MAY_RELEASE_OUTPUTS
from ..core.member import with_storage
from ..core.mesh import MeshInfo
from ..core.sharding import contiguous_strides

PRE_HOOK = "fsdp_pre_all_gather"
POST_HOOK = "fsdp_post_all_gather"
RELEASE_HOOK = "fsdp_should_release_all_gather_outputs_after_post_all_gather"


def defines_extension(local: torch.Tensor, description: str) -> bool:
    """Whether ``local`` (a sharded parameter's local tensor) gathers itself.

    Refuses a tensor that defines one of the two methods without the other, naming the
    parameter (``description``).
    """
    has_pre, has_post = hasattr(local, PRE_HOOK), hasattr(local, POST_HOOK)
    if has_pre != has_post:
        defined, missing = (PRE_HOOK, POST_HOOK) if has_pre else (POST_HOOK, PRE_HOOK)
        raise AssertionError(
            f"Both {PRE_HOOK} and {POST_HOOK} should be defined if using all-gather "
            f"extensions: the local tensor of {description} ({type(local).__name__}) "
            f"defines {defined} but not {missing}"
        )
    if EXTENSIONS_MAY_RELEASE_OUTPUTS and hasattr(local, RELEASE_HOOK) and not has_pre:
        raise AssertionError(
            f"{RELEASE_HOOK} requires {PRE_HOOK} and {POST_HOOK} to be defined: the local "
            f"tensor of {description} ({type(local).__name__}) defines only the first"
        )
    return has_pre


def shard_mesh(mesh_info: MeshInfo) -> DeviceMesh:
    """The mesh a parameter is sharded over: the whole mesh if 1-D, else its shard dim."""
    mesh = mesh_info.mesh
    if mesh.ndim == 1:
        return mesh
    assert mesh_info.shard_mesh_dim is not None and mesh.mesh_dim_names is not None
    return mesh[mesh.mesh_dim_names[mesh_info.shard_mesh_dim]]


@dataclass(frozen=True)
class ParamFacts:
    """What the pre hook is told about the parameter, and what FSDP checks its inputs
    against."""

    description: str  # for messages: the parameter's name and owning module
    mesh_info: MeshInfo
    outer_size: torch.Size  # the unsharded parameter's size
    padded_shard_size: torch.Size  # every rank's padded shard
    module: nn.Module
    mp_policy: Any

    @property
    def splits_evenly(self) -> bool:
        """Whether no rank pads (only dim-0 sharding may be uneven)."""
        return self.outer_size[0] % self.mesh_info.shard_size == 0


@dataclass
class AllGatherExtension:
    """One parameter's all-gather through its local tensor's hooks (see
    [Note: all-gather extensions])."""

    facts: ParamFacts
    # What the last pre hook returned, until the post hook consumes it.
    metadata: Any = None
    input_sizes: list[torch.Size] = field(default_factory=list)
    input_dtypes: list[torch.dtype] = field(default_factory=list)
    # 1-D, world_size * input numel each, in the inputs' dtypes: allocated at the first
    # unshard, their storage freed and regrown after that (rule 3).
    outputs: list[torch.Tensor] = field(default_factory=list)
    inner_tensors: list[torch.Tensor] = field(default_factory=list)
    sizes_agreed: bool = False  # rule 2, for a parameter some ranks pad
    release_outputs: bool = False  # rule 3, the extension's own choice
    device: torch.device | None = None  # where the inputs were, hence the outputs

    # -- before the all-gather -------------------------------------------------------------

    def all_gather_inputs(self, local: torch.Tensor) -> list[torch.Tensor]:
        """Call the pre hook on ``local``; its inputs, each flattened to 1-D."""
        hook = getattr(local, PRE_HOOK)
        arity = len(inspect.signature(hook).parameters)
        facts = self.facts
        mesh = shard_mesh(facts.mesh_info)
        if arity == 1:
            inputs, self.metadata = hook(mesh)
        elif arity == 5:
            strides = contiguous_strides(facts.outer_size)
            inputs, self.metadata = hook(
                mesh, facts.outer_size, strides, facts.module, facts.mp_policy
            )
        else:
            raise AssertionError(
                f"Invalid {PRE_HOOK} of {facts.description}: {inspect.signature(hook)}. "
                f"Expects {PRE_HOOK}(self, mesh: DeviceMesh, outer_size: torch.Size, "
                "outer_stride: tuple[int, ...], module: nn.Module, mp_policy: "
                "MixedPrecisionPolicy), or the older (self, mesh)"
            )
        inputs = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
        if not facts.splits_evenly and not self.sizes_agreed:
            self._agree_on_sizes(local, inputs, padded_rule=arity == 5)
        self.input_sizes = [t.size() for t in inputs]
        self.input_dtypes = [t.dtype for t in inputs]
        self.device = inputs[0].device
        return [t.reshape(-1) for t in inputs]

    def _agree_on_sizes(
        self, local: torch.Tensor, inputs: list[torch.Tensor], *, padded_rule: bool
    ) -> None:
        """Rule 2: every rank raises if any rank's inputs are the wrong size."""
        facts = self.facts
        padded = facts.padded_shard_size
        wrong = padded_rule and local.size() != padded and any(t.size() != padded for t in inputs)
        nbytes = sum(t.numel() * t.element_size() for t in inputs)
        mine = torch.tensor([int(wrong), nbytes], dtype=torch.int64, device=inputs[0].device)
        info = facts.mesh_info
        everyone = mine.new_empty(2 * info.shard_size)
        comms.all_gather(everyone, mine, info.shard_group)
        flags, sizes = everyone.view(-1, 2).unbind(1)
        wrong_ranks = flags.nonzero().flatten().tolist()
        if wrong_ranks:
            mine_text = f" (here: {[tuple(t.size()) for t in inputs]})" if wrong else ""
            raise AssertionError(
                f"When a parameter is unevenly sharded by FSDP (orig size="
                f"{tuple(facts.outer_size)}, FSDP world size={info.shard_size}), "
                f"{PRE_HOOK} must return all-gather inputs with the padded sharded size "
                f"{tuple(padded)}, but for {facts.description} shard ranks {wrong_ranks} "
                f"returned other sizes{mine_text}; every rank of the shard group stops here"
            )
        if len(set(sizes.tolist())) > 1:
            raise AssertionError(
                f"{PRE_HOOK} of {facts.description} returned inputs of different sizes on "
                f"different ranks ({sizes.tolist()} bytes on shard ranks 0..."
                f"{info.shard_size - 1}); an all-gather needs the same size on every rank"
            )
        self.sizes_agreed = True

    def output_buffers(self) -> list[torch.Tensor]:
        """The buffers the last inputs' all-gather lands in (storage regrown in place), as
        aliases autograd does not track (see ``GroupMember.all_gather_outputs``)."""
        world_size = self.facts.mesh_info.shard_size
        if len(self.outputs) != len(self.input_sizes):
            self.outputs = [None] * len(self.input_sizes)  # type: ignore[list-item]
        self.outputs = [
            with_storage(buffer, world_size * math.prod(size), dtype, self.device)
            for buffer, size, dtype in zip(self.outputs, self.input_sizes, self.input_dtypes)
        ]
        return [buffer.data for buffer in self.outputs]

    # -- after the all-gather --------------------------------------------------------------

    def _unflattened_outputs(self) -> tuple[torch.Tensor, ...]:
        """Each output with its input's trailing dims: rank blocks stacked along dim 0."""
        return tuple(out.view(-1, *size[1:]) for out, size in zip(self.outputs, self.input_sizes))

    def build(self, local: torch.Tensor, param_dtype: torch.dtype) -> torch.Tensor:
        """The first post hook: the unsharded tensor, trimmed to the parameter's size."""
        unsharded, inner = getattr(local, POST_HOOK)(
            self._unflattened_outputs(), self.metadata, param_dtype
        )
        self.inner_tensors = list(inner)
        self.metadata = None
        self._decide_release(local)
        size = self.facts.outer_size
        return torch.as_strided(unsharded, size, contiguous_strides(size), 0)

    def refill(self, local: torch.Tensor, param_dtype: torch.dtype, out: torch.Tensor) -> None:
        """Every later post hook: refill the unsharded parameter ``out`` in place."""
        for tensor in self.inner_tensors:
            _regrow(tensor)
        getattr(local, POST_HOOK)(self._unflattened_outputs(), self.metadata, param_dtype, out=out)
        self.metadata = None
        if self.release_outputs:
            self.free_outputs()

    def _decide_release(self, local: torch.Tensor) -> None:
        if not (EXTENSIONS_MAY_RELEASE_OUTPUTS and hasattr(local, RELEASE_HOOK)):
            return
        release = getattr(local, RELEASE_HOOK)()
        if not isinstance(release, bool):
            raise AssertionError(
                f"{RELEASE_HOOK} must return a bool, got {type(release)} ({self.facts.description})"
            )
        self.release_outputs = release
        if release:
            self.free_outputs()

    def post_forward_source(self, fqn: str) -> torch.Tensor:
        """The gathered output an int ``reshard_after_forward`` keeps a block of (rule 4)."""
        if self.release_outputs:
            raise NotImplementedError(
                f"{fqn}: releasing all-gather outputs after post-all-gather is not supported "
                "when reshard_after_forward is an int, because FSDP uses those outputs to "
                f"construct the post-forward shard ({RELEASE_HOOK} returned True)"
            )
        if len(self.outputs) != 1:
            raise AssertionError(
                f"Expected 1 all_gather_output, got {len(self.outputs)}: {fqn} gathers "
                f"{len(self.outputs)} tensors through {PRE_HOOK}, and an int "
                "reshard_after_forward can keep a block of one only; use "
                "reshard_after_forward=True or False for its module"
            )
        return self.outputs[0]

    # -- freeing ---------------------------------------------------------------------------

    def free_outputs(self) -> None:
        for tensor in self.outputs:
            _free(tensor)

    def free(self) -> None:
        """Reshard: free the gathered outputs and the tensors the unsharded form is built on."""
        self.free_outputs()
        for tensor in self.inner_tensors:
            _free(tensor)


def _free(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def _regrow(tensor: torch.Tensor) -> None:
    """Give a freed tensor its bytes back, in place (views of it stay valid). A tensor whose
    storage is already back (a view of a regrown output) is left alone."""
    storage = tensor.untyped_storage()
    if storage.size() == 0:
        storage.resize_((tensor.storage_offset() + tensor.numel()) * tensor.element_size())
