// Token-wise ops that only some model families use, fused for the CPU as token_ops.cpp fuses the common ones:
// GeGLU's GELU(tanh)-and-multiply (Gemma), Gemma 2's final logit soft cap, and Gemma 3's per-head RMSNorm of the
// queries and keys with RoPE and the K/V cache write in one pass (PyTorch's chain there is a reshape, two norms, a
// cat, then the RoPE op; a strided key view even drops the norm to PyTorch's seven-op formula).
//
// Built with token_ops.cpp's flags (-march=native, so AVX-512 where the CPU has it, AVX2 otherwise); the loops are
// written to vectorize. Math is float32; results round to the dtype where PyTorch's unfused ops round.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>

#include "cpu_common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

using namespace orcinus_cpu;

constexpr int64_t kMaxHeadDim = 512;  // a head's normed row is kept on the stack

// PyTorch's formula, 0.5 x (1 + tanh(u)), with tanh through exp (which vectorizes where tanh does not) on |u|: then
// 1 - 2 / (exp(2|u|) + 1) rounds near 1 as tanh does, so 1 + tanh(u) flushes to 0 where PyTorch's does (a large
// negative gate). Past |u| = 10, tanh is 1 in float32; the clamp keeps exp finite.
inline float gelu_tanh(float x) {
  constexpr float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
  constexpr float kKappa = 0.044715f;
  const float u = kBeta * (x + kKappa * (x * x * x));
  const float m = 1.f - 2.f / (std::exp(2.f * std::min(std::fabs(u), 10.f)) + 1.f);
  return 0.5f * x * (1.f + std::copysign(m, u));
}

template <typename T>
void gelu_tanh_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = gate_up + r * 2 * width;
      const T* up = gate + width;
      T* o = out + r * width;
      // gelu rounds to the dtype before the product, as F.gelu(gate, approximate="tanh") * up does.
      for (int64_t i = 0; i < width; ++i) store(o + i, rounded(gelu_tanh(load(gate[i])), T{}) * load(up[i]));
    }
  });
}

// One head's RMSNorm into `normed`, rounded to T as the norm's output tensor would be.
template <typename T>
inline void norm_head(const T* x, const T* weight, float eps, int64_t d, float* normed) {
  float squares = 0.f;
  for (int64_t i = 0; i < d; ++i) {
    const float v = load(x[i]);
    squares += v * v;
  }
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(d) + eps);
  for (int64_t i = 0; i < d; ++i) normed[i] = rounded(load(x[i]) * inv * load(weight[i]), T{});
}

// Each query and key head RMS-normed (its own weight, shared by the heads), then RoPE as token_ops.cpp's
// rope_write_kv does it (rotate-half, the table's sin half signed, each product and the sum rounded to T, no
// multiply-add: the pragma), queries into q, keys and the values into the cache's slots.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
// A normed head x rotated into out, of the query's type T or the cache's (see store_cache in cpu_common.h).
template <typename T, typename O>
inline void rotate_normed(const float* x, const T* cos, const T* sin, int64_t d, O* out) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = rounded(x[i] * load(cos[i]), T{});
    const float b = rounded(x[i + half] * load(sin[i]), T{});
    store_cache(out + i, a + b);
  }
  for (int64_t i = half; i < d; ++i) {
    const float a = rounded(x[i] * load(cos[i]), T{});
    const float b = rounded(x[i - half] * load(sin[i]), T{});
    store_cache(out + i, a + b);
  }
}

template <typename T, typename C>
void qk_norm_rope_write_kv_rows(const T* qkv, int64_t ld, const int64_t* positions, const T* table, const T* q_weight,
                                const T* k_weight, float eps, T* q, C* cache, int64_t num_slots, const int64_t* slots,
                                int64_t rows, int64_t hq, int64_t hkv, int64_t d) {
  C* values = cache + hkv * num_slots * d;
  at::parallel_for(0, rows, grain((hq + 2 * hkv) * d), [&](int64_t begin, int64_t end) {
    float x[kMaxHeadDim];
    for (int64_t r = begin; r < end; ++r) {
      const T* cos = table + positions[r] * 2 * d;
      const T* sin = cos + d;
      const T* row = qkv + r * ld;
      for (int64_t h = 0; h < hq; ++h) {
        norm_head(row + h * d, q_weight, eps, d, x);
        rotate_normed(x, cos, sin, d, q + (r * hq + h) * d);
      }
      for (int64_t h = 0; h < hkv; ++h) {
        norm_head(row + (hq + h) * d, k_weight, eps, d, x);
        rotate_normed(x, cos, sin, d, cache + (h * num_slots + slots[r]) * d);
      }
      for (int64_t h = 0; h < hkv; ++h) {
        write_cache(row + (hq + hkv + h) * d, values + (h * num_slots + slots[r]) * d, d);
      }
    }
  });
}
#pragma GCC pop_options

