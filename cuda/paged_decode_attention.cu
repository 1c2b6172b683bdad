// Paged decode attention: each request that decodes one token attends to its whole paged context.
//
// Loaded at run time by engine/attention/cupy_backend.py through cupy.RawModule (NVRTC), and compiled
// offline by tests/test_cuda_kernels.py with nvcc -Werror so warnings are caught without a GPU.
// The entry points are extern "C" so RawModule finds them by plain name; each is a thin wrapper
// over a template instantiated for __nv_bfloat16, __half and float. All arithmetic on scores, the
// softmax and the output accumulator is float32. Multi-token queries (prefill chunks) are not
// attended here: the backend hands them to a fused SDPA kernel, which uses tensor cores.
//
// Layouts (see engine/attention/backend.py):
//   q            [T, Hq, D]        contiguous
//   k, v         [T, Hkv, D]       contiguous (this iteration's new keys/values)
//   kv_cache     [2, Hkv, num_slots, D]  keys then values, num_slots = num_blocks * block_size
//   block_tables [B, max_blocks] int32; token p of request i is at slot
//                block_tables[i][p / block_size] * block_size + p % block_size
//   query_start_loc [B + 1] int32, context_lens [B] int32, slot_mapping [T] int64
//
// Decode is bound by reading K/V, so the kernel is built around the loads. Grid: (request, KV head x
// head block, KV split). A key row of D elements is read by lpk lanes with one 16-byte load each
// (lpk = D / 8 for 16-bit types, rounded up to a power of two), so a warp reads 32 / lpk keys at
// once and a 4-warp block 8 to 16; the query heads that share the KV head (up to kMaxHeads) are
// scored against each key while it is in registers, so K/V is read from memory once per group.
// Every lane group keeps its own online softmax (running max m, sum l, unnormalised acc over its
// lanes' dims); the groups are merged through shared memory at the end, and, when the KV range is
// cut into splits (flash-decoding, to fill the GPU when the batch is small), the splits' (m, l, acc)
// go to a float32 workspace that paged_decode_attention_reduce combines.
//
// The split count is a launch parameter (fixed when a decode step is captured as a CUDA graph);
// each request cuts its own context into that many equal ranges, so short and long contexts alike
// spread over every split, and no host value of a context length is needed.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace {

constexpr int kWarp = 32;
constexpr int kWarps = 4;         // warps per block
constexpr int kMaxHeads = 4;      // query heads per block; wider GQA groups are cut into head blocks
constexpr int kUnroll = 2;        // keys each lane group loads before using any: more loads in flight
constexpr int kMinPartition = 32; // a split covers at least this many keys
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

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
__device__ void decode_impl(T* __restrict__ out, float* __restrict__ ws_acc, float* __restrict__ ws_ml,
                            const T* __restrict__ q, const T* __restrict__ kv_cache,
                            const int* __restrict__ query_start_loc, const int* __restrict__ context_lens,
                            const int* __restrict__ block_tables, int max_blocks, int num_q_heads, int num_kv_heads,
                            int heads_per_block, int head_dim, int block_size, long long num_slots, float scale_log2) {
    constexpr int P = Pack<T>::kSize;
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

    // This request's context cut into num_splits equal ranges of whole 32-key tiles.
    const int kv_len = context_lens[req];
    int partition = (kv_len + num_splits - 1) / num_splits;
    partition = max(kMinPartition, (partition + kMinPartition - 1) / kMinPartition * kMinPartition);
    const int kv_begin = split * partition;
    const int kv_end = min(kv_begin + partition, kv_len);
    if (kv_begin >= kv_end) {  // a short context leaves the last splits empty: the reduction skips them
        if (threadIdx.x < num_heads) {
            const long long ws_row = (static_cast<long long>(req) * num_q_heads + first_q_head + threadIdx.x) *
                                     num_splits + split;
            ws_ml[2 * ws_row] = neg_inf();
            ws_ml[2 * ws_row + 1] = 0.0f;
        }
        return;  // uniform over the block
    }

    // Lane layout: lpk lanes per key, each owning P consecutive dims of the row.
    const int num_packs = head_dim / P;
    int lpk = 1;
    while (lpk < num_packs) lpk *= 2;
    const int lane = threadIdx.x % kWarp;
    const int pack = lane % lpk;
    const bool owns = pack < num_packs;  // e.g. D = 80: 10 packs, 16 lanes per key, 6 idle
    const int num_groups = kWarps * (kWarp / lpk);
    const int grp = threadIdx.x / lpk;   // this lane's key group within the block
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
    const int* table = block_tables + static_cast<long long>(req) * max_blocks;
    const int step = num_groups * kUnroll;

    for (int base = kv_begin; base < kv_end; base += step) {
        // Issue every load of this step before any use, so they are in flight together.
        uint4 k_raw[kUnroll], v_raw[kUnroll];
        bool valid[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int pos = base + u * num_groups + grp;
            valid[u] = pos < kv_end;
            k_raw[u] = v_raw[u] = make_uint4(0, 0, 0, 0);
            if (valid[u] && owns) {
                const long long slot =
                    static_cast<long long>(table[pos / block_size]) * block_size + pos % block_size;
                k_raw[u] = load16(k_cache + slot * head_dim);
                v_raw[u] = load16(v_cache + slot * head_dim);
            }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            float kf[P], vf[P];
            unpack<T>(k_raw[u], kf);
            unpack<T>(v_raw[u], vf);
#pragma unroll
            for (int h = 0; h < kMaxHeads; ++h) {
                if (h >= num_heads) break;  // uniform over the block
                float s = 0.0f;
#pragma unroll
                for (int i = 0; i < P; ++i) s += qf[h][i] * kf[i];
                for (int offset = lpk / 2; offset > 0; offset /= 2) s += __shfl_xor_sync(kFullMask, s, offset);
                if (valid[u]) {  // uniform over the lane group: every lane of it now holds the whole score
                    const float m_new = fmaxf(m[h], s);
                    const float alpha = exp2f(m[h] - m_new);  // 0 on the first key: m is -inf, m_new is not
                    const float p = exp2f(s - m_new);
                    l[h] = l[h] * alpha + p;
#pragma unroll
                    for (int i = 0; i < P; ++i) acc[h][i] = acc[h][i] * alpha + p * vf[i];
                    m[h] = m_new;
                }
            }
        }
    }

    // Merge the lane groups: shared memory holds each group's acc [groups][heads][D] and (m, l).
    extern __shared__ float smem[];
    float* s_acc = smem;
    float* s_ml = smem + num_groups * heads_per_block * head_dim;
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
    for (int e = threadIdx.x; e < num_heads * head_dim; e += blockDim.x) {
        const int h = e / head_dim;
        const int d = e % head_dim;
        float max_m = neg_inf();
        for (int g = 0; g < num_groups; ++g) max_m = fmaxf(max_m, s_ml[2 * (g * heads_per_block + h)]);
        float total_l = 0.0f, total = 0.0f;
        for (int g = 0; g < num_groups; ++g) {
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
            const long long ws_row = (static_cast<long long>(req) * num_q_heads + first_q_head + h) * num_splits + split;
            ws_acc[ws_row * head_dim + d] = total;
            if (d == 0) {
                ws_ml[2 * ws_row] = max_m;
                ws_ml[2 * ws_row + 1] = total_l;
            }
        }
    }
}

