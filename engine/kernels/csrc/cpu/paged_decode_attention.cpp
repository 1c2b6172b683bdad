// Paged attention for the CPU: each query row against its own request's keys, read in place from the paged cache
// (no gathered copy of every context in every layer, which is what the PyTorch reference does).
//
// Cache layout (engine/attention/backend.py): [2, num_kv_heads, num_blocks, block_size, head_dim], keys then
// values. Query head j reads KV head j / G (G query heads per KV head). Row r reads request row_requests[r]'s block
// table and its first lens[r] keys. Neighbouring rows of one request (the draft tokens a decoding request verifies,
// or a prompt chunk under --batch-invariant) share their reads: a task is a run of such rows and one KV head, which
// scores all its rows' G query heads against each key it reads, eight keys at a time. One query's arithmetic is
// the same whatever else is in its run or batch (each dot product, softmax sum and value sum runs in one fixed
// order from its own first key), so a token verified among draft tokens gets the bits it would get decoded alone.
// Arithmetic is float32 whatever the cache's dtype, as SDPA's CPU kernel does. A bfloat16 or float16 cache (the
// cache's own dtype, or --kv-cache-dtype under float32 queries) is read as stored and widened to float32 in registers
// as its keys and values are loaded: half the bytes of a float32 cache, and exactly the float32 arithmetic on the
// widened values, since widening is exact. A sliding window reads only the
// last `window` keys (the blocks before them may already hold another request's tokens); a soft cap turns each
// score s into cap * tanh(s / cap) (Gemma 2).

// Only the headers used, not <torch/extension.h> (all of torch's C++ API): a build parses a fraction of the headers.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

typedef float v8 __attribute__((vector_size(32)));  // 8 lanes: two SSE registers, one AVX2 one, half an AVX-512 one
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline v8 load8(const at::BFloat16* p) {  // bfloat16 is float32's top half: widen each lane, shift it up
  v8h h;
  std::memcpy(&h, p, sizeof h);
  return reinterpret_cast<v8>(__builtin_convertvector(h, v8i) << 16);
}

inline v8 load8(const at::Half* p) {
#ifdef __F16C__
  return reinterpret_cast<v8>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  v8 v;
  for (int i = 0; i < 8; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

inline void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }

// The 8 lane sums of a[0..7], as one vector: sum j = ((a_j0 + a_j1) + (a_j2 + a_j3)) + ((a_j4 + a_j5) + (a_j6 + a_j7))
// for every j, so a key's score does not depend on its place among the eight.
inline v8 transpose_sum(const v8* a) {
  v8 b[4], c[2];
  for (int i = 0; i < 4; ++i) {
    b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], (v8i){0, 8, 2, 10, 4, 12, 6, 14}) +
           __builtin_shuffle(a[2 * i], a[2 * i + 1], (v8i){1, 9, 3, 11, 5, 13, 7, 15});
  }
  for (int i = 0; i < 2; ++i) {
    c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], (v8i){0, 1, 8, 9, 4, 5, 12, 13}) +
           __builtin_shuffle(b[2 * i], b[2 * i + 1], (v8i){2, 3, 10, 11, 6, 7, 14, 15});
  }
  return __builtin_shuffle(c[0], c[1], (v8i){0, 1, 2, 3, 8, 9, 10, 11}) +
         __builtin_shuffle(c[0], c[1], (v8i){4, 5, 6, 7, 12, 13, 14, 15});
}

inline void to_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void to_float(const at::BFloat16* src, float* dst, int64_t n) {  // bfloat16 is float32's top half
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) dst[i] = __builtin_bit_cast(float, static_cast<uint32_t>(bits[i]) << 16);
}

template <typename T>  // float16 and float64: plain conversions
inline void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// The element type the kernels below load keys and values as: the cache's own where they widen it in registers
// (float32, bfloat16, float16), else float32 copies (float64).
template <typename C>
using Stored = std::conditional_t<std::is_same_v<C, float> || std::is_same_v<C, at::BFloat16> ||
                                      std::is_same_v<C, at::Half>,
                                  C, float>;

