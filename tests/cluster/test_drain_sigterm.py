"""An LLMServer replica sent SIGTERM mid-stream drains (cluster/replica_drain.py): its streams
finish on the other replica, equal to an undisturbed run, with no error; requests sent after the
SIGTERM succeed; its process exits.

Two replicas of the tiny Llama, the real openai client, greedy and seeded sampling. The sender
behaves as Kubernetes and `ray stop` do: SIGTERM, then SIGKILL once a grace period is over. The
grace here is measured in the requests' progress, so a loaded machine stretches it as it
stretches the drain: it ends when a stream that was in flight at the SIGTERM has received
GRACE_SHARE of its text since (hundreds of tokens: seconds here, against a drained replica's exit
in 0.1-0.4 s), or when every request in flight then has completed; and never before GRACE_MIN_S.
(It once ended at the first completion: a stream near its end at the SIGTERM ended it within a
second, and a CI run SIGKILLed a replica that was still exiting. Then progress alone ended it 1.1
s after the SIGTERM on a CI run: what it counts is text the client has read, which on a busy
machine can lag what the replicas sent.) Ray alone (old main) keeps a SIGTERMed replica's streams running in
place and its process waiting on Serve's long polls (30-60 s), so the SIGKILL cuts the streams,
or finds the replica alive.

The streams must outlast the sender's wait for /metrics to show where they run (replicas report
every second) by a wide margin on a loaded machine: a replica whose engine core runs in its own
process generated 400 tokens in about four seconds, and a CI run saw every request end before
/metrics showed them. So the model is the tiny Llama with 2048 positions, not 512."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import openai
import psutil
import pytest
import requests

from pagedserve.cluster.node_drain import local_replicas
from tests.cluster.conftest import deploy, wait_until
from tests.cluster.openai_requests import ask
from tests.models import build_model

APP = "sigterm"
MAX_MODEL_LEN = 2048
NUM_STREAMS = 8
NUM_WHOLE = 2  # non-streaming requests in flight beside the streams
NUM_AFTER = 2  # requests sent right after the SIGTERM (a stream and a whole one)
GRACE_SHARE = 0.4  # of a stream's text, received after the SIGTERM: the grace is over
GRACE_MIN_S = 5.0  # but not sooner (Kubernetes' default grace is 30 s)
PROMPTS = ["Once upon a time", "The capital of France is", "Hello, my name is", "In a hole in the ground"]


def max_tokens(i: int) -> int:
    """Long enough to be mid-stream at the SIGTERM; each request a different length, so the
    replica's requests do not all end in one step. Those sent after the SIGTERM are short."""
    return 16 if i >= NUM_STREAMS + NUM_WHOLE else 1600 + 32 * i


def sampling(i: int) -> dict:
    """Half greedy, half seeded sampling (two of those streams with n=2: each choice moves as its
    own request); completions and chat alternate. No top_p: a resumed request runs in another
    batch, whose logits round ~1e-6 apart, and a nucleus edge can turn that into another draw."""
    if i % 2 == 0:
        return {"temperature": 0.0}
    n = {"n": 2} if i in (3, 5) else {}
    return {"temperature": 1.0, "seed": 100 + i, "frequency_penalty": 0.3, **n}


async def one(client: openai.AsyncOpenAI, i: int, is_stream: bool, started: asyncio.Event, received: list[int]) -> tuple:
    """(each choice's text, prompt_tokens, completion_tokens) of request i; `started` is set at
    its first text (at once for a whole request), `received[0]` counts a stream's characters."""
    params = {"max_tokens": max_tokens(i), "extra_body": {"ignore_eos": True}, **sampling(i)}
    if not is_stream:
        started.set()
    return await ask(client, APP, PROMPTS[i % len(PROMPTS)], i % 4 >= 2, params, started if is_stream else None, received)


def is_stream(i: int) -> bool:
    return i < NUM_STREAMS or i == NUM_STREAMS + NUM_WHOLE


async def run(base_url: str, disturb=None) -> list[tuple]:
    """Every request's result. `disturb()` runs in a thread once every stream has text: it sends
    SIGTERM and returns; the requests sent after the SIGTERM go out then, and
    `disturb.finish(progress)` (also in a thread) plays the rest of the sender's part.
    `progress()`: each request in flight at the SIGTERM -> (done, characters received since)."""
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300) as client:
        num_before = NUM_STREAMS + NUM_WHOLE
        started = [asyncio.Event() for _ in range(num_before + NUM_AFTER)]
        received = [[0] for _ in range(num_before + NUM_AFTER)]
        calls = [asyncio.ensure_future(one(client, i, is_stream(i), started[i], received[i])) for i in range(num_before)]
        if disturb is not None:
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started[:NUM_STREAMS])), timeout=180)
            await asyncio.to_thread(disturb)
        at_sigterm = {i: received[i][0] for i in range(num_before) if not calls[i].done()}  # one done before counts for nothing
        calls += [asyncio.ensure_future(one(client, i, is_stream(i), started[i], received[i])) for i in range(num_before, num_before + NUM_AFTER)]
        if disturb is not None:
            assert at_sigterm, "every request ended before the SIGTERM: nothing was mid-stream"
            progress = lambda: {i: (calls[i].done(), received[i][0] - count) for i, count in at_sigterm.items()}  # noqa: E731
            await asyncio.to_thread(disturb.finish, progress)
        return await asyncio.wait_for(asyncio.gather(*calls), timeout=300)  # a failed request raises here


def replica_pids() -> dict[str, int]:
    """The app's live LLMServer replicas: unique id -> process id (the GCS's actor table; the
    state API would need this cluster's dashboard address among the machine's clusters)."""
    import ray._private.state

    prefix = f"SERVE_REPLICA::{APP}#LLMServer#"
    actors = ray._private.state.actors().values()
    return {a["Name"][len(prefix):]: a["Pid"] for a in actors if a["State"] == "ALIVE" and (a["Name"] or "").startswith(prefix)}


