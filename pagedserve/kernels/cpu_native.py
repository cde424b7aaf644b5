"""The native CPU paged attention (`attention_backend="native"`, what `auto` picks on the CPU
when the C++ kernel builds): every query token, decode or prefill, reads its K/V straight from
the paged cache in C++ (`csrc/cpu_paged_attention.cpp`), with no gathered copy and no padding.
Measured against the pure-torch paths (`benchmarks/cpu_kernels.py`), it wins for decode batches
and for prefill chunks alike (up to 2,048-token chunks).

Same cache layout and signature as `reference.py`, the ground truth it is tested against.
Beside it, the fused layers of `csrc/cpu_layers.cpp` (RMSNorm, SiLU-and-mul, rotary embeddings),
which the model's layers call through `can_fuse`.
"""

from __future__ import annotations

import torch

from pagedserve.kernels import native_build
from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.kernels.reference import kv_cache_shape

__all__ = [
    "kv_cache_shape", "write_kv_cache", "paged_attention", "is_available", "can_fuse", "rms_norm", "silu_and_mul",
    "rotary", "compiled_paths", "attention_path_counts",
]  # fmt: skip


compiled_paths = native_build.compiled_paths


def is_available() -> bool:
    """True once the C++ kernel is built and loaded (built on first use; see native_build)."""
    return native_build.load()


def attention_path_counts() -> dict[str, int]:
    """(query token, KV head) tasks run on each attention path in this process so far: "vector"
    (the served shapes, on the AVX-512 or AVX2 path the build compiled: `compiled_paths`) and
    "portable" (any other head_dim or group, or a CPU with neither). "prefill_blocks" counts
    those of "vector" computed in blocks of query rows (bf16 prefill chunks, with AVX-512 BF16)."""
    if not native_build.load():
        return {"vector": 0, "portable": 0, "prefill_blocks": 0}
    fast, portable, blocks = torch.ops.pagedserve_cpu.attention_path_counts()
    return {"vector": fast, "portable": portable, "prefill_blocks": blocks}


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    kv_cache: torch.Tensor,  # reference.py's layout
    slot_mapping: torch.Tensor,  # [num_tokens]
) -> None:
    """reference.write_kv_cache's result, one row copy per token and head in C++ (index_copy_
    over the cache's slot dimension was up to 3% of an offline run)."""
    torch.ops.pagedserve_cpu.write_kv_cache(key, value, kv_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]: this step's, already in the cache
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's query chunk over its cached tokens."""
    query = query.contiguous()
    out = torch.empty_like(query)
    torch.ops.pagedserve_cpu.paged_attention(
        query, out, kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, 0, meta.num_seqs, scale
    )
    return out


def can_fuse(x: torch.Tensor) -> bool:
    """Whether the fused layers below take `x`: a CPU tensor in half precision or float32, the
    kernels built, and not under torch.compile (inductor fuses those layers itself). float32 takes
    them too: torch's ops were 8% of an offline float32 run on a Zen 3 (SmolLM2), and the fused
    pass differs from them by a few float32 ulps, as the packed GEMM differs from MKL's."""
    return (
        x.device.type == "cpu"
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and not torch.compiler.is_compiling()
        and native_build.load()
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's RMSNorm (float32 statistics, rounded, then times the weight) in one pass."""
    x = x.contiguous()
    out = torch.empty_like(x)
    torch.ops.pagedserve_cpu.rms_norm(out, x, weight, eps)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] in one pass."""
    x = x.contiguous()
    out = x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
    torch.ops.pagedserve_cpu.silu_and_mul(out, x)
    return out


def rotary(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ([tokens, heads, head_dim], rotate-half layout) rotated by each token's position, in one
    pass; cos and sin are the float32 tables [max_positions, head_dim / 2]."""
    out = torch.empty(x.shape, dtype=x.dtype)
    torch.ops.pagedserve_cpu.rotary(out, x, positions.long().contiguous(), cos, sin)
    return out
