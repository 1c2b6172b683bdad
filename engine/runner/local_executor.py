"""Runs scheduled batches in this process, one at a time: build the model, size the KV cache, run and sample."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from engine.core.batch import Batch
from engine.core.config import EngineConfig, FaultPlan
from engine.core.executor import PromptLogprobs, Sampled
from engine.core.request import Failure, Request, SampledTokens
from engine.model.cuda_token_ops import cuda_norm_available, cuda_rope_available, use_cuda_rms_norm, use_cuda_rotary
from engine.model.decoder import Decoder, SkippedInit
from engine.model.families import model_class
from engine.model.loader import Checkpoint
from engine.model.lora import LoraAdapter, LoraSlots, read_adapter
from engine.model.output_buffer import OutputBuffer
from engine.model.packed_linear import can_pack, pack_linears
from engine.model.quantized import BlockLinear, can_use_blocks, use_block_weights
from engine.model.sampling.sampler import DeviceSample, Sampler
from engine.model.sampling.state import SamplingState
from engine.model.sharding import WHOLE, TensorShard
from engine.model.token_ops import Rotary, can_fuse, fuse_token_ops
from engine.runner.check_in_steps import run_steps
from engine.runner.device import DeviceError, block_weights, int16_activations
from engine.runner.model_runner import ModelRunner
from engine.runner.prompt_logprobs import DevicePromptLogprobs


def build_model(
    ckpt: Checkpoint, max_position: int, config: EngineConfig, span: range | None = None, shard: TensorShard = WHOLE
) -> Decoder:
    """The model (or one stage's span of it, or one rank's shard) on the configured device and dtype, with the
    checkpoint's weights."""
    device, dtype = torch.device(config.device), getattr(torch, config.dtype)
    with torch.device("meta"), SkippedInit():
        model = model_class(ckpt.shape)(ckpt.shape, max_position, span, shard)
    # Allocate without torch's random init: every parameter is overwritten next. Untouched, the allocation holds no
    # memory: the layers swapped for the file's blocks below are never written, so never take their float32 size.
    # (Module.to_empty would call empty_like on meta tensors, whose Python reference imports sympy at every start.)
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    model.materialize_buffers()
    blocks = block_weights(config, bool(ckpt.blocks)) and shard.size == 1 and can_use_blocks(device)
    swapped = use_block_weights(model, ckpt.blocks, int16=int16_activations(config)) if blocks else set()
    if isinstance(getattr(model, "lm_head", None), BlockLinear):
        # The logits of a large vocabulary outgrow what malloc recycles; every caller of the runner samples a step's
        # logits before it runs the next step.
        model.lm_head.output = OutputBuffer()
    if ckpt.weights:
        model.load_weights(ckpt.weights, skip=swapped)  # the swapped layers' tensors are never even dequantized
    else:
        model.init_random(config.seed)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    for table in {m for m in model.modules() if isinstance(m, Rotary)}:
        table.to(dtype)  # computed in float32, read in the compute dtype
    if config.batch_invariant:
        if not can_use_blocks(device):
            raise DeviceError(
                "--batch-invariant needs the CPU block matmul (engine/kernels/csrc/cpu/block_matmul.cpp) to build"
            )
        use_block_weights(model, {}, dense_too=True)  # every other linear layer through the same row-wise sums
    elif can_pack(device, dtype):
        pack_linears(model)
    # The token ops fuse in float32 too where the block weights run (PyTorch's float32 ops stay with dense weights,
    # the reference): one pass per row, which no batch changes. can_fuse asks about bfloat16, as it only knows it.
    if can_fuse(device, torch.bfloat16 if blocks or config.batch_invariant else dtype) and dtype != torch.float16:
        fuse_token_ops(model)
    elif config.batch_invariant:
        raise DeviceError(
            "--batch-invariant needs the fused CPU token ops (engine/kernels/csrc/cpu/token_ops.cpp) in "
            "float32 or bfloat16"
        )
    if device.type == "cuda" and cuda_rope_available():
        use_cuda_rotary(model)  # one kernel for RoPE and the cache write, eagerly and inside compiled segments
    if device.type == "cuda" and cuda_norm_available():
        use_cuda_rms_norm(model)  # one kernel a norm (with its residual add), eagerly and inside compiled segments
    return model.eval().requires_grad_(False)


