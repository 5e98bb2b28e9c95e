"""Evaluation research beside the product: how good the exported model and its explanation maps are, and
experiments on how it is trained. It may import model/ and export/; the product (model/, export/, service/,
vitserve/) never imports it (tests/test_layers.py), and the serving images leave it out.

Modules: `accuracy` (ONNX Runtime accuracy on Fashion-MNIST at several resolutions, `vitserve evaluate accuracy`),
`explanations` (how faithful the rollout and relevance maps are, `vitserve evaluate explanations`),
`self_supervision` (does masked-patch pre-training help when labels are few,
`python -m vitserve.evaluation.self_supervision`),
`calibration` (the served probabilities before and after the file's temperature, `vitserve evaluate calibration`),
`ood` (which out-of-distribution score separates Fashion-MNIST from what a user could send by mistake,
`python -m vitserve.evaluation.ood`),
`cli` (the `evaluate` subcommands; `vitserve evaluate bench` and `relevance-cost` are benchmarks: bench/cli.py).
"""
