"""The decoder layers' native CPU path (workers/models/native_layers.py) against the module tree
it replaces: one model, one process, the two paths alternating step by step, so the machine's drift falls on both alike. Each step is a decode step
of `--rows` requests (128-192 tokens of context) or, with `--prefill`, one prompt's chunk; both
paths must give the same bits, or the script stops.

cpu_forward.py compares trees, each in its own process; on a small shared VM the difference
between two processes' least times drifted as much as this path's gain, so this one alternates.

    python benchmarks/native_layers.py --model /work/smollm2-hf --dtype bfloat16 --rows 1,4,16 --prefill 128 --output benchmarks/results/native_layers.json

`--epilogues` compares the native path with its fused GEMM epilogues (a float32 layer on the native
GEMM adds its residuals in the GEMM's store and computes the MLP's SiLU-and-multiply inside it)
against the same path with the separate add and SiLU-and-multiply, the same way:

    python benchmarks/native_layers.py --model /work/smollm2-hf --epilogues --rows 1,8,64 --prefill 128

The linear layers are packed as a server packs them on this CPU: float32 on the native GEMM without
AVX-512 and on oneDNN with it (`PAGEDSERVE_FP32_GEMM=native` or `=onednn` forces one), bfloat16 on
oneDNN with the small-batch kernel where the CPU has AVX-512 BF16, widened onto float32 panels where
it has no AVX-512.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import positive_ints, write_report  # noqa: E402
from cpu_forward import bind_caches, build, steps  # noqa: E402

from pagedserve.workers.layers import cpu_gemm  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a Llama-family Hugging Face folder")
    parser.add_argument("--rows", type=positive_ints, default=[1, 4, 16], metavar="N,N,...", help="decode steps' rows")
    parser.add_argument("--prefill", type=positive_ints, default=[128], metavar="N,N,...", help="prefill chunks' tokens")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=60, help="steps per path")
    parser.add_argument("--epilogues", action="store_true", help="the fused GEMM epilogues against the separate ops (float32, native GEMM)")
    parser.add_argument("--output", type=Path)
    return parser.parse_args()


def set_epilogues(plan, on: bool) -> None:
    """The plan's fused epilogues on (as it made them) or off (the separate add and SiLU-and-multiply)."""
    for layer in plan.layers:
        layer.fused_mlp, layer.o.fuses_residual, layer.down.fuses_residual = on, on, on


def compare(model, step: tuple, repeats: int, epilogues: bool = False) -> dict:
    """The native path (first) against the modules, or with `epilogues` against itself without
    them: the two alternating, the same bits asked of both."""
    input_ids, positions, meta, kv_cache = step
    bind_caches([model], kv_cache)
    forward = lambda: model(input_ids, positions, meta)  # noqa: E731
    forward()  # decides the native path
    native = model.model._native_layers
    if not native:
        raise SystemExit("the native path does not take this model (a Llama-family model with packed linear layers needed)")
    if epilogues and not native.layers[0].fused_mlp:
        raise SystemExit("the plan fuses no epilogue here (float32 on the native GEMM, one rank, needed)")
    # name -> (the plan, its epilogues on or off, or None to leave them as they are)
    paths = {"fused": (native, True), "separate": (native, False)} if epilogues else {"native": (native, None), "modules": (False, None)}

    def take(name: str) -> None:
        plan, on = paths[name]
        if on is not None:
            set_epilogues(native, on)
        model.model._native_layers = plan

    outputs = {}
    for name in paths:
        take(name)
        outputs[name] = forward()
    first, second = paths
    if not torch.equal(outputs[first], outputs[second]):
        raise SystemExit(f"the {first} path's hidden states differ from the {second} path's")
    times: dict[str, list[float]] = {name: [] for name in paths}
    for i in range(repeats):
        for name in list(paths)[i % 2 :] + list(paths)[: i % 2]:
            take(name)
            start = time.perf_counter()
            forward()
            times[name].append((time.perf_counter() - start) * 1e3)
    take(first)
    result = {f"{name}_{stat}_ms": round(fn(ts), 2) for name, ts in times.items() for stat, fn in (("median", statistics.median), ("least", min))}
    result["speedup_median"] = round(result[f"{second}_median_ms"] / result[f"{first}_median_ms"], 3)
    # each repeat ran the two back to back: their ratio is the least touched by the machine's drift
    result["speedup_paired_median"] = round(statistics.median(b / a for a, b in zip(times[first], times[second])), 3)
    return result


@torch.inference_mode()
def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    model = build(Path(args.model), dtype, 4096)
    report: dict = {
        "model": args.model, "dtype": args.dtype, "fp32_gemm": cpu_gemm.fp32_gemm(), "small_batch_rows": sorted(cpu_gemm.kernel_rows()),
        "threads": args.threads, "repeats": args.repeats, "epilogues": args.epilogues, "steps": {},
    }  # fmt: skip
    for rows in args.rows:
        shape = argparse.Namespace(num_seqs=rows, min_context=128, max_context=192, prefill_tokens=1)
        report["steps"][f"decode_{rows}"] = compare(model, steps(model, shape, dtype)["decode"], args.repeats, args.epilogues)
        print(f"decode {rows}: {report['steps'][f'decode_{rows}']}", file=sys.stderr, flush=True)
    for tokens in args.prefill:
        shape = argparse.Namespace(num_seqs=1, min_context=128, max_context=192, prefill_tokens=tokens)
        report["steps"][f"prefill_{tokens}"] = compare(model, steps(model, shape, dtype)["prefill"], max(4, args.repeats // 4), args.epilogues)
        print(f"prefill {tokens}: {report['steps'][f'prefill_{tokens}']}", file=sys.stderr, flush=True)
    write_report(report, args.output)


if __name__ == "__main__":
    main()
