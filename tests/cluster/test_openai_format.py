"""cluster/openai_format.py: OpenAI's bodies from the engine's CompletionOutputs, logprobs in the
legacy completions format and in chat's, with top-N by rank and the sampled token kept apart."""

from __future__ import annotations

from pagedserve.cluster import openai_format as fmt
from pagedserve.engine.request_output import CompletionOutput, Logprob

# Two generated tokens, ids 7 and 9. At each position the sampled token and the top 2 by rank;
# at the second the sampled token (rank 3) is outside the top 2.
LOGPROBS = [
    {7: Logprob(-0.1, 1, "He"), 8: Logprob(-2.5, 2, "Ha")},
    {9: Logprob(-3.0, 3, "llo"), 4: Logprob(-0.5, 1, "y"), 5: Logprob(-1.0, 2, "é")},
]


def completion(**fields) -> CompletionOutput:
    return CompletionOutput(**{"index": 0, "text": "Hello", "token_ids": [7, 9], "logprobs": LOGPROBS, "finish_reason": "stop",
                               "stop_reason": 2, **fields})


def test_usage_and_envelope():
    assert fmt.usage(3, 4) == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    body = fmt.envelope("text_completion", "cmpl-1", "m", [{"index": 0}], created=123)
    assert body == {"id": "cmpl-1", "object": "text_completion", "created": 123, "model": "m", "choices": [{"index": 0}]}
    assert fmt.envelope("x", "id", "m", [])["created"] > 1_600_000_000  # now, when not given


def test_completion_choice_without_logprobs():
    choice = fmt.completion_choice(3, completion(logprobs=None), num_top=0)
    assert choice == {"index": 3, "text": "Hello", "logprobs": None, "finish_reason": "stop", "stop_reason": 2}


def test_completion_logprobs_legacy_format():
    logprobs = fmt.completion_choice(0, completion(), num_top=2, text_offset=10)["logprobs"]
    assert logprobs == {
        "tokens": ["He", "llo"],
        "token_logprobs": [-0.1, -3.0],
        "top_logprobs": [{"He": -0.1, "Ha": -2.5}, {"y": -0.5, "é": -1.0}],  # the sampled rank-3 token is not in the top 2
        "text_offset": [10, 12],  # each token's start in the text, after `text_offset`
    }
    assert fmt.completion_logprobs(completion(), 1, 0)["top_logprobs"] == [{"He": -0.1}, {"y": -0.5}]
    assert fmt.completion_logprobs(completion(), 0, 0)["top_logprobs"] == [{}, {}]


def test_chat_choice_and_its_logprobs():
    choice = fmt.chat_choice(1, completion(), num_top=1)
    assert choice["index"] == 1 and choice["message"] == {"role": "assistant", "content": "Hello"}
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", 2)
    assert choice["logprobs"] == {"content": [
        {"token": "He", "logprob": -0.1, "bytes": [72, 101], "top_logprobs": [{"token": "He", "logprob": -0.1, "bytes": [72, 101]}]},
        {"token": "llo", "logprob": -3.0, "bytes": [108, 108, 111], "top_logprobs": [{"token": "y", "logprob": -0.5, "bytes": [121]}]},
    ]}
    accented = fmt.chat_logprobs(completion(), 2)["content"][1]["top_logprobs"][1]
    assert accented == {"token": "é", "logprob": -1.0, "bytes": [195, 169]}  # UTF-8 bytes


def test_chat_chunk_choice_sends_the_role_only_first():
    first = fmt.chat_chunk_choice(0, completion(logprobs=None, text="Hel", finish_reason=None), 0, first=True)
    later = fmt.chat_chunk_choice(0, completion(logprobs=None, text="lo"), 0, first=False)
    assert first == {"index": 0, "delta": {"content": "Hel", "role": "assistant"}, "logprobs": None, "finish_reason": None}
    assert later == {"index": 0, "delta": {"content": "lo"}, "logprobs": None, "finish_reason": "stop"}


def test_a_forbidden_tokens_minus_infinity_is_sent_as_vllm_sends_it():
    """A grammar's forbidden tokens have logprob -inf, which strict JSON cannot carry."""
    import json

    forbidden = [{7: Logprob(0.0, 1, "He"), 8: Logprob(float("-inf"), 2, "Ha")}, LOGPROBS[1]]
    for choice in (fmt.completion_choice(0, completion(logprobs=forbidden), num_top=2), fmt.chat_choice(0, completion(logprobs=forbidden), num_top=2)):
        text = json.dumps(choice, allow_nan=False)  # what the response encoder does
        assert "-9999.0" in text
    assert fmt.chat_choice(0, completion(logprobs=forbidden), num_top=2)["logprobs"]["content"][0]["top_logprobs"][1]["logprob"] == -9999.0
