"""The prefix-aware router's choice, state and eviction logic, with fake replicas (a unit test of
one class: the system test with real Serve replicas is test_prefix_router_serve.py)."""

from __future__ import annotations

import asyncio

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

from pagedserve.cluster.prefix_router import PrefixAwareRouter, ReplicaPrefixTable
from pagedserve.cluster.routing_stats import RoutingStats, RoutingStatsReporter
from pagedserve.cluster.server_config import DeploymentConfig, ServerConfig
from pagedserve.engine.core.block_pool import BlockPool, extend_block_hashes, hash_block_tokens, routing_key
from pagedserve.engine.metrics import EngineStats

BLOCK = 4


class FakeReplica:
    """What the router reads of a RunningReplica."""

    def __init__(self, name: str, routing_stats: dict | None = None):
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DeploymentID(name="LLMServer", app_name="test"))
        self.routing_stats = routing_stats or {}
        self.max_ongoing_requests = 100
        self.multiplexed_model_ids: set[str] = set()
        self.node_id, self.availability_zone = "node", None

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


def stats(index: int, *, running: int = 0, waiting: int = 0, evicted: list[int] = (), num_evicted: int = 0, blocks: int = 1000) -> dict:
    return RoutingStats(index, running, waiting, 0.0, blocks, num_evicted, 0, list(evicted)).to_dict()


def keys_of(tokens: list[int]) -> list[int]:
    return [routing_key(h) for h in extend_block_hashes([], tokens, BLOCK)]


def pending(tokens: list[int], method: str = "generate") -> PendingRequest:
    metadata = RequestMetadata(request_id="r", internal_request_id=f"i{id(tokens)}", call_method=method)
    return PendingRequest(args=["r", {"prompt_token_ids": tokens}, None], kwargs={}, metadata=metadata, future=None)


@pytest.fixture
def make_router():
    """A router on its own event loop, with `replicas` as its live set."""
    loop = asyncio.new_event_loop()

    def make(replicas: list[FakeReplica], **kwargs) -> PrefixAwareRouter:
        async def build() -> PrefixAwareRouter:
            router = PrefixAwareRouter(deployment_id=DeploymentID(name="LLMServer", app_name="test"), handle_source=DeploymentHandleSource.UNKNOWN)
            router.initialize_state(block_size=BLOCK, **kwargs)
            router.update_replicas(replicas)
            return router

        return loop.run_until_complete(build())

    make.loop = loop
    yield make
    loop.close()


def refresh(router: PrefixAwareRouter, replicas: list[FakeReplica], loop) -> None:
    """Serve's call when the replica set or their routing stats change (it probes new ones)."""
    router.update_replicas(replicas)
    loop.run_until_complete(asyncio.sleep(0))


def route(router: PrefixAwareRouter, replicas: list[FakeReplica], tokens: list[int], loop) -> FakeReplica:
    """Choose as Serve does (the first rank), then record it as routed."""
    request = pending(tokens)
    ranks = loop.run_until_complete(router.choose_replicas(replicas, request))
    chosen = ranks[0][0]
    router.on_request_routed(request, chosen.replica_id, None)
    return chosen


def test_the_chain_is_the_engines():
    """The router's keys are the engine's block hashes (one function for both), full blocks only."""
    tokens = list(range(10))
    h0 = hash_block_tokens(None, tokens[:4])
    assert extend_block_hashes([], tokens, 4) == [h0, hash_block_tokens(h0, tokens[4:8])]
    assert extend_block_hashes([h0], tokens, 4)[1] == hash_block_tokens(h0, tokens[4:8])


def test_shared_prefix_follows_the_replica_that_has_it(make_router):
    replicas = [FakeReplica("a"), FakeReplica("b"), FakeReplica("c")]
    router = make_router(replicas)
    system = list(range(100, 140))  # 10 blocks shared by every conversation
    first = route(router, replicas, system + [1, 2, 3, 4], make_router.loop)
    for user in range(8):
        assert route(router, replicas, system + [user] * 8, make_router.loop) is first


