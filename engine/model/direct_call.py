"""A base for the CPU's leaf modules of a decode step: calling one runs its forward, without nn.Module.__call__.

At one row a step is a few hundred small calls, and __call__'s hook checks are a measurable share of the step's Python
(docs/performance.md, Host work per step). These modules take no hooks: registering one raises.
"""

from __future__ import annotations

from torch import nn


class DirectCall(nn.Module):
    """An nn.Module whose call is its forward (an instance's own `forward`, where one is set, included)."""

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def register_forward_hook(self, *args, **kwargs):
        raise TypeError(f"{type(self).__name__} is called directly: it runs no hooks")

    register_forward_pre_hook = register_full_backward_hook = register_full_backward_pre_hook = register_forward_hook
