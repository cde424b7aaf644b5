"""Linear layers on the CPU run on oneDNN-packed weights (workers/layers/cpu_gemm): the same
forward as `F.linear` on the plain weights, within bfloat16's rounding, or float32's; the plain
copies are freed except a tied LM head's, which the embedding shares, and a bfloat16 layer's where
the small-batch kernel reads it. Where oneDNN has no bfloat16 (or float16) GEMM, those weights are
packed widened to float32: one rounding of the float32 product."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pagedserve.workers.layers import cpu_gemm
from pagedserve.workers.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedserve.workers.models.llama import attention_dims
from tests.kernels.paged_batch import UNIT_ROUNDOFF, make_batch
from tests.models import HFReference

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from cpu_forward import build  # noqa: E402  (the model as a CPU worker loads it)

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN: nothing is packed there (cpu_gemm.can_pack)"
)


def _forward(model, query_lens=(1, 1, 9, 5), context_lens=(30, 12, 0, 7), sampled_rows=None) -> torch.Tensor:
    num_heads, num_kv_heads, head_dim = attention_dims(model.config)
    batch = make_batch(query_lens, context_lens, num_heads, num_kv_heads, head_dim, dtype=model.lm_head.weight.dtype)
    positions = torch.cat([torch.arange(c, c + q) for q, c in zip(query_lens, context_lens)])
    input_ids = torch.randint(0, model.config.vocab_size, (len(positions),), generator=torch.Generator().manual_seed(0))
    for attn in model.attention_layers():
        attn.kv_cache = batch.kv_cache.clone()
    hidden = model(input_ids, positions, batch.meta, None, sampled_rows)
    return model.compute_logits(hidden)


def _linears(model):
    return [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packs_dtype_answers_what_onednn_does(dtype):
    """oneDNN packs a half-precision weight only on CPUs with the instructions its path needs
    (float16 fails on an AVX-512 BF16 Zen 5, both on an AVX2 Zen 3); `packs_dtype` must say so
    beforehand, since a failed pack at load time ended the whole engine. A half-precision weight
    oneDNN cannot pack is packed widened to float32 instead."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.randn(8, 16).to(dtype), cpu_gemm.BATCH_HINT)
        packs = True
    except RuntimeError:
        packs = False
    assert cpu_gemm.packs_dtype(dtype) == packs
    assert cpu_gemm.packed_dtype(dtype) == (dtype if packs else torch.float32)
    assert cpu_gemm.can_pack(torch.randn(8, 16).to(dtype))
    assert cpu_gemm.pack(torch.randn(8, 16).to(dtype)).dtype == cpu_gemm.packed_dtype(dtype)


def _widen(monkeypatch, half: torch.dtype) -> None:
    """As on a CPU where oneDNN has no GEMM for `half` (bfloat16 on a Zen 3, float16 on a Zen 5):
    `half` weights are widened."""
    native = cpu_gemm.packs_dtype
    monkeypatch.setattr(cpu_gemm, "packs_dtype", lambda dtype: dtype != half and native(dtype))
    monkeypatch.setattr(cpu_gemm, "small_batch_rows", lambda: 0)  # its AVX-512 BF16 is not there either


HALVES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("rows", [1, 3, 64, 300])
def test_a_widened_linear_is_the_float32_product_rounded_once(rows, half, monkeypatch):
    """Half-precision inputs and weights, and their products, are exact in float32, so the widened
    GEMM is a half-precision GEMM with a float32 sum: the exact product and bias, rounded once to
    `half` (up to the sum's order)."""
    _widen(monkeypatch, half)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=generator).to(half)
    weight = (torch.randn(960, 576, generator=generator) * 0.05).to(half)
    bias = torch.randn(960, generator=generator).to(half)
    packed = cpu_gemm.pack(weight)
    assert packed.dtype == torch.float32
    ours = cpu_gemm.linear(x, packed, bias)
    assert ours.dtype == half and ours.shape == (rows, 960)
    exact = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    one_rounding = exact.abs() * UNIT_ROUNDOFF[half] + 1e-4
    assert ((ours.double() - exact).abs() <= one_rounding).all()


@pytest.mark.parametrize("half", HALVES)
def test_widening_is_switched_off_by_its_variable(half, monkeypatch):
    _widen(monkeypatch, half)
    monkeypatch.setenv(cpu_gemm.WIDENING_SWITCHES[half], "0")
    assert cpu_gemm.packed_dtype(half) is None
    assert not cpu_gemm.can_pack(torch.randn(8, 16).to(half))
    other = next(dtype for dtype in HALVES if dtype != half)  # each dtype has its own switch
    assert cpu_gemm.packed_dtype(other) is not None


