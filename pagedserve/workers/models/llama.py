"""The Llama family: Llama, Mistral, Qwen2 (QKV bias) and Qwen3 (per-head q/k RMSNorm).

One decoder serves all four; `DecoderOptions` names what differs. Layers follow Hugging Face's
order of operations so float32 results match it. With pipeline parallelism a stage holds only its
own layers (keyed by their global index, so checkpoint names map unchanged); the first stage holds
the embedding, the last the final norm and LM head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn

from pagedserve.kernels import AttentionBackend, AttentionMetadata
from pagedserve.workers.layers.activation import SiluAndMul
from pagedserve.workers.layers.attention import Attention, current_meta, forward_context
from pagedserve.workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.workers.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from pagedserve.workers.layers.norm import RMSNorm
from pagedserve.workers.layers.rotary import RotaryEmbedding, rope_parameters
from pagedserve.workers.models.native_layers import NativeLayers
from pagedserve.workers.parallel_state import ParallelContext, layer_range


@dataclass(frozen=True)
class DecoderOptions:
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False

    @classmethod
    def for_architecture(cls, architecture: str, hf_config: Any) -> DecoderOptions:
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        mlp_bias = bool(getattr(hf_config, "mlp_bias", False))
        if architecture == "Qwen2ForCausalLM":
            return cls(qkv_bias=True)
        if architecture == "Qwen3ForCausalLM":
            return cls(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True)
        return cls(qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=mlp_bias)


# Checkpoint projections that live inside one merged parameter: (merged, original, shard id).
STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


def attention_dims(cfg: Any) -> tuple[int, int, int]:
    """(query heads, KV heads, head size) of a checkpoint's config: the one place they are derived
    (the engine's ModelConfig asks here too). Older configs leave out num_key_value_heads (no GQA)
    and head_dim (hidden_size split evenly over the heads)."""
    num_heads = cfg.num_attention_heads
    num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    return num_heads, num_kv_heads, head_dim


class LlamaAttention(nn.Module):
    def __init__(
        self, cfg: Any, opts: DecoderOptions, parallel: ParallelContext, rotary: RotaryEmbedding, backend: AttentionBackend, layer_index: int
    ):
        super().__init__()
        num_heads, num_kv_heads, head_dim = attention_dims(cfg)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, head_dim, num_heads, num_kv_heads, opts.qkv_bias, parallel)
        self.o_proj = RowParallelLinear(num_heads * head_dim, cfg.hidden_size, opts.o_bias, parallel)
        self.q_norm = RMSNorm(head_dim, cfg.rms_norm_eps) if opts.qk_norm else None
        self.k_norm = RMSNorm(head_dim, cfg.rms_norm_eps) if opts.qk_norm else None
        self.rotary = rotary
        qkv = self.qkv_proj
        self.attn = Attention(qkv.num_heads, qkv.num_kv_heads, head_dim, head_dim**-0.5, backend, layer_index)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """`keep`: the rows whose output is wanted (every row's K and V are still cached)."""
        qkv = self.qkv_proj(hidden)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        head_dim = self.attn.head_dim
        q, k = q.reshape(-1, q_size // head_dim, head_dim), k.reshape(-1, kv_size // head_dim, head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v)
        return self.o_proj(out if keep is None else out.index_select(0, keep))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: Any, opts: DecoderOptions, parallel: ParallelContext):
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter, inter], opts.mlp_bias, parallel)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, opts.mlp_bias, parallel)
        self.act = SiluAndMul()
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}; supported: silu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, cfg: Any, opts: DecoderOptions, parallel: ParallelContext, rotary: RotaryEmbedding, backend: AttentionBackend, layer_index: int
    ):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, opts, parallel, rotary, backend, layer_index)
        self.mlp = LlamaMLP(cfg, opts, parallel)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """`keep`: only these rows past the attention (LlamaModel.forward says when)."""
        attended = self.self_attn(positions, self.input_layernorm(hidden), keep)
        hidden = (hidden if keep is None else hidden.index_select(0, keep)) + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, cfg: Any, opts: DecoderOptions, parallel: ParallelContext, backend: AttentionBackend, max_positions: int):
        super().__init__()
        self.parallel = parallel
        _, _, head_dim = attention_dims(cfg)
        rotary = RotaryEmbedding(head_dim, max_positions, rope_parameters(cfg))
        stage_layers = layer_range(cfg.num_hidden_layers, parallel.pp_rank, parallel.pp_size)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, parallel) if parallel.is_first_stage else None
        self.layers = nn.ModuleDict(
            {str(i): LlamaDecoderLayer(cfg, opts, parallel, rotary, backend, i) for i in stage_layers}
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if parallel.is_last_stage else None
        # The layers' native CPU path (native_layers.py): decided at the first real step, after
        # the weights are packed; False where the layers need their modules.
        self._native_layers: NativeLayers | bool | None = None

    def forward(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor, hidden: torch.Tensor | None = None,
        sampled_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Stage 0 embeds `input_ids`; later stages continue from the previous stage's `hidden`.
        Attention reads the step's metadata from `forward_context`, set by the caller.

        `sampled_rows` (the last stage only): the rows whose hidden states the caller wants, in
        order. The last layer still caches every row's K and V, but runs its o_proj, its MLP and
        the final norm for these rows alone, and only these rows are returned: in a prefill chunk
        of N tokens that samples once, N - 1 rows of one layer's linears and norms are skipped
        (about 2.5% of a SmolLM2 prefill). None: every row."""
        if self.embed_tokens is not None:
            hidden = self.embed_tokens(input_ids)
        # No metadata: the memory-profiling pass, before the weights are packed.
        meta = None if torch.compiler.is_compiling() else current_meta()
        if meta is not None and self._native_path_takes(hidden):
            hidden = self._native_layers.forward(hidden, positions, meta, sampled_rows)
        else:
            last = len(self.layers) - 1
            for i, layer in enumerate(self.layers.values()):
                hidden = layer(positions, hidden, sampled_rows if i == last else None)
        return self.norm(hidden) if self.norm is not None else hidden

    def _native_path_takes(self, hidden: torch.Tensor) -> bool:
        """Whether this real step runs on the native layers (deciding them at the first)."""
        if self._native_layers is None:
            self._native_layers = NativeLayers.of(list(self.layers.values())) or False
        return bool(self._native_layers) and self._native_layers.takes(hidden)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: Any, architecture: str, parallel: ParallelContext, backend: AttentionBackend, max_positions: int):
        super().__init__()
        self.config = cfg
        self.parallel = parallel
        opts = DecoderOptions.for_architecture(architecture, cfg)
        self.model = LlamaModel(cfg, opts, parallel, backend, max_positions)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, parallel) if parallel.is_last_stage else None
        if self.tie_word_embeddings and self.lm_head is not None and self.model.embed_tokens is not None:
            self.lm_head.weight = self.model.embed_tokens.weight
        # A plain dict, not a ModuleDict: the layers are registered once, under self.model.
        self.attention_by_index = {attn.layer_index: attn for attn in self.attention_layers()}
        # `torch.compile`d self.model (workers/compile.py), used for steps once the cache exists.
        self.compiled_model: Callable[..., torch.Tensor] | None = None

    def forward(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor, meta: AttentionMetadata | None,
        hidden: torch.Tensor | None = None, sampled_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`sampled_rows`: see LlamaModel.forward. The compiled model takes every row (its graphs
        are traced without the selection), and so does the caller that passes None."""
        with forward_context(meta, self.attention_by_index):
            # The memory-profiling pass (no metadata, no cache yet) stays eager: compiling it
            # would trace a branch no step takes.
            if self.compiled_model is not None and meta is not None:
                hidden = self.compiled_model(input_ids, positions, hidden)
                return hidden if sampled_rows is None else hidden.index_select(0, sampled_rows)
            return self.model(input_ids, positions, hidden, sampled_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits of the last stage, complete on the first TP rank (None on the others)."""
        return self.lm_head.compute_logits(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers.values()]

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Copy this rank's shard of each checkpoint tensor into place; returns what was loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            for target in self._targets(name, params):
                param_name, shard_id = target
                param = params[param_name]
                loader = getattr(param, "weight_loader", default_weight_loader)
                loader(param, tensor, shard_id)
                loaded.add(param_name)
        return loaded

    def _targets(self, name: str, params: dict) -> list[tuple[str, Any]]:
        """Which of this rank's parameters a checkpoint tensor feeds (none if another stage owns it)."""
        if "rotary_emb.inv_freq" in name:
            return []
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return []  # tied: the embedding matrix is the LM head
        if name == "model.embed_tokens.weight" and self.tie_word_embeddings and "model.embed_tokens.weight" not in params:
            name = "lm_head.weight"  # a later pipeline stage holds the tied head without the embedding
        for merged, original, shard_id in STACKED_PARAMS:
            if f".{original}." in name:
                merged_name = name.replace(f".{original}.", f".{merged}.")
                return [(merged_name, shard_id)] if merged_name in params else []
        return [(name, None)] if name in params else []
