"""Torch's low-rank product of one adapter's rows (workers/lora/layer_lora.add_low_rank): in
float32 for the few rows of a decode step, in the activations' dtype for a larger group, within
one rounding of the float64 product either way; float32 activations take float32 throughout (the
exactness tests)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.workers.lora.layer_lora import FLOAT32_MAX_ROWS, AdapterWeights, add_low_rank


@pytest.mark.parametrize("rows", [1, FLOAT32_MAX_ROWS, FLOAT32_MAX_ROWS + 1, 200])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_product_is_within_a_rounding_of_float64(rows, dtype):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=generator).to(dtype)
    a, b = torch.randn(8, 96, generator=generator) * 0.1, torch.randn(40, 8, generator=generator) * 0.1
    got = torch.zeros(rows, 40, dtype=dtype)
    add_low_rank(got, slice(None), x, AdapterWeights.build(a.t().contiguous(), [(0, b.t().contiguous())]))
    assert got.dtype == dtype and got.shape == (rows, 40)
    exact = (x.double() @ a.double().t()) @ b.double().t()
    magnitude = (x.double().abs() @ a.double().abs().t()) @ b.double().abs().t()  # bounds what rounding can move
    eps, eps32 = torch.finfo(dtype).eps, torch.finfo(torch.float32).eps
    if dtype == torch.float32 or rows <= FLOAT32_MAX_ROWS:
        # float32 throughout, then one rounding to the activations' dtype at the end.
        bound = eps * exact.abs() + 2 * (96 + 8) * eps32 * magnitude
    else:
        # In the activations' dtype: A, B and x A^T each rounded once more.
        bound = eps * exact.abs() + 2 * eps * magnitude
    assert ((got.double() - exact).abs() <= bound).all()
