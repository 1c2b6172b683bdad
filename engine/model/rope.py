"""Rotary position embeddings: the per-position cos/sin table, and Llama 3.1's scaled frequencies."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


class Rotary(nn.Module):
    """RoPE in the rotate-half convention (the GGUF loader undoes llama.cpp's Q/K row permutation)."""

    def __init__(self, head_dim: int, theta: float, max_position: int, freq_factors: tuple[float, ...] | None = None):
        super().__init__()
        inv_freq = base_frequencies(head_dim, theta)
        if freq_factors is not None:
            inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.int64).float(), inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        # [positions, 2, D]: cos for both halves, then -sin and sin, so a call is one gather and
        # x * cos + swap_halves(x) * sin (5 kernels; 9 with the halves apart). build_model casts it to the
        # compute dtype once: the same values a cast per call gave.
        table = torch.stack((torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)), dim=1)
        self.register_buffer("table", table, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] (queries and keys together) rotated by each row's position."""
        cos, sin = self.table[positions].to(x.dtype).unsqueeze(2).unbind(1)  # [T, 1, D] each
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((x2, x1), dim=-1) * sin


def base_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's RoPE frequency scaling: long wavelengths slowed by `factor`, short ones kept, a ramp between."""

    factor: float = 8.0  # how much the long wavelengths are stretched
    low_freq_factor: float = 1.0  # wavelengths above original_max_position / this are scaled fully
    high_freq_factor: float = 4.0  # wavelengths below original_max_position / this are not scaled
    original_max_position: int = 8192  # the context the base frequencies were trained for

    def freq_factors(self, head_dim: int, theta: float) -> tuple[float, ...]:
        """Each frequency's divisor, as llama.cpp stores the scaling (transformers' `llama3` rope type)."""
        inv_freq = base_frequencies(head_dim, theta)
        wavelen = 2 * math.pi / inv_freq
        low_wavelen = self.original_max_position / self.low_freq_factor
        high_wavelen = self.original_max_position / self.high_freq_factor
        scaled = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return tuple((inv_freq / torch.where(medium, smoothed, scaled)).tolist())
