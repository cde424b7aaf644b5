"""Sampler: greedy, per-request seeds, the sampled distribution under each truncation, penalties,
min_tokens bans and logprobs. Batches are built with `build_sampling_batch`, as the model runner does.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve.sampling_params import SamplingParams
from pagedserve.workers.step_inputs import CachedRequestState
from pagedserve.kernels import cpu_native
from pagedserve.workers.sampler import Sampler, _apply_penalties, argmax_rows, sample_inverse_cdf, step_seed
from pagedserve.workers.sampling_batch import build_sampling_batch

CPU = torch.device("cpu")
EOS = (1,)
NUM_SAMPLES = 20_000
# A small fixed distribution with distinct probabilities, so every truncation cuts somewhere known.
PROBS = [0.4, 0.3, 0.15, 0.1, 0.05]


def state(params: SamplingParams, prompt=(5, 6, 7), outputs=(), req_id="r") -> CachedRequestState:
    tokens = list(prompt) + list(outputs)
    return CachedRequestState(req_id, tokens, len(prompt), params, [0], len(tokens))


def sample(logits: torch.Tensor, states: list[CachedRequestState], seed: int = 0):
    batch = build_sampling_batch(states, EOS, logits.shape[-1], CPU)
    return Sampler(seed, CPU)(logits, batch)


def frequencies(params: SamplingParams, probs=PROBS) -> torch.Tensor:
    """Sample NUM_SAMPLES independent rows of one distribution; the frequency of each token."""
    logits = torch.tensor(probs).log().expand(NUM_SAMPLES, -1).contiguous()
    tokens = sample(logits, [state(params)] * NUM_SAMPLES).sampled_token_ids
    return torch.bincount(tokens, minlength=len(probs)).double() / NUM_SAMPLES


def assert_close_to(freq: torch.Tensor, expected: list[float]) -> None:
    """Each frequency within 5 standard errors, sqrt(p(1-p)/N), of its probability (a false
    failure has odds below 1e-6 per token); a token of probability 0 must never appear."""
    for token, (f, p) in enumerate(zip(freq.tolist(), expected)):
        if p == 0:
            assert f == 0, f"token {token} has probability 0 but was sampled ({f})"
        else:
            tolerance = 5 * math.sqrt(p * (1 - p) / NUM_SAMPLES)
            assert abs(f - p) <= tolerance, f"token {token}: frequency {f:.4f}, expected {p:.4f} +- {tolerance:.4f}"


def renormalised(keep: list[bool], probs=PROBS) -> list[float]:
    total = sum(p for p, k in zip(probs, keep) if k)
    return [p / total if k else 0.0 for p, k in zip(probs, keep)]


# ---- greedy -------------------------------------------------------------------------------


def test_top_k_one_equals_greedy():
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(1))
    states = [state(SamplingParams(temperature=1.5, top_k=1)) for _ in range(16)]
    assert torch.equal(sample(logits, states).sampled_token_ids, logits.argmax(-1))


def test_greedy_rows_are_argmax_among_random_rows():
    # Flat-ish logits: a random row picks the argmax rarely, so a greedy row doing so is no accident.
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(2)) * 0.1
    random_params = [SamplingParams(), SamplingParams(top_p=0.9, seed=3), SamplingParams(min_p=0.01)]
    greedy = SamplingParams(temperature=0.0)
    states = [state(greedy if row % 2 == 0 else random_params[row % 3]) for row in range(64)]
    tokens = sample(logits, states, seed=5).sampled_token_ids
    argmax = logits.argmax(-1)
    assert torch.equal(tokens[0::2], argmax[0::2])
    assert (tokens[1::2] != argmax[1::2]).sum() > 20  # the random rows really are random


def argmax_cases(dtype: torch.dtype, width: int) -> torch.Tensor:
    """Rows that test an argmax's rules: random, all equal, all -inf, NaNs (the first wins), ties
    at the far ends, +inf twice, and a few values repeated everywhere."""
    rows = (torch.randn(9, width, generator=torch.Generator().manual_seed(width)) * 3).to(dtype)
    rows[1], rows[2] = 1.0, float("-inf")
    rows[3, width // 2] = rows[3, width - 1] = float("nan")
    rows[4] = 0.0
    rows[4, width // 3] = rows[4, width - 1] = 2.0
    rows[5, 0] = rows[5, width - 1] = float("inf")
    rows[6] = torch.randint(0, 3, (width,), generator=torch.Generator().manual_seed(1)).to(dtype)
    return rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("width", [1, 2, 15, 16, 17, 33, 100, 49155])
def test_argmax_rows_is_torchs_argmax(dtype, width):
    """The sampler's argmax (native on the CPU, in the logits' dtype) gives torch's answer bit for
    bit on the rows where the rules matter, across the vector width's edges, and on rows that lie
    apart in memory (a view's stride)."""
    rows = argmax_cases(dtype, width)
    assert torch.equal(argmax_rows(rows), rows.argmax(-1))
    wider = torch.randn(5, width + 9, generator=torch.Generator().manual_seed(4)).to(dtype)
    view = wider[:, 4 : 4 + width]
    assert torch.equal(argmax_rows(view), view.argmax(-1))


def test_argmax_rows_runs_natively_on_the_cpu(monkeypatch):
    """On a CPU where the kernels build, the argmax is the native kernel's, not torch's."""
    assert cpu_native.is_available()
    rows = argmax_cases(torch.bfloat16, 300)
    expected = rows.argmax(-1)
    monkeypatch.setattr(torch.Tensor, "argmax", lambda *args, **kwargs: pytest.fail("torch's argmax ran"))
    assert torch.equal(argmax_rows(rows), expected)


def test_all_greedy_bf16_logits_sample_without_a_float32_copy(monkeypatch):
    """An all-greedy batch without logprobs, penalties or grammar takes its argmax on the logits
    as they come; the batch with logprobs still widens them (log_softmax in float32)."""
    logits = torch.randn(6, 70, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    expected = logits.float().argmax(-1)
    widened = []
    original = torch.Tensor.float
    monkeypatch.setattr(torch.Tensor, "float", lambda self, *a, **k: widened.append(self.shape) or original(self, *a, **k))
    greedy = [state(SamplingParams(temperature=0.0)) for _ in range(6)]
    assert torch.equal(sample(logits, greedy).sampled_token_ids, expected)
    assert widened == []
    out = sample(logits, [state(SamplingParams(temperature=0.0, logprobs=1)) for _ in range(6)])
    assert torch.equal(out.sampled_token_ids, expected) and widened == [logits.shape]


def test_sampler_leaves_input_logits_untouched():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(3))
    before = logits.clone()
    params = SamplingParams(repetition_penalty=2.0, min_tokens=2, top_k=3, top_p=0.5, min_p=0.1)
    sample(logits, [state(params, outputs=(5,)) for _ in range(3)])
    assert torch.equal(logits, before)


# ---- seeds --------------------------------------------------------------------------------


def seeded_token(
    logits_row: torch.Tensor, seed: int, num_outputs: int, others: list[SamplingParams], row: int, sampler_seed: int
) -> int:
    """The token of a seeded request placed at `row` among `others`, each with random logits."""
    params = SamplingParams(seed=seed)
    states = [state(p, outputs=range(8, 8 + row)) for p in others]
    states.insert(row, state(params, outputs=[9] * num_outputs))
    logits = torch.randn(len(states), logits_row.shape[0])
    logits[row] = logits_row
    return int(sample(logits, states, seed=sampler_seed).sampled_token_ids[row])


def test_seeded_row_ignores_batch_and_global_state():
    logits_row = torch.zeros(64)  # uniform: the token depends on nothing but the random stream
    others = [SamplingParams(temperature=0.0), SamplingParams(top_k=5, seed=11), SamplingParams(top_p=0.5),
              SamplingParams(min_p=0.2, repetition_penalty=1.5), SamplingParams(temperature=3.0, logprobs=2)]
    for seed in range(10):
        torch.manual_seed(seed)
        alone = seeded_token(logits_row, seed, 4, [], 0, sampler_seed=0)
        for i in range(1, len(others) + 1):
            torch.manual_seed(1000 + i)  # the global generator's state must not matter either
            assert seeded_token(logits_row, seed, 4, others[:i], row=i // 2, sampler_seed=i) == alone


def test_seeded_row_with_truncation_is_reproducible():
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(4))
    params = SamplingParams(seed=9, top_k=20, top_p=0.8, min_p=0.05, temperature=0.7)
    first = sample(logits, [state(params)], seed=1).sampled_token_ids
    batch = torch.cat([torch.randn(3, 64), logits])
    second = sample(batch, [state(SamplingParams())] * 3 + [state(params)], seed=2).sampled_token_ids[3:]
    assert torch.equal(first, second)


def test_different_seeds_and_output_indices_give_different_tokens():
    logits = torch.zeros(50, 64)
    by_seed = sample(logits, [state(SamplingParams(seed=s)) for s in range(50)]).sampled_token_ids
    by_index = sample(logits, [state(SamplingParams(seed=7), outputs=[9] * i) for i in range(50)]).sampled_token_ids
    # 50 uniform draws over 64 tokens have about 35 distinct values; a seed ignored gives 1.
    assert len(set(by_seed.tolist())) > 20
    assert len(set(by_index.tolist())) > 20


def test_step_seed_is_a_deterministic_63_bit_hash():
    values = {step_seed(s, i) for s in (-5, 0, 1, 2**62) for i in range(100)}
    assert len(values) == 400
    assert all(0 <= v < 2**63 for v in values)
    assert step_seed(42, 3) == step_seed(42, 3)


# ---- sampled distributions ----------------------------------------------------------------


def test_temperature_one_matches_softmax():
    assert_close_to(frequencies(SamplingParams()), PROBS)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_scales_logits(temperature):
    scaled = torch.tensor(PROBS).log().div(temperature).softmax(-1).tolist()
    assert_close_to(frequencies(SamplingParams(temperature=temperature)), scaled)


def test_top_k_keeps_k_most_likely_renormalised():
    assert_close_to(frequencies(SamplingParams(top_k=2)), renormalised([True, True, False, False, False]))


def test_top_p_keeps_smallest_nucleus_renormalised():
    # Cumulative mass from the top: 0.4, 0.7, 0.85 >= 0.75, so three tokens stay.
    assert_close_to(frequencies(SamplingParams(top_p=0.75)), renormalised([True, True, True, False, False]))


def test_min_p_drops_tokens_below_fraction_of_max():
    # Threshold 0.3 * 0.4 = 0.12: 0.1 and 0.05 go.
    assert_close_to(frequencies(SamplingParams(min_p=0.3)), renormalised([True, True, True, False, False]))


def test_top_k_then_top_p_on_renormalised_mass():
    # top_k=4 leaves 0.4, 0.3, 0.15, 0.1 (/0.95); from the top 0.42, 0.74, 0.89 >= 0.8: three stay.
    freq = frequencies(SamplingParams(top_k=4, top_p=0.8))
    assert_close_to(freq, renormalised([True, True, True, False, False]))


@pytest.mark.parametrize(
    "params", [SamplingParams(top_p=1e-9), SamplingParams(min_p=1.0), SamplingParams(top_k=1, top_p=1e-9)]
)
def test_tightest_truncation_keeps_the_most_likely_token(params):
    # In float32 1 - 1e-9 == 1, so every cumulative mass is "outside": the top token must survive.
    logits = torch.tensor(PROBS).log().expand(500, -1).contiguous()
    assert set(sample(logits, [state(params)] * 500).sampled_token_ids.tolist()) == {0}


def test_top_p_keeps_a_token_whose_mass_rounds_to_one():
    # The top token's probability is 1.0 in float32, so its cumulative mass equals 1 - top_p too.
    logits = torch.tensor([[-40.0, 0.0, -40.0, -40.0]] * 50)
    assert sample(logits, [state(SamplingParams(top_p=1e-9))] * 50).sampled_token_ids.tolist() == [1] * 50


def test_truncation_per_row_in_one_batch():
    logits = torch.tensor(PROBS).log().expand(4000, -1).contiguous()
    params = [SamplingParams(top_k=1), SamplingParams(top_p=0.5), SamplingParams(min_p=0.5), SamplingParams()]
    tokens = sample(logits, [state(params[r % 4]) for r in range(4000)]).sampled_token_ids.view(-1, 4)
    assert set(tokens[:, 0].tolist()) == {0}
    assert set(tokens[:, 1].tolist()) == {0, 1}  # 0.4 < 0.5 needs the second token
    assert set(tokens[:, 2].tolist()) == {0, 1}  # threshold 0.2
    assert set(tokens[:, 3].tolist()) == set(range(5))


def test_random_rows_draw_one_number_each_and_greedy_rows_none():
    # 6 rows over a 1,000-token vocabulary, 2 of them random and unseeded: the sampler's stream
    # advances by two uniforms, not by a draw per vocabulary entry or per greedy row.
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(12))
    params = [SamplingParams(temperature=0.0)] * 4 + [SamplingParams(), SamplingParams(top_p=0.9)]
    sampler = Sampler(7, CPU)
    sampler(logits, build_sampling_batch([state(p) for p in params], EOS, 1000, CPU))
    expected = torch.Generator().manual_seed(7)
    torch.rand(2, generator=expected, dtype=torch.float64)
    assert torch.equal(sampler.generator.get_state(), expected.get_state())


