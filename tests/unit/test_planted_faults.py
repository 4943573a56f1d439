"""The self-test's planted bugs by implementation, and which list-form all-gathers the
process-group faults take (those that fill one buffer)."""

import dataclasses

import torch

from reffsdp.testing.parity_suite import SuiteOptions
from reffsdp.testing.planted_faults import gathered_buffer
from reffsdp.testing.self_test import ANY, BUGS, list_self_test


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


def test_only_reffsdp_gets_the_bugs_that_patch_its_internals():
    everything = list_self_test(SuiteOptions())
    assert len(everything) == 23
    assert list_self_test(SuiteOptions(), impl="reffsdp") == everything
    anywhere = [(bug.name, api) for bug in BUGS if bug.impl == ANY for api in bug.apis]
    assert len(anywhere) == 11
    for impl in ("torch", "my_fsdp.testing_impl"):
        assert list_self_test(SuiteOptions(), impl=impl) == anywhere
    assert list_self_test(SuiteOptions(api=("wrapper",)), impl="torch") == [
        (name, api) for name, api in anywhere if api == "wrapper"
    ]


def test_the_implementation_may_come_with_the_options_or_as_an_object():
    @dataclasses.dataclass(frozen=True)
    class Options:  # options that name the implementation, as a suite run's may
        api: tuple[str, ...] = ()
        impl: object = "torch"

    @dataclasses.dataclass(frozen=True)
    class Impl:
        name: str

    torch_only = list_self_test(SuiteOptions(), impl="torch")
    assert list_self_test(Options()) == torch_only
    assert list_self_test(Options(impl=Impl("torch"))) == torch_only
    assert list_self_test(Options(), impl="reffsdp") == list_self_test(SuiteOptions())
