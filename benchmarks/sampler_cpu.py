"""The sampler's cost per decode step on the CPU: truncation from each row's top candidates
(workers/truncation.py) against the full sort of every row, on real logits; and the greedy
argmax of bf16 logits (`sampler.argmax_rows`, the native kernel in the logits' dtype) against
torch's float32 copy and argmax, which the sampler ran before.

The logits are SmolLM2's (Hugging Face, float32) at every position of a few natural texts, so the
nuclei have the sizes a served model's have. Each batch size draws its rows from them; both ways
run on the same rows, in the same process, alternating, and must pick the same tokens at the same
uniforms. Settings: the model's generation config (temperature 0.2, top_p 0.9, what `vllm bench
serve` gets from both servers when it sends no temperature), and temperature 1.0 with top_p 0.9
(wider nuclei, more rows go to the sort).

    python benchmarks/sampler_cpu.py --model /work/smollm2-hf --output benchmarks/results/sampler_cpu.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import least_ms, write_report  # noqa: E402

from pagedserve.workers.sampler import argmax_rows  # noqa: E402
from pagedserve.workers.truncation import _draw_from_candidates, sample_by_sort, sample_truncated  # noqa: E402

TEXTS = [
    "The history of the Roman Empire spans more than a thousand years, from the founding of the city to the fall of",
    "To install the package, open a terminal and run the following command. If you see an error about permissions,",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\nprint(",
    "Photosynthesis is the process by which green plants use sunlight to turn water and carbon dioxide into",
    "User: What should I pack for a week of hiking in the mountains?\nAssistant: Here is a list you can start from:",
]
SETTINGS = {"generation_config": (0.2, 0.9), "temperature_1": (1.0, 0.9)}


def real_logits(model_path: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for text in TEXTS:
            ids = tokenizer(text, return_tensors="pt").input_ids
            rows.append(model(ids).logits[0])
    return torch.cat(rows)


def by_sort(scaled: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    return sample_by_sort(scaled, None, top_p, None, uniforms)


def measure(pool: torch.Tensor, rows: int, temperature: float, top_p: float, repeats: int) -> dict:
    generator = torch.Generator().manual_seed(rows)
    picks = torch.randint(len(pool), (rows,), generator=generator)
    scaled = pool[picks] / temperature
    p = torch.full((rows,), top_p)
    uniforms = torch.rand(rows, generator=generator, dtype=torch.float64)
    # Wall time: torch's threads run outside this thread's CPU clock.
    same = torch.equal(sample_truncated(scaled, None, p, None, uniforms), by_sort(scaled, p, uniforms))
    settled, _ = _draw_from_candidates(scaled, None, p, None, uniforms)
    sort_ms = least_ms(lambda: by_sort(scaled, p, uniforms), repeats, clock=time.perf_counter)
    candidates_ms = least_ms(lambda: sample_truncated(scaled, None, p, None, uniforms), repeats, clock=time.perf_counter)
    return {"rows": rows, "sort_ms": round(sort_ms, 2), "candidates_ms": round(candidates_ms, 2),
            "speedup": round(sort_ms / candidates_ms, 1), "rows_settled": round(float(settled.float().mean()), 3), "same_tokens": same}


def measure_greedy(pool: torch.Tensor, rows: int, repeats: int) -> dict:
    """bf16 logits (the served model's dtype): the argmax in their dtype against float32 copy and argmax."""
    picks = torch.randint(len(pool), (rows,), generator=torch.Generator().manual_seed(rows))
    logits = pool[picks].to(torch.bfloat16)
    same = torch.equal(argmax_rows(logits), logits.float().argmax(-1))
    torch_ms = least_ms(lambda: logits.float().argmax(-1), repeats, clock=time.perf_counter)
    native_ms = least_ms(lambda: argmax_rows(logits), repeats, clock=time.perf_counter)
    return {"rows": rows, "float_copy_and_argmax_ms": round(torch_ms, 3), "argmax_rows_ms": round(native_ms, 3),
            "speedup": round(torch_ms / native_ms, 1), "same_tokens": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="SmolLM2's Hugging Face folder (python -m pagedserve.demo --hf-folder DIR)")
    parser.add_argument("--rows", default="1,16,64,128,211,256")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the worker's, on a 2-core machine)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pool = real_logits(args.model)
    report = {"model": args.model, "positions": len(pool), "vocab": pool.shape[1], "threads": args.threads, "settings": {}}
    for name, (temperature, top_p) in SETTINGS.items():
        runs = [measure(pool, int(rows), temperature, top_p, args.repeats) for rows in args.rows.split(",")]
        report["settings"][name] = {"temperature": temperature, "top_p": top_p, "runs": runs}
        if not all(run["same_tokens"] for run in runs):
            write_report(report, args.output)
            sys.exit(f"{name}: the candidate path picked other tokens than the sort")
    report["greedy_bf16"] = [measure_greedy(pool, int(rows), args.repeats) for rows in args.rows.split(",")]
    write_report(report, args.output)
    if not all(run["same_tokens"] for run in report["greedy_bf16"]):
        sys.exit("greedy: argmax_rows picked other tokens than torch's argmax")


if __name__ == "__main__":
    main()
