"""The tile plan of the prompt-tile kernel (csrc/cuda/paged_prompt_tiles.cu): a step's prompt rows cut into tiles of
consecutive rows of one request, each tile attended by one thread block per KV head.

Plain numpy, so the plan is checked without a GPU. A tile is four int32s: (first row of the flattened batch, rows,
row of the block tables its keys are found through, position of its first row); row i of a tile sits at position
first_pos + i and, causally, sees the keys before first_pos + i + 1.
"""

from __future__ import annotations

import numpy as np

PAIRS_PER_TILE = 64  # kPairs in the kernel: (row, query head) pairs a thread block holds
TILE_FIELDS = 4  # first_row, rows, table_row, first_pos


def rows_per_tile(num_q_heads: int, num_kv_heads: int) -> int:
    """Rows a tile holds: every query head of one KV head for each row, within PAIRS_PER_TILE pairs; 0 if a GQA group
    alone is wider than that (the rows then stay with the decode kernel)."""
    return PAIRS_PER_TILE // (num_q_heads // num_kv_heads)


def plan_prompt_tiles(
    query_lens: list[int], context_lens: list[int], tile_rows: int, tables_by_row: bool = False
) -> np.ndarray:
    """[tiles, TILE_FIELDS] int32 for the requests with more than one query (the others are decode rows).

    Request i's n queries are its last n positions, ctx - n .. ctx - 1. `tables_by_row`: the block tables have one
    row per query row (a whole-step graph's), so a tile's table row is its first row; else one per request. Tiles are
    ordered by their last key, longest first, so the blocks that read the most keys start first."""
    lens = np.asarray(query_lens, dtype=np.int64)
    ctx = np.asarray(context_lens, dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(lens)[:-1])) if len(lens) else lens
    prompts = np.flatnonzero(lens > 1)
    if tile_rows <= 0 or len(prompts) == 0:
        return np.zeros((0, TILE_FIELDS), dtype=np.int32)
    n = lens[prompts]
    per = -(-n // tile_rows)  # tiles of each prompt
    req = np.repeat(prompts, per)
    j = np.arange(per.sum()) - np.repeat(np.cumsum(per) - per, per)  # tile index within its request
    offset = j * tile_rows  # first query of the tile within its request's chunk
    rows = np.minimum(tile_rows, lens[req] - offset)
    first_row = starts[req] + offset
    first_pos = ctx[req] - lens[req] + offset
    plan = np.stack([first_row, rows, first_row if tables_by_row else req, first_pos], axis=1)
    order = np.argsort(-(first_pos + rows), kind="stable")
    return plan[order].astype(np.int32)


def tile_capacity(num_rows: int, tile_rows: int, max_requests: int) -> int:
    """The most tiles a step of `num_rows` rows and at most `max_requests` requests can need: a captured graph's grid.
    Every prompt has at least 2 rows, and a prompt of n rows needs ceil(n / tile_rows) tiles."""
    if tile_rows <= 0:
        return 0
    prompts = min(max_requests, num_rows // 2)
    return (num_rows + prompts * (tile_rows - 1)) // tile_rows  # sum of ceil(n / t) <= (rows + prompts (t - 1)) / t


def prompt_row_signs(query_lens: list[int], num_rows: int) -> np.ndarray:
    """[num_rows] int32: -1 for the rows of requests with more than one query (the tiles attend them), else 1.
    A whole-step graph multiplies each row's key count by it: the decode kernel leaves rows with a negative count."""
    lens = np.asarray(query_lens, dtype=np.int64)
    signs = np.ones(num_rows, dtype=np.int32)
    signs[: int(lens.sum())] = np.where(np.repeat(lens, lens) > 1, -1, 1)
    return signs
