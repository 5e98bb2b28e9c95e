"""Where an image is decoded: a lone request's small PNG of plain chunks on the event loop (no trip to a pool
thread), everything else in the pools, and the pixel budget held either way."""
from __future__ import annotations

import asyncio
import io
import struct
import threading
import zlib
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from vitserve.artifact import ModelInfo
from vitserve.service.ground.errors import ImageDecodeError, ImageTooLarge
from vitserve.service.ground.settings import Settings
from vitserve.service.usecases import state as state_module
from vitserve.service.usecases.preprocess import CHEAP_DECODE_BYTES, cheap_decode_pixels
from vitserve.service.usecases.state import ImagePools

pytestmark = pytest.mark.anyio

INFO = ModelInfo(name="m", version="1", labels=["a", "b"], patch_size=8, image_size=(32, 32), channels=3,
                 mean=[0.5] * 3, std=[0.25] * 3)
LIMITS = {"max_bytes": 20 * 2**20, "max_pixels": 40_000_000}


def encoded(size: tuple[int, int], fmt: str, **options) -> bytes:
    rng = np.random.default_rng(sum(size))
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), np.uint8)).save(buffer, fmt, **options)
    return buffer.getvalue()


def png_with_chunks(chunks: list[tuple[bytes, bytes]], size: tuple[int, int] = (28, 28)) -> bytes:
    """A PNG with `chunks` (type, data) placed after its IHDR."""
    png = encoded(size, "PNG")
    after_ihdr = 8 + 25  # the signature, then IHDR: length, type, 13 bytes, CRC
    extra = b"".join(struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
                     for kind, data in chunks)
    return png[:after_ihdr] + extra + png[after_ihdr:]


def test_only_a_small_png_of_plain_chunks_counts_as_cheap_to_decode():
    assert cheap_decode_pixels(encoded((40, 30), "PNG"), **LIMITS) == 1200
    assert cheap_decode_pixels(png_with_chunks([(b"tEXt", b"Comment\0small"), (b"pHYs", b"\0" * 9)]), **LIMITS) == 784
    # every JPEG goes to a pool: EXIF parsed on open, progressive scans; so do other formats
    for fmt, options in (("JPEG", {}), ("JPEG", {"progressive": True}), ("WEBP", {})):
        assert cheap_decode_pixels(encoded((40, 30), fmt, **options), **LIMITS) is None
    assert cheap_decode_pixels(encoded((300, 300), "PNG", compress_level=9), **LIMITS) is None  # over 65,536 pixels
    noisy = encoded((200, 200), "PNG")
    assert len(noisy) > CHEAP_DECODE_BYTES and cheap_decode_pixels(noisy, **LIMITS) is None  # over 64 KiB
    # a chunk Pillow inflates while reading the header: 60 of them, 1 MB each, in 63 KB took 135 ms to open here
    text_bomb = png_with_chunks([(b"zTXt", b"k\0\0" + zlib.compress(b"\0" * 2**20, 9))] * 55)
    assert len(text_bomb) < CHEAP_DECODE_BYTES and cheap_decode_pixels(text_bomb, **LIMITS) is None
    assert cheap_decode_pixels(png_with_chunks([(b"iCCP", b"p\0\0" + zlib.compress(b"\0" * 1000))]), **LIMITS) is None
    assert cheap_decode_pixels(png_with_chunks([(b"tIME", b"\0" * 7)] * 70), **LIMITS) is None  # too many chunks
    png = encoded((40, 30), "PNG")
    assert cheap_decode_pixels(png[:-12], **LIMITS) is None  # no IEND: truncated
    assert cheap_decode_pixels(png[:20], **LIMITS) is None  # a header cut short
    # the limits still hold, before any decoding: a small file that declares too many pixels is refused
    with pytest.raises(ImageTooLarge):
        cheap_decode_pixels(png, max_bytes=2**20, max_pixels=1000)
    with pytest.raises(ImageDecodeError):
        cheap_decode_pixels(png[:8] + b"\0\0\0\rIHDR" + b"\xff" * 13 + b"\0" * 4 + png[33:], **LIMITS)


@pytest.fixture
def decode_threads(monkeypatch):
    """The thread each prepare_image ran on, and the pixel budget's use at that moment."""
    seen: list[tuple[str, int]] = []
    original = state_module.prepare_image

    def recording(*args, **kwargs):
        seen.append((threading.current_thread().name, pools[0].budget.used))
        return original(*args, **kwargs)

    pools: list[ImagePools] = []
    monkeypatch.setattr(state_module, "prepare_image", recording)
    return seen, pools


