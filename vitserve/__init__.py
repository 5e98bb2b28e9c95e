"""vitserve: train a Vision Transformer, export it to ONNX, serve it over HTTP.

The product's layers are imported as `vitserve.model`, `vitserve.export`, `vitserve.service` (and the tools beside
them as `vitserve.evaluation`, `vitserve.bench`). The repository keeps each layer as a top-level folder (model/,
export/, service/, ...), and this package holds a relative symbolic link to each (vitserve/service -> ../service),
so that the import path is a file path that type checkers, IDEs and import-graph tools follow, and a checkout on
PYTHONPATH imports its own layers. A wheel holds the layers' files inside vitserve/ (setup.py); bench/ stays in the
checkout. docs/architecture.md says why links and not a move.
"""
__version__ = "0.1.0"
