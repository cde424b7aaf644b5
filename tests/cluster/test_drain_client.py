"""ResumingClient (cluster/handover.py) against a fake engine client: what it sends when a
stream's replica leaves, and what the caller sees. The real thing runs in test_drain.py."""

from __future__ import annotations

import asyncio

from pagedserve.cluster.handover import HandoverRegistry, ResumingClient
from pagedserve.cluster.stream_items import ErrorInfo, Handover
from pagedserve.engine.request_output import CompletionOutput, RequestOutput
from pagedserve.sampling_params import RequestOutputKind, SamplingParams

PROMPT_IDS = [7, 8, 9]


def item(text: str, token_ids: list[int], finished: bool = False, index: int = 0, is_last: bool | None = None) -> RequestOutput:
    """An item of one choice; `finished`: that choice ends; `is_last`: the request's last item
    (every choice ended), by default the same."""
    completion = CompletionOutput(index, text, token_ids, cumulative_logprob=-1.0 * len(token_ids), finish_reason="length" if finished else None)
    return RequestOutput("r", None, PROMPT_IDS, [completion], finished if is_last is None else is_last)


class FakeEngines:
    """Serves each call from a script: a list of items, where "leave" makes its replica leave
    (as the router would report) and then waits to be cancelled."""

    def __init__(self, registry: HandoverRegistry, scripts: list[list]):
        self.registry, self.scripts, self.calls, self.params = registry, scripts, [], []

    async def generate(self, request_id, prompt, params, resume=None):
        replica_id = f"replica-{len(self.calls)}"
        script = self.scripts[len(self.calls)]
        self.calls.append((request_id, prompt, resume))
        self.params.append(params)
        self.registry.routed(request_id, replica_id)
        for entry in script:
            if entry == "leave":
                self.registry.mark_leaving([replica_id])
                await asyncio.Event().wait()  # a stream that would go on, until it is cancelled
            yield entry


def run(scripts: list[list], params: SamplingParams, engines: FakeEngines | None = None) -> tuple[list, list]:
    registry = engines.registry if engines is not None else HandoverRegistry()
    engines = engines or FakeEngines(registry, scripts)

    async def collect():
        return [x async for x in ResumingClient(engines, registry).generate("req", "the prompt", params)]

    return asyncio.run(asyncio.wait_for(collect(), timeout=30)), engines.calls


def test_a_leaving_replicas_stream_resumes_from_what_was_received():
    params = SamplingParams(max_tokens=5, output_kind=RequestOutputKind.DELTA)
    first = [item("Hel", [1]), item("lo", [2, 3]), "leave"]
    second = [item(" wor", [4]), item("ld", [5], finished=True)]
    items, calls = run([first, second], params)
    assert "".join(i.outputs[0].text for i in items) == "Hello world"
    assert [t for i in items for t in i.outputs[0].token_ids] == [1, 2, 3, 4, 5]
    (id0, prompt0, resume0), (id1, prompt1, resume1) = calls
    assert (id0, prompt0, resume0) == ("req", "the prompt", None)
    assert id1 != id0 and prompt1 == {"prompt_token_ids": PROMPT_IDS}  # the prompt, not the outputs
    assert resume1.output_token_ids == [1, 2, 3] and resume1.num_sent_chars == 5 and resume1.cumulative_logprob == -2.0


def test_a_request_with_nothing_received_starts_again():
    params = SamplingParams(max_tokens=5)  # a whole (FINAL_ONLY) request: nothing comes before the end
    items, calls = run([["leave"], [item("Hello", [1, 2], finished=True)]], params)
    assert [i.outputs[0].text for i in items] == ["Hello"]
    assert [(prompt, resume) for _, prompt, resume in calls] == [("the prompt", None), ("the prompt", None)]


def test_a_replica_stopped_by_serve_hands_over_and_a_crash_does_not():
    params = SamplingParams(max_tokens=5, output_kind=RequestOutputKind.DELTA)
    items, calls = run([[item("Hel", [1]), Handover()], [item("lo", [2], finished=True)]], params)
    assert "".join(i.outputs[0].text for i in items) == "Hello" and calls[1][2].output_token_ids == [1]
    crash = ErrorInfo(503, "the engine replica serving this request died; retry later", "ServiceUnavailableError")
    items, calls = run([[item("Hel", [1]), crash]], params)
    assert items[-1] == crash and len(calls) == 1


def test_a_stream_whose_final_item_came_ends_there():
    """Its replica stopped after the last item went out: nothing is left to make, no error."""
    params = SamplingParams(max_tokens=2, output_kind=RequestOutputKind.DELTA)
    items, calls = run([[item("Hel", [1]), item("lo", [2], finished=True), Handover()]], params)
    assert [i.outputs[0].text for i in items] == ["Hel", "lo"] and len(calls) == 1


def test_an_n2_stream_moves_choice_by_choice():
    """Each unfinished choice resumes as its own one-sample request (seed + index, what the
    client has of that choice); a finished choice does not move; indices are the request's."""
    params = SamplingParams(n=3, max_tokens=3, output_kind=RequestOutputKind.DELTA, temperature=1.0, seed=10)
    first = [item("a", [1], index=0), item("bb", [5], index=1), item("c", [8, 9, 7], finished=True, index=2, is_last=False), "leave"]
    choice0 = [item("A", [2]), item("!", [3], finished=True)]
    choice1 = [item("B", [6, 4], finished=True)]
    engines = FakeEngines(HandoverRegistry(), [first, choice0, choice1])
    items, calls = run([], params, engines)
    texts = {i: "".join(c.text for x in items for c in x.outputs if c.index == i) for i in range(3)}
    assert texts == {0: "aA!", 1: "bbB", 2: "c"}
    assert [x.finished for x in items] == [False] * 5 + [True]  # once every choice is done
    (_, _, _), (_, prompt0, resume0), (_, prompt1, resume1) = calls
    assert prompt0 == prompt1 == {"prompt_token_ids": PROMPT_IDS}
    assert (resume0.output_token_ids, resume0.num_sent_chars) == ([1], 1)
    assert (resume1.output_token_ids, resume1.num_sent_chars) == ([5], 2)
    assert [(p.n, p.seed) for p in engines.params[1:]] == [(1, 10), (1, 11)]
