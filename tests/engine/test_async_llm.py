"""AsyncLLM: the background engine loop, streaming to asyncio callers. The shared fixtures run
each test in both modes: the engine in this process, and its core in a child process
(engine_core_process; tests/engine/core/test_core_proc.py has that mode's own failures)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time

import psutil
import pytest

from pagedserve import LLM, AsyncLLM, SamplingParams
from pagedserve.engine.async_llm import EngineOverloadedError
from pagedserve.engine.llm_engine import EngineDeadError
from pagedserve.sampling_params import RequestOutputKind
from tests.cluster.conftest import wait_until

PROMPTS = ["Hello, my name is", "The capital of France is", "Once upon a time", "café 日本語"]


# A core process gets one torch thread: the front end works beside it on this 2-core machine.
MODES = [pytest.param({}, id="in-process"), pytest.param({"engine_core_process": True, "num_cpu_threads": 1}, id="core-process")]


@pytest.fixture(scope="module", params=MODES)
def async_llm(model_dirs, request):
    llm = AsyncLLM.from_engine_args(model=str(model_dirs["llama"]), max_model_len=256, **request.param)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def expected(model_dirs):
    llm = LLM(str(model_dirs["llama"]), max_model_len=256)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0] for o in outputs]


def params(kind: RequestOutputKind, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=12, output_kind=kind, **kwargs)


async def collect(llm: AsyncLLM, prompt, sampling: SamplingParams, request_id: str) -> list:
    return [output async for output in llm.generate(prompt, sampling, request_id)]


def test_concurrent_streams_match_offline(async_llm, expected):
    async def run():
        deltas = [collect(async_llm, p, params(RequestOutputKind.DELTA), f"d{i}") for i, p in enumerate(PROMPTS)]
        cumulative = [collect(async_llm, p, params(RequestOutputKind.CUMULATIVE), f"c{i}") for i, p in enumerate(PROMPTS)]
        return await asyncio.gather(*deltas, *cumulative)

    results = asyncio.run(run())
    for outputs, want in zip(results[: len(PROMPTS)], expected):
        assert "".join(o.outputs[0].text for o in outputs) == want.text
        assert sum((o.outputs[0].token_ids for o in outputs), []) == want.token_ids
        assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    for outputs, want in zip(results[len(PROMPTS) :], expected):
        assert outputs[-1].outputs[0].token_ids == want.token_ids and outputs[-1].outputs[0].text == want.text
        lengths = [len(o.outputs[0].token_ids) for o in outputs]
        assert lengths == sorted(lengths)  # cumulative outputs only grow


def test_leaving_early_aborts_the_request(async_llm):
    num_aborted_before = async_llm.engine.stats.request_success_total.get("abort", 0)

    async def run():
        stream = async_llm.generate("Hello", SamplingParams(max_tokens=200, ignore_eos=True), "leaver")
        async for _ in stream:
            break
        await stream.aclose()

    asyncio.run(run())
    engine = async_llm.engine
    deadline = time.monotonic() + 30
    while (engine.has_unfinished_requests() or async_llm.stats().kv_cache_usage_perc) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.has_unfinished_requests()
    stats = async_llm.stats()  # the scheduler's view (the core's, in a core process)
    assert stats.kv_cache_usage_perc == 0 and stats.num_requests_running == 0 and stats.num_requests_waiting == 0
    assert engine.stats.request_success_total.get("abort", 0) == num_aborted_before + 1


def test_the_first_busy_step_after_an_idle_moment_shows_in_the_gauges(async_llm):
    """An idle engine's snapshot is taken at once; were the next one due only STATS_INTERVAL_S
    later, short requests at light load would keep the gauges empty throughout (a soak run read
    a peak KV usage of 0 over 610 requests)."""

    async def run():
        await collect(async_llm, "Hello", SamplingParams(max_tokens=2), "before-idle")
        wait_until(lambda: async_llm.stats().num_requests_running == 0, timeout=30, interval=0.005)
        stream = async_llm.generate("Hello", SamplingParams(max_tokens=50, ignore_eos=True), "after-idle")
        # The loop thread snapshots after delivering a step: by the second token, the first
        # token's step (this request running, its blocks held) has been taken.
        await anext(stream)
        await anext(stream)
        stats = async_llm.stats()
        await stream.aclose()
        return stats

    stats = asyncio.run(run())
    assert stats.num_requests_running == 1 and stats.kv_cache_usage_perc > 0, stats


def test_bad_input_and_duplicate_ids(async_llm):
    async def run():
        with pytest.raises(ValueError, match="empty"):
            await collect(async_llm, "", SamplingParams(), "bad")
        stream = async_llm.generate("Hello", SamplingParams(max_tokens=50, ignore_eos=True), "twin")
        await anext(stream)
        with pytest.raises(ValueError, match="already in use"):
            await collect(async_llm, "Hello", SamplingParams(), "twin")
        await stream.aclose()

    asyncio.run(run())
    assert async_llm.is_healthy


def test_idle_engine_uses_no_cpu(async_llm):
    """Counted on the engine's own loop thread and core process: this process also runs the Ray
    driver of other tests, whose threads' CPU time says nothing of the engine."""
    time.sleep(0.3)  # let the loop go idle
    start = engine_cpu_seconds(async_llm)
    time.sleep(1.0)
    assert engine_cpu_seconds(async_llm) - start < 0.05


