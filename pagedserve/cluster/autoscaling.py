"""Autoscaling the LLMServer on engine load: Serve's custom autoscaling policy.

What limits an LLM replica is not HTTP calls in flight (Serve's default signal): a replica runs
hundreds of streams at once until its batch slots (`max_num_seqs`) or its KV cache fill up, and
then requests wait in its scheduler. So every replica reports its engine's load to Serve
(`LLMServer.record_autoscaling_stats`, the metric names below), Serve averages each over
`look_back_period_s`, and `EngineLoadPolicy` turns them into a replica count:

    desired = max(waiting / target_waiting_per_replica,   # requests queued for a batch slot
                  kv_usage / target_kv_usage,              # KV-cache pressure
                  batch_usage / target_batch_usage)        # running / max_num_seqs

each summed over the replicas. Every term is "the replicas this load needs", so the answer does
not depend on how many replicas carry it now: moving load between replicas never changes it,
and a scale-down happens only once the running load fits in fewer replicas. Serve then applies
min/max_replicas, the up/downscale delays and its scaling factors.

Serve pickles this module by value into its controller, so it imports nothing from pagedserve
(the controller need not load torch) and its metric names are the contract with the replicas.
"""

from __future__ import annotations

from typing import Any

# Metric names the replicas report (LLMServer.record_autoscaling_stats).
NUM_WAITING_METRIC = "pagedserve_num_requests_waiting"
KV_USAGE_METRIC = "pagedserve_kv_cache_usage"
BATCH_USAGE_METRIC = "pagedserve_batch_usage"


class EngineLoadPolicy:
    """Serve autoscaling policy (a class: Serve builds it once with the config's `policy_kwargs`
    and calls it every control-loop tick with an `AutoscalingContext`)."""

    def __init__(self, target_waiting_per_replica: float, target_kv_usage: float, target_batch_usage: float):
        self.target_waiting_per_replica = target_waiting_per_replica
        self.target_kv_usage = target_kv_usage
        self.target_batch_usage = target_batch_usage

    def __call__(self, ctx: Any) -> tuple[float, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        if not any(metrics.get(name) for name in (NUM_WAITING_METRIC, KV_USAGE_METRIC, BATCH_USAGE_METRIC)):
            # No replica has reported yet (just deployed, or all restarting): hold.
            return ctx.target_num_replicas, {}
        # Requests Serve's handles hold back (every replica at max_ongoing_requests) wait too.
        queued_at_handles = ctx.total_queued_requests or 0.0
        waiting = sum(metrics.get(NUM_WAITING_METRIC, {}).values()) + queued_at_handles
        desired = self.desired_replicas(
            waiting, sum(metrics.get(KV_USAGE_METRIC, {}).values()), sum(metrics.get(BATCH_USAGE_METRIC, {}).values())
        )
        return desired, {}

    def desired_replicas(self, num_waiting: float, kv_usage: float, batch_usage: float) -> float:
        """The replicas a load needs: each argument summed over the replicas (usages are
        fractions of one replica's KV cache or batch slots, so their sums are in replicas).
        At least one while there is any load: Serve's min_replicas decides about zero."""
        needed = max(
            num_waiting / self.target_waiting_per_replica,
            kv_usage / self.target_kv_usage,
            batch_usage / self.target_batch_usage,
        )
        if num_waiting > 0 or kv_usage > 0 or batch_usage > 0:
            needed = max(needed, 1.0)
        # Serve rounds up: float noise above a whole number (2.4 / 0.8) must not add a replica.
        return round(needed, 6)
