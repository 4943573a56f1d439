"""Configuration of the wrapper API, ``FullyShardedDataParallel``: strategies and settings.

Mirrors ``torch.distributed.fsdp.api`` name for name, field for field: every enum has the same
members in the same order (values from ``enum.auto()``), and every dataclass the same fields,
defaults and field order, so code written against torch's classes runs unchanged. Like
torch's, the dataclasses are mutable.

[Note: state-dict configs come in pairs]
A model state dict and an optimizer state dict are configured separately, by two parallel
families: ``StateDictConfig`` (model) and ``OptimStateDictConfig`` (optimizer), each with a
``Full``, ``Local`` and ``Sharded`` subclass matching the three ``StateDictType`` members.
``StateDictSettings`` holds one of each with the type they serve. The two families differ in
one default: an optimizer state dict is offloaded to CPU by default (it is usually gathered
to be saved), a model state dict is not; a local optimizer state dict stays where it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto

import torch

from .core.torch_internals import batch_norm_base

__all__ = [
    "ShardingStrategy",
    "BackwardPrefetch",
    "MixedPrecision",
    "CPUOffload",
    "StateDictType",
    "StateDictConfig",
    "FullStateDictConfig",
    "LocalStateDictConfig",
    "ShardedStateDictConfig",
    "OptimStateDictConfig",
    "FullOptimStateDictConfig",
    "LocalOptimStateDictConfig",
    "ShardedOptimStateDictConfig",
    "StateDictSettings",
]


class ShardingStrategy(Enum):
    """What each wrapper instance keeps sharded, and over which ranks.

    * ``FULL_SHARD``: parameters, gradients and optimizer state sharded; parameters are
      gathered for forward, freed after it (except on the root), gathered again for backward.
    * ``SHARD_GRAD_OP``: as ``FULL_SHARD``, but parameters stay gathered from forward to the
      end of backward (more memory, one all-gather less per step).
    * ``NO_SHARD``: every rank holds everything and gradients are all-reduced (plain data
      parallelism).
    * ``HYBRID_SHARD``: ``FULL_SHARD`` within a shard group (usually a node), gradients then
      all-reduced across the replica groups.
    * ``_HYBRID_SHARD_ZERO2``: the ``SHARD_GRAD_OP`` flavour of ``HYBRID_SHARD``.
    """

    FULL_SHARD = auto()
    SHARD_GRAD_OP = auto()
    NO_SHARD = auto()
    HYBRID_SHARD = auto()
    _HYBRID_SHARD_ZERO2 = auto()


class BackwardPrefetch(Enum):
    """When the next instance's all-gather is issued during backward.

    * ``BACKWARD_PRE``: before computing this instance's gradients (most overlap, most
      memory: two instances' parameters are gathered at once).
    * ``BACKWARD_POST``: after computing this instance's gradients, before reducing them.
    """

    BACKWARD_PRE = auto()
    BACKWARD_POST = auto()


@dataclass
class MixedPrecision:
    """Low-precision compute for the wrapper API; ``None`` keeps a dtype at full precision.

    ``param_dtype`` is the dtype parameters are all-gathered and used in; ``reduce_dtype`` the
    dtype gradients are reduced in (it follows ``param_dtype`` when only that is set);
    ``buffer_dtype`` the dtype buffers are cast to. Gradients are cast back to the parameter
    dtype after reduction unless ``keep_low_precision_grads``. Forward inputs are cast to
    ``param_dtype`` at every instance when ``cast_forward_inputs``, at the root only when
    ``cast_root_forward_inputs``. Under an auto-wrap policy, instances of
    ``_module_classes_to_ignore`` (batch norm by default) are wrapped on their own with mixed
    precision off.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    _module_classes_to_ignore: Sequence[type[torch.nn.Module]] = (batch_norm_base(),)


@dataclass
class CPUOffload:
    """Keep the sharded parameters (and their gradients) on CPU between uses."""

    offload_params: bool = False


class StateDictType(Enum):
    """What ``state_dict()`` returns for a wrapped model (see [Note: state-dict configs come
    in pairs]).

    * ``FULL_STATE_DICT``: every parameter whole, under its original name.
    * ``LOCAL_STATE_DICT``: each instance's flat local shard, as stored.
    * ``SHARDED_STATE_DICT``: every parameter under its original name, as a sharded tensor.
    """

    FULL_STATE_DICT = auto()
    LOCAL_STATE_DICT = auto()
    SHARDED_STATE_DICT = auto()


@dataclass
class StateDictConfig:
    """Settings shared by every model state-dict type: ``offload_to_cpu`` moves values to CPU."""

    offload_to_cpu: bool = False


@dataclass
class FullStateDictConfig(StateDictConfig):
    """Full model state dict; with ``rank0_only`` the other ranks return an empty dict."""

    rank0_only: bool = False


@dataclass
class LocalStateDictConfig(StateDictConfig):
    """Local (flat shard) model state dict: no settings of its own."""


@dataclass
class ShardedStateDictConfig(StateDictConfig):
    """Sharded model state dict; ``_use_dtensor`` gives ``DTensor`` values instead of
    ``ShardedTensor`` ones."""

    _use_dtensor: bool = False


@dataclass
class OptimStateDictConfig:
    """Settings shared by every optimizer state-dict type (offloaded to CPU by default)."""

    offload_to_cpu: bool = True


@dataclass
class FullOptimStateDictConfig(OptimStateDictConfig):
    """Full optimizer state dict; with ``rank0_only`` the other ranks return an empty dict."""

    rank0_only: bool = False


@dataclass
class LocalOptimStateDictConfig(OptimStateDictConfig):
    """Local optimizer state dict: left on its device by default."""

    offload_to_cpu: bool = False


@dataclass
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    """Sharded optimizer state dict; ``_use_dtensor`` gives ``DTensor`` values."""

    _use_dtensor: bool = False


@dataclass
class StateDictSettings:
    """The state-dict type in force and the model and optimizer configs that go with it."""

    state_dict_type: StateDictType
    state_dict_config: StateDictConfig
    optim_state_dict_config: OptimStateDictConfig
