"""Turns the scheduler's per-step token news into `RequestOutput`s: detokenizes, applies stop
strings, assembles logprobs, and merges the n completions of a request.

A request with n > 1 runs as n independent scheduler requests ("children", see fan_out.py); the
parent collects them. Streaming kinds emit each child's progress as it comes; FINAL_ONLY emits one
output holding all n completions when the last one finishes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.engine_core_output import EngineCoreOutput, FinishReason, StepOutputs
from pagedserve.engine.fan_out import child_ids, fan_out
from pagedserve.engine.input_processor import ResumeState
from pagedserve.engine.metrics import EngineStats
from pagedserve.step_types.model_runner_output import TokenLogprobs
from pagedserve.engine.request_output import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedserve.request_ids import child_request_id
from pagedserve.sampling_params import RequestOutputKind, SamplingParams


@dataclass(frozen=True)
class Finish:
    """How one completion ended: the reason, and what stopped it when a stop condition did."""

    reason: FinishReason
    stop_token_id: int | None = None  # the one of stop_token_ids that ended it
    stop_string: str | None = None  # the stop string found in its text
    error: str | None = None  # with FinishReason.ERROR: what failed

    @property
    def stop_reason(self) -> int | str | None:
        """vLLM's public `stop_reason`: the stop string or stop token id, whichever ended it."""
        return self.stop_string if self.stop_string is not None else self.stop_token_id


@dataclass
class ParentRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    completions: dict[int, CompletionOutput] = field(default_factory=dict)  # finished children
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return len(self.completions) == self.params.n


class RequestState:
    """One scheduler request's user-facing progress."""

    def __init__(self, parent: ParentRequest, index: int, params: SamplingParams, detokenizer: IncrementalDetokenizer):
        self.parent = parent
        self.index = index
        self.params = params
        self.detokenizer = detokenizer
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.num_sent_tokens = 0  # for DELTA outputs

    def replay(self, resume: ResumeState) -> None:
        """Take over a request another replica began: its tokens so far rebuild the detokenizer
        (offsets, stop-string window), and count as sent, as is the text its client received."""
        self.token_ids = list(resume.output_token_ids)
        self.num_sent_tokens = len(self.token_ids)
        if self.logprobs is not None:  # the client has these; only their count matters here
            self.logprobs = [{} for _ in self.token_ids]
            self.cumulative_logprob = resume.cumulative_logprob or 0.0
        self.detokenizer.replay(self.token_ids, resume.num_sent_chars)

    def completion(self, finish: Finish | None) -> CompletionOutput:
        finished = finish is not None
        delta = self.params.output_kind == RequestOutputKind.DELTA
        start = self.num_sent_tokens if delta else 0
        self.num_sent_tokens = len(self.token_ids)
        return CompletionOutput(
            index=self.index,
            text=self.detokenizer.get_next_output_text(finished, delta),
            token_ids=self.token_ids[start:],
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs[start:] if self.logprobs is not None else None,
            finish_reason=finish.reason.value if finished else None,
            stop_reason=finish.stop_reason if finished else None,
            error=finish.error if finished else None,
        )


