"""What users get back (vLLM's names): `RequestOutput` with one `CompletionOutput` per sample."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1-based rank in the whole vocabulary
    decoded_token: str | None = None


# One dict per generated token: token id -> its Logprob (the sampled token and the top N).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # a FinishReason value ("stop", "length", "abort", "error") once finished
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # With finish_reason "error": why (a grammar that did not compile in time). Not in vLLM, whose
    # "error" says only "internal error"; here the caller's own input failed, so it is told how.
    error: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Times (time.monotonic) of a request's life, for latency metrics."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = field(default=None, repr=False)

    def merge_delta(self, later: RequestOutput) -> None:
        """Fold a later DELTA output of the same request into this one, so a consumer that fell
        behind gets one larger chunk instead of many small ones."""
        for new in later.outputs:
            mine = next((c for c in self.outputs if c.index == new.index), None)
            if mine is None:
                self.outputs.append(new)
                continue
            mine.text += new.text
            mine.token_ids = mine.token_ids + new.token_ids
            if new.logprobs is not None:
                mine.logprobs = (mine.logprobs or []) + new.logprobs
            mine.cumulative_logprob = new.cumulative_logprob
            mine.finish_reason, mine.stop_reason, mine.error = new.finish_reason, new.stop_reason, new.error
        self.finished = later.finished
        self.num_cached_tokens = later.num_cached_tokens
        self.metrics = later.metrics
