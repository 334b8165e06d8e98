// Elementwise ops: broadcasting binary ops, unary math, comparisons, where/masked_fill, and
// their gradients.
#include "lockstep/ops/elementwise.h"

#include <cmath>

#include "lockstep/autograd/grad_mode.h"
#include "lockstep/autograd/node.h"
#include "lockstep/ops/reduce.h"
#include "ops/elementwise_internal.h"

namespace lockstep {

using autograd::record;
using autograd::sum_to;
using autograd::TensorList;

Dims broadcast_shapes(const Dims& a, const Dims& b, const char* op) {
  const int64_t n = std::max(a.size(), b.size());
  Dims out = Dims::filled(n, 1);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t da = i - (n - a.size()) >= 0 ? a[i - (n - a.size())] : 1;
    const int64_t db = i - (n - b.size()) >= 0 ? b[i - (n - b.size())] : 1;
    LS_CHECK(da == db || da == 1 || db == 1, op, ": shapes ", a.str(), " and ", b.str(),
             " cannot be broadcast together (dimension ", i, ": ", da, " vs ", db, ")");
    out[i] = da == 1 ? db : da;
  }
  return out;
}

namespace {

// What a backward needs of an input whose values it does not read: keeping only this (not the
// tensor) lets the input's memory go as soon as the forward no longer needs it.
struct InputMeta {
  Dims shape;
  DType dtype;
  bool requires_grad;
  explicit InputMeta(const Tensor& t)
      : shape(t.shape()), dtype(t.dtype()), requires_grad(t.requires_grad()) {}
};

// Gradient for an input of a broadcasting op: reduce over broadcast dims, back to its dtype.
Tensor reduce_grad(const Tensor& g, const Dims& shape, DType dtype) {
  Tensor r = sum_to(g, shape);
  return r.dtype() == dtype ? r : r.to(dtype);
}
Tensor reduce_grad(const Tensor& g, const InputMeta& x) { return reduce_grad(g, x.shape, x.dtype); }
Tensor reduce_grad(const Tensor& g, const Tensor& x) {
  return reduce_grad(g, x.shape(), x.dtype());
}

// Broadcasts a and b, promotes their dtypes, and runs op in the promoted type. Half types are
// computed in f32 and stored back; no autograd.
template <typename Op>
Tensor binary_arith(const char* name, const Tensor& a, const Tensor& b, const Op& op,
                    bool floating_only = false) {
  autograd::NoGradGuard no_grad;  // internal views and casts are not part of the graph
  detail::check_cpu(a, name);
  detail::check_cpu(b, name);
  DType dt = promote_types(a.dtype(), b.dtype());
  if (floating_only && !is_floating(dt)) dt = kFloat32;
  const Dims shape = broadcast_shapes(a.shape(), b.shape(), name);
  if (is_half(dt)) {
    return binary_arith(name, a.to(kFloat32), b.to(kFloat32), op, floating_only).to(dt);
  }
  Tensor ae = (a.dtype() == dt ? a : a.to(dt)).expand(shape);
  Tensor be = (b.dtype() == dt ? b : b.to(dt)).expand(shape);
  Tensor out = empty(shape, dt);
  cpu::dispatch_numeric(dt, name,
                        [&]<typename T>() { cpu::binary_loop<T, T, T>(out, ae, be, op); });
  return out;
}

template <typename Op>
Tensor binary_compare(const char* name, const Tensor& a, const Tensor& b, const Op& op) {
  autograd::NoGradGuard no_grad;  // internal views and casts are not part of the graph
  detail::check_cpu(a, name);
  detail::check_cpu(b, name);
  DType dt = promote_types(a.dtype(), b.dtype());
  if (is_half(dt) || dt == kBool) dt = is_half(dt) ? kFloat32 : kUInt8;
  const Dims shape = broadcast_shapes(a.shape(), b.shape(), name);
  Tensor ae = (a.dtype() == dt ? a : a.to(dt)).expand(shape);
  Tensor be = (b.dtype() == dt ? b : b.to(dt)).expand(shape);
  Tensor out = empty(shape, kBool);
  cpu::dispatch_numeric(dt, name,
                        [&]<typename T>() { cpu::binary_loop<bool, T, T>(out, ae, be, op); });
  return out;
}

// The dtype of `a op scalar`: a's dtype, except an integer tensor with a fractional scalar
// gives f32.
DType scalar_result_dtype(const Tensor& a, double s) {
  if (is_floating(a.dtype())) return a.dtype();
  if (a.dtype() == kBool) return s == std::floor(s) ? kInt64 : kFloat32;
  return s == std::floor(s) ? a.dtype() : kFloat32;
}

// out = op(a, scalar) with the scalar converted to the compute type once.
template <typename Op>
Tensor scalar_arith(const char* name, const Tensor& a, double s, const Op& op,
                    bool floating_only = false) {
  autograd::NoGradGuard no_grad;  // internal views and casts are not part of the graph
  detail::check_cpu(a, name);
  DType dt = scalar_result_dtype(a, s);
  if (floating_only && !is_floating(dt)) dt = kFloat32;
  if (is_half(dt)) return scalar_arith(name, a.to(kFloat32), s, op, floating_only).to(dt);
  Tensor ac = a.dtype() == dt ? a : a.to(dt);
  Tensor out = empty(a.shape(), dt);
  cpu::dispatch_numeric(dt, name, [&]<typename T>() {
    const T sv = static_cast<T>(s);
    cpu::unary_loop<T, T>(out, ac, [&](T x) { return op(x, sv); });
  });
  return out;
}

template <typename Op>
Tensor scalar_compare(const char* name, const Tensor& a, double s, const Op& op) {
  autograd::NoGradGuard no_grad;  // internal views and casts are not part of the graph
  detail::check_cpu(a, name);
  Tensor ac = is_half(a.dtype()) || a.dtype() == kBool ? a.to(kFloat64) : a;
  Tensor out = empty(a.shape(), kBool);
  cpu::dispatch_numeric(ac.dtype(), name, [&]<typename T>() {
    cpu::unary_loop<bool, T>(out, ac, [&](T x) { return op(static_cast<double>(x), s); });
  });
  return out;
}

// Unary math in floating point (integer inputs are promoted to f32).
template <typename Op>
Tensor unary_float(const char* name, const Tensor& a, const Op& op) {
  autograd::NoGradGuard no_grad;  // internal views and casts are not part of the graph
  detail::check_cpu(a, name);
  if (!is_floating(a.dtype())) return unary_float(name, a.to(kFloat32), op);
  return detail::map1_float(name, a, op);
}

// Unary op keeping the input's numeric dtype.
template <typename Op>
Tensor unary_numeric(const char* name, const Tensor& a, const Op& op) {
  autograd::NoGradGuard no_grad;  // internal views and casts are not part of the graph
  detail::check_cpu(a, name);
  if (is_half(a.dtype())) return unary_numeric(name, a.to(kFloat32), op).to(a.dtype());
  Tensor ac = a.dtype() == kBool ? a.to(kUInt8) : a;
  Tensor out = empty(a.shape(), ac.dtype());
  cpu::dispatch_numeric(ac.dtype(), name,
                        [&]<typename T>() { cpu::unary_loop<T, T>(out, ac, op); });
  return out;
}

}  // namespace

