// Matmul against a GGUF file's 4- to 8-bit blocks (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K) with the activations
// rounded to 16-bit integers: y = x @ W^T, W [N, K], x [M, K] in float32 or bfloat16, at a fraction of the float32
// path's instructions (block_matmul.cpp decodes every weight to a float).
//
// Each row of x is quantized per 32 inputs (the weights' blocks), as llama.cpp's Q8 activations but with 16 bits: d =
// max|x| / 32767, q = round(x / d), an error of at most 2^-16 of the block's largest input (bfloat16's is 2^-9 of
// each). A block's dot product with the weights' codes is an integer sum, exact in int32 (AVX-512 VNNI's vpdpwssd, 32
// products an instruction), then scaled once in float32 by the weights' and the activations' scales. The weights are
// the file's codes and scales in about the file's bytes (4-bit codes as nibbles, the 5- and 6-bit formats' high bits
// packed apart, the file's float16 scales and the K-quants' sub-block scales as bytes, all widened in registers), since
// a lone stream's step is bound by reading them; their order in memory is not the file's (`pack`, Layout): 16 output
// rows make a tile, one int32 lane per row, the rows' block b side by side. A block of x is then one broadcast operand,
// no lane is idle whatever K is (a 576-wide model filled 18 of a group's 32 lanes when a lane held a block), no sum
// needs a horizontal reduction, and a tile streams through memory in order (against float32 inputs:
// docs/performance.md, Kernels).
//
// Lane i sums row i's blocks in order: an output's sum does not depend on M, on the tile or on the thread count.

// Only the headers used, not <torch/extension.h> (all of torch's C++ API): a build parses a fraction of the headers.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

// Two builds of the same sums: AVX-512 VNNI (vpdpwssd, a 16-row tile in one register) and AVX2 (vpmaddwd then an add,
// the tile as two 8-row halves). Integer sums are exact and the float steps are the same operations lane by lane, so
// both give the same bits.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define ORCINUS_VNNI 1
#endif
#if defined(ORCINUS_VNNI) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define ORCINUS_INT16 1
#include <immintrin.h>
#endif

