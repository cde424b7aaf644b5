"""workers/layers/linear.py: each tensor-parallel rank loads its own slice of a checkpoint
tensor, and the ranks' outputs (concatenated for column-parallel, summed for row-parallel) equal
the whole layer. The ranks run in turn in this process (fake_parallel.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.workers.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from pagedserve.workers.parallel_state import ParallelContext
from tests.workers.layers.fake_parallel import ranks

GEN = torch.Generator().manual_seed(0)


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN)


def load(layer, name: str, tensor: torch.Tensor, shard_id=None) -> None:
    param = getattr(layer, name)
    param.weight_loader(param, tensor, shard_id)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_column_parallel_ranks_hold_row_slices_and_concatenate_to_the_whole(tp_size):
    weight, bias, x = randn(8, 6), randn(8), randn(3, 6)
    outputs = []
    for parallel in ranks(tp_size):
        layer = ColumnParallelLinear(6, 8, bias=True, parallel=parallel)
        assert layer.weight.shape == (8 // tp_size, 6)
        load(layer, "weight", weight)
        load(layer, "bias", bias)
        outputs.append(layer(x))
    torch.testing.assert_close(torch.cat(outputs, dim=-1), F.linear(x, weight, bias))


@pytest.mark.parametrize("tp_size", [1, 2])
def test_row_parallel_sums_partials_and_adds_the_bias_once(tp_size):
    weight, bias, x = randn(5, 8), randn(5), randn(3, 8)
    contexts = ranks(tp_size)
    for parallel in contexts:
        layer = RowParallelLinear(8, 5, bias=True, parallel=parallel)
        assert layer.weight.shape == (5, 8 // tp_size)
        load(layer, "weight", weight)
        load(layer, "bias", bias)
        width = 8 // tp_size
        out = layer(x[:, parallel.tp_rank * width : (parallel.tp_rank + 1) * width])  # its input shard
        torch.testing.assert_close(out, contexts[0].group.reduced[parallel.tp_rank] + bias)
    total = sum(contexts[0].group.reduced.values())  # what the all-reduce makes of the partials
    torch.testing.assert_close(total + bias, F.linear(x, weight, bias))


def test_merged_gate_and_up_each_split_by_rank():
    gate, up, x = randn(6, 4), randn(6, 4), randn(2, 4)
    for parallel in ranks(2):
        layer = MergedColumnParallelLinear(4, [6, 6], bias=False, parallel=parallel)
        assert layer.output_sizes == [3, 3] and layer.weight.shape == (6, 4)
        load(layer, "weight", gate, 0)
        load(layer, "weight", up, 1)
        rows = slice(3 * parallel.tp_rank, 3 * parallel.tp_rank + 3)
        assert torch.equal(layer.weight[:3], gate[rows]) and torch.equal(layer.weight[3:], up[rows])
        torch.testing.assert_close(layer(x), torch.cat([x @ gate[rows].T, x @ up[rows].T], dim=-1))


def qkv_weights(num_heads: int, num_kv_heads: int, head_dim: int, hidden: int):
    return randn(num_heads * head_dim, hidden), randn(num_kv_heads * head_dim, hidden), randn(num_kv_heads * head_dim, hidden)


def test_qkv_split_by_heads():
    head_dim, hidden = 2, 4
    q, k, v = qkv_weights(4, 2, head_dim, hidden)
    for parallel in ranks(2):
        layer = QKVParallelLinear(hidden, head_dim, num_heads=4, num_kv_heads=2, bias=False, parallel=parallel)
        assert (layer.num_heads, layer.num_kv_heads, layer.kv_replicas) == (2, 1, 1)
        assert (layer.q_size, layer.kv_size) == (4, 2) and layer.weight.shape == (8, hidden)
        for name, tensor in (("q", q), ("k", k), ("v", v)):
            load(layer, "weight", tensor, name)
        r = parallel.tp_rank
        assert torch.equal(layer.weight[:4], q[4 * r : 4 * r + 4])
        assert torch.equal(layer.weight[4:6], k[2 * r : 2 * r + 2])
        assert torch.equal(layer.weight[6:], v[2 * r : 2 * r + 2])


def test_qkv_replicates_kv_heads_when_ranks_outnumber_them():
    head_dim, hidden = 2, 4
    q, k, v = qkv_weights(4, 2, head_dim, hidden)
    kv_rows = []
    for parallel in ranks(4):
        layer = QKVParallelLinear(hidden, head_dim, num_heads=4, num_kv_heads=2, bias=False, parallel=parallel)
        assert (layer.num_heads, layer.num_kv_heads, layer.kv_replicas) == (1, 1, 2)
        for name, tensor in (("q", q), ("k", k), ("v", v)):
            load(layer, "weight", tensor, name)
        assert torch.equal(layer.weight[:2], q[2 * parallel.tp_rank : 2 * parallel.tp_rank + 2])
        kv_rows.append(layer.weight[2:4])
    # ranks 0 and 1 share KV head 0, ranks 2 and 3 KV head 1
    assert torch.equal(kv_rows[0], k[0:2]) and torch.equal(kv_rows[1], k[0:2])
    assert torch.equal(kv_rows[2], k[2:4]) and torch.equal(kv_rows[3], k[2:4])


def test_sizes_that_do_not_divide_name_what_does_not():
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\) is not divisible by tensor_parallel_size \(4\)"):
        QKVParallelLinear(8, 2, num_heads=6, num_kv_heads=2, bias=False, parallel=ParallelContext(tp_size=4))
    with pytest.raises(ValueError, match=r"num_key_value_heads \(3\) is not divisible by tensor_parallel_size \(2\)"):
        QKVParallelLinear(8, 2, num_heads=4, num_kv_heads=3, bias=False, parallel=ParallelContext(tp_size=2))
    with pytest.raises(ValueError, match=r"output size \(5\) is not divisible"):
        ColumnParallelLinear(4, 5, bias=False, parallel=ParallelContext(tp_size=2))


def test_default_loader_refuses_a_checkpoint_of_another_shape():
    param = torch.nn.Parameter(torch.empty(3, 2), requires_grad=False)
    with pytest.raises(ValueError, match=r"checkpoint shape \(2, 3\) != parameter shape \(3, 2\)"):
        default_weight_loader(param, torch.zeros(2, 3))
    default_weight_loader(param, torch.ones(3, 2))
    assert torch.equal(param, torch.ones(3, 2))