// ---- binary arithmetic ----

Tensor add(const Tensor& a, const Tensor& b, double alpha) {
  Tensor out = alpha == 1.0 ? binary_arith("add", a, b, [](auto x, auto y) { return x + y; })
                            : binary_arith("add", a, b, [alpha](auto x, auto y) {
                                return static_cast<decltype(x)>(x + alpha * y);
                              });
  record("AddBackward", {a, b}, out,
         [ma = InputMeta(a), mb = InputMeta(b), alpha](const TensorList& g) {
           return TensorList{ma.requires_grad ? reduce_grad(g[0], ma) : Tensor(),
                             mb.requires_grad
                                 ? reduce_grad(alpha == 1.0 ? g[0] : mul(g[0], alpha), mb)
                                 : Tensor()};
         });
  return out;
}

Tensor sub(const Tensor& a, const Tensor& b, double alpha) {
  Tensor out = alpha == 1.0 ? binary_arith("sub", a, b, [](auto x, auto y) { return x - y; })
                            : binary_arith("sub", a, b, [alpha](auto x, auto y) {
                                return static_cast<decltype(x)>(x - alpha * y);
                              });
  record("SubBackward", {a, b}, out,
         [ma = InputMeta(a), mb = InputMeta(b), alpha](const TensorList& g) {
           return TensorList{ma.requires_grad ? reduce_grad(g[0], ma) : Tensor(),
                             mb.requires_grad ? reduce_grad(mul(g[0], -alpha), mb) : Tensor()};
         });
  return out;
}

