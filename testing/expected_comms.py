"""How many collectives a training step must issue, and the fewest bytes it can send.

Expectations are computed from the model's parameter shapes and the strategy alone, never
from reffsdp's own sharding code, so a wrong padding or a collective too many shows up as a
difference.

[Note: bytes sent per rank]
A ring collective over ``g`` ranks moving a buffer of ``N`` bytes (the unsharded side: the
all-gather output, the reduce-scatter input) sends ``N (g - 1) / g`` bytes from each rank;
an all-reduce of ``N`` bytes sends twice that. One FULL_SHARD step of a group of ``Psi``
padded bytes on ``W`` ranks therefore sends ``3 Psi (W - 1) / W`` (gather in forward, gather
again in backward, reduce-scatter), less ``Psi (W - 1) / W`` for a group that stays
unsharded between forward and backward; HSDP adds the all-reduce of the ``Psi / S`` byte
shard across the ``R`` replicas, ``2 (Psi / S) (R - 1) / R``. The minimum is exact: it is
what the strategy must move once every parameter is padded the way the strategy pads it
(each parameter's dim 0 to a multiple of the shard size for ``fully_shard``; for the
wrapper, the flat parameter, aligned per parameter with ``use_orig_params=True``, to a
multiple of the shard size; for :class:`reffsdp.naive.NaiveFSDP`, each parameter flattened
and padded to a multiple of ``W``, one unit per parameter, kept unsharded from forward to
backward: ``2 Psi (W - 1) / W``). The measured side (:class:`CommTally`) applies the same rule
to every collective reffsdp actually issues, with the size of the group it ran on.

A parameter whose tensor takes over its own all-gather (it defines ``fsdp_pre_all_gather``;
see [Note: the all-gather extension contract] in :mod:`reffsdp.testing.low_precision`) adds
to ``Psi`` what its hook sends, not its padded elements times its dtype's size: the hook is
asked for the inputs of the first shard, which has the padded size every rank sends, and
their bytes times ``S`` are the gathered bytes. It is asked with a stand-in for the shard
mesh (:class:`ShardGroupShape`) that knows the mesh's size, which is all a hook needs to pad
its shard, so the expectation needs no process group. Example: a ``15 x 5`` fp32 weight on
4 ranks gathers ``16 * 5 * 4 = 320`` bytes; as a
:class:`~reffsdp.testing.low_precision.Float8GatherWeight`, fp8 data and an fp32 scale per
row, ``16 * 5 + 16 * 4 = 144``. Its gradient is reduced in fp32 as before.

Such a parameter that some ranks pad costs reffsdp one more collective, once: at its first
unshard the shard group checks that every rank's inputs have the same size, in an
all-gather of two int64 per rank (rule 2 of [Note: all-gather extensions] in
``reffsdp/per_param/extensions.py``), so that a rank whose hook got the padding wrong fails
every rank instead of leaving the others waiting in the real all-gather. torch checks on
the padded rank alone. A unit counts these as ``handshakes``; :func:`expected_per_step`
spreads them over a run's steps when told how many there are, and leaves them out of a
steady-state step. The handshake is reffsdp's choice, not the strategy's: the parity suite
allows it to reffsdp (and to implementations whose ``fully_shard`` is reffsdp's) and holds
any other implementation, torch's among them, to the strategy's counts
(``fully_shard_units(..., size_handshakes=False)``; see
:attr:`reffsdp.testing.impls.Implementation.size_handshakes`).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from reffsdp.core import compat
from reffsdp.core.comms import Collective

from .preflight import blocks_of

ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE = "all_gather", "reduce_scatter", "all_reduce"
COUNT_KEYS = (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE)
_KEY_OF = {
    Collective.ALL_GATHER: ALL_GATHER,
    Collective.REDUCE_SCATTER: REDUCE_SCATTER,
    Collective.ALL_REDUCE: ALL_REDUCE,
}


@dataclasses.dataclass(frozen=True)
class CommUnit:
    """One parameter group (``fully_shard``) or flat parameter (the wrapper).

    ``reshard_after_forward``: ``True`` (gathered again in backward over the shard group),
    ``False`` (kept from forward to backward) or ``k`` (gathered again over ``k`` ranks).
    """

    name: str
    gather_numel: int  # all-gather output, padded, over the whole shard group
    reduce_numel: int  # reduce-scatter input: the trainable part, padded; 0 when frozen
    gather_itemsize: int
    reduce_itemsize: int
    reshard_after_forward: bool | int
    # All-gather output bytes when a member's tensor takes over its all-gather (see the
    # module note); None: gather_numel * gather_itemsize.
    gather_nbytes: int | None = None
    # One-time all-gathers of two int64 per rank at the first unshard: one per member that
    # takes over its all-gather and that some ranks pad (see the module note).
    handshakes: int = 0

    @property
    def gathered_bytes(self) -> int:
        """Bytes of the all-gather output over the whole shard group."""
        if self.gather_nbytes is not None:
            return self.gather_nbytes
        return self.gather_numel * self.gather_itemsize


@dataclasses.dataclass(frozen=True)
class StepShape:
    """The data-parallel mesh and what one optimizer step runs."""

    shard_size: int
    replicate_size: int = 1
    num_microbatches: int = 1
    sync_every_microbatch: bool = True  # False: gradients reduced in the last one only
    # The wrapper's NO_SHARD (what FULL_SHARD becomes on one rank): nothing is gathered and
    # each trainable flat parameter all-reduces its gradient over the shard group.
    no_shard: bool = False


def ring_bytes(nbytes: int | Fraction, group_size: int) -> Fraction:
    """Bytes each rank sends in a ring all-gather or reduce-scatter whose unsharded side is
    ``nbytes`` over ``group_size`` ranks (an all-reduce sends twice that); see the module
    note. The benchmark's bytes on the wire use it too (``reffsdp.bench.report``)::

        >>> ring_bytes(400, 4)
        Fraction(300, 1)
    """
    return Fraction(nbytes) * (group_size - 1) / group_size


def expected_per_step(
    units: Iterable[CommUnit], shape: StepShape, *, steps: int | None = None, builds: int = 1
) -> tuple[dict[str, float], Fraction]:
    """``(counts per step, minimum bytes sent per rank per step)``; see the module note.

    With ``steps``, the per-step average of a run of that many steps, which adds the
    units' one-time handshakes of each of ``builds`` models (a state-dict scenario trains a
    second, reloaded one); without, one steady-state step.
    """
    units = list(units)
    counts: Counter[str] = Counter()
    nbytes = Fraction(0)
    s, r, m = shape.shard_size, shape.replicate_size, shape.num_microbatches
    reduces = m if shape.sync_every_microbatch else 1
    handshakes = sum(unit.handshakes for unit in units) if steps is not None and s > 1 else 0
    if handshakes:
        share = Fraction(handshakes * builds, steps)
        counts[ALL_GATHER] += share
        nbytes += share * ring_bytes(2 * 8 * s, s)  # two int64 from each of s ranks
    for unit in units:
        if unit.gather_numel == 0:
            continue
        gather = unit.gathered_bytes
        if s > 1:
            counts[ALL_GATHER] += m
            nbytes += m * ring_bytes(gather, s)
            rf = unit.reshard_after_forward
            if rf is True or (rf is not False and rf > 1):
                group = s if rf is True else rf
                counts[ALL_GATHER] += m
                nbytes += m * ring_bytes(gather, group)
        if unit.reduce_numel == 0:
            continue
        reduce = unit.reduce_numel * unit.reduce_itemsize
        if s > 1:
            counts[REDUCE_SCATTER] += reduces
            nbytes += reduces * ring_bytes(reduce, s)
        elif shape.no_shard:
            counts[ALL_REDUCE] += reduces
            nbytes += reduces * 2 * ring_bytes(reduce, s)
        if r > 1:
            counts[ALL_REDUCE] += reduces
            nbytes += reduces * 2 * ring_bytes(Fraction(reduce, s), r)
    return {key: float(counts[key]) for key in COUNT_KEYS}, nbytes


def _local_shape(param: torch.Tensor) -> torch.Size:
    """The shape FSDP shards: a tensor-parallel parameter's local piece."""
    return _local(param).shape


