// Matmul against a GGUF file's quantized weights as the file holds them: y = x @ W^T, W [N, K] stored as llama.cpp's
// blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K .. Q6_K; also F32, F16, BF16), x [M, K] in float32 or bfloat16.
//
// Each block decodes to float32 exactly as gguf-py's (and ggml's) dequantization does: every value is
// d * q (+ m), where d * q is exact in float32 (an 11-bit float16 scale, times at most a 6-bit integer scale,
// times at most an 8-bit code), so the one rounding is the add's, the same with or without a fused multiply-add.
// Products and sums are float32: the weights are the float32 model's bit for bit, and only the order of the sums
// (and bfloat16 inputs, where given) differs from it.
//
// The order of every output's sum is fixed: 16 lane-wise partial sums over k in order, then one fixed tree. It does
// not depend on M (the batch), on which path runs (decoding block by block for a few rows, or a panel of rows once
// for many) or on the thread count (threads split the N outputs, never a sum): a row's result is the same alone or
// in any batch.

// Only the headers used, not <torch/extension.h> (all of torch's C++ API): a build parses a fraction of the headers.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

#ifdef __AVX512F__
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

inline v8 low8(v16 v) { return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7); }
inline v8 high8(v16 v) { return __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15); }

constexpr int kTileN = 4;  // outputs per register tile
constexpr int kTileM = 6;  // rows per register tile: 24 accumulators, 4 weights and a row of x: 29 of 32 registers
constexpr int kDirectWide = 4;  // outputs per direct tile for up to 4 rows (for up to kDirectRows: 2)
constexpr int kDirectRows = 8;  // up to this many rows a 32-weight block is decoded into registers where it is used
#else
// Without AVX-512 GCC keeps a 64-byte vector type in memory, every operation a store and a load; two 8-lane halves
// are two registers each, with the same 16 lanes and so the same sums, in the same order.
template <typename V>
struct Halves {
  V lo, hi;
#define ORCINUS_HALVES_OP(op)                                                                   \
  friend Halves operator op(Halves a, Halves b) { return {a.lo op b.lo, a.hi op b.hi}; }       \
  friend Halves operator op(Halves a, int s) { return {a.lo op s, a.hi op s}; }
  ORCINUS_HALVES_OP(+)
  ORCINUS_HALVES_OP(-)
  ORCINUS_HALVES_OP(*)
  ORCINUS_HALVES_OP(&)
  ORCINUS_HALVES_OP(|)
  ORCINUS_HALVES_OP(^)
  ORCINUS_HALVES_OP(>>)
  ORCINUS_HALVES_OP(<<)
#undef ORCINUS_HALVES_OP
  Halves& operator+=(Halves b) { return *this = *this + b; }
};
typedef Halves<v8> v16;
typedef Halves<i32x8> i32x16;

// Sixteen registers, a v16 in two: 12 accumulators, 2 weights and a row of x; the direct tiles' decoded weights take
// four registers an output.
constexpr int kTileN = 2;
constexpr int kTileM = 3;
constexpr int kDirectWide = 2;
constexpr int kDirectRows = 4;
#endif

constexpr int kLanes = 16;
constexpr int64_t kPanelBytes = 128 * 1024;  // a panel of decoded weights (float32) is sized to stay in L2

// A register's worth of a v16's lanes: the tiles keep their accumulators and weights as kParts registers a v16, in
// arrays the compiler keeps in registers (it does not for arrays of a two-register struct).
#ifdef __AVX512F__
typedef v16 vreg;
constexpr int kParts = 1;
inline vreg part(v16 v, int) { return v; }
#else
typedef v8 vreg;
constexpr int kParts = 2;
inline vreg part(v16 v, int p) { return p ? v.hi : v.lo; }
#endif
constexpr int kRegLanes = 16 / kParts;

