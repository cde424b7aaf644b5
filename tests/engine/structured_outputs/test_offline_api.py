"""LLM.generate under a constraint: every kind on both backends gives valid output, sampling
features keep working, and a bad spec fails its own request only."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedserve import LLM, SamplingParams, StructuredOutputsParams
from tests.engine.structured_outputs.conftest import CHOICES, EBNF, PERSON_SCHEMA, REGEX
from tests.models import TOKENIZER_VOCAB

PROMPTS = ["Hello, my name is", "The capital of France is", "A"]
LARK = 'start: "(" DIGIT ("+" DIGIT)* ")"\nDIGIT: /[0-9]/'


def check_valid(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), PERSON_SCHEMA)
        assert " \n" not in text and "\n" not in text  # compact by default
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        assert re.fullmatch(r"\(\d(\+\d)*\)", text), text


# The padded model: its 64 ids past the tokenizer must never be sampled.
@pytest.fixture(scope="module", params=["xgrammar", "guidance"])
def llm(request, model_dirs):
    llm = LLM(str(model_dirs["qwen2"]), max_model_len=256, dtype="float32", structured_outputs_backend=request.param)
    yield llm
    llm.shutdown()


def grammar_kinds(llm: LLM) -> dict:
    backend = llm.llm_engine.config.structured_outputs_backend
    return {"json": PERSON_SCHEMA, "json_object": True, "regex": REGEX, "choice": CHOICES,
            "grammar": EBNF if backend == "xgrammar" else LARK}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_kind_gives_valid_output(llm, temperature):
    kinds = grammar_kinds(llm)
    cases = [(p, k) for p in PROMPTS for k in kinds]
    params = [
        SamplingParams(temperature=temperature, seed=i, max_tokens=64, structured_outputs=StructuredOutputsParams(**{k: kinds[k]}))
        for i, (_, k) in enumerate(cases)
    ]
    outputs = llm.generate([p for p, _ in cases], params, use_tqdm=False)
    for (_, kind), output in zip(cases, outputs):
        completion = output.outputs[0]
        assert all(t < TOKENIZER_VOCAB for t in completion.token_ids)  # never the padding
        if kind == "json_object" and completion.finish_reason == "length":
            assert completion.text.startswith('{"')  # free keys: a random model may never close them
            continue
        assert completion.finish_reason == "stop", (kind, completion)
        check_valid(kind, completion.text)


def test_sampling_features_keep_working(llm):
    so = StructuredOutputsParams(json=PERSON_SCHEMA)
    seeded = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=64, structured_outputs=so, logprobs=2,
                            presence_penalty=0.5, repetition_penalty=1.2)
    first, again = llm.generate([PROMPTS[0]], seeded, use_tqdm=False), llm.generate([PROMPTS[0]], seeded, use_tqdm=False)
    assert [c.token_ids for c in first[0].outputs] == [c.token_ids for c in again[0].outputs]  # seeded: reproducible
    assert len(first[0].outputs) == 3
    for completion in first[0].outputs:
        check_valid("json", completion.text)
        assert len(completion.logprobs) == len(completion.token_ids)
    # A stop string ends a constrained request like any other (its text is cut before it).
    stopped = llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=so, stop=['"age"']), use_tqdm=False)
    assert stopped[0].outputs[0].finish_reason == "stop" and stopped[0].outputs[0].text.startswith('{"name":')
    assert '"age"' not in stopped[0].outputs[0].text
    # min_tokens past what the grammar allows: the grammar wins, the request still ends cleanly.
    short = llm.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=16, min_tokens=12,
                         structured_outputs=StructuredOutputsParams(choice=CHOICES)), use_tqdm=False)
    assert short[0].outputs[0].finish_reason == "stop"
    check_valid("choice", short[0].outputs[0].text)


@pytest.mark.parametrize(
    "spec, field",
    [
        ({"regex": "[a"}, "StructuredOutputsParams.regex"),
        ({"json": {"type": "foo"}}, "StructuredOutputsParams.json"),
        ({"json": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}, "StructuredOutputsParams.json"),
        ({"grammar": 'foo ::= "a"'}, "StructuredOutputsParams.grammar"),
    ],
)
def test_bad_spec_is_a_value_error_naming_the_field(llm, spec, field):
    with pytest.raises(ValueError, match=field):
        llm.generate(["Hi"], SamplingParams(structured_outputs=StructuredOutputsParams(**spec)), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_backend_specific_specs(llm):
    backend = llm.llm_engine.config.structured_outputs_backend
    if backend == "xgrammar":  # Lark is guidance's; auto would have picked it
        with pytest.raises(ValueError, match="Lark grammar is not supported by xgrammar"):
            llm.generate(["Hi"], SamplingParams(structured_outputs=StructuredOutputsParams(grammar=LARK)), use_tqdm=False)
    else:
        with pytest.raises(ValueError, match="structural_tag is not supported by llguidance"):
            llm.generate(["Hi"], SamplingParams(structured_outputs=StructuredOutputsParams(structural_tag='{"type": "x"}')), use_tqdm=False)