def padded_numel(shape: Sequence[int], shard_size: int) -> int:
    """Elements of ``shard_size`` shards of ``ceil(dim0 / shard_size)`` rows each (a scalar
    pads to one element per shard); ``fully_shard`` pads each parameter so, and the
    benchmark's fully sharded state counts them so::

        >>> padded_numel((15, 5), 4)  # 16 rows of 5
        80
    """
    if not shape:
        return shard_size
    rows = math.ceil(shape[0] / shard_size) * shard_size
    return rows * math.prod(shape[1:])


def _owned_params(modules: Sequence[nn.Module]) -> list[list[nn.Parameter]]:
    """Per module, its parameters that no earlier module in ``modules`` took (each once)."""
    seen: set[int] = set()
    owned = []
    for module in modules:
        params = []
        for param in module.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                params.append(param)
        owned.append(params)
    return owned


def fully_shard_units(
    modules: Sequence[nn.Module],
    shard_size: int,
    *,
    reshard_after_forward: bool | int | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    mp_policy: Any = None,
    size_handshakes: bool = True,
) -> list[CommUnit]:
    """The groups ``fully_shard`` makes when applied to ``modules`` in order (children
    first, the root last), each with the same arguments; call it before sharding.

    ``reshard_after_forward=None`` reshards every group but the root's, as ``fully_shard``
    does. A parameter that takes over its own all-gather counts what its hook sends (see
    the module note), asked with ``mp_policy``: the implementation's
    ``MixedPrecisionPolicy`` of ``param_dtype`` and ``reduce_dtype`` (default: reffsdp's).
    ``size_handshakes``: count reffsdp's one-time size handshakes (the module note).
    """
    units = []
    if mp_policy is None:
        from reffsdp import MixedPrecisionPolicy

        mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for index, params in enumerate(_owned_params(modules)):
        is_root = index == len(modules) - 1
        rf = (not is_root) if reshard_after_forward is None else reshard_after_forward
        if not params:
            continue
        dtype = params[0].dtype
        gather_dtype = param_dtype or dtype
        # Unset, the reduce dtype follows the installed torch (compat entry 5).
        reduce_as = reduce_dtype or compat.fully_shard_default_reduce_dtype(param_dtype, dtype)
        gather_nbytes = None
        if any(hasattr(_local(p), "fsdp_pre_all_gather") for p in params):
            owners = _direct_owners(modules[index])
            gather_nbytes = sum(
                _gather_nbytes(p, shard_size, gather_dtype, owners[id(p)], mp_policy)
                for p in params
            )
        units.append(
            CommUnit(
                name=type(modules[index]).__name__,
                gather_numel=sum(padded_numel(_local_shape(p), shard_size) for p in params),
                reduce_numel=sum(
                    padded_numel(_local_shape(p), shard_size) for p in params if p.requires_grad
                ),
                gather_itemsize=gather_dtype.itemsize,
                reduce_itemsize=reduce_as.itemsize,
                reshard_after_forward=rf,
                gather_nbytes=gather_nbytes,
                handshakes=sum(_needs_handshake(p, shard_size) for p in params)
                if size_handshakes
                else 0,
            )
        )
    return units


