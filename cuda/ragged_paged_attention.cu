// Ragged paged attention for a mixed batch of prefills and decodes, in one launch.
//
// Loaded at run time by engine/cuda_attention.py through cupy.RawModule (NVRTC), and compiled
// offline by tests/test_cuda_kernels.py with nvcc -Werror so warnings are caught without a GPU.
// The entry points are extern "C" so RawModule finds them by plain name; each is a thin wrapper
// over a template instantiated for __nv_bfloat16, __half and float inputs. All arithmetic on
// scores, the softmax and the output accumulator is float32.
//
// Layouts (see engine/attention.py):
//   q            [T, Hq, D]        contiguous; T = query_start_loc[B]
//   k, v         [T, Hkv, D]       contiguous (this iteration's new keys/values)
//   kv_cache     [2, Hkv, num_slots, D]  keys then values, num_slots = num_blocks * block_size
//   block_tables [B, max_blocks] int32; token p of request i is at slot
//                block_tables[i][p / block_size] * block_size + p % block_size
//   query_start_loc [B + 1] int32, context_lens [B] int32, slot_mapping [T] int64
//
// Request i's queries are the last n_i = qsl[i+1] - qsl[i] of its ctx_i positions, so query j of
// request i sits at position ctx_i - n_i + j and (causally) sees keys 0 .. ctx_i - n_i + j.
//
// Grid of the attention kernel: (query token, KV head x head group, KV split). One thread block
// serves up to kMaxHeadsPerBlock query heads that share a KV head (one warp per query head), so
// every K/V tile it stages in shared memory is read from global memory once for the whole group.
// The KV range of a token is cut into splits of partition_size keys (flash-decoding): with few
// query tokens (decode) the splits are what fill the GPU. Each split keeps an online softmax
// (running max m, running sum l, unnormalised accumulator acc) and either writes the normalised
// output directly (one split) or writes (m, l, acc) to a float32 workspace that
// ragged_paged_attention_reduce combines.
//
// Which request a token belongs to is found by a binary search of query_start_loc in the kernel
// (B + 1 ints, cached), so the host builds no per-token map and needs no extra launch.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace {

constexpr int kWarp = 32;
constexpr int kTile = 32;                          // keys staged per step: one per lane when scoring
constexpr int kMaxHeadDim = 128;
constexpr int kDimsPerLane = kMaxHeadDim / kWarp;  // each lane owns dims lane, lane+32, ... of acc
constexpr int kMaxHeadsPerBlock = 16;              // warps per block; keeps shared memory < 48 KiB
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

__device__ __forceinline__ float warp_max(float x) {
    for (int offset = kWarp / 2; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, offset));
    return x;
}

__device__ __forceinline__ float warp_sum(float x) {
    for (int offset = kWarp / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(kFullMask, x, offset);
    return x;
}

// The request owning flattened query row `token`: the last i with query_start_loc[i] <= token.
// "Last" skips requests with no queries this iteration (equal consecutive starts).
__device__ __forceinline__ int find_request(const int* __restrict__ query_start_loc, int num_requests, int token) {
    int lo = 0, hi = num_requests - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (query_start_loc[mid] <= token) lo = mid; else hi = mid - 1;
    }
    return lo;
}

template <typename T>
__device__ void reshape_and_cache_impl(T* __restrict__ kv_cache, const T* __restrict__ k, const T* __restrict__ v,
                                       const long long* __restrict__ slot_mapping, int num_tokens, int num_kv_heads,
                                       int head_dim, long long num_slots) {
    const long long total = static_cast<long long>(num_tokens) * num_kv_heads * head_dim;
    const long long values_offset = static_cast<long long>(num_kv_heads) * num_slots * head_dim;
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
        const int d = static_cast<int>(i % head_dim);
        const long long token_head = i / head_dim;
        const int head = static_cast<int>(token_head % num_kv_heads);
        const long long token = token_head / num_kv_heads;
        const long long slot = slot_mapping[token];
        if (slot < 0) continue;  // padded row: nothing to store
        const long long dst = (static_cast<long long>(head) * num_slots + slot) * head_dim + d;
        kv_cache[dst] = k[i];
        kv_cache[values_offset + dst] = v[i];
    }
}