def running_by_replica(base_url: str) -> dict[str, float]:
    """Requests running per replica unique id, from /metrics (each replica's latest report)."""
    from prometheus_client.parser import text_string_to_metric_families

    running: dict[str, float] = {}
    for family in text_string_to_metric_families(requests.get(f"{base_url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == "pagedserve:num_requests_running" and sample.labels.get("model_name") == APP:
                match = re.search(r"id='([^']+)'", sample.labels["replica"])
                if match:
                    running[match.group(1)] = sample.value
    return running


def is_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Sender:
    """SIGTERM to the replica running the most requests; SIGKILL if it is still alive when the
    grace is over (see the module's note). `lengths`: each request's characters, undisturbed."""

    def __init__(self, base_url: str, num_replicas: int, lengths: list[int]):
        self.base_url = base_url
        self.num_replicas = num_replicas
        self.lengths = lengths
        self.pid: int | None = None
        self.is_killed = False

    def __call__(self) -> None:
        pids = wait_until(lambda: len(p := replica_pids()) == self.num_replicas and p, timeout=60, what="the live replicas")
        # The chart's preStop hook finds a node's replicas by their process titles: so does it here.
        assert set(pids.values()) <= {process.pid for process in local_replicas()}
        # Both replicas' latest reports show the streams (a report is at most a second old).
        running = wait_until(  # polled gently: each scrape is work for the proxy, ingress and hub
            lambda: (r := running_by_replica(self.base_url)) and sum(r.values()) >= NUM_STREAMS and r,
            timeout=60, interval=0.25, what="the streams in /metrics", details=lambda: str(running_by_replica(self.base_url)),
        )
        busiest = max(running, key=running.get)
        assert running[busiest] >= 2, f"the SIGTERMed replica must hold streams of different lengths: {running}"
        self.pid = pids[busiest]
        os.kill(self.pid, signal.SIGTERM)
        self.sigterm_time = time.monotonic()

    def finish(self, progress) -> None:
        while is_alive(self.pid):
            if self.is_grace_over(progress()):
                os.kill(self.pid, signal.SIGKILL)
                self.is_killed = True
                break
            time.sleep(0.05)
        self.seconds_alive = time.monotonic() - self.sigterm_time  # for the failure's message

    def is_grace_over(self, progress: dict[int, tuple[bool, int]]) -> bool:
        if time.monotonic() - self.sigterm_time < GRACE_MIN_S:
            return False
        if all(done for done, _ in progress.values()):
            return True
        return any(since >= GRACE_SHARE * self.lengths[i] for i, (_, since) in progress.items())


def deploy_replicas(model_dir, num_replicas: int, **engine) -> None:
    """The app with that many LLMServer replicas (a change of the count only scales)."""
    config = {
        "model": str(model_dir), "served_model_name": APP, "graceful_shutdown_s": 2.0,
        "engine": {"max_model_len": MAX_MODEL_LEN, **engine}, "deployment": {"num_replicas": num_replicas},
    }
    deploy(config, APP, f"/{APP}")
    wait_until(lambda: len(replica_pids()) == num_replicas, timeout=120, what=f"{num_replicas} live replicas")


@pytest.fixture(scope="module")
def long_llama(artifacts, tokenizer_dir):
    """The tiny Llama's weights (same seed) with MAX_MODEL_LEN positions."""
    return build_model(artifacts / "llama_long", "llama", tokenizer_dir, max_position_embeddings=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def sigterm_url(serve_url, long_llama):
    from ray import serve

    deploy_replicas(long_llama, 2)
    yield f"{serve_url}/{APP}"
    serve.delete(APP)


@pytest.fixture(scope="module")
def undisturbed(sigterm_url):
    return asyncio.run(run(sigterm_url))


def sigterm_mid_stream(base_url: str, num_replicas: int, undisturbed) -> None:
    sender = Sender(base_url, num_replicas, [sum(map(len, texts)) for texts, _, _ in undisturbed])
    try:
        results = asyncio.run(run(base_url, sender))
    except openai.APIError as error:
        killed = f"SIGKILLed at the grace's end, {sender.seconds_alive:.1f} s after the SIGTERM" if sender.is_killed else "not SIGKILLed"
        raise AssertionError(f"a request failed: {error} (the SIGTERMed replica was {killed})") from error
    assert results == undisturbed  # text, prompt and completion tokens: as if undisturbed
    # It handed its streams over at once and exited, long before the moved ones got far.
    assert not sender.is_killed, f"the SIGTERMed replica was still running at the grace's end, {sender.seconds_alive:.1f} s after the SIGTERM"


def test_sigterm_mid_stream_hands_streams_over(sigterm_url, undisturbed):
    sigterm_mid_stream(sigterm_url, 2, undisturbed)


def test_sigterm_to_the_only_replica_waits_for_its_replacement(sigterm_url, undisturbed, long_llama):
    """The moved requests wait in the router until Serve's replacement runs; none fails."""
    deploy_replicas(long_llama, 1)
    sigterm_mid_stream(sigterm_url, 1, undisturbed)


def test_sigterm_to_a_replica_whose_engine_core_runs_in_its_own_process(sigterm_url, undisturbed, long_llama):
    """What `pagedserve serve` runs on a machine of its own: the drain stops the core process too."""
    deploy_replicas(long_llama, 2, engine_core_process=True)
    sigterm_mid_stream(sigterm_url, 2, undisturbed)
    assert not [p for p in psutil.process_iter(["cmdline"]) if "pagedserve.engine.core.proc" in " ".join(p.info["cmdline"] or []) and p.ppid() == 1]