class LocalExecutor:
    """The whole model in this process: each batch runs and samples as it is submitted.

    With async scheduling two batches may be in flight: the next is submitted before this one's sampled ids
    reach the host, and its rows scheduled ahead read those ids on the device.
    """

    def __init__(self, config: EngineConfig, ckpt: Checkpoint, max_model_len: int):
        self.config = config
        self.model = build_model(ckpt, max_model_len, config)
        # LoRA: the projections wrapped before the runner sizes the KV cache (their slots take memory too).
        self.lora = LoraSlots(self.model, config.max_loras, config.max_lora_rank) if config.lora_enabled else None
        self.adapters: dict[str, LoraAdapter] = {}  # on the host, by name
        # The runner sizes the KV cache after the weights and the piecewise graphs: it takes what they leave.
        self.runner = ModelRunner(config, self.model, None, max_model_len)
        self.runner.lora = self.lora
        self.num_blocks = self.runner.num_blocks
        self.max_in_flight = 2 if config.async_scheduling == "on" else 1
        self.max_steps = config.check_in_steps
        self.max_model_len = max_model_len
        self.sampler = Sampler(config.seed, torch.device(config.device), ckpt.tokenizer)
        # Each batch in flight: its sample, prompt logprobs and length probes' hidden states.
        self.done: deque[tuple[Batch, DeviceSample | Sampled, DevicePromptLogprobs | None, dict, dict]] = deque()
        # The newest batch's sampled ids on the device, and each request's row in them: what rows scheduled ahead
        # of their token read.
        self.previous: tuple[torch.Tensor, dict[str, int]] | None = None
        self.faults = config.faults or FaultPlan()
        self.num_submitted = 0

    @property
    def num_in_flight(self) -> int:
        return len(self.done)

    def submit(self, batch: Batch, sampling: list[Request]) -> None:
        """Run and sample; what raises fails only the requests it can be traced to, and the engine goes on."""
        self.num_submitted += 1
        for req in sampling:
            if req.request_id not in self.sampler.states:
                self.sampler.add(
                    SamplingState(
                        req.request_id,
                        req.prompt_token_ids,
                        req.params,
                        req.stop_token_ids,
                        list(req.output_token_ids),
                        matcher=req.matcher,
                    )
                )
        ids = [req.request_id for req in sampling]
        previous, self.previous = self.previous, None
        # Its block-table changes first, whatever fails next: the batches after it carry only theirs.
        self.runner.input_batch.apply(batch)
        if batch.num_steps > 1:
            self._run_steps(batch, previous)
            return
        try:
            self.faults.at_forward(self.num_submitted)
            logits = self.runner.run(batch, previous=previous)
        except Exception as e:
            if self.runner.device.type == "cuda":
                raise  # a failed kernel may leave the device or the KV cache in doubt: the engine restarts
            failed = {request_id: Failure(f"the forward pass failed: {e!r}") for request_id in batch.request_ids}
            self.runner.pooler.forget(failed)
            self.done.append((batch, failed, None, {}, {}))
            return
        drafts = batch.sampling_drafts
        result = self._sample_isolated(logits, ids, drafts)
        if isinstance(result, DeviceSample):
            # A row scheduled ahead reads its request's token, from a step that drafted nothing for it.
            self.previous = result.tokens, dict(zip(ids, result.last_rows))
        else:  # sampled request by request: the survivors' ids go back to the device
            tokens = [t.token_ids[-1] if isinstance(t, SampledTokens) else 0 for t in (result[i] for i in ids)]
            self.previous = torch.tensor(tokens, device=self.runner.device), {i: row for row, i in enumerate(ids)}
        self.done.append((batch, result, self.runner.prompt_logprobs, self.runner.probed_hidden, self.runner.pooled))

    def _run_steps(self, batch: Batch, previous: tuple[torch.Tensor, dict[str, int]] | None) -> None:
        """Several decode steps before the next check-in (engine/runner/check_in_steps.py); the first step's length
        probes go back with the tokens. Nothing runs ahead of such a batch, so no row reads its tokens here."""
        probed: dict[str, list[float]] = {}

        def forward(rows: Batch, first: bool) -> torch.Tensor | Failure:
            nonlocal probed
            try:
                if first:
                    self.faults.at_forward(self.num_submitted)
                logits = self.runner.run(rows, previous=previous if first else None)
            except Exception as e:
                if self.runner.device.type == "cuda":
                    raise  # as in submit: the engine restarts
                return Failure(f"the forward pass failed: {e!r}")
            if first:
                probed = self.runner.probed_hidden
            return logits

        def sample(logits: torch.Tensor, ids: list[str]) -> Sampled:
            result = self._sample_isolated(logits, ids, [[] for _ in ids])
            return self.sampler.finish(result) if isinstance(result, DeviceSample) else result

        sampled = run_steps(batch, forward, sample, self.sampler.states, self.max_model_len)
        self.done.append((batch, sampled, None, probed, {}))  # a run never pools: no prompt rows

    def _sample_isolated(self, logits: torch.Tensor, ids: list[str], drafts: list[list[int]]) -> DeviceSample | Sampled:
        return sample_isolated(self.sampler, logits, ids, drafts, self.faults.at_sampling)

    def collect(self) -> tuple[Batch, Sampled, PromptLogprobs]:
        batch, result, prompt, probed, pooled = self.done.popleft()
        sampled = self.sampler.finish(result) if isinstance(result, DeviceSample) else result
        attach_hidden(sampled, probed)
        attach_embeddings(sampled, pooled)
        return batch, sampled, prompt.finish() if prompt is not None else {}

    def release(self, request_ids: list[str]) -> None:
        self.sampler.release(request_ids)
        self.runner.pooler.forget(request_ids)  # an embedding request aborted part-way through its prompt

    def describe(self) -> str:
        return self.runner.describe()

    def add_lora(self, name: str, path: str) -> None:
        heads = self.model.layers[0].shape.num_heads, self.model.layers[0].shape.num_kv_heads
        adapter = read_adapter(path, len(self.model.layers), self.config.max_lora_rank, heads)
        self.lora.check(adapter)
        self.adapters[name] = adapter

    def load_lora(self, slot: int, name: str) -> None:
        self.lora.load(slot, self.adapters[name])

    def remove_lora(self, name: str) -> None:
        self.adapters.pop(name, None)

    def close(self) -> None:
        pass