inline vreg load_reg(const float* p) {
  vreg v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline v16 load16(const float* p) {
#ifdef __AVX512F__
  return load_reg(p);
#else
  return {load_reg(p), load_reg(p + 8)};
#endif
}

// One load per row, not one memory operand per output (loads would bound the loop). Where a vreg is no one register
// (x86 without AVX, other machines) the compiler's choice stands.
inline void keep_in_register(vreg& v) {
#if defined(__AVX512F__) || defined(__AVX__)
  asm("" : "+v"(v));
#else
  (void)v;
#endif
}

// An output's 16 partial sums (kParts registers) in one fixed order: halves, quarters, eighths, pairs.
inline float hsum(const vreg (&v)[kParts]) {
#ifdef __AVX512F__
  v8 a = low8(v[0]) + high8(v[0]);
#else
  v8 a = v[0] + v[1];
#endif
  v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  float c0 = b[0] + b[2], c1 = b[1] + b[3];
  return c0 + c1;
}

inline float half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(bits);  // one instruction; c10::Half's portable conversion is a dozen
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// ---------------------------------------------------------------- block decoders (gguf-py's dequantize_blocks)

// Sixteen codes of a block as floats: bytes zero- or sign-extended, the low or the high nibble.

// GCC lowers __builtin_convertvector from bytes to a scalar loop; the widening loads are one instruction each.
inline i32x16 bytes16(const uint8_t* p) {
#ifdef __AVX512F__
  return reinterpret_cast<i32x16>(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {reinterpret_cast<i32x8>(_mm256_cvtepu8_epi32(b)),
          reinterpret_cast<i32x8>(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)))};
#else
  typedef uint8_t u8x8 __attribute__((vector_size(8)));
  u8x8 lo, hi;
  std::memcpy(&lo, p, 8);
  std::memcpy(&hi, p + 8, 8);
  return {__builtin_convertvector(lo, i32x8), __builtin_convertvector(hi, i32x8)};
#endif
}

inline v16 signed16(const uint8_t* p) {
#ifdef __AVX512F__
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {reinterpret_cast<v8>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b))),
          reinterpret_cast<v8>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))))};
#else
  typedef int8_t i8x8 __attribute__((vector_size(8)));
  i8x8 lo, hi;
  std::memcpy(&lo, p, 8);
  std::memcpy(&hi, p + 8, 8);
  return {__builtin_convertvector(__builtin_convertvector(lo, i32x8), v8),
          __builtin_convertvector(__builtin_convertvector(hi, i32x8), v8)};
#endif
}

// Not v16{} + f, which turns a -0 scale into +0; and not _mm512_set1_ps, which GCC 12 sometimes lowers to sixteen
// masked inserts.
inline v16 splat(float f) {
#ifdef __AVX512F__
  return _mm512_broadcastss_ps(_mm_set_ss(f));
#elif defined(__AVX2__)
  const v8 v = reinterpret_cast<v8>(_mm256_broadcastss_ps(_mm_set_ss(f)));
  return {v, v};
#else
  v8 v;
  for (int i = 0; i < 8; ++i) v[i] = f;
  return {v, v};
#endif
}

#ifdef __AVX512F__
inline v16 floats(i32x16 q) { return __builtin_convertvector(q, v16); }
#else
inline v16 floats(i32x16 q) { return {__builtin_convertvector(q.lo, v8), __builtin_convertvector(q.hi, v8)}; }
#endif

inline void put16(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }

inline i32x16 splat_int(int32_t v) {
#ifdef __AVX512F__
  return reinterpret_cast<i32x16>(_mm512_set1_epi32(v));
#else
  return {i32x8{} + v, i32x8{} + v};
#endif
}

// Q5_0 and Q5_1's fifth bits, 16 of them from bit `first` of qh, at bit 4.
inline i32x16 fifth_bits(uint32_t qh, int first) {
#ifdef __AVX512F__
  const i32x16 shifts = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#else
  const i32x16 shifts = {i32x8{0, 1, 2, 3, 4, 5, 6, 7}, i32x8{8, 9, 10, 11, 12, 13, 14, 15}};
#endif
  return ((splat_int(static_cast<int32_t>(qh >> first)) >> shifts) & 1) << 4;
}

// The 32-weight formats decode straight into two registers (`regs`), so few rows can use them without a store;
// the 256-weight K-quants decode into memory (`decode`).
#ifdef __AVX512F__
// A 4-bit block holds at most 16 distinct weights: d * i (+ m), or d * (i - 8), for codes i = 0..15. They are computed
// once a block, in one register, exactly as the decoder below computes each weight, and each code picks its weight with
// a permute (which reads only an index's low 4 bits: the low nibble needs no mask). Two permutes replace a mask, two
// conversions and two multiply-adds for every 32 weights, and the weights are the same bits.
inline v16 codes16() { return v16{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}; }

