"""Routing among data-parallel replicas, on integers: round-robin, least-loaded, and cache-aware routing from the
block names an engine's scheduler really reports (cached, evicted), balanced against load."""

from __future__ import annotations

from dataclasses import dataclass

from engine import SamplingParams
from engine.core.config import EngineConfig
from engine.core.request import EngineRequest, Request, RequestOptions, SampledTokens
from engine.core.scheduler import Scheduler
from engine.ipc.messages import CacheEvents, cache_key
from gateway.engines.routing import BALANCE_TOKENS, CacheAware, LeastLoaded, RoundRobin, make_router

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
    s.add(Request(rid, list(prompt), SamplingParams(max_tokens=2), eos_token_id=0, options=RequestOptions(salt)))
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
        RoundRobin,
        LeastLoaded,
        CacheAware,
    ]


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
    assert [
        router.choose(replicas(*loads), prompt, b"")[1]
        for loads, prompt in [
            ((0, 0), shared + [9]),
            ((0, BALANCE_TOKENS + 1), shared + [9]),
            ((0, 0), list(range(50))),
        ]
    ] == ["cache", "balance", "load"]


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

    from gateway.engines.replicas import Replicas, replica_devices
    from gateway.web.metrics import Metrics

    with pytest.raises(ValueError, match="external-stages"):
        Replicas(EngineConfig(pipeline_stages=2, external_stages=True), Metrics(), size=2)
    # Each replica's own GPUs: its tensor x pipeline grid, in order.
    grid = EngineConfig(pipeline_stages=2, tensor_parallel_size=2)
    assert [replica_devices(grid, i, 2) for i in (0, 1)] == ["0,1,2,3", "4,5,6,7"]
    assert replica_devices(grid, 0, 1) is None


def test_without_prefix_caching_cache_aware_routing_is_least_loaded():
    from gateway.engines.replicas import Replicas
    from gateway.web.metrics import Metrics

    replicas = Replicas(EngineConfig(prefix_caching=False), Metrics(), size=2, routing="cache-aware")
    assert type(replicas.router) is LeastLoaded and all(c.on_cache is None for c in replicas.clients)
    replicas = Replicas(EngineConfig(), Metrics(), size=2)
    assert type(replicas.router) is CacheAware and all(c.on_cache is not None for c in replicas.clients)


class FakeEngine:
    """An engine process as its client sees it, without one: what was sent to it."""

    def __init__(self):
        self.sent: list = []
        self.alive = True
        self.unread = False  # frames of its waiting unread
        self.pid = 0

    def try_send(self, msg) -> bool:
        self.sent.append(msg)
        return True


def live_replicas(size: int):
    """Replicas taking requests in turn, each client with a FakeEngine that is ready and answering."""
    import time

    from gateway.engines.replicas import Replicas
    from gateway.web.metrics import Metrics

    replicas = Replicas(EngineConfig(), Metrics(), size=size, routing="round-robin")
    for c in replicas.clients:
        c.engine, c.ready = FakeEngine(), "ready"
        c.last_heard = c.last_beat = time.monotonic()
    return replicas


def drain(queue) -> list:
    out = []
    while not queue.empty():
        out.append(queue.get_nowait())
    return out


def test_a_request_with_no_token_yet_moves_once_from_a_dead_replica_one_that_streamed_fails():
    import asyncio

    from engine.ipc.messages import AddRequest, StepDeltas, TokenDelta
    from gateway.engines.client import EngineUnavailableError

    async def scenario():
        replicas = live_replicas(3)
        a, b, c = replicas.clients
        queue = asyncio.Queue()
        params = SamplingParams(max_tokens=4, temperature=0.0)
        for i in range(4):  # in turn: r0 and r3 on a, r1 on b, r2 on c
            await replicas.add(EngineRequest(f"r{i}", [1, 2, 3, i], params), queue)
        a._on_frame(StepDeltas([TokenDelta("r0", [7], None)]))  # r0 has streamed a token; r3 has nothing yet

        def dies(client) -> list:
            client.ready = None  # as its supervisor does when the process exits
            client._lose_in_flight(EngineUnavailableError("the engine process exited (code -9)"))
            return drain(queue)

        got = dies(a)
        assert [(rid, type(m).__name__) for rid, m in got] == [("r0", "TokenDelta"), ("r0", "EngineUnavailableError")]
        await asyncio.sleep(0)  # the re-submission's task
        [to] = [x for x in (b, c) if "r3" in x.routes]
        assert to.engine.sent[-1] == AddRequest(EngineRequest("r3", [1, 2, 3, 3], params))  # as it was first sent
        assert replicas.where["r3"] is to and a.routes == {} and a.load == 0
        # Moved once: where it went dies too, and it fails; that replica's own request moves to the last one.
        other = c if to is b else b
        got = dies(to)
        assert [(rid, type(m).__name__) for rid, m in got] == [("r3", "EngineUnavailableError")]
        await asyncio.sleep(0)
        assert set(other.routes) == {"r1", "r2"}
        # No replica left: nothing moves, everything fails as before.
        assert sorted(rid for rid, m in dies(other) if isinstance(m, EngineUnavailableError)) == ["r1", "r2"]
        m = replicas.metrics.registry
        assert [m.get_sample_value("orcinus_engine_healthy", {"replica": i}) for i in "012"] == [0.0, 0.0, 0.0]
        assert m.get_sample_value("orcinus_rerouted_requests_total", {"replica": "0", "reason": "exited"}) == 1

    asyncio.run(scenario())


