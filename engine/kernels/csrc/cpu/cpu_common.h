// What the token-wise CPU ops share (token_ops.cpp, family_ops.cpp): elements loaded as float32 and stored as
// float32 or bfloat16, the threads' grain, the dispatch on a tensor's dtype, and the gated activations' wrapper. Each op includes it into its own
// translation unit (and module), so it is all inline, in a namespace of its own.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>

#ifdef __F16C__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace orcinus_cpu {

constexpr int64_t kGrainElements = 16384;  // below this many elements per thread, threads cost more than they save

// Elements are handled as float or as uint16_t (bfloat16's bits): plain integer types the loops vectorize over.
inline float load(float x) { return x; }
inline float load(uint16_t x) { return __builtin_bit_cast(float, static_cast<uint32_t>(x) << 16); }

inline void store(float* p, float x) { *p = x; }
inline void store(uint16_t* p, float x) {
  // Round to nearest even, as at::BFloat16 does, but branch-free so the loops vectorize. Values are finite
  // here (activations of a working model); a NaN input would not stay a NaN.
  uint32_t u = __builtin_bit_cast(uint32_t, x);
  u += 0x7FFFu + ((u >> 16) & 1u);
  *p = static_cast<uint16_t>(u >> 16);
}

inline float rounded(float x, float) { return x; }
inline float rounded(float x, uint16_t) {  // x as bfloat16 would hold it
  uint16_t b;
  store(&b, x);
  return load(b);
}

inline int64_t grain(int64_t row_elements) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(row_elements, 1));
}

// A KV cache's elements: the activations' own type, or under float32 activations a 16-bit cache (--kv-cache-dtype):
// bfloat16 as uint16_t, float16 as at::Half. A value goes in rounded to nearest even, as PyTorch's .to() rounds it.
inline void store_cache(float* p, float x) { *p = x; }
inline void store_cache(uint16_t* p, float x) { store(p, x); }
inline void store_cache(at::Half* p, float x) {
#ifdef __F16C__
  // The instruction, not at::Half's portable conversion, whose float arithmetic -ffast-math may reassociate.
  *p = at::Half(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT), at::Half::from_bits());
#else
  *p = at::Half(x);
#endif
}

// One head's d values of activations x into a cache row: a copy where the types match, else rounded per store_cache.
template <typename T, typename C>
inline void write_cache(const T* x, C* out, int64_t d) {
  if constexpr (std::is_same_v<T, C>) {
    std::memcpy(out, x, d * sizeof(T));
  } else {
    for (int64_t i = 0; i < d; ++i) store_cache(out + i, load(x[i]));
  }
}

// Runs fn with null pointers of the activations' element type and of the cache's (see store_cache).
template <typename Fn>
void dispatch_cache(const at::Tensor& x, const at::Tensor& cache, Fn fn) {
  if (x.scalar_type() == at::kBFloat16) fn(static_cast<uint16_t*>(nullptr), static_cast<uint16_t*>(nullptr));
  else if (cache.scalar_type() == at::kHalf) fn(static_cast<float*>(nullptr), static_cast<at::Half*>(nullptr));
  else if (cache.scalar_type() == at::kBFloat16) fn(static_cast<float*>(nullptr), static_cast<uint16_t*>(nullptr));
  else fn(static_cast<float*>(nullptr), static_cast<float*>(nullptr));
}

// Whether a cache of this dtype goes with activations of x's: the same dtype, or 16 bits under float32.
inline bool cache_fits(const at::Tensor& x, const at::Tensor& cache) {
  return cache.scalar_type() == x.scalar_type() ||
         (x.scalar_type() == at::kFloat && (cache.scalar_type() == at::kHalf || cache.scalar_type() == at::kBFloat16));
}

// Runs fn with a null pointer of the element type: float, or uint16_t for bfloat16 (the callers let in no other).
template <typename Fn>
void dispatch(const at::Tensor& x, Fn fn) {
  if (x.scalar_type() == at::kBFloat16) fn(static_cast<uint16_t*>(nullptr));
  else fn(static_cast<float*>(nullptr));
}

template <typename T>
T* data(const at::Tensor& t) { return static_cast<T*>(t.data_ptr()); }

inline void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), name, " must be a contiguous [rows, width] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16");
}

// The shapes rope_write_kv and its normed variant agree on, checked once for both.
struct RopeWriteKvShape {
  int64_t rows;       // tokens in qkv
  int64_t d;          // head size
  int64_t num_slots;  // cache slots per kv head
};

// qkv [T, (hq + 2 hkv) * D] (rows may be strided), positions and slot_mapping [T] int64, table [positions, 2, D],
// kv_cache [2, hkv, blocks, block_size, D] of qkv's dtype (or 16 bits under float32); every position and slot in range.
inline RopeWriteKvShape check_rope_write_kv(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& table,
                                            const at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                                            int64_t num_heads, int64_t num_kv_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && (qkv.scalar_type() == at::kFloat ||
              qkv.scalar_type() == at::kBFloat16), "qkv must be a float32 or bfloat16 [T, width] tensor, rows dense");
  const int64_t rows = qkv.size(0), d = kv_cache.size(-1);
  TORCH_CHECK(d % 2 == 0 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * d, "qkv is not ", num_heads, " + 2 x ",
              num_kv_heads, " heads of ", d, " (an even head size)");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.size(1) == num_kv_heads &&
              kv_cache.is_contiguous() && cache_fits(qkv, kv_cache),
              "kv_cache must be a contiguous [2, kv heads, blocks, block size, D] tensor of qkv's dtype, or 16-bit "
              "under float32");
  TORCH_CHECK(table.dim() == 3 && table.size(1) == 2 && table.size(2) == d && table.is_contiguous() &&
              table.scalar_type() == qkv.scalar_type(), "table must be a contiguous [positions, 2, D] tensor of qkv's dtype");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == rows && positions.scalar_type() == at::kLong &&
              positions.is_contiguous() && slot_mapping.dim() == 1 && slot_mapping.size(0) == rows &&
              slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "positions and slot_mapping must be contiguous int64 [T] tensors");
  const int64_t num_slots = kv_cache.size(2) * kv_cache.size(3);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(pos[r] >= 0 && pos[r] < table.size(0) && slots[r] >= 0 && slots[r] < num_slots,
                "a position or slot out of range");
  return {rows, d, num_slots};
}

// gate_up [rows, 2 * width] (gate, then up) -> act(gate) * up [rows, width]. rows_fn(gate_up, out, rows, width) is
// the op's row loop, called with the element type's pointers (a generic lambda over the loop's template).
template <typename RowsFn>
at::Tensor gated_activation(const at::Tensor& gate_up, RowsFn rows_fn) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must hold gate and up side by side");
  const int64_t width = gate_up.size(1) / 2;
  auto out = at::empty({gate_up.size(0), width}, gate_up.options());
  dispatch(gate_up, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    rows_fn(data<T>(gate_up), data<T>(out), gate_up.size(0), width);
  });
  return out;
}

}  // namespace orcinus_cpu
