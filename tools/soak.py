"""Soak test: mixed load for a long time, then check that nothing leaked.

Clients (`--concurrency` of them) send, for `--duration-s` (default 10 minutes), a random mix of:
non-streaming completions and chat completions, streams read to the end, streams the client
drops after a few chunks (a disconnect: the server must abort the request and free its blocks),
non-streaming requests cancelled before their answer (an abort), and malformed bodies (400s that
must not disturb the others). Every `--sample-interval-s` it records the KV-cache usage, running
and waiting requests (from /metrics) and the RSS of the server's processes (the LLMServer
replica, the ingress, the HTTP proxy, the Serve controller, the metrics hub).

At the end it stops the load, waits for the engine to go idle and exits non-zero if the KV usage
does not return to 0, any request failed in a way it should not (a 5xx, a broken stream, a
timeout), or a process's RSS grew more than `--max-rss-growth-mib` from its first sample after
the warm-up (`--warmup-s`) to the end. The JSON summary goes to stdout and `--output`.

    # start a server on the demo model in this process (Ray + Serve on a free port), soak it
    python tools/soak.py --duration-s 600 --output benchmarks/results/soak_cpu.json
    # an existing server (its process RSS is measured when RAY_ADDRESS reaches its cluster)
    python tools/soak.py --url http://127.0.0.1:8000 --duration-s 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from common import write_report  # noqa: E402

# Serve actor class names (as Ray's state API lists them) -> the name the report uses.
SERVER_PROCESSES = {
    "LLMServer": "llm_server",
    "OpenAIIngress": "ingress",
    "MetricsHub": "metrics_hub",
    "ProxyActor": "proxy",
    "ServeController": "controller",
}
WORDS = "the of and to in is it you that he was for on are as with his they at be this have from".split()
KINDS = ("complete", "chat", "stream", "stream_chat", "disconnect", "abort", "malformed")
WEIGHTS = (3, 2, 3, 2, 2, 2, 1)
# Outcomes that are part of the plan, not failures.
EXPECTED = {"ok", "disconnected", "aborted", "rejected_400"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server's base URL; default: start one in this process")
    parser.add_argument("--model-path", default="demo", help="checkpoint folder or 'demo' (in-process server)")
    parser.add_argument("--model", help="model name sent to the server (default: its first in /v1/models)")
    parser.add_argument("--max-model-len", type=int, default=512, help="of the in-process server")
    parser.add_argument("--num-kv-blocks", type=int, default=32, help="of the in-process server: small, so requests preempt")
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--concurrency", type=int, default=8, help="clients sending requests back to back")
    parser.add_argument("--max-tokens", type=int, default=48, help="the largest max_tokens a request asks for")
    parser.add_argument("--sample-interval-s", type=float, default=10.0)
    parser.add_argument("--warmup-s", type=float, default=60.0, help="RSS growth is measured from the first sample after this")
    parser.add_argument("--max-rss-growth-mib", type=float, default=256.0, help="per process, warm-up to end")
    parser.add_argument("--idle-timeout-s", type=float, default=120.0, help="how long the engine may take to go idle after the load")
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", help="also write the JSON summary here")
    return parser.parse_args(argv)


# ---- one request of each kind --------------------------------------------------------------


class Client:
    """Sends one random request at a time and records how it ended."""

    def __init__(self, session: aiohttp.ClientSession, url: str, model: str, args: argparse.Namespace, rng: random.Random):
        self.session, self.url, self.model, self.args, self.rng = session, url, model, args, rng

    async def run_one(self) -> tuple[str, str]:
        kind = self.rng.choices(KINDS, WEIGHTS)[0]
        try:
            return kind, await getattr(self, f"_{kind}")()
        except asyncio.TimeoutError:
            return kind, "timeout"
        except aiohttp.ClientError as error:
            return kind, f"client_error:{type(error).__name__}"

    def _body(self, chat: bool, stream: bool) -> tuple[str, dict]:
        text = " ".join(self.rng.choices(WORDS, k=self.rng.randint(1, 60)))
        body = {"model": self.model, "max_tokens": self.rng.randint(1, self.args.max_tokens), "stream": stream}
        body["temperature"] = self.rng.choice([0.0, 0.7, 1.0])
        if self.rng.random() < 0.5:
            body["ignore_eos"] = True
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
            return "/v1/chat/completions", body
        body["prompt"] = text
        return "/v1/completions", body

    async def _post(self, path: str, body: dict) -> str:
        async with self.session.post(self.url + path, json=body) as response:
            payload = await response.read()
            return _status_outcome(response.status, payload)

    async def _complete(self) -> str:
        return await self._post(*self._body(chat=False, stream=False))

    async def _chat(self) -> str:
        return await self._post(*self._body(chat=True, stream=False))

    async def _stream(self, chat: bool = False, stop_after: int | None = None) -> str:
        path, body = self._body(chat, stream=True)
        async with self.session.post(self.url + path, json=body) as response:
            if response.status != 200:
                return _status_outcome(response.status, await response.read())
            num_events, is_done = 0, False
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue
                if line.strip() == b"data: [DONE]":
                    is_done = True
                    break
                event = json.loads(line[len(b"data: ") :])
                if "error" in event:
                    return "stream_error"
                num_events += 1
                if stop_after is not None and num_events >= stop_after:
                    response.close()  # drop the connection mid-stream
                    return "disconnected"
            return "ok" if is_done else "stream_truncated"

    async def _stream_chat(self) -> str:
        return await self._stream(chat=True)

    async def _disconnect(self) -> str:
        return await self._stream(chat=self.rng.random() < 0.5, stop_after=self.rng.randint(1, 4))

    async def _abort(self) -> str:
        path, body = self._body(chat=False, stream=False)
        body["max_tokens"], body["ignore_eos"] = self.args.max_tokens, True
        try:
            return await asyncio.wait_for(self._post(path, body), self.rng.uniform(0.05, 0.5))
        except asyncio.TimeoutError:
            return "aborted"  # the connection is closed under the request

    async def _malformed(self) -> str:
        body = self.rng.choice([
            {"model": self.model, "prompt": "x", "max_tokens": -1},
            {"model": self.model, "prompt": "x", "temperature": "hot"},
            {"model": self.model, "messages": "not a list"},
            {"model": self.model, "prompt": [10**12]},
        ])
        return await self._post("/v1/completions", body)


def _status_outcome(status: int, payload: bytes) -> str:
    if status == 200:
        return "ok"
    if status == 400 and b'"error"' in payload:
        return "rejected_400"
    return f"http_{status}"


# ---- the server's state -----------------------------------------------------------------------


GAUGES = ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting")


async def engine_gauges(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """KV usage, running and waiting requests, and preemptions so far, summed over the model's
    replicas (/metrics)."""
    async with session.get(url + "/metrics") as response:
        text = await response.text()
    gauges = dict.fromkeys((*GAUGES, "num_preemptions_total"), 0.0)
    for line in text.splitlines():
        for name in gauges:
            if line.startswith(f"pagedserve:{name}{{"):
                gauges[name] += float(line.rsplit(" ", 1)[1])
    return gauges


def server_pids() -> dict[str, int]:
    """The pids of the Serve processes on this node, by role (empty if Ray is not connected)."""
    import ray

    if not ray.is_initialized():
        return {}
    from ray.util.state import list_actors

    pids = {}
    # This cluster by address: other Ray clusters may run on the same machine.
    address = ray.get_runtime_context().gcs_address
    for actor in list_actors(address=address, filters=[("state", "=", "ALIVE")], limit=1000):
        for class_name, role in SERVER_PROCESSES.items():
            if actor.class_name.endswith(class_name) and actor.pid:
                key = role if role not in pids else f"{role}_{actor.pid}"
                pids[key] = actor.pid
    return pids


def rss_mib(pids: dict[str, int]) -> dict[str, float]:
    import psutil

    sizes = {}
    for role, pid in pids.items():
        try:
            sizes[role] = round(psutil.Process(pid).memory_info().rss / 2**20, 1)
        except psutil.Error:
            sizes[role] = None  # the process is gone (a replaced replica)
    return sizes


# ---- the run ----------------------------------------------------------------------------------


async def soak(url: str, args: argparse.Namespace) -> dict:
    """Runs the load and the sampler; returns the summary (see the module docstring)."""
    pids = server_pids()
    timeout = aiohttp.ClientTimeout(total=args.request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        model = args.model or await _first_model(session, url)
        outcomes: Counter[tuple[str, str]] = Counter()
        samples: list[dict] = []
        start = time.monotonic()
        deadline = start + args.duration_s

        async def client_loop(index: int) -> None:
            client = Client(session, url, model, args, random.Random(args.seed * 1000 + index))
            while time.monotonic() < deadline:
                outcomes[await client.run_one()] += 1

        async def sampler() -> None:
            while True:
                samples.append(await _sample(session, url, pids, start, outcomes))
                if time.monotonic() >= deadline:
                    return
                await asyncio.sleep(min(args.sample_interval_s, max(deadline - time.monotonic(), 0.0)))

        await asyncio.gather(sampler(), *(client_loop(i) for i in range(args.concurrency)))
        idle = await _wait_idle(session, url, args.idle_timeout_s)
        samples.append(await _sample(session, url, pids, start, outcomes))
        health = await session.get(url + "/health")
    return _summary(args, model, outcomes, samples, idle, health.status, time.monotonic() - start)


async def _first_model(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/v1/models") as response:
        return (await response.json())["data"][0]["id"]


async def _sample(session, url: str, pids: dict[str, int], start: float, outcomes: Counter) -> dict:
    gauges = await engine_gauges(session, url)
    return {"t_s": round(time.monotonic() - start, 1), "num_requests": sum(outcomes.values()), **gauges, "rss_mib": rss_mib(pids)}


async def _wait_idle(session, url: str, timeout_s: float) -> dict[str, float]:
    """The gauges once nothing runs or waits and the KV usage is 0, or the last ones seen."""
    deadline = time.monotonic() + timeout_s
    while True:
        gauges = await engine_gauges(session, url)
        if not any(gauges[name] for name in GAUGES) or time.monotonic() > deadline:
            return gauges
        await asyncio.sleep(0.5)


def _summary(args, model: str, outcomes: Counter, samples: list[dict], idle: dict, health: int, elapsed: float) -> dict:
    by_kind: dict[str, dict[str, int]] = {}
    for (kind, outcome), count in sorted(outcomes.items()):
        by_kind.setdefault(kind, {})[outcome] = count
    errors = Counter()
    for (kind, outcome), count in outcomes.items():
        if outcome not in EXPECTED:
            errors[f"{kind}:{outcome}"] += count
    rss_growth = _rss_growth(samples, args.warmup_s)
    failures = []
    if idle["kv_cache_usage_perc"] != 0 or idle["num_requests_running"] or idle["num_requests_waiting"]:
        failures.append(f"the engine did not go idle within {args.idle_timeout_s:g} s: {idle}")
    if errors:
        failures.append(f"unexpected outcomes: {dict(errors)}")
    if health != 200:
        failures.append(f"/health answered {health} after the run")
    for role, growth in rss_growth.items():
        if growth > args.max_rss_growth_mib:
            failures.append(f"{role} RSS grew {growth:.0f} MiB (bound {args.max_rss_growth_mib:g} MiB)")
    if not rss_growth:
        failures.append("no server process RSS was measured (is Ray connected to the server's cluster?)")
    return {
        "benchmark": "soak",
        "machine": _machine(),
        "model": model,
        "config": {k: v for k, v in vars(args).items() if k != "output"},
        "elapsed_s": round(elapsed, 1),
        "num_requests": sum(outcomes.values()),
        "outcomes": dict(Counter(outcome for _, outcome in outcomes.elements())),
        "by_kind": by_kind,
        "errors": dict(errors),
        "kv_cache_usage_after": idle["kv_cache_usage_perc"],
        "peak_kv_cache_usage": max(s["kv_cache_usage_perc"] for s in samples),
        "num_preemptions": samples[-1]["num_preemptions_total"],
        "rss_mib_first": samples[0]["rss_mib"],
        "rss_mib_last": samples[-1]["rss_mib"],
        "rss_growth_after_warmup_mib": rss_growth,
        "max_rss_growth_mib": args.max_rss_growth_mib,
        "samples": samples,
        "failures": failures,
        "passed": not failures,
    }


def _rss_growth(samples: list[dict], warmup_s: float) -> dict[str, float]:
    """Per process: RSS at the end minus RSS at the first sample after the warm-up."""
    after = [s for s in samples if s["t_s"] >= warmup_s] or samples[-1:]
    first, last = after[0]["rss_mib"], samples[-1]["rss_mib"]
    return {role: round(last[role] - first[role], 1) for role in first if first[role] is not None and last.get(role) is not None}


def _machine() -> str:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        name = next(line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration, subprocess.SubprocessError):
        name = platform.processor() or platform.machine()
    return f"{name}, {os.cpu_count()} CPUs, no GPU" if not _has_gpu() else f"{name}, GPU"


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def start_server(model_path: str, engine: dict, app_name: str) -> str:
    """Ray, Serve on a free port and the app on the given model (`engine`: EngineConfig fields),
    in this process; returns its URL. Also used by fuzz_http.py."""
    import ray
    from ray import serve

    from pagedserve.cluster.app import build_app
    from pagedserve.cluster.server_config import ServerConfig

    ray.init(num_cpus=4, include_dashboard=True, log_to_driver=False)  # the dashboard serves list_actors
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(ServerConfig(model=model_path, engine=engine)), name=app_name, route_prefix="/")
    return f"http://127.0.0.1:{port}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    url = args.url
    if url is None:
        engine = {"max_model_len": args.max_model_len, "num_gpu_blocks_override": args.num_kv_blocks}
        url = start_server(args.model_path, engine, "soak")
    elif os.environ.get("RAY_ADDRESS"):
        import ray

        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    summary = asyncio.run(soak(url.rstrip("/"), args))
    write_report(summary, args.output, argv)  # with the commit, the machine and the command line
    for failure in summary["failures"]:
        print(f"soak: FAILED: {failure}", file=sys.stderr)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
