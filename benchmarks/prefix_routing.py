"""Prefix-aware routing against Serve's default power of two choices, on a local Ray Serve app.

For each replica count and each router, the script deploys the app (pagedserve.cluster.app's
build_app), runs two workloads through the OpenAI chat endpoint, and reads the replicas' own
prefix-cache counters from /metrics:

- shared: `--num-users` users, each bound to one of `--num-system-prompts` long system prompts,
  chat `--num-turns` turns each (every turn resends the conversation so far), all users at once;
- unique: as many single-turn chats with prompts of the same length that share nothing.

Reported per run: the prefix-cache hit rate (hit tokens / prompt tokens looked up), request and
output-token throughput, and TTFT (mean, p50, p90). The KV cache is kept small
(`--num-kv-blocks` per replica) so caches evict, as they do in production. The ratios
(prefix_aware / power_of_two) are what transfer; on 2 cores the latencies mostly measure CPU
contention between replicas.

    python benchmarks/prefix_routing.py --output benchmarks/results/prefix_routing_cpu.json \\
        --plot benchmarks/results/prefix_routing_cpu.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

ROUTERS = ("power_of_two", "prefix_aware")
WORKLOADS = ("shared", "unique")
WORDS = "the of and to in is it you that he was for on are as with his they at be this have from".split()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="'tiny', 'demo' or a checkpoint folder")
    parser.add_argument("--replicas", default="2,4", help="comma-separated replica counts")
    parser.add_argument("--num-users", type=int, default=16)
    parser.add_argument("--num-system-prompts", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=300, help="words of each system prompt (about as many tokens)")
    parser.add_argument("--num-turns", type=int, default=3)
    parser.add_argument("--user-words", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=96, help="KV blocks of 16 tokens per replica")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: shared, unique")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args(argv)
    args.replica_counts = [int(n) for n in args.replicas.split(",")]
    args.workload_names = [name for name in args.workloads.split(",") if name]
    return args


# ---- workloads ---------------------------------------------------------------------------------


def words(rng: random.Random, num: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num))


def shared_conversations(args: argparse.Namespace, rng: random.Random) -> list[tuple[str, list[str]]]:
    """(system prompt, user turns) per user: many users share each long system prompt."""
    systems = [f"System {i}. " + words(rng, args.system_words) for i in range(args.num_system_prompts)]
    return [(systems[u % len(systems)], [words(rng, args.user_words) for _ in range(args.num_turns)]) for u in range(args.num_users)]


def unique_conversations(args: argparse.Namespace, rng: random.Random) -> list[tuple[str, list[str]]]:
    """One-turn chats of the same prompt length that share no prefix beyond the template's first block."""
    num = args.num_users * args.num_turns
    return [(f"{i} " + words(rng, args.system_words), [words(rng, args.user_words)]) for i in range(num)]


async def chat(session, url: str, model: str, messages: list[dict], max_tokens: int) -> tuple[float, str]:
    """Stream one chat completion; (TTFT in s, the reply text)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    start = time.perf_counter()
    ttft, parts = None, []
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:200]}")
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    parts.append(choice["delta"]["content"])
    return (ttft if ttft is not None else time.perf_counter() - start), "".join(parts)


async def run_workload(url: str, model: str, conversations: list[tuple[str, list[str]]], max_tokens: int, concurrency: int) -> dict:
    """Every conversation's turns in order; `concurrency` conversations at once."""
    import aiohttp

    ttfts: list[float] = []
    gate = asyncio.Semaphore(concurrency)

    async def converse(session, system: str, turns: list[str]) -> None:
        async with gate:
            messages = [{"role": "system", "content": system}]
            for turn in turns:
                messages.append({"role": "user", "content": turn})
                ttft, reply = await chat(session, url, model, messages, max_tokens)
                ttfts.append(ttft)
                messages.append({"role": "assistant", "content": reply})

    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()
        await asyncio.gather(*(converse(session, system, turns) for system, turns in conversations))
        duration = time.perf_counter() - start
    values = np.asarray(ttfts) * 1e3
    return {
        "num_requests": len(ttfts),
        "duration_s": round(duration, 3),
        "request_throughput": round(len(ttfts) / duration, 4),
        "output_token_throughput": round(len(ttfts) * max_tokens / duration, 3),
        "ttft_ms": {"mean": round(float(values.mean()), 2), "p50": round(float(np.percentile(values, 50)), 2), "p90": round(float(np.percentile(values, 90)), 2)},
    }


# ---- the app -----------------------------------------------------------------------------------


