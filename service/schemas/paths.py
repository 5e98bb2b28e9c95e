"""The inference routes' paths, as templates (FastAPI's way of writing a path), written once: the HTTP route table
(service/http/inference_routes.py) serves them (and asserts it serves these), admission and the statistics count by
them (service/usecases/); gRPC's frame labels a call by its method's full name (service/grpc/servicer.py `rpc`),
which for ModelInfer is GRPC_INFER. The Open Inference Protocol's root is here too: its paths answer in the
protocol's shapes (errors, compression, open health routes), and `is_protocol_path` is the one test of a path."""

PROTOCOL_ROOT = "/v2"  # the Open Inference Protocol (KServe v2): this path and every path under it
PROTOCOL_MODELS = PROTOCOL_ROOT + "/models/"  # followed by a model's name

CLASSIFY = "/v1/classify"
CLASSIFY_BATCH = "/v1/classify/batch"
EMBED = "/v1/embed"
INFER = PROTOCOL_MODELS + "{name}/infer"
VERSIONED_INFER = PROTOCOL_MODELS + "{name}/versions/{version}/infer"
GRPC_INFER = "/inference.GRPCInferenceService/ModelInfer"

HTTP_INFERENCE = (CLASSIFY, CLASSIFY_BATCH, EMBED, INFER, VERSIONED_INFER)
INFERENCE = frozenset({*HTTP_INFERENCE, GRPC_INFER})  # the routes admission guards


def is_protocol_path(path: str) -> bool:
    """Whether `path` belongs to the Open Inference Protocol, whose answers have their own shapes."""
    return path == PROTOCOL_ROOT or path.startswith(PROTOCOL_ROOT + "/")


def model_in_protocol_path(path: str) -> str | None:
    """The model a protocol path names (/v2/models/NAME/...), or None."""
    if not path.startswith(PROTOCOL_MODELS):
        return None
    return path[len(PROTOCOL_MODELS):].split("/", 1)[0] or None
