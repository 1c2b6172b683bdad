"""The engine process: drain the inbound ring, step the engine, publish token deltas; sleep on the doorbell when idle.

Started by the gateway as `python -m engine.worker SPEC_JSON` (a `WorkerSpec`), so nothing crosses
the process boundary as pickle: the spec is JSON, every frame after it msgspec.
"""

from __future__ import annotations

import sys
import time

import msgspec

from engine.channel import Channel, ChannelHandle
from engine.config import EngineConfig
from engine.messages import (
    Abort, AddRequest, EngineReady, EngineStats, FromEngine, RequestError, Shutdown, TokenDelta, ToEngine,
)
from engine.sampling_params import InvalidRequestError

IDLE_STATS_INTERVAL = 1.0  # seconds between stats reports while idle: the gateway's liveness signal


class WorkerSpec(msgspec.Struct):
    config: EngineConfig
    to_engine: ChannelHandle
    from_engine: ChannelHandle


class EngineWorker:
    """Glues an EngineCore to the two channels."""

    def __init__(self, spec: WorkerSpec):
        from engine.core import EngineCore

        self.inbox = Channel.attach(spec.to_engine, ToEngine)
        self.outbox = Channel.attach(spec.from_engine, FromEngine)
        self.engine = EngineCore(spec.config)
        e = self.engine
        self.outbox.send(EngineReady(e.model_name, e.limits))
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    def run(self) -> None:
        while True:
            for msg in self.inbox.recv_all():
                if isinstance(msg, Shutdown):
                    return
                self.handle(msg)
            if self.engine.has_unfinished():
                self.step()
            elif not self.inbox.wait(timeout=IDLE_STATS_INTERVAL):
                self.publish_stats(0.0)

    def handle(self, msg: AddRequest | Abort) -> None:
        if isinstance(msg, Abort):
            self.engine.abort_request(msg.request_id)
            return
        try:
            self.engine.add_request(msg.prompt_token_ids, msg.params, msg.request_id)
            self.prompt_tokens_total += len(msg.prompt_token_ids)
        except InvalidRequestError as e:
            self.outbox.send(RequestError(msg.request_id, str(e), e.param))

    def step(self) -> None:
        t = time.perf_counter()
        updated = self.engine.step()
        elapsed = time.perf_counter() - t
        for req in updated:
            lp = None
            if req.params.logprobs is not None:
                last = req.output_logprobs[-1]
                lp = [[last.token_id, last.logprob, [list(x) for x in last.top]]]
            self.outbox.send(TokenDelta(req.request_id, [req.output_token_ids[-1]], req.finish_reason, lp))
        self.generation_tokens_total += len(updated)
        self.publish_stats(elapsed)

    def publish_stats(self, iteration_seconds: float) -> None:
        e = self.engine
        s = e.scheduler
        self.outbox.send(EngineStats(
            s.num_running, s.num_waiting, s.kv.num_used_blocks, s.kv.num_free_blocks, e.num_iterations,
            e.last_batch_size, s.num_preemptions, self.prompt_tokens_total, self.generation_tokens_total,
            e.last_batch_tokens, iteration_seconds,
        ))

    def close(self) -> None:
        self.inbox.close()
        self.outbox.close()


def main(argv: list[str]) -> int:
    spec = msgspec.json.decode(argv[1], type=WorkerSpec)
    worker = EngineWorker(spec)
    try:
        worker.run()
    finally:
        worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
