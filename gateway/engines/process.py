"""One engine process and the two shared-memory channels the gateway created for it.

Each start gets fresh channels; when the process is gone the gateway unlinks them, so neither a
crash nor a restart leaves segments in /dev/shm (the engine only attaches, it never unlinks).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import Callable

import msgspec

from engine.core.config import EngineConfig
from engine.ipc.channel import Channel
from engine.ipc.engine_loop import EngineLoopArgs
from engine.ipc.messages import FromEngine, Shutdown, ToEngine

log = logging.getLogger("orcinus.engine_process")


def engine_env() -> dict[str, str]:
    """The engine's environment: OpenMP threads spin about a millisecond before they sleep (unless the user
    sets OMP_WAIT_POLICY or GOMP_SPINCOUNT).

    libgomp's default spin after every parallel region holds cores the gateway and the clients need between
    iterations; a passive policy sleeps at once, but then each of a step's many small ops pays a wake-up. A
    100k count keeps the threads awake across the gaps inside a step and bounds the spin between steps.
    """
    env = dict(os.environ)
    if "OMP_WAIT_POLICY" not in env:
        env.setdefault("GOMP_SPINCOUNT", "100000")
    return env


class EngineProcess:
    """Spawn with `launch()` (no event loop needed, so a server can start its engines before it imports the app) and
    `start()` (which launches too, if not yet); frames from the engine go to `on_frame`; `close()` frees everything."""

    def __init__(
        self,
        config: EngineConfig,
        on_frame: Callable[[object], None],
        cache_events: bool = False,
        devices: str | None = None,
    ):
        self.config = config
        self.on_frame = on_frame
        self.cache_events = cache_events  # the engine reports the blocks it caches and evicts
        self.devices = devices  # CUDA_VISIBLE_DEVICES for it (a data-parallel replica's GPUs); None: inherited
        self.proc: subprocess.Popen | None = None
        self.to_engine: Channel | None = None
        self.from_engine: Channel | None = None
        self._reader: asyncio.Task | None = None
        self._exited: asyncio.Future | None = None  # resolved with the exit code, through a pidfd
        self._pidfd: int | None = None
        self._closed = False

    def launch(self) -> None:
        """Create the channels and spawn the engine process."""
        self.to_engine = Channel.create(ToEngine)
        self.from_engine = Channel.create(FromEngine)
        args = EngineLoopArgs(
            self.config, self.to_engine.handle(), self.from_engine.handle(), self.cache_events, os.getpid()
        )
        env = engine_env()
        if self.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.devices
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "engine.ipc.engine_loop", msgspec.json.encode(args).decode()], env=env
            )
        except BaseException:
            self.discard()
            raise

    async def start(self) -> None:
        """Launch (unless launched already), then watch for the process's exit and read its frames."""
        if self.proc is None:
            self.launch()
        loop = asyncio.get_running_loop()
        self._exited = loop.create_future()
        # A pidfd turns readable when the process exits: the loop learns of it with no thread and no SIGCHLD handler.
        self._pidfd = os.pidfd_open(self.proc.pid)
        loop.add_reader(self._pidfd, self._on_exit)
        self._reader = asyncio.create_task(self._read_loop())

    def _on_exit(self) -> None:
        self._close_pidfd()
        code = self.proc.wait()  # already exited: reaps it at once
        if not self._exited.done():
            self._exited.set_result(code)

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None

    def discard(self) -> None:
        """For an engine launched but never started: kill it, reap it, free its channels (no event loop needed)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._closed = True
        self._free_channels()

    def _free_channels(self) -> None:
        for ch in (self.to_engine, self.from_engine):
            if ch is not None:
                ch.close()
                ch.unlink()

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None and not self._closed

    @property
    def unread(self) -> bool:
        """Frames it sent wait in the ring, not yet read: it answers, however long the gateway took to look."""
        return not self._closed and self.from_engine is not None and self.from_engine.ring.used > 0

    def try_send(self, msg: object) -> bool:
        """Send without waiting; False when the ring is full now. Raises if the process is gone."""
        if not self.alive:
            raise ProcessLookupError("the engine process is not running")
        return self.to_engine.try_send(msg)

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)  # shielded: a waiter cancelled must not cancel the others' wait

    async def stop(self, timeout: float) -> None:
        """Ask the engine to exit, kill it after `timeout` seconds, then close."""
        if self.alive:
            self.to_engine.try_send(Shutdown())
            try:
                await asyncio.wait_for(self.wait(), timeout)
            except TimeoutError:
                log.warning("the engine did not exit within %.0fs of Shutdown; killing it", timeout)
                self.kill()
                await self.wait()
        await self.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()

    def _unlink_names(self) -> None:
        """The engine attaches both channels before it sends anything, so after its first frame their names can go:
        the mappings and FIFOs stay open in both processes, and a gateway killed by SIGKILL leaves nothing behind."""
        for ch in (self.to_engine, self.from_engine):
            ch.unlink()

    async def close(self) -> None:
        """Stop reading, then close and unlink both channels (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._exited is not None and not self._exited.done():
            self._close_pidfd()  # nobody waits any more; the process, if still there, is reaped by Popen's finalizer
        if self._reader is not None:
            # The reader must unregister its fd from the event loop before the fd is closed, or a
            # later fd with the same number would inherit a stale selector entry.
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self._free_channels()

    async def _read_loop(self) -> None:
        try:
            frames = []
            while not frames:
                frames = await self.from_engine.recv_async()
            self._unlink_names()
            while True:
                for msg in frames:
                    self.on_frame(msg)
                frames = await self.from_engine.recv_async()
        except Exception:
            # A frame we cannot read means the stream is lost; a fresh engine is the only way back.
            log.exception("reading from the engine failed; killing it")
            self.kill()