def test_a_replica_that_stops_answering_leaves_routing_and_its_requests_with_no_token_move():
    import asyncio

    from engine.ipc.messages import Abort, AddGrammar, AddRequest, Heartbeat, ReleaseGrammar, StepDeltas, TokenDelta

    async def scenario():
        replicas = live_replicas(2)
        a, b = replicas.clients
        queue = asyncio.Queue()
        params = SamplingParams(max_tokens=4)
        await replicas.add_grammar("g", "start: /[0-9]+/")
        for i in range(4):  # in turn: r0 and r2 on a, r1 and r3 on b; r2 constrained
            await replicas.add(EngineRequest(f"r{i}", [5, i], params), queue, grammar_id="g" if i == 2 else None)
        replicas.release_grammar("g")
        a._on_frame(StepDeltas([TokenDelta("r0", [7], None)]))
        a.last_beat -= 60  # not even a heartbeat since
        assert not a.healthy and b.healthy
        a.engine.unread = True  # ...but frames wait unread: the gateway is the one behind
        assert a.healthy
        a.engine.unread = False
        a._watch_answering(a.engine)
        await asyncio.sleep(0)
        # r2 moves, with its grammar under an id of its own (b may still hold "g" for requests of its own); should a
        # wake, it does not run r2 too. r0 streamed: it stays and waits.
        assert b.engine.sent[-3:] == [
            AddGrammar("g/r2", "start: /[0-9]+/"),
            AddRequest(EngineRequest("r2", [5, 2], params), grammar_id="g/r2"),
            ReleaseGrammar("g/r2"),
        ]
        assert a.engine.sent[-1] == Abort("r2") and set(a.routes) == {"r0"} and set(b.routes) == {"r1", "r2", "r3"}
        assert [rid for rid, _ in drain(queue)] == ["r0"]  # its token, no error
        await replicas.add(EngineRequest("r4", [5, 4], params), queue)
        assert replicas.where["r4"] is b  # out of routing
        assert replicas.metrics.registry.get_sample_value("orcinus_engine_healthy", {"replica": "0"}) == 0
        a._on_frame(Heartbeat())
        a._watch_answering(a.engine)
        assert a.healthy and not a.unresponsive

    asyncio.run(scenario())


def test_where_no_replica_answers_a_request_waits_on_one_that_still_serves():
    """A stall (every replica silent, none exited or judged hung) queues requests as before; none is a 503."""
    import asyncio

    from gateway.engines.client import EngineUnavailableError

    async def scenario():
        replicas = live_replicas(1)
        [a] = replicas.clients
        a.last_beat -= 60
        assert not a.healthy and a.serving and not replicas.healthy  # /health says so
        await replicas.add(EngineRequest("r0", [5, 1], SamplingParams(max_tokens=4)), asyncio.Queue())
        assert replicas.where["r0"] is a and "r0" in a.routes
        a.ready = None  # exited: now there is nowhere to wait
        try:
            await replicas.add(EngineRequest("r1", [5, 2], SamplingParams(max_tokens=4)), asyncio.Queue())
        except EngineUnavailableError:
            pass
        else:
            raise AssertionError("a request was routed to an engine that exited")

    asyncio.run(scenario())


