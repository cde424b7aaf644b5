"""SamplingParams: vLLM's defaults and ranges, type checks, normalisation, children's seeds."""

from __future__ import annotations

import math

import pytest

from pagedserve.sampling_params import (
    GREEDY_TEMPERATURE_EPS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    RequestOutputKind,
    SamplingParams,
)

INF, NAN = math.inf, math.nan

# (field, bad value): each must raise ValueError naming the field and showing the value.
BAD_VALUES = [
    ("n", 0), ("n", -1), ("n", 1.5), ("n", True), ("n", "2"), ("n", None),
    ("temperature", -0.1), ("temperature", NAN), ("temperature", INF), ("temperature", -INF),
    ("temperature", True), ("temperature", "1.0"), ("temperature", None),
    ("top_p", 0.0), ("top_p", -0.5), ("top_p", 1.01), ("top_p", NAN), ("top_p", INF), ("top_p", False),
    ("top_k", -2), ("top_k", 2.0), ("top_k", True), ("top_k", None), ("top_k", "5"),
    ("min_p", -0.01), ("min_p", 1.01), ("min_p", NAN), ("min_p", INF), ("min_p", True),
    ("seed", 2**63), ("seed", -(2**63) - 1), ("seed", 1.0), ("seed", True), ("seed", "7"),
    ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", 1.5), ("max_tokens", True), ("max_tokens", INF),
    ("min_tokens", -1), ("min_tokens", 1.0), ("min_tokens", True), ("min_tokens", None),
    ("stop", 5), ("stop", [1]), ("stop", ""), ("stop", ["ok", ""]), ("stop", {"a": 1}),
    ("stop_token_ids", [-1]), ("stop_token_ids", [True]), ("stop_token_ids", 3),
    ("stop_token_ids", ["a"]), ("stop_token_ids", [1.0]),
    ("ignore_eos", 1), ("ignore_eos", "yes"), ("ignore_eos", None),
    ("include_stop_str_in_output", 0), ("skip_special_tokens", "true"),
    ("presence_penalty", 2.01), ("presence_penalty", -2.01), ("presence_penalty", NAN),
    ("presence_penalty", INF), ("presence_penalty", True),
    ("frequency_penalty", 2.5), ("frequency_penalty", -3), ("frequency_penalty", NAN),
    ("frequency_penalty", -INF), ("frequency_penalty", False),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", NAN),
    ("repetition_penalty", INF), ("repetition_penalty", True),
    ("logprobs", -1), ("logprobs", 1.5), ("logprobs", True), ("logprobs", "3"),
    ("output_kind", 1), ("output_kind", "delta"), ("output_kind", None),
]


@pytest.mark.parametrize("name,value", BAD_VALUES, ids=[f"{n}={v!r}" for n, v in BAD_VALUES])
def test_bad_value_is_rejected_with_field_and_value(name, value):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{name: value})
    message = str(info.value)
    assert name in message
    assert repr(value) in message
    assert "allowed" in message  # says what is allowed, not only what is wrong


# Boundary values that vLLM accepts.
GOOD_VALUES = [
    ("n", 1), ("n", 64), ("temperature", 0), ("temperature", 0.0), ("temperature", 100.0),
    ("top_p", 1), ("top_p", 1e-9), ("top_k", -1), ("top_k", 0), ("top_k", 1),
    ("min_p", 0), ("min_p", 1.0), ("seed", 0), ("seed", -(2**63)), ("seed", 2**63 - 1),
    ("max_tokens", 1), ("max_tokens", None), ("min_tokens", 0), ("min_tokens", 16),
    ("presence_penalty", -2), ("presence_penalty", 2.0), ("frequency_penalty", -2.0),
    ("frequency_penalty", 2), ("repetition_penalty", 1e-3), ("repetition_penalty", 5),
    ("logprobs", 0), ("logprobs", 20), ("logprobs", None),
    ("stop", "x"), ("stop", ["a", "b"]), ("stop", ("a", "b")), ("stop_token_ids", (0, 5)),
]


@pytest.mark.parametrize("name,value", GOOD_VALUES, ids=[f"{n}={v!r}" for n, v in GOOD_VALUES])
def test_boundary_value_is_accepted(name, value):
    SamplingParams(**{name: value})


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.seed, p.max_tokens, p.min_tokens, p.logprobs) == (None, 16, 0, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.stop == [] and p.stop_token_ids == []
    assert p.ignore_eos is False and p.include_stop_str_in_output is False
    assert p.skip_special_tokens is True
    assert p.output_kind is RequestOutputKind.CUMULATIVE
    assert not p.is_greedy and not p.has_penalties


def test_integer_floats_are_stored_as_float():
    # The sampler builds float tensors from these; an int that slipped through would still work,
    # but the normalisation keeps one type per field.
    p = SamplingParams(temperature=1, top_p=1, min_p=0, presence_penalty=1, repetition_penalty=2)
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "repetition_penalty"):
        assert type(getattr(p, name)) is float, name


def test_stop_string_becomes_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


def test_stop_buffer_length_holds_back_longest_stop_minus_one():
    assert SamplingParams(stop=["ab", "hello"]).stop_buffer_length == 4
    assert SamplingParams(stop="x").stop_buffer_length == 0
    assert SamplingParams().stop_buffer_length == 0
    # Text that will be shown anyway need not be held back.
    assert SamplingParams(stop=["hello"], include_stop_str_in_output=True).stop_buffer_length == 0


