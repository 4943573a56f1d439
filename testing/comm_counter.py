"""Counting collectives (placeholder: the counter is being written)."""

from reffsdp.core.comms import Collective


def record_collective(kind: Collective, nbytes: int) -> None:
    """Report one collective issued on this thread to the active counters."""
