// Prompt rows in tiles: one thread block attends a tile of consecutive query rows of one request (rows of a prompt
// chunk, causal: each row sees the keys up to its own position) for one KV head and all of that head's query heads, so
// every key and value loaded into shared memory serves rows x heads queries. The decode kernel
// (paged_decode_attention.cu), given the same rows one by one, re-reads the request's keys for every row.
//
// Loaded at run time by engine/attention/cuda_backend.py through cupy.RawModule (NVRTC) on sm_80 and later
// (mma.sync, ldmatrix, cp.async); the whole-step CUDA graphs (engine/runner/decode_graphs.py) launch it for the
// prompt rows of a mixed step and the decode kernel for the decode rows. Compiled offline by
// tests/test_cuda_kernels.py with nvcc -Werror --resource-usage (no spills) without a GPU.
//
// Layouts as in paged_decode_attention.cu (q [T, Hq, D], kv_cache [2, Hkv, num_slots, D], block_tables
// [rows of tables, max_blocks] int32). A tile (engine/attention/prompt_tiles.py plans them) is four int32s:
// (first row of q, rows, row of block_tables, position of the first row); row i of the tile sits at position
// first_pos + i and sees keys [max(0, first_pos + i + 1 - window), first_pos + i + 1). A tile with no rows (a
// captured graph's spare ones) returns at once.
//
// Grid (tiles, KV heads), 4 warps. A block's kPairs query rows are (row, head) pairs, p = row * G + head for the
// GQA group G: the plan cuts tiles of kPairs / G rows. Keys go through shared memory kKeys at a time (cp.async,
// zero-filled past the tile's last key, so a masked weight never meets a stale NaN value). Scores, the softmax and
// the output accumulators are float32 throughout.
//   bf16/f16: each warp owns 16 pairs (one m16 MMA tile) and computes S = Q K^T and O += P V on tensor cores
//             (mma.sync m16n8k16, float32 accumulate; P rounded to the input type for the second product, as
//             flash attention does), with the online softmax in the accumulators' registers (FlashAttention-2's
//             layout). V fragments come through ldmatrix.trans; rows of shared memory are padded so the 8 rows a
//             fragment load touches fall in different banks.
//   float32:  two threads a pair, each holding half the head dim, scalar FMAs over the same shared tiles.
// A warp whose pairs see none of a round's keys (causality, or a sliding window) skips its math for that round.
// The key range is not split across blocks: a step has tiles x KV heads blocks already, and the graphs cap the keys a
// step's prompt rows read.

#include "convert.cuh"

