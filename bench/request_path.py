"""`python -m vitserve.bench.request_path --baseline-commit REV`: one inference request's way through the service's
code, in stops and rooms, for this tree and a commit before it (the path before and after a change of the layers).

A request is sent to an in-process app (the bundled model, the engine in the process, gRPC on a free port) as HTTP
`POST /v2/models/NAME/infer` (a JSON `pixel_values` tensor), as HTTP `POST /v1/classify` (a PNG) and as gRPC
`ModelInfer` (the same tensor). While it runs, a profiler on the event loop's thread records every call of a
function in `service/`: a **stop** is one function call (a coroutine resumed is the same stop), a **room** is a
module, a **visit** is an entry into a room from another one, in the order the calls began. The engine's batch
threads and the decode pool are not traced: this is the front end's path, from the transport to the engine's
`submit` and back. Each request is sent 5 times after a warm-up and the run with the fewest stops is kept (a
background timer can add stops to one run; the loop-lag probe's are left out).

Each tree runs in its own process (`python -P bench/request_path.py --trace` with PYTHONPATH at the tree), so the
same tracer reads both; the baseline is exported with `git archive` (bench/peers/servers.py `export_commit`).
"""
from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "models" / "vit-fmnist" / "model.onnx"
# Timers of the process, not of the request, that can fire while it runs
BACKGROUND = ("LoopLag.",)
KINDS = ("http /v2 infer (JSON tensor)", "http /v1/classify (PNG)", "grpc ModelInfer (tensor)")


def trace(model: Path, runs: int = 5) -> dict:
    """In the tree on sys.path: each kind of request's stops, rooms and visits (the run with the fewest stops)."""
    import numpy as np
    from PIL import Image

    import vitserve.service
    # as Python loaded it (frames carry that path): vitserve/service, a link to service/, in a tree that has links
    service_dir = str(Path(vitserve.service.__file__).parent)
    return asyncio.run(_trace(model, service_dir, np, Image, runs))


async def _trace(model: Path, service_dir: str, np, Image, runs: int) -> dict:
    import grpc
    import httpx

    from vitserve.bench.servers import free_port
    from vitserve.service.app import create_app
    from vitserve.service.ground.settings import Settings
    from vitserve.service.grpc.generated import grpc_service_pb2 as pb
    from vitserve.service.grpc.generated import grpc_service_pb2_grpc as pb_grpc

    port = free_port()
    # no shedding on loop lag: the profiler itself slows the loop down
    settings = Settings(model_path=str(model), grpc_port=port, log_level="warning", max_loop_lag_ms=0,
                        overload_queue_ms=0)
    app = create_app(settings, serve_grpc=True)
    results = {}
    async with app.router.lifespan_context(app):
        while not app.state.service.ready:
            await asyncio.sleep(0.05)
        info = app.state.service.engine.route(None, None).info
        name, shape = info.name, [1, info.channels, *info.image_size]
        pixels = np.random.default_rng(0).normal(size=shape).astype(np.float32)
        tensor = {"name": "pixel_values", "shape": shape, "datatype": "FP32", "data": pixels.ravel().tolist()}
        body = json.dumps({"inputs": [tensor]}).encode()
        png = io.BytesIO()
        gray = (np.random.default_rng(1).random(tuple(shape[2:])) * 255).astype(np.uint8)
        Image.fromarray(gray).convert("RGB" if info.channels == 3 else "L").save(png, "PNG")
        grpc_request = pb.ModelInferRequest(model_name=name, inputs=[pb.ModelInferRequest.InferInputTensor(
            name="pixel_values", datatype="FP32", shape=shape)], raw_input_contents=[pixels.tobytes()])
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://vitserve") as client, \
                grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            sends = {
                KINDS[0]: lambda: client.post(f"/v2/models/{name}/infer", content=body),
                KINDS[1]: lambda: client.post("/v1/classify", content=png.getvalue(),
                                              headers={"content-type": "image/png"}),
                KINDS[2]: lambda: stub.ModelInfer(grpc_request),
            }
            for kind, send in sends.items():
                await send()  # warm-up: first-call imports and caches
                traced = [await _traced(send, service_dir) for _ in range(runs)]
                results[kind] = min(traced, key=lambda run: run["stops"])
    return results


