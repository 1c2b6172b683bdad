"""The CUDA decode kernel's host-side plan (engine/attention/cuda_backend.py): how many KV splits fill whole
waves of the GPU, which instantiation a head dim gets, and that the backend's constants match the kernel's.
Pure host arithmetic: runs without a GPU."""

import re

import pytest
import torch

from engine.attention.cuda_backend import (
    KERNEL_SOURCE,
    LANES_PER_KEY,
    MAX_HEADS_PER_BLOCK,
    MAX_SPLITS,
    MIN_PARTITION,
    SPLIT_TILE,
    WARPS,
    decode_kernel_name,
    kernel_names,
    plan_splits,
    split_partition,
)

H100_SMS = 132


def test_a_grid_that_fills_one_wave_is_not_split():
    # 64 requests x 8 KV heads = 512 blocks; 132 SMs x 4 resident = 528 slots: one wave, 97% full.
    assert plan_splits(64, 8, 2048, H100_SMS, 4) == 1


def test_splits_fill_the_last_wave():
    # 512 blocks on 396 slots leave the second wave 29% full; 3 splits make 1536 blocks, 3.9 waves.
    assert plan_splits(64, 8, 2048, H100_SMS, 3) == 3
    # 512 blocks on 264 slots already make 1.94 waves: splitting would not fill them better.
    assert plan_splits(64, 8, 2048, H100_SMS, 2) == 1


def test_a_lone_long_context_spreads_over_the_gpu():
    assert plan_splits(1, 8, 131072, H100_SMS, 2) == 33  # 8 x 33 = 264 blocks: exactly one full wave
    assert plan_splits(1, 8, 8192, H100_SMS, 2) == 8192 // MIN_PARTITION  # capped: a split keeps MIN_PARTITION keys
    assert plan_splits(1, 1, 10**6, H100_SMS, 2) == MAX_SPLITS


def test_short_contexts_and_full_grids_stay_whole():
    assert plan_splits(1, 8, MIN_PARTITION, H100_SMS, 2) == 1
    assert plan_splits(1, 8, 1, H100_SMS, 2) == 1
    assert plan_splits(2 * 264, 1, 4096, H100_SMS, 2) == 1  # exactly two whole waves


@pytest.mark.parametrize("num_requests", [1, 3, 8, 17, 64, 130, 256])
@pytest.mark.parametrize("context", [1, 31, 257, 700, 2048, 5000, 32768])
@pytest.mark.parametrize("resident", [1, 2, 3, 4])
def test_every_split_gets_keys_and_no_split_count_ends_sooner(num_requests, context, resident):
    splits = plan_splits(num_requests, 8, context, H100_SMS, resident)
    assert 1 <= splits <= min(MAX_SPLITS, max(1, -(-context // MIN_PARTITION)))
    partition = split_partition(context, splits)
    assert -(-context // partition) == splits  # no split of the longest context is left empty

    def last_wave_ends(s):  # whole waves of blocks, each about its keys plus one tile of fixed cost
        return -(-num_requests * 8 * s // (H100_SMS * resident)) * (split_partition(context, s) + SPLIT_TILE)

    allowed = range(1, min(MAX_SPLITS, max(1, -(-context // MIN_PARTITION))) + 1)
    assert last_wave_ends(splits) == min(last_wave_ends(s) for s in allowed)


@pytest.mark.parametrize("context", [1, 2, 31, 32, 33, 100, 2047, 2048, 2049, 5000])
@pytest.mark.parametrize("splits", [1, 2, 3, 7, 64])
def test_split_ranges_cover_the_context_once(context, splits):
    """The kernel's cut: split i covers [i * p, min((i + 1) * p, context)), p a whole number of tiles."""
    p = split_partition(context, splits)
    assert p % SPLIT_TILE == 0 and p * splits >= context
    covered = [k for i in range(splits) for k in range(i * p, min((i + 1) * p, context))]
    assert covered == list(range(context))


@pytest.mark.parametrize(
    "dtype,head_dim,lanes",
    [
        (torch.bfloat16, 64, 8),
        (torch.bfloat16, 80, 16),
        (torch.float16, 128, 16),
        (torch.bfloat16, 256, 32),
        (torch.float32, 32, 8),
        (torch.float32, 64, 16),
        (torch.float32, 128, 32),
        (torch.bfloat16, 16, 8),
    ],
)
def test_each_head_dim_gets_an_instantiation(dtype, head_dim, lanes):
    name = decode_kernel_name(dtype, head_dim)
    assert name.endswith(f"_lpk{lanes}")
    assert name in kernel_names()


def test_the_backend_constants_are_the_kernels():
    source = KERNEL_SOURCE.read_text()

    def constant(name):
        return int(re.search(rf"constexpr int {name} = (\d+);", source).group(1))

    assert constant("kWarps") == WARPS
    assert constant("kMaxHeads") == MAX_HEADS_PER_BLOCK
    assert constant("kSplitTile") == SPLIT_TILE
    assert tuple(int(n) for n in re.findall(r"ORCINUS_DECODE\(SUFFIX, T, (\d+)\)", source)) == LANES_PER_KEY


@pytest.mark.parametrize("num_requests", [1, 2, 8, 17, 33, 64, 256])
def test_a_captured_step_never_launches_more_than_one_wave_of_split_blocks(num_requests):
    """Planned for the block tables' capacity, not the contexts a replay brings: more than one wave of blocks would
    be mostly empty ones for short contexts."""
    splits = plan_splits(num_requests, 8, 131072, H100_SMS, 2, one_wave=True)
    assert splits == 1 or num_requests * 8 * splits <= H100_SMS * 2


def test_the_capacity_plan_keeps_a_plan_that_fits_one_wave_and_cuts_one_that_does_not():
    assert plan_splits(1, 8, 131072, H100_SMS, 2, one_wave=True) == 33  # the known-context plan: one full wave
    assert plan_splits(64, 8, 131072, H100_SMS, 2, one_wave=True) == 1  # was 64: 32768 blocks
