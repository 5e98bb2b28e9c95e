"""DynamicBatcher with a fake run_batch: grouping, limits, deadlines, cancellation, failure isolation, drain."""
from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from vitserve.service.engine import batcher as batcher_module
from vitserve.service.engine.batcher import DynamicBatcher
from vitserve.service.ground.errors import DeadlineExceeded, InferenceError, NotReady, QueueFullError
from service_fixtures import PATIENCE_S, until

pytestmark = pytest.mark.anyio


class Recorder:
    """run_batch that records every batch, echoes each item's first value, and can fail or block: while
    `gate` is clear, a batch waits in the runner after `started` has recorded it."""

    def __init__(self):
        self.started: list[list[float]] = []  # batches that entered run_batch, held at the gate or not
        self.targets: list[list[int] | None] = []  # each batch's targets (None: an untargeted batch)
        self.maps_free: list[bool] = []  # each batch: run as maps_free (every item maps_free)
        self.wide: list[bool] = []  # each batch: run wide (one image on every core)
        self.batches: list[list[float]] = []  # batches that ran
        self.threads: list[int] = []  # the thread each batch ran on
        self.fail_when = lambda values: False
        self.delay_s = 0.0  # each batch takes at least this long
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, stacked: np.ndarray, targets: np.ndarray | None = None, maps_free: bool = False,
                 wide: bool = False):
        values = [float(x.ravel()[0]) for x in stacked]
        self.threads.append(threading.get_ident())
        self.started.append(values)
        self.maps_free.append(maps_free)
        self.wide.append(wide)
        self.targets.append(None if targets is None else targets.tolist())
        if not self.gate.wait(PATIENCE_S):
            raise RuntimeError("the test never opened the gate")
        time.sleep(self.delay_s)
        self.batches.append(values)
        if self.fail_when(values):
            raise RuntimeError("boom")
        return [ValueError("bad item") if v < 0 else v * 10 for v in values]


def make(recorder, **overrides) -> DynamicBatcher:
    options = dict(max_batch_size=4, max_queue_delay_s=0.05, max_queue_size=100, max_batches_in_flight=1,
                   dispatch_when_idle=False)
    options.update(overrides)
    batcher = DynamicBatcher(recorder, **options)
    batcher.start()
    return batcher


def item(value: float, shape=(2, 2)) -> np.ndarray:
    return np.full(shape, value, np.float32)


async def test_concurrent_requests_share_batches_up_to_the_maximum():
    recorder = Recorder()
    batcher = make(recorder, max_queue_delay_s=0.5)
    results = await asyncio.gather(*(batcher.submit(item(i), 10) for i in range(10)))
    assert [r.output for r in results] == [i * 10 for i in range(10)]
    # ten queued at once, two batches' worth and more: a full batch; then six, between one batch and two: halves
    assert [len(b) for b in recorder.batches] == [4, 3, 3]
    assert all(r.batch_size in (3, 4) for r in results)
    await batcher.close()


async def test_a_lone_request_waits_about_the_delay_and_no_more():
    recorder = Recorder()
    batcher = make(recorder, max_queue_delay_s=0.2)
    result = await batcher.submit(item(1), 10)
    # The batcher dispatches on its own clock, never before the delay, so the lower bound is exact; above
    # it lies only an event-loop wake-up with nothing to compute, 1.8 s of slack.
    assert 0.15 <= result.queue_s < 2.0 and result.batch_size == 1
    await batcher.close()


async def test_an_idle_model_takes_a_lone_request_at_once_and_a_busy_one_batches():
    recorder = Recorder()
    batcher = make(recorder, max_queue_delay_s=5.0, dispatch_when_idle=True)
    lone = await asyncio.wait_for(batcher.submit(item(1), 10), PATIENCE_S)
    assert lone.batch_size == 1 and lone.queue_s < 2  # not the 5 s delay: nothing else runs
    recorder.gate.clear()
    first = asyncio.ensure_future(batcher.submit(item(2), 10))  # runs at once, then blocks in the model
    await until(lambda: recorder.started == [[1.0], [2.0]], "the second batch running")
    waiting = [asyncio.ensure_future(batcher.submit(item(i), 10)) for i in (3, 4, 5)]
    await until(lambda: batcher.queued == 3, "three items queued behind the running batch")
    recorder.gate.set()  # the model frees up: the three queued meanwhile go together, long before 5 s
    results = await asyncio.wait_for(asyncio.gather(first, *waiting), PATIENCE_S)
    assert [r.batch_size for r in results] == [1, 3, 3, 3]
    assert all(r.queue_s < 2 for r in results[1:])  # dispatched when the model freed up, not after the delay
    assert recorder.batches == [[1.0], [2.0], [3.0, 4.0, 5.0]]
    await batcher.close()


