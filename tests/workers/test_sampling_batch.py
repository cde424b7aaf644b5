"""SamplingBatchBuilder reuses the last step's batch; whatever it reuses or recomputes, each step's
batch must equal a fresh build_sampling_batch of the same rows."""

from __future__ import annotations

import dataclasses

import torch

from pagedserve.sampling_params import SamplingParams
from pagedserve.workers.sampler import SamplingBatch
from pagedserve.workers.sampling_batch import SamplingBatchBuilder, build_sampling_batch
from pagedserve.workers.step_inputs import CachedRequestState

EOS = (2,)
VOCAB = 50
CPU = torch.device("cpu")


def state(req_id: str, params: SamplingParams) -> CachedRequestState:
    return CachedRequestState(req_id, [5, 6, 7], 3, params, [0], 3)


def assert_same_batch(got: SamplingBatch, want: SamplingBatch) -> None:
    for field in dataclasses.fields(SamplingBatch):
        a, b = getattr(got, field.name), getattr(want, field.name)
        if field.name == "penalties" and a is not None:
            for name in ("presence", "frequency", "repetition", "prompt_mask", "output_counts"):
                assert torch.equal(getattr(a, name), getattr(b, name)), name
        elif isinstance(a, torch.Tensor):
            assert torch.equal(a, b), field.name
        else:
            assert a == b, field.name


def test_incremental_batch_equals_a_fresh_one_as_rows_decode_join_and_leave():
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=7),
        SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=[9], min_p=0.1),
        SamplingParams(temperature=0.0, presence_penalty=0.5, repetition_penalty=1.2, logprobs=2),
    ]
    builder = SamplingBatchBuilder(EOS, VOCAB, CPU)
    states = [state(f"r{i}", p) for i, p in enumerate(kinds)]
    for step in range(8):
        if step == 3:
            states = states[1:] + [state("late", SamplingParams(temperature=0.5, seed=1))]  # one leaves, one joins
        if step == 5:
            states = states[::-1]  # the same requests, reordered
        assert_same_batch(builder.build(states), build_sampling_batch(states, EOS, VOCAB, CPU))
        for s in states:
            s.token_ids.append(10 + step)  # each row sampled a token: seeds, bans and counts move


def test_an_all_greedy_batch_is_reused_unchanged():
    builder = SamplingBatchBuilder(EOS, VOCAB, CPU)
    states = [state(str(i), SamplingParams(temperature=0.0)) for i in range(3)]
    first = builder.build(states)
    for s in states:
        s.token_ids.append(11)
    assert builder.build(states) is first
    assert builder.build(states[:2]) is not first
