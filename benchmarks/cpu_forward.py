"""The whole forward pass of a checkpoint on the CPU, eager vs compiled: `cpu_kernels.py --model`.

The model is built as a worker builds it (real weights, the `cpu` attention backend in half
precision, the reference in float32, as `auto` picks), with every layer's cache bound to one
random paged cache (the cost is the same as separate ones). Steps: a decode step of `--num-seqs`
rows with contexts of `--min-context`..`--max-context` tokens, and one prefill chunk of
`--prefill-tokens` tokens.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from pagedserve.config import EngineConfig
from pagedserve.kernels import get_attention_backend
from pagedserve.model_resolver import resolve_model_config
from pagedserve.workers.model_loader import load_model
from pagedserve.workers.models.llama import LlamaForCausalLM, attention_dims
from pagedserve.workers.parallel_state import ParallelContext
from tests.kernels.paged_batch import make_batch


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
            for attn in [*model.attention_layers(), *compiled_model.attention_layers()]:
                attn.kv_cache = kv_cache
            eager = cpu_ms(lambda: model(input_ids, positions, meta), args.repeats)
            compiled = cpu_ms(lambda: compiled_model(input_ids, positions, meta), args.repeats)
            print(f"[forward] {dtype} {name}: eager {eager} ms, compiled {compiled} ms", file=sys.stderr, flush=True)
            row[name] = {"eager_ms": eager, "compiled_ms": compiled, "speedup": round(eager / compiled, 2), "compile_s": round(compile_s, 1)}
        report[str(dtype).removeprefix("torch.")] = row
    return report
