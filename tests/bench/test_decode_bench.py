"""`python -m vitserve.bench.decode`: every decoder gives the model's input from the same bytes, and the table says what each
cost (a short run on one small photo)."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("skimage")


def test_each_decoder_gives_the_model_input_and_the_table_has_every_case(monkeypatch, tmp_path):
    from vitserve.bench import decode

    monkeypatch.setattr(decode, "SIZES", {"320x240": (320, 240)})
    for fmt in ("PNG", "JPEG"):
        data = decode.encoded(decode.photo((320, 240)), fmt)
        for name, calls in decode.decoders().items():
            if fmt in calls["formats"]:
                assert calls["to_target"](data).shape == (224, 224, 3), (name, fmt)
                if calls["full"] is not None:
                    assert np.asarray(calls["full"](data)).shape == (240, 320, 3), (name, fmt)
    out = tmp_path / "decode.md"
    assert decode.main(["--rounds", "1", "--seconds", "0.01", "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())
    cases = {(r["format"], r["decoder"], r["mode"]) for r in rows}
    assert {("PNG", "Pillow", "full"), ("PNG", "Pillow", "to_target"), ("JPEG", "Pillow", "full"),
            ("JPEG", "Pillow draft", "to_target")} <= cases
    assert all(r["ms"] > 0 and r["size"] == "320x240" for r in rows)
    assert "| 320x240 | JPEG |" in out.read_text()
