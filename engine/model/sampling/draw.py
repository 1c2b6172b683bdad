"""Drawing one token per row of a distribution: the exponential race, argmax p_i / E_i with E_i = -log U_i ~ Exp(1).

It is what torch.multinomial does for one sample, but multinomial's exponentials on the CPU (`exponential_`) cost
more than the model's forward for a step of sampled rows over a large vocabulary (docs/performance.md, Sampler). An
inverse CDF was faster still, but its token hangs on a running sum over the whole vocabulary: a last-place change in
the logits moves some of its draws (the race's: none), and a seeded request drew other tokens with its prompt
cached than without (a cached prefix is attended as decode queries, not by SDPA). The race compares only the leading
candidates' ratios.

A row's uniforms come from its 64-bit key and the token's index alone (SplitMix64 of key + (i + 1) * gamma), so the
CPU's op (engine/kernels/csrc/cpu/sampling.cpp, which settles most tokens without a log) and the torch ops here draw
the same tokens, and a row's draw never depends on the rest of the batch.
"""

from __future__ import annotations

import functools

import torch

from engine.kernels.availability import builds
from engine.kernels.cpu_ops import load_cpu_extension

KEY_BITS = 62  # a key per row drawn from a torch generator: [0, 2^62)
REFERENCE_ELEMENTS = 1 << 22  # the torch race's rows at a time times the vocabulary: 32 MB per int64 temporary
_GAMMA = 0x9E3779B97F4A7C15 - (1 << 64)  # SplitMix64's constants as int64 (torch's int64 arithmetic wraps)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def keys(n: int, generator: torch.Generator | None, device: torch.device | str = "cpu") -> torch.Tensor:
    """n keys [n] int64 for `exponential_race`, from `generator` (the shared one, or a seeded request's own)."""
    return torch.randint(0, 1 << KEY_BITS, (n,), generator=generator, device=device)


def exponential_race(probs: torch.Tensor, row_keys: torch.Tensor) -> torch.Tensor:
    """probs [R, V] (non-negative, finite, each row's mass above 0, not necessarily 1) and a key per row -> per row
    a token drawn with probability p_i / sum(p); a token of probability 0 never."""
    if probs.device.type == "cpu" and probs.dtype == torch.float32 and sampling_op() is not None:
        return sampling_op().exponential_race(probs.contiguous(), row_keys.contiguous())
    return exponential_race_reference(probs, row_keys)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits [R, V] -> per row its most likely token: the first of tied maxima, a NaN first (torch.max's indices,
    which on the CPU the sampling op gives in a fraction of the time over a large vocabulary)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.shape[-1] > 0 and sampling_op():
        return sampling_op().argmax_rows(logits.contiguous())
    return logits.max(dim=-1).indices


def exponential_race_reference(probs: torch.Tensor, row_keys: torch.Tensor) -> torch.Tensor:
    """The race in torch ops, on any device (the GPU's, and the CPU's where its op does not build); a few rows at a
    time, so that its int64 temporaries stay near REFERENCE_ELEMENTS whatever the batch and vocabulary."""
    rows = max(1, REFERENCE_ELEMENTS // max(1, probs.shape[1]))
    tokens = torch.empty(probs.shape[0], dtype=torch.int64, device=probs.device)
    for start in range(0, probs.shape[0], rows):
        p, k = probs[start : start + rows], row_keys[start : start + rows]
        u = odd_uniforms(k, probs.shape[1]).float().mul_(2.0**-24)
        tokens[start : start + rows] = (p.float() / u.log_().neg_()).max(dim=-1).indices
    return tokens


def odd_uniforms(row_keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, V] int64: each token's uniform as an odd integer m in [1, 2^24), u = m / 2^24 (never 0 or 1)."""
    z = row_keys[:, None] + torch.arange(1, vocab + 1, dtype=torch.int64, device=row_keys.device) * _GAMMA
    z = (z ^ _shift(z, 30)) * _MIX1
    z = (z ^ _shift(z, 27)) * _MIX2
    z = z ^ _shift(z, 31)
    return _shift(z, 41) * 2 + 1


def _shift(z: torch.Tensor, n: int) -> torch.Tensor:
    """z >> n as unsigned 64-bit integers (torch shifts int64 arithmetically)."""
    return (z >> n) & ((1 << (64 - n)) - 1)


@functools.cache
def sampling_op():
    """The CPU's sampling ops (the race, top-p's row sums), or None where they cannot build (torch ops then do)."""
    load = functools.partial(load_cpu_extension, "orcinus_cpu_sampling")
    return load() if builds(load, "the C++ sampling op is unavailable, drawing with torch ops") else None
