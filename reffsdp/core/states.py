"""Training and sharding states, with checked transitions.

A parameter group moves through two small state machines:

* ``ShardedState``: where its parameters live. ``SHARDED`` (only the local shard is
  registered) and ``UNSHARDED`` (the full parameters are registered). With an integer
  ``reshard_after_forward`` there is a middle state, ``SHARDED_POST_FORWARD``: after forward
  the group keeps a larger shard so backward can all-gather over fewer ranks.
* ``TrainingState``: what the group (or a whole ``fully_shard`` state) is doing:
  ``IDLE -> FORWARD -> IDLE -> PRE_BACKWARD -> POST_BACKWARD -> IDLE``.

Transitions go through :func:`check_state`, which names the module and rank when code asks
for a transition from the wrong place.
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


def check_state(
    current: enum.Enum, allowed: tuple[enum.Enum, ...], *, action: str, owner: str
) -> None:
    """Raise ``RuntimeError`` unless ``current`` is one of ``allowed``.

    ``owner`` names the module (and rank) so the message says where the misuse happened.
    """
    if current not in allowed:
        names = ", ".join(state.name for state in allowed)
        raise RuntimeError(f"{owner}: cannot {action} in state {current.name} (expected {names})")
