"""How many tokens a request has left, from the model's own final hidden state (as TRAIL, 2024, does).

Ridge regression of log(1 + remaining tokens) on the hidden state at the request's last known token (the prefill
computes it for the prompt's last token anyway; decoding, every few tokens) and log(1 + outputs so far). It learns
online from finished requests' real lengths: their probes add to the regression's sufficient statistics, and the
weights are solved again every REFIT_EVERY requests (a (hidden + 2)-square system: milliseconds, between steps).
It predicts nothing until MIN_REQUESTS have finished, so a new server schedules as FCFS does. The statistics save
to a file beside the model (`--length-predictor PATH`), so a restart keeps what it learnt.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


class RidgeLengthPredictor:
    """engine/core/queue_policy.py's LengthPredictor."""

    MIN_REQUESTS = 32  # finished requests before the first prediction
    REFIT_EVERY = 16  # finished requests between solves
    SAVE_EVERY = 128  # finished requests between saves to `path`
    RIDGE = 1.0  # the regression's L2 penalty, against features of unit scale (an RMS-normed hidden state)

    def __init__(self, hidden_size: int, path: str | None = None):
        self.path = Path(path) if path else None
        dim = hidden_size + 2
        self.gram = torch.zeros(dim, dim, dtype=torch.float64)  # sum of x x^T over every probe learnt from
        self.moment = torch.zeros(dim, dtype=torch.float64)  # sum of x * log(1 + remaining)
        self.num_requests = 0
        self.weights: torch.Tensor | None = None
        if self.path is not None and self.path.exists():
            saved = load_file(str(self.path))
            if saved["gram"].shape != self.gram.shape:
                raise ValueError(
                    f"{self.path} was learnt for hidden size {saved['gram'].shape[0] - 2}, "
                    f"not this model's {hidden_size}"
                )
            self.gram, self.moment = saved["gram"], saved["moment"]
            self.num_requests = int(saved["num_requests"])
            self._solve()

    @staticmethod
    def _features(hidden: list[float], num_output_tokens: int) -> torch.Tensor:
        return torch.tensor(hidden + [math.log1p(num_output_tokens), 1.0], dtype=torch.float64)

    def predict(self, hidden: list[float], num_output_tokens: int) -> float | None:
        if self.weights is None:
            return None
        return math.expm1(max(0.0, float(self._features(hidden, num_output_tokens) @ self.weights)))

    def observe(self, probes: list[tuple[int, list[float]]], num_output_tokens: int) -> None:
        x = torch.stack([self._features(hidden, t) for t, hidden in probes])
        y = torch.tensor([math.log1p(num_output_tokens - t) for t, _ in probes], dtype=torch.float64)
        self.gram += x.T @ x
        self.moment += x.T @ y
        self.num_requests += 1
        if self.num_requests % self.REFIT_EVERY == 0:
            self._solve()
        if self.path is not None and self.num_requests % self.SAVE_EVERY == 0:
            self.save()

    def _solve(self) -> None:
        if self.num_requests < self.MIN_REQUESTS:
            return
        penalty = self.RIDGE * torch.eye(self.gram.shape[0], dtype=torch.float64)
        penalty[-1, -1] = 0.0  # the intercept is not shrunk
        self.weights = torch.linalg.solve(self.gram + penalty, self.moment)

    def save(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        save_file({"gram": self.gram, "moment": self.moment, "num_requests": torch.tensor(self.num_requests)}, str(tmp))
        tmp.replace(self.path)  # a reader never sees half a file
