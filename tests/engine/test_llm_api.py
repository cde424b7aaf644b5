"""The offline `LLM` API: what it returns, and how it rejects bad input without losing anything."""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(model_dirs):
    # float32 on a GPU too (its default is bf16): logprobs are compared with HF's float32 ones
    engine = LLM(str(model_dirs["llama"]), max_model_len=128, dtype="float32")
    yield engine
    engine.shutdown()


def greedy(max_tokens: int = 16, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def assert_idle(llm: LLM) -> None:
    """Nothing of a rejected call stays queued, and no block stays allocated."""
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.engine_core.engine_core.kv_cache_manager.pool.num_free_blocks == engine.engine_core.engine_core.kv_cache_manager.num_total_blocks
    assert not engine.output_processor.states and not engine.output_processor.parents


# ---- construction --------------------------------------------------------------------------


def test_unknown_engine_argument_is_named(model_dirs):
    with pytest.raises(ValueError, match="unknown engine argument 'max_num_seq'"):
        LLM(str(model_dirs["llama"]), max_num_seq=4)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"block_size": 12}, "block_size"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"dtype": "float64"}, "dtype"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"schedule_conservativeness": -0.5}, "schedule_conservativeness"),
        ({"schedule_conservativeness": float("inf")}, "schedule_conservativeness"),
        ({"attention_backend": "cuda"}, "attention_backend"),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 64, "max_model_len": 128}, "max_num_batched_tokens"),
        ({"enable_chunked_prefill": False, "min_num_batched_tokens": 64}, "min_num_batched_tokens needs enable_chunked_prefill"),
        ({"min_num_batched_tokens": 512, "max_num_batched_tokens": 256}, r"min_num_batched_tokens \(512\) must be <= max_num_batched_tokens \(256\)"),
        ({"min_num_batched_tokens": 0}, "min_num_batched_tokens"),
    ],
)
def test_bad_engine_argument_is_named(model_dirs, kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(str(model_dirs["llama"]), **kwargs)


def test_max_model_len_beyond_the_model_is_rejected(model_dirs):
    with pytest.raises(ValueError, match="max_model_len=100000 exceeds"):
        LLM(str(model_dirs["llama"]), max_model_len=100000)


# ---- outputs ---------------------------------------------------------------------------------


def test_outputs_in_input_order_with_mixed_prompt_kinds(llm, tokenizer):
    ids = tokenizer.encode("The capital of Japan is")
    prompts = ["Hello", {"prompt_token_ids": ids}, {"prompt": "Once upon a time"}]
    outputs = llm.generate(prompts, greedy(8), use_tqdm=False)
    assert [o.prompt for o in outputs] == ["Hello", None, "Once upon a time"]
    assert outputs[1].prompt_token_ids == ids
    for output in outputs:
        assert output.finished and len(output.outputs) == 1
        completion = output.outputs[0]
        assert completion.index == 0 and completion.finish_reason == "length" and len(completion.token_ids) == 8
        # An incomplete character at the very end (random weights emit raw bytes) is never shown.
        full_text = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        assert completion.text == full_text.rstrip("\ufffd")


def test_request_times_and_the_queue_time_metric(llm):
    """The time a request was first scheduled reaches its output and the queue-time histogram
    (it once went into the output's `error` field, and neither saw it)."""
    queue_time = llm.llm_engine.stats.request_queue_time_seconds
    observed_before = sum(bucket.get() for bucket in queue_time._buckets)
    [output] = llm.generate("Hello", greedy(4), use_tqdm=False)
    metrics = output.metrics
    assert metrics.arrival_time <= metrics.first_scheduled_time <= metrics.first_token_time <= metrics.last_token_time
    assert output.outputs[0].finish_reason == "length" and output.outputs[0].error is None
    assert sum(bucket.get() for bucket in queue_time._buckets) == observed_before + 1


def test_single_prompt_string_and_per_prompt_params(llm):
    [single] = llm.generate("Hello", greedy(3), use_tqdm=False)
    assert len(single.outputs[0].token_ids) == 3
    outputs = llm.generate(["Hello", "Hello"], [greedy(2), greedy(5)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [2, 5]
    assert outputs[1].outputs[0].token_ids[:3] == single.outputs[0].token_ids


def test_n_completions_with_seed_are_reproducible(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12)
    first = llm.generate("Tell me a story", params, use_tqdm=False)[0]
    second = llm.generate("Tell me a story", params, use_tqdm=False)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1  # seed + i differ per child


def test_seeded_request_ignores_its_batch(llm):
    # No top_p here: in another batch the logits round ~1e-6 apart, and a token on the nucleus
    # edge can fall in or out, so the draw may legitimately differ (it flaked). Truncation under
    # a seed across batches is checked on identical logits instead:
    # tests/workers/test_sampler.py::test_seeded_row_with_truncation_is_reproducible.
    params = SamplingParams(temperature=0.9, seed=1234, max_tokens=16)
    alone = llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=20)] * 3
    crowd = llm.generate(["Hi", "Once upon a time", "The sea", "Stars"], [others[0], params, *others[1:]], use_tqdm=False)
    assert crowd[1].outputs[0].token_ids == alone


def test_logprobs_match_hf_log_softmax(llm, hf_references):
    output = llm.generate("The capital of France is", greedy(6, logprobs=3), use_tqdm=False)[0]
    completion = output.outputs[0]
    ids = output.prompt_token_ids + completion.token_ids
    with torch.inference_mode():
        logits = hf_references["llama"].model(torch.tensor([ids])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)[len(output.prompt_token_ids) - 1 : -1]
    assert len(completion.logprobs) == 6
    total = 0.0
    for step, (token_id, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        top = expected[step].topk(3)
        assert set(entry) == {token_id, *top.indices.tolist()}
        assert entry[token_id].rank == 1  # greedy picks the most likely token
        for rank, (tid, value) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            assert entry[tid].rank == rank
            assert math.isclose(entry[tid].logprob, value, abs_tol=1e-4)
        assert entry[token_id].decoded_token == llm.get_tokenizer().decode([token_id])
        total += entry[token_id].logprob
    assert math.isclose(completion.cumulative_logprob, total, abs_tol=1e-4)


def test_stop_string_truncates_and_is_reported(llm):
    full = llm.generate("Hello, my name is", greedy(24), use_tqdm=False)[0].outputs[0]
    stop = full.text[6:9]
    assert stop and stop.strip(), "the reference completion is too short for this test"
    expected_text = full.text[: full.text.index(stop)]
    done = llm.generate("Hello, my name is", greedy(24, stop=[stop, "zzzz-never"]), use_tqdm=False)[0].outputs[0]
    assert (done.text, done.finish_reason, done.stop_reason) == (expected_text, "stop", stop)
    kept = llm.generate("Hello, my name is", greedy(24, stop=stop, include_stop_str_in_output=True), use_tqdm=False)
    assert kept[0].outputs[0].text == expected_text + stop
    assert_idle(llm)


def test_stop_token_ids_and_min_tokens(llm):
    full = llm.generate("Once upon a time", greedy(24), use_tqdm=False)[0].outputs[0].token_ids
    stop_id = full[4]
    first = full.index(stop_id)
    done = llm.generate("Once upon a time", greedy(24, stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert done.token_ids == full[: first + 1]
    assert (done.finish_reason, done.stop_reason) == ("stop", stop_id)
    # min_tokens bans the stop id until min_tokens outputs exist, so the text diverges after it.
    late = llm.generate("Once upon a time", greedy(24, stop_token_ids=[stop_id], min_tokens=first + 2), use_tqdm=False)
    assert len(late[0].outputs[0].token_ids) >= first + 2
    assert stop_id not in late[0].outputs[0].token_ids[: first + 1]


def test_eos_stops_unless_ignored(model_dirs, hf_references):
    """In the qwen3 test model this prompt reaches EOS after a few tokens (as in HF)."""
    llm = LLM(str(model_dirs["qwen3"]), max_model_len=256)
    try:
        prompt = (
            "Once upon a time there was a small server in a quiet data center. It answered questions about "
            "the weather, the sea, the mountains"
        )
        eos = llm.get_tokenizer().eos_token_id
        stopped = llm.generate(prompt, greedy(24), use_tqdm=False)[0]
        tokens = stopped.outputs[0].token_ids
        assert tokens[-1] == eos and len(tokens) < 24 and stopped.outputs[0].finish_reason == "stop"
        assert tokens == hf_references["qwen3"].greedy(stopped.prompt_token_ids, 24)
        ignored = llm.generate(prompt, greedy(24, ignore_eos=True), use_tqdm=False)[0].outputs[0]
        assert len(ignored.token_ids) == 24 and ignored.finish_reason == "length"
        assert ignored.token_ids[: len(tokens)] == tokens
    finally:
        llm.shutdown()


def test_max_model_len_caps_generation(llm, tokenizer):
    ids = (tokenizer.encode("the sea and the stars ") * 40)[:128]
    output = llm.generate({"prompt_token_ids": ids[:120]}, greedy(50), use_tqdm=False)[0].outputs[0]
    assert len(output.token_ids) == 128 - 120 and output.finish_reason == "length"
    full = llm.generate({"prompt_token_ids": ids[:128]}, greedy(5), use_tqdm=False)[0].outputs[0]
    assert len(full.token_ids) == 1  # a prompt of exactly max_model_len still samples one token


def test_chat_applies_the_template(llm):
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    outputs = llm.chat([conversation, conversation[1:]], greedy(4), use_tqdm=False)
    assert outputs[0].prompt == "<|system|>Be brief.<|end|><|user|>Hi!<|end|><|assistant|>"
    assert outputs[1].prompt == "<|user|>Hi!<|end|><|assistant|>"
    single = llm.chat(conversation, greedy(4), use_tqdm=False)
    assert single[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="chat template"):
        llm.chat([{"role": "wizard", "content": "x"}], use_tqdm=False)


# ---- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompts, params, message",
    [
        (["ok", ""], None, "empty"),
        (["ok", {"prompt_token_ids": []}], None, "empty"),
        (["ok", {"prompt_token_ids": [1, 100000]}], None, "outside the vocabulary"),
        (["ok", {"prompt_token_ids": [1, -1]}], None, "outside the vocabulary"),
        (["ok", {"prompt_token_ids": [1] * 129}], None, "max_model_len=128"),
        (["ok", {"prompt_token_ids": "abc"}], None, "list of integers"),
        (["ok", {"text": "x"}], None, "unknown prompt keys"),
        (["ok", 42], None, "a prompt must be"),
        (["a", "b", "c"], [SamplingParams(), SamplingParams()], "3 prompts but 2 sampling params"),
        (["ok", "fine"], [SamplingParams(), SamplingParams(logprobs=50)], "max_logprobs=20"),
        (["ok", "fine"], [SamplingParams(), SamplingParams(n=129)], "n=129 exceeds the engine's max_n=128"),
        (["ok", "fine"], [SamplingParams(), SamplingParams(stop_token_ids=[10**6])], "stop_token_ids"),
        (["ok", "fine"], [SamplingParams(), {"temperature": 0}], "must be a SamplingParams"),
    ],
)
def test_bad_input_rejected_and_nothing_left_queued(llm, prompts, params, message):
    before = llm.generate("Hello", greedy(6), use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, params, use_tqdm=False)
    assert_idle(llm)
    assert llm.generate("Hello", greedy(6), use_tqdm=False)[0].outputs[0].token_ids == before


@pytest.mark.parametrize("kwargs", [{"temperature": -1}, {"top_p": 0}, {"top_k": -2}, {"max_tokens": 0}, {"n": 0}])
def test_bad_sampling_params_name_the_field(kwargs):
    [(field, value)] = kwargs.items()
    with pytest.raises(ValueError, match=f"{field}={value}"):
        SamplingParams(**kwargs)


def test_max_model_len_beyond_the_cache_is_an_error_when_asked_for(model_dirs):
    with pytest.raises(ValueError, match=r"max_model_len=256 is more than the KV cache holds \(64 tokens\)"):
        LLM(str(model_dirs["llama"]), max_model_len=256, num_gpu_blocks_override=4)


def test_max_model_len_is_capped_to_the_cache_when_not_set(model_dirs):
    """The model says 512 positions; 4 blocks hold 64 tokens: a long request ends at 64."""
    llm = LLM(str(model_dirs["llama"]), num_gpu_blocks_override=4)
    try:
        assert llm.llm_engine.model_config.max_model_len == 64
        output = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True), use_tqdm=False)[0]
        assert len(output.prompt_token_ids) + len(output.outputs[0].token_ids) == 64
        assert output.outputs[0].finish_reason == "length"
        assert_idle(llm)
    finally:
        llm.shutdown()


def test_shutdown_is_idempotent(model_dirs):
    llm = LLM(str(model_dirs["llama"]), max_model_len=64)
    llm.shutdown()
    llm.shutdown()
    assert llm.llm_engine.engine_core.engine_core.executor is None


def test_cache_salt_in_a_prompt_dict_separates_prefix_hits(model_dirs):
    """vLLM's offline form: {"prompt": ..., "cache_salt": ...}. The same prompt under another salt
    computes every token; under the same salt it hits the cache. Outputs are the same."""
    llm = LLM(str(model_dirs["llama"]), max_model_len=128, block_size=16)
    try:
        text = "The capital of France is Paris. The capital of Japan is Tokyo. The capital of Italy is"

        def run(salt):
            prompt = {"prompt": text} if salt is None else {"prompt": text, "cache_salt": salt}
            return llm.generate(prompt, greedy(4), use_tqdm=False)[0]

        first = run("tenant-a")
        assert len(first.prompt_token_ids) > 16 and first.num_cached_tokens == 0
        assert run("tenant-b").num_cached_tokens == 0
        assert run(None).num_cached_tokens == 0
        again = run("tenant-a")
        assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
        for bad in ("", 7):
            with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
                llm.generate({"prompt": text, "cache_salt": bad}, greedy(4), use_tqdm=False)
    finally:
        llm.shutdown()
