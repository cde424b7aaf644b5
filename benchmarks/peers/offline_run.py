"""One engine's offline run, in its own process: `compare_vllm.py` starts this file once with
pagedserve's interpreter and once with the peer venv's, on the same prompts.

    python offline_run.py --engine pagedserve|pagedserve-compiled|vllm --model PATH --prompts FILE.json --dtype bfloat16

`pagedserve` runs with its defaults (eager on the CPU), `pagedserve-compiled` with `enforce_eager=False`
(torch.compile, workers/compile.py).

FILE.json holds {"prompts": [[token ids], ...], "output_len": N} and optionally "check_prompts"
and "check_len". Prints one JSON line: seconds, requests/s and tokens/s of generating exactly N
tokens per prompt (greedy, ignore_eos), after a short warm-up (which includes any compiling;
`startup_s` reports the start and the warm-up), and "check": the same engine's greedy completions
of the check prompts with their logprobs. It imports only the engine it runs, so either venv can
run it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def run_pagedserve(args: argparse.Namespace, prompts: list[list[int]], output_len: int) -> float:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from throughput import time_generate  # pagedserve's own offline timing, as benchmarks/throughput.py runs it

    kwargs = {"dtype": args.dtype, "seed": 0, "kv_cache_memory_bytes": int(args.kv_cache_gib * 2**30)}
    if args.num_cpu_threads:
        kwargs["num_cpu_threads"] = args.num_cpu_threads
    if args.engine == "pagedserve-compiled":
        kwargs["enforce_eager"] = False
    args.startup_s, seconds = time_generate(args.model, kwargs, prompts, output_len, then=lambda llm: check_outputs(llm, args))
    return seconds


def check_outputs(llm, args: argparse.Namespace) -> None:
    """The output check's greedy completions (`check_prompts`, with each token's logprob), from the
    engine just timed: compare_vllm.py compares them with Hugging Face's (bf16_check.py)."""
    if args.engine == "vllm":
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt as prompt
    else:
        from pagedserve import SamplingParams

        prompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}  # noqa: E731
    params = SamplingParams(temperature=0.0, max_tokens=args.check_len, logprobs=0)
    outputs = llm.generate([prompt(prompt_token_ids=p) for p in args.check_prompts], params, use_tqdm=False)
    args.check = []
    for output in outputs:
        completion = output.outputs[0]
        logprobs = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]
        args.check.append([list(output.prompt_token_ids), list(completion.token_ids), logprobs])


def run_vllm(args: argparse.Namespace, prompts: list[list[int]], output_len: int) -> float:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.generate(requests[:4], params, use_tqdm=False)
    args.startup_s = time.perf_counter() - started
    start = time.perf_counter()
    outputs = llm.generate(requests, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    assert sum(len(o.outputs[0].token_ids) for o in outputs) == len(prompts) * output_len
    check_outputs(llm, args)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("pagedserve", "pagedserve-compiled", "vllm"), required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-gib", type=float, default=4.0)
    parser.add_argument("--num-cpu-threads", type=int, default=0, help="pagedserve only; 0: its default")
    args = parser.parse_args()
    with open(args.prompts) as handle:
        workload = json.load(handle)
    prompts, output_len = workload["prompts"], workload["output_len"]
    args.check_prompts, args.check_len = workload.get("check_prompts", []), workload.get("check_len", 0)
    runner = run_vllm if args.engine == "vllm" else run_pagedserve
    seconds = runner(args, prompts, output_len)
    num_input = sum(map(len, prompts))
    num_output = len(prompts) * output_len
    print(
        "RESULT "
        + json.dumps(
            {
                "seconds": round(seconds, 2),
                "startup_s": round(args.startup_s, 1),
                "requests_per_s": round(len(prompts) / seconds, 3),
                "output_tokens_per_s": round(num_output / seconds, 1),
                "total_tokens_per_s": round((num_input + num_output) / seconds, 1),
                "check": args.check,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":  # vLLM's engine starts worker processes that re-import this module
    main()
