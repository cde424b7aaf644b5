"""The Llama decoder layers on the CPU's native kernels, called one after another without the
module tree.

Each layer's eager forward is about a dozen module calls, each asking which kernel takes its input
(`fused_kernels`, `can_fuse`), whether the step has adapters, and how to shape its rows, and
reaching its weights through `nn.Module.__getattr__`. On a small CPU that Python took a quarter of a
one-row float32 decode step of SmolLM2 (about 9 of 33 ms on a 2-core Zen 3). Here those questions
are answered once: when the plan is made (which kernels, which weights) and once per step (no
adapter, a hidden state `cpu_native` fuses). Each layer then calls the kernels its modules would,
with the same arguments in the same order, so the results are the same bits
(tests/workers/test_native_layers.py holds them equal to the module path):
- a linear layer calls `cpu_gemm.linear` with its packed weight, bias and plain weight, as the
  module does (oneDNN's packed GEMM, the small-batch kernel for a few bf16 rows, the native GEMM,
  a widened half-precision weight); a float32 model's layers packed for the native GEMM alone
  call `cpu_gemm.native_gemm`, which `native_linear` calls for 2-D float32 rows;
- the norms, rotary embedding, KV cache write, attention and SiLU-and-multiply call `cpu_native`;
- on one rank, a float32 layer on the native GEMM adds the residual in the GEMM's store (o and down
  projections), and its MLP's gate and up products go through SiLU-and-multiply inside the GEMM
  (`cpu_gemm.native_gemm_silu_mul`): the same bits, without a pass over each product. On a 2-core
  Zen 3 the 60 adds and 30 SiLU-and-multiplies of a float32 128-token SmolLM2 prefill took 6 of
  222 ms beside the GEMMs' 199; fused, the MLP alone ran 5-14% faster and the forward 1-3%
  (`benchmarks/native_layers.py --epilogues`).

The plan exists for a model whose linear layers are all packed for the CPU (`pack_for_cpu`), with
the native attention backend and no per-head q/k norm (Qwen3); any other model, a step with
adapters, and torch.compile run the modules.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels import AttentionMetadata, backend, cpu_native
from pagedserve.workers.layers import cpu_gemm
from pagedserve.workers.layers.cpu_gemm import NativeWeight
from pagedserve.workers.lora.context import current_groups


class _Linear:
    """One packed linear layer's GEMM: its weights and bias, looked up once."""

    __slots__ = ("packed", "bias", "plain", "native", "all_reduce", "fuses_residual")

    def __init__(self, module: nn.Module, row_parallel: bool):
        self.packed, self.bias, self.plain = module.packed_weight, module.bias, module.weight
        # A float32 layer on the native GEMM with no plain copy: `cpu_gemm.linear` would only pass
        # its 2-D float32 rows on to `native_gemm`, so call that directly.
        self.native = isinstance(self.packed, NativeWeight) and module.weight.dtype == torch.float32 and module.weight.numel() == 0
        # Row-parallel layers sum their shards, then add the bias once (RowParallelLinear).
        self.all_reduce = module.parallel.all_reduce if row_parallel else None
        # Where no shards are summed, the native GEMM can add a residual in its store.
        self.fuses_residual = self.native and (not row_parallel or module.parallel.tp_size == 1)

    @staticmethod
    def eligible(module: nn.Module) -> bool:
        return module.packed_weight is not None

    def gemm(self, x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ bias); a `residual` (where `fuses_residual`) added in the native GEMM's store."""
        if self.native:
            return cpu_gemm.native_gemm(x, self.packed, bias, residual)
        return cpu_gemm.linear(x, self.packed, bias, self.plain)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.all_reduce is None:  # ColumnParallelLinear: the bias inside the GEMM
            return self.gemm(x, self.bias)
        out = self.all_reduce(self.gemm(x, None))
        return out + self.bias if self.bias is not None else out

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + self(x)."""
        if self.fuses_residual and residual.is_contiguous():  # one rank: the bias (if any) in the GEMM, as __call__ has it
            return self.gemm(x, self.bias, residual)
        return residual + self(x)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """SiLU-and-multiply of this merged gate and up projection's product, inside the native GEMM."""
        return cpu_gemm.native_gemm_silu_mul(x, self.packed)


