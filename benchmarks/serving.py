"""Online serving benchmark: a load generator for any OpenAI-compatible endpoint, and the same load
on an in-process `AsyncLLM` as the baseline (like vLLM's benchmark_serving with random prompts).

Requests stream `/v1/completions` with random prompts (token ids by default) of random lengths and
random output lengths (`ignore_eos`, so every request produces exactly `max_tokens`). They arrive
as a Poisson process at `--request-rate` (`inf`: all at once), optionally capped at
`--max-concurrency` requests in flight. The JSON reports throughput and the mean, p50, p90 and p99
of TTFT, TPOT, ITL and end-to-end latency (ms); definitions are in serving_metrics.py.

    # one rate against a running server (`pagedserve serve --model tiny --served-model-name demo` on port 8000)
    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --request-rate 4 --num-prompts 64
    # a fixed concurrency instead of a rate
    python benchmarks/serving.py --request-rate inf --max-concurrency 8 --num-prompts 64
    # a sweep: every rate's result in the JSON, latency percentiles against rate in a PNG
    python benchmarks/serving.py --request-rates 1,2,4,inf --plot serving.png --output serving.json
    # the engine alone, in this process
    python benchmarks/serving.py --backend inprocess --model-path tiny --max-model-len 512
    # the Serve path's overhead: in-process first, then the server, same prompts and arrivals
    python benchmarks/serving.py --compare --model-path tiny --base-url http://127.0.0.1:8000 \\
        --request-rates 2,8,inf --num-prompts 64

Against a long-running server, give each run its own `--seed`: a server that already saw the same
prompts answers them from its prefix cache, and TTFT looks better than it is.

Engine arguments for the in-process backend are EngineConfig's fields as flags (`--max-model-len`,
`--dtype`, `--tensor-parallel-size`, ...): give it the ones the server was started with.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from serving_backends import HttpBackend, InProcessBackend, RequestSpec  # noqa: E402
from serving_metrics import RequestResult, compare, plot_sweep, summarize  # noqa: E402

# Short common words: most are one token in any BPE vocabulary, so a text prompt of N words is
# roughly N tokens. The exact count comes back from the server's usage (or the engine).
WORDS = "the of and to in is it you that he was for on are as with his they at be this have from".split()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("http", "inprocess"), default="http")
    parser.add_argument("--compare", action="store_true", help="run inprocess, then http, and compare")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", help="model name sent to the server (default: its first in /v1/models)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    parser.add_argument("--model-path", default="tiny", help="checkpoint folder, .gguf file, 'tiny' or 'demo' (inprocess)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=math.inf, help="req/s of a Poisson process; inf: all at once")
    parser.add_argument("--request-rates", help="comma-separated rates to sweep, e.g. 1,2,4,inf")
    parser.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    parser.add_argument("--input-len", type=_length_range, default=(32, 256), help="prompt tokens: N or MIN:MAX")
    parser.add_argument("--output-len", type=_length_range, default=(16, 128), help="output tokens: N or MIN:MAX")
    parser.add_argument("--prompt-format", choices=("ids", "text"), default="ids")
    parser.add_argument("--token-id-range", type=_length_range, default=(10, 250), help="MIN:MAX of random prompt ids")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--num-warmups", type=int, default=1, help="requests sent before measuring")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=Path, help="PNG of latency percentiles against rate (default with a sweep: serving_latency.png)")
    parser.add_argument("--output", type=Path, help="also write the JSON here")
    _add_engine_arguments(parser)
    args = parser.parse_args(argv)
    args.engine_args = _engine_args(args)
    args.rates = _parse_rates(args.request_rates) if args.request_rates else [args.request_rate]
    if args.plot is None and len(args.rates) > 1:
        args.plot = Path("serving_latency.png")
    return args


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    from pagedserve.cli_args import add_model_arguments
    from pagedserve.config import EngineConfig

    # `model` is --model-path here (--model names the served model); `seed` is the workload's.
    add_model_arguments(parser, EngineConfig, skip=("model", "seed"))


def _engine_args(args: argparse.Namespace) -> dict:
    from pagedserve.cli_args import given_fields
    from pagedserve.config import EngineConfig

    # --model and --seed share their names with EngineConfig fields but mean other things here.
    fields = given_fields(args, EngineConfig)
    return {name: value for name, value in fields.items() if name not in ("model", "seed")}


def _length_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    bounds = (int(low), int(high or low))
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: want N or MIN:MAX with 1 <= MIN <= MAX")
    return bounds


def _parse_rates(text: str) -> list[float]:
    rates = [float(part) for part in text.split(",") if part.strip()]
    if not rates or any(rate <= 0 for rate in rates):
        raise SystemExit(f"--request-rates {text!r}: want positive rates or inf, comma-separated")
    return rates


def build_requests(args: argparse.Namespace, run_name: str, num_requests: int | None = None) -> list[RequestSpec]:
    """The requests of one run, fixed by the seed and the run's name: every backend gets the same
    ones at a given rate, but each rate gets fresh prompts, or the prefix cache would serve the
    second rate's prompts from the first rate's blocks."""
    rng = random.Random(f"{args.seed}-{run_name}")  # str seeds are hashed the same on every run
    specs = []
    for _ in range(args.num_prompts if num_requests is None else num_requests):
        prompt_len = rng.randint(*args.input_len)
        output_len = rng.randint(*args.output_len)
        if args.prompt_format == "ids":
            prompt: str | list[int] = [rng.randint(*args.token_id_range) for _ in range(prompt_len)]
        else:
            prompt = " ".join(rng.choice(WORDS) for _ in range(prompt_len))
        specs.append(RequestSpec(prompt, prompt_len, output_len))
    return specs


def arrival_offsets(num_requests: int, rate: float, seed: int) -> list[float]:
    """Send times (s from the start) of a Poisson process: exponential gaps with mean 1/rate."""
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed + 1)  # its own stream: the schedule does not depend on the prompts
    offsets, now = [], 0.0
    for _ in range(num_requests):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


async def run_load(backend, specs: list[RequestSpec], rate: float, args: argparse.Namespace, tag: str) -> dict:
    """Send every request on schedule, wait for all, and summarize the run."""
    offsets = arrival_offsets(len(specs), rate, args.seed)
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    start = time.perf_counter()

    async def one(index: int, spec: RequestSpec) -> RequestResult:
        await asyncio.sleep(max(0.0, start + offsets[index] - time.perf_counter()))
        if limit is None:
            return await backend.send(spec, f"{tag}-{index}")
        async with limit:
            return await backend.send(spec, f"{tag}-{index}")

    results = await asyncio.gather(*(one(i, spec) for i, spec in enumerate(specs)))
    summary = summarize(list(results), time.perf_counter() - start)
    return {"backend": backend.name, "request_rate": _json_rate(rate), "max_concurrency": args.max_concurrency, **summary}


async def run_backend(backend, args: argparse.Namespace) -> list[dict]:
    """Every rate of the sweep on one backend, after warmup requests that are not measured."""
    async with backend:
        for index, spec in enumerate(build_requests(args, "warmup", args.num_warmups)):
            await backend.send(RequestSpec(spec.prompt, spec.prompt_len, 4), f"warmup-{index}")
        summaries = []
        for index, rate in enumerate(args.rates):
            specs = build_requests(args, f"rate-{index}")
            print(f"[{backend.name}] rate {_json_rate(rate)}: {len(specs)} requests", file=sys.stderr)
            summaries.append(await run_load(backend, specs, rate, args, f"bench-{index}"))
        return summaries


def make_backend(kind: str, args: argparse.Namespace):
    if kind == "inprocess":
        return InProcessBackend(args.model_path, args.engine_args, args.temperature)
    return HttpBackend(args.base_url, args.model, args.api_key, args.temperature, args.request_timeout, args.max_concurrency)


def run(args: argparse.Namespace) -> dict:
    """The whole benchmark: the report as a dict (also what `main` prints)."""
    # In-process first, and shut down before the HTTP run: on a shared machine the idle engine
    # would otherwise hold memory while the server is measured.
    kinds = ["inprocess", "http"] if args.compare else [args.backend]
    runs = {kind: asyncio.run(run_backend(make_backend(kind, args), args)) for kind in kinds}
    report = {"config": _describe_config(args), "results": runs}
    if args.compare:
        pairs = zip(runs["inprocess"], runs["http"])
        report["comparison"] = [{"request_rate": ip["request_rate"], **compare(ip, http)} for ip, http in pairs]
    if args.plot is not None:
        report["plot"] = str(plot_sweep(runs, args.plot))
    return report


def _json_rate(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate  # JSON has no infinity


def _describe_config(args: argparse.Namespace) -> dict:
    config = {
        "num_prompts": args.num_prompts,
        "request_rates": [_json_rate(rate) for rate in args.rates],
        "max_concurrency": args.max_concurrency,
        "input_len": list(args.input_len),
        "output_len": list(args.output_len),
        "prompt_format": args.prompt_format,
        "seed": args.seed,
    }
    if args.compare or args.backend == "http":
        config["base_url"] = args.base_url
    if args.compare or args.backend == "inprocess":
        config.update(model_path=args.model_path, engine_args=args.engine_args, device=_device_name(args.engine_args))
    return config


def _device_name(engine_args: dict) -> str:
    """The in-process engine's device; GPU runs must say which GPU (DESIGN.md, Performance)."""
    import torch

    from pagedserve.config import EngineConfig
    from pagedserve.executor.uniproc_executor import UniProcExecutor

    is_cuda = UniProcExecutor.resolve_device(EngineConfig.model_construct(device=engine_args.get("device", "auto"))) == "cuda"
    return torch.cuda.get_device_name(0) if is_cuda else "cpu"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = run(args)
    common.write_report(report, args.output, argv)


if __name__ == "__main__":
    main()
