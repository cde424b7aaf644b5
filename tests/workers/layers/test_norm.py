"""workers/layers/norm.py: RMSNorm's torch ops equal Hugging Face's LlamaRMSNorm bit for bit in
float32, the fused CPU pass is within float32's rounding of it, and the formula holds in every
dtype."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from pagedserve.kernels import cpu_native
from pagedserve.workers.layers import norm as norm_module
from pagedserve.workers.layers.norm import RMSNorm


def norm(hidden_size: int, eps: float, seed: int = 0) -> RMSNorm:
    layer = RMSNorm(hidden_size, eps)
    layer.weight.data.copy_(torch.rand(hidden_size, generator=torch.Generator().manual_seed(seed)) + 0.5)
    return layer


def _pair(hidden_size: int = 32):
    ours = norm(hidden_size, 1e-5)
    theirs = LlamaRMSNorm(hidden_size, eps=1e-5)
    theirs.weight.data.copy_(ours.weight.data)
    return ours, theirs, torch.randn(5, hidden_size, generator=torch.Generator().manual_seed(1)) * 3


def test_torch_ops_equal_hugging_face_in_float32(monkeypatch):
    """Without the fused kernels (not built, or switched off) the layer is Hugging Face's, bit for bit."""
    monkeypatch.setattr(norm_module, "fused_kernels", lambda x: None)
    ours, theirs, x = _pair()
    assert torch.equal(ours(x), theirs(x))


@pytest.mark.parametrize("hidden_size", [32, 576, 37])
def test_fused_float32_is_within_float32_rounding_of_hugging_face(hidden_size):
    """The fused pass sums the squares in another order and divides by a square root instead of
    torch's rsqrt: a few float32 ulps, as the packed GEMM differs from MKL's. The kernels must have
    built (a g++ is part of the test setup, as in test_cpu_native), so the fused pass is what runs."""
    ours, theirs, x = _pair(hidden_size)
    assert cpu_native.can_fuse(x), "the native CPU kernels did not build (g++ and torch's headers are needed)"
    torch.testing.assert_close(ours(x), theirs(x), rtol=4 * 2**-24, atol=1e-6)


def test_the_formula_and_the_epsilon():
    layer = norm(4, eps=0.5)
    x = torch.tensor([[1.0, -2.0, 3.0, 0.0]])
    rms = ((1 + 4 + 9 + 0) / 4 + 0.5) ** 0.5
    torch.testing.assert_close(layer(x), layer.weight * x / rms)
    assert layer(torch.zeros(1, 4)).abs().max() == 0  # eps keeps zero rows finite


def test_half_precision_output_keeps_its_dtype_and_is_close():
    layer = norm(64, 1e-6).to(torch.bfloat16)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    out = layer(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    expected = layer.weight.float() * (x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt())
    torch.testing.assert_close(out.float(), expected, rtol=2**-7, atol=2**-7)  # a few bf16 roundings
