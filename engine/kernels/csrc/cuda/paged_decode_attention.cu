// Paged decode attention: each request that decodes one token attends to its whole paged context.
//
// Loaded at run time by engine/attention/cuda_backend.py through cupy.RawModule (NVRTC), and compiled
// offline by tests/test_cuda_kernels.py with nvcc -Werror so warnings are caught without a GPU.
// The entry points are extern "C" so RawModule finds them by plain name; each is a thin wrapper
// over a template instantiated for __nv_bfloat16, __half and float (and, for the decode kernel, for
// 8, 16 or 32 lanes per key: the backend picks by head dim). All arithmetic on scores, the softmax
// and the output accumulator is float32. Multi-token queries (prefill chunks) are not attended here:
// the backend hands them to a fused SDPA kernel, which uses tensor cores.
//
// Layouts (see engine/attention/backend.py):
//   q            [T, Hq, D]        contiguous
//   kv_cache     [2, Hkv, num_slots, D]  keys then values, num_slots = num_blocks * block_size; it already
//                holds this iteration's keys and values (the model writes them, fused with RoPE)
//   block_tables [B, max_blocks] int32; token p of request i is at slot
//                block_tables[i][p / block_size] * block_size + p % block_size
//   query_start_loc [B + 1] int32, context_lens [B] int32; a negative length marks a row this kernel leaves alone
//                (a whole-step graph's prompt row, which paged_prompt_tiles.cu attends in a tile of its request's rows)
//
// Decode is bound by reading K/V, so the kernel is built around the loads. Grid: (request, KV head x
// head block, KV split). A key row of D elements is read by LPK lanes with one 16-byte load each
// (LPK = D / 8 for 16-bit types, rounded up to a power of two, at least 8), so a 4-warp block reads
// 128 / LPK keys per load round; the query heads that share the KV head (up to kMaxHeads) are scored
// against each key while it is in registers, so K/V is read from memory once per group.
//
// The split's cache slots are computed once into shared memory (kSlotChunk keys at a time), so no
// K/V load waits on a block-table load. Each lane group loads kUnroll keys per tile into one of two
// register buffers and issues the next tile's loads before the math on this one (software
// pipelining: 2 x kUnroll 16-byte K/V pairs in flight per lane). Every lane group keeps its own online
// softmax (running max m, sum l, unnormalised acc over its lanes' dims), rescaled once per tile; the
// groups are merged through shared memory at the end, and, when the KV range is cut into splits
// (flash-decoding, to fill the GPU), the splits' (m, l, acc) go to a float32 workspace, and the last split of a
// (request, head block) to finish combines them (a per-launch counter each, reset by that last split): no second
// kernel, whose launch and serial reads over the splits were a large share of a short context's attention at small
// batches (docs/performance.md, GPU).
//
// Per layer (AttentionParams): the softmax scale, a sliding window (only the last `window` keys are read) and a
// soft cap on the scores (cap * tanh(score / cap), in the base-2 domain the scores are kept in).
//
// The split count is a launch parameter (fixed when a decode step is captured as a CUDA graph);
// each request cuts its own context into that many equal ranges, so short and long contexts alike
// spread over every split, and no host value of a context length is needed.

#include "convert.cuh"

