"""`python -m vitserve.bench.interference`: a model's session alone and beside a process decoding photos.

A served model shares its cores with the work that feeds it: decoders, HTTP workers, the load generator. This times
the server's own session (service/engine/onnx_runtime.py, loaded as the engine loads it) at one batch size for
`--seconds` in two arrangements of the same cores: **one caller** of a session with a thread per core (what the
engine runs with one batch runner), and **a caller per core**, each calling a session of one thread (the batcher's
runners with `batch_runners` = cores). Each runs quiet and beside a neighbour process that decodes and prepares a
224x224 photo (scikit-image's astronaut as a PNG, the server's `prepare_image`) `--decode-rate` times a second,
the arrangements and the neighbour alternating in every round. Reported: images/s and the CPU time of this process
per image (all its threads).

An ONNX Runtime call's threads meet at the end of each parallel loop, and the caller busy-waits there for the
others: a thread that lost its core to the neighbour holds the call up while the caller spins. Sessions of one
thread have nothing to wait for.
"""
from __future__ import annotations

import argparse
import io
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from vitserve.bench.report import at_least, command_line, publish
from vitserve.machine import cpu_model_name, load_average

DEFAULT_MODEL = "vit-s16"
ARRANGEMENTS = ("one caller", "a caller per core")
NEIGHBOURS = ("quiet", "decoding beside")

# The neighbour: the server's own preparation of a photo, at a steady rate (not as fast as it can: a served model's
# decoders run as requests come). Its arguments: the model file, the PNG's path, images per second.
NEIGHBOUR = """
import sys, time
from pathlib import Path
from vitserve.service.engine.inference_model import read_model_file_info
from vitserve.service.usecases.preprocess import prepare_image
info, png, rate = read_model_file_info(Path(sys.argv[1])), Path(sys.argv[2]).read_bytes(), float(sys.argv[3])
due = time.perf_counter()
while True:
    prepare_image(png, info, resize="fit", max_bytes=1 << 26, max_pixels=1 << 26, max_tokens=1 << 16)
    due += 1 / rate
    time.sleep(max(0.0, due - time.perf_counter()))
"""


def photo_png(size: tuple[int, int]) -> bytes:
    from vitserve.bench.decode import photo

    buffer = io.BytesIO()
    photo(size).save(buffer, "PNG")
    return buffer.getvalue()


def timed(callers: list, pixels, seconds: float) -> tuple[float, float]:
    """Images/s and CPU ms per image of this process while each of `callers` calls its `run(pixels)` in a loop of
    its own for `seconds`."""
    stop, counts = time.perf_counter() + seconds, []

    def loop(run) -> None:
        done = 0
        while time.perf_counter() < stop:
            run(pixels)
            done += len(pixels)
        counts.append(done)

    started, cpu = time.perf_counter(), time.process_time()
    threads = [threading.Thread(target=loop, args=(run,)) for run in callers[1:]]
    for thread in threads:
        thread.start()
    loop(callers[0])
    for thread in threads:
        thread.join()
    images = sum(counts)
    return images / (time.perf_counter() - started), (time.process_time() - cpu) * 1000 / max(images, 1)