def test_inverse_cdf_at_the_extremes_picks_only_tokens_with_mass():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 3)
    uniforms = torch.tensor([0.0, 0.5, 1.0 - 2**-53], dtype=torch.float64)
    assert sample_inverse_cdf(probs, uniforms).tolist() == [1, 3, 3]


# ---- penalties ----------------------------------------------------------------------------

LOGITS = [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]


def penalised(params: SamplingParams, prompt, outputs) -> list[float]:
    states = [state(params, prompt, outputs), state(SamplingParams(), prompt, outputs)]
    batch = build_sampling_batch(states, EOS, len(LOGITS), CPU)
    logits = torch.tensor([LOGITS, LOGITS])
    _apply_penalties(logits, batch.penalties)
    assert logits[1].tolist() == LOGITS  # a row without penalties is untouched
    return logits[0].tolist()


def test_repetition_penalty_on_prompt_and_output_tokens():
    # Seen tokens: positive logits divided by 2, negative ones multiplied; 3 and 5 are unseen.
    got = penalised(SamplingParams(repetition_penalty=2.0), prompt=[0, 1], outputs=[2, 4, 4])
    assert got == [1.0, -2.0, 0.25, 3.0, -4.0, 1.0]


def test_frequency_penalty_counts_output_tokens_only():
    got = penalised(SamplingParams(frequency_penalty=0.5), prompt=[0, 1, 3], outputs=[2, 2, 4, 0])
    assert got == [1.5, -1.0, -0.5, 3.0, -2.5, 1.0]


