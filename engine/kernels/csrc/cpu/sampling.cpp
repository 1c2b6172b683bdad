// The exponential race on the CPU: per row, the token i with the largest p_i / E_i, E_i = -log U_i ~ Exp(1), which
// is drawn with probability p_i / sum(p) (torch.multinomial's own algorithm for one sample). engine/model/sampling/draw.py
// holds the same race in torch ops (the reference, and the GPU's); both make U_i from the row's 64-bit key and i alone
// (SplitMix64 of key + (i + 1) * gamma), so a row's draw depends on nothing else in the batch.
//
// Why an op: over a large vocabulary, torch.rand, a log and a division per token are a large share of a step of
// sampled rows (docs/performance.md, Sampler). Here most tokens are settled without a log: -log u >= 1 - u, so
// p_i / E_i <= p_i / (1 - u_i), and a token whose bound does not beat the best score so far cannot win.

// Only the headers used, not <torch/extension.h>: a build parses a fraction of the headers.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ull;
constexpr int64_t kChunk = 64;  // tokens whose bounds are tested together (a vector loop) before any is looked at
constexpr float kTwo24 = 16777216.0f;
// The bound is tested with a margin: in float, -log u for u within an ulp or two of 1 can round to 1 - u, and such a
// token is then scored exactly rather than skipped.
constexpr float kMargin = 1.0f + 1e-5f;

// The i-th uniform of a row as the odd integer m in [1, 2^24): u = m / 2^24 (23 random bits, never 0 or 1, and both u
// and 1 - u exact in float).
inline uint32_t odd_uniform(uint64_t key, int64_t i) {
  uint64_t z = key + static_cast<uint64_t>(i + 1) * kGamma;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<uint32_t>(z >> 41) * 2u + 1u;
}

int64_t race_row(const float* p, int64_t vocab, uint64_t key) {
  float best = 0.0f;  // the best score p_i / E_i so far
  int64_t token = 0;  // a row without mass (the caller gives none) would take token 0, as torch's max would
  for (int64_t begin = 0; begin < vocab; begin += kChunk) {
    const int64_t end = std::min(vocab, begin + kChunk);
    // A chunk without mass (top-k, top-p and min-p leave most of a large vocabulary at 0) cannot win: its hashes
    // are skipped. A zero never passes the test below either, so no draw changes.
    float most = 0.0f;
    for (int64_t i = begin; i < end; ++i) most = std::max(most, p[i]);
    if (!(most > 0.0f)) continue;
    const float threshold = best * kMargin;
    int any = 0;  // does any token of the chunk have a bound above the best? (p_i 2^24 > best (2^24 - m_i))
    for (int64_t i = begin; i < end; ++i) {
      const float rest = static_cast<float>(16777216u - odd_uniform(key, i));
      any |= p[i] * kTwo24 > threshold * rest;
    }
    if (!any) continue;
    for (int64_t i = begin; i < end; ++i) {
      const uint32_t m = odd_uniform(key, i);
      if (!(p[i] * kTwo24 > best * kMargin * static_cast<float>(16777216u - m))) continue;
      const float score = p[i] / -std::log(static_cast<float>(m) / kTwo24);
      if (score > best) {
        best = score;
        token = i;
      }
    }
  }
  return token;
}

// probs [R, V] float32 (non-negative, finite), keys [R] int64 -> tokens [R] int64.
at::Tensor exponential_race(const at::Tensor& probs, const at::Tensor& keys) {
  TORCH_CHECK(probs.device().is_cpu() && probs.scalar_type() == at::kFloat && probs.dim() == 2 && probs.is_contiguous(),
              "probs: a contiguous float32 [R, V] CPU tensor");
  TORCH_CHECK(keys.device().is_cpu() && keys.scalar_type() == at::kLong && keys.dim() == 1 &&
              keys.size(0) == probs.size(0) && keys.is_contiguous(), "keys: a contiguous int64 [R] CPU tensor");
  const int64_t rows = probs.size(0), vocab = probs.size(1);
  at::Tensor tokens = at::empty({rows}, keys.options());
  const float* p = probs.data_ptr<float>();
  const int64_t* k = keys.data_ptr<int64_t>();
  int64_t* out = tokens.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out[r] = race_row(p + r * vocab, vocab, static_cast<uint64_t>(k[r]));
  });
  return tokens;
}

