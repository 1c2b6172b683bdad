"""Shared-memory channel: framing and wrap-around, full ring, doorbell, asyncio, cross-process echo."""

import asyncio
import json
import os
import random
import subprocess
import sys
import threading
import time
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import pytest

from engine.core.request import EngineRequest, RequestOptions, TokenLogprobs
from engine.core.sampling_params import SamplingParams
from engine.ipc.channel import (
    Channel,
    ChannelFullError,
    ChannelHandle,
    Doorbell,
    ShmRing,
)
from engine.ipc.messages import (
    Abort,
    AddRequest,
    EngineStats,
    FromEngine,
    Heartbeat,
    RequestError,
    Shutdown,
    StepDeltas,
    ToEngine,
    TokenDelta,
)

ROOT = Path(__file__).resolve().parents[1]
# A child process's environment: it imports this checkout's engine, not another's.
CHECKOUT = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


@pytest.fixture
def channels():
    made = []

    def make(msg_type, capacity=1 << 16):
        made.append(Channel.create(msg_type, capacity))
        return made[-1]

    yield make
    for ch in made:
        ch.close()
        ch.unlink()


def test_round_trip_each_message_type(channels):
    to_engine, from_engine = channels(ToEngine), channels(FromEngine)
    params = SamplingParams(
        max_tokens=5, temperature=0.5, seed=3, logit_bias={7: -1.5}, stop_token_ids=(2, 9), logprobs=2
    )
    sent_in = [
        AddRequest(EngineRequest("r1", [1, 2, 3], params, RequestOptions(b"salt", -3))),
        AddRequest(EngineRequest("r2", [], SamplingParams()), "g"),
        Abort("r1"),
        Shutdown(),
    ]
    sent_out = [
        StepDeltas([TokenDelta("r1", [5, 6], None)]),
        StepDeltas([TokenDelta("r1", [7], "stop", logprobs=[TokenLogprobs(7, -0.25, [(7, -0.25), (8, -1.5)])])]),
        StepDeltas(
            [TokenDelta("r3", [1], None, num_cached_tokens=16, queue_seconds=0.5), TokenDelta("r4", [2], "length")]
        ),
        RequestError("r2", "prompt too long", "prompt"),
        EngineStats(1, 2, 30, 70, num_iterations=9, last_batch_size=3, num_preemptions=1),
    ]
    for ch, sent in ((to_engine, sent_in), (from_engine, sent_out)):
        peer = Channel.attach(ch.handle(), ch.msg_type)  # the consumer attaches, like the other process
        try:
            for msg in sent:
                ch.send(msg)
            got = peer.recv_all()
        finally:
            peer.close()
        assert got == sent and [type(m) for m in got] == [type(m) for m in sent]
    assert got[4].kv_blocks_free == 70 and sent_in[0].request.params.logit_bias == {7: -1.5}


def test_wrap_around_random_sizes():
    ring = ShmRing.create(capacity=4096)
    reader = ShmRing.attach(ring.name)
    rng = random.Random(1234)
    payloads = [rng.randbytes(rng.choice([0, 1, 3, rng.randrange(4000), rng.randrange(300)])) for _ in range(3000)]
    got, i, split_lengths = [], 0, 0
    try:
        while len(got) < len(payloads):
            while i < len(payloads) and rng.random() < 0.8:
                head = ring._hdr[8]
                if not ring.try_write(payloads[i]):
                    break
                split_lengths += ring.capacity - head % ring.capacity < 4  # the length field itself wraps
                i += 1
            got.extend(reader.read_all())
        assert got == payloads
        assert reader.read_all() == [] and ring.used == 0
        assert split_lengths > 0 and sum(map(len, payloads)) > 100 * ring.capacity
    finally:
        reader.close()
        ring.close()
        ring.unlink()


