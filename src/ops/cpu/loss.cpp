// The CPU loss kernels: cross_entropy (log-softmax and NLL fused, with ignore_index and label
// smoothing) and mse_loss, with their fused backward kernels.
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "ops/cpu/avx2_math.h"
#include "ops/cpu/kernels.h"
#include "ops/cpu/rows.h"
#include "tensor/dispatch.h"
#include "tensor/parallel.h"

namespace lockstep::cpu {

using detail::TargetCheck;

namespace {

// Counts the targets that are not ignore_index and finds the first outside [0, classes).
TargetCheck check_targets(const Tensor& targets, int64_t classes, int64_t ignore_index) {
  const int64_t* p = targets.data<int64_t>();
  TargetCheck c;
  for (int64_t i = 0; i < targets.numel(); ++i) {
    if (p[i] == ignore_index) continue;
    if (p[i] < 0 || p[i] >= classes) {
      c.bad = {i, p[i]};
      return c;
    }
    ++c.count;
  }
  return c;
}

// Note [Cross-entropy exp]
// A language model's logits are (B * T, V) with V in the hundreds or more, and cross_entropy
// takes one exp per logit forward and one backward: through libm's expf that was 2.5% of an
// f32 train_gpt step (V = 256). Contiguous f32 rows go through exp8 (avx2_math.h, within 1-2
// ulps of expf) instead, 8 logits at a time, and the forward's sums still accumulate in f64.
// exp8 stops at e^-87 where expf underflows to 0; those lanes are set to 0 (so a -inf logit
// still has probability and gradient exactly 0); a NaN stays NaN. Tails of fewer than 8 logits
// use expf. Other dtypes and strided rows keep the scalar loops.
#if LS_HAVE_AVX2
// exp(x - sub) on 8 lanes, 0 where x - sub < -87 (see the Note).
LS_AVX2 inline __m256 exp8_shifted(__m256 x, __m256 sub) {
  const __m256 a = _mm256_sub_ps(x, sub);
  return _mm256_andnot_ps(_mm256_cmp_ps(a, _mm256_set1_ps(-87.0f), _CMP_LT_OQ), exp8(a));
}

// sum_exp += exp(x[i] - mx) and sum_x += x[i] over i < c, in f64; contiguous x.
LS_AVX2 void exp_sums_f32(const float* x, int64_t c, float mx, double* sum_exp, double* sum_x) {
  const __m256 m = _mm256_set1_ps(mx);
  __m256d e0 = _mm256_setzero_pd(), e1 = e0, x0 = e0, x1 = e0;
  int64_t i = 0;
  for (; i + 8 <= c; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 e = exp8_shifted(v, m);
    e0 = _mm256_add_pd(e0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    e1 = _mm256_add_pd(e1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
    x0 = _mm256_add_pd(x0, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
    x1 = _mm256_add_pd(x1, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
  }
  double se[4], sx[4];
  _mm256_storeu_pd(se, _mm256_add_pd(e0, e1));
  _mm256_storeu_pd(sx, _mm256_add_pd(x0, x1));
  double a = (se[0] + se[1]) + (se[2] + se[3]), b = (sx[0] + sx[1]) + (sx[2] + sx[3]);
  for (; i < c; ++i) {
    a += std::exp(x[i] - mx);
    b += x[i];
  }
  *sum_exp = a;
  *sum_x = b;
}

// d[i] = scale * (exp(x[i] - l) - sub) for i < c; contiguous d and x.
LS_AVX2 void softmax_grad_f32(float* d, const float* x, int64_t c, float l, float scale,
                              float sub) {
  const __m256 lv = _mm256_set1_ps(l), sv = _mm256_set1_ps(scale), subv = _mm256_set1_ps(sub);
  int64_t i = 0;
  for (; i + 8 <= c; i += 8) {
    const __m256 p = exp8_shifted(_mm256_loadu_ps(x + i), lv);
    _mm256_storeu_ps(d + i, _mm256_mul_ps(sv, _mm256_sub_ps(p, subv)));
  }
  for (; i < c; ++i) d[i] = scale * (std::exp(x[i] - l) - sub);
}
#endif

// Whether rows of T with these element steps take the AVX2 loops (Note [Cross-entropy exp]).
template <typename T>
bool exp_rows_avx2(int64_t step_a, int64_t step_b = 1) {
#if LS_HAVE_AVX2
  return std::is_same_v<T, float> && step_a == 1 && step_b == 1 && cpu_has_avx2();
#else
  return false;
#endif
}

// Per-row loss (0 for ignored rows) and log-sum-exp, one row per (n, d...) position. Each row
// is read twice (max, then exp-sum together with the target and smoothing terms), never
// materializing log_softmax.
template <typename T>
void cross_entropy_rows(const Tensor& x, const int64_t* tgt, int64_t ignore_index, double smoothing,
                        T* lse_out, double* loss_out) {
  Rows<1> rows(x.shape(), 1, {&x});
  const T* px = x.data<T>();
  const int64_t c = rows.length(), sx = rows.step(0);
  const bool avx2 = exp_rows_avx2<T>(sx);
  parallel_rows(rows.count(), c, [&](int64_t r) {
    int64_t off;
    rows.offsets(r, &off);
    const T* xr = px + off;
    T mx = -std::numeric_limits<T>::infinity();
    for (int64_t i = 0; i < c; ++i) mx = std::max(mx, xr[i * sx]);
    double sum_exp = 0, sum_x = 0;
#if LS_HAVE_AVX2
    if constexpr (std::is_same_v<T, float>) {
      if (avx2) exp_sums_f32(xr, c, mx, &sum_exp, &sum_x);
    }
#endif
    for (int64_t i = 0; i < c && !avx2; ++i) {
      const T v = xr[i * sx];
      sum_exp += std::exp(v - mx);
      sum_x += v;
    }
    const double lse = static_cast<double>(mx) + std::log(sum_exp);
    lse_out[r] = static_cast<T>(lse);
    const int64_t t = tgt[r];
    if (t == ignore_index) {
      loss_out[r] = 0;
      return;
    }
    // -(1-e) log p_t - (e/C) sum_c log p_c, with log p_c = x_c - lse.
    const double nll = lse - static_cast<double>(xr[t * sx]);
    loss_out[r] = (1 - smoothing) * nll + smoothing * (lse - sum_x / static_cast<double>(c));
  });
}

// dx = scale_r * (softmax - (1 - e) * onehot(t) - e / C), without building the one-hot.
template <typename T>
void cross_entropy_backward_rows(const Tensor& dx, const Tensor& logits, const Tensor& targets,
                                 const Tensor& lse_t, const T* row_scale, double uniform_scale,
                                 int64_t ignore_index, double smoothing) {
  Rows<2> rows(dx.shape(), 1, {&dx, &logits});
  T* pd = dx.data<T>();
  const T* px = logits.data<T>();
  const T* lse = lse_t.data<T>();
  const int64_t* tgt = targets.data<int64_t>();
  const int64_t c = rows.length(), sd = rows.step(0), sx = rows.step(1);
  const double off_target = smoothing / static_cast<double>(c);
  const bool avx2 = exp_rows_avx2<T>(sd, sx);
  parallel_rows(rows.count(), c, [&](int64_t r) {
    int64_t off[2];
    rows.offsets(r, off);
    T* dr = pd + off[0];
    const T* xr = px + off[1];
    const int64_t t = tgt[r];
    if (t == ignore_index) {
      for (int64_t i = 0; i < c; ++i) dr[i * sd] = T(0);
      return;
    }
    const T scale = row_scale ? row_scale[r] : static_cast<T>(uniform_scale);
    const T l = lse[r], sub = static_cast<T>(off_target);
#if LS_HAVE_AVX2
    if constexpr (std::is_same_v<T, float>) {
      if (avx2) softmax_grad_f32(dr, xr, c, l, scale, sub);
    }
#endif
    for (int64_t i = 0; i < c && !avx2; ++i) dr[i * sd] = scale * (std::exp(xr[i * sx] - l) - sub);
    dr[t * sd] -= scale * static_cast<T>(1 - smoothing);
  });
}

}  // namespace

void cross_entropy_kernel(const Tensor& out, const Tensor& lse, const Tensor& logits,
                          const Tensor& targets, Reduction reduction, int64_t ignore_index,
                          double smoothing, TargetCheck* check) {
  *check = check_targets(targets, logits.size(1), ignore_index);
  if (check->bad.position >= 0) return;
  std::vector<double> loss(static_cast<size_t>(targets.numel()));
  dispatch_float(logits.dtype(), "cross_entropy", [&]<typename T>() {
    cross_entropy_rows<T>(logits, targets.data<int64_t>(), ignore_index, smoothing, lse.data<T>(),
                          loss.data());
    T* po = out.data<T>();
    if (reduction == Reduction::none) {
      for (size_t r = 0; r < loss.size(); ++r) po[r] = static_cast<T>(loss[r]);
      return;
    }
    double total = 0;
    for (double v : loss) total += v;
    // Mean over the non-ignored targets, as PyTorch: all ignored gives 0 / 0 = NaN.
    if (reduction == Reduction::mean) total /= static_cast<double>(check->count);
    po[0] = static_cast<T>(total);
  });
}

void cross_entropy_backward_kernel(const Tensor& dx, const Tensor& g, const Tensor& logits,
                                   const Tensor& targets, const Tensor& lse, Reduction reduction,
                                   int64_t ignore_index, double smoothing, int64_t count) {
  dispatch_float(logits.dtype(), "cross_entropy", [&]<typename T>() {
    const T* pg = g.data<T>();
    double uniform = 0;
    if (reduction != Reduction::none) {
      uniform = static_cast<double>(pg[0]);
      if (reduction == Reduction::mean) uniform /= static_cast<double>(count);
    }
    cross_entropy_backward_rows<T>(dx, logits, targets, lse,
                                   reduction == Reduction::none ? pg : nullptr, uniform,
                                   ignore_index, smoothing);
  });
}

void mse_loss_kernel(const Tensor& out, const Tensor& x, const Tensor& t, Reduction reduction) {
  dispatch_float(x.dtype(), "mse_loss", [&]<typename T>() {
    const T* px = x.data<T>();
    const T* pt = t.data<T>();
    T* po = out.data<T>();
    const int64_t n = x.numel();
    if (reduction == Reduction::none) {
      parallel_for(0, n, kElementwiseGrain, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
          const T d = px[i] - pt[i];
          po[i] = d * d;
        }
      });
      return;
    }
    double total = blocked_sum(n, [&](int64_t i) {
      const double d = static_cast<double>(px[i]) - static_cast<double>(pt[i]);
      return d * d;
    });
    if (reduction == Reduction::mean) total /= static_cast<double>(n);  // n == 0 gives NaN
    po[0] = static_cast<T>(total);
  });
}

// d/dx = 2 (x - t) g (/ n for mean); d/dt is its negation.
void mse_loss_backward_kernel(const Tensor& gx, const Tensor& gt, const Tensor& g, const Tensor& x,
                              const Tensor& t, Reduction reduction) {
  dispatch_float(x.dtype(), "mse_loss", [&]<typename T>() {
    const T* px = x.data<T>();
    const T* pt = t.data<T>();
    const int64_t n = x.numel();
    const T* pg = reduction == Reduction::none ? g.data<T>() : nullptr;
    const T scalar =
        reduction == Reduction::none
            ? T(0)
            : static_cast<T>(2.0 * static_cast<double>(g.data<T>()[0]) /
                             (reduction == Reduction::mean ? static_cast<double>(n) : 1.0));
    T* ox = gx.defined() ? gx.data<T>() : nullptr;
    T* ot = gt.defined() ? gt.data<T>() : nullptr;
    parallel_for(0, n, kElementwiseGrain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const T v = (pg ? T(2) * pg[i] : scalar) * (px[i] - pt[i]);
        if (ox) ox[i] = v;
        if (ot) ot[i] = -v;
      }
    });
  });
}

}  // namespace lockstep::cpu