def run(args, command: str, work: Path) -> dict:
    import numpy as np

    from vitserve.bench.presets import resolve_model
    from vitserve.bench.raw import load_raw_model, preprocessed
    from vitserve.service.ground.processes import usable_cores

    path = resolve_model(args.model, Path("build/bench-models"))
    cores = usable_cores()
    wide = load_raw_model(path, {"VITSERVE_INTRA_OP_THREADS": str(cores)})
    narrow = load_raw_model(path, {"VITSERVE_INTRA_OP_THREADS": "1"})
    png = work / "photo.png"
    png.write_bytes(photo_png((224, 224)))
    pixels = np.ascontiguousarray(np.repeat(preprocessed(wide, [photo_png(wide.info.image_size[::-1])]),
                                            args.batch_size, axis=0))
    wide.run(pixels), narrow.run(pixels)  # each session's first call sets it up
    callers = {ARRANGEMENTS[0]: [wide.run], ARRANGEMENTS[1]: [narrow.run] * cores}
    rows = []
    for round_ in range(args.rounds):
        for neighbour in NEIGHBOURS if round_ % 2 == 0 else NEIGHBOURS[::-1]:
            for arrangement in ARRANGEMENTS if round_ % 2 == 0 else ARRANGEMENTS[::-1]:
                process = None
                if neighbour != "quiet":
                    process = subprocess.Popen([sys.executable, "-c", NEIGHBOUR, str(path), str(png),
                                                str(args.decode_rate)])
                    time.sleep(1.0)  # its imports done: decoding
                try:
                    images_per_s, cpu_ms = timed(callers[arrangement], pixels, args.seconds)
                finally:
                    if process is not None:
                        process.kill()
                        process.wait()
                row = {"round": round_ + 1, "neighbour": neighbour, "arrangement": arrangement,
                       "images_per_s": round(images_per_s, 2), "cpu_ms_per_image": round(cpu_ms, 1)}
                print(f"  round {row['round']} {neighbour:16s} {arrangement:18s} {images_per_s:7.2f} images/s "
                      f"{cpu_ms:7.1f} ms CPU per image", flush=True)
                rows.append(row)
    return {"command": command, "machine": {"cpu": cpu_model_name(), "cores": cores, "load_average": load_average()},
            "model": str(path), "batch_size": args.batch_size, "decode_rate": args.decode_rate, "rows": rows}


def markdown(report: dict) -> str:
    machine = report["machine"]
    lines = ["# A model's session alone and beside a process decoding photos", "",
             f"`{report['command']}`, {machine['cpu']} ({machine['cores']} cores), load average before "
             f"{machine['load_average']}. Model `{report['model']}`, batch {report['batch_size']}; the neighbour "
             f"prepares {report['decode_rate']:g} photos a second (bench/interference.py).", "",
             "| neighbour | arrangement | images/s (rounds) | CPU ms per image (rounds) | images/s, median |",
             "| --- | --- | --- | --- | ---: |"]
    for neighbour in NEIGHBOURS:
        for arrangement in ARRANGEMENTS:
            rows = [r for r in report["rows"] if (r["neighbour"], r["arrangement"]) == (neighbour, arrangement)]
            lines.append(f"| {neighbour} | {arrangement} | {' / '.join(str(r['images_per_s']) for r in rows)} | "
                         f"{' / '.join(str(r['cpu_ms_per_image']) for r in rows)} | "
                         f"{statistics.median(r['images_per_s'] for r in rows):.2f} |")
    lines += ["", "A caller per core against one caller, round by round: "
              + "; ".join(f"{neighbour} " + ", ".join(f"{ratio:.2f}x" for ratio in ratios(report, neighbour))
                          for neighbour in NEIGHBOURS) + "."]
    return "\n".join(lines) + "\n"


def ratios(report: dict, neighbour: str) -> list[float]:
    by_round: dict[int, dict[str, float]] = {}
    for row in report["rows"]:
        if row["neighbour"] == neighbour:
            by_round.setdefault(row["round"], {})[row["arrangement"]] = row["images_per_s"]
    return [r[ARRANGEMENTS[1]] / r[ARRANGEMENTS[0]] for _, r in sorted(by_round.items())]


def main(argv: list[str] | None = None) -> None:
    import tempfile

    parser = argparse.ArgumentParser(prog="python -m vitserve.bench.interference",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="an ONNX file or a preset (bench/presets.py)")
    parser.add_argument("--batch-size", type=at_least(1), default=4)
    parser.add_argument("--seconds", type=at_least(1), default=8, help="per arrangement, neighbour and round")
    parser.add_argument("--rounds", type=at_least(1), default=3)
    parser.add_argument("--decode-rate", type=at_least(1), default=16, help="photos the neighbour prepares a second")
    parser.add_argument("--out", type=Path, help="the Markdown report; its JSON beside it")
    args = parser.parse_args(argv)
    if args.model.endswith(".onnx") and not Path(args.model).is_file():
        parser.error(f"--model: no file {args.model}")  # a preset's name `resolve_model` checks itself
    with tempfile.TemporaryDirectory(prefix="vitserve-interference-") as work:
        report = run(args, command_line("python -m vitserve.bench.interference", argv), Path(work))
    publish(markdown(report), report, args.out)


if __name__ == "__main__":
    main()