// A block's float16 scale in every lane: a broadcast load and one conversion (not an insert, a conversion and a
// broadcast).
inline v16 splat_half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return reinterpret_cast<v16>(_mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(bits))));
}

// Q4_1's scale d and minimum m, side by side in the block, each in every lane: one broadcast load of both, one
// conversion, then each duplicated from its even or odd lanes.
inline void splat_halves(const uint8_t* p, v16& d, v16& m) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m512 both = _mm512_cvtph_ps(_mm256_set1_epi32(static_cast<int>(bits)));
  d = reinterpret_cast<v16>(_mm512_moveldup_ps(both));
  m = reinterpret_cast<v16>(_mm512_movehdup_ps(both));
}

inline void pick(v16 table, const uint8_t* codes, v16 (&w)[2]) {
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  w[0] = reinterpret_cast<v16>(_mm512_permutexvar_ps(q, reinterpret_cast<__m512>(table)));
  w[1] = reinterpret_cast<v16>(_mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), reinterpret_cast<__m512>(table)));
}
#endif

struct Q4_0 {
  static constexpr int kSize = 32, kBytes = 18;
  static constexpr bool kRegs = true;
  static void regs(const uint8_t* b, v16 (&w)[2]) {
#ifdef __AVX512F__
    pick(splat_half(b) * (codes16() - 8), b + 2, w);
#else
    const v16 d = splat(half(b));
    const i32x16 q = bytes16(b + 2);
    w[0] = d * floats((q & 15) - 8);
    w[1] = d * floats((q >> 4) - 8);
#endif
  }
};

struct Q4_1 {
  static constexpr int kSize = 32, kBytes = 20;
  static constexpr bool kRegs = true;
  static void regs(const uint8_t* b, v16 (&w)[2]) {
#ifdef __AVX512F__
    v16 d, m;
    splat_halves(b, d, m);
    pick(d * codes16() + m, b + 4, w);
#else
    const v16 d = splat(half(b)), m = splat(half(b + 2));
    const i32x16 q = bytes16(b + 4);
    w[0] = d * floats(q & 15) + m;
    w[1] = d * floats(q >> 4) + m;
#endif
  }
};

struct Q5_0 {
  static constexpr int kSize = 32, kBytes = 22;
  static constexpr bool kRegs = true;
  static void regs(const uint8_t* b, v16 (&w)[2]) {
    const v16 d = splat(half(b));
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    const i32x16 q = bytes16(b + 6);
    w[0] = d * floats(((q & 15) | fifth_bits(qh, 0)) - 16);
    w[1] = d * floats(((q >> 4) | fifth_bits(qh, 16)) - 16);
  }
};

struct Q5_1 {
  static constexpr int kSize = 32, kBytes = 24;
  static constexpr bool kRegs = true;
  static void regs(const uint8_t* b, v16 (&w)[2]) {
    const v16 d = splat(half(b)), m = splat(half(b + 2));
    uint32_t qh;
    std::memcpy(&qh, b + 4, 4);
    const i32x16 q = bytes16(b + 8);
    w[0] = d * floats((q & 15) | fifth_bits(qh, 0)) + m;
    w[1] = d * floats((q >> 4) | fifth_bits(qh, 16)) + m;
  }
};

struct Q8_0 {
  static constexpr int kSize = 32, kBytes = 34;
  static constexpr bool kRegs = true;
  static void regs(const uint8_t* b, v16 (&w)[2]) {
#ifdef __AVX512F__
    const v16 d = splat_half(b);
#else
    const v16 d = splat(half(b));
#endif
    w[0] = signed16(b + 2) * d;
    w[1] = signed16(b + 18) * d;
  }
};

// Float weights as "blocks" of 32 (ggml's F32, F16 and BF16): --batch-invariant runs dense layers through the same
// sums as the quantized ones.
struct F32 {
  static constexpr int kSize = 32, kBytes = 128;
  static constexpr bool kRegs = true;
  static void regs(const uint8_t* b, v16 (&w)[2]) {
    w[0] = load16(reinterpret_cast<const float*>(b));
    w[1] = load16(reinterpret_cast<const float*>(b) + 16);
  }
};