def engine_cpu_seconds(async_llm: AsyncLLM) -> float:
    """CPU time of the engine loop thread (/proc's per-thread counters), plus its core process's."""
    with open(f"/proc/self/task/{async_llm._thread.native_id}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()  # (the thread's name may hold spaces)
    seconds = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    core_pid = getattr(async_llm.engine.engine_core, "pid", None)
    if core_pid is not None:
        seconds += sum(psutil.Process(core_pid).cpu_times()[:2])
    return seconds


def test_loop_error_reaches_every_caller(model_dirs):
    llm = AsyncLLM.from_engine_args(model=str(model_dirs["llama"]), max_model_len=256)
    try:
        def broken_step():
            raise RuntimeError("boom")

        llm.engine.step = broken_step

        async def run():
            calls = [collect(llm, p, params(RequestOutputKind.DELTA), f"e{i}") for i, p in enumerate(PROMPTS)]
            return await asyncio.gather(*calls, return_exceptions=True)

        errors = asyncio.run(asyncio.wait_for(run(), timeout=30))
        assert all(isinstance(e, EngineDeadError) and "boom" in str(e) for e in errors), errors
        assert not llm.is_healthy and "boom" in llm.dead_reason
        with pytest.raises(EngineDeadError):
            asyncio.run(collect(llm, "Hello", SamplingParams(), "after"))
    finally:
        llm.shutdown()


def test_the_engine_loop_thread_loads_and_steps_the_model(model_dirs, monkeypatch):
    """With the core in this process the output thread builds the engine too: the thread that
    steps the model is the one that loaded it (two threads' parallel ops would run on two OpenMP
    teams, each op waiting to wake its own; async_llm's module doc)."""
    from pagedserve.workers.model_runner import ModelRunner

    threads = {"load_model": set(), "execute_model": set()}
    for name in threads:
        method = getattr(ModelRunner, name)
        monkeypatch.setattr(ModelRunner, name, lambda self, *a, _m=method, _n=name: threads[_n].add(threading.get_ident()) or _m(self, *a))
    llm = AsyncLLM.from_engine_args(model=str(model_dirs["llama"]), max_model_len=256)
    try:
        asyncio.run(collect(llm, "Hello", SamplingParams(max_tokens=2), "thread"))
        assert threads == {"load_model": {llm._thread.ident}, "execute_model": {llm._thread.ident}}
        assert llm._thread.ident != threading.get_ident()
    finally:
        llm.shutdown()


def test_an_engine_that_cannot_be_built_raises_in_the_constructor(model_dirs, monkeypatch):
    """The output thread's build error is the constructor's, and that thread is gone."""
    from pagedserve.engine import async_llm

    def no_engine(config, placement):
        raise FileNotFoundError("no weights here")

    monkeypatch.setattr(async_llm, "LLMEngine", no_engine)
    before = set(threading.enumerate())
    with pytest.raises(FileNotFoundError, match="no weights here"):
        AsyncLLM.from_engine_args(model=str(model_dirs["llama"]), max_model_len=256)
    started = lambda: [t for t in set(threading.enumerate()) - before if t.name == "pagedserve-engine-loop"]  # noqa: E731
    wait_until(lambda: not started(), timeout=5, what="the engine loop thread to end")


def test_slow_consumer_gets_merged_deltas(async_llm):
    """Deltas that pile up while the caller is busy arrive as one output: nothing lost or doubled."""
    sampling = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1, output_kind=RequestOutputKind.DELTA)

    async def slow():
        outputs = []
        async for output in async_llm.generate("Once upon a time", sampling, "slow"):
            outputs.append(output)
            await asyncio.sleep(0.05)
        return outputs

    outputs = asyncio.run(slow())
    tokens = sum((o.outputs[0].token_ids for o in outputs), [])
    logprobs = sum((o.outputs[0].logprobs for o in outputs), [])
    assert len(tokens) == len(logprobs) == 40 and len(outputs) < 40
    assert [t in entry for t, entry in zip(tokens, logprobs)] == [True] * 40
    full = asyncio.run(collect(async_llm, "Once upon a time", sampling.clone(output_kind=RequestOutputKind.FINAL_ONLY), "fast"))
    assert full[-1].outputs[0].token_ids == tokens
    assert "".join(o.outputs[0].text for o in outputs) == full[-1].outputs[0].text


