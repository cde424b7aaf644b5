"""The model's whole forward pass on the CPU, as a worker loads it (real weights; the `cpu`
attention backend in half precision, the reference in float32, as `auto` picks), each layer with
its own copy of one random paged cache, as a worker binds them (`bind_caches`).

Run as a script: this tree against a baseline commit, at 1 and 2 torch threads: a decode step of
8, 64, 128 and 256 rows (contexts 128-192; `--decode-rows 1,2` for one or two requests in flight)
and a prefill chunk of 512 tokens (`--prefill-tokens 128,1024` for others), in half precision.
A decode step is the forward alone; a prefill chunk is the forward and the logits of its last row,
as the model runner runs a prompt's last chunk (where a tree's model takes `sampled_rows`, its
last layer runs past the attention for that row alone, as the runner has it do).
What the native attention kernel, the packed linear layers and the fused layers buy, one step at
a time. `--background-load 0.1` has another process take a tenth of a core meanwhile, as a
server's other processes do on a small machine. Each tree runs in its own process (the baseline
`git archive`d, see common.py), alternately, `--rounds` times; the figure is the least wall time
of `--repeats` calls. Wall time, because a second thread's work is not this thread's CPU time:
run it on a quiet machine.

    python benchmarks/cpu_forward.py --model /work/smollm2-hf --baseline HEAD~3 --output benchmarks/results/cpu_forward_vs.json

Eager against compiled is `cpu_kernels.py --model` (it uses `forward_report` below); the tests
build their CPU model with `build`.
"""

from __future__ import annotations

import argparse
import inspect
import json
import random
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
# Last, not first: a worker's PYTHONPATH names the tree it measures (common.run_in_tree), and this
# checkout ahead of it made the baseline's worker import this tree's pagedserve.
sys.path.append(str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402
from pagedserve.config import EngineConfig  # noqa: E402
from pagedserve.kernels import get_attention_backend  # noqa: E402
from pagedserve.model_resolver import resolve_model_config  # noqa: E402
from pagedserve.workers.model_loader import load_model  # noqa: E402
from pagedserve.workers.layers.linear import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from pagedserve.workers.models.llama import LlamaForCausalLM, attention_dims  # noqa: E402
from pagedserve.workers.parallel_state import ParallelContext  # noqa: E402
from tests.kernels.paged_batch import make_batch  # noqa: E402

DECODE_ROWS = (8, 64, 128, 256)


def build(folder: Path, dtype: torch.dtype, max_positions: int, compiled: bool = False) -> LlamaForCausalLM:
    """The model as a CPU worker loads it: eager, or compiled at load (`enforce_eager=False`)."""
    config = EngineConfig(
        model=str(folder), dtype=str(dtype).removeprefix("torch."), max_model_len=max_positions, enforce_eager=not compiled
    )
    model_config = resolve_model_config(config, lambda _: "cpu")
    backend = get_attention_backend("auto", "cpu", dtype=dtype)
    return load_model(model_config, ParallelContext(), backend, torch.device("cpu"), config)


def steps(model: LlamaForCausalLM, args: argparse.Namespace, dtype: torch.dtype) -> dict:
    """name -> (input_ids, positions, meta, kv_cache) of a decode step and of a prefill chunk."""
    num_heads, num_kv_heads, head_dim = attention_dims(model.config)
    rng = random.Random(0)
    lens = sorted((rng.randint(args.min_context, args.max_context) for _ in range(args.num_seqs)), reverse=True)
    decode = make_batch([1] * len(lens), [n - 1 for n in lens], num_heads, num_kv_heads, head_dim, dtype=dtype)
    prefill = make_batch([args.prefill_tokens], [0], num_heads, num_kv_heads, head_dim, dtype=dtype)
    out = {}
    for name, batch in (("decode", decode), ("prefill", prefill)):
        num_tokens = batch.meta.num_tokens
        positions = torch.cat(
            [torch.arange(s - (e - b), s) for s, b, e in zip(batch.meta.seq_lens_host, batch.meta.query_start_loc_host, batch.meta.query_start_loc_host[1:])]
        )
        input_ids = torch.randint(100, 10_000, (num_tokens,))
        out[name] = (input_ids, positions, batch.meta, batch.kv_cache)
    return out


@torch.inference_mode()
def forward_report(args: argparse.Namespace, cpu_ms: Callable[..., float]) -> dict:
    report = {}
    for dtype_name in args.forward_dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        model = build(Path(args.model), dtype, 4096)
        start = time.perf_counter()
        compiled_model = build(Path(args.model), dtype, 4096, compiled=True)
        compile_s = time.perf_counter() - start  # the load too: a second or two of it
        row = {}
        for name, (input_ids, positions, meta, kv_cache) in steps(model, args, dtype).items():
            bind_caches([model, compiled_model], kv_cache)
            eager = cpu_ms(lambda: model(input_ids, positions, meta), args.repeats)
            compiled = cpu_ms(lambda: compiled_model(input_ids, positions, meta), args.repeats)
            print(f"[forward] {dtype} {name}: eager {eager} ms, compiled {compiled} ms", file=sys.stderr, flush=True)
            row[name] = {"eager_ms": eager, "compiled_ms": compiled, "speedup": round(eager / compiled, 2), "compile_s": round(compile_s, 1)}
        report[str(dtype).removeprefix("torch.")] = row
    return report


def bind_caches(models: list[LlamaForCausalLM], kv_cache: torch.Tensor) -> None:
    """Each attention layer its own copy of `kv_cache`, as a worker gives every layer a cache of
    its own. One cache shared by all layers stays in the CPU's caches across a step, and hid the
    decode attention's memory stalls: with 200 rows of 128-168 tokens of context the shared
    cache read 1.3x faster than 30 of them in turn (one thread, Zen 4, the kernel of 6a64efd)."""
    for model in models:
        for attn in model.attention_layers():
            attn.kv_cache = kv_cache.clone()


def linear_layers(model: LlamaForCausalLM) -> list:
    """Every linear of every decoder layer, then the LM head."""
    return [*(m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))), model.lm_head]


