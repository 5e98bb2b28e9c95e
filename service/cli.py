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
    from vitserve.service.ground.settings import Settings

ENV_PREFIX = "VITSERVE_"


_SERVE_TEXT = dict(usage="vitserve serve [--model MODEL.onnx | --model-repository DIR] [options]",
                   description="Serve one vitserve ONNX model (--model) or a repository of models and versions "
                               "(--model-repository, laid out as Triton's: NAME/VERSION/model.onnx). Each flag also "
                               "reads from its VITSERVE_* environment variable.")


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """`vitserve serve`: every setting a flag; `--help` shows the common ones, `--help-all` every group."""
    from vitserve.service.ground.settings import SETTING_GROUPS
    more = sum(map(len, SETTING_GROUPS.values())) - len(SETTING_GROUPS["common"])
    parser = subparsers.add_parser(
        "serve", help="serve exported models over HTTP and gRPC (FastAPI + uvicorn, grpcio; dynamic batching)",
        **_SERVE_TEXT, epilog=f"{more} more options ({', '.join(list(SETTING_GROUPS)[1:])}): --help-all")
    parser.add_argument("--help-all", action=_HelpAll, nargs=0, help="show every option, grouped, and exit")
    _add_settings(parser, everything=False)
    parser.set_defaults(func=run_serve)
    return parser


class _HelpAll(argparse.Action):
    """Print the help of a parser that shows every group (the real one hides all but the common options)."""

    def __call__(self, parser, namespace, values, option_string=None):
        full = argparse.ArgumentParser(prog=parser.prog, **_SERVE_TEXT)
        _add_settings(full, everything=True)
        full.print_help()
        parser.exit()


def _add_settings(parser: argparse.ArgumentParser, everything: bool) -> None:
    from vitserve.service.ground.settings import SETTING_GROUPS, Settings
    for title, names in SETTING_GROUPS.items():
        shown = everything or title == "common"
        group = parser.add_argument_group(f"{title} options") if shown else parser
        for name in names:
            _add_setting(group, name, Settings.model_fields[name], shown)
            if name == "model_repository":
                group.add_argument("--ray", action="store_true", default=None,
                                   help="serve on Ray Serve: Ray's HTTP proxy in front of --ray-replicas replicas, "
                                        "each one session and batcher (`pip install \"vitserve[ray]\"`; docs/ray.md)")


# Flags spelt otherwise than their field: --model for model_path, and --load-model repeated (Triton's spelling)
_FLAG_NAMES = {"model_path": "--model", "load_models": "--load-model"}


# Defaults that the command derives rather than the Settings field's
_DEFAULTS_SHOWN = {"grpc_port": "--port + 1 when --port (or VITSERVE_PORT) is given, else 8001"}


def _add_setting(group, name: str, field, shown: bool) -> None:
    default = _DEFAULTS_SHOWN.get(name, field.default if field.default_factory is None else "(derived)")
    described = f"{field.description}; " if field.description else ""
    help_text = f"{described}env {ENV_PREFIX}{name.upper()}, default {default}".replace("%", "%%")
    if name == "load_models":
        help_text = f"{described}repeat it for several; env {ENV_PREFIX}LOAD_MODELS=A,B"
    help_text = help_text if shown else argparse.SUPPRESS
    if name == "load_models":
        group.add_argument("--load-model", dest=name, action="append", metavar="NAME", help=help_text)
        return
    metavar = "MODEL.onnx" if name == "model_path" else _metavar(field.annotation)
    group.add_argument(_FLAG_NAMES.get(name, "--" + name.replace("_", "-")), dest=name, metavar=metavar,
                       help=help_text)


def _metavar(annotation) -> str:
    if typing.get_origin(annotation) is typing.Literal:
        return "{" + ",".join(map(str, typing.get_args(annotation))) + "}"
    text = str(annotation)
    for needle, metavar in (("list", "A,B"), ("bool", "BOOL"), ("int", "N"), ("float", "X"), ("Path", "PATH")):
        if needle in text:
            return metavar
    return "VALUE"


# The settings a measurement depends on (service/engine/serving_plan.py KEYED_SETTINGS) and where it is recorded
_TUNE_SETTINGS = ("model_path", "runtime", "precision_hint", "providers", "max_batch_size", "tuning_dir")


