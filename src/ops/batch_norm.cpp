// batch_norm (torch.nn.functional.batch_norm): checks, the running-statistics update and the
// backward it records; the device's kernels compute the statistics, the normalization and the
// gradients (src/ops/cpu/norm.cpp).
#include "lockstep/autograd/grad_mode.h"
#include "lockstep/autograd/node.h"
#include "lockstep/ops/autocast.h"
#include "lockstep/ops/nn.h"
#include "ops/common.h"
#include "ops/kernels.h"

namespace lockstep {

using autograd::TensorList;
using detail::Kernels;

namespace {

constexpr const char* kOp = "batch_norm";

// A per-channel argument: undefined, or (C) floating on x's device.
void check_channel_arg(const Tensor& t, const Tensor& x, const char* what) {
  if (!t.defined()) return;
  detail::check_same_device(x, t, kOp);
  LS_CHECK(t.dim() == 1 && t.size(0) == x.size(1), "batch_norm: ", what, " of shape ",
           t.shape().str(), " does not match the ", x.size(1), " channels of input of shape ",
           x.shape().str(), " (expected [", x.size(1), "])");
  LS_CHECK(is_floating(t.dtype()), "batch_norm: ", what, " must be floating-point, got ",
           dtype_name(t.dtype()));
}

// `t` detached, contiguous, in dtype `ct` (undefined stays undefined).
Tensor in_dtype(const Tensor& t, DType ct) {
  return t.defined() ? t.detach().to(ct).contiguous() : t;
}

// A gradient computed in the compute dtype, returned in its input's dtype.
Tensor as_dtype(const Tensor& g, DType dt) { return g.defined() ? g.to(dt) : g; }

}  // namespace

Tensor batch_norm(const Tensor& x, const Tensor& running_mean, const Tensor& running_var,
                  const Tensor& weight, const Tensor& bias, bool training, double momentum,
                  double eps) {
  LS_AUTOCAST("batch_norm", batch_norm, x, running_mean, running_var, weight, bias, training,
              momentum, eps);
  detail::check_defined(x, kOp);
  LS_CHECK(x.dim() >= 2, "batch_norm: expected input of shape (N, C, *), got ", x.shape().str());
  LS_CHECK(is_floating(x.dtype()), "batch_norm: expected a floating-point input, got ",
           dtype_name(x.dtype()));
  check_channel_arg(running_mean, x, "running_mean");
  check_channel_arg(running_var, x, "running_var");
  check_channel_arg(weight, x, "weight");
  check_channel_arg(bias, x, "bias");
  LS_CHECK(running_mean.defined() == running_var.defined(),
           "batch_norm: running_mean and running_var must both be given or both be undefined");
  LS_CHECK(training || running_mean.defined(),
           "batch_norm: evaluation (training = false) normalizes with running_mean and "
           "running_var; both are undefined");
  LS_CHECK(eps >= 0, "batch_norm: eps must be non-negative, got ", eps);
  const int64_t channels = x.size(1);
  const int64_t count = channels > 0 ? x.numel() / channels : 0;  // values per channel
  LS_CHECK(!training || count > 1,
           "batch_norm: training needs more than one value per channel, got input of shape ",
           x.shape().str());
  const auto stats = detail::kernel(&Kernels::batch_norm_stats, x.device(), kOp);
  const auto forward = detail::kernel(&Kernels::batch_norm, x.device(), kOp);

  const DType dt = x.dtype();
  const DType ct = is_half(dt) ? kFloat32 : dt;  // compute dtype
  const auto opts = detail::options_on(x, ct);
  const Tensor xc = in_dtype(x, ct);
  Tensor mean, var;  // the statistics this forward normalizes with, (C) in ct
  if (training) {
    mean = empty({channels}, opts);
    var = empty({channels}, opts);
    stats(mean, var, xc);
    if (running_mean.defined()) {
      autograd::NoGradGuard no_grad;
      const double unbias = static_cast<double>(count) / static_cast<double>(count - 1);
      Tensor rm = running_mean, rv = running_var;  // handles to the caller's buffers
      rm.mul_(1.0 - momentum).add_(mean.to(rm.dtype()), momentum);
      rv.mul_(1.0 - momentum).add_(var.to(rv.dtype()), momentum * unbias);
    }
  } else {
    // Copies: a later training step updates the running statistics in place, and this
    // forward's backward must still see the values it normalized with.
    mean = running_mean.dtype() == ct ? running_mean.detach().clone() : in_dtype(running_mean, ct);
    var = running_var.dtype() == ct ? running_var.detach().clone() : in_dtype(running_var, ct);
  }
  const Tensor wc = in_dtype(weight, ct), bc = in_dtype(bias, ct);
  Tensor y = empty(x.shape(), opts);
  forward(y, xc, mean, var, wc, bc, eps);
  y = y.to(dt);

  autograd::record(
      "BatchNormBackward", {x, weight, bias}, y,
      [xc, mean, var, wc, eps, training, dt, wdt = weight.defined() ? weight.dtype() : dt,
       bdt = bias.defined() ? bias.dtype() : dt, rx = x.requires_grad(),
       rw = weight.defined() && weight.requires_grad(),
       rb = bias.defined() && bias.requires_grad()](const TensorList& g) {
        const auto backward = detail::kernel(&Kernels::batch_norm_backward, xc.device(), kOp);
        const auto opts = detail::options_on(xc, xc.dtype());
        const Tensor gc = g[0].to(xc.dtype()).contiguous();
        Tensor dx = rx ? empty(xc.shape(), opts) : Tensor();
        Tensor dw = rw ? empty(mean.shape(), opts) : Tensor();
        Tensor db = rb ? empty(mean.shape(), opts) : Tensor();
        backward(dx, dw, db, gc, xc, mean, var, wc, eps, training);
        return TensorList{as_dtype(dx, dt), as_dtype(dw, wdt), as_dtype(db, bdt)};
      });
  return y;
}

}  // namespace lockstep
