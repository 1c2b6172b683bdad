"""Turns logits into next tokens, per request: penalties, bias, temperature, top-k/p, min-p, seeds, logprobs, and
the verdicts on draft tokens (speculative decoding).

A request with d draft tokens has d + 1 rows of logits: row j is the next token's distribution after its context and
the first j draft tokens, and is adjusted as if those j were already its outputs (penalties, min_tokens, grammar).
Sampling stays on the logits' device, and so does what it keeps per request (engine/model/sampling/state.py):
a request is added before its first sample and released when it is gone. `sample` returns the ids there (where the next step's input can read
them) and starts one asynchronous copy to the host: each row's id and verdict, with the logprobs packed next to
them when any request asked for them. `finish` waits for that copy, so the host syncs with the device only there,
and takes each request's accepted drafts and the token after them (engine/model/sampling/verification.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.core.request import SampledTokens, TokenLogprobs
from engine.model.sampling.draw import exponential_race, greedy, keys
from engine.model.sampling.grammar import GrammarMasks
from engine.model.sampling.nucleus import nucleus
from engine.model.sampling.state import SamplingState
from engine.model.sampling.verification import NO_DRAFT, accepted_tokens, draft_acceptance


@dataclass(frozen=True)
class Row:
    """One row of logits: its request, and the draft tokens before it (taken as outputs when adjusting it)."""

    request: SamplingState
    drafted: list[int]
    draft_id: int  # the draft token this row verifies, NO_DRAFT on a request's last row

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids + self.drafted if self.drafted else self.request.output_token_ids


def rows_of(requests: list[SamplingState], drafts: list[list[int]] | None) -> list[Row]:
    rows = []
    for i, req in enumerate(requests):
        draft = drafts[i] if drafts else []
        rows += [Row(req, draft[:j], draft[j] if j < len(draft) else NO_DRAFT) for j in range(len(draft) + 1)]
    return rows


def _masks_stops(row: Row) -> bool:
    """Whether min_tokens still forbids the row's stop tokens (its drafts before it count as outputs)."""
    req = row.request
    return req.num_output_tokens + len(row.drafted) < req.params.min_tokens and bool(req.stop_token_ids)


def _changes_logits(row: Row) -> bool:
    """Whether the row's logits change before sampling: a logit bias, penalties, min_tokens masking a stop, a grammar."""
    p = row.request.params
    return bool(p.logit_bias) or p.has_penalties or p.grammar is not None or _masks_stops(row)


@dataclass
class DeviceSample:
    """One batch's sampled ids on the device, and their copy on its way to the host."""

    requests: list[SamplingState]
    drafts: list[list[int]]  # each request's draft tokens (rows: one per draft token, then one)
    tokens: torch.Tensor  # [R] int64 on the sampling device: each row's own token
    host: torch.Tensor  # [R, 2] ids and verdicts, or [R, 4 + 2k]: then the row's and its draft's logprobs, top-k
    num_top: list[int | None]  # each request's logprobs setting
    ready: torch.cuda.Event | None  # recorded after the copy; None on the CPU (already there)

    @property
    def last_rows(self) -> list[int]:
        """Each request's last row in `tokens`: its token when it drafted nothing."""
        ends, end = [], -1
        for draft in self.drafts:
            end += len(draft) + 1
            ends.append(end)
        return ends