def prefix_counters(url: str, model: str) -> dict[str, dict[str, float]]:
    """Prefix-cache queries and hits (tokens) per replica, from /metrics."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    counters: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(requests.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            name = sample.name.removeprefix("pagedserve:")
            if name in ("prefix_cache_queries_total", "prefix_cache_hits_total") and sample.labels.get("model_name") == model:
                counters.setdefault(sample.labels["replica"], {})[name] = sample.value
    return counters


def settled_counters(url: str, model: str, num_replicas: int) -> dict[str, dict[str, float]]:
    """The counters once every replica has reported twice without change (the hub is fed every second)."""
    previous = None
    while True:
        time.sleep(2.5)
        current = prefix_counters(url, model)
        if len(current) >= num_replicas and current == previous:
            return current
        previous = current


def hit_rate(before: dict, after: dict) -> dict:
    queries = sum(c.get("prefix_cache_queries_total", 0) for c in after.values()) - sum(c.get("prefix_cache_queries_total", 0) for c in before.values())
    hits = sum(c.get("prefix_cache_hits_total", 0) for c in after.values()) - sum(c.get("prefix_cache_hits_total", 0) for c in before.values())
    per_replica = {r: c.get("prefix_cache_queries_total", 0) - before.get(r, {}).get("prefix_cache_queries_total", 0) for r, c in after.items()}
    return {"prefix_cache_hit_rate": round(hits / max(queries, 1), 4), "prompt_tokens": queries, "hit_tokens": hits, "queries_per_replica": sorted(per_replica.values())}


def deploy(args: argparse.Namespace, router: str, num_replicas: int, name: str) -> None:
    from ray import serve

    from pagedserve.cluster.app import build_app
    from pagedserve.cluster.server_config import ServerConfig

    engine = {"max_model_len": args.max_model_len, "num_gpu_blocks_override": args.num_kv_blocks, "dtype": "float32"}
    deployment = {"num_replicas": num_replicas, "request_router": router, "num_cpus": 1.0}
    config = ServerConfig(model=args.model, served_model_name="bench", engine=engine, deployment=deployment)
    serve.run(build_app(config), name=name, route_prefix=f"/{name}")


def run_one(args: argparse.Namespace, base_url: str, router: str, num_replicas: int) -> dict:
    from ray import serve

    name = f"bench-{router}-{num_replicas}"
    deploy(args, router, num_replicas, name)
    url = f"{base_url}/{name}"
    results = {}
    try:
        # Warm up (the ingress loads its tokenizer, each engine runs its first steps) with short
        # chats that share nothing with the workloads; the counters are read after them.
        warmup = [(f"warm up {i}", ["hello"]) for i in range(4 * num_replicas)]
        asyncio.run(run_workload(url, "bench", warmup, 2, len(warmup)))
        for workload in args.workload_names:
            rng = random.Random(args.seed + (1 if workload == "unique" else 0))
            conversations = shared_conversations(args, rng) if workload == "shared" else unique_conversations(args, rng)
            before = settled_counters(url, "bench", num_replicas)
            load = asyncio.run(run_workload(url, "bench", conversations, args.max_tokens, args.num_users))
            results[workload] = {**load, **hit_rate(before, settled_counters(url, "bench", num_replicas))}
            print(json.dumps({"router": router, "replicas": num_replicas, "workload": workload, **results[workload]}), file=sys.stderr)
    finally:
        serve.delete(name)
    return results


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ratios(runs: dict) -> dict:
    """prefix_aware / power_of_two per replica count and workload (TTFT: lower is better)."""
    out = {}
    for replicas, by_router in runs.items():
        base, ours = by_router["power_of_two"], by_router["prefix_aware"]
        out[replicas] = {
            workload: {
                "hit_rate": round(ours[workload]["prefix_cache_hit_rate"] / max(base[workload]["prefix_cache_hit_rate"], 1e-9), 3),
                "output_token_throughput": round(ours[workload]["output_token_throughput"] / base[workload]["output_token_throughput"], 3),
                "ttft_mean": round(ours[workload]["ttft_ms"]["mean"] / base[workload]["ttft_ms"]["mean"], 3),
            }
            for workload in ours
        }
    return out


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("prefix_cache_hit_rate", "prefix-cache hit rate"), ("output_token_throughput", "output tok/s"), ("ttft_mean", "mean TTFT (ms)")]
    fig, axes = plt.subplots(2, len(panels), figsize=(13, 7), squeeze=False)
    counts = list(report["runs"])
    workloads = list(next(iter(report["runs"].values()))["power_of_two"])
    for row, workload in enumerate(workloads):
        for col, (key, label) in enumerate(panels):
            ax = axes[row][col]
            for i, router in enumerate(ROUTERS):
                values = [_value(report["runs"][n][router][workload], key) for n in counts]
                ax.bar(np.arange(len(counts)) + (i - 0.5) * 0.38, values, 0.38, label=router)
            ax.set_xticks(np.arange(len(counts)), [f"{n} replicas" for n in counts])
            ax.set_title(f"{workload}: {label}")
    axes[0][0].legend()
    fig.suptitle(f"prefix_aware vs power_of_two ({report['config']['machine_name']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _value(result: dict, key: str) -> float:
    return result["ttft_ms"]["mean"] if key == "ttft_mean" else result[key]


def machine_name() -> str:
    return f"{os.cpu_count()} cores of {common.cpu_info()['cpu']}, CPU only"


def main(argv: list[str] | None = None) -> None:
    import ray
    from ray import serve

    args = parse_args(argv)
    ray.init(num_cpus=max(args.replica_counts) + 4, include_dashboard=False, log_to_driver=False, namespace="prefix-routing-bench")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    runs: dict = {}
    try:
        for num_replicas in args.replica_counts:
            runs[num_replicas] = {router: run_one(args, f"http://127.0.0.1:{port}", router, num_replicas) for router in ROUTERS}
    finally:
        serve.shutdown()
        ray.shutdown()
    config = {k: v for k, v in vars(args).items() if k not in ("output", "plot", "replica_counts", "workload_names")}
    report = {"config": {**config, "machine_name": machine_name()}, "ratios": ratios(runs), "runs": runs}
    common.write_report(report, args.output, argv)
    if args.plot:
        plot(report, args.plot)


if __name__ == "__main__":
    main()