@pytest.mark.parametrize("temperature", [0.0, GREEDY_TEMPERATURE_EPS / 2])
def test_greedy_normalises_truncation(temperature):
    p = SamplingParams(temperature=temperature, top_p=0.5, top_k=7, min_p=0.2)
    assert p.is_greedy
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)


def test_small_positive_temperature_at_eps_is_random():
    p = SamplingParams(temperature=GREEDY_TEMPERATURE_EPS, top_k=7)
    assert not p.is_greedy
    assert p.top_k == 7


def test_greedy_normalisation_keeps_penalties():
    # Penalties change the argmax, so greedy requests must keep them.
    p = SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5)
    assert p.repetition_penalty == 1.3 and p.presence_penalty == 0.5
    assert p.has_penalties


@pytest.mark.parametrize(
    "changes", [dict(presence_penalty=0.1), dict(frequency_penalty=-0.1), dict(repetition_penalty=0.9)]
)
def test_has_penalties(changes):
    assert SamplingParams(**changes).has_penalties


def test_min_tokens_may_equal_but_not_exceed_max_tokens():
    SamplingParams(min_tokens=8, max_tokens=8)
    SamplingParams(min_tokens=1000, max_tokens=None)  # None: bounded by max_model_len later
    with pytest.raises(ValueError, match=r"min_tokens=9.*max_tokens \(8\)"):
        SamplingParams(min_tokens=9, max_tokens=8)


def test_for_child_offsets_seed_by_index():
    parent = SamplingParams(n=4, seed=100, temperature=0.8, stop=["x"])
    children = [parent.for_child(i) for i in range(4)]
    assert [c.seed for c in children] == [100, 101, 102, 103]
    assert all(c.n == 1 for c in children)
    assert all(c.temperature == 0.8 and c.stop == ["x"] for c in children)
    assert parent.n == 4 and parent.seed == 100  # the parent is left alone


def test_for_child_negative_seed():
    assert SamplingParams(n=3, seed=-1).for_child(2).seed == 1


def test_for_child_without_seed_stays_unseeded():
    children = [SamplingParams(n=3).for_child(i) for i in range(3)]
    assert all(c.seed is None and c.n == 1 for c in children)


def test_error_message_format():
    with pytest.raises(ValueError) as info:
        SamplingParams(top_p=1.5)
    assert str(info.value) == "SamplingParams.top_p=1.5 is invalid: allowed is 0 < top_p <= 1"


def test_the_error_names_its_field():
    from pagedserve.sampling_params import SamplingParamError

    for kwargs, field in (({"top_p": 1.5}, "top_p"), ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"n": True}, "n")):
        with pytest.raises(SamplingParamError) as info:
            SamplingParams(**kwargs)
        assert info.value.field == field and str(info.value).startswith(f"SamplingParams.{field}=")
# ---- bounded stop conditions (issue 19: 200k stop strings cost 50 ms per token) -------------


@pytest.mark.parametrize(
    "name, value, fragment",
    [
        ("stop", ["s"] * (MAX_STOP_STRINGS + 1), "<17 strings>"),
        ("stop", "x" * (MAX_STOP_STRING_CHARS + 1), "<257 characters>"),
        ("stop", ["ok", "x" * (MAX_STOP_STRING_CHARS + 1)], "<257 characters>"),
        ("stop_token_ids", list(range(MAX_STOP_TOKEN_IDS + 1)), "<257 token ids>"),
        ("stop", ["s"] * 200_000, "<200000 strings>"),
    ],
)
def test_stop_lists_are_capped(name, value, fragment):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{name: value})
    message = str(info.value)
    assert message.startswith(f"SamplingParams.{name}=") and fragment in message and "allowed is at most" in message
    assert len(message) < 200  # the over-long value is not echoed back


def test_stop_lists_at_the_caps_are_accepted():
    params = SamplingParams(
        stop=["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS, stop_token_ids=list(range(MAX_STOP_TOKEN_IDS))
    )
    assert len(params.stop) == 16 and len(params.stop_token_ids) == 256


def test_sampler_params_carry_no_stop_strings():
    params = SamplingParams(temperature=0.7, top_k=5, seed=3, stop=["x" * 256] * 16, stop_token_ids=[7, 9], logprobs=2)
    record = params.sampler_params()
    assert not hasattr(record, "stop") and record.stop_token_ids == ()  # no min_tokens: no bans
    assert (record.temperature, record.top_k, record.seed, record.logprobs) == (0.7, 5, 3, 2)
    assert not record.is_greedy and not record.has_penalties
    banned = SamplingParams(min_tokens=2, stop_token_ids=[7, 9], repetition_penalty=1.2).sampler_params()
    assert banned.stop_token_ids == (7, 9) and banned.has_penalties


def test_logit_bias_is_capped_and_reaches_the_sampler_record():
    """The biases travel to every rank: bounded like the stop lists, and carried by SamplerParams."""
    from pagedserve.sampling_params import MAX_LOGIT_BIAS_ENTRIES

    with pytest.raises(ValueError, match="at most 300 entries"):
        SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)})
    record = SamplingParams(logit_bias={3: -100, 5: 2.5}).sampler_params()
    assert record.logit_bias == {3: -100.0, 5: 2.5}
