"""pagedserve's own float32 GEMM (csrc/cpu_fp32_gemm.cpp), which cpu_gemm picks on CPUs with AVX2
but no AVX-512: within float32's rounding of the exact product for any shape (tails of its 6-row
and 16-column tiles, K split in blocks, a bias, strided rows); the same bits however K is split,
whatever a row is batched with and whichever thread computes it; the choice of GEMM as the
variable and the CPU say; and the whole model's forward on it, float32 and widened bfloat16. The
kernel runs on every x86 CPU the tests run on (AVX2 is older than AVX-512), so these force it
where `auto` would pick oneDNN. Its two epilogues (a residual added in the store, an MLP's
SiLU-and-multiply inside the GEMM) give the bits of the separate ops."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pagedserve.kernels import native_build
from pagedserve.workers.layers import cpu_gemm
from tests.kernels.paged_batch import UNIT_ROUNDOFF

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from cpu_forward import build  # noqa: E402  (the model as a CPU worker loads it)


@pytest.fixture(scope="module", autouse=True)
def kernels_built():
    """A compiler is part of the test setup, and every machine the suite runs on has AVX2 and FMA:
    a failed build fails these tests rather than skipping them."""
    assert native_build.load(), "the native CPU kernels did not build (see the log)"
    assert torch.ops.pagedserve_cpu.fp32_gemm_built(), "built without AVX2 and FMA"


@pytest.fixture
def native(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "_fp32_gemm", ["native"])


def _gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k_block: int = cpu_gemm.NATIVE_K_BLOCK) -> torch.Tensor:
    out = torch.empty(x.shape[0], weight.shape[0])
    torch.ops.pagedserve_cpu.fp32_gemm(out, x, torch.ops.pagedserve_cpu.fp32_gemm_pack(weight), bias, k_block)
    return out


def _assert_within_float32_rounding(ours: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """|ours - exact| <= K u sum_k |x_k w_k| (+ |bias| u): the bound of any order of a float32 sum."""
    exact = torch.nn.functional.linear(x.double(), weight.double(), None if bias is None else bias.double())
    magnitude = torch.nn.functional.linear(x.double().abs(), weight.double().abs(), None if bias is None else bias.double().abs())
    bound = (x.shape[1] + 1) * UNIT_ROUNDOFF[torch.float32] * magnitude
    assert ((ours.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 97, 200])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (17, 100), (16, 3), (1, 1), (33, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_native_gemm_is_the_product_within_float32_rounding(rows, out_features, in_features, with_bias):
    generator = torch.Generator().manual_seed(rows * 7919 + out_features * 31 + in_features)
    x = torch.randn(rows, in_features + 5, generator=generator)[:, :in_features]  # row stride != width
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    _assert_within_float32_rounding(_gemm(x, weight, bias), x, weight, bias)


@pytest.mark.parametrize("k_block", [1, 7, 64, 100])
def test_native_gemm_splits_a_long_input_dimension(k_block):
    """Past `k_block` the panels are swept once per block, each carrying on the sums the last left:
    still the product, and the bias added once."""
    generator = torch.Generator().manual_seed(k_block)
    x = torch.randn(13, 100, generator=generator)
    weight = torch.randn(40, 100, generator=generator) * 0.05
    bias = torch.randn(40, generator=generator)
    _assert_within_float32_rounding(_gemm(x, weight, bias, k_block), x, weight, bias)


def test_the_block_size_of_k_changes_no_bit():
    """Each output is one running sum over all of K, in full panels and the partial last one: the
    same bits whatever `k_block` splits K into, the bias added once at the end."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(13, 100, generator=generator)
    weight = torch.randn(40, 100, generator=generator) * 0.05  # two full panels and 8 features
    bias = torch.randn(40, generator=generator)
    whole = _gemm(x, weight, bias, 100)
    for k_block in (1, 7, 64, 99):
        assert torch.equal(_gemm(x, weight, bias, k_block), whole), k_block


