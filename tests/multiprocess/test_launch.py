"""The one rank launcher (``reffsdp.testing.launch``): ranks run a function in a world of
their own and send back what they have to say; a rank that raises, or ends without a word,
is named; SIGINT ends a rank quietly; closing stops the ranks still running. Under a
launcher (torchrun's variables set) the same rank code joins the launched world instead."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from reffsdp.testing.launch import (
    JoinedRank,
    RankFailed,
    RankProcesses,
    RankWorld,
    join_ranks,
    launched_world,
    spawn_ranks,
    start_ranks,
)

pytestmark = pytest.mark.multiprocess


def _all_reduce(world: RankWorld, channel, offset: int) -> None:
    world.init_process_group("gloo", timedelta(seconds=60))
    try:
        tensor = torch.ones(1) * (world.rank + offset)
        dist.all_reduce(tensor)
        channel.send((world.rank, world.world_size, tensor.item()))
    finally:
        dist.destroy_process_group()


def _raise_on_rank_1(world: RankWorld, channel) -> None:
    if world.rank == 1:
        raise ValueError("planted failure on rank 1")
    channel.send("rank 0 is done")


def _raise_on_rank_0(world, channel) -> None:
    world.init_process_group("gloo", timedelta(seconds=60))
    try:
        raise ValueError("planted failure on rank 0")
    finally:
        dist.destroy_process_group()


def _exit_on_rank_1(world: RankWorld, channel) -> None:
    if world.rank == 1:
        os._exit(3)


def _sleep(world: RankWorld, channel) -> None:
    channel.send("sleeping")
    time.sleep(600)


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_every_rank_runs_in_one_world_and_sends_back(start_method):
    with spawn_ranks(_all_reduce, 2, (10,), start_method=start_method) as ranks:
        sent = sorted(message for _, message in ranks.messages())
        directory = ranks.directory
    assert sent == [(0, 2, 21.0), (1, 2, 21.0)]  # (10 + 0) + (10 + 1) on each
    assert not os.path.exists(directory)  # the shared folder goes with the ranks


def test_a_rank_that_raises_is_named_with_its_traceback():
    with spawn_ranks(_raise_on_rank_1, 2, start_method="forkserver") as ranks:
        with pytest.raises(RankFailed) as failure:
            dict(ranks.messages())
    assert failure.value.rank == 1 and not failure.value.silent
    assert "ValueError: planted failure on rank 1" in failure.value.detail
    assert str(failure.value).startswith("rank 1 failed:\nTraceback")


def test_a_rank_that_ends_without_a_word_is_named_with_its_exit_code():
    with spawn_ranks(_exit_on_rank_1, 2, start_method="forkserver") as ranks:
        with pytest.raises(RankFailed) as failure:
            ranks.receive(1)
        assert failure.value.silent and failure.value.detail == "its exit code was 3"
        assert list(ranks.messages()) == []  # rank 0 ended well, having said nothing


def test_sigint_ends_a_rank_quietly_and_close_stops_the_others():
    ranks = spawn_ranks(_sleep, 2, start_method="forkserver")
    try:
        assert [ranks.receive(rank) for rank in (0, 1)] == ["sleeping", "sleeping"]
        os.kill(ranks.pid(1), signal.SIGINT)
        with pytest.raises(RankFailed, match="its exit code was 130"):
            ranks.receive(1)
    finally:
        start = time.monotonic()
        ranks.close()
    assert time.monotonic() - start < 5
    assert [process.is_alive() for process in ranks.processes] == [False, False]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        spawn_ranks(_sleep, 0)
    with pytest.raises(ValueError, match="start_method must be one of"):
        spawn_ranks(_sleep, 1, start_method="fork")


@pytest.fixture
def launched_alone(monkeypatch):
    """This process as the one rank of a world torchrun launched."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    environment = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    environment.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    for key, value in environment.items():
        monkeypatch.setenv(key, value)


def test_without_a_launcher_start_ranks_spawns():
    with start_ranks(_all_reduce, 2, (10,)) as ranks:
        assert isinstance(ranks, RankProcesses)
        assert sorted(message for _, message in ranks.messages())[0] == (0, 2, 21.0)


@pytest.mark.timeout(60)
def test_under_a_launcher_start_ranks_joins_and_runs_the_rank_here(launched_alone):
    with start_ranks(_all_reduce, 1, (10,)) as ranks:
        assert isinstance(ranks, JoinedRank)
        assert list(ranks.messages()) == [(0, (0, 1, 10.0))]
    with start_ranks(_all_reduce, 1, (5,)) as ranks:  # a second group: a store prefix of its own
        assert list(ranks.messages()) == [(0, (0, 1, 5.0))]
    with pytest.raises(ValueError, match="2 ranks asked for, but torchrun launched 1"):
        start_ranks(_all_reduce, 2, (10,))


@pytest.mark.timeout(60)
def test_a_joined_rank_that_raises_is_named_with_its_traceback(launched_alone):
    world = launched_world()
    with join_ranks(_raise_on_rank_0, world) as ranks:
        with pytest.raises(RankFailed) as failure:
            list(ranks.messages())
    assert failure.value.rank == 0 and "ValueError: planted failure on rank 0" in str(failure.value)
