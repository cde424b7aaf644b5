"""Every shape a request id takes, composed and parsed here and nowhere else.

One HTTP request becomes several engine requests, each with an id made from its parent's:

    chatcmpl-<32 hex>          the response (what the client sees as `id`)
    <response>-<i>             one engine request per prompt of the response (prompt i)
    <request>~handover<k>      the k-th time a request was issued again after its replica left
    <request>-<i>              choice i of an n > 1 request that moved, as its own request
    <i>_<request>              child i of an n > 1 request inside the engine (the scheduler's id)

so an id in a log names where it came from: `3_cmpl-...-0~handover1` is child 3 of the first
prompt's engine request after one handover. A module of the bottom layer: the engine composes
child ids, the cluster the rest.
"""

from __future__ import annotations

import re
import uuid

HANDOVER_MARK = "~handover"
_INDEXED = re.compile(r"(?P<base>.+)-(?P<index>\d+)")
_HANDOVER = re.compile(rf"(?P<base>.+){re.escape(HANDOVER_MARK)}(?P<attempt>[1-9]\d*)")
_CHILD = re.compile(r"(?P<index>\d+)_(?P<base>.+)")


def new_response_id(kind: str) -> str:
    """A fresh response id: `kind` is OpenAI's prefix ("cmpl", "chatcmpl")."""
    return f"{kind}-{uuid.uuid4().hex}"


def prompt_request_id(response_id: str, prompt_index: int) -> str:
    return f"{response_id}-{prompt_index}"


def choice_request_id(request_id: str, choice_index: int) -> str:
    return f"{request_id}-{choice_index}"


def handover_request_id(request_id: str, attempt: int) -> str:
    """The id of attempt `attempt` of a request; attempt 0 is the request itself."""
    return request_id if attempt == 0 else f"{request_id}{HANDOVER_MARK}{attempt}"


def child_request_id(request_id: str, index: int) -> str:
    return f"{index}_{request_id}"


def split_indexed(request_id: str) -> tuple[str, int]:
    """(base, i) of a prompt's or a choice's id; ValueError for another shape."""
    return _split(_INDEXED, request_id, "index", "<request>-<i>")


def split_handover(request_id: str) -> tuple[str, int]:
    """(request, attempt) of an attempt's id; (request_id, 0) for an id with no handover."""
    match = _HANDOVER.fullmatch(request_id)
    return (match["base"], int(match["attempt"])) if match else (request_id, 0)


def split_child(request_id: str) -> tuple[str, int]:
    """(parent, i) of an engine child's id; ValueError for another shape."""
    return _split(_CHILD, request_id, "index", "<i>_<request>")


def _split(pattern: re.Pattern, request_id: str, group: str, shape: str) -> tuple[str, int]:
    match = pattern.fullmatch(request_id)
    if match is None:
        raise ValueError(f"request id {request_id!r} is not of the shape {shape}")
    return match["base"], int(match[group])
