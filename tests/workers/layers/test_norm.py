"""workers/layers/norm.py: RMSNorm equals Hugging Face's LlamaRMSNorm bit for bit in float32, and
the formula in every dtype."""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from pagedserve.workers.layers.norm import RMSNorm


def norm(hidden_size: int, eps: float, seed: int = 0) -> RMSNorm:
    layer = RMSNorm(hidden_size, eps)
    layer.weight.data.copy_(torch.rand(hidden_size, generator=torch.Generator().manual_seed(seed)) + 0.5)
    return layer


def test_equals_hugging_face_in_float32():
    ours = norm(32, 1e-5)
    theirs = LlamaRMSNorm(32, eps=1e-5)
    theirs.weight.data.copy_(ours.weight.data)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1)) * 3
    assert torch.equal(ours(x), theirs(x))


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
