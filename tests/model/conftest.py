"""Fixtures of the training tests (helpers in training_fixtures.py): a real Ctrl-C in the middle of a step."""
from __future__ import annotations

import itertools
import os
import signal

import pytest


@pytest.fixture
def interrupt_at_step(monkeypatch):
    """interrupt_at_step(n): a real SIGINT to this process while the n-th training batch is being augmented."""
    import vitserve.model.train

    def arm(n: int) -> None:
        calls, augment_batch = itertools.count(1), vitserve.model.train.augment_batch

        def augment_then_interrupt(*args, **kwargs):
            if next(calls) == n:
                os.kill(os.getpid(), signal.SIGINT)
            return augment_batch(*args, **kwargs)

        monkeypatch.setattr(vitserve.model.train, "augment_batch", augment_then_interrupt)

    return arm