namespace {

constexpr int kWarp = 32;
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * kWarp;
constexpr int kPairs = 16 * kWarps;  // (row, head) pairs a block: PAIRS_PER_TILE in engine/attention/prompt_tiles.py
constexpr int kMinBlocksPerSM = 2;   // __launch_bounds__: at most 255 registers a thread
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

struct Tile {
    int first_row, rows, table_row, first_pos;
};

// What one block needs to know of its tile and of the pairs of one warp.
struct TileRange {
    Tile tile;
    int group;       // query heads per KV head
    int pairs;       // rows x group
    int begin, end;  // keys any row of the tile reads
    bool warp_busy;  // the warp has pairs
    int warp_lo, warp_hi;  // keys any pair of the warp reads
};

__device__ __forceinline__ TileRange tile_range(const int* tiles, int num_q_heads, int num_kv_heads, int window) {
    TileRange t;
    const int4 raw = *reinterpret_cast<const int4*>(tiles + 4 * static_cast<long long>(blockIdx.x));
    t.tile = {raw.x, raw.y, raw.z, raw.w};
    t.group = num_q_heads / num_kv_heads;
    t.pairs = t.tile.rows * t.group;
    t.end = t.tile.first_pos + t.tile.rows;
    t.begin = window > 0 ? max(0, t.tile.first_pos + 1 - window) : 0;
    const int first_pair = (threadIdx.x / kWarp) * 16;
    const int last_pair = min(first_pair + 15, t.pairs - 1);
    t.warp_busy = first_pair < t.pairs;
    t.warp_hi = t.tile.first_pos + last_pair / t.group + 1;
    t.warp_lo = window > 0 ? max(0, t.tile.first_pos + first_pair / t.group + 1 - window) : 0;
    return t;
}

// A 16-byte copy global -> shared that does not pass through registers; `valid` false writes zeros.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Keys [base, base + kKeys) of the tile into s_k and s_v ([kKeys][kStride] of T); keys at or past `end` are zeros
// (their table entries are never read: past a request's blocks they may be anything).
template <typename T, int D, int kKeys, int kStride>
__device__ __forceinline__ void stage_keys(T* s_k, T* s_v, int* s_slot, const T* k_cache, const T* v_cache,
                                           const int* table, int base, int end, int block_size) {
    constexpr int kPer = 16 / sizeof(T);  // elements a 16-byte copy
    constexpr int kCopies = kKeys * D / kPer;
    static_assert(kCopies % kThreads == 0, "whole rounds of copies");
    __syncthreads();  // every warp is done with the previous keys
    if (threadIdx.x < kKeys) {
        const int pos = base + threadIdx.x;
        s_slot[threadIdx.x] = pos < end ? table[pos / block_size] * block_size + pos % block_size : -1;
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kCopies / kThreads; ++i) {
        const int e = i * kThreads + threadIdx.x;
        const int key = e / (D / kPer), off = (e % (D / kPer)) * kPer;
        const int slot = s_slot[key];
        const long long src = slot >= 0 ? static_cast<long long>(slot) * D + off : 0;
        cp_async16(s_k + key * kStride + off, k_cache + src, slot >= 0);
        cp_async16(s_v + key * kStride + off, v_cache + src, slot >= 0);
    }
    cp_async_wait_all();
    __syncthreads();
}

// ---------------------------------------------------------------- bf16 / f16: tensor cores

template <typename T> struct Mma;
template <> struct Mma<__nv_bfloat16> {
    static __device__ __forceinline__ void run(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ unsigned pack(float lo, float hi) {
        const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<const unsigned*>(&h);
    }
};
template <> struct Mma<__half> {
    static __device__ __forceinline__ void run(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ unsigned pack(float lo, float hi) {
        const __half2 h = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<const unsigned*>(&h);
    }
};

template <typename T> __device__ __forceinline__ unsigned load_pair(const T* p) {
    return *reinterpret_cast<const unsigned*>(p);
}

// Four 8x8 b16 matrices, transposed: row addresses from lanes 8i..8i+7 give matrix i, in r[i].
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* p) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

template <typename T, int D>
__device__ __forceinline__ void tiles_mma(T* __restrict__ out, const T* __restrict__ q, const T* __restrict__ kv_cache,
                                          const int* __restrict__ tiles, const int* __restrict__ block_tables,
                                          int max_blocks, int num_q_heads, int num_kv_heads, int block_size,
                                          long long num_slots, float scale_log2, int window, float softcap_log2) {
    constexpr int kKeys = 64;           // keys a shared-memory round
    constexpr int kStride = D + 8;      // padded rows (16 bytes): fragment loads of 8 rows hit 8 bank groups
    constexpr int kN = kKeys / 8;       // score fragments (n8) a round
    constexpr int kK = D / 16;          // k16 steps over the head dim
    static_assert(D % 16 == 0, "whole k16 steps");
    __shared__ uint4 s_raw[2 * kKeys * kStride * sizeof(T) / 16];  // raw storage: T has a constructor
    __shared__ int s_slot[kKeys];
    T* s_k = reinterpret_cast<T*>(s_raw);
    T* s_v = s_k + kKeys * kStride;

    const TileRange t = tile_range(tiles, num_q_heads, num_kv_heads, window);
    if (t.tile.rows <= 0) return;  // uniform over the block
    const int kv_head = blockIdx.y;
    const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
    const int quad = lane / 4, tq = lane % 4;  // the fragment row this lane holds (and that + 8), its column pair

    // This lane's two pairs (rows quad and quad + 8 of the warp's 16): q row, the keys they see [lo, lim).
    long long q_off[2];
    int lo[2], lim[2];
    bool has[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int p = warp * 16 + quad + 8 * j;
        has[j] = p < t.pairs;
        const int r = p / t.group, h = p % t.group;
        lim[j] = has[j] ? t.tile.first_pos + r + 1 : 0;  // a pair past the tile sees nothing
        lo[j] = window > 0 ? max(0, lim[j] - window) : 0;
        q_off[j] = has[j] ? (static_cast<long long>(t.tile.first_row + r) * num_q_heads + kv_head * t.group + h) * D
                          : 0;
    }
    unsigned qa[kK][4];  // A fragments of Q
#pragma unroll
    for (int k = 0; k < kK; ++k) {
        const int d = k * 16 + tq * 2;
        qa[k][0] = has[0] ? load_pair(q + q_off[0] + d) : 0u;
        qa[k][1] = has[1] ? load_pair(q + q_off[1] + d) : 0u;
        qa[k][2] = has[0] ? load_pair(q + q_off[0] + d + 8) : 0u;
        qa[k][3] = has[1] ? load_pair(q + q_off[1] + d + 8) : 0u;
    }

    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m[2] = {neg_inf(), neg_inf()}, l[2] = {0.0f, 0.0f};

    const T* k_cache = kv_cache + static_cast<long long>(kv_head) * num_slots * D;
    const T* v_cache = kv_cache + (static_cast<long long>(num_kv_heads) + kv_head) * num_slots * D;
    const int* table = block_tables + static_cast<long long>(t.tile.table_row) * max_blocks;

    for (int base = t.begin; base < t.end; base += kKeys) {  // uniform over the block
        stage_keys<T, D, kKeys, kStride>(s_k, s_v, s_slot, k_cache, v_cache, table, base, t.end, block_size);
        if (!t.warp_busy || base >= t.warp_hi || base + kKeys <= t.warp_lo) continue;  // uniform over the warp

        // S = Q K^T: B fragments straight from the padded rows (key quad of each n8, dims tq*2, +1 and +8, +9).
        float s[kN][4];
#pragma unroll
        for (int n = 0; n < kN; ++n) {
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
            const T* krow = s_k + (n * 8 + quad) * kStride + tq * 2;
#pragma unroll
            for (int k = 0; k < kK; ++k) Mma<T>::run(s[n], qa[k], load_pair(krow + k * 16), load_pair(krow + k * 16 + 8));
        }

        // Base-2 scores, masked; one online-softmax step per pair for the round (the 4 lanes of a quad share a row).
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int n = 0; n < kN; ++n) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int j = c / 2, key = base + n * 8 + tq * 2 + (c & 1);
                float x = s[n][c] * scale_log2;
                if (softcap_log2 > 0.0f) x = softcap_log2 * tanhf(x / softcap_log2);  // uniform: a launch parameter
                x = key < lim[j] && key >= lo[j] ? x : neg_inf();
                s[n][c] = x;
                mx[j] = fmaxf(mx[j], x);
            }
        }
        float ref[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            mx[j] = fmaxf(mx[j], __shfl_xor_sync(kFullMask, mx[j], 1));
            mx[j] = fmaxf(mx[j], __shfl_xor_sync(kFullMask, mx[j], 2));
            ref[j] = mx[j] == neg_inf() ? 0.0f : mx[j];  // no key yet: weights 0, o stays 0 (not NaN)
            const float alpha = exp2f(m[j] - ref[j]);      // 0 while m is -inf
            m[j] = mx[j];
            l[j] *= alpha;
#pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                o[n][2 * j] *= alpha;
                o[n][2 * j + 1] *= alpha;
            }
        }
