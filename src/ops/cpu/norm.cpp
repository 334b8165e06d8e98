// The CPU normalization kernels: layer_norm (fused forward saving each row's mean and 1/std, and
// a fused backward computing dx, dweight and dbias in one pass over the rows) and batch_norm
// (one-pass channel statistics, the affine map, and the closed-form backward).
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "ops/cpu/kernels.h"
#include "ops/cpu/norm_avx2.h"
#include "ops/cpu/rows.h"
#include "tensor/dispatch.h"
#include "tensor/parallel.h"

namespace lockstep::cpu {

namespace {

// The backward sums dweight and dbias over rows in at most this many blocks (each with its own
// partial sums, added in block order), so the result does not depend on the thread count.
constexpr int64_t kMaxRowBlocks = 64;

// ---- layer_norm ----

// sum of f(i) for i < n in four interleaved f64 sums: one running sum waits on each add's
// latency (4 cycles), so the row reductions of layer_norm ran at one element per 4 cycles; four
// independent ones do four (they were 5% of a train_gpt step).
template <typename F>
double sum4(int64_t n, const F& f) {
  double a0 = 0, a1 = 0, a2 = 0, a3 = 0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    a0 += f(i);
    a1 += f(i + 1);
    a2 += f(i + 2);
    a3 += f(i + 3);
  }
  for (; i < n; ++i) a0 += f(i);
  return (a0 + a1) + (a2 + a3);
}

template <typename T>
void layer_norm_forward(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                        const Tensor& weight, const Tensor& bias, double eps) {
  const int64_t m = x.size(0), n = x.size(1);
  const T* px = x.data<T>();
  const T* pw = weight.defined() ? weight.data<T>() : nullptr;
  const T* pb = bias.defined() ? bias.data<T>() : nullptr;
  T* py = y.data<T>();
  T* pmean = mean.data<T>();
  T* prstd = rstd.data<T>();
  if constexpr (std::is_same_v<T, float>) {
    if (layer_norm_avx2_enabled()) {  // Note [layer_norm on AVX2] in norm_avx2.cpp
      parallel_rows(m, n, [&](int64_t r) {
        layer_norm_row_f32_avx2(py + r * n, pmean + r, prstd + r, px + r * n, pw, pb, n, eps);
      });
      return;
    }
  }
  parallel_rows(m, n, [&](int64_t r) {
    const T* xr = px + r * n;
    T* yr = py + r * n;
    const double mu_d =
        sum4(n, [&](int64_t i) { return static_cast<double>(xr[i]); }) / static_cast<double>(n);
    // Two passes: no cancellation when |mean| >> std.
    const double ss = sum4(n, [&](int64_t i) {
      const double d = static_cast<double>(xr[i]) - mu_d;
      return d * d;
    });
    const double rstd_d = 1.0 / std::sqrt(ss / static_cast<double>(n) + eps);
    pmean[r] = static_cast<T>(mu_d);
    prstd[r] = static_cast<T>(rstd_d);
    const T mu = static_cast<T>(mu_d), rs = static_cast<T>(rstd_d);
    for (int64_t i = 0; i < n; ++i) {
      T v = (xr[i] - mu) * rs;
      if (pw) v *= pw[i];
      if (pb) v += pb[i];
      yr[i] = v;
    }
  });
}

// With xhat = (x - mean) * rstd and wg = g * weight (PyTorch's formula):
//   dx = rstd * (wg - mean(wg) - xhat * mean(wg * xhat)),
//   dweight = sum over rows of g * xhat, dbias = sum over rows of g.
template <typename T>
void layer_norm_backward(const Tensor& dx, const Tensor& dw, const Tensor& db, const Tensor& g,
                         const Tensor& x, const Tensor& weight, const Tensor& mean,
                         const Tensor& rstd) {
  const int64_t m = x.size(0), n = x.size(1);
  const T* px = x.data<T>();
  const T* pg = g.data<T>();
  const T* pw = weight.defined() ? weight.data<T>() : nullptr;
  const T* pmean = mean.data<T>();
  const T* prstd = rstd.data<T>();
  T* pdx = dx.defined() ? dx.data<T>() : nullptr;
  const bool need_wb = dw.defined() || db.defined();
  const bool avx2 = std::is_same_v<T, float> && layer_norm_avx2_enabled();

  const int64_t blocks = std::clamp<int64_t>(
      m * n / kElementwiseGrain, 1, std::min<int64_t>(kMaxRowBlocks, std::max<int64_t>(m, 1)));
  const int64_t rows_per_block = (m + blocks - 1) / blocks;
  // partial[k] holds block k's sums: dweight in [0, n), dbias in [n, 2n).
  std::vector<double> partial(need_wb ? static_cast<size_t>(blocks * 2 * n) : 0, 0.0);
  parallel_for(0, blocks, 1, [&](int64_t kb, int64_t ke) {
    for (int64_t k = kb; k < ke; ++k) {
      double* pdw = need_wb ? partial.data() + k * 2 * n : nullptr;
      double* pdb = need_wb ? pdw + n : nullptr;
      const int64_t r_end = std::min(m, (k + 1) * rows_per_block);
      for (int64_t r = k * rows_per_block; r < r_end; ++r) {
        const T* xr = px + r * n;
        const T* gr = pg + r * n;
        const T mu = pmean[r], rs = prstd[r];
        if constexpr (std::is_same_v<T, float>) {
          if (avx2) {  // Note [layer_norm on AVX2] in norm_avx2.cpp
            layer_norm_backward_row_f32_avx2(pdx ? pdx + r * n : nullptr, pdw, pdb, gr, xr, pw, mu,
                                             rs, n);
            continue;
          }
        }
        if (need_wb) {
          for (int64_t i = 0; i < n; ++i) {
            const T xhat = (xr[i] - mu) * rs;
            pdw[i] += static_cast<double>(gr[i] * xhat);
            pdb[i] += static_cast<double>(gr[i]);
          }
        }
        if (pdx) {
          const double sum_wg =
              sum4(n, [&](int64_t i) { return static_cast<double>(pw ? gr[i] * pw[i] : gr[i]); });
          const double sum_wg_xhat = sum4(n, [&](int64_t i) {
            const T wg = pw ? gr[i] * pw[i] : gr[i];
            return static_cast<double>(wg * ((xr[i] - mu) * rs));
          });
          const T a = static_cast<T>(sum_wg / static_cast<double>(n));
          const T b = static_cast<T>(sum_wg_xhat / static_cast<double>(n));
          T* dr = pdx + r * n;
          for (int64_t i = 0; i < n; ++i) {
            const T wg = pw ? gr[i] * pw[i] : gr[i];
            dr[i] = rs * (wg - a - (xr[i] - mu) * rs * b);
          }
        }
      }
    }
  });
  if (!need_wb) return;
  T* odw = dw.defined() ? dw.data<T>() : nullptr;
  T* odb = db.defined() ? db.data<T>() : nullptr;
  parallel_for(0, n, kElementwiseGrain / blocks + 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      double sw = 0, sb = 0;
      for (int64_t k = 0; k < blocks; ++k) {
        sw += partial[k * 2 * n + i];
        sb += partial[k * 2 * n + n + i];
      }
      if (odw) odw[i] = static_cast<T>(sw);
      if (odb) odb[i] = static_cast<T>(sb);
    }
  });
}