// Gemma 2's final logits, tanh(x / cap) * cap, rounded where PyTorch's three float32 ops round: the quotient (a true
// division, not -ffast-math's reciprocal estimate), the tanh, the product. The tanh is taken in double and rounded
// once, so it is float32's correctly rounded tanh but for ties too close for double to tell; a float tanh (libmvec's
// under -ffast-math, Sleef's) is an ulp or two off for a share of the values, which the product can double. The
// pragma keeps the exponent trick below from being folded away; the arithmetic vectorizes without libm calls
// (builtins, not std:: templates, which GCC would not inline across the pragma's options).
#pragma GCC push_options
#pragma GCC optimize("no-unsafe-math-optimizations", "no-trapping-math")
// exp(x) for x in [0, 41]: 2^k exp(r), |r| <= ln2 / 2 (ln2 split in two, fdlibm's constants), exp(r) by its Taylor
// series to r^13 (the next term is below 1e-17 of it).
inline double exp_small(double x) {
  constexpr double kLog2e = 1.4426950408889634, kLn2Hi = 6.93147180369123816490e-01,
                   kLn2Lo = 1.90821492927058770002e-10;
  constexpr double kShift = 6755399441055744.0;  // 1.5 * 2^52: x + kShift holds round(x) in its low mantissa bits
  const double shifted = x * kLog2e + kShift;
  const double k = shifted - kShift;
  const double r = (x - k * kLn2Hi) - k * kLn2Lo;
  double p = 1.0 / 6227020800.0;  // 1 / 13!, then Horner's rule down to 1 / 0!
  for (double f : {479001600.0, 39916800.0, 3628800.0, 362880.0, 40320.0, 5040.0, 720.0, 120.0, 24.0, 6.0, 2.0, 1.0,
                   1.0})
    p = p * r + 1.0 / f;
  const int64_t k_int = __builtin_bit_cast(int64_t, shifted) - __builtin_bit_cast(int64_t, kShift);
  return p * __builtin_bit_cast(double, (k_int + 1023) << 52);
}

// tanh(a), a >= 0: its odd series below 1/16 (terms to a^11; the next is below 1e-16 of the sum), else
// 1 - 2 / (exp(2a) + 1), whose cancellation costs at most a few double ulps there. Past a = 20 tanh is 1 in double.
inline double tanh_nonnegative(double a) {
  a = a < 20.0 ? a : 20.0;
  const double a2 = a * a;
  const double series =
      a * (1.0 + a2 * (-1.0 / 3 + a2 * (2.0 / 15 + a2 * (-17.0 / 315 + a2 * (62.0 / 2835 + a2 * (-1382.0 / 155925))))));
  const double formula = 1.0 - 2.0 / (exp_small(2.0 * a) + 1.0);
  return a < 0.0625 ? series : formula;
}

void soft_cap_rows(const float* x, float* out, int64_t n, float cap) {
  at::parallel_for(0, n, kGrainElements, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float q = x[i] / cap;
      const float t = static_cast<float>(tanh_nonnegative(__builtin_fabs(static_cast<double>(q))));
      out[i] = __builtin_copysignf(t, q) * cap;
    }
  });
}
#pragma GCC pop_options

}  // namespace

// gate_up [rows, 2 * width] (gate, then up) -> gelu_tanh(gate) * up [rows, width]
at::Tensor gelu_tanh_mul(at::Tensor gate_up) {
  return gated_activation(gate_up, [](auto* in, auto* out, int64_t rows, int64_t width) {
    gelu_tanh_mul_rows(in, out, rows, width);
  });
}

// rope_write_kv's arguments (token_ops.cpp) and the query and key norms' weights [D] and eps: each query and key
// head RMS-normed before RoPE -> rotated queries [T, hq, D]; rotated keys and the values go into the cache.
at::Tensor qk_norm_rope_write_kv(at::Tensor qkv, at::Tensor positions, at::Tensor table, at::Tensor kv_cache,
                                 at::Tensor slot_mapping, int64_t num_heads, int64_t num_kv_heads, at::Tensor q_weight,
                                 at::Tensor k_weight, double eps) {
  const RopeWriteKvShape shape =
      check_rope_write_kv(qkv, positions, table, kv_cache, slot_mapping, num_heads, num_kv_heads);
  const int64_t rows = shape.rows, d = shape.d, num_slots = shape.num_slots;
  TORCH_CHECK(d <= kMaxHeadDim, "a head size of at most ", kMaxHeadDim, " (a normed row is kept on the stack)");
  for (const auto* w : {&q_weight, &k_weight})
    TORCH_CHECK(w->dim() == 1 && w->size(0) == d && w->is_contiguous() && w->scalar_type() == qkv.scalar_type(),
                "the norm weights must be contiguous [D] tensors of qkv's dtype");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  auto q = at::empty({rows, num_heads, d}, qkv.options());
  dispatch_cache(qkv, kv_cache, [&](auto* type, auto* cache_type) {
    using T = std::remove_pointer_t<decltype(type)>;
    using C = std::remove_pointer_t<decltype(cache_type)>;
    qk_norm_rope_write_kv_rows<T, C>(data<T>(qkv), qkv.stride(0), pos, data<T>(table), data<T>(q_weight),
                                     data<T>(k_weight), static_cast<float>(eps), data<T>(q), data<C>(kv_cache),
                                     num_slots, slots, rows, num_heads, num_kv_heads, d);
  });
  return q;
}

// logits [rows, vocab] float32 -> tanh(logits / cap) * cap (Gemma 2's final soft cap)
at::Tensor soft_cap(at::Tensor logits, double cap) {
  TORCH_CHECK(logits.is_contiguous() && logits.scalar_type() == at::kFloat,
              "logits must be a contiguous float32 tensor");
  TORCH_CHECK(cap > 0, "the soft cap must be positive");
  auto out = at::empty_like(logits);
  soft_cap_rows(logits.data_ptr<float>(), out.data_ptr<float>(), logits.numel(), static_cast<float>(cap));
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gelu_tanh_mul", &gelu_tanh_mul, "GELU (tanh) of the first half times the second (CPU)");
  m.def("qk_norm_rope_write_kv", &qk_norm_rope_write_kv,
        "per-head RMSNorm of queries and keys, RoPE, keys and values into the paged cache (CPU)");
  m.def("soft_cap", &soft_cap, "tanh(logits / cap) * cap, Gemma 2's final logit soft cap (CPU)");
}
