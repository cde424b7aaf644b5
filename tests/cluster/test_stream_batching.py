"""LLMServer's stream batching: deltas merged per interval, first and last at once, nothing lost."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from pagedserve.cluster.llm_server import LLMServer
from pagedserve.engine.request_output import CompletionOutput, RequestOutput


def delta(i: int, finished: bool = False) -> RequestOutput:
    completion = CompletionOutput(0, f"t{i} ", [i], finish_reason="length" if finished else None)
    return RequestOutput("r", "prompt", [1, 2, 3], [completion], finished)


async def produce(count: int, gap_s: float):
    for i in range(count):
        await asyncio.sleep(gap_s)
        yield delta(i, finished=i == count - 1)


def batched(interval_s: float, count: int, gap_s: float) -> list[RequestOutput]:
    server = SimpleNamespace(stream_interval_s=interval_s)

    async def run():
        return [item async for item in LLMServer._batched(server, produce(count, gap_s))]

    return asyncio.run(run())


def test_deltas_are_merged_within_the_interval():
    items = batched(interval_s=0.05, count=30, gap_s=0.005)
    assert 2 < len(items) < 30
    assert sum((i.outputs[0].token_ids for i in items), []) == list(range(30))
    assert "".join(i.outputs[0].text for i in items) == "".join(f"t{n} " for n in range(30))
    assert items[0].outputs[0].token_ids == [0]  # the first token is not held back
    assert items[0].prompt_token_ids == [1, 2, 3] and all(i.prompt_token_ids == [] for i in items[1:])
    assert items[-1].finished and items[-1].outputs[0].finish_reason == "length"
    assert [i.finished for i in items[:-1]] == [False] * (len(items) - 1)


def test_zero_interval_sends_every_token():
    items = batched(interval_s=0.0, count=10, gap_s=0.0)
    assert [i.outputs[0].token_ids for i in items] == [[n] for n in range(10)]
