"""The `auto` settings' rules (engine/core/defaults.py): each input's value and reason, a flag the user gave always
winning, and what the startup block says of them."""

import pytest

from engine.core.config import EngineConfig
from engine.core.defaults import (
    AS_ASKED,
    Choice,
    choose_block_activations,
    choose_dtype,
    choose_speculative,
    choose_threads,
)
from engine.core.request_limits import RequestLimits
from engine.ipc.messages import EngineReady, EngineSummary
from gateway.banner import startup_block


def test_dtype_is_float32_on_the_cpu_and_bfloat16_on_a_gpu():
    assert choose_dtype("auto", on_gpu=False) == Choice(
        "float32", "auto: the float32 model's greedy tokens; bfloat16 leaves the fidelity budget"
    )
    assert choose_dtype("auto", on_gpu=True) == Choice("bfloat16", "auto: a GPU's tensor cores run it at full rate")


def test_block_activations_follow_the_cpus_instructions():
    assert choose_block_activations("auto", "AVX-512 VNNI") == Choice("int16", "auto: this CPU has AVX-512 VNNI")
    assert choose_block_activations("auto", "AVX2") == Choice("int16", "auto: this CPU has AVX2")
    assert choose_block_activations("auto", None) == Choice("float32", "auto: the int16 op needs AVX-512 VNNI or AVX2")


def test_threads_are_every_core_the_process_may_use():
    assert choose_threads(None, 6) == Choice(6, "auto: every core this process may run on")
    assert choose_threads(None, 0) == Choice(1, "auto: every core this process may run on")


def test_speculation_is_prompt_lookup_on_the_cpu_and_off_elsewhere():
    assert choose_speculative("auto", on_gpu=False, batch_invariant=False) == Choice(
        "ngram", "auto: prompt lookup pays on the CPU at every model shape measured"
    )
    assert choose_speculative("auto", on_gpu=True, batch_invariant=False) == Choice(
        "off", "auto: not measured on a GPU yet"
    )
    assert choose_speculative("auto", on_gpu=False, batch_invariant=True) == Choice(
        "off", "auto: drafts would make a request's tokens depend on its batch"
    )


@pytest.mark.parametrize(
    "choice",
    [
        lambda: choose_dtype("bfloat16", on_gpu=False),
        lambda: choose_dtype("float32", on_gpu=True),
        lambda: choose_block_activations("float32", "AVX-512 VNNI"),
        lambda: choose_block_activations("int16", None),
        lambda: choose_threads(3, 64),
        lambda: choose_speculative("suffix", on_gpu=True, batch_invariant=False),
        lambda: choose_speculative("ngram", on_gpu=False, batch_invariant=True),
    ],
)
def test_a_flag_the_user_gave_always_wins(choice):
    c = choice()
    assert c.reason == AS_ASKED and c.value in ("bfloat16", "float32", "int16", 3, "suffix", "ngram")


def test_serving_takes_the_cores_of_its_affinity_mask_not_the_machines(monkeypatch):
    from engine.ipc import engine_loop

    monkeypatch.setattr(engine_loop.os, "cpu_count", lambda: 64)
    monkeypatch.setattr("engine.core.defaults.os.sched_getaffinity", lambda pid: {0, 1, 2})
    assert engine_loop.serving_config(EngineConfig()).num_threads == 3
    assert engine_loop.serving_config(EngineConfig(num_threads=5)).num_threads == 5


def test_the_startup_block_lists_each_choice_and_why(monkeypatch):
    from engine import launch
    from engine.runner.device import resolve_device

    monkeypatch.setattr(launch, "int16_isa", lambda device: "AVX2")
    monkeypatch.setattr("engine.core.defaults.os.sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    asked = EngineConfig(speculative="off")
    resolved = launch.resolve_speculative(resolve_device(asked))
    summary = EngineSummary("cpu", "float32", 10**6, 8, 512, True, 1, defaults=launch.default_choices(asked, resolved))
    text = startup_block(EngineReady("m", RequestLimits(2048, 100, 10, 16), summary), "x", None, api_key=False)
    assert text.splitlines()[6:10] == [
        "  defaults        dtype float32 (auto: the float32 model's greedy tokens; bfloat16 leaves the fidelity budget)",
        "                  block activations int16 (auto: this CPU has AVX2)",
        "                  threads 2 (auto: every core this process may run on)",
        "                  speculation off (as asked)",
    ]


def test_data_parallel_replicas_share_out_the_cores_of_the_affinity_mask(monkeypatch):
    from gateway.engines.replicas import replica_config

    monkeypatch.setattr("os.cpu_count", lambda: 64)
    monkeypatch.setattr("engine.core.defaults.os.sched_getaffinity", lambda pid: set(range(8)))
    assert replica_config(EngineConfig(), 2).num_threads == 4
    assert replica_config(EngineConfig(num_threads=3), 2).num_threads == 3
