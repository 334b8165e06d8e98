// AVX2 + FMA building blocks shared by the hand-vectorized f32 kernels (attention_avx2.cpp,
// gelu_avx2.cpp). The library is built for baseline x86-64; these functions carry their own
// target attribute, and callers check cpu_has_avx2() before calling into them.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define LS_HAVE_AVX2 1
#include <immintrin.h>
#define LS_AVX2 __attribute__((target("avx2,fma")))
#else
#define LS_HAVE_AVX2 0
#endif

namespace lockstep::cpu {

#if LS_HAVE_AVX2

// True when this CPU runs AVX2 and FMA.
inline bool cpu_has_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
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

#else

inline bool cpu_has_avx2() { return false; }

#endif

}  // namespace lockstep::cpu