async def test_a_lone_requests_small_image_is_decoded_on_the_loop_and_holds_its_pixels_meanwhile(decode_threads):
    seen, made = decode_threads
    pools = ImagePools(Settings(), SimpleNamespace(provider="CPUExecutionProvider"))
    made.append(pools)
    try:
        loop_thread = threading.current_thread().name
        png = encoded((40, 30), "PNG")
        prepared, seconds = await pools.preprocess(png, INFO, "fit", keep_source=False, inline=True)
        assert prepared.pixels.shape == (3, 32, 32) and seconds > 0
        assert seen[-1] == (loop_thread, 1200) and pools.budget.used == 0
        # not let inline (not alone, or a request's later image): the same image goes to a pool thread
        pooled, _ = await pools.preprocess(png, INFO, "fit", keep_source=False)
        assert seen[-1][0].startswith("preprocess") and pools.budget.used == 0
        # let inline, but an image that is not cheap to decode goes to a pool thread too
        await pools.preprocess(encoded((40, 30), "JPEG", progressive=True), INFO, "fit", keep_source=False,
                               inline=True)
        assert seen[-1][0].startswith("preprocess")
        # the same answer either way
        np.testing.assert_array_equal(prepared.pixels, pooled.pixels)
    finally:
        pools.stop()


async def test_a_lone_request_whose_image_does_not_fit_the_budget_waits_for_room_off_the_loop(decode_threads):
    seen, made = decode_threads
    pools = ImagePools(Settings(max_pixels_in_flight=1000), SimpleNamespace(provider="CPUExecutionProvider"))
    made.append(pools)
    try:
        held = pools.budget.try_reserve(1000)
        waiting = asyncio.ensure_future(pools.preprocess(encoded((40, 30), "PNG"), INFO, "fit", keep_source=False,
                                                         inline=True))
        await asyncio.sleep(0.05)
        assert not waiting.done() and not seen  # it waits for room; nothing decoded it on the loop
        pools.budget.release(held)
        await asyncio.wait_for(waiting, 10)
        assert seen[-1][0].startswith("preprocess")
    finally:
        pools.stop()


@pytest.mark.parametrize("in_flight, expected", [(1, [True, False, False]), (2, [False, False, False])])
async def test_only_a_lone_requests_first_image_may_be_decoded_on_the_loop(in_flight, expected):
    # a request of several images decodes them side by side in the pools, not one after another on the loop; a
    # request beside others never decodes on the loop, where they would wait behind it
    from vitserve.service.usecases import inference

    asked: list[bool] = []

    class Pools:
        async def preprocess(self, data, info, resize, keep_source, inline=False):
            asked.append(inline)
            await asyncio.sleep(0)
            return "prepared", 0.001

    call = call_in(SimpleNamespace(images=Pools(), admission=admitted(in_flight)))
    prepared = await inference._each([b"a", b"b", b"c"], lambda data: inference._decode(call, data, "fit", False))
    assert asked == expected and len(prepared) == 3
    assert [name for name, _ in call.stages].count("decode") == 3


@pytest.mark.parametrize("in_flight, images, alone", [(1, 1, True), (1, 3, False), (2, 1, False)])
async def test_only_a_lone_requests_only_image_may_run_its_batch_on_the_loop(in_flight, images, alone):
    # the engine's `alone` (the batcher runs such a batch of one on the event loop): a request of several images
    # batches them on the runner, and beside another request nobody may wait behind a model call on the loop
    from vitserve.service.engine import InferenceResult
    from vitserve.service.usecases import inference

    asked: list[bool] = []

    class Engine:
        async def submit(self, handle, pixels, timeout_s, target=None, maps_free=False, alone=False, budget=None):
            asked.append(alone)
            await asyncio.sleep(0)
            return InferenceResult((np.ones(2, np.float32), np.ones((4, 4), np.float32)), 0.0, 0.001, 1, "1")

    from vitserve.service.ground.metrics import ServiceMetrics

    state = SimpleNamespace(engine=Engine(), admission=admitted(in_flight), metrics=ServiceMetrics(),
                            ladder=lambda info: info.ladder)
    outputs, version, _ = await inference.run_pixel_tensors(call_in(state), np.zeros((images, 3, 32, 32), np.float32),
                                                            None)
    assert asked == [alone] * images and outputs["logits"].shape == (images, 2) and version == "1"


def admitted(in_flight: int):
    """An admission with `in_flight` requests admitted, from one client connected."""
    from vitserve.service.usecases.admission import Admission

    admission = Admission(max_in_flight=10)
    admission.count_connection(1)
    for _ in range(in_flight):
        admission.enter(0.0, 1.0)
    return admission


def call_in(state):
    """A use case's Call in a state the test fakes, routed to INFO's version."""
    from vitserve.service.ground.deadlines import Deadline
    from vitserve.service.usecases.pipeline import Call

    call = Call(state, None, Deadline.after(10.0))
    call.handle = SimpleNamespace(info=INFO, name="m", version="1")
    return call
