"""The engine core's torch threads bound one to a CPU (`cpu_omp_threads_bind` 'auto', the
default) against unbound ('nobind'), alone and beside a busy neighbour: another process, in a
session of its own, spinning on one core, as a build or a log shipper on the same machine would.

`LLM` with the engine core in its own process (what `pagedserve serve` runs), on every CPU this
process may use. With `--tensor-parallel-size` or `--pipeline-parallel-size` above 1, the model
on Ray worker ranks of one torch thread each (Ray gives a rank one CPU), bound with a CPU list per
rank ('0|1': rank i on the i-th CPU this process may use) against unbound. Per setting and
neighbour: the median time of a prompt with one output token (the prefill), and of the same
prompt with `--decode-tokens` more, whose difference per token is a decode step of one row. Both
settings produce the same tokens (checked).

    python benchmarks/thread_binding_cpu.py --model /work/smollm2-hf --output benchmarks/results/thread_binding_cpu.json
    python benchmarks/thread_binding_cpu.py --model /work/smollm2-hf --pipeline-parallel-size 2 --output ...
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_report  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5, help="requests timed per setting, neighbour and length")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="above 1: Ray worker ranks, one CPU each")
    parser.add_argument("--pipeline-parallel-size", type=int, default=1, help="likewise")
    parser.add_argument("--output", type=Path)
    return parser.parse_args()


def num_ranks(args: argparse.Namespace) -> int:
    return args.tensor_parallel_size * args.pipeline_parallel_size


def neighbour() -> subprocess.Popen:
    """A process spinning on one core, in a session (so a scheduling group) of its own."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)


def timed(llm, prompt: list[int], max_tokens: int, repeats: int) -> tuple[float, list[int]]:
    """Median seconds of `repeats` greedy requests for `prompt`, and the tokens they made."""
    from pagedserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    times, tokens = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        output = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        times.append(time.perf_counter() - start)
        tokens = list(output.outputs[0].token_ids)
    return statistics.median(times), tokens


def measure(args: argparse.Namespace, setting: str, prompt: list[int]) -> tuple[dict, list[int]]:
    from pagedserve import LLM

    threads = len(os.sched_getaffinity(0))
    ranks = {"tensor_parallel_size": args.tensor_parallel_size, "pipeline_parallel_size": args.pipeline_parallel_size}
    where = {"engine_core_process": True, "num_cpu_threads": threads} if num_ranks(args) == 1 else ranks
    llm = LLM(args.model, dtype=args.dtype, cpu_omp_threads_bind=setting, max_model_len=args.prompt_tokens + args.decode_tokens + 16,
              kv_cache_memory_bytes=1 << 28, enable_prefix_caching=False, **where)  # every request computes its whole prompt  # fmt: skip
    try:
        timed(llm, prompt, args.decode_tokens + 1, 2)  # warm-up
        result = {}
        for name in ("alone", "beside_a_busy_neighbour"):
            other = neighbour() if name != "alone" else None
            try:
                time.sleep(0.5 if other else 0)
                prefill, _ = timed(llm, prompt, 1, args.repeats)
                whole, tokens = timed(llm, prompt, args.decode_tokens + 1, args.repeats)
            finally:
                if other:
                    other.kill()
                    other.wait()
            result[name] = {"prefill_ms": round(prefill * 1e3, 1), "decode_step_ms": round((whole - prefill) / args.decode_tokens * 1e3, 2)}
            print(setting, name, result[name], flush=True)
        return result, tokens
    finally:
        llm.shutdown()


def main() -> None:
    args = parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < max(2, num_ranks(args)):
        raise SystemExit("binding needs two CPUs or more, and one a rank: with one, 'auto' binds nothing and both settings are the same")
    bound = "auto" if num_ranks(args) == 1 else "|".join(str(cpu) for cpu in cpus[: num_ranks(args)])
    prompt = [1000 + (i * 7919) % 20000 for i in range(args.prompt_tokens)]
    results, outputs = {}, {}
    for setting in ("nobind", bound):
        results[setting], outputs[setting] = measure(args, setting, prompt)
    if outputs[bound] != outputs["nobind"]:
        raise SystemExit(f"the settings made different tokens: {outputs}")
    report = {
        "workload": {"model": args.model, "dtype": args.dtype, "prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens,
                     "repeats": args.repeats, "threads": len(cpus),
                     "tensor_parallel_size": args.tensor_parallel_size, "pipeline_parallel_size": args.pipeline_parallel_size},  # fmt: skip
        "median": results,
        "unbound_over_bound": {
            name: {key: round(results["nobind"][name][key] / results[bound][name][key], 2) for key in results[bound][name]}
            for name in results[bound]
        },
    }
    write_report(report, args.output)


if __name__ == "__main__":
    main()
