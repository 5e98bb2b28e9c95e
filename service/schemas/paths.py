"""The inference routes' paths, as templates (FastAPI's way of writing a path), written once: the HTTP route table
(service/http/inference_routes.py) serves them (and asserts it serves these), admission and the statistics count by
them (service/usecases/); gRPC's frame labels a call by its method's full name (service/grpc/servicer.py `rpc`),
which for ModelInfer is GRPC_INFER."""

CLASSIFY = "/v1/classify"
CLASSIFY_BATCH = "/v1/classify/batch"
EMBED = "/v1/embed"
INFER = "/v2/models/{name}/infer"
VERSIONED_INFER = "/v2/models/{name}/versions/{version}/infer"
GRPC_INFER = "/inference.GRPCInferenceService/ModelInfer"

HTTP_INFERENCE = (CLASSIFY, CLASSIFY_BATCH, EMBED, INFER, VERSIONED_INFER)
INFERENCE = frozenset({*HTTP_INFERENCE, GRPC_INFER})  # the routes admission guards