namespace {

constexpr int kBlock = 32;  // inputs per block, in the weights and in x
constexpr int kRows = 16;   // output rows per tile: one int32 lane each
constexpr float kMaxCode = 32767.f;  // x's codes are int16: |q| <= 32767

// A packed type's tile, group by group (a K-quant's 256-weight super-block is a group of 8 blocks, other types' groups
// are one block): each block's low codes, then its high code bits; then each block's scale planes (16 rows each: its
// scale, or Q6_K's two, then its minimum); then the group's float16 planes (a K-quant's d, then dmin). The file's
// bits, no wider: Q4_0 w = d (c - 8); Q4_1 w = d c + m; Q5_0 w = d (c - 16), c 5 bits; Q8_0 w = d c (int8 codes);
// Q4_K w = (d sc) c - (dmin m) per 32 weights, sc and m 6 bits; Q5_K the same with c 5 bits; Q6_K w = (d sc_h) (c - 32)
// per 16, c 6 bits, sc_h int8.
struct Layout {
  int group;        // blocks a group
  int code_bytes;   // a block's low codes (a tile's 16 rows): 256 (4 bits a weight) or 512 (Q8_0's bytes)
  int high_bytes;   // a block's high code bits: Q5_0's and Q5_K's fifth (64), Q6_K's fifth and sixth (128)
  int planes;       // a block's scale planes
  int plane_bytes;  // a plane's bytes a row: 2 (float16), or 1 (a K-quant's sub-block scale)
  int head_planes;  // a group's float16 planes
  int offset;       // subtracted from every code (Q6_K: from each half of the block on its own)
  bool mins;        // the block's last plane is a minimum, added once per block
  int halves;       // scales per block: each of its halves summed on its own
  constexpr int block_bytes() const { return code_bytes + high_bytes; }
  constexpr int scale_bytes() const { return planes * kRows * plane_bytes; }
  constexpr int group_bytes() const { return group * (block_bytes() + scale_bytes()) + head_planes * kRows * 2; }
  constexpr int per_word() const { return code_bytes == 512 ? 2 : 4; }  // packed code slices per 16-bit word
};

// Packed types: Q4_0 (2), Q4_1 (3), Q5_0 (6), Q8_0 (8), Q4_K (12), Q5_K (13), Q6_K (14): a compile-time constant in
// the kernel, checked where a type comes in.
constexpr Layout layout_for(int64_t type) {
  return type == 2    ? Layout{1, 256, 0, 1, 2, 0, 8, false, 1}
         : type == 3  ? Layout{1, 256, 0, 2, 2, 0, 0, true, 1}
         : type == 6  ? Layout{1, 256, 64, 1, 2, 0, 16, false, 1}
         : type == 12 ? Layout{8, 256, 0, 2, 1, 2, 0, true, 1}
         : type == 13 ? Layout{8, 256, 64, 2, 1, 2, 0, true, 1}
         : type == 14 ? Layout{8, 256, 128, 2, 1, 1, 32, false, 2}
                      : Layout{1, 512, 0, 1, 2, 0, 0, false, 1};
}

bool takes(int64_t type) {
  return type == 2 || type == 3 || type == 6 || type == 8 || type == 12 || type == 13 || type == 14;
}

Layout layout_of(int64_t type) {
  TORCH_CHECK(takes(type), "no int16-activation matmul for packed ggml type ", type);
  return layout_for(type);
}

// The type a file's type is packed as (its own), or -1 where the op does not take it.
int64_t packed_type(int64_t type) { return takes(type) ? type : -1; }

// The file's weights and bytes per block of a type packed_type takes.
void file_block(int64_t type, int& weights, int& bytes) {
  switch (type) {
    case 2: weights = 32, bytes = 18; break;
    case 3: weights = 32, bytes = 20; break;
    case 6: weights = 32, bytes = 22; break;
    case 8: weights = 32, bytes = 34; break;
    case 12: weights = 256, bytes = 144; break;
    case 13: weights = 256, bytes = 176; break;
    default: weights = 256, bytes = 210; break;  // 14
  }
}

// Q4_K's 6-bit scale and minimum of sub-block j (ggml's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* q, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63, m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Block b (32 weights) of a file's row of type `type`: its 32 codes (unsigned, all their bits; Q8_0's int8 bytes),
// its scale planes' bytes and its group's float16 planes' bytes, as the packed layout stores them.
void block_of(const uint8_t* row, int64_t type, int64_t b, uint8_t* c, uint8_t* scale, uint8_t* head) {
  if (type == 2 || type == 3 || type == 8) {
    const uint8_t* block = row + b * (type == 2 ? 18 : type == 3 ? 20 : 34);
    std::memcpy(scale, block, type == 3 ? 4 : 2);  // d, and Q4_1's m after it
    if (type == 8) {
      std::memcpy(c, block + 2, kBlock);
      return;
    }
    const uint8_t* qs = block + (type == 3 ? 4 : 2);
    for (int e = 0; e < 16; ++e) {
      c[e] = qs[e] & 15;
      c[e + 16] = qs[e] >> 4;
    }
  } else if (type == 6) {  // d, 32 fifth bits, 16 bytes of low nibbles
    const uint8_t* block = row + b * 22;
    std::memcpy(scale, block, 2);
    uint32_t qh;
    std::memcpy(&qh, block + 2, 4);
    for (int e = 0; e < 16; ++e) {
      c[e] = (block[6 + e] & 15) | (((qh >> e) << 4) & 16);
      c[e + 16] = (block[6 + e] >> 4) | ((qh >> (e + 12)) & 16);
    }
  } else if (type == 12 || type == 13) {  // d, dmin, 12 bytes of 6-bit scales and minimums, (Q5_K: 32 bytes of fifth
                                          // bits,) 128 bytes of nibbles
    const uint8_t* block = row + (b / 8) * (type == 12 ? 144 : 176);
    const int j = b % 8;
    int sc, m;
    scale_min_k4(j, block + 4, sc, m);
    scale[0] = static_cast<uint8_t>(sc);
    scale[1] = static_cast<uint8_t>(m);
    std::memcpy(head, block, 4);
    const uint8_t* qh = block + 16;
    const uint8_t* q = block + (type == 12 ? 16 : 48) + 32 * (j / 2);
    for (int e = 0; e < kBlock; ++e) {
      c[e] = j % 2 ? q[e] >> 4 : q[e] & 15;
      if (type == 13) c[e] |= ((qh[e] >> j) & 1) << 4;
    }
  } else {  // Q6_K: 128 bytes of low nibbles, 64 of high pairs, 16 int8 scales, d
    const uint8_t* block = row + (b / 8) * 210;
    const int j = b % 8, n = j / 4, quarter = j % 4;
    const uint8_t* ql = block + 64 * n + (quarter % 2) * 32;
    const uint8_t* qh = block + 128 + 32 * n;
    for (int e = 0; e < kBlock; ++e) {
      const int lo = quarter < 2 ? ql[e] & 15 : ql[e] >> 4;
      c[e] = static_cast<uint8_t>(lo | (((qh[e] >> (2 * quarter)) & 3) << 4));
    }
    std::memcpy(scale, block + 192 + 8 * n + 2 * quarter, 2);
    std::memcpy(head, block + 208, 2);
  }
}

// Sixteen rows' groups as one tile (Layout). Code slice t (inputs 2t and 2t+1) of row r sits in 16-bit lanes 2r and
// 2r+1 of a 64-byte vector; 8-bit codes store slices 2u and 2u+1 in one vector's words (low and high byte), a 4-bit
// format slices 4u .. 4u+3 (the word's four nibbles, lowest first), so a load and a shift or mask widens a slice. The
// high bits are words in the same lanes: Q5_0's and Q5_K's one vector a block holds slice t's fifth bit at bit t,
// Q6_K's two slice t's two at bits 2 (t % 8) of vector t / 8, so a shift puts them above the nibble. Every byte of the
// tile is written, each code straight to its place (a model's load packs every weight: bit by bit into zeroed words was
// slow).
void pack_tile(const uint8_t* src, int64_t row_bytes, int64_t type, const Layout& f, int64_t groups, uint8_t* dst) {
  for (int64_t g = 0; g < groups; ++g) {
    uint8_t* gp = dst + g * f.group_bytes();
    uint8_t* sp = gp + f.group * f.block_bytes();
    uint8_t* hp = sp + f.group * f.scale_bytes();
    for (int r = 0; r < kRows; ++r)
      for (int j = 0; j < f.group; ++j) {
        uint8_t c[kBlock], scale[4], head[4];
        block_of(src + r * row_bytes, type, g * f.group + j, c, scale, head);
        uint8_t* codes = gp + j * f.block_bytes();
        if (f.per_word() == 2) {
          // Vector u, row r: bytes 4r .. 4r+3 are lane 2r (inputs 4u, 4u+2) then lane 2r+1 (4u+1, 4u+3).
          for (int u = 0; u < kBlock / 4; ++u) {
            uint8_t* d = codes + 64 * u + 4 * r;
            d[0] = c[4 * u];
            d[1] = c[4 * u + 2];
            d[2] = c[4 * u + 1];
            d[3] = c[4 * u + 3];
          }
        } else {
          // Vector u, lane 2r + p: inputs 8u + p, 8u + 2 + p, 8u + 4 + p, 8u + 6 + p, a nibble each, lowest first.
          for (int u = 0; u < kBlock / 8; ++u)
            for (int p = 0; p < 2; ++p) {
              const uint8_t* e = c + 8 * u + p;
              const uint16_t word = (e[0] & 15) | (e[2] & 15) << 4 | (e[4] & 15) << 8 | (e[6] & 15) << 12;
              std::memcpy(codes + 64 * u + 4 * r + 2 * p, &word, 2);
            }
        }
        for (int v = 0; v < f.high_bytes / 64; ++v)
          for (int p = 0; p < 2; ++p) {
            uint16_t word = 0;
            if (type == 6 || type == 13)
              for (int t = 0; t < 16; ++t) word |= ((c[2 * t + p] >> 4) & 1) << t;
            else
              for (int k = 0; k < 8; ++k) word |= ((c[2 * (8 * v + k) + p] >> 4) & 3) << (2 * k);
            std::memcpy(codes + f.code_bytes + 64 * v + 4 * r + 2 * p, &word, 2);
          }
        for (int q = 0; q < f.planes; ++q)
          std::memcpy(sp + j * f.scale_bytes() + (q * kRows + r) * f.plane_bytes, scale + q * f.plane_bytes,
                      f.plane_bytes);
        if (j == 0)
          for (int q = 0; q < f.head_planes; ++q) std::memcpy(hp + (q * kRows + r) * 2, head + 2 * q, 2);
      }
  }
}

#ifdef ORCINUS_INT16

// One block of a row of x, quantized: its 32 codes, its scale d, their sum s, d * s and each half's sum (Q6_K's
// offset is per half).
struct alignas(64) XBlock {
  int16_t q[kBlock];
  float d;
  int32_t s;
  float ds;
  int32_t sh[2];
};

// A block's scale and reciprocal from its largest magnitude: d = max|x| / 32767, q = round(x / d).
inline void block_scale(float amax, float& d, float& id) {
  d = amax / kMaxCode;
  id = amax > 0.f ? kMaxCode / amax : 0.f;
}

#ifdef ORCINUS_VNNI

inline __m512 load16(const float* v) { return _mm512_loadu_ps(v); }
inline __m512 load16(const at::BFloat16* v) {  // bfloat16 is float32's upper half: exact
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// x's row (K inputs, float32 or bfloat16) into K / 32 blocks. Lane by lane the scalar steps: |x|'s max (a NaN input
// skipped), x * id clamped to +-32767 (a NaN product clamped to -32767, as std::max(-32767, NaN) gives), rounded to
// nearest even. Vectorized, with the rounding on the calling thread for small inputs (below): the same bits as the
// scalar steps, faster at every row count (docs/performance.md, Kernels).
template <typename T>
void quantize_row(const T* x, int64_t nb, XBlock* out) {
  const __m512 sign = _mm512_set1_ps(-0.f), lo = _mm512_set1_ps(-kMaxCode), hi = _mm512_set1_ps(kMaxCode);
  for (int64_t b = 0; b < nb; ++b) {
    const __m512 v0 = load16(x + b * kBlock), v1 = load16(x + b * kBlock + 16);
    // max_ps returns its second operand when either is a NaN: a NaN input never becomes the max.
    const __m512 m = _mm512_max_ps(_mm512_andnot_ps(sign, v1),
                                   _mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_setzero_ps()));
    float d, id;
    block_scale(_mm512_reduce_max_ps(m), d, id);
    const __m512 vid = _mm512_set1_ps(id);
    const auto codes = [&](__m512 v) {
      const __m512 clamped = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(v, vid), lo), hi);
      return _mm512_cvtps_epi32(_mm512_roundscale_ps(clamped, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    };
    const __m512i q0 = codes(v0), q1 = codes(v1);
    _mm256_store_si256(reinterpret_cast<__m256i*>(out[b].q), _mm512_cvtepi32_epi16(q0));
    _mm256_store_si256(reinterpret_cast<__m256i*>(out[b].q + 16), _mm512_cvtepi32_epi16(q1));
    const int32_t s0 = _mm512_reduce_add_epi32(q0), s1 = _mm512_reduce_add_epi32(q1), s = s0 + s1;
    out[b].d = d;
    out[b].s = s;
    out[b].sh[0] = s0;
    out[b].sh[1] = s1;
    out[b].ds = d * static_cast<float>(s);
  }
}

#else  // AVX2

inline __m256 load8(const float* v) { return _mm256_loadu_ps(v); }
inline __m256 load8(const at::BFloat16* v) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline int32_t reduce_add(__m256i v) {
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  return _mm_cvtsi128_si32(s4);
}

// The VNNI build's quantize_row on 8 lanes.
template <typename T>
void quantize_row(const T* x, int64_t nb, XBlock* out) {
  const __m256 sign = _mm256_set1_ps(-0.f), lo = _mm256_set1_ps(-kMaxCode), hi = _mm256_set1_ps(kMaxCode);
  for (int64_t b = 0; b < nb; ++b) {
    __m256 v[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = load8(x + b * kBlock + 8 * i);
      m = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), m);  // a NaN input never becomes the max
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    float d, id;
    block_scale(_mm_cvtss_f32(h), d, id);
    const __m256 vid = _mm256_set1_ps(id);
    __m256i q[4];
    for (int i = 0; i < 4; ++i)
      q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(v[i], vid), lo), hi),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    // packs interleaves 128-bit lanes: the permute puts the 16 codes back in order.
    for (int i = 0; i < 2; ++i)
      _mm256_store_si256(reinterpret_cast<__m256i*>(out[b].q + 16 * i),
                         _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2 * i], q[2 * i + 1]), 0xD8));
    const int32_t s0 = reduce_add(_mm256_add_epi32(q[0], q[1])), s1 = reduce_add(_mm256_add_epi32(q[2], q[3]));
    const int32_t s = s0 + s1;
    out[b].d = d;
    out[b].s = s;
    out[b].sh[0] = s0;
    out[b].sh[1] = s1;
    out[b].ds = d * static_cast<float>(s);
  }
}