template <typename T>
__device__ void attention_impl(T* __restrict__ out, float* __restrict__ ws_acc, float* __restrict__ ws_ml,
                               const T* __restrict__ q, const T* __restrict__ kv_cache,
                               const int* __restrict__ query_start_loc, const int* __restrict__ context_lens,
                               const int* __restrict__ block_tables, int num_requests, int max_blocks,
                               int num_q_heads, int num_kv_heads, int heads_per_block, int head_dim,
                               int block_size, long long num_slots, int partition_size, float scale_log2) {
    // Shared memory: this block's queries (pre-scaled), then one K tile and one V tile, as float.
    // K rows are padded to head_dim + 1 floats so lane j reading row j hits distinct banks.
    extern __shared__ float smem[];
    float* q_s = smem;                                   // [heads_per_block][head_dim]
    float* k_s = q_s + heads_per_block * head_dim;       // [kTile][head_dim + 1]
    float* v_s = k_s + kTile * (head_dim + 1);           // [kTile][head_dim]
    const int k_stride = head_dim + 1;

    const int token = blockIdx.x;
    const int group = num_q_heads / num_kv_heads;        // G query heads per KV head
    const int blocks_per_kv = (group + heads_per_block - 1) / heads_per_block;
    const int kv_head = blockIdx.y / blocks_per_kv;
    const int first_g = (blockIdx.y % blocks_per_kv) * heads_per_block;
    const int warp = threadIdx.x / kWarp;
    const int lane = threadIdx.x % kWarp;
    const int g = first_g + warp;                         // this warp's query head within the group
    const bool head_active = g < group;                   // the last head block may be partial
    const int q_head = kv_head * group + g;
    const int split = blockIdx.z;
    const int num_splits = gridDim.z;

    // Ragged + causal: this query sees keys [0, kv_len); this split covers [kv_begin, kv_end).
    const int req = find_request(query_start_loc, num_requests, token);
    const int q_len = query_start_loc[req + 1] - query_start_loc[req];
    const int kv_len = context_lens[req] - q_len + (token - query_start_loc[req]) + 1;
    const int kv_begin = split * partition_size;
    const int kv_end = min(kv_begin + partition_size, kv_len);
    const long long row = static_cast<long long>(token) * num_q_heads + q_head;  // (token, head) row
    const long long ws_row = row * num_splits + split;

    if (kv_begin >= kv_end) {
        // An early query of a long prefill: its causal range ends before this split. Tell the
        // reduction to ignore the split (only reached with num_splits > 1, since split 0 is never empty).
        if (head_active && lane == 0) {
            ws_ml[2 * ws_row] = neg_inf();
            ws_ml[2 * ws_row + 1] = 0.0f;
        }
        return;  // uniform over the block, so no __syncthreads is skipped by only some threads
    }

    // Scores are computed in base 2: folding scale * log2(e) into q lets exp2f replace expf.
    for (int e = threadIdx.x; e < heads_per_block * head_dim; e += blockDim.x) {
        const int h = first_g + e / head_dim;
        const int d = e % head_dim;
        const long long src = (static_cast<long long>(token) * num_q_heads + kv_head * group + h) * head_dim + d;
        q_s[e] = h < group ? to_float(q[src]) * scale_log2 : 0.0f;
    }

    const T* k_cache = kv_cache + static_cast<long long>(kv_head) * num_slots * head_dim;
    const T* v_cache = kv_cache + (static_cast<long long>(num_kv_heads) + kv_head) * num_slots * head_dim;
    const int* table = block_tables + static_cast<long long>(req) * max_blocks;

    float m = neg_inf();  // running max of scores (base 2)
    float l = 0.0f;       // running sum of exp2(score - m)
    float acc[kDimsPerLane];
    for (int i = 0; i < kDimsPerLane; ++i) acc[i] = 0.0f;

    for (int tile = kv_begin; tile < kv_end; tile += kTile) {
        const int n = min(kTile, kv_end - tile);
        __syncthreads();  // q_s is written / the previous tile is consumed
        // Stage the tile: consecutive threads read consecutive dims of one key row (coalesced).
        for (int e = threadIdx.x; e < n * head_dim; e += blockDim.x) {
            const int j = e / head_dim;
            const int d = e % head_dim;
            const int pos = tile + j;
            const long long slot = static_cast<long long>(table[pos / block_size]) * block_size + pos % block_size;
            k_s[j * k_stride + d] = to_float(k_cache[slot * head_dim + d]);
            v_s[j * head_dim + d] = to_float(v_cache[slot * head_dim + d]);
        }
        __syncthreads();
        if (!head_active) continue;  // idle warp: it only helps stage tiles

        // Lane j scores key j of the tile against this warp's query head.
        float s = neg_inf();
        if (lane < n) {
            s = 0.0f;
            const float* qh = q_s + warp * head_dim;
            const float* kj = k_s + lane * k_stride;
            for (int d = 0; d < head_dim; ++d) s += qh[d] * kj[d];
        }
        // Online softmax: rescale what we have to the new max. m_new is finite (n >= 1), so
        // exp2f(m - m_new) is 0 on the first tile rather than NaN.
        const float m_new = fmaxf(m, warp_max(s));
        const float alpha = exp2f(m - m_new);
        const float p = lane < n ? exp2f(s - m_new) : 0.0f;
        l = l * alpha + warp_sum(p);
        for (int i = 0; i < kDimsPerLane; ++i) acc[i] *= alpha;
        // acc += P V: broadcast each key's weight; lanes own disjoint dims (conflict-free V reads).
        for (int j = 0; j < n; ++j) {
            const float pj = __shfl_sync(kFullMask, p, j);
            for (int i = 0; i < kDimsPerLane; ++i) {
                const int d = lane + i * kWarp;
                if (d < head_dim) acc[i] += pj * v_s[j * head_dim + d];
            }
        }
        m = m_new;
    }

    if (!head_active) return;
    if (num_splits == 1) {
        const float inv_l = 1.0f / l;
        for (int i = 0; i < kDimsPerLane; ++i) {
            const int d = lane + i * kWarp;
            if (d < head_dim) out[row * head_dim + d] = from_float<T>(acc[i] * inv_l);
        }
    } else {
        for (int i = 0; i < kDimsPerLane; ++i) {
            const int d = lane + i * kWarp;
            if (d < head_dim) ws_acc[ws_row * head_dim + d] = acc[i];
        }
        if (lane == 0) {
            ws_ml[2 * ws_row] = m;
            ws_ml[2 * ws_row + 1] = l;
        }
    }
}

