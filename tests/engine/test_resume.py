"""Resuming a request another replica began (engine/input_processor.py's ResumeState): the
resumed run continues exactly where the client's stream stopped, as if undisturbed. In-process,
no Ray: one LLMEngine runs the undisturbed request, then resumes it from several cut points."""

from __future__ import annotations

import pytest

from pagedserve.engine.input_processor import ResumeState
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.request_output import RequestOutput
from pagedserve.sampling_params import RequestOutputKind, SamplingParams

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def engine(model_dirs):
    engine = LLMEngine.from_engine_args(model=str(model_dirs["llama"]), max_model_len=256)
    yield engine
    engine.shutdown()


def stream(engine: LLMEngine, request_id: str, params: SamplingParams, resume: ResumeState | None = None) -> list[RequestOutput]:
    prompt_ids = engine.tokenizer.encode(PROMPT)
    engine.add_processed_request(request_id, engine.input_processor.process({"prompt_token_ids": prompt_ids}, params, resume), params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    assert outputs[-1].finished
    return outputs


def delta(**kwargs) -> SamplingParams:
    return SamplingParams(output_kind=RequestOutputKind.DELTA, ignore_eos=True, **{"max_tokens": 24, **kwargs})


def check_resumes_identically(engine: LLMEngine, params: SamplingParams, cuts: list[int]) -> list[RequestOutput]:
    """Resume from the client's view after `cut` items: prior tokens, the text it received."""
    whole = stream(engine, "whole", params)
    full_text = "".join(o.outputs[0].text for o in whole)
    full_ids = [t for o in whole for t in o.outputs[0].token_ids]
    for cut in cuts:
        seen = [o.outputs[0] for o in whole[:cut]]
        prior_ids = [t for c in seen for t in c.token_ids]
        sent_text = "".join(c.text for c in seen)
        resume = ResumeState(prior_ids, len(sent_text), seen[-1].cumulative_logprob)
        rest = stream(engine, f"resumed-{cut}", params, resume)
        completions = [o.outputs[0] for o in rest]
        assert sent_text + "".join(c.text for c in completions) == full_text, cut
        assert prior_ids + [t for c in completions for t in c.token_ids] == full_ids, cut
        assert completions[-1].finish_reason == whole[-1].outputs[0].finish_reason
        assert completions[-1].stop_reason == whole[-1].outputs[0].stop_reason
        assert rest[0].prompt_token_ids == whole[0].prompt_token_ids  # the prompt is still only the prompt
        if params.logprobs is not None:  # logprobs only for the new tokens, the sum carried on
            assert [len(c.logprobs) for c in completions] == [len(c.token_ids) for c in completions]
            # Same tokens and ranks; values to float32 rounding (a prefill sums in another order).
            got, want = [c.logprobs for c in completions], [o.outputs[0].logprobs for o in whole[cut:]]
            assert [[{t: lp.rank for t, lp in d.items()} for d in lps] for lps in got] == [[{t: lp.rank for t, lp in d.items()} for d in lps] for lps in want]
            assert [lp.logprob for lps in got for d in lps for lp in d.values()] == pytest.approx([lp.logprob for lps in want for d in lps for lp in d.values()], abs=1e-4)
            assert completions[-1].cumulative_logprob == pytest.approx(whole[-1].outputs[0].cumulative_logprob, abs=1e-3)
    assert not engine.output_processor.states and not engine.has_unfinished_requests()
    return whole


def test_greedy_resume_counts_earlier_tokens_as_outputs(engine):
    whole = check_resumes_identically(engine, delta(temperature=0, max_tokens=17), cuts=[1, 2, 9, 16])
    assert sum(len(o.outputs[0].token_ids) for o in whole) == 17  # max_tokens held across the handover


def test_seeded_sampling_continues_its_stream(engine):
    check_resumes_identically(engine, delta(temperature=1.0, top_p=0.9, seed=1234), cuts=[1, 5, 23])


def test_penalties_see_the_earlier_tokens_as_outputs(engine):
    penalties = dict(repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=0.6)
    check_resumes_identically(engine, delta(temperature=0, **penalties), cuts=[3, 12])
    check_resumes_identically(engine, delta(temperature=0.8, seed=7, **penalties), cuts=[4, 20])


def test_min_tokens_counts_earlier_tokens(engine):
    eos = next(iter(engine.model_config.eos_token_ids))
    check_resumes_identically(engine, delta(temperature=1.0, seed=3, min_tokens=10, stop_token_ids=[eos]), cuts=[5])


def test_logprobs_are_not_repeated(engine):
    check_resumes_identically(engine, delta(temperature=0.7, seed=11, logprobs=3), cuts=[1, 10])


def test_stop_string_with_held_back_text(engine):
    """The stop string's window is rebuilt from the earlier tokens, and text held back (never
    sent) comes out after the handover; the request stops where the undisturbed one did."""
    plain = stream(engine, "plain", delta(temperature=0, max_tokens=40))
    text = "".join(o.outputs[0].text for o in plain)
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    assert len(stop) == 4 and text.find(stop) > 8, text
    params = delta(temperature=0, max_tokens=40, stop=[stop])
    first = stream(engine, "first", params)
    assert first[-1].outputs[0].stop_reason == stop
    # Cut where text was held back (decoded but never sent), or this test does not test hold-back.
    held = []
    for cut in range(1, len(first)):
        seen = [o.outputs[0] for o in first[:cut]]
        decoded = engine.tokenizer.decode([t for c in seen for t in c.token_ids])
        if len("".join(c.text for c in seen)) < len(decoded):
            held.append(cut)
    assert held
    check_resumes_identically(engine, params, cuts=held[:3] + held[-2:] + [len(first) - 1])


def test_a_choice_of_n_resumes_as_its_own_request(engine):
    """An n > 1 stream moves choice by choice (cluster/handover.py): choice i of the request
    runs as the one-sample request `for_child(i)` (seed + i), so resuming it from what the
    client has of it, or starting it again when it has nothing, goes on as undisturbed."""
    # No top_p: a batch of three rows and a batch of one round the logits apart by ~1e-6 (either
    # attention backend, and the linear layers), and a nucleus edge turns that into another draw.
    params = delta(n=3, temperature=1.0, seed=77, frequency_penalty=0.4)
    whole = stream(engine, "whole-n", params)
    by_choice = {i: [c for o in whole for c in o.outputs if c.index == i] for i in range(params.n)}
    assert len({tuple(t for c in seen for t in c.token_ids) for seen in by_choice.values()}) == params.n  # distinct samples
    for i, completions in by_choice.items():
        for cut in (0, 1, len(completions) // 2):
            seen = completions[:cut]
            prior_ids = [t for c in seen for t in c.token_ids]
            sent_text = "".join(c.text for c in seen)
            resume = ResumeState(prior_ids, len(sent_text)) if seen else None
            rest = [o.outputs[0] for o in stream(engine, f"choice-{i}-{cut}", params.for_child(i), resume)]
            assert sent_text + "".join(c.text for c in rest) == "".join(c.text for c in completions), (i, cut)
            assert prior_ids + [t for c in rest for t in c.token_ids] == [t for c in completions for t in c.token_ids], (i, cut)
    assert not engine.output_processor.states and not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "params, resume, message",
    [
        (delta(n=2, temperature=1.0), ResumeState([5], 0), "only a stream"),
        (SamplingParams(max_tokens=8), ResumeState([5], 0), "only a stream"),
        (delta(max_tokens=2), ResumeState([5, 6], 0), "reach max_tokens=2"),
        (delta(), ResumeState([10**6], 0), "outside the vocabulary"),
        (delta(), ResumeState([5], -1), "num_sent_chars=-1"),
    ],
)
def test_bad_resume_state_is_named(engine, params, resume, message):
    with pytest.raises(ValueError, match=message):
        engine.input_processor.process("Hello", params, resume)


def test_resume_past_the_decoded_text_is_refused(engine):
    params = delta(temperature=0)
    with pytest.raises(ValueError, match="num_sent_chars=999"):
        stream(engine, "too-far", params, ResumeState([5, 6], 999))
    assert not engine.output_processor.parents and not engine.has_unfinished_requests()
