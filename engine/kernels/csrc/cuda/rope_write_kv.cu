// RoPE on the queries and keys of a fused QKV projection, and this iteration's keys and values into the paged cache,
// in one kernel (engine/model/cuda_token_ops.py launches it through cupy.RawModule, NVRTC).
//
// Traced by torch.compile, the same work was ~10 kernels a layer (the table gather, the half swap, the products, a
// torch.stack of K and V, and an index_put that TensorIterator cuts into four launches because the cache's strides
// pass 2^31 bytes): launches, not bytes, set its time, for a few KB of data.
//
// Layouts:
//   qkv       [T, (Hq + 2 Hkv) * D], rows `ld` elements apart, read in place (the projection's output)
//   table     [positions, 2, D]: cos for both halves, then (-sin, sin)  (engine/model/token_ops.py, Rotary)
//   q         [T, Hq, D] contiguous, the rotated queries (written here)
//   kv_cache  [2, Hkv, num_slots, D] contiguous, keys then values
// out[i] = x[i] * cos[i] + x[i +- D/2] * sin[i], with PyTorch's eager rounding: each product is rounded to T,
// then their sum (the __f*_rn intrinsics keep nvcc from contracting them into an fma), so the bits are those
// of Rotary.rope_write_kv run eagerly. A slot below 0 writes nothing to the cache.
//
// Grid: (T, ceil((Hq + 2 Hkv) * D / 2 / 128)); each thread owns one pair (i, i + D/2) of one head.

#include "convert.cuh"

namespace {

constexpr int kThreads = 128;

// a * b rounded to T, as a float.
template <typename T> __device__ __forceinline__ float mul_rounded(float a, float b) {
    return to_float<T>(from_float<T>(__fmul_rn(a, b)));
}

template <typename T>
__device__ __forceinline__ void rope_write_kv(T* __restrict__ q, T* __restrict__ cache, const T* __restrict__ qkv,
                                              const T* __restrict__ table, const long long* __restrict__ positions,
                                              const long long* __restrict__ slots, long long ld, long long num_slots,
                                              int num_q_heads, int num_kv_heads, int head_dim) {
    const int half = head_dim / 2;
    const int pair = blockIdx.y * kThreads + threadIdx.x;
    if (pair >= (num_q_heads + 2 * num_kv_heads) * half) return;
    const int head = pair / half, i = pair % half;
    const long long row = blockIdx.x;
    const T* x = qkv + row * ld + static_cast<long long>(head) * head_dim;
    const long long slot = slots[row];
    if (head >= num_q_heads + num_kv_heads) {  // a value head: copied as it is
        if (slot < 0) return;
        const int h = head - num_q_heads;  // num_kv_heads + the value head's index: the cache's second half
        T* out = cache + (static_cast<long long>(h) * num_slots + slot) * head_dim;
        out[i] = x[i];
        out[i + half] = x[i + half];
        return;
    }
    const T* cos = table + positions[row] * 2 * head_dim;
    const T* sin = cos + head_dim;
    const float lo = to_float(x[i]), hi = to_float(x[i + half]);
    const float out_lo = __fadd_rn(mul_rounded<T>(lo, to_float(cos[i])), mul_rounded<T>(hi, to_float(sin[i])));
    const float out_hi = __fadd_rn(mul_rounded<T>(hi, to_float(cos[i + half])),
                                   mul_rounded<T>(lo, to_float(sin[i + half])));
    T* out;
    if (head < num_q_heads) {
        out = q + (row * num_q_heads + head) * head_dim;
    } else {
        if (slot < 0) return;
        out = cache + (static_cast<long long>(head - num_q_heads) * num_slots + slot) * head_dim;
    }
    out[i] = from_float<T>(out_lo);
    out[i + half] = from_float<T>(out_hi);
}

}  // namespace

#define ROPE_WRITE_KV(SUFFIX, T)                                                                                    \
    extern "C" __global__ void __launch_bounds__(kThreads)                                                          \
        rope_write_kv_##SUFFIX(T* q, T* cache, const T* qkv, const T* table, const long long* positions,           \
                               const long long* slots, long long ld, long long num_slots, int num_q_heads,         \
                               int num_kv_heads, int head_dim) {                                                    \
        rope_write_kv<T>(q, cache, qkv, table, positions, slots, ld, num_slots, num_q_heads, num_kv_heads,         \
                         head_dim);                                                                                 \
    }

ROPE_WRITE_KV(bf16, __nv_bfloat16)
ROPE_WRITE_KV(f16, __half)
ROPE_WRITE_KV(f32, float)
