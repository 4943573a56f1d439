"""What one root's parameter groups share during an iteration.

[Note: bounded in-flight reductions]
Reduce-scatters are issued asynchronously so communication overlaps the rest of backward
(on CPU too: gloo runs collectives on its own threads). Each in-flight reduction keeps its
input buffer alive, so we bound how many are pending: before a group allocates the input
of a new one, it completes the oldest until fewer than its ``max_pending_reduces`` setting
remain. Completing before allocating (not after issuing) is what keeps the bound a bound
on memory: with a bound of 1 (the default on an accelerator), the previous group's input
is freed before the next input exists, and its reduction still overlapped the backward
compute in between.
Whatever is still pending when backward ends is completed in the final callback, before
anyone reads a gradient.

On CPU the default bound is 0: each reduction completes as soon as it is issued (see
[Note: collectives on CPU] in ``streams``). A user's explicit bound
(``set_reduce_scatter_max_input_buffers``) applies on CPU too.

One :class:`CommContext` serves every group under a root: the front end's root creates it
once and binds each group to it (``ParamGroup.bind``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .streams import AllGatherStream

if TYPE_CHECKING:
    from .collectives import PendingReduce


@dataclass
class CommContext:
    """Streams and in-flight collectives shared by every group under one root."""

    pending_reduces: deque[PendingReduce] = field(default_factory=deque)
    _all_gather_stream: AllGatherStream | None = None
    _host_copy_events: list[Any] = field(default_factory=list)

    def all_gather_stream(self, device: torch.device) -> AllGatherStream:
        """The side stream this root's all-gathers use (see [Note: why all-gathers get their
        own stream] in ``streams``)."""
        if self._all_gather_stream is None:
            self._all_gather_stream = AllGatherStream(device)
        return self._all_gather_stream

    def make_room_for_reduce(self, max_pending: int) -> None:
        """Before a new reduction allocates: complete the oldest until fewer than
        ``max_pending`` (at least one) remain (see [Note: bounded in-flight reductions])."""
        while len(self.pending_reduces) >= max(max_pending, 1):
            self._complete_oldest()

    def add_pending_reduce(self, pending: PendingReduce, max_pending: int = 1) -> None:
        """Track an issued reduction, completing the oldest while more than ``max_pending``
        are in flight (with a bound of 0: this one, at once)."""
        self.pending_reduces.append(pending)
        while len(self.pending_reduces) > max_pending:
            self._complete_oldest()

    def complete_reduces(self) -> None:
        """End of backward: every gradient written, and (CPU offload) landed on the host."""
        while self.pending_reduces:
            self._complete_oldest()
        self._wait_for_host_copies()

    def _wait_for_host_copies(self) -> None:
        """Rule 6 of [Note: why all-gathers get their own stream] in ``streams``: the host
        waits for the gradients' non-blocking copies before the optimizer touches them."""
        for event in self._host_copy_events:
            event.synchronize()
        self._host_copy_events.clear()

    def _complete_oldest(self) -> None:
        pending = self.pending_reduces.popleft()
        pending.complete()
        if pending.host_copy_event is not None:
            self._host_copy_events.append(pending.host_copy_event)

    def discard_reduces(self) -> None:
        """Wait for in-flight reductions but write no gradients (used after an error)."""
        while self.pending_reduces:
            self.pending_reduces.popleft().wait()
