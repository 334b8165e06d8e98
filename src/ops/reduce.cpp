// Reductions' fronts: sum, mean, var, max/min (with indices), argmax/argmin, their gradients,
// and sum_to; the kernels are src/ops/cpu/reduce.cpp.
#include "lockstep/ops/reduce.h"

#include <cmath>
#include <limits>

#include "lockstep/autograd/grad_mode.h"
#include "lockstep/autograd/node.h"
#include "lockstep/ops/autocast.h"
#include "lockstep/ops/elementwise.h"
#include "ops/common.h"
#include "ops/kernels.h"

namespace lockstep {

using autograd::record;
using autograd::TensorList;
using detail::Kernels;
using detail::ReducePlan;

namespace {

ReducePlan make_plan(const Tensor& a, const Dims& dims_in, bool keepdim, const char* op) {
  ReducePlan p;
  bool reduce[Dims::kMaxDims] = {};
  if (dims_in.empty()) {
    for (int64_t d = 0; d < a.dim(); ++d) reduce[d] = true;
  } else {
    for (int64_t d : dims_in) {
      int64_t nd = detail::normalize_dim(d, a.dim(), op);
      if (a.dim() == 0) continue;
      LS_CHECK(!reduce[nd], op, ": dimension ", d, " appears twice in ", dims_in.str());
      reduce[nd] = true;
    }
  }
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (reduce[d]) {
      p.red_shape.push_back(a.shape()[d]);
      p.red_strides.push_back(a.strides()[d]);
      p.count *= a.shape()[d];
      p.keepdim_shape.push_back(1);
      if (keepdim) p.out_shape.push_back(1);
    } else {
      p.keep_shape.push_back(a.shape()[d]);
      p.keep_strides.push_back(a.strides()[d]);
      p.keepdim_shape.push_back(a.shape()[d]);
      p.out_shape.push_back(a.shape()[d]);
    }
  }
  return p;
}

// Sum (mean when `divide`) without autograd.
Tensor sum_impl(const Tensor& a, const Dims& dims, bool keepdim, bool divide, const char* op) {
  autograd::NoGradGuard no_grad;  // internal views and casts are not part of the graph
  detail::check_defined(a, op);
  const auto kernel = detail::kernel(&Kernels::sum, a.device(), op);
  if (is_half(a.dtype())) return sum_impl(a.to(kFloat32), dims, keepdim, divide, op).to(a.dtype());
  ReducePlan p = make_plan(a, dims, keepdim, op);
  const bool floating = is_floating(a.dtype());
  LS_CHECK(floating || !divide, op, ": needs a floating-point input, got ", dtype_name(a.dtype()));
  Tensor out = empty(p.out_shape, detail::options_on(a, floating ? a.dtype() : kInt64));
  kernel(out, a, p, divide ? 1.0 / static_cast<double>(p.count) : 1.0);
  return out;
}

// Gradient of a reduction that broadcasts g back over the reduced dims.
Tensor expand_back(const Tensor& g, const Dims& input_shape, const ReducePlan& p) {
  return g.reshape(p.keepdim_shape).expand(input_shape);
}

constexpr int64_t kAllDims = std::numeric_limits<int64_t>::min();

// Values and indices along one dim (or over everything when dim < 0).
std::pair<Tensor, Tensor> extreme(const Tensor& a, int64_t dim, bool keepdim, bool is_max,
                                  const char* op) {
  autograd::NoGradGuard no_grad;  // internal views and casts are not part of the graph
  detail::check_defined(a, op);
  const auto kernel = detail::kernel(&Kernels::extreme, a.device(), op);
  LS_CHECK(a.numel() > 0, op, ": cannot reduce an empty tensor (shape ", a.shape().str(), ")");
  if (is_half(a.dtype())) {
    auto [v, i] = extreme(a.to(kFloat32), dim, keepdim, is_max, op);
    return {v.to(a.dtype()), i};
  }
  const bool all = dim == kAllDims;
  Tensor s = a.dtype() == kBool ? a.to(kUInt8) : a;
  if (all) s = s.reshape({-1});
  ReducePlan p = make_plan(s, all ? Dims{} : Dims{dim}, keepdim, op);
  Tensor values = empty(p.out_shape, detail::options_on(s, s.dtype()));
  Tensor indices = empty(p.out_shape, detail::options_on(s, kInt64));
  kernel(values, indices, s, p, is_max);
  return {values, indices};
}

// Scatters g (keepdim shape) into zeros of `shape` at `indices` along `dim`: gather's adjoint.
Tensor scatter_along(const Tensor& g, const Tensor& indices, const Dims& shape, int64_t dim) {
  const DType compute = is_half(g.dtype()) ? kFloat32 : g.dtype();
  const auto kernel = detail::kernel(&Kernels::scatter_add, g.device(), "max_backward");
  Tensor out = zeros(shape, detail::options_on(g, compute));
  kernel(out, dim, indices.contiguous(), g.to(compute).contiguous());
  return compute == g.dtype() ? out : out.to(g.dtype());
}

std::pair<Tensor, Tensor> extreme_dim(const Tensor& a, int64_t dim, bool keepdim, bool is_max) {
  const char* op = is_max ? "max" : "min";
  const int64_t d = detail::normalize_dim(dim, a.dim(), op);
  auto [values, indices] = extreme(a, a.dim() == 0 ? kAllDims : d, keepdim, is_max, op);
  Dims shape = a.shape();
  Dims kshape = shape;
  if (a.dim() > 0) kshape[d] = 1;
  record(
      is_max ? "MaxBackward" : "MinBackward", {a}, values,
      [indices, shape, kshape, d](const TensorList& g) {
        if (shape.empty()) return TensorList{g[0].reshape(shape)};
        return TensorList{scatter_along(g[0].reshape(kshape), indices.reshape(kshape), shape, d)};
      });
  return {values, indices};
}

Tensor extreme_all(const Tensor& a, bool is_max) {
  const char* op = is_max ? "max" : "min";
  Tensor values = extreme(a, kAllDims, false, is_max, op).first;
  Tensor saved = values.detach();
  record(is_max ? "MaxAllBackward" : "MinAllBackward", {a}, values,
         [a, saved](const TensorList& g) {
           // Ties share the gradient equally (as torch.max() over all elements does).
           Tensor mask = eq(a, saved).to(g[0].dtype());
           return TensorList{mul(mask, div(g[0], sum(mask)))};
         });
  return values;
}

}  // namespace