async def _traced(send, service_dir: str) -> dict:
    frames, order = {}, []

    def profiler(frame, event, arg):
        if (event == "call" and frame.f_code.co_filename.startswith(service_dir) and id(frame) not in frames
                and not frame.f_code.co_qualname.startswith(BACKGROUND)):
            frames[id(frame)] = frame  # kept alive so that its id is not reused within the run
            module = os.path.relpath(frame.f_code.co_filename, os.path.dirname(service_dir))
            order.append((module, frame.f_code.co_qualname))

    sys.setprofile(profiler)
    try:
        answer = await send()
    finally:
        sys.setprofile(None)
    status = getattr(answer, "status_code", 200)
    assert status == 200, status
    rooms = Counter(module for module, _ in order)
    visits: Counter[str] = Counter()
    previous = None
    for module, _ in order:
        if module != previous:
            visits[module] += 1
        previous = module
    return {"stops": len(order), "rooms": len(rooms), "visits": sum(visits.values()),
            "by_room": {module: {"stops": rooms[module], "visits": visits[module]} for module in rooms},
            "path": [f"{module}:{name}" for module, name in order]}


def run_tree(tree: Path, model: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "VITSERVE_LOG_LEVEL": "warning"}
    out = subprocess.run([sys.executable, "-P", str(Path(__file__).resolve()), "--trace", "--model", str(model)],
                         env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"tracing {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _room_cell(side: dict, module: str) -> str:
    return f"{side[module]['stops']} ({side[module]['visits']})" if module in side else ""


def report(results: dict, baseline: str, head: str) -> str:
    lines = ["# One request's path through the service, before and after", "",
             f"`python -m vitserve.bench.request_path --baseline-commit {baseline[:12]}`: this tree ({head}) and "
             f"commit `{baseline[:12]}`, each in its own process, the bundled model, the engine in the process. "
             f"See bench/request_path.py for what a stop, a room and a visit are (the front end's event-loop thread "
             f"only, from the transport to the engine's submit and back; the fewest stops of 5 runs).", "",
             "| request | before: stops / rooms / visits | after: stops / rooms / visits |", "|---|---|---|"]
    for kind in KINDS:
        b, a = results["before"][kind], results["after"][kind]
        lines.append(f"| {kind} | {b['stops']} / {b['rooms']} / {b['visits']} | {a['stops']} / {a['rooms']} / "
                     f"{a['visits']} |")
    for kind in KINDS:
        lines += ["", f"## {kind}", "", "| room | before: stops (visits) | after: stops (visits) |", "|---|---|---|"]
        before, after = results["before"][kind]["by_room"], results["after"][kind]["by_room"]
        for module in sorted(set(before) | set(after)):
            lines.append(f"| `{module}` | {_room_cell(before, module)} | {_room_cell(after, module)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vitserve.bench.request_path", description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-commit", help="the commit to compare with (git archive of it)")
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--out", type=Path, help="write the Markdown report here, and its JSON beside it")
    parser.add_argument("--trace", action="store_true", help=argparse.SUPPRESS)  # the child: print one tree's JSON
    args = parser.parse_args(argv)
    if args.trace:
        print(json.dumps(trace(args.model.resolve())))
        return
    if not args.baseline_commit:
        parser.error("--baseline-commit is required")
    from vitserve.bench.peers.servers import export_commit
    from vitserve.bench.report import publish
    with tempfile.TemporaryDirectory() as work:
        baseline_tree, sha = export_commit(args.baseline_commit, Path(work))
        results = {"before": run_tree(baseline_tree, args.model.resolve()),
                   "after": run_tree(REPO, args.model.resolve())}
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True,
                          text=True).stdout.strip() + (" with uncommitted changes" if dirty else "")
    publish(report(results, sha, head), {"baseline": sha, "head": head, **results}, args.out)


if __name__ == "__main__":
    main()
