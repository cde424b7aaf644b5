"""The flash-attn adapter: its layout, its K/V writes and the arguments it hands flash-attn.

flash-attn is CUDA-only and optional, so on the CPU a stand-in module computes what flash-attn's
documented paged API computes (keys gathered through `block_table`, causal mask aligned to the
end of each sequence) and checks the argument types flash-attn checks. The adapter's output must
then equal the reference. With a GPU and the package installed, the real thing is tested.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest

pytest.importorskip("triton", reason="triton is not installed (the test extra has it on x86-64 Linux only)")

import torch

from pagedserve.kernels import flash_attn, reference
from tests.kernels.conftest import DEVICE
from tests.kernels.paged_batch import make_batch

BLOCK_SIZE = flash_attn.PAGE_SIZE_MULTIPLE  # the smallest page upstream flash-attn accepts


def _paged_keys(cache: torch.Tensor, table_row: torch.Tensor, length: int) -> torch.Tensor:
    page = cache.shape[1]
    blocks = table_row[: -(-length // page)].long()
    return cache[blocks].reshape(-1, *cache.shape[2:])[:length]  # [length, kv_heads, dim]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Lq, H, D] over k, v [Lk, Hk, D], causal with the queries last (bottom-right)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    offset = k.shape[0] - q.shape[0]
    allowed = torch.arange(k.shape[0]) <= (torch.arange(q.shape[0]) + offset).unsqueeze(1)
    probs = scores.masked_fill(~allowed.to(q.device), float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)


def _check_paged_args(q, k_cache, block_table):
    assert q.dtype in (torch.float16, torch.bfloat16), "flash-attn supports fp16/bf16 only"
    assert block_table.dtype == torch.int32 and block_table.stride(-1) == 1
    assert k_cache.shape[1] % 256 == 0, "Paged KV cache block size must be divisible by 256"


def fake_flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal):
    _check_paged_args(q, k_cache, block_table)
    assert cache_seqlens.dtype == torch.int32 and causal
    out = torch.empty_like(q)
    for b, length in enumerate(cache_seqlens.tolist()):
        k, v = _paged_keys(k_cache, block_table[b], length), _paged_keys(v_cache, block_table[b], length)
        out[b] = _attend(q[b], k, v, softmax_scale)
    return out


def fake_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, block_table):
    _check_paged_args(q, k, block_table)
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32 and causal
    qsl, ksl = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    assert max_seqlen_q == max(b - a for a, b in zip(qsl, qsl[1:]))
    assert max_seqlen_k == max(b - a for a, b in zip(ksl, ksl[1:]))
    out = torch.empty_like(q)
    for b in range(len(qsl) - 1):
        length = ksl[b + 1] - ksl[b]
        keys, values = _paged_keys(k, block_table[b], length), _paged_keys(v, block_table[b], length)
        out[qsl[b] : qsl[b + 1]] = _attend(q[qsl[b] : qsl[b + 1]], keys, values, softmax_scale)
    return out


@pytest.fixture
def fake_flash_attn(monkeypatch):
    module = types.ModuleType("flash_attn")
    module.flash_attn_with_kvcache = fake_flash_attn_with_kvcache
    module.flash_attn_varlen_func = fake_flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "flash_attn", module)


def run_adapter_against_reference(query_lens, context_lens, device, dtype=torch.float16, num_heads=4, num_kv_heads=2):
    batch = make_batch(query_lens, context_lens, num_heads, num_kv_heads, 64, BLOCK_SIZE, dtype=dtype, device=device)
    # The same random context in flash-attn's layout: [2, blocks, block_size, kv_heads, dim].
    flash_cache = batch.kv_cache.permute(0, 2, 3, 1, 4).contiguous()
    flash_attn.write_kv_cache(batch.key, batch.value, flash_cache, batch.meta.slot_mapping)
    reference.write_kv_cache(batch.key, batch.value, batch.kv_cache, batch.meta.slot_mapping)
    assert torch.equal(flash_cache.permute(0, 3, 1, 2, 4), batch.kv_cache)

    actual = flash_attn.paged_attention(batch.query, batch.key, batch.value, flash_cache, batch.meta, batch.scale)
    f32 = [t.float() for t in (batch.query, batch.key, batch.value, batch.kv_cache)]
    expected = reference.paged_attention(*f32, batch.meta, batch.scale)
    torch.testing.assert_close(actual.float(), expected, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize(
    "query_lens, context_lens",
    [
        ([1, 1, 1], [300, 255, 0]),  # decode-only: flash_attn_with_kvcache
        ([1, 1, 20, 7, 40], [260, 3, 0, 250, 270]),  # mixed: flash_attn_varlen_func
    ],
    ids=["decode_only", "mixed"],
)
def test_adapter_matches_reference(fake_flash_attn, query_lens, context_lens):
    run_adapter_against_reference(query_lens, context_lens, DEVICE)


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="flash-attn is not installed")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_real_flash_attn_matches_reference(dtype):
    run_adapter_against_reference([1] * 8 + [100, 37], [900, 600, 511, 256, 255, 40, 2, 0, 0, 700], "cuda", dtype, 32, 8)
    run_adapter_against_reference([1] * 16, list(range(1600, 0, -100)), "cuda", dtype, 32, 8)
