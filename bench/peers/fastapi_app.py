"""The 20-line FastAPI app a user writes first: one ONNX Runtime session in the process, `UploadFile`, the work in a
sync endpoint (FastAPI runs it in its thread pool), no batching. The work is vitserve's own, as every peer's
(bench/peers/image_classifier.py). `uvicorn vitserve.bench.peers.fastapi_app:app` with MODEL_PATH set."""
import json
import os

from fastapi import FastAPI, Response, UploadFile

from vitserve.bench.peers.image_classifier import ImageClassifier

classifier = ImageClassifier(os.environ["MODEL_PATH"])
app = FastAPI()


@app.post("/classify")
def classify(file: UploadFile) -> Response:
    pixels = classifier.prepare(file.file.read())[None]
    logits, rollout = classifier.run(pixels)
    return Response(json.dumps(classifier.answer(logits[0], rollout[0])), media_type="application/json")


@app.get("/ready")
def ready() -> dict:
    return {"ready": True}
