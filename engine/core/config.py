"""Frozen configuration: the model's shape and the engine's knobs."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal


@dataclass(frozen=True)
class ModelShape:
    """Dimensions of a decoder, and the small ways its families differ."""

    family: str = "llama"  # the engine/model/families module that builds it (its registry key)
    vocab_size: int = 49152  # rows of the embedding and the LM head
    hidden_size: int = 576  # width of the residual stream
    intermediate_size: int = 1536  # width of the SwiGLU MLP
    num_layers: int = 30  # decoder blocks
    num_heads: int = 9  # query heads
    num_kv_heads: int = 3  # key/value heads (grouped-query attention)
    head_dim: int = 64  # per-head width
    rope_theta: float = 100000.0  # RoPE base frequency
    rms_norm_eps: float = 1e-5  # RMSNorm epsilon
    max_position: int = 8192  # context window the model was trained for
    tie_word_embeddings: bool = True  # LM head shares the embedding matrix
    qkv_bias: bool = False  # Qwen2: biases on the Q, K and V projections
    # Llama 3.1 and later: each RoPE frequency's divisor (a GGUF's rope_freqs, or from config.json's rope_scaling)
    rope_freq_factors: tuple[float, ...] | None = None
    sliding_window: int | None = None  # keys a windowed layer's query sees, its own included (Mistral, Gemma)
    sliding_layers: tuple[bool, ...] | None = None  # which layers are windowed; None: all, when there is a window
    attn_scale: float | None = None  # multiplies q.k; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_logit_softcap: float | None = None  # attention scores become cap * tanh(score / cap) (Gemma 2)
    final_logit_softcap: float | None = None  # the logits likewise (Gemma 2)
    rope_local_theta: float | None = None  # the windowed layers' RoPE base (Gemma 3); None: rope_theta
    # LongRoPE (Phi-3's long-context models): from position rope_long_from on the divisors are these, not
    # rope_freq_factors (the short ones); every cos and sin is multiplied by rope_attention_factor
    rope_long_factors: tuple[float, ...] | None = None
    rope_long_from: int | None = None
    rope_attention_factor: float = 1.0

    def is_sliding(self, layer: int) -> bool:
        return bool(self.sliding_window) and (self.sliding_layers is None or self.sliding_layers[layer])

    @property
    def kv_window(self) -> int | None:
        """The window of every layer, when all have one: then no request needs its K/V from before it."""
        if self.sliding_window and all(self.is_sliding(i) for i in range(self.num_layers)):
            return self.sliding_window
        return None

    @property
    def num_params(self) -> int:
        h, i, v, d = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        attn += (self.num_heads + 2 * self.num_kv_heads) * d if self.qkv_bias else 0
        per_layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * per_layer + h + head


# Named shapes for dummy weights: benchmarks need no checkpoint, only the right sizes.
DUMMY_SHAPES: dict[str, ModelShape] = {
    "smollm2-135m": ModelShape(),
    # Small enough for tests of every parallel layout (its heads split 2 and 4 ways), with SmolLM2's vocabulary.
    "tiny": ModelShape(hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                       head_dim=32, max_position=2048),
    "llama-1b": ModelShape(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
        num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500000.0, max_position=131072,
    ),
    "llama-8b": ModelShape(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0, max_position=131072,
        tie_word_embeddings=False,
    ),
}


class InjectedFault(RuntimeError):
    """Raised where a FaultPlan says, so tests can see what one failure takes down."""


@dataclass(frozen=True)
class FaultPlan:
    """Failures a test injects into a running engine, to check that each fails only what it should."""

    sampler_token: int | None = None  # sampling raises for any request whose prompt holds this token id
    runner_iterations: tuple[int, ...] = ()  # the forward pass raises on these iterations (1 = the first)
    publish_token: int | None = None  # the engine process raises publishing any request whose prompt holds this id

    # One check per injection point, called there; with no plan (FaultPlan()) each is a no-op.
    def at_forward(self, iteration: int) -> None:
        if iteration in self.runner_iterations:
            raise InjectedFault(f"injected into the forward pass of iteration {iteration}")

    def at_sampling(self, prompts: list[list[int]]) -> None:
        if self.sampler_token is not None and any(self.sampler_token in p for p in prompts):
            raise InjectedFault("injected into sampling")

    def at_publish(self, prompt: list[int]) -> None:
        if self.publish_token is not None and self.publish_token in prompt:
            raise InjectedFault("injected into publishing")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to know before it loads a model."""

    model: str | None = None  # GGUF file, HF checkpoint dir, or "dummy:NAME"; None = bundled default
    device: str = "auto"  # torch device the model runs on; "auto" = cuda when torch sees a GPU, else cpu
    dtype: str = "auto"  # compute dtype of weights and activations; "auto" = bfloat16 on a GPU, float32 on the CPU
    block_size: int = 16  # tokens per KV cache block
    # "gguf": the projections multiply by a GGUF file's quantized blocks as stored (CPU only; exactly the float32
    # model's weights); "dense": by float weights in the compute dtype; auto = gguf on the CPU where the file has them
    weights: Literal["auto", "dense", "gguf"] = "auto"
    # what those block matmuls multiply Q4_0/Q4_1/Q8_0 blocks by: the activations rounded to int16 per 32 inputs
    # (integer sums, AVX-512 VNNI or AVX2), or float32 exactly; auto = int16 where the CPU has either
    block_activations: Literal["auto", "int16", "float32"] = "auto"
    # a request's tokens and logprobs do not depend on what else is in the batch: one GEMM path for every row count
    # and attention one query at a time (CPU only)
    batch_invariant: bool = False
    kv_cache_memory: int | None = None  # bytes for the KV cache; None = 512 MiB on CPU, sized from free memory on GPU
    gpu_memory_utilization: float = 0.9  # share of the GPU's memory the engine may hold (weights, KV, activations)
    enforce_eager: bool = False  # never replay CUDA graphs (they are only ever used on a GPU)
    cuda_graph_max_tokens: int | None = None  # largest piecewise-graph token bucket; None = the token budget
    # torch.compile (Inductor) of the token-wise segments inside the CUDA graphs; auto = where graphs run, eager ops
    # (with a warning) if compiling fails; on = the same, but a failure, or no graphs to run in, is an error
    compile: Literal["auto", "on", "off"] = "auto"
    max_num_seqs: int = 64  # most requests in one iteration
    # per-iteration token budget (prefill chunks + decodes); None = 2048 on a GPU, 512 on the CPU
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # context cap; None = the model's own window
    scheduling: Literal["iteration", "request"] = "iteration"  # Orca's mode, or the request-level baseline
    # who runs first: fcfs, arrival order (Orca); priority, the requests' `priority` field (lower first, vLLM's);
    # predicted, the shortest predicted remaining output; or module:name, a policy that module registers
    # (engine/core/queue_policy.py)
    scheduling_policy: str = "fcfs"
    # a file the `predicted` policy's length predictor starts from and saves to as it learns; None = start afresh
    length_predictor: str | None = None
    # schedule step N+1 while the device runs step N, its sampled ids feeding N+1 on the device;
    # auto = on for one GPU process, off on the CPU (where nothing would overlap) and with stages or ranks
    async_scheduling: Literal["auto", "on", "off"] = "auto"
    kv_policy: Literal["paged", "orca-reserve"] = "paged"  # grow blocks on demand, or reserve max_tokens up front
    prefix_caching: bool = True  # requests reuse the cached K/V of full blocks their prompts share
    attention_backend: str = "auto"  # which AttentionBackend runs attention: auto|torch|cpu|cuda
    # speculative decoding without a second model: each step verifies draft tokens from prompt lookup (ngram) or suffix
    # trees over the context and recent outputs (suffix) beside the one it samples; auto = ngram on the CPU (what
    # benchmarks/speculative.json measured best there), off on a GPU (not measured there yet)
    speculative: Literal["auto", "off", "ngram", "suffix"] = "auto"
    num_speculative_tokens: int = 11  # most draft tokens per request per step (each request drafts as it earns)
    speculative_shared: bool = True  # drafts also from recent outputs of requests with the same cache salt (off: none)
    # one more row's cost as a share of a step's fixed cost; draft tokens are scheduled only where they are likely
    # enough to pay for their rows (engine/core/speculation.py); None: measured from the engine's own steps
    speculative_row_cost: float | None = None
    pipeline_stages: int = 1  # processes the decoder layers are split over; up to this many batches in flight
    tensor_parallel_size: int = 1  # processes each stage's layers are split over (heads, MLP width, vocabulary)
    external_stages: bool = False  # stages are started elsewhere and rendezvous via MASTER_ADDR/MASTER_PORT
    seed: int = 0  # seeds dummy weights and unseeded sampling
    num_threads: int | None = None  # torch CPU threads; None = torch's default
    faults: FaultPlan | None = None  # tests only: failures to inject (FaultPlan.at_* where they happen)

    def with_(self, **changes) -> EngineConfig:
        return replace(self, **changes)
