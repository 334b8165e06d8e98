// Losses: cross_entropy (log-softmax and NLL fused, with ignore_index and label smoothing) and
// mse_loss, with their fused backward kernels.
#include <cmath>
#include <limits>
#include <vector>

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

// ---- cross_entropy ----

// What the forward saves for the backward.
struct CrossEntropySaved {
  Tensor logits;   // (N, C, d...) detached input, in the compute dtype
  Tensor targets;  // (N * d...) contiguous i64
  Tensor lse;      // (N * d...) log-sum-exp of each row
  int64_t count;   // non-ignored targets
};

// Class indices as contiguous i64, checked against [0, C) unless equal to ignore_index.
Tensor checked_targets(const Tensor& targets, int64_t classes, int64_t ignore_index,
                       int64_t* count) {
  Tensor t = targets.to(kInt64).contiguous();
  const int64_t* p = t.data<int64_t>();
  int64_t n = 0;
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (p[i] == ignore_index) continue;
    LS_CHECK(p[i] >= 0 && p[i] < classes, "cross_entropy: target ", p[i], " is out of range for ",
             classes, " classes (expected 0 <= target < ", classes, ", or ignore_index ",
             ignore_index, ")");
    ++n;
  }
  *count = n;
  return t;
}

// Per-row loss (0 for ignored rows) and log-sum-exp, one row per (n, d...) position. Each row
// is read twice (max, then exp-sum together with the target and smoothing terms), never
// materializing log_softmax.
template <typename T>
void cross_entropy_rows(const Tensor& x, const int64_t* tgt, int64_t ignore_index, double smoothing,
                        T* lse_out, double* loss_out) {
  cpu::Rows<1> rows(x.shape(), 1, {&x});
  const T* px = x.data<T>();
  const int64_t c = rows.length(), sx = rows.step(0);
  cpu::parallel_rows(rows.count(), c, [&](int64_t r) {
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
void cross_entropy_backward_rows(const CrossEntropySaved& s, const Tensor& dx,
                                 const double* row_scale, double uniform_scale,
                                 int64_t ignore_index, double smoothing) {
  cpu::Rows<2> rows(dx.shape(), 1, {&dx, &s.logits});
  T* pd = dx.data<T>();
  const T* px = s.logits.data<T>();
  const T* lse = s.lse.data<T>();
  const int64_t* tgt = s.targets.data<int64_t>();
  const int64_t c = rows.length(), sd = rows.step(0), sx = rows.step(1);
  const double off_target = smoothing / static_cast<double>(c);
  cpu::parallel_rows(rows.count(), c, [&](int64_t r) {
    int64_t off[2];
    rows.offsets(r, off);
    T* dr = pd + off[0];
    const T* xr = px + off[1];
    const int64_t t = tgt[r];
    if (t == ignore_index) {
      for (int64_t i = 0; i < c; ++i) dr[i * sd] = T(0);
      return;
    }
    const T scale = static_cast<T>(row_scale ? row_scale[r] : uniform_scale);
    const T l = lse[r], sub = static_cast<T>(off_target);
    for (int64_t i = 0; i < c; ++i) dr[i * sd] = scale * (std::exp(xr[i * sx] - l) - sub);
    dr[t * sd] -= scale * static_cast<T>(1 - smoothing);
  });
}

Tensor cross_entropy_grad(const Tensor& g, const CrossEntropySaved& s, Reduction reduction,
                          int64_t ignore_index, double smoothing) {
  const DType dt = s.logits.dtype();
  Tensor dx = empty(s.logits.shape(), dt);
  std::vector<double> per_row;
  double uniform = 0;
  if (reduction == Reduction::none) {
    per_row = g.to(kFloat64).reshape({-1}).contiguous().to_vector<double>();
  } else {
    uniform = g.item();
    if (reduction == Reduction::mean) uniform /= static_cast<double>(s.count);
  }
  cpu::dispatch_float(dt, "cross_entropy", [&]<typename T>() {
    cross_entropy_backward_rows<T>(s, dx, per_row.empty() ? nullptr : per_row.data(), uniform,
                                   ignore_index, smoothing);
  });
  return dx;
}

// ---- mse_loss ----

template <typename T>
Tensor mse_forward(const Tensor& x, const Tensor& t, Reduction reduction) {
  const T* px = x.data<T>();
  const T* pt = t.data<T>();
  const int64_t n = x.numel();
  if (reduction == Reduction::none) {
    Tensor out = empty(x.shape(), dtype_of<T>::value);
    T* po = out.data<T>();
    cpu::parallel_for(0, n, cpu::kElementwiseGrain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const T d = px[i] - pt[i];
        po[i] = d * d;
      }
    });
    return out;
  }
  double total = cpu::blocked_sum(n, [&](int64_t i) {
    const double d = static_cast<double>(px[i]) - static_cast<double>(pt[i]);
    return d * d;
  });
  if (reduction == Reduction::mean) total /= static_cast<double>(n);  // n == 0 gives NaN
  return full({}, total, dtype_of<T>::value);
}

// d/dx = 2 (x - t) g (/ n for mean); d/dt is its negation.
template <typename T>
void mse_backward(const Tensor& x, const Tensor& t, const Tensor& g, Reduction reduction,
                  Tensor* gx, Tensor* gt) {
  const T* px = x.data<T>();
  const T* pt = t.data<T>();
  const int64_t n = x.numel();
  const T* pg = reduction == Reduction::none ? g.data<T>() : nullptr;
  const T scalar =
      reduction == Reduction::none
          ? T(0)
          : static_cast<T>(2.0 * g.item() /
                           (reduction == Reduction::mean ? static_cast<double>(n) : 1.0));
  T* ox = gx->defined() ? gx->data<T>() : nullptr;
  T* ot = gt->defined() ? gt->data<T>() : nullptr;
  cpu::parallel_for(0, n, cpu::kElementwiseGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const T v = (pg ? T(2) * pg[i] : scalar) * (px[i] - pt[i]);
      if (ox) ox[i] = v;
      if (ot) ot[i] = -v;
    }
  });
}

}  // namespace