#endif  // ORCINUS_VNNI

// Inputs 2t and 2t+1 of a block of x, as one int32.
inline int32_t pair(const XBlock& x, int t) {
  int32_t v;
  std::memcpy(&v, x.q + 2 * t, 4);
  return v;
}

// Weights are read this far ahead of their use: a tile's blocks stream through memory in order, but the hardware
// prefetchers stop at each 4 KB page. 16 KB ahead: from 32 KB or 8 KB a lone row's Q4_K and Q6_K tiles waited on
// memory. Into L2, not L1: fetched into L1 a pass took longer, most at few rows of x. The AVX2 build gains as much
// (bench/kernels/bench_block_types.py --against; docs/performance.md, Kernels).
constexpr int kPrefetchBytes = 16384;

inline void prefetch_ahead(const uint8_t* p, int bytes) {
  for (int l = 0; l < bytes; l += 64) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes + l), _MM_HINT_T1);
}

// f(I), f(I + 1) .. f(N - 1), each index a compile-time constant (the code slices' shifts are immediates). Always
// inlined, as the bodies passed are: a body GCC left as a call kept a tile's sums in memory (the AVX2 build ran slower).
#define ORCINUS_INLINE __attribute__((always_inline))
template <int I, int N, typename F>
ORCINUS_INLINE inline void unroll(F&& f) {
  if constexpr (I < N) {
    f(std::integral_constant<int, I>{});
    unroll<I + 1, N>(f);
  }
}

