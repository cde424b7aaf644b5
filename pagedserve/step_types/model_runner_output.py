"""The model runner's output: what the sampling rank sends back to the engine each step. Plain
data: the workers fill it, the scheduler reads it (see step_types/__init__.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenLogprobs:
    """Log-probabilities at one position, from the raw logits (before penalties and temperature)."""

    token_ids: list[int]  # the sampled token first, then the top-N (it may appear twice)
    logprobs: list[float]  # parallel to token_ids
    sampled_rank: int  # 1-based rank of the sampled token among the whole vocabulary


@dataclass
class ModelRunnerOutput:
    """What the sampling rank returns: one token for each request that reached the end of its
    known tokens this step (a partial prefill chunk samples nothing)."""

    req_ids: list[str]  # the requests that sampled, in the batch's order
    sampled_token_ids: list[int]  # parallel to req_ids
    logprobs: dict[str, TokenLogprobs] | None = None  # only requests that asked for them
    # With LoRA on: the adapters the sampling rank holds or has read, which a step can run
    # without a file read (the scheduler holds a request back until its adapter is here).
    ready_lora_ids: frozenset[int] | None = None

    @classmethod
    def empty(cls) -> ModelRunnerOutput:
        return cls([], [])