struct F16 {
  static constexpr int kSize = 32, kBytes = 64;
  static constexpr bool kRegs = true;
  static void regs(const uint8_t* b, v16 (&w)[2]) {
    for (int h = 0; h < 2; ++h) {
#ifdef __AVX512F__
      w[h] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 * h)));
#elif defined(__F16C__)
      const uint8_t* p = b + 32 * h;
      w[h] = {reinterpret_cast<v8>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))),
              reinterpret_cast<v8>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))))};
#else
      float f[kLanes];
      for (int i = 0; i < kLanes; ++i) f[i] = half(b + 2 * (h * kLanes + i));
      w[h] = load16(f);
#endif
    }
  }
};

struct BF16 {
  static constexpr int kSize = 32, kBytes = 64;
  static constexpr bool kRegs = true;
  static void regs(const uint8_t* b, v16 (&w)[2]) {
    for (int h = 0; h < 2; ++h) {  // bfloat16 is float32's top half
#ifdef __AVX512F__
      const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 * h)));
      w[h] = reinterpret_cast<v16>(_mm512_slli_epi32(bits, 16));
#else
      typedef uint16_t u16x8 __attribute__((vector_size(16)));
      u16x8 lo, hi;
      std::memcpy(&lo, b + 32 * h, 16);
      std::memcpy(&hi, b + 32 * h + 16, 16);
      w[h] = {reinterpret_cast<v8>(__builtin_convertvector(lo, i32x8) << 16),
              reinterpret_cast<v8>(__builtin_convertvector(hi, i32x8) << 16)};
#endif
    }
  }
};

// Q2_K, Q3_K and Q6_K decode 16 weights at a time (GCC vectorizes none of their scalar loops), each product
// in the order gguf-py's dequantization writes it: a group's scale (d times its integer scale, exact in float32)
// times the code, less the group's minimum where there is one. Q4_K's and Q5_K's loops GCC vectorizes as they are.

struct Q2_K {  // scales[16], qs[64], d, dmin; 16 groups of 16
  static constexpr int kSize = 256, kBytes = 84;
  static constexpr bool kRegs = false;
  static void decode(const uint8_t* b, float* w) {
    const uint8_t *scales = b, *qs = b + 16;
    const float d = half(b + 80), dmin = half(b + 82);
    for (int s = 0; s < 16; ++s) {  // weights 16s .. 16s+15: qs[32i + l], bits 2j, for i = s / 8, j = s / 2 % 4
      const v16 dl = splat(d * static_cast<float>(scales[s] & 15));
      const v16 ml = splat(dmin * static_cast<float>(scales[s] >> 4));
      const i32x16 q = (bytes16(qs + (s / 8) * 32 + (s % 2) * 16) >> (2 * (s / 2 % 4))) & 3;
      put16(w + 16 * s, dl * floats(q) - ml);
    }
  }
};

struct Q3_K {  // hmask[32], qs[64], scales[12], d; 16 groups of 16
  static constexpr int kSize = 256, kBytes = 110;
  static constexpr bool kRegs = false;
  static void decode(const uint8_t* b, float* w) {
    const uint8_t *hmask = b, *qs = b + 32, *sc = b + 96;
    const float d = half(b + 108);
    for (int s = 0; s < 16; ++s) {
      const int low = (sc[s % 8] >> (4 * (s / 8))) & 15, high = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
      const v16 dl = splat(d * static_cast<float>(static_cast<int>(static_cast<int8_t>(low | (high << 4))) - 32));
      const int l0 = (s % 2) * 16;  // weights 16s .. 16s+15: codes as Q2_K's, the high bit from hmask[l], bit s / 2
      const i32x16 q = (bytes16(qs + (s / 8) * 32 + l0) >> (2 * (s / 2 % 4))) & 3;
      const i32x16 h = ((bytes16(hmask + l0) >> (s / 2)) & 1) ^ 1;
      put16(w + 16 * s, dl * floats(q - (h << 2)));
    }
  }
};