#ifdef ORCINUS_VNNI

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::BFloat16* p, __m512 v) {
  alignas(64) float f[kRows];
  _mm512_store_ps(f, v);
  for (int i = 0; i < kRows; ++i) p[i] = at::BFloat16(f[i]);  // round to nearest even
}

// A block's scale for its half hh, 16 rows: the file's float16 d, or a K-quant's d times the block's sub-block scale
// (exact in float32: 11 + 8 bits); and its minimum, Q4_1's float16 m or Q4_K's -(dmin m). The K-quants' products are
// the ones the float32-scale layout stored, formed the same way, so the sums are scaled by the same floats.
template <int Type>
inline __m512 scales16(const uint8_t* s, __m512 d, int hh) {
  if constexpr (Type == 12 || Type == 13)
    return _mm512_mul_ps(
        d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)))));
  else if constexpr (Type == 14)
    return _mm512_mul_ps(
        d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16 * hh)))));
  else
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
}

template <int Type>
inline __m512 mins16(const uint8_t* s, __m512 dmin) {
  if constexpr (Type == 12 || Type == 13) {
    const __m512 dm = _mm512_mul_ps(
        dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16)))));
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(dm), _mm512_set1_epi32(INT32_MIN)));
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 32)));
  }
}

template <int N>
inline __m512i shift16(__m512i v) {  // each word N bits left (N < 0: right)
  if constexpr (N > 0) return _mm512_slli_epi16(v, N);
  else if constexpr (N < 0) return _mm512_srli_epi16(v, -N);
  else return v;
}

// Code slice t of a block (slice s of its vector u): the nibble, and for Q5_0, Q5_K and Q6_K the high bits shifted
// above it and merged in one ternary-logic instruction (lo | (high & mask)).
template <int Type, int U, int S>
inline __m512i codes16(__m512i v, const __m512i* high) {
  constexpr int t = 4 * U + S;
  const __m512i lo = S == 3 ? _mm512_srli_epi16(v, 12) : _mm512_and_si512(shift16<-4 * S>(v), _mm512_set1_epi16(15));
  if constexpr (Type == 6 || Type == 13)
    return _mm512_ternarylogic_epi32(lo, shift16<4 - t>(high[0]), _mm512_set1_epi16(0x10), 0xF8);
  else if constexpr (Type == 14)
    return _mm512_ternarylogic_epi32(lo, shift16<4 - 2 * (t % 8)>(high[t / 8]), _mm512_set1_epi16(0x30), 0xF8);
  else
    return lo;
}

