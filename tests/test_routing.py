"""Routing among data-parallel replicas, on integers: round-robin, least-loaded, and cache-aware routing from the
block names an engine's scheduler really reports (cached, evicted), balanced against load."""

from __future__ import annotations

from dataclasses import dataclass

from engine import SamplingParams
from engine.core.config import EngineConfig
from engine.core.request import Request, SampledTokens
from engine.core.scheduler import Scheduler
from engine.ipc.messages import CacheEvents, cache_key
from gateway.routing import BALANCE_TOKENS, CacheAware, LeastLoaded, RoundRobin, make_router

BS = 4


@dataclass
class Replica:
    index: int
    load: int = 0


def replicas(*loads: int) -> list[Replica]:
    return [Replica(i, load) for i, load in enumerate(loads)]


def engine(num_blocks: int = 16) -> Scheduler:
    s = Scheduler(EngineConfig(block_size=BS, max_num_batched_tokens=256), num_blocks, 1024)
    s.kv.record_events()
    return s


def serve(s: Scheduler, rid: str, prompt: list[int], salt: bytes = b"") -> CacheEvents:
    """Run one request to the end on `s`; the cache events its steps produced, as the engine's worker sends them."""
    s.add(Request(rid, list(prompt), SamplingParams(max_tokens=2), eos_token_id=0, cache_salt=salt))
    while s.has_unfinished():
        batch = s.schedule()
        s.update(batch, {r.request_id: SampledTokens([7]) for r in batch.requests if r.sample})
    stored, removed = s.kv.drain_events()
    return CacheEvents([cache_key(n) for n in stored], [cache_key(n) for n in removed])


def test_round_robin_takes_turns_and_least_loaded_takes_the_idlest():
    rr = RoundRobin()
    rs = replicas(0, 0, 0)
    assert [rr.choose(rs, [1], b"")[0].index for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    assert LeastLoaded().choose(replicas(50, 10, 30), [1], b"")[0].index == 1
    # Ties go in turn, so an idle server alternates rather than piling onto the first replica.
    ll = LeastLoaded()
    assert [ll.choose(replicas(0, 0), [1], b"")[0].index for _ in range(4)] == [0, 1, 0, 1]
    assert [type(make_router(p, 2, BS)) for p in ("round-robin", "least-loaded", "cache-aware")] == [
        RoundRobin, LeastLoaded, CacheAware]


def test_the_router_names_a_prompt_s_blocks_as_the_engine_caches_them():
    prompt = list(range(100, 123))  # 5 full blocks and 3 tokens
    s = engine()
    events = serve(s, "a", prompt, b"salt")
    router = CacheAware(1, BS)
    # The engine caches the prompt's 5 full blocks, then a sixth once the first output's K/V fills it.
    assert events.stored[:5] == router.keys(prompt, b"salt") and len(events.stored) == 6 and events.removed == []
    # A request can take every full block but one holding its last token, whose logits it needs: the router's keys.
    assert router.keys(prompt[:20], b"salt") == events.stored[:4]
    assert router.keys(prompt, b"") != events.stored  # a salt names every block differently


def test_cache_aware_sends_a_prompt_to_the_replica_holding_its_prefix():
    router = CacheAware(2, BS)
    shared = list(range(200, 240))  # 10 blocks
    e1 = engine()
    router.cache_events(1, serve(e1, "a", shared + [1, 2, 3]))
    rs = replicas(0, 0)
    assert router.choose(rs, shared + [9, 9], b"")[0].index == 1
    assert router.choose(replicas(0, 900), shared + [9, 9], b"")[0].index == 1  # cache beats a modest load difference
    assert router.choose(rs, shared + [9, 9], b"other tenant")[0].index in (0, 1)  # another salt finds nothing...
    assert router.choose(replicas(0, 10), shared + [9], b"other tenant")[0].index == 0  # ...so the idlest gets it
    # Too little of the prompt cached (under 30%): the idlest replica.
    assert router.choose(replicas(10, 0), shared[:8] + list(range(50)), b"")[0].index == 1
    assert router.choose(replicas(0, 10), shared[:8] + list(range(50)), b"")[0].index == 0
    # Out of balance: the idlest, whatever is cached.
    assert router.choose(replicas(0, BALANCE_TOKENS + 1), shared + [9], b"")[0].index == 0
    # Why each went where it did: orcinus_routed_requests' reason.
    assert [router.choose(replicas(*loads), prompt, b"")[1] for loads, prompt in [
        ((0, 0), shared + [9]), ((0, BALANCE_TOKENS + 1), shared + [9]), ((0, 0), list(range(50)))]] == [
        "cache", "balance", "load"]


def test_requests_in_flight_count_before_their_engine_reports_and_eviction_and_restart_forget():
    router = CacheAware(2, BS)
    prompt = list(range(300, 340))
    assert router.route("x", replicas(5, 0), prompt, b"")[0].index == 1  # routed, not yet prefilled: its twin...
    assert router.choose(replicas(5, 0), prompt + [1], b"")[0].index == 1
    assert router.choose(replicas(0, 5), prompt + [1], b"")[0].index == 1
    router.done("x")
    assert router.pending == [{}, {}]
    assert router.choose(replicas(0, 5), prompt + [1], b"")[0].index == 0  # nothing held: the idlest

    e0 = engine(num_blocks=12)
    router.cache_events(0, serve(e0, "a", prompt))  # 10 blocks of 12 cached
    assert router.choose(replicas(5, 0), prompt + [1], b"")[0].index == 0
    evicting = serve(e0, "b", list(range(900, 940)))  # another 10 blocks: most of the first prompt's are evicted
    assert evicting.removed
    router.cache_events(0, evicting)
    # The router holds what the engine holds: the first prompt's head, freed last, is evicted last.
    keys = router.keys(prompt + [1], b"")
    e0.kv._name_blocks(req := Request("c", prompt + [1], SamplingParams(), 0), 10)
    still = next(i for i, name in enumerate(req.block_names) if name not in e0.kv.cached)
    assert 0 < still < 10 and router.matched(0, keys) == still
    assert router.choose(replicas(0, 5), list(range(900, 940)) + [1], b"")[0].index == 0
    router.cache_events(0, None)  # the replica restarted: an empty cache
    assert router.cached[0] == set()


def test_replicas_refuse_one_rendezvous_for_several_engines():
    import pytest

    from gateway.metrics import Metrics
    from gateway.replicas import Replicas, replica_devices

    with pytest.raises(ValueError, match="external-stages"):
        Replicas(EngineConfig(pipeline_stages=2, external_stages=True), Metrics(), size=2)
    # Each replica's own GPUs: its tensor x pipeline grid, in order.
    grid = EngineConfig(pipeline_stages=2, tensor_parallel_size=2)
    assert [replica_devices(grid, i, 2) for i in (0, 1)] == ["0,1,2,3", "4,5,6,7"]
    assert replica_devices(grid, 0, 1) is None


def test_without_prefix_caching_cache_aware_routing_is_least_loaded():
    from gateway.metrics import Metrics
    from gateway.replicas import Replicas

    replicas = Replicas(EngineConfig(prefix_caching=False), Metrics(), size=2, routing="cache-aware")
    assert type(replicas.router) is LeastLoaded and all(c.on_cache is None for c in replicas.clients)
    replicas = Replicas(EngineConfig(), Metrics(), size=2)
    assert type(replicas.router) is CacheAware and all(c.on_cache is not None for c in replicas.clients)
