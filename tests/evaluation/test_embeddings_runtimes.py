"""`python -m vitserve.evaluation.embeddings --runtime openvino`: the vectors come from the runtime the server would
load, in the order the evaluation asks for them."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("openvino")


def test_a_served_runtime_answers_by_output_name_as_an_onnx_runtime_session_does(tiny_onnx):
    from vitserve.artifact import EMBEDDING_NAME, INPUT_NAME, OUTPUT_NAMES
    from vitserve.evaluation.embeddings import ServedRuntime
    from vitserve.export.verify import cpu_session

    served, session = ServedRuntime(tiny_onnx, "openvino", "fp32", 0), cpu_session(str(tiny_onnx))
    assert served.model.provider == "OpenVINO/CPU/fp32"
    feeds = {INPUT_NAME: np.random.default_rng(0).standard_normal((3, 3, 32, 32)).astype(np.float32)}
    names = [EMBEDDING_NAME, OUTPUT_NAMES[0]]  # not the file's order
    for got, want in zip(served.run(names, feeds), session.run(names, feeds)):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("argv, message", [(["--threads", "-1"], "--threads must be 0"),
                                           (["--runtime", "tensorrt"], "invalid choice: 'tensorrt'"),
                                           (["--precision-hint", "int4"], "invalid choice: 'int4'")])
def test_a_wrong_flag_is_a_one_line_error(argv, message, capsys):
    from vitserve.evaluation.embeddings import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]