Tensor mul(const Tensor& a, const Tensor& b) {
  Tensor out = binary_arith("mul", a, b, [](auto x, auto y) { return x * y; });
  record("MulBackward", {a, b}, out, [a, b](const TensorList& g) {
    return TensorList{a.requires_grad() ? reduce_grad(mul(g[0], b), a) : Tensor(),
                      b.requires_grad() ? reduce_grad(mul(g[0], a), b) : Tensor()};
  });
  return out;
}

Tensor div(const Tensor& a, const Tensor& b) {
  Tensor out = binary_arith(
      "div", a, b, [](auto x, auto y) { return x / y; }, true);
  record("DivBackward", {a, b}, out, [a, b](const TensorList& g) {
    Tensor ga, gb;
    if (a.requires_grad()) ga = reduce_grad(div(g[0], b), a);
    if (b.requires_grad()) gb = reduce_grad(neg(div(mul(g[0], a), mul(b, b))), b);
    return TensorList{ga, gb};
  });
  return out;
}

Tensor pow(const Tensor& a, const Tensor& b) {
  Tensor out = binary_arith(
      "pow", a, b, [](auto x, auto y) { return static_cast<decltype(x)>(std::pow(x, y)); }, true);
  Tensor saved = out.detach();
  record("PowBackward", {a, b}, out, [a, b, saved](const TensorList& g) {
    Tensor ga, gb;
    if (a.requires_grad()) ga = reduce_grad(mul(g[0], mul(b, pow(a, sub(b, 1.0)))), a);
    if (b.requires_grad()) gb = reduce_grad(mul(g[0], mul(saved, log(a))), b);
    return TensorList{ga, gb};
  });
  return out;
}

namespace {
// Gradient split for maximum/minimum: the winner takes g, ties share it equally.
TensorList minmax_backward(const Tensor& g, const Tensor& a, const Tensor& b, bool is_max) {
  Tensor a_wins = is_max ? gt(a, b) : lt(a, b);
  Tensor tie = eq(a, b);
  Tensor wa = add(a_wins.to(g.dtype()), mul(tie.to(g.dtype()), 0.5));
  Tensor ga = a.requires_grad() ? reduce_grad(mul(g, wa), a) : Tensor();
  Tensor gb = b.requires_grad() ? reduce_grad(mul(g, rsub(wa, 1.0)), b) : Tensor();
  return {ga, gb};
}
}  // namespace

Tensor maximum(const Tensor& a, const Tensor& b) {
  Tensor out = binary_arith("maximum", a, b, [](auto x, auto y) {
    return (x != x) ? x : (x > y ? x : y);  // NaN propagates
  });
  record("MaximumBackward", {a, b}, out,
         [a, b](const TensorList& g) { return minmax_backward(g[0], a, b, true); });
  return out;
}

Tensor minimum(const Tensor& a, const Tensor& b) {
  Tensor out =
      binary_arith("minimum", a, b, [](auto x, auto y) { return (x != x) ? x : (x < y ? x : y); });
  record("MinimumBackward", {a, b}, out,
         [a, b](const TensorList& g) { return minmax_backward(g[0], a, b, false); });
  return out;
}

// ---- with a scalar ----

Tensor add(const Tensor& a, double s) {
  Tensor out = scalar_arith("add", a, s, [](auto x, auto y) { return x + y; });
  record("AddScalarBackward", {a}, out,
         [dt = a.dtype()](const TensorList& g) { return TensorList{g[0].to(dt)}; });
  return out;
}

