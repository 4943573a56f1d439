"""Which list-form all-gathers the process-group faults take: those that fill one buffer."""

import torch

from reffsdp.testing.planted_faults import gathered_buffer


def test_pieces_of_one_buffer_are_a_gather_into_that_buffer():
    buffer = torch.zeros(10)
    pieces = list(torch.chunk(buffer[2:], 2))  # an offset into the storage, as a view can be
    gathered = gathered_buffer([pieces], [torch.ones(4)])
    assert gathered is not None and gathered.shape == (8,)
    gathered.fill_(1.0)
    assert buffer.tolist() == [0.0, 0.0] + [1.0] * 8


def test_other_all_gathers_are_left_alone():
    shard = torch.ones(4)
    separate = [torch.empty_like(shard) for _ in range(2)]  # the parity checker's
    assert gathered_buffer([separate], [shard]) is None
    raw = torch.zeros(8, dtype=torch.uint8)  # all_gather_object's pickled bytes
    assert gathered_buffer([list(raw.chunk(2))], [raw[:4]]) is None
    buffer = torch.zeros(8)
    swapped = list(reversed(buffer.chunk(2)))  # pieces out of order
    assert gathered_buffer([swapped], [shard]) is None
    gapped = [buffer[0:3], buffer[4:7]]  # pieces with a gap
    assert gathered_buffer([gapped], [shard[:3]]) is None
    assert gathered_buffer([buffer.chunk(2), buffer.chunk(2)], [shard, shard]) is None  # coalesced
