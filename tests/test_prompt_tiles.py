"""Prompt rows by tiles (engine/attention/prompt_tiles.py, csrc/cuda/paged_prompt_tiles.cu) without a GPU: the tile
plan, a PyTorch emulation of the kernel's algorithm against the reference attention, and whole-step graphs (CPU
stand-in) hand their prompt rows to a tiling backend (TilingTorchAttention, used by test_cuda_graphs.py). The kernel
itself is checked in test_cuda_kernels.py."""

import math
import random

import pytest
import torch
from test_cuda_kernels import TILE_MIXED, as_graph_rows, ragged_batch, rel_error

from engine.attention.backend import AttentionParams
from engine.attention.prompt_tiles import (
    PAIRS_PER_TILE,
    plan_prompt_tiles,
    prompt_row_signs,
    rows_per_tile,
    tile_capacity,
)
from engine.attention.torch_backend import TorchAttention

# ---------------------------------------------------------------- the plan


def test_rows_per_tile_fills_the_block_s_pairs():
    assert rows_per_tile(32, 8) == 16  # Llama-1B: group 4
    assert rows_per_tile(4, 4) == PAIRS_PER_TILE
    assert rows_per_tile(9, 3) == 21  # 63 of 64 pairs
    assert rows_per_tile(24, 1) == 2
    assert rows_per_tile(130, 2) == 0  # a group of 65 heads: no tile holds one row


def test_a_step_s_prompt_rows_are_cut_into_tiles_of_one_request():
    # decode, a 5-row chunk after 7 cached tokens, decode, a 2-row verification, a 7-row prompt from position 0
    query_lens, context_lens = [1, 5, 1, 2, 7], [9, 12, 4, 30, 7]
    plan = plan_prompt_tiles(query_lens, context_lens, tile_rows=3)
    assert plan.dtype.name == "int32"
    # (first row, rows, table row = request, first position), longest last key first
    assert plan.tolist() == [
        [7, 2, 3, 28],
        [4, 2, 1, 10],
        [1, 3, 1, 7],
        [15, 1, 4, 6],
        [12, 3, 4, 3],
        [9, 3, 4, 0],
    ]
    by_row = plan_prompt_tiles(query_lens, context_lens, tile_rows=3, tables_by_row=True)
    assert (by_row[:, 2] == by_row[:, 0]).all()
    assert prompt_row_signs(query_lens, 18).tolist() == [1] + [-1] * 5 + [1] + [-1] * 9 + [1, 1]


def test_no_prompt_rows_or_no_tiles_give_an_empty_plan():
    assert plan_prompt_tiles([1, 1, 1], [5, 6, 7], 16).shape == (0, 4)
    assert plan_prompt_tiles([], [], 16).shape == (0, 4)
    assert plan_prompt_tiles([4], [4], 0).shape == (0, 4)


@pytest.mark.parametrize("seed", range(20))
def test_every_prompt_row_is_in_one_tile_with_its_own_causal_limit(seed):
    rng = random.Random(seed)
    tile_rows = rng.choice([1, 2, 3, 4, 16, 21, 64])
    query_lens = [rng.choice([1, 1, 2, rng.randint(2, 150)]) for _ in range(rng.randint(1, 12))]
    context_lens = [n + rng.choice([0, 0, rng.randint(0, 500)]) for n in query_lens]
    plan = plan_prompt_tiles(query_lens, context_lens, tile_rows)
    starts = [sum(query_lens[:i]) for i in range(len(query_lens))]
    seen = {}
    for first_row, rows, request, first_pos in plan.tolist():
        assert 1 <= rows <= tile_rows
        n, ctx = query_lens[request], context_lens[request]
        assert n > 1
        for i in range(rows):
            row = first_row + i
            assert starts[request] <= row < starts[request] + n  # one request's rows
            assert row not in seen
            # the row's keys: every position up to its own, ctx - n + (its index in the chunk)
            seen[row] = first_pos + i + 1
            assert seen[row] == ctx - n + (row - starts[request]) + 1
    assert sorted(seen) == [starts[i] + j for i, n in enumerate(query_lens) if n > 1 for j in range(n)]
    last_keys = [p + r for _, r, _, p in plan.tolist()]
    assert last_keys == sorted(last_keys, reverse=True)
    max_requests = rng.randint(len(query_lens), 16)
    assert len(plan) <= tile_capacity(sum(query_lens), tile_rows, max_requests)


