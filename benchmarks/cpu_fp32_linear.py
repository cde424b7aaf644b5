"""float32 linear layers: MKL (`F.linear` on the plain weight, the engine's float32 path before
it packed float32) against oneDNN's GEMM on the weight packed at load (cpu_gemm, the path now),
on the shapes of a
model's layers (every linear of every decoder layer, then the LM head), and the whole eager
forward of a decode step with each.

Each figure is the median wall time of `--repeats` passes over all the layers, so the weights come
from memory as in a real step. Run it on a quiet machine.

    python benchmarks/cpu_fp32_linear.py --model /work/smollm2-hf \\
        --output benchmarks/results/cpu_fp32_linear.json
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cpu_forward import build, decode_forward, layer_bench_args, linear_layers  # noqa: E402
import common  # noqa: E402

from pagedserve.workers.layers import cpu_gemm  # noqa: E402


def build_plain(folder: Path):
    """The model with its float32 layers left on F.linear (MKL), as before float32 was packed."""
    can_pack = cpu_gemm.can_pack
    cpu_gemm.can_pack = lambda weight: False
    try:
        return build(folder, torch.float32, 4096)
    finally:
        cpu_gemm.can_pack = can_pack


def layer_pass(layers: list, rows: int, packed: dict | None) -> Callable[[], None]:
    """Every layer once on `rows` random rows: through its packed weight (`packed`, by layer) or
    through F.linear on its plain weight."""
    xs = [torch.randn(rows, m.weight.shape[1]) for m in layers]

    def run() -> None:
        for m, x in zip(layers, xs):
            if packed is None:
                F.linear(x, m.weight)
            else:
                cpu_gemm.onednn_linear(x, packed[m], None)

    return run


@torch.inference_mode()
def main() -> None:
    args = layer_bench_args(__doc__, rows="1,8,64,256,1024", repeats=5)
    if not torch.backends.mkldnn.is_available():
        sys.exit("this torch build has no oneDNN")
    plain_model = build_plain(Path(args.model))
    packed_model = build(Path(args.model), torch.float32, 4096)  # as the engine loads it
    layers = linear_layers(plain_model)
    packed = {m: cpu_gemm.pack(m.weight) for m in layers}
    report: dict = {"model": args.model, "weights_mb": round(sum(m.weight.nbytes for m in layers) / 1e6, 1), "layers": {}, "decode_forward": {}}
    for threads in map(int, args.threads.split(",")):
        torch.set_num_threads(threads)
        for rows in map(int, args.rows.split(",")):
            key = f"{threads}_threads_{rows}_rows"
            mkl = common.median_ms(layer_pass(layers, rows, None), args.repeats)
            onednn = common.median_ms(layer_pass(layers, rows, packed), args.repeats)
            report["layers"][key] = {"mkl_ms": mkl, "onednn_ms": onednn, "speedup": round(mkl / onednn, 2)}
            print(f"[{key}] layers {report['layers'][key]}", file=sys.stderr, flush=True)
        for rows in (r for r in map(int, args.rows.split(",")) if r <= 256):  # decode rows
            key = f"{threads}_threads_{rows}_rows"
            times = {}
            for name, model in (("mkl", plain_model), ("onednn", packed_model)):
                times[f"{name}_ms"] = common.median_ms(decode_forward(model, rows, torch.float32), args.repeats)
            report["decode_forward"][key] = {**times, "speedup": round(times["mkl_ms"] / times["onednn_ms"], 2)}
            print(f"[{key}] decode forward {report['decode_forward'][key]}", file=sys.stderr, flush=True)
    common.write_report(report, args.output, indent=1)


if __name__ == "__main__":
    main()
