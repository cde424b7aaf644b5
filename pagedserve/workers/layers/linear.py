"""Megatron-style linear layers that are plain `nn.Linear`s at tensor-parallel size 1.

Each parameter carries a `weight_loader(param, loaded, shard_id=None)` that copies this rank's
slice out of a checkpoint tensor. `loaded` is a torch tensor or a safetensors slice: both index
with `[a:b]` and `[:, a:b]`, and a safetensors slice reads only the rows asked for, so no rank
ever holds more of the model than its own shard.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.workers.layers import cpu_gemm
from pagedserve.workers.lora.context import current_groups
from pagedserve.workers.lora.layer_lora import AdapterWeights, add_lora
from pagedserve.workers.parallel_state import ParallelContext, divide


def new_parameter(*shape: int, loader: Any) -> nn.Parameter:
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader = loader
    return param


def copy_rows(param: torch.Tensor, loaded: Any, start: int, size: int, offset: int = 0) -> None:
    """param[offset:offset+size] = loaded[start:start+size] (dim 0)."""
    param.data[offset : offset + size].copy_(loaded[start : start + size])


def default_weight_loader(param: torch.Tensor, loaded: Any, shard_id: Any = None) -> None:
    tensor = loaded[:]
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(f"checkpoint shape {tuple(tensor.shape)} != parameter shape {tuple(param.shape)}")
    param.data.copy_(tensor)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's rows (output features) split across TP ranks. No communication."""

    def __init__(self, input_size: int, output_size: int, bias: bool, parallel: ParallelContext):
        super().__init__()
        self.parallel = parallel
        self.output_size_per_rank = divide(output_size, parallel.tp_size, "output size")
        self.weight = new_parameter(self.output_size_per_rank, input_size, loader=self.weight_loader)
        self.bias = new_parameter(self.output_size_per_rank, loader=self.weight_loader) if bias else None
        self.packed_weight: torch.Tensor | None = None
        self.lora_weights: dict[int, AdapterWeights] = {}  # lora_int_id -> this rank's share

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: Any = None) -> None:
        size = self.output_size_per_rank
        copy_rows(param, loaded, self.parallel.tp_rank * size, size)

    def pack_for_cpu(self) -> bool:
        return pack_weight(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            out = cpu_gemm.linear(x, self.packed_weight, self.bias, self.weight)
        else:
            out = F.linear(x, self.weight, self.bias)
        return _with_lora(self, x, out)


def _with_lora(layer: nn.Module, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`out` plus the step's adapters' low-rank products, if the step has any for this layer."""
    groups = current_groups() if layer.lora_weights else None
    return out if groups is None else add_lora(layer, x, out, groups)


def pack_weight(layer: nn.Module) -> bool:
    """After loading: the layer's weight in oneDNN's layout (cpu_gemm). The plain copy is freed
    unless the small-batch kernel reads it (cpu_gemm.keeps_plain)."""
    if not cpu_gemm.can_pack(layer.weight):
        return False
    layer.packed_weight = cpu_gemm.pack(layer.weight)
    if not cpu_gemm.keeps_plain(layer.weight):
        layer.weight.data = layer.weight.data.new_empty(0)  # only the packed copy is read from now on
    return True


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one matmul (gate and up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, parallel: ParallelContext):
        self.output_sizes = [divide(size, parallel.tp_size, "output size") for size in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias, parallel)

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: Any = None) -> None:
        size = self.output_sizes[shard_id]
        offset = sum(self.output_sizes[:shard_id])
        copy_rows(param, loaded, self.parallel.tp_rank * size, size, offset)


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V in one matmul, split by heads. With more TP ranks than KV heads, each KV head is
    replicated on `tp_size / num_kv_heads` ranks."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool, parallel: ParallelContext
    ):
        tp = parallel.tp_size
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp, "num_attention_heads")
        if tp >= num_kv_heads:
            self.kv_replicas = divide(tp, num_kv_heads, "tensor_parallel_size over num_key_value_heads")
            self.num_kv_heads = 1
        else:
            self.kv_replicas = 1
            self.num_kv_heads = divide(num_kv_heads, tp, "num_key_value_heads")
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden_size, output_size, bias, parallel)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: Any = None) -> None:
        rank = self.parallel.tp_rank
        if shard_id == "q":
            copy_rows(param, loaded, rank * self.q_size, self.q_size)
            return
        kv_rank = rank // self.kv_replicas
        offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
        copy_rows(param, loaded, kv_rank * self.kv_size, self.kv_size, offset)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's columns (input features) split across TP ranks; the partial
    products are summed with an all-reduce, and the bias is added once, after it."""

    def __init__(self, input_size: int, output_size: int, bias: bool, parallel: ParallelContext):
        super().__init__()
        self.parallel = parallel
        self.input_size_per_rank = divide(input_size, parallel.tp_size, "input size")
        self.weight = new_parameter(output_size, self.input_size_per_rank, loader=self.weight_loader)
        self.bias = new_parameter(output_size, loader=default_weight_loader) if bias else None
        self.packed_weight: torch.Tensor | None = None
        self.lora_weights: dict[int, AdapterWeights] = {}  # lora_int_id -> this rank's share

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: Any = None) -> None:
        size = self.input_size_per_rank
        start = self.parallel.tp_rank * size
        param.data.copy_(loaded[:, start : start + size])

    def pack_for_cpu(self) -> bool:
        return pack_weight(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight) if self.packed_weight is None else cpu_gemm.linear(x, self.packed_weight, None, self.weight)
        out = self.parallel.all_reduce(_with_lora(self, x, partial))  # (the shards' products sum as the base's)
        return out + self.bias if self.bias is not None else out
