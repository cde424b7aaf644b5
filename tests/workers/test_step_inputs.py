"""build_step_inputs flattens a step's requests into one ragged batch. Checked through its
outputs only (the row order is the function's own business): every token's id, position and
cache slot, each request's query range, sequence length and block-table row, and which rows'
logits are sampled, on a batch mixing decodes, a prefix hit, a partial prefill chunk and the last
chunk of a prompt, with partially filled last blocks."""

from __future__ import annotations

import dataclasses

import torch

from pagedserve.step_types.scheduler_output import CachedRequestData, SchedulerOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.workers.model_runner import _prunes_last_layer
from pagedserve.workers.step_inputs import CachedRequestState
from tests.workers.step_inputs_reference import build_step_inputs

BLOCK_SIZE = 4


def token(request_index: int, position: int) -> int:
    """Token ids that name their request and position, so each row of the batch says whose it is."""
    return 1000 * request_index + position


# name: (known tokens, computed before this step, scheduled this step, block ids)
REQUESTS = {
    "decode_long": (13, 12, 1, [7, 3, 9, 2]),  # decodes position 12, the 1st slot of its 4th block
    "decode_short": (6, 5, 1, [5, 1]),  # decodes position 5
    "prefix_hit": (11, 8, 3, [4, 6, 0]),  # 2 blocks hit in the prefix cache, computes 8..10
    "first_chunk": (10, 0, 6, [8, 10]),  # a partial prefill: computes 0..5, samples nothing
    "last_chunk": (9, 4, 5, [11, 12, 13]),  # its prompt's last chunk, 4..8, samples
}


def build():
    states, counts = {}, {}
    for index, (name, (num_known, num_computed, num_scheduled, block_ids)) in enumerate(REQUESTS.items()):
        tokens = [token(index, position) for position in range(num_known)]
        states[name] = CachedRequestState(name, tokens, min(num_known, 9), SamplingParams(), list(block_ids), num_computed)
        counts[name] = num_scheduled
    output = SchedulerOutput([], CachedRequestData(), counts, sum(counts.values()), set())
    return build_step_inputs(output, states, BLOCK_SIZE, torch.device("cpu")), states


def test_every_token_has_its_id_position_and_slot():
    inputs, _ = build()
    names = list(REQUESTS)
    assert inputs.num_tokens == sum(n for _, _, n, _ in REQUESTS.values())
    seen: dict[str, list[int]] = {name: [] for name in names}
    for input_id, position, slot in zip(inputs.input_ids.tolist(), inputs.positions.tolist(), inputs.meta.slot_mapping.tolist()):
        name = names[input_id // 1000]
        assert input_id % 1000 == position  # the token computed at its own position
        block_ids = REQUESTS[name][3]
        assert slot == block_ids[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE
        seen[name].append(position)
    for name, (_, num_computed, num_scheduled, _) in REQUESTS.items():
        assert seen[name] == list(range(num_computed, num_computed + num_scheduled)), name


def test_query_ranges_sequence_lengths_and_block_tables():
    inputs, _ = build()
    names = list(REQUESTS)
    starts = inputs.meta.query_start_loc.tolist()
    assert starts[0] == 0 and starts[-1] == inputs.num_tokens
    seq_lens, table = inputs.meta.seq_lens.tolist(), inputs.meta.block_tables.tolist()
    rows = set()
    for row, (begin, end) in enumerate(zip(starts, starts[1:])):
        owners = {names[t // 1000] for t in inputs.input_ids[begin:end].tolist()}
        assert len(owners) == 1, "a query range holds one request's tokens"
        (name,) = owners
        rows.add(name)
        _, num_computed, num_scheduled, block_ids = REQUESTS[name]
        assert end - begin == num_scheduled
        assert seq_lens[row] == num_computed + num_scheduled
        num_blocks = -(-seq_lens[row] // BLOCK_SIZE)
        assert table[row][:num_blocks] == block_ids[:num_blocks]
    assert rows == set(REQUESTS)


def test_logits_rows_are_the_last_token_of_each_request_that_samples():
    inputs, states = build()
    names = list(REQUESTS)
    sampled_rows = inputs.logits_indices.tolist()
    owners = [names[inputs.input_ids[row].item() // 1000] for row in sampled_rows]
    # Everyone whose step reaches the end of its known tokens samples; a partial chunk does not.
    assert sorted(owners) == sorted(n for n, (known, c, s, _) in REQUESTS.items() if c + s == known)
    assert "first_chunk" not in owners
    for row, name in zip(sampled_rows, owners):
        known, num_computed, num_scheduled, _ = REQUESTS[name]
        assert inputs.positions[row].item() == num_computed + num_scheduled - 1 == known - 1
    assert [state.req_id for state in inputs.sampled_states] == owners  # parallel to the rows
    assert all(state is states[state.req_id] for state in inputs.sampled_states)


def test_the_last_layer_keeps_only_the_sampled_rows_of_a_step_that_drops_some():
    """The model runner runs the last layer past its attention for the logits rows alone where a
    step has rows that do not sample, unless adapters ride in it (their groups cover every row)."""
    inputs, _ = build()
    assert 0 < len(inputs.sampled_states) < inputs.num_tokens and _prunes_last_layer(inputs)
    assert not _prunes_last_layer(dataclasses.replace(inputs, lora_groups=object()))
    every_row_samples = dataclasses.replace(inputs, input_ids=inputs.input_ids[: len(inputs.sampled_states)])
    assert not _prunes_last_layer(every_row_samples)  # a decode-only step: its rows are the logits rows
    assert not _prunes_last_layer(dataclasses.replace(inputs, sampled_states=[]))  # samples nothing
