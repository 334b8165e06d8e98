// IEEE binary16 conversions (round to nearest even, subnormals, NaN and infinity preserved).
#include "lockstep/tensor/half.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace lockstep {

float f16_bits_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t u;
  if (exp == 0x1f) {  // inf / NaN: keep the payload; a NaN comes out quiet (as F16C does)
    u = sign | 0x7f800000u | (mant << 13) | (mant != 0 ? 0x00400000u : 0u);
  } else if (exp != 0) {  // normal
    u = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {  // signed zero
    u = sign;
  } else {  // subnormal: value = mant * 2^-24, renormalize
    int shift = 0;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      ++shift;
    }
    mant &= 0x3ffu;
    u = sign | (static_cast<uint32_t>(113 - shift) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t float_to_f16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) {  // NaN: quiet, keep the top payload bits
    return static_cast<uint16_t>(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));
  }
  if (abs >= 0x477ff000u) {  // rounds to >= 65520: infinity
    return static_cast<uint16_t>(sign | 0x7c00u);
  }
  if (abs < 0x38800000u) {  // below the smallest normal (2^-14): subnormal or zero
    // The subnormal value is abs / 2^-24 rounded to nearest even. Build the full 24-bit
    // significand and shift it right by the exponent difference.
    int32_t e = static_cast<int32_t>(abs >> 23);  // biased f32 exponent
    if (e < 102) return sign;                     // < 2^-25: rounds to zero
    uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    int shift = 126 - e;  // 14 + (127 - 1 - e) ... number of bits to drop, in [14, 24]
    uint32_t half_ulp = 1u << (shift - 1);
    uint32_t rest = mant & ((1u << shift) - 1);
    uint32_t q = mant >> shift;
    if (rest > half_ulp || (rest == half_ulp && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  // Normal: rebias the exponent and round the mantissa from 23 to 10 bits.
  uint32_t v = abs - (112u << 23);
  uint32_t lsb = (v >> 13) & 1u;
  v += 0xfffu + lsb;
  return static_cast<uint16_t>(sign | (v >> 13));
}

namespace {

#if defined(__x86_64__)
// 8 values per instruction; the tail goes through the scalar code. vcvtps2ph with
// round-to-nearest-even gives the same bits as float_to_f16_bits (NaNs quieted, payload's top
// bits kept; subnormals; overflow to infinity), which a test checks over every f16 value and a
// sweep of f32 bit patterns.
__attribute__((target("avx,f16c"))) void to_f32_f16c(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) dst[i] = f16_bits_to_float(src[i]);
}

__attribute__((target("avx,f16c"))) void to_f16_f16c(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  for (; i < n; ++i) dst[i] = float_to_f16_bits(src[i]);
}

// f32 -> bf16 on 8 lanes, bit for bit float_to_bf16_bits: round to nearest even by adding
// 0x7fff plus the kept lowest bit, a NaN kept NaN and made quiet instead.
__attribute__((target("avx2"))) void to_bf16_avx2(const float* src, uint16_t* dst, int64_t n) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
  const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff);
  const __m256i quiet = _mm256_set1_epi32(0x0040);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m256i hi = _mm256_srli_epi32(u, 16);
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(bias, _mm256_and_si256(hi, one))), 16);
    // |u| > inf as signed 32-bit integers (|u| < 2^31) is the NaN test.
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs_mask), inf);
    const __m256i r = _mm256_blendv_epi8(rounded, _mm256_or_si256(hi, quiet), nan);
    // Pack the low 16 bits of the 8 lanes: packus works per 128-bit half, then fix the order.
    const __m256i packed = _mm256_packus_epi32(r, r);
    const __m256i ordered = _mm256_permute4x64_epi64(packed, 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_castsi256_si128(ordered));
  }
  for (; i < n; ++i) dst[i] = float_to_bf16_bits(src[i]);
}

__attribute__((target("avx2"))) void to_f32_from_bf16_avx2(const uint16_t* src, float* dst,
                                                           int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m256i u = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), u);
  }
  for (; i < n; ++i) dst[i] = bf16_bits_to_float(src[i]);
}

bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}

bool has_f16c() {
  static const bool yes = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
  return yes;
}
#endif

}  // namespace

void f16_bits_to_float_n(const uint16_t* src, float* dst, int64_t n) {
#if defined(__x86_64__)
  if (has_f16c()) return to_f32_f16c(src, dst, n);
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = f16_bits_to_float(src[i]);
}

void float_to_f16_bits_n(const float* src, uint16_t* dst, int64_t n) {
#if defined(__x86_64__)
  if (has_f16c()) return to_f16_f16c(src, dst, n);
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = float_to_f16_bits(src[i]);
}

void bf16_bits_to_float_n(const uint16_t* src, float* dst, int64_t n) {
#if defined(__x86_64__)
  if (has_avx2()) return to_f32_from_bf16_avx2(src, dst, n);
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_bits_to_float(src[i]);
}

void float_to_bf16_bits_n(const float* src, uint16_t* dst, int64_t n) {
#if defined(__x86_64__)
  if (has_avx2()) return to_bf16_avx2(src, dst, n);
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = float_to_bf16_bits(src[i]);
}

}  // namespace lockstep