def test_new_prefixes_spread_to_the_least_loaded(make_router):
    replicas = [FakeReplica("a", stats(1, running=3)), FakeReplica("b", stats(1, running=1)), FakeReplica("c", stats(1, running=2))]
    router = make_router(replicas)
    assert route(router, replicas, list(range(16)), make_router.loop) is replicas[1]
    # b now counts the request it was sent since its report (still running): 2, tied with c.
    assert route(router, replicas, list(range(50, 66)), make_router.loop) in (replicas[1], replicas[2])


def test_finished_requests_stop_counting_as_load(make_router):
    replicas = [FakeReplica("a", stats(1)), FakeReplica("b", stats(1))]
    router = make_router(replicas)
    first = pending(list(range(16)))
    chosen = make_router.loop.run_until_complete(router.choose_replicas(replicas, first))[0][0]
    router.on_request_routed(first, chosen.replica_id, None)
    assert router.tables[chosen.replica_id].load() == 1
    router.on_request_completed(chosen.replica_id, first.metadata.internal_request_id)
    assert router.tables[chosen.replica_id].load() == 0


def test_without_a_match_every_least_loaded_replica_is_offered(make_router):
    """Serve then takes the one with the fewest requests in flight among them."""
    replicas = [FakeReplica("a", stats(1, running=2)), FakeReplica("b", stats(1)), FakeReplica("c", stats(1))]
    router = make_router(replicas)
    ranks = make_router.loop.run_until_complete(router.choose_replicas(replicas, pending(list(range(16)))))
    assert sorted(r.replica_id.unique_id for r in ranks[0]) == ["b", "c"] and ranks[1] == [replicas[0]]


def test_an_imbalanced_replica_is_passed_over(make_router):
    replicas = [FakeReplica("a"), FakeReplica("b")]
    router = make_router(replicas, imbalanced_threshold=4)
    prefix = list(range(32))
    holder = route(router, replicas, prefix, make_router.loop)
    other = replicas[1] if holder is replicas[0] else replicas[0]
    holder.routing_stats, other.routing_stats = stats(1, running=4), stats(1, running=1)
    refresh(router, replicas, make_router.loop)
    assert route(router, replicas, prefix + [8] * 4, make_router.loop) is holder  # (4 + 0) - 1 <= 4
    holder.routing_stats, other.routing_stats = stats(2, running=5, waiting=2), stats(2, running=1)
    refresh(router, replicas, make_router.loop)
    assert route(router, replicas, prefix + [7] * 4, make_router.loop) is other  # 7 - 1 > 4


def test_a_short_match_goes_to_the_least_loaded(make_router):
    replicas = [FakeReplica("a", stats(1)), FakeReplica("b", stats(1))]
    router = make_router(replicas, match_rate_threshold=0.5)
    holder = route(router, replicas, list(range(8)), make_router.loop)  # 2 blocks
    other = replicas[1] if holder is replicas[0] else replicas[0]
    # 2 of 8 blocks match (25% < 50%): the least loaded (the other one) wins.
    assert route(router, replicas, list(range(8)) + [9] * 24, make_router.loop) is other


def test_calls_without_token_ids_use_power_of_two(make_router):
    replicas = [FakeReplica("a"), FakeReplica("b")]
    router = make_router(replicas)
    ranks = make_router.loop.run_until_complete(router.choose_replicas(replicas, pending([1, 2], method="model_card")))
    assert sorted(r.replica_id.unique_id for r in ranks[0]) == ["a", "b"]


def test_reported_evictions_are_forgotten():
    table = ReplicaPrefixTable()
    table.apply(RoutingStats.from_dict(stats(1, blocks=100)))
    first, second = keys_of(list(range(8))), keys_of(list(range(20, 28)))
    table.insert(first + second)
    assert table.num_matched(first) == 2
    table.apply(RoutingStats.from_dict(stats(2, evicted=[first[1]], num_evicted=1, blocks=100)))
    assert (table.num_matched(first), table.num_matched(second)) == (1, 2)
    # Three evictions counted, none listed (a report the router missed): the oldest three go.
    table.apply(RoutingStats.from_dict(stats(3, num_evicted=4, blocks=100)))
    assert (table.num_matched(first), table.num_matched(second)) == (0, 0)
    assert len(table.keys) == 0