def test_full_ring_and_oversize(channels):
    ring = ShmRing.create(capacity=64)
    try:
        assert ring.try_write(b"a" * 28) and ring.try_write(b"b" * 28)  # 2 x (4 + 28) = 64
        assert not ring.try_write(b"")
        assert ring.read_all() == [b"a" * 28, b"b" * 28]
        assert ring.try_write(b"c" * 60) and ring.read_all() == [b"c" * 60]  # exactly the capacity
        with pytest.raises(ValueError, match="exceeds ring"):
            ring.try_write(b"d" * 61)
    finally:
        ring.close()
        ring.unlink()
    ch = channels(FromEngine, capacity=64)
    ch.send(StepDeltas([TokenDelta("x", list(range(20)), None)]))
    assert not ch.try_send(StepDeltas([TokenDelta("x", list(range(20)), None)]))
    t0 = time.monotonic()
    with pytest.raises(ChannelFullError, match="stayed full"):
        ch.send(StepDeltas([TokenDelta("y", list(range(20)), None)]), timeout=0.05)
    assert time.monotonic() - t0 < 1.0
    assert [m.deltas[0].request_id for m in ch.recv_all()] == ["x"]  # nothing dropped or half-written
    with pytest.raises(ValueError):
        ch.send(StepDeltas([TokenDelta("z", list(range(100)), None)]))


def test_a_send_waits_out_a_reader_stalled_past_any_fixed_bound(channels):
    """The engine's sends wait for as long as the gateway (alive) takes to make room: with a bound, a gateway stalled
    for more than it (a long collection, a starved core) ended the engine and every request in flight."""
    ch = channels(FromEngine, capacity=64)
    ch.send(StepDeltas([TokenDelta("x", list(range(20)), None)]))
    got: list[str] = []

    def stalled_reader() -> None:
        time.sleep(5.5)  # the bound the engine's sends had
        got.extend(m.deltas[0].request_id for m in ch.recv_all())

    reader = threading.Thread(target=stalled_reader)
    reader.start()
    ch.send(StepDeltas([TokenDelta("y", list(range(20)), None)]))
    reader.join()
    assert got == ["x"] and [m.deltas[0].request_id for m in ch.recv_all()] == ["y"]


def test_doorbell_coalesces_and_never_blocks():
    bell = Doorbell.create()
    peer = Doorbell.attach(bell.path)
    try:
        assert not peer.wait(0.01)
        for _ in range(70_000):  # more than a pipe buffer: the ringer must not block
            bell.ring()
        assert peer.wait(1.0)  # one wake-up for all of them
        assert not peer.wait(0.01) and not peer.drain()
        bell.ring()
        assert peer.drain() and not peer.drain()
    finally:
        peer.close()
        bell.close()
        bell.unlink()
    assert not os.path.exists(os.path.dirname(bell.path))


def test_held_bell_rings_once_after_the_frames(channels):
    ch = channels(FromEngine)
    consumer = Channel.attach(ch.handle(), FromEngine)
    try:
        with ch.held_bell():
            with ch.held_bell():  # nested: the outermost block rings
                ch.send(Heartbeat())
            ch.send(RequestError("r1", "boom"))
            assert not consumer.doorbell.drain()  # frames written, nobody woken yet
        assert os.read(consumer.doorbell.fileno(), 16) == b"\1"  # one ring for both frames
        assert [type(m) for m in consumer.recv_all()] == [Heartbeat, RequestError]
        with pytest.raises(RuntimeError), ch.held_bell():  # a block that raises still rings
            ch.send(Heartbeat())
            raise RuntimeError
        assert consumer.wait(1.0) and [type(m) for m in consumer.recv_all()] == [Heartbeat]
        ch.send(Heartbeat())  # outside a block: a ring per frame again
        assert consumer.doorbell.drain()
    finally:
        consumer.ring.close()
        consumer.doorbell.close()


def test_async_recv_wakes_on_send(channels):
    inbox = channels(FromEngine)
    sender = Channel.attach(inbox.handle(), FromEngine)

    async def main():
        task = asyncio.create_task(inbox.recv_async())
        await asyncio.sleep(0.05)
        assert not task.done()  # parked on the doorbell fd, not spinning
        threading.Timer(0.05, lambda: sender.send(StepDeltas([TokenDelta("r", [42], "length")]))).start()
        first = await asyncio.wait_for(task, timeout=2.0)
        sender.send(RequestError("s", "bad", None))
        second = await asyncio.wait_for(inbox.recv_async(), timeout=2.0)  # already there: no waiting
        return first, second

    try:
        first, second = asyncio.run(main())
    finally:
        sender.close()
    assert first == [StepDeltas([TokenDelta("r", [42], "length")])] and second == [RequestError("s", "bad", None)]