Tensor sub(const Tensor& a, double s) { return add(a, -s); }

Tensor mul(const Tensor& a, double s) {
  Tensor out = scalar_arith("mul", a, s, [](auto x, auto y) { return x * y; });
  record("MulScalarBackward", {a}, out,
         [dt = a.dtype(), s](const TensorList& g) { return TensorList{mul(g[0], s).to(dt)}; });
  return out;
}

Tensor div(const Tensor& a, double s) {
  Tensor out = scalar_arith(
      "div", a, s, [](auto x, auto y) { return x / y; }, true);
  record("DivScalarBackward", {a}, out,
         [dt = a.dtype(), s](const TensorList& g) { return TensorList{div(g[0], s).to(dt)}; });
  return out;
}

Tensor rsub(const Tensor& a, double s) {
  Tensor out = scalar_arith("rsub", a, s, [](auto x, auto y) { return y - x; });
  record("RsubBackward", {a}, out,
         [dt = a.dtype()](const TensorList& g) { return TensorList{neg(g[0]).to(dt)}; });
  return out;
}

Tensor pow(const Tensor& a, double e) {
  Tensor out;
  if (e == 2.0) {
    out = scalar_arith(
        "pow", a, e, [](auto x, auto) { return x * x; }, true);
  } else {
    out = scalar_arith(
        "pow", a, e, [](auto x, auto y) { return static_cast<decltype(x)>(std::pow(x, y)); }, true);
  }
  record("PowScalarBackward", {a}, out, [a, e](const TensorList& g) {
    if (e == 0.0) return TensorList{zeros_like(a)};
    return TensorList{mul(g[0], mul(pow(a, e - 1.0), e))};
  });
  return out;
}

// ---- unary ----

Tensor neg(const Tensor& a) {
  LS_CHECK(a.dtype() != kBool, "neg: not defined for bool tensors; use logical_not");
  Tensor out = unary_numeric("neg", a, [](auto x) { return static_cast<decltype(x)>(-x); });
  record("NegBackward", {a}, out, [](const TensorList& g) { return TensorList{neg(g[0])}; });
  return out;
}

Tensor exp(const Tensor& a) {
  Tensor out = unary_float("exp", a, [](auto x) { return std::exp(x); });
  Tensor saved = out.detach();
  record("ExpBackward", {a}, out, [saved](const TensorList& g) {
    return TensorList{
        detail::map2_float("exp_backward", g[0], saved, [](auto gv, auto y) { return gv * y; })};
  });
  return out;
}

Tensor log(const Tensor& a) {
  Tensor out = unary_float("log", a, [](auto x) { return std::log(x); });
  record("LogBackward", {a}, out, [a](const TensorList& g) {
    return TensorList{
        detail::map2_float("log_backward", g[0], a, [](auto gv, auto x) { return gv / x; })};
  });
  return out;
}

Tensor sqrt(const Tensor& a) {
  Tensor out = unary_float("sqrt", a, [](auto x) { return std::sqrt(x); });
  Tensor saved = out.detach();
  record("SqrtBackward", {a}, out, [saved](const TensorList& g) {
    return TensorList{detail::map2_float("sqrt_backward", g[0], saved, [](auto gv, auto y) {
      return static_cast<decltype(gv)>(gv * 0.5 / y);
    })};
  });
  return out;
}

Tensor rsqrt(const Tensor& a) {
  Tensor out =
      unary_float("rsqrt", a, [](auto x) { return static_cast<decltype(x)>(1) / std::sqrt(x); });
  Tensor saved = out.detach();
  record("RsqrtBackward", {a}, out, [saved](const TensorList& g) {
    return TensorList{detail::map2_float("rsqrt_backward", g[0], saved, [](auto gv, auto y) {
      return static_cast<decltype(gv)>(-0.5 * gv * y * y * y);
    })};
  });
  return out;
}

