"""The CUDA attention kernels: nvcc must compile them warning-free (here), and on a GPU they must
match the PyTorch reference on ragged prefill/decode batches (skipped without CuPy and a GPU)."""

import importlib.util
import random
import re
import shutil
import subprocess

import pytest
import torch

from engine.attention import cuda_backend
from engine.attention.backend import AttentionMetadata, AttentionParams, write_kv
from engine.attention.prompt_tiles import plan_prompt_tiles, prompt_row_signs, rows_per_tile
from engine.attention.selector import make_backend
from engine.attention.torch_backend import TorchAttention
from engine.kernels.nvrtc import CUDA_SOURCES, NVRTC_OPTIONS, kernel_source
from engine.model import cuda_token_ops

KERNELS = sorted(CUDA_SOURCES.glob("*.cu"))
HAVE_GPU = torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None
needs_gpu = pytest.mark.gpu  # runs with `pytest --gpu` (conftest), which also needs CuPy here


# ---------------------------------------------------------------- compile check (no GPU needed)


# Each .cu file and every function its launcher may call.
LAUNCHED = {
    cuda_backend.KERNEL_SOURCE: cuda_backend.kernel_names(),
    cuda_backend.TILE_SOURCE: cuda_backend.tile_kernel_names(),
    cuda_token_ops.KERNEL_SOURCE: cuda_token_ops.kernel_names(),
    cuda_token_ops.NORM_SOURCE: cuda_token_ops.norm_kernel_names(),
}


def test_there_are_kernels():
    # The compile check below builds the launchers' sources; another .cu would need its launcher's names there.
    assert [p.name for p in KERNELS] == sorted(p.name for p in LAUNCHED), f".cu files in {CUDA_SOURCES}: {KERNELS}"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_every_launched_kernel_builds_without_spills(tmp_path):
    """Each kernel source as its launcher builds it (its headers pasted in, NVRTC's options, plus the -ftz=true CuPy
    adds) compiles without a warning for Hopper and Ampere; every function a launcher may call is there, and none
    spills registers or keeps a stack frame; nor does the decode kernel's variant with more blocks an SM that
    bench_attention.py times.
    (All the builds run side by side: ptxas is most of each ~10 s.)"""
    builds = {}
    variant = ("-DORCINUS_DECODE_UNROLL=2", "-DORCINUS_DECODE_MIN_BLOCKS=3")
    for source, arch, defines in [(s, a, ()) for s in LAUNCHED for a in ("sm_90", "sm_80")] + [
        (cuda_backend.KERNEL_SOURCE, "sm_90", variant)
    ]:
        out = tmp_path / f"{source.stem}.{arch}{len(defines)}.cubin"
        pasted = tmp_path / source.name  # the text NVRTC gets: the file with its own headers pasted in
        pasted.write_text(kernel_source(source))
        cmd = [
            "nvcc",
            f"-arch={arch}",
            *NVRTC_OPTIONS,
            *defines,
            "-ftz=true",
            "-Werror",
            "all-warnings",
            "--resource-usage",
            "-cubin",
            str(pasted),
            "-o",
            str(out),
        ]
        builds[source, arch, defines] = (
            cmd,
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
        )
    for (source, arch, _), (cmd, proc) in builds.items():
        log = proc.communicate(timeout=180)[0]
        assert proc.returncode == 0, f"{' '.join(cmd)}\n{log}"
        assert "warning" not in log.lower(), log
        usage = dict(re.findall(r"Function properties for (\w+)\n\s*(.*)", log))
        for name in LAUNCHED[source]:
            assert name in usage, f"{arch}: {name} is not in {source.name}:\n{log}"
            assert usage[name] == "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", (
                f"{arch} {name}: {usage[name]}"
            )


# ---------------------------------------------------------------- backend selection (CPU)


@pytest.mark.skipif(HAVE_GPU, reason="checks the CPU-only selection")
def test_auto_is_torch_and_cuda_refuses_without_gpu():
    assert type(make_backend("auto", "cuda")) is TorchAttention
    with pytest.raises(RuntimeError, match="needs CuPy and an NVIDIA GPU"):
        make_backend("cuda")


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="unknown attention backend"):
        make_backend("flash")


# ---------------------------------------------------------------- correctness on a GPU


