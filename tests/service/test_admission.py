"""Admission and the request's life: in-flight caps and predicted wait (429 before the body is read), the pixel
budget, the whole-request deadline (504; 408 for a slow upload), hang-ups (499), and the batcher's fairness."""
from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref

import numpy as np
import pytest
from starlette.requests import Request

from vitserve.service.usecases.admission import Admission, CompletionRate, PixelBudget
from vitserve.service.ground.deadlines import Deadline, StopSignal, run_within
from vitserve.service.ground.memory import collect_cycles, freeze_startup_objects, return_large_frees_to_the_os
from vitserve.service.engine.batcher import DynamicBatcher
from vitserve.service.ground.errors import ClientDisconnected, DeadlineExceeded, NotReady, Overloaded, RequestTimeout
from vitserve.service.http.routes.uploads import read_raw_body
from vitserve.service.ground.settings import Settings
from service_fixtures import (PATIENCE_S, WrappedModel, assert_error, classify, image_bytes, only_batcher,
                              run_as_call, serving, settings_for, until)

pytestmark = pytest.mark.anyio


def test_admission_caps_requests_in_flight_and_predicted_wait():
    admission = Admission(max_in_flight=2)
    admission.enter(0.0, 10.0)
    admission.enter(9.9, 10.0)
    with pytest.raises(Overloaded, match="2 requests in flight"):
        admission.enter(0.0, 10.0)
    admission.leave()
    with pytest.raises(Overloaded, match=r"about 12.00 s, more than this server waits \(10.00 s\)"):
        admission.enter(12.0, 10.0)
    assert admission.in_flight == 1


def test_the_queue_wait_admission_accepts_is_the_deadline_or_a_tighter_objective():
    assert Settings(request_timeout_ms=10_000).queue_wait_limit_s == 10.0
    assert Settings(request_timeout_ms=10_000, max_queue_wait_ms=300).queue_wait_limit_s == 0.3
    assert Settings(request_timeout_ms=200, max_queue_wait_ms=300).queue_wait_limit_s == 0.2


async def test_pixel_budget_makes_a_request_wait_until_its_pixels_fit():
    assert await PixelBudget(100).acquire(500) == 100  # more than the whole budget: clamped, never stuck
    budget = PixelBudget(100)
    assert await budget.acquire(70) == 70
    waiting = asyncio.ensure_future(budget.acquire(40))
    await asyncio.sleep(0)
    assert not waiting.done() and budget.used == 70
    budget.release(70)
    assert await asyncio.wait_for(waiting, 5) == 40 and budget.used == 40


async def test_a_decode_thread_reserves_at_once_only_what_fits_with_nobody_waiting():
    budget = PixelBudget(100)
    assert await asyncio.to_thread(budget.try_reserve, 60) == 60 and budget.used == 60
    assert budget.try_reserve(50) is None and budget.used == 60  # does not fit: the request waits on the loop
    waiting = asyncio.ensure_future(budget.acquire(50))
    await asyncio.sleep(0.01)
    assert budget.try_reserve(10) is None  # fits, but someone waits: no overtaking
    budget.release(60)
    assert await asyncio.wait_for(waiting, 5) == 50
    assert budget.try_reserve(500) is None  # clamped to the whole budget, which does not fit beside the 50
    budget.release(50)
    assert budget.try_reserve(500) == 100 and budget.used == 100  # an image over the budget is never stuck
    budget.release(100)
    assert budget.used == 0


async def test_a_cancelled_wait_for_pixels_leaves_the_budget_as_it_was():
    budget = PixelBudget(10)
    await budget.acquire(10)
    waiting = asyncio.ensure_future(budget.acquire(5))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    budget.release(10)
    assert budget.used == 0 and await budget.acquire(10) == 10


class _Connected:
    """A request whose client never disconnects."""

    async def receive(self):
        await asyncio.Event().wait()


async def _forever(cancelled: asyncio.Event):
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        cancelled.set()
        raise


async def test_guarded_work_past_its_deadline_is_cancelled():
    cancelled = asyncio.Event()
    with pytest.raises(DeadlineExceeded):
        await run_as_call(_Connected(), _forever(cancelled), Deadline.after(0.05), StopSignal())
    await asyncio.wait_for(cancelled.wait(), 5)
    with pytest.raises(RequestTimeout):
        await run_as_call(_Connected(), _forever(asyncio.Event()), Deadline.after(0.01), StopSignal(),
                          watch=False, on_timeout=RequestTimeout("slow upload"))


