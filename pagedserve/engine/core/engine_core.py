"""EngineCore: the scheduler, the KV cache manager, the executor and worker recovery, and nothing
else (no tokenizer, no text). The front end (LLMEngine) reaches it only through a core client
(client.py), with the messages of messages.py: in-process (InprocClient calls `handle` and
`step` directly) or in its own process (proc.py runs the same calls in a busy loop).

A step is: schedule -> execute on the workers -> update the scheduler. The news of each request
goes back in a StepOutputs (plain one-token rows as columns, an EngineCoreOutput for the rest);
detokenizing, stop strings and merging the n completions are the front end's. A stop string found
there comes back as StopRequests: in its own process the core may have computed one more token of
that request meanwhile, which the front end drops.

Grammar state for structured outputs sits beside the scheduler here (StructuredOutputManager: the
scheduler asks it for each request's allowed tokens and advances it with update_from_output).
Where a later feature lives: LoRA adapter slots sit beside the executor (the core maps a request's adapter to a slot when it
schedules it, and the step types carry the slot ids to the workers).
"""

from __future__ import annotations

import functools
import logging

from pagedserve.config import EngineConfig, ModelConfig, WorkerPlacement
from pagedserve.engine.core.kv_cache_manager import KVCacheManager
from pagedserve.engine.core.messages import AbortRequests, AddRequest, CoreOutputs, RefuseRequest, RemoveLoRA, SchedulerGauges, StopRequests
from pagedserve.engine.core.model_setup import fit_max_model_len
from pagedserve.engine.core.request import Request, RequestStatus
from pagedserve.engine.core.scheduler import Scheduler
from pagedserve.engine.core.step_split import merge_outputs, split_step
from pagedserve.engine.engine_core_output import EngineCoreOutput, FinishReason, StepOutputs
from pagedserve.engine.fan_out import child_ids, fan_out
from pagedserve.engine.structured_outputs import StructuredOutputManager
from pagedserve.engine.tokenizer import load_tokenizer
from pagedserve.executor.executor import StepTooLargeError, WorkerGroupError
from pagedserve.executor.factory import create_executor
from pagedserve.step_types.model_runner_output import ModelRunnerOutput
from pagedserve.step_types.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, placement: WorkerPlacement | None = None):
        """`model_config`: resolved (model_setup.resolve_core_model_config); its max_model_len is
        capped here to what the KV cache holds. `placement`: a Serve replica's bundles for the
        workers (see create_executor)."""
        self.config = config
        self.placement = placement
        self.executor = create_executor(config, model_config, placement)
        try:
            self.num_kv_blocks = self._initialize_kv_cache()
            self.model_config = fit_max_model_len(model_config, config.max_model_len, self.num_kv_blocks * config.block_size)
        except BaseException:
            self.executor.shutdown()
            raise
        self.num_worker_restarts = 0
        self._consecutive_failures = 0
        self.dead_reason: str | None = None
        self.kv_cache_manager = KVCacheManager(self.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        # Grammar state sits beside the scheduler; the grammar compilers need the vocabulary
        # (the one thing the core reads a tokenizer for, on the first constrained request).
        self.structured_outputs = StructuredOutputManager(
            functools.partial(load_tokenizer, self.model_config.tokenizer_path), self.model_config.vocab_size,
            list(self.model_config.eos_token_ids), config.structured_outputs_backend, config.structured_outputs_compile_timeout_s,
            reasoning_parser=config.reasoning_parser,
        )
        if config.structured_outputs_prewarm:
            self.structured_outputs.prewarm()
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_num_batched_tokens=config.token_budget(self.model_config.max_model_len),
            max_num_seqs=config.max_num_seqs,
            enable_chunked_prefill=config.enable_chunked_prefill,
            structured_outputs=self.structured_outputs,
            max_loras=config.max_loras if config.enable_lora else None,
            schedule_conservativeness=config.schedule_conservativeness,
            min_num_batched_tokens=config.min_num_batched_tokens,
        )
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        # Children taken in so far (AddRequest x n, refused ones too): with the scheduler's waiting
        # count, the front end's client knows how many wait, counting those still on their way.
        self.num_added_children = 0
        self.pending_failures: list[EngineCoreOutput] = []  # adds the core refused, to report
        # A message changed the scheduler since the last step was reported: before going idle the
        # core reports its gauges once more (an abort of the last request must show as 0 running).
        self.is_report_due = False

    def _initialize_kv_cache(self) -> int:
        num_blocks = self.executor.determine_num_kv_blocks()
        if num_blocks < 1:
            raise ValueError(
                "the KV cache holds no block: give it more memory (kv_cache_memory_bytes, "
                "gpu_memory_utilization) or set num_gpu_blocks_override"
            )
        # The scheduler's block pool and the workers' caches must agree on the count.
        self.executor.initialize_kv_cache(num_blocks)
        logger.info("KV cache: %d blocks of %d tokens", num_blocks, self.config.block_size)
        return num_blocks

    # ---- messages from the front end -------------------------------------------------------

    def handle(self, message: AddRequest | AbortRequests | StopRequests | RefuseRequest | RemoveLoRA) -> None:
        self.is_report_due = True
        if isinstance(message, AddRequest):
            self._add(message)
        elif isinstance(message, AbortRequests):
            self.scheduler.finish_requests(message.child_ids, RequestStatus.FINISHED_ABORTED)
        elif isinstance(message, StopRequests):
            self.scheduler.finish_requests(message.child_ids, RequestStatus.FINISHED_STOPPED)
        elif isinstance(message, RemoveLoRA):
            self.scheduler.retire_lora(message.lora_int_id)
        elif isinstance(message, RefuseRequest):
            logger.error("the front end could not send request %r: %s", message.request_id, message.reason)
            self.num_added_children += message.num_children
            self._fail_request(message.request_id, message.num_children)
        else:
            raise TypeError(f"the engine core got an unknown message: {type(message).__name__}")

    def _add(self, message: AddRequest) -> None:
        params, processed = message.params, message.processed
        self.num_added_children += params.n
        resumed = processed.resume.output_token_ids if processed.resume is not None else ()
        try:
            if self.dead_reason is not None:
                raise RuntimeError(f"the engine core is dead: {self.dead_reason}")
            requests = [
                Request(
                    child.request_id, processed.prompt_token_ids, child.params, self.eos_token_ids,
                    self.model_config.max_model_len, message.arrival_time, resumed, processed.cache_salt,
                    processed.lora_request,
                )
                for child in fan_out(message.request_id, params)
            ]
        except Exception:  # the front end validated it; if the core still cannot take it, end it alone
            logger.exception("the engine core could not add request %r", message.request_id)
            self._fail_request(message.request_id, params.n)
            return
        for request in requests:
            self.scheduler.add_request(request)

    def _fail_request(self, request_id: str, n: int) -> None:
        """End a request the core never scheduled: its children finish with "abort" next step."""
        self.pending_failures.extend(EngineCoreOutput(c, [], finish_reason=FinishReason.ABORT) for c in child_ids(request_id, n))

    # ---- the step ---------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.pending_failures) or self.scheduler.has_unfinished_requests()

    def step(self) -> CoreOutputs:
        """One step's news: the refused adds, then what the scheduler's step produced."""
        failures, self.pending_failures = self.pending_failures, []
        news = self._run_scheduler_step() if self.scheduler.has_unfinished_requests() else StepOutputs()
        news.outputs[:0] = failures
        self.is_report_due = False
        return CoreOutputs(news, self.gauges(), self.num_added_children, self.dead_reason)

    def idle_report(self) -> CoreOutputs | None:
        """The gauges once more when messages changed the scheduler and no step will report it."""
        if self.has_work() or not self.is_report_due:
            return None
        self.is_report_due = False
        return CoreOutputs(StepOutputs(), self.gauges(), self.num_added_children, self.dead_reason)

    def _run_scheduler_step(self) -> StepOutputs:
        scheduler_output = self.scheduler.schedule()
        runner_output, refused = ModelRunnerOutput.empty(), []
        # An idle step still runs when requests ended, so the workers drop their state, and when
        # adapters are being read or were removed (the workers start the reads and report the
        # ones done; they drop removed adapters).
        if scheduler_output.total_num_scheduled_tokens or scheduler_output.dropped_req_ids or scheduler_output.has_lora_news:
            try:
                runner_output, refused = self._execute(scheduler_output)
                self._consecutive_failures = 0
            except WorkerGroupError as error:
                # The step never happened: nothing of it reached the scheduler's request state.
                return StepOutputs(self._recover_from_worker_failure(error))
        news = self.scheduler.update_from_output(scheduler_output, runner_output)
        if refused:  # they sampled nothing, so the update above did not touch them
            logger.error("requests %s are too large for the step channel to the workers: ended", refused[:5])
            self.scheduler.finish_requests(refused, RequestStatus.FINISHED_ABORTED)
            error = "the request is too large to send to the workers (its prompt, or its sampling parameters)"
            news.outputs += [EngineCoreOutput(c, [], finish_reason=FinishReason.ERROR, error=error) for c in refused]
        return news

    def _execute(self, scheduler_output: SchedulerOutput) -> tuple[ModelRunnerOutput, list[str]]:
        """The step's output, and the requests it could not send to the workers: a step too large
        for the channel runs in parts; a request too large alone is refused (never a dead worker)."""
        try:
            return self.executor.execute_model(scheduler_output), []
        except StepTooLargeError as error:
            parts, refused = split_step(scheduler_output, error.max_bytes)
            logger.warning("%s: running it in %d parts; refusing %d request(s) too large alone", error, len(parts), len(refused))
            return merge_outputs([self.executor.execute_model(part) for part in parts]), refused

    def gauges(self) -> SchedulerGauges:
        scheduler, kv = self.scheduler, self.kv_cache_manager
        return SchedulerGauges(
            scheduler.num_running, scheduler.num_waiting, kv.usage, scheduler.num_preemptions_total,
            kv.num_prefix_queries, kv.num_prefix_hits,
        )

    # ---- recovery ---------------------------------------------------------------------------

    def _recover_from_worker_failure(self, error: WorkerGroupError) -> list[EngineCoreOutput]:
        """Rebuild the worker group and requeue every in-flight request to recompute from its
        tokens (the same mechanism as preemption). Gives up after `max_worker_restarts`
        failures in a row: then every pending request ends with finish_reason "abort"."""
        logger.warning("worker group failed, rebuilding it: %s", error)
        self.executor.shutdown()
        self.scheduler.requeue_after_worker_loss()
        self._consecutive_failures += 1
        if self._consecutive_failures > self.config.max_worker_restarts:
            return self._die(f"the worker group failed {self._consecutive_failures} times in a row; last error: {error}")
        try:
            self.executor = create_executor(self.config, self.model_config, self.placement)
        except Exception as rebuild_error:
            self.executor = None
            return self._die(f"the worker group died ({error}) and could not be rebuilt: {rebuild_error}")
        try:
            if self.executor.determine_num_kv_blocks() < self.num_kv_blocks:
                raise RuntimeError(f"the new workers hold fewer than {self.num_kv_blocks} KV blocks")
            self.executor.initialize_kv_cache(self.num_kv_blocks)
        except Exception as rebuild_error:
            return self._die(f"the worker group died ({error}) and could not be rebuilt: {rebuild_error}")
        self.num_worker_restarts += 1
        return []

    def _die(self, reason: str) -> list[EngineCoreOutput]:
        logger.error("engine is dead: %s", reason)
        self.dead_reason = reason
        self.shutdown()
        ended = self.scheduler.unfinished_request_ids()
        self.scheduler.finish_requests(ended, RequestStatus.FINISHED_ABORTED)
        return [EngineCoreOutput(c, [], finish_reason=FinishReason.ABORT) for c in ended]

    def shutdown(self) -> None:
        """Release the workers; safe to call more than once."""
        executor, self.executor = getattr(self, "executor", None), None
        if executor is not None:
            executor.shutdown()
        if getattr(self, "structured_outputs", None) is not None:
            self.structured_outputs.shutdown()
