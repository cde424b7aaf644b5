"""The engine's own CPU cost per decode step, this tree against a baseline commit, in one run.

256 requests decode together on the tiny random-weight model (the in-process executor, so the
whole step runs on one thread). Per step, in thread CPU time (robust to a loaded machine):

- `schedule`: Scheduler.schedule;
- `update`: Scheduler.update_from_output;
- `worker_prepare`: the model runner's step minus the forward pass, the logits and the sampler's
  own kernels: applying the step's diffs, building the inputs and the sampling batch, and turning
  the sampled ids into the runner's output;
- `engine_critical_path`: their sum, the issue's "engine CPU on the critical path";
- `detokenize_and_outputs`: the output processor, apart (it leaves the critical path once the
  engine core runs in its own process).

The baseline (`--baseline REV`; by default the merge-base with main, or HEAD~ on main) is `git
archive`d into a temporary folder and measured in its own process (see common.py), so both trees
run the same script here, alternately, `--rounds` times each; medians of all steps.

    python benchmarks/engine_step_cpu.py --baseline HEAD~5 --output benchmarks/results/engine_step_cpu.json
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

PARTS = ("schedule", "update", "worker_prepare", "detokenize_and_outputs")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_baseline_argument(parser)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompt-len", default="64:256", help="MIN:MAX tokens (the prefill before the measured steps)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs of each tree")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # one run, this process
    parser.add_argument("--output", type=Path)
    return parser.parse_args()


def measure_engine_cpu(num_requests: int, steps: int, prompt_len: str = "64:256") -> dict[str, list[float]]:
    """Thread-CPU seconds of each part, per decode step, with `num_requests` running."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.engine.output_processor import OutputProcessor
    try:
        from pagedserve.engine.core.scheduler import Scheduler
    except ImportError:  # a baseline tree from before the engine/core split
        from pagedserve.engine.scheduler import Scheduler
    from pagedserve.workers.model_runner import ModelRunner
    from pagedserve.workers.sampler import Sampler

    samples: dict[str, list[float]] = {name: [] for name in (*PARTS, "runner_step", "model_and_sampler")}

    def timed(owner, attribute: str, name: str):
        original = getattr(owner, attribute)

        def wrapper(*args, **kwargs):
            start = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                samples[name].append(time.thread_time() - start)

        setattr(owner, attribute, wrapper)

    # A KV cache that holds every request whole: with the engine's 256 MiB default, admission's
    # reservation for expected outputs lets only part of them run at once.
    llm = LLM("tiny", max_num_seqs=num_requests, max_num_batched_tokens=8192, max_model_len=512, enforce_eager=True, kv_cache_memory_bytes=1 << 30)
    engine = llm.llm_engine
    # The in-process core: behind the core client in this tree, the engine itself in older trees.
    core = engine.engine_core.engine_core if hasattr(engine, "engine_core") else engine
    timed(Scheduler, "schedule", "schedule")
    timed(Scheduler, "update_from_output", "update")
    timed(OutputProcessor, "process_outputs", "detokenize_and_outputs")
    timed(ModelRunner, "execute_model", "runner_step")
    timed(ModelRunner, "_forward", "model_and_sampler")
    timed(Sampler, "__call__", "model_and_sampler")
    timed(core.executor.worker.runner.model, "compute_logits", "model_and_sampler")  # the in-process rank
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 64, ignore_eos=True)
    min_len, max_len = map(int, prompt_len.split(":"))
    for i in range(num_requests):
        prompt = [rng.randint(10, 500) for _ in range(rng.randint(min_len, max_len))]
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    while core.scheduler.waiting or any(r.num_output_tokens == 0 for r in core.scheduler.running):
        engine.step()  # prefill everything first: the figure is for steady decoding
    for values in samples.values():
        values.clear()
    for _ in range(steps):
        assert core.scheduler.num_running == num_requests
        engine.step()
    llm.shutdown()
    # Three timed calls per step make up the model and sampler time (forward, logits, sampler).
    model = [sum(samples["model_and_sampler"][i : i + 3]) for i in range(0, len(samples["model_and_sampler"]), 3)]
    samples["worker_prepare"] = [step - m for step, m in zip(samples.pop("runner_step"), model)]
    samples.pop("model_and_sampler")
    return samples


def run_tree(tree: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    argv = ["--measure", "--num-requests", str(args.num_requests), "--steps", str(args.steps), "--prompt-len", args.prompt_len]
    return common.run_in_tree(tree, __file__, argv, timeout_s=1800)


def summarize(samples: dict[str, list[float]]) -> dict[str, float]:
    ms = {name: round(statistics.median(values) * 1e3, 3) for name, values in samples.items()}
    ms["engine_critical_path"] = round(ms["schedule"] + ms["update"] + ms["worker_prepare"], 3)
    return ms


def main() -> None:
    args = parse_args()
    if args.measure:
        print(json.dumps(measure_engine_cpu(args.num_requests, args.steps, args.prompt_len)))
        return
    with common.baseline_tree(args.baseline) as (baseline_commit, baseline_folder):
        trees = {"baseline": baseline_folder, "this_tree": common.REPO}
        merged: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
        for _ in range(args.rounds):
            for name, path in trees.items():
                for part, values in run_tree(path, args).items():
                    merged[name].setdefault(part, []).extend(values)
    report = {
        "workload": {"running_requests": args.num_requests, "steps": args.steps, "prompt_len": args.prompt_len, "rounds": args.rounds, "model": "tiny (random weights)"},
        "trees": {"baseline": baseline_commit, "this_tree": common.commit_info()["commit"]},
        "median_cpu_ms_per_step": {name: summarize(samples) for name, samples in merged.items()},
    }
    base, new = (report["median_cpu_ms_per_step"][k]["engine_critical_path"] for k in ("baseline", "this_tree"))
    report["critical_path_speedup"] = round(base / new, 2)
    common.write_report(report, args.output)

if __name__ == "__main__":
    main()