def ragged_batch(
    requests, num_q_heads, num_kv_heads, head_dim, block_size=16, dtype=torch.bfloat16, device="cuda", seed=0
):
    """requests: (new query tokens n, context length ctx) pairs -> (q, cache, meta). Positions before ctx - n
    hold random values in randomly placed blocks; the n new tokens' K/V are written as the model writes them."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_per = [-(-ctx // block_size) for _, ctx in requests]
    num_blocks = sum(blocks_per) + 3
    free = list(range(1, num_blocks))  # block 0 left unused, like a padding entry
    rng.shuffle(free)
    cache = torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim, generator=gen).to(dtype)
    tables = torch.zeros(len(requests), max(blocks_per), dtype=torch.int32)
    slots = []
    for i, ((n, ctx), nb) in enumerate(zip(requests, blocks_per)):
        tables[i, :nb] = torch.tensor([free.pop() for _ in range(nb)], dtype=torch.int32)
        slots += [int(tables[i, p // block_size]) * block_size + p % block_size for p in range(ctx - n, ctx)]
    num_tokens = sum(n for n, _ in requests)
    q = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    qsl = [0]
    for n, _ in requests:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        context_lens=torch.tensor([c for _, c in requests], dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_lens_cpu=[n for n, _ in requests],
        context_lens_cpu=[c for _, c in requests],
    )
    write_kv(k, v, cache, meta.slot_mapping)
    return q.to(device), cache.to(device), to_device(meta, device)


def to_device(meta, device):
    return meta.to(device)


def reference(q, cache, meta):
    """TorchAttention on float32 CPU copies of the same (already bf16-rounded) inputs."""
    return TorchAttention().forward(q.float().cpu(), cache.float().cpu(), to_device(meta, "cpu"))


def rel_error(a, b):
    return ((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm()).item()


PREFILL = [(15, 15), (16, 16), (17, 17), (300, 300), (40, 97)]  # last one: a chunk after 57 cached tokens
DECODE = [(1, 1), (1, 15), (1, 16), (1, 17), (1, 33), (1, 2048), (1, 2049)]
MIXED = [(1, 2048), (17, 17), (1, 16), (64, 1000), (1, 1), (33, 33), (1, 513)]
BATCHES = {"prefill": PREFILL, "decode": DECODE, "mixed": MIXED, "long-prefill": [(2048, 2048), (1, 300)]}


@needs_gpu
@pytest.mark.parametrize("kind", sorted(BATCHES))
@pytest.mark.parametrize(
    "num_q_heads,num_kv_heads", [(4, 4), (6, 2), (16, 2), (34, 2), (24, 1)], ids=["g1", "g3", "g8", "g17", "g24"]
)
def test_matches_reference(kind, num_q_heads, num_kv_heads):
    q, cache, meta = ragged_batch(BATCHES[kind], num_q_heads, num_kv_heads, head_dim=128)
    want = reference(q, cache, meta)
    got = make_backend("cuda").forward(q, cache, meta)
    assert rel_error(got, want) < 1e-2


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_dtypes_and_head_dims(dtype, head_dim):
    q, cache, meta = ragged_batch(MIXED, 8, 2, head_dim=head_dim, block_size=32, dtype=dtype, seed=1)
    want = reference(q, cache, meta)
    got = make_backend("cuda").forward(q, cache, meta)
    assert got.dtype == dtype
    assert rel_error(got, want) < (1e-2 if dtype != torch.float32 else 1e-4)


@needs_gpu
@pytest.mark.parametrize("seed", range(5))
def test_random_ragged_batches(seed):
    rng = random.Random(seed)
    requests = []
    for _ in range(rng.randint(1, 12)):
        ctx = rng.choice([1, 15, 16, 17, rng.randint(1, 700), 2048])
        requests.append((rng.choice([1, 1, ctx, rng.randint(1, ctx)]), ctx))
    heads = rng.choice([(8, 8), (12, 4), (32, 4)])
    q, cache, meta = ragged_batch(requests, *heads, head_dim=128, seed=seed)
    want = reference(q, cache, meta)
    assert rel_error(make_backend("cuda").forward(q, cache, meta), want) < 1e-2


@needs_gpu
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (16, 2), (34, 2), (24, 1)])
def test_forward_decode_matches_reference_with_the_fixed_split_plan(num_q_heads, num_kv_heads):
    """The graph-safe decode path plans its splits for the whole table width, not the batch's longest context."""
    q, cache, meta = ragged_batch(DECODE, num_q_heads, num_kv_heads, head_dim=128)
    want = reference(q, cache, meta)
    got = make_backend("cuda").forward_decode(q, cache, meta)
    assert rel_error(got, want) < 1e-2


