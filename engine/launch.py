"""Builds an engine from a config: resolve the device, load the checkpoint, pick the executor."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.core.config import EngineConfig
from engine.core.defaults import (
    choose_block_activations,
    choose_dtype,
    choose_speculative,
    choose_threads,
    usable_cores,
)
from engine.core.engine_core import EngineCore
from engine.core.executor import Executor
from engine.core.queue_policy import Predicted, queue_policy
from engine.drafting import DRAFT_SOURCES
from engine.kernels.cpu_ops import ops_origin
from engine.model.length_predictor import RidgeLengthPredictor
from engine.model.loader import Checkpoint, load_checkpoint
from engine.model.sharding import check_splittable
from engine.runner.device import int16_isa, resolve_device
from engine.runner.kv_dtype import describe_kv_dtype
from engine.runner.local_executor import LocalExecutor


def make_executor(config: EngineConfig, ckpt: Checkpoint, max_model_len: int) -> Executor:
    """The whole model in this process, or split over a grid of `pipeline_stages` x `tensor_parallel_size` processes."""
    if is_distributed(config):
        from engine.parallel.pipeline import (
            PipelineExecutor,  # torch.distributed only where it is used
        )

        return PipelineExecutor(config, max_model_len, ckpt.shape)
    return LocalExecutor(config, ckpt, max_model_len)


def is_distributed(config: EngineConfig) -> bool:
    return config.pipeline_stages > 1 or config.tensor_parallel_size > 1


def resolve_async(config: EngineConfig) -> EngineConfig:
    """ "auto" async scheduling becomes "on" for one process on a GPU, where host work can hide behind the device's;
    a CPU step runs in the calling thread, and pipeline stages already keep several batches in flight."""
    mode = config.async_scheduling
    if mode == "auto":
        mode = "on" if torch.device(config.device).type == "cuda" and not is_distributed(config) else "off"
    elif mode == "on" and is_distributed(config):
        raise ValueError(
            "async scheduling runs one engine process: not with --pipeline-stages or --tensor-parallel-size above 1"
        )
    return config.with_(async_scheduling=mode)


def resolve_speculative(config: EngineConfig) -> EngineConfig:
    """ "auto" speculation as engine/core/defaults.py's rule picks it, on a config whose device is resolved."""
    on_gpu = torch.device(config.device).type == "cuda"
    return config.with_(speculative=choose_speculative(config.speculative, on_gpu, config.batch_invariant).value)


def build_engine(config: EngineConfig, checkpoint: Checkpoint | None = None) -> EngineCore:
    """`checkpoint` reuses weights already loaded (e.g. to try several configs on one model)."""
    config = resolve_speculative(resolve_async(resolve_device(config)))
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    # Stage processes load their own weights: the driver needs only the shape and the tokenizer.
    ckpt = checkpoint or load_checkpoint(config.model, config.seed, weights=not is_distributed(config))
    check_splittable(ckpt.shape, config.tensor_parallel_size)  # here, before any process starts
    max_model_len = min(config.max_model_len or ckpt.shape.max_position, ckpt.shape.max_position)
    if config.check_in_steps < 1 or (config.check_in_steps > 1 and is_distributed(config)):
        raise ValueError("--check-in-steps is at least 1, and 1 with --pipeline-stages or --tensor-parallel-size")
    if config.length_predictor and config.scheduling_policy != "predicted":
        raise ValueError("--length-predictor is the predicted policy's: add --scheduling-policy predicted")
    # Before any stage process starts: an unknown policy, or a predictor file that does not suit the model, fails here.
    if config.scheduling_policy == "predicted":
        policy = Predicted(RidgeLengthPredictor(ckpt.shape.hidden_size, config.length_predictor))
    else:
        policy = queue_policy(config.scheduling_policy)()
    executor = make_executor(config, ckpt, max_model_len)
    draft_source = (
        None if config.speculative == "off" else DRAFT_SOURCES[config.speculative](shared=config.speculative_shared)
    )
    return EngineCore(config, executor, ckpt.name, ckpt.shape, ckpt.tokenizer, max_model_len, draft_source, policy)


def cpp_ops_origin() -> str:
    """Where this process's C++ ops came from (prebuilt by the install, or built at run time), for the startup block."""
    return ops_origin()


def default_choices(asked: EngineConfig, config: EngineConfig) -> tuple[str, ...]:
    """Each setting an `auto` rule decides, with its value and why, for the startup block: `asked` is the config as
    given (before serving's own defaults), `config` resolved."""
    device = torch.device(config.device)
    on_gpu = device.type == "cuda"
    choices = [("dtype", choose_dtype(asked.dtype, on_gpu))]
    if device.type == "cpu":
        choices.append(("block activations", choose_block_activations(asked.block_activations, int16_isa(device))))
        choices.append(("threads", choose_threads(asked.num_threads, usable_cores())))
    choices.append(("speculation", choose_speculative(asked.speculative, on_gpu, config.batch_invariant)))
    return tuple(f"{name} {choice}" for name, choice in choices)


def kv_cache_summary(asked: str, config: EngineConfig) -> str:
    """What the KV cache stores and why, for the startup block: `asked` is --kv-cache-dtype, `config` resolved."""
    return describe_kv_dtype(asked, config)


def grammar_compiler(engine: EngineCore) -> Callable[[str], object] | None:
    """Grammar text -> a matcher the engine's requests copy (engine/model/sampling/grammar.py); None without a tokenizer."""
    if engine.tokenizer is None:
        return None
    from engine.model.sampling.grammar import GrammarCompiler

    compiler = GrammarCompiler(engine.tokenizer)
    compiler.warm_up()
    return compiler.compile