@dataclasses.dataclass(frozen=True)
class ShardGroupShape:
    """Stands in for the shard mesh when a pre-all-gather hook is asked what it would send
    (see the module note): a 1-D mesh of ``shard_size`` ranks, with no process group."""

    shard_size: int
    ndim: int = 1

    def size(self, mesh_dim: int | None = None) -> int:
        return self.shard_size


def extension_gather_nbytes(
    local: torch.Tensor, shard_size: int, module: nn.Module, mp_policy: Any
) -> int:
    """Bytes of the all-gather output of ``local``, a tensor that defines
    ``fsdp_pre_all_gather``, over ``shard_size`` ranks: what its hook returns for the first
    (padded) shard, called in the form it declares, times ``shard_size``::

        >>> from reffsdp.testing.low_precision import Float8GatherWeight
        >>> extension_gather_nbytes(Float8GatherWeight(torch.ones(15, 5)), 4, None, None)
        144
    """
    shard = local.detach().chunk(shard_size)[0] if local.dim() else local.detach()
    hook = shard.fsdp_pre_all_gather
    mesh = ShardGroupShape(shard_size)
    if len(inspect.signature(hook).parameters) == 1:
        inputs, _ = hook(mesh)
    else:
        stride = torch.empty(local.shape, device="meta").stride()
        inputs, _ = hook(mesh, local.shape, stride, module, mp_policy)
    return shard_size * sum(t.numel() * t.element_size() for t in inputs)