async def test_a_batch_that_is_not_full_stays_open_while_another_runs_and_a_full_one_waits_behind_it():
    """With two batches in flight, the second used to close after the delay and queue for the runner while later
    arrivals missed it: an 8-client loop then split for good into half batches taking turns."""
    recorder = Recorder()
    batcher = make(recorder, max_queue_delay_s=0.01, dispatch_when_idle=True, max_batches_in_flight=2)
    recorder.gate.clear()
    first = asyncio.ensure_future(batcher.submit(item(1), 10))  # runs at once, then blocks in the model
    await until(lambda: recorder.started == [[1.0]], "the first batch running")
    waiting = []
    for value in (2, 3, 4):  # each arrives long after the one before has waited its 10 ms delay
        waiting.append(asyncio.ensure_future(batcher.submit(item(value), 10)))
        await asyncio.sleep(0.05)
    assert batcher.queued == 3  # still open: none taken while the runner is busy
    full = [asyncio.ensure_future(batcher.submit(item(v), 10)) for v in (5, 6, 7, 8)]  # 4, 5 ... fill one batch
    # seven queued, more than a batch and less than two: its first half taken to wait behind the running one
    await until(lambda: batcher.queued == 4, "a full batch taken to wait behind the running one")
    recorder.gate.set()
    results = await asyncio.wait_for(asyncio.gather(first, *waiting, *full), PATIENCE_S)
    assert recorder.batches == [[1.0], [2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]]
    assert [r.batch_size for r in results] == [1, 3, 3, 3, 4, 4, 4, 4]
    await batcher.close()


async def test_more_than_a_batch_and_less_than_two_go_as_halves_and_a_backlog_as_full_batches():
    """Seventeen clients of one process ran as 16 and the 17th a whole batch later, turn after turn."""
    for queued, batches in ((5, [2, 3]), (7, [3, 4]), (8, [4, 4]), (9, [4, 2, 3]), (4, [4]), (3, [3])):
        recorder = Recorder()
        batcher = make(recorder, max_queue_delay_s=0.2, dispatch_when_idle=True, max_batches_in_flight=2)
        recorder.gate.clear()
        first = asyncio.ensure_future(batcher.submit(item(0), 10))  # runs alone, then blocks in the model
        await until(lambda: recorder.started == [[0.0]], "the first batch running")
        rest = [asyncio.ensure_future(batcher.submit(item(v), 10)) for v in range(1, queued + 1)]
        await asyncio.sleep(0.05)
        recorder.gate.set()
        await asyncio.wait_for(asyncio.gather(first, *rest), PATIENCE_S)
        assert [len(b) for b in recorder.batches[1:]] == batches, queued
        assert sorted(v for b in recorder.batches for v in b) == list(range(queued + 1))  # in order, each once
        await batcher.close()


@pytest.mark.slow
async def test_an_idle_model_waits_for_the_clients_its_last_batch_answered_but_never_for_a_lone_client():
    """After a batch of 3, an idle model holds the first of its clients coming back until the other two arrive (not
    the first alone: that split a closed loop into groups taking turns); a lone client after a batch of one, or
    one whose company does not come within the queue delay, is not held longer than that."""
    recorder = Recorder()
    batcher = make(recorder, max_queue_delay_s=1.0, dispatch_when_idle=True, max_batches_in_flight=2)
    lone = await asyncio.wait_for(batcher.submit(item(1), 10), PATIENCE_S)
    assert lone.batch_size == 1 and lone.queue_s < 0.5  # the last batch had one image: at once
    recorder.gate.clear()
    first = asyncio.ensure_future(batcher.submit(item(2), 10))
    await until(lambda: len(recorder.started) == 2, "a batch running")
    group = [asyncio.ensure_future(batcher.submit(item(v), 10)) for v in (3, 4, 5)]
    await until(lambda: batcher.queued == 3, "three queued behind it")
    recorder.gate.set()
    await asyncio.wait_for(asyncio.gather(first, *group), PATIENCE_S)
    assert recorder.batches[-1] == [3.0, 4.0, 5.0]
    back = [asyncio.ensure_future(batcher.submit(item(6), 10))]
    await asyncio.sleep(0.05)
    assert batcher.queued == 1  # held: the last batch had three
    back += [asyncio.ensure_future(batcher.submit(item(v), 10)) for v in (7, 8)]
    results = await asyncio.wait_for(asyncio.gather(*back), PATIENCE_S)
    assert recorder.batches[-1] == [6.0, 7.0, 8.0] and all(r.queue_s < 0.9 for r in results)
    alone = await asyncio.wait_for(batcher.submit(item(9), 10), PATIENCE_S)  # nobody follows it
    assert alone.batch_size == 1 and 0.5 < alone.queue_s < 5  # held about the delay after the runner freed
    await batcher.close()