class Sampler:
    """Batched where settings agree; per request only where they cannot be (seeds, penalties, bias)."""

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu", tokenizer=None):
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)  # for requests without their own seed
        self.grammar = GrammarMasks(tokenizer) if tokenizer is not None else None  # no tokenizer: no grammars
        self.states: dict[str, SamplingState] = {}  # by request id: the requests added and not yet released

    def add(self, state: SamplingState) -> None:
        """A request to sample for from now on."""
        self.states[state.request_id] = state

    def release(self, request_ids: list[str]) -> None:
        """These requests are gone (a batch already sampled for them still finishes)."""
        for request_id in request_ids:
            self.states.pop(request_id, None)

    def _tensor(self, values, dtype=None) -> torch.Tensor:
        """A small host list on the sampling device without a sync: pinned memory, asynchronous copy."""
        t = torch.tensor(values, dtype=dtype)
        if self.device.type == "cpu":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def __call__(
        self, logits: torch.Tensor, request_ids: list[str], drafts: list[list[int]] | None = None
    ) -> dict[str, SampledTokens]:
        """Sample and wait for the result."""
        return self.finish(self.sample(logits, request_ids, drafts))

    def sample(
        self, logits: torch.Tensor, request_ids: list[str], drafts: list[list[int]] | None = None
    ) -> DeviceSample:
        """Each request's tokens, left on the device; their host copy is started, not awaited. `logits` has a row
        per request, or with `drafts` (each request's draft tokens) one per draft token and one more."""
        requests = [self.states[request_id] for request_id in request_ids]
        drafts = drafts or [[] for _ in requests]
        rows = rows_of(requests, drafts)
        logits = logits.float()
        raw = logits  # logprobs report the model's own distribution, before any sampling transform
        num_top = [r.params.logprobs for r in requests]
        refused: set[int] = set()
        if any(_changes_logits(row) for row in rows):  # else no copy: 64 rows of a 128k vocabulary are 33 MB
            logits = self._adjust(logits.clone(), rows)  # the runner returns an inference tensor: no in-place
            if self.grammar is not None:
                refused = self.grammar.apply(logits, rows)
            self._mask_stops_left_by_grammar(logits, rows)  # min_tokens under a grammar: after its mask, if any

        tokens = greedy(logits)
        # A draft token its grammar refuses has probability 0 under the constraint: its row verifies nothing and takes
        # its own token from its (masked) distribution, as the step without drafts would.
        draft_list = [NO_DRAFT if i in refused else row.draft_id for i, row in enumerate(rows)]
        draft_ids = self._tensor(draft_list, torch.int64)
        accepted = tokens == draft_ids  # greedy: a draft token is accepted where it is the argmax
        random_rows = [i for i, row in enumerate(rows) if not row.request.params.greedy]
        if random_rows:
            # Rows by a pinned index tensor: indexing with a Python list copies it to the device synchronously.
            index = self._tensor(random_rows, torch.int64)
            sampled_rows = [rows[i] for i in random_rows]
            every = len(random_rows) == len(rows)  # then no copy of the logits, a pass over every vocabulary
            probs = self._probs(
                logits if every else logits.index_select(0, index),
                [row.request for row in sampled_rows],
                tokens.index_select(0, index),
            )
            verifying = [j for j, i in enumerate(random_rows) if draft_list[i] != NO_DRAFT]
            if verifying:  # only the rows with a draft token: the others need no pass over their vocabulary
                at = self._tensor(verifying, torch.int64)
                batch_rows = index[at]  # the verifying rows' places in the batch
                uniforms = self._uniform([sampled_rows[j] for j in verifying], probs.device)
                verdicts, residual = draft_acceptance(probs.index_select(0, at), draft_ids[batch_rows], uniforms)
                accepted.index_copy_(0, batch_rows, verdicts)
                probs.index_copy_(0, at, residual)  # `_probs` made probs: its own tensor
            tokens.index_copy_(0, index, self._draw(probs, [row.request for row in sampled_rows]))

        # One transfer for everything: ids are exact in float64.
        parts = [tokens[:, None].double(), accepted[:, None].double()]
        if any(n is not None for n in num_top):
            parts.append(self._logprobs(raw, rows, tokens, draft_ids, max(n or 0 for n in num_top)))
        packed = torch.cat(parts, dim=1)
        if self.device.type == "cpu":
            return DeviceSample(requests, drafts, tokens, packed, num_top, None)
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return DeviceSample(requests, drafts, tokens, host, num_top, ready)

    def _logprobs(
        self, raw: torch.Tensor, rows: list[Row], tokens: torch.Tensor, draft_ids: torch.Tensor, k: int
    ) -> torch.Tensor:
        """[R, 2 + 2k] float64: each row's token's and draft token's logprobs and its k most likely tokens and theirs,
        computed for the rows of requests that asked (the others' are zeros, never read)."""
        asking = [i for i, row in enumerate(rows) if row.request.params.logprobs is not None]
        every = len(asking) == len(rows)
        at = None if every else self._tensor(asking, torch.int64)
        if not every:
            raw, tokens, draft_ids = raw.index_select(0, at), tokens.index_select(0, at), draft_ids.index_select(0, at)
        logprobs = torch.log_softmax(raw, dim=-1)  # a row's values do not depend on the other rows
        parts = [
            logprobs.gather(1, tokens[:, None]).double(),
            logprobs.gather(1, draft_ids.clamp(min=0)[:, None]).double(),
        ]
        if k:
            top = logprobs.topk(k, dim=-1)
            parts += [top.indices.double(), top.values.double()]
        part = torch.cat(parts, dim=1)
        if every:
            return part
        return part.new_zeros(len(rows), part.shape[1]).index_copy_(0, at, part)

    def finish(self, sample: DeviceSample) -> dict[str, SampledTokens]:
        """Wait for a sample's host copy; take each request's accepted drafts and the token after them, and advance
        its outputs and grammar by them."""
        if sample.ready is not None:
            sample.ready.synchronize()
        host = sample.host.tolist()
        k = (len(host[0]) - 4) // 2 if host else 0
        out = {}
        start = 0
        for req, draft, n in zip(sample.requests, sample.drafts, sample.num_top):
            rows = host[start : start + len(draft) + 1]
            start += len(draft) + 1
            tokens = accepted_tokens(draft, [int(row[0]) for row in rows], [row[1] > 0 for row in rows])
            lps = None
            if n is not None:
                lps = []
                for j, token in enumerate(tokens):
                    row = rows[j]
                    pairs = [(int(i), v) for i, v in zip(row[4 : 4 + n], row[4 + k : 4 + k + n])]
                    lps.append(TokenLogprobs(token, row[2] if j == len(tokens) - 1 else row[3], pairs))
            out[req.request_id] = SampledTokens(tokens, lps)
        if self.grammar is not None:
            self.grammar.advance(sample.requests, [out[r.request_id].token_ids for r in sample.requests])
        for req in sample.requests:  # the penalties, min_tokens and draft rows of its next step see them
            req.output_token_ids += out[req.request_id].token_ids
        return out

    def save_rng(self, request_ids: list[str]) -> Callable[[], None]:
        """A function that puts every generator these requests sample with back where it is now, so a batch that
        failed part-way can be sampled again request by request without drawing twice."""
        requests = [self.states[request_id] for request_id in request_ids]
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

    def _adjust(self, logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
        """Logit bias, penalties and min_tokens, in place; a row's draft tokens before it count as outputs."""
        for i, row in enumerate(rows):
            req = row.request
            p = req.params
            if p.logit_bias:
                ids = self._tensor(list(p.logit_bias.keys()), torch.int64)
                logits[i].index_add_(0, ids, self._tensor(list(p.logit_bias.values()), torch.float32))
            if p.has_penalties:
                self._penalize(logits[i], req, row.output_token_ids)
            if _masks_stops(row) and p.grammar is None:  # under a grammar: _mask_stops_left_by_grammar
                logits[i].index_fill_(0, self._tensor(sorted(req.stop_token_ids), torch.int64), float("-inf"))
        return logits

    def _mask_stops_left_by_grammar(self, logits: torch.Tensor, rows: list[Row]) -> None:
        """min_tokens under a grammar, after its mask: a row whose grammar allows only a stop keeps it (the format
        wins; masked, the row would have no token left and take id 0, text the format does not allow)."""
        for i, row in enumerate(rows):
            if row.request.params.grammar is not None and _masks_stops(row):
                kept = logits[i].index_fill(
                    0, self._tensor(sorted(row.request.stop_token_ids), torch.int64), -torch.inf
                )
                if bool((kept > -torch.inf).any()):
                    logits[i] = kept

    def _penalize(self, row: torch.Tensor, req: SamplingState, outputs: list[int]) -> None:
        p = req.params
        vocab = row.shape[0]
        if p.repetition_penalty != 1.0:
            # HF/CTRL: tokens seen anywhere (prompt or output) are made less likely whatever their sign.
            seen = self._tensor(sorted(set(req.prompt_token_ids) | set(outputs)), torch.int64)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if outputs and (p.presence_penalty or p.frequency_penalty):
            # OpenAI: only generated tokens count.
            # Only the tokens it generated change: their counts, not a vocabulary-wide one (the same float32 sums).
            counted = Counter(t for t in outputs if 0 <= t < vocab)
            ids = self._tensor(list(counted), torch.int64)
            counts = self._tensor(list(counted.values()), torch.float32)
            row.index_put_(
                (ids,), row[ids] - (p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float())
            )

    def _probs(
        self, logits: torch.Tensor, requests: list[SamplingState], best: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Each row's sampling distribution, as weights (unnormalized after min_p), which the draw and the verdicts
        on drafts both read; `best`, each row's most likely token (computed when not given), is the whole of a row
        that has no usable distribution."""
        if best is None:
            best = greedy(logits)
        logits = logits / self._tensor([r.params.temperature for r in requests], torch.float32).unsqueeze(1)
        top_ks = [r.params.top_k for r in requests]
        top_ps = [r.params.top_p for r in requests]
        if any(0 < k < logits.shape[1] for k in top_ks) or any(p < 1.0 for p in top_ps):
            logits = nucleus(logits, top_ks, top_ps, self._tensor)
        probs = logits.softmax(dim=-1)
        min_ps = [r.params.min_p for r in requests]
        if any(m > 0 for m in min_ps):
            # The most likely token's probability is the one at `best`: temperature, top-k and top-p keep the order
            # and the most likely token, so no pass for a max (nor a copy for the mask: softmax's own tensor).
            floor = self._tensor(min_ps, torch.float32).unsqueeze(1) * probs.gather(1, best[:, None])
            probs.masked_fill_(probs < floor, 0.0)
        # Extreme but valid settings (a repetition penalty near 0 makes logits inf) can leave a row with no
        # usable distribution; it takes its most likely token instead of failing the whole engine.
        probs = probs.nan_to_num_(nan=0.0, posinf=0.0)  # softmax's own tensor (or min_p's): in place
        unusable = ~(probs.sum(dim=-1, keepdim=True) > 0)  # all zeros: a 1 at the argmax makes it one-hot
        return probs.scatter_add_(1, best[:, None], unusable.to(probs.dtype))

    def _draw(self, probs: torch.Tensor, requests: list[SamplingState]) -> torch.Tensor:
        """A token per row, by the exponential race keyed from the shared generator, or from a seeded request's own."""
        row_keys = keys(len(requests), self.generator, probs.device)
        for i, r in enumerate(requests):
            if r.params.seed is not None:  # its draws never depend on the batch: the shared key is left unused
                row_keys[i] = keys(1, self._generator_for(r), probs.device)[0]
        return exponential_race(probs, row_keys)

    def _uniform(self, rows: list[Row], device: torch.device) -> torch.Tensor:
        """A uniform draw per draft row, from the generator its token is drawn with (a seeded request's own, so what
        it samples never depends on whether others in the batch drafted)."""
        out = torch.rand(len(rows), generator=self.generator, device=device)
        for i, row in enumerate(rows):
            if row.request.params.seed is not None:
                out[i] = torch.rand(1, generator=self._generator_for(row.request), device=device)[0]
        return out

    def _generator_for(self, req: SamplingState) -> torch.Generator:
        """A seeded request's own RNG, made on the sampling device the first time it samples."""
        if req.generator is None:
            req.generator = torch.Generator(device=self.device).manual_seed(req.params.seed)
        return req.generator
