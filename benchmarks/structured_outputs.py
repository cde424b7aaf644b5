"""Structured outputs under load: what a grammar costs pagedserve, and pagedserve against `vllm serve`
on the same constrained workloads, in one run (same machine, model, dtype, prompts and client).

Workloads, all streamed `/v1/chat/completions` at temperature 0:
- `json`: `response_format: json_schema` (strict) over a few schemas, each used by many requests;
- `tools`: three tools with `tool_choice: "required"` (the call is built by a grammar);
- `json_free`: the `json` prompts again without a grammar, each request's `max_tokens` set to the
  length its constrained run produced on the same server, with `ignore_eos`: the same token
  counts, so the difference between `json` and `json_free` is the grammar's cost alone.
Each at every `--request-rates` (inf is saturation). Both servers get compact JSON: pagedserve by
default, vLLM through `--structured-outputs-config '{"disable_any_whitespace": true}'` (its default
allows free whitespace).

Every constrained output is checked (parsed, validated against its schema or tool) and the
counts of invalid ones are reported: a run with invalid outputs has no valid figure.

    bash benchmarks/peers/build_vllm_cpu.sh                              # the peer venv, once
    python benchmarks/structured_outputs.py --model SMOLLM2_HF \\
        --output benchmarks/results/structured_outputs_cpu.json          # about 15 min; a PNG beside it
    python benchmarks/structured_outputs.py --engines pagedserve --request-rates inf   # our side only
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import sys
import time
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "peers"))
sys.path.insert(0, str(HERE))

from common import machine_info, write_report  # noqa: E402
from servers import start_server  # noqa: E402
from serving_metrics import summarize  # noqa: E402
from structured_workloads import SCHEMAS, WORKLOADS, ChatRequest, build_requests, check_output, send_chat  # noqa: E402

VLLM_COMPACT_JSON = ["--structured-outputs-config", json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})]
# vLLM refuses tool_choice "required" without a tool-call parser, though its forced call is plain
# JSON whatever the parser. pagedserve needs no flag for it and, without a parser, forces the same
# plain JSON shape (with one, it would force the parser's format, hermes tags and all).
TOOL_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a Hugging Face folder both engines load (default: the demo's SmolLM2)")
    parser.add_argument("--peer-venv", default=os.environ.get("PEERS_VENV", "/work/peers-venv"))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--engines", default="pagedserve,vllm")
    parser.add_argument("--num-prompts", type=int, default=64, help="per workload and rate")
    parser.add_argument("--request-rates", default="inf,1", help="'' with --engines pagedserve: first use alone")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--pagedserve-args", default="", help="extra flags for `pagedserve serve`")
    parser.add_argument("--output", type=Path, help="write the JSON here (and the PNG beside it)")
    args = parser.parse_args()
    if args.model is None:
        from pagedserve.demo import ensure_demo_model

        args.model = str(ensure_demo_model())
    return args


def engine_env(engine: str, args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("RAY_ADDRESS", None)
    if engine == "vllm":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, int(args.kv_cache_gib)))
        env.pop("PYTHONPATH", None)
    return env


async def run_load(url: str, model: str, requests: list[ChatRequest], rate: float, seed: int) -> tuple[list, float]:
    """Sends `requests` as a Poisson process at `rate` (all at once for inf; one after another,
    each once the last has ended, for 0); their results and the run's wall time."""
    import aiohttp

    rng = random.Random(seed)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=3600)) as session:
        started = time.perf_counter()
        if rate == 0:
            results = [await send_chat(session, url, model, request) for request in requests]
            return results, time.perf_counter() - started
        tasks = []
        for request in requests:
            tasks.append(asyncio.create_task(send_chat(session, url, model, request)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - started


def run_workload(server, name: str, rate: str, args: argparse.Namespace, lengths: list[int] | None) -> tuple[dict, list[int]]:
    seed = zlib.crc32(f"{name.removesuffix('_free')} {rate}".encode())  # json_free: json's prompts
    requests = build_requests(name, args.num_prompts, args.max_tokens, seed, lengths)
    print(f"[{server.engine}] {name} at {rate} req/s ...", file=sys.stderr, flush=True)
    results, duration = asyncio.run(run_load(server.url, server.model_name, requests, float(rate), seed=1))
    summary = summarize([r.timing for r in results], duration)
    if name != "json_free":
        checks = [check_output(request, result) for request, result in zip(requests, results)]
        summary["invalid_outputs"] = sum(1 for c in checks if c)
        summary["invalid_examples"] = [c for c in checks if c][:3]
        summary["truncated_outputs"] = sum(1 for r in results if r.finish_reason == "length")
    return summary, [r.timing.output_tokens for r in results]


def idle_ttft_per_spec(server, seed: int) -> dict[str, float]:
    """Each spec's TTFT (ms) on an otherwise idle server, one request at a time, after one request
    without a grammar (`free`; a fresh server's first request pays for warm-ups of its own). Run
    first it is each spec's first use (its grammar compiles); run again it must come from the
    compile cache (new prompts, so the prefix cache does not help it)."""
    free = build_requests("json_free", 1, 64, seed, lengths=[16])
    requests = [*free, *build_requests("json", len(SCHEMAS), 64, seed), *build_requests("tools", 1, 64, seed)]
    results, _ = asyncio.run(run_load(server.url, server.model_name, requests, 0.0, seed=0))
    keys = ["free", *(request.spec_key for request in requests[1:])]
    return {key: round(result.timing.ttft * 1e3, 1) for key, result in zip(keys, results)}


def run_engine(engine: str, args: argparse.Namespace) -> dict:
    python = sys.executable if engine == "pagedserve" else str(Path(args.peer_venv) / "bin" / "python")
    server_args = argparse.Namespace(**vars(args), vllm_args=shlex.join(VLLM_COMPACT_JSON + TOOL_FLAGS))
    report: dict = {"by_rate": {}}
    with start_server(engine, python, server_args, engine_env(engine, args)) as server:
        report["idle_ttft_ms_first_use"] = idle_ttft_per_spec(server, seed=7)
        report["idle_ttft_ms_cached"] = idle_ttft_per_spec(server, seed=8)
        for rate in filter(None, args.request_rates.split(",")):
            by_workload = {}
            by_workload["json"], lengths = run_workload(server, "json", rate, args, None)
            by_workload["json_free"], _ = run_workload(server, "json_free", rate, args, lengths)
            by_workload["tools"], _ = run_workload(server, "tools", rate, args, None)
            report["by_rate"][rate] = by_workload
    return report


def ratios(report: dict) -> dict:
    out: dict = {"grammar_cost_pagedserve": {}, "pagedserve_over_vllm": {}}
    ours = report["online"].get("pagedserve", {}).get("by_rate", {})
    for rate, runs in ours.items():
        out["grammar_cost_pagedserve"][rate] = {
            "itl_p50_json_over_free": _ratio(runs["json"]["itl_ms"]["p50"], runs["json_free"]["itl_ms"]["p50"]),
            "throughput_json_over_free": _ratio(runs["json"]["output_token_throughput"], runs["json_free"]["output_token_throughput"]),
        }
    theirs = report["online"].get("vllm", {}).get("by_rate", {})
    for rate in set(ours) & set(theirs):
        out["pagedserve_over_vllm"][rate] = {
            workload: {
                "output_throughput": _ratio(ours[rate][workload]["output_token_throughput"], theirs[rate][workload]["output_token_throughput"]),
                "ttft_p50": _ratio(ours[rate][workload]["ttft_ms"]["p50"], theirs[rate][workload]["ttft_ms"]["p50"]),
                "itl_p50": _ratio(ours[rate][workload]["itl_ms"]["p50"], theirs[rate][workload]["itl_ms"]["p50"]),
            }
            for workload in WORKLOADS
        }
    return out


def _ratio(value: float, base: float) -> float | None:
    return round(value / base, 3) if base else None


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("output_token_throughput", "output tok/s"), ("ttft_ms", "TTFT p50 (ms)"), ("itl_ms", "ITL p50 (ms)"))
    rates = report["workload"]["request_rates"].split(",")
    figure, axes = plt.subplots(len(rates), 3, figsize=(14, 3.6 * len(rates)), squeeze=False)
    for row, rate in enumerate(rates):
        for axis, (key, label) in zip(axes[row], panels):
            labels, values, colors = [], [], []
            for engine, color in (("pagedserve", "tab:blue"), ("vllm", "tab:orange")):
                for workload in WORKLOADS:
                    run = report["online"].get(engine, {}).get("by_rate", {}).get(rate, {}).get(workload)
                    if run is not None:
                        labels.append(f"{engine}\n{workload}")
                        values.append(run[key]["p50"] if isinstance(run[key], dict) else run[key])
                        colors.append(color)
            axis.bar(range(len(values)), values, color=colors)
            axis.set_xticks(range(len(values)), labels, fontsize=7)
            axis.set_title(f"{label} at {rate} req/s", fontsize=9)
    figure.suptitle(f"{Path(report['workload']['model']).name}, {report['workload']['dtype']}; {report['machine']['cpu']}")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main() -> None:
    args = parse_args()
    report: dict = {"machine": machine_info(), "workload": {k: str(v) for k, v in vars(args).items() if k != "output"}}
    report["online"] = {engine: run_engine(engine, args) for engine in args.engines.split(",")}
    report["ratios"] = ratios(report)
    write_report(report, args.output)
    if args.output and any(run["by_rate"] for run in report["online"].values()):
        plot(report, args.output.with_suffix(".png"))


if __name__ == "__main__":
    main()
