"""The scheduler under load, in process: `vllm bench serve`'s random workload (128-token prompts,
64 tokens out, ignore_eos, temperature 1) replayed against an LLMEngine with no server around it,
at several request rates and scheduler settings, one run.

Per rate and setting: output throughput, TTFT and ITL percentiles (from the engine's own output
times), and what the steps held: decodes and prefill tokens per step, the step time, preemptions.
It separates what the scheduler does at saturation from what the Serve path costs.

    python benchmarks/scheduler_saturation.py --model /work/smollm2-hf --num-prompts 40 --request-rates inf,4 --kv-cache-gib 1
    python benchmarks/scheduler_saturation.py --model /work/smollm2-hf --settings 2048x256,512x256 ...
    python benchmarks/scheduler_saturation.py --model /work/smollm2-hf --settings 2048x128x0,2048x128x1 ...  # KV reservation
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--request-rates", default="inf,4")
    parser.add_argument(
        "--settings", default="default", help="comma list of BUDGETxMAX_NUM_SEQS[xSCHEDULE_CONSERVATIVENESS], or 'default'"
    )
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path)
    return parser.parse_args()


def arrival_offsets(num: int, rate: float, rng: random.Random) -> list[float]:
    """Seconds after the start, Poisson arrivals at `rate` (all at once when it is inf)."""
    if rate == float("inf"):
        return [0.0] * num
    offsets, now = [], 0.0
    for _ in range(num):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


def run_rate(engine, prompts: list[list[int]], rate: float, args: argparse.Namespace) -> dict:
    from pagedserve import SamplingParams
    from pagedserve.sampling_params import RequestOutputKind

    params = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    offsets = arrival_offsets(len(prompts), rate, random.Random(args.seed))
    steps: list[tuple[int, int, float]] = []  # decodes, prefill tokens, seconds
    original_schedule = engine.engine_core.engine_core.scheduler.schedule

    def schedule():
        output = original_schedule()
        counts = output.num_scheduled_tokens.values()
        steps.append((sum(1 for n in counts if n == 1), sum(n for n in counts if n > 1), 0.0))
        return output

    engine.engine_core.engine_core.scheduler.schedule = schedule
    preemptions_before = engine.engine_core.engine_core.scheduler.num_preemptions_total
    token_times: dict[str, list[float]] = {}
    arrivals: dict[str, float] = {}
    start = time.monotonic()
    next_index = 0
    try:
        while next_index < len(prompts) or engine.has_unfinished_requests():
            now = time.monotonic() - start
            while next_index < len(prompts) and offsets[next_index] <= now:
                req_id = f"{rate}-{next_index}"
                arrivals[req_id] = start + offsets[next_index]
                engine.add_request(req_id, {"prompt_token_ids": prompts[next_index]}, params, arrival_time=arrivals[req_id])
                next_index += 1
            if not engine.has_unfinished_requests():
                time.sleep(max(offsets[next_index] - now, 0.0))
                continue
            step_start = time.monotonic()
            outputs = engine.step()
            done = time.monotonic()
            steps[-1] = (*steps[-1][:2], done - step_start)
            for output in outputs:
                new = len(output.outputs[0].token_ids) if output.outputs else 0
                token_times.setdefault(output.request_id, []).extend([done] * new)
    finally:
        engine.engine_core.engine_core.scheduler.schedule = original_schedule
    duration = time.monotonic() - start
    ttft = [times[0] - arrivals[req_id] for req_id, times in token_times.items()]
    itl = [b - a for times in token_times.values() for a, b in zip(times, times[1:])]
    num_output = sum(len(times) for times in token_times.values())
    busy = [s for s in steps if s[0] or s[1]]
    return {
        "duration_s": round(duration, 2),
        "output_tokens_per_s": round(num_output / duration, 1),
        "median_ttft_ms": round(statistics.median(ttft) * 1e3, 1),
        "p99_ttft_ms": round(common.percentile(ttft, 99) * 1e3, 1),
        "median_itl_ms": round(statistics.median(itl) * 1e3, 1),
        "p99_itl_ms": round(common.percentile(itl, 99) * 1e3, 1),
        "num_steps": len(busy),
        "mean_decodes_per_step": round(statistics.mean(s[0] for s in busy), 1),
        "mean_prefill_tokens_per_step": round(statistics.mean(s[1] for s in busy), 1),
        "median_step_ms": round(statistics.median(s[2] for s in busy) * 1e3, 1),
        "mixed_steps": sum(1 for s in busy if s[0] and s[1]),
        "num_preemptions": engine.engine_core.engine_core.scheduler.num_preemptions_total - preemptions_before,
    }


def main() -> None:
    args = parse_args()
    from pagedserve import LLM

    rng = random.Random(args.seed)
    prompts = [[rng.randint(100, 20000) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    report: dict = {"workload": {k: str(v) for k, v in vars(args).items() if k != "output"}, "runs": {}}
    for setting in args.settings.split(","):
        overrides = {}
        if setting != "default":
            budget, max_seqs, *conservativeness = setting.split("x")
            overrides = {"max_num_batched_tokens": int(budget), "max_num_seqs": int(max_seqs)}
            if conservativeness:
                overrides["schedule_conservativeness"] = float(conservativeness[0])
        llm = LLM(
            args.model, dtype=args.dtype, max_model_len=args.max_model_len, kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30), **overrides
        )
        engine = llm.llm_engine
        scheduler = engine.engine_core.engine_core.scheduler
        conservativeness = scheduler.reservation.conservativeness if scheduler.reservation else 0
        name = f"{scheduler.max_num_batched_tokens}x{scheduler.max_num_seqs}x{conservativeness:g}"
        name += f"#{sum(1 for n in report['runs'] if n.split('#')[0] == name) + 1}"  # a setting given twice keeps both runs
        llm.generate([{"prompt_token_ids": prompts[0]}], use_tqdm=False)  # warm-up
        report["runs"][name] = {}
        for rate in args.request_rates.split(","):
            report["runs"][name][rate] = run_rate(engine, prompts, float(rate), args)
            print(json.dumps({name: {rate: report["runs"][name][rate]}}), flush=True)
        llm.shutdown()
    common.write_report(report, args.output)


if __name__ == "__main__":
    main()
