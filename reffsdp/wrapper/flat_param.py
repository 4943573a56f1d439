"""The wrapper API's group member: many parameters flattened into one padded 1-D buffer.

[Note: flat parameter lifecycle]
One ``FullyShardedDataParallel`` instance owns the parameters of its module that no nested
instance owns. They are concatenated (see [Note: flat layout] in ``flat_layout``) and
the flat buffer is sharded like any tensor on dim 0. Per rank we keep:

* ``local_shard`` (1-D, ``shard_numel``, original dtype): this rank's padded chunk. The
  :class:`FlatParameter` the optimizer sees (``use_orig_params=False``) is this tensor; with
  ``use_orig_params=True`` the optimizer sees the original parameters instead (the same
  objects), each a 1-D view of its piece of ``local_shard`` (empty where the rank holds none;
  at its own shape under ``NO_SHARD``, where the piece is the whole parameter).
* ``gathered`` (1-D, ``world_size * shard_numel``, compute dtype): the all-gather target.
  Its storage is freed on reshard and regrown on unshard (same tensor object).
* ``unsharded``: an ``nn.Parameter`` viewing the first ``total_numel`` elements of
  ``gathered``. In forward each original parameter is set on its module as a view of it, so
  autograd sums every use into ``unsharded.grad``; a hook on its gradient accumulation tells
  the group backward is done with this unit.

A reduced gradient chunk becomes ``FlatParameter.grad`` (or, with ``use_orig_params=True``,
views of one flat gradient on each original parameter), added to what is already there.

Between forward passes (``use_orig_params=False``) each module keeps a plain attribute for
each of its original parameters, full-shaped but with no storage, as torch's wrapper leaves
views of its freed unsharded flat parameter: code that walks names with ``getattr``
(``torch.distributed.checkpoint.state_dict`` does) finds them; reading their values fails.

[Note: gradients kept while sync is off]
Inside ``no_sync()`` a backward reduces nothing: the handle adds the unsharded flat gradient
to ``unsharded_accumulated_grad`` (1-D, ``total_numel``, in the dtype backward made it in:
the param dtype under mixed precision, cast only for the reduction) and shows it, as torch's
wrapper does, as ``FlatParameter.grad`` (or, with ``use_orig_params=True``, as each
trainable original's ``.grad``, a full-shaped view of it), setting aside what ``.grad`` held
(the shard gradient of earlier synced steps). The shown gradient is this rank's own and
whole, so the shapes differ from the sharded parameters' under the sharded strategies: an
optimizer step before a synced backward fails on them, as with torch's wrapper, while under
``NO_SHARD`` it steps with this rank's gradient, as ``DistributedDataParallel.no_sync()``
does. In-place edits of the shown gradient edit what is kept. Before the next backward's
reduction (or keeping) the set-aside gradients come back; if the user set every shown
gradient to ``None`` (``zero_grad()``) in between, the kept gradient and the set-aside ones
are dropped, as torch's wrapper drops its flat gradient.

[Note: writing originals back]
With ``use_orig_params=True`` the original parameters between iterations are views of
``local_shard``, so in-place edits land in the shard by themselves. Two edits do not:

* ``param.data = tensor``: the parameter stops viewing the shard. Before each all-gather
  (``before_unshard``) the handle copies such a parameter into its piece of the shard and
  points it at the piece again. The tensor must have the shape the parameter showed (its
  1-D piece of the shard, or its own shape under ``NO_SHARD``), else ``RuntimeError``
  ("Cannot writeback", as torch's). A rank that holds none of the parameter ignores it,
  as torch's does: the ranks holding its pieces hold its values.
* ``module.weight = nn.Parameter(...)``: before the first all-gather (lazy init) the new
  object is adopted in place of the old one, then written back like new data; afterwards
  it is refused, since an optimizer built by then holds the old object, which would go on
  training alone (torch's wrapper adopts it and leaves the optimizer so).

[Note: moving a wrapped model]
``model.half()``, ``model.to(torch.float64)`` and ``to_empty()`` run ``nn.Module._apply``,
which gives every registered parameter new data. The flat parameter owns the storage, so
``FullyShardedDataParallel._apply`` lets the move reach the flat parameter alone (with
``use_orig_params=True`` the originals leave their modules and the flat parameter is
registered for the duration, as in torch's wrapper) and then the handle follows it: the new
data becomes ``local_shard``, its dtype the original dtype (mixed-precision dtypes are
resolved again; a ``param_dtype`` asked for still wins), buffers of the old dtype are
dropped, and the originals view the new shard, their gradients moved by the same function.
Any time between iterations, before the first forward or after training (torch's wrapper
follows a dtype move only before its first forward). The shard's device is fixed by the
constructor (``device_id``, ``CPUOffload``): a move to another device is refused.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..core.member import PaddedShardMember, resolve_dtypes
from ..core.streams import backend_for
from ..core.torch_internals import CHECKPOINT_WRAPPED_MODULE, registered_parameters
from .config import WrapperConfig
from .flat_layout import FlatLayout, RankShard, flat_layout

_CHECKPOINT_PREFIX = f"{CHECKPOINT_WRAPPED_MODULE}."
# Set to "1" (as for torch's wrapper) before wrapping: original parameters are shown by
# writing modules' dictionaries directly, bypassing ``__setattr__`` overrides and checks.
UNSAFE_SETATTR = "FSDP_USE_UNSAFE_SETATTR"


class FlatParameter(nn.Parameter):
    """This rank's shard of a wrapper instance's flattened parameters (1-D).

    Metadata lives on the handle that owns it (``FullyShardedDataParallel._handle``); the
    class marks the tensor so code can tell a flat parameter from an original one, and
    records the names torch's flat parameter records, which
    ``torch.distributed.checkpoint.state_dict`` reads.
    """

    _fqns: tuple[str, ...]  # the originals' names below the wrapped module, wrapper-free


@dataclass(frozen=True)
class ParamSlot:
    """Where an original parameter lives: ``getattr(module, name)``, and its path."""

    module: nn.Module
    name: str
    fqn: str  # relative to the wrapped module


def _set_tensor(
    slot: ParamSlot, tensor: torch.Tensor, registered: bool = False, *, unsafe: bool = False
) -> None:
    """Show ``tensor`` as ``slot``: registered if it is a Parameter (or ``registered``),
    else a plain attribute.

    The views shown in forward are plain tensors. With ``use_orig_params=True`` they are
    registered as torch's wrapper does, so ``named_parameters()`` between forward and
    backward lists the full-size views; otherwise the flat parameter is the registered one
    and they are plain attributes (``__dict__`` wins over ``nn.Module.__getattr__``).

    By default the attribute is deleted and set again through the module's own
    ``__setattr__``, overrides and ``nn.Module``'s checks included; ``unsafe`` writes the
    module's dictionaries directly, which is cheaper (see ``UNSAFE_SETATTR``).
    """
    module, name = slot.module, slot.name
    register = isinstance(tensor, nn.Parameter) or registered
    if not unsafe:
        if hasattr(module, name):
            delattr(module, name)
        setattr(module, name, tensor)
    if register:
        module.__dict__.pop(name, None)
        registered_parameters(module)[name] = tensor
    elif unsafe:
        registered_parameters(module).pop(name, None)
        module.__dict__[name] = tensor


class FlatParamHandle(PaddedShardMember):
    """A :class:`~reffsdp.core.member.GroupMember` made of many parameters, set up from its
    instance's config: whether original parameters show (``use_orig_params``), whether the
    shard lives on the host (``cpu_offload``), which dtype reduced gradients keep
    (``mixed_precision``)."""

    def __init__(
        self,
        slots: list[list[ParamSlot]],
        params: list[nn.Parameter],
        world_size: int,
        rank: int,
        device: torch.device,
        config: WrapperConfig,
        *,
        fqn_prefix: str,
        owner: str,
        pad_multiple: int | None = None,
    ) -> None:
        use_orig_params = config.use_orig_params
        _check_flattenable(params, slots, use_orig_params)
        self.slots = slots  # per original parameter: every place it is registered
        self.owner = owner  # the wrapper instance, for messages
        self.unsafe_setattr = os.environ.get(UNSAFE_SETATTR, "") == "1"
        self.device = device
        self.use_orig_params = use_orig_params
        # A CPU compute device makes offloading a no-op (see ShardedParam's).
        self.offload = (
            config.cpu_offload.offload_params and backend_for(device).separate_host_memory
        )
        # Reduced gradients stay in param_dtype (MixedPrecision.keep_low_precision_grads).
        self.keep_low_precision_grads = config.precision.keep_low_precision_grads
        self._fqn_prefix = fqn_prefix
        dtype = params[0].dtype
        self.layout: FlatLayout = flat_layout(
            [p.shape for p in params],
            world_size,
            align_itemsize=dtype.itemsize if use_orig_params else None,
            pad_multiple=pad_multiple,
        )
        self.rank_shard: RankShard = self.layout.rank_shard(rank)
        self.orig_dtype = dtype
        self.param_dtype: torch.dtype | None = None
        self.reduce_dtype: torch.dtype | None = None
        # The mixed-precision dtypes asked for, kept from lazy init to resolve them again
        # when the parameters move to another dtype (see follow_flat_param).
        self._mp_request: tuple[torch.dtype | None, torch.dtype | None] | None = None
        self.local_shard = self._flatten_and_shard(params)
        if self.offload:
            self.local_shard = backend_for(device).to_host(self.local_shard, pin=True)
        requires_grad = any(p.requires_grad for p in params)
        self.flat_param = FlatParameter(self.local_shard, requires_grad=requires_grad)
        self.flat_param._fqns = tuple(self.fqns)
        self.orig_params: list[nn.Parameter] = []
        if use_orig_params:
            # The very parameter objects, now viewing their pieces: an optimizer made before
            # wrapping (or anything else holding them) keeps working, as with torch's.
            self.orig_params = list(params)
            for i, param in enumerate(params):
                param.data = self.orig_piece(self.local_shard, i)
                param.grad = None
        self.gathered: torch.Tensor | None = None
        self.unsharded: nn.Parameter | None = None
        self.unsharded_accumulated_grad: torch.Tensor | None = None  # 1-D, total_numel
        # While it is shown as .grad: each parameter showing it, and what its .grad held.
        self._grads_set_aside: list[tuple[nn.Parameter, torch.Tensor | None]] | None = None
        self.post_backward_hook: Callable[[], None] | None = None
        self._storageless_views: list[torch.Tensor] | None = None  # see the note above
        self.show_sharded()

    # -- building -----------------------------------------------------------------------

    def _flatten_and_shard(self, params: list[nn.Parameter]) -> torch.Tensor:
        """This rank's padded chunk of the flattened parameters, on the compute device."""
        shard = torch.zeros(self.layout.shard_numel, dtype=self.orig_dtype, device=self.device)
        with torch.no_grad():
            for param, piece in zip(params, self.rank_shard.params):
                if piece.in_shard and piece.numel_in_shard:
                    source = param.detach().reshape(-1)
                    source = source[piece.intra_param_start : piece.intra_param_end]
                    start = piece.offset_in_shard
                    shard[start : start + piece.numel_in_shard].copy_(source)
        return shard

    def _shard_piece(self, flat_shard: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter ``index``'s piece of a flat shard (1-D, empty if not in the shard)."""
        piece = self.rank_shard.params[index]
        if not piece.in_shard:
            return flat_shard.narrow(0, 0, 0)
        return flat_shard.narrow(0, piece.offset_in_shard, piece.numel_in_shard)

    def orig_piece(self, flat_shard: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter ``index``'s piece as its original parameter shows it: 1-D, or at its own
        shape where this rank holds the whole flat parameter (``NO_SHARD``), as torch's."""
        piece = self._shard_piece(flat_shard, index)
        return piece.view(self.layout.shapes[index]) if self.layout.world_size == 1 else piece

    # -- the member contract: identity and dtypes ---------------------------------------

    @property
    def fqn(self) -> str:
        return f"{self._fqn_prefix}_flat_param"

    @property
    def fqns(self) -> list[str]:
        """The original parameters' names relative to the wrapped module, as state dicts
        name them: without the prefix of an activation-checkpoint wrapper."""
        return [slots[0].fqn.replace(_CHECKPOINT_PREFIX, "") for slots in self.slots]

    @property
    def trainable(self) -> list[bool]:
        """Per original parameter, whether it takes gradients: read at every use, since
        users freeze parameters after wrapping too (the flat parameter with
        ``use_orig_params=False``, any original with ``True``)."""
        if self.use_orig_params:
            return [param.requires_grad for param in self.orig_params]
        return [self.flat_param.requires_grad] * len(self.slots)

    @property
    def requires_grad(self) -> bool:
        return any(self.trainable)

    @property
    def is_materialized(self) -> bool:
        return self.local_shard.device.type != "meta"

    @property
    def shard_numel(self) -> int:
        return self.layout.shard_numel

    def lazy_init(self, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None):
        if self.use_orig_params:
            self._adopt_replaced_originals()
        self._mp_request = (param_dtype, reduce_dtype)
        self._resolve_dtypes()

    def _resolve_dtypes(self) -> None:
        assert self._mp_request is not None
        self.param_dtype, self.reduce_dtype = resolve_dtypes(self.orig_dtype, *self._mp_request)

    # -- originals edited by the user (see [Note: writing originals back]) ----------------

    def _shown_original(self, index: int) -> torch.Tensor | None:
        """What the modules show for original ``index``: the original, a parameter the user
        assigned in its place, a view of ours (between forward and backward), or ``None``
        where it is deregistered (e.g. while a checkpointing library holds it)."""
        shown = {id(p): p for p in (getattr(s.module, s.name, None) for s in self.slots[index])}
        if len(shown) > 1:
            raise NotImplementedError(
                f"{self.owner}: {self.fqns[index]} is shared under several names and one of "
                "them was assigned a new parameter; replacing one name of a shared parameter "
                "is not supported: assign to every name, or change the values in place"
            )
        return next(iter(shown.values()))

    def _adopt_replaced_originals(self) -> None:
        for i, param in enumerate(self.orig_params):
            shown = self._shown_original(i)
            if isinstance(shown, nn.Parameter) and shown is not param:
                self.orig_params[i] = shown

    def before_unshard(self) -> bool:
        """Write originals given new data back into the shard; refuse replaced ones."""
        if not self.use_orig_params:
            return False
        wrote = False
        for i, param in enumerate(self.orig_params):
            shown = self._shown_original(i)
            if isinstance(shown, nn.Parameter) and shown is not param:
                raise RuntimeError(
                    f"{self.owner}: {self.fqns[i]} was assigned a new nn.Parameter after the "
                    "first forward; optimizers and the wrapper hold the old one, which would "
                    "train on alone. Give the old one the new values (param.data = new, or "
                    "param.copy_(new) under torch.no_grad()), or replace it before the first "
                    "forward"
                )
            wrote |= self._write_back(i, param)
        return wrote

    def _write_back(self, index: int, param: nn.Parameter) -> bool:
        view = self.orig_piece(self.local_shard, index)
        if param.data_ptr() == view.data_ptr() and param.shape == view.shape:
            if param.dtype == view.dtype and param.device == view.device:
                return False
        if self.rank_shard.params[index].in_shard:
            piece = self._shard_piece(self.local_shard, index)
            source = param.detach()
            if self.layout.world_size == 1:  # NO_SHARD shows the parameter's own shape
                source = source.reshape(-1)
            if source.shape != piece.shape:
                raise RuntimeError(
                    f"Cannot writeback {self.fqns[index]} of {self.owner} on rank "
                    f"{self.rank_shard.rank}: its shape changed to {tuple(param.shape)}, but "
                    f"this rank's piece of it has shape {tuple(view.shape)}; assign data of "
                    "the shape the parameter shows, or edit it in place"
                )
            with torch.no_grad():
                piece.copy_(source)
        param.data = view
        return True

    # -- moves: nn.Module._apply (see [Note: moving a wrapped model]) -------------------

    def hide_originals(self) -> None:
        """Take the original parameters off their modules (``show_sharded`` puts them back)."""
        for slots in self.slots:
            for slot in slots:
                registered_parameters(slot.module).pop(slot.name, None)
                slot.module.__dict__.pop(slot.name, None)

    def is_local_shard(self, data: torch.Tensor) -> bool:
        """Whether ``data`` (the flat parameter's data after a move) is the local shard."""
        shard = self.local_shard
        same_place = data.dtype == shard.dtype and data.device == shard.device
        return same_place and data.data_ptr() == shard.data_ptr()

    def follow_flat_param(self, data: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]):
        """Make ``data``, the flat parameter's data after ``fn`` moved it, the local shard:
        the dtype follows, original parameters view it, their gradients get ``fn`` too."""
        storage_device = torch.device("cpu") if self.offload else self.device
        if data.device != storage_device:
            self.flat_param.data = self.local_shard  # the move is undone
            raise ValueError(
                f"{self.owner} keeps its shard on {storage_device}, but moving the model put "
                f"it on {data.device}; pass device_id (or CPUOffload) to the constructor "
                "instead of moving the wrapped model to another device"
            )
        if self.offload:
            data = backend_for(self.device).pinned(data)
        self.flat_param.data = data
        self.local_shard = data
        if data.dtype != self.orig_dtype:
            self.orig_dtype = data.dtype
            if self._mp_request is not None:  # resolved at lazy init already: again
                self._resolve_dtypes()
            self.gathered = self.unsharded = None
            self._storageless_views = None
        for i, param in enumerate(self.orig_params):
            grad = param.grad
            param.data = self.orig_piece(data, i)
            if grad is not None:
                param.grad = None
                _assign_grad(param, fn(grad))
        self.show_sharded()

    # -- all-gather (see PaddedShardMember) ----------------------------------------------

    def _padded_shard(self) -> torch.Tensor:
        return self.local_shard

    @property
    def _gathered_numel(self) -> int:
        return self.layout.padded_numel

    def _forget_unsharded(self) -> None:
        self.unsharded = None

    def finish_unshard(self) -> None:
        if self.unsharded is None or self.unsharded.requires_grad != self.requires_grad:
            assert self.gathered is not None
            data = self.gathered.narrow(0, 0, self.layout.total_numel)
            self.unsharded = nn.Parameter(data, requires_grad=self.requires_grad)
            if self.requires_grad:
                self.unsharded.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _on_grad_ready(self, _: torch.Tensor) -> None:
        if self.post_backward_hook is not None:
            self.post_backward_hook()

    # -- what the module sees -----------------------------------------------------------

    def unsharded_views(self) -> list[torch.Tensor]:
        """Each original parameter as a view of the unsharded flat parameter.

        Made under grad mode, so autograd routes every use back into ``unsharded``; frozen
        parameters are detached so no gradient is computed for them. The pieces come from
        one ``split`` (padding segments included), so backward builds the flat gradient in
        one node that concatenates the pieces' gradients; a ``narrow`` per parameter would
        instead make a zero-filled flat-size gradient per parameter and sum them.
        """
        assert self.unsharded is not None, "unsharded views before an all-gather finished"
        pieces = torch.split(self.unsharded, self.layout.numels_with_padding)
        params = [piece for piece, seg in zip(pieces, self.layout.segments) if not seg.is_padding]
        views = []
        for piece, shape, trainable in zip(params, self.layout.shapes, self.trainable):
            view = piece.view(shape)
            views.append(view if trainable else view.detach())
        return views

    def full_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each original parameter's view, at its own shape, of a full flat tensor."""
        layout = self.layout
        return [
            flat.narrow(0, offset, numel).view(shape)
            for offset, numel, shape in zip(layout.param_offsets, layout.numels, layout.shapes)
        ]

    def to_unsharded(self) -> None:
        for slots, view in zip(self.slots, self.unsharded_views()):
            for slot in slots:
                _set_tensor(slot, view, registered=self.use_orig_params, unsafe=self.unsafe_setattr)

    def show_sharded(self) -> None:
        """Between iterations: original parameters as shard views, or storage-less views
        (the flat parameter stands in for them; see the note above)."""
        views = self.orig_params if self.use_orig_params else self._storageless()
        for slots, view in zip(self.slots, views):
            for slot in slots:
                _set_tensor(slot, view, unsafe=self.unsafe_setattr)

    def _storageless(self) -> list[torch.Tensor]:
        """Full-shaped views of a flat buffer whose storage is freed, made once."""
        if self._storageless_views is None:
            freed = torch.empty(self.layout.total_numel, dtype=self.orig_dtype, device=self.device)
            self._storageless_views = self.full_views(freed)
            freed.untyped_storage().resize_(0)
        return self._storageless_views

    def to_sharded(self) -> None:
        self.show_sharded()
        if self.gathered is not None and self.gathered.untyped_storage().size() > 0:
            self.gathered.untyped_storage().resize_(0)

    @contextlib.contextmanager
    def in_orig_dtype(self) -> Iterator[None]:
        aside = (self.gathered, self.unsharded, self.param_dtype)
        self.gathered = self.unsharded = self.param_dtype = None
        try:
            yield
        finally:
            self.gathered, self.unsharded, self.param_dtype = aside

    def to_sharded_post_forward(self, rank: int, world_size: int) -> None:
        raise NotImplementedError("the wrapper API reshards after forward fully or not at all")

    def post_forward_all_gather_input(self) -> torch.Tensor:
        raise NotImplementedError("the wrapper API reshards after forward fully or not at all")

    # -- gradients ----------------------------------------------------------------------

    def _pop_unsharded_grad(self) -> torch.Tensor | None:
        grad = None
        if self.unsharded is not None and self.unsharded.grad is not None:
            grad, self.unsharded.grad = self.unsharded.grad, None
        return grad

    def _take_unsharded_grad(self) -> torch.Tensor | None:
        """Pop this backward's gradient plus the one kept while sync was off (``None``:
        neither)."""
        grad = self._pop_unsharded_grad()
        kept, self.unsharded_accumulated_grad = self.unsharded_accumulated_grad, None
        if kept is None:
            return grad
        if grad is not None:
            kept += grad
        return kept

    def take_grad_for_reduce(self, zeros_if_unused: bool) -> torch.Tensor | None:
        self._hide_kept_grad()
        grad = self._take_unsharded_grad()
        if grad is None and zeros_if_unused:
            numel, dtype = self.layout.total_numel, self.compute_dtype
            grad = torch.zeros(numel, dtype=dtype, device=self.device)
        # The reduce-scatter's copy-in pads dim 0 to world_size chunks of shard_numel
        # (ceil(total_numel / world_size)) elements: no padded copy is needed here.
        return grad

    def keep_unsharded_grad(self) -> None:
        """Add this backward's gradient to the kept one and show it (see [Note: gradients
        kept while sync is off]). It stays in the dtype backward made it in (the param dtype
        under mixed precision), as torch's wrapper keeps it: cast only for the reduction."""
        self._hide_kept_grad()
        grad = self._pop_unsharded_grad()
        if grad is not None:
            if self.unsharded_accumulated_grad is None:
                self.unsharded_accumulated_grad = grad.clone()
            else:
                self.unsharded_accumulated_grad += grad
        self._show_kept_grad()

    def _show_kept_grad(self) -> None:
        """Show the gradient kept while sync is off as ``.grad`` (see [Note: gradients kept
        while sync is off]), setting aside what ``.grad`` held."""
        kept = self.unsharded_accumulated_grad
        if kept is None:
            return
        if self.use_orig_params:
            views = zip(self.orig_params, self.full_views(kept), self.trainable)
            shown = [(param, view) for param, view, trainable in views if trainable]
        else:
            shown = [(self.flat_param, kept)]
        self._grads_set_aside = [(param, param.grad) for param, _ in shown]
        for param, grad in shown:
            param.grad = None
            _assign_grad(param, grad)

    def _hide_kept_grad(self) -> None:
        """Give ``.grad`` back what it held before; if the user cleared every gradient
        shown (``zero_grad()``), drop the kept gradient and what was set aside."""
        if self._grads_set_aside is None:
            return
        aside, self._grads_set_aside = self._grads_set_aside, None
        if all(param.grad is None for param, _ in aside):
            self.unsharded_accumulated_grad = None
            aside = [(param, None) for param, _ in aside]
        for param, grad in aside:
            param.grad = None
            if grad is not None:
                _assign_grad(param, grad)

    def accept_reduced_grad(self, shard: torch.Tensor) -> bool:
        # ``shard`` is the group's whole reduced row for a one-member group: viewing it keeps
        # no more memory alive than the gradient needs.
        keep_low = self.keep_low_precision_grads and self.param_dtype is not None
        grad = shard.to(self.param_dtype if keep_low else self.orig_dtype)
        if self.offload:
            grad = backend_for(self.device).to_host(grad)
        if not self.use_orig_params:
            flat = self.flat_param
            if flat.grad is None:
                _assign_grad(flat, grad)
            else:
                flat.grad.add_(grad)
            return False
        for i, (param, trainable) in enumerate(zip(self.orig_params, self.trainable)):
            if not trainable:
                continue
            piece = self._shard_piece(grad, i)
            if piece.numel() == 0:  # none of it on this rank: no gradient (optimizers skip it)
                continue
            if param.grad is not None:  # accumulate into whatever the user left there
                piece.add_(param.grad.view(-1))
            _assign_grad(param, piece.view(param.shape))
        return False

    def discard_grads(self) -> None:
        self._hide_kept_grad()
        self._pop_unsharded_grad()
        self.unsharded_accumulated_grad = None


def _assign_grad(param: nn.Parameter, grad: torch.Tensor) -> None:
    """``param.grad = grad``, also for a gradient of another dtype (low precision), shape or
    device (kept unsharded while gradient sync is off)."""
    if (grad.dtype, grad.shape, grad.device) == (param.dtype, param.shape, param.device):
        param.grad = grad
    else:  # ``.grad`` must match the param on assignment; ``.data`` need not
        param.grad = torch.empty_like(param)
        param.grad.data = grad


def _check_flattenable(
    params: list[nn.Parameter], slots: list[list[ParamSlot]], use_orig_params: bool
) -> None:
    """The wrapper's flattening rules (one dtype, one device, uniform ``requires_grad``)."""
    names = [s[0].fqn for s in slots]
    if not params:
        raise ValueError("a flat parameter needs at least one parameter")
    for param, name in zip(params, names):
        if param.dim() == 0:
            raise ValueError(
                f"FullyShardedDataParallel cannot flatten the scalar (0-dim) parameter {name}; "
                "give it a dimension (e.g. shape (1,)) or list it in ignored_states"
            )
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1 or not params[0].is_floating_point():
        raise ValueError(
            "FullyShardedDataParallel flattens parameters of one floating-point dtype per "
            f"instance, got {sorted(map(str, dtypes))} for {names}; wrap the modules with "
            "other dtypes separately"
        )
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(
            f"FullyShardedDataParallel needs the parameters of one instance on one device, "
            f"got {sorted(map(str, devices))}"
        )
    if not use_orig_params and len({p.requires_grad for p in params}) > 1:
        frozen = [n for p, n in zip(params, names) if not p.requires_grad]
        raise ValueError(
            "FullyShardedDataParallel with use_orig_params=False needs uniform requires_grad "
            f"within one instance, but {frozen} are frozen and the rest are not; wrap them "
            "separately or pass use_orig_params=True"
        )
