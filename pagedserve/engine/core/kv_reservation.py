"""Admission that leaves room for the running requests' outputs (`schedule_conservativeness`).

Without it the scheduler admits whatever prompt fits in the free blocks now; when the running
requests' outputs later fill the cache, the newest are preempted and recompute their prompts from
scratch. Under a burst larger than the cache that is thrash: on a 2-core Zen 3 at 1 GiB of
float32 KV, 256 prompts of 32-256 tokens with 64 outputs each were preempted 50 times and 13.6%
of the compute was redone (docs/benchmarks.md).

With it, a waiting request is admitted only if the free blocks, besides its own, also hold what
every running request is expected to still write. A request's expected output is the running
mean of the output lengths of finished requests (starting from `COLD_OUTPUT_TOKENS`), times
the conservativeness, and at most its own `max_tokens`. So a workload with a known `max_tokens`
that it reaches reserves exactly what it uses, and chat requests with no `max_tokens` (capped only
by max_model_len) reserve what replies have really taken. Preemption stays the safety net for
requests that outrun the estimate. SGLang admits the same way (its `schedule_conservativeness`);
vLLM does not (conservativeness 0 here).
"""

from __future__ import annotations

import math
from typing import Iterable

from pagedserve.engine.core.kv_cache_manager import KVCacheManager
from pagedserve.engine.core.request import Request

# The expected output of a request before any has finished: a chat reply's order of magnitude.
# Only requests without a smaller max_tokens reserve this much, and less as requests finish.
COLD_OUTPUT_TOKENS = 256
# The running mean averages the cold guess (as one request) and the first finished requests alike,
# then weighs each new one by this: about the last 16 count. One short warm-up request then moves
# the guess halfway, not all the way (a 16-token warm-up had a burst of 64-token requests reserve
# 16 each, and preempt as before).
MEAN_WEIGHT = 1 / 16


class KVReservation:
    def __init__(self, kv_cache_manager: KVCacheManager, conservativeness: float):
        assert conservativeness > 0, "conservativeness 0 means no reservation: pass None to the scheduler"
        self.kv = kv_cache_manager
        self.conservativeness = conservativeness
        self.mean_output_tokens = float(COLD_OUTPUT_TOKENS)
        self.num_observed = 0

    @property
    def expected_output_tokens(self) -> int:
        """The output a request with no smaller max_tokens is expected to reach."""
        return max(math.ceil(self.conservativeness * self.mean_output_tokens), 1)

    def observe(self, num_output_tokens: int) -> None:
        """A request finished (stopped or reached its length) with this many outputs; aborted
        ones say nothing about how long replies are and are not observed."""
        self.num_observed += 1
        weight = max(1 / (self.num_observed + 1), MEAN_WEIGHT)
        self.mean_output_tokens += weight * (num_output_tokens - self.mean_output_tokens)

    def blocks_to_come(self, request: Request, num_held_blocks: int) -> int:
        """Blocks the request is expected to still allocate beyond the `num_held_blocks` it holds
        (or adopts from the prefix cache): its K/V up to its expected length, the last sampled
        token excluded (it is never fed back), and at least over the tokens it already has."""
        expected_len = min(request.length_cap, request.num_prompt_tokens + self.expected_output_tokens)
        return max(self.kv.blocks_needed(max(expected_len - 1, request.num_tokens)) - num_held_blocks, 0)

    def reserved_blocks(self, running: Iterable[Request]) -> int:
        """Free blocks the running requests are expected to still take (`blocks_to_come` of each,
        inlined). A request past its expected length reserves only its known tokens' blocks: it
        grows into what others leave."""
        expected_output = self.expected_output_tokens
        block_size = self.kv.block_size
        req_to_blocks = self.kv.req_to_blocks
        total = 0
        for request in running:  # every running request, once a step while requests wait: no calls
            expected_len = min(request.length_cap, len(request.prompt_token_ids) + expected_output)
            num_kv_tokens = max(expected_len - 1, len(request.all_token_ids))
            need = -(-num_kv_tokens // block_size) - len(req_to_blocks.get(request.request_id, ()))
            if need > 0:
                total += need
        return total
