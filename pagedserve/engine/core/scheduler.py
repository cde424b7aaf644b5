"""The scheduler: one token budget per step, no separate prefill and decode phases.

Algorithm. Each request knows `num_tokens` (prompt + outputs) and `num_computed_tokens` (K/V
already in the cache). A step gives requests tokens to close that gap, spending at most
`max_num_batched_tokens`:

1. Running requests first, oldest first. Each gets its whole gap (1 token when decoding) or what
   is left of the budget (a prefill chunk). When the pool has no blocks for it, the newest running
   request is preempted (blocks freed, computed count reset, back to the front of the waiting
   queue) until the allocation fits, possibly preempting the request itself.
2. Then, if nothing was preempted this step, waiting requests in arrival order while the budget,
   `max_num_seqs` and the pool allow. Each first adopts its prefix-cache hits, which skip compute.
   Without chunked prefill a prompt that does not fit in the remaining budget waits. With a
   reservation (`schedule_conservativeness` > 0, engine/core/kv_reservation.py) a request also
   waits until the pool holds its expected length besides what the running ones are expected to
   still write, so that their growth does not preempt it.

With a least budget (`min_num_batched_tokens`) a step spends at most max(that, 16 x the running
requests, the first waiting request's uncached tokens, the queue's share): few running rows, short
steps (a wave of prompts gets its first tokens one by one, and the running streams their next ones
sooner); many, the full budget (the rows' share of each step stays at most 1/16); the next prompt
always fits whole, up to the full budget (a lone long prompt is not cut into short chunks); and a
deep queue takes sqrt(W x O) tokens a step (`queue_share`): W the waiting prompt tokens (less the
prefix-cache hits found when each came, or this step for the next one), O a step's overhead in
prompt-token times. Each waiting prompt pays every step's overhead until its own, and each prompt
in a step waits for the whole step: in W / b steps of b tokens the queue pays about W x O x W / 2b
for the first and W x b / 2 for the second, least at b = sqrt(W x O).

`update_from_output` then advances the computed counts, appends sampled tokens, checks the
token-level stop conditions, and frees the blocks of finished requests.

Structured outputs: a constrained request waits in WAITING_FOR_GRAMMAR while its grammar compiles
(off the loop); the waiting ones behind it go ahead. Each step carries one bitmask row per
constrained request that samples, and the sampled token then advances its matcher; a matcher
that terminates ends the request (engine/structured_outputs).

LoRA: a waiting request whose adapter the sampling rank has not reported read waits too, and the
step names its adapter in `prefetch_loras`, so every rank reads it off the step; at most
`max_loras` distinct adapters run in one step (the workers' slots), and a request beyond them
waits. Neither ever fails a request.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque

from pagedserve.engine.core.kv_cache_manager import KVCacheManager
from pagedserve.engine.core.kv_reservation import KVReservation
from pagedserve.engine.core.request import Request, RequestStatus
from pagedserve.engine.engine_core_output import GRAMMAR_ERROR_PREFIX, EngineCoreOutput, FinishReason, StepOutputs
from pagedserve.lora_request import LoRARequest
from pagedserve.step_types.model_runner_output import ModelRunnerOutput
from pagedserve.step_types.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

# The new block ids of a running request that got none this step: one shared, immutable empty value
# (most decode steps), read by the workers and never changed.
NO_BLOCKS: tuple[int, ...] = ()
# Nothing to run but adapters being read: how long a step waits before asking the workers again.
ADAPTER_POLL_S = 0.002
# With a least step budget: the step's prefill tokens per running request it keeps to, so that the
# running rows (each about one prompt token's work, its LM head and sampling besides) take at most
# a sixteenth of a step.
STEP_TOKENS_PER_RUNNING = 16
# A step's overhead in prompt-token times for the queue's share: a fixed part (the weights read
# once a step: a one-row step costs about 11 prompt tokens' time on a 2-core Zen 4, 7.6 vs 0.7 ms)
# and two tokens per running row (one row's compute is about a prompt token's; its streamed output
# costs the host about as much again, and the running rows grow while a wave goes in).
STEP_OVERHEAD_TOKENS = 16
STEP_OVERHEAD_TOKENS_PER_RUNNING = 2
# Finished requests whose output length tells how long replies run (an aborted one was cut short).
_COMPLETED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        enable_chunked_prefill: bool,
        structured_outputs=None,
        max_loras: int | None = None,
        schedule_conservativeness: float = 0.0,
        min_num_batched_tokens: int | None = None,
    ):
        """Each Request carries its own length limit (`length_cap`: max_model_len and max_tokens).
        `max_loras`: the most distinct adapters the running requests may use (the workers' slots).
        `schedule_conservativeness`: 0 admits what fits now (vLLM's policy, and the default here so
        that tests can provoke preemption); more reserves room for expected outputs (the engine's
        default is 1, EngineConfig). `min_num_batched_tokens`: the least step budget (see above); None:
        every step `max_num_batched_tokens`."""
        self.kv_cache_manager = kv_cache_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.min_num_batched_tokens = min_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.enable_chunked_prefill = enable_chunked_prefill
        self.max_loras = max_loras
        self.reservation = KVReservation(kv_cache_manager, schedule_conservativeness) if schedule_conservativeness > 0 else None
        # Adapters the sampling rank reported resident or read: a waiting request whose adapter
        # is not among them stays waiting while the workers read it off the step.
        self.ready_loras: frozenset[int] = frozenset()
        self.retired_loras: set[int] = set()  # removed since the last step: the workers drop them
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in the order they started running
        # Workers drop these requests' state at the next step (see SchedulerOutput).
        self.finished_req_ids: set[str] = set()
        self.preempted_req_ids: set[str] = set()
        self.num_preemptions_total = 0
        self._preempted_this_step = False
        # The grammar engine (a StructuredOutputManager); None: constrained requests are refused.
        self.structured_outputs = structured_outputs
        self.num_constrained = 0  # live requests with a grammar: zero skips every grammar step
        self._grammar_failures: list[EngineCoreOutput] = []  # ended while waiting; reported next update

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        if request.sampling_params.structured_outputs is not None:
            self._start_grammar(request)
        if self.min_num_batched_tokens is not None:  # the step budget counts what is left to compute
            request.expected_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)[1]
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, req_ids: list[str], status: RequestStatus) -> None:
        """End requests from outside the step (abort, stop string); unknown ids are ignored."""
        assert status.is_finished
        ended = set()
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            request.status = status
            self._free(request)
            ended.add(req_id)
        if ended:
            self.running = [r for r in self.running if r.request_id not in ended]
            self.waiting = deque(r for r in self.waiting if r.request_id not in ended)

    def requeue_after_worker_loss(self) -> None:
        """The workers and their KV caches are gone: every running request goes back to the
        waiting queue (in arrival order) to be recomputed from its tokens, and no prefix-cache block
        can be trusted any more."""
        while self.running:
            self._requeue(self.running.pop())
        self.kv_cache_manager.reset_prefix_cache()
        # The new workers hold no state to drop.
        self.finished_req_ids.clear()
        self.preempted_req_ids.clear()

    def unfinished_request_ids(self) -> list[str]:
        return [r.request_id for r in self.running] + [r.request_id for r in self.waiting]

    def retire_lora(self, lora_int_id: int) -> None:
        """An adapter the front end removed: the next step tells the workers, and until they
        report it read again, a later request of it waits for a fresh read."""
        self.retired_loras.add(lora_int_id)
        self.ready_loras = self.ready_loras - {lora_int_id}

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- one step ------------------------------------------------------------------------

    def step_budget(self) -> int:
        """The most tokens this step computes (see the module doc)."""
        if self.min_num_batched_tokens is None:
            return self.max_num_batched_tokens
        running = len(self.running)
        least = max(self.min_num_batched_tokens, STEP_TOKENS_PER_RUNNING * running)
        if not self.waiting or least >= self.max_num_batched_tokens:  # at saturation: no walk of the queue
            return min(self.max_num_batched_tokens, least)
        # The next prompt whole beside a token for each running request: no short chunks of a long
        # one. Whole means its tokens past its prefix-cache hits: counting the hits would make room
        # for the prompts behind it too, and prompts that share a prefix would start in lockstep.
        head = self.waiting[0]
        head.expected_hit_tokens = self.kv_cache_manager.get_computed_blocks(head)[1]
        next_prompt = head.num_tokens - head.expected_hit_tokens + running
        least = max(least, next_prompt, self.queue_share())
        return min(self.max_num_batched_tokens, least)

    def queue_share(self) -> int:
        """sqrt(W x O): the step size that keeps the waiting prompts' total wait least (module doc)."""
        overhead = STEP_OVERHEAD_TOKENS + STEP_OVERHEAD_TOKENS_PER_RUNNING * len(self.running)
        # Past this many waiting tokens the share is the whole budget: stop counting there.
        enough = self.max_num_batched_tokens**2 // overhead + 1
        waiting_tokens = 0
        for request in self.waiting:  # a waiting request has computed nothing (preemption resets it)
            waiting_tokens += request.num_tokens - request.expected_hit_tokens
            if waiting_tokens >= enough:
                break
        return math.isqrt(waiting_tokens * overhead)

    def schedule(self) -> SchedulerOutput:
        budget = step_budget = self.step_budget()
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        diffs = CachedRequestData()  # for the running requests, which the workers hold

        self._preempted_this_step = False
        # This loop runs for every running request every step: locals, and in the common decode
        # case no call and no dict lookup (benchmarks/engine_step_cpu.py measures it).
        block_size = self.kv_cache_manager.block_size
        diff_ids, diff_tokens, diff_blocks, diff_computed = diffs.req_ids, diffs.new_token_ids, diffs.new_block_ids, diffs.num_computed_tokens
        for request in self.running:  # preemption pops from its end: the iteration stops there
            if budget <= 0:
                break
            num_computed = request.num_computed_tokens
            all_token_ids = request.all_token_ids
            num_new = min(len(all_token_ids) - num_computed, budget)
            assert num_new > 0, f"running request with nothing to compute: {request}"
            # The new tokens land in the request's partly filled last block without filling it:
            # it holds the block already and nothing joins the prefix cache, so allocate_slots
            # would change nothing. 14 of 16 decode steps at block_size 16.
            offset = num_computed % block_size
            if offset and offset + num_new < block_size:
                new_block_ids = NO_BLOCKS
            else:
                new_blocks = self._allocate_or_preempt(request, num_new)
                if new_blocks is None:  # the request preempted itself; everything older is scheduled
                    break
                new_block_ids = [block.block_id for block in new_blocks] if new_blocks else NO_BLOCKS
            req_id = request.request_id
            num_scheduled[req_id] = num_new
            budget -= num_new
            # Its diff: the tokens the workers have not seen, and its new blocks.
            diff_ids.append(req_id)
            diff_tokens.append(all_token_ids[request.num_tokens_on_workers :])
            request.num_tokens_on_workers = len(all_token_ids)
            diff_blocks.append(new_block_ids)
            diff_computed.append(num_computed)

        # After a preemption the pool is tight: admitting new requests would only thrash.
        skipped: list[Request] = []  # their grammar is still compiling, or their adapter is not ready: the others go first
        running_loras = {r.lora_int_id for r in self.running if r.lora_int_id} if self.max_loras else set()
        prefetch: dict[int, LoRARequest] = {}  # adapters being read for the skipped requests
        reserved = None  # blocks the running requests are expected to still take (with a reservation)
        while not self._preempted_this_step and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.status == RequestStatus.WAITING_FOR_GRAMMAR and not self._is_grammar_ready(request):
                self.waiting.popleft()
                if not request.is_finished:  # else its grammar failed: it ended alone
                    skipped.append(request)
                continue
            if self.max_loras and request.lora_int_id and request.lora_int_id not in running_loras:
                if request.lora_int_id not in self.ready_loras:  # the workers read it off the step meanwhile
                    if len(prefetch) < self.max_loras:
                        prefetch[request.lora_int_id] = request.lora_request
                    skipped.append(self.waiting.popleft())
                    continue
                if len(running_loras) >= self.max_loras:
                    skipped.append(self.waiting.popleft())  # every adapter slot is taken: it waits, never fails
                    continue
            computed_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit_tokens
            if not self.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            reserve = self.reservation is not None and bool(self.running)  # alone, a request always may run
            if reserve:
                if reserved is None:  # at most once a step: only when a request waits and others run
                    reserved = self.reservation.reserved_blocks(self.running)
                need = self.reservation.blocks_to_come(request, len(computed_blocks))
                if need > self.kv_cache_manager.num_free_blocks_beside(computed_blocks) - reserved:
                    break  # it waits for running requests to finish, rather than preempt them later
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new, computed_blocks)
            if new_blocks is None:
                break
            if reserve:
                reserved += need - len(new_blocks)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens is None:  # first scheduled (not resumed)
                request.num_cached_tokens = num_hit_tokens
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            if request.lora_int_id:
                running_loras.add(request.lora_int_id)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            new_reqs.append(self._new_request_data(request))

        self.waiting.extendleft(reversed(skipped))
        finished, self.finished_req_ids = self.finished_req_ids, set()
        preempted, self.preempted_req_ids = self.preempted_req_ids, set()
        total = step_budget - budget
        retired, self.retired_loras = self.retired_loras, set()
        output = SchedulerOutput(
            new_reqs, diffs, num_scheduled, total, finished, preempted, prefetch_loras=list(prefetch.values()), retired_lora_ids=retired
        )
        if prefetch and not total:  # nothing to run but adapter reads: a short wait, not a spin
            time.sleep(ADAPTER_POLL_S)
        if self.num_constrained:
            self._add_grammar_bitmask(output)
            if not total and skipped:  # nothing to run but compiles: wait for one, do not spin
                self.structured_outputs.wait_for_any([r.grammar for r in skipped if r.grammar is not None], 0.01)
        return output

    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> StepOutputs:
        sampled = dict(zip(runner_output.req_ids, runner_output.sampled_token_ids))
        logprobs = runner_output.logprobs or {}
        if runner_output.ready_lora_ids is not None:
            self.ready_loras = runner_output.ready_lora_ids
        requests = self.requests
        news, self._grammar_failures = StepOutputs(self._grammar_failures), []
        outputs, plain_req_ids, plain_token_ids = news.outputs, news.token_req_ids, news.token_ids
        any_finished = False
        running_status = RequestStatus.RUNNING
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = requests.get(req_id)
            if request is None or request.status != running_status:
                continue  # ended (aborted) while the step ran
            request.num_computed_tokens += num_tokens
            token_id = sampled.get(req_id)
            if token_id is None:
                continue  # a prefill chunk that has not reached the end of the prompt
            request.output_token_ids.append(token_id)  # append_output_token_id, inlined: it runs for every row
            all_token_ids = request.all_token_ids
            all_token_ids.append(token_id)
            # The common case, one test: a plain row (StepOutputs) short of its length cap, not a stop token.
            if request.plain_news and len(all_token_ids) < request.length_cap and token_id not in request.stop_ids:
                plain_req_ids.append(req_id)
                plain_token_ids.append(token_id)
                continue
            grammar_status = self._advance_grammar(request, token_id) if request.grammar is not None else None
            status = self._check_stop(request, token_id)
            if grammar_status is not None and (status is None or grammar_status == RequestStatus.FINISHED_ABORTED):
                status = grammar_status
            finish_reason = None
            if status is not None:
                request.status = status
                self._free(request)
                any_finished = True
                finish_reason = status.finish_reason
            outputs.append(
                EngineCoreOutput(
                    req_id,
                    [token_id],
                    logprobs.get(req_id) if logprobs else None,
                    finish_reason,
                    request.stop_token_id,
                    request.num_cached_tokens,  # set when it was first scheduled
                    first_scheduled_time=request.first_scheduled_time,
                )
            )
            # Its first token has gone out whole: without logprobs or a grammar, the rest can go as plain rows.
            request.plain_news = request.grammar is None and request.sampling_params.logprobs is None
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        return news

    # ---- internals ------------------------------------------------------------------------

    def _allocate_or_preempt(self, request: Request, num_new: int) -> list | None:
        """Blocks for the request, preempting the newest running requests until they fit.
        None if the request had to preempt itself."""
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_blocks is not None:
                return new_blocks
            victim = self.running.pop()
            self._preempt(victim)
            if victim is request:
                return None

    def _preempt(self, request: Request) -> None:
        self._requeue(request)
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self._preempted_this_step = True

    def _requeue(self, request: Request) -> None:
        """Free the request's blocks and send it back to recompute from its tokens."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.preempted_req_ids.add(request.request_id)  # its next schedule resends it whole
        # Requests go back newest first, each to the front: the queue keeps arrival order.
        self.waiting.appendleft(request)

    def _free(self, request: Request) -> None:
        if self.reservation is not None and request.status in _COMPLETED:
            self.reservation.observe(request.num_output_tokens)
        if request.grammar is not None:
            self.num_constrained -= 1
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        """Whether the token just appended ends the request (max_model_len, max_tokens, an EOS
        or one of stop_token_ids past min_tokens)."""
        if request.num_tokens >= request.length_cap:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        if request.num_output_tokens < request.sampling_params.min_tokens:
            return None
        if token_id in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token_id in request.stop_ids:  # a set: the stop_token_ids list is never scanned
            request.stop_token_id = token_id
            return RequestStatus.FINISHED_STOPPED
        return None

    def _new_request_data(self, request: Request) -> NewRequestData:
        request.num_tokens_on_workers = request.num_tokens
        return NewRequestData(
            req_id=request.request_id,
            token_ids=list(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            sampling_params=request.sampling_params.sampler_params(),
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            num_computed_tokens=request.num_computed_tokens,
            lora_request=request.lora_request,
        )


    # ---- structured outputs (the grammar state itself lives in engine/structured_outputs) -----

    def _start_grammar(self, request: Request) -> None:
        """Start compiling its grammar (ValueError on a spec no backend takes); it waits meanwhile."""
        if self.structured_outputs is None:
            raise ValueError("structured outputs are not enabled on this scheduler")
        request.grammar = self.structured_outputs.grammar_for(request.sampling_params.structured_outputs)
        reasoning_end = self.structured_outputs.reasoning_end
        if reasoning_end is not None:
            request.grammar_start = reasoning_end.grammar_start(request.prompt_token_ids, request.output_token_ids)
        request.status = RequestStatus.WAITING_FOR_GRAMMAR
        self.num_constrained += 1

    def _is_grammar_ready(self, request: Request) -> bool:
        """Its matcher is ready (it now waits as any other request); if its grammar failed, the
        request ends alone with finish_reason "error", the reason going back with it."""
        grammar = request.grammar
        if grammar.poll(request.grammar_token_ids, time.monotonic()):
            request.status = RequestStatus.WAITING
            return True
        if grammar.error is not None:
            logger.warning("request %s failed: %s", request.request_id, grammar.error)
            request.status = RequestStatus.FINISHED_ABORTED
            self._free(request)
            error = f"{GRAMMAR_ERROR_PREFIX}{grammar.error}"
            self._grammar_failures.append(EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ERROR, error=error))
        return False

    def _add_grammar_bitmask(self, output: SchedulerOutput) -> None:
        """One bitmask row for each constrained request that samples this step (it reaches the
        end of its known tokens); a prefill chunk short of the end samples nothing."""
        requests = self.requests
        constrained = []
        for req_id, num_tokens in output.num_scheduled_tokens.items():
            request = requests[req_id]
            if request.grammar_start is not None and request.grammar is not None and request.num_computed_tokens + num_tokens == request.num_tokens:
                constrained.append(request)
        if constrained:
            output.grammar_req_ids = [r.request_id for r in constrained]
            output.grammar_bitmask = self.structured_outputs.fill_bitmask([r.grammar for r in constrained])

    def _advance_grammar(self, request: Request, token_id: int) -> RequestStatus | None:
        """Feed the sampled token to the matcher: STOPPED once the grammar is complete, ABORTED
        if it refuses the token (the mask allowed nothing the sampler could take). While the
        reasoning goes on, only watch for its end: the grammar starts with the next token."""
        if request.grammar_start is None:
            if token_id == self.structured_outputs.reasoning_end.end_token_id:
                request.grammar_start = request.num_output_tokens  # this token, appended, is the last before it
            return None
        grammar = request.grammar
        if not grammar.accept(token_id):
            logger.warning("request %s failed: %s", request.request_id, grammar.error)
            return RequestStatus.FINISHED_ABORTED
        return RequestStatus.FINISHED_STOPPED if grammar.is_terminated() else None
