"""Dynamic batching: many concurrent `submit(array)` calls become few `run_batch(stacked, targets)` calls.

The batcher knows nothing of HTTP or ONNX. It groups items by array shape, and by whether they carry a
target (an int per item that `run_batch` receives with the batch, as `targets`; the engine uses it for the class
to explain): targeted items run a different, costlier computation, so they batch apart, up to
`max_targeted_batch_size`, and their speed is learnt apart for `predicted_wait_s`. It dispatches a group when
it reaches `max_batch_size` images or `max_batch_cost` input values, or when its oldest item has waited
`max_queue_delay_s` (or at once when no batch is in flight and `dispatch_when_idle`: an idle model has
nobody to wait for), and keeps up to `max_batches_in_flight` batches assembled or running (one runs at a
time on its own thread), so the next batch is stacked while the current one runs. Only a full batch waits
assembled behind the running one: one that is not full stays open to newcomers until the runner is free,
as Triton's dynamic batcher forms a batch when a model instance is free. With `runners` (Triton's instance
count) that many batches run at once, each on a runner thread of its own; runners free together share out a
group larger than the last batch.

An item may also be `maps_free`: it needs less of the computation than the others (the engine: no rollout). With
`maps_free_batches`, such items batch apart from the rest, and their batches run as `run_batch(stacked, targets,
maps_free=True)`, the cheaper computation. Apart, not mixed in: the cheaper computation may round differently, and an
item's answer must not depend on what its batch-mates asked for. Without `maps_free_batches` (a model with one
computation) the flag is ignored, and nothing splits the batches.

A lone image may run on the event loop (`enqueue(..., alone=True)`: its caller says nothing else is in flight in
its process) when the batcher is idle and its batch is predicted, from the measured speed, to take at most
`ON_LOOP_MAX_S`: nobody waits behind it there, and the way to the runner thread and back (two thread wake-ups and
the dispatch loop's turns) cost a light model's lone request 0.4-0.5 ms of a 4.7 ms answer on 2 cores
(docs/latency-budget.md). Its answer is the same batch of one the runner would have run.

More than a batch queued and less than two goes as two halves, not a full batch and a few left over a batch
behind.

With `wide_lone_batches` (a model whose runners share the cores out, one thread each, and which is loaded a second
time with every core's thread), a batch of one image taken while no batch runs and nothing else is queued runs as
`run_batch(stacked, targets, wide=True)` (with `maps_free=True` too for a maps-free image), on every core, and no
other batch starts until it ends: a lone request gets the model's best speed, a loaded server its runners. A
targeted image runs on a runner (the relevance path is loaded once).

Token budgets (service/engine/budgets.py): an item may ask for a cheaper `rung` (an index into its model's ladder
of input grids), and may forbid load to make it cheaper still (`degradable` False). Items batch apart by rung asked
and by that flag; a batch runs as `run_batch(stacked, targets, rung=k)` when k is not the full budget. With a
`budgets` controller, each batch taken of degradable items of `resizable_shape` (the trained size: other sizes have
no rungs) runs at the controller's rung where that is cheaper than the one asked, chosen from the queue's work and
the arrivals (the controller hears of every batch taken and every item queued); a non-degradable item is refused
(Overloaded) at once while the controller degrades. Speed is learnt at the full budget's scale (a batch at a rung
did that rung's share of the work), and `predicted_wait_s`, admission's estimate, is the queue's work at the
cheapest rung: what the controller would run it at, so admission refuses only what the cheapest cannot serve.

Fairness: among the groups ready to go, the one served longest ago goes first, and the cost cap keeps a
batch of large inputs short; so a burst of large images is cut into small batches and a small request
waits for at most the batches already in flight, not for the whole burst.

Each item gets its own result or its own exception:
  - QueueFullError at once when `max_queue_size` items are already queued;
  - DeadlineExceeded when it waited queued past its timeout (it never runs);
  - InferenceError when its batch's `run_batch` call raised (its batch-mates get it too, nobody else);
  - the exception `run_batch` put in its slot, if any (that item only).
A cancelled `submit` (e.g. the client went away) is dropped before it runs.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from vitserve.service.engine.budgets import FULL, BudgetController
from vitserve.service.engine.threads import CpuPriority, lower_thread_priority
from vitserve.service.ground import tracing
from vitserve.service.ground.errors import DeadlineExceeded, InferenceError, NotReady, Overloaded, QueueFullError

log = logging.getLogger("vitserve.engine")

# A batch this small is copied together on the event loop (tens of microseconds): the hop to a thread for it cost
# more than the copy (7% of an engine process's time at its ceiling, docs/results/bench-engine-ceiling.md). A larger
# one is copied on a thread, so the loop keeps answering meanwhile.
STACK_INLINE_BYTES = 256 * 1024

# A lone image's batch predicted to run within this long may run on the event loop (module doc): the longest the
# loop then keeps a request that arrives meanwhile waiting, which the runner thread would keep waiting for its
# batch anyway. A heavy model (ViT-S/16: 72 ms on 2 cores) always goes to the runner.
ON_LOOP_MAX_S = 0.005

# A group due within this long goes now. uvloop counts a timer in whole milliseconds, to the nearest, and runs one
# due within half a millisecond at once: a wait's last fraction of a millisecond spun the loop, a new wait each
# turn, until the clock passed the delay. A batch now goes up to half a millisecond early instead.
TIMER_SLACK_S = 0.0005

# (B, ...) and the batch's targets (B,) int64, or None for untargeted items -> B per-item outputs (or exceptions);
# for a batch of maps-free items, also `maps_free=True`
RunBatch = Callable[..., Sequence[Any]]


class BatchObserver(Protocol):
    """Where the batcher reports plain numbers (service.ground.metrics implements it)."""

    def batch_done(self, size: int, seconds: float, stack_seconds: float, targeted: bool = False,
                   maps_free: bool = False) -> None: ...

    def queue_wait(self, seconds: float) -> None: ...

    def queue_depth(self, depth: int) -> None: ...


class _NullObserver:
    def batch_done(self, size: int, seconds: float, stack_seconds: float, targeted: bool = False,
                   maps_free: bool = False) -> None:
        pass

    def queue_wait(self, seconds: float) -> None:
        pass

    def queue_depth(self, depth: int) -> None:
        pass


@dataclass
class BatchResult:
    output: Any
    queue_s: float  # submitted -> its batch dispatched
    inference_s: float  # the run_batch call of its batch
    batch_size: int
    batch_span: str = ""  # the traced batch ("traceid-spanid", service/ground/tracing.py), or ""
    rung: int = FULL  # the token budget its batch ran at (an index into the served ladder)
    reason: str | None = None  # why below the full budget: "asked", "load"; None at the full budget


@dataclass(eq=False)
class _Item:
    array: np.ndarray
    future: asyncio.Future
    enqueued: float
    deadline: float
    target: int | None = None
    maps_free: bool = False  # needs only the cheaper computation (module doc)
    dispatched: float = field(default=0.0)
    wide: bool = False  # runs as a batch of one on every core (module doc)
    rung: int = FULL  # the budget asked for (module doc)
    degradable: bool = True  # load may run it at a cheaper rung than asked
    ran_rung: int = FULL  # the rung its batch ran at

    @property
    def targeted(self) -> bool:
        return self.target is not None


class DynamicBatcher:
    def __init__(self, run_batch: RunBatch, *, max_batch_size: int, max_queue_delay_s: float,
                 max_queue_size: int, max_batches_in_flight: int = 2, dispatch_when_idle: bool = True,
                 max_batch_cost: int | None = None, observer: BatchObserver | None = None,
                 max_targeted_batch_size: int | None = None, runner_priority: CpuPriority = "normal",
                 trace_attributes: dict | None = None, maps_free_batches: bool = False, runners: int = 1,
                 wide_lone_batches: bool = False, budgets: BudgetController | None = None,
                 resizable_shape: tuple[int, ...] | None = None):
        self._run_batch = run_batch
        self.budgets = budgets  # chooses the rung of degradable batches under load (module doc); None: never
        self.resizable_shape = resizable_shape  # the items that have cheaper rungs: those of this shape
        self.wide_lone_batches = wide_lone_batches and runners > 1  # a lone image on every core (module doc)
        self._wide_running = False  # a wide batch runs: no other starts beside it
        self.maps_free_batches = maps_free_batches  # maps-free items batch apart, run maps-free (module doc)
        self._trace_attributes = trace_attributes or {}  # on each batch's span, when tracing is on
        self.max_batch_size = max_batch_size
        self.max_targeted_batch_size = max_targeted_batch_size or max_batch_size
        self.max_batch_cost = max_batch_cost  # input values (array.size summed) per batch; None: no cap
        self.max_queue_delay_s = max_queue_delay_s
        self.max_queue_size = max_queue_size
        self.dispatch_when_idle = dispatch_when_idle
        self._observer = observer or _NullObserver()
        # (shape, dtype, targeted, maps_free) -> items, oldest first
        self._groups: OrderedDict[tuple, deque[_Item]] = OrderedDict()
        self._last_served: dict[tuple, float] = {}  # shape -> when a batch of it last went out
        self._queued = 0
        self._queued_costs = {False: 0, True: 0}  # targeted -> input values queued
        self._depth_due = False  # the queue's depth is to be reported at the end of this loop turn
        self._seconds_per_cost: dict[bool, float] = {}  # targeted -> run_batch time per input value (moving average)
        self._alone_per_cost: dict[bool, float] = {}  # targeted -> the last batch of one's time per input value
        self._active = 0  # batches taken from the queue and not yet answered
        self._free_since = float("-inf")  # when a runner last went idle (a batch finished with fewer left running)
        self._last_size = 1  # images in the last batch that finished: how many clients may be coming back
        self.runners = runners
        self._slots = asyncio.Semaphore(max(max_batches_in_flight, runners))  # at least a batch per runner
        self._wakeup = asyncio.Event()
        self._closing = False
        # a model whose threads run at a lowered priority (a shadow, a background model) never runs on the loop's
        self._runs_at_loop_priority = runner_priority == "normal"
        self._runner = ThreadPoolExecutor(max_workers=runners, thread_name_prefix="batch-runner",
                                          initializer=lower_thread_priority, initargs=(runner_priority,))
        self._tasks: set[asyncio.Task] = set()
        self._loop_task: asyncio.Task | None = None

    @property
    def queued(self) -> int:
        return self._queued

    @property
    def busy(self) -> bool:
        """Whether it has images queued or a batch running."""
        return self._queued > 0 or self._active > 0

    @property
    def queued_cost(self) -> int:
        """Input values of the images queued."""
        return self._queued_costs[False] + self._queued_costs[True]

    @property
    def seconds_per_cost(self) -> float | None:
        """The measured run time per input value of the work queued now (untargeted work's when none is queued),
        so that `queued_cost * seconds_per_cost` is `predicted_wait_s()`; None before the first batch."""
        if not self._seconds_per_cost:
            return None
        if self.queued_cost:
            return self.predicted_wait_s() / self.queued_cost
        return self._seconds_per_cost.get(False, next(iter(self._seconds_per_cost.values())))

    def predicted_wait_s(self, extra_cost: int = 0) -> float:
        """How long the work queued now (plus `extra_cost` input values of untargeted work) will take to run, from
        measured batch times of each kind; 0 until a batch has run."""
        full_s = self._queued_full_s(extra_cost)
        if self.budgets is None:
            return full_s
        return full_s * self.budgets.share(len(self.budgets.costs) - 1, self._full_image_s())  # at the cheapest

    def _full_image_s(self) -> float:
        """An image's seconds at the full budget, from the learnt speed (0 before the first batch)."""
        return self._seconds_per_cost.get(False, 0.0) * math.prod(self.resizable_shape or (0,))

    def _queued_full_s(self, extra_cost: int = 0) -> float:
        """`predicted_wait_s` at the full budget."""
        rates = self._seconds_per_cost
        if not rates:
            return 0.0
        cost = {False: self._queued_costs[False] + extra_cost, True: self._queued_costs[True]}
        return sum(c * rates.get(targeted, rates.get(not targeted, 0.0)) for targeted, c in cost.items())

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._dispatch_loop(), name="batcher-dispatch")

    async def submit(self, array: np.ndarray, timeout_s: float, target: int | None = None,
                     maps_free: bool = False, alone: bool = False, rung: int = FULL,
                     degradable: bool = True) -> BatchResult:
        """Queue one item (with its target, if any) and wait for its result; raises the item's own error."""
        future = self.enqueue(array, timeout_s, target, maps_free, alone, rung, degradable)
        try:
            return await future
        except asyncio.CancelledError:
            future.cancel()  # a cancelled future is skipped when its batch is assembled
            raise

    def enqueue(self, array: np.ndarray, timeout_s: float, target: int | None = None,
                maps_free: bool = False, alone: bool = False, rung: int = FULL,
                degradable: bool = True) -> asyncio.Future:
        """Queue one item; its future gets the BatchResult or the item's own error. Cancelling the future drops the
        item if it has not run. No task and no coroutine per item: an engine process answers a frontend's images
        from the futures' callbacks (service/engine/server.py). Raises NotReady or QueueFullError at once.
        `alone`: nothing else is in flight in the caller's process; the item may then run here, on the event loop,
        and its future is done on return (module doc). `rung`: the budget asked for; `degradable` False: Overloaded
        at once while load answers cheaper, rather than a cheaper answer (module doc)."""
        if self._closing:
            raise NotReady("shutting down: not accepting new work")
        if self._queued >= self.max_queue_size:
            raise QueueFullError(f"queue full ({self._queued} images waiting)")
        budgets = self.budgets
        if budgets is not None:
            if not degradable and rung < budgets.rung:
                raise Overloaded("the server answers at a reduced token budget under load now, and this request "
                                 "asked for none (degrade=never); retry later")
            budgets.arrived()
        loop, now = asyncio.get_running_loop(), time.perf_counter()
        item = _Item(array, loop.create_future(), now, now + timeout_s, target, maps_free and self.maps_free_batches,
                     rung=rung, degradable=degradable)
        if alone and self._runs_on_loop(item):
            self._run_on_loop(item)
            return item.future
        key = (array.shape, array.dtype.str, item.targeted, item.maps_free, rung, degradable)
        self._groups.setdefault(key, deque()).append(item)
        # counted in place, the depth gauge told once per loop turn, not a new dict and a metric's lock per image
        # (about 4% of an engine process's samples at its ceiling)
        self._queued += 1
        self._queued_costs[item.targeted] += array.size
        if not self._depth_due:
            self._depth_due = True
            loop.call_soon(self._report_depth)
        self._wakeup.set()
        # A timer, not `asyncio.wait(timeout=)`: that makes a waiter future and callbacks per image besides the timer,
        # a measurable share of an engine process's time at its ceiling (docs/results/bench-engine-ceiling.md).
        expiry = loop.call_later(timeout_s, self._expire_if_queued, item)
        item.future.add_done_callback(lambda future: self._item_done(future, expiry))
        return item.future

    def _item_done(self, future: asyncio.Future, expiry: asyncio.TimerHandle) -> None:
        expiry.cancel()
        if future.cancelled():
            self._wakeup.set()  # let the loop drop it from the queue (and the depth gauge) now

    def _expire_if_queued(self, item: _Item) -> None:
        """At an item's deadline: one still queued never runs; one in a running batch gets its result."""
        if not item.dispatched:
            self._expire(item)
            self._wakeup.set()

    def _expire(self, item: _Item) -> None:
        if not item.future.done():
            waited_ms = (time.perf_counter() - item.enqueued) * 1000
            limit_ms = (item.deadline - item.enqueued) * 1000
            item.future.set_exception(DeadlineExceeded(f"waited {waited_ms:.0f} ms in the queue; "
                                                       f"the deadline is {limit_ms:.0f} ms"))

    def _set_queued(self, depth: int, costs: dict[bool, int]) -> None:
        self._queued, self._queued_costs = depth, costs
        self._observer.queue_depth(depth)

    def _report_depth(self) -> None:
        self._depth_due = False
        self._observer.queue_depth(self._queued)

    async def _dispatch_loop(self) -> None:
        while True:
            await self._slots.acquire()
            try:
                batch = await self._next_batch()
            except Exception:  # (an observer's metric failing) the loop must go on: a dead one answers nobody again
                log.exception("forming the next batch failed")
                self._slots.release()
                await asyncio.sleep(0.01)  # a failure that repeats does not spin the loop
                continue
            if batch is None:
                self._slots.release()
                return
            task = asyncio.create_task(self._execute(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _next_batch(self) -> list[_Item] | None:
        """Wait until some group is full or its oldest item has waited the delay; take up to a full batch
        from the ready group served longest ago."""
        while True:
            self._drop_finished()
            if self._wide_running:  # a batch on every core: nothing starts beside it (module doc)
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if not self._groups:
                if self._closing:
                    return None
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            now = time.perf_counter()
            waits = {shape: self._wait_s(group, now) for shape, group in self._groups.items()}
            ready = [shape for shape, wait in waits.items() if wait <= TIMER_SLACK_S]
            if ready:
                shape = min(ready, key=lambda s: (self._last_served.get(s, float("-inf")), self._groups[s][0].enqueued))
                return self._take(shape, self._groups[shape])
            self._wakeup.clear()
            timeout = min(waits.values())
            try:  # new items and a batch finishing set the wakeup too
                await asyncio.wait_for(self._wakeup.wait(), timeout=None if timeout == float("inf") else timeout)
            except TimeoutError:
                pass

    def _wait_s(self, group: deque[_Item], now: float) -> float:
        """Seconds until the group should go (0 or less: now; inf: until something changes).

        A full group goes at once, even to wait assembled behind the running batch. One that is not full stays
        open while a batch runs: taken then, it would only queue for the runner while the requests arriving
        meanwhile miss it (Triton's dynamic batcher forms a batch when an instance is free). Once the runner is
        free it goes after `max_queue_delay_s` (from its oldest item, or with `dispatch_when_idle` from when the
        runner freed), or at once with `dispatch_when_idle` when it holds as many items as the last batch had: a
        lone client is not kept waiting, but the clients a batch has just answered, all coming back within a few
        milliseconds, go together instead of the first of them alone. Running that first one alone split an
        8-client loop for good into groups that took turns on the engine (mean batch 2.7 of 8)."""
        if self._closing or self._batch_length(group) < len(group) or len(group) >= self._largest_batch(group):
            return 0.0
        if self._active >= self.runners:
            return float("inf")
        if not self.dispatch_when_idle:
            return group[0].enqueued + self.max_queue_delay_s - now
        if len(group) >= min(self._last_size, self._largest_batch(group)):
            return 0.0
        return self._free_since + self.max_queue_delay_s - now

    def _batch_length(self, group: deque[_Item]) -> int:
        """How many of the group's oldest items one batch takes: up to max_batch_size, within max_batch_cost
        (always at least one, however large)."""
        largest = self._largest_batch(group)
        if self.max_batch_cost is None:
            return min(largest, len(group))
        per_item = group[0].array.size  # one group, one shape
        return max(1, min(largest, len(group), self.max_batch_cost // per_item))

    def _largest_batch(self, group: deque[_Item]) -> int:
        return self.max_targeted_batch_size if group[0].targeted else self.max_batch_size

    def _drop_finished(self) -> None:
        """Remove items already answered (cancelled, or expired) and expire those past their deadline."""
        now = time.perf_counter()
        for shape in list(self._groups):
            kept: deque[_Item] = deque()
            for item in self._groups[shape]:
                if not item.future.done() and now >= item.deadline:
                    self._expire(item)
                if not item.future.done():
                    kept.append(item)
            if kept:
                self._groups[shape] = kept
            else:
                del self._groups[shape]
        costs = {False: 0, True: 0}
        for (_, _, targeted, *_), group in self._groups.items():
            costs[targeted] += sum(item.array.size for item in group)
        self._set_queued(sum(len(g) for g in self._groups.values()), costs)

    def _take(self, shape: tuple, group: deque[_Item]) -> list[_Item]:
        now = time.perf_counter()
        rung = self._rung_of(group[0], now)
        length = self._batch_length(group)
        if length < len(group) < 2 * length:
            # More than a batch queued and less than two: two halves, the smaller first, not a full batch and the
            # few left over. Seventeen clients of one process ran as 16 and then the 17th a whole batch and its way
            # back later, turn after turn (the 32-client tail: docs/latency-budget.md); as 8 and 9 they take turns,
            # each waiting one batch, and the 9 go as soon as the runner frees (as many as the last batch, and
            # more). From two batches' worth on, full batches: a backlog keeps the batches it can fill.
            length = len(group) // 2
        free = self.runners - self._active
        if free > 1:
            # Runners free together share a group larger than the last batch, none left idle; not one the size of
            # the last batch (the clients it answered coming back), which halved would halve every batch after it.
            length = min(length, max(self._last_size, -(-len(group) // free)))
        batch = [group.popleft() for _ in range(length)]
        batch[0].ran_rung = rung  # the batch's (read from its first item)
        if not group:
            del self._groups[shape]
        if self._runs_wide(batch):
            batch[0].wide = self._wide_running = True
        self._last_served[shape] = now
        if len(self._last_served) > 2 * len(self._groups) + 64:  # forget shapes no longer queued: bounded memory
            self._last_served = {s: t for s, t in self._last_served.items() if s in self._groups or s == shape}
        self._dispatch(batch, now)
        targeted = batch[0].targeted  # one group: all or none
        costs = {**self._queued_costs, targeted: self._queued_costs[targeted] - sum(i.array.size for i in batch)}
        self._set_queued(self._queued - len(batch), costs)
        self._active += 1
        return batch

    def _rung_of(self, first: _Item, now: float) -> int:
        """The rung a batch of `first`'s group runs at: the rung asked for, or under load the controller's where it
        is cheaper and the items may be degraded (the controller hears of every batch taken, to follow the load)."""
        budgets = self.budgets
        if budgets is None:
            return first.rung
        load = budgets.choose(now, self._queued, self._full_image_s(), self.max_batch_size, self.runners)
        if first.degradable and first.array.shape == self.resizable_shape:
            return max(first.rung, load)
        return first.rung

    def _runs_wide(self, batch: list[_Item]) -> bool:
        """Whether `batch`, just taken, is one untargeted image with nothing running or queued beside it."""
        return (self.wide_lone_batches and len(batch) == 1 and not self._active and not self._groups
                and not batch[0].targeted)

    def _dispatch(self, batch: list[_Item], now: float) -> None:
        """The batch's items taken off the queue at `now`, their waits recorded: from here only the batch's run
        answers them, so nothing (a metric failing) may stop it."""
        for item in batch:
            item.dispatched = now
        try:
            for item in batch:
                self._observer.queue_wait(now - item.enqueued)
        except Exception:
            log.exception("recording a batch's queue wait failed")

    async def _execute(self, batch: list[_Item]) -> None:
        unanswered: BaseException = NotReady("shut down before this image ran")
        try:
            batch = [item for item in batch if not item.future.done()]  # cancelled while assembling
            if not batch:
                return
            loop, stacking = asyncio.get_running_loop(), time.perf_counter()
            if len(batch) == 1:  # a lone request (an idle model) pays no thread hop for a copy
                stacked = batch[0].array[None]  # (1, ...)
            elif sum(item.array.nbytes for item in batch) <= STACK_INLINE_BYTES:
                stacked = np.stack([item.array for item in batch])  # (B, ...)
            else:
                stacked = await asyncio.to_thread(np.stack, [item.array for item in batch])
            call, stack_seconds = self._call_of(batch, stacked), time.perf_counter() - stacking
            started_ns = tracing.now_ns()
            outputs: Sequence[Any] | Exception
            try:
                # Timed inside the runner thread: with two batches in flight, the wait behind the other
                # batch is queueing, not inference.
                outputs, seconds = await loop.run_in_executor(self._runner, call)
            except Exception as e:
                outputs, seconds = e, (tracing.now_ns() - started_ns) / 1e9
            self._answer(batch, outputs, seconds, started_ns, stack_seconds)
        except Exception as e:  # before the run (stacking: a MemoryError): its images fail now, not at their deadline
            log.exception("a batch of %d could not be assembled", len(batch))
            unanswered = InferenceError(f"a batch of {len(batch)} could not be assembled: {e!r:.200}")
        finally:
            for item in batch:  # a batch that ended early (above, or cancelled by close) answers every image
                if not item.future.done():
                    item.future.set_exception(unanswered)
            self._batch_ended()

    def _call_of(self, batch: list[_Item], stacked: np.ndarray) -> Callable[[], tuple[Sequence[Any], float]]:
        """The batch's `run_batch` call, timed where it runs: with its targets, and `maps_free` and `wide` only when
        set (a run_batch with one computation need not take them)."""
        targets = np.array([item.target for item in batch], np.int64) if batch[0].targeted else None  # one group
        first = batch[0]
        options: dict[str, Any] = {name: True for name, wanted in (("maps_free", first.maps_free), ("wide", first.wide))
                                   if wanted}
        if first.ran_rung != FULL:
            options["rung"] = first.ran_rung
        return functools.partial(_timed_call, self._run_batch, stacked, targets, **options)

    def _answer(self, batch: list[_Item], outputs: Sequence[Any] | Exception, seconds: float, started_ns: int,
                stack_seconds: float) -> None:
        """Each image its output (or its batch's error: `outputs` an exception), then the batch's span, speed and
        metrics."""
        if not isinstance(outputs, Exception) and len(outputs) != len(batch):
            outputs = RuntimeError(f"run_batch returned {len(outputs)} outputs for {len(batch)} inputs")
        if isinstance(outputs, Exception):
            outputs = [InferenceError(f"inference failed for a batch of {len(batch)}: {outputs}")] * len(batch)
        targeted, maps_free = batch[0].targeted, batch[0].maps_free  # one group: all or none
        span = tracing.batch_span(started_ns, started_ns + int(seconds * 1e9), self._trace_attributes, len(batch),
                                  targeted)
        rung = batch[0].ran_rung
        for item, output in zip(batch, outputs):  # answered first: a failing observer strands nobody
            self._resolve(item, output, seconds, len(batch), span, rung)
        self._last_size = len(batch)
        share = 1.0
        if self.budgets is not None and not targeted and batch[0].array.shape == self.resizable_shape:
            self.budgets.ran(rung, len(batch), seconds, loaded=len(batch) >= max(1, self.max_batch_size // 2))
            # at the full budget's scale: a batch at a cheaper rung did that share of the work
            share = self.budgets.share(rung, self._full_image_s())
        self._learn_speed(targeted, seconds, round(share * sum(item.array.size for item in batch)), len(batch))
        self._observer.batch_done(len(batch), seconds, stack_seconds, targeted, maps_free)

    def _batch_ended(self) -> None:
        self._active -= 1
        self._wide_running = False  # a wide batch runs alone: whichever batch ended, none is wide now
        if self._active < self.runners:
            self._free_since = time.perf_counter()
        self._slots.release()
        self._wakeup.set()  # an idle model may now take what is queued

    def _runs_on_loop(self, item: _Item) -> bool:
        """Whether a lone item may run on the event loop now: nothing queued or running, its kind of batch of one
        measured to run within ON_LOOP_MAX_S (unmeasured: to the runner), and the model not lowered."""
        rate = self._alone_per_cost.get(item.targeted)
        return (not self._queued and not self._active and rate is not None and self._runs_at_loop_priority
                and rate * item.array.size <= ON_LOOP_MAX_S)

    def _run_on_loop(self, item: _Item) -> None:
        """A batch of the one item, run here on the event loop, as the runner would have run it (nothing runs beside
        it: on every core where the model is loaded wide too)."""
        item.wide = self.wide_lone_batches and not item.targeted
        item.ran_rung = item.rung  # alone: nothing loads it
        self._dispatch([item], time.perf_counter())
        try:
            started_ns = tracing.now_ns()
            outputs: Sequence[Any] | Exception
            try:
                outputs, seconds = self._call_of([item], item.array[None])()
            except Exception as e:
                outputs, seconds = e, (tracing.now_ns() - started_ns) / 1e9
            self._answer([item], outputs, seconds, started_ns, 0.0)
        except Exception as e:
            log.exception("a batch of 1 on the event loop failed")
            if not item.future.done():
                item.future.set_exception(InferenceError(f"a batch of 1 could not run: {e!r:.200}"))
        finally:
            self._free_since = time.perf_counter()

    def _learn_speed(self, targeted: bool, seconds: float, cost: int, size: int, wide: bool = False) -> None:
        """An exponential moving average of seconds per input value, per kind of work, for `predicted_wait_s`; and
        apart, the last batch of one's, for `_runs_on_loop` (an average would carry a cold first call, 8.6 ms
        against 2-3.5 after it for the default model, past ON_LOOP_MAX_S for the next ten batches). A wide batch
        (every core on one image) says nothing of the queue's wait: queued work runs on the runners."""
        rate = seconds / max(cost, 1)
        previous = self._seconds_per_cost.get(targeted)
        if not wide or previous is None:
            self._seconds_per_cost[targeted] = rate if previous is None else 0.8 * previous + 0.2 * rate
        if size == 1:
            self._alone_per_cost[targeted] = rate

    @staticmethod
    def _resolve(item: _Item, output: Any, seconds: float, size: int, span: str, rung: int) -> None:
        if item.future.done():  # its client left while it ran
            return
        if isinstance(output, BaseException):
            item.future.set_exception(output)
        else:
            reason = None if rung == FULL else "asked" if rung == item.rung else "load"
            item.future.set_result(BatchResult(output, item.dispatched - item.enqueued, seconds, size, span, rung,
                                               reason))

    async def close(self, timeout_s: float = 30.0) -> None:
        """Stop accepting, run everything already queued, wait for running batches, then stop."""
        self._closing = True
        self._wakeup.set()
        pending = [t for t in (self._loop_task,) if t] + list(self._tasks)
        try:
            await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), timeout_s)
            if self._tasks:
                await asyncio.wait_for(asyncio.gather(*self._tasks, return_exceptions=True), timeout_s)
        except TimeoutError:
            for group in self._groups.values():
                for item in group:
                    if not item.future.done():
                        item.future.set_exception(NotReady("shut down before this image ran"))
            if self._loop_task:
                self._loop_task.cancel()
        self._runner.shutdown(wait=False)


def _timed_call(function: Callable, *args, **kwargs) -> tuple[Any, float]:
    started = time.perf_counter()
    result = function(*args, **kwargs)
    return result, time.perf_counter() - started