def test_the_table_is_bounded_by_the_replicas_cache():
    table = ReplicaPrefixTable()
    table.apply(RoutingStats.from_dict(stats(1, blocks=3)))
    old, new = keys_of(list(range(8))), keys_of(list(range(40, 52)))
    table.insert(old + new)
    assert len(table.keys) == 3 and table.num_matched(new) == 3 and table.num_matched(old) == 0


def test_removed_replicas_lose_their_state(make_router):
    replicas = [FakeReplica("a"), FakeReplica("b")]
    router = make_router(replicas)
    route(router, replicas, list(range(16)), make_router.loop)
    refresh(router, replicas[:1], make_router.loop)
    assert list(router.tables) == [replicas[0].replica_id]


def test_the_replica_reports_its_evictions():
    pool = BlockPool(2)
    reporter = RoutingStatsReporter(pool)
    blocks = pool.allocate(2)
    hashes = extend_block_hashes([], list(range(8)), 4)
    for block, block_hash in zip(blocks, hashes):
        pool.register_block(block, block_hash)
    pool.free(blocks)
    pool.allocate(1)  # evicts the least recently freed: the first block
    report = reporter.report(EngineStats())
    assert (report.evicted_routing_keys, report.num_evicted_blocks, report.num_total_blocks) == ([routing_key(hashes[0])], 1, 2)
    again = reporter.report(EngineStats())
    assert again.evicted_routing_keys == [] and again.report_index == report.report_index + 1
    assert reporter.report(EngineStats()) is again  # nothing changed: the same report, no broadcast


def test_the_router_setting_and_its_default():
    # The default does not depend on the scale (an override may change it unseen by the args).
    assert DeploymentConfig().resolved_request_router(enable_prefix_caching=True) == "prefix_aware"
    assert DeploymentConfig(num_replicas=2).resolved_request_router(enable_prefix_caching=False) == "power_of_two"
    assert DeploymentConfig(request_router="power_of_two").resolved_request_router(enable_prefix_caching=True) == "power_of_two"
    with pytest.raises(ValueError, match="deployment.request_router.*'prefix_aware' or 'power_of_two'"):
        ServerConfig.load(overrides={"request_router": "random"})
    with pytest.raises(ValueError, match="deployment.imbalanced_threshold"):
        ServerConfig.load(overrides={"imbalanced_threshold": 0})


def test_prefix_aware_needs_the_prefix_cache():
    from pagedserve.cluster.app import request_router_config

    config = ServerConfig(model="tiny", engine={"enable_prefix_caching": False, "block_size": 8}, deployment={"request_router": "prefix_aware"})
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        request_router_config(config)
    routed = request_router_config(ServerConfig(model="tiny", engine={"block_size": 8}, deployment={"num_replicas": 2}))
    assert routed["request_router_class"].endswith("PrefixAwareRouter")
    assert routed["request_router_kwargs"]["block_size"] == 8
    assert request_router_config(ServerConfig(model="tiny"))["request_router_class"].endswith("PrefixAwareRouter")
    unprefixed = request_router_config(ServerConfig(model="tiny", engine={"enable_prefix_caching": False}))
    assert unprefixed["request_router_class"].endswith("handover_router:PowerOfTwoRouter")


def test_a_replica_without_its_block_pool_reports_load_only():
    """With the engine core in its own process the replica cannot see its block pool: its reports
    carry the load and no evictions, and the router's table keeps its default bound."""
    report = RoutingStatsReporter(None).report(EngineStats(num_requests_running=3))
    assert (report.num_running, report.evicted_routing_keys, report.num_total_blocks) == (3, [], 0)
    table = ReplicaPrefixTable()
    table.insert([1, 2, 3])
    table.apply(report)
    assert table.capacity > 3 and table.num_matched([1, 2, 3]) == 3