async def test_guarded_work_is_answered_not_ready_when_the_drain_runs_out():
    stop, cancelled = StopSignal(), asyncio.Event()
    work = asyncio.ensure_future(run_as_call(_Connected(), _forever(cancelled), Deadline.after(60), stop))
    await asyncio.sleep(0)
    stop.set()
    with pytest.raises(NotReady, match="shut down"):
        await asyncio.wait_for(work, 5)
    await asyncio.wait_for(cancelled.wait(), 5)



async def test_the_guard_leaves_no_timer_callback_or_task_behind_and_passes_an_outside_cancellation_on():
    stop = StopSignal()

    async def quick():
        await asyncio.sleep(0)
        return 7

    assert await run_within(quick(), Deadline.after(0.05), stop) == 7
    assert not stop._callbacks
    await asyncio.sleep(0.1)  # past the deadline: its timer was cancelled, so nothing cancels this task now
    assert asyncio.current_task().cancelling() == 0

    # Someone else cancels the request's task (uvicorn at shutdown): that is a cancellation, not a 504 or 503.
    cancelled = asyncio.Event()
    guarded = asyncio.ensure_future(run_within(_forever(cancelled), Deadline.after(60), stop))
    await asyncio.sleep(0)
    guarded.cancel()
    with pytest.raises(asyncio.CancelledError):
        await guarded
    assert cancelled.is_set() and not stop._callbacks


async def test_the_guard_refuses_at_once_once_the_drain_has_run_out_and_the_work_never_starts():
    stop, started = StopSignal(), []
    stop.set()

    async def work():
        started.append(True)

    with pytest.raises(NotReady, match="shut down"):
        await run_within(work(), Deadline.after(60), stop)
    assert started == []


async def test_work_that_swallows_its_cancellation_keeps_its_answer_and_the_task_is_not_left_cancelled():
    async def stubborn():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            return "finished anyway"

    assert await run_within(stubborn(), Deadline.after(0.02), StopSignal()) == "finished anyway"
    assert asyncio.current_task().cancelling() == 0
    await asyncio.sleep(0)  # no cancellation left pending on this task

async def test_a_hang_up_mid_upload_is_client_disconnected():
    messages = [{"type": "http.request", "body": b"x" * 10, "more_body": True}, {"type": "http.disconnect"}]

    async def receive():
        return messages.pop(0)

    request = Request({"type": "http", "method": "POST", "headers": []}, receive)
    with pytest.raises(ClientDisconnected, match="after 10 bytes"):
        await read_raw_body(request, 1000)


async def test_past_the_in_flight_cap_a_request_gets_429_before_its_body_is_read(tiny_onnx, tiny_model):
    model = WrappedModel(tiny_model)
    settings = settings_for(tiny_onnx, max_requests_in_flight=1, retry_after_s=3)
    async with serving(settings, model) as client:
        model.hold()
        first = asyncio.ensure_future(classify(client, image_bytes("PNG")))
        await until(lambda: model.entered == [1], "the first request in the model")
        read = asyncio.Event()

        async def body():  # a body the server never asks for: refused from the headers alone
            read.set()
            yield image_bytes("PNG")

        refused = await client.post("/v1/classify", content=body(), headers={"content-type": "image/png"})
        assert_error(refused, 429, "overloaded")
        assert refused.headers["retry-after"] == "3" and not read.is_set()
        model.release()
        assert (await first).status_code == 200
        assert (await classify(client, image_bytes("PNG"))).status_code == 200  # admitted again


async def test_the_deadline_covers_inference_too(tiny_onnx, tiny_model):
    model = WrappedModel(tiny_model)
    settings = settings_for(tiny_onnx, request_timeout_ms=300)
    async with serving(settings, model) as client:
        model.hold()  # the model never finishes this request's batch in time
        late = await classify(client, image_bytes("PNG"))
        assert_error(late, 504, "deadline_exceeded")
        assert not model.gate.is_set()  # answered at the deadline, not when the model finished
        model.release()
        assert (await classify(client, image_bytes("PNG"))).status_code == 200