// Q4_K's and Q5_K's 6-bit scales and minimums for their 8 groups of 32.
inline void k_scale_min(const uint8_t* s, int group, int* sc, int* mn) {
  if (group < 4) {
    *sc = s[group] & 63;
    *mn = s[group + 4] & 63;
  } else {
    *sc = (s[group + 4] & 15) | ((s[group - 4] >> 2) & 0x30);
    *mn = (s[group + 4] >> 4) | ((s[group] >> 2) & 0x30);
  }
}

struct Q4_K {  // d, dmin, scales[12], qs[128]
  static constexpr int kSize = 256, kBytes = 144;
  static constexpr bool kRegs = false;
  static void decode(const uint8_t* b, float* w) {
    const float d = half(b), dmin = half(b + 2);
    const uint8_t *scales = b + 4, *qs = b + 16;
    for (int g = 0; g < 8; ++g) {
      int sc, mn;
      k_scale_min(scales, g, &sc, &mn);
      const float dg = d * static_cast<float>(sc), mg = dmin * static_cast<float>(mn);
      const int i = g / 2, j = g % 2;
      for (int l = 0; l < 32; ++l) w[g * 32 + l] = dg * static_cast<float>((qs[i * 32 + l] >> (4 * j)) & 15) - mg;
    }
  }
};

struct Q5_K {  // d, dmin, scales[12], qh[32], qs[128]
  static constexpr int kSize = 256, kBytes = 176;
  static constexpr bool kRegs = false;
  static void decode(const uint8_t* b, float* w) {
    const float d = half(b), dmin = half(b + 2);
    const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + 48;
    for (int g = 0; g < 8; ++g) {
      int sc, mn;
      k_scale_min(scales, g, &sc, &mn);
      const float dg = d * static_cast<float>(sc), mg = dmin * static_cast<float>(mn);
      const int i = g / 2, j = g % 2;
      for (int l = 0; l < 32; ++l) {
        const int q = ((qs[i * 32 + l] >> (4 * j)) & 15) | (((qh[l] >> g) & 1) << 4);
        w[g * 32 + l] = dg * static_cast<float>(q) - mg;
      }
    }
  }
};

struct Q6_K {  // ql[128], qh[64], scales[16] (int8), d; 16 groups of 16
  static constexpr int kSize = 256, kBytes = 210;
  static constexpr bool kRegs = false;
  static void decode(const uint8_t* b, float* w) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half(b + 208);
    for (int s = 0; s < 16; ++s) {  // weights 16s ..: i = s / 8, r = 16 (s % 8) in the half's 128
      const int i = s / 8, r = 16 * (s % 8);
      const i32x16 low = (bytes16(ql + i * 64 + r % 64) >> (4 * (r / 64))) & 15;
      const i32x16 high = (bytes16(qh + i * 32 + r % 32) >> (2 * (r / 32))) & 3;
      put16(w + 16 * s, splat(d * static_cast<float>(scales[s])) * floats((low | (high << 4)) - 32));
    }
  }
};

template <typename B>
inline void decode(const uint8_t* b, float* w) {
  if constexpr (B::kRegs) {
    v16 r[2];
    B::regs(b, r);
    put16(w, r[0]);
    put16(w + 16, r[1]);
  } else {
    B::decode(b, w);
  }
}

// ---------------------------------------------------------------- the matmul

inline void store(float* p, float v) { *p = v; }
inline void store(at::BFloat16* p, float v) { *p = at::BFloat16(v); }  // round to nearest even

// out[r][n] = x row r . w row n for R rows and NB outputs: lane-wise sums over k in order, then hsum.
template <int R, int NB, typename T>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t k, T* out, int64_t ldo) {
  vreg acc[R][NB][kParts] = {};
  for (int64_t i = 0; i < k; i += kLanes)
    for (int p = 0; p < kParts; ++p) {
      const int64_t j = i + p * kRegLanes;
      vreg wv[NB];
      for (int n = 0; n < NB; ++n) wv[n] = load_reg(w + n * k + j);
      for (int r = 0; r < R; ++r) {
        vreg xv = load_reg(x + r * ldx + j);
        keep_in_register(xv);
        for (int n = 0; n < NB; ++n) acc[r][n][p] += xv * wv[n];
      }
    }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NB; ++n) store(out + r * ldo + n, hsum(acc[r][n]));
}