def _gather_nbytes(
    param: torch.Tensor, shard_size: int, gather_dtype: torch.dtype, owner: nn.Module, policy: Any
) -> int:
    """Bytes of one parameter's part of its group's all-gather output."""
    local = _local(param)
    if hasattr(local, "fsdp_pre_all_gather"):
        return extension_gather_nbytes(local, shard_size, owner, policy)
    return padded_numel(local.shape, shard_size) * gather_dtype.itemsize


def _needs_handshake(param: torch.Tensor, shard_size: int) -> bool:
    """Whether ``param`` takes over its all-gather and some ranks pad it (module note)."""
    shape = _local_shape(param)
    padded = bool(shape) and shape[0] % shard_size != 0
    return padded and hasattr(_local(param), "fsdp_pre_all_gather")


def _local(param: torch.Tensor) -> torch.Tensor:
    """What FSDP shards: a tensor-parallel parameter's local piece, else the parameter."""
    return param.to_local() if isinstance(param, DTensor) else param


def _direct_owners(module: nn.Module) -> dict[int, nn.Module]:
    """For each parameter under ``module`` (by ``id``), the module that holds it directly."""
    return {
        id(param): owner for owner in module.modules() for param in owner.parameters(recurse=False)
    }


def flat_numel(shapes: Sequence[Sequence[int]], shard_size: int, align_itemsize: int | None) -> int:
    """A flat parameter's padded size: parameters end to end (each starting on a 16-byte
    boundary when ``align_itemsize`` is given), the total rounded up to ``shard_size``."""
    align = 16 // align_itemsize if align_itemsize else 0
    offset = 0
    for shape in shapes:
        if align and offset % align:
            offset += align - offset % align
        offset += math.prod(shape)
    return math.ceil(offset / shard_size) * shard_size