// The 16 outputs of one tile for R rows of x (row r's blocks at xb + r * nb). Lane i sums row i's blocks in order, so
// an output's sum never depends on M, on the tile or on the thread count.
template <int R, int Type, typename T>
void tile(const XBlock* xb, int64_t nb, int64_t ldx, const uint8_t* w, T* out, int64_t ldo) {
  constexpr Layout f = layout_for(Type);
  // At least 8 independent sums below 8 rows: with fewer, a pass at 1 row waits on vpdpwssd's latency
  // (docs/performance.md, Kernels); same bits. 12 sums at 4-5 rows spill registers and run slower.
  constexpr int per_word = f.per_word(), chains = R >= 8 ? 1 : R >= 4 ? 2 : (8 + R - 1) / R;
  constexpr int vectors = f.code_bytes / 64, per_half = vectors / f.halves;  // 64-byte code vectors a block
  constexpr int share = f.group_bytes() / f.group;  // a block's share of its group, prefetched with it
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < nb / f.group; ++g) {
    const uint8_t* gp = w + g * f.group_bytes();
    const uint8_t* sp = gp + f.group * f.block_bytes();
    const uint8_t* hp = sp + f.group * f.scale_bytes();
    __m512 d = _mm512_setzero_ps(), dmin = _mm512_setzero_ps();
    if constexpr (f.head_planes > 0) d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hp)));
    if constexpr (f.head_planes > 1)
      dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hp + 2 * kRows)));
    for (int j = 0; j < f.group; ++j) {
      const int64_t b = g * f.group + j;
      const uint8_t* p = gp + j * f.block_bytes();
      const uint8_t* scales = sp + j * f.scale_bytes();
      prefetch_ahead(gp + j * share, share);
      __m512i high[2];
      for (int v = 0; v < f.high_bytes / 64; ++v) high[v] = _mm512_loadu_si512(p + f.code_bytes + 64 * v);
      // Integer sums are exact in any order: several chains (or rows) hide the multiply-adds' latency. A block's
      // halves (Q6_K's per-16 scales) are summed and scaled in turn; other formats are one half.
      __m512i sum[R][chains];
      unroll<0, vectors>([&](auto uc) ORCINUS_INLINE {
        constexpr int u = decltype(uc)::value, hh = u / per_half;
        if constexpr (u % per_half == 0)
          for (int r = 0; r < R; ++r) {
            const XBlock& x = xb[r * ldx + b];
            sum[r][0] = !f.offset ? _mm512_setzero_si512()
                        : f.halves == 2 ? _mm512_set1_epi32(-f.offset * x.sh[hh])
                                        : _mm512_set1_epi32(-f.offset * x.s);
            for (int c = 1; c < chains; ++c) sum[r][c] = _mm512_setzero_si512();
          }
        const __m512i v = _mm512_loadu_si512(p + u * 64);
        unroll<0, per_word>([&](auto sc) ORCINUS_INLINE {
          constexpr int s = decltype(sc)::value, t = per_word * u + s;
          __m512i wv;
          if constexpr (per_word == 2)
            wv = s == 0 ? _mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8) : _mm512_srai_epi16(v, 8);
          else
            wv = codes16<Type, u, s>(v, high);
          for (int r = 0; r < R; ++r)
            sum[r][t % chains] =
                _mm512_dpwssd_epi32(sum[r][t % chains], wv, _mm512_set1_epi32(pair(xb[r * ldx + b], t)));
        });
        if constexpr (u % per_half == per_half - 1) {
          const __m512 dw = scales16<Type>(scales, d, hh);
          for (int r = 0; r < R; ++r) {
            const XBlock& x = xb[r * ldx + b];
            __m512i s = sum[r][0];
            for (int c = 1; c < chains; ++c) s = _mm512_add_epi32(s, sum[r][c]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, _mm512_set1_ps(x.d)), acc[r]);
          }
        }
      });
      if constexpr (f.mins) {
        const __m512 mw = mins16<Type>(scales, dmin);
        for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xb[r * ldx + b].ds), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) store16(out + r * ldo, acc[r]);
}

// Rows of x a tile's weights serve at once: 12 rows' sums and accumulators, a word's slices and a broadcast fit the
// 32 registers, so a verification step of 8 drafts (9 rows) takes one pass, not two; 16 rows spill
// (bench/kernels/bench_block_matmul.py --against; docs/performance.md, Kernels).
constexpr int kTileRowsOfX = 12;

#else  // AVX2

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::BFloat16* p, __m256 v) {
  alignas(32) float f[8];
  _mm256_store_ps(f, v);
  for (int i = 0; i < 8; ++i) p[i] = at::BFloat16(f[i]);  // round to nearest even
}

// The VNNI build's scales16 and mins16 for eight rows (s and hp already at the half's rows).
template <int Type>
inline __m256 scales8(const uint8_t* s, __m256 d, int hh) {
  if constexpr (Type == 12 || Type == 13)
    return _mm256_mul_ps(
        d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s)))));
  else if constexpr (Type == 14)
    return _mm256_mul_ps(
        d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + 16 * hh)))));
  else
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
}

template <int Type>
inline __m256 mins8(const uint8_t* s, __m256 dmin) {
  if constexpr (Type == 12 || Type == 13) {
    const __m256 dm = _mm256_mul_ps(
        dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + 16)))));
    return _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(dm), _mm256_set1_epi32(INT32_MIN)));
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32)));
  }
}

template <int N>
inline __m256i shift16(__m256i v) {
  if constexpr (N > 0) return _mm256_slli_epi16(v, N);
  else if constexpr (N < 0) return _mm256_srli_epi16(v, -N);
  else return v;
}