// One task's keys and values as rows the kernels load: pointers into the cache, or converted copies (float64).
template <typename C>
struct Rows {
  using E = Stored<C>;
  std::vector<const E*> keys, values;
  std::vector<float> buffer;

  void read(const C* cache_keys, const C* cache_values, const int32_t* table, int64_t block_size, int64_t first,
            int64_t end, int64_t head_dim) {
    const int64_t n = end - first;
    keys.resize(n);
    values.resize(n);
    if constexpr (!std::is_same_v<C, E>) buffer.resize(2 * n * head_dim);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t p = first + t;
      const int64_t slot = static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size;
      if constexpr (std::is_same_v<C, E>) {
        keys[t] = cache_keys + slot * head_dim;
        values[t] = cache_values + slot * head_dim;
      } else {
        float* k = buffer.data() + 2 * t * head_dim;
        to_float(cache_keys + slot * head_dim, k, head_dim);
        to_float(cache_values + slot * head_dim, k + head_dim, head_dim);
        keys[t] = k;
        values[t] = k + head_dim;
      }
    }
  }
};

// The arithmetic of one query, whatever the build: a score is eight lanes of fused multiply-adds over head_dim in
// order, then transpose_sum; a value sum is, lane by lane (one lane a dimension), a fused multiply-add per key in
// order. The AVX-512 build does the same operations two at a time in 16-lane registers (two keys or two queries side
// by side, or 16 dimensions of one sum), so it gives the AVX2 build's bits in half the multiply-adds, which pays most
// for a request's many rows (a decode verifying drafts) (bench/kernels/bench_cpu_attention.py --against;
// docs/performance.md, Kernels).
#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define ORCINUS_ATTENTION_WIDE 1
#endif

#ifdef ORCINUS_ATTENTION_WIDE

inline v8 low(__m512 v) { return reinterpret_cast<v8>(_mm512_castps512_ps256(v)); }
inline v8 high(__m512 v) { return reinterpret_cast<v8>(_mm512_extractf32x8_ps(v, 1)); }
template <typename E>
inline __m256 load8ps(const E* a) { return reinterpret_cast<__m256>(load8(a)); }
template <typename E>
inline __m512 side_by_side(const E* a, const E* b) {  // a's 8 values, then b's
  return _mm512_insertf32x8(_mm512_castps256_ps512(load8ps(a)), load8ps(b), 1);
}
template <typename E>
inline __m512 twice(const E* a) { return _mm512_broadcast_f32x8(load8ps(a)); }
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// scores[t] = q . keys[t] for the 8 keys from `keys` (missing ones point at `zero`), head_dim a multiple of 8: keys
// 2i and 2i+1 share a register.
template <typename E>
inline void score8(const float* q, const E* const* keys, int64_t head_dim, float* scores) {
  __m512 acc[4];
  for (int i = 0; i < 4; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < head_dim; d += 8) {
    const __m512 qd = _mm512_broadcast_f32x8(_mm256_loadu_ps(q + d));
    for (int i = 0; i < 4; ++i) {
      acc[i] = _mm512_fmadd_ps(qd, side_by_side(keys[2 * i] + d, keys[2 * i + 1] + d), acc[i]);
    }
  }
  v8 a[8];
  for (int i = 0; i < 4; ++i) {
    a[2 * i] = low(acc[i]);
    a[2 * i + 1] = high(acc[i]);
  }
  store8(scores, transpose_sum(a));
}

// score8 for two queries, side by side in one register: a key's slice is read once for both.
template <typename E>
inline void score8x2(const float* q0, const float* q1, const E* const* keys, int64_t head_dim, float* scores0,
                     float* scores1) {
  __m512 acc[8];
  for (int t = 0; t < 8; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t d = 0; d < head_dim; d += 8) {
    const __m512 qq = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(q0 + d)), _mm256_loadu_ps(q1 + d), 1);
    for (int t = 0; t < 8; ++t) acc[t] = _mm512_fmadd_ps(qq, twice(keys[t] + d), acc[t]);
  }
  v8 a0[8], a1[8];
  for (int t = 0; t < 8; ++t) {
    a0[t] = low(acc[t]);
    a1[t] = high(acc[t]);
  }
  store8(scores0, transpose_sum(a0));
  store8(scores1, transpose_sum(a1));
}