async def test_a_slow_upload_is_408(tiny_onnx, tiny_model):
    settings = settings_for(tiny_onnx, request_timeout_ms=200)
    async with serving(settings, tiny_model) as client:
        never = asyncio.Event()

        async def stalled_body():
            yield image_bytes("PNG")[:10]
            await never.wait()  # the client stops sending: the server must not wait for it
            yield b""

        response = await client.post("/v1/classify", content=stalled_body(), headers={"content-type": "image/png"})
        assert_error(response, 408, "request_timeout")
        assert response.headers["connection"] == "close"


async def test_a_chunked_multipart_body_over_the_limit_is_413(tiny_onnx, tiny_model):
    settings = settings_for(tiny_onnx, max_upload_bytes=1000, max_batch_files=2)
    async with serving(settings, tiny_model) as client:
        async def endless_part():  # no Content-Length: counted as it streams
            yield b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.png\"\r\n" \
                  b"Content-Type: image/png\r\n\r\n"
            for _ in range(1000):
                yield b"\0" * 1024

        response = await client.post("/v1/classify/batch", content=endless_part(),
                                     headers={"content-type": "multipart/form-data; boundary=b"})
        assert_error(response, 413, "payload_too_large")


async def test_a_burst_of_large_inputs_does_not_starve_a_small_one():
    """Six large items queued first, then one small: the small one runs after at most the large batch in
    flight, not after all six (the cost cap makes each large batch one item)."""
    order: list[int] = []
    gate = threading.Event()

    def run_batch(stacked: np.ndarray, targets=None):
        gate.wait(10)
        order.extend(int(x.size) for x in stacked)
        return [x.size for x in stacked]

    batcher = DynamicBatcher(run_batch, max_batch_size=8, max_queue_delay_s=0.0, max_queue_size=100,
                             max_batches_in_flight=1, max_batch_cost=64)
    batcher.start()
    large = [asyncio.ensure_future(batcher.submit(np.zeros((1, 16, 16), np.float32), 30)) for _ in range(6)]
    await until(lambda: batcher.queued == 5, "one large batch running (held by the gate)")
    small = asyncio.ensure_future(batcher.submit(np.zeros((1, 4, 4), np.float32), 30))
    await until(lambda: batcher.queued == 6, "the small item queued")
    gate.set()
    await asyncio.wait_for(asyncio.gather(small, *large), PATIENCE_S)
    assert order == [256, 16, 256, 256, 256, 256, 256]
    assert batcher.predicted_wait_s() == 0.0 and batcher.predicted_wait_s(100) > 0  # measured, nothing queued
    await batcher.close()


async def test_a_loop_running_behind_refuses_new_requests():
    admission = Admission(max_in_flight=10, max_loop_lag_s=0.02)
    admission.loop_lag.start()
    try:
        assert admission.refusal(0.0, 10.0) is None
        admission.enter(0.0, 10.0)  # a request in flight: the loop is watched closely
        time.sleep(0.1)  # the loop is blocked: its timer fires at least this late
        await until(lambda: admission.loop_lag.lag_s > 0.02, "the lag measured")
        assert "ms behind on its connections" in str(admission.refusal(0.0, 10.0))
    finally:
        admission.loop_lag.stop()


async def test_an_idle_process_looks_at_its_loop_seldom_and_closely_once_a_request_is_in():
    admission = Admission(max_in_flight=10, max_loop_lag_s=0.02)
    lag = admission.loop_lag
    lag.start()
    try:
        assert lag.next_look_in() > 0.05  # idle: the next look is idle_interval_s (0.1 s) away
        admission.enter(0.0, 10.0)
        assert lag.busy and lag.next_look_in() <= lag.interval_s  # brought forward
        admission.enter(0.0, 10.0)
        admission.leave()
        assert lag.busy  # one still in flight
        admission.leave()
        assert not lag.busy
        await until(lambda: lag.next_look_in() > 0.05, "back to the idle interval")
    finally:
        lag.stop()


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_completion_rate_counts_busy_time_only():
    rate = CompletionRate()
    assert rate.per_s() is None
    rate.busy(0.0)
    for t in (0.01, 0.02, 0.03):
        rate.completed(t, still_busy=True)
    rate.completed(0.04, still_busy=False)
    assert rate.per_s() == pytest.approx(100.0)
    rate.busy(60.0)  # a minute idle, then a request that takes 10 ms: still 100 per second
    rate.completed(60.01, still_busy=False)
    assert rate.per_s() == pytest.approx(100.0)


