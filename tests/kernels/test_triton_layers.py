"""The CUDA path's fused layers (kernels/triton_layers), in every float dtype, on random inputs
and on strided views like the ones the model passes: RMSNorm and SiLU-and-mul against the same
layers' torch path (Hugging Face's roundings), the rotation against float32 rounded once (the
CPU's fused kernel's contract). Without CUDA they run in Triton's interpreter
(tests/kernels/conftest.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pagedserve.kernels import cpu_native, cuda_layers, triton_layers  # noqa: E402
from pagedserve.kernels.triton_attention import IS_INTERPRETED  # noqa: E402
from pagedserve.workers.layers.activation import SiluAndMul  # noqa: E402
from pagedserve.workers.layers.norm import RMSNorm  # noqa: E402
from pagedserve.workers.layers.rotary import RotaryEmbedding  # noqa: E402
from pagedserve.workers.layers.rotary import _rotate  # noqa: E402
from tests.kernels.conftest import DEVICE  # noqa: E402
from tests.kernels.paged_batch import assert_rounded  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture
def torch_path(monkeypatch):
    """The layers' own torch ops: both fused paths switched off."""
    monkeypatch.setattr(cpu_native, "can_fuse", lambda x: False)
    monkeypatch.setattr(cuda_layers, "can_fuse", lambda x: False)


def assert_same_roundings(ours: torch.Tensor, reference: torch.Tensor) -> None:
    """The kernels round where torch rounds, so in half precision the outputs are equal bit for
    bit nearly everywhere, and elsewhere one rounding apart (a float32 sum or exp taken in another
    order moves a value across a rounding boundary, rarely). In float32 that order is all there
    is: a few units in the last place. The interpreter's casts to bfloat16 truncate instead of
    rounding, at each of the kernels' two roundings: there, a few units of the values' scale and
    no bitwise claim."""
    assert ours.dtype == reference.dtype and ours.shape == reference.shape
    dtype, eps = ours.dtype, torch.finfo(ours.dtype).eps
    ours, reference = ours.float(), reference.float()
    scale = reference.abs().max().item()
    if dtype == torch.float32:
        torch.testing.assert_close(ours, reference, rtol=8 * eps, atol=8 * eps * scale)
    elif IS_INTERPRETED and dtype == torch.bfloat16:
        torch.testing.assert_close(ours, reference, rtol=2 * eps, atol=3 * eps * scale)
    else:
        torch.testing.assert_close(ours, reference, rtol=2 * eps, atol=eps * 1e-2)
        assert (ours == reference).float().mean() > 0.97


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden", [(1, 64), (7, 576), (33, 2048), (3, 100)])
def test_rms_norm(torch_path, dtype, rows, hidden):
    gen = torch.Generator().manual_seed(rows * hidden)
    layer = RMSNorm(hidden, 1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(hidden, generator=gen) * 0.5 + 1)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(DEVICE, dtype)
    assert_same_roundings(triton_layers.rms_norm(x, layer.weight, layer.eps), layer(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 64), (9, 3, 128), (5, 1, 48)])
def test_rotary_on_views_of_the_qkv_projection(torch_path, dtype, heads, kv_heads, head_dim):
    """q and k as the attention layer slices them out of one qkv row: strided token rows. On an
    H200 a kernel that rounded after each op, as torch does, missed torch's bf16 and fp16 values
    by more than a rounding (the cause was not found in the time the GPU was lent); this kernel
    rounds once and is held to that."""
    gen = torch.Generator().manual_seed(heads * head_dim)
    rope = RotaryEmbedding(head_dim, 4096, {"rope_type": "default", "rope_theta": 10000.0}).to(DEVICE)
    tokens = 11
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(DEVICE, dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 4096, (tokens,), generator=gen).to(DEVICE)
    before = qkv.clone()
    cos, sin = rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1)
    for x in (q, k):
        ours = triton_layers.rotary(x, positions, rope.cos, rope.sin)
        expected = _rotate(x.float(), cos, sin)
        assert ours.dtype == dtype and ours.shape == x.shape
        if dtype == torch.float32:
            torch.testing.assert_close(ours, expected, rtol=0, atol=4e-6)  # an FMA moves a product's rounding
        else:  # the interpreter's bfloat16 casts truncate: up to a whole ulp
            assert_rounded(ours, expected, dtype, roundings=2 if IS_INTERPRETED and dtype == torch.bfloat16 else 1)
        # The torch layer (three roundings) is within three roundings of the values' scale of it.
        scale = x.float().abs().max().item()
        torch.testing.assert_close(ours.float(), rope(positions, x, x)[0].float(), rtol=0, atol=3 * torch.finfo(dtype).eps * scale)
    assert torch.equal(qkv, before)  # new tensors: the projection's output is left alone


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, width", [(1, 64), (5, 1536), (2, 2 * 1100), (17, 2 * 8192)])
def test_silu_and_mul(torch_path, dtype, rows, width):
    gen = torch.Generator().manual_seed(rows + width)
    x = (torch.randn(rows, width, generator=gen) * 4).to(DEVICE, dtype)
    assert_same_roundings(triton_layers.silu_and_mul(x), SiluAndMul()(x))


def test_empty_batches():
    x = torch.empty(0, 64, device=DEVICE)
    assert triton_layers.rms_norm(x, torch.ones(64, device=DEVICE), 1e-6).shape == (0, 64)
    assert triton_layers.silu_and_mul(x).shape == (0, 32)
    table = torch.zeros(8, 8, device=DEVICE)
    assert triton_layers.rotary(torch.empty(0, 2, 16, device=DEVICE), torch.empty(0, dtype=torch.long, device=DEVICE),
                                table, table).shape == (0, 2, 16)


def test_the_layers_take_the_fused_kernels_on_cuda_only():
    cpu = torch.zeros(2, 4)
    assert not cuda_layers.can_fuse(cpu)
    if torch.cuda.is_available():
        assert cuda_layers.can_fuse(cpu.cuda())
