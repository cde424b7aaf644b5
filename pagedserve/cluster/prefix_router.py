"""Prefix-aware routing: send a request to the LLMServer replica whose KV cache most likely holds
its prompt's prefix, on Ray Serve's own router API (`request_router_config`).

A Serve `RequestRouter` runs where the handle call is made (the ingress), and sees the call's
arguments: `generate(request_id, {"prompt_token_ids": [...]}, params)`. From the token ids it
computes the engine's own block-hash chain (block_pool.extend_block_hashes, the hashes the prefix
cache registers blocks under), so a match means blocks that were cached, not similar text.

Per request (`choose_replicas`):
1. For each replica, the number of the prompt's leading full blocks it holds (its table below).
2. The best-matching replica wins, unless its match covers less than `match_rate_threshold` of
   the prompt's blocks, or its load exceeds the least-loaded replica's by more than
   `imbalanced_threshold`; then the least-loaded replicas (by engine requests) are the choice,
   and among them Serve's own pick takes the one with the fewest requests in flight.
3. Calls that carry no token ids (model_card, tokenize, ...) use Serve's power of two choices.
The chosen rank goes first; the other replicas follow as a second rank, for when its queues are full.

Load is the engine's own: requests running and waiting and KV usage from the replica's routing
stats (LLMServer.record_routing_stats), or this router's own requests running there if more
(they are known at once, while a report is up to a period old when it arrives).

A replica's table holds the routing keys of the blocks this router sent it, least recently used
first, at most as many as the replica's cache has blocks. It forgets what the replica reports
evicted; evictions it missed (Serve delivers only a replica's latest report) drop that many of
its oldest keys, as the engine's LRU would have.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any, Optional

from ray.serve.request_router import LocalityMixin, MultiplexMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagedserve.cluster.handover_router import HandoverMixin
from pagedserve.cluster.ray_internals import PowerOfTwoChoicesRequestRouter
from pagedserve.cluster.routing_stats import RoutingStats
from pagedserve.engine.core.block_pool import extend_block_hashes, routing_key
from pagedserve.lora_request import LoRARequest
from pagedserve.inputs import is_tokens_prompt

# What a table remembers of a replica before its first report names the cache's size.
DEFAULT_TABLE_CAPACITY = 65_536
MAX_CACHED_CHAINS = 1024  # prompts' chains kept between choose_replicas and on_request_routed


class ReplicaPrefixTable:
    """What one router believes one replica's prefix cache holds, and its load as last seen."""

    def __init__(self, capacity: int = DEFAULT_TABLE_CAPACITY):
        self.capacity = capacity
        self.keys: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.stats: RoutingStats | None = None
        # Internal ids of this router's requests running there: its own load, known at once
        # (a report is up to a period old when it arrives).
        self.in_flight: set[str] = set()

    def num_matched(self, keys: list[int]) -> int:
        """How many of the chain's leading blocks the replica holds (the engine's own lookup
        also stops at the first miss)."""
        num = 0
        for key in keys:
            if key not in self.keys:
                break
            num += 1
        return num

    def insert(self, keys: list[int]) -> None:
        for key in keys:
            self.keys[key] = None
            self.keys.move_to_end(key)
        self._trim(len(self.keys) - self.capacity)

    def apply(self, stats: RoutingStats) -> None:
        """Take a new report: its load, and forget what it says was evicted."""
        previous = self.stats
        if previous is not None and stats.report_index == previous.report_index:
            return
        self.stats = stats
        if stats.num_total_blocks > 0:  # 0: the replica cannot see its cache (engine core process)
            self.capacity = stats.num_total_blocks
        if previous is not None and stats.num_prefix_cache_resets != previous.num_prefix_cache_resets:
            self.keys.clear()
            return
        for key in stats.evicted_routing_keys:
            self.keys.pop(key, None)
        if previous is not None:
            num_missed = stats.num_evicted_blocks - previous.num_evicted_blocks - len(stats.evicted_routing_keys)
            self._trim(num_missed)
        self._trim(len(self.keys) - self.capacity)

    def load(self, num_in_flight: int = 0) -> float:
        """Engine requests (running and waiting, from every router), or this router's own
        requests in flight there if more (they are live; a report lags); KV usage (a fraction)
        breaks ties."""
        reported, usage = 0, 0.0
        if self.stats is not None:
            reported, usage = self.stats.num_running + self.stats.num_waiting, self.stats.kv_cache_usage
        return max(reported, len(self.in_flight), num_in_flight) + usage

    def _trim(self, num: int) -> None:
        for _ in range(min(max(num, 0), len(self.keys))):
            self.keys.popitem(last=False)


