"""Frozen configuration: the model's shape and the engine's knobs."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal


@dataclass(frozen=True)
class ModelShape:
    """Dimensions of a decoder, and the small ways its families differ."""

    family: str = "llama"
    """The engine/model/families module that builds it (its registry key)."""
    vocab_size: int = 49152
    """Rows of the embedding and the LM head."""
    hidden_size: int = 576
    """Width of the residual stream."""
    intermediate_size: int = 1536
    """Width of the SwiGLU MLP."""
    num_layers: int = 30
    """Decoder blocks."""
    num_heads: int = 9
    """Query heads."""
    num_kv_heads: int = 3
    """Key/value heads (grouped-query attention)."""
    head_dim: int = 64
    """Per-head width."""
    rope_theta: float = 100000.0
    """RoPE base frequency."""
    rms_norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    max_position: int = 8192
    """Context window the model was trained for."""
    tie_word_embeddings: bool = True
    """LM head shares the embedding matrix."""
    qkv_bias: bool = False
    """Qwen2: biases on the Q, K and V projections."""
    rope_freq_factors: tuple[float, ...] | None = None
    """Llama 3.1 and later: each RoPE frequency's divisor (a GGUF's rope_freqs, or config.json's rope_scaling)."""
    sliding_window: int | None = None
    """Keys a windowed layer's query sees, its own included (Mistral, Gemma)."""
    sliding_layers: tuple[bool, ...] | None = None
    """Which layers are windowed; None: all, when there is a window."""
    attn_scale: float | None = None
    """Multiplies q.k; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)."""
    attn_logit_softcap: float | None = None
    """Attention scores become cap * tanh(score / cap) (Gemma 2)."""
    final_logit_softcap: float | None = None
    """The logits likewise (Gemma 2)."""
    rope_local_theta: float | None = None
    """The windowed layers' RoPE base (Gemma 3); None: rope_theta."""
    rope_long_factors: tuple[float, ...] | None = None
    """LongRoPE (Phi-3's long-context models): the divisors from rope_long_from on, not rope_freq_factors."""
    rope_long_from: int | None = None
    """LongRoPE: the first position that takes rope_long_factors (the pretrained context)."""
    rope_attention_factor: float = 1.0
    """LongRoPE: multiplies every cos and sin."""

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
    "tiny": ModelShape(
        hidden_size=128,
        intermediate_size=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        max_position=2048,
    ),
    "llama-1b": ModelShape(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        rope_theta=500000.0,
        max_position=131072,
    ),
    "llama-8b": ModelShape(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        max_position=131072,
        tie_word_embeddings=False,
    ),
}


class InjectedFault(RuntimeError):
    """Raised where a FaultPlan says, so tests can see what one failure takes down."""


