"""The ingress's streamed responses close their events' generator however they end
(ingress.ClosingStreamingResponse): closing it is what aborts the engine requests beneath it. A
client that goes away mid-send leaves a plain StreamingResponse's generator suspended at a yield,
for the garbage collector to close; the test below shows that, so it would fail if Starlette
changed and the class were no longer needed, then the same with the class."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.responses import StreamingResponse

from pagedserve.cluster.ingress import ClosingStreamingResponse


def scope(spec_version: str) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}}


async def serve_until_send_fails(response_class: type, spec_version: str) -> list[str]:
    """A response whose second body chunk meets a closed socket: the generator's own record of
    how it had ended when the response returned (the generator itself is still referenced here,
    as a reference cycle would keep it; asyncio.run closes it later, at the loop's end)."""
    ended: list[str] = []

    async def events():
        try:
            for i in range(1000):
                yield f"data: {i}\n\n"
                await asyncio.sleep(0)
            ended.append("finished")
        finally:
            ended.append("closed")

    sent = []

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body" and sent:
            raise OSError("the client went away")
        sent.append(message)

    async def receive() -> dict:
        await asyncio.Event().wait()  # the client says nothing; its socket fails the send
        return {}

    body = events()
    response = response_class(body, media_type="text/event-stream")
    with pytest.raises(Exception):
        await response(scope(spec_version), receive, send)
    assert body is not None
    return list(ended)


@pytest.mark.parametrize("spec_version", ["2.4", "2.3"])
def test_a_failed_send_closes_the_events(spec_version):
    ended = asyncio.run(serve_until_send_fails(StreamingResponse, spec_version))
    assert ended == [], "a plain StreamingResponse closed its generator: ClosingStreamingResponse may be redundant"
    assert asyncio.run(serve_until_send_fails(ClosingStreamingResponse, spec_version)) == ["closed"]