async def test_items_of_different_shapes_never_share_a_batch():
    recorder = Recorder()
    batcher = make(recorder, max_queue_delay_s=0.2)
    shapes = [(2, 2), (2, 3)] * 3
    await asyncio.gather(*(batcher.submit(item(i, s), 10) for i, s in enumerate(shapes)))
    assert sorted(sorted(b) for b in recorder.batches) == [[0, 2, 4], [1, 3, 5]]
    await batcher.close()


async def test_queue_full_is_rejected_at_once():
    recorder = Recorder()
    recorder.gate.clear()  # the first batch blocks in the runner
    batcher = make(recorder, max_batch_size=1, max_queue_delay_s=0, max_queue_size=2)
    first = asyncio.ensure_future(batcher.submit(item(0), 10))
    await until(lambda: recorder.started == [[0.0]], "the first batch running (blocked)")
    queued = [asyncio.ensure_future(batcher.submit(item(i), 10)) for i in (1, 2)]
    await until(lambda: batcher.queued == 2, "two items queued")
    with pytest.raises(QueueFullError, match="queue full"):
        await batcher.submit(item(3), 10)
    recorder.gate.set()
    assert [r.output for r in await asyncio.gather(first, *queued)] == [0, 10, 20]
    await batcher.close()


async def test_deadline_exceeded_items_never_run():
    recorder = Recorder()
    recorder.gate.clear()
    batcher = make(recorder, max_batch_size=1, max_queue_delay_s=0)
    running = asyncio.ensure_future(batcher.submit(item(1), 10))
    await until(lambda: recorder.started == [[1.0]], "the first batch running (blocked)")
    with pytest.raises(DeadlineExceeded):
        await batcher.submit(item(2), 0.1)  # queued behind the blocked batch past its deadline
    recorder.gate.set()
    assert (await running).output == 10
    # Had the expired item stayed queued, it would run before (or with) a later item of its shape.
    assert (await batcher.submit(item(3), 10)).output == 30
    assert recorder.batches == [[1.0], [3.0]]
    assert batcher.queued == 0
    await batcher.close()


async def test_a_cancelled_request_is_dropped_before_it_runs():
    recorder = Recorder()
    batcher = make(recorder, max_queue_delay_s=0.3)
    leaving = asyncio.ensure_future(batcher.submit(item(7), 10))
    staying = asyncio.ensure_future(batcher.submit(item(8), 10))
    await until(lambda: batcher.queued == 2, "both items queued")
    leaving.cancel()  # what the route does when the client disconnects
    assert (await staying).output == 80
    assert recorder.batches == [[8.0]]
    await batcher.close()


@pytest.mark.slow
async def test_a_bad_item_fails_alone_and_a_failed_batch_fails_only_itself():
    recorder = Recorder()
    recorder.fail_when = lambda values: 99.0 in values
    batcher = make(recorder, max_queue_delay_s=0.2)
    good, bad = await asyncio.gather(batcher.submit(item(1), 10), batcher.submit(item(-1), 10),
                                     return_exceptions=True)
    assert good.output == 10 and isinstance(bad, ValueError)
    failed = await asyncio.gather(batcher.submit(item(99), 10), batcher.submit(item(2), 10), return_exceptions=True)
    assert all(isinstance(f, InferenceError) for f in failed)
    assert (await batcher.submit(item(3), 10)).output == 30  # the next batch is fine
    await batcher.close()