// ---- batch_norm ----

// x (N, C, *) contiguous as N * C runs of `inner` elements; run i belongs to channel i % C.
struct ChannelRuns {
  int64_t batch, channels, inner;
  explicit ChannelRuns(const Tensor& x)
      : batch(x.size(0)),
        channels(x.size(1)),
        inner(x.numel() / std::max<int64_t>(x.size(0) * x.size(1), 1)) {}
  int64_t count() const { return batch * inner; }  // values per channel
};

// Calls f(c) for every channel in parallel.
template <typename F>
void for_channels(const ChannelRuns& r, const F& f) {
  const int64_t grain = std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(r.count(), 1));
  parallel_for(0, r.channels, grain, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) f(c);
  });
}

// Calls f(run, channel) for every run of `inner` elements in parallel.
template <typename F>
void for_runs(const ChannelRuns& r, const F& f) {
  const int64_t grain = std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(r.inner, 1));
  parallel_for(0, r.batch * r.channels, grain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) f(i, i % r.channels);
  });
}

// 1 / sqrt(var + eps) per channel, in double.
template <typename T>
std::vector<double> inv_std(const Tensor& var, double eps) {
  const T* pv = var.data<T>();
  std::vector<double> out(static_cast<size_t>(var.numel()));
  for (size_t c = 0; c < out.size(); ++c)
    out[c] = 1.0 / std::sqrt(static_cast<double>(pv[c]) + eps);
  return out;
}

