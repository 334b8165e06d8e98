// SyncBatchNorm: statistics gathered across the group in forward, the two gradient sums reduced
// in backward (Note [SyncBatchNorm]), and the conversion of a model's BatchNorm layers.
#include "lockstep/distributed/sync_batchnorm.h"

#include <cmath>
#include <sstream>
#include <vector>

#include "lockstep/autograd/grad_mode.h"
#include "lockstep/autograd/node.h"
#include "lockstep/base/error.h"
#include "lockstep/distributed/init.h"
#include "lockstep/nn/layers.h"
#include "lockstep/ops/elementwise.h"
#include "lockstep/ops/nn.h"
#include "lockstep/ops/reduce.h"

namespace lockstep::dist {

namespace {

// The dims a per-channel statistic reduces over: all but 1.
Dims reduce_dims(const Tensor& x) {
  Dims d;
  for (int64_t i = 0; i < x.dim(); ++i) {
    if (i != 1) d.push_back(i);
  }
  return d;
}

// (C) -> (1, C, 1, ...) to broadcast against x.
Tensor per_channel(const Tensor& t, const Tensor& x) {
  Dims shape;
  for (int64_t i = 0; i < x.dim(); ++i) shape.push_back(i == 1 ? x.size(1) : 1);
  return t.view(shape);
}

}  // namespace

Tensor sync_batch_norm(const Tensor& x, const Tensor& running_mean, const Tensor& running_var,
                       const Tensor& weight, const Tensor& bias, double momentum, double eps,
                       ProcessGroup& pg) {
  LS_CHECK(x.defined() && x.dim() >= 2, "sync_batch_norm: expected input of shape (N, C, *), got ",
           x.defined() ? x.shape().str() : std::string("an undefined tensor"));
  LS_CHECK(is_floating(x.dtype()), "sync_batch_norm: expected a floating-point input, got ",
           dtype_name(x.dtype()));
  const int64_t channels = x.size(1);
  const DType dt = x.dtype();
  const DType ct = is_half(dt) ? kFloat32 : dt;  // compute dtype, as batch_norm's
  const auto opts = TensorOptions(ct).with_device(x.device());
  const int64_t count = channels > 0 ? x.numel() / channels : 0;  // this rank's values/channel
  const Tensor xc = x.detach().to(ct).contiguous();
  const Dims dims = reduce_dims(xc);

  // ---- the whole batch's statistics: every rank's (mean, var, count), combined ----
  Tensor mean, var;  // (C) in ct
  int64_t total = 0;
  {
    autograd::NoGradGuard no_grad;
    Tensor local = zeros({2 * channels + 1}, opts);
    if (count > 0) {
      const Tensor m = lockstep::mean(xc, dims);
      const Tensor centered = sub(xc, per_channel(m, xc));
      local.narrow(0, 0, channels).copy_(m);
      local.narrow(0, channels, channels).copy_(lockstep::mean(mul(centered, centered), dims));
      local.narrow(0, 2 * channels, 1).fill_(static_cast<double>(count));
    }
    const int world = pg.size();
    Tensor gathered = empty({world * (2 * channels + 1)}, opts);
    pg.all_gather(gathered, local)->wait();
    // Chan et al.'s combination of per-rank moments, on the host in f64 and in rank order.
    const std::vector<double> g = gathered.to(Device()).to_vector<double>();
    std::vector<double> mu(channels, 0.0), m2(channels, 0.0);
    const auto at = [&](int r, int64_t i) { return g[r * (2 * channels + 1) + i]; };
    for (int r = 0; r < world; ++r) total += static_cast<int64_t>(at(r, 2 * channels));
    LS_CHECK(total > 1,
             "SyncBatchNorm: training needs more than one value per channel across "
             "the group, got ",
             total, " (this rank's input has shape ", x.shape().str(), ")");
    for (int64_t c = 0; c < channels; ++c) {
      for (int r = 0; r < world; ++r) mu[c] += at(r, 2 * channels) * at(r, c);
      mu[c] /= static_cast<double>(total);
      for (int r = 0; r < world; ++r) {
        const double d = at(r, c) - mu[c];
        m2[c] += at(r, 2 * channels) * (at(r, channels + c) + d * d);
      }
      m2[c] /= static_cast<double>(total);  // biased variance
    }
    mean = from_vector(mu, {channels}).to(ct).to(x.device());
    var = from_vector(m2, {channels}).to(ct).to(x.device());
    if (running_mean.defined()) {
      const double unbias = static_cast<double>(total) / static_cast<double>(total - 1);
      Tensor rm = running_mean, rv = running_var;  // handles to the caller's buffers
      rm.mul_(1.0 - momentum).add_(mean.to(rm.dtype()), momentum);
      rv.mul_(1.0 - momentum).add_(var.to(rv.dtype()), momentum * unbias);
    }
  }

  // ---- normalize: batch_norm with these statistics in the role of the running ones ----
  const Tensor wc = weight.defined() ? weight.detach().to(ct) : Tensor();
  Tensor y;
  {
    autograd::NoGradGuard no_grad;
    y = batch_norm(xc, mean, var, wc, bias.defined() ? bias.detach().to(ct) : Tensor(), false, 0.0,
                   eps)
            .to(dt);
  }

  autograd::record(
      "SyncBatchNormBackward", {x, weight, bias}, y,
      [xc, mean, var, wc, eps, total, dims, dt, pg = pg.shared_from_this(),
       wdt = weight.defined() ? weight.dtype() : dt, bdt = bias.defined() ? bias.dtype() : dt,
       rx = x.requires_grad(), rw = weight.defined() && weight.requires_grad(),
       rb = bias.defined() && bias.requires_grad()](const autograd::TensorList& grads) {
        autograd::NoGradGuard no_grad;
        const int64_t channels = mean.size(0);
        const Tensor gc = grads[0].to(xc.dtype()).contiguous();
        const Tensor xmu = sub(xc, per_channel(mean, xc));
        const Tensor invstd = rsqrt(add(var, eps));
        // Local sums per channel (zeros where this rank's batch is empty).
        Tensor sums = zeros({2 * channels}, TensorOptions(xc.dtype()).with_device(xc.device()));
        if (xc.numel() > 0) {
          sums.narrow(0, 0, channels).copy_(sum(gc, dims));
          sums.narrow(0, channels, channels).copy_(sum(mul(gc, xmu), dims));
        }
        const Tensor dw = rw ? mul(sums.narrow(0, channels, channels), invstd).to(wdt) : Tensor();
        const Tensor db = rb ? sums.narrow(0, 0, channels).clone().to(bdt) : Tensor();
        Tensor dx;
        if (rx) {
          Tensor global = sums.clone();
          pg->all_reduce(global)->wait();
          const double n = static_cast<double>(total);
          const Tensor mean_dy = div(global.narrow(0, 0, channels), n);
          const Tensor mean_dy_xmu = div(global.narrow(0, channels, channels), n);
          // dx = (dy - mean(dy) - (x - mean) invstd^2 mean(dy (x - mean))) invstd weight
          Tensor scale = wc.defined() ? mul(invstd, wc) : invstd;
          Tensor t = sub(gc, per_channel(mean_dy, xc));
          t = sub(t, mul(xmu, per_channel(mul(mul(invstd, invstd), mean_dy_xmu), xc)));
          dx = mul(t, per_channel(scale, xc)).to(dt);
        }
        return autograd::TensorList{dx, dw, db};
      });
  return y;
}

SyncBatchNorm::SyncBatchNorm(int64_t num_features, double eps, double momentum, bool affine,
                             ProcessGroupPtr pg)
    : nn::Module("SyncBatchNorm"),
      num_features_(num_features),
      eps_(eps),
      momentum_(momentum),
      pg_(std::move(pg)) {
  if (affine) {
    weight_ = register_parameter("weight", ones({num_features}));
    bias_ = register_parameter("bias", zeros({num_features}));
  }
  running_mean_ = register_buffer("running_mean", zeros({num_features}));
  running_var_ = register_buffer("running_var", ones({num_features}));
  num_batches_tracked_ = register_buffer("num_batches_tracked", zeros({}, kInt64));
}

// The same tensors, not copies: an optimizer built on the BatchNorm still updates them.
SyncBatchNorm::SyncBatchNorm(const nn::BatchNorm& from, ProcessGroupPtr pg)
    : nn::Module("SyncBatchNorm"),
      num_features_(from.num_features()),
      eps_(from.eps()),
      momentum_(from.momentum()),
      pg_(std::move(pg)) {
  for (const auto& [name, t] : from.named_parameters(false)) {
    (name == "weight" ? weight_ : bias_) = register_parameter(name, t);
  }
  for (const auto& [name, t] : from.named_buffers(false)) {
    Tensor& b = register_buffer(name, t);
    if (name == "running_mean") running_mean_ = b;
    if (name == "running_var") running_var_ = b;
    if (name == "num_batches_tracked") num_batches_tracked_ = b;
  }
  train(from.is_training());
}

Tensor SyncBatchNorm::forward(const Tensor& x) {
  LS_CHECK(x.dim() >= 2 && x.size(1) == num_features_,
           "SyncBatchNorm: expected input of shape (N, C, *) with C=", num_features_, ", got ",
           x.shape().str());
  if (!is_training()) {
    return batch_norm(x, running_mean_, running_var_, weight_, bias_, false, momentum_, eps_);
  }
  if (pg_ == nullptr) {
    pg_ = default_group();
    LS_CHECK(pg_ != nullptr,
             "SyncBatchNorm: no process group given and none initialized; call "
             "init_process_group() before the first training forward, or pass a group");
  }
  Tensor y = sync_batch_norm(x, running_mean_, running_var_, weight_, bias_, momentum_, eps_, *pg_);
  autograd::NoGradGuard no_grad;
  num_batches_tracked_.add_(1.0);
  return y;
}

std::string SyncBatchNorm::extra_repr() const {
  std::ostringstream os;
  os << num_features_ << ", eps=" << eps_ << ", momentum=" << momentum_;
  return os.str();
}

std::shared_ptr<nn::Module> convert_sync_batchnorm(std::shared_ptr<nn::Module> module,
                                                   ProcessGroupPtr pg) {
  LS_CHECK(module != nullptr, "convert_sync_batchnorm: no module given");
  if (auto bn = std::dynamic_pointer_cast<nn::BatchNorm>(module)) {
    return std::shared_ptr<SyncBatchNorm>(new SyncBatchNorm(*bn, std::move(pg)));
  }
  for (const auto& [name, child] : module->named_children()) {
    auto converted = convert_sync_batchnorm(child, pg);
    if (converted != child) module->replace_child(name, converted);
  }
  return module;
}

}  // namespace lockstep::dist
