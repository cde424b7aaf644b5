"""Batched sampling: greedy, temperature, top-k, top-p, min-p, penalties, per-request seeds,
and logprobs.

Logprobs come from the raw logits, before penalties, temperature and truncation (vLLM's default),
but after a grammar's mask: a token the grammar forbids has logprob -inf, as in vLLM, whose
runner masks the logits before its sampler sees them.
Random rows sample by inverting their cumulative distribution at one uniform draw per row (no
noise over the whole vocabulary); greedy rows cost an argmax and draw nothing. A seeded request
draws its uniform from a generator seeded by (seed, output index): the token depends only on its own
logits, seed and position, not on the batch it shares, nor on whether it was preempted or its worker
restarted in between. Truncation (top-k, top-p, min-p) works on each row's likeliest tokens and
sorts a row only when they do not settle it (workers/truncation.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedserve.kernels import native_build
from pagedserve.sampling_params import GREEDY_TEMPERATURE_EPS
from pagedserve.workers.grammar_mask import apply_grammar
from pagedserve.workers.truncation import sample_inverse_cdf, sample_truncated


@dataclass
class Penalties:
    presence: torch.Tensor  # [rows] float
    frequency: torch.Tensor  # [rows] float
    repetition: torch.Tensor  # [rows] float
    prompt_mask: torch.Tensor  # [rows, vocab] bool: token occurs in the prompt
    output_counts: torch.Tensor  # [rows, vocab] float: occurrences among the outputs


@dataclass
class SamplingBatch:
    """Per-row sampling settings of one step, built by the model runner."""

    temperature: torch.Tensor  # [rows] float; rows below GREEDY_TEMPERATURE_EPS are greedy
    all_greedy: bool
    top_k: torch.Tensor | None = None  # [rows] long; vocab size where disabled; None if no row uses it
    top_p: torch.Tensor | None = None  # [rows] float; None if no row uses it
    min_p: torch.Tensor | None = None  # [rows] float; None if no row uses it
    seeds: dict[int, int] = field(default_factory=dict)  # row -> per-step seed of a seeded request
    penalties: Penalties | None = None
    banned_tokens: dict[int, list[int]] = field(default_factory=dict)  # row -> ids masked (min_tokens)
    logit_bias: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)  # row -> (ids, biases)
    num_logprobs: list[int | None] | None = None  # per row; None when no row asked
    # Structured outputs (workers/grammar_mask.py): rows that sample under a grammar, and each
    # one's packed bitmask row ([len(grammar_rows), words] int32, on the CPU: bit i of word
    # i // 32 set, token i allowed). None when no row is constrained.
    grammar_rows: torch.Tensor | None = None
    grammar_bitmask: torch.Tensor | None = None


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [rows] long
    # With logprobs: [rows, 1 + max N] ids and logprobs (sampled token first), and its rank.
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    sampled_ranks: torch.Tensor | None = None


class Sampler:
    def __init__(self, seed: int, device: torch.device):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        is_constrained = batch.grammar_rows is not None
        edits_logits = batch.banned_tokens or batch.penalties is not None or batch.logit_bias
        if batch.all_greedy and batch.num_logprobs is None and not is_constrained and not edits_logits:
            return SamplerOutput(argmax_rows(logits))  # in the logits' own dtype: no float32 copy
        floats = logits.float()
        if is_constrained:  # before the logprobs, as vLLM masks in its runner before its sampler
            # The mask writes in place: into the float copy, or into a clone of float32 logits
            # (never into the caller's tensor).
            floats = floats.clone() if floats is logits else floats
            apply_grammar(floats, batch.grammar_rows, batch.grammar_bitmask)
        logits = floats
        raw_logprobs = torch.log_softmax(logits, dim=-1) if batch.num_logprobs is not None else None
        if edits_logits:
            logits = logits if is_constrained else logits.clone()
            _add_logit_bias(logits, batch.logit_bias)
            _ban_tokens(logits, batch.banned_tokens, is_constrained=is_constrained)
            if batch.penalties is not None:
                _apply_penalties(logits, batch.penalties)
        sampled = self._sample(logits, batch)
        if raw_logprobs is None:
            return SamplerOutput(sampled)
        return SamplerOutput(sampled, *_gather_logprobs(raw_logprobs, sampled, batch.num_logprobs))

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Greedy rows cost an argmax; only the random rows are scaled, truncated and drawn from."""
        if batch.all_greedy:
            return argmax_rows(logits)
        is_random = batch.temperature >= GREEDY_TEMPERATURE_EPS
        rows = is_random.nonzero().squeeze(1)
        row_ids = rows.tolist()
        every_row = len(row_ids) == logits.shape[0]

        def pick(values: torch.Tensor | None) -> torch.Tensor | None:
            return values if values is None or every_row else values[rows]

        scaled = pick(logits) / pick(batch.temperature).unsqueeze(1)
        uniforms = self._uniforms(row_ids, batch.seeds, scaled.device)
        if batch.top_k is not None or batch.top_p is not None or batch.min_p is not None:
            drawn = sample_truncated(scaled, pick(batch.top_k), pick(batch.top_p), pick(batch.min_p), uniforms)
        else:
            drawn = sample_inverse_cdf(torch.softmax(scaled, dim=-1), uniforms)
        if every_row:
            return drawn
        return argmax_rows(logits).index_copy_(0, rows, drawn)

    def _uniforms(self, row_ids: list[int], seeds: dict[int, int], device: torch.device) -> torch.Tensor:
        """One uniform in [0, 1) per random row: from the sampler's stream, or for a seeded row
        from its own generator, so its token depends on its seed and position alone."""
        uniforms = torch.rand(len(row_ids), generator=self.generator, dtype=torch.float64, device=device)
        for index, row in enumerate(row_ids):
            if row in seeds:
                row_generator = torch.Generator(device=device).manual_seed(seeds[row])
                uniforms[index] = torch.rand(1, generator=row_generator, dtype=torch.float64, device=device)[0]
        return uniforms


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's token id of largest logit, by torch's rules (the first of equal values; a NaN
    counts as largest). On the CPU the native kernel (csrc/cpu_argmax.cpp) splits the rows among
    torch's threads and reads them in their own dtype, where torch's argmax takes a row on one
    thread: 0.71 against 5.75 ms for 211 bf16 rows of SmolLM2's 49k vocabulary, the float32 copy
    included (2-core Zen 4, `benchmarks/sampler_cpu.py`)."""
    if (
        logits.device.type == "cpu"
        and logits.dim() == 2
        and logits.stride(-1) == 1
        and logits.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and native_build.load()
    ):
        ids = torch.empty(logits.shape[0], dtype=torch.long)
        torch.ops.pagedserve_cpu.argmax_rows(ids, logits)
        return ids
    return logits.argmax(dim=-1)


def step_seed(seed: int, output_index: int) -> int:
    """A 63-bit seed for one position of a seeded request (splitmix64 of the pair)."""
    x = (seed * 0x9E3779B97F4A7C15 + output_index + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) >> 1


def _add_logit_bias(logits: torch.Tensor, bias: dict[int, tuple[list[int], list[float]]]) -> None:
    """OpenAI's logit_bias: added to the raw logits (before penalties, as vLLM does); logprobs
    stay those of the unbiased model."""
    for row, (token_ids, values) in bias.items():
        logits[row, token_ids] += torch.tensor(values, dtype=logits.dtype, device=logits.device)


def _ban_tokens(logits: torch.Tensor, banned: dict[int, list[int]], is_constrained: bool = False) -> None:
    for row, token_ids in banned.items():
        kept = logits[row, token_ids] if is_constrained else None  # (advanced indexing: a copy)
        logits[row, token_ids] = float("-inf")
        # A grammar that allows only the banned stop tokens (min_tokens not reached, the grammar
        # complete): the grammar wins, or the row could sample nothing.
        if is_constrained and bool(torch.isneginf(logits[row]).all()):
            logits[row, token_ids] = kept


def _apply_penalties(logits: torch.Tensor, p: Penalties) -> None:
    """vLLM's order: repetition (prompt and output tokens), then frequency and presence (outputs)."""
    seen = p.prompt_mask | (p.output_counts > 0)
    repetition = torch.where(seen, p.repetition.unsqueeze(1), torch.ones_like(logits))
    logits.copy_(torch.where(logits > 0, logits / repetition, logits * repetition))
    logits -= p.frequency.unsqueeze(1) * p.output_counts
    logits -= p.presence.unsqueeze(1) * (p.output_counts > 0).to(logits.dtype)


def _gather_logprobs(
    logprobs: torch.Tensor, sampled: torch.Tensor, num_logprobs: list[int | None]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    max_n = max(n or 0 for n in num_logprobs)
    sampled_logprob = logprobs.gather(1, sampled.unsqueeze(1))
    ranks = (logprobs > sampled_logprob).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(max_n, dim=-1) if max_n else (logprobs[:, :0], sampled[:, None][:, :0])
    ids = torch.cat([sampled.unsqueeze(1), top_ids], dim=1)
    values = torch.cat([sampled_logprob, top_logprobs], dim=1)
    return ids, values, ranks
