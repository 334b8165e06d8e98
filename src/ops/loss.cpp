// Losses: cross_entropy (log-softmax and NLL fused, with ignore_index and label smoothing) and
// mse_loss: checks, dtypes and the backward they record; the device's loss kernels compute.
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

const char* reduction_name(Reduction r) {
  switch (r) {
    case Reduction::none:
      return "none";
    case Reduction::mean:
      return "mean";
    case Reduction::sum:
      return "sum";
  }
  return "?";
}

// What the forward saves for the backward.
struct CrossEntropySaved {
  Tensor logits;   // (N, C, d...) detached input, in the compute dtype
  Tensor targets;  // (N * d...) contiguous i64
  Tensor lse;      // (N * d...) log-sum-exp of each row
  int64_t count;   // non-ignored targets
};

}  // namespace

Tensor cross_entropy(const Tensor& logits, const Tensor& targets, const CrossEntropyOptions& opts) {
  LS_AUTOCAST("cross_entropy", cross_entropy, logits, targets, opts);
  detail::check_defined(logits, "cross_entropy", "logits");
  detail::check_defined(targets, "cross_entropy", "targets");
  detail::check_same_device(logits, targets, "cross_entropy");
  LS_CHECK(is_floating(logits.dtype()), "cross_entropy: logits must be floating-point, got ",
           dtype_name(logits.dtype()));
  LS_CHECK(targets.dtype() == kInt64 || targets.dtype() == kInt32,
           "cross_entropy: targets must be class indices (i64 or i32), got ",
           dtype_name(targets.dtype()));
  LS_CHECK(logits.dim() >= 2,
           "cross_entropy: expected logits of shape (N, C) or (N, C, d1, ...), got ",
           logits.shape().str());
  LS_CHECK(opts.label_smoothing >= 0.0 && opts.label_smoothing <= 1.0,
           "cross_entropy: label_smoothing must be in [0, 1], got ", opts.label_smoothing);
  Dims tshape = logits.shape();
  tshape.erase(1);
  LS_CHECK(targets.shape() == tshape, "cross_entropy: logits of shape ", logits.shape().str(),
           " need targets of shape ", tshape.str(), ", got ", targets.shape().str());
  const auto forward = detail::kernel(&Kernels::cross_entropy, logits.device(), "cross_entropy");
  const int64_t classes = logits.size(1);
  const DType dt = logits.dtype();
  const DType ct = is_half(dt) ? kFloat32 : dt;  // compute dtype

  auto saved = std::make_shared<CrossEntropySaved>();
  saved->logits = logits.detach().to(ct);
  saved->targets = targets.to(kInt64).contiguous();
  saved->lse = empty({tshape.numel()}, detail::options_on(logits, ct));
  Tensor out =
      empty(opts.reduction == Reduction::none ? tshape : Dims{}, detail::options_on(logits, ct));
  detail::TargetCheck check;
  forward(out, saved->lse, saved->logits, saved->targets, opts.reduction, opts.ignore_index,
          opts.label_smoothing, &check);
  LS_CHECK(check.bad.position < 0, "cross_entropy: target ", check.bad.value,
           " is out of range for ", classes, " classes (expected 0 <= target < ", classes,
           ", or ignore_index ", opts.ignore_index, ")");
  saved->count = check.count;
  if (ct != dt) out = out.to(dt);
  record("CrossEntropyBackward", {logits}, out, [saved, opts, dt](const TensorList& g) {
    const Tensor& x = saved->logits;
    const auto backward =
        detail::kernel(&Kernels::cross_entropy_backward, x.device(), "cross_entropy");
    const Tensor gc = g[0].to(x.dtype()).contiguous();
    Tensor dx = empty(x.shape(), detail::options_on(x, x.dtype()));
    backward(dx, gc, x, saved->targets, saved->lse, opts.reduction, opts.ignore_index,
             opts.label_smoothing, saved->count);
    return TensorList{dx.to(dt)};
  });
  return out;
}

Tensor mse_loss(const Tensor& input, const Tensor& target, Reduction reduction) {
  LS_AUTOCAST("mse_loss", mse_loss, input, target, reduction);
  detail::check_defined(input, "mse_loss");
  detail::check_defined(target, "mse_loss", "target");
  detail::check_same_device(input, target, "mse_loss");
  LS_CHECK(input.shape() == target.shape(), "mse_loss: input of shape ", input.shape().str(),
           " and target of shape ", target.shape().str(), " differ (reduction ",
           reduction_name(reduction), ")");
  LS_CHECK(input.dtype() == target.dtype(), "mse_loss: dtypes ", dtype_name(input.dtype()), " and ",
           dtype_name(target.dtype()), " of input and target differ; convert one with .to()");
  LS_CHECK(is_floating(input.dtype()), "mse_loss: expected floating-point tensors, got ",
           dtype_name(input.dtype()));
  const auto forward = detail::kernel(&Kernels::mse_loss, input.device(), "mse_loss");
  const DType dt = input.dtype();
  const DType ct = is_half(dt) ? kFloat32 : dt;
  const Tensor x = input.detach().to(ct).contiguous(), t = target.detach().to(ct).contiguous();
  Tensor out = empty(reduction == Reduction::none ? x.shape() : Dims{}, detail::options_on(x, ct));
  forward(out, x, t, reduction);
  out = out.to(dt);
  record("MseLossBackward", {input, target}, out,
         [x, t, reduction, dt, rx = input.requires_grad(),
          rt = target.requires_grad()](const TensorList& g) {
           const auto backward =
               detail::kernel(&Kernels::mse_loss_backward, x.device(), "mse_loss");
           const auto opts = detail::options_on(x, x.dtype());
           const Tensor gc = g[0].to(x.dtype()).contiguous();
           Tensor gx = rx ? empty(x.shape(), opts) : Tensor();
           Tensor gt = rt ? empty(x.shape(), opts) : Tensor();
           backward(gx, gt, gc, x, t, reduction);
           return TensorList{gx.defined() ? gx.to(dt) : gx, gt.defined() ? gt.to(dt) : gt};
         });
  return out;
}

}  // namespace lockstep