def test_adapter_requests_go_where_their_adapter_is_resident_else_to_the_least_loaded():
    from gateway.engines.adapter_routing import AdapterAware

    router = AdapterAware(RoundRobin(), 3, max_loras=2)
    rs = replicas(0, 0, 0)
    assert router.route("a1", rs, [1, 2], b"", "a") == (rs[0], "load")  # resident nowhere: the least loaded
    rs[0].load, rs[1].load = 100, 50
    assert router.route("a2", rs, [1, 2], b"", "a") == (rs[0], "lora")  # busier, but a is resident there
    assert router.route("b1", rs, [1, 2], b"", "b") == (rs[2], "load")
    rs[2].load = 10
    assert router.route("x", rs, [1, 2], b"", "") == (rs[0], "turn")  # the base model: the policy underneath
    assert router.route("y", rs, [1, 2], b"", "") == (rs[1], "turn")
    # Loads out of balance: the least loaded, which now holds a too.
    rs[0].load = BALANCE_TOKENS * 2
    assert router.route("a3", rs, [1, 2], b"", "a") == (rs[2], "load")
    assert router.route("a4", rs, [1, 2], b"", "a") == (rs[2], "lora")
    assert list(router.resident[2]) == ["b", "a"]
    # Two slots on replica 2: c comes in, b (unheld, used least recently) goes; a is held and stays.
    router.done("b1")
    rs[1].load = rs[0].load
    assert router.route("c1", rs, [1, 2], b"", "c") == (rs[2], "load")
    assert list(router.resident[2]) == ["a", "c"]
    assert router.route("b2", rs, [1, 2], b"", "b") == (rs[2], "load")  # resident nowhere again
    assert list(router.resident[2]) == ["a", "c", "b"]  # every one held: the engine makes b wait for a slot
    for r in ("a1", "a2", "a3", "a4", "c1", "b2", "x", "y"):
        router.done(r)
    assert not router.in_flight and all(not u for u in router.users)
    # a's last request on replica 2 gave its slot to the waiting b, as the engine's pool does.
    assert [list(r) for r in router.resident] == [["a"], [], ["c", "b"]]
    router.unloaded("a")
    assert all("a" not in r for r in router.resident)


def test_replicas_serving_adapters_route_by_residency_and_count_why():
    import asyncio

    from gateway.engines.adapter_routing import AdapterAware
    from gateway.engines.replicas import Replicas
    from gateway.web.metrics import Metrics

    async def scenario():
        import time

        replicas = Replicas(EngineConfig(enable_lora=True, max_loras=2), Metrics(), size=2, routing="round-robin")
        assert isinstance(replicas.router, AdapterAware)
        for c in replicas.clients:
            c.engine, c.ready = FakeEngine(), "ready"
            c.last_heard = c.last_beat = time.monotonic()
        queue = asyncio.Queue()
        params = SamplingParams(max_tokens=4)
        for i, lora in enumerate(["a", "", "a", "b", "a"]):
            request = EngineRequest(f"r{i}", [1, 2, 3], params, options=RequestOptions(lora=lora))
            await replicas.add(request, queue)
        where = {r: c.index for r, c in replicas.where.items()}
        m = replicas.metrics.registry
        reasons = {
            (s.labels["replica"], s.labels["reason"]): s.value
            for metric in m.collect()
            if metric.name == "orcinus_routed_requests"
            for s in metric.samples
            if s.name.endswith("_total")
        }
        return where, reasons

    where, reasons = asyncio.run(scenario())
    # r0 (a) to replica 0, r1 (base) by turn, r2 (a) where a is, r3 (b) to the less loaded, r4 (a) to a's.
    assert where == {"r0": 0, "r1": 0, "r2": 0, "r3": 1, "r4": 0}
    assert reasons == {("0", "load"): 1, ("0", "turn"): 1, ("0", "lora"): 2, ("1", "load"): 1}


