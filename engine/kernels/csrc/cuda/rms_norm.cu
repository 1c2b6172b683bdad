// RMSNorm of each row of x [T, H], optionally with a residual added first (the sum written out too), in one kernel
// (engine/model/cuda_token_ops.py launches it through cupy.RawModule, NVRTC).
//
// Traced by torch.compile, a norm was two kernels (a looped reduction, then a pointwise pass re-reading the row:
// Inductor keeps reductions of more than 1024 elements out of one kernel), two launches for a few KB at decode sizes.
//
// sum = residual + x rounded to T (PyTorch's add); out = (v * rstd) * w rounded once to T, v the row (or the
// rounded sum), rstd = rsqrt(mean(v^2) + eps) in float32: the order of PyTorch's formula; the mean's order of
// sums is this kernel's (a block reduction), so an output may differ from PyTorch's in its last place.
//
// Grid: (T); each block's threads stride over the row twice (the second pass re-reads what it read or wrote).

#include "convert.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int kWarp = 32;

template <typename T>
__device__ __forceinline__ void rms_norm(T* __restrict__ out, T* sum, const T* __restrict__ x,
                                         const T* __restrict__ residual, const T* __restrict__ weight, int hidden,
                                         float eps) {
    __shared__ float s_partial[kThreads / kWarp];
    const long long base = static_cast<long long>(blockIdx.x) * hidden;
    float squares = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += kThreads) {
        float v = to_float(x[base + i]);
        if (residual != nullptr) {
            const T rounded = from_float<T>(__fadd_rn(to_float(residual[base + i]), v));
            sum[base + i] = rounded;
            v = to_float(rounded);
        }
        squares = __fmaf_rn(v, v, squares);
    }
#pragma unroll
    for (int offset = kWarp / 2; offset > 0; offset /= 2) squares += __shfl_xor_sync(0xffffffffu, squares, offset);
    if (threadIdx.x % kWarp == 0) s_partial[threadIdx.x / kWarp] = squares;
    __syncthreads();
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kThreads / kWarp; ++w) total += s_partial[w];
    const float rstd = rsqrtf(total / static_cast<float>(hidden) + eps);
    for (int i = threadIdx.x; i < hidden; i += kThreads) {
        // This thread's own write of sum (or the input): program order makes it visible to this thread.
        const float v = to_float(residual != nullptr ? sum[base + i] : x[base + i]);
        out[base + i] = from_float<T>(__fmul_rn(__fmul_rn(v, rstd), to_float(weight[i])));
    }
}

}  // namespace

#define RMS_NORM(SUFFIX, T)                                                                                         \
    extern "C" __global__ void __launch_bounds__(kThreads)                                                          \
        rms_norm_##SUFFIX(T* out, T* sum, const T* x, const T* residual, const T* weight, int hidden, float eps) {  \
        rms_norm<T>(out, sum, x, residual, weight, hidden, eps);                                                    \
    }

RMS_NORM(bf16, __nv_bfloat16)
RMS_NORM(f16, __half)
RMS_NORM(f32, float)
