"""Starting and stopping the two servers `compare_vllm.py` loads."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from typing import Iterator

MODEL_NAME = "model"  # what both servers answer to, so one client command fits both


@dataclass(frozen=True)
class Server:
    engine: str
    url: str
    model_name: str
    pid: int = 0  # the server's process: every process it starts descends from it


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# `--server-defaults`: what a user who reads each server's quick start runs. vLLM's CPU build needs
# a context bound for SmolLM2 (8192 would not fit its KV space) and its KV space from the
# environment (`VLLM_CPU_KVCACHE_SPACE`, set by compare_vllm.engine_env); pagedserve sizes both
# itself.
VLLM_DEFAULTS_MAX_MODEL_LEN = 2048


def server_command(engine: str, python: str, args, port: int) -> list[str]:
    common = ["--port", str(port), "--served-model-name", MODEL_NAME, "--dtype", args.dtype]
    if getattr(args, "server_defaults", False):
        if engine == "pagedserve":
            return [python, "-m", "pagedserve.cli", "serve", "--model", args.model, "--host", "127.0.0.1", *common]
        vllm = os.path.join(os.path.dirname(python), "vllm")
        return [vllm, "serve", args.model, "--host", "127.0.0.1", *common, "--max-model-len", str(VLLM_DEFAULTS_MAX_MODEL_LEN)]
    common += ["--max-model-len", str(args.max_model_len)]
    if engine == "pagedserve":
        command = [python, "-m", "pagedserve.cli", "serve", "--model", args.model, "--host", "127.0.0.1", *common]
        command += ["--kv-cache-memory-bytes", str(int(args.kv_cache_gib * 2**30))]
        return command + shlex.split(args.pagedserve_args)
    command = [os.path.join(os.path.dirname(python), "vllm"), "serve", args.model, "--host", "127.0.0.1", *common]
    return command + shlex.split(getattr(args, "vllm_args", ""))


@contextlib.contextmanager
def start_server(engine: str, python: str, args, env: dict[str, str], timeout_s: float = 900) -> Iterator[Server]:
    """The server running on a free loopback port until the block ends; SIGINT (a graceful stop
    for both servers) then SIGKILL of its process group if it lingers."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix=f"{engine}_server_", suffix=".log", delete=False)
    process = subprocess.Popen(server_command(engine, python, args, port), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, process, log.name, timeout_s)
        yield Server(engine, url, MODEL_NAME, process.pid)
    finally:
        stop(process)
        print(f"[{engine}] server log: {log.name}", file=sys.stderr)


def wait_ready(url: str, process: subprocess.Popen, log_path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}; log {log_path}:\n{open(log_path).read()[-4000:]}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as response:
                if response.status == 200:
                    return
        time.sleep(2)
    raise TimeoutError(f"server at {url} not ready after {timeout_s:.0f} s; log {log_path}")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGINT)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