// The VNNI build's codes16, its merge an and and an or.
template <int Type, int U, int S>
inline __m256i codes8(__m256i v, const __m256i* high) {
  constexpr int t = 4 * U + S;
  const __m256i lo = S == 3 ? _mm256_srli_epi16(v, 12) : _mm256_and_si256(shift16<-4 * S>(v), _mm256_set1_epi16(15));
  if constexpr (Type == 6 || Type == 13)
    return _mm256_or_si256(lo, _mm256_and_si256(shift16<4 - t>(high[0]), _mm256_set1_epi16(0x10)));
  else if constexpr (Type == 14)
    return _mm256_or_si256(lo, _mm256_and_si256(shift16<4 - 2 * (t % 8)>(high[t / 8]), _mm256_set1_epi16(0x30)));
  else
    return lo;
}

// Half h of a tile's groups g0 .. g1-1 (its rows 8h .. 8h+7, the upper or lower 32 bytes of each of its vectors, the
// same half of each plane) for R rows of x, added to acc: the VNNI tile's steps on 8 lanes, with vpmaddwd's pair sums
// added to the chain instead of accumulated in one instruction.
template <int R, int Type>
void half_tile(const XBlock* xb, int64_t g0, int64_t g1, int64_t ldx, const uint8_t* w, int h, float (*acc)[8]) {
  constexpr Layout f = layout_for(Type);
  constexpr int per_word = f.per_word(), chains = R < 4 ? 4 / R : 1;
  constexpr int vectors = f.code_bytes / 64, per_half = vectors / f.halves;  // 64-byte code vectors a block
  constexpr int share = f.group_bytes() / f.group;
  // Past 4 rows the rows' sums, a word's slices and a broadcast fill the 16 registers: the float accumulators,
  // touched once a block, live in memory then (left in registers, GCC spills sums in the inner loop instead).
  constexpr bool in_memory = R > 4;
  __m256 acc_reg[in_memory ? 1 : R];
  if constexpr (!in_memory)
    for (int r = 0; r < R; ++r) acc_reg[r] = _mm256_load_ps(acc[r]);
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* gp = w + g * f.group_bytes();
    const uint8_t* sp = gp + f.group * f.block_bytes() + 8 * f.plane_bytes * h;
    const uint8_t* hp = gp + f.group * (f.block_bytes() + f.scale_bytes()) + 16 * h;
    __m256 d = _mm256_setzero_ps(), dmin = _mm256_setzero_ps();
    if constexpr (f.head_planes > 0) d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hp)));
    if constexpr (f.head_planes > 1)
      dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hp + 2 * kRows)));
    for (int j = 0; j < f.group; ++j) {
      const int64_t b = g * f.group + j;
      const uint8_t* p = gp + j * f.block_bytes() + 32 * h;
      const uint8_t* scales = sp + j * f.scale_bytes();
      if (h == 0) prefetch_ahead(gp + j * share, share);  // the second half reads what the first brought in
      __m256i high[2];
      for (int v = 0; v < f.high_bytes / 64; ++v)
        high[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + f.code_bytes + 64 * v));
      __m256i sum[R][chains];
      unroll<0, vectors>([&](auto uc) ORCINUS_INLINE {
        constexpr int u = decltype(uc)::value, hh = u / per_half;
        if constexpr (u % per_half == 0)
          for (int r = 0; r < R; ++r) {
            const XBlock& x = xb[r * ldx + b];
            sum[r][0] = !f.offset ? _mm256_setzero_si256()
                        : f.halves == 2 ? _mm256_set1_epi32(-f.offset * x.sh[hh])
                                        : _mm256_set1_epi32(-f.offset * x.s);
            for (int c = 1; c < chains; ++c) sum[r][c] = _mm256_setzero_si256();
          }
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + u * 64));
        unroll<0, per_word>([&](auto sc) ORCINUS_INLINE {
          constexpr int s = decltype(sc)::value, t = per_word * u + s;
          __m256i wv;
          if constexpr (per_word == 2)
            wv = s == 0 ? _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8) : _mm256_srai_epi16(v, 8);
          else
            wv = codes8<Type, u, s>(v, high);
          for (int r = 0; r < R; ++r) {
            sum[r][t % chains] = _mm256_add_epi32(
                sum[r][t % chains], _mm256_madd_epi16(wv, _mm256_set1_epi32(pair(xb[r * ldx + b], t))));
            // Integer adds reassociate: left to itself GCC keeps every product of the block live for one sum tree at
            // its end, spilling them all. Each product goes into its chain as it is made.
            asm("" : "+x"(sum[r][t % chains]));
          }
        });
        if constexpr (u % per_half == per_half - 1) {
          const __m256 dw = scales8<Type>(scales, d, hh);
          for (int r = 0; r < R; ++r) {
            const XBlock& x = xb[r * ldx + b];
            __m256i s = sum[r][0];
            for (int c = 1; c < chains; ++c) s = _mm256_add_epi32(s, sum[r][c]);
            __m256 a = in_memory ? _mm256_load_ps(acc[r]) : acc_reg[r];
            a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, _mm256_set1_ps(x.d)), a);
            if constexpr (in_memory) _mm256_store_ps(acc[r], a);
            else acc_reg[r] = a;
          }
        }
      });
      if constexpr (f.mins) {
        const __m256 mw = mins8<Type>(scales, dmin);
        for (int r = 0; r < R; ++r) {
          __m256 a = in_memory ? _mm256_load_ps(acc[r]) : acc_reg[r];
          a = _mm256_fmadd_ps(mw, _mm256_set1_ps(xb[r * ldx + b].ds), a);
          if constexpr (in_memory) _mm256_store_ps(acc[r], a);
          else acc_reg[r] = a;
        }
      }
    }
  }
  if constexpr (!in_memory)
    for (int r = 0; r < R; ++r) _mm256_store_ps(acc[r], acc_reg[r]);
}