@needs_gpu
def test_auto_picks_cuda_and_cpu_tensors_fall_back():
    backend = make_backend("auto", "cuda")
    assert type(backend).__name__ == "CudaAttention"
    q, cache, meta = ragged_batch([(3, 3), (1, 5)], 4, 2, 64, dtype=torch.float32, device="cpu")
    want = reference(q, cache, meta)
    assert rel_error(backend.forward(q, cache, meta), want) < 1e-5


# Decode contexts around the kernel's edges: one key, block and 32-key tile boundaries, more keys than one
# shared-memory chunk of slots (2048), and lengths no block size divides.
SPLIT_CONTEXTS = [1, 2, 15, 16, 17, 33, 100, 257, 1000, 2048, 2049, 4100, 5000]


def force_splits(monkeypatch, splits):
    monkeypatch.setattr(cuda_backend, "plan_splits", lambda *args, **kwargs: splits)


@needs_gpu
@pytest.mark.parametrize("splits", [1, 2, 3, 7, 64])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (16, 4), (32, 4)], ids=["g1", "g4", "g8"])
def test_decode_kernel_with_any_split_count(monkeypatch, splits, num_q_heads, num_kv_heads):
    """Ragged contexts cut into a forced number of splits (short ones leave splits empty) vs the reference."""
    force_splits(monkeypatch, splits)
    q, cache, meta = ragged_batch([(1, c) for c in SPLIT_CONTEXTS], num_q_heads, num_kv_heads, 128, seed=splits)
    assert rel_error(make_backend("cuda").forward(q, cache, meta), reference(q, cache, meta)) < 1e-2


@needs_gpu
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_kernel_dtypes_and_head_dims_with_splits(monkeypatch, splits, dtype, head_dim):
    force_splits(monkeypatch, splits)
    q, cache, meta = ragged_batch([(1, c) for c in SPLIT_CONTEXTS], 16, 4, head_dim, block_size=24, dtype=dtype, seed=7)
    got = make_backend("cuda").forward(q, cache, meta)
    assert got.dtype == dtype
    assert rel_error(got, reference(q, cache, meta)) < (1e-2 if dtype != torch.float32 else 1e-4)


@needs_gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_batches_of_several_waves(head_dim):
    """More thread blocks than the GPU holds at once (300 requests x 8 KV heads), split as the backend plans,
    through the eager and the graph-safe path."""
    rng = random.Random(head_dim)
    q, cache, meta = ragged_batch([(1, rng.randint(1, 700)) for _ in range(300)], 32, 8, head_dim, seed=3)
    want = reference(q, cache, meta)
    backend = make_backend("cuda")
    assert rel_error(backend.forward(q, cache, meta), want) < 1e-2
    assert rel_error(backend.forward_decode(q, cache, meta), want) < 1e-2


@needs_gpu
def test_split_counters_are_zero_again_after_every_launch_and_replay(monkeypatch):
    """The last split of each (request, head block) merges and resets its counter: a captured split launch
    replayed many times gives the same bits each time and leaves every counter zero."""
    force_splits(monkeypatch, 7)
    q, cache, meta = ragged_batch([(1, c) for c in SPLIT_CONTEXTS] + [(5, 40)], 16, 4, 128, seed=11)
    backend = make_backend("cuda")
    first = backend.forward_decode(q, cache, meta)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward_decode(q, cache, meta)
    decode_rows = torch.tensor(meta.query_lens_cpu) == 1
    want = reference(q, cache, meta)
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        rows = meta.query_start_loc[:-1].cpu()[decode_rows]
        assert torch.equal(out[rows.to(out.device)], first[rows.to(out.device)])
    assert rel_error(out[rows.to(out.device)], want[rows]) < 1e-2
    assert not backend._counters[q.device.index].any()


# ---------------------------------------------------------------- prompt rows by tiles (paged_prompt_tiles.cu)


# Decodes beside prompt chunks: from position 0 (17, 33, 200 rows: several tiles, a partial last one), after a cached
# prefix (64 rows after 936 keys: more than one 64-key round before the diagonal), and a 2-row verification.
TILE_MIXED = [(1, 2048), (17, 17), (1, 16), (64, 1000), (1, 1), (33, 33), (1, 513), (200, 200), (2, 40)]