#pragma unroll
        for (int n = 0; n < kN; ++n) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                s[n][c] = exp2f(s[n][c] - ref[c / 2]);
                l[c / 2] += s[n][c];
            }
        }

        // O += P V: the score fragments of keys 16k..16k+15 are P's A fragment; V's B fragments via ldmatrix.trans,
        // two n8 tiles of dims a load.
#pragma unroll
        for (int k = 0; k < kKeys / 16; ++k) {
            const unsigned pa[4] = {Mma<T>::pack(s[2 * k][0], s[2 * k][1]), Mma<T>::pack(s[2 * k][2], s[2 * k][3]),
                                    Mma<T>::pack(s[2 * k + 1][0], s[2 * k + 1][1]),
                                    Mma<T>::pack(s[2 * k + 1][2], s[2 * k + 1][3])};
            const T* vrow = s_v + (k * 16 + lane % 8 + (lane / 8) % 2 * 8) * kStride + (lane / 16) * 8;
#pragma unroll
            for (int n = 0; n < D / 16; ++n) {
                unsigned b[4];
                ldmatrix_x4_trans(b, vrow + n * 16);
                Mma<T>::run(o[2 * n], pa, b[0], b[1]);
                Mma<T>::run(o[2 * n + 1], pa, b[2], b[3]);
            }
        }
    }

