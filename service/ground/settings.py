"""The service's one configuration object: every limit and batching knob, from `VITSERVE_*` variables.

`vitserve serve` maps each command-line flag onto one of these fields (see `service/cli.py`), so a
flag, an environment variable and a test's keyword argument all land in the same place.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, FilePath, SecretStr, StringConstraints, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from vitserve.service.ground.processes import usable_cores

Provider = Literal["tensorrt", "cuda", "cpu"]  # ONNX Runtime's execution providers (service/engine/providers.py)
# A runtime by its registered name (service/engine/runtime.py's RUNTIMES: onnxruntime, openvino), or auto. Checked
# against the registry when a model loads, as Triton checks a model's backend: a new runtime registers there alone.
Runtime = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]{0,31}$")]
PrecisionHint = Literal["auto", "fp32", "bf16"]
INTERNAL = "internal"  # the description of fields `vitserve serve` sets for its own processes: no flag


class Settings(BaseSettings):
    # env_ignore_empty: `VITSERVE_MODEL_REPOSITORY=` (compose passes unset variables so) means unset, not "."
    model_config = SettingsConfigDict(env_prefix="VITSERVE_", extra="ignore", env_ignore_empty=True)

    # the model and where to serve it
    model_path: Path = Field(Path("models/vit-fmnist/model.onnx"), description="one model file to serve (a "
                             "repository of one); ignored with model_repository")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    engine: Literal["auto", "process", "inline"] = Field(
        "auto", description="process: the session and batcher in one engine process per device, fed by every "
                            "HTTP worker; inline: in each HTTP worker (each loads its own session); auto: inline "
                            "for a light model on the CPU served from one file, else process "
                            "(service/engine/topology.py)")
    workers: int | None = Field(None, ge=1, description="HTTP worker processes (uvicorn); unset: one per core, 1 "
                                                        "with engine=inline")
    lone_request_path: bool = Field(False, description="with engine=process and one model file: each HTTP worker "
                                    "also loads the model, as the engine does, and runs a request there when it is "
                                    "the only one in flight in the worker and the engine has none of the worker's "
                                    "and nothing queued (no hop for a lone request; every batch under load in the "
                                    "engine); engine auto turns it on for a light model on the CPU "
                                    "(service/engine/lone_path.py)")
    engine_arena_bytes: int = Field(64 * 2**20, ge=2**20, description="shared memory each HTTP worker writes pixels "
                                                                      "into for the engine (at most a quarter of "
                                                                      "what /dev/shm has free)")
    engine_timeout_s: float = Field(2.0, gt=0, description="an engine silent this long is given up on: its "
                                                           "requests fail with 503 (it is restarted)")
    # Set by `vitserve serve` for its HTTP workers: where the engine processes listen (one per device).
    engine_addresses: Annotated[list[str], NoDecode] = Field(default_factory=list, description=INTERNAL)
    grpc_port: int = Field(8001, ge=0, le=65535, description="the Open Inference Protocol over gRPC (Triton's "
                           "GRPCInferenceService) on this port, in every HTTP worker; 0: no gRPC")
    ssl_certfile: FilePath | None = Field(None, description="serve HTTPS and gRPC over TLS with this certificate chain "
                                                        "(PEM); with ssl_keyfile")
    ssl_keyfile: FilePath | None = Field(None, description="the certificate's private key (PEM)")
    ssl_ca_certs: FilePath | None = Field(None, description="mutual TLS: clients must present a certificate signed by "
                                                        "these CAs (PEM), on HTTP and gRPC")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    otlp_endpoint: str | None = Field(None, max_length=2048, description="send OpenTelemetry traces to this "
                                      "OTLP/HTTP collector (http://HOST:4318); unset: tracing is on only if "
                                      "OTEL_EXPORTER_OTLP_ENDPOINT is set (docs/tracing.md)")
    trace_sample_ratio: float | None = Field(None, ge=0, le=1, description="share of requests traced (a sampled "
                                             "caller's always are); unset: OTEL_TRACES_SAMPLER, else all")
    server_timing: bool = Field(False, description="each inference answer over HTTP carries a Server-Timing header "
                                "(W3C): the time its stages took in this server, in ms (docs/latency-budget.md)")
    limit_concurrency: int | None = Field(None, ge=1, description="open connections before uvicorn answers 503")

    # the model repository (service/repository/): several models and versions, loaded and unloaded live
    model_repository: Path | None = Field(None, description="a folder of models laid out as Triton's: "
                                                            "NAME/VERSION/model.onnx (and NAME/config.json)")
    model_control_mode: Literal["none", "explicit", "poll"] = Field(
        "none", description="none: load every model at start, no repository API; explicit: load load_models at "
                            "start, then the repository API loads and unloads; poll: follow the repository's "
                            "changes every repository_poll_secs")
    load_models: Annotated[list[str], NoDecode] = Field(default_factory=list, description="with explicit: the "
                                                        "models to load at start ('*': all)")
    repository_poll_secs: float = Field(15.0, ge=0.1, le=86_400, description="with poll: seconds between looks at "
                                        "the repository (a new file is loaded once unchanged for one interval)")
    admin_key: SecretStr | None = Field(None, description="the key the repository API requires (Authorization: "
                                                          "Bearer KEY; prefer the variable: a flag shows in ps); "
                                                          "needed with explicit or poll unless the server listens "
                                                          "on loopback only")
    api_key: SecretStr | None = Field(None, description="if set, the inference and model routes require it too "
                                                        "(health, metrics and the web page's files stay open)")

    # The runtime: ONNX Runtime (CUDA when there, else the CPU), or OpenVINO for the CPU; auto follows the file's
    # plan on this machine (service/engine/serving_plan.py), decided without timing anything at load
    runtime: Runtime = Field(
        "auto", description="onnxruntime, openvino, or auto: what a tuning record of this file on this machine "
                            "chose (vitserve tune), else ONNX Runtime on a GPU, OpenVINO bf16 on a CPU that computes "
                            "bfloat16 (AVX512-BF16, AMX) or runs an int8 file in integer arithmetic (VNNI, AMX) "
                            "where it agrees with the file, ONNX Runtime otherwise (docs/tuning.md)")
    tuning: Literal["read", "write-when-idle", "off"] = Field(
        "read", description="read: a tuning record of this file on this machine (vitserve tune) decides runtime, "
                            "precision, maps-free graph and threads where there is one, declared facts otherwise; "
                            "write-when-idle: also, a load with no record measures and records one when the machine "
                            "is idle; off: declared facts only")
    tuning_dir: Path | None = Field(None, description="where tuning records are read and written (one JSON file per "
                                    "file, machine and settings); unset: $XDG_CACHE_HOME/vitserve/tuning, else "
                                    "~/.cache/vitserve/tuning")
    precision_hint: PrecisionHint = Field(
        "auto", description="the compute precision asked of the runtime (bf16: OpenVINO on a CPU with AVX512-BF16 "
                            "or AMX); an int8 file computes its quantized layers in int8 whatever this says")
    # ONNX Runtime: execution providers in order of preference; CPU is always the last resort
    providers: Annotated[list[Provider], NoDecode] = ["cuda", "cpu"]
    cuda_device_id: int = Field(0, ge=0)
    cuda_device_ids: Annotated[list[int], NoDecode] = Field(default_factory=list, description="with engine=process: "
                                                            "one engine per device listed; unset: cuda_device_id")
    cuda_mem_limit_bytes: int | None = Field(None, ge=1, description="CUDA arena limit; unset = no limit")
    cudnn_conv_algo_search: Literal["EXHAUSTIVE", "HEURISTIC", "DEFAULT"] = "HEURISTIC"
    cuda_graphs: bool = Field(True, description="on CUDA: batches at the trained size run as CUDA graphs, one "
                                                "captured per batch bucket (1, 2, 4, ... max_batch_size; a batch "
                                                "is padded up to its bucket)")
    gpu_batch_step: int = Field(8, ge=0, le=1024, description="on CUDA, a batch that runs on ONNX Runtime's dynamic "
                                "session (no CUDA graph for its size) is padded with zero images up to a multiple of "
                                "this (at most max_batch_size), and each such size is run at load: the CUDA "
                                "provider's first call at a new batch size cost ViT-B/16 48-94 ms on an H200, which "
                                "no client then pays; 1 pads nothing and runs every size at load, 0 does neither")
    tensorrt_fp16: bool = False
    tensorrt_cache_dir: Path | None = None
    intra_op_threads: int = Field(0, ge=0, description="threads inside one ORT call; "
                                                       "0 = one per core, shared out among workers")
    inter_op_threads: int = Field(1, ge=0)
    # Off by default: spinning intra-op threads take the cores from the event loop and the decoders between
    # batches (2 cores, same open-loop load: 210 req/s spinning, 510 not); worth it only with spare cores.
    intra_op_spinning: bool = Field(False, description="spin-wait between ORT ops (lower latency per call, "
                                                        "but burns the cores the HTTP side needs)")
    graph_optimization: Literal["disable", "basic", "extended", "all"] = "all"
    pixel_transport: Literal["auto", "float32", "uint8"] = Field(
        "auto", description="how frontends hand images to the engine: float32 normalised, or uint8 as decoded and "
                            "normalised by the engine on the model's device (a quarter of the bytes to stack and "
                            "copy); auto: uint8 when the models run on a GPU")
    maps_free: Literal["auto", "on", "off"] = Field(
        "auto", description="a batch whose requests all ask for no map (map=none, /v2 without the rollout output, "
                            "embeddings) runs a second graph without the rollout, each block's attention one fused "
                            "operator (service/engine/attention_fusion.py); auto: on, unless a tuning record of this "
                            "file on this machine measured it no faster (on a GPU 1.4x the rollout graph, ViT-B/16 "
                            "fp16, batch 64; on a CPU 5-22% faster)")
    warmup_batch_sizes: Annotated[list[int], NoDecode] = Field(
        default_factory=list, description="batch sizes run at the trained resolution before ready; empty = 1 and max")

    # dynamic batching
    max_batch_size: int = Field(16, ge=1)
    max_relevance_batch_size: int = Field(8, ge=1, description="images per batch on the relevance path (map="
                                                               "relevance): its backward pass keeps every layer's "
                                                               "activations, several times a fast batch's memory")
    max_queue_delay_ms: float = Field(5.0, ge=0, description="how long a batch that is not full waits for company "
                                                          "once the runner is free (within half a millisecond: "
                                                          "the event loop's timers count whole milliseconds)")
    max_queue_size: int = Field(256, ge=1, description="queued images before new ones get 429")
    max_batches_in_flight: int = Field(2, ge=1, description="batches assembled or running at once (one runs; "
                                                            "one more per batch runner past the first)")
    batch_runners: int = Field(1, ge=1, le=64, description="batches of one model that run at once, each on a thread of "
                                                    "its own, the intra-op threads shared out among them (Triton's "
                                                    "instance count): more answers a second at a few clients, a "
                                                    "longer tail; on the CPU a lone request still runs on every "
                                                    "core (docs/results.md)")
    dispatch_when_idle: bool = Field(True, description="with no batch in flight, run the queued requests at once "
                                                       "when they are as many as the last batch, instead of "
                                                       "waiting max_queue_delay_ms for company")
    request_timeout_ms: float = Field(10_000, gt=0, description="deadline of a whole request from its headers: "
                                                                "upload, decode, queue, inference, rendering")
    retry_after_s: int = Field(1, ge=0)
    drain_timeout_s: float = Field(30.0, ge=0, description="on SIGTERM, how long admitted requests may finish "
                                                           "(0: not at all); those still waiting then get 503")

    # token budgets (docs/token-budgets.md): the model's own sequence length, smaller under load or when asked
    degrade_under_load: bool = Field(True, description="under load, answer at a cheaper token budget (a smaller "
                                                       "input grid) rather than refuse; false: refuse, as without "
                                                       "budgets (a client's max_tokens is still honoured)")
    budget_accuracy_floor: float = Field(1.0, ge=0, le=100, description="percentage points a budget's accuracy "
                                                                        "(measured at export) may fall below the "
                                                                        "full budget's; a cheaper one is never "
                                                                        "served")
    budget_unmeasured_rungs: bool = Field(False, description="serve budgets whose accuracy the file does not "
                                                             "record (exported without --eval): their loss is "
                                                             "unknown")
    budget_queue_batches: float = Field(2.0, gt=0, description="degrade once more than this many full batches (per "
                                                               "batch runner) are queued: at or below saturation "
                                                               "the queue holds one")

    # admission: decided before a request's body is read
    max_requests_in_flight: int = Field(64, ge=1, description="inference requests admitted at once per process; "
                                                              "more get 429 at once")
    max_queue_wait_ms: float | None = Field(None, gt=0, description="refuse new inference requests when the queued "
                                                                    "work would take longer than this: a latency "
                                                                    "objective tighter than the deadline (fewer "
                                                                    "admitted, each faster); unset: the deadline")
    overload_queue_ms: float | None = Field(20.0, ge=0, description="once it is full (max_requests_in_flight: more "
                                                                    "arrive than it finishes), a process admits for "
                                                                    "a second only what it finishes in this time: "
                                                                    "the queue the admitted, the refused and the "
                                                                    "first request after the load wait behind; "
                                                                    "0: up to max_requests_in_flight")
    overload_keeps_batches: bool = Field(True, description="while shedding, still admit this process's share of "
                                                           "the engine's batches (max_batch_size x "
                                                           "max_batches_in_flight over the HTTP workers): at 2x "
                                                           "overload about 1.7x the answers, refusals slower "
                                                           "(docs/reliability.md); false: only overload_queue_ms "
                                                           "of work, the fastest refusals")
    # 50, not the 20 of a single process: HTTP workers share the cores with the engine, and a loop's timers then
    # run late by the scheduler's slices too (at 64 closed-loop clients, 20 refused 1% of requests, 50 none).
    max_loop_lag_ms: float | None = Field(50.0, ge=0, description="refuse new inference requests while the event "
                                                                  "loop runs this far behind (its backlog); unset: "
                                                                  "never on this ground")
    max_pixels_in_flight: int = Field(100_000_000, ge=1, description="decoded pixels held by admitted requests at "
                                                                     "once; a request waits for its share")
    large_image_pixels: int = Field(4_000_000, ge=1, description="images with more pixels decode on their own "
                                                                 "thread, so small ones never queue behind them")
    max_batch_cost: int | None = Field(None, ge=1, description="input values one batch may hold (batch x C x H x "
                                                               "W); unset = max_batch_size images at the trained "
                                                               "size, so large inputs go in small batches")

    # input limits and preprocessing
    max_upload_bytes: int = Field(20 * 2**20, ge=1)
    max_image_pixels: int = Field(40_000_000, ge=1, description="width x height read from the header")
    max_batch_files: int = Field(32, ge=1)
    max_native_tokens: int = Field(1024, ge=1, description="patch-token cap for resize=native")
    preprocess_threads: int = Field(2, ge=1, description="threads decoding images and rendering PNGs")
    max_rollout_image_side: int = Field(1024, ge=16, description="longest side of rollout heat-map and overlay "
                                                                 "PNGs (larger inputs are drawn scaled down)")
    max_json_body_bytes: int = Field(16 * 2**20, ge=1, description="largest JSON request body (Open Inference "
                                                                   "Protocol)")
    max_binary_body_bytes: int = Field(64 * 2**20, ge=1, description="largest Open Inference Protocol body with "
                                                                     "binary tensors (JSON header and tensors; the "
                                                                     "header within max_json_body_bytes)")
    max_json_values: int = Field(2**20, ge=1, description="JSON values in one body, counted before it is parsed "
                                                          "(the parse costs per value); twice the default "
                                                          "model's largest request, 32x1x128x128")

    # the gRPC connection (grpcio): what one client may hold open
    grpc_max_concurrent_streams: int = Field(100, ge=1, le=10_000, description="calls open at once on one gRPC "
                                             "connection (HTTP/2 streams); more wait for a free one")
    grpc_max_metadata_bytes: int = Field(16 * 1024, ge=1024, le=2**20, description="request metadata (gRPC's "
                                         "headers) per call; more is refused")

    # compressed answers (service/http/compression.py; gRPC: service/grpc/server.py): what one answer may cost
    compress_min_bytes: int = Field(1024, ge=0, description="answers smaller than this are sent as they are, "
                                                            "whatever the client accepts")
    compress_max_bytes: int = Field(4 * 2**20, ge=0, description="answers larger than this are sent uncompressed "
                                    "(a bound on the CPU one answer costs); 0: never compress")
    grpc_response_compression: Literal["none", "gzip", "deflate"] = Field(
        "none", description="compress gRPC answers (within the compress_* sizes) with this, as Triton's "
                            "--grpc-infer-response-compression-level; compressed requests are always read")

    # the HTTP connection (uvicorn): what a client may send before the app sees a request
    max_header_bytes: int = Field(16 * 1024, ge=1024, description="request line and headers together; more gets 431")
    max_headers: int = Field(100, ge=1, description="header fields per request; more gets 431")
    header_timeout_s: float = Field(10.0, gt=0, description="time to send the request line and headers; "
                                                            "slower clients get 408 and are disconnected")
    body_timeout_s: float = Field(10.0, gt=0, description="longest pause between two pieces of a request body; "
                                                          "a slower client gets 408")
    max_requests_per_connection: int = Field(
        0, ge=0, description="close a keep-alive connection after this many requests (its last answer says "
                             "Connection: close, as nginx's keepalive_requests and Envoy's "
                             "max_requests_per_connection), so that clients behind a connection-level (L4) load "
                             "balancer spread again over the replicas; 0: never")

    # Ray Serve (`vitserve serve --ray`, service/ray_serve.py): Ray's proxy serves HTTP at host:port, replicas
    # each hold one session and batcher; the settings above apply in every replica
    ray_address: str | None = Field(None, description="with --ray: the Ray cluster to join ('auto': the one this "
                                                      "node belongs to); unset: start a local one")
    ray_replicas: int = Field(1, ge=1, description="with --ray: replicas, each one ONNX Runtime session and "
                                                   "batcher (the minimum when ray_max_replicas is set)")
    ray_max_replicas: int | None = Field(None, ge=1, description="with --ray: autoscale between ray_replicas and "
                                                                 "this many on Ray's ongoing requests per replica")
    ray_target_ongoing_requests: float = Field(16.0, gt=0, description="with --ray and ray_max_replicas: the "
                                                                       "ongoing requests per replica Ray's "
                                                                       "autoscaler aims at")
    ray_replica_cpus: float = Field(1.0, gt=0, description="with --ray: CPUs Ray reserves for each replica (its "
                                                           "ONNX Runtime threads too, unless intra_op_threads)")
    ray_replica_gpus: float = Field(0.0, ge=0, description="with --ray: GPUs Ray reserves for each replica")
    ray_metrics_export_port: int | None = Field(None, ge=1, le=65535, description="with --ray and no ray_address: "
                                                "the port where the local cluster's metrics agent exports every "
                                                "replica's metrics for Prometheus; unset: a free one")
    ray_max_queued_requests: int = Field(256, ge=1, description="with --ray: requests Ray's router holds while "
                                                                "every replica has max_requests_in_flight; more "
                                                                "get 429")
    ray_models_per_replica: int = Field(0, ge=0, le=1024, description="with --ray and model_repository: 0, every "
                                        "replica loads every model; N, Ray's model multiplexing: a replica loads a "
                                        "model when a request names it, holds at most N (least recently used "
                                        "unloaded first), and Ray routes a request with the "
                                        "serve_multiplexed_model_id header to a replica that holds its model")

    @field_validator("load_models", mode="before")
    @classmethod
    def _split_names(cls, value):
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        return value

    @field_validator("providers", "warmup_batch_sizes", mode="before")
    @classmethod
    def _split_commas(cls, value):
        if isinstance(value, str):
            return [v.strip().lower() for v in value.split(",") if v.strip()]
        return value

    @field_validator("cuda_device_ids", mode="before")
    @classmethod
    def _split_ints(cls, value):
        if isinstance(value, str):
            return [int(v) for v in value.split(",") if v.strip()]
        return value

    @field_validator("engine_addresses", mode="before")
    @classmethod
    def _split_addresses(cls, value):
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        return value

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if not self.warmup_batch_sizes:
            self.warmup_batch_sizes = sorted({1, self.max_batch_size})
        if any(b < 1 or b > self.max_batch_size for b in self.warmup_batch_sizes):
            raise ValueError(f"warmup_batch_sizes {self.warmup_batch_sizes} must lie in 1..max_batch_size")
        if self.model_control_mode != "none" and self.model_repository is None:
            raise ValueError(f"model_control_mode {self.model_control_mode} needs a model_repository")
        if self.load_models and self.model_control_mode != "explicit":
            raise ValueError("load_models is for model_control_mode explicit (the other modes load every model)")
        # (each replica runs it in explicit mode with nothing loaded at start: service/ray_serve.py)
        if self.ray_models_per_replica and (self.model_repository is None or self.model_control_mode == "poll"
                                            or self.load_models):
            raise ValueError("ray_models_per_replica loads a repository's models on demand: it needs a "
                             "model_repository, and no poll mode or load_models")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("ssl_certfile and ssl_keyfile go together: set both for TLS, or neither")
        if self.ssl_ca_certs is not None and self.ssl_certfile is None:
            raise ValueError("ssl_ca_certs (mutual TLS) needs the server's own ssl_certfile and ssl_keyfile")
        if self.grpc_port and self.grpc_port == self.port:
            raise ValueError(f"grpc_port {self.grpc_port} is the HTTP port: give gRPC its own (0: no gRPC)")
        if self.ray_max_replicas is not None and self.ray_max_replicas < self.ray_replicas:
            raise ValueError(f"ray_max_replicas {self.ray_max_replicas} is below ray_replicas {self.ray_replicas}")
        return self

    @property
    def batches_in_flight(self) -> int:
        """Batches a model keeps assembled or running at once: `max_batches_in_flight`, one more for each runner
        past the first (each runs one while the next waits assembled: service/engine/batcher.py)."""
        return self.max_batches_in_flight + self.batch_runners - 1

    @property
    def http_workers(self) -> int:
        """HTTP worker processes: as set, else one per core that this process may use, or one with engine=inline
        (auto's inline sets the count: service/engine/topology.py)."""
        if self.workers:
            return self.workers
        return 1 if self.engine == "inline" else usable_cores()

    @property
    def startup_models(self) -> list[str] | None:
        """The models loaded at start: None for every model of the repository (or the single file)."""
        if self.model_control_mode != "explicit" or "*" in self.load_models:
            return None
        return list(self.load_models)

    @property
    def max_queue_delay_s(self) -> float:
        return self.max_queue_delay_ms / 1000

    @property
    def request_timeout_s(self) -> float:
        return self.request_timeout_ms / 1000

    @property
    def queue_wait_limit_s(self) -> float:
        """The longest predicted wait in the batch queue admission accepts."""
        limit = self.request_timeout_s
        return min(limit, self.max_queue_wait_ms / 1000) if self.max_queue_wait_ms else limit


# `vitserve serve --help` in this order: what a first user needs, then each concern apart. Every field but the
# internal ones is in exactly one group (tests/service/test_runtime_and_cli.py holds it).
SETTING_GROUPS: dict[str, tuple[str, ...]] = {
    "common": ("model_path", "model_repository", "host", "port", "grpc_port", "model_control_mode", "load_models",
               "admin_key", "api_key", "runtime", "providers", "workers", "max_batch_size", "max_queue_delay_ms",
               "request_timeout_ms", "log_level"),
    "server": ("engine", "lone_request_path", "limit_concurrency", "drain_timeout_s", "retry_after_s",
               "max_header_bytes", "max_headers",
               "header_timeout_s", "body_timeout_s", "max_requests_per_connection",
               "grpc_max_concurrent_streams", "grpc_max_metadata_bytes",
               "compress_min_bytes", "compress_max_bytes", "grpc_response_compression"),
    "TLS": ("ssl_certfile", "ssl_keyfile", "ssl_ca_certs"),
    "tracing": ("otlp_endpoint", "trace_sample_ratio", "server_timing"),
    "repository": ("repository_poll_secs",),
    "engine and ONNX Runtime": ("precision_hint", "tuning", "tuning_dir", "engine_arena_bytes", "engine_timeout_s",
                                "cuda_device_id", "cuda_device_ids", "cuda_mem_limit_bytes", "cudnn_conv_algo_search",
                                "cuda_graphs",
                                "gpu_batch_step", "tensorrt_fp16", "tensorrt_cache_dir", "intra_op_threads",
                                "inter_op_threads", "intra_op_spinning", "graph_optimization", "pixel_transport",
                                "maps_free", "warmup_batch_sizes"),
    "batching": ("max_relevance_batch_size", "max_queue_size", "max_batches_in_flight", "batch_runners",
                 "dispatch_when_idle", "max_batch_cost"),
    "token budgets": ("degrade_under_load", "budget_accuracy_floor", "budget_unmeasured_rungs",
                      "budget_queue_batches"),
    "admission and limits": ("max_requests_in_flight", "overload_queue_ms", "overload_keeps_batches",
                             "max_queue_wait_ms", "max_loop_lag_ms",
                             "max_pixels_in_flight", "large_image_pixels", "max_upload_bytes", "max_image_pixels",
                             "max_batch_files", "max_native_tokens", "preprocess_threads", "max_rollout_image_side",
                             "max_json_body_bytes", "max_binary_body_bytes", "max_json_values"),
    "Ray Serve (--ray)": ("ray_address", "ray_replicas", "ray_max_replicas", "ray_target_ongoing_requests",
                          "ray_replica_cpus", "ray_replica_gpus", "ray_metrics_export_port",
                          "ray_max_queued_requests", "ray_models_per_replica"),
}

