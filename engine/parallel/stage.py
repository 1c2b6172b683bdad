"""A stage process: for each batch frame, run this stage's layers (or this rank's shard of them) and pass the
activations on.

The ranks form a grid, Orca's Figure 7: pipeline stages (inter-layer) by tensor-parallel ranks (intra-layer).
Each rank of a stage holds a shard of every one of its layers and sums partial results with its peers; the
first stage embeds the batch's tokens; the last applies the final norm and LM head, and its tensor-parallel
rank 0 samples and returns the sampled ids to the driver. Ranks rendezvous through the standard
torch.distributed environment (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK), so a rank can run on another host,
or under torchrun (engine/parallel/world.py):

    RANK=1 WORLD_SIZE=3 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 python -m engine.parallel.stage
    torchrun --nnodes 1 --nproc-per-node 2 -m engine.parallel.stage --driver 10.0.0.1:29500

A rank whose driver goes away (its process killed, its host lost) exits with one line and status 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

from engine.core.config import FaultPlan
from engine.model.loader import load_checkpoint
from engine.model.lora import LoraSlots
from engine.model.lora_shards import adapter_from_bytes
from engine.model.sampling.sampler import DeviceSample, Sampler
from engine.model.sampling.state import SamplingState
from engine.model.sharding import TensorShard
from engine.parallel.frames import (
    ACTIVATION_TAG,
    PendingSends,
    StageBatch,
    StageLora,
    StageReady,
    StageResult,
    StageSetup,
    StageShutdown,
    recv_frame,
    send_frame,
)
from engine.parallel.world import LinkLost, join, stage_place
from engine.runner.device import num_kv_blocks
from engine.runner.local_executor import attach_embeddings, attach_hidden, build_model, sample_isolated
from engine.runner.model_runner import ModelRunner

DRIVER = 0


def stage_span(num_layers: int, stage: int, num_stages: int) -> range:
    """Stage `stage`'s layers when `num_layers` are split as evenly as they go (earlier stages take the extras)."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers over {num_stages} pipeline stages")
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def rank_of(stage: int, tp_rank: int, tp_size: int) -> int:
    """The process rank of a grid position; the driver is rank 0."""
    return 1 + stage * tp_size + tp_rank


def make_groups(device: torch.device, num_stages: int, tp_size: int) -> tuple[object, list]:
    """The activations' group, and each stage's tensor-parallel group. NCCL where every rank has a GPU of its own,
    else gloo through host memory (NCCL refuses two ranks on one GPU); None means the (gloo) world group.
    Collective: every rank, the driver included, calls it, in the same order."""
    own_gpus = device.type == "cuda" and torch.cuda.device_count() >= num_stages * tp_size
    activations = dist.new_group(backend="nccl") if own_gpus else None
    tp_groups = []
    if tp_size > 1:
        backend = "nccl" if own_gpus else "gloo"
        tp_groups = [
            dist.new_group([rank_of(s, r, tp_size) for r in range(tp_size)], backend=backend) for s in range(num_stages)
        ]
    return activations, tp_groups


