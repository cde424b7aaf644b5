"""ServeEngineClient (cluster/serve_engine_client.py) against a fake Serve handle: which transport
each call takes, and what a stream that ends in an error becomes. The real transport runs in the
Serve tests (test_drain_redeploy.py's delete test fails over gRPC without the death record;
test_replica_crash.py's crash must not read as a stop)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from ray.exceptions import ActorUnavailableError

from pagedserve.cluster import serve_engine_client
from pagedserve.cluster.serve_engine_client import GRPC_ARGS_MAX_BYTES, ServeEngineClient
from pagedserve.cluster.stream_items import ErrorInfo, Handover
from pagedserve.sampling_params import SamplingParams

ACTOR_ID = b"\x01" * 16


class FakeHandle:
    """A handle that records the options it was made with, and streams `items` (an exception
    among them is raised there) from each `generate.remote` call."""

    def __init__(self, items: list | None = None, **options):
        self.options_given, self.items, self.calls = options, items or [], []
        self.generate = self

    def options(self, **options) -> FakeHandle:
        handle = FakeHandle(self.items, **{**self.options_given, **options})
        handle.calls = self.calls
        return handle

    def remote(self, *args) -> FakeStream:
        self.calls.append((self.options_given, args))
        return FakeStream(self.items)


class FakeStream:
    def __init__(self, items: list):
        self.items, self.cancelled = list(items), False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


def run(client: ServeEngineClient, prompt: str = "hi") -> list:
    async def collect():
        return [item async for item in client.generate("r", prompt, SamplingParams(max_tokens=1))]

    return asyncio.run(collect())


def transport_of_last_call(handle: FakeHandle) -> str:
    options, _ = handle.calls[-1]
    assert options["stream"] is True
    return "actor" if options.get("_by_reference", True) else "grpc"


def test_calls_go_over_grpc_unless_their_arguments_pass_the_bound():
    handle = FakeHandle(["out"])
    client = ServeEngineClient(handle)
    assert run(client) == ["out"]
    assert transport_of_last_call(handle) == "grpc"
    run(client, "x" * (GRPC_ARGS_MAX_BYTES - 1000))
    assert transport_of_last_call(handle) == "grpc"
    run(client, "x" * GRPC_ARGS_MAX_BYTES)  # pickled, past the bound
    assert transport_of_last_call(handle) == "actor"


def test_the_actor_transport_never_uses_grpc():
    handle = FakeHandle(["out"])
    run(ServeEngineClient(handle, "actor"))
    assert transport_of_last_call(handle) == "actor"


def test_an_unknown_transport_is_refused_by_name():
    with pytest.raises(ValueError, match=r"transport must be one of \('grpc', 'actor'\), not 'http'"):
        ServeEngineClient(FakeHandle(), "http")


@pytest.mark.parametrize(
    "death, expected",
    [("RAY_KILL", Handover()), ("WORKER_DIED", "died"), ("NODE_DIED", "died"), ("RESTARTING", "died"), (None, "died")],
)
def test_an_unavailable_replica_is_a_handover_only_if_the_gcs_says_serve_killed_it(monkeypatch, death, expected):
    """Over gRPC both a stop and a crash end the stream with ActorUnavailableError; the GCS's
    death record decides (None: still alive after the wait, so lost for this stream)."""
    looked = []
    monkeypatch.setattr(serve_engine_client, "DEATH_RECORD_WAIT_S", 0.05)
    monkeypatch.setattr(serve_engine_client, "DEATH_RECORD_POLL_S", 0.01)
    monkeypatch.setattr(serve_engine_client, "actor_death", lambda actor_id: looked.append(actor_id) or death)
    items = run(ServeEngineClient(FakeHandle(["a", ActorUnavailableError("gone", ACTOR_ID)])))
    assert items[0] == "a" and looked and set(looked) == {ACTOR_ID.hex()}
    if expected == "died":
        assert isinstance(items[1], ErrorInfo) and items[1].status == 503 and "died" in items[1].message
    else:
        assert items[1] == expected


def test_the_streams_of_one_replica_ask_the_gcs_once(monkeypatch):
    looked = []
    monkeypatch.setattr(serve_engine_client, "actor_death", lambda actor_id: looked.append(actor_id) or "RAY_KILL")
    client = ServeEngineClient(FakeHandle([ActorUnavailableError("gone", ACTOR_ID)]))

    async def many():
        async def one():
            return [item async for item in client.generate("r", "hi", SamplingParams(max_tokens=1))]

        return await asyncio.gather(*(one() for _ in range(8)))

    assert asyncio.run(many()) == [[Handover()]] * 8
    assert looked == [ACTOR_ID.hex()]


class FakeRpcError(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode):
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="too big")


def test_a_grpc_failure_is_a_503_naming_its_code_not_a_500():
    items = run(ServeEngineClient(FakeHandle(["a", FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED)])))
    assert items[0] == "a"
    assert isinstance(items[1], ErrorInfo) and items[1].status == 503
    assert "gRPC RESOURCE_EXHAUSTED" in items[1].message


def test_a_replica_that_read_as_alive_is_asked_about_again_when_it_ends(monkeypatch):
    """A stream cut while the GCS still held its replica alive (lost for that stream) must not
    make the replica's later stop read as a crash."""
    deaths = iter([None, "RAY_KILL"])
    monkeypatch.setattr(serve_engine_client, "DEATH_RECORD_WAIT_S", 0.0)
    monkeypatch.setattr(serve_engine_client, "actor_death", lambda actor_id: next(deaths))
    client = ServeEngineClient(FakeHandle([ActorUnavailableError("gone", ACTOR_ID)]))
    first, second = run(client), run(client)
    assert isinstance(first[0], ErrorInfo) and "died" in first[0].message
    assert second == [Handover()]