def test_a_rows_result_does_not_depend_on_its_batch():
    """The same row alone, first, last or inside a batch of any size (across the 96-row blocks
    too): the same bits, so a sequence's greedy tokens cannot change with what it is batched with."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(70, 576, generator=generator) * 0.05
    batch = torch.randn(250, 576, generator=generator)
    panels = torch.ops.pagedserve_cpu.fp32_gemm_pack(weight)

    def run(x):
        out = torch.empty(x.shape[0], 70)
        torch.ops.pagedserve_cpu.fp32_gemm(out, x, panels, None, cpu_gemm.NATIVE_K_BLOCK)
        return out

    full = run(batch)
    for row in (0, 5, 96, 97, 249):
        assert torch.equal(run(batch[row : row + 1])[0], full[row])
        assert torch.equal(run(batch[max(0, row - 10) : row + 1])[-1], full[row])


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_sharing_panels_among_threads_changes_no_bit(threads):
    """Threads take panels from their own share and then from the others' (whichever finishes
    first): every output written once, by the same arithmetic, whoever computes it. More threads
    than cores (3 and 5 on the CI's two) keep some of them off a core mid-call, so panels are taken
    from shares whose owner is still working. The outputs start as NaN, so a panel no thread took
    would show (skipping the stolen panels fails this at 2, 3 and 5 threads)."""
    generator = torch.Generator().manual_seed(threads)
    cases = [(250, 70, 576, 2048), (7, 33, 100, 7), (200, 16, 40, 2048), (3, 960, 576, 256)]  # blocks of rows and of K, one panel
    previous = torch.get_num_threads()
    try:
        for rows, out_features, in_features, k_block in cases:
            x = torch.randn(rows, in_features, generator=generator)
            weight = torch.randn(out_features, in_features, generator=generator) * 0.05
            bias = torch.randn(out_features, generator=generator)
            panels = torch.ops.pagedserve_cpu.fp32_gemm_pack(weight)
            torch.set_num_threads(1)
            alone = _gemm(x, weight, bias, k_block)
            torch.set_num_threads(threads)
            for _ in range(20):
                out = torch.full((rows, out_features), float("nan"))
                torch.ops.pagedserve_cpu.fp32_gemm(out, x, panels, bias, k_block)
                assert torch.equal(out, alone), (rows, out_features, in_features, k_block)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("rows", [1, 2, 7, 97, 200])
@pytest.mark.parametrize("out_features,in_features,k_block", [(576, 576, 2048), (40, 100, 7), (1, 3, 2048)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_residual_added_in_the_store_is_the_separate_add(rows, out_features, in_features, k_block, with_bias):
    """`residual + (x W^T + bias)` to the bit, added once after the last block of K (a residual
    added to every block's partial sums would show), in the partial last panel too."""
    generator = torch.Generator().manual_seed(rows * 31 + out_features + k_block)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    residual = torch.randn(rows, out_features, generator=generator)
    out = torch.full((rows, out_features), float("nan"))
    torch.ops.pagedserve_cpu.fp32_gemm(out, x, torch.ops.pagedserve_cpu.fp32_gemm_pack(weight), bias, k_block, residual)
    assert torch.equal(out, residual + _gemm(x, weight, bias, k_block))


def _silu_mul(x: torch.Tensor, weight: torch.Tensor, k_block: int = cpu_gemm.NATIVE_K_BLOCK) -> torch.Tensor:
    out = torch.full((x.shape[0], weight.shape[0] // 2), float("nan"))
    torch.ops.pagedserve_cpu.fp32_gemm_silu_mul(out, x, torch.ops.pagedserve_cpu.fp32_gemm_pack(weight), k_block)
    return out


@pytest.mark.parametrize("rows", [1, 2, 6, 97, 200])
@pytest.mark.parametrize("intermediate,in_features,k_block", [(1536, 576, 2048), (48, 100, 7), (16, 3, 2048)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_fused_silu_and_multiply_is_the_two_ops(rows, intermediate, in_features, k_block, threads):
    """The gate and up products and SiLU-and-multiply of an MLP's merged weight in one op: the
    bits of the GEMM then `silu_and_mul`, over blocks of rows and of K, whichever thread takes a
    pair of panels (every output starts as NaN: a pair no thread took would show)."""
    from pagedserve.kernels import cpu_native

    generator = torch.Generator().manual_seed(rows + intermediate + threads)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(2 * intermediate, in_features, generator=generator) * 0.3
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        expected = cpu_native.silu_and_mul(_gemm(x, weight, None, k_block))
        for _ in range(3):
            assert torch.equal(_silu_mul(x, weight, k_block), expected)
    finally:
        torch.set_num_threads(previous)


def test_the_fused_epilogues_refuse_what_they_cannot_take():
    ops = torch.ops.pagedserve_cpu
    x, panels = torch.randn(3, 8), ops.fp32_gemm_pack(torch.randn(40, 8))
    with pytest.raises(RuntimeError, match="intermediate size must be a multiple of 16"):
        ops.fp32_gemm_silu_mul(torch.empty(3, 20), x, panels, 2048)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        ops.fp32_gemm_silu_mul(torch.empty(3, 32), x, panels, 2048)
    out = torch.empty(3, 40)
    with pytest.raises(RuntimeError, match=r"residual \[rows, out\] float32, contiguous, not out itself"):
        ops.fp32_gemm(out, x, panels, None, 2048, out)
    with pytest.raises(RuntimeError, match="residual"):
        ops.fp32_gemm(out, x, panels, None, 2048, torch.randn(3, 41))


def test_pack_and_linear_take_the_native_gemm_when_chosen(native):
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(50, 64, generator=generator)
    packed = cpu_gemm.pack(weight)
    assert isinstance(packed, cpu_gemm.NativeWeight) and packed.dtype == torch.float32 and packed.out_features == 50
    x = torch.randn(2, 3, 64, generator=generator)  # any leading shape
    out = cpu_gemm.linear(x, packed, None)
    assert out.shape == (2, 3, 50)
    assert torch.equal(out.reshape(6, 50), _gemm(x.reshape(6, 64), weight, None))
    assert cpu_gemm.linear(torch.empty(0, 64), packed, None).shape == (0, 50)


def test_a_widened_half_layer_on_the_native_gemm_rounds_once(native, monkeypatch):
    """bfloat16 packed as float32 (as on a Zen 3): the float32 result of the same values, rounded
    to bfloat16 once."""
    monkeypatch.setattr(cpu_gemm, "packs_dtype", lambda dtype: dtype == torch.float32)
    monkeypatch.setattr(cpu_gemm, "small_batch_rows", lambda: 0)
    generator = torch.Generator().manual_seed(2)
    weight = (torch.randn(40, 96, generator=generator) * 0.05).to(torch.bfloat16)
    bias = torch.randn(40, generator=generator).to(torch.bfloat16)
    x = torch.randn(9, 96, generator=generator).to(torch.bfloat16)
    packed = cpu_gemm.pack(weight)
    assert isinstance(packed, cpu_gemm.NativeWeight)
    ours = cpu_gemm.linear(x, packed, bias)
    assert ours.dtype == torch.bfloat16
    assert torch.equal(ours, _gemm(x.float(), weight.float(), bias.float()).to(torch.bfloat16))


@pytest.mark.parametrize("value, expected", [("native", "native"), ("onednn", "onednn"), (" OneDNN ", "onednn")])
def test_the_variable_chooses_the_gemm(value, expected, monkeypatch):
    monkeypatch.setattr(cpu_gemm, "_fp32_gemm", [])
    monkeypatch.setenv(cpu_gemm.ENV_FP32_GEMM, value)
    assert cpu_gemm.fp32_gemm() == expected


AVX512 = frozenset({"avx512", "avx512_bf16"})


@pytest.mark.parametrize(
    "paths, cpu, expected",
    [
        (frozenset({"avx2"}), ("AuthenticAMD", 25), "native"),  # Zen 3
        (frozenset({"avx2"}), ("GenuineIntel", 6), "native"),
        (AVX512, ("AuthenticAMD", 25), "native"),  # Zen 4: AVX-512 in two halves
        (AVX512, ("AuthenticAMD", 26), "onednn"),  # Zen 5: full width
        (AVX512, ("GenuineIntel", 6), "onednn"),
        (AVX512, ("", None), "onednn"),  # /proc/cpuinfo does not say
    ],
)
def test_auto_takes_the_native_gemm_without_full_width_avx512(paths, cpu, expected, monkeypatch):
    """Measured, the native GEMM was faster on a Zen 3 (AVX2 only) and on a Zen 4 (AVX-512 in two
    256-bit halves); with full-width AVX-512, oneDNN's uses it."""
    monkeypatch.delenv(cpu_gemm.ENV_FP32_GEMM, raising=False)
    monkeypatch.setattr(cpu_gemm, "_fp32_gemm", [])
    monkeypatch.setattr(native_build, "compiled_paths", lambda: paths)
    monkeypatch.setattr(native_build, "cpu_vendor_family", lambda: cpu)
    assert cpu_gemm.fp32_gemm() == expected


def test_the_cpu_is_read_from_cpuinfo():
    vendor, family = native_build.cpu_vendor_family()
    text = Path("/proc/cpuinfo").read_text()
    assert f"vendor_id\t: {vendor}" in text and f"cpu family\t: {family}" in text


def test_an_unknown_choice_says_what_is_allowed(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "_fp32_gemm", [])
    monkeypatch.setenv(cpu_gemm.ENV_FP32_GEMM, "mkl")
    with pytest.raises(ValueError, match="PAGEDSERVE_FP32_GEMM='mkl': expected one of auto, native, onednn"):
        cpu_gemm.fp32_gemm()


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 6e-2)])
@torch.inference_mode()
def test_the_model_on_the_native_gemm_matches_plain(dtype, tolerance, model_dirs, native, monkeypatch):
    """Every linear and the LM head on the native GEMM (bfloat16 widened), prefill and decode,
    against F.linear's forward."""
    from tests.workers.test_cpu_gemm import _forward, _linears

    if dtype != torch.float32:
        monkeypatch.setattr(cpu_gemm, "packs_dtype", lambda d: d == torch.float32)
        monkeypatch.setattr(cpu_gemm, "small_batch_rows", lambda: 0)
    packed = build(model_dirs["llama"], dtype, max_positions=128)
    assert all(isinstance(m.packed_weight, cpu_gemm.NativeWeight) for m in [*_linears(packed), packed.lm_head])
    monkeypatch.setattr(cpu_gemm, "can_pack", lambda weight: False)
    plain = build(model_dirs["llama"], dtype, max_positions=128)
    torch.testing.assert_close(_forward(packed), _forward(plain), atol=tolerance, rtol=tolerance)
    decode = {"query_lens": (1, 1, 1), "context_lens": (30, 12, 7)}
    torch.testing.assert_close(_forward(packed, **decode), _forward(plain, **decode), atol=tolerance, rtol=tolerance)