def test_once_it_refuses_a_process_admits_only_what_it_finishes_in_the_overload_queue():
    clock = FakeClock()
    admission = Admission(max_in_flight=64, overload_queue_s=0.05, clock=clock)
    for _ in range(64):  # a process finishing 100 requests per second, full
        admission.enter(0.0, 10.0)
    for _ in range(20):
        clock.now += 0.01
        admission.leave()
        admission.enter(0.0, 10.0)
    assert admission.completions.per_s() == pytest.approx(100.0)
    assert admission.in_flight_limit(clock.now) == 64  # refused nothing yet: the limit is the whole process's
    assert "the limit of this process" in str(admission.refusal(0.0, 10.0))
    # Shedding now: 100/s x 50 ms = 5 admitted at once, however many the process may hold
    assert admission.in_flight_limit(clock.now) == 5
    while admission.in_flight > 5:
        clock.now += 0.01
        admission.leave()
        with pytest.raises(Overloaded, match="all it can finish soon under load"):
            admission.enter(0.0, 10.0)
    clock.now += 0.01
    admission.leave()
    admission.enter(0.0, 10.0)  # 4 in flight: one more fits
    # A second after the last refusal the process takes its full share again
    clock.now += Admission.SHEDDING_HOLD_S
    assert admission.in_flight_limit(clock.now) == 64
    for _ in range(59):
        admission.enter(0.0, 10.0)
    assert admission.in_flight == 64


def test_shedding_still_admits_the_process_s_share_of_the_engine_s_batches():
    """Small batches cost the engine more per image: shedding below a batch's worth starves it (goodput lost)."""
    clock = FakeClock()
    admission = Admission(max_in_flight=64, overload_queue_s=0.05, clock=clock, min_shed_in_flight=16)
    for _ in range(64):
        admission.enter(0.0, 10.0)
    for _ in range(20):  # 100 requests per second: 5 would be the overload queue's worth
        clock.now += 0.01
        admission.leave()
        admission.enter(0.0, 10.0)
    assert admission.refusal(0.0, 10.0) is not None  # full: shedding from now
    assert admission.in_flight_limit(clock.now) == 16


def test_a_server_s_batch_share_is_its_engine_s_batches_over_its_workers(tiny_onnx):
    from vitserve.service.usecases.state import shedding_floor
    from service_fixtures import settings_for

    def limit(**overrides) -> int:
        return shedding_floor(settings_for(tiny_onnx, **{"degrade_under_load": False, **overrides}))

    assert limit(max_batch_size=16, max_batches_in_flight=2, workers=2) == 16
    # degrading under load: budget_queue_batches more, the backlog past which the engine answers cheaper
    assert limit(max_batch_size=16, max_batches_in_flight=2, workers=2, degrade_under_load=True) == 32
    assert limit(max_batch_size=16, max_batches_in_flight=2, workers=2, degrade_under_load=True,
                 budget_queue_batches=1) == 24
    # a light model inline does not degrade: its refusals keep the short queue
    assert limit(max_batch_size=16, max_batches_in_flight=2, workers=2, degrade_under_load=True,
                 engine="inline") == 32
    assert limit(max_batch_size=16, max_batches_in_flight=2, workers=3) == 11
    assert limit(max_batch_size=16, max_batches_in_flight=2, workers=2, overload_keeps_batches=False) == 0
    # a session in each worker: its batches are all its own
    assert limit(max_batch_size=16, max_batches_in_flight=2, workers=2, engine="inline") == 32
    # two batches at once: one more batch in flight, so that both runners have one while shedding
    assert limit(max_batch_size=16, max_batches_in_flight=2, workers=2, batch_runners=2) == 24


def test_a_closed_loop_within_the_limit_is_never_refused_and_keeps_the_full_limit():
    clock = FakeClock()
    admission = Admission(max_in_flight=64, overload_queue_s=0.02, clock=clock)
    for _ in range(32):
        admission.enter(0.0, 10.0)
    for _ in range(1000):  # each client sends its next request as its answer comes
        clock.now += 0.004
        admission.leave()
        admission.enter(0.0, 10.0)
    assert admission.in_flight == 32 and admission.in_flight_limit(clock.now) == 64


