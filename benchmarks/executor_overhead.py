"""Per-step executor overhead: Ray workers (TP=1, TP=2) against the in-process executor, one run.

Two figures per executor, both medians over many steps:
- `empty_step_ms`: `execute_model` of a step with no tokens. The workers do nothing, so this is
  the pure cost of reaching every rank and getting the reply back.
- `decode_step_ms`: a whole engine step decoding a small batch (8 requests) on the tiny random-weight model.
  Against in-process, the difference is what Ray costs a real step (TP=2 also splits the matmuls
  and adds two all-reduces per layer, so its difference is not pure overhead).

Every rank runs one torch thread (a Ray CPU worker gets one per CPU of its bundle), and so does
the in-process run here, so the decode figures compare like with like.

    python benchmarks/executor_overhead.py --output benchmarks/results/executor_overhead_cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import time

from pagedserve import LLM, SamplingParams
from pagedserve.step_types.scheduler_output import SchedulerOutput


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--output", help="also write the JSON here")
    return parser.parse_args()


def median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 3)


def measure(engine_args: dict, batch: int, steps: int) -> dict:
    llm = LLM("tiny", max_model_len=1024, **engine_args)
    engine = llm.llm_engine
    try:
        empty = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.engine_core.engine_core.executor.execute_model(SchedulerOutput.empty())
            empty.append(time.perf_counter() - start)
        params = SamplingParams(temperature=0.0, max_tokens=steps + 10, ignore_eos=True)
        for i in range(batch):
            engine.add_request(str(i), {"prompt_token_ids": [10 + i] * 32}, params)
        engine.step()  # the prefills
        decode = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            decode.append(time.perf_counter() - start)
        engine.abort_request([str(i) for i in range(batch)])
    finally:
        llm.shutdown()
    return {"empty_step_ms": median_ms(empty), "decode_step_ms": median_ms(decode)}


def main() -> None:
    args = parse_args()
    import ray
    import torch

    torch.set_num_threads(1)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    results = {
        "in_process": measure({}, args.batch, args.steps),
        "ray_tp1": measure({"distributed_executor_backend": "ray"}, args.batch, args.steps),
        "ray_tp2": measure({"tensor_parallel_size": 2}, args.batch, args.steps),
    }
    base = results["in_process"]
    for name in ("ray_tp1", "ray_tp2"):
        results[name]["added_decode_step_ms"] = round(results[name]["decode_step_ms"] - base["decode_step_ms"], 3)
    report = {"batch": args.batch, "steps": args.steps, "model": "tiny", "results": results}
    ray.shutdown()
    write_report(report, args.output)


def write_report(report: dict, output) -> None:
    """common.write_report (benchmarks/common.py, beside this script): the JSON with its provenance."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import common

    common.write_report(report, output)


if __name__ == "__main__":
    main()
