"""Wire formats, without a transport: the Open Inference Protocol's requests and responses (JSON and binary
tensors), the response schemas, and how a model describes itself (metadata, Triton's configuration and
statistics)."""
