"""The native C++ CPU attention (`cpu_native`) against the torch reference: decode, prefill,
chunked prefill and mixed batches; GQA/MQA/MHA; head_dim 64 and 128 (the register-resident AVX-512
path) and 32 (the portable loop); block sizes 1 to 64; float32, bfloat16 and float16. The kernel
is built here if this machine has none cached (a g++ is part of the test setup, as for
torch.compile); building it is part of what is tested."""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedserve.kernels import cpu_native, get_attention_backend, native_build, reference
from tests.kernels.paged_batch import FLOAT32_SLACK, PagedBatch, assert_rounded, half_ulp, make_batch, random_lengths
from tests.kernels.paged_batch import check_against_reference as check_with

REPO = Path(__file__).resolve().parents[2]
CASES = {
    "decode_only": ([1, 1, 1, 1, 1], [70, 33, 32, 15, 0]),
    "prefill_only": ([17, 2, 40, 8], [0, 0, 0, 0]),
    "chunked_prefill": ([16, 9], [48, 5]),
    "mixed": ([1, 1, 1, 12, 30, 3], [50, 17, 8, 0, 21, 64]),
}
AVX512_BLOCK_ROWS = {group: 24 // group for group in range(1, 9)}  # cpu_prefill_attention.h: 24 query heads a block
AVX2_BLOCK_ROWS = {group: max(1, 6 // group) for group in range(1, 7)}  # cpu_prefill_attention_avx2.h: 6; none past 6


def block_rows(group: int, dtype: torch.dtype) -> int | None:
    """The query rows of a prefill block for this shape and dtype in this machine's build, or None
    where prefill chunks go row by row: bf16 with AVX-512 BF16, every dtype with AVX2 alone."""
    paths = cpu_native.compiled_paths()
    if "avx512_bf16" in paths:
        return AVX512_BLOCK_ROWS[group] if dtype == torch.bfloat16 else None
    return AVX2_BLOCK_ROWS.get(group) if "avx2_prefill_blocks" in paths else None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_blocks_against_reference(group, head_dim, dtype):
    """Prefill chunks of at least a block's rows (two at the least) go in blocks of rows where this
    build has a block kernel for the dtype and shape: chunks over many key tiles, with and without
    cached context, a last block padded, beside decodes and a chunk too short for a block; each value
    the float32 attention rounded once."""
    blocked_rows = block_rows(group, dtype)
    rows = blocked_rows or AVX512_BLOCK_ROWS[group]  # chunks around a block's size either way
    query_lens = [1, 1, 5 * rows + 3, max(2, rows), max(2, rows - 1), 200]  # decodes first (make_batch)
    context_lens = [300, 7, 0, 45, 3, 333]
    batch = make_batch(query_lens, context_lens, 2 * group, 2, head_dim=head_dim, block_size=16, dtype=dtype, seed=group)
    before = cpu_native.attention_path_counts()
    check_against_reference(batch)
    after = cpu_native.attention_path_counts()
    expected = sum(q for q in query_lens if q >= max(2, rows)) * 2 if blocked_rows else 0
    assert after["prefill_blocks"] - before["prefill_blocks"] == expected


def test_a_prefill_rows_answer_does_not_depend_on_the_chunk_around_it():
    """A row computed in a block (padded or not, first or last in it) gives the bits it gives in
    any other chunk of the same prompt that also takes blocks (a block's rows or more): the blocks
    keep each query head's arithmetic its own."""
    prompt = 100
    whole = make_batch([prompt], [0], 9, 3, head_dim=64, dtype=torch.bfloat16, seed=7)
    cache = whole.kv_cache.clone()
    reference.write_kv_cache(whole.key, whole.value, cache, whole.meta.slot_mapping)
    full = cpu_native.paged_attention(whole.query, whole.key, whole.value, cache, whole.meta, whole.scale)
    for start, end in ((37, 100), (40, 61), (91, 100)):  # later chunks, their earlier tokens cached
        meta = dataclasses.replace(
            whole.meta, query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32), max_query_len=end - start, max_seq_len=end,
            query_start_loc_host=[0, end - start], seq_lens_host=[end],
        )  # fmt: skip
        part = cpu_native.paged_attention(whole.query[start:end], whole.key[start:end], whole.value[start:end], cache, meta, whole.scale)
        assert torch.equal(part, full[start:end]), (start, end)


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_native.is_available(), "the native CPU kernel did not build (g++ and torch's headers are needed)"


def check_against_reference(batch: PagedBatch) -> None:
    check_with(batch, cpu_native.paged_attention)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (4, 1)], ids=["mha", "gqa3", "mqa"])