def decode_forward(model: LlamaForCausalLM, rows: int, dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    """The eager forward and logits of a decode step of `rows` sequences (128-192 tokens of context)."""
    shape = argparse.Namespace(num_seqs=rows, min_context=128, max_context=192, prefill_tokens=16)
    input_ids, positions, meta, kv_cache = steps(model, shape, dtype)["decode"]
    bind_caches([model], kv_cache)
    return lambda: model.compute_logits(model(input_ids, positions, meta))


def prefill_forward(model: LlamaForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> Callable[[], torch.Tensor]:
    """A prompt's last chunk as the model runner runs it: the forward, then the logits of the row
    that samples. A tree whose model takes no `sampled_rows` (before the last layer kept the
    sampled rows alone) selects the row after the forward, as its runner did."""
    last = torch.tensor([input_ids.shape[0] - 1])
    if "sampled_rows" in inspect.signature(model.forward).parameters:
        return lambda: model.compute_logits(model(input_ids, positions, meta, None, last))
    return lambda: model.compute_logits(model(input_ids, positions, meta).index_select(0, last))


def layer_bench_args(description: str, rows: str, repeats: int) -> argparse.Namespace:
    """The flags of the per-layer benchmarks (cpu_small_linear.py, cpu_fp32_linear.py)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a Llama-family Hugging Face folder")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rows", default=rows)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--output", type=Path)
    return parser.parse_args()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a Llama-family Hugging Face folder")
    parser.add_argument("--dtype", default="bfloat16")
    common.add_baseline_argument(parser)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument(
        "--decode-rows", type=common.positive_ints, default=DECODE_ROWS, metavar="N,N,...",
        help="the decode steps' rows (requests in flight), comma-separated; the prefill chunk runs after the last",
    )
    parser.add_argument(
        "--prefill-tokens", type=common.positive_ints, default=[512], metavar="N,N,...",
        help="the prefill chunks' tokens (one prompt from the start), comma-separated",
    )
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--background-load", type=float, default=0.0, metavar="FRACTION",
        help="another process takes this fraction of one core in 1 ms bursts while each tree runs (a server's other processes)",
    )
    parser.add_argument("--output", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    error = common.background_load_error(args.background_load)
    if error:
        parser.error(f"--background-load: {error}")
    return args


def worker(args: argparse.Namespace) -> dict[str, float]:
    """In the tree on PYTHONPATH: name -> least wall ms of one forward."""
    torch.set_num_threads(int(args.threads))
    dtype = getattr(torch, args.dtype)
    result = {}
    with torch.inference_mode():
        model = build(Path(args.model), dtype, 4096)
        runs = [("decode", rows, f"decode_{rows}", 16) for rows in args.decode_rows]
        runs += [("prefill", 1, f"prefill_{tokens}", tokens) for tokens in args.prefill_tokens]
        for kind, rows, name, prefill_tokens in runs:
            shape = argparse.Namespace(num_seqs=rows, min_context=128, max_context=192, prefill_tokens=prefill_tokens)
            input_ids, positions, meta, kv_cache = steps(model, shape, dtype)[kind]
            bind_caches([model], kv_cache)
            forward = prefill_forward(model, input_ids, positions, meta) if kind == "prefill" else lambda: model(input_ids, positions, meta)
            result[name] = common.least_ms(forward, args.repeats, clock=time.perf_counter)
    return result


def main() -> None:
    args = parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    runs: dict[str, dict[str, list[dict[str, float]]]] = {}
    with common.baseline_tree(args.baseline) as (baseline_commit, baseline_folder):
        trees = {"this_tree": common.REPO, "baseline": baseline_folder}
        for _ in range(args.rounds):
            for threads in (int(t) for t in args.threads.split(",")):
                for name, tree in trees.items():
                    print(f"[forward] {name}, {threads} thread(s) ...", file=sys.stderr, flush=True)
                    argv = ["--worker", "--model", args.model, "--dtype", args.dtype, "--threads", str(threads), "--repeats", str(args.repeats)]
                    argv += ["--decode-rows", ",".join(map(str, args.decode_rows))]
                    argv += ["--prefill-tokens", ",".join(map(str, args.prefill_tokens))]
                    with common.background_load(args.background_load):
                        result = common.run_in_tree(tree, __file__, argv, env={"OMP_NUM_THREADS": str(threads)})
                    runs.setdefault(f"{threads}_threads", {}).setdefault(name, []).append(result)
    report = {"model": args.model, "dtype": args.dtype, "background_load": args.background_load, "baseline_commit": baseline_commit, "ms": {}, "speedup": {}}
    for threads, by_tree in runs.items():
        best = {name: {step: min(r[step] for r in rs) for step in rs[0]} for name, rs in by_tree.items()}
        report["ms"][threads] = best
        report["speedup"][threads] = {step: round(best["baseline"][step] / best["this_tree"][step], 2) for step in best["this_tree"]}
    common.write_report(report, args.output)


if __name__ == "__main__":
    main()
