"""The grammar state beside the scheduler: compiles never hold up other requests, a grammar that
fails ends its own request only, compilations are shared, and a resumed request's matcher
replays its earlier outputs. In-process LLMEngine on the padded tiny model."""

from __future__ import annotations

import json
import threading
import time

import jsonschema
import pytest

from pagedserve.engine.input_processor import ResumeState
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.core.request import RequestStatus
from pagedserve.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from tests.engine.structured_outputs.conftest import PERSON_SCHEMA

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def engine(model_dirs):
    engine = LLMEngine.from_engine_args(model=str(model_dirs["qwen2"]), max_model_len=256, dtype="float32")
    yield engine
    engine.shutdown()


@pytest.fixture
def slow_compiles(engine, monkeypatch):
    """Every compilation takes at least `delay_s` more (a costly schema, deterministically)."""
    manager = engine.engine_core.engine_core.structured_outputs
    compile_ = manager._compile
    settings = {"delay_s": 1.0}

    def slow(name, params):
        time.sleep(settings["delay_s"])
        return compile_(name, params)

    monkeypatch.setattr(manager, "_compile", slow)
    manager.cache.entries.clear()  # no earlier test's compilation may be reused
    return settings


def json_params(**kwargs) -> SamplingParams:
    so = StructuredOutputsParams(json=PERSON_SCHEMA)
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 64, "structured_outputs": so, **kwargs})


def run(engine: LLMEngine, on_step=None) -> dict:
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        if on_step is not None:
            on_step()
    return finals


def test_compiling_grammar_holds_up_nobody(engine, slow_compiles):
    engine.add_request("json", PROMPT, json_params())
    engine.add_request("plain", PROMPT, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    finals, status_when_plain_ended = {}, None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
                if output.request_id == "plain":
                    status_when_plain_ended = engine.engine_core.engine_core.scheduler.requests["json"].status
    # The unconstrained request ran to its end while the other's grammar was still compiling.
    assert status_when_plain_ended == RequestStatus.WAITING_FOR_GRAMMAR
    assert finals["plain"].outputs[0].finish_reason == "length"
    jsonschema.validate(json.loads(finals["json"].outputs[0].text), PERSON_SCHEMA)


def test_same_spec_compiles_once(engine, slow_compiles):
    cache = engine.engine_core.engine_core.structured_outputs.cache
    misses, hits = cache.num_misses, cache.num_hits
    for i in range(3):
        engine.add_request(f"r{i}", PROMPT, json_params(n=2, seed=i, temperature=1.0))
    finals = run(engine)
    assert (cache.num_misses - misses, cache.num_hits - hits) == (1, 5)  # 6 requests, one compilation
    for output in finals.values():
        for completion in output.outputs:
            jsonschema.validate(json.loads(completion.text), PERSON_SCHEMA)


def test_compile_timeout_fails_that_request_only(engine, slow_compiles, monkeypatch):
    monkeypatch.setattr(engine.engine_core.engine_core.structured_outputs, "compile_timeout_s", 0.2)
    engine.add_request("json", PROMPT, json_params())
    engine.add_request("plain", PROMPT, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    finals = run(engine)
    failed = finals["json"].outputs[0]
    assert failed.finish_reason == "error" and failed.token_ids == []
    assert failed.error == "structured outputs: StructuredOutputsParams.json: the grammar did not compile within 0.2 s (structured_outputs_compile_timeout_s); simplify the spec"
    assert finals["plain"].outputs[0].finish_reason == "length"
    assert engine.engine_core.engine_core.scheduler.num_constrained == 0
    # The engine goes on: the same spec, given time, works.
    monkeypatch.setattr(engine.engine_core.engine_core.structured_outputs, "compile_timeout_s", 30.0)
    engine.add_request("again", PROMPT, json_params())
    jsonschema.validate(json.loads(run(engine)["again"].outputs[0].text), PERSON_SCHEMA)


def stream(engine: LLMEngine, request_id: str, params: SamplingParams, resume: ResumeState | None = None) -> list:
    processed = engine.input_processor.process(PROMPT, params, resume)
    engine.add_processed_request(request_id, processed, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return outputs


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_resumed_request_replays_its_grammar(engine, backend, monkeypatch):
    """A request handed over mid-JSON (its earlier outputs given back) goes on where it was: the
    matcher replays those tokens, and the whole output is the undisturbed one."""
    monkeypatch.setattr(engine.engine_core.engine_core.structured_outputs, "backend_setting", backend)
    params = json_params(output_kind=RequestOutputKind.DELTA)
    whole = stream(engine, f"whole-{backend}", params)
    full_ids = [t for o in whole for t in o.outputs[0].token_ids]
    full_text = "".join(o.outputs[0].text for o in whole)
    jsonschema.validate(json.loads(full_text), PERSON_SCHEMA)
    for cut in (3, len(whole) // 2):
        prior = [t for o in whole[:cut] for t in o.outputs[0].token_ids]
        sent = "".join(o.outputs[0].text for o in whole[:cut])
        rest = stream(engine, f"resumed-{backend}-{cut}", params, ResumeState(prior, len(sent)))
        assert prior + [t for o in rest for t in o.outputs[0].token_ids] == full_ids, cut
        assert sent + "".join(o.outputs[0].text for o in rest) == full_text


def test_resumed_tokens_that_break_the_grammar_end_that_request(engine, tokenizer):
    params = json_params(output_kind=RequestOutputKind.DELTA)
    bad = tokenizer.encode("nope", add_special_tokens=False)  # a JSON object cannot start so
    rest = stream(engine, "bad-resume", params, ResumeState(bad, 0))
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "error"
    assert "is not allowed by the grammar" in rest[-1].outputs[0].error
    assert engine.engine_core.engine_core.scheduler.num_constrained == 0


def test_compiles_that_never_end_do_not_starve_the_next(engine, monkeypatch):
    """Two compiles that hang (the libraries cannot cancel one) hold both compile threads; each
    fails its own request at the timeout, and a constrained request behind them still runs."""
    manager = engine.engine_core.engine_core.structured_outputs
    compile_, released = manager._compile, threading.Event()

    def hanging_for_some(name, params):
        if params.regex is not None and params.regex.startswith("hang"):
            released.wait(60)
        return compile_(name, params)

    monkeypatch.setattr(manager, "_compile", hanging_for_some)
    monkeypatch.setattr(manager, "compile_timeout_s", 0.5)
    manager.cache.entries.clear()
    try:
        for i in range(2):
            so = StructuredOutputsParams(regex=f"hang{i}[a-z]+")
            engine.add_request(f"hang{i}", PROMPT, SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=so))
        monkeypatch.setattr(manager, "compile_timeout_s", 30.0)  # the one behind them has time to compile
        engine.add_request("json", PROMPT, json_params())
        finals = run(engine)
    finally:
        released.set()
    assert [finals[f"hang{i}"].outputs[0].finish_reason for i in range(2)] == ["error", "error"]
    jsonschema.validate(json.loads(finals["json"].outputs[0].text), PERSON_SCHEMA)
    assert manager.pool.num_abandoned >= 2