@pytest.mark.parametrize("head_dim", [64, 128, 32])
@pytest.mark.parametrize("case", list(CASES))
def test_against_reference(case, head_dim, heads, dtype):
    batch = make_batch(*CASES[case], heads[0], heads[1], head_dim=head_dim, block_size=16, dtype=dtype)
    check_against_reference(batch)


@pytest.mark.parametrize("block_size", [1, 8, 64])
def test_block_sizes(block_size):
    batch = make_batch(*CASES["mixed"], num_heads=6, num_kv_heads=2, head_dim=64, block_size=block_size, seed=1, dtype=torch.bfloat16)
    check_against_reference(batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [10, 11])
def test_random_ragged_batches(seed, dtype):
    query_lens, context_lens = random_lengths(num_decodes=12, num_prefills=3, max_context=300, max_query=40, seed=seed)
    batch = make_batch(query_lens, context_lens, 9, 3, head_dim=64, block_size=16, dtype=dtype, seed=seed)
    check_against_reference(batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16])
def test_cache_write_equals_the_reference_bit_for_bit(dtype, block_size):
    """The C++ write puts each token's K/V row where reference.write_kv_cache's index_copy_ puts
    it, including from strided views of a QKV projection (how the model hands them over), and
    leaves every other slot alone."""
    batch = make_batch(*CASES["mixed"], 9, 3, head_dim=64, block_size=block_size, dtype=dtype, seed=3)
    num_tokens = batch.key.shape[0]
    qkv = torch.randn(num_tokens, (9 + 3 + 3) * 64).to(dtype)
    key = qkv[:, 9 * 64 : 12 * 64].reshape(num_tokens, 3, 64)  # a view: rows 15 heads apart
    value = qkv[:, 12 * 64 :].reshape(num_tokens, 3, 64)
    assert not key.is_contiguous()
    expected, actual = batch.kv_cache.clone(), batch.kv_cache.clone()
    reference.write_kv_cache(key, value, expected, batch.meta.slot_mapping)
    cpu_native.write_kv_cache(key, value, actual, batch.meta.slot_mapping)
    assert not torch.equal(expected, batch.kv_cache)  # the reference wrote something
    assert torch.equal(actual, expected)


def test_cache_write_refuses_a_slot_outside_the_cache():
    batch = make_batch([1], [3], 4, 2, head_dim=64, dtype=torch.float32)
    slots = batch.kv_cache.shape[2] * batch.kv_cache.shape[3]
    with pytest.raises(RuntimeError, match=f"slot {slots} is outside the cache's {slots} slots"):
        cpu_native.write_kv_cache(batch.key, batch.value, batch.kv_cache, torch.tensor([slots]))


def test_threads_split_decodes_by_work_to_the_same_answer():
    """Decode rows come longest first, and the kernel splits them across threads by keys to read,
    not by count: any number of threads (more than rows, too) gives the same bits."""
    lengths = [900, 700, 300, 40, 17, 16, 5, 1]
    batch = make_batch([1] * len(lengths), [n - 1 for n in lengths], 9, 3, head_dim=64, dtype=torch.bfloat16, seed=4)
    check_against_reference(batch)
    cache = batch.kv_cache.clone()
    reference.write_kv_cache(batch.key, batch.value, cache, batch.meta.slot_mapping)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3, 64):
            torch.set_num_threads(n)
            outs.append(cpu_native.paged_attention(batch.query, batch.key, batch.value, cache, batch.meta, batch.scale))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], out) for out in outs[1:])


