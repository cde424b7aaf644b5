"""The per-step description of a ragged batch that every attention backend reads."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The slot of a padding row (CUDA-graph batches padded up to a captured size): every K/V writer
# that can run under a graph skips negative slots, so padding never touches a real cache slot.
PAD_SLOT_ID = -1


@dataclass
class AttentionMetadata:
    """Where each query token's K/V goes and which cached tokens each sequence attends to.

    The batch is ordered decode-first: the first `num_decodes` sequences have exactly one query
    token each (so they occupy query rows 0..num_decodes-1), sorted by `seq_lens` descending;
    the rest are prefill chunks. Query
    token j of sequence i sits at position `seq_lens[i] - query_len[i] + j` and attends causally to
    cached positions 0..that position.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot (block_id * block_size + offset)
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32: tokens in the cache after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32: block ids, padded with 0
    num_decodes: int  # leading sequences whose query is a single token
    max_query_len: int
    max_seq_len: int
    # Host copies, so backends that loop per sequence need no device-to-host sync per layer.
    query_start_loc_host: list[int]
    seq_lens_host: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_host[-1]
