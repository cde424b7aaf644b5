"""OutputProcessor on its own, fed the scheduler's per-step news (`StepOutputs`: whole
`EngineCoreOutput`s and plain one-token rows) by hand, on the session's real byte-level BPE
tokenizer: n=3 completions merged as FINAL_ONLY or streamed as DELTA, a stop string split across
tokens, and one child of three given up on."""

from __future__ import annotations

import pytest

from pagedserve.engine.engine_core_output import EngineCoreOutput, FinishReason, StepOutputs
from pagedserve.engine.fan_out import child_request_id
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.sampling_params import RequestOutputKind, SamplingParams

PROMPT = "Tell me a story:"
# Each child's tokens, and the step at which the scheduler ends it (by length).
TEXTS = [" Once upon a time", " There was a cat", " It rained"]


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def start(tokenizer, kind: RequestOutputKind, request_id: str = "r", n: int = 3, **params):
    processor = OutputProcessor(tokenizer)
    sampling = SamplingParams(n=n, max_tokens=32, output_kind=kind, **params)
    children = processor.add_request(request_id, PROMPT, encode(tokenizer, PROMPT), sampling, arrival_time=0.0)
    return processor, [child_id for child_id, _ in children]


def run_children(processor: OutputProcessor, child_ids: list[str], streams: list[list[int]]):
    """One token per child per step, each child ending by length on its last token; returns
    every RequestOutput delivered."""
    delivered = []
    for position in range(max(map(len, streams))):
        news = StepOutputs()
        for child_id, tokens in zip(child_ids, streams):
            if position == 0 or position == len(tokens) - 1:  # its first token, or its end: a whole output
                finish_reason = FinishReason.LENGTH if position == len(tokens) - 1 else None
                news.outputs.append(EngineCoreOutput(child_id, [tokens[position]], finish_reason=finish_reason))
            elif position < len(tokens):  # as the scheduler sends most tokens: a plain row
                news.token_req_ids.append(child_id)
                news.token_ids.append(tokens[position])
        outputs, stopped = processor.process_outputs(news)
        assert stopped == []
        delivered.extend(outputs)
    return delivered


def test_children_get_their_own_ids(tokenizer):
    _, child_ids = start(tokenizer, RequestOutputKind.DELTA)
    assert child_ids == [child_request_id("r", i) for i in range(3)] and len(set(child_ids)) == 3
    _, single = start(tokenizer, RequestOutputKind.DELTA, n=1)
    assert single == ["r"]


def test_final_only_delivers_one_output_with_all_n_when_the_last_child_ends(tokenizer):
    processor, child_ids = start(tokenizer, RequestOutputKind.FINAL_ONLY)
    streams = [encode(tokenizer, text) for text in TEXTS]
    assert len({len(s) for s in streams}) == 3  # the children end at different steps
    delivered = run_children(processor, child_ids, streams)
    (final,) = delivered
    assert final.request_id == "r" and final.finished
    assert [c.index for c in final.outputs] == [0, 1, 2]
    assert [c.text for c in final.outputs] == TEXTS
    assert [c.token_ids for c in final.outputs] == streams
    assert {c.finish_reason for c in final.outputs} == {"length"}
    assert processor.parents == {} and processor.states == {}


def test_delta_streams_each_child_and_the_deltas_add_up(tokenizer):
    processor, child_ids = start(tokenizer, RequestOutputKind.DELTA)
    streams = [encode(tokenizer, text) for text in TEXTS]
    delivered = run_children(processor, child_ids, streams)
    assert len(delivered) == sum(map(len, streams))  # one output per child per token
    assert all(len(output.outputs) == 1 for output in delivered)
    for index, (text, tokens) in enumerate(zip(TEXTS, streams)):
        mine = [output.outputs[0] for output in delivered if output.outputs[0].index == index]
        assert "".join(c.text for c in mine) == text
        assert [t for c in mine for t in c.token_ids] == tokens  # each token exactly once
        assert [c.finish_reason for c in mine] == [None] * (len(tokens) - 1) + ["length"]
    # The request is finished only with its last child's last output.
    assert [output.finished for output in delivered] == [False] * (len(delivered) - 1) + [True]