def test_threads_split_the_same_answer():
    """Rows are split across torch's threads: the answer must not depend on how."""
    batch = make_batch(*CASES["mixed"], 8, 2, head_dim=64, dtype=torch.bfloat16, seed=5)
    cache = batch.kv_cache.clone()
    reference.write_kv_cache(batch.key, batch.value, cache, batch.meta.slot_mapping)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(cpu_native.paged_attention(batch.query, batch.key, batch.value, cache, batch.meta, batch.scale))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


def test_auto_picks_native_on_the_cpu():
    for dtype in (torch.float32, torch.bfloat16):
        assert get_attention_backend("auto", "cpu", dtype=dtype).name == "native"
    assert get_attention_backend("native", "cpu").name == "native"
    with pytest.raises(ValueError, match="CPU only"):
        get_attention_backend("native", "cuda")


def test_unbuildable_kernel_falls_back(monkeypatch, caplog, tmp_path):
    """No compiler: `auto` keeps the pure-torch paths and says why; `native` asked by name is an
    error that names the alternatives."""
    monkeypatch.setattr(native_build, "_state", {})
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv(native_build.ENV_CACHE, str(tmp_path))
    with caplog.at_level(logging.WARNING, logger=native_build.__name__):
        assert get_attention_backend("auto", "cpu", dtype=torch.bfloat16).name == "cpu"
        assert get_attention_backend("auto", "cpu", dtype=torch.float32).name == "torch"
    assert "pure-torch" in caplog.text
    with pytest.raises(ValueError, match="could not build"):
        get_attention_backend("native", "cpu")


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setattr(native_build, "_state", {})
    monkeypatch.setenv(native_build.ENV_SWITCH, "0")
    assert get_attention_backend("auto", "cpu", dtype=torch.bfloat16).name == "cpu"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(7, 576), (3, 37), (2, 5, 64)])
