"""handover.py's pieces alone, with fakes (a unit test of each class; the real thing runs in
test_drain.py and test_drain_sigterm.py): `StreamProgress` through ResumingClient, and HandoverMixin
with a replica whose routing stats say it drains."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID

from pagedserve.cluster.handover import ResumingClient
from pagedserve.cluster.handover_registry import REGISTRY, HandoverRegistry
from pagedserve.cluster.handover_router import PowerOfTwoRouter
from pagedserve.cluster.prefix_router import PrefixAwareRouter
from pagedserve.cluster.routing_stats import RoutingStats
from pagedserve.cluster.stream_items import ErrorInfo
from pagedserve.sampling_params import RequestOutputKind, SamplingParams
from tests.cluster.test_drain_client import item
from tests.cluster.test_prefix_router import FakeReplica, pending


class LeavesBeforeTheEnd:
    """A replica that sends a whole stream, then leaves before the stream's end is read (the
    race the redeploy test hit). A second call, a resume, is refused as the engine refuses a
    resume with nothing left to make."""

    def __init__(self, registry: HandoverRegistry):
        self.registry = registry
        self.resumes: list = []

    async def generate(self, request_id, prompt, params, resume=None):
        self.resumes.append(resume)
        if len(self.resumes) > 1:
            yield ErrorInfo(400, "2 resumed outputs reach max_tokens=2: nothing is left to generate")
            return
        self.registry.routed(request_id, "replica-0")
        yield item("Hel", [1])
        yield item("lo", [2], finished=True)
        self.registry.mark_leaving(["replica-0"])
        for _ in range(10):  # event-loop turns in which the news arrives before the stream's end
            await asyncio.sleep(0)


def test_a_stream_whose_final_item_arrived_is_not_moved_when_its_replica_leaves():
    registry = HandoverRegistry()
    engines = LeavesBeforeTheEnd(registry)
    params = SamplingParams(max_tokens=2, output_kind=RequestOutputKind.DELTA)

    async def collect():
        return [x async for x in ResumingClient(engines, registry).generate("req", "the prompt", params)]

    items = asyncio.run(asyncio.wait_for(collect(), timeout=30))
    assert [i.outputs[0].text for i in items] == ["Hel", "lo"]  # no error after the whole text
    assert engines.resumes == [None]  # one call: nothing was moved


def routing_stats(num_running: int, is_draining: bool = False) -> dict:
    return RoutingStats(1, num_running, 0, 0.0, 1000, 0, 0, [], is_draining=is_draining).to_dict()


@pytest.mark.parametrize("router_class", [PrefixAwareRouter, PowerOfTwoRouter])
def test_a_draining_replica_is_leaving_and_never_chosen(router_class):
    """It stays in Serve's running set until its process exits; its report says it drains."""
    suffix = uuid.uuid4().hex[:8]  # the registry is the process's own: ids no other test uses
    # The draining replica is the idle one: without its report it would be the choice.
    draining = FakeReplica(f"draining-{suffix}", routing_stats(0, is_draining=True))
    staying = FakeReplica(f"staying-{suffix}", routing_stats(6))
    moved = []
    REGISTRY.watch(f"req-{suffix}", lambda: moved.append(True))
    REGISTRY.routed(f"req-{suffix}", draining.replica_id.unique_id)  # routed there before the report
    loop = asyncio.new_event_loop()
    try:
        async def build():  # Serve builds a router on its event loop
            router = router_class(deployment_id=DeploymentID(name="LLMServer", app_name="test"), handle_source=DeploymentHandleSource.UNKNOWN)
            if router_class is PrefixAwareRouter:
                router.initialize_state(block_size=4)
            router.update_replicas([FakeReplica(draining.replica_id.unique_id), staying])  # before its report
            return router

        router = loop.run_until_complete(build())
        assert not REGISTRY.is_leaving(draining.replica_id.unique_id)
        router.update_replicas([draining, staying])
        assert REGISTRY.is_leaving(draining.replica_id.unique_id) and moved == [True]
        for tokens in ([1, 2, 3, 4, 5, 6, 7, 8], [9]):
            for _ in range(10):
                ranks = loop.run_until_complete(router.choose_replicas([draining, staying], pending(tokens)))
                assert [replica for rank in ranks for replica in rank] == [staying]
    finally:
        REGISTRY.forget(f"req-{suffix}")
        loop.close()


class HandsOverOnce:
    """A replica that sends one item and then hands the stream over; the next one finishes it."""

    def __init__(self):
        self.prompts: list = []

    async def generate(self, request_id, prompt, params, resume=None):
        from pagedserve.cluster.stream_items import Handover

        self.prompts.append(prompt)
        if len(self.prompts) == 1:
            yield item("Hel", [1])
            yield Handover()
            return
        yield item("lo", [2], finished=True)


def test_a_resumed_stream_keeps_its_tenants_cache_salt():
    """The resumed request goes as token ids, with the salt: unsalted, the new replica would
    cache the tenant's prompt where any unsalted prompt hits it."""
    engines = HandsOverOnce()
    params = SamplingParams(max_tokens=2, output_kind=RequestOutputKind.DELTA)
    client = ResumingClient(engines, HandoverRegistry())

    async def collect():
        prompt = {"prompt_token_ids": [5, 6, 7], "cache_salt": "tenant-a"}
        return [x async for x in client.generate("req", prompt, params)]

    items = asyncio.run(asyncio.wait_for(collect(), timeout=30))
    assert [i.outputs[0].text for i in items] == ["Hel", "lo"]
    assert len(engines.prompts) == 2 and engines.prompts[1]["cache_salt"] == "tenant-a"
