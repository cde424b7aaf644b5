"""A real model, SmolLM2-135M-Instruct from its Q4_1 GGUF file: greedy float32 outputs equal
transformers' own load of the same file token for token (64 tokens of 8 prompts, chat and plain),
in every configuration that fills the KV cache differently, on Ray TP and PP, and through the
OpenAI server. Trained weights reach paths random ones do not: long coherent continuations, EOS
mid-batch, the chat template's special tokens."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import openai
import psutil
import pytest

from pagedserve import LLM, SamplingParams
from tests.cluster.conftest import free_port, wait_until
from tests.cluster.test_cli_serve import _healthy, _listener, _tail

MAX_TOKENS = 64
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Name three primary colors."}],
    [{"role": "user", "content": "Write a haiku about a server that never sleeps."}],
    [{"role": "user", "content": "Explain in two sentences why the sky is blue."}],
]
PLAIN = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "café naïve 日本語 🙂 — the list of",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
# name -> engine arguments; the model's own limits otherwise (max_model_len is capped to the cache).
CONFIGS = {
    "default": {},
    "chunked_prefill_budget_16": {"max_num_batched_tokens": 16},
    # 12 blocks of 16 tokens for 8 requests of up to ~100 tokens each: with no room reserved for
    # outputs at admission, the batch keeps preempting.
    "forced_preemption": {"num_gpu_blocks_override": 12, "schedule_conservativeness": 0},
}


@pytest.fixture(scope="module")
def gguf_tokenizer(smollm2_gguf):
    """transformers' tokenizer read straight from the GGUF file's metadata."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="module")
def prompts(gguf_tokenizer) -> list[dict]:
    chats = [gguf_tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True) for chat in CHATS]
    chats = [ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids for ids in chats]
    plain = [gguf_tokenizer.encode(text) for text in PLAIN]
    return [{"prompt_token_ids": list(ids)} for ids in chats + plain]


@pytest.fixture(scope="module")
def default_llm(smollm2_gguf):
    llm = LLM(str(smollm2_gguf), dtype="float32")
    yield llm
    llm.shutdown()


def engine_vs_hf(llm: LLM, hf, prompts: list[dict]) -> list:
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for output in outputs:
        expected = hf.greedy(output.prompt_token_ids, MAX_TOKENS)
        assert output.outputs[0].token_ids == expected, f"prompt {output.prompt_token_ids[:12]}..."
    return outputs


def test_default_configuration_matches_hf(default_llm, smollm2_hf, prompts):
    outputs = engine_vs_hf(default_llm, smollm2_hf, prompts)
    # Real weights end some replies with <|im_end|> before 64 tokens: EOS mid-batch is exercised.
    assert {o.outputs[0].finish_reason for o in outputs} == {"stop", "length"}
    # SmolLM2 says 8192 positions; the default CPU cache holds fewer, so the limit was capped.
    engine = default_llm.llm_engine
    assert engine.model_config.max_model_len == engine.num_kv_blocks * engine.config.block_size < 8192


@pytest.mark.parametrize("config_name", [name for name in CONFIGS if name != "default"])
def test_scheduling_configurations_match_hf(config_name, smollm2_gguf, smollm2_hf, prompts):
    llm = LLM(str(smollm2_gguf), dtype="float32", **CONFIGS[config_name])
    try:
        engine_vs_hf(llm, smollm2_hf, prompts)
        if config_name == "forced_preemption":
            assert llm.llm_engine.engine_core.engine_core.scheduler.num_preemptions_total > 0  # or this proves nothing
    finally:
        llm.shutdown()


def test_prefix_caching_on_a_second_run(default_llm, smollm2_hf, prompts):
    engine_vs_hf(default_llm, smollm2_hf, prompts)
    outputs = engine_vs_hf(default_llm, smollm2_hf, prompts)
    block = default_llm.llm_engine.config.block_size
    for output in outputs:
        assert output.num_cached_tokens == (len(output.prompt_token_ids) - 1) // block * block
    assert sum(o.num_cached_tokens for o in outputs) > 0


