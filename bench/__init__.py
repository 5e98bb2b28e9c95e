"""`vitserve bench`: what serving costs over the bare model, measured in one run on one model and one set of inputs.

A tool beside the product: it starts servers the way a user does (`vitserve serve` in a child process) and
writes under build/ unless told where (`--out`). Three measurements, in this order:

1. **raw**: the ONNX Runtime session alone, made by the service's own runtime code with the server's settings,
   fed the server's own preprocessing of the same images: images/s at batch sizes 1, 8, 32 and batch-1 latency.
   The ceiling the server can approach.
2. **served**: a real `vitserve serve` (uvicorn) child process on 127.0.0.1 under closed-loop load at each
   concurrency level, with batching on (max batch size N) and off (max batch size 1), for pre-sized PNGs and
   for 640x480 JPEGs. Requests are `POST /v1/classify` with the raw image as the body and default parameters.
3. **bare** (small, HTTP-bound models): the same uvicorn options serving one FastAPI endpoint that reads the
   upload and returns a constant: the HTTP floor the served numbers should be read against.

Modules: `config` (the one set of defaults), `cli` (flags onto it), `run` (the phases in order), `raw` (the
session alone, and `vitserve evaluate bench`'s ONNX Runtime vs PyTorch speed), `load` (the HTTP load generator),
`measure` (latency percentiles, CPU use), `servers` (server processes, the bare endpoint), `presets` (models
made on first use), `report` (Markdown, targets, plot); `int8_choice` and `fast_path_choice` (`python -m`: the
measurements that chose export's int8 recipe and its single fast path, docs/int8.md, torch and onnx at their top).
Nothing else imports torch until a function needs it; the product never imports this package (tests/test_layers.py).
"""
