"""LLMServer's stream batching: an idle stream's tokens go out at once; tokens that pile up while
a chunk is being sent go out merged in the next; nothing is lost or doubled."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from pagedserve.cluster.llm_server import LLMServer
from pagedserve.cluster.server_config import ServerConfig
from pagedserve.engine.async_llm import _Stream
from pagedserve.engine.request_output import CompletionOutput, RequestOutput
from pagedserve.sampling_params import RequestOutputKind

COUNT = 30


def delta(i: int, finished: bool = False) -> RequestOutput:
    completion = CompletionOutput(0, f"t{i} ", [i], finish_reason="length" if finished else None)
    return RequestOutput("r", "prompt", [1, 2, 3], [completion], finished)


def check_complete(items: list[RequestOutput]) -> None:
    assert sum((i.outputs[0].token_ids for i in items), []) == list(range(COUNT))
    assert "".join(i.outputs[0].text for i in items) == "".join(f"t{n} " for n in range(COUNT))
    assert items[0].outputs[0].token_ids == [0]  # the first token is not held back
    assert items[0].prompt_token_ids == [1, 2, 3] and all(i.prompt_token_ids == [] for i in items[1:])
    assert items[-1].finished and items[-1].outputs[0].finish_reason == "length"
    assert [i.finished for i in items[:-1]] == [False] * (len(items) - 1)


def server(interval_ms: float = ServerConfig().stream_interval_ms) -> SimpleNamespace:
    return SimpleNamespace(stream_interval_s=interval_ms / 1000)


def test_idle_stream_sends_each_token_at_once():
    """The default: a token that arrives while nothing is being sent goes out alone, at once."""

    async def produce():
        for i in range(COUNT):
            await asyncio.sleep(0.002)
            yield delta(i, finished=i == COUNT - 1)

    async def run():
        return [item async for item in LLMServer._batched(server(), produce())]

    items = asyncio.run(run())
    assert [i.outputs[0].token_ids for i in items] == [[n] for n in range(COUNT)]
    check_complete(items)


def test_backlog_is_merged_while_a_chunk_is_sent():
    """Tokens that arrive (from the engine thread) while the consumer is busy sending the last
    chunk are folded by the request's stream and go out as one chunk."""

    async def run():
        stream = _Stream(asyncio.get_running_loop(), RequestOutputKind.DELTA)
        sent_first = threading.Event()

        def engine_thread():
            stream.put(delta(0))
            sent_first.wait(30)
            for i in range(1, COUNT):
                stream.put(delta(i, finished=i == COUNT - 1))

        async def outputs():
            while True:
                item = await stream.get()
                yield item
                if item.finished:
                    return

        producer = threading.Thread(target=engine_thread)
        producer.start()
        items = []
        async for item in LLMServer._batched(server(), outputs()):
            items.append(item)
            if len(items) == 1:
                sent_first.set()
                # A slow send: the engine delivers every other token meanwhile.
                await asyncio.get_running_loop().run_in_executor(None, producer.join, 30)
        return items

    items = asyncio.run(run())
    assert len(items) == 2
    check_complete(items)


def test_interval_waits_between_chunks():
    async def produce():
        for i in range(COUNT):
            yield delta(i, finished=i == COUNT - 1)

    async def run():
        return [item async for item in LLMServer._batched(server(interval_ms=1), produce())]

    check_complete(asyncio.run(run()))
