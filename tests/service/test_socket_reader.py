"""A plain ZeroMQ socket read from the event loop (service/engine/socket_reader.py): every message taken, a bounded
number per loop turn, and none left behind by ZeroMQ's edge-triggered descriptor."""
from __future__ import annotations

import asyncio

import pytest
import zmq

from vitserve.service.engine import socket_reader
from vitserve.service.engine.socket_reader import SocketReader

pytestmark = pytest.mark.anyio


@pytest.fixture
def pair(tmp_path):
    context = zmq.Context()
    router, dealer = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
    router.bind(f"ipc://{tmp_path}/r.sock")
    dealer.connect(f"ipc://{tmp_path}/r.sock")
    yield router, dealer
    context.destroy(linger=0)


async def until(condition, seconds: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + seconds
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.001)


async def test_messages_queued_before_it_starts_are_all_taken_a_bounded_number_per_turn(pair):
    router, dealer = pair
    total = 3 * socket_reader.DRAIN_AT_ONCE + 10
    for number in range(total):
        dealer.send(str(number).encode())
    while not router.poll(0):  # the first has arrived; its edge fired before anyone watched
        await asyncio.sleep(0.001)
    await asyncio.sleep(0.2)  # and the rest (a first round of DRAIN_AT_ONCE at start, most likely)
    taken: list[int] = []
    turns: list[int] = []  # how many were taken when another callback ran between reads
    reader = SocketReader(router, lambda frames: taken.append(int(frames[1])))

    def between() -> None:
        turns.append(len(taken))
        if len(taken) < total:
            asyncio.get_running_loop().call_soon(between)

    reader.start()  # takes the first round at once, with no new edge to come
    at_start = len(taken)
    assert 0 < at_start <= socket_reader.DRAIN_AT_ONCE
    asyncio.get_running_loop().call_soon(between)
    await until(lambda: len(taken) == total)
    reader.stop()
    assert taken == list(range(total))
    # the loop ran other work between rounds, each round at most DRAIN_AT_ONCE
    steps = [after - before for before, after in zip([at_start, *turns], turns)]
    assert len(turns) >= 3 and max(steps) <= socket_reader.DRAIN_AT_ONCE


async def test_a_message_it_cannot_take_is_dropped_and_the_next_still_arrives(pair, caplog):
    router, dealer = pair
    taken: list[bytes] = []

    def take(frames: list[bytes]) -> None:
        if frames[1] == b"bad":
            raise ValueError("unreadable")
        taken.append(frames[1])

    reader = SocketReader(router, take)
    reader.start()
    dealer.send(b"bad")
    dealer.send(b"good")
    await until(lambda: taken == [b"good"])
    assert "could not be taken" in caplog.text
    reader.stop()
    dealer.send(b"after")  # stopped: nobody reads any more
    await asyncio.sleep(0.05)
    assert taken == [b"good"]


async def test_after_its_owner_sends_it_reads_the_socket_again(pair):
    router, dealer = pair
    reads: list[str] = []
    reader = SocketReader(router, lambda frames: None)
    reader.start()
    original = reader._read

    def counted() -> None:
        reads.append("read")
        original()

    reader._read = counted  # what `send` schedules
    reader.send([b"nobody", b"x"])  # a ROUTER drops what it cannot route
    reader.send([b"nobody", b"y"])  # read once per turn, however many sends
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert reads == ["read"]
    reader.stop()
    reader.send([b"nobody", b"z"])  # stopped: nothing scheduled
    await asyncio.sleep(0)
    assert reads == ["read"]
