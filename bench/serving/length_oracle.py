"""The length-aware policy's ceiling: `predicted` told each request's true output length, a research baseline that
no server can run (bench/serving/bench_length_aware.py measures the lengths in the run before and sends each as the
request's `priority`).

Served as `--scheduling-policy bench.serving.length_oracle:oracle`: the engine imports this module, which registers
the policy under that name.
"""

from __future__ import annotations

from engine.core.queue_policy import Predicted, register_policy
from engine.core.request import Request

NAME = "bench.serving.length_oracle:oracle"


class Oracle(Predicted):
    """`predicted` with the true lengths: each request's `priority` option carries its real output length."""

    @staticmethod
    def remaining(req: Request) -> float:
        return max(1.0, float(min(req.options.priority, req.params.max_tokens) - req.num_output_tokens))


register_policy(NAME, Oracle)
