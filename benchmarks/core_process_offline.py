"""Offline `LLM.generate` throughput with the engine core in this process against the core in
its own process (engine_core_process), same model, prompts and settings, one run, back to back.

    python benchmarks/core_process_offline.py --model /work/smollm2-hf --output benchmarks/results/core_proc_offline.json

Each mode runs `--num-prompts` random-token prompts (`--input-len` MIN:MAX, `--output-len` new
tokens each, greedy, ignore_eos) after a short warm-up; the time covers generate() only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

from pagedserve import LLM, SamplingParams

MODES = {  # name -> engine arguments
    "in_process": {},  # torch's default threads: the process's cores
    "in_process_1_thread": {"num_cpu_threads": 1},
    "core_process_1_thread": {"engine_core_process": True, "num_cpu_threads": 1},
    "core_process_2_threads": {"engine_core_process": True, "num_cpu_threads": 2},
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--input-len", default="32:256", help="MIN:MAX tokens")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--output", type=Path)
    return parser.parse_args()


def run(args: argparse.Namespace, mode: str, prompts: list[list[int]]) -> dict:
    llm = LLM(
        args.model, dtype=args.dtype, max_model_len=1024, kv_cache_memory_bytes=int(args.kv_cache_gib * 1024**3), **MODES[mode]
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
    finally:
        llm.shutdown()
    num_output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"seconds": round(seconds, 2), "output_tokens_per_s": round(num_output_tokens / seconds, 1), "num_output_tokens": num_output_tokens}


def main() -> None:
    args = parse_args()
    low, high = map(int, args.input_len.split(":"))
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(low, high))] for _ in range(args.num_prompts)]
    report = {"model": args.model, "dtype": args.dtype, "num_prompts": args.num_prompts, "input_len": args.input_len,
              "output_len": args.output_len, "cpu_count": os.cpu_count(), "load_before": os.getloadavg()[0], "modes": {}}
    for mode in args.modes.split(","):
        report["modes"][mode] = run(args, mode, prompts)
        print(mode, report["modes"][mode], flush=True)
    report["load_after"] = os.getloadavg()[0]
    first, *_ = report["modes"]
    base = report["modes"][first]["seconds"]
    report[f"speedup_vs_{first}"] = {m: round(base / r["seconds"], 3) for m, r in report["modes"].items()}
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
