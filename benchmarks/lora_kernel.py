"""The native LoRA kernel (`csrc/cpu_lora.cpp`) on SmolLM2-135M's layer shapes, this tree against a
baseline commit, in one run.

Two tables, bf16 activations, adapters of `--ranks` on every projection (a fused layer's
projections each with their own B^T, as layer_lora.AdapterWeights holds them; a baseline from
before it gets the one block-diagonal B^T it then used):

- `step`: one `lora_add` call for a step's rows spread over four adapters (rows % 4), at
  `--step-rows` rows: what a decode step pays per layer;
- `group` (this tree only): one adapter's group of n rows, the kernel against torch's path
  (`layer_lora.add_low_rank`), at `--group-rows`: the n rows of a step of n (`contiguous`, one
  prefill chunk) and every other row of a step of 2n (`scattered`, prefills of two adapters
  interleaved, which torch gathers and adds back with index_add_). This table is why the kernel
  takes groups of every size (layer_lora.add_lora).

Each figure is the least of `--repeats` timings of 20 calls, in microseconds per call, on
`--threads` torch threads; the step table takes the least over `--rounds` runs of each tree,
alternately. The baseline (`--baseline REV`; by default the merge-base with main,
or HEAD~ on main) runs the same script in its own process (see common.py); its kernel builds
into the kernel cache once, under its own source hash.

    python benchmarks/lora_kernel.py --baseline ef0637a --output benchmarks/results/lora_kernel_cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

if TYPE_CHECKING:
    import torch

# name: (input features, output features of each fused projection)
SHAPES = {"qkv": (576, (576, 192, 192)), "o": (576, (576,)), "gate_up": (576, (1536, 1536)), "down": (1536, (576,))}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_baseline_argument(parser)
    parser.add_argument("--ranks", default="8,16")
    parser.add_argument("--step-rows", default="8,32,64,128")
    parser.add_argument("--group-rows", default="128,512,1024,2048")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs of each tree for the step table (the least of them)")
    parser.add_argument("--measure", choices=("step", "group"), help=argparse.SUPPRESS)  # one table, this process
    parser.add_argument("--output", type=Path)
    return parser.parse_args()


def least_us(fn, repeats: int, calls: int = 20) -> float:
    for _ in range(calls):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return round(best * 1e6, 1)


def adapter(inp: int, outs: tuple[int, ...], rank: int, gen) -> tuple[list[torch.Tensor], Callable]:
    """An adapter of `rank` on each fused projection: the kernel's three arguments for it, and
    torch's path, a function of (out, x)."""
    import torch

    a_t = torch.randn(inp, rank * len(outs), generator=gen) * 0.05
    blocks, column = [], 0
    for width in outs:
        blocks.append((column, torch.randn(rank, width, generator=gen) * 0.05))
        column += width
    try:
        from pagedserve.workers.lora.layer_lora import AdapterWeights, add_low_rank
    except ImportError:  # a baseline tree from before the packed B: one block-diagonal B^T
        from pagedserve.workers.lora.layer_lora import kernel_ranges, low_rank_product

        b_t = torch.zeros(rank * len(outs), column)
        for part, (first, block) in enumerate(blocks):
            b_t[part * rank : (part + 1) * rank, first : first + block.shape[1]] = block
        return [a_t, b_t, kernel_ranges(b_t)], lambda out, x: out.add_(low_rank_product(x, a_t, b_t))
    weights = AdapterWeights.build(a_t, blocks)
    return list(weights.tensors()), lambda out, x, rows=slice(None): add_low_rank(out, rows, x, weights)


def measure(table: str, args: argparse.Namespace) -> dict:
    import torch

    from pagedserve.kernels import cpu_native

    assert cpu_native.is_available(), "the native kernels did not build"
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    lora_add = torch.ops.pagedserve_cpu.lora_add
    result = {}
    for rank in map(int, args.ranks.split(",")):
        for name, (inp, outs) in SHAPES.items():
            made = [adapter(inp, outs, rank, gen) for _ in range(4 if table == "step" else 1)]
            tensors = [list(parts) for parts in zip(*(tensors for tensors, _ in made))]
            for rows in map(int, (args.step_rows if table == "step" else args.group_rows).split(",")):
                key = f"rank_{rank}/{name}/{rows}_rows"
                if table == "step":
                    x, out = step_tensors(rows, inp, sum(outs), gen)
                    slots = torch.arange(rows) % len(made)
                    result[key] = least_us(lambda: lora_add(out, x, slots, *tensors), args.repeats)
                    continue
                result[key] = {}
                for layout, every in (("contiguous", 1), ("scattered", 2)):
                    x, out = step_tensors(every * rows, inp, sum(outs), gen)
                    picked = torch.arange(0, every * rows, every)
                    slots = torch.full((every * rows,), -1).index_fill_(0, picked, 0)
                    torch_rows = slice(None) if every == 1 else picked
                    result[key][f"{layout}_kernel_us"] = least_us(lambda: lora_add(out, x, slots, *tensors), args.repeats, calls=5)
                    result[key][f"{layout}_torch_us"] = least_us(lambda: made[0][1](out, x, torch_rows), args.repeats, calls=5)
    return result


def step_tensors(rows: int, inp: int, width: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    return torch.randn(rows, inp, generator=gen).bfloat16(), torch.randn(rows, width, generator=gen).bfloat16()


def layer_totals(group: dict) -> dict:
    """Each table row's sum over the layer's four projections, per rank and rows."""
    totals: dict = {}
    for key, times in group.items():
        rank, _, rows = key.split("/")
        into = totals.setdefault(f"{rank}/all/{rows}", {})
        for name, us in times.items():
            into[name] = round(into.get(name, 0.0) + us, 1)
    return totals


def run_tree(tree: Path, table: str, args: argparse.Namespace) -> dict:
    argv = ["--measure", table, "--ranks", args.ranks, "--step-rows", args.step_rows, "--group-rows", args.group_rows,
            "--threads", str(args.threads), "--repeats", str(args.repeats)]  # fmt: skip
    return common.run_in_tree(tree, __file__, argv, timeout_s=1800)


def main() -> None:
    args = parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args)))
        return
    baseline: dict[str, float] = {}
    this_tree: dict[str, float] = {}
    with common.baseline_tree(args.baseline) as (baseline_commit, baseline_folder):
        for _ in range(args.rounds):  # alternately: the machine's speed drifts over minutes
            for tree, best in ((baseline_folder, baseline), (common.REPO, this_tree)):
                for key, us in run_tree(tree, "step", args).items():
                    best[key] = min(us, best.get(key, us))
    step = {key: {"baseline_us": baseline[key], "this_tree_us": us, "speedup": round(baseline[key] / us, 2)} for key, us in this_tree.items()}
    report = {
        "workload": {"ranks": args.ranks, "threads": args.threads, "dtype": "bfloat16", "model_shapes": "SmolLM2-135M", "repeats": args.repeats, "rounds": args.rounds},
        "trees": {"baseline": baseline_commit, "this_tree": common.commit_info()["commit"]},
        "step_four_adapters": step,
        "one_adapter_group": (group := run_tree(common.REPO, "group", args)),
        "one_adapter_group_per_layer": layer_totals(group),
    }
    common.write_report(report, args.output, indent=1)


if __name__ == "__main__":
    main()
