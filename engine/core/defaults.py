"""What each `auto` setting becomes, and why: one small rule per setting, returning its value and the reason the
startup block prints. The rules take what they depend on as plain values (the machine's probes are the caller's), so
a flag the user gave always wins and each rule can be tested on its inputs alone."""

from __future__ import annotations

import os
from typing import NamedTuple

AS_ASKED = "as asked"


class Choice(NamedTuple):
    """A resolved setting and the reason for it."""

    value: str | int
    reason: str

    def __str__(self) -> str:
        return f"{self.value} ({self.reason})"


def choose_dtype(asked: str, on_gpu: bool) -> Choice:
    """The compute dtype of weights and activations."""
    if asked != "auto":
        return Choice(asked, AS_ASKED)
    if on_gpu:
        return Choice("bfloat16", "auto: a GPU's tensor cores run it at full rate")
    # bfloat16 activations flip greedy choices whose float32 margins are no near-ties (tests/test_fidelity.py); with
    # the GGUF blocks the weights a step reads stay 4-8 bits either way, so bfloat16 saves only activation work
    # (docs/performance.md, Defaults per model), which does not buy back the answers.
    return Choice("float32", "auto: the float32 model's greedy tokens; bfloat16 leaves the fidelity budget")


def choose_block_activations(asked: str, int16_isa: str | None) -> Choice:
    """What the GGUF block matmuls take as inputs: int16 rounded per 32 values, or float32; `int16_isa` names the
    instructions the int16 op runs on here (None: it does not run here)."""
    if asked != "auto":
        return Choice(asked, AS_ASKED)
    if int16_isa is None:
        return Choice("float32", "auto: the int16 op needs AVX-512 VNNI or AVX2")
    # The int16 op reads the same blocks faster than the float32 path, within the fidelity budget (docs/performance.md).
    return Choice("int16", f"auto: this CPU has {int16_isa}")


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask: a container's or taskset's share, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity masks on this platform
        return os.cpu_count() or 1


def choose_threads(asked: int | None, cores: int) -> Choice:
    """Torch CPU threads for a serving engine: every core it may run on (one thread waiting on another for a core
    costs more than the core gives)."""
    if asked is not None:
        return Choice(asked, AS_ASKED)
    return Choice(max(1, cores), "auto: every core this process may run on")


def choose_speculative(asked: str, on_gpu: bool, batch_invariant: bool) -> Choice:
    """Speculative decoding's draft source, or off."""
    if asked != "auto":
        return Choice(asked, AS_ASKED)
    if batch_invariant:
        # Whether a request drafts depends on the batch's size, and its sampled draws on its drafts.
        return Choice("off", "auto: drafts would make a request's tokens depend on its batch")
    if on_gpu:
        return Choice("off", "auto: not measured on a GPU yet")
    # A draft row costs about the same share of a step at every model shape measured, large vocabularies included,
    # and the engine weighs that cost per step (engine/core/speculation.py): no shape needs another default.
    return Choice("ngram", "auto: prompt lookup pays on the CPU at every model shape measured")
