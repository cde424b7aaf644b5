"""EngineCore on its own, in this process: the messages it takes (add with the n > 1 fan-out,
abort and stop by child id, a refused add), its steps, and its idle report. It holds no tokenizer:
only token ids go in and come out."""

from __future__ import annotations

import pytest

from pagedserve.config import EngineConfig
from pagedserve.engine.core.engine_core import EngineCore
from pagedserve.engine.core.messages import AbortRequests, AddRequest, RefuseRequest, StopRequests
from pagedserve.engine.core.model_setup import resolve_core_model_config
from pagedserve.engine.engine_core_output import FinishReason
from pagedserve.engine.input_processor import ProcessedPrompt
from pagedserve.sampling_params import SamplingParams

PROMPT = [5, 6, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def core(model_dirs):
    config = EngineConfig(model=str(model_dirs["llama"]), max_model_len=128, dtype="float32")
    core = EngineCore(config, resolve_core_model_config(config))
    yield core
    core.shutdown()


def add(request_id: str, **params) -> AddRequest:
    return AddRequest(request_id, ProcessedPrompt(None, list(PROMPT)), SamplingParams(temperature=0, **params), 0.0)


def run_to_end(core: EngineCore) -> dict[str, list]:
    """Every output of every step until the core has nothing to do, by scheduler id."""
    outputs: dict[str, list] = {}
    while core.has_work():
        for output in core.step().outputs:
            outputs.setdefault(output.req_id, []).append(output)
    return outputs


def test_holds_no_tokenizer(core):
    assert not [name for name, value in vars(core).items() if hasattr(value, "decode") or hasattr(value, "encode")]


def test_an_add_fans_out_into_n_children(core):
    added_before = core.num_added_children
    core.handle(add("fan", n=2, max_tokens=3, ignore_eos=True))
    assert core.num_added_children == added_before + 2
    outputs = run_to_end(core)
    assert sorted(outputs) == ["0_fan", "1_fan"]
    for child in outputs.values():
        assert sum(len(o.new_token_ids) for o in child) == 3 and child[-1].finish_reason == FinishReason.LENGTH
    # Greedy children are the same request twice.
    assert [o.new_token_ids for o in outputs["0_fan"]] == [o.new_token_ids for o in outputs["1_fan"]]
    assert core.kv_cache_manager.pool.num_free_blocks == core.kv_cache_manager.num_total_blocks


@pytest.mark.parametrize("message", [AbortRequests, StopRequests])
def test_abort_and_stop_end_children_by_id_and_report_once_idle(core, message):
    core.handle(add("ended", n=2, max_tokens=50, ignore_eos=True))
    core.step()
    assert core.scheduler.num_running == 2
    core.handle(message(["0_ended"]))
    assert core.scheduler.num_running == 1 and core.idle_report() is None  # 1_ended still runs
    core.handle(message(["1_ended"]))
    assert not core.has_work()
    report = core.idle_report()  # the gauges once more, so the front end sees 0 running
    assert report is not None and len(report.outputs) == 0 and report.gauges.num_requests_running == 0
    assert report.gauges.kv_cache_usage_perc == 0.0
    assert core.idle_report() is None


def test_a_refused_request_ends_as_abort_and_counts_as_taken_in(core):
    added_before = core.num_added_children
    core.handle(RefuseRequest("refused", 2, "ValueError: too large"))
    assert core.num_added_children == added_before + 2
    step = core.step()
    assert [(o.req_id, o.new_token_ids, o.finish_reason) for o in step.outputs] == [
        ("0_refused", [], FinishReason.ABORT), ("1_refused", [], FinishReason.ABORT)
    ]
    assert not core.has_work()


def test_an_unknown_message_is_an_error(core):
    with pytest.raises(TypeError, match="unknown message: str"):
        core.handle("hello")


def test_reads_a_tokenizer_only_for_its_first_constrained_request(core):
    """The grammar engine's vocabulary is read when a grammar first needs it, not at start."""
    from pagedserve.sampling_params import StructuredOutputsParams

    manager = core.structured_outputs
    assert manager._tokenizer is None  # started, and served requests, without it
    manager.grammar_for(StructuredOutputsParams(regex="[a-z]+")).future.result(timeout=60)
    assert manager._tokenizer is not None


@pytest.mark.parametrize(
    "settings, max_model_len, budget",
    [
        ({}, 8192, 2048),  # chunked prefill: a long context does not grow the step (SmolLM2's 8192 did)
        ({}, 512, 2048),
        ({"enable_chunked_prefill": False}, 8192, 8192),  # unchunked: a whole prompt fits in one step
        ({"enable_chunked_prefill": False}, 512, 2048),
        ({"max_num_batched_tokens": 1024}, 8192, 1024),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 8192}, 4096, 8192),
    ],
)
def test_the_step_token_budget(settings, max_model_len, budget):
    assert EngineConfig(model="unused", **settings).token_budget(max_model_len) == budget


def test_the_scheduler_gets_the_default_budget(core):
    assert core.scheduler.max_num_batched_tokens == 2048
