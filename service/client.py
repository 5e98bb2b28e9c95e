"""`vitserve predict IMAGE...`: the top-k classes of each image as a table, and with `--out-dir` its map overlay as
a PNG there (nothing is written without it: an image's own folder is no place for our output).

With `--url` the images go to a running server (`POST /v1/classify`); without, to the service's own app in this
process (the same use case, plan, preprocessing and encoding as `vitserve serve`; no port opened), so the answers
are the server's. Either way one image's failure is reported on its row and the others go on.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import logging
import math
import mimetypes
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path

from vitserve.help_format import DefaultsHelpFormatter

DEFAULT_MODEL = Path("models/vit-fmnist/model.onnx")
# The long side an overlay file gets at least: the server draws it at the input's size, and a 28x28 Fashion-MNIST
# overlay is a speck on a screen.
MIN_OVERLAY_SIDE = 224


@dataclass
class Prediction:
    """One image's answer, from either backend."""

    image: Path
    predictions: list[tuple[str, float]] = field(default_factory=list)  # (label, probability), best first
    overlay_png: bytes | None = None
    error: str | None = None  # "code: message" when the image failed


class Predictor:
    """One `POST /v1/classify` per image, the image as a multipart `file`: to a running server, or to the service's
    own app in this process (`in_process`), so a local answer is the server's, its calibrated scores, its plan
    (runtime and precision) and its maps included."""

    def __init__(self, client, top_k: int, resize: str, map_kind: str = "rollout", target: str | None = None):
        self.client = client  # an httpx.AsyncClient
        self.top_k, self.resize, self.map, self.target = top_k, resize, map_kind, target

    async def predict(self, image: Path, want_overlay: bool) -> Prediction:
        import httpx

        media_type = mimetypes.guess_type(image.name)[0] or "application/octet-stream"
        params: dict[str, str | int] = {"top_k": self.top_k, "resize": self.resize,
                                        "map": self.map if want_overlay else "none"}
        if want_overlay:
            params["map_format"] = "overlay"
        if want_overlay and self.target is not None:  # the server refuses a target without the map it explains
            params["target"] = self.target
        try:
            r = await self.client.post("/v1/classify", params=params,
                                       files={"file": (image.name, image.read_bytes(), media_type)})
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            raise ServerUnreachable(connect_failure(e)) from e
        except httpx.HTTPError as e:
            return Prediction(image, error=f"connection_failed: {self.client.base_url}: {e}")
        body = _json_or_none(r)
        if r.status_code != 200 or body is None:
            error = (body or {}).get("error", {})
            return Prediction(image, error=f"{error.get('code', f'http_{r.status_code}')}: "
                                           f"{error.get('message', r.text[:200])}")
        result = Prediction(image, [(p["label"], p["score"]) for p in body["predictions"]])
        shown = body.get(self.map) if want_overlay else None
        if shown:
            result.overlay_png = base64.b64decode(shown["data"])
        return result


class ServerUnreachable(Exception):
    """No connection to the `--url` server: every image would fail alike, so the command stops with one line."""


def connect_failure(error: Exception) -> str:
    """Why a connection failed, in a few words. The operating system's error is the innermost of the chain: over
    asyncio, httpx's own message for a refused connection is only "All connection attempts failed"."""
    import httpx

    links: list[BaseException] = [error]
    while (cause := links[-1].__cause__ or links[-1].__context__) is not None and cause not in links:
        links.append(cause)
    for link in reversed(links):
        if isinstance(link, ConnectionRefusedError):
            return "connection refused"
        if isinstance(link, socket.gaierror):
            return f"unknown host: {link.strerror}"
        if isinstance(link, TimeoutError | httpx.TimeoutException):
            return "no answer to the connection"
    return re.sub(r"^\[Errno -?\d+\]\s*", "", " ".join(str(error).split())) or type(error).__name__


def unreachable_line(url: str, reason: str) -> str:
    """The one line for a server that cannot be reached: the URL as given, why, and what to check."""
    return (f"vitserve predict: cannot reach {url} ({reason}): is `vitserve serve` running there, and is the URL "
            f"right?")


