"""One layer's adapters added to a step's rows (workers/lora/layer_lora.add_lora): a long prefill
chunk's group, scattered decode rows, an adapter the layer lacks and the base model's rows, on the
native kernel in one call and on torch's path, every adapted row within rounding of float64 and
the others untouched."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pagedserve.workers.lora.context import LoRAGroups
from pagedserve.workers.lora.layer_lora import AdapterWeights, add_lora

IN, OUT = 64, 48


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_groups_of_one_step(dtype, path):
    gen = torch.Generator().manual_seed(0)
    big = 600  # a long prefill chunk
    # Adapter 1: one long prefill chunk; 2: scattered decode rows; 3: a row of an adapter this
    # layer lacks; 0: the base model.
    ids = np.array([1] * big + [2, 0, 2, 3, 0, 2], dtype=np.int64)
    groups = LoRAGroups.of(ids, torch.device("cpu"))
    assert groups.kernel_ids == [1, 2, 3]
    if path == "torch":  # as on a GPU
        groups = dataclasses.replace(groups, kernel_ids=[], kernel_rows=None)
    # Two projections, as a fused layer has: rank r on columns 0-19, r on columns 28-47; 20-27
    # belong to a projection the adapters do not target.
    weights = {}
    for lora_id, r in ((1, 8), (2, 16)):
        blocks = [(0, torch.randn(r, 20, generator=gen) * 0.2), (28, torch.randn(r, 20, generator=gen) * 0.2)]
        weights[lora_id] = AdapterWeights.build(torch.randn(IN, 2 * r, generator=gen) * 0.2, blocks)
    layer = SimpleNamespace(lora_weights=weights)
    x = torch.randn(len(ids), IN, generator=gen).to(dtype)
    out = torch.randn(len(ids), OUT, generator=gen).to(dtype)
    got = add_lora(layer, x, out.clone(), groups)
    eps = torch.finfo(dtype).eps
    for row, lora_id in enumerate(ids.tolist()):
        if lora_id not in weights:
            assert torch.equal(got[row], out[row]), f"row {row} (adapter {lora_id}) changed"
            continue
        assert torch.equal(got[row, 20:28], out[row, 20:28]), f"row {row}: an untargeted projection changed"
        a64 = weights[lora_id].a_t.double()
        b64 = torch.zeros(a64.shape[1], OUT, dtype=torch.float64)
        for index, (column, width, first, rank, _) in enumerate(weights[lora_id].parts):
            b64[first : first + rank, column : column + width] = weights[lora_id].b_t(index).double()
        exact = out[row].double() + (x[row].double() @ a64) @ b64
        magnitude = out[row].double().abs() + (x[row].double().abs() @ a64.abs()) @ b64.abs()
        # The torch path in bf16 rounds A, B, x A^T and the product once more each.
        bound = eps * exact.abs() + 4 * eps * magnitude
        assert ((got[row].double() - exact).abs() <= bound).all(), f"row {row} (adapter {lora_id})"