def wrapper_units(
    modules: Sequence[nn.Module],
    shard_size: int,
    *,
    reshard_after_forward: bool,
    use_orig_params: bool,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> list[CommUnit]:
    """The flat parameters ``FullyShardedDataParallel`` makes for ``modules`` (the wrapped
    ones in post-order, the root last). ``reshard_after_forward``: the strategy's, which the
    root never does."""
    units = []
    for index, params in enumerate(_owned_params(modules)):
        if not params:
            continue
        dtype = params[0].dtype
        numel = flat_numel(
            [p.shape for p in params], shard_size, dtype.itemsize if use_orig_params else None
        )
        is_root = index == len(modules) - 1
        gather_dtype = param_dtype or dtype
        units.append(
            CommUnit(
                name=type(modules[index]).__name__,
                gather_numel=numel,
                reduce_numel=numel if any(p.requires_grad for p in params) else 0,
                gather_itemsize=gather_dtype.itemsize,
                reduce_itemsize=(reduce_dtype or gather_dtype).itemsize,
                reshard_after_forward=reshard_after_forward and not is_root,
            )
        )
    return units


def naive_units(model: nn.Module, shard_size: int) -> list[CommUnit]:
    """The units :class:`reffsdp.naive.NaiveFSDP` makes of ``model``: one per parameter (a
    tied one once), flattened and padded to a multiple of ``shard_size``, gathered once per
    forward and kept for backward; call it before sharding."""
    units = []
    for name, param in model.named_parameters():
        numel = math.ceil(param.numel() / shard_size) * shard_size
        itemsize = param.dtype.itemsize
        reduce_numel = numel if param.requires_grad else 0
        units.append(CommUnit(name, numel, reduce_numel, itemsize, itemsize, False))
    return units


class CommTally:
    """Counts and ring bytes of the collectives reffsdp issues on this rank (see
    :func:`reffsdp.testing.patching.observe_collectives` for how it is fed)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.bytes = Fraction(0)

    def observe(self, kind: Collective, tensor: torch.Tensor, group: Any) -> None:
        """One collective seen through reffsdp's comms seam (``observe_collectives``)."""
        self.record(kind, tensor.numel() * tensor.element_size(), dist.get_world_size(group))

    def record(self, kind: Collective, nbytes: int, group_size: int) -> None:
        """One collective whose unsharded side is ``nbytes`` over ``group_size`` ranks;
        kinds other than all-gather, reduce-scatter and all-reduce are not FSDP's sharding
        collectives and are left out."""
        key = _KEY_OF.get(kind)
        if key is None:
            return
        self.counts[key] += 1
        sent = ring_bytes(nbytes, group_size)
        self.bytes += 2 * sent if key == ALL_REDUCE else sent

    def per_step(self, steps: int) -> tuple[dict[str, float], Fraction]:
        return {key: self.counts[key] / steps for key in COUNT_KEYS}, self.bytes / steps


def expected_counts(
    model: nn.Module,
    block_types: Sequence[type[nn.Module]] = (),
    *,
    shard_size: int | None = None,
    replicate_size: int = 1,
    api: str = "fully_shard",
    reshard_after_forward: bool | int | None = None,
    num_microbatches: int = 1,
    sync_every_microbatch: bool = True,
) -> dict[str, float]:
    """The collectives one training step of ``model`` issues on each rank, once every module
    of ``block_types`` is sharded on its own and then the root: ``{"all_gather": ...,
    "reduce_scatter": ..., "all_reduce": ...}``, for ``check_train_parity(...,
    expected_counts=...)``.

    Call it on the model *before* sharding it. ``api="fully_shard"``: one ``fully_shard``
    call per block (in ``model.modules()`` order) and one for the root, each with
    ``reshard_after_forward`` (``None``: ``fully_shard``'s default, every group but the
    root's). ``api="wrapper"``: ``FullyShardedDataParallel`` with an auto-wrap policy over
    ``block_types``; ``reshard_after_forward`` is the strategy's (``True``, the default, for
    ``FULL_SHARD``/``HYBRID_SHARD``; ``False`` for ``SHARD_GRAD_OP``/
    ``_HYBRID_SHARD_ZERO2``). ``shard_size`` (default: the default group's size divided by
    ``replicate_size``) and ``replicate_size`` (HSDP's replicas) describe the mesh; with
    ``sync_every_microbatch=False`` only the last of ``num_microbatches`` reduces gradients
    (``no_sync``). Frozen parameters are gathered but never reduced.
    """
    if api not in ("fully_shard", "wrapper"):
        raise ValueError(f"api must be 'fully_shard' or 'wrapper', got {api!r}")
    if shard_size is None:
        shard_size = dist.get_world_size() // replicate_size
    modules = [*blocks_of(model, block_types), model]
    if api == "fully_shard":
        units = fully_shard_units(modules, shard_size, reshard_after_forward=reshard_after_forward)
    else:
        reshard = True if reshard_after_forward is None else bool(reshard_after_forward)
        units = wrapper_units(
            modules, shard_size, reshard_after_forward=reshard, use_orig_params=False
        )
    no_shard = api == "wrapper" and shard_size == 1 and replicate_size == 1
    shape = StepShape(
        shard_size, replicate_size, num_microbatches, sync_every_microbatch, no_shard=no_shard
    )
    counts, _ = expected_per_step(units, shape)
    return counts
