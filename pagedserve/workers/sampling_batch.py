"""Turn the sampled requests' parameters into the sampler's per-row tensors.

The common cases stay cheap: an all-greedy batch without penalties or logprobs builds one small
tensor, and each optional feature costs only when some row uses it. `SamplingBatchBuilder` keeps
the last step's batch: the per-row parameter tensors are rebuilt only when the sampled requests
(or their order) change, and the parts that move every step (seeds, min_tokens bans, penalties)
only when some row uses them.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from pagedserve.step_types.scheduler_output import SchedulerOutput
from pagedserve.workers.sampler import Penalties, SamplingBatch, step_seed
from pagedserve.workers.step_inputs import CachedRequestState


class SamplingBatchBuilder:
    """`build_sampling_batch` with memory: decode steps of an unchanged batch reuse the last
    step's parameter tensors."""

    def __init__(self, eos_token_ids: tuple[int, ...], vocab_size: int, device: torch.device):
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.device = device
        # Held, so no object of the last batch can be freed and its id() reused by a new one.
        self._states: list[CachedRequestState] = []
        self._batch: SamplingBatch | None = None
        self._is_per_step = False  # a row uses seeds, min_tokens or penalties

    def build(self, states: list[CachedRequestState]) -> SamplingBatch:
        if not _same_objects(states, self._states):
            self._states = list(states)
            self._batch = build_sampling_batch(states, self.eos_token_ids, self.vocab_size, self.device)
            self._is_per_step = any(_moves_per_step(s.sampling_params) for s in states)
            return self._batch
        if not self._is_per_step:
            return self._batch
        # The same requests, one token further: only the parts that depend on their outputs move.
        batch = dataclasses.replace(self._batch)
        if batch.seeds:
            params = [s.sampling_params for s in states]
            batch.seeds = {row: step_seed(params[row].seed, states[row].num_output_tokens) for row in batch.seeds}
        batch.banned_tokens = _min_tokens_bans(states, self.eos_token_ids)
        if batch.penalties is not None:
            batch.penalties = _penalties(states, self.vocab_size, self.device)
        return batch


def _same_objects(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _moves_per_step(p) -> bool:
    return (p.seed is not None and not p.is_greedy) or p.min_tokens > 0 or p.has_penalties


def build_sampling_batch(
    states: list[CachedRequestState], eos_token_ids: tuple[int, ...], vocab_size: int, device: torch.device
) -> SamplingBatch:
    params = [s.sampling_params for s in states]
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    batch = SamplingBatch(temperature=temperature, all_greedy=all(p.is_greedy for p in params))
    if not batch.all_greedy:
        if any(p.top_k > 0 for p in params):
            # A top_k past the vocabulary keeps every token; clamped here, before an int64 tensor
            # would overflow on a client's top_k >= 2**63 and kill the engine loop.
            top_k = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
            batch.top_k = torch.tensor(top_k, dtype=torch.long, device=device)
        if any(p.top_p < 1.0 for p in params):
            batch.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        if any(p.min_p > 0.0 for p in params):
            batch.min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
        batch.seeds = {
            row: step_seed(p.seed, s.num_output_tokens)
            for row, (s, p) in enumerate(zip(states, params))
            if p.seed is not None and not p.is_greedy
        }
    batch.banned_tokens = _min_tokens_bans(states, eos_token_ids)
    batch.logit_bias = {row: (list(p.logit_bias), list(p.logit_bias.values())) for row, p in enumerate(params) if p.logit_bias}
    if any(p.has_penalties for p in params):
        batch.penalties = _penalties(states, vocab_size, device)
    if any(p.logprobs is not None for p in params):
        batch.num_logprobs = [p.logprobs for p in params]
    return batch


def _min_tokens_bans(states: list[CachedRequestState], eos_token_ids: tuple[int, ...]) -> dict[int, list[int]]:
    """Rows still short of min_tokens may not sample a token that would stop them."""
    bans = {}
    for row, state in enumerate(states):
        p = state.sampling_params
        if state.num_output_tokens < p.min_tokens:
            stoppers = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
            if stoppers:
                bans[row] = stoppers
    return bans


def _penalties(states: list[CachedRequestState], vocab_size: int, device: torch.device) -> Penalties:
    rows = len(states)
    prompt_mask = torch.zeros(rows, vocab_size + 1, dtype=torch.bool, device=device)
    output_counts = torch.zeros(rows, vocab_size + 1, dtype=torch.float32, device=device)
    for row, state in enumerate(states):
        if not state.sampling_params.has_penalties:
            continue
        # Read once: an InputBatch row builds this list from its arrays at each read.
        token_ids = state.token_ids
        # Ids past the vocabulary (invalid) land in the extra column, dropped below.
        prompt = torch.tensor(token_ids[: state.num_prompt_tokens], dtype=torch.long, device=device)
        prompt_mask[row, prompt.clamp(max=vocab_size)] = True
        outputs = torch.tensor(token_ids[state.num_prompt_tokens :], dtype=torch.long, device=device)
        output_counts[row].scatter_add_(0, outputs.clamp(max=vocab_size), torch.ones_like(outputs, dtype=torch.float32))
    params = [s.sampling_params for s in states]
    return Penalties(
        presence=torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=device),
        frequency=torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=device),
        repetition=torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=device),
        prompt_mask=prompt_mask[:, :vocab_size],
        output_counts=output_counts[:, :vocab_size],
    )


def with_grammar(batch: SamplingBatch, step: SchedulerOutput, states: list[CachedRequestState], device: torch.device) -> SamplingBatch:
    """The step's sampling batch plus its grammar rows (a copy: the builder reuses its batch)."""
    row_of = {state.req_id: row for row, state in enumerate(states)}
    rows = np.array([row_of[req_id] for req_id in step.grammar_req_ids], dtype=np.int64)
    # In row order: when every row is constrained, torch's mask (grammar_mask.mask_unpacked, where
    # the native kernel does not run) covers the logits as they lie, with no gather and scatter.
    order = np.argsort(rows, kind="stable")
    bitmask = torch.from_numpy(np.asarray(step.grammar_bitmask, dtype=np.int32)[order])  # indexing copies, contiguous
    return dataclasses.replace(
        batch,
        grammar_rows=torch.from_numpy(rows[order]).to(device),
        grammar_bitmask=bitmask,
    )
