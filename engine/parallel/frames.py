"""Control frames between the pipeline driver (rank 0) and its stages (ranks 1..N): msgspec over gloo.

Frames are small (batch metadata, sampled ids); the activations go over the tensor path (NCCL on
GPUs, gloo on CPU). A frame travels as two gloo messages, its length then its msgpack bytes.
"""

from __future__ import annotations

import msgspec
import torch
import torch.distributed as dist

from engine.core.batch import Batch
from engine.core.config import EngineConfig
from engine.core.request import Failure, SampledTokens, TokenLogprobs
from engine.core.sampling_params import SamplingParams

CONTROL_TAG = 1
ACTIVATION_TAG = 2


class StageSetup(msgspec.Struct, tag=True):
    """Driver -> each rank, once: what to load, which layers are its stage's and which shard of them is its own."""

    config: EngineConfig
    stage: int  # 0-based
    num_stages: int
    max_model_len: int
    tp_rank: int = 0  # 0-based within the stage; the process's rank is rank_of(stage, tp_rank, tp_size)
    tp_size: int = 1


class StageReady(msgspec.Struct, tag=True):
    """Stage -> driver, once: the stage has its layers and this many KV blocks."""

    num_blocks: int


class SamplingStart(msgspec.Struct, array_like=True):
    """What the last stage's sampler needs of a request it has not seen before (engine/model/sampling/state.py)."""

    request_id: str
    prompt_token_ids: list[int]  # repetition penalties look at the prompt
    params: SamplingParams
    stop_token_ids: list[int]  # what min_tokens masks


class StageBatch(msgspec.Struct, tag=True):
    """Driver -> every stage, per iteration: the batch; to the sampling rank also requests to start or stop tracking."""

    batch_id: int
    batch: Batch
    new_requests: list[SamplingStart]
    released: list[str]


class StageResult(msgspec.Struct, tag=True):
    """Last stage -> driver, per iteration: each sampling request's tokens (accepted drafts, then one), in batch order,
    or the Failure of one whose sampling raised."""

    batch_id: int
    sampled: list[SampledTokens | Failure]
    # Per request whose chunk asked for prompt logprobs, one per row.
    prompt_logprobs: dict[str, list[TokenLogprobs]] = {}


class StageLora(msgspec.Struct, tag=True):
    """Driver -> every rank, between batches: put this rank's part of an adapter (engine/model/lora_shards.py) in
    `slot`, for the batches that follow."""

    slot: int
    rank: int
    scale: float
    weights: bytes  # safetensors: this rank's layers' A and B


class StageShutdown(msgspec.Struct, tag=True):
    pass


Frame = StageSetup | StageReady | StageBatch | StageResult | StageLora | StageShutdown
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Frame)


class PendingSends:
    """Asynchronous sends whose buffers must stay alive until they complete."""

    def __init__(self):
        self.items: list[tuple[dist.Work, torch.Tensor]] = []

    def add(self, work: dist.Work, tensor: torch.Tensor) -> None:
        self.items = [(w, t) for w, t in self.items if not w.is_completed()]
        self.items.append((work, tensor))

    def wait_all(self) -> None:
        for work, _ in self.items:
            work.wait()
        self.items = []


def send_frame(frame: Frame, dst: int, pending: PendingSends) -> None:
    data = _encoder.encode(frame)
    header = torch.tensor([len(data)], dtype=torch.int64)
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    pending.add(dist.isend(header, dst, tag=CONTROL_TAG), header)
    pending.add(dist.isend(payload, dst, tag=CONTROL_TAG), payload)


def recv_frame(src: int) -> Frame:
    header = torch.empty(1, dtype=torch.int64)
    dist.recv(header, src, tag=CONTROL_TAG)
    payload = torch.empty(int(header.item()), dtype=torch.uint8)
    dist.recv(payload, src, tag=CONTROL_TAG)
    return _decoder.decode(payload.numpy().tobytes())