# ---- shutdown, stalls, bounded streams, admission ---------------------------------------------


def test_shutdown_ends_open_streams_and_waits_for_the_step(model_dirs):
    llm = AsyncLLM.from_engine_args(model=str(model_dirs["llama"]), max_model_len=256)
    events: list[str] = []
    core = llm.engine.engine_core.engine_core  # the in-process EngineCore
    step, core_shutdown = core.step, core.shutdown

    def slow_step():
        events.append("step")
        time.sleep(0.05)  # long enough that shutdown arrives during a step
        outputs = step()
        events.append("step done")
        return outputs

    core.step = slow_step
    core.shutdown = lambda: (events.append("executor shutdown"), core_shutdown())
    long = SamplingParams(max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def run():
        streams = [llm.generate(p, long, f"s{i}") for i, p in enumerate(PROMPTS)]
        for stream in streams:
            await anext(stream)
        await asyncio.get_running_loop().run_in_executor(None, llm.shutdown)

        async def rest(stream):
            async for _ in stream:
                pass

        return await asyncio.wait_for(asyncio.gather(*(rest(s) for s in streams), return_exceptions=True), timeout=30)

    errors = asyncio.run(run())
    assert all(isinstance(e, EngineDeadError) and "shutting down" in str(e) for e in errors), errors
    # The executor went away only after the loop thread left its step.
    assert events[-1] == "executor shutdown" and events[-2] == "step done", events[-4:]
    with pytest.raises(EngineDeadError, match="shutting down"):
        asyncio.run(collect(llm, "Hello", SamplingParams(), "after"))
    assert not llm.is_healthy


@pytest.fixture(scope="module", params=MODES)
def small_llm(model_dirs, request):
    """One running request at a time, two waiting at most, and a short step timeout."""
    llm = AsyncLLM.from_engine_args(
        model=str(model_dirs["llama"]), max_model_len=256, max_num_seqs=1, max_waiting_requests=2, step_timeout_s=0.5, max_n=4,
        **request.param,
    )
    yield llm
    llm.shutdown()


@contextlib.contextmanager
def wedged_step(llm: AsyncLLM):
    """An engine step that makes no progress until the block ends: in-process, the loop
    thread's step waits on an event; with a core process, the core is stopped (SIGSTOP) in the
    middle of a step. A request must be running when it is entered."""
    if llm.config.engine_core_process:
        pid, clock = llm.engine.engine_core.pid, llm.engine.engine_core.clock
        try:
            for _ in range(1000):  # catch the core inside a step, not between two
                os.kill(pid, signal.SIGSTOP)
                time.sleep(0.005)
                if clock.started is not None:
                    break
                os.kill(pid, signal.SIGCONT)
            assert clock.started is not None
            yield
        finally:
            os.kill(pid, signal.SIGCONT)
        return
    release, entered = threading.Event(), threading.Event()
    core = llm.engine.engine_core.engine_core  # the in-process EngineCore
    step = core.step

    def wedged():
        entered.set()
        release.wait(60)
        return step()

    core.step = wedged
    try:
        assert entered.wait(30)
        yield
    finally:
        core.step = step
        release.set()


def test_stalled_step_is_unhealthy(small_llm):
    async def run():
        stream = small_llm.generate("Hello", SamplingParams(max_tokens=100, ignore_eos=True), "wedged")
        await anext(stream)
        with wedged_step(small_llm):
            deadline = time.monotonic() + 30
            while small_llm.is_healthy and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            reason = small_llm.dead_reason
        rest = [output async for output in stream]
        return reason, rest

    reason, rest = asyncio.run(run())
    assert "step_timeout_s=0.5" in reason
    assert rest[-1].finished and small_llm.is_healthy  # the step ended: healthy again


def test_slow_consumer_holds_one_pending_output(small_llm):
    """A caller that stops reading for many steps then gets one output: the latest for
    CUMULATIVE, all the tokens merged for DELTA (the stream holds no backlog)."""

    async def pause_then_read(kind: RequestOutputKind, request_id: str) -> tuple[list, list]:
        sampling = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, output_kind=kind)
        stream = small_llm.generate("Once upon a time", sampling, request_id)
        first = [await anext(stream)]
        deadline = time.monotonic() + 60
        while small_llm.engine.has_unfinished_requests() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # the event loop runs: outputs keep arriving, unread
        return first, [output async for output in stream]

    first, rest = asyncio.run(pause_then_read(RequestOutputKind.CUMULATIVE, "cumulative"))
    assert len(rest) == 1 and rest[0].finished and len(rest[0].outputs[0].token_ids) == 30
    first, rest = asyncio.run(pause_then_read(RequestOutputKind.DELTA, "delta"))
    assert len(rest) == 1 and rest[0].finished
    assert len(first[0].outputs[0].token_ids + rest[0].outputs[0].token_ids) == 30


def test_admission_counts_engine_requests(small_llm):
    long = SamplingParams(max_tokens=200, ignore_eos=True)

    async def run():
        running = small_llm.generate("Hello", long, "running")
        await anext(running)  # it holds the one running slot
        waiting = small_llm.generate("Hello", long.clone(n=2), "waiting")  # two engine requests wait
        pending = asyncio.ensure_future(anext(waiting))
        await asyncio.sleep(0)
        with pytest.raises(EngineOverloadedError, match="max_waiting_requests=2"):
            await collect(small_llm, "Hi", SamplingParams(max_tokens=2), "refused")
        with pytest.raises(ValueError, match="max_n=4"):
            await collect(small_llm, "Hi", SamplingParams(max_tokens=2, n=5), "too-many")
        pending.cancel()  # the waiting request's caller goes away: it is aborted
        await asyncio.gather(pending, return_exceptions=True)
        await running.aclose()

    asyncio.run(run())
    engine = small_llm.engine
    deadline = time.monotonic() + 30
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.has_unfinished_requests() and small_llm.is_healthy
