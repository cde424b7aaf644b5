"""With a reasoning parser, a constrained request's grammar applies only after its reasoning ends
(vLLM's reasoning_ended): the thinking is free, the answer after `</think>` follows the grammar.

The padded tiny qwen2 (576 logit rows, 512 tokens) with `<think>` and `</think>` added to its
tokenizer as tokens 512 and 513, which its embedding already has rows for. The reference is HF
greedy, unmasked until the end marker, then masked by xgrammar's own matcher."""

from __future__ import annotations

import json
import shutil

import jsonschema
import pytest
import torch

from pagedserve.engine.input_processor import ResumeState
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from tests.engine.structured_outputs.conftest import PERSON_SCHEMA
from tests.engine.structured_outputs.grammar_reference import GrammarReference

MAX_TOKENS = 128


@pytest.fixture(scope="module")
def thinking_model(model_dirs, tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("thinking") / "qwen2"
    shutil.copytree(model_dirs["qwen2"], folder)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    tokenizer.save_pretrained(str(folder))
    return folder, tokenizer.convert_tokens_to_ids("<think>"), tokenizer.convert_tokens_to_ids("</think>")


@pytest.fixture(scope="module")
def engine(thinking_model):
    engine = LLMEngine.from_engine_args(model=str(thinking_model[0]), max_model_len=256, dtype="float32", reasoning_parser="deepseek_r1")
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reference(thinking_model):
    return GrammarReference(thinking_model[0])


@torch.inference_mode()
def reasoning_greedy(reference: GrammarReference, prompt_ids: list[int], end_id: int, bias: dict[int, float]) -> list[int]:
    """HF greedy with `bias` added, free until `end_id`, then under PERSON_SCHEMA's matcher."""
    import xgrammar as xgr

    matcher, bitmask, outputs, ended = None, xgr.allocate_token_bitmask(1, reference.vocab_size), [], False
    for _ in range(MAX_TOKENS):
        logits = reference.model(torch.tensor([prompt_ids + outputs])).logits[:, -1, :].float()
        for token_id, value in bias.items():
            logits[0, token_id] += value
        if ended:
            matcher.fill_next_token_bitmask(bitmask)
            xgr.apply_token_bitmask_inplace(logits, bitmask)
        token_id = int(logits.argmax())
        outputs.append(token_id)
        if ended:
            assert matcher.accept_token(token_id)
            if matcher.is_terminated():
                break
        elif token_id == end_id:
            ended, matcher = True, xgr.GrammarMatcher(reference.compile("json", PERSON_SCHEMA))
        elif token_id in reference.eos_token_ids:
            break
    return outputs


def params(**kwargs) -> SamplingParams:
    so = StructuredOutputsParams(json=PERSON_SCHEMA)
    return SamplingParams(**{"temperature": 0.0, "max_tokens": MAX_TOKENS, "structured_outputs": so, **kwargs})


def generate(engine: LLMEngine, request_id: str, prompt_ids: list[int], sampling: SamplingParams, resume: ResumeState | None = None) -> list[int]:
    processed = engine.input_processor.process({"prompt_token_ids": prompt_ids}, sampling, resume)
    engine.add_processed_request(request_id, processed, sampling)
    token_ids = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id:
                token_ids = token_ids + output.outputs[0].token_ids if sampling.output_kind == RequestOutputKind.DELTA else output.outputs[0].token_ids
    return token_ids


def answer(engine: LLMEngine, token_ids: list[int], end_id: int) -> dict:
    """The JSON after the end marker, checked against the schema."""
    text = engine.tokenizer.decode(token_ids[token_ids.index(end_id) + 1 :], skip_special_tokens=True)
    value = json.loads(text)
    jsonschema.validate(value, PERSON_SCHEMA)
    return value


def test_the_thinking_is_free_and_the_answer_after_it_follows_the_grammar(engine, reference, thinking_model, tokenizer):
    """The prompt opens a think block (DeepSeek-R1's template); the bias on `</think>` makes the
    model close it after a few free tokens; the grammar applies from the next token on."""
    _, start_id, end_id = thinking_model
    prompt_ids = tokenizer.encode("Who is it?", add_special_tokens=False) + [start_id]
    for bias in (4.0, 100.0):  # closed after some free tokens; closed at once
        expected = reasoning_greedy(reference, prompt_ids, end_id, {end_id: bias})
        assert end_id in expected
        got = generate(engine, f"think-{bias}", prompt_ids, params(logit_bias={end_id: bias}))
        assert got == expected, bias
        answer(engine, got, end_id)
    assert expected.index(end_id) == 0 and reasoning_greedy(reference, prompt_ids, end_id, {end_id: 4.0}).index(end_id) > 0


def test_reasoning_that_never_ends_leaves_the_output_free(engine, reference, thinking_model, tokenizer, hf_references):
    _, start_id, end_id = thinking_model
    prompt_ids = tokenizer.encode("Once upon a time", add_special_tokens=False) + [start_id]
    expected = reasoning_greedy(reference, prompt_ids, end_id, {end_id: -100.0})
    assert generate(engine, "never", prompt_ids, params(logit_bias={end_id: -100.0})) == expected
    with pytest.raises(ValueError):
        json.loads(engine.tokenizer.decode(expected))  # (free text, no JSON: the grammar never applied)


def test_a_prompt_that_closed_the_think_block_is_constrained_from_the_first_token(engine, reference, thinking_model, tokenizer):
    """Qwen3's template with thinking off ends the prompt with an empty think block."""
    _, start_id, end_id = thinking_model
    prompt_ids = tokenizer.encode("Who is it?", add_special_tokens=False) + [start_id, end_id]
    got = generate(engine, "closed", prompt_ids, params())
    assert got == reference.greedy(prompt_ids, "json", PERSON_SCHEMA, MAX_TOKENS)
    jsonschema.validate(json.loads(engine.tokenizer.decode(got, skip_special_tokens=True)), PERSON_SCHEMA)


def test_a_resumed_request_replays_only_the_answer_into_its_grammar(engine, reference, thinking_model, tokenizer):
    """Handed over mid-answer: the matcher replays the tokens after `</think>`, not the thinking."""
    _, start_id, end_id = thinking_model
    prompt_ids = tokenizer.encode("Who is it?", add_special_tokens=False) + [start_id]
    whole = reasoning_greedy(reference, prompt_ids, end_id, {end_id: 4.0})
    cut = whole.index(end_id) + 3  # three tokens into the JSON
    sampling = params(logit_bias={end_id: 4.0}, output_kind=RequestOutputKind.DELTA)
    prior = whole[:cut]
    rest = generate(engine, "resumed", prompt_ids, sampling, ResumeState(prior, len(engine.tokenizer.decode(prior, skip_special_tokens=True))))
    assert prior + rest == whole


def test_a_tokenizer_without_the_markers_is_refused_at_start(model_dirs):
    with pytest.raises(ValueError, match="reasoning_parser 'qwen3' needs '<think>' as one token"):
        LLMEngine.from_engine_args(model=str(model_dirs["qwen2"]), max_model_len=64, dtype="float32", reasoning_parser="qwen3")
