"""A rogue client on the engine's network: it connects to every TCP port the engine process
listens on, while the worker group starts and again while it is rebuilt after a worker died, and
sends (a) a raw pickle whose unpickling creates a file, (b) the same in the step channel's framing,
(c) a length header claiming gigabytes; from the engine's address and from one outside the group. Nothing of it may be unpickled or allocated, and the
engine must start, recover and generate exactly as Hugging Face does."""

from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
import struct
import threading

import psutil
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.workers import step_channel

PROMPTS = ["Hello, my name is", "The capital of France is Paris. The capital of Japan is"]
HUGE_CLAIM = 3 * 1024**3  # a vulnerable reader allocates (and zero-fills) this much at once
RSS_MARGIN = 1024**3  # start-up, recovery and generation grow the engine process by far less


class CreatesFile:
    """Unpickling this opens (so creates) `path`: code execution in miniature."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


class RogueClient(threading.Thread):
    """Keeps scanning this process's listening TCP ports and attacks each new one once."""

    def __init__(self, marker: str):
        super().__init__(name="rogue-client", daemon=True)
        raw = pickle.dumps(CreatesFile(marker))
        # Framed first: a reader that unpickles the first message runs it before choking on the rest.
        self.payloads = [struct.pack("!Q", len(raw)) + raw, raw, struct.pack("!Q", HUGE_CLAIM)]
        self.attacked: set[int] = set()
        self.changed = threading.Condition()
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            for host, port in listening_addresses():
                if port not in self.attacked:
                    self.attack(host, port)
                    with self.changed:
                        self.attacked.add(port)
                        self.changed.notify_all()
            self.stopped.wait(0.02)

    def attack(self, host: str, port: int) -> None:
        # From the engine's own address, and from another host's (127.0.0.2: also loopback on
        # Linux, but not the address of any node of the group).
        sources = [None, ("127.0.0.2", 0)] if host == "127.0.0.1" else [None]
        for source in sources:
            for payload in self.payloads:
                try:
                    with socket.create_connection((host, port), timeout=5, source_address=source) as sock:
                        sock.sendall(payload)
                except OSError:  # the port closed meanwhile, or refused the bytes
                    pass

    def wait_until_attacked(self, port: int, timeout: float = 120.0) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: port in self.attacked, timeout=timeout)


def listening_addresses() -> list[tuple[str, int]]:
    found = []
    for conn in psutil.Process().net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN:
            ip = conn.laddr.ip
            host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(ip, ip)
            found.append((host, conn.laddr.port))
    return found


@pytest.fixture
def rogue(tmp_path):
    client = RogueClient(str(tmp_path / "rogue-was-here"))
    client.start()
    yield client
    client.stopped.set()
    client.join(timeout=30)


def test_rogue_client_gets_nothing(ray_cluster, model_dirs, hf_references, rogue, tmp_path, monkeypatch, caplog):
    marker = tmp_path / "rogue-was-here"
    channel_ports = []
    listen = step_channel.listen

    def listen_and_let_the_rogue_in_first(host: str) -> socket.socket:
        """The rogue's bytes wait in the listener's queue before any worker is told to connect."""
        server = listen(host)
        assert server.getsockname()[0] == "127.0.0.1"  # every rank runs on this node
        channel_ports.append(server.getsockname()[1])
        assert rogue.wait_until_attacked(channel_ports[-1]), "the rogue never found the step channel"
        return server

    monkeypatch.setattr(step_channel, "listen", listen_and_let_the_rogue_in_first)
    hf = hf_references["qwen3"]
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    rss_before = psutil.Process().memory_info().rss
    with caplog.at_level(logging.WARNING, logger=step_channel.__name__):
        llm = LLM(str(model_dirs["qwen3"]), max_model_len=256, tensor_parallel_size=2)
        try:
            first = llm.generate(PROMPTS, greedy, use_tqdm=False)
            os.kill(llm.llm_engine.engine_core.engine_core.executor.worker_pids()[1], signal.SIGKILL)
            after_recovery = llm.generate(PROMPTS, greedy, use_tqdm=False)
            assert llm.llm_engine.engine_core.engine_core.num_worker_restarts == 1
        finally:
            llm.shutdown()
    assert len(channel_ports) == 2  # start-up and recovery each opened one, and each was attacked
    assert not marker.exists()
    assert psutil.Process().memory_info().rss - rss_before < RSS_MARGIN
    refused = [r for r in caplog.records if "failed the handshake" in r.getMessage()]
    assert len(refused) >= 2 * len(rogue.payloads)  # every attack reached the handshake and stopped there
    outsiders = [r for r in caplog.records if "not a node of this worker group" in r.getMessage()]
    assert len(outsiders) >= 2 * len(rogue.payloads)  # from another address: not even a handshake
    for output in first + after_recovery:
        assert output.outputs[0].token_ids == hf.greedy(output.prompt_token_ids, 24)
