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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("exponential_race", &exponential_race, "per row, argmax p_i / -log U_i with U_i from the row's key (CPU)");
  m.def("exp_sums", &exp_sums, "per row, the sum of exp(x - shift) (CPU)");
}