// score8x2 for four queries (two pairs): a key's slice is widened once for all four, which pays for a group of four
// or more query heads on one KV head (Gemma 3, Llama 3.2) over a 16-bit cache, where the widening costs as much as
// the multiply-adds. Each query's lanes see the same operations in the same order as under score8x2.
template <typename E>
inline void score8x4(const float* const* q, const E* const* keys, int64_t head_dim, float* const* scores) {
  __m512 acc[2][8];
  for (int t = 0; t < 8; ++t) acc[0][t] = acc[1][t] = _mm512_setzero_ps();
  for (int64_t d = 0; d < head_dim; d += 8) {
    const __m512 q01 = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(q[0] + d)), _mm256_loadu_ps(q[1] + d), 1);
    const __m512 q23 = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(q[2] + d)), _mm256_loadu_ps(q[3] + d), 1);
    for (int t = 0; t < 8; ++t) {
      const __m512 k = twice(keys[t] + d);
      acc[0][t] = _mm512_fmadd_ps(q01, k, acc[0][t]);
      acc[1][t] = _mm512_fmadd_ps(q23, k, acc[1][t]);
    }
  }
  for (int h = 0; h < 2; ++h) {
    v8 a0[8], a1[8];
    for (int t = 0; t < 8; ++t) {
      a0[t] = low(acc[h][t]);
      a1[t] = high(acc[h][t]);
    }
    store8(scores[2 * h], transpose_sum(a0));
    store8(scores[2 * h + 1], transpose_sum(a1));
  }
}

// acc[0, 16 kWidth) += p[t] * values[t][0, 16 kWidth) for t in [a, b), in that order, for kQueries queries (their
// weights p[q] and sums acc[q]) at once; the sums stay in registers between a load and a store of acc.
template <int kWidth, int kQueries, typename E>
inline void accumulate_slice(const float* const* p, const E* const* values, int64_t offset, int64_t a, int64_t b,
                             float* const* acc) {
  __m512 sum[kQueries][kWidth];
  for (int q = 0; q < kQueries; ++q)
    for (int i = 0; i < kWidth; ++i) sum[q][i] = _mm512_loadu_ps(acc[q] + 16 * i);
  for (int64_t t = a; t < b; ++t) {
    __m512 w[kQueries];
    for (int q = 0; q < kQueries; ++q) w[q] = _mm512_set1_ps(p[q][t]);
    for (int i = 0; i < kWidth; ++i) {
      const __m512 v = load16(values[t] + offset + 16 * i);
      for (int q = 0; q < kQueries; ++q) sum[q][i] = _mm512_fmadd_ps(w[q], v, sum[q][i]);
    }
  }
  for (int q = 0; q < kQueries; ++q)
    for (int i = 0; i < kWidth; ++i) _mm512_storeu_ps(acc[q] + 16 * i, sum[q][i]);
}

// The same over the whole head: 64 lanes at a time, then 16, then 8 (a half register, as the AVX2 build does it).
template <int kQueries, typename E>
inline void accumulate_head(const float* const* p, const E* const* values, int64_t a, int64_t b, int64_t head_dim,
                            float* const* acc) {
  const auto at = [&](int64_t d) {
    std::array<float*, kQueries> out;
    for (int q = 0; q < kQueries; ++q) out[q] = acc[q] + d;
    return out;
  };
  int64_t d = 0;
  for (; d + 64 <= head_dim; d += 64) accumulate_slice<4, kQueries>(p, values, d, a, b, at(d).data());
  for (; d + 16 <= head_dim; d += 16) accumulate_slice<1, kQueries>(p, values, d, a, b, at(d).data());
  for (; d < head_dim; d += 8) {
    for (int q = 0; q < kQueries; ++q) {
      v8 sum = load8(acc[q] + d);
      for (int64_t t = a; t < b; ++t) sum += (v8{} + p[q][t]) * load8(values[t] + d);
      store8(acc[q] + d, sum);
    }
  }
}