def test_presence_penalty_once_per_output_token():
    got = penalised(SamplingParams(presence_penalty=-0.25), prompt=[1, 3], outputs=[2, 2, 2, 5])
    assert got == [2.0, -1.0, 0.75, 3.0, -2.0, 1.25]


def test_all_penalties_in_vllm_order():
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    got = penalised(params, prompt=[0, 1], outputs=[2, 2, 4])
    # 2: 0.5/2 - 2*0.5 - 0.25; 4: -2*2 - 0.5 - 0.25.
    assert got == [1.0, -2.0, -1.0, 3.0, -4.75, 1.0]


def test_penalties_ignore_ids_past_vocabulary():
    got = penalised(SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0), prompt=[0, 99], outputs=[7, 3])
    assert got == [1.0, -1.0, 0.5, 0.5, -2.0, 1.0]


def test_penalty_changes_greedy_choice():
    logits = torch.tensor([LOGITS])
    params = SamplingParams(temperature=0.0, repetition_penalty=4.0)
    # 3 -> 0.75 and 0 -> 0.5 fall below the unseen token 5's 1.0.
    assert sample(logits, [state(params, prompt=[3], outputs=[0])]).sampled_token_ids.tolist() == [5]


# ---- min_tokens ---------------------------------------------------------------------------


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    params = SamplingParams(min_tokens=3, stop_token_ids=[4])
    states = [state(params, outputs=[9] * n) for n in range(5)]
    batch = build_sampling_batch(states, EOS, 10, CPU)
    assert {row: sorted(ids) for row, ids in batch.banned_tokens.items()} == {0: [1, 4], 1: [1, 4], 2: [1, 4]}