#pragma unroll
    for (int j = 0; j < 2; ++j) {
        float total = l[j];
        total += __shfl_xor_sync(kFullMask, total, 1);
        total += __shfl_xor_sync(kFullMask, total, 2);
        if (!has[j]) continue;
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;  // 0: no key (never for a real prompt row)
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            T* dst = out + q_off[j] + n * 8 + tq * 2;
            dst[0] = from_float<T>(o[n][2 * j] * inv);
            dst[1] = from_float<T>(o[n][2 * j + 1] * inv);
        }
    }
}

// ---------------------------------------------------------------- float32: scalar

template <int D>
__device__ __forceinline__ void tiles_f32(float* __restrict__ out, const float* __restrict__ q,
                                          const float* __restrict__ kv_cache, const int* __restrict__ tiles,
                                          const int* __restrict__ block_tables, int max_blocks, int num_q_heads,
                                          int num_kv_heads, int block_size, long long num_slots, float scale_log2,
                                          int window, float softcap_log2) {
    constexpr int kKeys = 32;  // keys a shared-memory round
    constexpr int kSub = 8;    // keys scored before one online-softmax step
    constexpr int kHalf = D / 2;
    static_assert(kHalf % 4 == 0, "whole float4s a half row");
    static_assert(2 * kPairs == kThreads, "two threads a pair");
    __shared__ float4 s_raw[2 * kKeys * D / 4];
    __shared__ int s_slot[kKeys];
    float* s_k = reinterpret_cast<float*>(s_raw);
    float* s_v = s_k + kKeys * D;

    const TileRange t = tile_range(tiles, num_q_heads, num_kv_heads, window);
    if (t.tile.rows <= 0) return;  // uniform over the block
    const int kv_head = blockIdx.y;
    const int pair = threadIdx.x / 2, half = threadIdx.x % 2;  // a warp's 32 lanes hold 16 pairs
    const bool has = pair < t.pairs;
    const int r = pair / t.group, h = pair % t.group;
    const int lim = has ? t.tile.first_pos + r + 1 : 0;
    const int lo = window > 0 ? max(0, lim - window) : 0;
    const long long q_off =
        (static_cast<long long>(t.tile.first_row + r) * num_q_heads + kv_head * t.group + h) * D + half * kHalf;

    float qf[kHalf], acc[kHalf];
#pragma unroll
    for (int i = 0; i < kHalf; i += 4) {
        const float4 x = has ? *reinterpret_cast<const float4*>(q + q_off + i) : make_float4(0.f, 0.f, 0.f, 0.f);
        qf[i] = x.x * scale_log2;
        qf[i + 1] = x.y * scale_log2;
        qf[i + 2] = x.z * scale_log2;
        qf[i + 3] = x.w * scale_log2;
        acc[i] = acc[i + 1] = acc[i + 2] = acc[i + 3] = 0.0f;
    }
    float m = neg_inf(), l = 0.0f;

    const float* k_cache = kv_cache + static_cast<long long>(kv_head) * num_slots * D;
    const float* v_cache = kv_cache + (static_cast<long long>(num_kv_heads) + kv_head) * num_slots * D;
    const int* table = block_tables + static_cast<long long>(t.tile.table_row) * max_blocks;

    for (int base = t.begin; base < t.end; base += kKeys) {  // uniform over the block
        stage_keys<float, D, kKeys, D>(s_k, s_v, s_slot, k_cache, v_cache, table, base, t.end, block_size);
        if (!t.warp_busy || base >= t.warp_hi || base + kKeys <= t.warp_lo) continue;  // uniform over the warp
#pragma unroll 1
        for (int sub = 0; sub < kKeys; sub += kSub) {
            float s[kSub];
            float mx = m;
#pragma unroll
            for (int u = 0; u < kSub; ++u) {
                const float* krow = s_k + (sub + u) * D + half * kHalf;
                float x = 0.0f;
#pragma unroll
                for (int i = 0; i < kHalf; i += 4) {
                    const float4 k4 = *reinterpret_cast<const float4*>(krow + i);
                    x += qf[i] * k4.x + qf[i + 1] * k4.y + qf[i + 2] * k4.z + qf[i + 3] * k4.w;
                }
                x += __shfl_xor_sync(kFullMask, x, 1);  // the pair's other half
                if (softcap_log2 > 0.0f) x = softcap_log2 * tanhf(x / softcap_log2);
                const int key = base + sub + u;
                s[u] = key < lim && key >= lo ? x : neg_inf();
                mx = fmaxf(mx, s[u]);
            }
            const float ref = mx == neg_inf() ? 0.0f : mx;
            const float alpha = exp2f(m - ref);
            m = mx;
            l *= alpha;
#pragma unroll
            for (int i = 0; i < kHalf; ++i) acc[i] *= alpha;
#pragma unroll
            for (int u = 0; u < kSub; ++u) {
                const float p = exp2f(s[u] - ref);
                l += p;
                const float* vrow = s_v + (sub + u) * D + half * kHalf;
#pragma unroll
                for (int i = 0; i < kHalf; i += 4) {
                    const float4 v4 = *reinterpret_cast<const float4*>(vrow + i);
                    acc[i] += p * v4.x;
                    acc[i + 1] += p * v4.y;
                    acc[i + 2] += p * v4.z;
                    acc[i + 3] += p * v4.w;
                }
            }
        }
    }
    if (!has) return;
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
    for (int i = 0; i < kHalf; i += 4) {
        *reinterpret_cast<float4*>(out + q_off + i) =
            make_float4(acc[i] * inv, acc[i + 1] * inv, acc[i + 2] * inv, acc[i + 3] * inv);
    }
}

}  // namespace

