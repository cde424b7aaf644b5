"""Top-k, top-p and min-p sampling without sorting the vocabulary, where that is exact.

The plain way (`sample_by_sort`, kept as the reference and the fallback) sorts every row of the
logits. For 128 rows of SmolLM2's 49k vocabulary that took 340 ms on two Zen 4 cores, about as
long as the model's whole decode step at that batch. A nucleus is nearly always small (temperature
0.2 and top_p 0.9 keep a handful of tokens), so a row's K most likely tokens (one `topk` pass)
usually hold every token truncation keeps: the same rows cost 11.5 ms that way
(benchmarks/sampler_cpu.py). Whether they do follows exactly from the
candidates alone (and, for top-p without top-k, the row's softmax denominator):

- top-k (k <= K): a token outside the candidates is below the k-th, unless the K-th ties with it;
- top-p: the first token outside has all the candidates' mass above it; once that reaches top_p,
  it and everything below it is dropped;
- min-p: a token outside is no likelier than the last candidate; once that one is below the
  threshold, so is every token outside.

A row for which none of these settles it (a wide nucleus at a high temperature, a top_k above K)
goes through the sort, alone. Kept candidates are drawn by the same inverse CDF as every other
row, over the candidates in vocabulary order, so a uniform picks the token the full-vocabulary
draw picks (up to float rounding at a boundary).
"""

from __future__ import annotations

import torch

# Candidates per row: the cost of topk grows slowly with it (200 x 49k rows, two Zen 4 cores: 14 ms
# at 64, 18 ms at 128, 25 ms at 256); generation configs' top_k is 20 to 50.
NUM_CANDIDATES = 128

# exp() of a float32 below about -87 is subnormal, and subnormals are slow on x86: at temperature
# 0.2 most of a row's 49k terms land there (SmolLM2, 256 rows: 109 ms, clamped 24 ms). Clamping
# adds at most vocab * exp(-80) ~ 1e-30 (masked -inf logits included) to a sum of at least 1
# (the top token's term), far below one float32 rounding.
EXP_FLOOR = -80.0


def sample_truncated(
    scaled: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """One token per row of temperature-scaled logits [rows, vocab], truncated by top-k, then
    top-p on the renormalised mass, then min-p (vLLM's order), drawn at `uniforms` [rows]."""
    settled, tokens = _draw_from_candidates(scaled, top_k, top_p, min_p, uniforms)
    rest = (~settled).nonzero().squeeze(1)
    if len(rest):
        def pick(values):
            return None if values is None else values[rest]

        tokens[rest] = sample_by_sort(scaled[rest], pick(top_k), pick(top_p), pick(min_p), uniforms[rest])
    return tokens


def sample_by_sort(
    scaled: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """`sample_truncated` by a full sort of every row: the reference, and the way for rows the
    candidates do not settle."""
    probs = torch.softmax(apply_top_k_top_p(scaled, top_k, top_p), dim=-1)
    if min_p is not None:
        probs = apply_min_p(probs, min_p)
    return sample_inverse_cdf(probs, uniforms)


def _draw_from_candidates(scaled, top_k, top_p, min_p, uniforms) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows settled within their candidates [rows] bool, their tokens [rows] long; other rows'
    entries are meaningless)."""
    vocab = scaled.shape[-1]
    num = min(NUM_CANDIDATES, vocab)
    values, ids = scaled.topk(num, dim=-1)  # descending
    keep = torch.ones_like(values, dtype=torch.bool)
    # Every token outside the candidates is dropped (or there is none).
    settled = torch.full((scaled.shape[0],), num == vocab, dtype=torch.bool, device=scaled.device)
    unsettleable = torch.zeros_like(settled)  # its kept set may reach outside: the sort decides
    relative = (values - values[:, :1]).exp()  # exp(x - max): 0 for -inf logits
    if top_k is not None:
        k = top_k.clamp(1, vocab)
        within = k <= num
        kth = values.gather(1, (k.clamp(max=num) - 1).unsqueeze(1)).squeeze(1)
        keep &= values >= kth.unsqueeze(1)  # all of them where k > num (kth is then the last)
        settled_by_k = within & ((values[:, -1] < kth) | torch.isneginf(kth))
        settled |= settled_by_k
        # Top-p renormalises over the top-k set: a row whose set may reach outside cannot be settled.
        unsettleable |= (k < vocab) & ~settled_by_k
    if top_p is not None:
        weights = relative * keep
        total = weights.sum(-1)  # the softmax denominator where nothing outside is kept
        if not bool(settled.all()):
            total = torch.where(settled, total, _row_mass(scaled, values[:, 0]))
        mass = (weights / total.unsqueeze(1)).double()
        inclusive = mass.cumsum(-1)
        applies = top_p < 1.0
        keep &= ~applies.unsqueeze(1) | ((inclusive - mass) < top_p.unsqueeze(1))
        settled |= applies & (inclusive[:, -1] >= top_p)
    if min_p is not None:
        applies = min_p > 0.0
        keep &= ~applies.unsqueeze(1) | (relative >= min_p.unsqueeze(1))
        settled |= applies & (relative[:, -1] < min_p)
    settled &= ~unsettleable
    return settled, _inverse_cdf_in_vocabulary_order(ids, relative * keep, uniforms)


def _row_mass(scaled: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """sum(exp(x - max)) over each whole row: the softmax denominator in `relative`'s units."""
    return (scaled - row_max.unsqueeze(1)).clamp_(min=EXP_FLOOR).exp_().sum(-1)


def _inverse_cdf_in_vocabulary_order(ids: torch.Tensor, weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The token the full-vocabulary inverse CDF would pick: the candidates put back in vocabulary
    order, so the cumulative mass grows in the same order as over the whole row."""
    order = ids.argsort(dim=-1)
    picked = sample_inverse_cdf(weights.gather(1, order), uniforms)
    return ids.gather(1, order).gather(1, picked.unsqueeze(1)).squeeze(1)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask to -inf everything outside each row's top-k, then outside its top-p nucleus, by a full
    sort of each row."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        vocab = logits.shape[-1]
        kth = sorted_logits.gather(1, (vocab - top_k.clamp(1, vocab)).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        outside = cumulative <= 1 - top_p.unsqueeze(1)
        outside[:, -1] = False  # the most likely token always stays
        sorted_logits.masked_fill_(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return probs.masked_fill(probs < threshold, 0.0)


def sample_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Row i's token is the first whose cumulative probability passes uniforms[i] times the row's
    total: one random number per row (not one per vocabulary entry), and a token of probability
    zero can never be picked (its cumulative value equals its predecessor's)."""
    cdf = probs.double().cumsum(dim=-1)
    targets = (uniforms * cdf[:, -1]).unsqueeze(1)
    tokens = torch.searchsorted(cdf, targets, right=True).squeeze(1)
    # Rounding may put a target at the very total: fall back to the last token that has mass.
    last_with_mass = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)
    return torch.minimum(tokens, last_with_mass)
