"""Checkpoint -> one verified ONNX file: in-graph position-embedding interpolation and attention rollout.

Kept free of imports so that `vitserve` can load `export.cli` without torch; the work lives in
`export.onnx_export` (export_onnx), `export.verify`, `export.fp16` and `export.int8`. What the export is measured
by afterwards (accuracy, the explanation maps' faithfulness) lives in evaluation/, the speed in bench/.
"""
