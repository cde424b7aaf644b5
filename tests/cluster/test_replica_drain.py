"""ReplicaDrain (cluster/replica_drain.py) and SigtermHook (cluster/ray_internals.py) alone, with fake engine streams and a
stand-in for Ray's SIGTERM handler; a real replica sent SIGTERM is test_drain_sigterm.py."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from pagedserve.cluster.llm_server import LLMServer
from pagedserve.cluster.ray_internals import RAY_SIGTERM_MESSAGE, SigtermHook
from pagedserve.cluster.replica_drain import ReplicaDrain
from pagedserve.cluster.stream_items import Handover
from pagedserve.sampling_params import RequestOutputKind, SamplingParams

HANDOVER = "handover"
ONE_DELTA = SamplingParams(max_tokens=100, output_kind=RequestOutputKind.DELTA)
TWO_DELTAS = SamplingParams(n=2, max_tokens=100, output_kind=RequestOutputKind.DELTA, temperature=1.0)
CUMULATIVE = SamplingParams(max_tokens=100, output_kind=RequestOutputKind.CUMULATIVE)


class EngineStream:
    """An engine request's outputs: what the test puts, until the stream is closed."""

    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.is_closed = False

    async def outputs(self):
        try:
            while True:
                yield await self.queue.get()
        finally:
            self.is_closed = True


class Caller:
    """Reads one stream through the drain, as LLMServer.generate does."""

    def __init__(self, drain: ReplicaDrain, params: SamplingParams):
        self.engine = EngineStream()
        self.items: list = []
        self.received = asyncio.Event()
        self.task = asyncio.ensure_future(self._read(drain, params))

    async def _read(self, drain, params):
        async for item in drain.stream(self.engine.outputs(), params):
            self.items.append(item)
            self.received.set()

    async def put(self, output) -> None:
        self.received.clear()
        await self.engine.queue.put(output)
        await self.received.wait()


def run(scenario) -> None:
    asyncio.run(asyncio.wait_for(scenario(), timeout=30))


def test_streams_that_can_move_end_with_a_handover_at_once_then_the_replica_ends():
    async def scenario():
        drained = asyncio.Event()

        async def on_drained():
            drained.set()

        drain = ReplicaDrain(HANDOVER, 3600.0, on_drained)  # no deadline within the test
        one = Caller(drain, ONE_DELTA)  # resumes from what the client has
        two = Caller(drain, TWO_DELTAS)  # each choice resumes as its own request
        whole = Caller(drain, SamplingParams(n=2, max_tokens=100))  # nothing sent before its end: restarts
        await one.put("a")
        await two.put("b")
        drain.start()
        await asyncio.gather(one.task, two.task, whole.task)
        assert one.items == ["a", HANDOVER] and two.items == ["b", HANDOVER] and whole.items == [HANDOVER]
        assert one.engine.is_closed and two.engine.is_closed and whole.engine.is_closed  # closed: the engine aborts them
        await drained.wait()
        assert drain.is_draining and drain.num_streams == 0

    run(scenario)


def test_a_stream_that_cannot_move_runs_until_the_deadline():
    async def scenario():
        drained = asyncio.Event()

        async def on_drained():
            drained.set()

        drain = ReplicaDrain(HANDOVER, 0.5, on_drained)
        samples = Caller(drain, CUMULATIVE)  # text sent, not as deltas: the ingress could not resume it
        await samples.put("a")
        drain.start()
        await samples.put("b")  # it runs on while the replica drains
        assert not drained.is_set()
        await samples.task  # until the deadline
        assert samples.items == ["a", "b", HANDOVER] and samples.engine.is_closed
        await drained.wait()

    run(scenario)


def test_a_stream_that_ends_is_untouched_and_an_idle_replica_ends_at_once():
    async def scenario():
        drained = asyncio.Event()

        async def on_drained():
            drained.set()

        async def outputs():
            for output in ("a", "b"):
                yield output

        drain = ReplicaDrain(HANDOVER, 3600.0, on_drained)
        assert [item async for item in drain.stream(outputs(), ONE_DELTA)] == ["a", "b"]
        assert drain.num_streams == 0 and not drained.is_set()
        drain.start()
        await drained.wait()

    run(scenario)


def test_a_draining_replica_answers_a_new_request_with_a_handover_alone():
    """The ingress then sends the request to another replica (test_drain_client.py)."""

    async def scenario():
        server = object.__new__(LLMServer)  # no engine: a draining replica must not reach it
        server.drain = ReplicaDrain(Handover("replica-0"), 3600.0, None)
        server.drain.is_draining = True
        items = [item async for item in server.generate("req", {"prompt_token_ids": [1, 2]}, ONE_DELTA)]
        assert items == [Handover("replica-0")]

    run(scenario)


# A stand-in for Ray 2.60's worker SIGTERM handler (ray/_private/worker.py, Worker.main_loop):
# it calls this module-level name, looked up when it runs.
def raise_sys_exit_with_custom_error_message(message: str, exit_code: int = 0) -> None:
    raise SystemExit(exit_code)


def ray_sigterm_handler(signum, frame):
    raise_sys_exit_with_custom_error_message("The process receives a SIGTERM.", exit_code=1)


def test_the_sigterm_hook_hands_sigterm_to_the_drain_instead_of_exiting():
    assert RAY_SIGTERM_MESSAGE in ray_sigterm_handler.__code__.co_consts
    original_handler = signal.signal(signal.SIGTERM, ray_sigterm_handler)
    original_exit = raise_sys_exit_with_custom_error_message
    answers = [True]
    calls = []

    def on_sigterm() -> bool:
        calls.append(True)
        return answers[0]

    try:
        assert SigtermHook(on_sigterm).install()
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs on this (the main) thread
        assert calls == [True]  # handed over, no SystemExit
        answers[0] = False  # a drain that cannot run: Ray's exit as before
        with pytest.raises(SystemExit):
            os.kill(os.getpid(), signal.SIGTERM)
        assert calls == [True, True]
    finally:
        signal.signal(signal.SIGTERM, original_handler)
        globals()["raise_sys_exit_with_custom_error_message"] = original_exit


def test_the_sigterm_hook_leaves_a_handler_it_does_not_know_alone():
    original_handler = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        assert not SigtermHook(lambda: True).install()
    finally:
        signal.signal(signal.SIGTERM, original_handler)