@pytest.mark.parametrize("tp, pp", [(3, 1), (1, 2)], ids=["tp3", "pp2"])
def test_ray_parallel_matches_hf(ray_cluster, tp, pp, smollm2_gguf, smollm2_hf, prompts):
    """TP=3 splits SmolLM2's 9 query and 3 KV heads evenly; PP=2 splits its 30 layers."""
    llm = LLM(str(smollm2_gguf), dtype="float32", tensor_parallel_size=tp, pipeline_parallel_size=pp, max_model_len=512)
    try:
        engine_vs_hf(llm, smollm2_hf, prompts)
    finally:
        llm.shutdown()


# A schema a trained model fills with its own words: the answer's content is the model's, the
# shape the grammar's.
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}},
    "required": ["city", "country"], "additionalProperties": False,
}
CONSTRAINED = {"json": CITY_SCHEMA, "choice": ["Paris", "Lyon", "Nice"], "regex": r"[A-Z][a-z]{2,9}"}


@pytest.fixture(scope="module")
def smollm2_grammar(smollm2_hf, gguf_tokenizer):
    from tests.engine.structured_outputs.grammar_reference import GrammarReference

    return GrammarReference.of(smollm2_hf.model, gguf_tokenizer)


def test_constrained_greedy_matches_hf_masked_by_xgrammar(default_llm, smollm2_grammar, prompts):
    """Every spec kind on every chat prompt: the engine's constrained greedy equals HF's logits
    masked by xgrammar's own matcher, token by token (a 49152-token vocabulary, trained weights)."""
    from pagedserve import StructuredOutputsParams

    chats = prompts[: len(CHATS)]
    cases = [(prompt, kind) for prompt in chats for kind in CONSTRAINED]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(**{kind: CONSTRAINED[kind]})) for _, kind in cases]
    outputs = default_llm.generate([p for p, _ in cases], params, use_tqdm=False)
    for (prompt, kind), output in zip(cases, outputs):
        expected = smollm2_grammar.greedy(prompt["prompt_token_ids"], kind, CONSTRAINED[kind], MAX_TOKENS)
        assert output.outputs[0].token_ids == expected, (kind, output.outputs[0].text)
    assert sum(o.outputs[0].finish_reason == "stop" for o in outputs) == len(cases)  # every grammar completed


def test_engine_tokenizer_is_the_gguf_tokenizer(default_llm, gguf_tokenizer, prompts):
    """The converted folder's tokenizer and chat template give the same ids as the GGUF's own."""
    outputs = default_llm.chat(CHATS, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == [p["prompt_token_ids"] for p in prompts[: len(CHATS)]]
    assert [default_llm.get_tokenizer().encode(text) for text in PLAIN] == [p["prompt_token_ids"] for p in prompts[len(CHATS):]]
    assert default_llm.get_tokenizer().decode(gguf_tokenizer.encode(PLAIN[3]), skip_special_tokens=True) == PLAIN[3]


def test_served_chat_equals_offline_chat(default_llm, smollm2_gguf, tmp_path):
    """`pagedserve serve --model FILE.gguf`: the openai client's greedy chat answers equal
    `LLM.chat`'s, and the model is served under the name it was given. Serve's proxy answers on
    the port here (`--http-ingress proxy`) and the engine runs in an LLMServer replica
    (`--engine-host replicas`); tests/cluster/test_cli_serve.py runs the defaults."""
    expected = [o.outputs[0].text for o in default_llm.chat(CHATS[:2], GREEDY, use_tqdm=False)]
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    command = [sys.executable, "-m", "pagedserve.cli", "serve", "--model", str(smollm2_gguf), "--port", str(port),
               "--dtype", "float32", "--max-model-len", "1024", "--http-ingress", "proxy", "--engine-host", "replicas"]
    log = open(tmp_path / "serve.log", "w+")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_until(lambda: _healthy(port) or process.poll() is not None, timeout=480, interval=1.0)
        assert process.poll() is None, _tail(log)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
        assert client.models.list().data[0].id == str(smollm2_gguf)
        assert "ProxyActor" in _listener(process.pid, port)
        assert any("LLMServer" in " ".join(p.cmdline()) for p in psutil.Process(process.pid).children(recursive=True))
        for chat, text in zip(CHATS[:2], expected):
            reply = client.chat.completions.create(model=str(smollm2_gguf), messages=chat, max_tokens=MAX_TOKENS, temperature=0)
            assert reply.choices[0].message.content == text
        assert "Paris" in expected[0]  # a trained model answers; random weights would not
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) == 0, _tail(log)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        log.close()
