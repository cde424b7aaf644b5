"""Is a bf16 engine's output what Hugging Face computes in bf16? A check on greedy completions,
used by tests/e2e/test_bf16_closeness.py and by compare_vllm.py (a speed figure from a run whose
outputs fail it is not reported).

HF is teacher-forced on the engine's own tokens (one forward pass over prompt + completion), so
every position is compared on the same context, however early the two would part if each ran
free. HF runs twice, in bf16 and in float32. At each position:
- top-1 agreement: the engine's greedy token is HF bf16's argmax there;
- top-1 against float32: the engine's token is HF float32's argmax, beside how often HF bf16's own
  argmax is;
- the logprob gap: the engine's logprob of its token against HF bf16's of the same token.

Two correct bf16 implementations part wherever float32's top two are closer than their rounding:
on SmolLM2-135M, HF bf16 picks HF float32's token at only 96% of positions, and our engine at 98%,
so a fixed 99% agreement between the two bf16 runs would fail a correct engine. The bounds are
therefore HF's own bf16 error, measured on the same tokens:
- top-1: the engine picks float32's token at least as often as HF bf16 does, less what chance
  allows. The two counts differ only where the engine's token is not HF bf16's: on each of those
  `d` positions at most one of the two is float32's. Two equally good roundings win these like
  coins, so the engine's shortfall has a standard deviation of at most sqrt(d); the bound is
  SIGMAS of them, and never less than AGREEMENT_SLACK (one position in a hundred). With 157
  teacher-forced positions a fixed 1% was a position and a half: a correct engine on a Zen 3
  (torch's own bf16 GEMM) fell two short, 150 against 152, on four disagreements. A wrong fast path
  disagrees at many positions and loses most of them, which the bound still fails;
- the mean logprob gap: both bf16 runs approximate the same float32 one, so
  |ours - HF_bf16| <= |ours - fp32| + |fp32 - HF_bf16|. An engine no less precise than HF's bf16
  gives a mean gap of at most twice HF bf16's own mean distance from float32 (GAP_FACTOR).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

AGREEMENT_SLACK = 0.01
SIGMAS = 3.0
GAP_FACTOR = 2.0


@dataclass
class Closeness:
    positions: int
    top1_agreement: float  # the engine's token is HF bf16's argmax
    top1_vs_fp32: float  # the engine's token is HF float32's argmax
    hf_bf16_top1_vs_fp32: float  # HF bf16's argmax is HF float32's: HF's own rounding
    mean_gap: float  # mean |engine logprob - HF bf16 logprob| of the engine's tokens
    hf_bf16_vs_fp32: float  # mean |HF bf16 - HF fp32| logprob of the same tokens
    bound: float  # GAP_FACTOR * hf_bf16_vs_fp32

    @property
    def top1_shortfall_allowed(self) -> float:
        """How far top1_vs_fp32 may fall below HF bf16's own, as a share of the positions."""
        disagreements = round((1 - self.top1_agreement) * self.positions)
        return max(AGREEMENT_SLACK, SIGMAS * math.sqrt(disagreements) / max(self.positions, 1))

    @property
    def passed(self) -> bool:
        return self.top1_vs_fp32 >= self.hf_bf16_top1_vs_fp32 - self.top1_shortfall_allowed and self.mean_gap <= self.bound

    def summary(self) -> dict:
        figures = asdict(self) | {"top1_shortfall_allowed": self.top1_shortfall_allowed}
        return {key: round(value, 4) if isinstance(value, float) else value for key, value in figures.items()} | {"passed": self.passed}


@torch.inference_mode()
def teacher_forced_logprobs(model, prompt_ids: list[int], context_ids: list[int]) -> torch.Tensor:
    """[len(context), vocab] float64 log-softmax of `model`'s logits at each position of
    `context_ids` after `prompt_ids` (the prediction of context_ids[i] from what precedes it)."""
    ids = torch.tensor([list(prompt_ids) + list(context_ids)])
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1]
    return torch.log_softmax(logits.double(), dim=-1)


Sample = tuple[list[int], list[int], list[int], "list[float] | None"]


def closeness(hf_bf16, hf_fp32, samples: list[Sample], cache: dict | None = None) -> Closeness:
    """`samples`: (prompt ids, the context forced at each position, the engine's greedy token at
    each position, its logprob or None). For the engine's own completion the context is the
    completion itself; teacher-forced on HF's tokens it is HF's completion. Without logprobs (an
    engine that returned none) only the top-1 figures are measured and the gaps read 0. `cache`
    keeps HF's passes between calls on the same contexts."""
    cache = {} if cache is None else cache
    agree = agree_fp32 = hf_agree_fp32 = positions = 0
    gaps, own = [], []
    for prompt, context, chosen_ids, logprobs in samples:
        if not chosen_ids:
            continue
        key = (tuple(prompt), tuple(context[: len(chosen_ids)]))
        if key not in cache:
            cache[key] = tuple(teacher_forced_logprobs(model, prompt, key[1]) for model in (hf_bf16, hf_fp32))
        bf16, fp32 = cache[key]
        chosen = torch.tensor(chosen_ids)
        agree += int((bf16.argmax(-1) == chosen).sum())
        agree_fp32 += int((fp32.argmax(-1) == chosen).sum())
        hf_agree_fp32 += int((bf16.argmax(-1) == fp32.argmax(-1)).sum())
        positions += len(chosen_ids)
        theirs = bf16.gather(1, chosen[:, None])[:, 0]
        own += (theirs - fp32.gather(1, chosen[:, None])[:, 0]).abs().tolist()
        if logprobs is not None:
            gaps += (torch.tensor(logprobs, dtype=torch.float64) - theirs).abs().tolist()
    mean = lambda values: sum(values) / len(values) if values else 0.0  # noqa: E731
    share = lambda count: count / max(positions, 1)  # noqa: E731
    return Closeness(positions, share(agree), share(agree_fp32), share(hf_agree_fp32), mean(gaps), mean(own), GAP_FACTOR * mean(own))


def load_hf_pair(model_path: str):
    """HF's bf16 and float32 models of one checkpoint folder."""
    from transformers import AutoModelForCausalLM

    return tuple(AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval() for dtype in (torch.bfloat16, torch.float32))
