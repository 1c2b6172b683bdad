"""Top-k and top-p by a partial sort: the leading candidates of each row (torch.topk), widened only while some row's
top-p set may reach past them, instead of a sort of the whole vocabulary (which costs many times a pass over it).

The tokens kept are the full sort's: the k most likely, then among them every token whose mass before it (over the
top-k set's own distribution) is below top_p, the most likely always. A row with neither setting keeps every token,
whatever the rest of its batch asks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.model.sampling.draw import sampling_op

FIRST_CANDIDATES = 1024  # at a typical temperature a top-p set is far smaller; a flat row widens the search
GROWTH = 8  # how much wider each further search is


def nucleus(logits: torch.Tensor, top_ks: list[int], top_ps: list[float], tensor: Callable) -> torch.Tensor:
    """logits [R, V] (temperature applied) -> a new tensor, every token outside its row's top-k and top-p sets at -inf.
    `tensor(values, dtype)` puts a host list on the logits' device."""
    vocab = logits.shape[1]
    ks = [k if 0 < k < vocab else vocab for k in top_ks]
    limited = [i for i, (k, p) in enumerate(zip(ks, top_ps)) if k < vocab or p < 1.0]
    if not limited:
        return logits
    every = len(limited) == len(ks)
    index = None if every else tensor(limited, torch.int64)
    rows = logits if every else logits.index_select(0, index)
    ks = [ks[i] for i in limited]
    top_ps = [top_ps[i] for i in limited]
    k_t = tensor(ks, torch.int64).unsqueeze(1)
    p_t = tensor(top_ps, torch.float32).unsqueeze(1)
    width = min(vocab, max([FIRST_CANDIDATES] + [k for k in ks if k < vocab]))
    if logits.device.type != "cpu":
        width = vocab  # a sort is cheap there, and asking whether to widen would wait for the device
    out = torch.full_like(rows, float("-inf"))
    pending = list(range(len(ks)))  # rows of `rows` whose kept tokens are not settled yet
    while pending:
        whole = len(pending) == len(ks)
        at = None if whole else tensor(pending, torch.int64)
        values, order, drop, open_rows = _kept(
            rows if whole else rows.index_select(0, at),
            width,
            [ks[i] for i in pending],
            k_t if whole else k_t.index_select(0, at),
            p_t if whole else p_t.index_select(0, at),
            tensor,
        )
        kept = values.masked_fill_(drop, float("-inf"))
        if whole and not any(open_rows):
            out.scatter_(1, order, kept)
            break
        settled = [j for j, o in enumerate(open_rows) if not o]
        if settled:
            local = tensor(settled, torch.int64)
            part = rows.new_full((len(settled), vocab), float("-inf"))
            part.scatter_(1, order.index_select(0, local), kept.index_select(0, local))
            out.index_copy_(0, tensor([pending[j] for j in settled], torch.int64), part)
        pending = [pending[j] for j, o in enumerate(open_rows) if o]
        width = min(vocab, width * GROWTH)
    return out if every else logits.index_copy(0, index, out)


def _kept(
    rows: torch.Tensor, width: int, ks: list[int], k_t: torch.Tensor, p_t: torch.Tensor, tensor: Callable
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[bool]]:
    """The `width` leading candidates of each row (values, token ids), which of them are dropped, and whether each
    row's sets may reach past them (a top-k wider than them, and its last candidate still within top-p)."""
    vocab = rows.shape[1]
    values, order = rows.topk(width, dim=-1)  # descending
    outside_k = torch.arange(width, device=rows.device).unsqueeze(0) >= k_t
    masked = values.masked_fill(outside_k, float("-inf"))
    wide = [k > width for k in ks]  # its top-k set reaches past the candidates: normalize over the whole row
    if all(wide):  # no copy of the rows
        top = values[:, :1]
        probs = (masked - top).exp_().div_(_exp_sums(rows, top))
    else:
        probs = masked.softmax(dim=-1)  # exact for a row whose top-k set is among the candidates
    if any(wide) and not all(wide):
        index = tensor([i for i, w in enumerate(wide) if w], torch.int64)
        top = values.index_select(0, index)[:, :1]
        total = _exp_sums(rows.index_select(0, index), top)
        probs.index_copy_(0, index, (masked.index_select(0, index) - top).exp_().div_(total))
    # The mass before a token: the full sort's cumulative sum over the same leading tokens.
    mass_before = probs.cumsum(dim=-1) - probs
    drop = outside_k | (mass_before >= p_t)
    drop[:, 0] = False  # a top_p that rounds to 0 in float32 must still leave one token
    # Asked only on the CPU (a device's search is the whole vocabulary at once): no wait for a device.
    if width == vocab or not any(wide):
        return values, order, drop, [False] * len(ks)
    return values, order, drop, (tensor(wide, torch.bool) & ~drop[:, -1]).tolist()


def _exp_sums(rows: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """[R, 1]: each row's sum of exp(x - top), one read of the row by the CPU's op (no [R, V] temporary)."""
    op = sampling_op()
    if op is not None and rows.device.type == "cpu" and rows.dtype == torch.float32:
        return op.exp_sums(rows.contiguous(), top.reshape(-1).contiguous()).unsqueeze(1)
    return (rows - top).exp_().sum(dim=-1, keepdim=True)
