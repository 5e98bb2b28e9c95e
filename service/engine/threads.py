"""Threads with a lowered CPU priority, for a model configured with `cpu_priority` (service/repository/layout.py).

Linux keeps a scheduling policy and a nice value per thread, and a thread starts with its creator's: a lowered
thread that creates an ONNX Runtime session lowers the session's intra-op threads too, and the batch runner that
calls it computes lowered. Lowering needs no privilege; raising back would, so these threads are never reused for
other work.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Literal, TypeVar

T = TypeVar("T")
CpuPriority = Literal["normal", "low", "idle"]
LOW_NICE = 10  # the kernel weighs nice 10 at about a tenth of nice 0

log = logging.getLogger("vitserve.engine")


def lower_thread_priority(priority: CpuPriority) -> None:
    """The calling thread at `priority`: "normal" leaves it as it is; "low" adds LOW_NICE to its nice value;
    "idle" is SCHED_IDLE: it runs only when no other thread of the machine wants the core, and a waking thread
    preempts it at once. Where the system refuses (no such call, a sandbox), a warning and normal priority."""
    if priority == "normal":
        return
    thread = threading.get_native_id()
    try:
        if priority == "idle":
            os.sched_setscheduler(thread, os.SCHED_IDLE, os.sched_param(0))
        else:
            os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + LOW_NICE))
    except (AttributeError, OSError) as e:
        log.warning("cannot lower a model thread to cpu_priority %s (%s); it runs at normal priority", priority, e)


async def run_on_new_thread(call: Callable[[], T], priority: CpuPriority = "normal") -> T:
    """`call()` on a thread of its own at `priority` (on asyncio's shared pool when "normal"), awaited. The thread
    is lowered as the batch runner's is: by its executor's initializer."""
    if priority == "normal":
        return await asyncio.to_thread(call)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{priority}-priority-loader",
                              initializer=lower_thread_priority, initargs=(priority,))
    try:
        return await asyncio.get_running_loop().run_in_executor(pool, call)
    finally:
        pool.shutdown(wait=False)  # the thread ends once `call` returns; nothing here waits for it
