"""vitserve's serving world: ONNX Runtime, Pillow, FastAPI, Prometheus. Never imports torch."""
