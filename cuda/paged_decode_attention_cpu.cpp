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
// Arithmetic is float32 whatever the cache's dtype, as SDPA's CPU kernel does. A sliding window reads only the
// last `window` keys (the blocks before them may already hold another request's tokens); a soft cap turns each
// score s into cap * tanh(s / cap) (Gemma 2).

// Only the headers used, not <torch/extension.h> (all of torch's C++ API): each build takes half the time.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

typedef float v8 __attribute__((vector_size(32)));  // 8 lanes: two SSE registers, one AVX2 one, half an AVX-512 one
typedef int32_t v8i __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
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

// One task's keys and values as float32 rows: pointers into the cache when it is float32, else converted copies.
template <typename T>
struct Rows {
  std::vector<const float*> keys, values;
  std::vector<float> buffer;

  void read(const T* cache_keys, const T* cache_values, const int32_t* table, int64_t block_size, int64_t first,
            int64_t end, int64_t head_dim) {
    const int64_t n = end - first;
    keys.resize(n);
    values.resize(n);
    if constexpr (!std::is_same_v<T, float>) buffer.resize(2 * n * head_dim);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t p = first + t;
      const int64_t slot = static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size;
      if constexpr (std::is_same_v<T, float>) {
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

// scores[t] = q . keys[t] for the 8 keys from `keys` (missing ones point at `zero`), head_dim a multiple of 8.
inline void score8(const float* q, const float* const* keys, int64_t head_dim, float* scores) {
  v8 acc[8] = {};
  for (int64_t d = 0; d < head_dim; d += 8) {
    const v8 qd = load8(q + d);
    for (int t = 0; t < 8; ++t) acc[t] += qd * load8(keys[t] + d);
  }
  store8(scores, transpose_sum(acc));
}

// acc[0, 8 kWidth) += p[t] * values[t][0, 8 kWidth) for t in [a, b), in that order; the sums stay in registers
// (a width known at compile time) between a load and a store of acc.
template <int kWidth>
inline void accumulate_slice(const float* p, const float* const* values, int64_t offset, int64_t a, int64_t b,
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
inline void accumulate(const float* p, const float* const* values, int64_t a, int64_t b, int64_t head_dim,
                       float* acc) {
  int64_t d = 0;
  for (; d + 64 <= head_dim; d += 64) accumulate_slice<8>(p, values, d, a, b, acc + d);
  for (; d < head_dim; d += 8) accumulate_slice<1>(p, values, d, a, b, acc + d);
}

// Values are read a tile of keys at a time, which stays in L1 while every query of the task adds it in (each query
// re-reading its whole context's values ran at L2's bandwidth). A query's sums are the same whatever the tiling: each
// lane adds its keys in order, and a tile's end only stores and reloads them.
constexpr int64_t kValueTile = 64;

// A run of `num_rows` rows of one request (rows row0..), against one KV head.
struct Task {
  int64_t row0, num_rows, head;
};

template <typename T>
void attend(const T* q, int64_t q_stride_r, int64_t q_stride_h, const T* cache, const int32_t* tables,
            int64_t table_stride, const int32_t* row_requests, const int32_t* lens, T* out,
            const std::vector<Task>& tasks, int64_t num_kv_heads, int64_t group, int64_t num_blocks,
            int64_t block_size, int64_t head_dim, float scale, int64_t window, float softcap) {
  const int64_t head_stride = num_blocks * block_size * head_dim;  // one KV head's slice of keys (or values)
  const int64_t values_offset = num_kv_heads * head_stride;
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query, scores, totals, sums, zero(head_dim, 0.f);
    Rows<T> rows;
    for (int64_t i = begin; i < end; ++i) {
      const Task& task = tasks[i];
      const int64_t request = row_requests ? row_requests[task.row0] : task.row0;
      // A row with `len` keys sees [window_start(len), len); keys [first, last) cover every row's.
      auto window_start = [&](int64_t len) { return window > 0 ? std::max<int64_t>(0, len - window) : int64_t{0}; };
      int64_t first = std::numeric_limits<int64_t>::max(), last = 0;
      for (int64_t r = task.row0; r < task.row0 + task.num_rows; ++r) {
        first = std::min(first, window_start(lens[r]));
        last = std::max<int64_t>(last, lens[r]);
      }
      first = std::min(first, last);
      const int64_t span = last - first;
      // Row r's keys, [row_first, row_last), counted from `first`.
      auto row_keys = [&](int64_t r) {
        const int64_t len = lens[task.row0 + r];
        return std::pair<int64_t, int64_t>{window_start(len) - first, len - first};
      };
      const T* keys = cache + task.head * head_stride;
      rows.read(keys, keys + values_offset, tables + request * table_stride, block_size, first, last, head_dim);
      const int64_t num_queries = task.num_rows * group;
      query.resize(num_queries * head_dim);
      const int64_t stride = (span + 7) / 8 * 8;
      scores.resize(num_queries * stride);
      for (int64_t r = 0; r < task.num_rows; ++r) {
        for (int64_t g = 0; g < group; ++g) {
          float* qg = query.data() + (r * group + g) * head_dim;
          to_float(q + (task.row0 + r) * q_stride_r + (task.head * group + g) * q_stride_h, qg, head_dim);
          for (int64_t d = 0; d < head_dim; ++d) qg[d] *= scale;
        }
      }
      // Scores, eight keys at a time, each row only where it has keys (a later row sees more of them).
      const float* eight[8];
      for (int64_t t0 = 0; t0 < span; t0 += 8) {
        for (int t = 0; t < 8; ++t) eight[t] = t0 + t < span ? rows.keys[t0 + t] : zero.data();
        for (int64_t r = 0; r < task.num_rows; ++r) {
          const auto [row_first, row_last] = row_keys(r);
          if (t0 >= row_last || t0 + 8 <= row_first) continue;
          for (int64_t g = 0; g < group; ++g) {
            const int64_t j = r * group + g;
            score8(query.data() + j * head_dim, eight, head_dim, scores.data() + j * stride + t0);
          }
        }
      }
      // Each query's softmax over its own keys: its scores become weights, its sum is kept for the end.
      totals.resize(num_queries);
      for (int64_t r = 0; r < task.num_rows; ++r) {
        const auto [row_first, row_last] = row_keys(r);
        for (int64_t g = 0; g < group; ++g) {
          const int64_t j = r * group + g;
          float* s = scores.data() + j * stride + row_first;
          const int64_t n = row_last - row_first;
          if (softcap > 0.f) {
            for (int64_t t = 0; t < n; ++t) s[t] = softcap * std::tanh(s[t] / softcap);
          }
          float best = std::numeric_limits<float>::lowest();  // finite: built with -ffast-math
          for (int64_t t = 0; t < n; ++t) best = std::max(best, s[t]);
          for (int64_t t = 0; t < n; ++t) s[t] = std::exp(s[t] - best);
          // The sum in a fixed order from this query's first key: 8 lanes, then the lanes' sums, then the tail.
          v8 lanes = {};
          int64_t t = 0;
          for (; t + 8 <= n; t += 8) lanes += load8(s + t);
          float total =
              ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
          for (; t < n; ++t) total += s[t];
          totals[j] = total;
        }
      }
      // The values, a tile of keys at a time, into every query's sums.
      sums.assign(num_queries * head_dim, 0.f);
      for (int64_t t0 = 0; t0 < span; t0 += kValueTile) {
        for (int64_t r = 0; r < task.num_rows; ++r) {
          const auto [row_first, row_last] = row_keys(r);
          const int64_t a = std::max(t0, row_first), b = std::min(t0 + kValueTile, row_last);
          if (a >= b) continue;
          for (int64_t g = 0; g < group; ++g) {
            const int64_t j = r * group + g;
            accumulate(scores.data() + j * stride, rows.values.data(), a, b, head_dim, sums.data() + j * head_dim);
          }
        }
      }
      for (int64_t r = 0; r < task.num_rows; ++r) {
        for (int64_t g = 0; g < group; ++g) {
          const int64_t j = r * group + g;
          const float inv = totals[j] > 0.f ? 1.f / totals[j] : 0.f;
          T* o = out + (task.row0 + r) * num_kv_heads * group * head_dim + (task.head * group + g) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<T>(sums[j * head_dim + d] * inv);
        }
      }
    }
  });
}

// Runs of neighbouring rows with the same request, cut into equal pieces small enough that the tasks (pieces x KV
// heads) keep every thread busy: a lone request verifying 8 drafts still spreads over the cores.
std::vector<Task> make_tasks(const int32_t* row_requests, int64_t num_rows, int64_t num_kv_heads) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t cap = std::clamp<int64_t>(num_rows * num_kv_heads / (2 * threads), 1, 16);
  std::vector<Task> tasks;
  for (int64_t start = 0; start < num_rows;) {
    int64_t stop = start + 1;
    while (row_requests && stop < num_rows && row_requests[stop] == row_requests[start]) ++stop;
    const int64_t pieces = (stop - start + cap - 1) / cap;
    for (int64_t p = 0; p < pieces; ++p) {
      const int64_t a = start + (stop - start) * p / pieces, b = start + (stop - start) * (p + 1) / pieces;
      for (int64_t h = 0; h < num_kv_heads; ++h) tasks.push_back({a, b - a, h});
    }
    start = stop;
  }
  return tasks;
}

}  // namespace