def test_a_steps_frame_gives_each_request_the_delta_the_engine_made_for_it():
    """The engine loop sends a step's plain deltas (one new token of a running request) as columns of its StepDeltas,
    the others as TokenDeltas: through the ring's encoding, the gateway hands each request what EngineLoop.delta makes."""
    import asyncio
    import copy

    import msgspec

    from engine.core.config import FaultPlan
    from engine.core.request import RequestStatus, TokenLogprobs
    from engine.ipc.engine_loop import EngineLoop
    from engine.ipc.messages import AddRequest, FromEngine
    from gateway.engines.client import _Route

    class Loop:  # what publish_deltas reads of its EngineLoop
        faults = FaultPlan()
        generation_tokens_total = 0
        delta = EngineLoop.delta

        def __init__(self):
            self.sent, self.outbox = [], self

        def send(self, frame) -> None:
            self.sent.append(frame)

    def made(rid, outputs, delivered, status=RequestStatus.RUNNING, logprobs=None) -> Request:
        r = Request(rid, [1, 2, 3], SamplingParams(max_tokens=8, logprobs=logprobs), status=status)
        r.output_token_ids, r.num_delivered_tokens = list(outputs), delivered
        r.output_logprobs = [TokenLogprobs(t, -0.5, []) for t in outputs] if logprobs is not None else []
        r.num_cached_tokens, r.queue_seconds = 2, 0.25
        return r

    updated = [
        made("plain", [4, 5, 6], 2),
        made("first", [4], 0),
        made("last", [4, 5], 1, RequestStatus.FINISHED_LENGTH),
        made("logprobs", [4, 5], 1, logprobs=1),
        made("drafted", [4, 5, 6], 1),  # a step that accepted a draft: two tokens
        made("plain2", [9, 8], 1),
    ]
    want = {r.request_id: EngineLoop.delta(Loop(), copy.deepcopy(r)) for r in updated}
    loop = Loop()
    EngineLoop.publish_deltas(loop, updated)
    [frame] = loop.sent
    assert (frame.request_ids, frame.token_ids) == (["plain", "plain2"], [6, 8])
    assert [d.request_id for d in frame.deltas] == ["first", "last", "logprobs", "drafted"]
    assert loop.generation_tokens_total == 7
    assert [r.num_delivered_tokens for r in updated] == [len(r.output_token_ids) for r in updated]

    async def scenario():
        [client] = live_replicas(1).clients
        queue = asyncio.Queue()
        for rid in want:
            client.routes[rid] = _Route(queue, AddRequest(EngineRequest(rid, [1, 2, 3], SamplingParams())))
        client._on_frame(msgspec.msgpack.decode(msgspec.msgpack.encode(frame), type=FromEngine))
        return drain(queue), client.routes

    got, routes = asyncio.run(scenario())
    assert dict(got) == want and len(got) == len(want)
    assert sorted(routes) == sorted(set(want) - {"last"})  # a finished request's route goes
    assert routes["drafted"].num_tokens == 3 + 2 and routes["plain"].num_tokens == 3 + 1


def test_an_adapter_load_a_replica_cannot_take_leaves_it_on_none():
    """A replica restarting while an adapter loads: the load is a 503 and the replicas that loaded it unload it, so
    loading it again later works (it was refused as "already loaded" by them, and served nowhere)."""
    import asyncio
    import time

    from engine.ipc.messages import LoadLora, LoraResult, UnloadLora
    from gateway.engines.client import EngineUnavailableError
    from gateway.engines.replicas import Replicas
    from gateway.web.metrics import Metrics

    class AdapterEngine(FakeEngine):
        """Answers adapter updates as an engine does: a name it has cannot be loaded again."""

        def __init__(self, client):
            super().__init__()
            self.client, self.names = client, set()

        def try_send(self, msg) -> bool:
            super().try_send(msg)
            if isinstance(msg, LoadLora):
                error = "The lora adapter 'x' has already been loaded." if msg.name in self.names else None
                self.names.add(msg.name)
            elif isinstance(msg, UnloadLora):
                error = None if msg.name in self.names else "The lora adapter 'x' cannot be found."
                self.names.discard(msg.name)
            self.client._on_frame(LoraResult(msg.op_id, error))
            return True

    async def scenario():
        replicas = Replicas(EngineConfig(enable_lora=True), Metrics(), size=2, routing="round-robin")
        for c in replicas.clients:
            c.engine, c.ready = AdapterEngine(c), "ready"
            c.last_heard = c.last_beat = time.monotonic()
        up, down = replicas.clients
        down.ready = None  # restarting
        try:
            await replicas.load_lora("x", "/x")
            raise AssertionError("the load went through with a replica down")
        except EngineUnavailableError:
            pass
        after_failure = (set(up.engine.names), dict(up.loras))
        down.ready = "ready"
        result = await replicas.load_lora("x", "/x")
        return after_failure, result.error, up.engine.names, down.engine.names

    after_failure, error, up_names, down_names = asyncio.run(scenario())
    assert after_failure == (set(), {})
    assert (error, up_names, down_names) == (None, {"x"}, {"x"})
