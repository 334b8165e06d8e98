// softmax and log_softmax over one dim: one numerically stable kernel per row, and their fused
// backward formulas.
#include <cmath>
#include <limits>

#include "lockstep/autograd/node.h"
#include "lockstep/ops/autocast.h"
#include "lockstep/ops/nn.h"
#include "ops/common.h"
#include "ops/cpu/rows.h"
#include "tensor/dispatch.h"

namespace lockstep {

using autograd::record;
using autograd::TensorList;

namespace {

// y = softmax(x) or log_softmax(x) along `dim`; y is a fresh tensor of x's shape. Each row
// subtracts its max before exponentiating, so large logits never overflow.
template <typename T>
void softmax_forward(const Tensor& x, const Tensor& y, int64_t dim, bool log) {
  cpu::Rows<2> rows(x.shape(), dim, {&y, &x});
  const T* px = x.data<T>();
  T* py = y.data<T>();
  const int64_t n = rows.length(), sy = rows.step(0), sx = rows.step(1);
  cpu::parallel_rows(rows.count(), n, [&](int64_t r) {
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
  cpu::Rows<3> rows(y.shape(), dim, {&dx, &g, &y});
  T* pd = dx.data<T>();
  const T* pg = g.data<T>();
  const T* py = y.data<T>();
  const int64_t n = rows.length(), sd = rows.step(0), sg = rows.step(1), sy = rows.step(2);
  cpu::parallel_rows(rows.count(), n, [&](int64_t r) {
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

// Runs the forward in x's dtype (16-bit floats in f32); no autograd.
Tensor softmax_nograd(const Tensor& x, int64_t dim, bool log, const char* op) {
  const DType dt = x.dtype();
  if (is_half(dt)) return softmax_nograd(x.to(kFloat32), dim, log, op).to(dt);
  Tensor y = empty(x.shape(), dt);
  cpu::dispatch_float(dt, op, [&]<typename T>() { softmax_forward<T>(x, y, dim, log); });
  return y;
}

Tensor softmax_grad(const Tensor& g, const Tensor& y, int64_t dim, bool log, const char* op) {
  const DType dt = y.dtype();
  if (is_half(dt)) {
    return softmax_grad(g.to(kFloat32), y.to(kFloat32), dim, log, op).to(dt);
  }
  const Tensor gc = g.dtype() == dt ? g : g.to(dt);
  Tensor dx = empty(y.shape(), dt);
  cpu::dispatch_float(dt, op, [&]<typename T>() { softmax_backward<T>(gc, y, dx, dim, log); });
  return dx;
}

Tensor softmax_op(const Tensor& x, int64_t dim, bool log, const char* op, const char* node) {
  detail::check_cpu(x, op);
  LS_CHECK(is_floating(x.dtype()), op, ": expected a floating-point tensor, got ",
           dtype_name(x.dtype()));
  const int64_t d = detail::normalize_dim(dim, x.dim(), op);
  // A 0-dim tensor is a row of one element.
  const Tensor xv = x.dim() == 0 ? x.detach().reshape({1}) : x.detach();
  Tensor out = softmax_nograd(xv, d, log, op).reshape(x.shape());
  record(node, {x}, out, [saved = out.detach(), d, log, op](const TensorList& g) {
    const Dims shape = saved.shape();
    const bool scalar = shape.empty();
    const Tensor gv = scalar ? g[0].reshape({1}) : g[0];
    const Tensor yv = scalar ? saved.reshape({1}) : saved;
    return TensorList{softmax_grad(gv, yv, d, log, op).reshape(shape)};
  });
  return out;
}

}  // namespace

Tensor softmax(const Tensor& x, int64_t dim) {
  LS_AUTOCAST("softmax", softmax, x, dim);
  return softmax_op(x, dim, false, "softmax", "SoftmaxBackward");
}

Tensor log_softmax(const Tensor& x, int64_t dim) {
  LS_AUTOCAST("log_softmax", log_softmax, x, dim);
  return softmax_op(x, dim, true, "log_softmax", "LogSoftmaxBackward");
}

}  // namespace lockstep
