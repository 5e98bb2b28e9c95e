"""Evaluation research beside the product: how good the exported model and its explanation maps are, and
experiments on how it is trained. It may import model/ and export/; the product (model/, export/, service/,
vitserve/) never imports it (tests/test_layers.py), and the serving images leave it out.

Modules: `accuracy` (ONNX Runtime accuracy on Fashion-MNIST at several resolutions, `vitserve evaluate accuracy`),
`explanations` (how faithful the rollout and relevance maps are, `vitserve evaluate explanations`),
`self_supervision` (does masked-patch pre-training help when labels are few, `python -m evaluation.self_supervision`),
`cli` (the `evaluate` subcommands; `vitserve evaluate bench` and `relevance-cost` are benchmarks: bench/cli.py).
"""