@pytest.mark.parametrize("half", HALVES)
@torch.inference_mode()
def test_widened_forward_matches_plain(half, model_dirs, monkeypatch):
    """The whole model with widened layers: their half-precision copies freed, the LM head's kept
    (the embedding's), the same forward as F.linear's within half precision's rounding, prefill
    and decode."""
    _widen(monkeypatch, half)
    widened = build(model_dirs["llama"], half, max_positions=128)
    assert all(m.packed_weight.dtype == torch.float32 and m.weight.numel() == 0 for m in _linears(widened))
    assert widened.lm_head.packed_weight.dtype == torch.float32 and widened.lm_head.weight.numel() > 0
    monkeypatch.setattr(cpu_gemm, "can_pack", lambda weight: False)
    plain = build(model_dirs["llama"], half, max_positions=128)
    out = _forward(widened)
    assert out.dtype == half
    torch.testing.assert_close(out, _forward(plain), atol=6e-2, rtol=6e-2)
    decode = {"query_lens": (1, 1, 1), "context_lens": (30, 12, 7)}
    torch.testing.assert_close(_forward(widened, **decode), _forward(plain, **decode), atol=6e-2, rtol=6e-2)


def test_a_float16_model_runs_on_any_cpu(model_dirs):
    """Packed in float16 where oneDNN can, widened to float32 elsewhere: the model loads and greedy
    decoding gives Hugging Face's float16 tokens (the tiny model's margins are wide enough that
    float16 rounding flips none of these)."""
    from pagedserve import LLM, SamplingParams

    prompts = [[5, 17, 99, 230, 41], [300, 12, 7], list(range(20, 60))]
    hf = HFReference(model_dirs["llama"], torch.float16)
    llm = LLM(str(model_dirs["llama"]), dtype="float16", max_model_len=128)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, output in zip(prompts, outputs):
        assert list(output.outputs[0].token_ids) == hf.greedy(prompt, 8)


@pytest.mark.skipif(not cpu_gemm.packs_dtype(torch.bfloat16), reason="oneDNN packs no bfloat16 weight on this CPU (no AVX-512 BW/VL/DQ or AVX-NE-CONVERT)")
@torch.inference_mode()
def test_packed_bf16_forward_matches_plain(model_dirs, monkeypatch):
    packed = build(model_dirs["llama"], torch.bfloat16, max_positions=128)
    keeps_plain = cpu_gemm.small_batch_rows() > 0  # for the small-batch kernel
    assert all(m.packed_weight is not None and (m.weight.numel() > 0) == keeps_plain for m in _linears(packed))
    assert packed.lm_head.packed_weight is not None and packed.lm_head.weight.numel() > 0
    monkeypatch.setattr(cpu_gemm, "can_pack", lambda weight: False)
    plain = build(model_dirs["llama"], torch.bfloat16, max_positions=128)
    assert all(m.packed_weight is None for m in _linears(plain))
    torch.testing.assert_close(_forward(packed), _forward(plain), atol=6e-2, rtol=6e-2)
    # three decode rows: the small-batch kernel where it runs
    decode = {"query_lens": (1, 1, 1), "context_lens": (30, 12, 7)}
    torch.testing.assert_close(_forward(packed, **decode), _forward(plain, **decode), atol=6e-2, rtol=6e-2)


@pytest.mark.skipif(cpu_gemm.small_batch_rows() == 0, reason="no AVX-512 BF16 (or no compiler) here: oneDNN takes every batch")
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (576, 1536), (37, 100), (5, 31)])
def test_small_batch_kernel_matches_float32_within_a_rounding(rows, out_features, in_features):
    """The native kernel for 1-4 rows, with a bias, widths that are not a multiple of its 32-wide
    step, and input rows that are not contiguous with each other: the float32 product, rounded
    once to bfloat16."""
    generator = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = torch.randn(rows, in_features + 7, generator=generator).to(torch.bfloat16)[:, :in_features]  # row stride != width
    weight = (torch.randn(out_features, in_features, generator=generator) * 0.05).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=generator).to(torch.bfloat16)
    exact = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    ours = cpu_gemm.small_linear(x, weight, bias)  # whatever the start-up timing chose for `linear`
    one_rounding = exact.abs() * 2**-8 + 1e-4  # bfloat16 keeps 8 significant bits; float32 sums round too
    assert ((ours.float() - exact).abs() <= one_rounding).all()


@torch.inference_mode()
def test_packed_float32_forward_matches_plain(model_dirs, monkeypatch):
    """float32 runs on oneDNN too (MKL's float32 was 2-5x slower on a Zen 5): within float32's
    rounding of F.linear. Its LM head keeps the plain weight it shares with the embedding, and a
    decode step of a few rows must not take it to the bfloat16-only small-batch kernel."""
    packed = build(model_dirs["llama"], torch.float32, max_positions=128)
    assert all(m.packed_weight is not None and m.weight.numel() == 0 for m in _linears(packed))
    assert packed.lm_head.packed_weight is not None and packed.lm_head.weight.numel() > 0
    assert not packed.lm_head.plain_for_kernel
    monkeypatch.setattr(cpu_gemm, "can_pack", lambda weight: False)
    plain = build(model_dirs["llama"], torch.float32, max_positions=128)
    assert all(m.packed_weight is None for m in _linears(plain))
    torch.testing.assert_close(_forward(packed), _forward(plain), atol=1e-4, rtol=1e-4)
    decode = {"query_lens": (1, 1, 1), "context_lens": (30, 12, 7)}
    torch.testing.assert_close(_forward(packed, **decode), _forward(plain, **decode), atol=1e-4, rtol=1e-4)
