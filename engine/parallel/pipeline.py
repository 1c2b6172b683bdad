"""The distributed driver: sends each batch to a grid of stage processes and keeps up to N batches in flight.

Orca's distributed execution: the layers are split into N pipeline stages (inter-layer), and each stage's
layers over T tensor-parallel ranks (intra-layer; stage.py). The scheduler hands batches to the first
stage while the later ones still work on earlier batches, and the last stage returns the sampled ids.
The driver is rank 0 and holds no layers. By default it launches the N x T ranks here; with
`external_stages` they are started elsewhere (other hosts) and all ranks meet through MASTER_ADDR / MASTER_PORT.
"""

from __future__ import annotations

import atexit
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections import deque

import torch
import torch.distributed as dist

from engine.core.batch import Batch
from engine.core.config import EngineConfig, ModelShape
from engine.core.executor import PromptLogprobs, Sampled
from engine.core.request import Request
from engine.model.lora import LoraAdapter, read_adapter
from engine.model.lora_shards import adapter_bytes, adapter_part, check_adapter
from engine.model.sharding import TensorShard
from engine.parallel.frames import (
    PendingSends,
    SamplingStart,
    StageBatch,
    StageLora,
    StageReady,
    StageResult,
    StageSetup,
    StageShutdown,
    recv_frame,
    send_frame,
)
from engine.parallel.stage import make_groups, rank_of, stage_span
from engine.parallel.world import Place, driver_place, join