// rows [R, V] float32, shift [R] float32 -> [R] float32: each row's sum of exp(x - shift), in one read of the row and
// no temporary (top-p's normalizer over a whole row whose candidates alone were sorted).
at::Tensor exp_sums(const at::Tensor& rows, const at::Tensor& shift) {
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == at::kFloat && rows.dim() == 2 && rows.is_contiguous(),
              "rows: a contiguous float32 [R, V] CPU tensor");
  TORCH_CHECK(shift.device().is_cpu() && shift.scalar_type() == at::kFloat && shift.dim() == 1 &&
              shift.size(0) == rows.size(0) && shift.is_contiguous(), "shift: a contiguous float32 [R] CPU tensor");
  const int64_t n = rows.size(0), vocab = rows.size(1);
  at::Tensor out = at::empty({n}, shift.options());
  const float* x = rows.data_ptr<float>();
  const float* s = shift.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * vocab;
      const float m = s[r];
      double sum = 0.0;  // a float32 running sum over a whole vocabulary would lose its last bits
      for (int64_t i = 0; i < vocab; ++i) sum += std::exp(row[i] - m);
      o[r] = static_cast<float>(sum);
    }
  });
  return out;
}

// Greedy decoding's token: the first of a row's largest values, or its first NaN, as torch.max(dim=-1).indices picks
// (torch's kernel is several times slower over a large vocabulary: index bookkeeping in scalar code). NaNs are found
// by their bits: -ffast-math lets the compiler assume a float comparison never meets one.
inline bool is_nan(float v) { return (__builtin_bit_cast(uint32_t, v) & 0x7FFFFFFFu) > 0x7F800000u; }

int64_t first_nan(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (is_nan(x[i])) return i;
  }
  return -1;
}

#ifdef __AVX512F__
inline __mmask16 nan_lanes(__m512 v) {  // as signed integers, |bits| above +inf's are the NaNs
  const __m512i magnitude = _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7FFFFFFF));
  return _mm512_cmpgt_epi32_mask(magnitude, _mm512_set1_epi32(0x7F800000));
}
#endif

int64_t argmax_row(const float* x, int64_t n) {
  int64_t vec_end = 0, token = 0;
  float best = x[0];
#ifdef __AVX512F__
  if (n >= 16) {
    // Lane l holds the largest of x[l], x[l + 16], ... and the first index where it occurs (strictly greater values
    // replace it, so a tie keeps the earlier index); the row's token is then the smallest index among the lanes
    // holding the row's largest value.
    __m512 lane_best = _mm512_loadu_ps(x);
    __m512i lane_index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __mmask16 nan = nan_lanes(lane_best);
    __m512i index = lane_index;
    const __m512i step = _mm512_set1_epi32(16);
    vec_end = n / 16 * 16;
    for (int64_t i = 16; i < vec_end; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      index = _mm512_add_epi32(index, step);
      const __mmask16 greater = _mm512_cmp_ps_mask(v, lane_best, _CMP_GT_OQ);
      nan |= nan_lanes(v);
      lane_best = _mm512_mask_mov_ps(lane_best, greater, v);
      lane_index = _mm512_mask_mov_epi32(lane_index, greater, index);
    }
    if (nan) return first_nan(x, vec_end);
    best = _mm512_reduce_max_ps(lane_best);
    const __mmask16 at_best = _mm512_cmp_ps_mask(lane_best, _mm512_set1_ps(best), _CMP_EQ_OQ);
    token = _mm512_mask_reduce_min_epi32(at_best, lane_index);
  }
#endif
  if (vec_end == 0) {  // no vector part: the scalar loop from the first element
    if (is_nan(best)) return 0;
    vec_end = 1;
  }
  for (int64_t i = vec_end; i < n; ++i) {
    if (is_nan(x[i])) return i;
    if (x[i] > best) {
      best = x[i];
      token = i;
    }
  }
  return token;
}

// logits [R, V] float32, V > 0 -> [R] int64: each row's argmax as torch.max(dim=-1).indices gives it.
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
              logits.is_contiguous() && logits.size(1) > 0, "logits: a contiguous float32 [R, V] CPU tensor, V > 0");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  at::Tensor tokens = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* out = tokens.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out[r] = argmax_row(x + r * vocab, vocab);
  });
  return tokens;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("exponential_race", &exponential_race, "per row, argmax p_i / -log U_i with U_i from the row's key (CPU)");
  m.def("exp_sums", &exp_sums, "per row, the sum of exp(x - shift) (CPU)");
  m.def("argmax_rows", &argmax_rows, "per row, the first index of its largest value or of its first NaN (CPU)");
}
