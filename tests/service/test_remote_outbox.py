"""A frontend's messages to its engine (service/engine/remote.py): the Submits and Cancels of one loop turn travel
as one ZeroMQ message of one frame; a socket that cannot send yet (an engine reconnecting) is retried within the
grace, then each image fails with 503 and its shared memory is freed."""
from __future__ import annotations

import asyncio
from functools import partial

import numpy as np
import pytest
import zmq
import zmq.asyncio

from vitserve.service.engine import ModelHandle, remote
from vitserve.service.engine.messages import Codec, EngineStatus, Submit
from vitserve.service.engine.remote import RemoteEngine, _Link
from vitserve.service.engine.socket_reader import SocketReader
from vitserve.service.ground.errors import NotReady
from vitserve.service.ground.metrics import ServiceMetrics
from vitserve.service.ground.settings import Settings


def _engine_with_link(address: str) -> tuple[RemoteEngine, _Link]:
    """A frontend whose one engine is `address`, said ready, without `start` (which waits for a real engine)."""
    engine = RemoteEngine(Settings(engine_arena_bytes=2**20), ServiceMetrics())
    engine.arena = remote.TensorArena.create(2**20)
    requests = zmq.Context.instance().socket(zmq.DEALER)  # as `start` makes it: a plain socket read from the loop
    requests.setsockopt(zmq.LINGER, 0)
    requests.setsockopt(zmq.IMMEDIATE, 1)  # as `start` sets it: nothing queued for an engine not connected
    requests.connect(address)
    link = _Link(address, requests, zmq.Context.instance().socket(zmq.SUB),
                 status=EngineStatus("incarnation", True, "CPUExecutionProvider", 0, [], 0.0))
    link.reader = SocketReader(requests, partial(engine._answers, link))
    link.reader.start()
    link.status_reader = SocketReader(link.status_socket, partial(engine._status, link))
    link.status_reader.start()
    engine._links.append(link)
    return engine, link


async def _submit(engine: RemoteEngine, link: _Link, pixels: np.ndarray) -> asyncio.Task:
    handle = ModelHandle("tiny-vit", "1", info=None)  # the frontend sends; it reads no metadata
    return asyncio.ensure_future(engine.submit(handle, pixels, 5.0))


def test_one_loop_turns_submits_reach_the_engine_as_one_message_of_one_frame(tmp_path):
    async def main():
        address = f"ipc://{tmp_path}/engine"
        router = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(address)
        engine, link = _engine_with_link(address)
        try:
            await asyncio.sleep(0.1)  # connected
            pixels = np.ones((1, 4, 4), np.float32)
            submits = [await _submit(engine, link, pixels) for _ in range(3)]
            frames = await asyncio.wait_for(router.recv_multipart(), 5)
            assert len(frames) == 2  # the frontend's identity, then one frame holding the turn's messages
            decoded = Codec().to_engine.decode(frames[1])
            assert [type(m) for m in decoded] == [Submit] * 3 and len({m.id for m in decoded}) == 3
            assert {m.offset for m in decoded} == {p.offset for p in link.pending.values()}
            for task in submits:
                task.cancel()
            cancels = await asyncio.wait_for(router.recv_multipart(), 5)
            assert sorted(m.id for m in Codec().to_engine.decode(cancels[1])) == sorted(m.id for m in decoded)
        finally:
            await engine.close(1.0)
            router.close(linger=0)

    asyncio.run(main())


def test_an_engine_not_reachable_within_the_grace_fails_each_image_with_503_and_frees_its_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(remote, "RECONNECT_GRACE_S", 0.2)

    async def main():
        engine, link = _engine_with_link(f"ipc://{tmp_path}/nobody")  # nothing bound: the socket cannot send
        try:
            pixels = np.ones((1, 4, 4), np.float32)
            submits = [await _submit(engine, link, pixels) for _ in range(2)]
            for task in submits:
                with pytest.raises(NotReady, match="not reachable"):
                    await asyncio.wait_for(task, 5)
            assert engine.arena.free_bytes == engine.arena.size and not link.pending and not engine._late
        finally:
            await engine.close(1.0)

    asyncio.run(main())


def test_an_image_posted_to_a_socket_closed_before_the_turn_ends_fails_with_503_and_frees_its_memory(tmp_path):
    async def main():
        engine, link = _engine_with_link(f"ipc://{tmp_path}/engine")
        try:
            submit = await _submit(engine, link, np.ones((1, 4, 4), np.float32))
            await asyncio.sleep(0)  # posted: the turn's flush is scheduled
            link.requests.close(linger=0)
            with pytest.raises(NotReady, match="not reachable"):
                await asyncio.wait_for(submit, 5)
            assert engine.arena.free_bytes == engine.arena.size and not link.pending
        finally:
            await engine.close(1.0)

    asyncio.run(main())
