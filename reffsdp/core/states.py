"""Training and sharding states, with checked transitions.

[Note: state machines]
Three small state machines run an iteration. Each belongs to one object and changes in one
method of it, which checks the move against the machine's table below
(:func:`check_transition`): an illegal move raises, naming the object, both states and the
moves allowed from where it is. Nothing else assigns them.

    machine                   belongs to                changes only in
    a state's training state  ``IterationDriver``       ``IterationDriver._to_training_state``
    a group's training state  ``ParamGroup``            ``ParamGroup._to_training_state``
    a group's sharded state   ``ParamGroup``            ``ParamGroup._to_sharded_state``

A state (one per ``fully_shard`` call or wrapper instance) follows its modules' hooks
(``STATE_TRAINING``)::

    IDLE --pre-forward--> FORWARD --post-forward--> IDLE
    IDLE --pre-backward--> PRE_BACKWARD --final callback--> IDLE

1. FORWARD -> FORWARD: the state's forward starts again before it ended (a grouped call's
   second module, a forward method that calls ``forward``, a forward after one that
   raised).
2. PRE_BACKWARD -> PRE_BACKWARD: every output of the forward that backward reaches runs
   the pre-backward hook.
3. Any state -> IDLE: the final callback idles every state under the root (IDLE ones too),
   and so does ``reset_iter_state`` after an error.

A group (one all-gather and reduce-scatter unit) also records that it reduced its
gradients (``GROUP_TRAINING``)::

    IDLE -> FORWARD -> IDLE -> PRE_BACKWARD -> POST_BACKWARD -> IDLE

4. FORWARD -> FORWARD as in rule 1, and IDLE from everywhere as in rule 3; POST_BACKWARD
   -> PRE_BACKWARD: a module used twice in forward gets its second pre-backward after its
   first reduction.

A group's sharded state says which form of its parameters the module shows
(``GROUP_SHARDING``)::

    SHARDED --all-gather--> UNSHARDED --reshard--> SHARDED
                            UNSHARDED --reshard after forward--> SHARDED_POST_FORWARD
    SHARDED_POST_FORWARD --all-gather--> UNSHARDED,  SHARDED_POST_FORWARD --reshard--> SHARDED
    SHARDED or UNSHARDED --summon--> SUMMONED --the summon ends--> where it started

5. SUMMONED: shown unsharded in the original dtype for a caller outside forward and
   backward (the wrapper's ``summon_full_params`` and full state dicts), by
   ``ParamGroup.unsharded_in_full_precision``. A group UNSHARDED for compute in a lower
   ``param_dtype`` keeps those buffers set aside meanwhile (a pending backward's saved
   tensors may alias them) and is UNSHARDED again when the summon ends. A summon in a
   summon is refused. Forward and backward do not run in a summon; one that did (its
   gather or reshard) would end the summon early, and the summon leaves the group as it
   found it then.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TypeVar


class TrainingState(enum.Enum):
    IDLE = enum.auto()
    FORWARD = enum.auto()
    PRE_BACKWARD = enum.auto()
    POST_BACKWARD = enum.auto()  # a group's only: its gradients were reduced


class ShardedState(enum.Enum):
    SHARDED = enum.auto()
    SHARDED_POST_FORWARD = enum.auto()  # reshard_after_forward=k: a k-rank shard kept
    UNSHARDED = enum.auto()
    SUMMONED = enum.auto()  # unsharded in the original dtype for a summon (rule 5)


_T = TypeVar("_T", TrainingState, ShardedState)
_Table = Mapping[_T, frozenset[_T]]

# Where a state's training state may go next (rules 1-3).
STATE_TRAINING: _Table[TrainingState] = {
    TrainingState.IDLE: frozenset(
        {TrainingState.IDLE, TrainingState.FORWARD, TrainingState.PRE_BACKWARD}
    ),
    TrainingState.FORWARD: frozenset({TrainingState.FORWARD, TrainingState.IDLE}),
    TrainingState.PRE_BACKWARD: frozenset({TrainingState.PRE_BACKWARD, TrainingState.IDLE}),
    TrainingState.POST_BACKWARD: frozenset(),  # never a state's
}

# Where a group's training state may go next (rule 4).
GROUP_TRAINING: _Table[TrainingState] = {
    TrainingState.IDLE: frozenset(TrainingState),
    TrainingState.FORWARD: frozenset({TrainingState.FORWARD, TrainingState.IDLE}),
    TrainingState.PRE_BACKWARD: frozenset({TrainingState.POST_BACKWARD, TrainingState.IDLE}),
    TrainingState.POST_BACKWARD: frozenset(
        {TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD, TrainingState.IDLE}
    ),
}

# Where a group's sharding may go next (rule 5 for SUMMONED).
GROUP_SHARDING: _Table[ShardedState] = {
    ShardedState.SHARDED: frozenset({ShardedState.UNSHARDED, ShardedState.SUMMONED}),
    ShardedState.SHARDED_POST_FORWARD: frozenset({ShardedState.UNSHARDED, ShardedState.SHARDED}),
    ShardedState.UNSHARDED: frozenset(
        {ShardedState.SHARDED, ShardedState.SHARDED_POST_FORWARD, ShardedState.SUMMONED}
    ),
    ShardedState.SUMMONED: frozenset({ShardedState.SHARDED, ShardedState.UNSHARDED}),
}


def check_transition(table: _Table[_T], current: _T, new: _T, *, owner: object) -> None:
    """Raise ``RuntimeError`` unless ``table`` lets ``owner`` go from ``current`` to ``new``.

    The message names ``owner`` (its ``str``: the module, and the rank for a group), so it
    says where the misuse happened; it is formatted only when the move is refused.

    >>> check_transition(GROUP_TRAINING, TrainingState.IDLE, TrainingState.FORWARD, owner="block")
    >>> check_transition(
    ...     GROUP_TRAINING, TrainingState.FORWARD, TrainingState.POST_BACKWARD, owner="block"
    ... )
    Traceback (most recent call last):
    RuntimeError: block: cannot go from FORWARD to POST_BACKWARD (allowed: FORWARD, IDLE)
    >>> check_transition(GROUP_SHARDING, ShardedState.SUMMONED, ShardedState.SUMMONED, owner="b")
    Traceback (most recent call last):
    RuntimeError: b: cannot go from SUMMONED to SUMMONED (allowed: SHARDED, UNSHARDED)
    """
    allowed = table[current]
    if new not in allowed:
        names = ", ".join(sorted(state.name for state in allowed)) or "none"
        raise RuntimeError(
            f"{owner}: cannot go from {current.name} to {new.name} (allowed: {names})"
        )