def test_min_tokens_with_ignore_eos_bans_only_stop_ids():
    with_stop = state(SamplingParams(min_tokens=2, ignore_eos=True, stop_token_ids=[4]))
    without = state(SamplingParams(min_tokens=2, ignore_eos=True))
    batch = build_sampling_batch([with_stop, without], EOS, 10, CPU)
    assert batch.banned_tokens == {0: [4]}


def test_banned_tokens_are_never_sampled():
    logits = torch.full((200, 10), -5.0)
    logits[:, 1] = logits[:, 4] = 10.0  # eos and a stop id would win almost every draw
    states = [state(SamplingParams(min_tokens=1, stop_token_ids=[4], temperature=t)) for t in (0.0, 1.0) * 100]
    tokens = sample(logits, states).sampled_token_ids
    assert not torch.isin(tokens, torch.tensor([1, 4])).any()
    logits[0, 4] = 9.0
    done = sample(logits[:1], [state(SamplingParams(min_tokens=1, temperature=0.0), outputs=[9])])
    assert done.sampled_token_ids.tolist() == [1]  # once min_tokens is reached eos is allowed again


# ---- logprobs -----------------------------------------------------------------------------


def test_logprobs_come_from_raw_logits():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(6)) * 3
    params = SamplingParams(
        temperature=0.3, repetition_penalty=3.0, presence_penalty=2.0, min_tokens=5, top_k=4, logprobs=5
    )
    out = sample(logits, [state(params, prompt=[1, 2, 3], outputs=[4, 4]) for _ in range(4)])
    raw = torch.log_softmax(logits, dim=-1)
    top_values, top_ids = raw.topk(5, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 0], out.sampled_token_ids)
    assert torch.equal(out.logprob_token_ids[:, 1:], top_ids)
    torch.testing.assert_close(out.logprobs[:, 1:], top_values)
    torch.testing.assert_close(out.logprobs[:, 0], raw.gather(1, out.sampled_token_ids[:, None])[:, 0])
    assert (out.logprobs[:, 1:].diff(dim=-1) <= 0).all()  # best first


def test_sampled_rank_is_one_based_in_whole_vocabulary():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]] * 3)
    # Greedy with a penalty on token 1 picks token 3, which ranks 2nd in the raw logits.
    states = [state(SamplingParams(temperature=0.0, logprobs=1, repetition_penalty=10.0), prompt=[1]),
              state(SamplingParams(temperature=0.0, logprobs=0)),
              state(SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=10.0), prompt=[1, 3])]
    out = sample(logits, states)
    assert out.sampled_token_ids.tolist() == [3, 1, 2]
    assert out.sampled_ranks.tolist() == [2, 1, 3]
    assert out.logprob_token_ids.tolist() == [[3, 1, 3], [1, 1, 3], [2, 1, 3]]  # padded to the widest N


def test_zero_logprobs_returns_sampled_token_only():
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(8))
    out = sample(logits, [state(SamplingParams(logprobs=0))] * 2)
    assert out.logprob_token_ids.shape == (2, 1)
    assert torch.equal(out.logprob_token_ids[:, 0], out.sampled_token_ids)


def test_no_logprobs_when_none_asked():
    out = sample(torch.randn(2, 10), [state(SamplingParams())] * 2)
    assert out.logprobs is None and out.logprob_token_ids is None and out.sampled_ranks is None
