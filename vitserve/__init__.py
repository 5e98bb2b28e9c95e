"""vitserve: train a Vision Transformer, export it to ONNX, serve it over HTTP."""
__version__ = "0.1.0"