Tensor abs(const Tensor& a) {
  Tensor out = unary_numeric("abs", a, [](auto x) {
    if constexpr (std::is_unsigned_v<decltype(x)>)
      return x;
    else
      return x < 0 ? static_cast<decltype(x)>(-x) : x;
  });
  record("AbsBackward", {a}, out, [a](const TensorList& g) {
    return TensorList{detail::map2_float("abs_backward", g[0], a, [](auto gv, auto x) {
      return x > 0 ? gv : (x < 0 ? -gv : static_cast<decltype(gv)>(0));
    })};
  });
  return out;
}

Tensor sign(const Tensor& a) {
  Tensor out = unary_numeric("sign", a, [](auto x) {
    using T = decltype(x);
    return static_cast<T>((T(0) < x) - (x < T(0)));
  });
  record("SignBackward", {a}, out, [shape = a.shape(), dt = a.dtype()](const TensorList&) {
    return TensorList{zeros(shape, dt)};
  });
  return out;
}

Tensor relu(const Tensor& a) {
  Tensor out =
      unary_numeric("relu", a, [](auto x) { return x > 0 ? x : static_cast<decltype(x)>(0); });
  record("ReluBackward", {a}, out, [a](const TensorList& g) {
    return TensorList{detail::map2_float("relu_backward", g[0], a, [](auto gv, auto x) {
      return x > 0 ? gv : static_cast<decltype(gv)>(0);
    })};
  });
  return out;
}

Tensor tanh(const Tensor& a) {
  Tensor out = unary_float("tanh", a, [](auto x) { return std::tanh(x); });
  Tensor saved = out.detach();
  record("TanhBackward", {a}, out, [saved](const TensorList& g) {
    return TensorList{detail::map2_float("tanh_backward", g[0], saved,
                                         [](auto gv, auto y) { return gv * (1 - y * y); })};
  });
  return out;
}

Tensor sigmoid(const Tensor& a) {
  Tensor out = unary_float("sigmoid", a, [](auto x) {
    using T = decltype(x);
    return T(1) / (T(1) + std::exp(-x));
  });
  Tensor saved = out.detach();
  record("SigmoidBackward", {a}, out, [saved](const TensorList& g) {
    return TensorList{detail::map2_float("sigmoid_backward", g[0], saved,
                                         [](auto gv, auto y) { return gv * y * (1 - y); })};
  });
  return out;
}

namespace {
constexpr double kSqrt2OverPi = 0.7978845608028654;  // sqrt(2 / pi)
constexpr double kInvSqrt2 = 0.7071067811865476;
constexpr double kInvSqrt2Pi = 0.3989422804014327;  // 1 / sqrt(2 pi)
constexpr double kGeluCoeff = 0.044715;
}  // namespace

Tensor gelu(const Tensor& a, GeluApprox approx) {
  Tensor out;
  if (approx == GeluApprox::tanh) {
    out = unary_float("gelu", a, [](auto x) {
      using T = decltype(x);
      const T inner = T(kSqrt2OverPi) * (x + T(kGeluCoeff) * x * x * x);
      return T(0.5) * x * (T(1) + std::tanh(inner));
    });
  } else {
    out = unary_float("gelu", a, [](auto x) {
      using T = decltype(x);
      return T(0.5) * x * (T(1) + std::erf(x * T(kInvSqrt2)));
    });
  }
  record("GeluBackward", {a}, out, [a, approx](const TensorList& g) {
    if (approx == GeluApprox::tanh) {
      return TensorList{detail::map2_float("gelu_backward", g[0], a, [](auto gv, auto x) {
        using T = decltype(x);
        const T inner = T(kSqrt2OverPi) * (x + T(kGeluCoeff) * x * x * x);
        const T t = std::tanh(inner);
        const T dinner = T(kSqrt2OverPi) * (T(1) + T(3 * kGeluCoeff) * x * x);
        return gv * (T(0.5) * (T(1) + t) + T(0.5) * x * (T(1) - t * t) * dinner);
      })};
    }
    return TensorList{detail::map2_float("gelu_backward", g[0], a, [](auto gv, auto x) {
      using T = decltype(x);
      const T cdf = T(0.5) * (T(1) + std::erf(x * T(kInvSqrt2)));
      const T pdf = T(kInvSqrt2Pi) * std::exp(T(-0.5) * x * x);
      return gv * (cdf + x * pdf);
    })};
  });
  return out;
}