template <int NB, typename T, int R = kTileM>
inline void tile_rows(int64_t rows, const float* x, int64_t ldx, const float* w, int64_t k, T* out, int64_t ldo) {
  if constexpr (R > 1) {
    if (rows < R) return tile_rows<NB, T, R - 1>(rows, x, ldx, w, k, out, ldo);
  }
  tile<R, NB>(x, ldx, w, k, out, ldo);
}

template <typename T>
inline void tile_any(int64_t rows, int64_t cols, const float* x, int64_t ldx, const float* w, int64_t k, T* out,
                     int64_t ldo) {
  switch (cols) {
    case 1: tile_rows<1>(rows, x, ldx, w, k, out, ldo); break;
    case 2: tile_rows<2>(rows, x, ldx, w, k, out, ldo); break;
    case 3: tile_rows<3>(rows, x, ldx, w, k, out, ldo); break;
    default: tile_rows<4>(rows, x, ldx, w, k, out, ldo); break;
  }
}

// A few rows of a 32-weight format: each block is decoded into registers and used at once, no store between. The
// sums run in the same order as tile's.
template <typename B, int R, int NB, typename T>
inline void direct_tile(const float* x, int64_t ldx, const uint8_t* blocks, int64_t row_bytes, int64_t k, T* out,
                        int64_t ldo) {
  vreg acc[R][NB][kParts] = {};
  for (int64_t kb = 0; kb < k / B::kSize; ++kb) {
    vreg w[NB][2][kParts];
    for (int n = 0; n < NB; ++n) {
      v16 decoded[2];
      B::regs(blocks + n * row_bytes + kb * B::kBytes, decoded);
      for (int h = 0; h < 2; ++h)
        for (int p = 0; p < kParts; ++p) w[n][h][p] = part(decoded[h], p);
    }
    for (int h = 0; h < 2; ++h)
      for (int p = 0; p < kParts; ++p)
        for (int r = 0; r < R; ++r) {
          vreg xv = load_reg(x + r * ldx + kb * B::kSize + h * kLanes + p * kRegLanes);
          keep_in_register(xv);
          for (int n = 0; n < NB; ++n) acc[r][n][p] += xv * w[n][h][p];
        }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NB; ++n) store(out + r * ldo + n, hsum(acc[r][n]));
}

template <typename B, int NB, typename T, int R>
inline void direct_rows(int64_t rows, const float* x, int64_t ldx, const uint8_t* blocks, int64_t row_bytes,
                        int64_t k, T* out, int64_t ldo) {
  if constexpr (R > 1) {
    if (rows < R) return direct_rows<B, NB, T, R - 1>(rows, x, ldx, blocks, row_bytes, k, out, ldo);
  }
  direct_tile<B, R, NB>(x, ldx, blocks, row_bytes, k, out, ldo);
}

// Whether a unit of work decodes a panel of weights into memory (else its blocks decode into registers).
template <typename B>
bool decodes_a_panel(int64_t m) {
  return !(B::kRegs && m <= kDirectRows);
}

// Outputs per unit of work: a register tile's width where blocks decode into registers (kDirectWide outputs for up to
// half of kDirectRows rows, half as many for up to kDirectRows), else a panel of decoded weights sized for L2.
template <typename B>
int64_t unit_outputs(int64_t m, int64_t k) {
  if constexpr (B::kRegs) {
    if (m <= kDirectRows / 2) return kDirectWide;
    if (m <= kDirectRows) return kDirectWide / 2;
  }
  return std::max<int64_t>(kTileN, kPanelBytes / (k * 4) / kTileN * kTileN);
}

