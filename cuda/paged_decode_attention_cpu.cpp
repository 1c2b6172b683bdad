// Paged decode attention for the CPU: one query per request against its keys, read in place from the paged
// cache (no gathered copy of every context in every layer, which is what the PyTorch reference does).
//
// Cache layout (engine/attention/backend.py): [2, num_kv_heads, num_blocks, block_size, head_dim], keys then
// values. Query head j reads KV head j / G (G query heads per KV head). One task per (request, KV head),
// spread over torch's intra-op threads: it scores the G query rows against each key as it reads it, keeps the
// scores (a context is at most a few thousand keys), then sums the values once with the softmax weights.
// Arithmetic is float32 whatever the cache's dtype, as SDPA's CPU kernel does. A sliding window reads only the
// last `window` keys (the blocks before them may already hold another request's tokens); a soft cap turns each
// score s into cap * tanh(s / cap) (Gemma 2).

// Only the headers used, not <torch/extension.h> (all of torch's C++ API): each build takes half the time.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

inline void to_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void to_float(const at::BFloat16* src, float* dst, int64_t n) {  // bfloat16 is float32's top half
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) dst[i] = __builtin_bit_cast(float, static_cast<uint32_t>(bits[i]) << 16);
}

template <typename T>  // float16 and float64: plain conversions
inline void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// A row of the cache as float32: read in place when it is float32 already, else converted into `buf`.
template <typename T>
inline const float* row_as_float(const T* src, float* buf, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    to_float(src, buf, n);
    return buf;
  }
}

// kHeadDim > 0 fixes the head size at compile time (64 and 128 are the common ones), so the per-key dot
// products and value sums unroll into a few vector instructions; 0 takes it from head_dim.
template <typename T, int kHeadDim>
void attend(const T* q, int64_t q_stride_b, int64_t q_stride_h, const T* cache, const int32_t* tables,
            int64_t table_stride, const int32_t* lens, T* out, int64_t num_requests, int64_t num_kv_heads,
            int64_t group, int64_t num_blocks, int64_t block_size, int64_t runtime_head_dim, float scale,
            int64_t window, float softcap) {
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : runtime_head_dim;
  const int64_t head_stride = num_blocks * block_size * head_dim;  // one KV head's slice of keys (or values)
  const int64_t values_offset = num_kv_heads * head_stride;
  at::parallel_for(0, num_requests * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(group * head_dim), row(head_dim), acc(group * head_dim), scores, best(group), total(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / num_kv_heads, h = task % num_kv_heads;
      const int64_t first = window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
      const int64_t len = lens[b] - first;  // keys [first, lens[b]); scores and loops index them from 0
      const int32_t* table = tables + b * table_stride;
      const T* keys = cache + h * head_stride;
      const T* values = keys + values_offset;
      for (int64_t g = 0; g < group; ++g) {
        float* qg = query.data() + g * head_dim;
        to_float(q + b * q_stride_b + (h * group + g) * q_stride_h, qg, head_dim);
        for (int64_t d = 0; d < head_dim; ++d) qg[d] *= scale;
      }
      scores.resize(group * len);
      std::fill(best.begin(), best.end(), std::numeric_limits<float>::lowest());  // finite: built with -ffast-math
      for (int64_t t = 0; t < len; ++t) {
        const int64_t p = first + t;
        const int64_t slot = static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size;
        const float* k = row_as_float(keys + slot * head_dim, row.data(), head_dim);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = query.data() + g * head_dim;
          float dot = 0.f;
          for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * k[d];
          if (softcap > 0.f) dot = softcap * std::tanh(dot / softcap);
          scores[g * len + t] = dot;
          best[g] = std::max(best[g], dot);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * len;
        const float m = best[g];
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          s[t] = std::exp(s[t] - m);
          sum += s[t];
        }
        total[g] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t p = first + t;
        const int64_t slot = static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size;
        const float* v = row_as_float(values + slot * head_dim, row.data(), head_dim);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + t];
          float* a = acc.data() + g * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) a[d] += p * v[d];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* o = out + (b * num_kv_heads * group + h * group + g) * head_dim;
        const float inv = len > 0 ? 1.f / total[g] : 0.f;
        for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<T>(acc[g * head_dim + d] * inv);
      }
    }
  });
}

}  // namespace

// q [B, Hq, D] (rows may be strided, the last dim contiguous); kv_cache as above; block_tables [B, >= blocks
// needed] int32 (rows may be strided); context_lens [B] int32; window 0 and softcap 0 turn those off.
// Returns [B, Hq, D] in q's dtype.
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor kv_cache, at::Tensor block_tables,
                                     at::Tensor context_lens, double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [B, Hq, D] with a contiguous last dimension");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous(), "kv_cache must be a contiguous 5-d tensor");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "q and kv_cache must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1, "block_tables: int32 rows");
  TORCH_CHECK(context_lens.scalar_type() == at::kInt && context_lens.is_contiguous(), "context_lens: int32");
  const int64_t num_requests = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = kv_cache.size(1), num_blocks = kv_cache.size(2), block_size = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == head_dim && num_heads % num_kv_heads == 0, "head shapes disagree");
  auto out = at::empty({num_requests, num_heads, head_dim}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    auto run = [&](auto kernel) {
      kernel(q.data_ptr<scalar_t>(), q.stride(0), q.stride(1), kv_cache.data_ptr<scalar_t>(),
             block_tables.data_ptr<int32_t>(), block_tables.stride(0), context_lens.data_ptr<int32_t>(),
             out.data_ptr<scalar_t>(), num_requests, num_kv_heads, num_heads / num_kv_heads, num_blocks, block_size,
             head_dim, static_cast<float>(scale), window, static_cast<float>(softcap));
    };
    if (head_dim == 64) run(attend<scalar_t, 64>);
    else if (head_dim == 128) run(attend<scalar_t, 128>);
    else run(attend<scalar_t, 0>);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
}
