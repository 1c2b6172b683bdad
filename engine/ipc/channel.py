"""Gateway <-> engine messaging over shared memory: SPSC byte rings, a doorbell, msgspec frames.

One `Channel` is one direction: a `ShmRing` (the bytes), a `Doorbell` (the wake-up) and a msgpack
encoder/decoder for a tagged union of Structs. The gateway sends `ToEngine` messages on one channel
and receives `FromEngine` messages on another.

Ring segment layout (POSIX shared memory, every header field a little-endian uint64):

    offset   0  magic      b"ORCRING\\0" read as uint64; written last by the creator
    offset   8  version    RING_VERSION (attach refuses another version)
    offset  16  capacity   size of the data area in bytes
    offset  64  head       bytes ever written; only the producer stores it (own cache line)
    offset 128  tail       bytes ever read; only the consumer stores it (own cache line)
    offset 192  data       `capacity` bytes

head and tail only grow (2**64 bytes never wrap); used = head - tail, free = capacity - used, and a
byte at stream position p lives at data[p % capacity]. A frame is a 4-byte little-endian length then
the payload. Frames are contiguous in the byte stream, so a frame (its length field included) may be
split across the end of the data area: the writer and the reader copy in two pieces there; no
padding marker. A frame of 4 + len(payload) > capacity bytes can never fit: ValueError.

Memory ordering: the producer copies the whole frame into the data area, then publishes it with one
aligned 8-byte store to head; the consumer copies the frames out, then frees them with one aligned
8-byte store to tail. Aligned 8-byte loads and stores are single-copy atomic on x86-64 and AArch64,
so an index is never torn. x86-64 (TSO) keeps the producer's stores in program order, so a consumer
that sees the new head sees the payload. CPython has no portable fence; on weakly ordered CPUs
(AArch64) we rely on the hundreds of interpreter instructions between the copy and the publish, and
the consumer checks every length against head - tail and raises on an impossible one rather than
returning garbage. Each ring has one producer and one consumer; neither side locks.

Why no pickle: frames cross a process boundary, and unpickling runs arbitrary code and is slow;
msgspec msgpack Structs (tag=True, array_like=True) are typed, validated on decode, compact and
several times faster, and the tag lets several message kinds share one ring.

Doorbell: a named FIFO (mkfifo in a private mkdtemp directory). Its path is plain data, so a child
started with the multiprocessing "spawn" context (which closes every fd it is not told about) or any
unrelated process can open it; raw pipe/eventfd fds would need multiprocessing's fd passing. Each
side opens it O_RDWR | O_NONBLOCK (Linux), so opening never blocks and `ring()` never blocks: when the
pipe buffer is full the bell is already rung and the EAGAIN is ignored. Every ring before a wait is
one wake-up: `wait()` drains all the bytes. The fd works with select/poll/epoll, so asyncio can
`loop.add_reader(bell.fileno(), ...)`. No busy-waiting: an idle consumer sleeps in poll(2).
Lost-wake-up rule for consumers: drain the bell, then read the ring, then wait (`wait()` and
`recv_async()` do this); a producer writes the ring, then rings.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import secrets
import select
import shutil
import stat
import struct
import sys
import tempfile
import threading
import time
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any, Self

import msgspec

assert sys.byteorder == "little", "the ring header is little-endian uint64"

RING_MAGIC = int.from_bytes(b"ORCRING\0", "little")
RING_VERSION = 1
HEADER_SIZE = 192
_MAGIC, _VERSION, _CAPACITY, _HEAD, _TAIL = 0, 1, 2, 8, 16  # uint64 indices (byte offset / 8)
_LEN = struct.Struct("<I")
_TRACKER_LOCK = threading.Lock()


# ----------------------------------------------------------------------------- ring
def _open_untracked(name: str) -> SharedMemory:
    """Attach without registering with resource_tracker (which would unlink or warn at our exit)."""
    if sys.version_info >= (3, 13):
        return SharedMemory(name=name, track=False)
    # Python < 3.13 registers every attach. Unregistering afterwards is wrong for a spawned child:
    # it shares its parent's tracker and would drop the creator's registration too.
    with _TRACKER_LOCK:
        register = resource_tracker.register

        def skip_ours(n: str, rtype: str) -> None:
            if (rtype, n.lstrip("/")) != ("shared_memory", name.lstrip("/")):
                register(n, rtype)

        resource_tracker.register = skip_ours
        try:
            return SharedMemory(name=name)
        finally:
            resource_tracker.register = register


class ShmRing:
    """Single-producer single-consumer ring of length-prefixed frames in a SharedMemory segment."""

    def __init__(self, shm: SharedMemory, owner: bool):
        self._shm, self.owner, self.name = shm, owner, shm.name
        self._closed = self._unlinked = False
        self._hdr = shm.buf[:HEADER_SIZE].cast("Q")
        self.capacity = self._hdr[_CAPACITY]
        self._data = shm.buf[HEADER_SIZE : HEADER_SIZE + self.capacity]

    @classmethod
    def create(cls, name: str | None = None, capacity: int = 1 << 22) -> ShmRing:
        if capacity < 8:
            raise ValueError(f"ring capacity must be at least 8 bytes, got {capacity}")
        name = name or f"orcinus_{os.getpid()}_{secrets.token_hex(4)}"
        shm = SharedMemory(name=name, create=True, size=HEADER_SIZE + capacity)  # zero-filled
        hdr = shm.buf[:HEADER_SIZE].cast("Q")
        hdr[_VERSION], hdr[_CAPACITY], hdr[_HEAD], hdr[_TAIL] = RING_VERSION, capacity, 0, 0
        hdr[_MAGIC] = RING_MAGIC  # last: an attacher never sees a half-written header
        hdr.release()
        return cls(shm, owner=True)

    @classmethod
    def attach(cls, name: str) -> ShmRing:
        shm = _open_untracked(name)
        hdr = shm.buf[:HEADER_SIZE].cast("Q") if shm.size >= HEADER_SIZE else None
        ok = hdr is not None and hdr[_MAGIC] == RING_MAGIC and hdr[_VERSION] == RING_VERSION
        ok = ok and shm.size >= HEADER_SIZE + hdr[_CAPACITY]
        if hdr is not None:
            hdr.release()
        if not ok:
            shm.close()
            raise ValueError(f"shared memory {name!r} is not an Orcinus ring of version {RING_VERSION}")
        return cls(shm, owner=False)

    @property
    def used(self) -> int:
        return self._hdr[_HEAD] - self._hdr[_TAIL]

    def try_write(self, payload: bytes) -> bool:
        """Append one frame; False if there is not room for it now (the caller retries)."""
        n = len(payload)
        if n + 4 > self.capacity:
            raise ValueError(f"frame of {n} bytes (+4 length) exceeds ring {self.name!r} capacity {self.capacity}")
        head = self._hdr[_HEAD]
        if self.capacity - (head - self._hdr[_TAIL]) < n + 4:
            return False
        self._put(head, _LEN.pack(n))
        self._put(head + 4, payload)
        self._hdr[_HEAD] = head + 4 + n  # publish after the payload is in place
        return True

    def read_all(self) -> list[bytes]:
        """Drain every complete frame, oldest first."""
        tail, head = self._hdr[_TAIL], self._hdr[_HEAD]
        if not 0 <= head - tail <= self.capacity:
            raise RuntimeError(f"ring {self.name!r} corrupt: head={head} tail={tail}")
        frames = []
        while tail != head:
            (n,) = _LEN.unpack(self._get(tail, 4)) if head - tail >= 4 else (1 << 32,)
            if n + 4 > head - tail:
                raise RuntimeError(f"ring {self.name!r} corrupt: frame of {n} bytes, {head - tail} published")
            frames.append(self._get(tail + 4, n))
            tail += 4 + n
        self._hdr[_TAIL] = tail  # free the space only after copying out
        return frames

    def _put(self, pos: int, data: bytes) -> None:
        src, off = memoryview(data), pos % self.capacity
        first = min(len(src), self.capacity - off)
        self._data[off : off + first] = src[:first]
        if first < len(src):
            self._data[: len(src) - first] = src[first:]

    def _get(self, pos: int, n: int) -> bytes:
        off = pos % self.capacity
        if off + n <= self.capacity:
            return bytes(self._data[off : off + n])
        return bytes(self._data[off:]) + bytes(self._data[: off + n - self.capacity])

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._hdr.release()
            self._data.release()
            self._shm.close()

    def unlink(self) -> None:
        """Remove the segment name (creator only, also unregisters it from resource_tracker)."""
        if not self.owner:
            raise RuntimeError(f"only the creator of ring {self.name!r} unlinks it")
        if not self._unlinked:
            self._unlinked = True
            self._shm.unlink()


# ----------------------------------------------------------------------------- doorbell
class Doorbell:
    """Coalescing cross-process wake-up on a named FIFO (see the module docstring)."""

    def __init__(self, path: str, owner: bool):
        self.path, self.owner = path, owner
        if not stat.S_ISFIFO(os.stat(path).st_mode):
            raise ValueError(f"doorbell {path!r} is not a FIFO")
        self._fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        self._poll = select.poll()
        self._poll.register(self._fd, select.POLLIN)

    @classmethod
    def create(cls) -> Doorbell:
        path = os.path.join(tempfile.mkdtemp(prefix="orcinus-bell-"), "bell")
        os.mkfifo(path, 0o600)
        return cls(path, owner=True)

    @classmethod
    def attach(cls, path: str) -> Doorbell:
        return cls(path, owner=False)

    def fileno(self) -> int:
        return self._fd

    def ring(self) -> None:
        try:
            os.write(self._fd, b"\1")
        except BlockingIOError:
            pass  # the pipe is full, so the bell is already rung

    def drain(self) -> bool:
        """Clear the bell; True if it was rung."""
        rung = False
        try:
            while os.read(self._fd, 65536):
                rung = True
        except BlockingIOError:
            pass
        return rung

    def wait(self, timeout: float | None = None) -> bool:
        """Block until rung (then clear it) or timeout seconds pass; True if rung."""
        ms = None if timeout is None else max(0, math.ceil(timeout * 1000))
        if not self._poll.poll(ms):
            return False
        self.drain()
        return True

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def unlink(self) -> None:
        if self.owner:
            shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)


# ----------------------------------------------------------------------------- channel
class ChannelFullError(TimeoutError):
    """The consumer did not free room for a frame in time; the message was not sent."""


class ChannelHandle(msgspec.Struct, frozen=True):
    """Plain data naming one channel, to pass to another process (args of a spawned Process, JSON...)."""

    shm_name: str
    doorbell_path: str


class Channel:
    """One direction: ring + doorbell + msgspec codec for `msg_type` (a Struct or tagged union)."""

    def __init__(self, ring: ShmRing, bell: Doorbell, msg_type: Any):
        self.ring, self.doorbell, self.msg_type = ring, bell, msg_type
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(msg_type)
        self._send_lock = threading.Lock()
        self._held = 0  # inside held_bell(): sends defer their ring to its end

    @classmethod
    def create(cls, msg_type: Any, capacity: int = 1 << 22, name: str | None = None) -> Channel:
        ring = ShmRing.create(name, capacity)
        try:
            return cls(ring, Doorbell.create(), msg_type)
        except BaseException:
            ring.close()
            ring.unlink()
            raise

    @classmethod
    def attach(cls, handle: ChannelHandle, msg_type: Any) -> Channel:
        ring = ShmRing.attach(handle.shm_name)
        try:
            return cls(ring, Doorbell.attach(handle.doorbell_path), msg_type)
        except BaseException:
            ring.close()
            raise

    def handle(self) -> ChannelHandle:
        return ChannelHandle(self.ring.name, self.doorbell.path)

    def fileno(self) -> int:
        return self.doorbell.fileno()

    def try_send(self, msg: Any) -> bool:
        """Send without waiting (for an event loop); False if the ring has no room now."""
        with self._send_lock:
            if not self.ring.try_write(self._encoder.encode(msg)):
                return False
        self._ring()
        return True

    @contextlib.contextmanager
    def held_bell(self):
        """Messages sent inside ring the doorbell once, as the block ends: one wake-up of the consumer for all of them
        (each wakes it, and on a busy machine it then takes a core from the producer). One thread's blocks: sends
        from other threads meanwhile ring at its end too."""
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
            if not self._held:
                self.doorbell.ring()  # unconditionally: a consumer asleep since before the block sees every frame

    def _ring(self) -> None:
        if not self._held:
            self.doorbell.ring()

    def send(self, msg: Any, timeout: float | None = None) -> None:
        """Send, sleeping briefly while the ring is full; ChannelFullError after `timeout` seconds (None: for as long
        as it stays full, as the engine does: a gateway stalled a while loses nothing, and one that died ends the
        engine through its orphan watch)."""
        payload = self._encoder.encode(msg)
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        with self._send_lock:
            while not self.ring.try_write(payload):
                self.doorbell.ring()  # make sure the consumer is awake to make room
                if time.monotonic() >= deadline:
                    raise ChannelFullError(
                        f"channel {self.ring.name!r} stayed full for {timeout}s "
                        f"({self.ring.used}/{self.ring.capacity} bytes used); {type(msg).__name__} not sent"
                    )
                time.sleep(0.0005)
        self._ring()

    def recv_all(self) -> list:
        return [self._decoder.decode(frame) for frame in self.ring.read_all()]

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the producer rings (see the lost-wake-up rule); True if rung."""
        return self.doorbell.wait(timeout)

    async def recv_async(self) -> list:
        """Await at least one message without blocking the event loop (uses loop.add_reader)."""
        loop = asyncio.get_running_loop()
        while True:
            self.doorbell.drain()
            msgs = self.recv_all()
            if msgs:
                return msgs
            ready = loop.create_future()
            loop.add_reader(self.fileno(), lambda fut=ready: fut.done() or fut.set_result(None))
            try:
                await ready
            finally:
                loop.remove_reader(self.fileno())

    def close(self) -> None:
        self.ring.close()
        self.doorbell.close()

    def unlink(self) -> None:
        """Remove the segment and the FIFO (creator only); attachers just close()."""
        try:
            self.ring.unlink()
        finally:
            self.doorbell.unlink()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if self.ring.owner:
            self.unlink()
