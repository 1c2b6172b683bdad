// Matmul against a GGUF file's 4- and 8-bit blocks (Q4_0, Q4_1, Q8_0) with the activations rounded to 16-bit
// integers: y = x @ W^T, W [N, K], x [M, K] in float32 or bfloat16. For a few rows (decoding) it reads the weights
// once at a fraction of the float32 path's instructions (cuda/block_matmul_cpu.cpp decodes every weight to a float).
//
// Each row of x is quantized per 32 inputs (the weights' blocks), as llama.cpp's Q8 activations but with 16 bits:
// d = max|x| / 32767, q = round(x / d), an error of at most 2^-16 of the block's largest input (bfloat16's is 2^-9 of
// each). A block's dot product with the weights' codes is an integer sum, exact in int32 (AVX-512 VNNI's vpdpwssd, 32
// products an instruction), then scaled once in float32 by the weights' and the activations' scales. The weights are
// the file's codes and scales, unchanged; only their order in memory is (`pack`): a row's blocks go in groups of 16,
// laid out so that one int32 lane holds one block's sum, so a group's 16 sums need no shuffles.
//
// The order of every output's sum is fixed (lane j sums blocks j, j + 16, ... in order, then one fixed tree); it does
// not depend on M, on the row tile or on the thread count.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define ORCINUS_VNNI 1
#include <immintrin.h>
#endif

