"""What the client has of a stream so far, choice by choice: what a handover resumes from."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.engine.input_processor import ResumeState
from pagedserve.engine.request_output import CompletionOutput, RequestOutput
from pagedserve.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class ChoiceProgress:
    """What the client has of one choice (one of a request's n samples)."""

    output_token_ids: list[int] = field(default_factory=list)
    num_sent_chars: int = 0
    cumulative_logprob: float | None = None
    is_finished: bool = False

    def record(self, completion: CompletionOutput) -> None:
        self.output_token_ids += completion.token_ids
        self.num_sent_chars += len(completion.text)
        self.cumulative_logprob = completion.cumulative_logprob
        self.is_finished = self.is_finished or completion.finish_reason is not None

    def resume(self) -> ResumeState:
        return ResumeState(list(self.output_token_ids), self.num_sent_chars, self.cumulative_logprob)


@dataclass
class StreamProgress:
    """What the client has of one engine request so far (DELTA streams), choice by choice."""

    prompt_token_ids: list[int] | None = None  # from the first item
    choices: dict[int, ChoiceProgress] = field(default_factory=dict)  # by choice index
    num_items: int = 0
    is_finished: bool = False  # the final item arrived: only the stream's end is left to read

    def record(self, output: RequestOutput) -> None:
        if self.prompt_token_ids is None:
            self.prompt_token_ids = list(output.prompt_token_ids)
        self.num_items += 1
        for completion in output.outputs:
            self.choices.setdefault(completion.index, ChoiceProgress()).record(completion)
        self.is_finished = self.is_finished or output.finished

    def can_move(self, params: SamplingParams) -> bool:
        """Nothing sent yet: start again anywhere. Else only a stream (DELTA outputs) resumes,
        and not once its final item arrived (a resume would have no tokens left to make)."""
        if self.is_finished:
            return False
        return self.num_items == 0 or params.output_kind == RequestOutputKind.DELTA

    def resume(self) -> ResumeState | None:
        """The ResumeState of a one-sample request; None: nothing sent, start again."""
        if self.num_items == 0:
            return None
        return self.choices.get(0, ChoiceProgress()).resume()

    def unfinished_choices(self, n: int) -> dict[int, ChoiceProgress]:
        """By index, the choices of an n-sample request still to finish (a new one if none came)."""
        choices = {i: self.choices.get(i) or ChoiceProgress() for i in range(n)}
        return {i: choice for i, choice in choices.items() if not choice.is_finished}