async def test_close_drains_queued_items_and_then_refuses():
    recorder = Recorder()
    batcher = make(recorder, max_queue_delay_s=5.0)  # they would otherwise wait 5 s
    pending = [asyncio.ensure_future(batcher.submit(item(i), 10)) for i in range(3)]
    await until(lambda: batcher.queued == 3, "three items queued")
    await asyncio.wait_for(batcher.close(), PATIENCE_S)
    assert [p.result().output for p in pending] == [0, 10, 20]
    assert all(p.result().queue_s < 2 for p in pending)  # dispatched by close, not after the 5 s delay
    with pytest.raises(NotReady):
        await batcher.submit(item(1), 10)


async def test_observer_gets_plain_numbers():
    class Observer:
        def __init__(self):
            self.batches, self.depths, self.waits = [], [], []

        def batch_done(self, size, seconds, stack_seconds, targeted, maps_free=False):
            self.batches.append((size, targeted))

        def queue_wait(self, seconds):
            self.waits.append(seconds)

        def queue_depth(self, depth):
            self.depths.append(depth)

    observer = Observer()
    batcher = DynamicBatcher(Recorder(), max_batch_size=4, max_queue_delay_s=0.2, max_queue_size=10,
                             dispatch_when_idle=False, observer=observer)
    batcher.start()
    await asyncio.gather(*(batcher.submit(item(i), 10) for i in range(3)))
    assert observer.batches == [(3, False)] and max(observer.depths) == 3 and observer.depths[-1] == 0
    assert len(observer.waits) == 3 and all(0.1 < w < 5 for w in observer.waits)
    await batcher.close()


async def test_the_queue_depth_is_reported_once_per_loop_turn_and_follows_a_queue_behind_a_stuck_batch():
    class Depths:
        def __init__(self):
            self.depths = []

        def batch_done(self, *args, **kwargs):
            pass

        def queue_wait(self, seconds):
            pass

        def queue_depth(self, depth):
            self.depths.append(depth)

    recorder, observer = Recorder(), Depths()
    recorder.gate.clear()  # the first batch holds the runner
    batcher = DynamicBatcher(recorder, max_batch_size=1, max_queue_delay_s=0.0, max_queue_size=100,
                             max_batches_in_flight=1, observer=observer)
    batcher.start()
    first = batcher.enqueue(item(1), PATIENCE_S)
    await until(lambda: recorder.started == [[1.0]], "the first batch running (blocked)")
    observer.depths.clear()
    queued = [batcher.enqueue(item(v), PATIENCE_S) for v in (2, 3, 4)]  # in one turn
    await asyncio.sleep(0.05)
    assert observer.depths == [3]  # one report for the turn, not 1, 2, 3
    queued.append(batcher.enqueue(item(5), PATIENCE_S))
    await asyncio.sleep(0.05)
    assert observer.depths[-1] == 4  # the runner is still stuck: the gauge still follows the queue
    recorder.gate.set()
    assert [(await f).output for f in (first, *queued)] == [10, 20, 30, 40, 50]
    assert observer.depths[-1] == 0
    await batcher.close()


async def test_targeted_items_batch_apart_with_their_targets_and_their_own_limit():
    recorder = Recorder()
    batcher = make(recorder, max_queue_delay_s=0.5, max_targeted_batch_size=2)
    plain = [batcher.submit(item(i), 10) for i in range(3)]
    targeted = [batcher.submit(item(10 + i), 10, target=i - 1) for i in range(3)]
    results = await asyncio.gather(*plain, *targeted)
    assert [r.output for r in results] == [0, 10, 20, 100, 110, 120]
    runs = sorted(zip(recorder.batches, recorder.targets), key=lambda run: run[0])
    # three targeted, between one batch of theirs (2) and two: halves, the smaller first
    assert runs == [([0.0, 1.0, 2.0], None), ([10.0], [-1]), ([11.0, 12.0], [0, 1])]
    await batcher.close()