namespace {

constexpr int kBlock = 32;  // inputs per block, in the weights and in x
constexpr int kGroup = 16;  // blocks per group: one int32 lane each
constexpr float kMaxCode = 32767.f;  // x's codes are int16: |q| <= 32767

// What a block holds besides its codes: Q4_0 w = d (c - 8); Q4_1 w = d c + m; Q8_0 w = d c, c stored as c + 128.
struct Format {
  int code_bytes;  // per block
  bool mins;       // a float16 minimum m per block after the scales
  int offset;      // subtracted from every stored code
  constexpr int bytes() const { return code_bytes + 2 + (mins ? 2 : 0); }
};

Format format_of(int64_t type) {
  switch (type) {
    case 2: return {16, false, 8};    // Q4_0
    case 3: return {16, true, 0};     // Q4_1
    case 8: return {32, false, 0};    // Q8_0
    default: TORCH_CHECK(false, "no int16-activation matmul for ggml type ", type);
  }
}

// A block's 32 codes (0..15, or Q8_0's int8 bytes) from the file's block (scales first, then codes).
void codes_of(const uint8_t* block, int64_t type, uint8_t* c) {
  if (type == 8) {
    std::memcpy(c, block + 2, kBlock);  // int8 codes, kept as their bytes
    return;
  }
  const uint8_t* qs = block + (type == 3 ? 4 : 2);
  for (int e = 0; e < 16; ++e) {
    c[e] = qs[e] & 15;
    c[e + 16] = qs[e] >> 4;
  }
}

// A group of g blocks as packed: codes, then g float16 scales, then (Q4_1) g minimums. Codes: sixteen slices t of 2g
// bytes, slice t holding inputs 2t and 2t+1 of block j at bytes 2j and 2j+1; a 4-bit format stores slices 2u and
// 2u+1 in one (the low and the high nibbles).
void pack_group(const uint8_t* src, int64_t type, const Format& f, int g, uint8_t* dst) {
  uint8_t* scales = dst + g * f.code_bytes;
  for (int j = 0; j < g; ++j) {
    const uint8_t* block = src + j * f.bytes();
    uint8_t c[kBlock];
    codes_of(block, type, c);
    for (int e = 0; e < kBlock; ++e) {
      const int t = e / 2, b = e % 2;
      if (f.code_bytes == kBlock) dst[t * 2 * g + 2 * j + b] = c[e];
      else dst[(t / 2) * 2 * g + 2 * j + b] |= c[e] << (4 * (t % 2));
    }
    std::memcpy(scales + 2 * j, block, 2);
    if (f.mins) std::memcpy(scales + 2 * g + 2 * j, block + 2, 2);
  }
}

#ifdef ORCINUS_VNNI

// One row of x, quantized, for one group: sixteen 64-byte slices of codes (lanes past the group's blocks zero), then
// each block's scale d, its code sum s and d * s.
struct alignas(64) XGroup {
  int16_t q[16][32];
  float d[kGroup];
  int32_t s[kGroup];
  float ds[kGroup];
};

// x's row (K inputs, float32 or bfloat16) into `groups` (K / 512 rounded up).
template <typename T>
void quantize_row(const T* x, int64_t k, XGroup* groups) {
  const int64_t nb = k / kBlock;
  for (int64_t gi = 0; gi * kGroup < nb; ++gi) {
    XGroup& out = groups[gi];
    std::memset(&out, 0, sizeof(out));
    for (int j = 0; j < kGroup && gi * kGroup + j < nb; ++j) {
      const T* v = x + (gi * kGroup + j) * kBlock;
      float f[kBlock], amax = 0.f;
      for (int e = 0; e < kBlock; ++e) {
        f[e] = static_cast<float>(v[e]);
        amax = std::max(amax, std::fabs(f[e]));
      }
      const float d = amax / kMaxCode, id = amax > 0.f ? kMaxCode / amax : 0.f;
      int32_t s = 0;
      for (int e = 0; e < kBlock; ++e) {
        const int q = static_cast<int>(std::nearbyint(std::min(kMaxCode, std::max(-kMaxCode, f[e] * id))));
        out.q[e / 2][2 * j + e % 2] = static_cast<int16_t>(q);
        s += q;
      }
      out.d[j] = d;
      out.s[j] = s;
      out.ds[j] = d * static_cast<float>(s);
    }
  }
}

inline void store(float* p, float v) { *p = v; }
inline void store(at::BFloat16* p, float v) { *p = at::BFloat16(v); }  // round to nearest even

// out[r][n] for R rows of x (`xg`: each row's groups, `groups` apart) and NB outputs of one part, whose codes are
// widened to int16 in registers where they are used.
template <int R, int NB, int Type, typename T>
void tile(const XGroup* xg, int64_t groups, const uint8_t* w, int64_t row_bytes, int64_t nb, T* out, int64_t ldo) {
  constexpr Format f = Type == 8 ? Format{32, false, 0} : Type == 3 ? Format{16, true, 0} : Format{16, false, 8};
  const __m512i low = _mm512_set1_epi16(15);
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NB; ++n) acc[r][n] = _mm512_setzero_ps();
  for (int64_t gi = 0; gi < groups; ++gi) {
    const int g = static_cast<int>(std::min<int64_t>(kGroup, nb - gi * kGroup));
    const __mmask32 bytes = g == kGroup ? ~0u : (1u << (2 * g)) - 1;
    const __mmask16 lanes = static_cast<__mmask16>((1u << g) - 1);
    const int64_t at = gi * kGroup * f.bytes();
    for (int n = 0; n < NB; ++n) {
      const uint8_t* p = w + n * row_bytes + at;
      __m512i wv[16];
      if constexpr (f.code_bytes == kBlock) {
        for (int t = 0; t < 16; ++t) wv[t] = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(bytes, p + t * 2 * g));
      } else {
        for (int u = 0; u < 8; ++u) {
          const __m512i v = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(bytes, p + u * 2 * g));
          wv[2 * u] = _mm512_and_si512(v, low);
          wv[2 * u + 1] = _mm512_srli_epi16(v, 4);
        }
      }
      const uint8_t* scales = p + g * f.code_bytes;
      const __m512 dw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, scales));
      __m512 mw = _mm512_setzero_ps();
      if constexpr (f.mins) mw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, scales + 2 * g));
      for (int r = 0; r < R; ++r) {
        const XGroup& x = xg[r * groups + gi];
        // Integer sums are exact in any order: two chains hide the multiply-adds' latency.
        __m512i sum[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
        if constexpr (f.offset) sum[0] = _mm512_mullo_epi32(_mm512_load_si512(x.s), _mm512_set1_epi32(-f.offset));
        for (int t = 0; t < 16; ++t) sum[t % 2] = _mm512_dpwssd_epi32(sum[t % 2], wv[t], _mm512_load_si512(x.q[t]));
        const __m512 scale = _mm512_mul_ps(dw, _mm512_load_ps(x.d));
        acc[r][n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(sum[0], sum[1])), scale, acc[r][n]);
        if constexpr (f.mins) acc[r][n] = _mm512_fmadd_ps(mw, _mm512_load_ps(x.ds), acc[r][n]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NB; ++n) store(out + r * ldo + n, _mm512_reduce_add_ps(acc[r][n]));
}

