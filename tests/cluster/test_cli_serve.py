"""`pagedserve serve` as a user runs it: a subprocess that starts its own Ray, requires the key
from its key file, answers a chat request, and exits cleanly on SIGTERM."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time

import openai
import pytest
import requests

from tests.cluster.conftest import free_port, wait_until


def test_serve_command_answers_and_stops_on_sigterm(model_dirs, tmp_path):
    port = free_port()
    key = "sk-" + secrets.token_hex(12)
    (tmp_path / "key").write_text(key)
    config = tmp_path / "server.yaml"
    config.write_text(
        f"model: {model_dirs['llama']}\nserved_model_name: cli-llama\napi_key_file: {tmp_path / 'key'}\nengine: {{max_model_len: 128}}\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    command = [sys.executable, "-m", "pagedserve.cli", "serve", "--config", str(config), "--port", str(port), "--max-model-len", "256"]
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
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) == 0, _tail(log)
        assert time.monotonic() - started < 120
        output = _tail(log)
        assert "serving 'cli-llama'" in output and "curl http://127.0.0.1" in output and "pagedserve: stopped" in output
        assert "Bearer $PAGEDSERVE_API_KEY" in output and key not in output
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        log.close()


def _healthy(port: int) -> bool:
    try:
        return requests.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    except requests.RequestException:
        return False


def _tail(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-4000:]
