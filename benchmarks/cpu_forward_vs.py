"""The model's eager forward on the CPU, this tree against a baseline commit, at 1 and 2 torch
threads: a decode step of 8, 64, 128 and 256 rows (contexts 128-192) and a prefill chunk of 512
tokens, in half precision, on a checkpoint as a worker loads it (`cpu_forward.build`). What the
native attention kernel, the packed linear layers and the fused layers buy, one step at a time.

Each tree runs in its own process (the baseline `git archive`d), alternately, `--rounds` times;
the figure is the least wall time of `--repeats` calls. Wall time, because a second thread's work
is not this thread's CPU time: run it on a quiet machine.

    python benchmarks/cpu_forward_vs.py --model /work/smollm2-hf --output benchmarks/results/cpu_forward_vs.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DECODE_ROWS = (8, 64, 128, 256)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a Llama-family Hugging Face folder")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--baseline-commit", default="4831c70")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


def worker(args: argparse.Namespace) -> dict[str, float]:
    """In the tree on PYTHONPATH: name -> least wall ms of one forward."""
    import torch

    sys.path.insert(0, str(REPO / "benchmarks"))
    from cpu_forward import build, steps

    torch.set_num_threads(int(args.threads))
    dtype = getattr(torch, args.dtype)
    result = {}
    with torch.inference_mode():
        model = build(Path(args.model), dtype, 4096)
        for rows in DECODE_ROWS:
            shape = argparse.Namespace(num_seqs=rows, min_context=128, max_context=192, prefill_tokens=512)
            batches = steps(model, shape, dtype)
            names = [("decode", f"decode_{rows}")] + ([("prefill", "prefill_512")] if rows == DECODE_ROWS[-1] else [])
            for kind, name in names:
                input_ids, positions, meta, kv_cache = batches[kind]
                for attn in model.attention_layers():
                    attn.kv_cache = kv_cache
                model(input_ids, positions, meta)  # warm-up
                times = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    model(input_ids, positions, meta)
                    times.append(time.perf_counter() - start)
                result[name] = round(min(times) * 1e3, 2)
    return result


def run_tree(tree: Path, threads: int, args: argparse.Namespace) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{REPO}", "OMP_NUM_THREADS": str(threads)}
    command = [sys.executable, __file__, "--worker", "--model", args.model, "--dtype", args.dtype,
               "--threads", str(threads), "--repeats", str(args.repeats)]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{tree}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    args = parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    with tempfile.TemporaryDirectory() as baseline_tree:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", args.baseline_commit, "pagedserve"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", baseline_tree], input=archive.stdout, check=True)
        trees = {"this_tree": REPO, "baseline": Path(baseline_tree)}
        runs: dict[str, dict[str, list[dict[str, float]]]] = {}
        for _ in range(args.rounds):
            for threads in (int(t) for t in args.threads.split(",")):
                for name, tree in trees.items():
                    print(f"[forward] {name}, {threads} thread(s) ...", file=sys.stderr, flush=True)
                    runs.setdefault(f"{threads}_threads", {}).setdefault(name, []).append(run_tree(tree, threads, args))
    report = {"model": args.model, "dtype": args.dtype, "baseline_commit": args.baseline_commit, "ms": {}, "speedup": {}}
    for threads, by_tree in runs.items():
        best = {name: {step: min(r[step] for r in rs) for step in rs[0]} for name, rs in by_tree.items()}
        report["ms"][threads] = best
        report["speedup"][threads] = {step: round(best["baseline"][step] / best["this_tree"][step], 2) for step in best["this_tree"]}
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