async def test_light_items_batch_apart_and_run_light_where_the_model_has_a_light_computation():
    """Apart: an item's answer must not depend on what its batch-mates asked for (the maps_free computation may round
    differently). A batcher without maps_free batches ignores the flag, and mixed items share batches."""
    recorder = Recorder()
    batcher = make(recorder, max_queue_delay_s=0.2, maps_free_batches=True)
    mixed = await asyncio.gather(*(batcher.submit(item(i), 10, maps_free=i % 2 == 0) for i in range(8)))
    assert sorted(r.batch_size for r in mixed) == [4] * 8
    runs = sorted(zip(recorder.batches, recorder.maps_free))
    assert runs == [([0.0, 2.0, 4.0, 6.0], True), ([1.0, 3.0, 5.0, 7.0], False)]
    await batcher.close()

    recorder = Recorder()
    batcher = make(recorder, max_queue_delay_s=0.2)  # one computation: maps_free means nothing
    mixed = await asyncio.gather(*(batcher.submit(item(i), 10, maps_free=i % 2 == 0) for i in range(8)))
    assert sorted(len(b) for b in recorder.batches) == [4, 4] and recorder.maps_free == [False, False]
    await batcher.close()


async def test_predicted_wait_counts_each_kind_at_its_own_speed():
    batcher = DynamicBatcher(lambda stacked, targets=None: list(stacked), max_batch_size=4, max_queue_delay_s=10,
                             max_queue_size=100, dispatch_when_idle=False)
    batcher._seconds_per_cost = {False: 0.001, True: 0.003}  # learnt from earlier batches
    batcher.start()
    waiting = [asyncio.ensure_future(batcher.submit(item(0), 10)),
               asyncio.ensure_future(batcher.submit(item(1), 10, target=2))]
    await until(lambda: batcher.queued == 2, "both queued")
    assert batcher.predicted_wait_s() == pytest.approx(4 * 0.001 + 4 * 0.003)  # a (2, 2) item costs 4 values
    assert batcher.seconds_per_cost * batcher.queued_cost == pytest.approx(batcher.predicted_wait_s())
    await batcher.close()
    await asyncio.gather(*waiting)


async def test_a_batch_that_cannot_be_assembled_fails_its_images_at_once(monkeypatch):
    # np.stack raising (a MemoryError for a large batch) ended the batch's task with its images unanswered: their
    # callers waited out their deadline
    import vitserve.service.engine.batcher as batcher_module

    def no_memory(arrays, *args, **kwargs):
        raise MemoryError("no room for the stacked batch")

    recorder = Recorder()
    batcher = make(recorder, max_queue_delay_s=0.2)
    monkeypatch.setattr(batcher_module.np, "stack", no_memory)
    started = asyncio.get_running_loop().time()
    results = await asyncio.gather(*(batcher.submit(item(i), PATIENCE_S) for i in range(3)), return_exceptions=True)
    assert all(isinstance(r, InferenceError) and "could not be assembled" in str(r) for r in results)
    assert asyncio.get_running_loop().time() - started < PATIENCE_S / 2  # answered, not timed out
    monkeypatch.undo()
    assert (await batcher.submit(item(7), PATIENCE_S)).output == 70  # and the batcher goes on
    await batcher.close()


async def test_the_dispatch_loop_outlives_a_failure_while_it_forms_a_batch():
    # an error there (a metric's observer) ended the loop for good, and stranded the images it had taken off the
    # queue: every later image queued, none ran, and the model refused everything once its queue was full
    class FailingOnce:
        failed = False

        def batch_done(self, *args, **kwargs):
            pass

        def queue_depth(self, depth):
            pass

        def queue_wait(self, seconds):
            if not self.failed:
                self.failed = True
                raise RuntimeError("a metric that failed once")

    batcher = DynamicBatcher(Recorder(), max_batch_size=4, max_queue_delay_s=0.01, max_queue_size=10,
                             dispatch_when_idle=False, observer=FailingOnce())
    batcher.start()
    answers = [await asyncio.wait_for(batcher.submit(item(i), PATIENCE_S), PATIENCE_S) for i in (1, 2)]
    assert [a.output for a in answers] == [10, 20]  # the image taken when it failed too
    await batcher.close()


