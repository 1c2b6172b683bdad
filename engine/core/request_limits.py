"""What a request may ask of an engine: checked by the engine on arrival and by the gateway before sending."""

from __future__ import annotations

import msgspec

from engine.core.sampling_params import InvalidRequestError, SamplingParams


class RequestLimits(msgspec.Struct, frozen=True, array_like=True):
    """The engine's model and KV cache, as far as admitting a request is concerned."""

    max_model_len: int  # prompt + max_tokens may not exceed this
    vocab_size: int  # token ids are in [0, vocab_size)
    num_kv_blocks: int  # a request must fit in the whole KV cache
    block_size: int  # tokens per KV block
    max_held_tokens: int = 0  # with a sliding window on every layer, the most tokens' K/V a request holds at once

    def check(self, prompt_token_ids: list[int], params: SamplingParams, param: str = "prompt") -> None:
        """Raise InvalidRequestError (naming `param`) for a request that can never run."""
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty", param)
        if any(not 0 <= t < self.vocab_size for t in prompt_token_ids):
            raise InvalidRequestError(f"prompt has token ids outside [0, {self.vocab_size})", param)
        total = n + params.output_room
        if total > self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{total} tokens ({n} in the prompt, {params.output_room} for the completion). "
                "Please reduce the prompt or max_tokens.",
                param,
            )
        held = min(total, self.max_held_tokens) if self.max_held_tokens else total
        if -(-held // self.block_size) > self.num_kv_blocks:
            raise InvalidRequestError("the request needs more KV cache than the server has", param)
        params.check_vocab(self.vocab_size)
