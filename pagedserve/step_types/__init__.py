"""The step types: the only data that crosses the engine <-> worker boundary each step (pickled by
Ray or the step channel). A leaf: the engine and the workers import it; it imports nothing of the
project but the leaf `sampling_params` (a new request carries its SamplingParams once)."""

from pagedserve.step_types.model_runner_output import ModelRunnerOutput, TokenLogprobs
from pagedserve.step_types.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

__all__ = ["CachedRequestData", "ModelRunnerOutput", "NewRequestData", "SchedulerOutput", "TokenLogprobs"]