Tensor cross_entropy(const Tensor& logits, const Tensor& targets, const CrossEntropyOptions& opts) {
  LS_AUTOCAST("cross_entropy", cross_entropy, logits, targets, opts);
  detail::check_cpu(logits, "cross_entropy");
  detail::check_cpu(targets, "cross_entropy");
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
  const int64_t classes = logits.size(1);
  const DType dt = logits.dtype();
  const DType ct = is_half(dt) ? kFloat32 : dt;  // compute dtype

  auto saved = std::make_shared<CrossEntropySaved>();
  saved->logits = logits.detach().to(ct);
  saved->targets = checked_targets(targets, classes, opts.ignore_index, &saved->count);
  const int64_t rows = tshape.numel();
  saved->lse = empty({rows}, ct);
  std::vector<double> loss(static_cast<size_t>(rows));
  cpu::dispatch_float(ct, "cross_entropy", [&]<typename T>() {
    cross_entropy_rows<T>(saved->logits, saved->targets.data<int64_t>(), opts.ignore_index,
                          opts.label_smoothing, saved->lse.data<T>(), loss.data());
  });

  Tensor out;
  if (opts.reduction == Reduction::none) {
    out = from_vector(loss, tshape).to(dt);
  } else {
    double total = 0;
    for (double v : loss) total += v;
    // Mean over the non-ignored targets, as PyTorch: all ignored gives 0 / 0 = NaN.
    if (opts.reduction == Reduction::mean) total /= static_cast<double>(saved->count);
    out = full({}, total, dt);
  }
  record("CrossEntropyBackward", {logits}, out, [saved, opts, dt](const TensorList& g) {
    Tensor dx =
        cross_entropy_grad(g[0], *saved, opts.reduction, opts.ignore_index, opts.label_smoothing);
    return TensorList{dx.to(dt)};
  });
  return out;
}

Tensor mse_loss(const Tensor& input, const Tensor& target, Reduction reduction) {
  LS_AUTOCAST("mse_loss", mse_loss, input, target, reduction);
  detail::check_cpu(input, "mse_loss");
  detail::check_cpu(target, "mse_loss");
  LS_CHECK(input.shape() == target.shape(), "mse_loss: input of shape ", input.shape().str(),
           " and target of shape ", target.shape().str(), " differ (reduction ",
           reduction_name(reduction), ")");
  LS_CHECK(input.dtype() == target.dtype(), "mse_loss: dtypes ", dtype_name(input.dtype()), " and ",
           dtype_name(target.dtype()), " of input and target differ; convert one with .to()");
  LS_CHECK(is_floating(input.dtype()), "mse_loss: expected floating-point tensors, got ",
           dtype_name(input.dtype()));
  const DType dt = input.dtype();
  const DType ct = is_half(dt) ? kFloat32 : dt;
  const Tensor x = input.detach().to(ct).contiguous(), t = target.detach().to(ct).contiguous();
  Tensor out = cpu::dispatch_float(ct, "mse_loss",
                                   [&]<typename T>() { return mse_forward<T>(x, t, reduction); });
  out = out.to(dt);
  record("MseLossBackward", {input, target}, out,
         [x, t, reduction, dt, rx = input.requires_grad(),
          rt = target.requires_grad()](const TensorList& g) {
           const DType ct = x.dtype();
           const Tensor gc = g[0].to(ct).contiguous();
           Tensor gx = rx ? empty(x.shape(), ct) : Tensor();
           Tensor gt = rt ? empty(x.shape(), ct) : Tensor();
           cpu::dispatch_float(ct, "mse_loss", [&]<typename T>() {
             mse_backward<T>(x, t, gc, reduction, &gx, &gt);
           });
           return TensorList{gx.defined() ? gx.to(dt) : gx, gt.defined() ? gt.to(dt) : gt};
         });
  return out;
}

}  // namespace lockstep