@contextlib.asynccontextmanager
async def in_process(model_path: Path):
    """An httpx client of the service's own app serving `model_path` in this process (its settings from the
    environment, as `vitserve serve`'s; no port opened), once the model is loaded and warmed up."""
    import httpx

    from vitserve.service.app import create_app
    from vitserve.service.engine.topology import engine_choice
    from vitserve.service.ground.settings import Settings

    settings = Settings(model_path=model_path, grpc_port=0, max_loop_lag_ms=None)
    # the thread count `vitserve serve` would give the model (a light one: one, as in each worker), so that the
    # answers are the server's bit for bit
    choice = engine_choice(settings)
    threads = int(choice.pinned.get("INTRA_OP_THREADS", settings.intra_op_threads)) if choice else \
        settings.intra_op_threads
    settings = settings.model_copy(update={"engine": "inline", "workers": 1, "intra_op_threads": threads})
    app = create_app(settings)
    async with quiet_server_log(), app.router.lifespan_context(app):
        engine = app.state.service.engine
        if not await engine.warmed_up():
            reasons = "; ".join(entry.reason for entry in await engine.index() if entry.reason)
            raise SystemExit(f"vitserve predict: {model_path} cannot be served: {reasons or 'it did not load'}")
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://vitserve.in-process") as client:
            yield client


@contextlib.asynccontextmanager
async def quiet_server_log():
    """The server's own log at ERROR while the app runs here (the table is the output), as it was after."""
    logger = logging.getLogger("vitserve")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def checked_model(model_path: Path, map_kind: str, target: str | None) -> None:
    """A local model file that can be read, and the class to explain among its labels, before anything loads:
    SystemExit with the one-line reason otherwise."""
    from vitserve.service.engine.inference_model import read_model_file_info
    from vitserve.service.ground.errors import InvalidParameter, ModelLoadError
    from vitserve.service.usecases.explanations import relevance_target

    try:
        info = read_model_file_info(model_path)
        if map_kind == "relevance":
            relevance_target(target, info)
    except (ModelLoadError, InvalidParameter) as e:
        raise SystemExit(f"vitserve predict: {e}") from None


def _json_or_none(response) -> dict | None:
    try:
        body = response.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def overlay_path(image: Path, out_dir: Path, map_kind: str = "rollout") -> Path:
    """`photo.jpg` -> `out_dir/photo.rollout.png` (or `photo.relevance.png`)."""
    return out_dir / f"{image.stem}.{map_kind}.png"


def overlay_paths(images: list[Path], out_dir: Path, map_kind: str = "rollout") -> dict[Path, Path]:
    """Each image's overlay file, no two images of one command on the same file: `overlay_path`'s name, unless
    another image would get it too (`a.png` and `a.jpg`, or two folders' `a.png`); those keep their extension
    (`a.png.rollout.png`), and what still collides is numbered in the order given (`a.png.rollout-2.png`). An image
    named twice is one image, with one file."""
    unique = list(dict.fromkeys(images))
    plain = {image: overlay_path(image, out_dir, map_kind) for image in unique}
    shared = {path for path in plain.values() if list(plain.values()).count(path) > 1}
    chosen: dict[Path, Path] = {}
    taken = {path for path in plain.values() if path not in shared}
    for image in unique:
        path = plain[image]
        if path in shared:
            path = path.with_name(f"{image.name}.{map_kind}.png")
            number = 1
            while path in taken:
                number += 1
                path = path.with_name(f"{image.name}.{map_kind}-{number}.png")
        taken.add(path)
        chosen[image] = path
    return chosen


def display_size(png: bytes, min_side: int = MIN_OVERLAY_SIDE) -> bytes:
    """An overlay whose long side is below `min_side`, enlarged by the whole factor that reaches it, each pixel
    drawn as a block (nearest neighbour): the map's patch cells and the input's pixels stay sharp, not blurred into
    detail the model never saw."""
    from PIL import Image

    with Image.open(io.BytesIO(png)) as image:
        factor = math.ceil(min_side / max(image.size))
        if factor <= 1:
            return png
        larger = image.resize((image.width * factor, image.height * factor), Image.Resampling.NEAREST)
    buffer = io.BytesIO()
    larger.save(buffer, format="PNG")
    return buffer.getvalue()