class OutputProcessor:
    def __init__(self, tokenizer: Any, stats: EngineStats | None = None):
        self.tokenizer = tokenizer
        self.stats = stats or EngineStats()
        self.vocab_size = len(tokenizer)
        self.states: dict[str, RequestState] = {}  # by child (scheduler) request id
        self.parents: dict[str, ParentRequest] = {}  # by user request id
        self._token_text: dict[int, str] = {}  # decoded single tokens, for logprobs

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams, arrival_time: float,
        resume: ResumeState | None = None,
    ) -> list[tuple[str, SamplingParams]]:
        """Register a user request; returns the (child id, params) to schedule. A resumed one
        (n == 1, checked by the input processor) starts from what its client already has."""
        if request_id in self.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        parent = ParentRequest(request_id, prompt, prompt_token_ids, params, RequestMetrics(arrival_time))
        states: dict[str, RequestState] = {}
        for child in fan_out(request_id, params):
            detok = IncrementalDetokenizer(self.tokenizer, self.vocab_size, prompt_token_ids, child.params)
            states[child.request_id] = RequestState(parent, child.index, child.params, detok)
            if resume is not None:
                states[child.request_id].replay(resume)  # may refuse it: nothing is registered yet
        self.parents[request_id] = parent
        self.states.update(states)
        return [(child_id, state.params) for child_id, state in states.items()]

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return [] if parent is None else child_ids(request_id, parent.params.n)

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget user requests; returns the scheduler ids to abort."""
        child_ids = []
        now = time.monotonic()
        for request_id in request_ids:
            for child_id in self.child_ids(request_id):
                state = self.states.pop(child_id, None)
                if state is not None:
                    child_ids.append(child_id)
                    self.stats.record_finished(FinishReason.ABORT, now - state.parent.metrics.arrival_time)
            self.parents.pop(request_id, None)
        return child_ids

    def finish_aborted(self, child_ids: list[str]) -> list[RequestOutput]:
        """Final outputs (finish_reason "abort") for requests the engine had to give up."""
        outputs = []
        for child_id in child_ids:
            state = self.states.pop(child_id, None)
            if state is not None:
                self.stats.record_finished(FinishReason.ABORT, time.monotonic() - state.parent.metrics.arrival_time)
                output = self._make_output(state, Finish(FinishReason.ABORT), 0)
                if output is not None:
                    outputs.append(output)
        return outputs

    def process_outputs(self, news: StepOutputs) -> tuple[list[RequestOutput], list[str]]:
        """Returns the outputs to deliver, and the scheduler ids a stop string ended (to abort).
        The plain rows take the same path as a full output without its extras."""
        now = time.monotonic()
        request_outputs, stopped_by_string = [], []
        states = self.states
        for out in news.outputs:
            state = states.get(out.req_id)
            if state is not None:
                self._take(state, out.req_id, out.new_token_ids, out, now, request_outputs, stopped_by_string)
        for req_id, token_id in zip(news.token_req_ids, news.token_ids):
            state = states.get(req_id)
            if state is not None:
                self._take(state, req_id, [token_id], None, now, request_outputs, stopped_by_string)
        return request_outputs, stopped_by_string

    def _take(
        self, state: RequestState, req_id: str, new_token_ids: list[int], out: EngineCoreOutput | None, now: float,
        request_outputs: list[RequestOutput], stopped_by_string: list[str],
    ) -> None:
        """One row's news: `out` None for a plain row (one token, not the first, nothing else)."""
        finish = self._update(state, new_token_ids, out, now)
        if finish is not None:
            if finish.stop_string is not None and (out is None or out.finish_reason is None):
                stopped_by_string.append(req_id)
            del self.states[req_id]
            self.stats.record_finished(finish.reason, now - state.parent.metrics.arrival_time)
        request_output = self._make_output(state, finish, out.num_cached_tokens if out is not None else 0)
        if request_output is not None:
            request_outputs.append(request_output)

    def _update(self, state: RequestState, new_token_ids: list[int], out: EngineCoreOutput | None, now: float) -> Finish | None:
        self._record_token_times(state, len(new_token_ids), out.first_scheduled_time if out is not None else None, now)
        state.token_ids.extend(new_token_ids)
        if out is not None and out.new_logprobs is not None and state.logprobs is not None:
            self._append_logprobs(state, out.new_logprobs)
        finish_reason = out.finish_reason if out is not None else None
        stop_string = state.detokenizer.update(new_token_ids, finish_reason == FinishReason.STOP)
        if stop_string is not None:  # a stop string wins over a length cap in the same token
            return Finish(FinishReason.STOP, stop_string=stop_string)
        if finish_reason is None:
            return None
        return Finish(finish_reason, stop_token_id=out.stop_token_id, error=out.error)

    def _record_token_times(self, state: RequestState, num_new: int, first_scheduled_time: float | None, now: float) -> None:
        metrics, stats = state.parent.metrics, self.stats
        if not state.token_ids:  # this child's first token: its prompt is processed
            stats.prompt_tokens_total += len(state.parent.prompt_token_ids)
            if metrics.first_token_time is None:
                metrics.first_token_time = now
                metrics.first_scheduled_time = first_scheduled_time
                stats.time_to_first_token_seconds.observe(now - metrics.arrival_time)
                if first_scheduled_time is not None:
                    stats.request_queue_time_seconds.observe(first_scheduled_time - metrics.arrival_time)
        elif metrics.last_token_time is not None:
            stats.inter_token_latency_seconds.observe(now - metrics.last_token_time)
        metrics.last_token_time = now
        stats.generation_tokens_total += num_new

    def _append_logprobs(self, state: RequestState, lp: TokenLogprobs) -> None:
        entry = {}
        for rank_in_top, (token_id, value) in enumerate(zip(lp.token_ids, lp.logprobs)):
            rank = lp.sampled_rank if rank_in_top == 0 else rank_in_top
            if token_id not in entry:
                entry[token_id] = Logprob(value, rank, self._decode_token(token_id))
        state.logprobs.append(entry)
        state.cumulative_logprob += lp.logprobs[0]

    def _decode_token(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id]) if token_id < self.vocab_size else ""
            self._token_text[token_id] = text
        return text

    def _make_output(self, state: RequestState, finish: Finish | None, num_cached: int) -> RequestOutput | None:
        parent = state.parent
        parent.num_cached_tokens = max(parent.num_cached_tokens, num_cached)
        finished = finish is not None
        kind = state.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        completion = state.completion(finish)
        if finished:
            parent.completions[state.index] = completion
        if kind == RequestOutputKind.FINAL_ONLY:
            if not parent.finished:
                return None
            completions = [parent.completions[i] for i in range(parent.params.n)]
        else:
            completions = [completion]
        if parent.finished:
            parent.metrics.finished_time = time.monotonic()
            del self.parents[parent.request_id]
        return RequestOutput(
            parent.request_id, parent.prompt, parent.prompt_token_ids, completions, parent.finished, parent.num_cached_tokens, parent.metrics
        )