def sample_isolated(
    sampler: Sampler,
    logits: torch.Tensor,
    ids: list[str],
    drafts: list[list[int]],
    check: Callable[[list[list[int]]], None],
) -> DeviceSample | Sampled:
    """The batch's sample; where it raises, each request samples alone and only the one that raised gets a Failure.
    `check` (the fault plan's) sees each sample's prompts after its generators moved."""

    def one_sample(rows: torch.Tensor, request_ids: list[str], request_drafts: list[list[int]]) -> DeviceSample:
        sample = sampler.sample(rows, request_ids, request_drafts)
        check([r.prompt_token_ids for r in sample.requests])
        return sample

    restore = sampler.save_rng(ids)
    try:
        return one_sample(logits, ids, drafts)
    except Exception:
        # Who raised? Each request samples alone, its generator back where it was; the others get their tokens.
        restore()
        out: Sampled = {}
        start = 0
        for request_id, draft in zip(ids, drafts):
            rows, start = logits[start : start + len(draft) + 1], start + len(draft) + 1
            try:
                out.update(sampler.finish(one_sample(rows, [request_id], [draft])))
            except Exception as e:
                out[request_id] = Failure(f"sampling failed: {e!r}")
        return out


def attach_hidden(sampled: Sampled, probed: dict[str, list[float]]) -> None:
    """Each probed request's hidden state goes back with its tokens (one that failed has none to carry it)."""
    for request_id, hidden in probed.items():
        tokens = sampled.get(request_id)
        if isinstance(tokens, SampledTokens):
            tokens.hidden = hidden


def attach_embeddings(sampled: Sampled, pooled: dict[str, list[float]]) -> None:
    """Each embedding request's pooled prompt goes back with its (dropped) sampled token."""
    for request_id, embedding in pooled.items():
        tokens = sampled.get(request_id)
        if isinstance(tokens, SampledTokens):
            tokens.embedding = embedding