class _Layer:
    """One decoder layer: its weights, shapes and attention module, looked up once."""

    def __init__(self, layer: nn.Module):
        attention, mlp = layer.self_attn, layer.mlp
        self.norm1 = (layer.input_layernorm.weight, layer.input_layernorm.eps)
        self.norm2 = (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
        self.qkv, self.o = _Linear(attention.qkv_proj, False), _Linear(attention.o_proj, True)
        self.gate_up, self.down = _Linear(mlp.gate_up_proj, False), _Linear(mlp.down_proj, True)
        # SiLU-and-multiply inside the GEMM: each panel of 16 features all gate or all up.
        self.fused_mlp = self.gate_up.native and self.gate_up.bias is None and self.gate_up.packed.out_features % 32 == 0
        self.attn = attention.attn  # its kv_cache is read each step: the runner may bind a new one
        self.split = [attention.qkv_proj.q_size, attention.qkv_proj.kv_size, attention.qkv_proj.kv_size]
        self.heads, self.kv_heads, self.head_dim = self.attn.num_heads, self.attn.num_kv_heads, self.attn.head_dim
        self.scale = self.attn.scale
        self.cos, self.sin = attention.rotary.cos, attention.rotary.sin

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, keep: torch.Tensor | None = None) -> torch.Tensor:
        """`keep`: only these rows past the attention, as LlamaDecoderLayer.forward."""
        rows, kv_cache = hidden.shape[0], self.attn.kv_cache
        q, k, v = self.qkv(cpu_native.rms_norm(hidden, *self.norm1)).split(self.split, dim=-1)
        q = cpu_native.rotary(q.reshape(rows, self.heads, self.head_dim), positions, self.cos, self.sin)
        k = cpu_native.rotary(k.reshape(rows, self.kv_heads, self.head_dim), positions, self.cos, self.sin)
        v = v.reshape(rows, self.kv_heads, self.head_dim)
        cpu_native.write_kv_cache(k, v, kv_cache, meta.slot_mapping)  # every row before any query reads
        out = cpu_native.paged_attention(q, k, v, kv_cache, meta, self.scale).view(rows, self.heads * self.head_dim)
        if keep is not None:
            out, hidden = out.index_select(0, keep), hidden.index_select(0, keep)
        hidden = self.o.add_to(hidden, out)
        normed = cpu_native.rms_norm(hidden, *self.norm2)
        if self.fused_mlp:
            return self.down.add_to(hidden, self.gate_up.silu_mul(normed))
        return self.down.add_to(hidden, cpu_native.silu_and_mul(self.gate_up(normed)))


class NativeLayers:
    """A stage's decoder layers on the native path, for the steps that can take it."""

    def __init__(self, layers: list[nn.Module]):
        self.layers = [_Layer(layer) for layer in layers]

    @classmethod
    def of(cls, layers: list[nn.Module]) -> NativeLayers | None:
        """The layers' native path, or None where a layer needs its modules (see the module doc)."""
        for layer in layers:
            attention, mlp = layer.self_attn, layer.mlp
            linears = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not all(_Linear.eligible(linear) for linear in linears):
                return None
            if attention.q_norm is not None or attention.attn.backend is not backend.NATIVE:
                return None
        return cls(layers)

    def takes(self, hidden: torch.Tensor) -> bool:
        """Whether this step runs here: no adapter in it, and a hidden state `cpu_native` fuses
        (the model's dtype). The caller has checked it is a real step."""
        return current_groups() is None and cpu_native.can_fuse(hidden)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, sampled_rows: torch.Tensor | None = None) -> torch.Tensor:
        """`sampled_rows`: the rows the last layer keeps past its attention (LlamaModel.forward)."""
        positions = positions.long().contiguous()  # once for every layer's rotary, not twice a layer
        for layer in self.layers[:-1]:
            hidden = layer.forward(hidden, positions, meta)
        return self.layers[-1].forward(hidden, positions, meta, sampled_rows)
