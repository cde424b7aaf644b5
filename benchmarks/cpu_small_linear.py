"""bfloat16 linear layers at 1-4 rows (decode at light load): the native small-batch kernel
(`csrc/cpu_small_linear.cpp`, on the plain weight) against oneDNN on its prepacked weight, on the
shapes of a model's layers (every linear of every decoder layer, then the LM head), and the whole
eager forward with the kernel on and off; and the row counts the model runner's start-up timing
(small_batch_choice.py) picks at each thread count, to hold against those measurements.

Each figure is the median wall time of `--repeats` passes over all the layers, so the weights come
from memory as in a real step (the layers together are far larger than the caches). Run it on a
quiet machine: wall time, and a second thread's work is not this thread's CPU time.

    python benchmarks/cpu_small_linear.py --model /work/smollm2-hf \\
        --output benchmarks/results/cpu_small_linear.json
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cpu_forward import build, decode_forward, layer_bench_args, linear_layers  # noqa: E402
import common  # noqa: E402

from pagedserve.workers.layers import cpu_gemm, small_batch_choice  # noqa: E402

median_ms = common.median_ms


def layer_pass(model, rows: int, small: bool) -> Callable[[], None]:
    """Every linear of the model and its LM head once, on `rows` random rows."""
    layers = linear_layers(model)
    xs = [torch.randn(rows, m.weight.shape[1], dtype=torch.bfloat16) for m in layers]

    def run() -> None:
        for m, x in zip(layers, xs):
            cpu_gemm.linear(x, m.packed_weight, None, m.weight if small else None)

    return run


@torch.inference_mode()
def main() -> None:
    args = layer_bench_args(__doc__, rows="1,2,3,4", repeats=9)
    if cpu_gemm.small_batch_rows() == 0:
        sys.exit("the small-batch kernel does not run here (no AVX-512 BF16, or no compiler)")
    model = build(Path(args.model), torch.bfloat16, 4096)
    weight_mb = sum(m.weight.numel() * 2 for m in linear_layers(model)) / 1e6
    report = {"model": args.model, "weights_read_mb": round(weight_mb, 1), "layers": {}, "forward": {}, "start_up_choice": {}}
    every_count = frozenset(range(1, cpu_gemm.small_batch_rows() + 1))
    for threads in map(int, args.threads.split(",")):
        # What a model runner with this many light-step threads would choose at start-up, then
        # the measurements that say whether it chose right.
        report["start_up_choice"][f"{threads}_threads"] = sorted(small_batch_choice.choose_kernel_rows(model, threads))
        cpu_gemm.set_kernel_rows(every_count)
        torch.set_num_threads(threads)
        for rows in map(int, args.rows.split(",")):
            small = median_ms(layer_pass(model, rows, small=True), args.repeats)
            onednn = median_ms(layer_pass(model, rows, small=False), args.repeats)
            forward = decode_forward(model, rows, torch.bfloat16)
            with_kernel = median_ms(forward, args.repeats)
            cpu_gemm.set_kernel_rows(frozenset())  # oneDNN for every batch
            without = median_ms(forward, args.repeats)
            cpu_gemm.set_kernel_rows(every_count)
            key = f"{threads}_threads_{rows}_rows"
            report["layers"][key] = {"small_ms": small, "onednn_ms": onednn, "speedup": round(onednn / small, 2), "small_gb_s": round(weight_mb / small, 1)}
            report["forward"][key] = {"with_ms": with_kernel, "without_ms": without, "speedup": round(without / with_kernel, 2)}
            print(f"[{key}] layers {report['layers'][key]}  forward {report['forward'][key]}", file=sys.stderr, flush=True)
    common.write_report(report, args.output, indent=1)


if __name__ == "__main__":
    main()