// NB outputs of a few rows, from registers.
template <typename B, int NB, int R, typename T>
void direct_unit(const float* x, int64_t m, int64_t k, const uint8_t* blocks, int64_t n, int64_t n0, T* out,
                 int64_t ldo) {
  const int64_t row_bytes = k / B::kSize * B::kBytes;
  const uint8_t* src = blocks + n0 * row_bytes;
  // A tile reads its rows side by side, block by block, which the prefetchers follow poorly: ask for the rows 16
  // ahead (~6-10 KB: far enough to hide a read from memory behind the tiles between).
  if (n0 + 16 + NB <= n)
    for (int64_t off = 0; off < NB * row_bytes; off += 64) __builtin_prefetch(src + 16 * row_bytes + off);
  const int64_t cols = std::min<int64_t>(NB, n - n0);
  if (cols == NB) direct_rows<B, NB, T, R>(m, x, k, src, row_bytes, k, out + n0, ldo);
  else if (cols == 1) direct_rows<B, 1, T, R>(m, x, k, src, row_bytes, k, out + n0, ldo);
  else if (cols == 2) direct_rows<B, 2 < NB ? 2 : 1, T, R>(m, x, k, src, row_bytes, k, out + n0, ldo);
  else direct_rows<B, 3 < NB ? 3 : 1, T, R>(m, x, k, src, row_bytes, k, out + n0, ldo);
}

// A panel of outputs decoded once into `w` (64-byte aligned, room for the panel), then every row tile over it.
template <typename B, typename T>
void panel_unit(const float* x, int64_t m, int64_t k, const uint8_t* blocks, int64_t n, int64_t p0, int64_t panel,
                float* w, T* out, int64_t ldo) {
  const int64_t row_bytes = k / B::kSize * B::kBytes, width = std::min(panel, n - p0);
  const uint8_t* src = blocks + p0 * row_bytes;
  for (int64_t b = 0; b < width * (k / B::kSize); ++b) decode<B>(src + b * B::kBytes, w + b * B::kSize);
  for (int64_t r0 = 0; r0 < m; r0 += kTileM)
    for (int64_t c0 = 0; c0 < width; c0 += kTileN)
      tile_any(std::min<int64_t>(kTileM, m - r0), std::min<int64_t>(kTileN, width - c0), x + r0 * k, k, w + c0 * k,
               k, out + r0 * ldo + p0 + c0, ldo);
}

template <typename B, typename T>
void run_unit(const float* x, int64_t m, int64_t k, const uint8_t* blocks, int64_t n, int64_t unit, float* w, T* out,
              int64_t ldo) {
  const int64_t width = unit_outputs<B>(m, k);
  if constexpr (B::kRegs) {
    const int64_t n0 = unit * width;
    if (m <= kDirectRows / 2) return direct_unit<B, kDirectWide, kDirectRows / 2>(x, m, k, blocks, n, n0, out, ldo);
    if (m <= kDirectRows) return direct_unit<B, kDirectWide / 2, kDirectRows>(x, m, k, blocks, n, n0, out, ldo);
  }
  panel_unit<B>(x, m, k, blocks, n, unit * width, width, w, out, ldo);
}

// ggml's type ids (gguf.GGMLQuantizationType) of the block formats decoded here.
template <typename Fn>
void dispatch(int64_t type, Fn fn) {
  switch (type) {
    case 0: fn(F32{}); break;
    case 1: fn(F16{}); break;
    case 30: fn(BF16{}); break;
    case 2: fn(Q4_0{}); break;
    case 3: fn(Q4_1{}); break;
    case 6: fn(Q5_0{}); break;
    case 7: fn(Q5_1{}); break;
    case 8: fn(Q8_0{}); break;
    case 10: fn(Q2_K{}); break;
    case 11: fn(Q3_K{}); break;
    case 12: fn(Q4_K{}); break;
    case 13: fn(Q5_K{}); break;
    case 14: fn(Q6_K{}); break;
    default: TORCH_CHECK(false, "no block decoder for ggml type ", type);
  }
}

// A layer's weight as one or more parts (a fused Q/K/V's three tensors, each in its own type): their rows stack.
struct Part {
  const uint8_t* blocks;
  int64_t type, rows, col;  // ggml type, outputs, and the first output column it writes
};

// Below this many multiply-adds a call runs on the calling thread: a parallel region costs a thread wake-up, which
// on a busy machine is a scheduler tick, not microseconds.
constexpr int64_t kParallelMacs = 1 << 16;

