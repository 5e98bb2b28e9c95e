"""`EngineSupervisor`: `vitserve serve`'s side of the engine processes: one per device, restarted when one dies,
stopped after the HTTP frontends have drained.

On CPU there is one engine (it uses every core through ONNX Runtime's threads); with the CUDA or TensorRT
provider, one per device in `cuda_device_ids`. The frontends find them through `Settings.engine_addresses`
(ZeroMQ `ipc://` sockets in a private directory).
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from vitserve.service.engine.providers import GPU_PROVIDERS, ORT_PROVIDERS
from vitserve.service.engine.shm import remove_orphaned_segments
from vitserve.service.ground.errors import ModelLoadError
from vitserve.service.ground.settings import Settings

log = logging.getLogger("vitserve.supervisor")

RESTART_DELAY_S = 1.0  # between an engine's death and its restart: a crash loop must not spin
SWEEP_INTERVAL_S = 10.0
LOAD_TIMEOUT_S = 600.0  # a TensorRT engine build can take minutes


@dataclass(eq=False)
class _Engine:
    device: int | None
    address: str
    settings: Settings
    process: BaseProcess | None = None
    started: Connection | None = None  # the pipe end its process reports the model's loading on
    restarts: int = 0


def engine_devices(settings: Settings, available: list[str]) -> list[int | None]:
    """One engine per device: the CUDA devices named when a GPU provider is asked for first and this
    onnxruntime build has it (`available`), else one for the CPU."""
    first = ORT_PROVIDERS[settings.providers[0]]
    if first in GPU_PROVIDERS and first in available:
        return list(settings.cuda_device_ids or [settings.cuda_device_id])
    return [None]


class EngineSupervisor:
    def __init__(self, settings: Settings):
        import onnxruntime
        self._context = multiprocessing.get_context("spawn")
        self._stop = self._context.Event()
        self._directory = tempfile.mkdtemp(prefix="vitserve-")  # short: ipc paths have a ~100-byte limit
        self._engines = [
            _Engine(device, f"ipc://{self._directory}/engine-{i}",
                    settings.model_copy(update={"cuda_device_id": device} if device is not None else {}))
            for i, device in enumerate(engine_devices(settings, onnxruntime.get_available_providers()))]
        self._stopping = False
        self._watchdog: threading.Thread | None = None

    @property
    def addresses(self) -> list[str]:
        return [engine.address for engine in self._engines]

    def start(self) -> None:
        """Start every engine and wait until each has loaded the model (warm-up goes on in the background);
        ModelLoadError if one cannot: a bad model stops startup."""
        waiting = [self._spawn(engine) for engine in self._engines]
        for engine, started in zip(self._engines, waiting):
            failure = self._load_outcome(engine, started)
            if failure is not None:
                self.stop(timeout_s=5)
                raise ModelLoadError(failure)
        self._watchdog = threading.Thread(target=self._watch, name="engine-watchdog", daemon=True)
        self._watchdog.start()

    def _spawn(self, engine: _Engine) -> Connection:
        """Start `engine`'s process; the pipe end that will say whether it loaded the model."""
        from vitserve.service.engine.server import run_engine_process
        receiving, sending = self._context.Pipe(duplex=False)
        process = self._context.Process(target=run_engine_process, name=f"vitserve-engine-{engine.device}",
                                        args=(engine.settings, engine.address, self._stop, os.getpid(), sending))
        engine.process = process
        if engine.started is not None:
            engine.started.close()
        process.start()
        engine.started = receiving
        sending.close()  # the child's copy is the one that counts: a child that dies closes the pipe
        log.info("started engine process %d for %s at %s", process.pid,
                 "the CPU" if engine.device is None else f"CUDA device {engine.device}", engine.address)
        return receiving

    @staticmethod
    def _load_outcome(engine: _Engine, started: Connection) -> str | None:
        if not started.poll(LOAD_TIMEOUT_S):
            return f"the engine did not load the model in {LOAD_TIMEOUT_S:.0f} s"
        try:
            return started.recv()
        except EOFError:
            assert engine.process is not None, "_spawn started it"
            engine.process.join(5)
            return f"the engine process exited with {engine.process.exitcode} before loading the model"

    def _watch(self) -> None:
        sweep_at = 0.0
        while not self._stopping:
            if time.monotonic() >= sweep_at:  # killed HTTP workers' shared memory
                for name in remove_orphaned_segments():
                    log.warning("removed shared memory %s of an HTTP worker that is gone", name)
                sweep_at = time.monotonic() + SWEEP_INTERVAL_S
            for engine in self._engines:
                process = engine.process
                assert process is not None, "start() spawned every engine before the watch"
                if self._stopping or process.is_alive():
                    continue
                log.error("engine process %d exited with %s; restarting it in %.0f s", process.pid,
                          process.exitcode, RESTART_DELAY_S)
                time.sleep(RESTART_DELAY_S)
                if not self._stopping:
                    engine.restarts += 1
                    self._spawn(engine)  # its frontends see it come back through its status
            time.sleep(0.2)

    def stop(self, timeout_s: float) -> None:
        """Let each engine run what it holds and exit (up to `timeout_s`), then make sure it has."""
        self._stopping = True
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for engine in self._engines:
            if engine.process is not None:
                engine.process.join(max(0.0, deadline - time.monotonic()))
                if engine.process.is_alive():
                    log.warning("engine process %d did not stop in time; killing it", engine.process.pid)
                    engine.process.kill()
                    engine.process.join(5)
        shutil.rmtree(self._directory, ignore_errors=True)

    def __enter__(self) -> EngineSupervisor:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop(self._engines[0].settings.drain_timeout_s + 5)