def test_close_unlink_removes_segment_and_fifo():
    ch = Channel.create(ToEngine, capacity=1024)
    handle = ch.handle()
    assert isinstance(handle, ChannelHandle) and os.path.exists(f"/dev/shm/{handle.shm_name}")
    peer = Channel.attach(handle, ToEngine)
    peer.close()
    with pytest.raises(RuntimeError, match="only the creator"):
        peer.ring.unlink()
    ch.close()
    ch.unlink()
    assert not os.path.exists(f"/dev/shm/{handle.shm_name}")
    assert not os.path.exists(handle.doorbell_path)
    with pytest.raises(FileNotFoundError):
        ShmRing.attach(handle.shm_name)


def test_attach_rejects_foreign_segment():
    shm = SharedMemory(create=True, size=4096)
    try:
        with pytest.raises(ValueError, match="not an Orcinus ring"):
            ShmRing.attach(shm.name)
    finally:
        shm.close()
        shm.unlink()


# Run as its own process so the resource_tracker (which prints "leaked shared_memory" warnings when
# its owner exits) writes into a stderr we capture. It imports this checkout's engine: CHECKOUT puts it first.
_ECHO_SCRIPT = """
import json, multiprocessing, os, time
from engine.ipc.channel import *
from engine.ipc.messages import *
from engine.core.sampling_params import SamplingParams


def echo_worker(handle_in, handle_out):
    inbox, outbox = Channel.attach(handle_in, ToEngine), Channel.attach(handle_out, FromEngine)
    waits = 0
    try:
        while True:
            msgs = inbox.recv_all()
            if not msgs:
                waits += 1
                if not inbox.wait(timeout=10):
                    raise SystemExit("echo worker: nothing arrived for 10 s")
                continue
            for m in msgs:
                if isinstance(m, Shutdown):
                    outbox.send(EngineStats(0, 0, 0, 0, num_iterations=waits, last_batch_size=0))
                    return
                outbox.send(StepDeltas([TokenDelta(m.request.request_id, m.request.prompt_token_ids, None)]))
    finally:
        inbox.close()
        outbox.close()


def cpu_ticks(pid):
    fields = open(f"/proc/{{pid}}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


if __name__ == "__main__":
    N = 200
    to_engine = Channel.create(ToEngine, capacity=4096)
    # Small input ring: sends find it full and retry. The output ring holds every echo, since this
    # parent only reads after sending a batch (a real gateway drains outputs concurrently).
    from_engine = Channel.create(FromEngine, capacity=1 << 20)
    child = multiprocessing.get_context("spawn").Process(
        target=echo_worker, args=(to_engine.handle(), from_engine.handle()), daemon=True
    )
    child.start()
    got = []

    def collect(k):
        deadline = time.monotonic() + 10
        while len(got) < k:
            msgs = from_engine.recv_all()
            got.extend(msgs)
            if not msgs and not from_engine.wait(max(0.0, deadline - time.monotonic())):
                raise SystemExit(f"parent: only {{len(got)}}/{{k}} echoes after 10 s")

    sent = [AddRequest(EngineRequest(f"r{{i}}", list(range(i % 150)), SamplingParams(seed=i))) for i in range(N)]
    for m in sent[: N // 2]:
        to_engine.send(m)
    collect(N // 2)
    time.sleep(0.05)
    ticks = cpu_ticks(child.pid)
    time.sleep(0.4)  # the child is idle now: it must sleep in the doorbell, not spin
    idle_ticks = cpu_ticks(child.pid) - ticks
    for m in sent[N // 2 :] + [Shutdown()]:
        to_engine.send(m)
    collect(N + 1)
    child.join(10)
    exitcode = child.exitcode
    names = [to_engine.handle(), from_engine.handle()]
    for ch in (to_engine, from_engine):
        ch.close()
        ch.unlink()
    ok = [(s.deltas[0].request_id, s.deltas[0].token_ids) for s in got[:N]] == [(m.request.request_id, m.request.prompt_token_ids)
                                                            for m in sent]
    print(json.dumps(dict(
        exitcode=exitcode, in_order=ok, last=type(got[-1]).__name__, waits=got[-1].num_iterations,
        idle_ticks=idle_ticks, tick_hz=os.sysconf("SC_CLK_TCK"),
        left=[os.path.exists("/dev/shm/" + h.shm_name) or os.path.exists(h.doorbell_path) for h in names],
    )))
"""