namespace {

constexpr int kWarp = 32;
constexpr int kWarps = 4;          // warps per block
constexpr int kThreads = kWarps * kWarp;
// The two tuning knobs take -D overrides, so a benchmark can build variants side by side (bench_attention.py
// --variant); the engine builds the defaults.
#ifndef ORCINUS_DECODE_MIN_BLOCKS
#define ORCINUS_DECODE_MIN_BLOCKS 2
#endif
#ifndef ORCINUS_DECODE_UNROLL
#define ORCINUS_DECODE_UNROLL 4
#endif
constexpr int kMinBlocksPerSM = ORCINUS_DECODE_MIN_BLOCKS; // __launch_bounds__: registers for this many blocks an SM
constexpr int kMaxHeads = 4;       // query heads per block; wider GQA groups are cut into head blocks
constexpr int kUnroll = ORCINUS_DECODE_UNROLL;  // keys per lane group per tile; two tiles' loads in flight at once
constexpr int kSplitTile = 32;     // a split covers a multiple of this many keys (SPLIT_TILE in the backend)
constexpr int kSlotChunk = 2048;   // keys whose cache slots are staged in shared memory at once (8 KB)
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// 16 bytes of T as floats: 8 for the 16-bit types, 4 for float.
template <typename T> struct Pack {
    static constexpr int kSize = 16 / sizeof(T);
};

template <typename T> __device__ __forceinline__ void unpack(const uint4& raw, float* f);
template <> __device__ __forceinline__ void unpack<float>(const uint4& raw, float* f) {
    f[0] = __uint_as_float(raw.x);
    f[1] = __uint_as_float(raw.y);
    f[2] = __uint_as_float(raw.z);
    f[3] = __uint_as_float(raw.w);
}
template <> __device__ __forceinline__ void unpack<__nv_bfloat16>(const uint4& raw, float* f) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 x = __bfloat1622float2(h[i]);
        f[2 * i] = x.x;
        f[2 * i + 1] = x.y;
    }
}
template <> __device__ __forceinline__ void unpack<__half>(const uint4& raw, float* f) {
    const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 x = __half22float2(h[i]);
        f[2 * i] = x.x;
        f[2 * i + 1] = x.y;
    }
}

template <typename T> __device__ __forceinline__ uint4 load16(const T* p) {
    return *reinterpret_cast<const uint4*>(p);
}

// This lane's 16 bytes of the rows of one tile's keys base + u * kGroups + grp (K or V: `cache` picks).
// Keys at or past `end` (and lanes past the row) load nothing and hold zeros, so the math needs no branch.
template <typename T, int kGroups>
__device__ __forceinline__ void load_tile(uint4 (&raw)[kUnroll], const T* cache, const int* s_slot, int chunk,
                                          int end, int base, int grp, bool owns, int head_dim) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const int pos = base + u * kGroups + grp;
        raw[u] = make_uint4(0, 0, 0, 0);
        if (owns && pos < end) raw[u] = load16(cache + static_cast<long long>(s_slot[pos - chunk]) * head_dim);
    }
}

// Scores of one tile's keys against every head, then one online-softmax step per head for the whole tile:
// m and l move on, acc is rescaled, and p holds the keys' weights for accumulate_tile.
template <typename T, int LPK, int kGroups>
__device__ __forceinline__ void score_tile(const uint4 (&k)[kUnroll], const float (&qf)[kMaxHeads][Pack<T>::kSize],
                                           float (&p)[kUnroll][kMaxHeads], float (&acc)[kMaxHeads][Pack<T>::kSize],
                                           float (&m)[kMaxHeads], float (&l)[kMaxHeads], int base,
                                           int end, int grp, float softcap_log2) {
    constexpr int P = Pack<T>::kSize;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        float kf[P];
        unpack<T>(k[u], kf);
        const bool valid = base + u * kGroups + grp < end;  // uniform over the lane group
#pragma unroll
        for (int h = 0; h < kMaxHeads; ++h) {
            float s = 0.0f;
#pragma unroll
            for (int i = 0; i < P; ++i) s += qf[h][i] * kf[i];
#pragma unroll
            for (int offset = LPK / 2; offset > 0; offset /= 2) s += __shfl_xor_sync(kFullMask, s, offset);
            if (softcap_log2 > 0.0f) s = softcap_log2 * tanhf(s / softcap_log2);  // uniform: a launch parameter
            p[u][h] = valid ? s : neg_inf();
        }
    }
#pragma unroll
    for (int h = 0; h < kMaxHeads; ++h) {
        float m_new = m[h];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) m_new = fmaxf(m_new, p[u][h]);
        // No key yet for this group (m_new is -inf): every weight is 0 and acc stays 0, not NaN.
        const float m_ref = m_new == neg_inf() ? 0.0f : m_new;
        const float alpha = exp2f(m[h] - m_ref);  // 0 while m is -inf
        float sum = 0.0f;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            p[u][h] = exp2f(p[u][h] - m_ref);
            sum += p[u][h];
        }
        l[h] = l[h] * alpha + sum;
        m[h] = m_new;