class StageFailedError(RuntimeError):
    """A pipeline stage died or its connection broke; in-flight batches are lost."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PipelineExecutor:
    """Rank 0 of the stage grid: submit batches in order, collect sampled ids in the same order."""

    def __init__(self, config: EngineConfig, max_model_len: int, shape: ModelShape):
        self.shape, self.max_lora_rank = shape, config.max_lora_rank
        self.adapters: dict[str, LoraAdapter] = {}  # LoRA adapters on the host, by name; the ranks get slot loads
        self.num_stages = config.pipeline_stages
        self.tp_size = config.tensor_parallel_size
        self.max_in_flight = self.num_stages
        world = self.num_stages * self.tp_size + 1
        self.procs: list[subprocess.Popen] = []
        self.closing = False
        self.failed = False  # a stage died: the rest are killed, not asked to stop
        if config.external_stages:
            place = driver_place(world)  # the stage ranks reach this process at MASTER_ADDR:MASTER_PORT
        else:
            place = Place(0, world, "127.0.0.1", _free_port())
            config = config.with_(num_threads=config.num_threads or self._threads_per_stage(config))
            self.procs = [self._launch(rank, world, place.port) for rank in range(1, world)]
        try:
            join(place, self._check_launched)
        except BaseException:
            for proc in self.procs:  # the ranks that came wait for the one that never will
                proc.kill()
                proc.wait()
            raise
        # An LLM dropped without close() still stops its ranks at exit: torn down with the interpreter instead, the
        # process group aborted the process ("terminate called without an active exception") under a blocked receive.
        atexit.register(self.close)
        self.ranks = range(1, world)
        self.last_rank = rank_of(self.num_stages - 1, 0, self.tp_size)  # it samples
        self.pending = PendingSends()
        for stage in range(self.num_stages):
            for tp_rank in range(self.tp_size):
                setup = StageSetup(config, stage, self.num_stages, max_model_len, tp_rank, self.tp_size)
                send_frame(setup, rank_of(stage, tp_rank, self.tp_size), self.pending)
        # The stages create them too: group creation is collective.
        make_groups(torch.device(config.device), self.num_stages, self.tp_size)
        ready = [recv_frame(rank) for rank in self.ranks]
        assert all(isinstance(r, StageReady) for r in ready)
        self.num_blocks = min(r.num_blocks for r in ready)

        self.in_flight: deque[tuple[int, Batch, list[str]]] = deque()
        self.results: queue.Queue[StageResult | BaseException] = queue.Queue()
        self.known: set[str] = set()  # requests the last stage keeps sampling state for
        self.released: list[str] = []
        self.next_batch_id = 0
        self.receiver = threading.Thread(target=self._receive_results, daemon=True)
        self.receiver.start()
        for rank, proc in enumerate(self.procs, start=1):
            threading.Thread(target=self._watch, args=(rank, proc), daemon=True).start()

    @staticmethod
    def _threads_per_stage(config: EngineConfig) -> int:
        # Ranks share this host's cores; more threads than cores makes every rank stall.
        ranks = config.pipeline_stages * config.tensor_parallel_size
        return max(1, (os.cpu_count() or 1) // ranks) if config.device == "cpu" else 1

    def _launch(self, rank: int, world: int, port: int) -> subprocess.Popen:
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        return subprocess.Popen(
            [sys.executable, "-m", "engine.parallel.stage", "--parent-pid", str(os.getpid())], env=env
        )

    def _check_launched(self) -> None:
        """Called while the rendezvous waits: a rank launched here that has exited will never come."""
        for rank, proc in enumerate(self.procs, start=1):
            if proc.poll() is not None:
                where = f"{self._where(rank)} (pid {proc.pid})"
                raise StageFailedError(f"{where} exited with code {proc.returncode} before it joined")

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        proc.wait()
        if not self.closing:
            self.failed = True
            self.results.put(StageFailedError(self._who_died()))

    def _who_died(self, grace: float = 1.0) -> str | None:
        """Which local stage exited first (a dead stage's peers fail right after it; give its exit a moment to show)."""
        deadline = time.monotonic() + grace
        while True:
            for rank, proc in enumerate(self.procs, start=1):
                if proc.poll() is not None:
                    return f"{self._where(rank)} (pid {proc.pid}) exited with code {proc.returncode}"
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    def _where(self, rank: int) -> str:
        stage, tp_rank = divmod(rank - 1, self.tp_size)
        return f"pipeline stage {stage}" + (f" tensor-parallel rank {tp_rank}" if self.tp_size > 1 else "")

    def _receive_results(self) -> None:
        try:
            while True:
                self.results.put(recv_frame(self.last_rank))
        except BaseException as e:
            if not self.closing:
                self.failed = True
                self.results.put(StageFailedError(self._who_died() or f"lost the last pipeline stage: {e}"))

    @property
    def num_in_flight(self) -> int:
        return len(self.in_flight)

    def submit(self, batch: Batch, sampling: list[Request]) -> None:
        new = [
            SamplingStart(r.request_id, r.prompt_token_ids, r.params, sorted(r.stop_token_ids))
            for r in sampling
            if r.request_id not in self.known
        ]
        self.known.update(s.request_id for s in new)
        # Only the sampling rank keeps per-request state; the others get the batch alone.
        sampler_frame = StageBatch(self.next_batch_id, batch, new, self.released)
        frame = StageBatch(self.next_batch_id, batch, [], []) if new or self.released else sampler_frame
        self.released = []
        try:
            for rank in self.ranks:
                send_frame(sampler_frame if rank == self.last_rank else frame, rank, self.pending)
        except RuntimeError as e:  # gloo: the peer's connection is gone
            self.failed = True
            raise StageFailedError(f"cannot reach {self._where(rank)}: {e}") from e
        self.in_flight.append((self.next_batch_id, batch, [r.request_id for r in sampling]))
        self.next_batch_id += 1

    def collect(self) -> tuple[Batch, Sampled, PromptLogprobs]:
        result = self.results.get()
        if isinstance(result, BaseException):
            raise result
        batch_id, batch, sampling_ids = self.in_flight.popleft()
        if not isinstance(result, StageResult) or result.batch_id != batch_id:
            raise StageFailedError(f"pipeline out of order: expected batch {batch_id}, got {result!r}")
        sampled: Sampled = dict(zip(sampling_ids, result.sampled))
        return batch, sampled, result.prompt_logprobs

    def release(self, request_ids: list[str]) -> None:
        gone = [r for r in request_ids if r in self.known]
        self.known.difference_update(gone)
        self.released += gone

    def add_lora(self, name: str, path: str) -> None:
        adapter = read_adapter(path, self.shape.num_layers, self.max_lora_rank)
        check_adapter(adapter, self.shape)
        self.adapters[name] = adapter

    def load_lora(self, slot: int, name: str) -> None:
        """Each rank gets its layers' and its shard's part; frames to a rank keep their order, so every batch
        submitted after this one runs under the new weights, and every one before under the old."""
        adapter = self.adapters[name]
        try:
            for stage in range(self.num_stages):
                span = stage_span(self.shape.num_layers, stage, self.num_stages)
                for tp_rank in range(self.tp_size):
                    part = adapter_part(adapter, span, TensorShard(tp_rank, self.tp_size))
                    frame = StageLora(slot, adapter.rank, adapter.scale, adapter_bytes(part))
                    send_frame(frame, rank_of(stage, tp_rank, self.tp_size), self.pending)
        except RuntimeError as e:  # gloo: the peer's connection is gone
            self.failed = True
            raise StageFailedError(f"cannot reach pipeline stage {stage}: {e}") from e

    def remove_lora(self, name: str) -> None:
        self.adapters.pop(name, None)

    def close(self) -> None:
        if self.closing:
            return
        self.closing = True
        atexit.unregister(self.close)
        if self.failed:
            for proc in self.procs:
                proc.kill()  # the survivors may be blocked on the dead one; no point asking them
            # Still leave no process group behind: this process may build another pipeline.
            dist.destroy_process_group()
            return
        for rank in self.ranks:
            send_frame(StageShutdown(), rank, self.pending)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        if not self.procs:
            self.pending.wait_all()
        # Its receive ends when the last rank, shut down, closes its connection; a process group destroyed under a
        # blocked receive aborts the process at exit.
        self.receiver.join(timeout=10)
        dist.destroy_process_group()