def test_a_stop_string_split_across_tokens_ends_the_request(tokenizer):
    text = " Once upon a time there was a cat"
    tokens = encode(tokenizer, text)
    # A stop string that starts in one token and ends in the next.
    boundary = next(
        i for i in range(1, len(tokens)) if len(tokenizer.decode(tokens[:i])) >= 12 and tokenizer.decode(tokens[i : i + 1]).strip()
    )
    before, after = tokenizer.decode(tokens[:boundary]), tokenizer.decode(tokens[boundary : boundary + 1])
    stop = before[-2:] + after[:2]
    assert stop in text and len(after) >= 2 and text.index(stop) == len(before) - 2
    processor, (child_id,) = start(tokenizer, RequestOutputKind.DELTA, n=1, stop=[stop])

    deltas = []
    for position, token_id in enumerate(tokens):
        outputs, stopped = processor.process_outputs(StepOutputs([], [child_id], [token_id]))
        (output,) = outputs
        deltas.append(output.outputs[0].text)
        completion = output.outputs[0]
        if position < boundary:
            assert stopped == [] and completion.finish_reason is None
            continue
        # The token completing the stop string ends it: the scheduler must abort it (it still runs).
        assert stopped == [child_id] and output.finished
        assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
        break
    assert position == boundary
    assert "".join(deltas) == before[:-2]  # the text before the stop string, and none of it
    assert processor.stats.request_success_total == {"stop": 1}


def test_a_stop_token_id_is_reported_as_the_stop_reason(tokenizer):
    processor, (child_id,) = start(tokenizer, RequestOutputKind.FINAL_ONLY, n=1)
    tokens = encode(tokenizer, " Once upon")
    outputs, stopped = processor.process_outputs(
        StepOutputs([EngineCoreOutput(child_id, tokens[:1]), EngineCoreOutput(child_id, tokens[1:2], finish_reason=FinishReason.STOP, stop_token_id=tokens[1])])
    )
    (output,) = outputs
    assert stopped == []  # the scheduler ended it itself
    assert (output.outputs[0].finish_reason, output.outputs[0].stop_reason) == ("stop", tokens[1])
    assert output.outputs[0].token_ids == tokens[:2] and output.outputs[0].text == tokenizer.decode(tokens[:1])


@pytest.mark.parametrize("kind", [RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA])
def test_one_child_given_up_the_others_finish(tokenizer, kind):
    processor, child_ids = start(tokenizer, kind)
    streams = [encode(tokenizer, text) for text in TEXTS]
    # Everyone gets a first token; then the engine gives up on child 1 alone.
    first, _ = processor.process_outputs(StepOutputs([EngineCoreOutput(c, s[:1]) for c, s in zip(child_ids, streams)]))
    aborted = processor.finish_aborted([child_ids[1]])
    assert processor.finish_aborted([child_ids[1]]) == []  # once only
    rest = run_children(processor, [child_ids[0], child_ids[2]], [streams[0][1:], streams[2][1:]])
    final = rest[-1]
    assert final.finished and processor.parents == {}
    if kind == RequestOutputKind.FINAL_ONLY:
        assert first == [] and aborted == [] and rest == [final]  # nothing before the end
        assert [c.finish_reason for c in final.outputs] == ["length", "abort", "length"]
        assert [c.token_ids for c in final.outputs] == [streams[0], streams[1][:1], streams[2]]
    else:
        assert len(first) == 3
        (output,) = aborted
        assert not output.finished  # the other two still run
        assert [(c.index, c.finish_reason, c.token_ids) for c in output.outputs] == [(1, "abort", [])]
        assert all(o.outputs[0].index != 1 for o in rest)
    assert processor.stats.request_success_total == {"abort": 1, "length": 2}


def test_aborting_the_request_aborts_its_live_children_only(tokenizer):
    processor, child_ids = start(tokenizer, RequestOutputKind.DELTA)
    streams = [encode(tokenizer, text) for text in TEXTS]
    processor.process_outputs(StepOutputs([EngineCoreOutput(child_ids[0], streams[0][:1], finish_reason=FinishReason.LENGTH)]))
    assert processor.abort_requests(["r", "unknown"]) == child_ids[1:]  # child 0 already ended
    assert processor.parents == {} and processor.states == {}
    assert processor.stats.request_success_total == {"length": 1, "abort": 2}