def test_fused_rms_norm_matches_the_torch_layer(shape, dtype):
    """The fused pass rounds where Hugging Face's RMSNorm rounds (the normalized row, then its
    product with the weight): each output is the float32 product of the rounded row and the
    weight, rounded once."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
    weight = torch.randn(shape[-1], generator=gen).to(dtype)
    y = x.float()
    expected = weight.float() * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype).float()
    actual = cpu_native.rms_norm(x, weight, 1e-6)
    assert actual.dtype == dtype and actual.shape == x.shape
    assert_rounded(actual, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(7, 2 * 1536), (3, 2 * 37), (2, 5, 2 * 64)])
def test_fused_silu_and_mul_matches_the_torch_layer(shape, dtype):
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(*shape, generator=gen) * 4).to(dtype)
    x.view(-1)[:4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's clamps at both ends
    gate, up = x.chunk(2, dim=-1)
    # As Hugging Face rounds it: silu(gate) in the dtype, then its product with up, rounded again.
    # The first rounding may fall the other way for a silu near a midpoint (the kernel's exp is
    # vectorized): up to one ulp of silu, times up, on top of the final rounding.
    silu = torch.nn.functional.silu(gate.double()).to(dtype).double()
    expected = silu * up.double()
    actual = cpu_native.silu_and_mul(x)
    assert actual.dtype == dtype and actual.shape == gate.shape
    bound = half_ulp(expected.float(), dtype) + 2 * half_ulp(silu.float(), dtype) * up.double().abs() + FLOAT32_SLACK
    assert ((actual.double() - expected).abs() <= bound).all(), "silu_and_mul: beyond its two roundings"


def test_layers_take_the_fused_path_on_the_cpu_in_every_model_dtype():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert cpu_native.can_fuse(torch.zeros(2, 4, dtype=dtype))
    assert not cpu_native.can_fuse(torch.zeros(2, 4, dtype=torch.float64))
    assert not cpu_native.can_fuse(torch.zeros(2, 4, dtype=torch.bfloat16, device="meta"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_rotary_matches_the_torch_layer(dtype):
    """On a view into a fused QKV output (not contiguous per token), as the attention layer calls it."""
    from pagedserve.workers.layers.rotary import RotaryEmbedding, _rotate

    rope = RotaryEmbedding(64, 512, {"rope_theta": 10000.0, "rope_type": "default"})
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(6, (4 + 2 + 2) * 64, generator=gen).to(dtype)
    q, k, _ = qkv.split([4 * 64, 2 * 64, 2 * 64], dim=-1)
    q, k = q.view(6, 4, 64), k.view(6, 2, 64)
    positions = torch.tensor([0, 1, 7, 300, 511, 42])
    for x in (q, k):
        expected = _rotate(x.float(), rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1))
        actual = cpu_native.rotary(x, positions, rope.cos, rope.sin)
        assert actual.dtype == dtype and actual.shape == x.shape
        assert_rounded(actual, expected, dtype)
    with pytest.raises(RuntimeError, match="position out of range"):
        cpu_native.rotary(q, torch.tensor([0, 1, 2, 3, 4, 512]), rope.cos, rope.sin)


# /proc/cpuinfo flag(s) -> the path a -march=native build of this machine must have compiled.
PROMISED_PATHS = {("avx512f",): "avx512", ("avx512f", "avx512_bf16"): "avx512_bf16", ("avx512bw", "avx512_bf16"): "small_linear_bf16"}
AVX2_FLAGS = ("avx2", "fma", "f16c")  # the eight-lane path, compiled where AVX-512 is not


def test_the_build_compiled_every_path_this_cpu_promises():
    """A CPU whose flags promise AVX-512 (or AVX-512 BF16, or AVX2 without AVX-512) must get
    those paths: a build that missed them (a wrong -march, an old compiler) would pass every
    output test on the portable loop and lose the speed silently."""
    flags = set(native_build._cpu_flags().split())
    promised = {path for needs, path in PROMISED_PATHS.items() if flags.issuperset(needs)}
    if "avx512f" not in flags and flags.issuperset(AVX2_FLAGS):
        promised.add("avx2")
    compiled = cpu_native.compiled_paths()
    assert promised <= compiled, f"this CPU has {sorted(promised)}; the build compiled only {sorted(compiled)}"
    assert not {"avx512", "avx2"} <= compiled  # one vector width per build


@pytest.mark.parametrize(
    "heads, head_dim, served",
    [((8, 1), 64, True), ((6, 2), 128, True), ((4, 4), 32, False), ((9, 1), 64, False)],
    ids=["group8_d64", "group3_d128", "d32", "group9"],
)
def test_the_kernel_reports_the_path_each_task_took(heads, head_dim, served):
    """Served shapes (head_dim 64 or 128, 1 to 8 query heads per KV head) take the vector path
    (AVX-512 or AVX2) where it was compiled; any other shape takes the portable loop. One task
    per (query token, KV head)."""
    query_lens, context_lens = CASES["mixed"]
    batch = make_batch(query_lens, context_lens, *heads, head_dim=head_dim, block_size=16, dtype=torch.float32)
    before = cpu_native.attention_path_counts()
    check_against_reference(batch)
    after = cpu_native.attention_path_counts()
    tasks = sum(query_lens) * heads[1]
    fast = tasks if served and {"avx512", "avx2"} & cpu_native.compiled_paths() else 0
    assert after["vector"] - before["vector"] == fast
    assert after["portable"] - before["portable"] == tasks - fast


def test_the_throw_probe_sees_a_failed_check_raise_here(tmp_path):
    """tools/native_throw_probe.py, kept for the next lent Intel host (where a failed check
    crashed the process): on this machine a check's error, built with the kernels' own flags,
    reaches Python as the RuntimeError it must be, and so does a plain C++ exception."""
    report = tmp_path / "probe.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "tools" / "native_throw_probe.py"), "--variants", "native_build,plain_exception", "--output", str(report)],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    outcomes = {r["variant"]: r["outcome"] for r in json.loads(report.read_text())["results"]}
    assert outcomes == {"native_build": "raised", "plain_exception": "raised"}, done.stderr[-2000:]