async def test_a_refusal_for_the_loop_s_lag_does_not_lower_the_limit():
    admission = Admission(max_in_flight=64, max_loop_lag_s=0.02, overload_queue_s=0.02)
    admission.enter(0.0, 10.0)
    admission.leave()
    admission.loop_lag.lag_s = 0.5  # a stall, as test_a_loop_running_behind_refuses_new_requests measures one
    assert "behind on its connections" in str(admission.refusal(0.0, 10.0))
    assert admission.in_flight_limit(time.perf_counter()) == 64


def test_without_an_overload_queue_the_limit_stays_the_process_s():
    clock = FakeClock()
    admission = Admission(max_in_flight=3, clock=clock)
    for _ in range(3):
        admission.enter(0.0, 10.0)
    clock.now += 0.01
    admission.leave()
    admission.enter(0.0, 10.0)
    assert admission.refusal(0.0, 10.0) is not None and admission.in_flight_limit(clock.now) == 3


def test_large_frees_go_back_to_the_os_on_glibc():
    import platform
    assert return_large_frees_to_the_os() == (platform.libc_ver()[0] == "glibc")


class Node:
    def __init__(self):
        self.other = None


@pytest.mark.slow
def test_frozen_startup_objects_are_left_out_of_collections_until_collect_cycles():
    try:
        cycle = Node()
        cycle.other = Node()
        cycle.other.other = cycle  # freed by the cyclic collector only
        alive = weakref.ref(cycle)
        freeze_startup_objects()
        assert gc.get_freeze_count() > 0
        del cycle
        gc.collect()
        assert alive() is not None  # frozen: a full collection does not walk it
        collect_cycles()  # what an unloaded model's session goes through
        assert alive() is None
        assert gc.get_freeze_count() > 0  # the survivors frozen again
    finally:
        gc.unfreeze()


@pytest.mark.slow
def test_startup_garbage_is_collected_before_the_freeze():
    try:
        cycle = Node()
        cycle.other = cycle
        alive = weakref.ref(cycle)
        del cycle  # garbage, not yet collected
        freeze_startup_objects()
        assert alive() is None
    finally:
        gc.unfreeze()


@pytest.mark.slow
async def test_a_lone_request_runs_its_batch_on_the_event_loop_and_others_on_the_runner(tiny_onnx, tiny_model):
    """Alone in its process, a light model's batch of one runs where its request is (the batcher's module doc):
    no hop to the runner thread and back. A request of several images, and images that arrive together, go to the
    runner, where they batch."""
    class ThreadRecording(WrappedModel):
        threads: list[int] = []

        def run(self, pixel_values):
            self.threads.append(threading.get_ident())
            return super().run(pixel_values)

    model, loop_thread = ThreadRecording(tiny_model), threading.get_ident()
    async with serving(settings_for(tiny_onnx, max_queue_delay_ms=50), model) as client:
        model.threads.clear()  # the warm-up's
        for _ in range(3):
            assert (await classify(client, image_bytes("PNG"))).status_code == 200
        assert model.threads[0] != loop_thread and model.threads[1:] == [loop_thread] * 2  # once measured
        model.threads.clear()
        model.hold()
        shape = [2, model.info.channels, *model.info.image_size]
        pixels = {"name": "pixel_values", "datatype": "FP32", "shape": shape, "data": [0.5] * int(np.prod(shape))}
        pair = asyncio.ensure_future(client.post(f"/v2/models/{model.info.name}/infer", json={"inputs": [pixels]}))
        await until(lambda: model.entered == [2], "the two images in the model")
        behind = asyncio.ensure_future(classify(client, image_bytes("PNG")))
        await until(lambda: only_batcher(client.app).queued == 1, "a lone request queued behind them")
        model.release()
        assert (await pair).status_code == 200 and (await behind).status_code == 200
        assert len(model.threads) == 2 and loop_thread not in model.threads


def test_a_request_is_alone_only_as_its_process_s_only_request_from_its_only_client():
    admission = Admission(max_in_flight=10)
    assert admission.alone  # (an app served in-process: no transport counts connections)
    admission.count_connection(1)
    admission.enter(0.0, 1.0)
    assert admission.alone
    admission.count_connection(1)  # a second client, between its requests
    assert not admission.alone
    admission.count_connection(-1)
    admission.enter(0.0, 1.0)  # a second request on the one connection (HTTP/2, gRPC)
    assert not admission.alone
    admission.leave()
    assert admission.alone