template <typename E>
inline void accumulate(const float* p, const E* const* values, int64_t a, int64_t b, int64_t head_dim, float* acc) {
  accumulate_head<1>(&p, values, a, b, head_dim, &acc);
}

template <typename E>
inline void accumulate2(const float* p0, const float* p1, const E* const* values, int64_t a, int64_t b,
                        int64_t head_dim, float* acc0, float* acc1) {
  const float* p[2] = {p0, p1};
  float* acc[2] = {acc0, acc1};
  accumulate_head<2>(p, values, a, b, head_dim, acc);
}

template <typename E>
inline void accumulate4(const float* const* p, const E* const* values, int64_t a, int64_t b, int64_t head_dim,
                        float* const* acc) {
  accumulate_head<4>(p, values, a, b, head_dim, acc);
}

constexpr bool kPairQueries = true;

#else  // eight lanes (AVX2, or whatever the compiler makes of them)

// scores[t] = q . keys[t] for the 8 keys from `keys` (missing ones point at `zero`), head_dim a multiple of 8.
template <typename E>
inline void score8(const float* q, const E* const* keys, int64_t head_dim, float* scores) {
  v8 acc[8] = {};
  for (int64_t d = 0; d < head_dim; d += 8) {
    const v8 qd = load8(q + d);
    for (int t = 0; t < 8; ++t) acc[t] += qd * load8(keys[t] + d);
  }
  store8(scores, transpose_sum(acc));
}

// Never called: pairs of queries need the wide build's registers (16 sums and the loads spill on 16).
template <typename E>
inline void score8x2(const float*, const float*, const E* const*, int64_t, float*, float*) {}
template <typename E>
inline void accumulate2(const float*, const float*, const E* const*, int64_t, int64_t, int64_t, float*, float*) {}
template <typename E>
inline void score8x4(const float* const*, const E* const*, int64_t, float* const*) {}
template <typename E>
inline void accumulate4(const float* const*, const E* const*, int64_t, int64_t, int64_t, float* const*) {}
constexpr bool kPairQueries = false;

// acc[0, 8 kWidth) += p[t] * values[t][0, 8 kWidth) for t in [a, b), in that order; the sums stay in registers
// (a width known at compile time) between a load and a store of acc.
template <int kWidth, typename E>
inline void accumulate_slice(const float* p, const E* const* values, int64_t offset, int64_t a, int64_t b,
                             float* acc) {
  v8 sum[kWidth];
  for (int i = 0; i < kWidth; ++i) sum[i] = load8(acc + 8 * i);
  for (int64_t t = a; t < b; ++t) {
    const v8 w = v8{} + p[t];
    for (int i = 0; i < kWidth; ++i) sum[i] += w * load8(values[t] + offset + 8 * i);
  }
  for (int i = 0; i < kWidth; ++i) store8(acc + 8 * i, sum[i]);
}

// The same over the whole head: 64 lanes at a time (eight registers of sums), then what is left, 8 at a time.
template <typename E>
inline void accumulate(const float* p, const E* const* values, int64_t a, int64_t b, int64_t head_dim, float* acc) {
  int64_t d = 0;
  for (; d + 64 <= head_dim; d += 64) accumulate_slice<8>(p, values, d, a, b, acc + d);
  for (; d < head_dim; d += 8) accumulate_slice<1>(p, values, d, a, b, acc + d);
}

#endif  // ORCINUS_ATTENTION_WIDE

// Values are read a tile of keys at a time, which stays in L1 while every query of the task adds it in (each query
// re-reading its whole context's values ran at L2's bandwidth). A query's sums are the same whatever the tiling: each
// lane adds its keys in order, and a tile's end only stores and reloads them.
constexpr int64_t kValueTile = 64;
// Elements of a cache row in one 64-byte line: a prefetch each.
template <typename C>
constexpr int64_t kLine = 64 / sizeof(Stored<C>);

