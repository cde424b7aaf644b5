"""float32 linear layers: MKL (`F.linear` on the plain weight, the engine's float32 path before
it packed float32), oneDNN's GEMM on the weight packed at load, and pagedserve's native AVX2 GEMM
(csrc/cpu_fp32_gemm.cpp, which cpu_gemm picks on CPUs without AVX-512), on the shapes of a
model's layers (every linear of every decoder layer, then the LM head), and the whole eager
forward of a decode step with each.

Each figure is the median wall time of `--repeats` passes over all the layers, so the weights come
from memory as in a real step. Run it on a quiet machine.

    python benchmarks/cpu_fp32_linear.py --model /work/smollm2-hf \\
        --output benchmarks/results/cpu_fp32_linear.json
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cpu_forward import build, decode_forward, layer_bench_args, linear_layers  # noqa: E402
import common  # noqa: E402

from pagedserve.kernels import native_build  # noqa: E402
from pagedserve.workers.layers import cpu_gemm  # noqa: E402

GEMMS = ("onednn", "native")


def build_plain(folder: Path):
    """The model with its float32 layers left on F.linear (MKL), as before float32 was packed."""
    can_pack = cpu_gemm.can_pack
    cpu_gemm.can_pack = lambda weight: False
    try:
        return build(folder, torch.float32, 4096)
    finally:
        cpu_gemm.can_pack = can_pack


def build_packed(folder: Path, gemm: str):
    """The model as the engine loads it, with its float32 layers on `gemm` ("onednn" or "native")."""
    chosen = list(cpu_gemm._fp32_gemm)
    cpu_gemm._fp32_gemm[:] = [gemm]
    try:
        return build(folder, torch.float32, 4096)
    finally:
        cpu_gemm._fp32_gemm[:] = chosen


def packed_for(weight: torch.Tensor, gemm: str):
    if gemm == "native":
        return cpu_gemm.NativeWeight(torch.ops.pagedserve_cpu.fp32_gemm_pack(weight), weight.shape[0])
    return cpu_gemm.pack_onednn(weight)


def layer_pass(layers: list, rows: int, packed: dict | None) -> Callable[[], None]:
    """Every layer once on `rows` random rows: through its packed weight (`packed`, by layer) or
    through F.linear on its plain weight."""
    xs = [torch.randn(rows, m.weight.shape[1]) for m in layers]

    def run() -> None:
        for m, x in zip(layers, xs):
            if packed is None:
                F.linear(x, m.weight)
            else:
                cpu_gemm.linear(x, packed[m], None)

    return run


def paths_report(run_for: Callable[[str], Callable[[], object]], repeats: int) -> dict:
    """Each path's median time, the paths taking turns within every repeat so that the machine's
    drifts fall on all of them alike; speed-ups against MKL and, for the native GEMM, oneDNN."""
    runs = {name: run_for(name) for name in ("mkl", *GEMMS)}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            times[name].append(common.median_ms(run, 1))
    ms = {name: statistics.median(values) for name, values in times.items()}
    return {
        **{f"{name}_ms": round(value, 3) for name, value in ms.items()},
        "speedup": round(ms["mkl"] / ms["onednn"], 2),
        "native_over_onednn": round(ms["onednn"] / ms["native"], 2),
    }


@torch.inference_mode()
def main() -> None:
    args = layer_bench_args(__doc__, rows="1,8,64,256,1024", repeats=5)
    if not torch.backends.mkldnn.is_available():
        sys.exit("this torch build has no oneDNN")
    if not (native_build.load() and torch.ops.pagedserve_cpu.fp32_gemm_built()):
        sys.exit("the native kernels did not build with AVX2 and FMA here")
    models = {"mkl": build_plain(Path(args.model)), **{gemm: build_packed(Path(args.model), gemm) for gemm in GEMMS}}
    layers = linear_layers(models["mkl"])
    packed = {gemm: {m: packed_for(m.weight, gemm) for m in layers} for gemm in GEMMS}
    report: dict = {"model": args.model, "weights_mb": round(sum(m.weight.nbytes for m in layers) / 1e6, 1), "layers": {}, "decode_forward": {}}
    for threads in map(int, args.threads.split(",")):
        torch.set_num_threads(threads)
        for rows in map(int, args.rows.split(",")):
            key = f"{threads}_threads_{rows}_rows"
            report["layers"][key] = paths_report(lambda gemm: layer_pass(layers, rows, packed.get(gemm)), args.repeats)
            print(f"[{key}] layers {report['layers'][key]}", file=sys.stderr, flush=True)
        for rows in (r for r in map(int, args.rows.split(",")) if r <= 256):  # decode rows
            key = f"{threads}_threads_{rows}_rows"
            report["decode_forward"][key] = paths_report(lambda gemm: decode_forward(models[gemm], rows, torch.float32), args.repeats)
            print(f"[{key}] decode forward {report['decode_forward'][key]}", file=sys.stderr, flush=True)
    common.write_report(report, args.output, indent=1)


if __name__ == "__main__":
    main()
