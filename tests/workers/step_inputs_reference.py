"""build_step_inputs: a step's inputs built from scratch out of the scheduler's output and the
workers' request states. The persistent InputBatch (pagedserve/workers/input_batch.py) must build
exactly these; only the tests use this reference, so it lives here."""

from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from pagedserve.kernels import AttentionMetadata
from pagedserve.step_types.scheduler_output import SchedulerOutput
from pagedserve.workers.step_inputs import CachedRequestState, StepInputs, to_device


def build_step_inputs(
    scheduler_output: SchedulerOutput, requests: dict[str, CachedRequestState], block_size: int, device: torch.device
) -> StepInputs:
    """Flatten the scheduled requests into one ragged batch: decodes first, longest context
    first (the attention backends vectorize the single-token queries at the front, and a decode
    chunk past the shorter contexts then only involves a prefix of the rows)."""
    counts = scheduler_output.num_scheduled_tokens
    decodes = sorted((r for r, n in counts.items() if n == 1), key=lambda r: -requests[r].num_computed_tokens)
    order = decodes + [r for r, n in counts.items() if n > 1]
    states = [requests[req_id] for req_id in order]
    num_scheduled = np.fromiter((counts[r] for r in order), dtype=np.int64, count=len(order))
    num_computed = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=len(order))
    query_start_loc = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(num_scheduled, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    seq_lens = num_computed + num_scheduled

    input_ids = list(chain.from_iterable(s.token_ids[c : c + n] for s, c, n in zip(states, num_computed.tolist(), num_scheduled.tolist())))
    # Token i of request r is at position num_computed[r] + (i - query_start_loc[r]).
    positions = np.arange(num_tokens) + np.repeat(num_computed - query_start_loc[:-1], num_scheduled)
    block_tables = _block_table(states, seq_lens, block_size)
    request_index = np.repeat(np.arange(len(order)), num_scheduled)
    slot_mapping = block_tables[request_index, positions // block_size].astype(np.int64) * block_size + positions % block_size

    # A request samples when this step reaches the end of its known tokens.
    known = np.fromiter((len(s.token_ids) for s in states), dtype=np.int64, count=len(order))
    samples = seq_lens == known
    logits_indices = query_start_loc[1:][samples] - 1
    sampled_states = [s for s, flag in zip(states, samples.tolist()) if flag]

    query_lens_host = num_scheduled.tolist()
    meta = AttentionMetadata(
        slot_mapping=to_device(slot_mapping, device),
        query_start_loc=to_device(query_start_loc.astype(np.int32), device),
        seq_lens=to_device(seq_lens.astype(np.int32), device),
        block_tables=to_device(block_tables, device),
        num_decodes=sum(1 for n in query_lens_host if n == 1),
        max_query_len=max(query_lens_host),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_host=query_start_loc.tolist(),
        seq_lens_host=seq_lens.tolist(),
    )
    return StepInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=to_device(positions, device),
        meta=meta,
        logits_indices=to_device(logits_indices, device),
        sampled_states=sampled_states,
    )


def _block_table(states: list[CachedRequestState], seq_lens: np.ndarray, block_size: int) -> np.ndarray:
    """Rows of block ids, padded with block 0 (never read: attention masks past seq_len)."""
    num_blocks = -(-seq_lens // block_size)
    table = np.zeros((len(states), int(num_blocks.max())), dtype=np.int32)
    for row, (state, n) in enumerate(zip(states, num_blocks.tolist())):
        table[row, :n] = state.block_ids[:n]
    return table
