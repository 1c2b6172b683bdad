"""Turns logits into next tokens, per request: penalties, bias, temperature, top-k/p, min-p, seeds, logprobs."""

from __future__ import annotations

import torch

from engine.request import Request, TokenLogprobs


class Sampler:
    """Batched where settings agree; per request only where they cannot be (seeds, penalties, bias)."""

    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)  # for requests without their own seed

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> dict[str, tuple[int, TokenLogprobs | None]]:
        logits = logits.float().cpu()
        # Logprobs report the model's own distribution, before any sampling transform.
        want_logprobs = [r.params.logprobs is not None for r in requests]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        logits = self._adjust(logits.clone(), requests)  # the runner returns an inference tensor: no in-place

        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        if random_rows:
            probs = self._probs(logits[random_rows], [requests[i] for i in random_rows])
            tokens[random_rows] = self._draw(probs, [requests[i] for i in random_rows])

        out = {}
        for i, (req, token) in enumerate(zip(requests, tokens.tolist())):
            lp = None
            if want_logprobs[i]:
                row = raw_logprobs[i]
                top = row.topk(req.params.logprobs) if req.params.logprobs else None
                lp = TokenLogprobs(
                    token, float(row[token]),
                    list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else [],
                )
            out[req.request_id] = (token, lp)
        return out

    def _adjust(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Logit bias, penalties and min_tokens, in place."""
        for i, req in enumerate(requests):
            p = req.params
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias.keys()))
                logits[i].index_add_(0, ids, torch.tensor(list(p.logit_bias.values())))
            if p.has_penalties:
                self._penalize(logits[i], req)
            if req.num_output_tokens < p.min_tokens and req.stop_token_ids:
                logits[i, list(req.stop_token_ids)] = float("-inf")
        return logits

    @staticmethod
    def _penalize(row: torch.Tensor, req: Request) -> None:
        p = req.params
        vocab = row.shape[0]
        if p.repetition_penalty != 1.0:
            # HF/CTRL: tokens seen anywhere (prompt or output) are made less likely whatever their sign.
            seen = torch.tensor(sorted(set(req.prompt_token_ids) | set(req.output_token_ids)))
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if req.output_token_ids and (p.presence_penalty or p.frequency_penalty):
            # OpenAI: only generated tokens count.
            counts = torch.bincount(torch.tensor(req.output_token_ids), minlength=vocab)[:vocab].float()
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()

    @staticmethod
    def _probs(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        temps = torch.tensor([r.params.temperature for r in requests]).unsqueeze(1)
        logits = logits / temps
        top_ks = [r.params.top_k for r in requests]
        top_ps = [r.params.top_p for r in requests]
        vocab = logits.shape[1]
        if any(0 < k < vocab for k in top_ks) or any(p < 1.0 for p in top_ps):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            k = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks]).unsqueeze(1)
            drop = torch.arange(vocab).unsqueeze(0) >= k
            sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
            # Drop a token if the mass before it already reaches top_p (the most likely one always stays).
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop |= mass_before >= torch.tensor(top_ps).unsqueeze(1)
            logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = logits.softmax(dim=-1)
        min_ps = torch.tensor([r.params.min_p for r in requests]).unsqueeze(1)
        if (min_ps > 0).any():
            probs = probs.masked_fill(probs < min_ps * probs.max(dim=-1, keepdim=True).values, 0.0)
        return probs

    def _draw(self, probs: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        out = torch.empty(len(requests), dtype=torch.int64)
        shared = [i for i, r in enumerate(requests) if r.generator is None]
        if shared:
            out[shared] = torch.multinomial(probs[shared], 1, generator=self.generator).squeeze(1)
        for i, r in enumerate(requests):
            if r.generator is not None:
                out[i] = torch.multinomial(probs[i], 1, generator=r.generator)
        return out