class Stage:
    """One span of the decoder layers (one shard of each, under tensor parallelism), with its own KV cache blocks;
    the last stage's first tensor-parallel rank also samples."""

    def __init__(self, setup: StageSetup):
        config = setup.config
        device = torch.device(config.device)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.rank = rank_of(setup.stage, setup.tp_rank, setup.tp_size)
        if device.type == "cuda":
            torch.cuda.set_device((self.rank - 1) % torch.cuda.device_count())  # a GPU each where there are enough
        self.tensors, tp_groups = make_groups(device, setup.num_stages, setup.tp_size)
        # Ranks sharing a GPU send activations (and sum partial results) through gloo, which takes host tensors only.
        self.via_host = device.type == "cuda" and self.tensors is None
        shard = TensorShard(setup.tp_rank, setup.tp_size, tp_groups[setup.stage] if tp_groups else None, self.via_host)
        ckpt = load_checkpoint(config.model, config.seed)
        self.span = stage_span(ckpt.shape.num_layers, setup.stage, setup.num_stages)
        self.model = build_model(ckpt, setup.max_model_len, config, self.span, shard)
        tokenizer = ckpt.tokenizer  # the last stage's sampler needs it for grammars
        del ckpt
        # LoRA: this rank's layers wrapped (their slots take memory) before the KV cache is sized.
        self.lora = LoraSlots(self.model, config.max_loras, config.max_lora_rank) if config.lora_enabled else None
        self.num_blocks = num_kv_blocks(config, self.model.shape, len(self.span))
        self.runner = ModelRunner(config, self.model, self.num_blocks, setup.max_model_len)
        self.runner.lora = self.lora
        self.samples = self.model.is_last and setup.tp_rank == 0
        self.sampler = Sampler(config.seed, self.runner.device, tokenizer) if self.samples else None
        self.faults = config.faults or FaultPlan()
        # Activations go to and come from the same tensor-parallel rank of the next and previous stage.
        self.prev_rank, self.next_rank = self.rank - setup.tp_size, self.rank + setup.tp_size
        self.pending = PendingSends()

    def run(self) -> None:
        while True:
            frame = receive_from_driver()
            if isinstance(frame, StageShutdown):
                self.pending.wait_all()
                return
            if isinstance(frame, StageLora):
                self.lora.load(frame.slot, adapter_from_bytes(frame.weights, frame.rank, frame.scale))
                continue
            assert isinstance(frame, StageBatch)
            self.step(frame)

    def step(self, frame: StageBatch) -> None:
        if self.samples:
            self.sampler.release(frame.released)
            self.runner.pooler.forget(frame.released)
            for new in frame.new_requests:
                self.sampler.add(
                    SamplingState(new.request_id, new.prompt_token_ids, new.params, frozenset(new.stop_token_ids))
                )
        batch = frame.batch
        hidden = None
        if not self.model.is_first:
            hidden = torch.empty(
                batch.num_tokens,
                self.model.shape.hidden_size,
                dtype=self.runner.dtype,
                device="cpu" if self.via_host else self.runner.device,
            )
            try:
                dist.recv(hidden, self.prev_rank, group=self.tensors, tag=ACTIVATION_TAG)
            except RuntimeError as e:
                raise LinkLost(self.prev_rank, e) from e
            hidden = hidden.to(self.runner.device)
        out = self.runner.run(batch, hidden)
        if not self.model.is_last:
            out = out.cpu() if self.via_host else out
            try:
                self.pending.add(dist.isend(out, self.next_rank, group=self.tensors, tag=ACTIVATION_TAG), out)
            except RuntimeError as e:
                # The next stage is gone (its host lost) while this batch was under way: its link to the driver broke
                # too, so the driver fails the job and leaves, and this rank then exits as it does when that happens.
                print(
                    f"orcinus stage rank {self.rank}: {LinkLost(self.next_rank, e)}; waiting for the driver",
                    file=sys.stderr,
                    flush=True,
                )
            return
        if not self.samples:
            return  # its logits went into the gather; tensor-parallel rank 0 samples
        sampling = batch.sampling_ids
        # One request whose sampling raises (its grammar failed) fails alone, as in a single process.
        sampled = sample_isolated(self.sampler, out, sampling, batch.sampling_drafts, self.faults.at_sampling)
        if isinstance(sampled, DeviceSample):
            sampled = self.sampler.finish(sampled)
        attach_hidden(sampled, self.runner.probed_hidden)
        attach_embeddings(sampled, self.runner.pooled)
        prompt = self.runner.prompt_logprobs
        send_frame(
            StageResult(
                frame.batch_id,
                [sampled[request_id] for request_id in sampling],
                {} if prompt is None else prompt.finish(),
            ),
            DRIVER,
            self.pending,
        )


def receive_from_driver():
    try:
        return recv_frame(DRIVER)
    except RuntimeError as e:  # gloo: the driver's connection closed (it exited, or its host went away)
        raise LinkLost(DRIVER, e) from e


def _exit_when_orphaned(parent_pid: int, rank: int) -> None:
    """A locally launched stage must not outlive its driver, even one killed with SIGKILL."""
    while os.getppid() == parent_pid:
        time.sleep(0.2)
    _leave(f"orcinus stage rank {rank}: its driver (pid {parent_pid}) exited; exiting", 0)


def _leave(line: str, code: int) -> None:
    print(line, file=sys.stderr, flush=True)
    os._exit(code)  # not sys.exit: gloo's threads may still be blocked on the closed connections


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="an Orcinus pipeline stage (rank and peers from the environment)")
    ap.add_argument("--parent-pid", type=int, default=None, help="exit when this process (the driver) is gone")
    ap.add_argument(
        "--driver",
        default=None,
        metavar="HOST:PORT",
        help="where the driver listens (its MASTER_ADDR:MASTER_PORT); needed under torchrun",
    )
    args = ap.parse_args(argv)
    try:
        place = stage_place(args.driver)
    except ValueError as e:
        ap.error(str(e))
    if args.parent_pid:
        # Ctrl-C reaches the whole process group; the driver decides when its stages stop.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        threading.Thread(target=_exit_when_orphaned, args=(args.parent_pid, place.rank), daemon=True).start()
    try:
        join(place)
        setup = receive_from_driver()
        assert isinstance(setup, StageSetup) and rank_of(setup.stage, setup.tp_rank, setup.tp_size) == dist.get_rank()
        stage = Stage(setup)
        pending = PendingSends()
        send_frame(StageReady(stage.num_blocks), DRIVER, pending)
        pending.wait_all()
        stage.run()
    except LinkLost as e:
        # The driver gone (its engine killed, its host lost) is the end of the job, not an error of this rank's.
        _leave(f"orcinus stage rank {place.rank}: {e}; exiting", 0 if e.rank == DRIVER else 1)
    except Exception:
        # A failed stage must not leave its peers waiting: exiting closes its connections, which they see.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    dist.destroy_process_group()
    # Without the interpreter's teardown, which is slow with torch loaded and closes nothing left open.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
