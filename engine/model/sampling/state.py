"""What the sampler keeps per request between its steps: one registry in the sampler, wherever it runs (this
process, or a pipeline's last stage), so no executor keeps a copy of the scheduler's Request."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.core.sampling_params import SamplingParams


@dataclass(eq=False)
class SamplingState:
    """A request as sampling sees it: its settings and context (penalties, min_tokens and a grammar read them), and
    the generator and grammar matcher that carry on from one of its steps to the next."""

    request_id: str
    prompt_token_ids: list[int]  # repetition penalties look at the prompt
    params: SamplingParams
    stop_token_ids: frozenset[int]  # what min_tokens masks (eos unless ignored, and the request's own)
    output_token_ids: list[int] = field(default_factory=list)  # every token sampled for it, accepted drafts included
    generator: torch.Generator | None = None  # a seeded request's own RNG, made on the sampling device at first use
    matcher: object | None = None  # a constrained request's llguidance matcher (or the sampler compiles one)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)
