// softmax and log_softmax over one dim: the fronts (dtype, a 0-dim input as one row, the
// backward); the row kernels are src/ops/cpu/softmax.cpp.
#include "lockstep/autograd/node.h"
#include "lockstep/ops/autocast.h"
#include "lockstep/ops/nn.h"
#include "ops/common.h"
#include "ops/kernels.h"

namespace lockstep {

using autograd::record;
using autograd::TensorList;
using detail::Kernels;

namespace {

// Runs the forward in x's dtype (16-bit floats in f32); no autograd.
Tensor softmax_nograd(const Tensor& x, int64_t dim, bool log, const char* op) {
  const auto kernel = detail::kernel(&Kernels::softmax, x.device(), op);
  const DType dt = x.dtype();
  if (is_half(dt)) return softmax_nograd(x.to(kFloat32), dim, log, op).to(dt);
  Tensor y = empty(x.shape(), detail::options_on(x, dt));
  kernel(y, x, dim, log);
  return y;
}

Tensor softmax_grad(const Tensor& g, const Tensor& y, int64_t dim, bool log, const char* op) {
  const auto kernel = detail::kernel(&Kernels::softmax_backward, y.device(), op);
  const DType dt = y.dtype();
  if (is_half(dt)) {
    return softmax_grad(g.to(kFloat32), y.to(kFloat32), dim, log, op).to(dt);
  }
  const Tensor gc = g.dtype() == dt ? g : g.to(dt);
  Tensor dx = empty(y.shape(), detail::options_on(y, dt));
  kernel(dx, gc, y, dim, log);
  return dx;
}

Tensor softmax_op(const Tensor& x, int64_t dim, bool log, const char* op, const char* node) {
  detail::check_defined(x, op);
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