// Some consecutive queries of one request against one KV head: query j of the task is row row0 + (q0 + j) / G's
// query head head * G + (q0 + j) % G (so a task may start or end inside a row's G queries).
struct Task {
  int64_t row0, head, q0, num_queries;
};

// The first of a row's `len` keys that it sees: its last `window` (0: all of them).
inline int64_t window_start(int64_t len, int64_t window) { return window > 0 ? std::max<int64_t>(0, len - window) : 0; }

// One thread's buffers, reused task after task.
template <typename C>
struct Scratch {
  std::vector<float> query, scores, totals, sums;
  std::vector<Stored<C>> zero;
  std::vector<int64_t> row_of, first_key, last_key;  // per query: its row, and its keys [first, last) of the task's
  Rows<C> rows;
};

// One call's inputs (see paged_decode_attention below) and what a task does with them: queries and output of
// dtype T, a cache of dtype C.
template <typename T, typename C>
struct Attention {
  const T* q;
  int64_t q_stride_r, q_stride_h;
  const C* cache;
  const int32_t *tables, *row_requests, *lens;
  int64_t table_stride;
  T* out;
  int64_t num_kv_heads, group, num_blocks, block_size, head_dim;
  float scale;
  int64_t window;
  float softcap;

  void run(const Task& task, Scratch<C>& w) const {
    const int64_t head_stride = num_blocks * block_size * head_dim;  // one KV head's keys (or values)
    const int64_t request = row_requests ? row_requests[task.row0] : task.row0;
    const int64_t n = task.num_queries;
    w.row_of.resize(n);
    w.first_key.resize(n);
    w.last_key.resize(n);
    // Keys [first, last) cover every query's.
    int64_t first = std::numeric_limits<int64_t>::max(), last = 0;
    for (int64_t j = 0; j < n; ++j) {
      w.row_of[j] = task.row0 + (task.q0 + j) / group;
      first = std::min(first, window_start(lens[w.row_of[j]], window));
      last = std::max<int64_t>(last, lens[w.row_of[j]]);
    }
    first = std::min(first, last);
    const int64_t span = last - first;
    for (int64_t j = 0; j < n; ++j) {
      w.first_key[j] = window_start(lens[w.row_of[j]], window) - first;
      w.last_key[j] = lens[w.row_of[j]] - first;
    }
    const C* keys = cache + task.head * head_stride;
    w.rows.read(keys, keys + num_kv_heads * head_stride, tables + request * table_stride, block_size, first, last,
                head_dim);
    w.query.resize(n * head_dim);
    for (int64_t j = 0; j < n; ++j) {
      float* qj = w.query.data() + j * head_dim;
      to_float(q + w.row_of[j] * q_stride_r + head_of(task, j) * q_stride_h, qj, head_dim);
      for (int64_t d = 0; d < head_dim; ++d) qj[d] *= scale;
    }
    const int64_t stride = (span + 7) / 8 * 8;
    w.scores.resize(n * stride);
    score(w, n, span, stride);
    softmax(w, n, stride);
    // The values, a tile of keys at a time, into every query's sums.
    w.sums.assign(n * head_dim, 0.f);
    for (int64_t t0 = 0; t0 < span; t0 += kValueTile) {
      for (int64_t t = t0 + kValueTile; t < std::min(t0 + 2 * kValueTile, span); ++t) {
        for (int64_t d = 0; d < head_dim; d += kLine<C>) __builtin_prefetch(w.rows.values[t] + d);
      }
      for (int64_t j = 0; j < n;) {
        const int64_t a = std::max(t0, w.first_key[j]), b = std::min(t0 + kValueTile, w.last_key[j]);
        float* sums = &w.sums[j * head_dim];
        const float* p = &w.scores[j * stride];
        if (kPairQueries && j + 3 < n && same_keys(w, j, 4) && a < b) {
          // Four queries over the same keys (one row's query heads of a KV head): each value widened once for all.
          const float* ps[4] = {p, p + stride, p + 2 * stride, p + 3 * stride};
          float* accs[4] = {sums, sums + head_dim, sums + 2 * head_dim, sums + 3 * head_dim};
          accumulate4(ps, w.rows.values.data(), a, b, head_dim, accs);
          j += 4;
          continue;
        }
        if (kPairQueries && j + 1 < n && std::max(t0, w.first_key[j + 1]) == a) {
          // Two queries from their common first key to the first's or the second's last; then the longer one alone.
          const int64_t b1 = std::min(t0 + kValueTile, w.last_key[j + 1]), common = std::min(b, b1);
          const auto* values = w.rows.values.data();
          if (a < common) accumulate2(p, p + stride, values, a, common, head_dim, sums, sums + head_dim);
          if (common < b) accumulate(p, values, std::max(a, common), b, head_dim, sums);
          if (common < b1) accumulate(p + stride, values, std::max(a, common), b1, head_dim, sums + head_dim);
          j += 2;
          continue;
        }
        if (a < b) accumulate(p, w.rows.values.data(), a, b, head_dim, sums);
        ++j;
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      const float inv = w.totals[j] > 0.f ? 1.f / w.totals[j] : 0.f;
      T* o = out + w.row_of[j] * num_kv_heads * group * head_dim + head_of(task, j) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<T>(w.sums[j * head_dim + d] * inv);
    }
  }

  int64_t head_of(const Task& task, int64_t j) const { return task.head * group + (task.q0 + j) % group; }

  // Whether queries j .. j + count - 1 of the task see the same keys.
  static bool same_keys(const Scratch<C>& w, int64_t j, int64_t count) {
    for (int64_t i = j + 1; i < j + count; ++i) {
      if (w.first_key[i] != w.first_key[j] || w.last_key[i] != w.last_key[j]) return false;
    }
    return true;
  }

  // Scores, eight keys at a time, each query only where it has keys (a later row sees more of them).
  void score(Scratch<C>& w, int64_t n, int64_t span, int64_t stride) const {
    w.zero.resize(head_dim);  // zeros, never written
    const Stored<C>* eight[8];
    // A block of keys is a page of its own, where the hardware's prefetcher stops: fetch keys two eights ahead, for a
    // layer whose cache comes from memory, not the last-level cache, and their values with them, which the value
    // pass then finds in L2. Into L2, not L1: fetched into L1 the misses of a 256-wide head waited on each other
    // (docs/performance.md, Kernels).
    const auto fetch = [&](int64_t t) {
      for (int64_t d = 0; d < head_dim; d += kLine<C>) {
        __builtin_prefetch(w.rows.keys[t] + d, 0, 2);
        __builtin_prefetch(w.rows.values[t] + d, 0, 2);
      }
    };
    for (int64_t t = 0; t < std::min<int64_t>(16, span); ++t) fetch(t);
    for (int64_t t0 = 0; t0 < span; t0 += 8) {
      for (int t = 0; t < 8; ++t) eight[t] = t0 + t < span ? w.rows.keys[t0 + t] : w.zero.data();
      for (int64_t t = t0 + 16; t < std::min(t0 + 24, span); ++t) fetch(t);
      const auto wants = [&](int64_t j) { return t0 < w.last_key[j] && t0 + 8 > w.first_key[j]; };
      for (int64_t j = 0; j < n;) {
        if (kPairQueries && j + 3 < n && wants(j) && wants(j + 1) && wants(j + 2) && wants(j + 3)) {
          const float* qs[4];
          float* out[4];
          for (int i = 0; i < 4; ++i) {
            qs[i] = w.query.data() + (j + i) * head_dim;
            out[i] = w.scores.data() + (j + i) * stride + t0;
          }
          score8x4(qs, eight, head_dim, out);
          j += 4;
          continue;
        }
        if (kPairQueries && j + 1 < n && wants(j) && wants(j + 1)) {
          score8x2(w.query.data() + j * head_dim, w.query.data() + (j + 1) * head_dim, eight, head_dim,
                   w.scores.data() + j * stride + t0, w.scores.data() + (j + 1) * stride + t0);
          j += 2;
          continue;
        }
        if (wants(j)) score8(w.query.data() + j * head_dim, eight, head_dim, w.scores.data() + j * stride + t0);
        ++j;
      }
    }
  }

  // Each query's softmax over its own keys: its scores become weights, its sum is kept for the end.
  void softmax(Scratch<C>& w, int64_t n, int64_t stride) const {
    w.totals.resize(n);
    for (int64_t j = 0; j < n; ++j) {
      float* s = w.scores.data() + j * stride + w.first_key[j];
      const int64_t len = w.last_key[j] - w.first_key[j];
      if (softcap > 0.f) {
        for (int64_t t = 0; t < len; ++t) s[t] = softcap * std::tanh(s[t] / softcap);
      }
      float best = std::numeric_limits<float>::lowest();  // finite: built with -ffast-math
      for (int64_t t = 0; t < len; ++t) best = std::max(best, s[t]);
      for (int64_t t = 0; t < len; ++t) s[t] = std::exp(s[t] - best);
      // The sum in a fixed order from this query's first key: 8 lanes, then the lanes' sums, then the tail.
      v8 lanes = {};
      int64_t t = 0;
      for (; t + 8 <= len; t += 8) lanes += load8(s + t);
      float total =
          ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
      for (; t < len; ++t) total += s[t];
      w.totals[j] = total;
    }
  }
};

// Most queries in one task: its scores and sums stay small enough for the caches.
constexpr int64_t kMaxTaskQueries = 48;
// Below this much work (queries x keys) a call runs on one thread: waking another costs more than it saves.
constexpr int64_t kMinParallelWork = 512;

// The call's queries, in order of (request, KV head, row, query head), cut at rows into one chunk of about equal
// work (queries x keys) a thread; each chunk's queries cut into tasks at a request's or KV head's end, of at most
// kMaxTaskQueries. A lone request's 9 rows (8 drafts) over 3 KV heads go 13 / 14 rows-heads to two threads, each
// reading a head's keys once for all the rows it takes of it (pieces of 4 and 5 rows a head went 12 / 15).
std::vector<std::vector<Task>> make_chunks(const int32_t* row_requests, const int32_t* lens, int64_t num_rows,
                                           int64_t num_kv_heads, int64_t group, int64_t window) {
  struct Run {
    int64_t row0, num_rows, keys;  // keys: one query's, the run's longest (a window caps it)
  };
  std::vector<Run> runs;
  int64_t work = 0;
  for (int64_t start = 0; start < num_rows;) {
    int64_t stop = start + 1;
    while (row_requests && stop < num_rows && row_requests[stop] == row_requests[start]) ++stop;
    int64_t keys = 0;
    for (int64_t r = start; r < stop; ++r) {
      keys = std::max<int64_t>(keys, lens[r] - window_start(lens[r], window));
    }
    keys += 8;  // a query's fixed cost, in keys
    runs.push_back({start, stop - start, keys});
    work += (stop - start) * group * num_kv_heads * keys;
    start = stop;
  }
  const int64_t threads = work < kMinParallelWork ? 1 : std::max<int64_t>(1, at::get_num_threads());
  std::vector<std::vector<Task>> chunks(threads);
  int64_t done = 0;  // work before the current piece
  for (const Run& run : runs) {
    const int64_t queries = run.num_rows * group;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      for (int64_t j = 0; j < queries;) {
        const int64_t c = std::min(threads - 1, done * threads / work);
        const int64_t chunk_end = (c + 1) * work / threads;  // this chunk's work ends here
        // Whole rows: a thread that takes part of a row's queries reads all its keys for them, and a lone decode is
        // bound by reading its keys (its KV heads go out whole, 2 / 1 over two threads).
        const int64_t rows_fit = std::max<int64_t>(1, (chunk_end - done + run.keys * group / 2) / (run.keys * group));
        const int64_t n = c == threads - 1 ? queries - j : std::min(queries - j, group * rows_fit);
        // Pieces of at most kMaxTaskQueries, equal-sized.
        const int64_t pieces = (n + kMaxTaskQueries - 1) / kMaxTaskQueries;
        for (int64_t p = 0; p < pieces; ++p) {
          const int64_t a = j + n * p / pieces, b = j + n * (p + 1) / pieces;
          chunks[c].push_back({run.row0 + a / group, h, a % group, b - a});
        }
        j += n;
        done += n * run.keys;
      }
    }
  }
  return chunks;
}

}  // namespace