#pragma unroll
        for (int i = 0; i < Pack<T>::kSize; ++i) acc[h][i] *= alpha;
    }
}

// acc += the tile's weighted values (invalid keys have weight 0 and zero values).
template <typename T>
__device__ __forceinline__ void accumulate_tile(const uint4 (&v)[kUnroll], const float (&p)[kUnroll][kMaxHeads],
                                                float (&acc)[kMaxHeads][Pack<T>::kSize]) {
    constexpr int P = Pack<T>::kSize;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        float vf[P];
        unpack<T>(v[u], vf);
#pragma unroll
        for (int h = 0; h < kMaxHeads; ++h) {
#pragma unroll
            for (int i = 0; i < P; ++i) acc[h][i] += p[u][h] * vf[i];
        }
    }
}

// One split's keys [kv_begin, kv_end) of one (request, head block): the output row itself when the context is not
// split, else the split's (m, l, acc) in the workspace.
template <typename T, int LPK>
__device__ __forceinline__ void attend_range(T* __restrict__ out, float* __restrict__ ws_acc,
                                             float* __restrict__ ws_ml, const T* __restrict__ q,
                                             const T* __restrict__ kv_cache, const int* __restrict__ table,
                                             int req, int row, int kv_head, int first_q_head, int num_heads,
                                             int kv_begin, int kv_end, int split, int num_splits,
                                             int num_q_heads, int num_kv_heads, int heads_per_block, int head_dim,
                                             int block_size, long long num_slots, float scale_log2,
                                             float softcap_log2) {
    constexpr int P = Pack<T>::kSize;
    constexpr int kGroups = kThreads / LPK;  // lane groups: keys per load round
    constexpr int kStep = kGroups * kUnroll; // keys per tile
    static_assert(kSlotChunk % (2 * kStep) == 0, "a slot chunk holds whole pairs of tiles");
    __shared__ int s_slot[kSlotChunk];

    // Lane layout: LPK lanes per key, each owning P consecutive dims of the row.
    const int num_packs = head_dim / P;
    const int pack = threadIdx.x % LPK;
    const bool owns = pack < num_packs;  // e.g. D = 80: 10 packs, 16 lanes per key, 6 idle
    const int grp = threadIdx.x / LPK;   // this lane's key group within the block
    const int dim0 = pack * P;

    // Queries pre-scaled into base 2 (scale * log2 e), so exp2f replaces expf.
    float qf[kMaxHeads][P];
    float acc[kMaxHeads][P];
    float m[kMaxHeads], l[kMaxHeads];
#pragma unroll
    for (int h = 0; h < kMaxHeads; ++h) {
        m[h] = neg_inf();
        l[h] = 0.0f;
#pragma unroll
        for (int i = 0; i < P; ++i) qf[h][i] = acc[h][i] = 0.0f;
        if (h < num_heads && owns) {
            unpack<T>(load16(q + (static_cast<long long>(row) * num_q_heads + first_q_head + h) * head_dim + dim0),
                      qf[h]);
#pragma unroll
            for (int i = 0; i < P; ++i) qf[h][i] *= scale_log2;
        }
    }

    const T* k_cache = kv_cache + static_cast<long long>(kv_head) * num_slots * head_dim + dim0;
    const T* v_cache = kv_cache + (static_cast<long long>(num_kv_heads) + kv_head) * num_slots * head_dim + dim0;

    for (int chunk = kv_begin; chunk < kv_end; chunk += kSlotChunk) {  // one chunk unless the split is long
        const int end = min(chunk + kSlotChunk, kv_end);
        __syncthreads();  // every lane is done with the previous chunk's slots
        for (int pos = chunk + threadIdx.x; pos < end; pos += kThreads) {
            s_slot[pos - chunk] = table[pos / block_size] * block_size + pos % block_size;
        }
        __syncthreads();

        // Two register buffers a and b per K and V. The next tile's keys are loaded before this tile's
        // scores, its values before this tile's accumulation: every load has a tile of math to arrive.
        uint4 ka[kUnroll], va[kUnroll], kb[kUnroll], vb[kUnroll];
        float p[kUnroll][kMaxHeads];
        load_tile<T, kGroups>(ka, k_cache, s_slot, chunk, end, chunk, grp, owns, head_dim);
        load_tile<T, kGroups>(va, v_cache, s_slot, chunk, end, chunk, grp, owns, head_dim);
        for (int base = chunk; base < end; base += 2 * kStep) {
            load_tile<T, kGroups>(kb, k_cache, s_slot, chunk, end, base + kStep, grp, owns, head_dim);
            score_tile<T, LPK, kGroups>(ka, qf, p, acc, m, l, base, end, grp, softcap_log2);
            load_tile<T, kGroups>(vb, v_cache, s_slot, chunk, end, base + kStep, grp, owns, head_dim);
            accumulate_tile<T>(va, p, acc);
            if (base + kStep >= end) break;  // uniform over the block
            load_tile<T, kGroups>(ka, k_cache, s_slot, chunk, end, base + 2 * kStep, grp, owns, head_dim);
            score_tile<T, LPK, kGroups>(kb, qf, p, acc, m, l, base + kStep, end, grp, softcap_log2);
            load_tile<T, kGroups>(va, v_cache, s_slot, chunk, end, base + 2 * kStep, grp, owns, head_dim);
            accumulate_tile<T>(vb, p, acc);
        }
    }

    // Merge the lane groups: shared memory holds each group's acc [groups][heads][D] and (m, l).
    extern __shared__ float smem[];
    float* s_acc = smem;
    float* s_ml = smem + kGroups * heads_per_block * head_dim;
#pragma unroll
    for (int h = 0; h < kMaxHeads; ++h) {
        if (h >= num_heads) break;
        const int slot = grp * heads_per_block + h;
        if (owns) {
#pragma unroll
            for (int i = 0; i < P; ++i) s_acc[slot * head_dim + dim0 + i] = acc[h][i];
        }
        if (pack == 0) {
            s_ml[2 * slot] = m[h];
            s_ml[2 * slot + 1] = l[h];
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < num_heads * head_dim; e += kThreads) {
        const int h = e / head_dim;
        const int d = e % head_dim;
        float max_m = neg_inf();
#pragma unroll
        for (int g = 0; g < kGroups; ++g) max_m = fmaxf(max_m, s_ml[2 * (g * heads_per_block + h)]);
        float total_l = 0.0f, total = 0.0f;
#pragma unroll
        for (int g = 0; g < kGroups; ++g) {
            const int slot = g * heads_per_block + h;
            const float mg = s_ml[2 * slot];
            if (mg == neg_inf()) continue;  // a group that got no key of this split
            const float w = exp2f(mg - max_m);
            total_l += w * s_ml[2 * slot + 1];
            total += w * s_acc[slot * head_dim + d];
        }
        const long long head_row = static_cast<long long>(row) * num_q_heads + first_q_head + h;
        if (num_splits == 1) {
            out[head_row * head_dim + d] = from_float<T>(total / total_l);
        } else {
            const long long ws_row =
                (static_cast<long long>(req) * num_q_heads + first_q_head + h) * num_splits + split;
            ws_acc[ws_row * head_dim + d] = total;
            if (d == 0) {
                ws_ml[2 * ws_row] = max_m;
                ws_ml[2 * ws_row + 1] = total_l;
            }
        }
    }
}

// Called by every block of a split launch once its partial is written: the last of a (request, head block)'s splits
// to get here combines them, out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s, skipping empty splits.
template <typename T>
__device__ __forceinline__ void merge_if_last(T* __restrict__ out, float* ws_acc, float* ws_ml,
                                              int* __restrict__ counters, int req, int row, int first_q_head,
                                              int num_heads, int num_q_heads, int head_dim, int num_splits) {
    __shared__ int s_last;
    __threadfence();  // this thread's part of the partial is visible GPU-wide before the split is counted
    __syncthreads();  // (and every thread is done with the merge buffer that s_w below reuses)
    if (threadIdx.x == 0) {
        int* counter = counters + static_cast<long long>(req) * gridDim.y + blockIdx.y;
        s_last = atomicAdd(counter, 1) == num_splits - 1;
        if (s_last) *counter = 0;  // every split has counted: ready for the next launch, which the stream orders
    }
    __syncthreads();
    if (!s_last) return;  // uniform over the block
    __threadfence();  // the other splits' partials, counted before ours, are read after the count (and from L2:
                      // __ldcg, as this SM's L1 is not kept coherent with the others' writes)

    // Each head's split weights 2^(m_s - M) and their sum of l_s, one warp per head (num_heads <= kWarps).
    extern __shared__ float smem[];
    static_assert(kMaxHeads <= kWarps, "a warp a head");
    float* s_w = smem;                           // [num_heads][num_splits]
    float* s_l = smem + kMaxHeads * num_splits;  // [num_heads]
    const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
    const long long first_ws_row = (static_cast<long long>(req) * num_q_heads + first_q_head) * num_splits;
    if (warp < num_heads) {
        const float* ml = ws_ml + 2 * (first_ws_row + static_cast<long long>(warp) * num_splits);
        float max_m = neg_inf();
        for (int s = lane; s < num_splits; s += kWarp) max_m = fmaxf(max_m, __ldcg(ml + 2 * s));
#pragma unroll
        for (int offset = kWarp / 2; offset > 0; offset /= 2) {
            max_m = fmaxf(max_m, __shfl_xor_sync(kFullMask, max_m, offset));
        }
        float total_l = 0.0f;
        for (int s = lane; s < num_splits; s += kWarp) {
            const float m = __ldcg(ml + 2 * s);
            const float w = m == neg_inf() ? 0.0f : exp2f(m - max_m);  // an empty split weighs nothing
            s_w[warp * num_splits + s] = w;
            total_l += w * __ldcg(ml + 2 * s + 1);
        }
#pragma unroll
        for (int offset = kWarp / 2; offset > 0; offset /= 2) total_l += __shfl_xor_sync(kFullMask, total_l, offset);
        if (lane == 0) s_l[warp] = total_l;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < num_heads * head_dim; e += kThreads) {
        const int h = e / head_dim;
        const int d = e % head_dim;
        const float* acc = ws_acc + (first_ws_row + static_cast<long long>(h) * num_splits) * head_dim + d;
        float total = 0.0f;
        for (int s = 0; s < num_splits; ++s) {
            const float w = s_w[h * num_splits + s];
            if (w != 0.0f) total += w * __ldcg(acc + static_cast<long long>(s) * head_dim);  // empty: never written
        }
        const float total_l = s_l[h];
        out[(static_cast<long long>(row) * num_q_heads + first_q_head + h) * head_dim + d] =
            from_float<T>(total_l > 0.0f ? total / total_l : 0.0f);  // 0: no context
    }
}

template <typename T, int LPK>
__device__ __forceinline__ void decode_impl(T* __restrict__ out, float* __restrict__ ws_acc,
                                            float* __restrict__ ws_ml, int* __restrict__ counters,
                                            const T* __restrict__ q, const T* __restrict__ kv_cache,
                                            const int* __restrict__ query_start_loc,
                                            const int* __restrict__ context_lens,
                                            const int* __restrict__ block_tables, int max_blocks, int num_q_heads,
                                            int num_kv_heads, int heads_per_block, int head_dim, int block_size,
                                            long long num_slots, float scale_log2, int window, float softcap_log2) {
    const int req = blockIdx.x;
    const int row = query_start_loc[req];
    if (query_start_loc[req + 1] - row != 1) return;  // a prefill chunk (or no query): attended elsewhere

    const int group = num_q_heads / num_kv_heads;  // G query heads per KV head
    const int blocks_per_kv = (group + heads_per_block - 1) / heads_per_block;
    const int kv_head = blockIdx.y / blocks_per_kv;
    const int first_g = (blockIdx.y % blocks_per_kv) * heads_per_block;
    const int num_heads = min(heads_per_block, group - first_g);  // the last head block may be partial
    const int first_q_head = kv_head * group + first_g;
    const int split = blockIdx.z;
    const int num_splits = gridDim.z;

    // This request's keys (its last `window` with a sliding window: the blocks before them may hold another
    // request's tokens by now, so they are never read) cut into num_splits equal ranges of whole kSplitTile tiles.
    const int kv_len = context_lens[req];
    if (kv_len < 0) return;  // a prompt row of a whole-step graph: paged_prompt_tiles.cu attends it (all splits leave)
    const int kv_first = window > 0 ? max(0, kv_len - window) : 0;
    int partition = (kv_len - kv_first + num_splits - 1) / num_splits;
    partition = max(kSplitTile, (partition + kSplitTile - 1) / kSplitTile * kSplitTile);
    const int kv_begin = kv_first + split * partition;
    const int kv_end = min(kv_begin + partition, kv_len);
    if (kv_begin < kv_end) {
        attend_range<T, LPK>(out, ws_acc, ws_ml, q, kv_cache, block_tables + static_cast<long long>(req) * max_blocks,
                             req, row, kv_head, first_q_head, num_heads, kv_begin, kv_end, split, num_splits,
                             num_q_heads, num_kv_heads, heads_per_block, head_dim, block_size, num_slots, scale_log2,
                             softcap_log2);
    } else if (num_splits == 1) {  // no context at all: write the row (0)
        for (int e = threadIdx.x; e < num_heads * head_dim; e += kThreads) {
            out[(static_cast<long long>(row) * num_q_heads + first_q_head) * head_dim + e] = from_float<T>(0.0f);
        }
    } else if (threadIdx.x < num_heads) {  // a short context leaves the last splits empty: the merge skips them
        const long long ws_row = (static_cast<long long>(req) * num_q_heads + first_q_head + threadIdx.x) *
                                 num_splits + split;
        ws_ml[2 * ws_row] = neg_inf();
        ws_ml[2 * ws_row + 1] = 0.0f;
    }
    if (num_splits > 1) {
        merge_if_last<T>(out, ws_acc, ws_ml, counters, req, row, first_q_head, num_heads, num_q_heads, head_dim,
                         num_splits);
    }
}

}  // namespace