async def test_a_lone_image_runs_on_the_event_loop_once_its_batch_of_one_is_measured_fast():
    recorder, waits_fail = Recorder(), threading.Event()

    class Observer(batcher_module._NullObserver):
        def queue_wait(self, seconds):
            if waits_fail.is_set():
                raise RuntimeError("the metric failed")

    batcher = make(recorder, dispatch_when_idle=True, observer=Observer())
    loop_thread = threading.get_ident()
    first = await batcher.submit(item(1), 10, alone=True)  # its speed unknown yet: the runner
    assert first.output == 10 and recorder.threads[-1] != loop_thread
    lone = batcher.enqueue(item(2), 10, alone=True)
    assert lone.done() and lone.result().output == 20 and lone.result().batch_size == 1  # answered on return
    assert recorder.threads[-1] == loop_thread and recorder.batches[-1] == [2.0]
    bad = batcher.enqueue(item(-1), 10, alone=True)  # an item's own error, on the loop too
    assert isinstance(bad.exception(), ValueError) and recorder.threads[-1] == loop_thread
    recorder.fail_when = lambda values: True  # a failing batch: the item's InferenceError, the loop unharmed
    failed = batcher.enqueue(item(3), 10, alone=True)
    assert isinstance(failed.exception(), InferenceError) and "boom" in str(failed.exception())
    recorder.fail_when = lambda values: False
    waits_fail.set()  # a metric that fails: the image is answered all the same, as on the runner
    assert batcher.enqueue(item(5), 10, alone=True).result().output == 50 and recorder.threads[-1] == loop_thread
    waits_fail.clear()
    assert (await batcher.submit(item(4), 10)).output == 40  # not alone: the runner, as ever
    assert recorder.threads[-1] != loop_thread and batcher.queued == 0 and not batcher.busy
    await batcher.close()


async def test_a_lone_image_goes_to_the_runner_behind_other_work_or_when_its_batch_is_slow_or_lowered(monkeypatch):
    recorder = Recorder()
    batcher = make(recorder, dispatch_when_idle=True)
    loop_thread = threading.get_ident()
    await batcher.submit(item(1), 10, alone=True)  # measured
    recorder.gate.clear()
    running = asyncio.ensure_future(batcher.submit(item(2), 10))
    await until(lambda: recorder.started[-1] == [2.0], "a batch running")
    behind = batcher.enqueue(item(3), 10, alone=True)  # something runs: it queues, the loop is not held
    assert not behind.done() and batcher.queued == 1
    recorder.gate.set()
    assert [r.output for r in await asyncio.gather(running, behind)] == [20, 30]
    assert loop_thread not in recorder.threads
    monkeypatch.setattr(batcher_module, "ON_LOOP_MAX_S", 0.0)  # every batch measured slower than the limit
    assert (await batcher.submit(item(4), 10, alone=True)).output == 40 and recorder.threads[-1] != loop_thread
    monkeypatch.undo()
    recorder.delay_s = 4 * batcher_module.ON_LOOP_MAX_S  # a slow batch of one (a cold first call): the runner next
    await batcher.submit(item(5), 10)
    assert (await batcher.submit(item(6), 10, alone=True)).output == 60 and recorder.threads[-1] != loop_thread
    recorder.delay_s = 0.0  # the last batch of one decides, not an average that still carries the slow one
    await batcher.submit(item(7), 10)
    assert (await batcher.submit(item(8), 10, alone=True)).output == 80 and recorder.threads[-1] == loop_thread
    lowered = Recorder()
    batcher = make(lowered, dispatch_when_idle=True, runner_priority="low")  # its threads never at the loop's
    for value in (1, 2):
        assert (await batcher.submit(item(value), 10, alone=True)).output == value * 10
    assert loop_thread not in lowered.threads and len(lowered.threads) == 2
    await batcher.close()


async def test_with_two_runners_a_second_batch_runs_while_the_first_is_still_running():
    """`runners` batches at once, each on a thread of its own; with one, the second full batch waits assembled."""
    for runners, running_together in ((1, 1), (2, 2)):
        recorder = Recorder()
        batcher = make(recorder, max_batches_in_flight=2, runners=runners)
        recorder.gate.clear()
        futures = [batcher.enqueue(item(v), 10) for v in range(1, 9)]  # two full batches
        await until(lambda: len(recorder.started) == running_together, f"{running_together} batch(es) running")
        await asyncio.sleep(0.05)
        assert len(recorder.started) == running_together
        recorder.gate.set()
        await asyncio.wait_for(asyncio.gather(*futures), PATIENCE_S)
        assert sorted(recorder.batches) == [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]]
        assert len(set(recorder.threads)) == runners
        await batcher.close()


