"""OpenTelemetry traces, opt-in: on when `--otlp-endpoint` (VITSERVE_OTLP_ENDPOINT) or OpenTelemetry's own
OTEL_EXPORTER_OTLP_ENDPOINT / OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set (and OTEL_SDK_DISABLED is not true).
The SDK does the work: its TracerProvider, sampler and batch processor, and its OTLP/HTTP exporter.

What one inference request leaves (docs/tracing.md):
- a SERVER span per request (HTTP inference routes, gRPC ModelInfer; never health, metrics or the web page),
  the child of the caller's W3C `traceparent` when it sent one;
- children: `decode` per image (decoding and preprocessing), `queue` and `inference` per image (from the
  engine's own measurements, which may have been taken in the engine process), `encode`;
- the ORT run that served an image is a span of its own, `batch` (one per run, in the process that ran it,
  a trace of its own since it serves many requests), and each image's `inference` span links to it.

Off, nothing is installed: no middleware, and each helper here returns at its first test of `_tracer`.
"""
from __future__ import annotations

import contextlib
import os
import time

_tracer = None  # an opentelemetry Tracer once `configure` turned tracing on in this process
_provider = None


def enabled_by(settings) -> bool:
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return bool(settings.otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def configure(settings, exporter=None) -> bool:
    """Turn tracing on in this process if the settings (or `exporter`, a test's) ask for it; whether it is on.
    Sampling: `trace_sample_ratio` (parent-based: a sampled caller's request is always traced), else the SDK's
    OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG, else every request."""
    global _tracer, _provider
    if exporter is None and not enabled_by(settings):
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    sampler = None if settings.trace_sample_ratio is None else ParentBased(TraceIdRatioBased(
        settings.trace_sample_ratio))
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "vitserve")})
    provider = TracerProvider(sampler=sampler, resource=resource)  # None: the SDK's OTEL_TRACES_SAMPLER
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        endpoint = settings.otlp_endpoint
        target = OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces") if endpoint else OTLPSpanExporter()
        provider.add_span_processor(BatchSpanProcessor(target))
    shutdown()
    _provider, _tracer = provider, provider.get_tracer("vitserve")
    return True


def shutdown() -> None:
    """Flush what is buffered and stop (at the process's end)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def enabled() -> bool:
    return _tracer is not None


@contextlib.contextmanager
def server_span(name: str, carrier: dict, attributes: dict):
    """A request's SERVER span, the current span inside the block: the child of the `traceparent` in `carrier`
    (headers or gRPC metadata, lower-case keys) when there is one. Yields the span (None when off)."""
    if _tracer is None:
        yield None
        return
    from opentelemetry import trace
    from opentelemetry.propagate import extract
    with _tracer.start_as_current_span(name, context=extract(carrier), kind=trace.SpanKind.SERVER,
                                       attributes=attributes) as span:
        yield span


def stage(name: str):
    """A child span of the current request around a stage it runs here (decode, encode); a no-op when off."""
    if _tracer is None:
        return contextlib.nullcontext()
    return _tracer.start_as_current_span(name)


def now_ns() -> int:
    return time.time_ns() if _tracer is not None else 0


def engine_spans(submitted_ns: int, result) -> None:
    """An image's `queue` and `inference` spans, placed from the engine's measurements (result: an
    InferenceResult) after its submit at `submitted_ns`; `inference` links to the batch that ran it."""
    if _tracer is None:
        return
    from opentelemetry import trace
    queued_ns = submitted_ns + int(result.queue_s * 1e9)
    _tracer.start_span("queue", start_time=submitted_ns).end(end_time=queued_ns)
    links = [trace.Link(_remote_context(result.batch_span))] if result.batch_span else []
    span = _tracer.start_span("inference", start_time=queued_ns, links=links,
                              attributes={"vitserve.batch_size": result.batch_size})
    span.end(end_time=queued_ns + int(result.inference_s * 1e9))


def batch_span(started_ns: int, ended_ns: int, attributes: dict, batch_size: int, relevance: bool) -> str:
    """One ORT run as a `batch` span (a root: it serves many requests), with the model's `attributes`, its size and
    path; its "traceid-spanid" for the requests it served to link to, or "" when off or not sampled."""
    if _tracer is None:
        return ""
    from opentelemetry import context
    attributes = {**attributes, "vitserve.batch_size": batch_size, "vitserve.relevance": relevance}
    span = _tracer.start_span("batch", context=context.Context(), start_time=started_ns, attributes=attributes)
    span.end(end_time=ended_ns)
    ids = span.get_span_context()
    return f"{ids.trace_id:032x}-{ids.span_id:016x}" if ids.trace_flags.sampled else ""


def _remote_context(text: str):
    from opentelemetry import trace
    trace_id, span_id = text.split("-")
    return trace.SpanContext(int(trace_id, 16), int(span_id, 16), is_remote=True,
                             trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED))


def record_outcome(span, code: int | str, error: bool, model: str, version: str) -> None:
    """A request's outcome on its server span (None: not traced): its status code and the model version that
    ran it; an error status for server errors (5xx, gRPC's INTERNAL...)."""
    if span is None:
        return
    from opentelemetry.trace import Status, StatusCode
    span.set_attributes({"vitserve.status": str(code), "vitserve.model": model, "vitserve.version": version})
    if error:
        span.set_status(Status(StatusCode.ERROR))
