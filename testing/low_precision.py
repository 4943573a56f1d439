"""A weight that FSDP all-gathers in fp8: a test subject for the all-gather extension contract.

:class:`Float8GatherWeight` holds an fp32 weight, which the optimizer updates, and tells
``fully_shard`` to all-gather it as fp8 data plus one fp32 scale per row, as torchao's
float8 training weights do; :class:`Float8GatherWeightMeshOnly` is the same with the older,
one-argument pre-all-gather hook. :class:`Float8GatherReference` is the unsharded twin for
``DistributedDataParallel``: plain fp32 weights whose forward uses the same quantized values
with a straight-through gradient, so the two train alike up to the order of the reductions
(see [Note: quantized weights] in :mod:`reffsdp.testing.tolerances`).

[Note: the all-gather extension contract]
A sharded parameter's local tensor may take over its own all-gather by defining two hooks.
Before each all-gather, FSDP calls

    inputs, metadata = local.fsdp_pre_all_gather(mesh)                     # one argument
    inputs, metadata = local.fsdp_pre_all_gather(mesh, outer_size, outer_stride, module,
                                                 mp_policy)                # five arguments

(FSDP tells the forms apart by the number of parameters of the bound method; ``mesh`` is the
shard mesh, ``outer_size`` the unsharded parameter's size). It all-gathers every input along
dim 0 over ``mesh``: inputs of several dtypes travel in one collective, as bytes. So every
rank must return inputs of the same shapes, those of the *padded* shard: dim 0 padded to
``ceil(rows / mesh.size())``, whether or not this rank holds padding. (torch's
``fully_shard`` goes further for the five-argument form: on a rank that holds padding it
wants every input in the padded shard's full shape, which a one-column scale input cannot
have; with torch that form suits only weights whose dim 0 divides evenly.) Then FSDP calls

    local.fsdp_post_all_gather(outputs, metadata, param_dtype)            # the first time
    local.fsdp_post_all_gather(outputs, metadata, param_dtype, out=param)  # every later time

with ``outputs`` the gathered inputs, in order, each ``mesh.size()`` times as long on dim 0.
The first call returns ``(unsharded, tensors_to_free)``: FSDP keeps ``unsharded`` as the
unsharded parameter for the rest of training and frees the storage of ``tensors_to_free``
when it reshards. Later calls must refill ``out``, that same parameter, in place (autograd
may hold it from an earlier forward) and return ``None``.

Here the inputs are the shard quantized row by row (:func:`quantize_rows`): fp8 data, one
byte an element, and one fp32 scale per row, the row's largest magnitude over fp8's largest
value, 448. A row is never split by dim-0 sharding, so a rank's scales are those the whole
weight would have: the gathered weight equals the whole weight quantized, on any number of
ranks. Padding rows are zeros, whose largest magnitude is 0: they get the scale 1, not 0/448.

Worked example (two ranks, the weight of :func:`quantize_rows`' example, 3 rows of 2):
rank 0 holds rows 0-1, rank 1 row 2 and pads a zero row. Each sends its rows as fp8 and
their scales:

    rank 0: data [[448, 80], [128, -448]]  scales [1/256, 1/512]   4 + 8 bytes
    rank 1: data [[-448, 128], [0, 0]]     scales [1/128, 1]       4 + 8 bytes

Both receive data of 4 rows and 4 scales, and dequantize the first 3 rows:
``[[1.75, 0.3125], [0.25, -0.875], [-3.5, 1.0]]`` (0.3 came back as fp8's nearest, 0.3125).
In fp32 each rank would send 2 rows of 2 elements, 16 bytes.

Where the bytes go: a padded row of ``C`` elements sends ``C`` bytes of data and 4 of scale
instead of ``4 C``, so ``(C + 4) / (4 C)`` of fp32's bytes: a quarter as rows widen (C = 4096:
0.2502; C = 64: 0.27), more for narrow rows (C = 2 above: 0.75; the parity suite's 5-wide
MLP rows: 0.45). The gradient is reduce-scattered in the unsharded parameter's dtype, fp32,
as for any parameter: only the all-gathers shrink.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn

from reffsdp.core.torch_internals import tree_leaves, tree_map_only

from . import torch_private

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448.0


@dataclasses.dataclass(frozen=True)
class Float8Rows:
    """A tensor quantized row by row: ``data`` (fp8, the tensor's shape) times ``scales``
    (fp32, one per row: shape ``(rows, 1, ...)``)."""

    data: torch.Tensor
    scales: torch.Tensor

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The values ``data * scales``, in ``dtype``."""
        return (self.data.to(torch.float32) * self.scales).to(dtype)


def quantize_rows(weight: torch.Tensor) -> Float8Rows:
    """``weight`` as fp8 with one fp32 scale per row (dim 0): the scale maps the row's
    largest magnitude to fp8's largest value, 448; a row of zeros gets the scale 1.

    >>> weight = torch.tensor([[1.75, 0.3], [0.25, -0.875], [-3.5, 1.0]])
    >>> rows = quantize_rows(weight)
    >>> rows.data.float().tolist(), rows.scales.flatten().tolist()
    ([[448.0, 80.0], [128.0, -448.0], [-448.0, 128.0]], [0.00390625, 0.001953125, 0.0078125])
    >>> rows.dequantize(torch.float32).tolist()  # 0.3 * 256 = 76.8 rounds to fp8's 80
    [[1.75, 0.3125], [0.25, -0.875], [-3.5, 1.0]]
    >>> quantize_rows(torch.zeros(1, 2)).scales.tolist()  # a padding row
    [[1.0]]
    """
    if weight.dim() < 2:
        raise ValueError(f"quantize_rows needs a tensor of 2 or more dims, got {weight.dim()}")
    weight = weight.detach().to(torch.float32)
    amax = weight.abs().amax(dim=tuple(range(1, weight.dim())), keepdim=True)
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    data = (weight / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return Float8Rows(data, scales)


def quantize_dequantize(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` through fp8 and back, in its own dtype: what a :class:`Float8GatherWeight`
    computes with after its all-gather."""
    return quantize_rows(weight).dequantize(weight.dtype)


def straight_through(weight: torch.Tensor) -> torch.Tensor:
    """``weight + (quantize_dequantize(weight) - weight).detach()``: the quantized values in
    forward, and in backward the gradient passed to ``weight`` unchanged.

    The value is the quantized one exactly: a quantized element is within a factor 2 of the
    element (fp8 rounds to within 1/16 of it, or to 0), so their difference is exact in
    fp32 (Sterbenz's lemma), and adding it back gives the quantized element.
    """
    return weight + (quantize_dequantize(weight) - weight).detach()


def padded_rows(rows: int, shard_size: int) -> int:
    """Rows of a padded shard when ``rows`` are sharded on dim 0 over ``shard_size`` ranks.

    >>> padded_rows(15, 4), padded_rows(5, 4), padded_rows(8, 2)
    (4, 2, 4)
    """
    return math.ceil(rows / shard_size)


# Ops whose outputs stay a Float8GatherWeight: FSDP builds shards and padded copies with
# them (split/chunk, new_zeros, slice/narrow, view), and nn.Parameter, optimizers and
# state dicts detach, clone, copy and move them. Any other op computes on the fp32 value
# and returns a plain tensor; ops that write their first argument return that argument.
_aten = torch.ops.aten
_KEEP_SUBCLASS = {
    _aten.detach.default,
    _aten.alias.default,
    _aten.clone.default,
    _aten._to_copy.default,
    _aten.empty_like.default,
    _aten.zeros_like.default,
    _aten.new_zeros.default,
    _aten.new_empty.default,
    _aten.new_empty_strided.default,
    _aten.view.default,
    _aten._unsafe_view.default,
    _aten.as_strided.default,
    _aten.slice.Tensor,
    _aten.split.Tensor,
    _aten.split_with_sizes.default,
    _aten._pin_memory.default,
}


def _in_place(func: Any) -> bool:
    """Whether ``func`` writes its first argument: aten names in-place ops with a trailing
    underscore (``add_``, ``copy_``)."""
    return func.overloadpacket.__name__.endswith("_")


class Float8GatherWeight(torch.Tensor):
    """An fp32 weight that ``fully_shard`` all-gathers as fp8 plus per-row scales (the
    five-argument pre-all-gather hook); see [Note: the all-gather extension contract].

    A wrapper tensor: it holds the fp32 value (``_tensor``), on which every op computes (the
    optimizer updates it in place), and ``unsharded_rows``, dim 0 of the weight it was cut
    from (FSDP's shards and padded copies of it inherit both; see ``_KEEP_SUBCLASS``)::

        >>> weight = Float8GatherWeight(torch.ones(3, 2))
        >>> type(weight[1:]).__name__, weight[1:].unsharded_rows, (weight * 2).__class__
        ('Float8GatherWeight', 3, <class 'torch.Tensor'>)
    """

    _tensor: torch.Tensor
    unsharded_rows: int

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, unsharded_rows: int | None = None):
        # a tensor with no storage of its own: its data is _tensor's
        return torch_private.make_wrapper_subclass(cls, tensor)

    def __init__(self, tensor: torch.Tensor, unsharded_rows: int | None = None) -> None:
        self._tensor = tensor
        self.unsharded_rows = tensor.shape[0] if unsharded_rows is None else unsharded_rows

    # Torch functions go straight to __torch_dispatch__, as for every wrapper subclass.
    __torch_function__ = torch_private.DISABLED_TORCH_FUNCTION

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._tensor}, unsharded_rows={self.unsharded_rows})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        like = next(t for t in tree_leaves((args, kwargs)) if isinstance(t, Float8GatherWeight))
        unwrap = lambda t: t._tensor  # noqa: E731
        out = func(*tree_map_only(Float8GatherWeight, unwrap, args),
                   **tree_map_only(Float8GatherWeight, unwrap, kwargs))  # fmt: skip
        if _in_place(func) and isinstance(args[0], Float8GatherWeight):
            return args[0]
        if func not in _KEEP_SUBCLASS:
            return out
        rewrap = lambda t: type(like)(t, like.unsharded_rows)  # noqa: E731
        return tree_map_only(torch.Tensor, rewrap, out)

    def __tensor_flatten__(self) -> tuple[list[str], dict[str, int]]:
        return ["_tensor"], {"unsharded_rows": self.unsharded_rows}

    @classmethod
    def __tensor_unflatten__(cls, inner: dict, meta: dict, outer_size: Any, outer_stride: Any):
        return cls(inner["_tensor"], meta["unsharded_rows"])

    # -- the all-gather extension ----------------------------------------------------------

    def fsdp_pre_all_gather(
        self,
        mesh: Any,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        module: nn.Module,
        mp_policy: Any,
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Size]:
        """This rank's shard, padded and quantized: ``((fp8 data, fp32 scales), the
        unsharded size)``."""
        return self._all_gather_inputs(torch.Size(outer_size), mesh.size())

    def _all_gather_inputs(
        self, unsharded_size: torch.Size, shard_size: int
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Size]:
        local = self._tensor
        padding = padded_rows(unsharded_size[0], shard_size) - local.shape[0]
        if padding > 0:
            local = torch.cat([local, local.new_zeros((padding, *local.shape[1:]))])
        rows = quantize_rows(local)
        return (rows.data, rows.scales), unsharded_size

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: torch.Size,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        """The gathered rows dequantized to ``param_dtype``, without the padding rows: the
        unsharded weight and the tensor to free on reshard, or, with ``out``, written into
        ``out`` in place."""
        data, scales = all_gather_outputs
        unsharded_size = metadata
        rows = unsharded_size[0]
        data = data.reshape(-1, *unsharded_size[1:])[:rows]
        scales = scales.reshape(-1, *([1] * (data.dim() - 1)))[:rows]
        weight = Float8Rows(data, scales).dequantize(param_dtype)
        if out is None:
            return weight, (weight,)
        with torch.no_grad():
            # .data: autograd may hold `out` from an earlier forward; a refill must not bump
            # its version, or that backward would refuse it
            out.data.copy_(weight)
        return None


class Float8GatherWeightMeshOnly(Float8GatherWeight):
    """:class:`Float8GatherWeight` with the one-argument pre-all-gather hook, which is
    given the shard mesh alone: the shard pads to the unsharded rows it carries."""

    def fsdp_pre_all_gather(  # type: ignore[override]
        self, mesh: Any
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Size]:
        """Rank 1's part of the worked example of [Note: the all-gather extension contract]:

        >>> class TwoRanks:
        ...     def size(self):
        ...         return 2
        >>> weight = torch.tensor([[1.75, 0.3], [0.25, -0.875], [-3.5, 1.0]])
        >>> shard = Float8GatherWeightMeshOnly(weight)[2:]  # row 2; rank 0 holds rows 0-1
        >>> (data, scales), unsharded_size = shard.fsdp_pre_all_gather(TwoRanks())
        >>> data.float().tolist(), scales.flatten().tolist(), unsharded_size
        ([[-448.0, 128.0], [0.0, 0.0]], [0.0078125, 1.0], torch.Size([3, 2]))
        """
        unsharded_size = torch.Size((self.unsharded_rows, *self.shape[1:]))
        return self._all_gather_inputs(unsharded_size, mesh.size())


HOOK_FORMS: dict[int, type[Float8GatherWeight]] = {
    1: Float8GatherWeightMeshOnly,
    5: Float8GatherWeight,
}


def float8_weight_names(model: nn.Module) -> list[str]:
    """The parameters :func:`to_float8_gather` converts: every ``nn.Linear``'s weight, as
    torchao's float8 training converts linear layers (norms, embeddings and biases stay)."""
    return [
        f"{name}.weight" if name else "weight"
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
    ]


def to_float8_gather(model: nn.Module, hook_arguments: int = 5) -> list[str]:
    """Make every ``nn.Linear`` weight of ``model`` a :class:`Float8GatherWeight` (or, with
    ``hook_arguments=1``, a :class:`Float8GatherWeightMeshOnly`), in place, before
    ``fully_shard``; returns their names."""
    cls = HOOK_FORMS.get(hook_arguments)
    if cls is None:
        raise ValueError(f"hook_arguments must be 1 or 5, got {hook_arguments}")
    for module in model.modules():
        if isinstance(module, nn.Linear):
            weight = module.weight
            if isinstance(weight, Float8GatherWeight):
                raise ValueError(f"{module} already has a {type(weight).__name__} weight")
            module.weight = nn.Parameter(cls(weight.detach()), weight.requires_grad)
    return float8_weight_names(model)


class Float8GatherReference(nn.Module):
    """The unsharded reference for a model whose ``names`` weights are
    :class:`Float8GatherWeight`: ``module`` with plain fp32 weights, run with each of
    ``names`` replaced by :func:`straight_through` of it. Pair it with
    :class:`~reffsdp.testing.parity.Passthrough` around the sharded model so the parameter
    names match."""

    def __init__(self, module: nn.Module, names: Iterable[str]) -> None:
        super().__init__()
        self.module = module
        self.names = tuple(names)
        known = dict(module.named_parameters())
        missing = [name for name in self.names if name not in known]
        if missing:
            raise ValueError(f"no parameter(s) {missing} in {type(module).__name__}")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        params = dict(self.module.named_parameters())
        quantized = {name: straight_through(params[name]) for name in self.names}
        return torch.func.functional_call(self.module, quantized, args, kwargs)