async def test_runners_free_together_share_a_group_larger_than_the_last_batch_but_not_one_its_size():
    """Six queued with both runners idle: three each, no runner left idle. Then the three clients one batch answered
    come back together: one batch of three, not halved (halving it would halve every batch after it)."""
    recorder = Recorder()
    batcher = make(recorder, max_batch_size=8, max_queue_delay_s=1.0, dispatch_when_idle=True,
                   max_batches_in_flight=2, runners=2)
    recorder.gate.clear()
    six = [batcher.enqueue(item(v), 10) for v in range(1, 7)]  # in one loop turn: the dispatcher sees all six
    await until(lambda: len(recorder.started) == 2, "two batches running")
    assert sorted(recorder.started) == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
    recorder.gate.set()
    await asyncio.wait_for(asyncio.gather(*six), PATIENCE_S)
    three = [batcher.enqueue(item(v), 10) for v in (7, 8, 9)]
    results = await asyncio.wait_for(asyncio.gather(*three), PATIENCE_S)
    assert recorder.batches[-1] == [7.0, 8.0, 9.0] and all(r.batch_size == 3 for r in results)
    await batcher.close()




async def test_a_lone_image_runs_wide_and_alone_and_a_loaded_batcher_on_its_runners():
    """One image with nothing running or queued runs wide, and nothing starts beside it, a runner free or not; what
    queued meanwhile runs on the runners, two batches at once. A lone maps-free image runs wide and maps-free; a lone
    targeted one on a runner (the relevance path is loaded once); none where the model has no wide copy or one
    runner."""
    recorder = Recorder()
    batcher = make(recorder, max_batch_size=4, max_queue_delay_s=0.01, dispatch_when_idle=True,
                   max_batches_in_flight=2, runners=2, wide_lone_batches=True, maps_free_batches=True)
    recorder.gate.clear()
    lone = batcher.enqueue(item(1), 10)
    await until(lambda: len(recorder.started) == 1, "the lone image running")
    eight = [batcher.enqueue(item(v), 10) for v in range(2, 10)]  # two full batches, one runner free
    await asyncio.sleep(0.05)
    assert recorder.started == [[1.0]] and recorder.wide == [True]
    recorder.gate.set()
    assert (await asyncio.wait_for(lone, PATIENCE_S)).output == 10.0
    await asyncio.wait_for(asyncio.gather(*eight), PATIENCE_S)
    assert sorted(recorder.batches[1:]) == [[2.0, 3.0, 4.0, 5.0], [6.0, 7.0, 8.0, 9.0]]
    assert recorder.wide == [True, False, False]
    for options in ({"target": 3}, {"maps_free": True}):
        await asyncio.wait_for(batcher.submit(item(1), 10, **options), PATIENCE_S)
    assert recorder.wide[3:] == [False, True] and recorder.maps_free[3:] == [False, True]
    await batcher.close()

    for options in ({"runners": 1, "wide_lone_batches": True}, {"runners": 2}):
        recorder = Recorder()
        batcher = make(recorder, dispatch_when_idle=True, **options)
        await asyncio.wait_for(batcher.submit(item(1), 10), PATIENCE_S)
        assert recorder.wide == [False], options
        await batcher.close()


def test_a_wait_for_company_never_asks_uvloop_for_a_timer_it_would_run_at_once(monkeypatch):
    # uvloop counts a timer in whole milliseconds, to the nearest, and runs one due within half a millisecond at once:
    # the batcher's wait for company spun through its last fraction of a millisecond, a new wait each loop turn
    uvloop = pytest.importorskip("uvloop")
    timeouts: list[float] = []
    wait_for = asyncio.wait_for

    def recorded(awaitable, timeout):
        timeouts.append(timeout)
        return wait_for(awaitable, timeout)

    monkeypatch.setattr(batcher_module.asyncio, "wait_for", recorded)

    async def main():
        batcher = make(Recorder(), max_queue_delay_s=0.0024)
        timeouts.clear()
        results = [await batcher.submit(item(1), 10) for _ in range(5)]  # where the timer fires varies
        waits = [t for t in timeouts if t is not None]  # the batches', not close()'s
        await batcher.close()
        return results, waits

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        results, waits = runner.run(main())
    assert all(r.batch_size == 1 and r.queue_s >= 0.0024 - batcher_module.TIMER_SLACK_S for r in results)
    assert waits and min(waits) > batcher_module.TIMER_SLACK_S, waits
    assert len(waits) <= 3 * len(results)  # one wait each, or more where uvloop's clock (read at the turn's start)
    # fired it early
