"""OpenTelemetry traces: the SDK's in-memory exporter in process (HTTP and gRPC, the spans and their links), and
the SDK's real OTLP/HTTP exporter from a real `vitserve serve` (HTTP workers and the engine process) to a small
OTLP receiver here, which decodes what arrives with OpenTelemetry's own protobuf messages."""
from __future__ import annotations

import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import numpy as np
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from tritonclient.grpc import service_pb2, service_pb2_grpc

from vitserve.service.ground import tracing
from vitserve.service.app import RequestRecordMiddleware, create_app
from service_fixtures import free_port, patterned_png, settings_for, until, uvicorn_server, wait_until

TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


@pytest.fixture
def exporter():
    exporter = InMemorySpanExporter()
    yield exporter
    tracing.shutdown()


def by_name(spans) -> dict[str, list]:
    named: dict[str, list] = {}
    for span in spans:
        named.setdefault(span.name, []).append(span)
    return named


def assert_request_trace(spans, server_name: str, images: int) -> None:
    """One server span, the child of TRACEPARENT; decode (for encoded images), queue, inference per image and
    encode as its children; each inference linked to a batch span that was recorded."""
    named = by_name(spans)
    (server,) = named[server_name]
    assert f"{server.context.trace_id:032x}" == TRACE_ID and f"{server.parent.span_id:016x}" == PARENT_ID
    for child in ("queue", "inference"):
        assert len(named[child]) == images, child
    assert len(named["encode"]) == 1
    for span in [*named["queue"], *named["inference"], *named["encode"], *named.get("decode", [])]:
        assert span.parent.span_id == server.context.span_id and span.context.trace_id == server.context.trace_id
    batches = {(b.context.trace_id, b.context.span_id): b for b in named["batch"]}
    for inference in named["inference"]:
        (link,) = inference.links
        batch = batches[(link.context.trace_id, link.context.span_id)]
        assert batch.attributes["vitserve.batch_size"] == inference.attributes["vitserve.batch_size"] >= 1
        assert batch.parent is None  # a batch serves many requests: a trace of its own
    queue, inference = named["queue"][0], named["inference"][0]
    assert queue.start_time <= queue.end_time == inference.start_time <= inference.end_time


@pytest.mark.anyio
async def test_http_requests_are_traced_with_their_stages_and_batch(tiny_onnx, tiny_model, exporter):
    settings = settings_for(tiny_onnx)
    assert tracing.configure(settings, exporter=exporter)
    app = create_app(settings, model=tiny_model)
    async with app.router.lifespan_context(app):
        await until(lambda: app.state.service.ready, "warm-up finished")
        import httpx
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as client:
            for path in ("/v2/health/ready", "/metrics", "/v2/models/tiny-vit"):
                assert (await client.get(path)).status_code == 200
            assert not exporter.get_finished_spans()  # health, metrics and metadata are not traced
            answer = await client.post("/v1/classify", content=patterned_png(), headers={
                "content-type": "image/png", "traceparent": TRACEPARENT})
            assert answer.status_code == 200
            assert_request_trace(exporter.get_finished_spans(), "POST /v1/classify", images=1)
            (server,) = by_name(exporter.get_finished_spans())["POST /v1/classify"]
            assert server.attributes["http.response.status_code"] == 200
            assert server.attributes["vitserve.model"] == "tiny-vit"
            exporter.clear()
            body = {"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": [3, 3, 32, 32],
                                "data": np.zeros(3 * 3 * 32 * 32).tolist()}]}
            answer = await client.post("/v2/models/tiny-vit/infer", json=body, headers={"traceparent": TRACEPARENT})
            assert answer.status_code == 200
            assert_request_trace(exporter.get_finished_spans(), "POST /v2/models/{name}/infer", images=3)
            exporter.clear()
            await client.post("/v2/models/nope/infer", json=body)  # no traceparent: a trace of its own
            (server,) = exporter.get_finished_spans()
            assert server.parent is None and server.attributes["http.response.status_code"] == 404


@pytest.mark.anyio
async def test_grpc_calls_are_traced_from_their_metadata(tiny_onnx, tiny_model, exporter):
    port = free_port()
    settings = settings_for(tiny_onnx, grpc_port=port)
    assert tracing.configure(settings, exporter=exporter)
    app = create_app(settings, model=tiny_model, serve_grpc=True)
    async with app.router.lifespan_context(app):
        await until(lambda: app.state.service.ready, "warm-up finished")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            calls = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            await calls.ServerReady(service_pb2.ServerReadyRequest())
            assert not exporter.get_finished_spans()
            request = service_pb2.ModelInferRequest(model_name="tiny-vit")
            request.inputs.add(name="image", datatype="BYTES", shape=[2]).contents.bytes_contents.extend(
                [patterned_png(), patterned_png((40, 24))])
            await calls.ModelInfer(request, metadata=(("traceparent", TRACEPARENT),))
    spans = exporter.get_finished_spans()
    assert_request_trace(spans, "inference.GRPCInferenceService/ModelInfer", images=2)
    assert len(by_name(spans)["decode"]) == 2
    (server,) = by_name(spans)["inference.GRPCInferenceService/ModelInfer"]
    assert server.attributes["rpc.system"] == "grpc" and server.attributes["vitserve.status"] == "OK"


