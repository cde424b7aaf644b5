"""The typed messages between the front end and its engine core, and the one channel that carries
them when the core runs in its own process (an in-process core takes the same messages directly).

Both processes belong to one replica: the child is started by the parent, with one end of a
socket pair that nobody else holds, so pickling is as trusted as a thread hand-off. Every
message still has a size limit, so a bug cannot make one side allocate without bound.
Requests travel as whole dataclasses (ProcessedPrompt, SamplingParams): a new field of either
reaches the core with no plumbing here.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from pagedserve.config import EngineConfig, ModelConfig, WorkerPlacement
from pagedserve.engine.engine_core_output import StepOutputs
from pagedserve.engine.input_processor import ProcessedPrompt
from pagedserve.sampling_params import SamplingParams

# A prompt of max_model_len ids pickles to a few bytes per id; 64 MiB is far above any message.
MAX_MESSAGE_BYTES = 64 * 1024**2


# ---- front end -> core ------------------------------------------------------------------------


@dataclass
class StartCore:
    """The first message: what the core builds its engine from."""

    config: EngineConfig
    placement: WorkerPlacement | None  # a Serve replica's bundles for Ray workers, else None
    ray_address: str | None  # the parent's Ray cluster (the Ray executor joins it), else None
    ray_namespace: str | None


@dataclass
class AddRequest:
    request_id: str  # the user's id; the core derives the n children (fan_out.py) as the front end does
    processed: ProcessedPrompt
    params: SamplingParams
    arrival_time: float  # time.monotonic() in the front end (one clock for the whole machine)


@dataclass
class AbortRequests:
    child_ids: list[str]  # scheduler ids (the front end knows each user request's children)


@dataclass
class StopRequests:
    child_ids: list[str]  # scheduler ids a stop string ended in the front end's detokenizer


@dataclass
class RefuseRequest:
    """An AddRequest the front end could not send (too large, unpicklable): the core ends the
    request's children with finish_reason "abort", as if it had refused the add itself."""

    request_id: str
    num_children: int  # the request's n: the core counts them as taken in
    reason: str


@dataclass
class RemoveLoRA:
    """An adapter the front end forgot: the workers drop its weights once no running request uses
    it (a request already taken in still finishes under it, reading it again if it must)."""

    lora_int_id: int


@dataclass
class ShutdownCore:
    """Leave the loop, release the workers and exit."""


# ---- core -> front end ------------------------------------------------------------------------


@dataclass
class CoreReady:
    model_config: ModelConfig  # as the core resolved it (max_model_len capped to the KV cache)
    num_kv_blocks: int


@dataclass
class CoreFailed:
    """The core could not build its engine: the error, raised again in the front end."""

    error: BaseException


@dataclass
class SchedulerGauges:
    """The scheduler's side of EngineStats, as of the end of a step."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage_perc: float = 0.0
    num_preemptions_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0


@dataclass
class CoreOutputs:
    """One step's news, sent as soon as the step ends (the front end detokenizes it while the
    core runs the next step)."""

    outputs: StepOutputs  # only requests with news: new tokens or an end
    gauges: SchedulerGauges = field(default_factory=SchedulerGauges)
    # Children the core has taken in so far (AddRequest x n): with the gauges' waiting count, the
    # front end knows how many requests wait, for admission control.
    num_added_children: int = 0
    dead_reason: str | None = None  # set when the engine died in this step: the core exits


# ---- the channel ------------------------------------------------------------------------------


def send(conn: Connection, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) > MAX_MESSAGE_BYTES:
        raise ValueError(f"a {type(message).__name__} of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    conn.send_bytes(data)


def recv(conn: Connection) -> Any:
    """The next message; EOFError when the other process has gone (its end closed)."""
    return pickle.loads(conn.recv_bytes(MAX_MESSAGE_BYTES))
