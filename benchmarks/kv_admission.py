"""Offline generation with and without the KV reservation at admission (`schedule_conservativeness`),
in process, the settings taking turns so that the machine's drift falls on each alike.

The workload is compare_vllm.py's offline point (random prompts of 32-256 tokens, exactly 64 greedy
tokens out, ignore_eos) on a cache too small to hold it all at once. Per run: wall time, the
scheduler's preemptions, and the tokens the steps computed against those the requests needed
(each prompt and every output but the last, once): what preemption made the engine recompute.

    python benchmarks/kv_admission.py --model /work/smollm2-hf --dtype float32 --kv-cache-gib 1 --rounds 2
"""

from __future__ import annotations

import argparse
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
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", default="32:256", help="MIN:MAX tokens")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--conservativeness", default="0,1", help="comma list of schedule_conservativeness values")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each value, taking turns")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path)
    return parser.parse_args()


def run_once(args: argparse.Namespace, prompts: list[list[int]], conservativeness: float) -> dict:
    from pagedserve import LLM, SamplingParams

    llm = LLM(
        args.model, dtype=args.dtype, seed=args.seed, kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30),
        schedule_conservativeness=conservativeness,
    )
    try:
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)  # warm-up
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        computed = [0]
        schedule = scheduler.schedule

        def counting_schedule():
            output = schedule()
            computed[0] += output.total_num_scheduled_tokens
            return output

        scheduler.schedule = counting_schedule
        preemptions_before = scheduler.num_preemptions_total
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == args.output_len for o in outputs), "a request stopped short"
        return dict(
            conservativeness=conservativeness,
            seconds=round(seconds, 2),
            preemptions=scheduler.num_preemptions_total - preemptions_before,
            tokens_computed=computed[0],
            num_kv_blocks=scheduler.kv_cache_manager.num_total_blocks,
        )
    finally:
        llm.shutdown()


def summarize(runs: list[dict], values: list[float]) -> list[dict]:
    summary = []
    for value in values:
        mine = [r for r in runs if r["conservativeness"] == value]
        summary.append(
            dict(
                conservativeness=value,
                median_seconds=round(statistics.median(r["seconds"] for r in mine), 2),
                preemptions=[r["preemptions"] for r in mine],
                tokens_computed=[r["tokens_computed"] for r in mine],
            )
        )
    return summary


def main() -> int:
    args = parse_args()
    low, high = common.parse_range(args.input_len)
    prompts = common.random_token_prompts(args.num_prompts, low, high, seed=args.seed)
    values = [float(v) for v in args.conservativeness.split(",")]
    runs = []
    for round_no in range(args.rounds):
        for value in values:
            runs.append(run_once(args, prompts, value))
            print(f"round {round_no}: {runs[-1]}", file=sys.stderr, flush=True)
    needed = sum(len(p) for p in prompts) + len(prompts) * (args.output_len - 1)
    report = dict(
        workload=dict(num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len, tokens_needed=needed),
        dtype=args.dtype,
        kv_cache_gib=args.kv_cache_gib,
        runs=runs,
        summary=summarize(runs, values),
    )
    common.write_report(report, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
