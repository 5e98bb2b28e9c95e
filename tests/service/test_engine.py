"""The engine boundary: the messages' round trip, the shared-memory arena, and a real engine process fed by
two frontends' `RemoteEngine`s in this test's event loop (batches fill across frontends; errors, cancels and
a restarted engine reach the right caller)."""
from __future__ import annotations

import asyncio
import os
import signal

import msgspec
import numpy as np
import onnxruntime as ort
import pytest

from vitserve.service.engine.messages import (Cancel, Codec, Control, ControlReply, EngineStatus, Failure, IndexRow,
                                     LoadedVersion, RepositoryIndex, Result, Submit, Tensor, VersionQueue, error_of,
                                     failure_for)
from vitserve.service.engine.remote import RemoteEngine
from vitserve.service.engine.shm import (ALIGNMENT, ArenaFull, ArenaReader, TensorArena, owner_pid,
                                 remove_orphaned_segments)
from vitserve.service.engine.supervisor import EngineSupervisor, engine_devices
from vitserve.service.ground.errors import DeadlineExceeded, ModelLoadError, NotReady, QueueFullError
from vitserve.service.ground.metrics import ServiceMetrics
from vitserve.service.ground.settings import Settings
from service_fixtures import PATIENCE_S, settings_for, until

# --- the messages ---


@pytest.mark.parametrize("message", [
    Submit(7, "tiny-vit", "7", "vitserve-1-ab", 128, (3, 16, 24), "<f4", 9.5), Cancel(7), Control(8, "load", "m"),
    Result(7, [Tensor((3,), b"\0" * 12), Tensor((2, 2), b"\1" * 16)], 0.001, 0.002, 4),
    Failure(7, "queue_full", "queue full (3 images waiting)"),
    ControlReply(8, RepositoryIndex(3, [IndexRow("m", "2", "READY", "")], [LoadedVersion("m", "2", {"k": "v"}, 17,
                                                                                           {"max_batch_size": 4})],
                                    {"n": "config.json: bad"}), "model_load_failed", "no version"),
])
def test_every_message_round_trips_in_a_turn(message):
    codec = Codec()
    decoder = codec.to_engine if isinstance(message, (Submit, Cancel, Control)) else codec.from_engine
    assert decoder.decode(codec.encode([message])) == [message]
    assert decoder.decode(codec.encode([message, message])) == [message, message]


def test_status_round_trips_and_a_message_for_the_other_side_is_refused():
    codec = Codec()
    status = EngineStatus("abc", True, "CPUExecutionProvider", 4, [VersionQueue("m", "1", 3, 768, None)], 1.5)
    assert codec.status.decode(codec.encode(status)) == status
    with pytest.raises(msgspec.ValidationError):
        codec.to_engine.decode(codec.encode([Failure(1, "x", "y")]))


def test_an_engine_failure_is_the_same_error_on_the_frontend():
    for error in (QueueFullError("full"), DeadlineExceeded("late"), NotReady("stopping")):
        again = error_of(failure_for(3, error))
        assert type(again) is type(error) and str(again) == str(error)
    assert type(error_of(Failure(1, "no_such_code", "?"))).__name__ == "ServiceError"


# --- the arena ---


@pytest.fixture
def arena():
    arena = TensorArena.create(4096)
    yield arena
    arena.close()


def test_the_arena_allocates_aligned_regions_and_coalesces_what_is_freed(arena):
    a, b, c = (np.full((10,), i, np.float32) for i in range(3))  # 40 bytes: one 64-byte region each
    offsets = [arena.put(x) for x in (a, b, c)]
    assert offsets == [0, ALIGNMENT, 2 * ALIGNMENT]
    reader = ArenaReader()
    np.testing.assert_array_equal(reader.array(arena.name, offsets[1], (10,), "<f4"), b)
    arena.release(offsets[1], b.nbytes)
    arena.release(offsets[0], a.nbytes)
    assert arena._free[0] == (0, 2 * ALIGNMENT)  # the two freed neighbours are one region again
    arena.release(offsets[2], c.nbytes)
    assert arena._free == [(0, arena.size)] and arena.free_bytes == arena.size
    reader.close()