def test_tile_capacity_is_reached():
    assert tile_capacity(3, 2, 8) == 2  # one 3-row prompt: two tiles
    assert len(plan_prompt_tiles([3], [3], 2)) == 2
    assert tile_capacity(8, 3, 8) >= 4  # four 2-row prompts
    assert len(plan_prompt_tiles([2, 2, 2, 2], [2, 5, 9, 2], 3)) == 4
    assert tile_capacity(512, 16, 64) == 92  # Llama-1B's largest whole-step bucket
    assert tile_capacity(1, 16, 64) == 0


# ---------------------------------------------------------------- the algorithm, emulated


def emulate_tiles(q, kv_cache, block_tables, tiles, params: AttentionParams, keys_per_round: int, out=None):
    """What paged_prompt_tiles.cu computes, in PyTorch: for each tile and KV head, the tile's keys in rounds of
    `keys_per_round` (from the tile's first row's window to its last row's position), scores in float32 in base 2,
    one online-softmax step a round, and, for 16-bit inputs, the weights rounded to that type before P V (as the
    tensor-core path does). Rows outside the tiles are left as they are in `out` (NaN if none is given)."""
    out = torch.full_like(q, float("nan")) if out is None else out
    num_kv_heads, block_size, head_dim = kv_cache.shape[1], kv_cache.shape[3], kv_cache.shape[4]
    group = q.shape[1] // num_kv_heads
    scale_log2 = params.scale * math.log2(math.e)
    cap_log2 = (params.logit_softcap or 0.0) * math.log2(math.e)
    window = params.sliding_window or 0
    for first_row, rows, table_row, first_pos in tiles.tolist():
        if rows <= 0:
            continue
        limit = (first_pos + torch.arange(rows) + 1).repeat_interleave(group)  # pair p = row * group + head
        first = (limit - window).clamp(min=0) if window else torch.zeros_like(limit)
        begin, end = (max(0, first_pos + 1 - window) if window else 0), first_pos + rows
        table = block_tables[table_row].long().cpu()
        # [KV heads, pairs, D]: every KV head's block at once
        qt = q[first_row : first_row + rows].float().reshape(rows, num_kv_heads, group, head_dim)
        qt = qt.permute(1, 0, 2, 3).reshape(num_kv_heads, rows * group, head_dim)
        m = torch.full((num_kv_heads, rows * group), float("-inf"))
        l, acc = torch.zeros(num_kv_heads, rows * group), torch.zeros(num_kv_heads, rows * group, head_dim)
        for base in range(begin, end, keys_per_round):
            pos = torch.arange(base, min(base + keys_per_round, end))
            slots = table[pos // block_size] * block_size + pos % block_size
            k = kv_cache[0].reshape(num_kv_heads, -1, head_dim)[:, slots].float()
            v = kv_cache[1].reshape(num_kv_heads, -1, head_dim)[:, slots].float()
            s = qt @ k.transpose(1, 2) * scale_log2
            if cap_log2:
                s = cap_log2 * torch.tanh(s / cap_log2)
            seen = (pos[None, :] < limit[:, None]) & (pos[None, :] >= first[:, None])
            s = s.masked_fill(~seen, float("-inf"))
            top = torch.maximum(m, s.max(dim=2).values)
            ref = torch.where(top == float("-inf"), torch.zeros_like(top), top)
            alpha, p = torch.exp2(m - ref), torch.exp2(s - ref[..., None])
            l = l * alpha + p.sum(dim=2)
            weights = p if q.dtype == torch.float32 else p.to(q.dtype).float()
            acc = acc * alpha[..., None] + weights @ v
            m = top
        o = (acc / l[..., None]).reshape(num_kv_heads, rows, group, head_dim).permute(1, 0, 2, 3)
        out[first_row : first_row + rows] = o.reshape(rows, num_kv_heads * group, head_dim).to(q.dtype)
    return out


MIXED = [(1, 300), (17, 17), (1, 16), (40, 97), (1, 1), (33, 33), (2, 50), (70, 70)]
# float32 agrees with the reference to rounding; 16-bit inputs differ by the weights' rounding before P V (the
# reference multiplies float32 weights) and the output's.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def prompt_rows(meta):
    return torch.tensor([n > 1 for n in meta.query_lens_cpu for _ in range(n)])


# (query heads, KV heads, head dim, dtype, keys a round): Llama-1B's group of 4 in each dtype, SmolLM2's group of 3
# (63 of 64 pairs), a 128-wide head, a group of 24 (2 rows a tile), the float32 path's 32-key rounds.
CASES = [
    (32, 8, 64, torch.bfloat16, 64),
    (32, 8, 64, torch.float16, 64),
    (32, 8, 64, torch.float32, 32),
    (9, 3, 64, torch.bfloat16, 64),
    (8, 8, 128, torch.bfloat16, 64),
    (24, 1, 64, torch.float32, 32),
]


@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim,dtype,keys_per_round", CASES, ids=str)
def test_the_tiled_algorithm_matches_the_reference(num_q_heads, num_kv_heads, head_dim, dtype, keys_per_round):
    q, cache, meta = ragged_batch(MIXED, num_q_heads, num_kv_heads, head_dim, dtype=dtype, device="cpu", seed=head_dim)
    params = AttentionParams.plain(head_dim)
    want = TorchAttention().forward(q.float(), cache.float(), meta, params)
    tile_rows = rows_per_tile(num_q_heads, num_kv_heads)
    plan = torch.from_numpy(plan_prompt_tiles(meta.query_lens_cpu, meta.context_lens_cpu, tile_rows))
    got = emulate_tiles(q, cache, meta.block_tables, plan, params, keys_per_round)
    rows = prompt_rows(meta)
    assert not got[rows].isnan().any()
    assert got[~rows].isnan().all()  # decode rows are not the tiles' work
    assert rel_error(got[rows], want[rows]) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "params",
    [AttentionParams(0.125, sliding_window=20), AttentionParams(0.125, logit_softcap=5.0)],
    ids=["window", "cap"],
)
def test_the_tiled_algorithm_honours_the_window_and_the_soft_cap(dtype, params):
    q, cache, meta = ragged_batch(MIXED, 16, 4, 64, dtype=dtype, device="cpu", seed=5)
    want = TorchAttention().forward(q.float(), cache.float(), meta, params)
    plan = torch.from_numpy(plan_prompt_tiles(meta.query_lens_cpu, meta.context_lens_cpu, rows_per_tile(16, 4)))
    got = emulate_tiles(q, cache, meta.block_tables, plan, params, 64)
    rows = prompt_rows(meta)
    assert rel_error(got[rows], want[rows]) < TOLERANCE[dtype]


