"""Truncated sampling from each row's top candidates against the full sort of every row.

Vocabularies here are larger than NUM_CANDIDATES, so both ways run: rows the candidates settle, and
rows that go through the sort. Each case draws at many uniforms and must pick, row by row, the token
the sort-based reference picks."""

from __future__ import annotations

import pytest
import torch

from pagedserve.workers.truncation import (
    NUM_CANDIDATES,
    _draw_from_candidates,
    apply_min_p,
    apply_top_k_top_p,
    sample_inverse_cdf,
    sample_truncated,
)

VOCAB = 2000


def reference(scaled, top_k, top_p, min_p, uniforms):
    probs = torch.softmax(apply_top_k_top_p(scaled, top_k, top_p), dim=-1)
    if min_p is not None:
        probs = apply_min_p(probs, min_p)
    return sample_inverse_cdf(probs, uniforms)


def logits(rows: int, spread: float, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * spread


def assert_same_draws(scaled, top_k=None, top_p=None, min_p=None):
    """Same token as the reference at 50 uniforms per row; returns which rows the candidates settled."""
    settled, _ = _draw_from_candidates(scaled, top_k, top_p, min_p, torch.zeros(scaled.shape[0], dtype=torch.float64))
    for u in torch.linspace(0.005, 0.995, 50, dtype=torch.float64):
        uniforms = torch.full((scaled.shape[0],), float(u), dtype=torch.float64)
        ours = sample_truncated(scaled, top_k, top_p, min_p, uniforms)
        assert torch.equal(ours, reference(scaled, top_k, top_p, min_p, uniforms)), f"uniform {float(u)}"
    return settled


def test_top_p_settles_peaked_rows_and_sorts_flat_ones():
    # Rows 0-3 peaked (a low temperature): a few tokens hold 0.9. Rows 4-7 nearly flat: the nucleus
    # is most of the vocabulary, far past the candidates.
    scaled = torch.cat([logits(4, 8.0), logits(4, 0.05, seed=1)])
    top_p = torch.full((8,), 0.9)
    settled = assert_same_draws(scaled, top_p=top_p)
    assert settled.tolist() == [True] * 4 + [False] * 4


def test_top_k_within_the_candidates_settles_and_above_them_sorts():
    scaled = logits(6, 1.0)
    top_k = torch.tensor([1, 20, 50, NUM_CANDIDATES - 1, NUM_CANDIDATES + 1, VOCAB])
    top_p = torch.tensor([1.0, 1.0, 0.8, 0.95, 0.95, 1.0])  # top_k = VOCAB is no truncation at all
    settled = assert_same_draws(scaled, top_k=top_k, top_p=top_p)
    assert settled.tolist() == [True, True, True, True, False, False]


def test_a_tie_at_the_last_candidate_goes_to_the_sort():
    # Ten tokens stand out and the other 1990 tie: the k-th of top_k=30 ties past the candidates.
    scaled = torch.zeros(2, VOCAB)
    scaled[:, :10] = torch.arange(10, 0, -1, dtype=torch.float32)
    settled = assert_same_draws(scaled, top_k=torch.tensor([30, 5]))
    assert settled.tolist() == [False, True]


def test_min_p_settles_when_the_last_candidate_is_below_its_threshold():
    scaled = torch.cat([logits(3, 6.0), logits(3, 0.05, seed=2)])
    min_p = torch.tensor([0.1, 0.0, 0.5, 0.1, 0.0, 0.5])
    settled = assert_same_draws(scaled, min_p=min_p)
    assert settled.tolist() == [True, False, True, False, False, False]


def test_every_truncation_at_once_per_row():
    scaled = torch.cat([logits(4, 5.0, seed=3), logits(4, 0.5, seed=4)])
    top_k = torch.tensor([10, VOCAB, 40, VOCAB, 10, VOCAB, 200, VOCAB])
    top_p = torch.tensor([0.9, 0.5, 1.0, 0.99, 0.9, 0.5, 0.7, 1.0])
    min_p = torch.tensor([0.0, 0.05, 0.2, 0.0, 0.0, 0.05, 0.0, 0.3])
    assert_same_draws(scaled, top_k=top_k, top_p=top_p, min_p=min_p)


def test_rows_with_few_allowed_tokens_draw_only_those():
    # A grammar's mask leaves three tokens; top_k above that keeps all three (the rest is -inf).
    scaled = torch.full((2, VOCAB), float("-inf"))
    scaled[:, [7, 900, 1999]] = torch.tensor([1.0, 2.0, 0.5])
    settled = assert_same_draws(scaled, top_k=torch.tensor([5, NUM_CANDIDATES]), top_p=torch.tensor([0.99, 0.5]))
    assert settled.all()
    uniforms = torch.rand(2, dtype=torch.float64)
    assert set(sample_truncated(scaled, torch.tensor([5, 5]), None, None, uniforms).tolist()) <= {7, 900, 1999}


@pytest.mark.parametrize("top_p", [1e-9, 0.3])
def test_the_most_likely_token_always_stays(top_p):
    scaled = logits(4, 3.0, seed=5)
    tokens = sample_truncated(scaled, None, torch.full((4,), top_p), None, torch.full((4,), 0.999, dtype=torch.float64))
    if top_p == 1e-9:
        assert torch.equal(tokens, scaled.argmax(-1))
    assert_same_draws(scaled, top_p=torch.full((4,), top_p))


def test_top_p_after_a_top_k_above_the_candidates_goes_to_the_sort():
    # Token 0 holds about a third of the whole row's mass but 85% of its top 200's, over which
    # top-p renormalises: with top_p 0.35 only token 0 stays. Measured against the whole row's
    # mass instead, the candidates would seem to settle it with about 50 tokens kept.
    scaled = -torch.arange(VOCAB, dtype=torch.float32).unsqueeze(0) * 1e-3
    scaled[0, 0] = torch.tensor(1000.0).log()
    settled = assert_same_draws(scaled, top_k=torch.tensor([200]), top_p=torch.tensor([0.35]))
    assert settled.tolist() == [False]