Tensor clamp(const Tensor& a, double lo, double hi) {
  LS_CHECK(!(lo > hi), "clamp: min ", lo, " is greater than max ", hi);
  Tensor out = unary_numeric("clamp", a, [lo, hi](auto x) {
    using T = decltype(x);
    if (x != x) return x;
    const double v = static_cast<double>(x);
    return v < lo ? static_cast<T>(lo) : (v > hi ? static_cast<T>(hi) : x);
  });
  record("ClampBackward", {a}, out, [a, lo, hi](const TensorList& g) {
    return TensorList{detail::map2_float("clamp_backward", g[0], a, [lo, hi](auto gv, auto x) {
      return (x >= lo && x <= hi) ? gv : static_cast<decltype(gv)>(0);
    })};
  });
  return out;
}

Tensor clamp_min(const Tensor& a, double lo) { return clamp(a, lo, INFINITY); }

// ---- comparisons ----

Tensor eq(const Tensor& a, const Tensor& b) {
  return binary_compare("eq", a, b, [](auto x, auto y) { return x == y; });
}
Tensor ne(const Tensor& a, const Tensor& b) {
  return binary_compare("ne", a, b, [](auto x, auto y) { return x != y; });
}
Tensor lt(const Tensor& a, const Tensor& b) {
  return binary_compare("lt", a, b, [](auto x, auto y) { return x < y; });
}
Tensor le(const Tensor& a, const Tensor& b) {
  return binary_compare("le", a, b, [](auto x, auto y) { return x <= y; });
}
Tensor gt(const Tensor& a, const Tensor& b) {
  return binary_compare("gt", a, b, [](auto x, auto y) { return x > y; });
}
Tensor ge(const Tensor& a, const Tensor& b) {
  return binary_compare("ge", a, b, [](auto x, auto y) { return x >= y; });
}
Tensor eq(const Tensor& a, double b) {
  return scalar_compare("eq", a, b, [](double x, double y) { return x == y; });
}
Tensor ne(const Tensor& a, double b) {
  return scalar_compare("ne", a, b, [](double x, double y) { return x != y; });
}
Tensor lt(const Tensor& a, double b) {
  return scalar_compare("lt", a, b, [](double x, double y) { return x < y; });
}
Tensor le(const Tensor& a, double b) {
  return scalar_compare("le", a, b, [](double x, double y) { return x <= y; });
}
Tensor gt(const Tensor& a, double b) {
  return scalar_compare("gt", a, b, [](double x, double y) { return x > y; });
}
Tensor ge(const Tensor& a, double b) {
  return scalar_compare("ge", a, b, [](double x, double y) { return x >= y; });
}

Tensor logical_not(const Tensor& a) { return eq(a, 0.0); }

Tensor isnan(const Tensor& a) {
  return scalar_compare("isnan", a, 0.0, [](double x, double) { return std::isnan(x); });
}

Tensor isfinite(const Tensor& a) {
  return scalar_compare("isfinite", a, 0.0, [](double x, double) { return std::isfinite(x); });
}

// ---- selection ----

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  detail::check_cpu(cond, "where");
  detail::check_cpu(a, "where");
  detail::check_cpu(b, "where");
  const Dims shape =
      broadcast_shapes(cond.shape(), broadcast_shapes(a.shape(), b.shape(), "where"), "where");
  const DType dt = promote_types(a.dtype(), b.dtype());
  Tensor c, out = empty(shape, dt);
  {
    autograd::NoGradGuard no_grad;
    c = (cond.dtype() == kBool ? cond : ne(cond, 0.0)).expand(shape);
    Tensor ae = (a.dtype() == dt ? a : a.to(dt)).expand(shape);
    Tensor be = (b.dtype() == dt ? b : b.to(dt)).expand(shape);
    cpu::dispatch_all(dt, "where", [&]<typename T>() {
      cpu::ternary_loop<T, bool, T, T>(out, c, ae, be, [](bool m, T x, T y) { return m ? x : y; });
    });
  }
  Tensor cond_b = c;
  record("WhereBackward", {a, b}, out, [a, b, cond_b](const TensorList& g) {
    Tensor zero = zeros({}, g[0].dtype());
    Tensor ga = a.requires_grad() ? reduce_grad(where(cond_b, g[0], zero), a) : Tensor();
    Tensor gb = b.requires_grad() ? reduce_grad(where(cond_b, zero, g[0]), b) : Tensor();
    return TensorList{ga, gb};
  });
  return out;
}

