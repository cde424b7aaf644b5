"""StructuredOutputsParams: vLLM's names, exactly one kind, bad values named."""

import pytest

from pagedserve import SamplingParams, StructuredOutputsParams


def test_each_kind_is_accepted_and_named():
    cases = {
        "json": {"type": "object"},
        "regex": r"\d+",
        "choice": ["yes", "no"],
        "grammar": 'root ::= "a"',
        "json_object": True,
        "structural_tag": '{"type": "structural_tag"}',
    }
    for kind, value in cases.items():
        params = StructuredOutputsParams(**{kind: value})
        assert params.kind == kind
        assert params.disable_any_whitespace is True  # compact JSON is our default


def test_json_as_text_or_dict_gives_one_cache_key():
    a = StructuredOutputsParams(json={"type": "object", "required": ["a"]})
    b = StructuredOutputsParams(json='{"type": "object",  "required": ["a"]}')
    assert a.cache_key() == b.cache_key()
    # Property order is generation order: another order is another grammar.
    reordered = StructuredOutputsParams(json={"required": ["a"], "type": "object"})
    assert reordered.cache_key() != a.cache_key()
    c = StructuredOutputsParams(json={"type": "object", "required": ["a"]},
                                disable_any_whitespace=False)
    assert c.cache_key() != a.cache_key()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({}, "exactly one"),
        ({"json_object": False}, "exactly one"),
        ({"regex": "a", "choice": ["a"]}, "regex, choice"),
        ({"json": "{not json"}, "StructuredOutputsParams.json="),
        ({"json": "[1, 2]"}, "StructuredOutputsParams.json="),
        ({"json": 3}, "StructuredOutputsParams.json="),
        ({"regex": ""}, "StructuredOutputsParams.regex="),
        ({"choice": []}, "StructuredOutputsParams.choice="),
        ({"choice": ["a", 1]}, "StructuredOutputsParams.choice="),
        ({"grammar": 5}, "StructuredOutputsParams.grammar="),
        ({"json_object": 1}, "StructuredOutputsParams.json_object="),
        ({"regex": "a", "disable_any_whitespace": "no"},
         "StructuredOutputsParams.disable_any_whitespace="),
        ({"regex": "a" * (256 * 1024 + 1)}, "at most"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_carries_it_and_checks_its_type():
    so = StructuredOutputsParams(regex="[ab]+")
    params = SamplingParams(structured_outputs=so)
    assert params.structured_outputs is so
    assert params.for_child(1).structured_outputs is so
    assert SamplingParams().structured_outputs is None
    with pytest.raises(ValueError, match="SamplingParams.structured_outputs="):
        SamplingParams(structured_outputs={"regex": "a"})