#define ORCINUS_DECODE(SUFFIX, T, LPK)                                                                           \
    extern "C" __global__ void __launch_bounds__(kThreads, kMinBlocksPerSM)                                    \
        paged_decode_attention_##SUFFIX##_lpk##LPK(                                                            \
            T* out, float* ws_acc, float* ws_ml, int* counters, const T* q, const T* kv_cache,                 \
            const int* query_start_loc, const int* context_lens, const int* block_tables, int max_blocks,      \
            int num_q_heads, int num_kv_heads, int heads_per_block, int head_dim, int block_size,              \
            long long num_slots, float scale_log2, int window, float softcap_log2) {                           \
        decode_impl<T, LPK>(out, ws_acc, ws_ml, counters, q, kv_cache, query_start_loc, context_lens,          \
                            block_tables, max_blocks, num_q_heads, num_kv_heads, heads_per_block, head_dim,    \
                            block_size, num_slots, scale_log2, window, softcap_log2);                          \
    }

#define ORCINUS_INSTANTIATE(SUFFIX, T)                                                                          \
    ORCINUS_DECODE(SUFFIX, T, 8)                                                                                \
    ORCINUS_DECODE(SUFFIX, T, 16)                                                                               \
    ORCINUS_DECODE(SUFFIX, T, 32)

ORCINUS_INSTANTIATE(bf16, __nv_bfloat16)
ORCINUS_INSTANTIATE(f16, __half)
ORCINUS_INSTANTIATE(f32, float)