Tensor masked_fill(const Tensor& a, const Tensor& mask, double value) {
  LS_CHECK(broadcast_shapes(a.shape(), mask.shape(), "masked_fill") == a.shape(),
           "masked_fill: mask of shape ", mask.shape().str(), " does not broadcast to ",
           a.shape().str());
  Tensor v = full({}, value, a.dtype());
  Tensor m = mask.dtype() == kBool ? mask : ne(mask, 0.0);
  return where(m, v, a);
}

// ---- whole-tensor predicates ----

bool allclose(const Tensor& a, const Tensor& b, double rtol, double atol) {
  if (a.shape() != b.shape()) return false;
  std::vector<double> x = a.to_vector<double>(), y = b.to_vector<double>();
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(x[i]) || std::isnan(y[i])) return false;
    if (x[i] == y[i]) continue;  // equal infinities
    if (!(std::abs(x[i] - y[i]) <= atol + rtol * std::abs(y[i]))) return false;
  }
  return true;
}

bool equal(const Tensor& a, const Tensor& b) { return allclose(a, b, 0.0, 0.0); }

// ---- in-place ----

namespace detail {
void check_inplace(const Tensor& self, const char* op) {
  check_cpu(self, op);
  LS_CHECK(!(autograd::grad_enabled() && self.requires_grad()), op,
           ": in-place operation on a "
           "tensor that requires grad; run it under NoGradGuard (as an optimizer step does) or on "
           "a detach()ed tensor");
  // An expanded destination has elements that alias each other: a write to one is a write to
  // all, and parallel writers would race.
  for (int64_t d = 0; d < self.dim(); ++d)
    LS_CHECK(self.shape()[d] <= 1 || self.strides()[d] != 0, op, ": the destination of shape ",
             self.shape().str(), " has strides ", self.strides().str(),
             " (an expanded view: "
             "several elements share memory); write into a clone() or contiguous() copy instead");
}
}  // namespace detail

namespace {
// Last element's offset + 1 (elements), for a tensor with non-negative strides.
int64_t extent_of(const Tensor& t) {
  int64_t e = t.offset() + 1;
  for (int64_t d = 0; d < t.dim(); ++d) e += (t.shape()[d] - 1) * t.strides()[d];
  return e;
}

// `src` (already expanded to dst's shape), or a copy of it when it shares memory with `dst` in
// another layout: an in-place loop would otherwise read elements it has already overwritten.
Tensor unaliased_source(const Tensor& src, const Tensor& dst) {
  if (src.storage() != dst.storage() || src.numel() == 0) return src;
  if (src.dtype() == dst.dtype() && src.offset() == dst.offset() && src.strides() == dst.strides())
    return src;  // the same elements in the same order: each is read before it is written
  const int64_t es = src.element_size(), ed = dst.element_size();
  const bool disjoint =
      extent_of(src) * es <= dst.offset() * ed || extent_of(dst) * ed <= src.offset() * es;
  if (disjoint) return src;
  autograd::NoGradGuard no_grad;
  return src.clone();
}
}  // namespace

Tensor& Tensor::zero_() {
  detail::check_inplace(*this, "zero_");
  if (is_contiguous()) {
    std::memset(data_ptr(), 0, static_cast<size_t>(nbytes()));
    return *this;
  }
  return fill_(0.0);
}

