"""The CUDA attention backend: engine/kernels/csrc/cuda/paged_decode_attention.cu launched through CuPy, SDPA
for prefills.

The model has written this iteration's K/V into the paged cache (fused with RoPE); one kernel attends
every decoding request to its paged context (grid: request x KV head x KV split); when a context is split, the last
split to finish combines them (no second kernel). Multi-token queries (prefill chunks) go, all in one call, to PyTorch's
variable-length flash attention (engine/attention/varlen_prefill.py), which uses tensor cores; a per-token
kernel re-reading each token's prefix cannot.
Everything runs on PyTorch's current stream on the tensors' own memory (engine/kernels/nvrtc.py), so there
are no copies and no synchronisation; the split count comes from host-side lengths.

CuPy is imported lazily so this module imports on machines without it; constructing the backend
there raises a RuntimeError that says why.
"""

from __future__ import annotations

import functools
import math
import warnings

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.attention.backend import AttentionMetadata, AttentionParams
from engine.attention.prompt_tiles import rows_per_tile
from engine.attention.torch_backend import TorchAttention, attend_prefill
from engine.attention.varlen_prefill import PrefillPlan, attend_prefills, flash_varlen
from engine.kernels.availability import builds
from engine.kernels.nvrtc import CUDA_SOURCES, DTYPE_SUFFIX, NvrtcKernels, ptr

KERNEL_SOURCE = CUDA_SOURCES / "paged_decode_attention.cu"
TILE_SOURCE = CUDA_SOURCES / "paged_prompt_tiles.cu"
TILE_HEAD_DIMS = (64, 128)  # the prompt-tile kernel's instantiations
WARPS = 4  # kWarps in the kernel: threads per block = 128
MAX_HEADS_PER_BLOCK = 4  # kMaxHeads: query heads scored per K/V read
LANES_PER_KEY = (8, 16, 32)  # the decode kernel's instantiations (LPK): lanes that read one key row
SPLIT_TILE = 32  # kSplitTile: a split covers a multiple of this many keys
MIN_PARTITION = 256  # fewer keys per split than this and combining the splits costs more than it saves
MAX_SPLITS = 64
MAX_HEAD_BLOCKS = 1 << 20  # (request, head block) pairs one split launch may count: 4 MB of counters a device
PREFILL_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def cuda_backend_available() -> bool:
    """Whether CudaAttention works here: a CUDA device, an importable CuPy, and a kernel that compiles and runs.

    `auto` must fall back to the PyTorch reference rather than fail at the first request, so this
    compiles the module (NVRTC, seconds, once per process) and launches it on a tiny batch.
    """
    return torch.cuda.is_available() and builds(
        lambda: CudaAttention().self_test(), "the CUDA attention kernel is unusable here, using the PyTorch reference"
    )