// Combine the splits of one (token, head): out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s.
template <typename T>
__device__ void reduce_impl(T* __restrict__ out, const float* __restrict__ ws_acc, const float* __restrict__ ws_ml,
                            int num_q_heads, int head_dim, int num_splits) {
    const long long row = static_cast<long long>(blockIdx.x) * num_q_heads + blockIdx.y;
    const float* ml = ws_ml + 2 * row * num_splits;
    float max_m = neg_inf();
    for (int s = 0; s < num_splits; ++s) max_m = fmaxf(max_m, ml[2 * s]);
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float total_l = 0.0f, total = 0.0f;
        for (int s = 0; s < num_splits; ++s) {
            const float m = ml[2 * s];
            if (m == neg_inf()) continue;  // empty split (causal range ended before it)
            const float w = exp2f(m - max_m);
            total_l += w * ml[2 * s + 1];
            total += w * ws_acc[(row * num_splits + s) * head_dim + d];
        }
        out[row * head_dim + d] = from_float<T>(total / total_l);
    }
}

}  // namespace

#define ORCINUS_INSTANTIATE(SUFFIX, T)                                                                          \
    extern "C" __global__ void reshape_and_cache_##SUFFIX(T* kv_cache, const T* k, const T* v,                  \
                                                          const long long* slot_mapping, int num_tokens,        \
                                                          int num_kv_heads, int head_dim, long long num_slots) { \
        reshape_and_cache_impl<T>(kv_cache, k, v, slot_mapping, num_tokens, num_kv_heads, head_dim, num_slots);  \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(kMaxHeadsPerBlock * kWarp) ragged_paged_attention_##SUFFIX(    \
        T* out, float* ws_acc, float* ws_ml, const T* q, const T* kv_cache, const int* query_start_loc,          \
        const int* context_lens, const int* block_tables, int num_requests, int max_blocks, int num_q_heads,     \
        int num_kv_heads, int heads_per_block, int head_dim, int block_size, long long num_slots,               \
        int partition_size, float scale_log2) {                                                                 \
        attention_impl<T>(out, ws_acc, ws_ml, q, kv_cache, query_start_loc, context_lens, block_tables,         \
                          num_requests, max_blocks, num_q_heads, num_kv_heads, heads_per_block, head_dim,       \
                          block_size, num_slots, partition_size, scale_log2);                                   \
    }                                                                                                           \
    extern "C" __global__ void ragged_paged_attention_reduce_##SUFFIX(T* out, const float* ws_acc,              \
                                                                      const float* ws_ml, int num_q_heads,      \
                                                                      int head_dim, int num_splits) {           \
        reduce_impl<T>(out, ws_acc, ws_ml, num_q_heads, head_dim, num_splits);                                  \
    }

ORCINUS_INSTANTIATE(bf16, __nv_bfloat16)
ORCINUS_INSTANTIATE(f16, __half)
ORCINUS_INSTANTIATE(f32, float)
