"""The offline API: `LLM(...).generate(prompts, params)` runs every prompt through the scheduler at once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Self

from tqdm import tqdm

from engine.core.config import EngineConfig
from engine.core.request import Request, RequestOptions, TokenLogprobs
from engine.core.sampling_params import SamplingParams
from engine.launch import build_engine
from engine.model.loader import Checkpoint


@dataclass
class Completion:
    """One finished generation."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # 'stop' | 'length'
    logprobs: list[TokenLogprobs] | None = field(default=None)
    # With params.prompt_logprobs: one per prompt token, None for the first (nothing predicts it).
    prompt_logprobs: list[TokenLogprobs | None] | None = field(default=None)
    embedding: list[float] | None = field(default=None)  # with params.pooling: the pooled prompt, unnormalised


class LLM:
    """Load a model (the bundled default when `model` is None) and generate offline."""

    def __init__(self, model: str | None = None, checkpoint: Checkpoint | None = None, **config):
        self.engine = build_engine(EngineConfig(model=model, **config), checkpoint)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
        priority: list[int] | None = None,
        lora: list[str] | None = None,
    ) -> list[Completion]:
        """`priority`: one per prompt, lower admitted first under the `priority` scheduling policy (vLLM's); `lora`:
        one adapter name per prompt ("" for the base model), of those loaded with `lora=("NAME=PATH", ...)`."""
        if isinstance(params, list) and len(params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError("give one priority per prompt")
        if lora is not None and len(lora) != len(prompts):
            raise ValueError("give one adapter name per prompt")
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        requests = [
            self.engine.add_request(
                self._ids(p),
                sp,
                RequestOptions(priority=priority[i] if priority else 0, lora=lora[i] if lora else ""),
            )
            for i, (p, sp) in enumerate(zip(prompts, params_list))
        ]
        with tqdm(total=len(requests), disable=not use_tqdm, desc="generating") as bar:
            while self.engine.has_unfinished():
                bar.update(sum(r.status.finished for r in self.engine.step()))
        return [self._completion(r) for r in requests]

    def close(self) -> None:
        """Stop pipeline stage processes, if any (they also exit on their own when this process does)."""
        self.engine.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> Completion:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate([self.tokenizer.encode(prompt)], params)[0]  # the template writes any BOS itself

    def _ids(self, prompt: str | list[int]) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else list(prompt)

    def _completion(self, req: Request) -> Completion:
        outputs = [] if req.params.prompt_only else list(req.output_token_ids)  # the prompt's scores only
        shown = outputs[:-1] if req.finish_reason == "stop" else outputs  # the stop token's text is not the output's
        text = self.tokenizer.decode(shown, skip_special_tokens=True) if self.tokenizer else ""
        return Completion(
            req.prompt_token_ids,
            outputs,
            text,
            req.finish_reason,
            list(req.output_logprobs)[: len(outputs)] if req.params.logprobs is not None else None,
            [None, *req.prompt_logprobs] if req.params.prompt_logprobs is not None else None,
            req.embedding,
        )
