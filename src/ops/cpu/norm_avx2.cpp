// layer_norm's f32 rows, forward and backward, on AVX2 lanes (Note [layer_norm on AVX2]).
#include "ops/cpu/norm_avx2.h"

#include <atomic>
#include <cmath>

#include "ops/cpu/avx2_math.h"

namespace lockstep::cpu {

// Note [layer_norm on AVX2]
// GPT's layer norms are rows of n_embd (128) floats, and their f64 row sums (sum4 in norm.cpp:
// four interleaved f64 sums, for precision and latency) compiled to scalar or 2-lane code: the
// forward and backward were 3.5% of an f32 train_gpt step. Here the four sums are the four f64
// lanes of one register, fed 4 floats at a time in the same order (the last n % 4 go to lane 0
// after the loop, as in sum4, and the lanes combine as (a0 + a1) + (a2 + a3)); the f32
// elementwise parts run 8 lanes wide with the same operations in the same order. The target
// has AVX2 but not FMA, and contraction is off, so nothing is fused into a multiply-add: every
// result has the bits of the portable loops, which the tests check with set_layer_norm_avx2.

namespace {

std::atomic<bool> g_enabled{true};

}  // namespace

void set_layer_norm_avx2(bool enabled) { g_enabled.store(enabled, std::memory_order_relaxed); }

#if LS_HAVE_AVX2

#if defined(__GNUC__) && !defined(__clang__)
#define LS_LN_AVX2 gnu::target("avx2"), gnu::optimize("fp-contract=off")
#else
#define LS_LN_AVX2 gnu::target("avx2")
#endif

bool layer_norm_avx2_enabled() {
  return cpu_has_avx2() && g_enabled.load(std::memory_order_relaxed);
}

namespace {

// The four lanes combined as sum4 does, plus the tail (already added to lane 0 by the caller).
[[LS_LN_AVX2]] inline double combine(__m256d acc) {
  alignas(32) double a[4];
  _mm256_store_pd(a, acc);
  return (a[0] + a[1]) + (a[2] + a[3]);
}

[[LS_LN_AVX2]] inline __m256d add_lane0(__m256d acc, double v) {
  return _mm256_add_pd(acc, _mm256_setr_pd(v, 0.0, 0.0, 0.0));
}

}  // namespace

[[LS_LN_AVX2]] void layer_norm_row_f32_avx2(float* y, float* mean, float* rstd, const float* x,
                                            const float* w, const float* b, int64_t n, double eps) {
  const int64_t n4 = n / 4 * 4;
  __m256d acc = _mm256_setzero_pd();
  for (int64_t i = 0; i < n4; i += 4)
    acc = _mm256_add_pd(acc, _mm256_cvtps_pd(_mm_loadu_ps(x + i)));
  for (int64_t i = n4; i < n; ++i) acc = add_lane0(acc, static_cast<double>(x[i]));
  const double mu_d = combine(acc) / static_cast<double>(n);
  const __m256d mu4 = _mm256_set1_pd(mu_d);
  acc = _mm256_setzero_pd();
  for (int64_t i = 0; i < n4; i += 4) {
    const __m256d d = _mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(x + i)), mu4);
    acc = _mm256_add_pd(acc, _mm256_mul_pd(d, d));
  }
  for (int64_t i = n4; i < n; ++i) {
    const double d = static_cast<double>(x[i]) - mu_d;
    acc = add_lane0(acc, d * d);
  }
  const double rstd_d = 1.0 / std::sqrt(combine(acc) / static_cast<double>(n) + eps);
  *mean = static_cast<float>(mu_d);
  *rstd = static_cast<float>(rstd_d);
  const float mu = *mean, rs = *rstd;
  const __m256 mu8 = _mm256_set1_ps(mu), rs8 = _mm256_set1_ps(rs);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), mu8), rs8);
    if (w) v = _mm256_mul_ps(v, _mm256_loadu_ps(w + i));
    if (b) v = _mm256_add_ps(v, _mm256_loadu_ps(b + i));
    _mm256_storeu_ps(y + i, v);
  }
  for (; i < n; ++i) {
    float v = (x[i] - mu) * rs;
    if (w) v *= w[i];
    if (b) v += b[i];
    y[i] = v;
  }
}