// Combine the splits of one (request, head): out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s.
template <typename T>
__device__ void reduce_impl(T* __restrict__ out, const float* __restrict__ ws_acc, const float* __restrict__ ws_ml,
                            const int* __restrict__ query_start_loc, int num_q_heads, int head_dim, int num_splits) {
    const int req = blockIdx.x;
    const int row = query_start_loc[req];
    if (query_start_loc[req + 1] - row != 1) return;  // the decode kernel skipped it too
    const long long ws_row = static_cast<long long>(req) * num_q_heads + blockIdx.y;
    const float* ml = ws_ml + 2 * ws_row * num_splits;
    float max_m = neg_inf();
    for (int s = 0; s < num_splits; ++s) max_m = fmaxf(max_m, ml[2 * s]);
    const long long out_row = static_cast<long long>(row) * num_q_heads + blockIdx.y;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float total_l = 0.0f, total = 0.0f;
        for (int s = 0; s < num_splits; ++s) {
            const float m = ml[2 * s];
            if (m == neg_inf()) continue;  // an empty split
            const float w = exp2f(m - max_m);
            total_l += w * ml[2 * s + 1];
            total += w * ws_acc[(ws_row * num_splits + s) * head_dim + d];
        }
        out[out_row * head_dim + d] = from_float<T>(total / total_l);
    }
}

}  // namespace

#define ORCINUS_INSTANTIATE(SUFFIX, T)                                                                          \
    extern "C" __global__ void reshape_and_cache_##SUFFIX(T* kv_cache, const T* k, const T* v,                  \
                                                          const long long* slot_mapping, int num_tokens,        \
                                                          int num_kv_heads, int head_dim, long long num_slots) { \
        reshape_and_cache_impl<T>(kv_cache, k, v, slot_mapping, num_tokens, num_kv_heads, head_dim, num_slots);  \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(kWarps * kWarp) paged_decode_attention_##SUFFIX(              \
        T* out, float* ws_acc, float* ws_ml, const T* q, const T* kv_cache, const int* query_start_loc,          \
        const int* context_lens, const int* block_tables, int max_blocks, int num_q_heads, int num_kv_heads,    \
        int heads_per_block, int head_dim, int block_size, long long num_slots, float scale_log2) {             \
        decode_impl<T>(out, ws_acc, ws_ml, q, kv_cache, query_start_loc, context_lens, block_tables, max_blocks, \
                       num_q_heads, num_kv_heads, heads_per_block, head_dim, block_size, num_slots, scale_log2); \
    }                                                                                                           \
    extern "C" __global__ void paged_decode_attention_reduce_##SUFFIX(                                          \
        T* out, const float* ws_acc, const float* ws_ml, const int* query_start_loc, int num_q_heads,           \
        int head_dim, int num_splits) {                                                                         \
        reduce_impl<T>(out, ws_acc, ws_ml, query_start_loc, num_q_heads, head_dim, num_splits);                 \
    }

ORCINUS_INSTANTIATE(bf16, __nv_bfloat16)
ORCINUS_INSTANTIATE(f16, __half)
ORCINUS_INSTANTIATE(f32, float)