// q [R, Hq, D] (rows may be strided, the last dim contiguous; D a multiple of 8); kv_cache as above; block_tables
// [B, >= blocks needed] int32 (rows may be strided); row_requests [R] int32: each row's table (None: row r reads
// table r); context_lens [R] int32: keys each row sees; window 0 and softcap 0 turn those off. kv_cache is of q's dtype,
// or bfloat16 / float16 under float32 queries.
// Returns [R, Hq, D] in q's dtype.
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor kv_cache, at::Tensor block_tables,
                                  std::optional<at::Tensor> row_requests, at::Tensor context_lens, double scale,
                                  int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [R, Hq, D] with a contiguous last dimension");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous(), "kv_cache must be a contiguous 5-d tensor");
  const bool narrow_cache = kv_cache.scalar_type() == at::kBFloat16 || kv_cache.scalar_type() == at::kHalf;
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type() || (q.scalar_type() == at::kFloat && narrow_cache),
              "kv_cache must be of q's dtype, or bfloat16 or float16 under float32 queries");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1, "block_tables: int32 rows");
  TORCH_CHECK(context_lens.scalar_type() == at::kInt && context_lens.is_contiguous(), "context_lens: int32");
  const int64_t num_rows = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = kv_cache.size(1), num_blocks = kv_cache.size(2), block_size = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == head_dim && num_heads % num_kv_heads == 0, "head shapes disagree");
  TORCH_CHECK(head_dim % 8 == 0, "head_dim must be a multiple of 8");
  TORCH_CHECK(context_lens.numel() == num_rows, "context_lens: one per query row");
  const int32_t* requests = nullptr;
  if (row_requests) {
    TORCH_CHECK(row_requests->scalar_type() == at::kInt && row_requests->is_contiguous() &&
                row_requests->numel() == num_rows, "row_requests: int32, one per query row");
    requests = row_requests->data_ptr<int32_t>();
  }
  const int64_t group = num_heads / num_kv_heads;
  const auto chunks = make_chunks(requests, context_lens.data_ptr<int32_t>(), num_rows, num_kv_heads, group, window);
  auto out = at::empty({num_rows, num_heads, head_dim}, q.options());
  const auto attend = [&](auto* query_type, auto* cache_type) {
    using T = std::remove_pointer_t<decltype(query_type)>;
    using C = std::remove_pointer_t<decltype(cache_type)>;
    const Attention<T, C> call{q.data_ptr<T>(), q.stride(0), q.stride(1), kv_cache.data_ptr<C>(),
                               block_tables.data_ptr<int32_t>(), requests, context_lens.data_ptr<int32_t>(),
                               block_tables.stride(0), out.data_ptr<T>(), num_kv_heads, group, num_blocks,
                               block_size, head_dim, static_cast<float>(scale), window, static_cast<float>(softcap)};
    at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t begin, int64_t end) {
      Scratch<C> scratch;
      for (int64_t c = begin; c < end; ++c) {
        for (const Task& task : chunks[c]) call.run(task, scratch);
      }
    });
  };
  if (kv_cache.scalar_type() == at::kBFloat16 && q.scalar_type() == at::kFloat) {
    attend(static_cast<float*>(nullptr), static_cast<at::BFloat16*>(nullptr));
  } else if (kv_cache.scalar_type() == at::kHalf && q.scalar_type() == at::kFloat) {
    attend(static_cast<float*>(nullptr), static_cast<at::Half*>(nullptr));
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
      attend(static_cast<scalar_t*>(nullptr), static_cast<scalar_t*>(nullptr));
    });
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged attention of query rows (CPU)");
}