@dataclass(frozen=True)
class FaultPlan:
    """Failures a test injects into a running engine, to check that each fails only what it should."""

    sampler_token: int | None = None
    """Sampling raises for any request whose prompt holds this token id."""
    runner_iterations: tuple[int, ...] = ()
    """The forward pass raises on these iterations (1 = the first)."""
    publish_token: int | None = None
    """The engine process raises publishing any request whose prompt holds this id."""

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

    model: str | None = None
    """GGUF file, HF checkpoint dir, or dummy:NAME; unset: the bundled SmolLM2-135M."""
    device: str = "auto"
    """Torch device the model runs on: cuda|cpu; auto: cuda when torch sees a GPU, else cpu."""
    dtype: str = "auto"
    """Compute dtype of weights and activations; auto: bfloat16 on a GPU, float32 on the CPU."""
    block_size: int = 16
    """Tokens per KV cache block."""
    weights: Literal["auto", "dense", "gguf"] = "auto"
    """gguf: multiply by the GGUF file's quantized blocks as stored (CPU only, the float32 model's weights exactly);
    dense: by float weights in the compute dtype; auto: gguf on the CPU where the file has them."""
    block_activations: Literal["auto", "int16", "float32"] = "auto"
    """The GGUF block matmuls' inputs: int16, rounded per 32 values (AVX-512 VNNI or AVX2), or float32 exactly;
    auto: int16 where the CPU has either."""
    batch_invariant: bool = False
    """A request's tokens and logprobs do not depend on the rest of the batch (CPU only)."""
    kv_cache_memory: int | None = None
    """Bytes for the KV cache; unset: 512 MiB on the CPU, what is free on a GPU."""
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """What the KV cache stores: the compute dtype, or bfloat16 / float16 under float32 on the CPU (half the bytes:
    twice the tokens, half the attention's reads); auto: float16 under float32 on the CPU, else the compute dtype."""
    gpu_memory_utilization: float = 0.9
    """Share of the GPU's memory the engine may hold (weights, KV cache, activations)."""
    enforce_eager: bool = False
    """Never replay CUDA graphs (they are only ever used on a GPU)."""
    cuda_graph_max_tokens: int | None = None
    """Largest token bucket of the piecewise CUDA graphs; unset: the token budget."""
    compile: Literal["auto", "on", "off"] = "auto"
    """torch.compile the token-wise ops inside the CUDA graphs; auto: where graphs run, eager ops (with a warning)
    if compiling fails; on: a failure, or no graphs to run in, is an error."""
    max_num_seqs: int = 64
    """Most requests in one iteration."""
    max_num_batched_tokens: int | None = None
    """Per-iteration token budget (prefill chunks + decodes); unset: 2048 on a GPU, 512 on the CPU."""
    max_model_len: int | None = None
    """Context window cap; unset: the model's own window."""
    scheduling: Literal["iteration", "request"] = "iteration"
    """Granularity of scheduling: Orca's iteration-level, or the request-level baseline."""
    scheduling_policy: str = "fcfs"
    """Who runs first: fcfs (arrival order), priority (the requests' `priority` field, lower first), predicted (the
    shortest predicted remaining output), or module:name (a policy that module registers)."""
    length_predictor: str | None = None
    """The file the `predicted` policy's length predictor starts from and saves to as it learns; unset: start afresh."""
    async_scheduling: Literal["auto", "on", "off"] = "auto"
    """Schedule the next step while the device runs this one; auto: on for one GPU process, off on the CPU (where
    nothing would overlap) and with stages or ranks."""
    kv_policy: Literal["paged", "orca-reserve"] = "paged"
    """Grow KV blocks on demand, or reserve max_tokens up front."""
    prefix_caching: bool = True
    """Reuse the cached K/V of prompt prefixes shared with earlier requests."""
    attention_backend: str = "auto"
    """Which AttentionBackend runs attention: auto|torch|cpu|cuda."""
    check_in_steps: int = 1
    """Decode steps a batch of long requests runs between check-ins (the scheduler, stop checks and output delivery
    see them every this many steps): under the predicted policy those predicted long, under the others every one."""
    speculative: Literal["auto", "off", "ngram", "suffix"] = "auto"
    """Speculative decoding: draft from prompt lookup (ngram) or suffix trees, verify in one step; auto: ngram on the
    CPU, off on a GPU."""
    num_speculative_tokens: int = 11
    """Most draft tokens per request per step (each request drafts as it earns)."""
    speculative_shared: bool = True
    """Draft also from the recent outputs of requests with the same cache salt (API key), where a request's own
    context has no match."""
    speculative_row_cost: float | None = None
    """One more row's cost as a share of a step's fixed cost: drafts are scheduled only where likely to pay for their
    rows; unset: measured from the engine's own steps, starting at 0.25; 0 drafts always."""
    pipeline_stages: int = 1
    """Split the decoder layers over this many stage processes, as many batches in flight."""
    tensor_parallel_size: int = 1
    """Split every layer over this many processes (per pipeline stage): heads, MLP width, vocabulary."""
    external_stages: bool = False
    """Stages are started elsewhere and rendezvous via MASTER_ADDR/MASTER_PORT."""
    seed: int = 0
    """Seeds dummy weights and unseeded sampling."""
    num_threads: int | None = None
    """Torch CPU threads (per stage process when pipelined); unset: every core the server may run on (shared out among
    data-parallel replicas), torch's default offline."""
    lora: tuple[str, ...] = ()
    """Serve a LoRA adapter beside the base model, as NAME=PATH (a PEFT directory: adapter_config.json and
    adapter_model.safetensors; repeat for several); a request names one as its `model`."""
    enable_lora: bool = False
    """Serve LoRA adapters, loaded and unloaded at run time (POST /v1/load_lora_adapter); on whenever --lora names one."""
    max_loras: int = 4
    """Most LoRA adapters resident at once (the others wait on the host until a slot frees)."""
    max_lora_rank: int = 16
    """Largest rank of a LoRA adapter the engine takes."""
    faults: FaultPlan | None = None
    """Tests only: failures to inject (FaultPlan.at_* where they happen)."""

    def with_(self, **changes) -> EngineConfig:
        return replace(self, **changes)

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora)