// Sixteen registers, not 32: a half tile at a time. Run over a whole tile, the first half read it from memory and the
// second from L2, the memory idle for half of a lone row's pass; in chunks, the second half reads from L1 what the
// first has just brought in (docs/performance.md, Kernels).
template <int R, int Type, typename T>
void tile(const XBlock* xb, int64_t nb, int64_t ldx, const uint8_t* w, T* out, int64_t ldo) {
  constexpr Layout f = layout_for(Type);
  // Below 4 rows a pass is bound by memory: both halves of a few KB of groups in turn. From 4 rows on it is bound by
  // instructions, and the halves' accumulators stored between chunks cost more than the overlap gives.
  const int64_t groups = nb / f.group, chunk = R < 4 ? std::max(1, 4096 / f.group_bytes()) : groups;
  alignas(32) float acc[2][R][8] = {};
  for (int64_t g0 = 0; g0 < groups; g0 += chunk) {
    const int64_t g1 = std::min(groups, g0 + chunk);
    half_tile<R, Type>(xb, g0, g1, ldx, w, 0, acc[0]);
    half_tile<R, Type>(xb, g0, g1, ldx, w, 1, acc[1]);
  }
  for (int r = 0; r < R; ++r) {
    store8(out + r * ldo, _mm256_load_ps(acc[0][r]));
    store8(out + r * ldo + 8, _mm256_load_ps(acc[1][r]));
  }
}

// 8 rows, not 4: with 4, a step's matmuls at 5 to 9 rows (a decoding request and its drafts) took longer, the same
// past 16 (bench/kernels/bench_block_matmul.py --against; docs/performance.md, Kernels).
constexpr int kTileRowsOfX = 8;

#endif  // ORCINUS_VNNI

// `rows` (1 .. R) rows of x through one tile.
template <int Type, typename T, int R = kTileRowsOfX>
void tile_rows(int64_t rows, const XBlock* xb, int64_t nb, int64_t ldx, const uint8_t* w, T* out, int64_t ldo) {
  if constexpr (R > 1) {
    if (rows < R) return tile_rows<Type, T, R - 1>(rows, xb, nb, ldx, w, out, ldo);
  }
  tile<R, Type>(xb, nb, ldx, w, out, ldo);
}

template <int Type, typename T>
void run_tile(const XBlock* xb, int64_t m, int64_t nb, int64_t ldx, const uint8_t* w, T* out, int64_t ldo) {
  for (int64_t r0 = 0; r0 < m; r0 += kTileRowsOfX)
    tile_rows<Type>(std::min<int64_t>(kTileRowsOfX, m - r0), xb + r0 * ldx, nb, ldx, w, out + r0 * ldo, ldo);
}

// Below this many multiply-adds a call runs on the calling thread: a parallel region costs a thread wake-up.
constexpr int64_t kParallelMacs = 1 << 16;
// Below this many inputs x is rounded on the calling thread: vectorized, a verification step's 12 rows of 576 take
// about a microsecond, less than waking the other threads for a parallel region.
constexpr int64_t kParallelInputs = 1 << 15;

template <typename T>
void run_parts(const T* x, int64_t m, int64_t k, const std::vector<at::Tensor>& parts,
               const std::vector<int64_t>& types, T* out, int64_t ldo) {
  const int64_t nb = k / kBlock;
  // x's rows an odd number of blocks apart: a power-of-two stride put a tile's rows of x in the same few L1 sets, each
  // read evicting the next row's block (docs/performance.md, Kernels).
  const int64_t ldx = nb | 1;
  std::unique_ptr<XBlock[]> xb(new XBlock[m * ldx]);  // not value-initialized: quantize_row writes every field
  at::parallel_for(0, m, std::max<int64_t>(1, kParallelInputs / k), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) quantize_row(x + r * k, nb, xb.get() + r * ldx);
  });
  std::vector<int64_t> first(parts.size() + 1, 0);
  for (size_t i = 0; i < parts.size(); ++i) first[i + 1] = first[i] + parts[i].size(0) / kRows;
  const int64_t tiles = first.back();
  const int64_t grain = std::max<int64_t>(1, kParallelMacs / std::max<int64_t>(1, m * k * kRows));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    size_t i = std::upper_bound(first.begin(), first.end(), begin) - first.begin() - 1;
    for (int64_t u = begin; u < end; ++u) {
      while (u >= first[i + 1]) ++i;
      const int64_t tile_bytes = kRows * parts[i].size(1);
      const uint8_t* w = parts[i].data_ptr<uint8_t>() + (u - first[i]) * tile_bytes;
      T* o = out + u * kRows;
      switch (types[i]) {
        case 2: run_tile<2>(xb.get(), m, nb, ldx, w, o, ldo); break;
        case 3: run_tile<3>(xb.get(), m, nb, ldx, w, o, ldo); break;
        case 6: run_tile<6>(xb.get(), m, nb, ldx, w, o, ldo); break;
        case 12: run_tile<12>(xb.get(), m, nb, ldx, w, o, ldo); break;
        case 13: run_tile<13>(xb.get(), m, nb, ldx, w, o, ldo); break;
        case 14: run_tile<14>(xb.get(), m, nb, ldx, w, o, ldo); break;
        default: run_tile<8>(xb.get(), m, nb, ldx, w, o, ldo); break;
      }
    }
  });
}

