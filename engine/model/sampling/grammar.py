"""Constrained decoding: each request with a grammar gets an llguidance matcher that allows only the tokens
keeping its output inside the grammar (a JSON schema, Lark or a regex, compiled by the gateway).

A grammar is compiled once (a large one takes a second or more) and each request constrained by it gets a copy of
that matcher (`deep_copy`, microseconds). The engine process compiles a served request's grammar in a thread before
the request reaches the scheduler (engine/ipc/grammar_gate.py); the sampler compiles only what comes without a
matcher (the offline API, a pipeline's last stage), keeping a few compiled grammars for the requests that share them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import llguidance
import torch

from engine.model.sampling.state import SamplingState

_BITS = torch.arange(32, dtype=torch.int32)


class _TokenTable:
    """What llguidance.TokenizerWrapper reads: every id's bytes, the special ids, eos/bos, and encode."""

    def __init__(self, tokenizer) -> None:
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = sorted(tokenizer.special_token_ids)
        self._encode = tokenizer.encode

    def __call__(self, text: str) -> list[int]:
        return self._encode(text)


class GrammarError(RuntimeError):
    """A request's matcher is in error (a grammar the gateway did not check, or a token it refused): the request
    fails rather than sampling unconstrained."""


class GrammarCompiler:
    """Grammar text -> a fresh matcher, safe to call from several threads (llguidance drops the GIL while it builds)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ll: llguidance.LLTokenizer | None = None  # built on first use: it walks the whole vocabulary
        self._lock = threading.Lock()

    def warm_up(self) -> None:
        """Build the token table now. It holds the GIL (a quarter of a second for 49k tokens): an engine process
        does it at startup rather than in a compile thread beside its first constrained step."""
        with self._lock:
            if self._ll is None:
                self._ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenTable(self._tokenizer)))

    def compile(self, grammar: str) -> llguidance.LLMatcher:
        """A matcher in its start state; in error (is_error) when the grammar is invalid, never raising for that."""
        self.warm_up()
        return llguidance.LLMatcher(self._ll, grammar, log_level=0)


class GrammarMasks:
    """Masks the logits of constrained requests before sampling, and advances their matchers after it."""

    KEPT_GRAMMARS = 8  # compiled grammars kept for the requests that come without a matcher and share one

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._compiler = GrammarCompiler(tokenizer)
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()  # grammar -> matcher in start state

    def _matcher(self, req: SamplingState) -> llguidance.LLMatcher:
        if req.matcher is None:
            grammar = req.params.grammar
            start = self._compiled.pop(grammar, None) or self._compiler.compile(grammar)
            self._compiled[grammar] = start  # most recent last
            while len(self._compiled) > self.KEPT_GRAMMARS:
                self._compiled.popitem(last=False)
            req.matcher = start.deep_copy()
            # Outputs it had before it was added (sampled elsewhere), the new matcher catches up on.
            req.matcher.consume_tokens(req.output_token_ids)
        return req.matcher

    def apply(self, logits: torch.Tensor, rows: list) -> set[int]:
        """Set the logits of tokens each constrained request may not take next to -inf, in place. `rows` are the
        sampler's (engine/model/sampling/sampler.py): a row after draft tokens is masked as the grammar stands after them.
        Returns the rows whose draft token the grammar refuses: the rows after it are left unmasked, so it must never
        be accepted (a mask can allow what the matcher refuses, as the end of text once it has stopped, and a row with
        nothing allowed takes its argmax fallback, which may be the draft)."""
        rows = [(i, row) for i, row in enumerate(rows) if row.request.params.grammar is not None]
        refused: set[int] = set()
        if not rows:
            return refused
        # A bit per token, 1 = allowed. (llguidance.torch has helpers for this, but importing it runs a torch.compile
        # decorator, which would slow every engine start.)
        bitmask = torch.full((len(rows), (self._tokenizer.vocab_size + 31) // 32), -1, dtype=torch.int32)
        consumed: dict[int, int] = {}  # per request (by id()): draft tokens its matcher took to mask the rows after
        try:
            for j, (i, row) in enumerate(rows):
                req = row.request
                matcher = self._matcher(req)
                if matcher.is_error():  # the executor samples the others alone, and this one fails with the reason
                    raise GrammarError(
                        f"request {req.request_id}'s grammar failed: {matcher.get_error().strip()[:500]}"
                    )
                if consumed.get(id(req), 0) < len(row.drafted):
                    continue  # a draft token before this row is not allowed: it is rejected there, this row never counts
                matcher.unsafe_compute_mask_ptr(bitmask[j].data_ptr(), bitmask.shape[1] * 4)
                if row.draft_id >= 0:
                    taken = matcher.try_consume_tokens([row.draft_id])
                    consumed[id(req)] = consumed.get(id(req), 0) + taken
                    if not taken:
                        refused.add(i)
        finally:  # back to where the step started, raised or not: finish() (or a retry alone) takes it from there
            for _, row in rows:
                n = consumed.pop(id(row.request), 0)
                if n:
                    row.request.matcher.rollback(n)
        allowed = ((bitmask.unsqueeze(-1) >> _BITS) & 1).flatten(1)[:, : logits.shape[1]].bool()
        if allowed.shape[1] < logits.shape[1]:  # ids past the tokenizer's vocabulary are never allowed
            allowed = torch.nn.functional.pad(allowed, (0, logits.shape[1] - allowed.shape[1]))
        index = torch.tensor([i for i, _ in rows], device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed.to(logits.device), float("-inf"))
        return refused

    def advance(self, requests: list[SamplingState], tokens: list[list[int]]) -> None:
        for req, ids in zip(requests, tokens):
            for token in ids:
                if req.params.grammar is None or req.matcher is None or req.matcher.is_stopped():
                    break
                req.matcher.consume_token(token)