[[LS_LN_AVX2]] void layer_norm_backward_row_f32_avx2(float* dx, double* dw_acc, double* db_acc,
                                                     const float* g, const float* x, const float* w,
                                                     float mean, float rstd, int64_t n) {
  const __m256 mu8 = _mm256_set1_ps(mean), rs8 = _mm256_set1_ps(rstd);
  const int64_t n4 = n / 4 * 4;
  if (dw_acc) {
    int64_t i = 0;
    for (; i < n4; i += 4) {
      const __m128 gi = _mm_loadu_ps(g + i);
      const __m128 xhat = _mm_mul_ps(_mm_sub_ps(_mm_loadu_ps(x + i), _mm256_castps256_ps128(mu8)),
                                     _mm256_castps256_ps128(rs8));
      _mm256_storeu_pd(dw_acc + i, _mm256_add_pd(_mm256_loadu_pd(dw_acc + i),
                                                 _mm256_cvtps_pd(_mm_mul_ps(gi, xhat))));
      _mm256_storeu_pd(db_acc + i, _mm256_add_pd(_mm256_loadu_pd(db_acc + i), _mm256_cvtps_pd(gi)));
    }
    for (; i < n; ++i) {
      const float xhat = (x[i] - mean) * rstd;
      dw_acc[i] += static_cast<double>(g[i] * xhat);
      db_acc[i] += static_cast<double>(g[i]);
    }
  }
  if (!dx) return;
  // sum4 of wg and of wg * xhat, as f64 lanes.
  __m256d s_wg = _mm256_setzero_pd(), s_wgx = _mm256_setzero_pd();
  for (int64_t i = 0; i < n4; i += 4) {
    __m128 wg = _mm_loadu_ps(g + i);
    if (w) wg = _mm_mul_ps(wg, _mm_loadu_ps(w + i));
    const __m128 xhat = _mm_mul_ps(_mm_sub_ps(_mm_loadu_ps(x + i), _mm256_castps256_ps128(mu8)),
                                   _mm256_castps256_ps128(rs8));
    s_wg = _mm256_add_pd(s_wg, _mm256_cvtps_pd(wg));
    s_wgx = _mm256_add_pd(s_wgx, _mm256_cvtps_pd(_mm_mul_ps(wg, xhat)));
  }
  for (int64_t i = n4; i < n; ++i) {
    const float wg = w ? g[i] * w[i] : g[i];
    s_wg = add_lane0(s_wg, static_cast<double>(wg));
    s_wgx = add_lane0(s_wgx, static_cast<double>(wg * ((x[i] - mean) * rstd)));
  }
  const float a = static_cast<float>(combine(s_wg) / static_cast<double>(n));
  const float bb = static_cast<float>(combine(s_wgx) / static_cast<double>(n));
  const __m256 a8 = _mm256_set1_ps(a), b8 = _mm256_set1_ps(bb);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 wg = _mm256_loadu_ps(g + i);
    if (w) wg = _mm256_mul_ps(wg, _mm256_loadu_ps(w + i));
    const __m256 t =
        _mm256_mul_ps(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), mu8), rs8), b8);
    _mm256_storeu_ps(dx + i, _mm256_mul_ps(rs8, _mm256_sub_ps(_mm256_sub_ps(wg, a8), t)));
  }
  for (; i < n; ++i) {
    const float wg = w ? g[i] * w[i] : g[i];
    dx[i] = rstd * (wg - a - (x[i] - mean) * rstd * bb);
  }
}

#else  // not x86-64: the portable loops only

bool layer_norm_avx2_enabled() { return false; }
void layer_norm_row_f32_avx2(float*, float*, float*, const float*, const float*, const float*,
                             int64_t, double) {}
void layer_norm_backward_row_f32_avx2(float*, double*, double*, const float*, const float*,
                                      const float*, float, float, int64_t) {}

#endif

}  // namespace lockstep::cpu
