"""Prompt logprobs from the prefill's own hidden states: the LM head over the rows asked for, in bounded chunks.

A row at position p of a prompt gives the logprob of prompt token p + 1 (and its rank and the top alternatives).
The logits of a long prompt do not fit at once (4k rows x 49k vocabulary in float32 is 800 MB), so the head runs
on at most ROW_BUDGET logits at a time, each chunk reduced to a few numbers per row before the next is made.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.batch import Batch
from engine.core.executor import PromptLogprobs
from engine.core.request import TokenLogprobs
from engine.model.decoder import Decoder

ROW_BUDGET = 1 << 23  # logits per chunk: 32 MiB of float32 (170 rows of a 49k vocabulary)


@dataclass
class PromptRows:
    """Where one batch's prompt-logprob rows are: flat row indices, their targets, and whose they are."""

    rows: list[int]  # indices into the batch's flattened tokens
    targets: list[int]  # the prompt token each row predicts
    owners: list[tuple[str, int, int]]  # (request id, rows, top alternatives), in row order
    num_top: int  # the most alternatives any request asked for

    @classmethod
    def of(cls, batch: Batch) -> PromptRows | None:
        """The batch's prompt-logprob rows; None when no chunk asked for any."""
        rows, targets, owners, start = [], [], [], 0
        for r in batch.requests:
            p = r.prompt_logprobs
            if p is not None:
                first = start + p.first_row
                rows += range(first, first + len(p.targets))
                targets += p.targets
                owners.append((r.request_id, len(p.targets), p.num_top))
            start += len(r.token_ids)
        if not rows:
            return None
        return cls(rows, targets, owners, max(n for _, _, n in owners))


def reduce_rows(model: Decoder, normed: torch.Tensor, targets: torch.Tensor, num_top: int) -> torch.Tensor:
    """Normed hidden rows [R, hidden] -> [R, 3 + 2k] float64: the target's id, logprob and rank (1: the most likely),
    then the top k ids and their logprobs. Every tensor-parallel rank calls it (the head gathers the vocabulary)."""
    vocab = model.full_shape.vocab_size
    step = max(1, ROW_BUDGET // vocab)
    out = torch.empty(normed.shape[0], 3 + 2 * num_top, dtype=torch.float64, device=normed.device)
    for s in range(0, normed.shape[0], step):
        logprobs = torch.log_softmax(model.logits(normed[s : s + step]), dim=-1)
        target = targets[s : s + step, None]
        chosen = logprobs.gather(1, target)
        rank = (logprobs > chosen).sum(dim=-1, keepdim=True) + 1
        parts = [target.double(), chosen.double(), rank.double()]
        if num_top:
            top = logprobs.topk(num_top, dim=-1)
            parts += [top.indices.double(), top.values.double()]
        out[s : s + step] = torch.cat(parts, dim=1)
        del logprobs
    return out


class DevicePromptLogprobs:
    """One batch's reduced prompt rows on the device, and their copy to the host once started."""

    def __init__(self, packed: torch.Tensor, rows: PromptRows):
        self.rows = rows
        self.ready: torch.cuda.Event | None = None
        if packed.device.type == "cpu":
            self.host = packed
            return
        self.host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        self.host.copy_(packed, non_blocking=True)
        self.ready = torch.cuda.Event()
        self.ready.record()

    def finish(self) -> PromptLogprobs:
        """Wait for the copy; each request's rows as TokenLogprobs, in prompt order."""
        if self.ready is not None:
            self.ready.synchronize()
        values = self.host.tolist()
        k = self.rows.num_top
        out: PromptLogprobs = {}
        i = 0
        for request_id, n, num_top in self.rows.owners:
            out[request_id] = [
                TokenLogprobs(
                    int(v[0]),
                    v[1],
                    [(int(t), lp) for t, lp in zip(v[3 : 3 + num_top], v[3 + k : 3 + k + num_top])],
                    int(v[2]),
                )
                for v in values[i : i + n]
            ]
            i += n
        return out
