"""`pagedserve serve` as a user runs it: a subprocess that starts its own Ray, requires the key
from its key file, answers a chat request, and exits cleanly on SIGTERM. Its ingress replica
holds the engine (`engine_host: auto`, cluster/local_engine.py) and runs on tcmalloc exactly
where this machine has it (cluster/tcmalloc.py), and it answers HTTP on the port itself (Serve's
direct ingress, `http_ingress: auto`): a client that
goes away mid-stream still aborts its request there, and once SIGTERM comes new requests get a
503 while the stream in flight runs to its end. (tests/e2e/test_real_model.py runs the
command with Serve's proxy on the port and the engine in an LLMServer replica.)"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time

import openai
import psutil
import pytest
import requests

from pagedserve.cluster import tcmalloc
from tests.cluster.conftest import free_port, metric_values, wait_until


def test_serve_command_answers_and_stops_on_sigterm(model_dirs, tmp_path):
    port = free_port()
    key = "sk-" + secrets.token_hex(12)
    (tmp_path / "key").write_text(key)
    config = tmp_path / "server.yaml"
    config.write_text(
        f"model: {model_dirs['llama']}\nserved_model_name: cli-llama\napi_key_file: {tmp_path / 'key'}\nengine: {{max_model_len: 128}}\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "LD_PRELOAD", tcmalloc.SWITCH)}
    command = [sys.executable, "-m", "pagedserve.cli", "serve", "--config", str(config), "--port", str(port), "--max-model-len", "512"]
    log = open(tmp_path / "serve.log", "w+")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_until(lambda: _healthy(port) or process.poll() is not None, timeout=240, interval=1.0)
        assert process.poll() is None, _tail(log)
        with_wrong_key = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            with_wrong_key.models.list()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
        reply = client.chat.completions.create(model="cli-llama", messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
        assert reply.choices[0].message.role == "assistant" and reply.usage.completion_tokens >= 1
        assert client.models.list().data[0].id == "cli-llama"  # the flag overrode nothing else
        assert "OpenAIIngress" in _listener(process.pid, port)
        _disconnect_mid_stream(f"http://127.0.0.1:{port}", key)
        expected = tcmalloc.find()  # None on a machine without it: then glibc's malloc
        assert _engine_host_allocator(process.pid) == (os.path.realpath(expected) if expected else None)
        assert _served_niceness(process.pid) == {os.nice(0)}  # not Ray's 15 for workers: pagedserve/ray_env.py
        stream = _stream(f"http://127.0.0.1:{port}", key, max_tokens=500)
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        wait_until(lambda: _refused(f"http://127.0.0.1:{port}", key), timeout=30, interval=0.2, what="a 503 for a new request", details=lambda: _tail(log))
        last_events = list(stream)[-2:]  # the stream in flight at SIGTERM runs to its end
        assert json.loads(last_events[0])["usage"]["completion_tokens"] == 500 and last_events[1] == "[DONE]"
        assert process.wait(timeout=120) == 0, _tail(log)
        assert time.monotonic() - started < 120
        output = _tail(log)
        assert "serving 'cli-llama'" in output and "curl http://127.0.0.1" in output and "pagedserve: stopped" in output
        assert "Bearer $PAGEDSERVE_API_KEY" in output and key not in output
        assert ("pagedserve: tcmalloc preloaded" if expected else "pagedserve: no tcmalloc found") in output
        assert "the engine runs in the ingress replica's process (engine_host: ingress)" in output
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        log.close()


def _listener(pid: int, port: int) -> str:
    """The command line of `pid`'s descendant that listens on `port`."""
    for child in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in child.net_connections("tcp")):
                return " ".join(child.cmdline())
    raise AssertionError(f"none of {pid}'s processes listens on {port}")


def _stream(base_url: str, key: str, max_tokens: int):
    """A streamed completion of exactly `max_tokens`, started and its first event read: the
    rest of its events' data, the usage chunk and [DONE] last."""
    body = {"model": "cli-llama", "prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    response = requests.post(f"{base_url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, stream=True, timeout=60)
    assert response.status_code == 200, response.text
    events = (line.removeprefix("data: ") for line in response.iter_lines(decode_unicode=True) if line.startswith("data: "))
    assert next(events)
    return events


def _refused(base_url: str, key: str) -> bool:
    """Whether a new request now gets the stopping server's 503 (a 200 means not yet)."""
    body = {"model": "cli-llama", "prompt": "Hi", "max_tokens": 1}
    response = requests.post(f"{base_url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert response.status_code in (200, 503), response.text
    return response.status_code == 503 and "shutting down" in response.json()["error"]["message"]


def _disconnect_mid_stream(base_url: str, key: str) -> None:
    """A stream whose client leaves after its first chunk is aborted, long before its end."""
    labels = (("model_name", "cli-llama"),)
    aborts = ("pagedserve:request_success_total", (("finished_reason", "abort"), *labels))
    tokens = ("pagedserve:generation_tokens_total", labels)
    before = metric_values(base_url)
    body = {"model": "cli-llama", "prompt": "Hello", "max_tokens": 240, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {key}"}
    with requests.post(f"{base_url}/v1/completions", json=body, headers=headers, stream=True, timeout=30) as response:
        assert response.status_code == 200, response.text
        assert next(line for line in response.iter_lines(decode_unicode=True) if line.startswith("data:"))
    wait_until(lambda: metric_values(base_url).get(aborts, 0) == before.get(aborts, 0) + 1, timeout=15, interval=0.5, what="the abort")
    assert metric_values(base_url)[tokens] - before.get(tokens, 0) < 240


def _engine_host_allocator(pid: int) -> str | None:
    """The tcmalloc the engine's host among `pid`'s descendants has mapped, or None: the one
    ingress replica, with no LLMServer replica beside it."""
    processes = psutil.Process(pid).children(recursive=True)
    assert not [p for p in processes if "LLMServer" in " ".join(p.cmdline())]
    replicas = [p for p in processes if "OpenAIIngress" in " ".join(p.cmdline())]
    assert len(replicas) == 1, [p.cmdline() for p in processes]
    paths = {m.path for m in replicas[0].memory_maps() if "tcmalloc" in os.path.basename(m.path)}
    assert len(paths) <= 1, paths
    return os.path.realpath(paths.pop()) if paths else None


def _served_niceness(pid: int) -> set[int]:
    """The niceness of the Serve replicas among `pid`'s descendants and of the processes they
    started: the engine's core process among them."""
    replicas = [p for p in psutil.Process(pid).children(recursive=True) if "ServeReplica" in " ".join(p.cmdline())]
    served = replicas + [child for replica in replicas for child in replica.children(recursive=True)]
    assert any("pagedserve.engine.core.proc" in " ".join(p.cmdline()) for p in served), [p.cmdline() for p in served]
    return {p.nice() for p in served}


def _healthy(port: int) -> bool:
    try:
        return requests.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    except requests.RequestException:
        return False


def _tail(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-4000:]