def add_tune_parser(subparsers) -> argparse.ArgumentParser:
    """`vitserve tune --model FILE`: measure how the file is best served on this machine, once, and record it."""
    from vitserve.service.ground.settings import Settings
    parser = subparsers.add_parser(
        "tune", help="measure once, on a quiet machine, how a model file is best served here, and record it",
        usage="vitserve tune --model MODEL.onnx [options]",
        description="Times the runtimes and precisions that agree with the file (ONNX Runtime, OpenVINO fp32 and "
                    "bf16), its maps-free graph and its batch-1 call, and writes a tuning record keyed by the "
                    "file's hash, this CPU and these settings. Every later load with the same key (`vitserve "
                    "serve`, every replica that reads the same tuning directory) serves the file as recorded, "
                    "without timing anything. Refuses on a busy machine.")
    for name in _TUNE_SETTINGS:
        _add_setting(parser, name, Settings.model_fields[name], shown=True)
    parser.add_argument("--json", action="store_true", help="print the record as JSON")
    parser.set_defaults(func=run_tune)
    return parser


def run_tune(args: argparse.Namespace) -> int:
    import json

    from pydantic import ValidationError

    from vitserve.service.engine.tuning import tune
    from vitserve.service.ground.errors import ServiceError
    from vitserve.service.ground.logs import configure_logging
    from vitserve.service.ground.settings import Settings
    given = {name: getattr(args, name) for name in _TUNE_SETTINGS if getattr(args, name, None) is not None}
    try:
        settings = Settings(**given)
    except ValidationError as e:
        print(f"vitserve tune: invalid settings: {settings_problems(e)}", file=sys.stderr)
        return 2
    configure_logging("warning")
    try:
        path, choice = tune(settings)
    except (ServiceError, OSError) as e:
        print(f"vitserve tune: {settings.model_path}: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(path.read_text(), end="")
        return 0
    record = json.loads(path.read_text())
    costs = record["measured"]["ms_per_image_at_1_plus_max_batch"]
    print(f"{settings.model_path}: {choice['runtime']}/{choice['precision_hint']}, maps-free graph "
          f"{'kept' if choice['maps_free'] else 'left out'}, {'light' if choice['light'] else 'heavy'}")
    for name, ms in costs.items():
        print(f"  {name:<24} {ms:8.3f} ms per image at batch 1 plus at batch {settings.max_batch_size}")
    for name, why in record["measured"]["left_out"].items():
        print(f"  {name:<24} left out: {why}")
    print(f"recorded in {path}")
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from vitserve.artifact import ArtifactError
    from vitserve.service.ground.errors import ModelLoadError, ServiceError
    from vitserve.service.ground.logs import configure_logging
    from vitserve.service.ground.settings import Settings

    for name, value in vars(args).items():
        if name in ("command", "func", "ray") or value is None:
            continue
        text = ",".join(value) if isinstance(value, list) else str(value)
        if not text.strip():  # an empty variable means unset (compose passes unset ones so): a flag may not be
            flag = _FLAG_NAMES.get(name, "--" + name.replace("_", "-"))
            print(f"vitserve serve: {flag} is empty: give it a value, or leave it out",
                  file=sys.stderr)
            return 2
        os.environ[ENV_PREFIX + name.upper()] = text
    grpc_derived = derive_grpc_port(os.environ)
    try:
        settings = Settings()
        what = _what_is_served(settings)  # cheap: no session yet
    except ValidationError as e:
        print(f"vitserve serve: invalid settings: {settings_problems(e)}", file=sys.stderr)
        return 2
    except (ArtifactError, ServiceError, OSError) as e:
        print(f"vitserve serve: cannot serve {settings.model_repository or settings.model_path}: {e}",
              file=sys.stderr)
        return 2
    if getattr(args, "ray", None):
        if settings.model_control_mode == "explicit":
            # Ray's proxy hands a load or unload to one replica: the others would go on serving what they had
            print("vitserve serve --ray: --model-control-mode explicit would load and unload in one replica only "
                  "(Ray's proxy picks one); use none or poll, in which every replica reads the repository itself",
                  file=sys.stderr)
            return 2
        return _serve_on_ray(settings)
    # Before any model is loaded (uvicorn would say only "Address already in use", after the warm-up), and before
    # anything imports prometheus_client: it picks its multiprocess mode on import.
    taken = port_in_use(settings, grpc_derived)
    if taken:
        print(f"vitserve serve: {taken}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    try:
        settings = _resolve_engine(settings)
    except ModelLoadError as e:
        logging.getLogger("vitserve.cli").error("cannot start: %s", e)
        return 1
    metrics_dir = None
    if settings.http_workers > 1 or settings.engine == "process":
        from vitserve.service.ground.metrics_files import prepare_multiprocess_dir
        metrics_dir, made = prepare_multiprocess_dir()
        metrics_dir = metrics_dir if made else None  # a directory the user named is theirs to keep
    scheme = "https" if settings.ssl_certfile else "http"
    grpc_note = f", gRPC on port {settings.grpc_port}" if settings.grpc_port else ""
    logging.getLogger("vitserve.cli").info("serving %s on %s://%s:%d%s: %d HTTP worker(s), engine %s", what, scheme,
                                           settings.host, settings.port, grpc_note, settings.http_workers,
                                           settings.engine)
    try:
        with _engines(settings) as settings:
            serve_with_uvicorn("vitserve.service.app:app_from_env", settings)
    except ModelLoadError as e:
        logging.getLogger("vitserve.cli").error("cannot start: %s", e)
        return 1
    finally:
        if metrics_dir:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    return 0


def derive_grpc_port(environ) -> bool:
    """With the HTTP port given (--port or VITSERVE_PORT) and the gRPC port not, gRPC takes the next port, as the
    defaults pair 8000 with 8001: a second server started on another --port does not collide with the first on
    gRPC's 8001. Written into `environ`, which the HTTP workers read their settings from; returns whether it did."""
    port = environ.get(ENV_PREFIX + "PORT", "").strip()
    if environ.get(ENV_PREFIX + "GRPC_PORT", "").strip() or not port.isdigit() or not 0 < int(port) < 65535:
        return False  # port 0 (any free one) has no next port: gRPC keeps its default
    environ[ENV_PREFIX + "GRPC_PORT"] = str(int(port) + 1)
    return True


def port_in_use(settings: Settings, grpc_derived: bool = False) -> str | None:
    """What to tell the user when the HTTP or the gRPC port is taken, naming it and the flag that moves it."""
    if settings.port and not port_is_free(settings.host, settings.port):
        return (f"the HTTP port {settings.host}:{settings.port} is in use: stop what holds it, or choose another "
                f"with --port (VITSERVE_PORT; make serve PORT=N)")
    if settings.grpc_port and not port_is_free(settings.host, settings.grpc_port):
        derived = " (--port + 1)" if grpc_derived else ""
        return (f"the gRPC port {settings.host}:{settings.grpc_port}{derived} is in use: stop what holds it, or "
                f"choose another with --grpc-port (VITSERVE_GRPC_PORT; 0: no gRPC)")
    return None


def port_is_free(host: str, port: int) -> bool:
    """Whether nothing listens on or is bound to host:port (a bind without SO_REUSEPORT succeeds). The gRPC
    server's workers share its port with SO_REUSEPORT, which would otherwise share it silently with another
    server of the same user (service/grpc/server.py). SO_REUSEADDR, as the servers themselves set it: the
    closed connections of a server that just stopped (TIME_WAIT) do not hold the port."""
    import socket
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def settings_problems(error) -> str:
    """A pydantic ValidationError of the settings in one line: each field, what is wrong, and what was given."""
    def one(problem: dict) -> str:
        where = ".".join(map(str, problem["loc"]))
        message = problem["msg"].removeprefix("Value error, ")
        given = problem.get("input")
        shown = f" (got {given!r})" if where and not isinstance(given, dict) else ""
        return f"{where + ': ' if where else ''}{message}{shown}"
    return "; ".join(one(p) for p in error.errors(include_url=False))


def _what_is_served(settings: Settings) -> str:
    """What the server will serve, said in a log line; a single file that is no vitserve model, a repository that
    is not a folder, or a repository API open to the network without a key is refused here, before any
    process starts."""
    from vitserve.service.ground.errors import ServiceError
    if settings.model_control_mode != "none" and settings.admin_key is None and not _loopback(settings.host):
        raise ServiceError(f"--model-control-mode {settings.model_control_mode} on {settings.host} lets anyone who "
                           f"reaches the port change what is served: set --admin-key (or VITSERVE_ADMIN_KEY), or "
                           f"listen on 127.0.0.1")
    if settings.model_repository is None:
        from vitserve.onnx_header import read_model_info
        info = read_model_info(settings.model_path)
        return f"{info.name} {info.version} from {settings.model_path}"
    from vitserve.service.repository.layout import ModelRepository
    names = ModelRepository(settings.model_repository).names()
    return (f"the repository {settings.model_repository} ({len(names)} model(s): {', '.join(names[:10])}; control "
            f"mode {settings.model_control_mode})")


def _loopback(host: str) -> bool:
    import ipaddress
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _serve_on_ray(settings: Settings) -> int:
    try:
        from vitserve.service.ray_serve import run_on_ray
    except ImportError as e:
        print(f"vitserve serve --ray: Ray Serve is not installed ({e}): pip install \"vitserve[ray]\"",
              file=sys.stderr)
        return 2
    from vitserve.service.ground.logs import configure_logging
    configure_logging(settings.log_level)
    return run_on_ray(settings)


def _resolve_engine(settings: Settings) -> Settings:
    """engine=auto made process or inline (service/engine/topology.py), with what auto chose at load pinned: in the
    environment, which the HTTP workers and the engine processes build their settings from. Decided in a child
    process: the model it loads to decide would otherwise stay in this one, which only supervises (the runtimes'
    libraries and arenas: 140 MB of the default model's server, more than an HTTP worker's whole share)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    from vitserve.service.ground.errors import ModelLoadError
    from vitserve.service.ground.logs import configure_logging
    from vitserve.service.ground.settings import Settings
    if settings.engine != "auto":
        return settings
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=configure_logging,
                             initargs=(settings.log_level,)) as child:
        try:
            choice = child.submit(_engine_choice, settings).result()
        except BrokenProcessPool as e:  # the runtime itself died on the file (a signal, not an exception)
            raise ModelLoadError(f"loading {settings.model_path} to choose where it runs ended its process: {e}") from e
    if choice is None:
        return settings
    logging.getLogger("vitserve.cli").info("engine auto: %s, %s (--engine process or inline sets it)",
                                           choice.engine, choice.why)
    for name, value in choice.environment.items():
        os.environ[ENV_PREFIX + name] = value
    return Settings()


def _engine_choice(settings: Settings):
    """service/engine/topology.py's `engine_choice`, imported (with the runtimes) only in the process that runs it."""
    from vitserve.service.engine.topology import engine_choice
    return engine_choice(settings)


@contextlib.contextmanager
def _engines(settings: Settings):
    """With engine=process: the engine processes running (stopped after the HTTP workers have drained), and the
    settings that tell the workers where they are."""
    if settings.engine != "process":
        yield settings
        return
    from vitserve.service.engine.supervisor import EngineSupervisor
    with EngineSupervisor(settings) as supervisor:
        os.environ[ENV_PREFIX + "ENGINE_ADDRESSES"] = ",".join(supervisor.addresses)
        yield settings.model_copy(update={"engine_addresses": supervisor.addresses})


# uvicorn's own graceful timeout comes this long after the service's drain (service/usecases/state.py), so requests
# still waiting at the end of the drain get the service's JSON 503, never uvicorn's cancellation.
DRAIN_MARGIN_S = 1.0


def uvicorn_options(settings: Settings) -> dict:
    """The uvicorn options a `vitserve serve` process runs with, from its `Settings`."""
    # imports uvicorn and httptools: only when serving
    from vitserve.service.http.connection import uvicorn_http_options
    return {"host": settings.host, "port": settings.port, "workers": settings.http_workers,
            "log_level": settings.log_level, "limit_concurrency": settings.limit_concurrency,
            "timeout_graceful_shutdown": settings.drain_timeout_s + DRAIN_MARGIN_S,
            **uvicorn_http_options(settings), **tls_options(settings)}


def tls_options(settings: Settings) -> dict:
    """uvicorn's TLS options: HTTPS with the certificate and key, and with ssl_ca_certs, client certificates
    required (mutual TLS)."""
    if settings.ssl_certfile is None:
        return {}
    import ssl
    mutual = {"ssl_ca_certs": str(settings.ssl_ca_certs), "ssl_cert_reqs": ssl.CERT_REQUIRED} \
        if settings.ssl_ca_certs else {}
    return {"ssl_certfile": str(settings.ssl_certfile), "ssl_keyfile": str(settings.ssl_keyfile), **mutual}


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