// Note [Batch statistics in one pass]
// The mean and variance of a channel come from one read of its values: sums of (v - K) and
// (v - K)^2 in double, shifted by K, the channel's first value. Without the shift, E[v^2] -
// E[v]^2 cancels catastrophically when |mean| >> std; with it the sums only see the spread
// around a value of the right size, as a second pass around the mean would.
template <typename T>
void batch_norm_stats(const Tensor& mean, const Tensor& var, const Tensor& x) {
  const ChannelRuns r(x);
  const T* px = x.data<T>();
  T* pm = mean.data<T>();
  T* pv = var.data<T>();
  const double m = static_cast<double>(r.count());
  for_channels(r, [&](int64_t c) {
    const double shift = static_cast<double>(px[c * r.inner]);
    double s = 0, ss = 0;
    for (int64_t n = 0; n < r.batch; ++n) {
      const T* p = px + (n * r.channels + c) * r.inner;
      for (int64_t i = 0; i < r.inner; ++i) {
        const double d = static_cast<double>(p[i]) - shift;
        s += d;
        ss += d * d;
      }
    }
    const double d_mean = s / m;
    pm[c] = static_cast<T>(shift + d_mean);
    pv[c] = static_cast<T>(std::max(ss / m - d_mean * d_mean, 0.0));
  });
}

template <typename T>
void batch_norm_apply(const Tensor& y, const Tensor& x, const Tensor& mean, const Tensor& var,
                      const Tensor& weight, const Tensor& bias, double eps) {
  const ChannelRuns r(x);
  const std::vector<double> istd = inv_std<T>(var, eps);
  const T* px = x.data<T>();
  const T* pm = mean.data<T>();
  const T* pw = weight.defined() ? weight.data<T>() : nullptr;
  const T* pb = bias.defined() ? bias.data<T>() : nullptr;
  T* py = y.data<T>();
  for_runs(r, [&](int64_t run, int64_t c) {
    const T mu = pm[c];
    const T scale = static_cast<T>(pw ? istd[c] * static_cast<double>(pw[c]) : istd[c]);
    const T shift = pb ? pb[c] : T(0);
    const T* xr = px + run * r.inner;
    T* yr = py + run * r.inner;
    for (int64_t i = 0; i < r.inner; ++i) yr[i] = (xr[i] - mu) * scale + shift;
  });
}

