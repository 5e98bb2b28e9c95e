"""What a client may ask to have explained: which map, and for the relevance map which class.

Two maps: `rollout`, the attention rollout (class-agnostic: how attention flows from the class token to the
patches; the same map whatever the class), and `relevance`, conservative relevance for one class (what each
patch's content added to that class's logit, signed; docs/maps.md), which runs the model's relevance path (a
backward pass inside the graph) in batches of its own. Pure functions of the request's words and the model's labels.
"""
from __future__ import annotations

from vitserve.artifact import TOP1_TARGET, ModelInfo
from vitserve.service.ground.errors import InvalidParameter

MAX_TARGET_CHARS = 256


def relevance_target(text: str | int | None, info: ModelInfo) -> int:
    """The class to explain: an index or a label of the model (None: the top-1, `TOP1_TARGET`); InvalidParameter
    for a class the model does not have or a model without the relevance path."""
    require_relevance(info)
    if text is None:
        return TOP1_TARGET
    if isinstance(text, bool):  # JSON true is an int to Python, never a class
        raise InvalidParameter(f"target must be a class index or label, got {text!r}")
    if isinstance(text, int) or (isinstance(text, str) and text.isdecimal() and text not in info.labels):
        index = int(text)
        if not 0 <= index < info.num_classes:
            shown = str(text) if len(str(text)) <= 20 else f"{str(text)[:20]}..."  # never echo a long number whole
            raise InvalidParameter(f"target {shown} is not a class index of this model (0 to {info.num_classes - 1})")
        return index
    if text in info.labels:
        return info.labels.index(text)
    shown = ", ".join(repr(label) for label in info.labels[:10]) + (", ..." if info.num_classes > 10 else "")
    raise InvalidParameter(f"target {text[:MAX_TARGET_CHARS]!r} is neither a class index (0 to "
                           f"{info.num_classes - 1}) nor a label of this model ({shown})")


def require_relevance(info: ModelInfo) -> None:
    if not info.explains_classes:
        raise InvalidParameter(f"model {info.name} {info.version} was exported without the relevance path (its maps: "
                               f"{', '.join(info.maps)}); export it again without --no-relevance")
