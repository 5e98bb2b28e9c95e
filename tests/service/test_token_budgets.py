"""Token budgets: the served ladder, a client's max_tokens and degrade, the controller that chooses a rung per batch
under load, and what every answer says of the budget it used (service/engine/budgets.py, docs/token-budgets.md)."""
from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import onnxruntime as ort
import pytest
from service_fixtures import assert_error, classify, image_bytes, samples, serving, settings_for, value

from vitserve.artifact import INPUT_NAME, OUTPUT_NAMES
from vitserve.budgets import Rung, resample
from vitserve.service.engine.batcher import DynamicBatcher
from vitserve.service.engine.budgets import BudgetController, rung_for_tokens, served_ladder
from vitserve.service.ground.errors import InvalidParameter, Overloaded

pytestmark = pytest.mark.anyio


@pytest.fixture
def settings(tiny_onnx):
    return settings_for(tiny_onnx, budget_unmeasured_rungs=True)


def ladder_with(accuracies):
    grids = [(32, 32), (24, 24), (16, 16)]
    return tuple(Rung(g, (g[0] // 8) ** 2, (g[0] / 32) ** 2, a) for g, a in zip(grids, accuracies))


# ------------------------------------------------------------------------------------------------ the served ladder

def test_a_rung_further_below_the_full_budget_than_the_floor_is_never_served(tiny_model, settings):
    info = replace(tiny_model.info, budgets=ladder_with([0.93, 0.925, 0.90]))
    assert [r.tokens for r in served_ladder(info, settings.model_copy(update={"budget_accuracy_floor": 1.0}))] == \
        [16, 9]
    assert [r.tokens for r in served_ladder(info, settings.model_copy(update={"budget_accuracy_floor": 3.0}))] == \
        [16, 9, 4]
    assert [r.tokens for r in served_ladder(info, settings.model_copy(update={"budget_accuracy_floor": 0.0}))] == [16]


def test_rungs_without_a_measured_accuracy_are_served_only_when_the_operator_says_so(tiny_model, settings):
    info = replace(tiny_model.info, budgets=ladder_with([None, None, None]))
    assert len(served_ladder(info, settings)) == 3
    assert len(served_ladder(info, settings.model_copy(update={"budget_unmeasured_rungs": False}))) == 1


def test_max_tokens_picks_the_most_accurate_rung_within_it_and_refuses_below_the_cheapest():
    ladder = ladder_with([0.9, 0.9, 0.9])
    assert [rung_for_tokens(ladder, t) for t in (None, 100, 16, 15, 9, 8, 4)] == [0, 0, 0, 1, 1, 2, 2]
    with pytest.raises(InvalidParameter, match="below the cheapest budget this model serves \\(4 tokens"):
        rung_for_tokens(ladder, 3)


# ------------------------------------------------------------------------------------------------- the controller

IMAGE_S, BATCH = 0.01, 4  # a full batch at the full budget: 40 ms


def loaded(controller: BudgetController, seconds: list[float]) -> BudgetController:
    """The controller having measured each rung's seconds an image in loaded batches."""
    for rung, s in enumerate(seconds):
        controller.ran(rung, BATCH, s * BATCH, loaded=True)
    return controller


def test_below_saturation_the_controller_never_degrades():
    controller = loaded(BudgetController([1.0, 0.5, 0.25], queue_batches=2), [IMAGE_S, IMAGE_S / 2, IMAGE_S / 4])
    for step in range(100):  # a batch taken, and a full batch waiting behind it, each time; 95% of its speed arriving
        controller._arrived += BATCH
        assert controller.choose(step * BATCH * IMAGE_S / 0.95, 2 * BATCH, IMAGE_S, BATCH, runners=1) == 0


def test_a_backlog_takes_the_most_accurate_rung_that_runs_it_within_the_queue_allowed():
    controller = loaded(BudgetController([1.0, 0.5, 0.25], queue_batches=2), [IMAGE_S, IMAGE_S / 2, IMAGE_S / 4])
    assert controller.choose(0.0, BATCH + 3 * BATCH, IMAGE_S, BATCH, 1) == 1  # 3 batches wait: twice as fast fits
    assert controller.choose(0.001, BATCH + 7 * BATCH, IMAGE_S, BATCH, 1) == 2
    assert controller.choose(0.002, BATCH + 30 * BATCH, IMAGE_S, BATCH, 1) == 2  # the cheapest: the rest, admission's


def test_the_rungs_measured_speed_decides_not_their_multiply_adds():
    """A light model's cheaper grid saves less than its multiply-adds say: a call's fixed cost stays."""
    controller = loaded(BudgetController([1.0, 0.5, 0.25], queue_batches=2), [IMAGE_S, 0.9 * IMAGE_S, 0.7 * IMAGE_S])
    assert controller.choose(0.0, BATCH + 3 * BATCH, IMAGE_S, BATCH, 1) == 2
    assert controller.share(1, IMAGE_S) == pytest.approx(0.9)
    unmeasured = BudgetController([1.0, 0.5, 0.25], queue_batches=2)
    assert unmeasured.share(2, IMAGE_S) == pytest.approx(0.25)  # before any loaded batch: the multiply-adds


def test_it_goes_back_up_only_once_the_arrivals_have_fit_the_dearer_rung_for_the_hold():
    controller = loaded(BudgetController([1.0, 0.5, 0.25], queue_batches=2), [IMAGE_S, IMAGE_S / 2, IMAGE_S / 4])
    now = 0.0
    controller.choose(now, 100 * BATCH, IMAGE_S, BATCH, 1)  # overloaded: the cheapest
    # arrivals at 150 images a second: rung 1 serves 200 (75% of it, within the headroom), rung 0 100
    while now < 3.0:
        now += 0.02
        controller._arrived += 3
        rung = controller.choose(now, 1, IMAGE_S, BATCH, 1)
        if now < controller.HOLD_S:
            assert rung == 2, now  # not before the hold, however short the queue
    assert rung == 1  # never to the full budget, which those arrivals would overload


def test_an_idle_gap_brings_it_back_to_the_full_budget_at_the_next_batch():
    controller = loaded(BudgetController([1.0, 0.5, 0.25], queue_batches=2), [IMAGE_S, IMAGE_S / 2, IMAGE_S / 4])
    controller.choose(0.0, 100 * BATCH, IMAGE_S, BATCH, 1)
    assert controller.choose(5.0, 1, IMAGE_S, BATCH, 1) == 0


# ------------------------------------------------------------------------------------------------ in the batcher

async def test_under_a_backlog_the_batcher_runs_degradable_batches_cheaper_and_says_why():
    ran: list[int] = []

    def run_batch(stacked, targets, rung=0):
        ran.append(rung)
        return [float(rung)] * len(stacked)

    controller = BudgetController([1.0, 0.5, 0.25], queue_batches=1)
    batcher = DynamicBatcher(run_batch, max_batch_size=2, max_queue_delay_s=0.0, max_queue_size=64,
                             budgets=controller, resizable_shape=(1, 4, 4), max_batches_in_flight=1)
    batcher._seconds_per_cost[False] = 0.01 / 16  # measured: 10 ms an image
    batcher.start()
    try:
        image = np.zeros((1, 4, 4), np.float32)
        results = await asyncio.gather(*(batcher.submit(image, 10.0) for _ in range(12)))
        assert max(ran) > 0 and {r.reason for r in results if r.rung} == {"load"}
        assert all(r.reason is None for r in results if r.rung == 0)
        with pytest.raises(Overloaded, match="degrade=never"):
            controller.rung = 1
            batcher.enqueue(image, 10.0, degradable=False)
        asked = await batcher.submit(image, 10.0, rung=1, degradable=False)
        assert (asked.rung, asked.reason) == (1, "asked")
        other = await batcher.submit(np.zeros((1, 8, 8), np.float32), 10.0)  # not the trained size: no rungs
        assert other.rung == 0
    finally:
        await batcher.close()


# ------------------------------------------------------------------------------------------------ through the API

async def test_max_tokens_answers_on_the_cheaper_grid_and_every_answer_says_its_budget(settings, tiny_model):
    async with serving(settings, tiny_model) as client:
        full = (await classify(client, image_bytes("PNG"))).json()
        cheap = await classify(client, image_bytes("PNG"), max_tokens=9)
        embedded = await client.post("/v1/embed", params={"max_tokens": 4}, content=image_bytes("PNG"),
                                     headers={"content-type": "image/png"})
        below = await classify(client, image_bytes("PNG"), max_tokens=3)
        bad = await classify(client, image_bytes("PNG"), degrade="sometimes")
        native = (await classify(client, image_bytes("PNG", size=(64, 64)), resize="native", max_tokens=4)).json()
        metrics = samples((await client.get("/metrics")).text)
    assert full["budget"] == {"tokens": 16, "full_tokens": 16, "grid": [32, 32], "reason": None, "accuracy": None}
    assert cheap.status_code == 200, cheap.text
    assert cheap.json()["budget"] == {"tokens": 9, "full_tokens": 16, "grid": [24, 24], "reason": "asked",
                                      "accuracy": None}
    rollout = cheap.json()["rollout"]
    assert (rollout["height"], rollout["width"], np.asarray(rollout["values"]).shape) == (3, 3, (3, 3))  # own grid
    assert embedded.json()["results"][0]["budget"]["tokens"] == 4
    assert_error(below, 422, "invalid_parameter")
    assert "cheapest budget this model serves (4 tokens" in below.text
    assert bad.status_code == 422
    assert native["budget"] == {"tokens": 64, "full_tokens": 64, "grid": [64, 64], "reason": None, "accuracy": None}
    assert value(metrics, "vitserve_budget_answers_total", model="tiny-vit", version="7", tokens="9",
                 reason="asked") == 1
    assert value(metrics, "vitserve_budget_answers_total", model="tiny-vit", version="7", tokens="16", reason="") == 1


async def test_a_rung_served_over_v2_equals_the_graph_run_on_resampled_pixels(settings, tiny_model, tiny_onnx):
    pixels = np.random.default_rng(3).normal(0, 1, (2, 3, 32, 32)).astype(np.float32)
    body = {"parameters": {"max_tokens": 9},
            "inputs": [{"name": INPUT_NAME, "datatype": "FP32", "shape": list(pixels.shape),
                        "data": pixels.ravel().tolist()}],
            "outputs": [{"name": OUTPUT_NAMES[0]}]}
    async with serving(settings, tiny_model) as client:
        response = await client.post("/v2/models/tiny-vit/infer", json=body)
        never = await client.post("/v2/models/tiny-vit/infer", json={**body, "parameters": {"degrade": "never"}})
        wrong = await client.post("/v2/models/tiny-vit/infer", json={**body, "parameters": {"max_tokens": "9"}})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["parameters"] == {"budget_tokens": 9, "budget_full_tokens": 16, "budget_grid": "24x24",
                                    "budget_reason": "asked"}
    session = ort.InferenceSession(str(tiny_onnx), providers=["CPUExecutionProvider"])
    offline = session.run([OUTPUT_NAMES[0]], {INPUT_NAME: resample(pixels, (24, 24))})[0]
    served = np.asarray(answer["outputs"][0]["data"], np.float32).reshape(offline.shape)
    np.testing.assert_allclose(served, offline, atol=1e-5)
    assert never.json()["parameters"] == {"budget_tokens": 16, "budget_full_tokens": 16, "budget_grid": "32x32"}
    assert wrong.status_code == 400 and "max_tokens must be an integer" in wrong.text


async def test_the_same_image_at_a_rung_answers_alike_alone_and_in_a_burst(settings, tiny_model):
    """A burst degrades (the tests' batches hold 4): each answer equals the image's alone at the rung it got."""
    images = [image_bytes("PNG", color=(i * 20, 255 - i * 20, 90)) for i in range(8)]
    async with serving(settings, tiny_model) as client:
        alone = {(i, tokens): (await classify(client, data, max_tokens=tokens, top_k=3)).json()
                 for i, data in enumerate(images) for tokens in (16, 9, 4)}
        burst = await asyncio.gather(*(classify(client, data, max_tokens=9, top_k=3) for data in images * 4))
    seen = set()
    for i, response in enumerate(burst):
        answer = response.json()
        tokens = answer["budget"]["tokens"]
        seen.add((tokens, answer["budget"]["reason"]))
        expected = alone[i % len(images), tokens]
        assert answer["predictions"] == expected["predictions"]  # classes and scores, exactly
        # the map within its rounding (the logits are what batch invariance holds bit for bit)
        np.testing.assert_allclose(answer["rollout"]["values"], expected["rollout"]["values"], atol=2e-6)
    assert (9, "asked") in seen and seen <= {(9, "asked"), (4, "load")}


def test_resample_keeps_a_flat_image_flat_and_each_image_apart():
    flat = np.full((2, 3, 32, 32), 0.25, np.float32)
    assert resample(flat, (24, 24)).shape == (2, 3, 24, 24)
    np.testing.assert_allclose(resample(flat, (24, 24)), 0.25, atol=1e-6)
    rng = np.random.default_rng(0)
    batch = rng.normal(size=(3, 3, 32, 32)).astype(np.float32)
    np.testing.assert_array_equal(resample(batch, (16, 16))[1], resample(batch[1:2], (16, 16))[0])


def test_a_budget_round_trips_through_the_grpc_parameters():
    from vitserve.service.grpc import messages
    from vitserve.service.schemas.inference_protocol import OutputRequest, ParsedInferRequest

    call = ParsedInferRequest(id="x", outputs=[OutputRequest(OUTPUT_NAMES[0], binary=True)])
    response = messages.infer_response(call, "m", "1", {OUTPUT_NAMES[0]: np.zeros((1, 3), np.float32)}, ["a", "b", "c"],
                                       {"budget_tokens": 9, "budget_grid": "24x24", "budget_reason": "load"})
    assert response.parameters["budget_tokens"].int64_param == 9
    assert response.parameters["budget_reason"].string_param == "load"


async def test_the_card_and_the_triton_config_show_the_ladder_and_what_is_served(tiny_onnx, tiny_model):
    measured = replace(tiny_model.info, budgets=ladder_with([0.93, 0.925, 0.80]))

    class Measured:  # the tiny model with a measured ladder, as `vitserve export --eval` writes one
        info, capabilities = measured, tiny_model.capabilities
        run, explain, provider = tiny_model.run, tiny_model.explain, tiny_model.provider

    async with serving(settings_for(tiny_onnx), Measured()) as client:
        card = (await client.get("/v1/model")).json()
        config = (await client.get("/v2/models/tiny-vit/config")).json()
    assert [(r["tokens"], r["accuracy"], r["served"]) for r in card["budgets"]] == \
        [(16, 0.93, True), (9, 0.925, True), (4, 0.8, False)]
    assert card["degrade_under_load"] is True
    parameters = config["parameters"]
    assert parameters["budget_tokens"] == {"string_value": "16,9"}
    assert parameters["budget_grids"] == {"string_value": "32x32,24x24"}
    assert parameters["budget_accuracy"] == {"string_value": "0.9300,0.9250"}
    assert parameters["degrade_under_load"] == {"string_value": "true"}


@pytest.mark.slow
def test_an_engine_process_runs_the_budget_asked_and_its_frontends_say_it(tiny_onnx):
    """The budget crosses the engine's message contract (Submit's rung and degradable, Result's rung and reason)."""
    import httpx
    from service_fixtures import uvicorn_server

    with uvicorn_server(tiny_onnx, "--budget-unmeasured-rungs", "true", workers=2) as (base_url, _):
        answers = [httpx.post(f"{base_url}/v1/classify", params={"max_tokens": tokens}, content=image_bytes("PNG"),
                              headers={"content-type": "image/png"}, timeout=60).json() for tokens in (4, 9, 100)]
        never = httpx.post(f"{base_url}/v1/classify", params={"degrade": "never"}, content=image_bytes("PNG"),
                           headers={"content-type": "image/png"}, timeout=60).json()
    assert [(a["budget"]["tokens"], a["budget"]["reason"]) for a in answers] == [(4, "asked"), (9, "asked"),
                                                                                  (16, None)]
    assert [len(a["rollout"]["values"]) for a in answers] == [2, 3, 4]
    assert never["budget"]["tokens"] == 16


def test_arrivals_past_the_full_budgets_speed_take_the_rung_with_headroom_and_below_it_none():
    speeds = [IMAGE_S, IMAGE_S / 2, IMAGE_S / 4]  # 100, 200 and 400 images a second

    def settled(per_s: float) -> int:
        controller = loaded(BudgetController([1.0, 0.5, 0.25], queue_batches=2), speeds)
        now, rung = 0.0, 0
        while now < 3.0:  # an open loop at per_s, a batch taken every 50 ms with nothing waiting behind it
            now += 0.05
            controller._arrived += round(per_s * 0.05)
            rung = controller.choose(now, 1, IMAGE_S, BATCH, 1)
        return rung

    assert settled(80) == 0  # 0.8x the full budget's speed: never degraded
    assert settled(160) == 1  # 1.6x: half the work, 80% of its speed
    assert settled(220) == 2  # 2.2x: past rung 1's speed; a quarter's has headroom


async def test_a_cheaper_answers_map_is_drawn_at_the_images_size_like_the_full_ones(settings, tiny_model):
    async with serving(settings, tiny_model) as client:
        maps = {(tokens, kind): (await classify(client, image_bytes("PNG", size=(48, 40)), max_tokens=tokens,
                                                map_format=kind)).json()["rollout"]
                for tokens in (16, 4) for kind in ("png", "overlay")}
    for kind in ("png", "overlay"):
        full, cheap = maps[16, kind], maps[4, kind]
        assert (cheap["height"], cheap["width"]) == (full["height"], full["width"]), kind


async def test_a_light_model_refuses_under_load_rather_than_answer_cheaper(settings, tiny_model):
    """Its server is bound by the HTTP path (docs/token-budgets.md): no controller; a client's max_tokens still."""
    from vitserve.service.engine.inference_model import Capabilities
    from vitserve.service.engine.served_model import ServedModel
    from vitserve.service.engine.serving_plan import ServingPlan
    from vitserve.service.ground.metrics import ServiceMetrics

    def plan(light: bool) -> ServingPlan:
        return ServingPlan("onnxruntime", "auto", False, light, "declared", "a test's")

    class Planned:
        def __init__(self, light: bool):
            self.info, self.provider = tiny_model.info, tiny_model.provider
            self.run, self.explain = tiny_model.run, tiny_model.explain
            self.capabilities = Capabilities(plan=plan(light))

    for light, controlled in ((True, False), (False, True)):
        served = ServedModel("tiny-vit", "7", settings, ServiceMetrics().for_model("tiny-vit", "7"), Planned(light))
        await served.load()
        assert (served.batcher.budgets is not None) is controlled and len(served.ladder) == 3
        await served.close(1.0)