class PrefixRouting(LocalityMixin, MultiplexMixin, RequestRouter):
    """The prefix-aware choice (see the module docstring). Every hook it overrides calls super(),
    so other mixins compose with it."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.tables: dict[ReplicaID, ReplicaPrefixTable] = {}
        self._chains: OrderedDict[str, list[int]] = OrderedDict()  # internal request id -> routing keys
        self.initialize_state()

    def initialize_state(
        self, block_size: int = 16, imbalanced_threshold: float = 8.0, match_rate_threshold: float = 0.1, **kwargs: Any
    ) -> None:
        """Serve calls this with `request_router_kwargs` (cluster/app.py's request_router_config)."""
        super().initialize_state(**kwargs)
        self.block_size = block_size
        self.imbalanced_threshold = imbalanced_threshold
        self.match_rate_threshold = match_rate_threshold

    # ---- Serve's hooks -----------------------------------------------------------------------

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: Optional[PendingRequest] = None
    ) -> list[list[RunningReplica]]:
        keys = self._routing_keys(pending_request)
        if keys is None or not candidate_replicas:
            return await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas, pending_request)
        # A full queue at every replica must back off and retry, not spin (Serve's locality
        # routing sets this on the power-of-two path).
        pending_request.routing_context.should_backoff = True
        chosen = self.choose(candidate_replicas, keys, _lora_id(pending_request.args[1]))
        others = [replica for replica in candidate_replicas if replica not in chosen]
        return [chosen, others] if others else [chosen]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        keys = self._chains.pop(pending_request.metadata.internal_request_id, None)
        table = self.tables.get(replica_id)
        if keys is not None and table is not None:
            table.insert(keys)
            table.in_flight.add(pending_request.metadata.internal_request_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        table = self.tables.get(replica_id)
        if table is not None:
            table.in_flight.discard(internal_request_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """New replicas get an empty table, removed ones lose theirs; every replica's latest
        routing stats are applied (Serve calls this when the set or the stats change)."""
        super().update_replicas(replicas)
        live = {replica.replica_id for replica in replicas}
        for replica_id in list(self.tables):
            if replica_id not in live:
                del self.tables[replica_id]
        for replica in replicas:
            table = self.tables.setdefault(replica.replica_id, ReplicaPrefixTable())
            stats = RoutingStats.from_dict(replica.routing_stats or {})
            if stats is not None:
                table.apply(stats)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.tables.pop(replica_id, None)

    # ---- the choice --------------------------------------------------------------------------

    def choose(self, candidates: list[RunningReplica], keys: list[int], lora_id: int = 0) -> list[RunningReplica]:
        """The first rank for a prompt whose full blocks have these routing keys: the replica
        holding its prefix, or else the least-loaded ones (requests, ignoring the KV-usage
        fraction), among which Serve takes the one with the fewest requests in flight. A
        request under an adapter chooses among the replicas that have it loaded, unless they
        are busier than the others by more than the imbalance threshold."""
        tables = [self.tables.setdefault(replica.replica_id, ReplicaPrefixTable()) for replica in candidates]
        loads = [table.load(self._num_in_flight(replica)) for replica, table in zip(candidates, tables)]
        if lora_id:
            candidates, tables, loads = _holders_of(lora_id, candidates, tables, loads, self.imbalanced_threshold)
        lowest = min(loads)
        if keys:
            matched = [table.num_matched(keys) for table in tables]
            best = max(range(len(candidates)), key=lambda i: (matched[i], -loads[i], random.random()))
            is_long_enough = matched[best] > 0 and matched[best] / len(keys) >= self.match_rate_threshold
            if is_long_enough and loads[best] - lowest <= self.imbalanced_threshold:
                return [candidates[best]]
        least = [replica for replica, load in zip(candidates, loads) if int(load) == int(lowest)]
        random.shuffle(least)
        return least

    def _num_in_flight(self, replica: RunningReplica) -> int:
        """Serve's count of this router's requests in flight at the replica (0 if unknown)."""
        return self.replica_queue_len_cache.get(replica.replica_id) or 0

    def _routing_keys(self, pending_request: Optional[PendingRequest]) -> list[int] | None:
        """The routing keys of a generate call's prompt blocks; None for other calls."""
        if pending_request is None or pending_request.metadata.call_method != "generate" or len(pending_request.args) < 2:
            return None
        prompt = pending_request.args[1]
        if not is_tokens_prompt(prompt) or not isinstance(prompt["prompt_token_ids"], list):
            return None
        request_id = pending_request.metadata.internal_request_id
        keys = self._chains.get(request_id)
        if keys is None:
            # The engine's chain, salted as the engine salts it: a tenant's prompt finds only the
            # blocks of its own tenant.
            salt = prompt.get("cache_salt") if isinstance(prompt.get("cache_salt"), str) else None
            lora_id = _lora_id(prompt)  # the engine salts with it too
            keys = [routing_key(h) for h in extend_block_hashes([], prompt["prompt_token_ids"], self.block_size, salt, lora_id)]
            self._chains[request_id] = keys
            while len(self._chains) > MAX_CACHED_CHAINS:
                self._chains.popitem(last=False)
        return keys


def _lora_id(prompt: Any) -> int:
    """The lora_int_id of the adapter the ingress put beside a prompt (0: the base model)."""
    lora = prompt.get("lora_request") if isinstance(prompt, dict) else None
    return lora.lora_int_id if isinstance(lora, LoRARequest) else 0


def _holders_of(lora_id: int, candidates: list, tables: list, loads: list, imbalanced_threshold: float) -> tuple[list, list, list]:
    """The candidates (with their tables and loads) whose engines report the adapter loaded, when
    any does and the least busy of them is within the imbalance threshold of the least busy of
    all; else all of them (loading it elsewhere beats queueing)."""
    held = [i for i, table in enumerate(tables) if table.stats is not None and lora_id in table.stats.lora_ids]
    if not held or min(loads[i] for i in held) - min(loads) > imbalanced_threshold:
        return candidates, tables, loads
    return [candidates[i] for i in held], [tables[i] for i in held], [loads[i] for i in held]


class PrefixAwareRouter(HandoverMixin, PrefixRouting):
    """Serve's `request_router_class` for LLMServer: prefix-aware routing, and the handover of a
    leaving replica's streams (cluster/handover.py) around it."""
