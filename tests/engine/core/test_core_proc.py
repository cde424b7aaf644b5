"""The engine core in its own process (engine_core_process=True): exactness, errors that cross
the process boundary, and the lives of the two processes (each dies with the other, or shuts
down in order). tests/engine/test_async_llm.py runs AsyncLLM's behaviour in this mode too."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from pagedserve import LLM, AsyncLLM, SamplingParams
from pagedserve.engine.llm_engine import EngineDeadError
from pagedserve.sampling_params import RequestOutputKind

PROMPTS = ["Hello, my name is", "The capital of France is", "Once upon a time", "café 日本語"]
# One torch thread in the core: the front end works beside it on this 2-core machine.
CORE = {"engine_core_process": True, "num_cpu_threads": 1}


@pytest.fixture(scope="module")
def core_llm(model_dirs):
    llm = LLM(str(model_dirs["llama"]), max_model_len=128, dtype="float32", **CORE)
    yield llm
    llm.shutdown()


def is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def wait_until_gone(pid: int, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while is_running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not is_running(pid)


def test_greedy_matches_hf_token_for_token(core_llm, hf_references):
    outputs = core_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    for output in outputs:
        assert output.outputs[0].token_ids == hf_references["llama"].greedy(output.prompt_token_ids, 24)


@pytest.mark.parametrize("setting", ["auto", "nobind"])
def test_the_core_binds_its_threads_one_to_a_cpu(model_dirs, hf_references, setting):
    """`cpu_omp_threads_bind`: with 'auto', where the core's torch threads are every CPU it may
    use, each runs on a CPU of its own and no other thread of the process shares one (a thread
    started by the bound step thread would inherit its CPU); greedy output stays Hugging Face's."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("binding two threads to two CPUs needs two CPUs")
    llm = LLM(str(model_dirs["llama"]), max_model_len=128, dtype="float32", engine_core_process=True, num_cpu_threads=len(cpus), cpu_omp_threads_bind=setting)
    try:
        outputs = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
        pid = llm.llm_engine.engine_core.pid
        masks = [sorted(os.sched_getaffinity(int(task))) for task in os.listdir(f"/proc/{pid}/task")]
    finally:
        llm.shutdown()
    for output in outputs:
        assert output.outputs[0].token_ids == hf_references["llama"].greedy(output.prompt_token_ids, 16)
    bound = sorted(mask[0] for mask in masks if len(mask) == 1)
    assert bound == (cpus if setting == "auto" else []), masks
    assert all(mask == cpus for mask in masks if len(mask) > 1), masks