constexpr int kTileRows = 4;
constexpr int kTileOutputs = 4;

template <int NB, int Type, typename T>
void tile_rows(int64_t rows, const XGroup* xg, int64_t groups, const uint8_t* w, int64_t row_bytes, int64_t nb, T* out,
               int64_t ldo) {
  switch (rows) {
    case 1: return tile<1, NB, Type>(xg, groups, w, row_bytes, nb, out, ldo);
    case 2: return tile<2, NB, Type>(xg, groups, w, row_bytes, nb, out, ldo);
    case 3: return tile<3, NB, Type>(xg, groups, w, row_bytes, nb, out, ldo);
    default: return tile<4, NB, Type>(xg, groups, w, row_bytes, nb, out, ldo);
  }
}

// kTileOutputs outputs (fewer at a part's end) of every row.
template <int Type, typename T>
void run_unit(const XGroup* xg, int64_t m, int64_t groups, const uint8_t* w, int64_t n, int64_t nb, int64_t n0, T* out,
              int64_t ldo) {
  const int64_t row_bytes = nb * format_of(Type).bytes();
  const int64_t cols = std::min<int64_t>(kTileOutputs, n - n0);
  const uint8_t* src = w + n0 * row_bytes;
  // A tile reads its outputs' rows side by side, which the prefetchers follow poorly: ask for the rows 16 ahead.
  if (n0 + 16 + kTileOutputs <= n)
    for (int64_t off = 0; off < kTileOutputs * row_bytes; off += 64) __builtin_prefetch(src + 16 * row_bytes + off);
  for (int64_t r0 = 0; r0 < m; r0 += kTileRows) {
    const int64_t rows = std::min<int64_t>(kTileRows, m - r0);
    const XGroup* x = xg + r0 * groups;
    T* o = out + r0 * ldo + n0;
    switch (cols) {
      case 1: tile_rows<1, Type>(rows, x, groups, src, row_bytes, nb, o, ldo); break;
      case 2: tile_rows<2, Type>(rows, x, groups, src, row_bytes, nb, o, ldo); break;
      case 3: tile_rows<3, Type>(rows, x, groups, src, row_bytes, nb, o, ldo); break;
      default: tile_rows<4, Type>(rows, x, groups, src, row_bytes, nb, o, ldo); break;
    }
  }
}

// Below this many multiply-adds a call runs on the calling thread: a parallel region costs a thread wake-up.
constexpr int64_t kParallelMacs = 1 << 16;

template <typename T, typename X>
void run_parts(const X* x, int64_t m, int64_t k, const std::vector<torch::Tensor>& parts,
               const std::vector<int64_t>& types, T* out, int64_t ldo) {
  const int64_t nb = k / kBlock, groups = (nb + kGroup - 1) / kGroup;
  std::vector<XGroup> xg(m * groups);
  at::parallel_for(0, m, std::max<int64_t>(1, kParallelMacs / (16 * k)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) quantize_row(x + r * k, k, xg.data() + r * groups);
  });
  std::vector<int64_t> first(parts.size() + 1, 0), col(parts.size(), 0);
  for (size_t i = 0; i < parts.size(); ++i) {
    first[i + 1] = first[i] + (parts[i].size(0) + kTileOutputs - 1) / kTileOutputs;
    if (i + 1 < parts.size()) col[i + 1] = col[i] + parts[i].size(0);
  }
  const int64_t units = first.back(), outputs = col.back() + parts.back().size(0);
  const int64_t grain = std::max<int64_t>(1, kParallelMacs * units / std::max<int64_t>(1, m * k * outputs));
  at::parallel_for(0, units, grain, [&](int64_t begin, int64_t end) {
    size_t i = std::upper_bound(first.begin(), first.end(), begin) - first.begin() - 1;
    for (int64_t u = begin; u < end; ++u) {
      while (u >= first[i + 1]) ++i;
      const uint8_t* w = parts[i].data_ptr<uint8_t>();
      const int64_t n = parts[i].size(0), n0 = (u - first[i]) * kTileOutputs;
      T* o = out + col[i];
      switch (types[i]) {
        case 2: run_unit<2>(xg.data(), m, groups, w, n, nb, n0, o, ldo); break;
        case 3: run_unit<3>(xg.data(), m, groups, w, n, nb, n0, o, ldo); break;
        default: run_unit<8>(xg.data(), m, groups, w, n, nb, n0, o, ldo); break;
      }
    }
  });
}

