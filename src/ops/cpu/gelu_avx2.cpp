// GELU's tanh approximation on 8 f32 lanes, from f32 or bf16 memory (Note [GELU on AVX2]).
#include "ops/cpu/gelu_avx2.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "ops/cpu/avx2_math.h"
#include "tensor/parallel.h"

namespace lockstep::cpu {

// Note [GELU on AVX2]
// GPT's MLP applies GELU to (B, T, 4C) activations, one call of libm's tanhf per element
// forward and backward (tanhf itself calls expm1f). With the rest of a train_gpt step on GEMMs
// and the fused attention, those calls took 42% of its time (perf, 1 thread, the default
// model). Here 0.5 (1 + tanh(u)) is written as the logistic function of 2u, 1 / (1 + e^(-2u)),
// so one exp8 (avx2_math.h) and one division per 8 elements make the forward:
//   y = x s,  s = 1 / (1 + e^(-2u)),  u = sqrt(2 / pi) (x + 0.044715 x^3)
// and the backward, from 1 - tanh(u)^2 = 4 s (1 - s):
//   dx = g (s + 2 x s (1 - s) du/dx),  du/dx = sqrt(2 / pi) (1 + 3 0.044715 x^2).
// Relative error a few f32 ulps (exp8's 1-2 ulps and the rounding of u); the tests compare with
// the f64 formula. exp8 clamps its argument to [-87, 88]; where -2u > 88 (x below about -10)
// s is set to 0, as 1 + tanh(u) is in f32, so y = -0 and dx = 0 there (and NaN for x = -inf or
// where x^2 overflows, as the portable formula gives); for x above about 9, s is 1 and y = x. A NaN
// x gives NaN (exp8 keeps it). The last n % 8 elements go through an 8-float buffer, so they are
// computed by the same lanes as the rest. A bf16 tensor (autocast's MLP) is converted on load and
// rounded on store (avx2_math.h), which gives the bits of the f32 kernel run between a
// .to(kFloat32) and a .to(kBFloat16), without those two passes over memory.
//
// Note [GELU on AVX-512]
// Where the CPU has AVX-512F, f32 GELU runs the same lanes 16 at a time (exp16, the tail under a
// lane mask): the same operations in the same order per lane, so the same bits as the 8-lane
// kernel (tests/ops/elementwise_test.cpp compares them). The loop is bound by its arithmetic,
// not by memory: on the 2-core AMD EPYC (Zen 4) the forward took 0.44 ns per element against
// 0.59 on 8 lanes, at 64K and at 1M elements alike (a /tmp experiment; docs/PERFORMANCE.md).
// Half as many instructions, and the division in particular, are the saving.

namespace {

std::atomic<bool> g_avx512{true};

}  // namespace

bool gelu_avx512_enabled() {
  return cpu_has_avx512() && g_avx512.load(std::memory_order_relaxed);
}

void set_gelu_avx512(bool enabled) { g_avx512.store(enabled, std::memory_order_relaxed); }

#if LS_HAVE_AVX2

namespace {

struct GeluLanes {
  __m256 s, du;  // the logistic of 2u; du/dx (backward only)
};

template <bool kBackward>
LS_AVX2 inline GeluLanes gelu_lanes(__m256 x) {
  const __m256 c = _mm256_set1_ps(0.7978845608028654f);  // sqrt(2 / pi)
  const __m256 k = _mm256_set1_ps(0.044715f);
  const __m256 x2 = _mm256_mul_ps(x, x);
  const __m256 u = _mm256_mul_ps(c, _mm256_fmadd_ps(_mm256_mul_ps(k, x2), x, x));
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 z = _mm256_mul_ps(_mm256_set1_ps(-2.0f), u);
  GeluLanes r;
  r.s = _mm256_div_ps(one, _mm256_add_ps(one, exp8(z)));
  // exp8 stops at e^88, so s would stay ~6e-39 where it is 0 in f32 (tanh(u) = -1 exactly):
  // past that, s = 0, or y and dx would grow like x and x^3 for huge negative x.
  r.s = _mm256_andnot_ps(_mm256_cmp_ps(z, _mm256_set1_ps(88.0f), _CMP_GT_OQ), r.s);
  if constexpr (kBackward)
    r.du = _mm256_mul_ps(c, _mm256_fmadd_ps(_mm256_set1_ps(3 * 0.044715f), x2, one));
  return r;
}

LS_AVX2 inline __m256 forward8(__m256 x) { return _mm256_mul_ps(x, gelu_lanes<false>(x).s); }

LS_AVX2 inline __m256 backward8(__m256 g, __m256 x) {
  const GeluLanes l = gelu_lanes<true>(x);
  const __m256 one = _mm256_set1_ps(1.0f);
  // 2 x s (1 - s) du
  const __m256 t = _mm256_mul_ps(_mm256_mul_ps(_mm256_add_ps(x, x), l.s),
                                 _mm256_mul_ps(_mm256_sub_ps(one, l.s), l.du));
  return _mm256_mul_ps(g, _mm256_add_ps(l.s, t));
}

// f32 or bf16 (uint16_t bit patterns) lanes in memory.
LS_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
LS_AVX2 inline __m256 load8(const uint16_t* p) { return bf16_to_f32_8(p); }
LS_AVX2 inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
LS_AVX2 inline void store8(uint16_t* p, __m256 v) { f32_to_bf16_8(p, v); }

template <typename T>
LS_AVX2 void forward_range(T* y, const T* x, int64_t b, int64_t e) {
  int64_t i = b;
  for (; i + 8 <= e; i += 8) store8(y + i, forward8(load8(x + i)));
  if (i < e) {
    T xb[8] = {}, yb[8];
    const size_t bytes = static_cast<size_t>(e - i) * sizeof(T);
    std::memcpy(xb, x + i, bytes);
    store8(yb, forward8(load8(xb)));
    std::memcpy(y + i, yb, bytes);
  }
}

template <typename T>
LS_AVX2 void backward_range(T* dx, const T* g, const T* x, int64_t b, int64_t e) {
  int64_t i = b;
  for (; i + 8 <= e; i += 8) store8(dx + i, backward8(load8(g + i), load8(x + i)));
  if (i < e) {
    T gb[8] = {}, xb[8] = {}, db[8];
    const size_t bytes = static_cast<size_t>(e - i) * sizeof(T);
    std::memcpy(gb, g + i, bytes);
    std::memcpy(xb, x + i, bytes);
    store8(db, backward8(load8(gb), load8(xb)));
    std::memcpy(dx + i, db, bytes);
  }
}

#if LS_HAVE_AVX512
// GCC 12 warns that its own intrinsics' _mm512_undefined_ps() placeholders are used
// uninitialized when inlined here (GCC bug 105593, fixed in 13); they are not read.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// gelu_lanes on 16 lanes.
template <bool kBackward>
LS_AVX512 inline void gelu_lanes16(__m512 x, __m512* s, __m512* du) {
  const __m512 c = _mm512_set1_ps(0.7978845608028654f);  // sqrt(2 / pi)
  const __m512 k = _mm512_set1_ps(0.044715f);
  const __m512 x2 = _mm512_mul_ps(x, x);
  const __m512 u = _mm512_mul_ps(c, _mm512_fmadd_ps(_mm512_mul_ps(k, x2), x, x));
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 z = _mm512_mul_ps(_mm512_set1_ps(-2.0f), u);
  *s = _mm512_div_ps(one, _mm512_add_ps(one, exp16(z)));
  *s = _mm512_mask_mov_ps(*s, _mm512_cmp_ps_mask(z, _mm512_set1_ps(88.0f), _CMP_GT_OQ),
                          _mm512_setzero_ps());
  if constexpr (kBackward)
    *du = _mm512_mul_ps(c, _mm512_fmadd_ps(_mm512_set1_ps(3 * 0.044715f), x2, one));
}

LS_AVX512 inline __m512 forward16(__m512 x) {
  __m512 s, du;
  gelu_lanes16<false>(x, &s, &du);
  return _mm512_mul_ps(x, s);
}

LS_AVX512 inline __m512 backward16(__m512 g, __m512 x) {
  __m512 s, du;
  gelu_lanes16<true>(x, &s, &du);
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 t = _mm512_mul_ps(_mm512_mul_ps(_mm512_add_ps(x, x), s),
                                 _mm512_mul_ps(_mm512_sub_ps(one, s), du));
  return _mm512_mul_ps(g, _mm512_add_ps(s, t));
}

LS_AVX512 void forward_range16(float* y, const float* x, int64_t b, int64_t e) {
  int64_t i = b;
  for (; i + 16 <= e; i += 16) _mm512_storeu_ps(y + i, forward16(_mm512_loadu_ps(x + i)));
  if (i < e) {
    const __mmask16 m = static_cast<__mmask16>((1u << (e - i)) - 1u);
    _mm512_mask_storeu_ps(y + i, m, forward16(_mm512_maskz_loadu_ps(m, x + i)));
  }
}

LS_AVX512 void backward_range16(float* dx, const float* g, const float* x, int64_t b, int64_t e) {
  int64_t i = b;
  for (; i + 16 <= e; i += 16)
    _mm512_storeu_ps(dx + i, backward16(_mm512_loadu_ps(g + i), _mm512_loadu_ps(x + i)));
  if (i < e) {
    const __mmask16 m = static_cast<__mmask16>((1u << (e - i)) - 1u);
    _mm512_mask_storeu_ps(dx + i, m,
                          backward16(_mm512_maskz_loadu_ps(m, g + i), _mm512_maskz_loadu_ps(m, x + i)));
  }
}
#pragma GCC diagnostic pop
#endif

// Chunks that start on a multiple of 8, so that only the very end takes the buffered tail.
template <typename F>
void for_chunks(int64_t n, const F& f) {
  parallel_for(0, (n + 7) / 8, kElementwiseGrain / 8,
               [&](int64_t b, int64_t e) { f(b * 8, std::min(e * 8, n)); });
}

}  // namespace

bool gelu_tanh_f32_avx2(float* y, const float* x, int64_t n) {
  if (!cpu_has_avx2()) return false;
#if LS_HAVE_AVX512
  if (gelu_avx512_enabled()) {
    for_chunks(n, [&](int64_t b, int64_t e) { forward_range16(y, x, b, e); });
    return true;
  }
#endif
  for_chunks(n, [&](int64_t b, int64_t e) { forward_range(y, x, b, e); });
  return true;
}

bool gelu_tanh_backward_f32_avx2(float* dx, const float* g, const float* x, int64_t n) {
  if (!cpu_has_avx2()) return false;
#if LS_HAVE_AVX512
  if (gelu_avx512_enabled()) {
    for_chunks(n, [&](int64_t b, int64_t e) { backward_range16(dx, g, x, b, e); });
    return true;
  }
#endif
  for_chunks(n, [&](int64_t b, int64_t e) { backward_range(dx, g, x, b, e); });
  return true;
}

bool gelu_tanh_bf16_avx2(uint16_t* y, const uint16_t* x, int64_t n) {
  if (!cpu_has_avx2()) return false;
  for_chunks(n, [&](int64_t b, int64_t e) { forward_range(y, x, b, e); });
  return true;
}

bool gelu_tanh_backward_bf16_avx2(uint16_t* dx, const uint16_t* g, const uint16_t* x, int64_t n) {
  if (!cpu_has_avx2()) return false;
  for_chunks(n, [&](int64_t b, int64_t e) { backward_range(dx, g, x, b, e); });
  return true;
}

#else

bool gelu_tanh_f32_avx2(float*, const float*, int64_t) { return false; }
bool gelu_tanh_backward_f32_avx2(float*, const float*, const float*, int64_t) { return false; }
bool gelu_tanh_bf16_avx2(uint16_t*, const uint16_t*, int64_t) { return false; }
bool gelu_tanh_backward_bf16_avx2(uint16_t*, const uint16_t*, const uint16_t*, int64_t) {
  return false;
}

#endif

}  // namespace lockstep::cpu
