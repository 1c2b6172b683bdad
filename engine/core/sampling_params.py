"""How to pick each next token of one request, and when to stop."""

from __future__ import annotations

import msgspec

MAX_LOGPROBS = 20
GREEDY_BELOW = 1e-5  # temperatures under this sample greedily


class InvalidRequestError(ValueError):
    """A request the engine can never serve as asked; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """Per-request sampling settings (OpenAI and vLLM semantics)."""

    max_tokens: int = 16  # most tokens to generate
    min_tokens: int = 0  # eos and stop ids are masked until this many are generated
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 = all
    top_p: float = 1.0  # keep the smallest set with this much probability mass
    min_p: float = 0.0  # drop tokens below min_p * p(most likely)
    seed: int | None = None  # same seed -> same tokens, whatever else is in the batch
    presence_penalty: float = 0.0  # OpenAI: subtract once per token already generated
    frequency_penalty: float = 0.0  # OpenAI: subtract per occurrence in the output
    repetition_penalty: float = 1.0  # HF/CTRL: scale logits of prompt and output tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    stop_token_ids: tuple[int, ...] = ()  # extra ids that end the request
    ignore_eos: bool = False  # keep generating past eos
    logprobs: int | None = None  # return this many top logprobs per token (and the chosen one's)
    prompt_logprobs: int | None = None  # each prompt token's logprob (the first has none) and this many top ones
    grammar: str | None = None  # an llguidance grammar the output must match (from a JSON schema, Lark or a regex)
    prompt_only: bool = False  # the API's max_tokens 0: score the prompt; its one sampled token is no output
    pooling: str = ""  # "last" or "mean": an embedding of the prompt's final hidden states (with prompt_only)

    def __post_init__(self) -> None:
        checks = [
            (self.max_tokens >= 1, "max_tokens", "must be at least 1"),
            (not self.prompt_only or self.max_tokens == 1, "max_tokens", "must be 1 for a prompt-only request"),
            (self.pooling in ("", "last", "mean"), "pooling", "must be last or mean"),
            (not self.pooling or self.prompt_only, "pooling", "needs a prompt-only request"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens", "must be between 0 and max_tokens"),
            (0.0 <= self.temperature <= 2.0, "temperature", "must be between 0 and 2"),
            (self.top_k >= -1, "top_k", "must be -1, 0 or positive"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be between -2 and 2"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be between -2 and 2"),
            (0.0 < self.repetition_penalty <= 2.0, "repetition_penalty", "must be in (0, 2]"),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                "logprobs",
                f"must be between 0 and {MAX_LOGPROBS}",
            ),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                "prompt_logprobs",
                f"must be between 0 and {MAX_LOGPROBS}",
            ),
            (
                all(-100.0 <= b <= 100.0 for b in (self.logit_bias or {}).values()),
                "logit_bias",
                "values must be between -100 and 100",
            ),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequestError(f"{param} {message}", param)

    @property
    def output_room(self) -> int:
        """Tokens the context window must hold after the prompt: max_tokens, none for a prompt-only request (the
        token sampled after the prompt is never computed)."""
        return 0 if self.prompt_only else self.max_tokens

    @property
    def greedy(self) -> bool:
        # Dividing logits by a temperature this small overflows float32; it means greedy anyway (as in vLLM).
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def check_vocab(self, vocab_size: int) -> None:
        """Reject token ids the model does not have."""
        for param, ids in (("logit_bias", self.logit_bias or {}), ("stop_token_ids", self.stop_token_ids)):
            bad = [i for i in ids if not 0 <= i < vocab_size]
            if bad:
                raise InvalidRequestError(f"{param} has token ids outside [0, {vocab_size}): {bad[:5]}", param)