Tensor& Tensor::fill_(double value) {
  detail::check_inplace(*this, "fill_");
  cpu::dispatch_all(dtype(), "fill_", [&]<typename T>() {
    const T v = cpu::convert<T>(value);
    cpu::StridedLoop<1> loop(shape(), {this});
    loop.run([&](char** p, const int64_t* s, int64_t n) {
      if (s[0] == sizeof(T)) {
        T* o = reinterpret_cast<T*>(p[0]);
        for (int64_t i = 0; i < n; ++i) o[i] = v;
      } else {
        for (int64_t i = 0; i < n; ++i) *reinterpret_cast<T*>(p[0] + i * s[0]) = v;
      }
    });
  });
  return *this;
}

Tensor& Tensor::copy_(const Tensor& src) {
  detail::check_inplace(*this, "copy_");
  detail::check_cpu(src, "copy_");
  Tensor s = unaliased_source(src.expand(shape()), *this);
  // f32 <-> f16 between contiguous tensors: the bulk (F16C) conversions, in parallel chunks.
  const bool f32_f16 = (dtype() == kFloat16 && s.dtype() == kFloat32) ||
                       (dtype() == kFloat32 && s.dtype() == kFloat16);
  if (f32_f16 && is_contiguous() && s.is_contiguous() && s.numel() == numel()) {
    const bool to_half = dtype() == kFloat16;
    void* d = data_ptr();
    const void* from = s.data_ptr();
    cpu::parallel_for(0, numel(), cpu::kElementwiseGrain, [&](int64_t b, int64_t e) {
      if (to_half) {
        float_to_f16_bits_n(static_cast<const float*>(from) + b, static_cast<uint16_t*>(d) + b,
                            e - b);
      } else {
        f16_bits_to_float_n(static_cast<const uint16_t*>(from) + b, static_cast<float*>(d) + b,
                            e - b);
      }
    });
    return *this;
  }
  cpu::dispatch_all(dtype(), "copy_", [&]<typename To>() {
    cpu::dispatch_all(s.dtype(), "copy_", [&]<typename From>() {
      cpu::unary_loop<To, From>(*this, s, [](From v) { return cpu::convert<To>(v); });
    });
  });
  return *this;
}

Tensor& Tensor::add_(const Tensor& other, double alpha) {
  detail::check_inplace(*this, "add_");
  detail::check_cpu(other, "add_");
  Tensor o = unaliased_source(
      (other.dtype() == dtype() ? other : other.to(dtype())).expand(shape()), *this);
  cpu::dispatch_all(dtype(), "add_", [&]<typename T>() {
    if constexpr (std::is_same_v<T, bool>) {
      LS_THROW("add_: not defined for bool tensors");
    } else if constexpr (cpu::is_half_type_v<T>) {
      const float al = static_cast<float>(alpha);
      cpu::binary_loop<T, T, T>(*this, *this, o, [al](T x, T y) {
        return T(static_cast<float>(x) + al * static_cast<float>(y));
      });
    } else if (alpha == 1.0) {
      cpu::binary_loop<T, T, T>(*this, *this, o, [](T x, T y) { return static_cast<T>(x + y); });
    } else {
      const T al = static_cast<T>(alpha);
      cpu::binary_loop<T, T, T>(*this, *this, o,
                                [al](T x, T y) { return static_cast<T>(x + al * y); });
    }
  });
  return *this;
}

Tensor& Tensor::add_(double value) { return add_(full({}, value, dtype())); }

Tensor& Tensor::mul_(const Tensor& other) {
  detail::check_inplace(*this, "mul_");
  detail::check_cpu(other, "mul_");
  Tensor o = unaliased_source(
      (other.dtype() == dtype() ? other : other.to(dtype())).expand(shape()), *this);
  cpu::dispatch_all(dtype(), "mul_", [&]<typename T>() {
    if constexpr (cpu::is_half_type_v<T>) {
      cpu::binary_loop<T, T, T>(*this, *this, o, [](T x, T y) {
        return T(static_cast<float>(x) * static_cast<float>(y));
      });
    } else {
      cpu::binary_loop<T, T, T>(*this, *this, o, [](T x, T y) { return static_cast<T>(x * y); });
    }
  });
  return *this;
}

Tensor& Tensor::mul_(double value) { return mul_(full({}, value, dtype())); }

}  // namespace lockstep