@pytest.mark.anyio
async def test_sampling_is_parent_based(tiny_onnx, tiny_model, exporter):
    """A ratio of 0 traces nothing of its own, but a caller that sampled its trace is followed."""
    settings = settings_for(tiny_onnx, trace_sample_ratio=0.0)
    assert tracing.configure(settings, exporter=exporter)
    app = create_app(settings, model=tiny_model)
    async with app.router.lifespan_context(app):
        await until(lambda: app.state.service.ready, "warm-up finished")
        import httpx
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as client:
            await client.post("/v1/classify", content=patterned_png(), headers={"content-type": "image/png"})
            assert not [s for s in exporter.get_finished_spans() if s.name != "batch"]
            await client.post("/v1/classify", content=patterned_png(), headers={"content-type": "image/png",
                                                                                 "traceparent": TRACEPARENT})
            assert "POST /v1/classify" in by_name(exporter.get_finished_spans())


def test_off_nothing_is_installed(tiny_onnx, tiny_model, monkeypatch):
    for variable in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(variable, raising=False)
    settings = settings_for(tiny_onnx)
    assert not tracing.configure(settings) and not tracing.enabled()
    app = create_app(settings, model=tiny_model)
    [record] = [m for m in app.user_middleware if m.cls is RequestRecordMiddleware]
    assert record.kwargs["traced"] is False  # no span, nor a look at the path for one, per request
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not tracing.configure(settings)


class Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP endpoint: every POST /v1/traces decoded as OpenTelemetry's ExportTraceServiceRequest."""

    def __init__(self):
        self.spans: list = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["content-length"]))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest.FromString(body)
                with receiver.lock:
                    receiver.spans += [(resource.resource, span) for resource in request.resource_spans
                                       for scope in resource.scope_spans for span in scope.spans]
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)


@pytest.mark.slow
def test_a_real_server_exports_to_an_otlp_endpoint(tiny_onnx):
    """`vitserve serve --otlp-endpoint`: the HTTP worker's request spans and the engine process's batch spans
    arrive over OTLP/HTTP, and the request's inference span links to a batch span that arrived."""
    receiver = Receiver()
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    grpc_port = free_port()
    try:
        with uvicorn_server(tiny_onnx, "--otlp-endpoint", f"http://127.0.0.1:{receiver.server_port}",
                            "--grpc-port", str(grpc_port),
                            env={"OTEL_BSP_SCHEDULE_DELAY": "50", "OTEL_SERVICE_NAME": "vitserve-test"}) as (url, _):
            import httpx
            answer = httpx.post(f"{url}/v1/classify", content=patterned_png(),
                                headers={"content-type": "image/png", "traceparent": TRACEPARENT}, timeout=30)
            assert answer.status_code == 200
            with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                request = service_pb2.ModelInferRequest(model_name="tiny-vit")
                request.inputs.add(name="image", datatype="BYTES", shape=[1]).contents.bytes_contents.append(
                    patterned_png())
                service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
                    request, metadata=(("traceparent", TRACEPARENT),), timeout=30)

            def names() -> set[str]:
                with receiver.lock:
                    return {span.name for _, span in receiver.spans}
            wanted = {"POST /v1/classify", "inference.GRPCInferenceService/ModelInfer", "decode", "queue",
                      "inference", "encode", "batch"}
            wait_until(lambda: wanted <= names(), f"the spans {wanted} at the OTLP endpoint")
    finally:
        receiver.shutdown()
    spans = [span for _, span in receiver.spans]
    batches = {(s.trace_id, s.span_id) for s in spans if s.name == "batch"}
    inferences = [s for s in spans if s.name == "inference"]
    assert inferences and all((s.links[0].trace_id, s.links[0].span_id) in batches for s in inferences)
    servers = [s for s in spans if s.name in ("POST /v1/classify", "inference.GRPCInferenceService/ModelInfer")]
    assert all(s.trace_id.hex() == TRACE_ID and s.parent_span_id.hex() == PARENT_ID for s in servers)
    services = {attribute.value.string_value for resource, _ in receiver.spans for attribute in resource.attributes
                if attribute.key == "service.name"}
    assert services == {"vitserve-test"}