#endif  // ORCINUS_INT16

// A part's shape: whole tiles of rows, whole blocks of `weights` inputs of `bytes` each.
void check_part(const at::Tensor& part, int64_t k, int weights, int bytes) {
  TORCH_CHECK(part.dim() == 2 && part.is_contiguous() && part.scalar_type() == at::kByte,
              "blocks must be a contiguous uint8 [N, row bytes] tensor");
  TORCH_CHECK(part.size(0) % kRows == 0, "the int16 op takes whole tiles of ", kRows, " rows, not ", part.size(0));
  TORCH_CHECK(k % weights == 0, "the input width ", k, " is not a whole number of ", weights, "-weight blocks");
  TORCH_CHECK(part.size(1) == k / weights * bytes, "blocks hold ", part.size(1), " bytes a row, not ",
              k / weights * bytes);
}

void check_part(const at::Tensor& part, int64_t type, int64_t k) {
  const Layout f = layout_of(type);
  check_part(part, k, kBlock * f.group, f.group_bytes() / kRows);
}

}  // namespace

// Whether this build has the op (AVX-512 VNNI, or AVX2 with FMA and F16C, where it was compiled).
bool available() {
#ifdef ORCINUS_INT16
  return true;
#else
  return false;
#endif
}

// The instructions this build's sums run on: "AVX-512 VNNI", "AVX2", or "" (no op).
std::string isa() {
#if defined(ORCINUS_VNNI)
  return "AVX-512 VNNI";
#elif defined(ORCINUS_INT16)
  return "AVX2";
#else
  return "";
#endif
}

// The file's blocks [N, row bytes] of ggml type `type` (N a multiple of 16) in the order int16_matmul reads
// (Layout): the same bytes for Q4_0, Q4_1 and Q8_0 and as many for Q5_0 and Q6_K; Q4_K's and Q5_K's 6-bit scales
// and minimums as bytes (+2.8%, +2.3%).
at::Tensor pack(at::Tensor blocks, int64_t type, int64_t k) {
  TORCH_CHECK(takes(type), "no int16-activation matmul for ggml type ", type);
  int weights, bytes;
  file_block(type, weights, bytes);
  check_part(blocks, k, weights, bytes);
  const Layout f = layout_of(type);
  const int64_t groups = k / (kBlock * f.group), row_bytes = blocks.size(1);
  const int64_t packed_bytes = groups * f.group_bytes() / kRows;
  auto out = at::empty({blocks.size(0), packed_bytes}, blocks.options());  // pack_tile writes every byte
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, blocks.size(0) / kRows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      pack_tile(src + t * kRows * row_bytes, row_bytes, type, f, groups, dst + t * kRows * packed_bytes);
  });
  return out;
}

// out = x @ W^T for W the packed parts' rows stacked (parts[i] of ggml type types[i]), x rounded to int16 per 32 inputs;
// without `out`, into a new tensor. Returns out.
at::Tensor int16_matmul(at::Tensor x, std::vector<at::Tensor> parts, std::vector<int64_t> types,
                        std::optional<at::Tensor> out_arg) {
  TORCH_CHECK(available(), "the int16-activation matmul needs AVX-512 VNNI or AVX2 where it was built");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a float32 or bfloat16 [rows, K] tensor");
  x = x.contiguous();
  TORCH_CHECK(parts.size() == types.size() && !parts.empty(), "one type per part, and at least one part");
  const int64_t m = x.size(0), k = x.size(1);
  int64_t n = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    check_part(parts[i], types[i], k);
    n += parts[i].size(0);
  }
  at::Tensor out = out_arg ? *out_arg : at::empty({m, n}, x.options());
  TORCH_CHECK(out.dim() == 2 && out.size(0) == m && out.size(1) == n && out.stride(1) == 1 && out.stride(0) >= n &&
              out.scalar_type() == x.scalar_type(), "out must be [rows, N] of x's dtype with unit column stride");
  if (m == 0) return out;
#ifdef ORCINUS_INT16
  if (x.scalar_type() == at::kFloat)
    run_parts(x.data_ptr<float>(), m, k, parts, types, out.data_ptr<float>(), out.stride(0));
  else
    run_parts(x.data_ptr<at::BFloat16>(), m, k, parts, types, out.data_ptr<at::BFloat16>(), out.stride(0));
#endif
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether this build has the int16-activation matmul (AVX-512 VNNI or AVX2)");
  m.def("isa", &isa, "the instructions this build's sums run on (\"\": none)");
  m.def("packed_type", &packed_type, "the type `pack` gives a file's type (-1: not taken)");
  m.def("pack", &pack, "Q4_0 / Q4_1 / Q5_0 / Q8_0 / Q4_K / Q5_K / Q6_K blocks -> the order int16_matmul reads");
  m.def("int16_matmul", &int16_matmul, "x @ W^T (into out, if given), x rounded to int16 per 32, W packed GGUF blocks",
        pybind11::arg("x"), pybind11::arg("parts"), pybind11::arg("types"), pybind11::arg("out") = pybind11::none());
}
