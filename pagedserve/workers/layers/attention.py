"""The attention layer: write this step's K/V into the paged cache, then attend over it.

A step's `AttentionMetadata` does not travel down the layers as an argument: the model sets it
for the duration of one forward pass (`forward_context`) and each layer reads it there. That keeps
the per-step host lists out of a compiled graph's inputs (guarding on them would recompile every
step): under `torch.compile` the layer calls the opaque custom op `pagedserve::attention`, which
the compiler treats as one call whose output has the query's shape, and the op finds the step's
metadata and its layer (the cache it writes) through the same context.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels import AttentionBackend, AttentionMetadata


@dataclass(frozen=True)
class ForwardContext:
    meta: AttentionMetadata | None  # None before the cache exists (the memory-profiling pass)
    layers: dict[int, Attention]  # by layer index: the custom op's way back to its layer's cache


_forward_context: ContextVar[ForwardContext | None] = ContextVar("pagedserve_forward_context", default=None)


@contextmanager
def forward_context(meta: AttentionMetadata | None, layers: dict[int, Attention]) -> Iterator[None]:
    """The step's metadata, readable by every attention layer until the block exits."""
    token = _forward_context.set(ForwardContext(meta, layers))
    try:
        yield
    finally:
        _forward_context.reset(token)


def current_meta() -> AttentionMetadata | None:
    """The step's metadata, or None outside a step (no forward_context, or the profiling pass)."""
    context = _forward_context.get()
    return context.meta if context is not None else None


def current_context() -> ForwardContext:
    context = _forward_context.get()
    if context is None:
        raise RuntimeError("attention ran outside forward_context(): the model sets it around each forward pass")
    return context


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, backend: AttentionBackend, layer_index: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.backend = backend
        self.layer_index = layer_index
        # This layer's keys and values in the backend's layout, bound by the model runner once
        # the cache is sized.
        self.kv_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.pagedserve.attention(q, k, v, self.layer_index)
        return self.attend(q, k, v, current_context().meta)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata | None) -> torch.Tensor:
        """[num_tokens, num_heads * head_dim] attention output of this step's q, k, v."""
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if meta is None:  # memory profiling, or compiling (workers/compile.py): no cache to use yet
            return self._profile_attention(q, k, v)
        # Every K/V of the step is written before any query reads: a request may hit prefix-cache
        # blocks that another request of the same step is filling.
        self.backend.write_kv_cache(k, v, self.kv_cache, meta.slot_mapping)
        out = self.backend.paged_attention(q, k, v, self.kv_cache, meta, self.scale)
        return out.reshape(-1, self.num_heads * self.head_dim)

    def _profile_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Before the cache exists (memory profiling): the whole batch as one causal sequence."""
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=self.scale, enable_gqa=True
        )
        return out.transpose(0, 1).reshape(-1, self.num_heads * self.head_dim)


# The cache write is a side effect the compiler does not see: the op reaches the cache through its
# layer, and nothing in the graph reads the cache, so no functionalization copy of it is made.
@torch.library.custom_op("pagedserve::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_index: int) -> torch.Tensor:
    context = current_context()
    layer, meta = context.layers[layer_index], context.meta
    num_tokens = meta.num_tokens if meta is not None else q.shape[0]  # no metadata: the warm-up's pass
    if q.shape[0] == num_tokens:
        return layer.attend(q, k, v, context.meta)  # a fresh tensor: no aliasing
    # A compiled step padded past its real tokens (workers/compile.py): padding rows write no
    # cache slot and attend to nothing.
    out = q.new_zeros(q.shape[0], q.shape[1] * q.shape[2])
    out[:num_tokens] = layer.attend(q[:num_tokens], k[:num_tokens], v[:num_tokens], context.meta)
    return out


@attention_op.register_fake
def _attention_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_index: int) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])  # q: [num_tokens, num_heads, head_dim]
