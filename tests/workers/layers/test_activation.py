"""workers/layers/activation.py: SiluAndMul of a merged [gate | up] projection."""

from __future__ import annotations

import torch

from pagedserve.workers.layers.activation import SiluAndMul


def test_silu_of_the_first_half_times_the_second():
    x = torch.tensor([[0.0, 1.0, -2.0, 3.0, 2.0, -1.0]])
    gate, up = x[:, :3], x[:, 3:]
    expected = gate / (1 + torch.exp(-gate)) * up
    out = SiluAndMul()(x.clone())
    assert out.shape == (1, 3)
    torch.testing.assert_close(out, expected)
    assert out[0, 0] == 0  # silu(0) = 0


def test_bfloat16_is_close_to_float32():
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(0))
    expected = SiluAndMul()(x.clone())
    out = SiluAndMul()(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and out.shape == (4, 64)
    torch.testing.assert_close(out.float(), expected, rtol=2**-7, atol=2**-7)
