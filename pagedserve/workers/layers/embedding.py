"""Vocabulary-parallel embedding and LM head: each TP rank owns a contiguous range of token ids.

The vocabulary is padded up to a multiple of the TP size; padding rows are zero and their logits
are cut off after the gather, so a vocabulary that does not divide evenly works.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.workers.layers import cpu_gemm
from pagedserve.workers.layers.linear import new_parameter
from pagedserve.workers.parallel_state import ParallelContext


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelContext):
        super().__init__()
        self.parallel = parallel
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // parallel.tp_size)
        self.vocab_start = parallel.tp_rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, vocab_size)
        self.weight = new_parameter(self.rows_per_rank, hidden_size, loader=self.weight_loader)

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: Any = None) -> None:
        num_rows = self.vocab_end - self.vocab_start
        param.data.zero_()
        param.data[:num_rows].copy_(loaded[self.vocab_start : self.vocab_end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        is_mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(is_mine, input_ids - self.vocab_start, 0)
        out = F.embedding(local_ids, self.weight) * is_mine.unsqueeze(-1).to(self.weight.dtype)
        return self.parallel.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits of this rank's vocabulary range, gathered to the first TP rank."""

    packed_weight: torch.Tensor | None = None
    # Whether the plain weight also serves the small-batch kernel (cpu_gemm.keeps_plain): it always
    # stays, since a tied head shares it with the embedding, but the kernel takes bfloat16 only.
    plain_for_kernel = False

    def pack_for_cpu(self) -> bool:
        """A oneDNN-packed copy for the logits (cpu_gemm)."""
        if not cpu_gemm.can_pack(self.weight):
            return False
        self.packed_weight = cpu_gemm.pack(self.weight)
        self.plain_for_kernel = cpu_gemm.keeps_plain(self.weight)
        return True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        if self.packed_weight is not None:
            local = cpu_gemm.linear(hidden, self.packed_weight, None, self.weight if self.plain_for_kernel else None)
        else:
            local = F.linear(hidden, self.weight)
        logits = self.parallel.gather_to_first(local)
        return logits[:, : self.vocab_size] if logits is not None else None
