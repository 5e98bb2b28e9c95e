"""`python -m vitserve.bench.ipc_round_trip`: what one round trip between two processes costs, the way an HTTP
worker reaches its engine process (service/engine/remote.py, server.py: pyzmq's asyncio sockets, DEALER to ROUTER
over `ipc://`, uvloop on both sides), beside an asyncio Unix-domain stream between the same two processes.

A lone request pays this once on its way to the engine and back (the latency budget's `engine_hop`,
docs/latency-budget.md). ZeroMQ moves each message through an I/O thread on each side: four more thread wake-ups
per round trip than a stream read by the event loop itself, and a wake-up costs most when the machine was idle,
so each arm is measured back to back and with an idle gap before each round trip. The arms alternate within each
round (the order reversed every other round). The echoing process answers on its event loop, as the engine's
receive loop does.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import tempfile
import time
from pathlib import Path

import zmq
import zmq.asyncio

from vitserve.bench.report import at_least, command_line, publish
from vitserve.machine import cpu_model_name, load_average

MESSAGE = b"x" * 128  # about a Submit's size (service/engine/messages.py): the pixels travel in shared memory


def _install_uvloop() -> None:
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass


def _echo_zeromq(address: str) -> None:
    _install_uvloop()

    async def serve() -> None:
        router = zmq.asyncio.Context().socket(zmq.ROUTER)
        router.bind(address)
        while True:
            await router.send_multipart(await router.recv_multipart())

    asyncio.run(serve())


def _echo_stream(path: str) -> None:
    _install_uvloop()

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            writer.write(await reader.readexactly(len(MESSAGE)))

    async def serve() -> None:
        server = await asyncio.start_unix_server(echo, path)
        await server.serve_forever()

    asyncio.run(serve())


async def _zeromq_client(address: str):
    dealer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    dealer.connect(address)

    async def once() -> None:
        await dealer.send(MESSAGE)
        await dealer.recv()
    return once


async def _stream_client(path: str):
    for _ in range(200):  # the echoing process may still be starting
        try:
            reader, writer = await asyncio.open_unix_connection(path)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            await asyncio.sleep(0.01)
    else:
        raise RuntimeError(f"nothing listens at {path}")

    async def once() -> None:
        writer.write(MESSAGE)
        await reader.readexactly(len(MESSAGE))
    return once


async def _measure(once, count: int, gap_s: float) -> list[float]:
    for _ in range(50):
        await once()
    microseconds = []
    for _ in range(count):
        if gap_s:
            time.sleep(gap_s)  # idle, as a lone client's next request finds the engine
        started = time.perf_counter()
        await once()
        microseconds.append((time.perf_counter() - started) * 1e6)
    return microseconds


async def _run(args, folder: Path) -> dict:
    address, path = f"ipc://{folder}/zeromq.sock", str(folder / "stream.sock")
    spawn = multiprocessing.get_context("spawn")
    echoes = [spawn.Process(target=_echo_zeromq, args=(address,), daemon=True),
              spawn.Process(target=_echo_stream, args=(path,), daemon=True)]
    for echo in echoes:
        echo.start()
    try:
        arms = {"ZeroMQ (pyzmq asyncio, ipc)": await _zeromq_client(address),
                "asyncio Unix stream": await _stream_client(path)}
        results: dict[str, dict[str, list[float]]] = {arm: {} for arm in arms}
        for number in range(args.rounds):
            order = list(arms) if number % 2 == 0 else list(reversed(arms))
            for gap_ms in args.gaps_ms:
                for arm in order:
                    results[arm].setdefault(str(gap_ms), []).extend(
                        await _measure(arms[arm], args.count, gap_ms / 1000))
        return results
    finally:
        for echo in echoes:
            echo.kill()


def gaps_ms(text: str) -> list[float]:
    """`--gaps-ms`: milliseconds, comma separated, each from 0 to a second."""
    try:
        gaps = [float(gap) for gap in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds, comma separated, e.g. 0,3; got {text!r}") from None
    if not all(0 <= gap <= 1000 for gap in gaps):
        raise argparse.ArgumentTypeError(f"each gap from 0 to 1000 ms; got {text!r}")
    return gaps


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def markdown(results: dict, args, command: str, machine: str) -> str:
    lines = ["# One round trip between two processes", "",
             f"`{command}`: {machine}. A {len(MESSAGE)}-byte message echoed, {args.count} "
             f"round trips per arm, gap and round, the arms alternating (bench/ipc_round_trip.py says how).", "",
             "| transport | idle gap before each | p50 µs | p90 µs | p99 µs |", "|---|---:|---:|---:|---:|"]
    for arm, by_gap in results.items():
        for gap, values in by_gap.items():
            lines.append(f"| {arm} | {gap} ms | {statistics.median(values):.0f} | {percentile(values, 0.9):.0f} | "
                         f"{percentile(values, 0.99):.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vitserve.bench.ipc_round_trip",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=at_least(1), default=3)
    parser.add_argument("--count", type=at_least(1), default=1000, help="round trips per arm, gap and round")
    parser.add_argument("--gaps-ms", type=gaps_ms, default=[0.0, 3.0],
                        help="idle before each round trip, e.g. 0,3")
    parser.add_argument("--out", type=Path, help="write the Markdown report here too, its JSON beside it")
    args = parser.parse_args(argv)
    _install_uvloop()
    with tempfile.TemporaryDirectory() as folder:
        results = asyncio.run(_run(args, Path(folder)))
    machine = f"{cpu_model_name()}, {len(os.sched_getaffinity(0))} cores, load average {load_average()}"
    command = command_line("python -m vitserve.bench.ipc_round_trip", argv)
    publish(markdown(results, args, command, machine), results, args.out)


if __name__ == "__main__":
    main()
