"""The scheduler -> runner contract: what one iteration computes, as msgspec structs (they cross processes)."""

from __future__ import annotations

import msgspec

# In a chunk scheduled ahead (async scheduling): the token the batch before samples for this request, which only
# the device knows yet; the executor puts it in place.
PLACEHOLDER = -1


class PromptLogprobRows(msgspec.Struct, array_like=True):
    """The rows of a chunk whose next prompt token's logprob its request asked for: rows first_row, first_row + 1,
    ... predict targets[0], targets[1], ..."""

    first_row: int  # within the chunk
    targets: list[int]  # the prompt tokens those rows predict
    num_top: int  # top alternatives per row


class ScheduledRequest(msgspec.Struct, array_like=True):
    """One request's share of an iteration: compute `token_ids` starting at `num_computed_tokens`; the last
    `num_draft` of them are draft tokens the step verifies (speculative decoding)."""

    request_id: str
    token_ids: list[int]  # the last may be PLACEHOLDER
    num_computed_tokens: int  # the chunk's first position (tokens computed, or in a batch ahead of it)
    block_table: list[int]  # its request's blocks from `block_offset` on: those that batches before it did not carry
    sample: bool  # these tokens reach the end of what is known: sample the next one (after the accepted drafts)
    prompt_logprobs: PromptLogprobRows | None = None  # rows whose prompt logprobs the LM head computes too
    num_draft: int = 0  # draft tokens at the end of token_ids; the rows from the last known token on sample
    probe: bool = False  # return the final hidden state at its last known token (the length predictor reads it)
    # Where block_table starts in the request's table: the runners keep the blocks batches before it carried (0: the
    # whole table, the request's first batch or its table started again).
    block_offset: int = 0
    pooling: str = ""  # a prompt chunk of an embedding request: pool its rows ("last" or "mean")

    @property
    def num_logits_rows(self) -> int:
        """Rows whose logits sample or verify: the last known token's and each draft token's."""
        return self.num_draft + 1 if self.sample else 0

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_draft :]


class DecodeRows(msgspec.Struct, array_like=True):
    """A batch's plain decode rows as columns: each computes one token (known, or PLACEHOLDER) and samples the next;
    none drafts, probes, pools or asks for prompt logprobs. Only what changed travels: a row's position where it is not
    the one after its request's last row the runners saw, and the blocks no batch before carried."""

    request_ids: list[str] = []
    token_ids: list[int] = []
    # Rows (indices into request_ids) whose position is given, and those positions: the runners keep the others'.
    moved: list[int] = []
    positions: list[int] = []
    # Rows that bring blocks, where in their request's table those start, and the blocks.
    grown: list[int] = []
    block_offsets: list[int] = []
    blocks: list[list[int]] = []

    def __len__(self) -> int:
        return len(self.request_ids)


class Batch(msgspec.Struct):
    """The scheduler -> runner contract for one iteration: the rows of `requests`, then those of `decode`."""

    requests: list[ScheduledRequest]
    lora_slots: list[int] | None = None  # each request's LoRA slot (-1: the base model); None: no adapters served
    # Decode steps to run before the next check-in, each row's sampled token fed back as its next input (see
    # engine/core/check_ins.py); a row stops early at a stop token, max_tokens or the context window.
    num_steps: int = 1
    # Requests finished, aborted or preempted since the batch before: their rows in the runners' persistent batch go.
    dropped: list[str] = []
    decode: DecodeRows = msgspec.field(default_factory=DecodeRows)  # plain decode rows, after those of `requests`

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests) + len(self.decode.request_ids)

    def __len__(self) -> int:
        return len(self.requests) + len(self.decode.request_ids)

    @property
    def request_ids(self) -> list[str]:
        """Every row's request, in row order."""
        return [r.request_id for r in self.requests] + self.decode.request_ids

    @property
    def sampling_ids(self) -> list[str]:
        """The requests that sample, in the order of their logits rows."""
        return [r.request_id for r in self.requests if r.sample] + self.decode.request_ids

    @property
    def sampling_drafts(self) -> list[list[int]]:
        """Each sampling request's draft tokens, as `sampling_ids` orders them."""
        return [r.draft_token_ids for r in self.requests if r.sample] + [[] for _ in self.decode.request_ids]
