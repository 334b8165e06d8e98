// The CPU loss kernels: cross_entropy (log-softmax and NLL fused, with ignore_index and label
// smoothing) and mse_loss, with their fused backward kernels.
#include <cmath>
#include <limits>
#include <vector>

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

// Per-row loss (0 for ignored rows) and log-sum-exp, one row per (n, d...) position. Each row
// is read twice (max, then exp-sum together with the target and smoothing terms), never
// materializing log_softmax.
template <typename T>
void cross_entropy_rows(const Tensor& x, const int64_t* tgt, int64_t ignore_index, double smoothing,
                        T* lse_out, double* loss_out) {
  Rows<1> rows(x.shape(), 1, {&x});
  const T* px = x.data<T>();
  const int64_t c = rows.length(), sx = rows.step(0);
  parallel_rows(rows.count(), c, [&](int64_t r) {
    int64_t off;
    rows.offsets(r, &off);
    const T* xr = px + off;
    T mx = -std::numeric_limits<T>::infinity();
    for (int64_t i = 0; i < c; ++i) mx = std::max(mx, xr[i * sx]);
    double sum_exp = 0, sum_x = 0;
    for (int64_t i = 0; i < c; ++i) {
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
    for (int64_t i = 0; i < c; ++i) dr[i * sd] = scale * (std::exp(xr[i * sx] - l) - sub);
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