#endif  // ORCINUS_VNNI

void check_part(const torch::Tensor& part, int64_t type, int64_t k) {
  const Format f = format_of(type);
  TORCH_CHECK(part.dim() == 2 && part.is_contiguous() && part.scalar_type() == at::kByte,
              "blocks must be a contiguous uint8 [N, row bytes] tensor");
  TORCH_CHECK(k % kBlock == 0, "the input width ", k, " is not a whole number of 32-weight blocks");
  TORCH_CHECK(part.size(1) == k / kBlock * f.bytes(), "blocks hold ", part.size(1), " bytes a row, not ",
              k / kBlock * f.bytes());
}

}  // namespace

// Whether this build has the op (AVX-512 with VNNI where it was compiled).
bool available() {
#ifdef ORCINUS_VNNI
  return true;
#else
  return false;
#endif
}

// The file's blocks [N, row bytes] of ggml type `type` in the order int16_matmul_out reads; the same size.
torch::Tensor pack(torch::Tensor blocks, int64_t type, int64_t k) {
  check_part(blocks, type, k);
  const Format f = format_of(type);
  const int64_t nb = k / kBlock, row_bytes = blocks.size(1);
  auto out = torch::zeros_like(blocks);
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, blocks.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t b0 = 0; b0 < nb; b0 += kGroup)
        pack_group(src + r * row_bytes + b0 * f.bytes(), type, f, static_cast<int>(std::min<int64_t>(kGroup, nb - b0)),
                   dst + r * row_bytes + b0 * f.bytes());
  });
  return out;
}

// out = x @ W^T for W the packed parts' rows stacked (parts[i] of ggml type types[i]), x rounded to int16 per 32 inputs.
void int16_matmul_out(torch::Tensor x, std::vector<torch::Tensor> parts, std::vector<int64_t> types, torch::Tensor out) {
  TORCH_CHECK(available(), "the int16-activation matmul needs AVX-512 VNNI where it was built");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a contiguous float32 or bfloat16 [rows, K] tensor");
  TORCH_CHECK(parts.size() == types.size() && !parts.empty(), "one type per part, and at least one part");
  const int64_t m = x.size(0), k = x.size(1);
  int64_t n = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    check_part(parts[i], types[i], k);
    n += parts[i].size(0);
  }
  TORCH_CHECK(out.dim() == 2 && out.size(0) == m && out.size(1) == n && out.stride(1) == 1 && out.stride(0) >= n &&
              out.scalar_type() == x.scalar_type(), "out must be [rows, N] of x's dtype with unit column stride");
  if (m == 0) return;
#ifdef ORCINUS_VNNI
  if (x.scalar_type() == at::kFloat)
    run_parts(x.data_ptr<float>(), m, k, parts, types, out.data_ptr<float>(), out.stride(0));
  else
    run_parts(x.data_ptr<at::BFloat16>(), m, k, parts, types, out.data_ptr<at::BFloat16>(), out.stride(0));
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether this build has the int16-activation matmul (AVX-512 VNNI)");
  m.def("pack", &pack, "Q4_0 / Q4_1 / Q8_0 blocks -> the order int16_matmul_out reads");
  m.def("int16_matmul_out", &int16_matmul_out, "out = x @ W^T, x rounded to int16 per 32, W packed GGUF blocks (CPU)");
}
