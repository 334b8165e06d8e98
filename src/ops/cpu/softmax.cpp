// CPU softmax and log_softmax kernels: one numerically stable pass per row, and their fused
// backward formulas.
#include <cmath>
#include <limits>

#include "ops/cpu/kernels.h"
#include "ops/cpu/rows.h"
#include "tensor/dispatch.h"

namespace lockstep::cpu {

namespace {

// y = softmax(x) or log_softmax(x) along `dim`; y is a fresh tensor of x's shape. Each row
// subtracts its max before exponentiating, so large logits never overflow.
template <typename T>
void softmax_forward(const Tensor& x, const Tensor& y, int64_t dim, bool log) {
  Rows<2> rows(x.shape(), dim, {&y, &x});
  const T* px = x.data<T>();
  T* py = y.data<T>();
  const int64_t n = rows.length(), sy = rows.step(0), sx = rows.step(1);
  parallel_rows(rows.count(), n, [&](int64_t r) {
    int64_t off[2];
    rows.offsets(r, off);
    T* yr = py + off[0];
    const T* xr = px + off[1];
    T mx = -std::numeric_limits<T>::infinity();
    for (int64_t i = 0; i < n; ++i) mx = std::max(mx, xr[i * sx]);
    double sum = 0;
    if (log) {
      for (int64_t i = 0; i < n; ++i) sum += std::exp(xr[i * sx] - mx);
      // (x - max) - log(sum) rather than x - (max + log(sum)): x - max is exact, so large
      // logits keep their precision.
      const T log_sum = static_cast<T>(std::log(sum));
      for (int64_t i = 0; i < n; ++i) yr[i * sy] = (xr[i * sx] - mx) - log_sum;
    } else {
      for (int64_t i = 0; i < n; ++i) {
        const T e = std::exp(xr[i * sx] - mx);
        yr[i * sy] = e;
        sum += e;
      }
      const T inv = static_cast<T>(1.0 / sum);
      for (int64_t i = 0; i < n; ++i) yr[i * sy] *= inv;
    }
  });
}

// softmax: dx = y * (g - sum(g * y)); log_softmax: dx = g - exp(y) * sum(g). One pass to reduce
// and one to write, per row.
template <typename T>
void softmax_backward(const Tensor& g, const Tensor& y, const Tensor& dx, int64_t dim, bool log) {
  Rows<3> rows(y.shape(), dim, {&dx, &g, &y});
  T* pd = dx.data<T>();
  const T* pg = g.data<T>();
  const T* py = y.data<T>();
  const int64_t n = rows.length(), sd = rows.step(0), sg = rows.step(1), sy = rows.step(2);
  parallel_rows(rows.count(), n, [&](int64_t r) {
    int64_t off[3];
    rows.offsets(r, off);
    T* dr = pd + off[0];
    const T* gr = pg + off[1];
    const T* yr = py + off[2];
    double acc = 0;
    if (log) {
      for (int64_t i = 0; i < n; ++i) acc += gr[i * sg];
      const T s = static_cast<T>(acc);
      for (int64_t i = 0; i < n; ++i) dr[i * sd] = gr[i * sg] - std::exp(yr[i * sy]) * s;
    } else {
      for (int64_t i = 0; i < n; ++i) acc += static_cast<double>(gr[i * sg]) * yr[i * sy];
      const T s = static_cast<T>(acc);
      for (int64_t i = 0; i < n; ++i) dr[i * sd] = yr[i * sy] * (gr[i * sg] - s);
    }
  });
}

}  // namespace

void softmax_kernel(const Tensor& y, const Tensor& x, int64_t dim, bool log) {
  dispatch_float(x.dtype(), log ? "log_softmax" : "softmax",
                 [&]<typename T>() { softmax_forward<T>(x, y, dim, log); });
}

void softmax_backward_kernel(const Tensor& dx, const Tensor& g, const Tensor& y, int64_t dim,
                             bool log) {
  dispatch_float(y.dtype(), log ? "log_softmax" : "softmax",
                 [&]<typename T>() { softmax_backward<T>(g, y, dx, dim, log); });
}

}  // namespace lockstep::cpu
