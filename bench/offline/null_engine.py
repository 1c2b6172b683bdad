"""The engine the host benchmarks share: dummy:tiny on the CPU with every request decoding (its prompts computed,
untimed), optionally its model swapped for a null one (as bench_length_aware's --null-model runs swap theirs), and
the engine loop's output on a real channel.

Imported by benchmarks that run it in other trees' engines (bench_host_step.py): it imports only what every tree has.
"""

from __future__ import annotations

import torch

NULL_VOCAB = 256


class NullModel(torch.nn.Module):
    """Fixed logits (token 5 the most likely) for the rows asked: no compute but the output's slice."""

    is_last = True
    is_whole = True

    def __init__(self, rows: int):
        super().__init__()
        self.table = torch.zeros(rows, NULL_VOCAB)
        self.table[:, 5] = 1.0

    def forward(self, input_ids, positions, kv_caches, meta, attention, logits_indices, hidden=None):
        return self.table[: len(logits_indices)]


def use_null_model(engine) -> None:
    """Swap the engine's model for a NullModel with a row for every token a step may take."""
    engine.executor.runner.model = NullModel(engine.scheduler.config.max_num_batched_tokens or 512)


def decoding_engine(batch: int, prompt_len: int, max_tokens: int, null_model: bool = False, **config):
    """An engine whose `batch` requests (greedy, eos ignored) have each got their first token: what follows decodes."""
    from engine import SamplingParams
    from engine.core.config import EngineConfig
    from engine.launch import build_engine

    config = EngineConfig(
        model="dummy:tiny", device="cpu", max_num_seqs=batch, speculative="off", kv_cache_memory=2**30, **config
    )
    engine = build_engine(config)
    if null_model:
        use_null_model(engine)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request([(7 * i + j) % 40000 for j in range(prompt_len)], params)
    while engine.scheduler.num_waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    return engine


class Output:
    """The engine loop's part of a step: its token deltas built and sent on a real channel (one StepDeltas frame where
    the tree has it, else a frame per request); `drain` is the consumer, left out of any timing."""

    def __init__(self):
        from engine.core.config import FaultPlan
        from engine.ipc.channel import Channel
        from engine.ipc.engine_loop import EngineLoop
        from engine.ipc.messages import FromEngine

        try:
            from engine.ipc.messages import StepDeltas
        except ImportError:  # a tree from before it
            StepDeltas = None

        class Publisher:  # what EngineLoop.delta and EngineLoop.publish_deltas read of their loop
            faults = FaultPlan()
            generation_tokens_total = 0
            delta = EngineLoop.delta

        self.publisher, self.delta, self.step_deltas = Publisher(), EngineLoop.delta, StepDeltas
        self.outbox = Channel.create(FromEngine)
        self.consumer = Channel.attach(self.outbox.handle(), FromEngine)
        self.publisher.outbox = self.outbox
        # The engine loop's own step output, where the tree has it.
        self.publish_deltas = getattr(EngineLoop, "publish_deltas", None)

    def publish(self, updated: list) -> int:
        """Send the deltas of the requests a step updated; returns the tokens they carry."""
        if self.publish_deltas is not None:
            before = self.publisher.generation_tokens_total
            self.publish_deltas(self.publisher, updated)
            return self.publisher.generation_tokens_total - before
        deltas = [self.delta(self.publisher, r) for r in updated]
        if self.step_deltas is not None:
            self.outbox.send(self.step_deltas(deltas))
        else:
            for delta in deltas:
                self.outbox.send(delta)
        return sum(len(d.token_ids) for d in deltas)

    def drain(self) -> None:
        self.consumer.recv_all()

    def close(self) -> None:
        self.consumer.close()
        self.outbox.close()
        self.outbox.unlink()