def test_the_router_salts_the_chain_as_the_engine_does(make_router):
    """A salted prompt's routing keys are the engine's salted block hashes: they differ per salt,
    so one tenant's prompt is not steered towards (and timed against) another's cached blocks."""
    from pagedserve.engine.core.kv_cache_manager import KVCacheManager
    from pagedserve.engine.core.request import Request
    from pagedserve.sampling_params import SamplingParams

    tokens = list(range(100, 120))
    kv = KVCacheManager(16, BLOCK, enable_caching=True)
    engine_request = Request("a", tokens, SamplingParams(max_tokens=4), frozenset(), max_model_len=256, cache_salt="tenant-a")
    kv.get_computed_blocks(engine_request)  # fills the request's hash chain
    router = make_router([FakeReplica("a")])
    requests = []  # kept alive: pending() names a request by its token list's id()

    def routed_keys(salt):
        request = pending(list(tokens))
        requests.append(request)
        if salt is not None:
            request.args[1]["cache_salt"] = salt
        return router._routing_keys(request)

    tenant_a, tenant_b, plain = routed_keys("tenant-a"), routed_keys("tenant-b"), routed_keys(None)
    assert tenant_a == [routing_key(h) for h in engine_request.block_hashes]
    assert plain == keys_of(tokens)
    assert len(tenant_a) == 5 and not set(tenant_a) & set(tenant_b) and not set(tenant_a) & set(plain)


def test_a_tenant_does_not_follow_another_tenants_prefix(make_router):
    # Names of their own: an earlier test of this module leaves replica "b" marked as leaving.
    replicas = [FakeReplica("tenant-test-1", stats(1)), FakeReplica("tenant-test-2", stats(1))]
    router = make_router(replicas)
    system = list(range(100, 140))
    requests = []  # kept alive: pending() names a request by its token list's id()

    def route_salted(salt: str, suffix: list[int]) -> FakeReplica:
        request = pending(system + suffix)
        requests.append(request)
        request.args[1]["cache_salt"] = salt
        ranks = make_router.loop.run_until_complete(router.choose_replicas(replicas, request))
        chosen = ranks[0][0]
        router.on_request_routed(request, chosen.replica_id, None)
        return chosen

    first = route_salted("tenant-a", [1] * 8)
    other = replicas[1] if first is replicas[0] else replicas[0]
    first.routing_stats, other.routing_stats = stats(2, running=4), stats(2)
    refresh(router, replicas, make_router.loop)
    assert route_salted("tenant-a", [2] * 8) is first  # the same tenant follows its prefix
    assert route_salted("tenant-b", [3] * 8) is not first  # another tenant goes to the least loaded


def test_a_request_under_an_adapter_prefers_replicas_that_have_it(make_router):
    """Replicas report their engines' adapters; a request under one goes to a replica holding
    it (its hashes salted with the adapter's id), unless those are too busy."""
    from pagedserve.lora_request import LoRARequest

    def with_adapters(index: int, lora_ids: list[int], running: int = 0) -> dict:
        return {**stats(index, running=running), "lora_ids": lora_ids}

    replicas = [FakeReplica("lora-test-1", with_adapters(1, [])), FakeReplica("lora-test-2", with_adapters(1, [7]))]
    router = make_router(replicas, imbalanced_threshold=2)
    requests = []

    def route_under(lora_id: int, tokens: list[int]) -> FakeReplica:
        request = pending(tokens)
        requests.append(request)
        request.args[1]["lora_request"] = LoRARequest("sql", lora_id, "/adapters/sql")
        chosen = make_router.loop.run_until_complete(router.choose_replicas(replicas, request))[0][0]
        router.on_request_routed(request, chosen.replica_id, None)
        router.on_request_completed(chosen.replica_id, request.metadata.internal_request_id)
        return chosen

    assert all(route_under(7, list(range(i, i + 16))) is replicas[1] for i in range(5))
    assert {route_under(8, list(range(i, i + 16))).replica_id.unique_id for i in range(40)} == {"lora-test-1", "lora-test-2"}
    replicas[1].routing_stats = with_adapters(2, [7], running=3)  # 3 - 0 > 2: the holder is too busy
    refresh(router, replicas, make_router.loop)
    assert route_under(7, list(range(200, 216))) is replicas[0]
    # The adapter salts the chain, as the engine's: no key in common with the same tokens unsalted.
    request = pending(list(range(16)))
    requests.append(request)
    request.args[1]["lora_request"] = LoRARequest("sql", 7, "/adapters/sql")
    assert not set(router._routing_keys(request)) & set(keys_of(list(range(16))))


def test_the_replica_reports_its_adapters():
    reporter = RoutingStatsReporter(None)
    assert reporter.report(EngineStats(), lora_ids={3, 1}).lora_ids == [1, 3]