def as_graph_rows(q, cache, meta, tiles: bool = True, spare: int = 0):
    """`meta` as a whole-step graph hands it to forward_decode: a row per query with its request's block table and its
    own key count, negated for prompt rows, which the tile plan (and `spare` empty tiles after it) covers."""
    lens_q, ctx = meta.query_lens_cpu, meta.context_lens_cpu
    num_rows = sum(lens_q)
    keys = torch.tensor([c - n + j + 1 for n, c in zip(lens_q, ctx) for j in range(n)], dtype=torch.int32)
    requests = torch.tensor([i for i, n in enumerate(lens_q) for _ in range(n)], device=meta.block_tables.device)
    plan = None
    if tiles:
        keys *= torch.from_numpy(prompt_row_signs(lens_q, num_rows))
        rows = rows_per_tile(q.shape[1], cache.shape[1])
        plan = torch.from_numpy(plan_prompt_tiles(lens_q, ctx, rows, tables_by_row=True))
        plan = torch.cat([plan, torch.zeros(spare, 4, dtype=torch.int32)]).to(q.device)
    return AttentionMetadata(
        torch.arange(num_rows + 1, dtype=torch.int32, device=q.device),
        keys.to(q.device),
        meta.block_tables[requests],
        meta.slot_mapping,
        [1] * num_rows,
        [abs(k) for k in keys.tolist()],
        prompt_tiles=plan,
    )


@needs_gpu
@pytest.mark.parametrize(
    "dtype,head_dim,num_q_heads,num_kv_heads",
    [
        (torch.bfloat16, 64, 32, 8),  # Llama-1B: a group of 4, 16 rows a tile
        (torch.bfloat16, 128, 32, 8),
        (torch.bfloat16, 64, 9, 3),  # SmolLM2: 21 rows, 63 of 64 pairs
        (torch.bfloat16, 64, 24, 1),  # 2 rows a tile
        (torch.float16, 64, 32, 8),
        (torch.float16, 128, 32, 8),
        (torch.float32, 64, 32, 8),
        (torch.float32, 128, 8, 8),  # 64 rows a tile
    ],
    ids=str,
)
def test_prompt_tiles_match_reference(dtype, head_dim, num_q_heads, num_kv_heads):
    """A mixed step through the graph-safe path with tiles: decode rows by the decode kernel, prompt rows by the tile
    kernel (spare tiles with no rows after the plan), every row against the reference."""
    q, cache, meta = ragged_batch(TILE_MIXED, num_q_heads, num_kv_heads, head_dim, dtype=dtype, seed=head_dim)
    want = reference(q, cache, meta)
    got = make_backend("cuda").forward_decode(q, cache, as_graph_rows(q, cache, meta, spare=5))
    assert got.dtype == dtype
    assert rel_error(got, want) < (1e-2 if dtype != torch.float32 else 1e-4)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "params", [AttentionParams(0.1, sliding_window=48), AttentionParams(0.1, logit_softcap=5.0)], ids=["window", "cap"]
)
def test_prompt_tiles_honour_the_window_and_the_soft_cap(dtype, params):
    q, cache, meta = ragged_batch(TILE_MIXED, 16, 4, 64, dtype=dtype, seed=2)
    want = TorchAttention().forward(q.float().cpu(), cache.float().cpu(), to_device(meta, "cpu"), params)
    got = make_backend("cuda").forward_decode(q, cache, as_graph_rows(q, cache, meta), params)
    assert rel_error(got, want) < (1e-2 if dtype != torch.float32 else 1e-4)


@needs_gpu
def test_prompt_tiles_in_a_captured_graph_give_the_same_bits_on_every_replay():
    q, cache, meta = ragged_batch(TILE_MIXED, 32, 8, 64, seed=4)
    rows = as_graph_rows(q, cache, meta, spare=3)
    backend = make_backend("cuda")
    first = backend.forward_decode(q, cache, rows)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward_decode(q, cache, rows)
    for _ in range(10):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first)
    per_row = backend.forward_decode(q, cache, as_graph_rows(q, cache, meta, tiles=False))  # every row a decode query
    assert rel_error(out, per_row) < 1e-2
