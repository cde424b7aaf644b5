"""InprocClient: messages take effect at once when no step runs, wait for the next step when one
does (a sender never waits for a step), the stepping thread sleeps while there is nothing to do,
and shutdown waits for a running step before it releases the workers."""

from __future__ import annotations

import threading
import time

import pytest

from pagedserve.config import EngineConfig
from pagedserve.engine.core.inproc_client import InprocClient
from pagedserve.engine.core.messages import AbortRequests, AddRequest
from pagedserve.engine.input_processor import ProcessedPrompt
from pagedserve.sampling_params import SamplingParams


@pytest.fixture
def client(model_dirs):
    client = InprocClient(EngineConfig(model=str(model_dirs["llama"]), max_model_len=128, max_num_seqs=1))
    yield client
    client.shutdown()


def add(request_id: str, n: int = 1, max_tokens: int = 50) -> AddRequest:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, n=n)
    return AddRequest(request_id, ProcessedPrompt(None, [5, 6, 7, 8]), params, 0.0)


def in_thread(target) -> tuple[threading.Thread, list]:
    results: list = []
    thread = threading.Thread(target=lambda: results.append(target()), daemon=True)
    thread.start()
    return thread, results


def test_a_message_applies_at_once_when_no_step_runs(client):
    client.send(add("now"))
    assert client.engine_core.scheduler.num_waiting == 1
    client.send(AbortRequests(["now"]))
    assert not client.engine_core.has_work()


def test_messages_sent_during_a_step_wait_for_the_next_one(client):
    core = client.engine_core
    client.send(add("running"))
    client.get_output()  # its first step: it runs, nothing waits
    assert core.scheduler.num_waiting == 0
    release, entered = threading.Event(), threading.Event()
    step = core.step

    def held_step():
        entered.set()
        release.wait(30)
        return step()

    core.step = held_step
    thread, _ = in_thread(client.get_output)
    assert entered.wait(30)
    assert client.step_started is not None
    client.send(add("queued", n=2))  # returns at once, though a step runs
    assert core.scheduler.num_waiting == 0  # not applied yet
    assert client.num_waiting_requests == 2  # but counted: on its way
    core.step = step
    release.set()
    thread.join(30)
    assert client.step_started is None
    client.get_output()  # takes the queued add before stepping
    assert {r.request_id for r in core.scheduler.running + list(core.scheduler.waiting)} == {"running", "0_queued", "1_queued"}
    assert client.num_waiting_requests == 2  # max_num_seqs=1: both children wait, now in the core


def test_get_output_sleeps_until_a_message_comes(client):
    thread, results = in_thread(client.get_output)
    time.sleep(0.3)
    assert thread.is_alive() and not results  # nothing to do: it waits
    client.send(add("wake", max_tokens=1))
    thread.join(30)
    assert results and [o.req_id for o in results[0].outputs] == ["wake"]


def test_shutdown_ends_a_waiting_get_output_and_releases_the_workers(client):
    thread, results = in_thread(lambda: pytest.raises(EOFError, client.get_output))
    time.sleep(0.2)
    client.shutdown()
    thread.join(30)
    assert results and client.engine_core.executor is None
    with pytest.raises(EOFError):
        client.get_output()
