"""Training and sharding states, with checked transitions.

A parameter group moves through two small state machines:

* ``ShardedState``: where its parameters live. ``SHARDED`` (only the local shard is
  registered) and ``UNSHARDED`` (the full parameters are registered). With an integer
  ``reshard_after_forward`` there is a middle state, ``SHARDED_POST_FORWARD``: after forward
  the group keeps a larger shard so backward can all-gather over fewer ranks.
* ``TrainingState``: what the group (or a front end's per-module state) is doing:
  ``IDLE -> FORWARD -> IDLE -> PRE_BACKWARD -> POST_BACKWARD -> IDLE``.

A group's training state changes only through :func:`check_transition`, which names the
module and rank when code asks for a transition from the wrong place.
"""

from __future__ import annotations

import enum


class TrainingState(enum.Enum):
    IDLE = enum.auto()
    FORWARD = enum.auto()
    PRE_BACKWARD = enum.auto()
    POST_BACKWARD = enum.auto()


class ShardedState(enum.Enum):
    SHARDED = enum.auto()
    SHARDED_POST_FORWARD = enum.auto()
    UNSHARDED = enum.auto()


# Where a training state may go next. IDLE is reachable from everywhere: the final
# callback and ``reset()`` after an error end every iteration there.
_NEXT: dict[TrainingState, frozenset[TrainingState]] = {
    TrainingState.IDLE: frozenset(TrainingState),
    # A module called twice in one forward re-enters FORWARD.
    TrainingState.FORWARD: frozenset({TrainingState.FORWARD, TrainingState.IDLE}),
    TrainingState.PRE_BACKWARD: frozenset({TrainingState.POST_BACKWARD, TrainingState.IDLE}),
    # A module used twice in forward sees a second pre-backward after its first reduction.
    TrainingState.POST_BACKWARD: frozenset(
        {TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD, TrainingState.IDLE}
    ),
}


def check_transition(current: TrainingState, new: TrainingState, *, owner: str) -> None:
    """Raise ``RuntimeError`` unless a group may go from ``current`` to ``new``.

    ``owner`` names the module (and rank) so the message says where the misuse happened.

    >>> check_transition(TrainingState.IDLE, TrainingState.FORWARD, owner="block")
    >>> check_transition(TrainingState.FORWARD, TrainingState.POST_BACKWARD, owner="block")
    Traceback (most recent call last):
    RuntimeError: block: cannot go from FORWARD to POST_BACKWARD (allowed: FORWARD, IDLE)
    """
    allowed = _NEXT[current]
    if new not in allowed:
        names = ", ".join(sorted(state.name for state in allowed))
        raise RuntimeError(
            f"{owner}: cannot go from {current.name} to {new.name} (allowed: {names})"
        )