def test_a_full_arena_refuses_then_waits_for_a_release(arena):
    big = np.zeros(arena.size // 4, np.float32)  # the whole arena
    offset = arena.put(big)
    with pytest.raises(ArenaFull):
        arena.put(np.zeros(1, np.float32))

    async def scenario():
        waiting = asyncio.create_task(arena.put_when_free(np.zeros(4, np.float32), timeout_s=PATIENCE_S))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        arena.release(offset, big.nbytes)
        assert await waiting == 0
        with pytest.raises(asyncio.TimeoutError):
            await arena.put_when_free(big, timeout_s=0.01)

    asyncio.run(scenario())


def test_an_arena_takes_no_more_than_its_share_of_dev_shm(tmp_path):
    arena = TensorArena.create(2**40)  # a terabyte asked for
    try:
        stats = os.statvfs("/dev/shm")
        assert arena.size <= stats.f_bavail * stats.f_frsize * 0.25 + ALIGNMENT
    finally:
        arena.close()


def test_segments_of_processes_that_are_gone_are_removed(tmp_path):
    import subprocess
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer runs
    for name in (f"vitserve-{gone.pid}-abcd", f"vitserve-{os.getpid()}-abcd", "vitserve-x-y", "other-1-2"):
        (tmp_path / name).write_bytes(b"")
    assert owner_pid(f"/vitserve-{os.getpid()}-ab12") == os.getpid() and owner_pid("other-1-2") is None
    assert remove_orphaned_segments(str(tmp_path)) == [f"vitserve-{gone.pid}-abcd"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["other-1-2", f"vitserve-{os.getpid()}-abcd",
                                                                 "vitserve-x-y"])


# --- a real engine process ---


def test_one_engine_for_the_cpu_one_per_named_gpu(tiny_onnx):
    assert engine_devices(settings_for(tiny_onnx), ["CPUExecutionProvider"]) == [None]
    gpu = settings_for(tiny_onnx, providers=["cuda", "cpu"], cuda_device_ids=[0, 1])
    assert engine_devices(gpu, ["CUDAExecutionProvider", "CPUExecutionProvider"]) == [0, 1]
    assert engine_devices(gpu, ["CPUExecutionProvider"]) == [None]  # a CPU-only build: one CPU engine


@pytest.fixture(scope="module")
def engine_settings(tiny_onnx):
    return settings_for(tiny_onnx, max_batch_size=8, max_queue_delay_ms=200, dispatch_when_idle=False,
                        max_queue_size=64, engine_timeout_s=2.0)


@pytest.fixture
def supervisor(engine_settings):
    with EngineSupervisor(engine_settings) as supervisor:
        yield supervisor


async def frontends(settings, supervisor, count: int) -> list[RemoteEngine]:
    engines = [RemoteEngine(settings.model_copy(update={"engine_addresses": supervisor.addresses}), ServiceMetrics())
               for _ in range(count)]
    for engine in engines:
        await engine.start()
    await until(lambda: all(e.ready for e in engines), "the engine ready for every frontend")
    return engines


def reference(tiny_onnx, pixels: np.ndarray):
    session = ort.InferenceSession(str(tiny_onnx), providers=["CPUExecutionProvider"])
    return session.run(["logits", "rollout"], {"pixel_values": pixels})


@pytest.mark.slow
def test_images_from_two_frontends_share_batches_and_get_their_own_results(engine_settings, supervisor, tiny_onnx):
    pixels = np.random.default_rng(0).normal(size=(6, 3, 16, 16)).astype(np.float32)
    logits, rollout = reference(tiny_onnx, pixels)

    async def scenario():
        a, b = await frontends(engine_settings, supervisor, 2)
        results = await asyncio.gather(*(engine.submit(engine.route(None), image, PATIENCE_S)
                                         for engine, image in zip([a, b] * 3, pixels)))
        await asyncio.gather(a.close(1), b.close(1))
        return results

    results = asyncio.run(scenario())
    for i, result in enumerate(results):
        np.testing.assert_allclose(result.output[0], logits[i], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(result.output[1], rollout[i], rtol=1e-5, atol=1e-6)
    assert max(r.batch_size for r in results) > 1  # the two frontends' images ran together
    assert all(r.queue_s >= 0 and r.inference_s > 0 for r in results)


def test_engine_errors_reach_their_caller_and_cancelled_images_free_their_memory(engine_settings, supervisor):
    async def scenario():
        (frontend,) = await frontends(engine_settings, supervisor, 1)
        image = np.zeros((3, 16, 16), np.float32)
        with pytest.raises(DeadlineExceeded):  # queued for 200 ms (no company) with 50 ms left
            await frontend.submit(frontend.route(None), image, 0.05)
        waiting = asyncio.create_task(frontend.submit(frontend.route(None), image, PATIENCE_S))
        await asyncio.sleep(0.05)
        waiting.cancel()
        await until(lambda: frontend.arena.free_bytes == frontend.arena.size, "the cancelled image's region freed")
        assert (await frontend.submit(frontend.route(None), image, PATIENCE_S)).output[0].shape == (3,)
        await frontend.close(1)

    asyncio.run(scenario())


@pytest.mark.slow
def test_a_killed_engine_fails_its_requests_at_once_and_its_restart_serves_again(engine_settings, supervisor):
    async def scenario():
        (frontend,) = await frontends(engine_settings, supervisor, 1)
        image = np.zeros((3, 16, 16), np.float32)
        held = asyncio.create_task(frontend.submit(frontend.route(None), image, PATIENCE_S))  # queued for 200 ms
        await asyncio.sleep(0.05)
        os.kill(supervisor._engines[0].process.pid, signal.SIGKILL)
        with pytest.raises(NotReady, match="restarted|stopped responding"):
            await held
        await until(lambda: frontend.ready, "the restarted engine ready")
        assert (await frontend.submit(frontend.route(None), image, PATIENCE_S)).output[0].shape == (3,)
        assert supervisor._engines[0].restarts == 1
        await frontend.close(1)

    asyncio.run(scenario())


@pytest.mark.slow
def test_an_engine_restarted_after_it_went_silent_is_a_restart_and_its_frontends_serve_again(engine_settings):
    # The new engine loads its models for longer than engine_timeout_s, so the frontend first gives up on the silent
    # one; the new engine's first status must still be taken as a restart, whose routing generations count from 0
    # again: before, a frontend that had seen model changes (a higher generation) threw every new index away as
    # older, and stayed not ready for good.
    settings = engine_settings.model_copy(update={"engine_timeout_s": 0.4})

    async def scenario(supervisor):
        (frontend,) = await frontends(settings, supervisor, 1)
        frontend._index = msgspec.structs.replace(frontend._index, generation=frontend._index.generation + 5)
        os.kill(supervisor._engines[0].process.pid, signal.SIGKILL)
        await until(lambda: not frontend.ready, "the frontend giving up on the silent engine")
        await until(lambda: frontend.ready, "the restarted engine ready")
        image = np.zeros((3, 16, 16), np.float32)
        assert (await frontend.submit(frontend.route(None), image, PATIENCE_S)).output[0].shape == (3,)
        await frontend.close(1)

    with EngineSupervisor(settings) as supervisor:
        asyncio.run(scenario(supervisor))


def test_a_model_that_does_not_load_stops_the_supervisor(tmp_path, engine_settings):
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(engine_settings.model_path.read_bytes()[:2000])
    with pytest.raises(ModelLoadError):
        EngineSupervisor(engine_settings.model_copy(update={"model_path": broken})).start()


def test_a_message_the_engine_cannot_read_is_dropped_and_the_next_ones_are_taken(caplog):
    # one unreadable frame (a frontend of another version) ended the engine's receive loop: it still said it was
    # ready, and every request after it waited out its deadline
    from types import SimpleNamespace

    from vitserve.service.engine.server import EngineServer
    server = EngineServer(SimpleNamespace(settings=Settings()), "ipc://unused")
    server._take_all([b"frontend", b"\xff not a message", Codec().encode([Cancel(7)])], router=None)
    assert server.work_arrived.is_set()  # the Cancel after it was taken
    assert "could not be read" in caplog.text


@pytest.mark.anyio
@pytest.mark.slow
async def test_an_idle_engine_publishes_its_status_seldom_and_soon_after_work_arrives():
    # 50 statuses a second woke every HTTP worker of an idle server; while there is work they still come every
    # STATUS_INTERVAL_S, since a frontend counts what it sent since the last one as queued
    from types import SimpleNamespace

    from vitserve.service.engine.server import IDLE_STATUS_INTERVAL_S, STATUS_INTERVAL_S, EngineServer
    server = EngineServer(SimpleNamespace(settings=Settings(engine_timeout_s=40.0)), "ipc://unused")
    sent: list[float] = []

    async def record(publisher):
        sent.append(asyncio.get_running_loop().time())

    server._send_status = record
    publishing = asyncio.create_task(server._publish(None))
    try:
        await asyncio.sleep(0.3)
        assert 1 <= len(sent) <= 3  # at start, then idle (every interval: 15)
        before, arrived = len(sent), asyncio.get_running_loop().time()
        server.work_arrived.set()  # what _receive does with a frontend's message
        await until(lambda: len(sent) > before, "a status after work arrived")
        assert sent[before] - arrived < IDLE_STATUS_INTERVAL_S / 2
        server.running[(b"frontend", 1)] = publishing  # work in flight: a status every interval
        await asyncio.sleep(20 * STATUS_INTERVAL_S)
        assert len(sent) - before >= 5
        del server.running[(b"frontend", 1)]
        await asyncio.sleep(0.1)
        idle_from = len(sent)
        await asyncio.sleep(2.5 * IDLE_STATUS_INTERVAL_S)
        assert 2 <= len(sent) - idle_from <= 4  # still a heartbeat: frontends give up on a silent engine
    finally:
        publishing.cancel()


@pytest.mark.anyio
async def test_the_answers_of_one_turn_go_to_each_frontend_as_one_message_of_one_frame():
    # a batch's answers finish together: one message per frontend wakes it once, not once per image, and one frame
    # (pyzmq's calls per frame cost as much as the rest of an image's answer)
    from types import SimpleNamespace

    from vitserve.service.engine.messages import Codec, Failure, Result, Tensor
    from vitserve.service.engine.server import EngineServer
    server = EngineServer(SimpleNamespace(settings=Settings()), "ipc://unused")
    quiet, unused = os.pipe()
    sent: list[list[bytes]] = []
    reads: list[int] = []  # len(sent) each time the engine asked the socket for its events

    class Router:
        def send_multipart(self, frames, flags=0):
            sent.append(frames)

        def getsockopt(self, option):
            reads.append(len(sent))
            return 0  # nothing to receive

        def fileno(self):
            return quiet  # a descriptor that never fires: the test calls the engine itself

    router, codec = Router(), Codec()
    server.listen(router)
    answers = {b"a": [Result(1, [Tensor((2,), b"\0" * 8)], 0.1, 0.2, 3), Failure(2, "deadline_exceeded", "late")],
               b"b": [Result(7, [], 0.0, 0.0, 1)]}
    for frontend, replies in answers.items():
        for reply in replies:
            server._answer(router, frontend, reply)
    assert sent == []  # at the end of the turn
    await asyncio.sleep(0)
    assert sorted(frames[0] for frames in sent) == [b"a", b"b"]
    for frames in sent:
        assert len(frames) == 2 and codec.from_engine.decode(frames[1]) == answers[frames[0]]  # one frame
    server._answer(router, b"a", Failure(3, "deadline_exceeded", "late"))
    await asyncio.sleep(0)
    assert len(sent) == 3 and len(sent[2]) == 2  # the next turn's answer: a message of its own
    await asyncio.sleep(0)
    # after each turn's sends the socket is read again: a send may take the edge a receive waits for
    assert reads == [0, 2, 3]  # (the first when it started listening)
    server.reader.stop()
    os.close(quiet)
    os.close(unused)


def test_an_answer_that_cannot_be_encoded_fails_alone_and_the_turns_other_answers_arrive(caplog):
    # a turn's answers are encoded together: a bug in one (a report holding what msgpack cannot write) must not cost
    # the images answered beside it
    from types import SimpleNamespace

    from vitserve.service.engine.server import EngineServer
    server, codec = EngineServer(SimpleNamespace(settings=Settings()), "ipc://unused"), Codec()
    index = RepositoryIndex(1, [], [], {})
    result = Result(1, [Tensor((2,), b"\0" * 8)], 0.1, 0.2, 2)
    answers = codec.from_engine.decode(server._encoded([result, ControlReply(2, index, report={"x": object()})]))
    assert answers == [result, Failure(2, "internal_error", "the engine's answer could not be encoded")]
    assert "could not be encoded together" in caplog.text


@pytest.mark.anyio
async def test_the_engine_reads_every_message_of_many_frontends_while_it_answers(tmp_path):
    # ZeroMQ's descriptor is edge-triggered and a send may take the edge a receive waits for: interleaved bursts
    # from several frontends, answered as they come, must all be read and answered, none left waiting
    import random
    from types import SimpleNamespace

    import zmq
    import zmq.asyncio

    from vitserve.service.engine.messages import Codec, Failure
    from vitserve.service.engine.server import EngineServer
    server = EngineServer(SimpleNamespace(settings=Settings()), "unused")
    server._take = lambda frontend, message, router: server._answer(  # an echo in place of the engine
        router, frontend, Failure(message.id, "echo", ""))
    address = f"ipc://{tmp_path}/engine.sock"
    plain, context, codec = zmq.Context(), zmq.asyncio.Context(), Codec()
    router = plain.socket(zmq.ROUTER)
    router.setsockopt(zmq.SNDHWM, 0)
    router.bind(address)
    reader = server.listen(router)
    rng = random.Random(3)

    async def frontend(number: int) -> set[int]:
        dealer = context.socket(zmq.DEALER)
        dealer.connect(address)
        ids = list(range(number * 100_000, number * 100_000 + 3_000))
        answered: set[int] = set()

        async def receive() -> None:
            while len(answered) < len(ids):
                answered.update(answer.id for frame in await dealer.recv_multipart()
                                for answer in codec.from_engine.decode(frame))

        receiving = asyncio.ensure_future(receive())
        for start in range(0, len(ids), 50):
            burst = ids[start:start + 50]
            cut = rng.randrange(1, len(burst) + 1)  # a turn of many messages, then the rest one by one
            await dealer.send(codec.encode([Cancel(i) for i in burst[:cut]]))
            for i in burst[cut:]:
                await dealer.send(codec.encode([Cancel(i)]))
            if rng.random() < 0.3:
                await asyncio.sleep(0)
        await asyncio.wait_for(receiving, 30)
        dealer.close(linger=0)
        return answered

    try:
        results = await asyncio.gather(*(frontend(n) for n in range(3)))
        assert [len(r) for r in results] == [3_000] * 3
    finally:
        reader.stop()
        context.destroy(linger=0)
        plain.destroy(linger=0)
