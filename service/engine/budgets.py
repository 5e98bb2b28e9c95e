"""Token budgets in the engine: which of a file's rungs (vitserve/budgets.py) a version serves, which rung a client's
`max_tokens` asks for, and the controller that chooses, per batch, the rung of the work that may be answered
cheaper under load.

The rungs served (`served_ladder`): the full budget, then each lower rung whose accuracy on the export's labelled
set is within `budget_accuracy_floor` points of the full budget's; a rung the file has no accuracy for only with
`budget_unmeasured_rungs` (a file exported without a labelled set: its loss is unknown). The same function of the
file and the settings in every process, so a frontend describes the rung the engine ran by its index.

The controller (`BudgetController`), asked as each batch is taken, follows two signals:

- the arrivals (images a second, a moving average) against each rung's speed, from its measured seconds an image in
  a loaded batch (before a rung has run loaded: the full budget's times its multiply-adds share; a light model's
  cheaper grid saves less than its multiply-adds, as a call's fixed cost stays). Once the arrivals need more than
  OVERLOADED of the current rung's speed, it takes the most accurate rung they need at most UP_HEADROOM of. Up to
  saturation (the full budget's speed) it never degrades on this ground, and it does not until a loaded batch at
  the full budget has been measured;
- the queue, for a burst the average has not seen yet: the images waiting behind the batch taken against
  `budget_queue_batches` full batches' time at the full budget, per runner (a closed loop of clients at
  saturation refills one batch while another runs, and waits no more). Past it, the most accurate rung that runs
  what waits within that time.

It goes down at once; back up only to a rung the arrivals have needed at most UP_HEADROOM of for HOLD_S, so noise
in one batch's queue does not move it, and an idle gap (one long sample of the arrival rate) brings it back to the
full budget at the next batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vitserve.artifact import ModelInfo
from vitserve.budgets import Rung
from vitserve.service.ground.errors import InvalidParameter

if TYPE_CHECKING:  # pydantic's settings stay out of the engine's interface: the peers' venvs import it without them
    from vitserve.service.ground.settings import Settings

FULL = 0  # the index of the full budget in a ladder


def served_ladder(info: ModelInfo, settings: Settings) -> tuple[Rung, ...]:
    """The rungs this server uses for a version of `info`, the full budget first (module doc)."""
    ladder = info.ladder
    full = ladder[0]
    kept = [full]
    for rung in ladder[1:]:
        if rung.accuracy is None or full.accuracy is None:
            if settings.budget_unmeasured_rungs:
                kept.append(rung)
        elif (full.accuracy - rung.accuracy) * 100 <= settings.budget_accuracy_floor + 1e-9:
            kept.append(rung)
    return tuple(kept)


def rung_for_tokens(ladder: tuple[Rung, ...], max_tokens: int | None) -> int:
    """The index of the most accurate served rung within `max_tokens` (None: the full budget); InvalidParameter
    when even the cheapest has more tokens."""
    if max_tokens is None or max_tokens >= ladder[FULL].tokens:
        return FULL
    for index, rung in enumerate(ladder):
        if rung.tokens <= max_tokens:
            return index
    served = ", ".join(str(r.tokens) for r in ladder)
    raise InvalidParameter(f"max_tokens={max_tokens} is below the cheapest budget this model serves "
                           f"({ladder[-1].tokens} tokens; it serves {served})")


@dataclass(frozen=True)
class BudgetAsk:
    """What a request asks of its images' budget: the rung (an index into the served ladder) and whether load may
    answer it cheaper still (`degrade=never`: refused with 429 instead)."""

    rung: int = FULL
    degradable: bool = True


FULL_BUDGET = BudgetAsk()


class BudgetController:
    """The rung of the degradable work, chosen per batch (module doc). `costs`: each served rung's multiply-adds
    relative to the full budget, the full budget's 1.0 first: the estimate of a rung's speed until batches at it
    have been measured (a light model's rungs save less than their multiply-adds: a call's fixed cost stays)."""

    HOLD_S = 0.5
    OVERLOADED = 1.0  # arrivals needing more than a rung's speed: a cheaper rung, with headroom
    UP_HEADROOM = 0.8  # the share of a rung's speed the arrivals may need for it to be chosen (or gone back up to)
    RATE_HALF_LIFE_S = 0.25

    def __init__(self, costs: list[float], queue_batches: float):
        self.costs = costs
        self.queue_batches = queue_batches
        self.rung = FULL
        self.arrival_rate = 0.0  # images a second, a moving average
        self._arrived = 0
        self._rate_since: float | None = None
        self._fits_since: list[float | None] = [None] * len(costs)  # since when each rung had headroom
        self._image_s: dict[int, float] = {}  # rung -> seconds an image in a loaded batch, a moving average

    def arrived(self) -> None:
        self._arrived += 1

    def ran(self, rung: int, images: int, seconds: float, loaded: bool) -> None:
        """A batch at `rung` ran; `loaded`: it was as large as load makes them (a small one's image costs more)."""
        if loaded and images:
            previous = self._image_s.get(rung)
            sample = seconds / images
            self._image_s[rung] = sample if previous is None else 0.8 * previous + 0.2 * sample

    def image_seconds(self, full_image_s: float) -> list[float]:
        """Each rung's seconds an image in a loaded batch: measured, else the full budget's (measured, else
        `full_image_s`, the batcher's estimate) times the rung's cost."""
        base = self._image_s.get(FULL) or full_image_s
        return [self._image_s.get(i) or base * cost for i, cost in enumerate(self.costs)]

    def share(self, rung: int, full_image_s: float) -> float:
        """A rung's work over the full budget's, as measured (or estimated)."""
        seconds = self.image_seconds(full_image_s)
        return seconds[rung] / seconds[FULL] if seconds[FULL] > 0 else self.costs[rung]

    def choose(self, now: float, queued: int, full_image_s: float, batch_images: int, runners: int) -> int:
        """The rung for the degradable batch taken now. `queued`: images queued, the batch being taken among them;
        `full_image_s`: the batcher's estimate of an image's seconds at the full budget (0: nothing run yet);
        `batch_images`: a full batch."""
        sampled_since = self._update_rate(now)
        seconds = self.image_seconds(full_image_s)
        if seconds[FULL] <= 0:
            return self.rung
        cheapest = len(seconds) - 1
        use = [self.arrival_rate * s / runners for s in seconds]  # the share of each rung's speed the arrivals need
        by_rate = FULL
        if FULL in self._image_s and use[self.rung] > self.OVERLOADED:  # past what the rung serves: headroom
            by_rate = next((i for i, u in enumerate(use) if u <= self.UP_HEADROOM), cheapest)
        waiting = max(0, queued - batch_images)  # behind this batch
        allowed_s = self.queue_batches * batch_images * seconds[FULL]  # that many full batches' wall time
        by_queue = next((i for i, s in enumerate(seconds) if waiting * s / runners <= allowed_s), cheapest)
        for i, u in enumerate(use):
            if u > self.UP_HEADROOM:
                self._fits_since[i] = None
            elif self._fits_since[i] is None:
                self._fits_since[i] = sampled_since  # the rate that fits was measured since then
        needed = max(by_rate, by_queue)
        if needed >= self.rung:
            self.rung = needed  # down (or stay) at once
        else:
            held = [i for i in range(needed, self.rung)
                    if (since := self._fits_since[i]) is not None and now - since >= self.HOLD_S]
            if held:
                self.rung = held[0]
        return self.rung

    def _update_rate(self, now: float) -> float:
        """The arrival rate's moving average brought to `now`; since when the sample it took was measured (an idle
        gap is one long sample: a rung that fits then fits from the gap's start)."""
        if self._rate_since is None:
            self._rate_since, self._arrived = now, 0
            return now
        since = self._rate_since
        elapsed = now - since
        if elapsed < 0.02:  # too short to measure a rate from
            return now
        rate = self._arrived / elapsed
        keep = math.exp(-elapsed * math.log(2) / self.RATE_HALF_LIFE_S)
        self.arrival_rate = keep * self.arrival_rate + (1 - keep) * rate
        self._rate_since, self._arrived = now, 0
        return since
