"""ResumingClient (cluster/handover.py) against a fake engine client: what it sends when a
stream's replica leaves, and what the caller sees. The real thing runs in test_drain.py."""

from __future__ import annotations

import asyncio

from pagedserve.cluster.handover import HandoverRegistry, ResumingClient
from pagedserve.cluster.llm_server import ErrorInfo, Handover
from pagedserve.engine.request_output import CompletionOutput, RequestOutput
from pagedserve.sampling_params import RequestOutputKind, SamplingParams

PROMPT_IDS = [7, 8, 9]


def item(text: str, token_ids: list[int], finished: bool = False) -> RequestOutput:
    completion = CompletionOutput(0, text, token_ids, cumulative_logprob=-1.0 * len(token_ids), finish_reason="length" if finished else None)
    return RequestOutput("r", None, PROMPT_IDS, [completion], finished)


class FakeEngines:
    """Serves each call from a script: a list of items, where "leave" makes its replica leave
    (as the router would report) and then waits to be cancelled."""

    def __init__(self, registry: HandoverRegistry, scripts: list[list]):
        self.registry, self.scripts, self.calls = registry, scripts, []

    async def generate(self, request_id, prompt, params, resume=None):
        replica_id = f"replica-{len(self.calls)}"
        script = self.scripts[len(self.calls)]
        self.calls.append((request_id, prompt, resume))
        self.registry.routed(request_id, replica_id)
        for entry in script:
            if entry == "leave":
                self.registry.mark_leaving([replica_id])
                await asyncio.Event().wait()  # a stream that would go on, until it is cancelled
            yield entry


def run(scripts: list[list], params: SamplingParams) -> tuple[list, list]:
    registry = HandoverRegistry()
    engines = FakeEngines(registry, scripts)

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


def test_a_stream_that_cannot_resume_ends_with_an_error():
    """n > 1 streams interleave samples: once text went out, they cannot move."""
    params = SamplingParams(n=2, max_tokens=5, output_kind=RequestOutputKind.DELTA, temperature=1.0)
    items, calls = run([[item("Hel", [1]), Handover()]], params)
    assert isinstance(items[-1], ErrorInfo) and items[-1].status == 503 and len(calls) == 1