def test_cross_process_echo_spawn_no_leak_warning(tmp_path):
    script = tmp_path / "echo_channel.py"
    script.write_text(_ECHO_SCRIPT.format())
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=CHECKOUT
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["exitcode"] == 0 and result["in_order"] and result["last"] == "EngineStats"
    assert result["left"] == [False, False]  # segments and FIFOs removed
    assert result["idle_ticks"] <= result["tick_hz"] * 0.1  # < 0.1 s CPU over 0.4 s idle: not spinning
    assert result["waits"] <= 2 * 200 + 50  # woken by rings, not looping
    for bad in ("leaked", "resource_tracker", "Traceback", "Warning"):
        assert bad not in proc.stderr, proc.stderr


def test_unrelated_attacher_process_neither_unlinks_nor_warns(channels):
    """A process with its own resource_tracker (not our child) attaches, reads and exits."""
    ch = channels(ToEngine, capacity=4096)
    ch.send(Abort("r9"))
    h = ch.handle()
    code = (
        "from engine.ipc.channel import Channel, ChannelHandle\nfrom engine.ipc.messages import ToEngine\n"
        f"c = Channel.attach(ChannelHandle({h.shm_name!r}, {h.doorbell_path!r}), ToEngine)\n"
        "print(c.recv_all()[0].request_id)\n"
        "c.close()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, env=CHECKOUT)
    assert proc.returncode == 0 and proc.stdout.strip() == "r9", proc.stderr
    assert proc.stderr == ""
    assert os.path.exists(f"/dev/shm/{h.shm_name}")  # its exit did not unlink our segment
    ch.send(Abort("r10"))  # and the ring still works
    peer = Channel.attach(h, ToEngine)
    try:
        assert peer.recv_all() == [Abort("r10")]
    finally:
        peer.close()


def test_shared_memory_pages_count_in_rss_but_not_in_private_memory():
    """Why a soak's RSS climbs by up to the rings' size and then flattens: a ring page joins a process's RSS the
    first time it is touched. engine/ipc/memory.py reports RSS without those pages."""
    from multiprocessing.shared_memory import SharedMemory

    from engine.ipc.memory import this_process

    before = this_process()
    shm = SharedMemory(create=True, size=8 << 20)
    try:
        shm.buf[:] = b"\1" * len(shm.buf)  # touch every page, as a stream passing once through a ring does
        after = this_process()
        assert after.shared_bytes - before.shared_bytes >= 8 << 20
        # The ring's pages are not private: private memory grows by the bytes object above at most. It may shrink
        # (another thread frees memory, or the kernel reclaims pages between the two reads: -118 MB was seen once).
        assert after.private_bytes - before.private_bytes < 4 << 20
    finally:
        shm.close()
        shm.unlink()


def test_a_step_finishing_many_wide_embeddings_is_split_over_frames_the_ring_holds():
    """Embedding requests all finish in the step that ran their prompts, each with a vector as wide as the model's
    hidden size: the step's deltas must go in frames the ring can hold (one frame of them all exceeded it, and the
    ValueError took the engine process down), and the gateway still gets every vector."""
    from engine.core.config import FaultPlan
    from engine.core.request import Request, RequestStatus
    from engine.ipc.engine_loop import EngineLoop

    width, count = 4096, 128  # an 8B model's hidden size; a step of --max-num-seqs 128 embedding inputs
    outbox = Channel.create(FromEngine)  # the size the gateway creates
    try:

        class Loop:  # what publish_deltas reads of its EngineLoop
            faults = FaultPlan()
            generation_tokens_total = 0
            delta = EngineLoop.delta

        loop = Loop()
        loop.outbox = outbox
        params = SamplingParams(max_tokens=1, prompt_only=True, pooling="mean")
        updated = []
        for i in range(count):
            r = Request(f"e{i}", [1, 2, 3], params, status=RequestStatus.FINISHED_LENGTH)
            r.output_token_ids, r.embedding = [0], [i + j / width for j in range(width)]
            updated.append(r)
        got: dict[str, list[float]] = {}
        done = threading.Event()

        def gateway():
            while len(got) < count and not done.is_set():
                outbox.wait(0.05)
                for frame in outbox.recv_all():
                    got.update((d.request_id, d.embedding) for d in frame.deltas)

        reader = threading.Thread(target=gateway)
        reader.start()
        try:
            EngineLoop.publish_deltas(loop, updated)
        finally:
            reader.join(timeout=30)
            done.set()
        assert sorted(got) == sorted(r.request_id for r in updated)
        assert all(got[r.request_id] == r.embedding for r in updated)
    finally:
        outbox.close()
        outbox.unlink()
