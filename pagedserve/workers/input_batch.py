"""The requests a worker holds, as rows of host arrays kept from step to step.

A step's diffs touch only what changed (one appended token and a computed count per decode, a
block id now and then), and the step's flat inputs are gathered from the rows with a handful of
numpy operations: no per-step Python lists of every request's tokens or blocks, no `torch.tensor`
of a list. `build_step_inputs` (tests/workers/step_inputs_reference.py) builds the same inputs
from scratch; it is the reference this batch is tested against.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np
import torch

from pagedserve.step_types.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedserve.kernels import AttentionMetadata
from pagedserve.sampling_params import SamplerParams
from pagedserve.workers.lora.context import LoRAGroups
from pagedserve.workers.step_inputs import StepInputs, to_device


class BatchRow:
    """A request the batch holds, as the sampler reads it (CachedRequestState's fields). Its
    tokens, blocks and computed count live in the batch's arrays, which a step's diffs update in
    a few numpy operations for all rows at once; these properties read them back (the sampler
    does only for the rows that use seeds, min_tokens or penalties)."""

    __slots__ = ("req_id", "num_prompt_tokens", "sampling_params", "row", "_batch")

    def __init__(self, req_id: str, num_prompt_tokens: int, sampling_params: SamplerParams, row: int, batch: InputBatch):
        self.req_id, self.num_prompt_tokens, self.sampling_params = req_id, num_prompt_tokens, sampling_params
        self.row, self._batch = row, batch

    @property
    def token_ids(self) -> list[int]:
        batch = self._batch
        return batch.token_ids[self.row, : batch.num_tokens[self.row]].tolist()

    @property
    def block_ids(self) -> list[int]:
        batch = self._batch
        return batch.block_table[self.row, : batch.num_blocks[self.row]].tolist()

    @property
    def num_computed_tokens(self) -> int:
        return int(self._batch.num_computed[self.row])

    @property
    def num_output_tokens(self) -> int:
        return int(self._batch.num_tokens[self.row]) - self.num_prompt_tokens


class InputBatch:
    """One row per request the worker holds. Rows are reused once their request is dropped; a
    row's arrays past the request's own length hold stale values that are never read."""

    def __init__(self, block_size: int, device: torch.device, max_num_reqs: int = 64, max_tokens: int = 256):
        self.block_size = block_size
        self.device = device
        self.states: dict[str, BatchRow] = {}  # the sampler's view, by request id
        self.row_of: dict[str, int] = {}
        self.row_states: list[BatchRow | None] = [None] * max_num_reqs
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))  # a stack: lowest row first
        self.token_ids = np.zeros((max_num_reqs, max_tokens), dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, -(-max_tokens // block_size)), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)  # known: prompt + outputs
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.lora_ids = np.zeros(max_num_reqs, dtype=np.int64)  # each request's lora_int_id (0: none)
        self.num_lora_rows = 0  # rows with an adapter: 0 skips the per-token lookup

    def __len__(self) -> int:
        return len(self.row_of)

    # ---- keeping the rows up to date -------------------------------------------------------

    def update(self, scheduler_output: SchedulerOutput) -> None:
        """Apply one step's changes: drop, then add the new requests, then the running ones' diffs."""
        for req_id in scheduler_output.dropped_req_ids:
            self.remove(req_id)
        for new in scheduler_output.scheduled_new_reqs:
            self.add(new)
        self._apply_diffs(scheduler_output.scheduled_cached_reqs)

    def add(self, new: NewRequestData) -> None:
        self.remove(new.req_id)  # sent whole again: whatever this rank held of it is stale
        if not self.free_rows:
            self._grow_rows()
        row = self.free_rows.pop()
        state = BatchRow(new.req_id, new.num_prompt_tokens, new.sampling_params, row, self)
        self.states[new.req_id], self.row_of[new.req_id], self.row_states[row] = state, row, state
        self.num_tokens[row] = self.num_blocks[row] = 0
        rows = np.array([row])
        self.token_ids = _append_ragged(self.token_ids, self.num_tokens, rows, [new.token_ids])
        self.block_table = _append_ragged(self.block_table, self.num_blocks, rows, [new.block_ids])
        self.num_computed[row] = new.num_computed_tokens
        self.lora_ids[row] = new.lora_request.lora_int_id if new.lora_request is not None else 0
        self.num_lora_rows += bool(self.lora_ids[row])

    def remove(self, req_id: str) -> None:
        """Forget a request; unknown ids are ignored (a request may end before it first ran)."""
        row = self.row_of.pop(req_id, None)
        if row is None:
            return
        del self.states[req_id]
        self.row_states[row] = None
        self.num_lora_rows -= bool(self.lora_ids[row])
        self.lora_ids[row] = 0
        self.free_rows.append(row)

    def _apply_diffs(self, cached: CachedRequestData) -> None:
        """Every row's new tokens and blocks appended, and its computed count set, in one go."""
        if not len(cached):
            return
        row_of = self.row_of
        rows = np.fromiter([row_of[req_id] for req_id in cached.req_ids], dtype=np.int64, count=len(cached))
        self.num_computed[rows] = cached.num_computed_tokens
        self.token_ids = _append_ragged(self.token_ids, self.num_tokens, rows, cached.new_token_ids)
        self.block_table = _append_ragged(self.block_table, self.num_blocks, rows, cached.new_block_ids)

    def _grow_rows(self) -> None:
        old = len(self.row_states)
        for name in ("token_ids", "block_table", "num_tokens", "num_computed", "num_blocks", "lora_ids"):
            array = getattr(self, name)
            grown = np.zeros((2 * old, *array.shape[1:]), dtype=array.dtype)
            grown[:old] = array
            setattr(self, name, grown)
        self.row_states.extend([None] * old)
        self.free_rows.extend(range(2 * old - 1, old - 1, -1))

    # ---- one step's inputs -----------------------------------------------------------------

    def prepare(self, scheduler_output: SchedulerOutput) -> StepInputs:
        """The step's ragged batch, in build_step_inputs' order: decodes first, longest context
        first (ties in scheduling order), then the prefill chunks in scheduling order."""
        counts = scheduler_output.num_scheduled_tokens
        rows = np.fromiter((self.row_of[req_id] for req_id in counts), dtype=np.int64, count=len(counts))
        num_scheduled = np.fromiter(counts.values(), dtype=np.int64, count=len(counts))
        num_computed = self.num_computed[rows]
        is_prefill = num_scheduled > 1
        order = np.lexsort((np.where(is_prefill, 0, -num_computed), is_prefill))  # stable
        rows, num_scheduled, num_computed = rows[order], num_scheduled[order], num_computed[order]

        query_start_loc = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        seq_lens = num_computed + num_scheduled
        # Token i of request r is at position num_computed[r] + (i - query_start_loc[r]).
        request_index = np.repeat(np.arange(len(rows)), num_scheduled)
        positions = np.arange(int(query_start_loc[-1])) + (num_computed - query_start_loc[:-1])[request_index]
        token_rows = rows[request_index]
        input_ids = self.token_ids[token_rows, positions]

        num_blocks = -(-seq_lens // self.block_size)
        width = int(num_blocks.max())
        block_tables = self.block_table[rows, :width]
        block_tables *= np.arange(width) < num_blocks[:, None]  # pad with block 0, as a fresh build
        slot_mapping = block_tables[request_index, positions // self.block_size].astype(np.int64) * self.block_size
        slot_mapping += positions % self.block_size

        # A request samples when this step reaches the end of its known tokens.
        samples = seq_lens == self.num_tokens[rows]
        sampled_states = [self.row_states[row] for row in rows[samples].tolist()]
        num_decodes = int(np.count_nonzero(~is_prefill))
        meta = AttentionMetadata(
            slot_mapping=to_device(slot_mapping, self.device),
            query_start_loc=to_device(query_start_loc.astype(np.int32), self.device),
            seq_lens=to_device(seq_lens.astype(np.int32), self.device),
            block_tables=to_device(block_tables, self.device),
            num_decodes=num_decodes,
            max_query_len=int(num_scheduled.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc_host=query_start_loc.tolist(),
            seq_lens_host=seq_lens.tolist(),
        )
        return StepInputs(
            input_ids=to_device(input_ids, self.device),
            positions=to_device(positions, self.device),
            meta=meta,
            logits_indices=to_device(query_start_loc[1:][samples] - 1, self.device),
            sampled_states=sampled_states,
            lora_groups=LoRAGroups.of(self.lora_ids[token_rows], self.device) if self.num_lora_rows else None,
        )


def _append_ragged(array: np.ndarray, lengths: np.ndarray, rows: np.ndarray, values: list[Sequence[int]]) -> np.ndarray:
    """Append `values[i]` to row `rows[i]` of `array` past `lengths[rows[i]]` (the rows are
    distinct), advancing `lengths`; returns the array, widened if a row outgrew it."""
    counts = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
    total = int(counts.sum())
    if not total:
        return array
    starts = lengths[rows]
    ends = starts + counts
    if int(ends.max()) > array.shape[1]:
        array = _widen(array, int(ends.max()))
    # Value j of the flat list goes to column starts[i] + (j - first[i]), i being its row's index.
    first = np.cumsum(counts) - counts
    index = np.repeat(np.arange(len(values)), counts)
    columns = np.arange(total) + (starts - first)[index]
    array[rows[index], columns] = np.fromiter(itertools.chain.from_iterable(values), dtype=array.dtype, count=total)
    lengths[rows] = ends
    return array


def _widen(array: np.ndarray, min_columns: int) -> np.ndarray:
    """A copy with at least `min_columns` columns (doubling, so appends stay amortized O(1))."""
    columns = max(min_columns, 2 * array.shape[1])
    wider = np.zeros((array.shape[0], columns), dtype=array.dtype)
    wider[:, : array.shape[1]] = array
    return wider
