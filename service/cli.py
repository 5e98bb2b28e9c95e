"""`vitserve serve --model MODEL.onnx [--host H] [--port P] [--workers N] ...`

Every `Settings` field is a flag (`--max-batch-size 32` is `VITSERVE_MAX_BATCH_SIZE=32`): the flags are
written into the environment, so uvicorn's worker processes build the very same `Settings`.
Only the standard library and `service.settings` are imported until the command runs.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import sys
import typing

if typing.TYPE_CHECKING:
    from service.settings import Settings

ENV_PREFIX = "VITSERVE_"


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    from service.settings import INTERNAL, Settings
    parser = subparsers.add_parser(
        "serve", help="serve an exported model over HTTP (FastAPI + uvicorn, dynamic batching)",
        description="Serve a vitserve ONNX model. Each flag also reads from its VITSERVE_* environment variable.")
    parser.add_argument("--model", dest="model_path", metavar="MODEL.onnx",
                        help="the exported model (VITSERVE_MODEL_PATH)")
    parser.add_argument("--ray", action="store_true", default=None,
                        help="serve on Ray Serve: Ray's HTTP proxy in front of --ray-replicas replicas, each one "
                             "session and batcher (needs `pip install \"vitserve[ray]\"`; docs/ray.md)")
    for name, field in Settings.model_fields.items():
        if name == "model_path" or field.description == INTERNAL:
            continue
        default = field.default if field.default_factory is None else "(derived)"
        described = f"{field.description}; " if field.description else ""
        help_text = f"{described}env {ENV_PREFIX}{name.upper()}, default {default}"
        parser.add_argument("--" + name.replace("_", "-"), dest=name, metavar=_metavar(field.annotation),
                            help=help_text.replace("%", "%%"))
    parser.set_defaults(func=run_serve)
    return parser


def _metavar(annotation) -> str:
    if typing.get_origin(annotation) is typing.Literal:
        return "{" + ",".join(map(str, typing.get_args(annotation))) + "}"
    text = str(annotation)
    for needle, metavar in (("list", "A,B"), ("bool", "BOOL"), ("int", "N"), ("float", "X"), ("Path", "PATH")):
        if needle in text:
            return metavar
    return "VALUE"


def run_serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from service.errors import ModelLoadError
    from service.settings import Settings
    from vitserve.artifact import ArtifactError
    from vitserve.onnx_header import read_model_info

    for name, value in vars(args).items():
        if name not in ("command", "func", "ray") and value is not None:
            os.environ[ENV_PREFIX + name.upper()] = str(value)
    try:
        settings = Settings()
        info = read_model_info(settings.model_path)  # cheap: no session yet
    except ValidationError as e:
        print(f"vitserve serve: invalid settings:\n{e}", file=sys.stderr)
        return 2
    except ArtifactError as e:
        print(f"vitserve serve: cannot serve {settings.model_path}: {e}", file=sys.stderr)
        return 2
    if getattr(args, "ray", None):
        return _serve_on_ray(settings)
    metrics_dir = None
    if settings.http_workers > 1 or settings.engine == "process":
        from service.metrics_files import prepare_multiprocess_dir
        metrics_dir, made = prepare_multiprocess_dir()
        metrics_dir = metrics_dir if made else None  # a directory the user named is theirs to keep
    configure_logging(settings.log_level)
    logging.getLogger("vitserve.cli").info(
        "serving %s %s from %s on http://%s:%d: %d HTTP worker(s), engine %s", info.name, info.version,
        settings.model_path, settings.host, settings.port, settings.http_workers, settings.engine)
    try:
        with _engines(settings) as settings:
            serve_with_uvicorn("service.app:app_from_env", settings)
    except ModelLoadError as e:
        logging.getLogger("vitserve.cli").error("cannot start: %s", e)
        return 1
    finally:
        if metrics_dir:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    return 0


def _serve_on_ray(settings: Settings) -> int:
    try:
        from service.ray_serve import run_on_ray
    except ImportError as e:
        print(f"vitserve serve --ray: Ray Serve is not installed ({e}): pip install \"vitserve[ray]\"",
              file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    return run_on_ray(settings)


@contextlib.contextmanager
def _engines(settings: Settings):
    """With engine=process: the engine processes running (stopped after the HTTP workers have drained), and the
    settings that tell the workers where they are."""
    if settings.engine != "process":
        yield settings
        return
    from service.engine.supervisor import EngineSupervisor
    with EngineSupervisor(settings) as supervisor:
        os.environ[ENV_PREFIX + "ENGINE_ADDRESSES"] = ",".join(supervisor.addresses)
        yield settings.model_copy(update={"engine_addresses": supervisor.addresses})


# uvicorn's own graceful timeout comes this long after the service's drain (service/state.py), so requests
# still waiting at the end of the drain get the service's JSON 503, never uvicorn's cancellation.
DRAIN_MARGIN_S = 1.0


def uvicorn_options(settings: Settings) -> dict:
    """The uvicorn options a `vitserve serve` process runs with, from its `Settings`."""
    from service.http_protocol import uvicorn_http_options  # imports uvicorn and httptools: only when serving
    return {"host": settings.host, "port": settings.port, "workers": settings.http_workers,
            "log_level": settings.log_level, "limit_concurrency": settings.limit_concurrency,
            "timeout_graceful_shutdown": settings.drain_timeout_s + DRAIN_MARGIN_S,
            **uvicorn_http_options(settings)}


def serve_with_uvicorn(app_factory_path: str, settings: Settings) -> None:
    """Run uvicorn on the app that `app_factory_path` ('module:function') builds, with `uvicorn_options`.

    `vitserve serve` and the benchmark's bare endpoint (bench/servers.py) both start here, so the bare
    endpoint measures the HTTP floor under exactly the options the real server has.
    """
    import uvicorn
    # uvicorn drains on these, then raises the signal again under the handler it found: a drained server
    # exits 0 rather than dying of its signal (143 or a KeyboardInterrupt traceback).
    previous = {number: signal.signal(number, _exit_cleanly) for number in (signal.SIGTERM, signal.SIGINT)}
    try:
        uvicorn.run(app_factory_path, factory=True, **uvicorn_options(settings))
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _exit_cleanly(number, frame) -> None:
    raise SystemExit(0)


def configure_logging(level: str) -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
