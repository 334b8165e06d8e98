// AVX2 + FMA building blocks shared by the hand-vectorized f32 kernels (attention_avx2.cpp,
// gelu_avx2.cpp). The library is built for baseline x86-64; these functions carry their own
// target attribute, and callers check cpu_has_avx2() before calling into them.
#pragma once

#include <cstdint>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define LS_HAVE_AVX2 1
#include <immintrin.h>
#define LS_AVX2 __attribute__((target("avx2,fma")))
#define LS_HAVE_AVX512 1
#define LS_AVX512 __attribute__((target("avx512f,avx2,fma")))
#else
#define LS_HAVE_AVX2 0
#define LS_HAVE_AVX512 0
#endif

namespace lockstep::cpu {

#if LS_HAVE_AVX2

// True when this CPU runs AVX2 and FMA.
inline bool cpu_has_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}

// True when this CPU runs AVX-512F (and so AVX2 and FMA) and the OS saves the zmm registers
// (__builtin_cpu_supports checks the XCR0 bits too).
inline bool cpu_has_avx512() {
  static const bool ok = cpu_has_avx2() && __builtin_cpu_supports("avx512f");
  return ok;
}

// e^x on 8 lanes: the range reduction and polynomial of exp_f32 (Note [Vectorized exp] in
// attention.cpp), x clamped to [-87, 88] so 2^n stays a normal float; both clamps keep a NaN
// (vmaxps and vminps return their second operand when either is NaN).
LS_AVX2 inline __m256 exp8(__m256 x) {
  const __m256 kLog2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 kLn2Hi = _mm256_set1_ps(0.693359375f), kLn2Lo = _mm256_set1_ps(-2.12194440e-4f);
  x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);  // NaN stays NaN (the second operand)
  x = _mm256_min_ps(_mm256_set1_ps(88.0f), x);
  const __m256 n =
      _mm256_round_ps(_mm256_mul_ps(x, kLog2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, kLn2Hi, x);
  r = _mm256_fnmadd_ps(n, kLn2Lo, r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 er = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(er, _mm256_castsi256_ps(e));
}

#if LS_HAVE_AVX512
// exp8 on 16 lanes: the same operations in the same order, so each lane's result is exp8's bits
// (vrndscaleps to nearest is vroundps's rounding; vcvtps2dq rounds to nearest in both).
LS_AVX512 inline __m512 exp16(__m512 x) {
  const __m512 kLog2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 kLn2Hi = _mm512_set1_ps(0.693359375f), kLn2Lo = _mm512_set1_ps(-2.12194440e-4f);
  x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);  // NaN stays NaN (the second operand)
  x = _mm512_min_ps(_mm512_set1_ps(88.0f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, kLog2e),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, kLn2Hi, x);
  r = _mm512_fnmadd_ps(n, kLn2Lo, r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 er = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(er, _mm512_castsi512_ps(e));
}
#endif

// 8 bf16 (bit patterns) -> f32, exact.
LS_AVX2 inline __m256 bf16_to_f32_8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// f32 -> 8 bf16 stored at p, bit for bit float_to_bf16_bits (the algorithm of to_bf16_avx2 in
// src/tensor/half.cpp): round to nearest even by adding 0x7fff plus the kept lowest bit; a NaN
// stays NaN and is made quiet. Denormals are rounded, not flushed, unlike vcvtneps2bf16.
LS_AVX2 inline void f32_to_bf16_8(uint16_t* p, __m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i hi = _mm256_srli_epi32(u, 16);
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                           _mm256_and_si256(hi, _mm256_set1_epi32(1)))),
      16);
  // |u| > inf as signed 32-bit integers (|u| < 2^31) is the NaN test.
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  const __m256i r =
      _mm256_blendv_epi8(rounded, _mm256_or_si256(hi, _mm256_set1_epi32(0x0040)), nan);
  // packus works per 128-bit half; the permute puts the two halves' 4 values together.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

#else

inline bool cpu_has_avx2() { return false; }
inline bool cpu_has_avx512() { return false; }

#endif

}  // namespace lockstep::cpu
