"""Turns logits into next tokens, per request: penalties, bias, temperature, top-k/p, min-p, seeds, logprobs.

Sampling stays on the logits' device. `sample` returns the ids there (where the next step's input can read
them) and starts one asynchronous copy to the host: the sampled ids, with the logprobs packed next to them
when any request asked for them. `finish` waits for that copy, so the host syncs with the device only there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.core.request import Request, TokenLogprobs
from engine.model.grammar import GrammarMasks


@dataclass
class DeviceSample:
    """One batch's sampled ids on the device, and their copy on its way to the host."""

    requests: list[Request]
    tokens: torch.Tensor  # [B] int64 on the sampling device
    host: torch.Tensor  # [B, 1] ids, or [B, 2 + 2k] ids, chosen logprob, top-k ids and logprobs (float64)
    num_top: list[int | None]  # each request's logprobs setting
    ready: torch.cuda.Event | None  # recorded after the copy; None on the CPU (already there)


class Sampler:
    """Batched where settings agree; per request only where they cannot be (seeds, penalties, bias)."""

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu", tokenizer=None):
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)  # for requests without their own seed
        self.grammar = GrammarMasks(tokenizer) if tokenizer is not None else None  # no tokenizer: no grammars

    def _tensor(self, values, dtype=None) -> torch.Tensor:
        """A small host list on the sampling device without a sync: pinned memory, asynchronous copy."""
        t = torch.tensor(values, dtype=dtype)
        if self.device.type == "cpu":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> dict[str, tuple[int, TokenLogprobs | None]]:
        """Sample and wait for the result."""
        return self.finish(self.sample(logits, requests))

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> DeviceSample:
        """Each request's next token, left on the device; its host copy is started, not awaited."""
        logits = logits.float()
        # Logprobs report the model's own distribution, before any sampling transform.
        num_top = [r.params.logprobs for r in requests]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(n is not None for n in num_top) else None
        logits = self._adjust(logits.clone(), requests)  # the runner returns an inference tensor: no in-place
        if self.grammar is not None:
            self.grammar.apply(logits, requests)

        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        if random_rows:
            # Rows by a pinned index tensor: indexing with a Python list copies it to the device synchronously.
            rows = self._tensor(random_rows, torch.int64)
            probs = self._probs(logits.index_select(0, rows), [requests[i] for i in random_rows])
            tokens.index_copy_(0, rows, self._draw(probs, [requests[i] for i in random_rows]))

        if raw_logprobs is None:
            packed = tokens[:, None]
        else:
            k = max(n or 0 for n in num_top)
            # One transfer for everything: ids are exact in float64.
            parts = [tokens[:, None].double(), raw_logprobs.gather(1, tokens[:, None]).double()]
            if k:
                top = raw_logprobs.topk(k, dim=-1)
                parts += [top.indices.double(), top.values.double()]
            packed = torch.cat(parts, dim=1)
        if self.device.type == "cpu":
            return DeviceSample(requests, tokens, packed, num_top, None)
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return DeviceSample(requests, tokens, host, num_top, ready)

    def finish(self, sample: DeviceSample) -> dict[str, tuple[int, TokenLogprobs | None]]:
        """Wait for a sample's host copy; advance the grammars by its tokens. {request_id: (token, logprobs)}."""
        if sample.ready is not None:
            sample.ready.synchronize()
        rows = sample.host.tolist()
        k = (len(rows[0]) - 2) // 2 if rows else 0
        out = {}
        for req, row, n in zip(sample.requests, rows, sample.num_top):
            token = int(row[0])
            lp = None
            if n is not None:
                pairs = [(int(i), v) for i, v in zip(row[2 : 2 + n], row[2 + k : 2 + k + n])]
                lp = TokenLogprobs(token, row[1], pairs)
            out[req.request_id] = (token, lp)
        if self.grammar is not None:
            self.grammar.advance(sample.requests, [out[r.request_id][0] for r in sample.requests])
        return out

    def save_rng(self, requests: list[Request]) -> Callable[[], None]:
        """A function that puts every generator these requests sample with back where it is now, so a batch that
        failed part-way can be sampled again request by request without drawing twice."""
        if all(r.params.greedy for r in requests):
            return lambda: None
        shared = self.generator.get_state()
        own = [(r, None if r.generator is None else r.generator.get_state()) for r in requests]

        def restore() -> None:
            self.generator.set_state(shared)
            for req, state in own:
                if state is None:
                    req.generator = None
                else:
                    req.generator.set_state(state)

        return restore

    def _adjust(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Logit bias, penalties and min_tokens, in place."""
        for i, req in enumerate(requests):
            p = req.params
            if p.logit_bias:
                ids = self._tensor(list(p.logit_bias.keys()), torch.int64)
                logits[i].index_add_(0, ids, self._tensor(list(p.logit_bias.values()), torch.float32))
            if p.has_penalties:
                self._penalize(logits[i], req)
            if req.num_output_tokens < p.min_tokens and req.stop_token_ids:
                logits[i].index_fill_(0, self._tensor(sorted(req.stop_token_ids), torch.int64), float("-inf"))
        return logits

    def _penalize(self, row: torch.Tensor, req: Request) -> None:
        p = req.params
        vocab = row.shape[0]
        if p.repetition_penalty != 1.0:
            # HF/CTRL: tokens seen anywhere (prompt or output) are made less likely whatever their sign.
            seen = self._tensor(sorted(set(req.prompt_token_ids) | set(req.output_token_ids)), torch.int64)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if req.output_token_ids and (p.presence_penalty or p.frequency_penalty):
            # OpenAI: only generated tokens count.
            counts = torch.bincount(self._tensor(req.output_token_ids, torch.int64), minlength=vocab)[:vocab].float()
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()

    def _probs(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        logits = logits / self._tensor([r.params.temperature for r in requests], torch.float32).unsqueeze(1)
        top_ks = [r.params.top_k for r in requests]
        top_ps = [r.params.top_p for r in requests]
        vocab = logits.shape[1]
        if any(0 < k < vocab for k in top_ks) or any(p < 1.0 for p in top_ps):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            k = self._tensor([k if 0 < k < vocab else vocab for k in top_ks], torch.int64).unsqueeze(1)
            drop = torch.arange(vocab, device=logits.device).unsqueeze(0) >= k
            sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
            # Drop a token if the mass before it already reaches top_p (the most likely one always stays).
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop |= mass_before >= self._tensor(top_ps, torch.float32).unsqueeze(1)
            drop[:, 0] = False  # a top_p that rounds to 0 in float32 must still leave one token
            logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = logits.softmax(dim=-1)
        min_ps = [r.params.min_p for r in requests]
        if any(m > 0 for m in min_ps):
            floor = self._tensor(min_ps, torch.float32).unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)
        # Extreme but valid settings (a repetition penalty near 0 makes logits inf) can leave a row with no
        # usable distribution; it takes its most likely token instead of failing the whole engine.
        probs = probs.nan_to_num(nan=0.0, posinf=0.0)
        unusable = ~(probs.sum(dim=-1, keepdim=True) > 0)
        greedy = torch.zeros_like(probs).scatter_(1, logits.nan_to_num(nan=float("-inf")).argmax(-1, keepdim=True), 1.0)
        return torch.where(unusable, greedy, probs)

    def _draw(self, probs: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        out = torch.empty(len(requests), dtype=torch.int64, device=probs.device)
        shared = [i for i, r in enumerate(requests) if r.params.seed is None]
        if shared:
            rows = self._tensor(shared, torch.int64)
            out.index_copy_(0, rows, torch.multinomial(probs.index_select(0, rows), 1, generator=self.generator)[:, 0])
        for i, r in enumerate(requests):
            if r.params.seed is not None:
                out[i] = torch.multinomial(probs[i], 1, generator=self._generator_for(r)).squeeze(0)
        return out

    def _generator_for(self, req: Request) -> torch.Generator:
        """A seeded request's own RNG, made on the sampling device the first time it samples."""
        if req.generator is None:
            req.generator = torch.Generator(device=self.device).manual_seed(req.params.seed)
        return req.generator