// With xhat = (x - mean) * istd over the m values of a channel:
//   dbias = sum g, dweight = sum g * xhat,
//   dx = weight * istd * (g - dbias / m - xhat * dweight / m)  when training (batch statistics),
//   dx = weight * istd * g                                      when not (constants).
template <typename T>
void batch_norm_backward(const Tensor& dx, const Tensor& dw, const Tensor& db, const Tensor& g,
                         const Tensor& x, const Tensor& mean, const Tensor& var,
                         const Tensor& weight, double eps, bool training) {
  const ChannelRuns r(x);
  const int64_t C = r.channels;
  const std::vector<double> istd = inv_std<T>(var, eps);
  const T* px = x.data<T>();
  const T* pg = g.data<T>();
  const T* pm = mean.data<T>();
  const T* pw = weight.defined() ? weight.data<T>() : nullptr;
  // Per channel: sum g and sum g * (x - mean), in double.
  std::vector<double> sum_g(static_cast<size_t>(C), 0.0), sum_gx(static_cast<size_t>(C), 0.0);
  if (training || dw.defined() || db.defined()) {
    for_channels(r, [&](int64_t c) {
      const double mu = static_cast<double>(pm[c]);
      double sg = 0, sgx = 0;
      for (int64_t n = 0; n < r.batch; ++n) {
        const int64_t off = (n * C + c) * r.inner;
        for (int64_t i = 0; i < r.inner; ++i) {
          const double gv = static_cast<double>(pg[off + i]);
          sg += gv;
          sgx += gv * (static_cast<double>(px[off + i]) - mu);
        }
      }
      sum_g[c] = sg;
      sum_gx[c] = sgx;
    });
  }
  if (db.defined()) {
    T* p = db.data<T>();
    for (int64_t c = 0; c < C; ++c) p[c] = static_cast<T>(sum_g[c]);
  }
  if (dw.defined()) {
    T* p = dw.data<T>();
    for (int64_t c = 0; c < C; ++c) p[c] = static_cast<T>(sum_gx[c] * istd[c]);
  }
  if (!dx.defined()) return;
  const double m = static_cast<double>(r.count());
  T* pdx = dx.data<T>();
  for_runs(r, [&](int64_t run, int64_t c) {
    const double w = pw ? static_cast<double>(pw[c]) : 1.0;
    const T scale = static_cast<T>(w * istd[c]);
    const T* gr = pg + run * r.inner;
    T* dr = pdx + run * r.inner;
    if (!training) {
      for (int64_t i = 0; i < r.inner; ++i) dr[i] = gr[i] * scale;
      return;
    }
    // g - mean(g) - (x - mean) * istd^2 * sum(g (x - mean)) / m
    const T mu = pm[c];
    const T g_mean = static_cast<T>(sum_g[c] / m);
    const T proj = static_cast<T>(sum_gx[c] * istd[c] * istd[c] / m);
    const T* xr = px + run * r.inner;
    for (int64_t i = 0; i < r.inner; ++i) dr[i] = scale * (gr[i] - g_mean - (xr[i] - mu) * proj);
  });
}

}  // namespace

void layer_norm_kernel(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                       const Tensor& weight, const Tensor& bias, double eps) {
  dispatch_float(x.dtype(), "layer_norm",
                 [&]<typename T>() { layer_norm_forward<T>(y, mean, rstd, x, weight, bias, eps); });
}

void layer_norm_backward_kernel(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                                const Tensor& g, const Tensor& x, const Tensor& weight,
                                const Tensor& mean, const Tensor& rstd) {
  dispatch_float(x.dtype(), "layer_norm", [&]<typename T>() {
    layer_norm_backward<T>(dx, dweight, dbias, g, x, weight, mean, rstd);
  });
}

void batch_norm_stats_kernel(const Tensor& mean, const Tensor& var, const Tensor& x) {
  dispatch_float(x.dtype(), "batch_norm", [&]<typename T>() { batch_norm_stats<T>(mean, var, x); });
}

void batch_norm_kernel(const Tensor& y, const Tensor& x, const Tensor& mean, const Tensor& var,
                       const Tensor& weight, const Tensor& bias, double eps) {
  dispatch_float(x.dtype(), "batch_norm",
                 [&]<typename T>() { batch_norm_apply<T>(y, x, mean, var, weight, bias, eps); });
}

void batch_norm_backward_kernel(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                                const Tensor& g, const Tensor& x, const Tensor& mean,
                                const Tensor& var, const Tensor& weight, double eps,
                                bool training) {
  dispatch_float(x.dtype(), "batch_norm", [&]<typename T>() {
    batch_norm_backward<T>(dx, dweight, dbias, g, x, mean, var, weight, eps, training);
  });
}

}  // namespace lockstep::cpu