def test_front_end_work_matches_in_process(core_llm, model_dirs):
    """Stop strings, n completions, seeds and logprobs are the front end's and the core's work
    split in two: the outputs are the in-process engine's, field for field."""
    in_process = LLM(str(model_dirs["llama"]), max_model_len=128, dtype="float32")
    try:
        reference = in_process.generate("Hello, my name is", SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
        stop = reference[0].outputs[0].text[6:9]
        params = [
            SamplingParams(temperature=0, max_tokens=24, stop=[stop], logprobs=2),
            SamplingParams(temperature=1.0, max_tokens=16, n=3, seed=7, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),  # capped by max_model_len
        ]
        prompts = ["Hello, my name is", "Once upon a time", "café 日本語"]
        want = in_process.generate(prompts, params, use_tqdm=False)
    finally:
        in_process.shutdown()
    got = core_llm.generate(prompts, params, use_tqdm=False)
    assert got[0].outputs[0].stop_reason == stop and got[0].outputs[0].finish_reason == "stop"
    assert got[2].outputs[0].finish_reason == "length"
    for mine, theirs in zip(got, want):
        assert mine.prompt_token_ids == theirs.prompt_token_ids
        assert [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in mine.outputs] == [
            (c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in theirs.outputs
        ]
    # The same tokens, ranks and texts; values to float32 rounding (the two ran on different thread counts).
    for mine, theirs in zip(got[0].outputs[0].logprobs, want[0].outputs[0].logprobs):
        assert {t: (p.rank, p.decoded_token) for t, p in mine.items()} == {t: (p.rank, p.decoded_token) for t, p in theirs.items()}
        assert all(mine[t].logprob == pytest.approx(theirs[t].logprob, abs=1e-4) for t in mine)


def test_startup_error_reaches_the_caller(model_dirs):
    with pytest.raises(ValueError, match=r"max_model_len=256 is more than the KV cache holds \(64 tokens\)"):
        LLM(str(model_dirs["llama"]), max_model_len=256, num_gpu_blocks_override=4, **CORE)


async def open_streams(llm: AsyncLLM) -> list:
    """Four long requests (up to max_model_len), each past its first output."""
    long = SamplingParams(max_tokens=100_000, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    streams = [llm.generate(p, long, f"s{i}") for i, p in enumerate(PROMPTS)]
    for stream in streams:
        await anext(stream)
    return streams


async def first_output(llm: AsyncLLM):
    return await anext(llm.generate("Hello", SamplingParams(), "after"))


async def drain(streams: list) -> list:
    async def rest(stream):
        async for _ in stream:
            pass

    return await asyncio.wait_for(asyncio.gather(*(rest(s) for s in streams), return_exceptions=True), timeout=60)


def test_dead_core_ends_every_stream(model_dirs):
    """The replica notices its core died: every open stream ends with EngineDeadError, health
    turns false, and new requests fail at once."""
    llm = AsyncLLM.from_engine_args(model=str(model_dirs["llama"]), max_model_len=256, **CORE)
    try:
        async def run():
            streams = await open_streams(llm)
            os.kill(llm.engine.engine_core.pid, signal.SIGKILL)
            return await drain(streams)

        errors = asyncio.run(run())
        assert all(isinstance(e, EngineDeadError) and "engine core process exited" in str(e) for e in errors), errors
        assert not llm.is_healthy and "engine core process exited" in llm.dead_reason
        with pytest.raises(EngineDeadError, match="engine core process exited"):
            asyncio.run(first_output(llm))
    finally:
        llm.shutdown()


def test_shutdown_ends_streams_and_the_core_exits(model_dirs):
    llm = AsyncLLM.from_engine_args(model=str(model_dirs["llama"]), max_model_len=256, **CORE)
    pid = llm.engine.engine_core.pid

    async def run():
        streams = await open_streams(llm)
        await asyncio.get_running_loop().run_in_executor(None, llm.shutdown)
        return await drain(streams)

    errors = asyncio.run(run())
    assert all(isinstance(e, EngineDeadError) and "shutting down" in str(e) for e in errors), errors
    assert llm.engine.engine_core.process.returncode == 0  # it left its loop and released its workers
    assert not is_running(pid) and not llm.is_healthy
    with pytest.raises(EngineDeadError, match="shutting down"):
        asyncio.run(first_output(llm))


PARENT = """
import sys, time
from pagedserve import LLM
llm = LLM(sys.argv[1], max_model_len=64, engine_core_process=True, num_cpu_threads=1)
print(llm.llm_engine.engine_core.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_core_dies_with_its_parent(model_dirs):
    """No orphan: a parent killed without a chance to clean up still takes its core along."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(model_dirs["llama"])], stdout=subprocess.PIPE, text=True)
    try:
        core_pid = int(parent.stdout.readline())
        assert is_running(core_pid)
        parent.kill()
        parent.wait()
        assert wait_until_gone(core_pid), "the engine core outlived its parent"
    finally:
        parent.kill()
        parent.wait()


def alive_workers(ray) -> list:
    from ray.util.state import list_actors

    # This session's cluster by address: other Rays run on the same machine.
    address = ray.get_runtime_context().gcs_address
    return list_actors(address=address, filters=[("class_name", "=", "Worker"), ("state", "=", "ALIVE")])


@pytest.mark.slow
def test_ray_executor_runs_under_the_core_process(ray_cluster, model_dirs, hf_references):
    """The core joins this process's Ray cluster (its address and namespace) and drives TP=2
    worker actors from there; they go when the core shuts down."""
    llm = LLM(str(model_dirs["llama"]), max_model_len=128, tensor_parallel_size=2, distributed_executor_backend="ray", **CORE)
    try:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
        for output in outputs:
            assert output.outputs[0].token_ids == hf_references["llama"].greedy(output.prompt_token_ids, 16)
        assert len(alive_workers(ray_cluster)) == 2
    finally:
        llm.shutdown()
    deadline = time.monotonic() + 60
    while alive_workers(ray_cluster) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive_workers(ray_cluster)