class CudaAttention:
    """Ragged paged attention in one launch per layer.

    Tensors not on a CUDA device, or head dims above 128, go to the PyTorch reference instead, so
    "auto" stays correct for an engine configured with device="cpu" on a GPU machine.
    """

    graph_safe_decode = True  # forward_decode reads only device tensors: whole decode steps may be captured
    label = "CuPy paged decode, flash varlen prefill"

    def __init__(self, options: tuple[str, ...] = ()) -> None:
        """`options`: extra NVRTC options for the kernels (benchmarks build -D variants; the engine, none)."""
        self._kernels = NvrtcKernels(
            KERNEL_SOURCE, decode_kernel_name(torch.bfloat16, 128), "the cuda attention backend", options
        )
        self._fallback = TorchAttention()
        self._resident: dict = {}  # (kernel, device, shared bytes) -> (SMs, resident blocks per SM)
        self._counters: dict[int, torch.Tensor] = {}  # device -> the split launches' counters, zero between launches
        self.prefill_kernel = "flash"  # "sdpa" once flash varlen attention has failed here
        self._plan_meta, self._plans = None, {}  # the step whose PrefillPlans (by sliding window) are cached
        self._tile_kernels: NvrtcKernels | None = None  # paged_prompt_tiles.cu, compiled when first asked for
        self._tiles_ok: bool | None = None  # whether it compiled and passed its self-test; None: not yet asked

    def self_test(self) -> None:
        """Compile, then decode one token against 3 cached ones (GQA, bf16), whole and cut into 3 splits (two of them
        empty), and compare with the reference."""
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(1, 2, 64, generator=gen).to(torch.bfloat16)
        cache = torch.randn(2, 1, 2, 16, 64, generator=gen).to(torch.bfloat16)  # the request lives in block 1
        meta = AttentionMetadata(
            torch.tensor([0, 1], dtype=torch.int32),
            torch.tensor([3], dtype=torch.int32),
            torch.tensor([[1]], dtype=torch.int32),
            torch.tensor([18]),
            [1],
            [3],
        )
        expected = self._fallback.forward(q.float(), cache.float(), meta)
        dev = torch.device("cuda", torch.cuda.current_device())
        for splits in (None, 3):
            got = self.attend(q.to(dev), cache.to(dev), meta.to(dev), 3, num_splits=splits)
            torch.cuda.synchronize(dev)
            if not torch.allclose(got.float().cpu(), expected, atol=3e-2, rtol=3e-2):
                raise RuntimeError(f"the kernel's self-test output ({splits or 1} splits) differs from the reference")

    def _fits(self, q: torch.Tensor) -> bool:
        """Whether the kernel takes q: on a GPU, a dtype it is built for, rows of whole 16-byte loads."""
        if not q.is_cuda or q.dtype not in DTYPE_SUFFIX:
            return False
        per_load = 16 // q.element_size()
        return q.shape[2] % per_load == 0 and q.shape[2] // per_load <= 32

    def forward(self, q, kv_cache, meta: AttentionMetadata, params: AttentionParams | None = None):
        params = params or AttentionParams.plain(q.shape[-1])
        if not self._fits(q):
            return self._fallback.forward(q, kv_cache, meta, params)
        longest = meta.max_decode_context_len  # once per step, not per layer (a piecewise step asks 16+ times)
        out = self.attend(q, kv_cache, meta, longest, params) if longest else torch.empty_like(q)
        if not meta.is_pure_decode:  # after the kernel: it leaves prefill rows alone
            self._attend_prefills(q, kv_cache, meta, out, params)
        return out

    def _attend_prefills(self, q, kv_cache, meta: AttentionMetadata, out, params: AttentionParams) -> None:
        """All prefill chunks in one flash-attention call where it runs (bf16/f16, no soft cap), else one SDPA each."""
        if (
            self.prefill_kernel == "flash"
            and q.dtype != torch.float32
            and q.shape[2] % 8 == 0
            and q.shape[2] <= 256
            and params.logit_softcap is None
        ):
            if self._plan_meta is not meta:  # once per step: layers share the gather plans (one per window)
                self._plan_meta, self._plans = meta, {}
            if params.sliding_window not in self._plans:
                self._plans[params.sliding_window] = PrefillPlan.build(meta, kv_cache.shape[3], params.sliding_window)
            try:
                attend_prefills(q, kv_cache, self._plans[params.sliding_window], out, flash_varlen, params)
                return
            except RuntimeError as e:  # a PyTorch built without flash attention, an older GPU
                warnings.warn(f"flash varlen attention is unusable here, prefills go one SDPA each: {e}", stacklevel=2)
                self.prefill_kernel = "sdpa"
        qsl = meta.query_starts_cpu
        # Not cuDNN's SDPA: it builds a plan for every new (query, context) shape, and prefill chunks come in ever
        # new shapes, so mixed steps ran many times slower until every shape had been seen.
        with sdpa_kernel(PREFILL_SDPA):
            for i, n in enumerate(meta.query_lens_cpu):
                if n > 1:
                    attend_prefill(q, kv_cache, meta, i, qsl, out, params)

    def forward_decode(self, q, kv_cache, meta: AttentionMetadata, params: AttentionParams | None = None):
        params = params or AttentionParams.plain(q.shape[-1])
        if not self._fits(q):
            return self._fallback.forward_decode(q, kv_cache, meta, params)
        # The split plan for the longest context the block tables can hold: fixed, so it can be captured.
        out = self.attend(
            q, kv_cache, meta, meta.block_tables.shape[1] * kv_cache.shape[3], params, context_known=False
        )
        if meta.prompt_tiles is not None and meta.prompt_tiles.shape[0]:  # the rows the decode kernel left
            self.attend_tiles(q, kv_cache, meta.block_tables, meta.prompt_tiles, out, params)
        return out

    def prompt_tile_rows(self, dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int, device) -> int:
        """Rows of a prompt tile for this model, or 0 where the tile kernel does not run (a dtype or head dim it is not
        built for, a GQA group wider than a tile, a GPU before sm_80, a kernel that fails to compile or its self-test:
        the prompt rows then stay with the decode kernel, one by one)."""
        device = torch.device(device)
        if (
            device.type != "cuda"
            or dtype not in DTYPE_SUFFIX
            or head_dim not in TILE_HEAD_DIMS
            or torch.cuda.get_device_capability(device) < (8, 0)
        ):
            return 0
        if self._tiles_ok is None:
            self._tiles_ok = builds(
                lambda: self.tile_self_test(device),
                "the prompt-tile kernel is unusable here, prompt rows go one by one",
            )
        return rows_per_tile(num_q_heads, num_kv_heads) if self._tiles_ok else 0

    def tile_self_test(self, device: torch.device) -> None:
        """Compile paged_prompt_tiles.cu, then attend the last 20 of 70 keys' rows of one request (GQA 4, D 64) as a
        full tile and a partial one, plus a spare, in bf16 and float32, and compare with the reference."""
        self._tile_kernels = NvrtcKernels(TILE_SOURCE, tile_kernel_name(torch.bfloat16, 128), "the prompt-tile kernel")
        gen = torch.Generator().manual_seed(0)
        table = torch.tensor([[3, 1, 5, 0, 2]], dtype=torch.int32)  # 70 keys in 5 blocks of 16, out of order
        meta = AttentionMetadata(
            torch.tensor([0, 20], dtype=torch.int32),
            torch.tensor([70], dtype=torch.int32),
            table,
            torch.zeros(20, dtype=torch.int64),
            [20],
            [70],
        )
        tiles = torch.tensor([[0, 16, 0, 50], [16, 4, 0, 66], [0, 0, 0, 0]], dtype=torch.int32, device=device)
        for dtype, tolerance in ((torch.bfloat16, 3e-2), (torch.float32, 1e-4)):
            q = torch.randn(20, 8, 64, generator=gen).to(dtype)
            cache = torch.randn(2, 2, 6, 16, 64, generator=gen).to(dtype)
            expected = self._fallback.forward(q.float(), cache.float(), meta)
            out = torch.zeros(q.shape, dtype=dtype, device=device)
            self.attend_tiles(q.to(device), cache.to(device), table.to(device), tiles, out)
            torch.cuda.synchronize(device)
            if not torch.allclose(out.float().cpu(), expected, atol=tolerance, rtol=tolerance):
                raise RuntimeError(f"the prompt-tile kernel's self-test output ({dtype}) differs from the reference")

    def attend_tiles(self, q, kv_cache, block_tables, tiles, out, params: AttentionParams | None = None) -> None:
        """Rows of `tiles` ([k, 4] int32, engine/attention/prompt_tiles.py; tiles with 0 rows are skipped) attended
        into `out` by paged_prompt_tiles.cu: one block a (tile, KV head). Reads only device tensors: capturable."""
        params = params or AttentionParams.plain(q.shape[-1])
        _, num_q_heads, head_dim = q.shape
        num_kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[3]
        if self._tile_kernels is None and not self.prompt_tile_rows(
            q.dtype, num_q_heads, num_kv_heads, head_dim, q.device
        ):
            raise RuntimeError(f"the prompt-tile kernel does not take {q.dtype} rows of {head_dim} on {q.device}")
        if not (q.dtype in DTYPE_SUFFIX and head_dim in TILE_HEAD_DIMS and rows_per_tile(num_q_heads, num_kv_heads)):
            raise ValueError(f"the prompt-tile kernel does not take {num_q_heads} heads of {head_dim} in {q.dtype}")
        q = q.contiguous()  # out was made like this (forward_decode's attend): rows at q's dense strides
        tables = block_tables.to(torch.int32).contiguous()
        tiles = tiles.to(torch.int32).contiguous()  # each read as one 16-byte load
        scale_log2, cap_log2 = math.log2(math.e) * params.scale, math.log2(math.e) * (params.logit_softcap or 0.0)
        with self._tile_kernels.on_torch_stream(q):
            self._tile_kernels(tile_kernel_name(q.dtype, head_dim), q.device)(
                (tiles.shape[0], num_kv_heads),
                (WARPS * 32,),
                (
                    ptr(out),
                    ptr(q),
                    ptr(kv_cache),
                    ptr(tiles),
                    ptr(tables),
                    np.int32(tables.shape[1]),
                    np.int32(num_q_heads),
                    np.int32(num_kv_heads),
                    np.int32(block_size),
                    np.int64(kv_cache.shape[2] * block_size),
                    np.float32(scale_log2),
                    np.int32(params.sliding_window or 0),
                    np.float32(cap_log2),
                ),
            )

    # ----------------------------------------------------------------------------- launches

    def attend(
        self,
        q,
        kv_cache,
        meta: AttentionMetadata,
        max_context_len: int,
        params: AttentionParams | None = None,
        context_known: bool = True,
        num_splits: int | None = None,
    ) -> torch.Tensor:
        """Attention of every request with one query token; other rows of the result are left unwritten.
        `context_known=False`: max_context_len is only the capacity (a captured step), not the longest context.
        `num_splits` overrides the plan (the self-test)."""
        params = params or AttentionParams.plain(q.shape[-1])
        num_tokens, num_q_heads, head_dim = q.shape
        num_kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[3]
        q = q.contiguous()
        out = torch.empty_like(q)  # after contiguous(): the kernel writes rows at q's dense strides
        num_requests = meta.num_requests
        if num_tokens == 0 or num_requests == 0:
            return out
        qsl = meta.query_start_loc.to(torch.int32).contiguous()
        ctx = meta.context_lens.to(torch.int32).contiguous()
        tables = meta.block_tables.to(torch.int32).contiguous()
        group = num_q_heads // num_kv_heads
        # Groups wider than MAX_HEADS_PER_BLOCK heads are cut into equal head blocks.
        blocks_per_kv = -(-group // MAX_HEADS_PER_BLOCK)
        heads_per_block = -(-group // blocks_per_kv)
        name = decode_kernel_name(q.dtype, head_dim)
        # The merge buffer: each lane group's acc [heads, D] and (m, l) per head, float32; the splits' merge reuses
        # it for kMaxHeads x (splits + 1) weights and sums.
        shared = 4 * max(
            (WARPS * 32 // lanes_per_key(head_dim, q.element_size())) * heads_per_block * (head_dim + 2),
            MAX_HEADS_PER_BLOCK * (MAX_SPLITS + 1),
        )
        sm_count, resident = self._occupancy(name, q.device, shared)
        keys = min(max_context_len, params.sliding_window or max_context_len)  # the most keys a request reads
        num_splits = num_splits or plan_splits(
            num_requests, num_kv_heads * blocks_per_kv, keys, sm_count, resident, one_wave=not context_known
        )
        if num_splits > 1:
            rows = num_requests * num_q_heads * num_splits
            ws_acc = torch.empty(rows * head_dim, dtype=torch.float32, device=q.device)
            ws_ml = torch.empty(rows * 2, dtype=torch.float32, device=q.device)
            counters = self._counters_on(q.device, num_requests * num_kv_heads * blocks_per_kv)
        else:  # the kernel writes `out` directly and never touches the workspace
            ws_acc = ws_ml = out
            counters = qsl  # never read
        # Scores are kept in base 2 (exp2f): the scale and the cap carry log2(e).
        scale_log2, cap_log2 = math.log2(math.e) * params.scale, math.log2(math.e) * (params.logit_softcap or 0.0)
        with self._kernels.on_torch_stream(q):
            self._kernels(name, q.device)(
                (num_requests, num_kv_heads * blocks_per_kv, num_splits),
                (WARPS * 32,),
                (
                    ptr(out),
                    ptr(ws_acc),
                    ptr(ws_ml),
                    ptr(counters),
                    ptr(q),
                    ptr(kv_cache),
                    ptr(qsl),
                    ptr(ctx),
                    ptr(tables),
                    np.int32(tables.shape[1]),
                    np.int32(num_q_heads),
                    np.int32(num_kv_heads),
                    np.int32(heads_per_block),
                    np.int32(head_dim),
                    np.int32(block_size),
                    np.int64(kv_cache.shape[2] * block_size),
                    np.float32(scale_log2),
                    np.int32(params.sliding_window or 0),
                    np.float32(cap_log2),
                ),
                shared_mem=shared,
            )
        return out

    def _counters_on(self, device: torch.device, head_blocks: int) -> torch.Tensor:
        """The device's split counters, one per (request, head block); each launch leaves them zero again. Made once
        at their full size: a captured step bakes in their address."""
        if head_blocks > MAX_HEAD_BLOCKS:
            raise ValueError(
                f"{head_blocks} (request, KV head block) pairs in one decode launch; at most {MAX_HEAD_BLOCKS}"
            )
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._counters:
            self._counters[index] = torch.zeros(MAX_HEAD_BLOCKS, dtype=torch.int32, device=device)
        return self._counters[index]

    def _occupancy(self, name: str, device: torch.device, shared: int) -> tuple[int, int]:
        """(SMs, resident blocks per SM of kernel `name` with `shared` bytes of dynamic shared memory), once each."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        key = (name, index, shared)
        if key not in self._resident:
            kernel = self._kernels(name, torch.device("cuda", index))
            with self._kernels.cp.cuda.Device(index):
                blocks = self._kernels.cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
                    kernel.kernel.ptr, WARPS * 32, shared
                )
            self._resident[key] = (torch.cuda.get_device_properties(index).multi_processor_count, blocks)
        return self._resident[key]


@functools.cache
def lanes_per_key(head_dim: int, element_size: int) -> int:
    """The decode kernel's LPK for a head dim: one 16-byte load per lane, a power of two, at least 8."""
    packs = head_dim * element_size // 16
    return max(LANES_PER_KEY[0], 1 << (packs - 1).bit_length())


@functools.cache  # asked by every layer of every step
def decode_kernel_name(dtype: torch.dtype, head_dim: int) -> str:
    return f"paged_decode_attention_{DTYPE_SUFFIX[dtype]}_lpk{lanes_per_key(head_dim, dtype.itemsize)}"


def kernel_names() -> list[str]:
    """Every function of paged_decode_attention.cu the backend may launch."""
    return [f"paged_decode_attention_{s}_lpk{n}" for s in DTYPE_SUFFIX.values() for n in LANES_PER_KEY]


def tile_kernel_name(dtype: torch.dtype, head_dim: int) -> str:
    return f"paged_prompt_tiles_{DTYPE_SUFFIX[dtype]}_d{head_dim}"


def tile_kernel_names() -> list[str]:
    """Every function of paged_prompt_tiles.cu the backend may launch."""
    return [tile_kernel_name(t, d) for t in DTYPE_SUFFIX for d in TILE_HEAD_DIMS]


def split_partition(context_len: int, num_splits: int) -> int:
    """Keys per split as the kernel cuts a context: equal ranges, rounded up to whole SPLIT_TILEs."""
    per_split = -(-context_len // num_splits)
    return max(SPLIT_TILE, -(-per_split // SPLIT_TILE) * SPLIT_TILE)


@functools.lru_cache(maxsize=4096)  # a pure function, asked by every layer of a step: its loop runs once a shape
def plan_splits(
    num_requests: int,
    kv_head_blocks: int,
    max_context_len: int,
    sm_count: int,
    blocks_per_sm: int,
    one_wave: bool = False,
) -> int:
    """How many KV ranges the decode kernel cuts every context into (its grid: requests x kv_head_blocks x splits).

    The grid runs in waves of sm_count x blocks_per_sm resident blocks, each block taking about its keys plus a
    fixed tile's worth; the count whose last wave ends soonest wins, the fewest splits on a tie. Capped so a
    split keeps MIN_PARTITION keys of the longest context, and at MAX_SPLITS. `one_wave`: max_context_len is a
    capacity (a captured step replays for any context), so the splits stop at one wave of blocks: planned for the
    capacity, short contexts left nearly every block empty (llama-1b, 64 requests of ~140 keys: 124 waves).
    """
    slots = sm_count * max(1, blocks_per_sm)
    blocks = num_requests * kv_head_blocks
    longest = max(1, max_context_len)
    most = min(MAX_SPLITS, -(-longest // MIN_PARTITION))
    if one_wave:
        most = min(most, slots // blocks)
    best, best_cost = 1, None
    for splits in range(1, max(1, most) + 1):
        partition = split_partition(longest, splits)
        if -(-longest // partition) < splits:  # its last splits get no key: the work of fewer splits, more blocks
            continue
        cost = -(-blocks * splits // slots) * (partition + SPLIT_TILE)  # whole waves x one block's keys (+ fixed)
        if best_cost is None or cost < best_cost:
            best, best_cost = splits, cost
    return best