#define ORCINUS_TILES(SUFFIX, T, D, IMPL)                                                                         \
    extern "C" __global__ void __launch_bounds__(kThreads, kMinBlocksPerSM) paged_prompt_tiles_##SUFFIX##_d##D(   \
        T* out, const T* q, const T* kv_cache, const int* tiles, const int* block_tables, int max_blocks,          \
        int num_q_heads, int num_kv_heads, int block_size, long long num_slots, float scale_log2, int window,     \
        float softcap_log2) {                                                                                     \
        IMPL(out, q, kv_cache, tiles, block_tables, max_blocks, num_q_heads, num_kv_heads, block_size, num_slots, \
             scale_log2, window, softcap_log2);                                                                   \
    }

ORCINUS_TILES(bf16, __nv_bfloat16, 64, (tiles_mma<__nv_bfloat16, 64>))
ORCINUS_TILES(bf16, __nv_bfloat16, 128, (tiles_mma<__nv_bfloat16, 128>))
ORCINUS_TILES(f16, __half, 64, (tiles_mma<__half, 64>))
ORCINUS_TILES(f16, __half, 128, (tiles_mma<__half, 128>))
ORCINUS_TILES(f32, float, 64, tiles_f32<64>)
ORCINUS_TILES(f32, float, 128, tiles_f32<128>)