def format_table(results: list[Prediction]) -> str:
    """One row per (image, rank); a failed image gets one row with its error."""
    rows = [("image", "rank", "label", "score")]
    for r in results:
        if r.error:
            rows.append((str(r.image), "-", "error", r.error))
        for rank, (label, score) in enumerate(r.predictions, 1):
            rows.append((str(r.image) if rank == 1 else "", str(rank), label, f"{score:.4f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [f"{a:<{widths[0]}}  {b:>{widths[1]}}  {c:<{widths[2]}}  {d}" for a, b, c, d in rows]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def add_predict_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "predict", help="classify images: a top-k table, and map overlay PNGs with --out-dir",
        description="Prints the top-k classes of each image. With --out-dir DIR, also writes its map over the image "
                    "as DIR/IMAGE.rollout.png (IMAGE.EXT.rollout.png where two images share a name); without it, "
                    "writes no file. With --url, asks a running server; otherwise runs the ONNX model here.",
        formatter_class=DefaultsHelpFormatter)
    p.add_argument("images", nargs="+", type=Path, metavar="IMAGE")
    p.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000 (default: run the model locally)")
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="the ONNX artifact, when running locally")
    p.add_argument("--top-k", type=int, default=5, help="classes to show per image")
    p.add_argument("--resize", choices=("fit", "native"), default="fit",
                   help="fit: scale and centre-crop to the trained size; native: keep the aspect ratio")
    p.add_argument("--out-dir", type=Path, metavar="DIR",
                   help="write each image's map overlay there as a PNG (default: no files written)")
    p.add_argument("--no-overlay", action="store_true", help="print the table only, even with --out-dir")
    p.add_argument("--map", choices=("rollout", "relevance"), default="rollout",
                   help="the overlay's map: attention rollout, or the relevance of a class (--target)")
    p.add_argument("--target", help="with --map relevance: the class to explain, index or label (default: top-1)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per request (--url)")
    p.set_defaults(func=run_predict)


def run_predict(args) -> int:
    """Exit status 0 when every image was classified (and its overlay written), 1 otherwise."""
    if args.top_k < 1:
        raise SystemExit("vitserve predict: --top-k must be at least 1")
    if args.target is not None and args.map != "relevance":
        raise SystemExit("vitserve predict: --target needs --map relevance")
    if args.url and not args.url.lower().startswith(("http://", "https://")):
        raise SystemExit(f"vitserve predict: --url takes http:// or https://, as in http://{args.url}")
    if not args.url:
        checked_model(args.model, args.map, args.target)
    want_overlay = args.out_dir is not None and not args.no_overlay
    if want_overlay:
        args.out_dir.mkdir(parents=True, exist_ok=True)
    try:
        results = asyncio.run(_predict_all(args, want_overlay))
    except ServerUnreachable as e:
        raise SystemExit(unreachable_line(args.url, str(e))) from None
    written = []
    destinations = overlay_paths(args.images, args.out_dir, args.map) if want_overlay else {}
    for result in results:
        if result.overlay_png:
            path = destinations[result.image]
            written.append((path, path.exists()))
            path.write_bytes(display_size(result.overlay_png))
    print(format_table(results))
    for path, existed in written:
        print(f"{'replaced' if existed else 'wrote'} {path}")
    if args.out_dir is None and not args.no_overlay and any(r.predictions for r in results):
        print(f"--out-dir DIR saves each image's {args.map} map over it as a PNG")
    return 1 if any(r.error for r in results) else 0


async def _predict_all(args, want_overlay: bool) -> list[Prediction]:
    import httpx

    client: contextlib.AbstractAsyncContextManager[httpx.AsyncClient]
    if args.url:
        client = httpx.AsyncClient(base_url=args.url.rstrip("/"), timeout=args.timeout)
    else:
        client = in_process(args.model)
    async with client as connected:
        predictor = Predictor(connected, args.top_k, args.resize, args.map, args.target)
        return [await predictor.predict(image, want_overlay) if image.is_file()
                else Prediction(image, error="not_found: no such file") for image in args.images]
