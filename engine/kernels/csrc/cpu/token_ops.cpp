// Token-wise ops of a decoder layer fused for the CPU: RMSNorm (optionally after the residual add),
// SiLU-and-multiply, and RoPE with the K/V cache write, one pass over each row instead of PyTorch's chain of small
// ops. On the CPU each of those ops costs its dispatch whatever its size (F.rms_norm runs as pow, mean, add, rsqrt,
// mul, mul, casts), which adds up to a noticeable share of a small model's decode step at small batches.
//
// Math is float32 whatever the dtype. Results round to the tensor's dtype where PyTorch's unfused ops round,
// so bfloat16 outputs differ from them only now and then in the last place (float32 sums added in another
// order, an exp that rounds differently).

// Only the headers used, not <torch/extension.h> (all of torch's C++ API): a build parses a fraction of the headers.
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
#include <tuple>
#include <type_traits>

namespace {

using namespace orcinus_cpu;

// residual == nullptr: out = norm(x). Otherwise sum = x + residual (rounded), out = norm(sum).
template <typename T>
void rms_norm_rows(const T* x, const T* residual, const T* weight, T* sum, T* out, int64_t rows, int64_t hidden,
                   float eps) {
  at::parallel_for(0, rows, grain(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * hidden;
      T* outr = out + r * hidden;
      const T* src = xr;
      if (residual != nullptr) {
        const T* rr = residual + r * hidden;
        T* sr = sum + r * hidden;
        for (int64_t i = 0; i < hidden; ++i) store(sr + i, load(xr[i]) + load(rr[i]));
        src = sr;
      }
      float squares = 0.f;
      for (int64_t i = 0; i < hidden; ++i) {
        const float v = load(src[i]);
        squares += v * v;
      }
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(hidden) + eps);
      for (int64_t i = 0; i < hidden; ++i) store(outr + i, load(src[i]) * inv * load(weight[i]));
    }
  });
}

template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = gate_up + r * 2 * width;
      const T* up = gate + width;
      T* o = out + r * width;
      for (int64_t i = 0; i < width; ++i) {
        const float g = load(gate[i]);
        // silu rounds to the dtype before the product, as F.silu(gate) * up does.
        store(o + i, rounded(g / (1.f + std::exp(-g)), T{}) * load(up[i]));
      }
    }
  });
}

// RoPE in the rotate-half convention on a fused QKV row's queries and keys (out = x * cos + swap_halves(x) * sin, the
// table's sin half already signed), queries into q, rotated keys and the values into the cache's slots. Each product
// and the sum round to T as PyTorch's three ops do; no multiply-add contracts them (the pragma), so float32 gives
// PyTorch's bits.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
// One head rotated: out[i] = x[i] cos[i] + x[i +- D/2] sin[i], each product and the sum rounded to T; out of the
// query's type T or the cache's C (then rounded once more into it, as the reference's .to() does).
template <typename T, typename O>
inline void rotate_head(const T* x, const T* cos, const T* sin, int64_t d, O* out) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; ++i) {
    const float a = rounded(load(x[i]) * load(cos[i]), T{});
    const float b = rounded(load(x[i < half ? i + half : i - half]) * load(sin[i]), T{});
    store_cache(out + i, a + b);
  }
}

template <typename T, typename C>
void rope_write_kv_rows(const T* qkv, int64_t ld, const int64_t* positions, const T* table, T* q, C* cache,
                        int64_t num_slots, const int64_t* slots, int64_t rows, int64_t hq, int64_t hkv, int64_t d) {
  C* values = cache + hkv * num_slots * d;
  at::parallel_for(0, rows, grain((hq + 2 * hkv) * d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* cos = table + positions[r] * 2 * d;
      const T* sin = cos + d;
      const T* row = qkv + r * ld;
      for (int64_t h = 0; h < hq; ++h) rotate_head(row + h * d, cos, sin, d, q + (r * hq + h) * d);
      for (int64_t h = 0; h < hkv; ++h) {
        rotate_head(row + (hq + h) * d, cos, sin, d, cache + (h * num_slots + slots[r]) * d);
      }
      for (int64_t h = 0; h < hkv; ++h) {
        write_cache(row + (hq + hkv + h) * d, values + (h * num_slots + slots[r]) * d, d);
      }
    }
  });
}
#pragma GCC pop_options

}  // namespace

// x [rows, hidden], weight [hidden] -> x * rsqrt(mean(x^2) + eps) * weight
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
              weight.scalar_type() == x.scalar_type(), "weight must be a contiguous [hidden] tensor of x's dtype");
  auto out = at::empty_like(x);
  dispatch(x, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    rms_norm_rows<T>(data<T>(x), nullptr, data<T>(weight), nullptr, data<T>(out), x.size(0),
                     x.size(1), static_cast<float>(eps));
  });
  return out;
}

// (x + residual, rms_norm(x + residual)): the residual add before a norm, in the same pass.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight,
                                                      double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "x and residual must match");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
              weight.scalar_type() == x.scalar_type(), "weight must be a contiguous [hidden] tensor of x's dtype");
  auto sum = at::empty_like(x);
  auto out = at::empty_like(x);
  dispatch(x, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    rms_norm_rows<T>(data<T>(x), data<T>(residual), data<T>(weight), data<T>(sum),
                     data<T>(out), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return {sum, out};
}

// gate_up [rows, 2 * width] (gate, then up) -> silu(gate) * up [rows, width]
at::Tensor silu_mul(at::Tensor gate_up) {
  return gated_activation(gate_up, [](auto* in, auto* out, int64_t rows, int64_t width) {
    silu_mul_rows(in, out, rows, width);
  });
}

// qkv [T, (hq + 2 hkv) * D] (rows may be strided), positions and slot_mapping [T] int64, table [positions, 2, D] (cos,
// then signed sin), kv_cache [2, hkv, blocks, block_size, D] (qkv's dtype, or 16 bits under float32) -> rotated queries [T, hq, D]; rotated keys and the
// values go into the cache at their slots.
at::Tensor rope_write_kv(at::Tensor qkv, at::Tensor positions, at::Tensor table, at::Tensor kv_cache,
                            at::Tensor slot_mapping, int64_t num_heads, int64_t num_kv_heads) {
  const RopeWriteKvShape shape =
      check_rope_write_kv(qkv, positions, table, kv_cache, slot_mapping, num_heads, num_kv_heads);
  const int64_t rows = shape.rows, d = shape.d, num_slots = shape.num_slots;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  auto q = at::empty({rows, num_heads, d}, qkv.options());
  dispatch_cache(qkv, kv_cache, [&](auto* type, auto* cache_type) {
    using T = std::remove_pointer_t<decltype(type)>;
    using C = std::remove_pointer_t<decltype(cache_type)>;
    rope_write_kv_rows<T, C>(data<T>(qkv), qkv.stride(0), pos, data<T>(table), data<T>(q), data<C>(kv_cache),
                             num_slots, slots, rows, num_heads, num_kv_heads, d);
  });
  return q;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm (CPU)");
  m.def("add_rms_norm", &add_rms_norm, "residual add, then RMSNorm (CPU)");
  m.def("silu_mul", &silu_mul, "SiLU of the first half times the second (CPU)");
  m.def("rope_write_kv", &rope_write_kv, "RoPE on queries and keys, keys and values into the paged cache (CPU)");
}
