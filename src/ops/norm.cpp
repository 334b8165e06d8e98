// layer_norm: checks, dtypes and the backward it records; the device's kernels do the fused
// forward (saving each row's mean and 1/std) and the one-pass backward (src/ops/cpu/norm.cpp).
#include <memory>

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

struct LayerNormSaved {
  Tensor x;             // (M, N) contiguous, compute dtype
  Tensor weight, bias;  // normalized_shape, contiguous, or undefined
  Tensor mean, rstd;    // (M)
  Dims x_shape, normalized_shape;
};

void check_affine(const Tensor& t, const Tensor& x, const Dims& normalized_shape,
                  const char* what) {
  if (!t.defined()) return;
  detail::check_same_device(x, t, "layer_norm");
  LS_CHECK(t.shape() == normalized_shape, "layer_norm: ", what, " of shape ", t.shape().str(),
           " does not match normalized_shape ", normalized_shape.str());
  LS_CHECK(t.dtype() == x.dtype(), "layer_norm: ", what, " dtype ", dtype_name(t.dtype()),
           " differs from input dtype ", dtype_name(x.dtype()));
}

}  // namespace

Tensor layer_norm(const Tensor& x, const Dims& normalized_shape, const Tensor& weight,
                  const Tensor& bias, double eps) {
  LS_AUTOCAST("layer_norm", layer_norm, x, normalized_shape, weight, bias, eps);
  detail::check_defined(x, "layer_norm");
  LS_CHECK(is_floating(x.dtype()), "layer_norm: expected a floating-point input, got ",
           dtype_name(x.dtype()));
  const int64_t k = normalized_shape.size();
  bool trailing = k >= 1 && k <= x.dim();
  for (int64_t i = 0; trailing && i < k; ++i)
    trailing = x.size(x.dim() - k + i) == normalized_shape[i];
  LS_CHECK(trailing, "layer_norm: normalized_shape ", normalized_shape.str(),
           " does not match the trailing dimensions of input of shape ", x.shape().str());
  LS_CHECK(eps >= 0, "layer_norm: eps must be non-negative, got ", eps);
  check_affine(weight, x, normalized_shape, "weight");
  check_affine(bias, x, normalized_shape, "bias");
  const auto forward = detail::kernel(&Kernels::layer_norm, x.device(), "layer_norm");

  const DType dt = x.dtype();
  const DType ct = is_half(dt) ? kFloat32 : dt;
  const int64_t n = normalized_shape.numel();
  Dims lead = x.shape();
  for (int64_t i = 0; i < k; ++i) lead.erase(lead.size() - 1);
  const int64_t m = lead.numel();
  const auto opts = detail::options_on(x, ct);
  auto in_ct = [ct](const Tensor& t) { return t.defined() ? t.detach().to(ct).contiguous() : t; };

  auto s = std::make_shared<LayerNormSaved>();
  s->x = in_ct(x).reshape({m, n});
  s->weight = in_ct(weight);
  s->bias = in_ct(bias);
  s->mean = empty({m}, opts);
  s->rstd = empty({m}, opts);
  s->x_shape = x.shape();
  s->normalized_shape = normalized_shape;
  Tensor y = empty({m, n}, opts);
  forward(y, s->mean, s->rstd, s->x, s->weight, s->bias, eps);
  y = y.view(x.shape()).to(dt);

  record("LayerNormBackward", {x, weight, bias}, y,
         [s, dt, rx = x.requires_grad(), rw = weight.defined() && weight.requires_grad(),
          rb = bias.defined() && bias.requires_grad()](const TensorList& g) {
           const auto backward =
               detail::kernel(&Kernels::layer_norm_backward, s->x.device(), "layer_norm");
           const auto opts = detail::options_on(s->x, s->x.dtype());
           const Tensor gc = g[0].to(s->x.dtype()).contiguous().reshape(s->x.shape());
           Tensor dx = rx ? empty(s->x.shape(), opts) : Tensor();
           Tensor dw = rw ? empty(s->normalized_shape, opts) : Tensor();
           Tensor db = rb ? empty(s->normalized_shape, opts) : Tensor();
           backward(dx, dw, db, gc, s->x, s->weight, s->mean, s->rstd);
           auto back = [dt](const Tensor& t) { return t.defined() ? t.to(dt) : t; };
           return TensorList{rx ? back(dx.view(s->x_shape)) : dx, back(dw), back(db)};
         });
  return y;
}

}  // namespace lockstep
