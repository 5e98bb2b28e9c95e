"""The one contract between HTTP frontends and an engine process: the messages, as msgspec structs over ZeroMQ.

A frontend (DEALER socket) sends `Submit` for each image, naming the model version it was routed to: the pixels
themselves are in the frontend's shared-memory arena (`service/engine/shm.py`); the message says where. It may
send `Cancel` for an image whose client went away. What a frontend has to send at the end of its loop's turn
travels as one message of one frame, a msgpack array of its `Submit`s and `Cancel`s (a ZeroMQ frame costs each side
about as much Python as the rest of an image's message: 4.5 us to send and receive, against 0.2 to encode and 0.5 to
decode a Submit in an array). The engine (ROUTER socket) answers every `Submit` exactly once, with `Result` or
`Failure`; the answers it has for one frontend at the end of its loop's turn travel the same way, one frame (a
batch's answers wake the frontend once). It publishes `EngineStatus` on a PUB socket several times a second:
readiness, which engine incarnation is running (a restarted engine has a new one), the repository's generation
(it changes whenever a version's state does) and each version's queue, for the frontends' admission.

`Control` asks the engine for its repository index, or to load or unload a model; it gets one `ControlReply`
with the outcome and the index after it (every version's state, and the metadata of those loaded, which the
frontend routes and preprocesses with).

Both sides import this module; tests/service/test_engine.py holds the round trip.
"""
from __future__ import annotations

import msgspec

from vitserve.service.ground.errors import KINDS, ServiceError


class Submit(msgspec.Struct, tag="submit", array_like=True):
    id: int  # unique per frontend connection
    model: str
    version: str  # the version the frontend routed it to: it runs there or fails (VersionRetired)
    arena: str  # the shared-memory segment's name
    offset: int  # of the array's first byte in it
    shape: tuple[int, ...]
    dtype: str  # numpy's dtype.str, e.g. "<f4"
    timeout_s: float  # the time left before the request's deadline
    target: int | None = None  # the class to explain (relevance path; -1 the top-1); None: the fast path
    maps_free: bool = False  # the answer needs no rollout (the maps-free graph may run it)
    rung: int = 0  # the token budget asked for: an index into the version's served ladder (service/engine/budgets.py)
    degradable: bool = True  # load may answer it at a cheaper rung (False: refused instead)


class Cancel(msgspec.Struct, tag="cancel", array_like=True):
    id: int


class Control(msgspec.Struct, tag="control", array_like=True):
    id: int
    op: str  # "index", "load", "unload" or "shadow" (the model's shadow report)
    model: str = ""


class IndexRow(msgspec.Struct, array_like=True):
    model: str
    version: str
    state: str
    reason: str


class LoadedVersion(msgspec.Struct, array_like=True):
    model: str
    version: str
    metadata: dict[str, str]  # ModelInfo.to_metadata() of the version as served (its name and version)
    opset: int | None
    batching: dict[str, int | float]  # its own batching limits (config.json)
    shadow: bool = False  # its model's shadow version: routed to only when named
    version_policy: dict = msgspec.field(default_factory=dict)  # its model's (config.json), Triton's JSON form
    serving: dict = msgspec.field(default_factory=dict)  # how it is served and why (ServedModel.serving)


class RepositoryIndex(msgspec.Struct, array_like=True):
    generation: int
    rows: list[IndexRow]  # every model and version known, as the repository index lists them
    loaded: list[LoadedVersion]
    problems: dict[str, str]  # model -> why it cannot load at all


class ControlReply(msgspec.Struct, tag="control_reply", array_like=True):
    id: int
    index: RepositoryIndex
    code: str = ""  # empty: it worked; else a ServiceError's code
    message: str = ""
    report: dict = msgspec.field(default_factory=dict)  # op "shadow": the model's shadow report


class Tensor(msgspec.Struct, array_like=True):
    shape: tuple[int, ...]
    data: bytes  # float32, little-endian, row-major


class Result(msgspec.Struct, tag="result", array_like=True):
    id: int
    outputs: list[Tensor]  # one per model output, in service.artifact's OUTPUT_NAMES order
    queue_s: float
    inference_s: float
    batch_size: int
    batch_span: str = ""  # the traced batch, for the request's span to link to (service/ground/tracing.py)
    rung: int = 0  # the token budget its batch ran at
    reason: str = ""  # why below the full budget ("asked", "load"); empty at the full budget


class Failure(msgspec.Struct, tag="failure", array_like=True):
    id: int
    code: str  # a ServiceError's code: the frontend raises the same error
    message: str


class VersionQueue(msgspec.Struct, array_like=True):
    model: str
    version: str
    queued: int  # images waiting in its batch queue
    queued_cost: int  # their input values
    seconds_per_cost: float | None  # measured batch time per input value; None before the first batch


class EngineStatus(msgspec.Struct, tag="status", array_like=True):
    incarnation: str  # new each time an engine process starts
    ready: bool  # its startup models loaded and warmed up, not shutting down
    provider: str  # the ONNX Runtime execution provider in use
    generation: int  # the repository's: a frontend with an older index asks for the new one
    queues: list[VersionQueue]  # each ready version's
    sent_at: float  # time.time() when published


def status_address(address: str) -> str:
    """Where the engine at `address` publishes its status."""
    return address + ".status"


ToEngine = Submit | Cancel | Control
FromEngine = Result | Failure | ControlReply


def failure_for(id: int, error: ServiceError) -> Failure:
    return Failure(id, error.code, str(error))


def error_of(failure: Failure) -> ServiceError:
    """The frontend's exception for an engine's Failure: the same kind, found by its code."""
    return KINDS.get(failure.code, ServiceError)(failure.message)


class Codec:
    """msgpack encoders and typed decoders for both directions (one instance per socket user)."""

    def __init__(self):
        self.encoder = msgspec.msgpack.Encoder()
        # a turn's messages each way: one frame holding an array of them
        self.to_engine = msgspec.msgpack.Decoder(list[ToEngine])
        self.from_engine = msgspec.msgpack.Decoder(list[FromEngine])
        self.status = msgspec.msgpack.Decoder(EngineStatus)

    def encode(self, message) -> bytes:
        """One message (a status), or a turn's messages as a list (what `to_engine` and `from_engine` read)."""
        return self.encoder.encode(message)