Tensor sum(const Tensor& a, const Dims& dims, bool keepdim) {
  LS_AUTOCAST("sum", sum, a, dims, keepdim);
  Tensor out = sum_impl(a, dims, keepdim, false, "sum");
  if (autograd::needs_grad({&a})) {
    ReducePlan p = make_plan(a, dims, keepdim, "sum");
    record("SumBackward", {a}, out, [shape = a.shape(), p](const TensorList& g) {
      return TensorList{expand_back(g[0], shape, p)};
    });
  }
  return out;
}

Tensor sum(const Tensor& a) { return sum(a, Dims{}, false); }

Tensor mean(const Tensor& a, const Dims& dims, bool keepdim) {
  LS_AUTOCAST("mean", mean, a, dims, keepdim);
  Tensor out = sum_impl(a, dims, keepdim, true, "mean");
  if (autograd::needs_grad({&a})) {
    ReducePlan p = make_plan(a, dims, keepdim, "mean");
    record("MeanBackward", {a}, out, [shape = a.shape(), p](const TensorList& g) {
      return TensorList{expand_back(div(g[0], static_cast<double>(p.count)), shape, p)};
    });
  }
  return out;
}

Tensor mean(const Tensor& a) { return mean(a, Dims{}, false); }

Tensor var(const Tensor& a, const Dims& dims, int64_t correction, bool keepdim) {
  LS_AUTOCAST("var", var, a, dims, correction, keepdim);
  detail::check_defined(a, "var");
  const auto kernel = detail::kernel(&Kernels::var, a.device(), "var");
  LS_CHECK(is_floating(a.dtype()), "var: needs a floating-point input, got ",
           dtype_name(a.dtype()));
  if (is_half(a.dtype())) return var(a.to(kFloat32), dims, correction, keepdim).to(a.dtype());
  ReducePlan p = make_plan(a, dims, keepdim, "var");
  Tensor out = empty(p.out_shape, detail::options_on(a, a.dtype()));
  const double denom = std::max<double>(0.0, static_cast<double>(p.count - correction));
  kernel(out, a, p, denom);  // denom 0 gives inf/NaN, as torch.var
  record("VarBackward", {a}, out, [a, p, denom, dims](const TensorList& g) {
    Tensor m = mean(a, dims, true);
    Tensor scale = div(expand_back(g[0], a.shape(), p), denom / 2.0);
    return TensorList{mul(scale, sub(a, m))};
  });
  return out;
}

Tensor var(const Tensor& a, int64_t correction) { return var(a, Dims{}, correction, false); }

Tensor max(const Tensor& a) { return extreme_all(a, true); }
Tensor min(const Tensor& a) { return extreme_all(a, false); }

std::pair<Tensor, Tensor> max(const Tensor& a, int64_t dim, bool keepdim) {
  return extreme_dim(a, dim, keepdim, true);
}
std::pair<Tensor, Tensor> min(const Tensor& a, int64_t dim, bool keepdim) {
  return extreme_dim(a, dim, keepdim, false);
}

Tensor argmax(const Tensor& a, int64_t dim, bool keepdim) {
  autograd::NoGradGuard g;
  return max(a, dim, keepdim).second;
}
Tensor argmin(const Tensor& a, int64_t dim, bool keepdim) {
  autograd::NoGradGuard g;
  return min(a, dim, keepdim).second;
}
Tensor argmax(const Tensor& a) { return extreme(a, kAllDims, false, true, "argmax").second; }

Tensor sum_to(const Tensor& grad, const Dims& shape) {
  if (!grad.defined() || grad.shape() == shape) return grad;
  const int64_t lead = grad.dim() - shape.size();
  LS_CHECK(lead >= 0, "sum_to: cannot reduce ", grad.shape().str(), " to ", shape.str());
  Dims dims;
  for (int64_t d = 0; d < grad.dim(); ++d) {
    if (d < lead || (shape[d - lead] == 1 && grad.shape()[d] != 1)) dims.push_back(d);
  }
  Tensor r = dims.empty() ? grad : sum(grad, dims, /*keepdim=*/true);
  return r.reshape(shape);
}


}  // namespace lockstep
