"""CPU cost of the decode attention backends and of the sampler, measured as this thread's CPU
time (`time.thread_time`, the least of `--repeats` calls), not wall time, so the ratios hold on a
machine shared with other work.

Decode attention: `--num-seqs` decode rows of random context lengths over a paged cache shaped like
SmolLM2-135M's (9 query heads, 3 KV heads, head_dim 64), reference vs the pure-torch `cpu`
backend vs the C++ `native` one, in float32 and bfloat16, one layer (and `native` per layer over
`--layers` layers' caches in turn, reading its contexts from memory); and one prefill chunk of
`--prefill-tokens` tokens, reference vs `native`. Sampler: `--num-seqs` rows over a 49,152-token vocabulary at
temperature 1 (what `vllm bench serve` sends) and greedy; the exponential race over the whole
vocabulary (the sampler before issue 10) vs `Sampler` now. With `--model` (a Llama-family Hugging
Face folder): the whole forward pass of that model in bfloat16 and float32, eager vs compiled
(workers/compile.py), for a decode step of `--num-seqs` rows and a prefill step of
`--prefill-tokens` tokens, after the compiles it needs (their wall time is reported too).

    python benchmarks/cpu_kernels.py --output benchmarks/results/cpu_kernels.json
    python benchmarks/cpu_kernels.py --model /work/smollm2-hf --skip-kernels
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from pagedserve.kernels import cpu_attention, cpu_native, reference  # noqa: E402
from pagedserve.sampling_params import SamplingParams  # noqa: E402
from pagedserve.workers.step_inputs import CachedRequestState  # noqa: E402
from pagedserve.workers.sampler import Sampler  # noqa: E402
from pagedserve.workers.huge_pages import zeros_in_huge_pages  # noqa: E402
from pagedserve.workers.sampling_batch import build_sampling_batch  # noqa: E402
from tests.kernels.paged_batch import make_batch  # noqa: E402


cpu_ms = common.least_ms  # the least thread-CPU time of `repeats` calls: others only ever add to it


def attention(args: argparse.Namespace) -> dict:
    rng = random.Random(0)
    lens = sorted((rng.randint(args.min_context, args.max_context) for _ in range(args.num_seqs)), reverse=True)
    result = {}
    for dtype in (torch.float32, torch.bfloat16):
        batch = make_batch([1] * len(lens), [n - 1 for n in lens], 9, 3, head_dim=64, block_size=16, dtype=dtype)
        inputs = (batch.query, batch.key, batch.value, batch.kv_cache, batch.meta, batch.scale)
        ref = cpu_ms(lambda: reference.paged_attention(*inputs), args.repeats)
        fast = cpu_ms(lambda: cpu_attention.paged_attention(*inputs), args.repeats)
        row = {"reference_ms": ref, "cpu_ms": fast, "speedup": round(ref / fast, 2)}
        if cpu_native.is_available():
            native = cpu_ms(lambda: cpu_native.paged_attention(*inputs), args.repeats)
            row |= {"native_ms": native, "native_vs_reference": round(ref / native, 2), "native_vs_cpu": round(fast / native, 2)}
            row["native_from_memory_ms"] = native_from_memory(lens, dtype, args)
            prefill = make_batch([args.prefill_tokens], [0], 9, 3, head_dim=64, block_size=16, dtype=dtype)
            prefill_inputs = (prefill.query, prefill.key, prefill.value, prefill.kv_cache, prefill.meta, prefill.scale)
            row["prefill_reference_ms"] = cpu_ms(lambda: reference.paged_attention(*prefill_inputs), args.repeats)
            row["prefill_native_ms"] = cpu_ms(lambda: cpu_native.paged_attention(*prefill_inputs), args.repeats)
        result[str(dtype).removeprefix("torch.")] = row
    return result


def native_from_memory(lens: list[int], dtype: torch.dtype, args: argparse.Namespace) -> float:
    """The native decode attention per layer over `--layers` layers' caches in turn, as a forward
    reads them: each layer's contexts come from memory. One layer called again and again keeps
    much of its cache in the CPU's (256 rows of 128-192 tokens hold about 32 MB in bf16), which
    hides the memory stalls. Each cache lies in 2 MiB pages, as the engine allocates it."""
    batches = []
    for layer in range(args.layers):
        batch = make_batch([1] * len(lens), [n - 1 for n in lens], 9, 3, head_dim=64, block_size=16, dtype=dtype, seed=layer)
        kv_cache = zeros_in_huge_pages(tuple(batch.kv_cache.shape), dtype)
        batches.append(dataclasses.replace(batch, kv_cache=kv_cache.copy_(batch.kv_cache)))

    def every_layer() -> None:
        for b in batches:
            cpu_native.paged_attention(b.query, b.key, b.value, b.kv_cache, b.meta, b.scale)

    return round(cpu_ms(every_layer, args.repeats) / args.layers, 3)


def old_exponential_race(logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The sampler's draw before issue 10: Exp(1) noise over every row and every token."""
    probs = torch.softmax(logits, dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def sampler(args: argparse.Namespace) -> dict:
    logits = torch.randn(args.num_seqs, 49_152, generator=torch.Generator().manual_seed(0))
    result = {}
    for name, params in (("temperature_1", SamplingParams(temperature=1.0)), ("greedy", SamplingParams(temperature=0.0))):
        states = [CachedRequestState(str(i), [5, 6], 2, params, [0], 2) for i in range(args.num_seqs)]
        batch = build_sampling_batch(states, (1,), logits.shape[-1], torch.device("cpu"))
        new = Sampler(0, torch.device("cpu"))
        generator = torch.Generator().manual_seed(0)
        old = cpu_ms(lambda: old_exponential_race(logits, generator) if not batch.all_greedy else logits.argmax(-1), args.repeats)
        now = cpu_ms(lambda: new(logits, batch), args.repeats)
        result[name] = {"before_ms": old, "now_ms": now, "speedup": round(old / now, 2)}
    return result


def forward(args: argparse.Namespace) -> dict:
    from cpu_forward import forward_report

    return forward_report(args, cpu_ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--min-context", type=int, default=128)
    parser.add_argument("--max-context", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=30, help="layers' caches the from-memory decode attention reads in turn")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", help="a Hugging Face folder: also time its whole forward, eager vs compiled")
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--forward-dtypes", default="bfloat16,float32")
    parser.add_argument("--skip-kernels", action="store_true", help="only the forward pass (needs --model)")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report = {"workload": vars(args) | {"output": None}}
    if not args.skip_kernels:
        report["decode_attention_one_layer"] = attention(args)
        report["sampler"] = sampler(args)
    if args.model:
        report["forward"] = forward(args)
    common.write_report(report, args.output)


if __name__ == "__main__":
    main()