# ---------------------------------------------------------------- whole-step graphs with a tiling backend


class TilingTorchAttention(TorchAttention):
    """The reference for decode rows and the emulated kernel for tiles, behind CudaAttention's graph interface: prompt
    rows (negative context lengths) the tiles do not write stay NaN."""

    graph_safe_decode = True
    tiles_seen = 0

    def prompt_tile_rows(self, dtype, num_q_heads, num_kv_heads, head_dim, device) -> int:
        return 4  # few rows a tile, so a prompt takes several

    def forward_decode(self, q, kv_cache, meta, params=None):
        params = params or AttentionParams.plain(q.shape[-1])
        lens = meta.context_lens
        out = self._decode(q, kv_cache, meta.block_tables, None, lens.clamp(min=1), params)
        out[lens < 0] = float("nan")
        if meta.prompt_tiles is not None:
            self.tiles_seen += int((meta.prompt_tiles[:, 1] > 0).sum())
            emulate_tiles(q, kv_cache, meta.block_tables, meta.prompt_tiles, params, 16, out)
        return out


@pytest.mark.parametrize("tiles", [True, False], ids=["tiles", "rows"])
def test_the_gpu_tests_graph_rows_through_the_emulation_match_the_reference(tiles):
    """The metadata test_cuda_kernels.py's tile tests hand the kernels (a whole-step graph's rows), checked here
    through the emulation (or, without tiles, the reference's own graph-safe path)."""
    q, cache, meta = ragged_batch(TILE_MIXED, 32, 8, 64, dtype=torch.bfloat16, device="cpu", seed=4)
    want = TorchAttention().forward(q.float(), cache.float(), meta)
    rows = as_graph_rows(q.float(), cache.float(), meta, tiles=tiles, spare=3)
    got = TilingTorchAttention().forward_decode(q.float(), cache.float(), rows)
    assert not got.isnan().any()
    assert rel_error(got, want) < 1e-5
