// Reductions: sum, mean, var, max/min (with indices), argmax/argmin, and their gradients.
#include "lockstep/ops/reduce.h"

#include <cmath>
#include <limits>

#include "lockstep/autograd/grad_mode.h"
#include "lockstep/autograd/node.h"
#include "lockstep/ops/autocast.h"
#include "lockstep/ops/elementwise.h"
#include "ops/common.h"
#include "tensor/dispatch.h"
#include "tensor/parallel.h"

namespace lockstep {

using autograd::record;
using autograd::TensorList;

namespace {

// Outputs per thread chunk: a reduction of many small rows should still spread over threads,
// one over few long rows parallelizes inside nothing (rows are reduced serially).
constexpr int64_t kReduceGrainElements = 32768;

// Splits a tensor's dims into kept (output) and reduced ones.
struct ReducePlan {
  Dims keep_shape, keep_strides;  // input strides of the kept dims
  Dims red_shape, red_strides;    // input strides of the reduced dims
  Dims out_shape;                 // with or without the kept size-1 dims
  Dims keepdim_shape;             // always with them
  int64_t count = 1;              // elements reduced per output
};

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

// Calls f(ptr, stride, n) for each run of the innermost reduced dim of output `o`.
template <typename T, typename F>
void visit_reduced(const T* base, const ReducePlan& p, int64_t o, const F& f) {
  for (int64_t d = p.keep_shape.size() - 1; d >= 0; --d) {
    base += (o % p.keep_shape[d]) * p.keep_strides[d];
    o /= p.keep_shape[d];
  }
  const int64_t nr = p.red_shape.size();
  if (nr == 0) {
    f(base, 1, 1);
    return;
  }
  const int64_t inner_n = p.red_shape[nr - 1], inner_s = p.red_strides[nr - 1];
  if (inner_n == 0) return;
  int64_t outer = 1;
  for (int64_t d = 0; d + 1 < nr; ++d) outer *= p.red_shape[d];
  for (int64_t r = 0; r < outer; ++r) {
    const T* q = base;
    int64_t rem = r;
    for (int64_t d = nr - 2; d >= 0; --d) {
      q += (rem % p.red_shape[d]) * p.red_strides[d];
      rem /= p.red_shape[d];
    }
    f(q, inner_s, inner_n);
  }
}

// Runs body(o) for every output index in parallel.
template <typename Body>
void for_outputs(int64_t outputs, int64_t count, const Body& body) {
  const int64_t grain = std::max<int64_t>(1, kReduceGrainElements / std::max<int64_t>(count, 1));
  cpu::parallel_for(0, outputs, grain, [&](int64_t b, int64_t e) {
    for (int64_t o = b; o < e; ++o) body(o);
  });
}

template <typename T>
inline double sum_run(const T* p, int64_t s, int64_t n) {
  // Four partial sums: independent chains the CPU overlaps, and a little less rounding.
  double a0 = 0, a1 = 0, a2 = 0, a3 = 0;
  int64_t i = 0;
  if (s == 1) {
    for (; i + 4 <= n; i += 4) {
      a0 += static_cast<double>(p[i]);
      a1 += static_cast<double>(p[i + 1]);
      a2 += static_cast<double>(p[i + 2]);
      a3 += static_cast<double>(p[i + 3]);
    }
  }
  for (; i < n; ++i) a0 += static_cast<double>(p[i * s]);
  return (a0 + a1) + (a2 + a3);
}

// Sum (mean when `divide`) without autograd.
Tensor sum_impl(const Tensor& a, const Dims& dims, bool keepdim, bool divide, const char* op) {
  autograd::NoGradGuard no_grad;  // internal views and casts are not part of the graph
  detail::check_cpu(a, op);
  if (is_half(a.dtype())) return sum_impl(a.to(kFloat32), dims, keepdim, divide, op).to(a.dtype());
  ReducePlan p = make_plan(a, dims, keepdim, op);
  const bool floating = is_floating(a.dtype());
  LS_CHECK(floating || !divide, op, ": needs a floating-point input, got ", dtype_name(a.dtype()));
  Tensor out = empty(p.out_shape, floating ? a.dtype() : kInt64);
  const int64_t outputs = out.numel();
  const double scale = divide ? 1.0 / static_cast<double>(p.count) : 1.0;
  cpu::dispatch_all(a.dtype(), op, [&]<typename T>() {
    if constexpr (cpu::is_half_type_v<T>) {
      LS_THROW(op, ": unreachable half path");
    } else {
      const T* base = static_cast<const T*>(a.data_ptr());
      if constexpr (std::is_floating_point_v<T>) {
        T* o = static_cast<T*>(out.data_ptr());
        if (outputs == 1 && a.is_contiguous()) {  // one long sum: split it into blocks
          const double total =
              cpu::blocked_sum(a.numel(), [&](int64_t k) { return static_cast<double>(base[k]); });
          o[0] = static_cast<T>(total * scale);
          return;
        }
        for_outputs(outputs, p.count, [&](int64_t i) {
          double acc = 0;
          visit_reduced(base, p, i,
                        [&](const T* q, int64_t s, int64_t n) { acc += sum_run(q, s, n); });
          o[i] = static_cast<T>(acc * scale);
        });
      } else {
        int64_t* o = static_cast<int64_t*>(out.data_ptr());
        for_outputs(outputs, p.count, [&](int64_t i) {
          int64_t acc = 0;
          visit_reduced(base, p, i, [&](const T* q, int64_t s, int64_t n) {
            for (int64_t k = 0; k < n; ++k) acc += static_cast<int64_t>(q[k * s]);
          });
          o[i] = acc;
        });
      }
    }
  });
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
  detail::check_cpu(a, op);
  LS_CHECK(a.numel() > 0, op, ": cannot reduce an empty tensor (shape ", a.shape().str(), ")");
  if (is_half(a.dtype())) {
    auto [v, i] = extreme(a.to(kFloat32), dim, keepdim, is_max, op);
    return {v.to(a.dtype()), i};
  }
  const bool all = dim == kAllDims;
  Tensor s = a.dtype() == kBool ? a.to(kUInt8) : a;
  if (all) s = s.reshape({-1});
  ReducePlan p = make_plan(s, all ? Dims{} : Dims{dim}, keepdim, op);
  Tensor values = empty(p.out_shape, s.dtype());
  Tensor indices = empty(p.out_shape, kInt64);
  cpu::dispatch_numeric(s.dtype(), op, [&]<typename T>() {
    const T* base = static_cast<const T*>(s.data_ptr());
    T* vo = static_cast<T*>(values.data_ptr());
    int64_t* io = static_cast<int64_t*>(indices.data_ptr());
    for_outputs(values.numel(), p.count, [&](int64_t o) {
      T best{};
      int64_t best_i = -1, k = 0;
      bool nan_seen = false;
      visit_reduced(base, p, o, [&](const T* q, int64_t st, int64_t n) {
        for (int64_t j = 0; j < n; ++j, ++k) {
          const T v = q[j * st];
          if (nan_seen) continue;
          if (v != v) {  // NaN wins and stays, as in PyTorch
            best = v, best_i = k, nan_seen = true;
          } else if (best_i < 0 || (is_max ? v > best : v < best)) {
            best = v, best_i = k;
          }
        }
      });
      vo[o] = best;
      io[o] = best_i;
    });
  });
  return {values, indices};
}

// Scatters g (keepdim shape) into zeros of `shape` at `indices` along `dim`.
Tensor scatter_along(const Tensor& g, const Tensor& indices, const Dims& shape, int64_t dim) {
  Tensor out = zeros(shape, g.dtype());
  Tensor gc = g.contiguous(), ic = indices.contiguous();
  const Dims kshape = gc.shape();
  const Dims ostr = out.strides();
  cpu::dispatch_float(g.dtype(), "max_backward", [&]<typename T>() {
    T* o = static_cast<T*>(out.data_ptr());
    const T* gv = static_cast<const T*>(gc.data_ptr());
    const int64_t* iv = static_cast<const int64_t*>(ic.data_ptr());
    for (int64_t k = 0; k < gc.numel(); ++k) {
      int64_t rem = k, off = 0;
      for (int64_t d = kshape.size() - 1; d >= 0; --d) {
        const int64_t i = d == dim ? iv[k] : rem % kshape[d];
        off += i * ostr[d];
        rem /= kshape[d];
      }
      o[off] += gv[k];
    }
  });
  return out;
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
  detail::check_cpu(a, "var");
  LS_CHECK(is_floating(a.dtype()), "var: needs a floating-point input, got ",
           dtype_name(a.dtype()));
  if (is_half(a.dtype())) return var(a.to(kFloat32), dims, correction, keepdim).to(a.dtype());
  ReducePlan p = make_plan(a, dims, keepdim, "var");
  Tensor out = empty(p.out_shape, a.dtype());
  const double denom = std::max<double>(0.0, static_cast<double>(p.count - correction));
  cpu::dispatch_float(a.dtype(), "var", [&]<typename T>() {
    const T* base = static_cast<const T*>(a.data_ptr());
    T* o = static_cast<T*>(out.data_ptr());
    for_outputs(out.numel(), p.count, [&](int64_t i) {
      double s = 0;
      visit_reduced(base, p, i, [&](const T* q, int64_t st, int64_t n) { s += sum_run(q, st, n); });
      const double m = s / static_cast<double>(p.count);
      double ss = 0;
      visit_reduced(base, p, i, [&](const T* q, int64_t st, int64_t n) {
        for (int64_t k = 0; k < n; ++k) {
          const double dv = static_cast<double>(q[k * st]) - m;
          ss += dv * dv;
        }
      });
      o[i] = static_cast<T>(ss / denom);  // denom 0 gives inf/NaN, as torch.var
    });
  });
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

}  // namespace lockstep