// q [R, Hq, D] (rows may be strided, the last dim contiguous; D a multiple of 8); kv_cache as above; block_tables
// [B, >= blocks needed] int32 (rows may be strided); row_requests [R] int32: each row's table (None: row r reads
// table r); context_lens [R] int32: keys each row sees; window 0 and softcap 0 turn those off.
// Returns [R, Hq, D] in q's dtype.
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor kv_cache, at::Tensor block_tables,
                                  std::optional<at::Tensor> row_requests, at::Tensor context_lens, double scale,
                                  int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [R, Hq, D] with a contiguous last dimension");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous(), "kv_cache must be a contiguous 5-d tensor");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "q and kv_cache must share a dtype");
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
  const std::vector<Task> tasks = make_tasks(requests, num_rows, num_kv_heads);
  auto out = at::empty({num_rows, num_heads, head_dim}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    attend<scalar_t>(q.data_ptr<scalar_t>(), q.stride(0), q.stride(1), kv_cache.data_ptr<scalar_t>(),
                     block_tables.data_ptr<int32_t>(), block_tables.stride(0), requests,
                     context_lens.data_ptr<int32_t>(), out.data_ptr<scalar_t>(), tasks, num_kv_heads,
                     num_heads / num_kv_heads, num_blocks, block_size, head_dim, static_cast<float>(scale), window,
                     static_cast<float>(softcap));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged attention of query rows (CPU)");
}
