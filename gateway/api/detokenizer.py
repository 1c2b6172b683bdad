"""Streaming detokenization of one generated sequence: UTF-8-safe pieces, stop strings, token offsets."""

from __future__ import annotations

import codecs
from collections.abc import Iterable

from engine.model.tokenizer import Tokenizer

_Utf8Decoder = codecs.getincrementaldecoder("utf-8")


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """A token's text for logprobs: its text if its bytes are valid UTF-8, else OpenAI's "bytes:\\xNN..." form.

    Special tokens show their literal text; ids outside the vocabulary (dummy models) have none.
    """
    if not 0 <= token_id < tokenizer.vocab_size:
        return ""
    data = tokenizer.token_bytes(token_id)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


class IncrementalDetokenizer:
    """Turns the tokens of one sequence (one choice) into text as they come, safe to stream.

    `push` returns only text that is final: an incomplete trailing UTF-8 sequence waits for its remaining bytes
    (bytes that can never complete become U+FFFD exactly as a one-shot `decode(errors="replace")` makes them, the
    incremental decoder being consistent with it), and a suffix that could still grow into a stop string waits
    until it either does (the text is cut before the stop string) or diverges (it is released). Each call costs
    O(new bytes + longest stop string), never the whole history.

    Stop strings are matched in order of completion, as streaming demands (and as vLLM does): the first token that
    completes any stop string ends the sequence, cutting at the earliest occurrence among those it completed. None
    ends it before `min_tokens` tokens: an occurrence must end in the text of a later token (as vLLM's).
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        stop: Iterable[str] = (),
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer  # None (a dummy model served without one): no text, token ids and counts only
        self.stop = tuple(dict.fromkeys(s for s in stop if s))  # empty strings would match everywhere: ignored
        self.min_tokens = min_tokens
        self.skip_special_tokens = skip_special_tokens
        self._skip = tokenizer.special_token_ids if tokenizer is not None and skip_special_tokens else frozenset()
        self._max_hold = max((len(s) for s in self.stop), default=1) - 1
        self._first_chars = frozenset(s[0] for s in self.stop)
        self._decoder = _Utf8Decoder(errors="replace")
        self._pending = ""  # decoded text not yet emitted (a possible stop-string start)
        self._decoded_len = 0  # characters decoded so far: emitted + pending
        self._pieces: list[str] = []  # emitted text
        self._offsets: list[int] = []
        self.stopped = False
        self.finished = False

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def num_tokens(self) -> int:
        """Tokens taken so far (up to and including the one that completed a stop string)."""
        return len(self._offsets)

    @property
    def token_offsets(self) -> list[int]:
        """For each token taken, the character offset in the text where it starts.

        That is the length of the text fully decoded before the token. A token that starts in the middle of a
        character (its first bytes complete one begun by earlier tokens) gets that character's start, so it shares
        an offset with the token that began the character; a token that completes no character (a lone lead byte,
        a skipped special token) starts where the next one does. Offsets of tokens past a stop cut may exceed
        `len(text)`.
        """
        return self._offsets

    def push(self, token_ids: list[int], ends_with_stop_token: bool = False) -> str:
        """Take newly generated tokens; return the text now safe to emit ("" once stopped).

        `ends_with_stop_token`: the last one is the eos or stop token id that ended the sequence; it is taken (counted,
        with an offset) but its text is not the choice's, as in vLLM's output, whether or not it is a special token.
        """
        if self.stopped:
            return ""
        if self.finished:
            raise RuntimeError("push() after flush()")
        if self.tokenizer is None:
            self._offsets += [0] * len(token_ids)
            return ""
        shown = token_ids[:-1] if ends_with_stop_token else token_ids
        vocab_size, token_bytes, skip = self.tokenizer.vocab_size, self.tokenizer.token_bytes, self._skip
        for token_id in shown:
            self._offsets.append(self._decoded_len)
            if 0 <= token_id < vocab_size and token_id not in skip:
                chunk = self._decoder.decode(token_bytes(token_id))
                if chunk and self._take(chunk):
                    return self._emit(self._pending)
        if len(shown) < len(token_ids):
            self._offsets.append(self._decoded_len)
        held = self._held_len()
        out = self._pending[: len(self._pending) - held]
        self._pending = self._pending[len(self._pending) - held :]
        return self._emit(out)

    def flush(self) -> str:
        """End the sequence: return everything still held back (an incomplete character becomes U+FFFD)."""
        if self.finished or self.stopped:
            self.finished = True
            return ""
        self.finished = True
        chunk = self._decoder.decode(b"", final=True)
        if chunk:
            self._take(chunk)
        out, self._pending = self._pending, ""
        return self._emit(out)

    def _take(self, chunk: str) -> bool:
        """Append decoded text; on a completed stop string, cut `_pending` before it and return True."""
        start = max(0, len(self._pending) - self._max_hold)  # earlier occurrences were found by earlier calls
        self._pending += chunk
        self._decoded_len += len(chunk)
        if not self.stop or len(self._offsets) <= self.min_tokens:
            return False
        cut = min((i for i in (self._pending.find(s, start) for s in self.stop) if i >= 0), default=-1)
        if cut < 0:
            return False
        self._pending = self._pending[:cut]
        self.stopped = True
        return True

    def _held_len(self) -> int:
        """Length of the longest suffix of `_pending` that is a proper prefix of some stop string."""
        pending, n = self._pending, len(self._pending)
        for i in range(max(0, n - self._max_hold), n):  # earliest start first: the longest suffix
            if pending[i] in self._first_chars and any(
                len(s) > n - i and pending.startswith(s[: n - i], i) for s in self.stop
            ):
                return n - i
        return 0

    def _emit(self, out: str) -> str:
        if out:
            self._pieces.append(out)
        if self.stopped:
            self._pending = ""
        return out