template <typename T>
void run_parts(const float* x, int64_t m, int64_t k, const std::vector<Part>& parts, T* out, int64_t ldo) {
  std::vector<int64_t> first(parts.size() + 1, 0);  // each part's first unit of work
  int64_t panel_floats = 0, outputs = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    dispatch(parts[i].type, [&](auto block) {
      const int64_t width = unit_outputs<decltype(block)>(m, k);
      first[i + 1] = first[i] + (parts[i].rows + width - 1) / width;
      // Not `width > 4`: a panel is a single tile's width where K is wide (K-quants past 8192 inputs).
      if (decodes_a_panel<decltype(block)>(m)) panel_floats = std::max(panel_floats, width * k);
    });
    outputs += parts[i].rows;
  }
  const int64_t units = first.back();
  const int64_t grain = std::max<int64_t>(1, kParallelMacs * units / std::max<int64_t>(1, m * k * outputs));
  at::parallel_for(0, units, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(panel_floats ? panel_floats + kLanes : 0);
    float* w = buffer.data() + (-reinterpret_cast<intptr_t>(buffer.data()) / 4 & (kLanes - 1));  // 64-byte aligned
    size_t i = std::upper_bound(first.begin(), first.end(), begin) - first.begin() - 1;
    for (int64_t u = begin; u < end; ++u) {
      while (u >= first[i + 1]) ++i;
      const Part& p = parts[i];
      dispatch(p.type, [&](auto block) {
        run_unit<decltype(block)>(x, m, k, p.blocks, p.rows, u - first[i], w, out + p.col, ldo);
      });
    }
  });
}

template <typename B>
void check_blocks(const at::Tensor& blocks, int64_t k) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.is_contiguous() && blocks.scalar_type() == at::kByte,
              "blocks must be a contiguous uint8 [N, row bytes] tensor");
  TORCH_CHECK(k % B::kSize == 0, "the input width ", k, " is not a whole number of ", B::kSize, "-weight blocks");
  TORCH_CHECK(blocks.size(1) == k / B::kSize * B::kBytes, "blocks hold ", blocks.size(1), " bytes a row, not ",
              k / B::kSize * B::kBytes, " for ", k, " inputs");
}

}  // namespace

// out = x @ W^T for W the parts' rows stacked (blocks[i] of ggml type types[i]), summed in float32.
void block_matmul_out(at::Tensor x, std::vector<at::Tensor> blocks, std::vector<int64_t> types,
                      at::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a float32 or bfloat16 [rows, K] tensor");
  TORCH_CHECK(blocks.size() == types.size() && !blocks.empty(), "one type per part, and at least one part");
  const int64_t m = x.size(0), k = x.size(1);
  std::vector<Part> parts;
  int64_t n = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    dispatch(types[i], [&](auto block) { check_blocks<decltype(block)>(blocks[i], k); });
    parts.push_back({blocks[i].data_ptr<uint8_t>(), types[i], blocks[i].size(0), n});
    n += blocks[i].size(0);
  }
  TORCH_CHECK(out.dim() == 2 && out.size(0) == m && out.size(1) == n && out.stride(1) == 1 && out.stride(0) >= n &&
              out.scalar_type() == x.scalar_type(), "out must be [rows, N] of x's dtype with unit column stride");
  if (m == 0 || n == 0) return;
  // bfloat16 inputs widen exactly; float32 ones are read in place.
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  if (out.scalar_type() == at::kFloat)
    run_parts(xf.data_ptr<float>(), m, k, parts, out.data_ptr<float>(), out.stride(0));
  else
    run_parts(xf.data_ptr<float>(), m, k, parts, out.data_ptr<at::BFloat16>(), out.stride(0));
}

// The weights the blocks hold, [N, K] float32: gguf's dequantization, bit for bit.
at::Tensor block_dequantize(at::Tensor blocks, int64_t type, int64_t k) {
  auto out = at::empty({blocks.size(0), k}, at::kFloat);
  dispatch(type, [&](auto block) {
    using B = decltype(block);
    check_blocks<B>(blocks, k);
    const uint8_t* b = blocks.data_ptr<uint8_t>();
    float* w = out.data_ptr<float>();
    at::parallel_for(0, blocks.size(0), 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        for (int64_t kb = 0; kb < k; kb += B::kSize)
          decode<B>(b + r * blocks.size(1) + kb / B::kSize * B::kBytes, w + r * k + kb);
    });
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("block_matmul_out", &block_matmul_out, "out = x @ W^T with W as GGUF blocks in parts (CPU, float32 sums)");
  m.def("block_dequantize", &block_dequantize, "GGUF blocks -> float32 weights (CPU)");
}
