"""The router's side of the handover (see handover.py's note): a Serve `RequestRouter` mixin that
publishes leaving replicas and where each request went, and never routes to a leaving replica."""

from __future__ import annotations

import importlib
import logging
from typing import Any

from pagedserve.cluster.handover_registry import HandoverRegistry
from pagedserve.cluster.ray_internals import PowerOfTwoChoicesRequestRouter

logger = logging.getLogger("ray.serve")  # into the replica's log, beside Serve's own replica news


def _registry() -> HandoverRegistry:
    """The process's registry, for the router. Serve pickles a router class's module by value,
    so the router's copy of this module's globals would be its own: it looks the real module up
    in the process it runs in (the ingress's, where `ResumingClient` watches the same one)."""
    return importlib.import_module("pagedserve.cluster.handover_registry").REGISTRY


class HandoverMixin:
    """For a Serve `RequestRouter` of the LLMServer deployment: publishes leaving replicas and
    where each `generate` call went, and never routes to a replica that is leaving. Put it first
    among the bases; the router's own hooks run through super()."""

    def update_replicas(self, replicas: list[Any]) -> None:
        """Replicas removed from the running set, and those whose routing stats say they drain
        (sent SIGTERM, they stay in the set until their process exits), are leaving."""
        before = {replica_id.unique_id for replica_id in self.curr_replicas}
        super().update_replicas(replicas)
        removed = before - {replica.replica_id.unique_id for replica in replicas}
        draining = {replica.replica_id.unique_id for replica in replicas if (replica.routing_stats or {}).get("is_draining")}
        registry = _registry()
        leaving = {replica_id for replica_id in removed | draining if not registry.is_leaving(replica_id)}
        if leaving:
            logger.info("replicas leaving: %s; handing their streams over", sorted(leaving))
            registry.mark_leaving(leaving)

    def on_request_routed(self, pending_request: Any, replica_id: Any, result: Any) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        if pending_request.metadata.call_method == "generate" and pending_request.args:
            _registry().routed(str(pending_request.args[0]), replica_id.unique_id)

    async def choose_replicas(self, candidate_replicas: list[Any], pending_request: Any = None) -> list[list[Any]]:
        ranks = await super().choose_replicas(candidate_replicas, pending_request)
        registry = _registry()
        ranks = [[r for r in rank if not registry.is_leaving(r.replica_id.unique_id)] for rank in ranks]
        return [rank for rank in ranks if rank]  # none left: the router backs off and asks again


class PowerOfTwoRouter(HandoverMixin, PowerOfTwoChoicesRequestRouter):
    """Serve's default power-of-two-choices router, with handover."""
