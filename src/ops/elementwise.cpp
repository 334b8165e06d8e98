// Elementwise ops' fronts: broadcasting and dtype promotion for binary ops, unary math,
// comparisons, where/masked_fill, and their gradients; the kernels are src/ops/cpu/elementwise.cpp
// (Note [Kernel tables] in src/ops/kernels.h).
#include "lockstep/ops/elementwise.h"

#include <cmath>
#include <initializer_list>

#include "lockstep/autograd/grad_mode.h"
#include "lockstep/autograd/node.h"
#include "lockstep/ops/reduce.h"
#include "ops/common.h"
#include "ops/kernels.h"

namespace lockstep {

using autograd::record;
using autograd::TensorList;
using detail::BinaryOp;
using detail::CompareOp;
using detail::Kernels;
using detail::ScalarOp;
using detail::UnaryOp;

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

void check_operands(const Tensor& a, const Tensor& b, const char* name) {
  detail::check_defined(a, name);
  detail::check_defined(b, name);
  detail::check_same_device(a, b, name);
}

// Broadcasts a and b, promotes their dtypes, and runs op in the promoted type. Half types are
// computed in f32 and stored back; no autograd.
Tensor binary_arith(BinaryOp op, const char* name, const Tensor& a, const Tensor& b,
                    double alpha = 1.0, bool floating_only = false) {
  autograd::NoGradGuard no_grad;  // internal views and casts are not part of the graph
  check_operands(a, b, name);
  const auto kernel = detail::kernel(&Kernels::binary, a.device(), name);
  DType dt = promote_types(a.dtype(), b.dtype());
  if (floating_only && !is_floating(dt)) dt = kFloat32;
  const Dims shape = broadcast_shapes(a.shape(), b.shape(), name);
  if (is_half(dt)) {
    return binary_arith(op, name, a.to(kFloat32), b.to(kFloat32), alpha, floating_only).to(dt);
  }
  Tensor ae = (a.dtype() == dt ? a : a.to(dt)).expand(shape);
  Tensor be = (b.dtype() == dt ? b : b.to(dt)).expand(shape);
  Tensor out = empty(shape, detail::options_on(a, dt));
  kernel(op, out, ae, be, alpha);
  return out;
}

Tensor binary_compare(CompareOp op, const char* name, const Tensor& a, const Tensor& b) {
  autograd::NoGradGuard no_grad;  // internal views and casts are not part of the graph
  check_operands(a, b, name);
  const auto kernel = detail::kernel(&Kernels::compare, a.device(), name);
  DType dt = promote_types(a.dtype(), b.dtype());
  if (is_half(dt) || dt == kBool) dt = is_half(dt) ? kFloat32 : kUInt8;
  const Dims shape = broadcast_shapes(a.shape(), b.shape(), name);
  Tensor ae = (a.dtype() == dt ? a : a.to(dt)).expand(shape);
  Tensor be = (b.dtype() == dt ? b : b.to(dt)).expand(shape);
  Tensor out = empty(shape, detail::options_on(a, kBool));
  kernel(op, out, ae, be);
  return out;
}

// The dtype of `a op scalar`: a's dtype, except an integer tensor with a fractional scalar
// gives f32.
DType scalar_result_dtype(const Tensor& a, double s) {
  if (is_floating(a.dtype())) return a.dtype();
  if (a.dtype() == kBool) return s == std::floor(s) ? kInt64 : kFloat32;
  return s == std::floor(s) ? a.dtype() : kFloat32;
}

// out = op(a, scalar).
Tensor scalar_arith(ScalarOp op, const char* name, const Tensor& a, double s,
                    bool floating_only = false) {
  autograd::NoGradGuard no_grad;  // internal views and casts are not part of the graph
  detail::check_defined(a, name);
  const auto kernel = detail::kernel(&Kernels::binary_scalar, a.device(), name);
  DType dt = scalar_result_dtype(a, s);
  if (floating_only && !is_floating(dt)) dt = kFloat32;
  if (is_half(dt)) return scalar_arith(op, name, a.to(kFloat32), s, floating_only).to(dt);
  Tensor ac = a.dtype() == dt ? a : a.to(dt);
  Tensor out = empty(a.shape(), detail::options_on(a, dt));
  kernel(op, out, ac, s);
  return out;
}

Tensor scalar_compare(CompareOp op, const char* name, const Tensor& a, double s) {
  autograd::NoGradGuard no_grad;  // internal views and casts are not part of the graph
  detail::check_defined(a, name);
  const auto kernel = detail::kernel(&Kernels::compare_scalar, a.device(), name);
  Tensor ac = is_half(a.dtype()) || a.dtype() == kBool ? a.to(kFloat64) : a;
  Tensor out = empty(a.shape(), detail::options_on(a, kBool));
  kernel(op, out, ac, s);
  return out;
}

// The CPU's tanh GELU takes contiguous bf16 tensors as they are (Note [bf16 GELU] in
// src/ops/cpu/elementwise.cpp); other ops, dtypes and devices compute 16-bit floats in f32.
bool bf16_gelu_on_cpu(UnaryOp op, std::initializer_list<const Tensor*> ts) {
  if (op != UnaryOp::gelu_tanh) return false;
  for (const Tensor* t : ts) {
    if (t->dtype() != kBFloat16 || !t->device().is_cpu() || !t->is_contiguous()) return false;
  }
  return true;
}

// Unary math in floating point (integer inputs are promoted to f32, 16-bit floats computed in
// f32 and stored back).
Tensor unary_float(UnaryOp op, const char* name, const Tensor& a) {
  autograd::NoGradGuard no_grad;  // internal views and casts are not part of the graph
  detail::check_defined(a, name);
  const auto kernel = detail::kernel(&Kernels::unary, a.device(), name);
  if (!is_floating(a.dtype())) return unary_float(op, name, a.to(kFloat32));
  if (bf16_gelu_on_cpu(op, {&a})) {  // Note [bf16 GELU] in src/ops/cpu/elementwise.cpp
    Tensor out = empty(a.shape(), detail::options_on(a, a.dtype()));
    kernel(op, out, a, 0.0, 0.0);
    return out;
  }
  if (is_half(a.dtype())) return unary_float(op, name, a.to(kFloat32)).to(a.dtype());
  Tensor out = empty(a.shape(), detail::options_on(a, a.dtype()));
  kernel(op, out, a, 0.0, 0.0);
  return out;
}

// Unary op keeping the input's numeric dtype; lo and hi are clamp's bounds.
Tensor unary_numeric(UnaryOp op, const char* name, const Tensor& a, double lo = 0.0,
                     double hi = 0.0) {
  autograd::NoGradGuard no_grad;  // internal views and casts are not part of the graph
  detail::check_defined(a, name);
  const auto kernel = detail::kernel(&Kernels::unary, a.device(), name);
  if (is_half(a.dtype())) return unary_numeric(op, name, a.to(kFloat32), lo, hi).to(a.dtype());
  Tensor ac = a.dtype() == kBool ? a.to(kUInt8) : a;
  Tensor out = empty(a.shape(), detail::options_on(a, ac.dtype()));
  kernel(op, out, ac, lo, hi);
  return out;
}

// g * d op(x)/dx from the saved input x or output y, of g's floating dtype (16-bit floats in
// f32); no broadcasting, no autograd.
Tensor unary_grad(UnaryOp op, const char* name, const Tensor& g, const Tensor& saved,
                  double lo = 0.0, double hi = 0.0) {
  LS_CHECK(g.shape() == saved.shape(), name, ": shapes ", g.shape().str(), " and ",
           saved.shape().str(), " differ");
  const DType dt = g.dtype();
  if (bf16_gelu_on_cpu(op, {&g, &saved})) {  // Note [bf16 GELU] in src/ops/cpu/elementwise.cpp
    const auto kernel = detail::kernel(&Kernels::unary_backward, g.device(), name);
    Tensor out = empty(g.shape(), detail::options_on(g, dt));
    kernel(op, out, g, saved, lo, hi);
    return out;
  }
  if (is_half(dt)) {
    return unary_grad(op, name, g.to(kFloat32), saved.to(kFloat32), lo, hi).to(dt);
  }
  const auto kernel = detail::kernel(&Kernels::unary_backward, g.device(), name);
  const Tensor s = saved.dtype() == dt ? saved : saved.to(dt);
  Tensor out = empty(g.shape(), detail::options_on(g, dt));
  kernel(op, out, g, s, lo, hi);
  return out;
}

}  // namespace

// ---- binary arithmetic ----

Tensor add(const Tensor& a, const Tensor& b, double alpha) {
  Tensor out = binary_arith(BinaryOp::add, "add", a, b, alpha);
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
  Tensor out = binary_arith(BinaryOp::sub, "sub", a, b, alpha);
  record("SubBackward", {a, b}, out,
         [ma = InputMeta(a), mb = InputMeta(b), alpha](const TensorList& g) {
           return TensorList{ma.requires_grad ? reduce_grad(g[0], ma) : Tensor(),
                             mb.requires_grad ? reduce_grad(mul(g[0], -alpha), mb) : Tensor()};
         });
  return out;
}

Tensor mul(const Tensor& a, const Tensor& b) {
  Tensor out = binary_arith(BinaryOp::mul, "mul", a, b);
  record("MulBackward", {a, b}, out, [a, b](const TensorList& g) {
    return TensorList{a.requires_grad() ? reduce_grad(mul(g[0], b), a) : Tensor(),
                      b.requires_grad() ? reduce_grad(mul(g[0], a), b) : Tensor()};
  });
  return out;
}

Tensor div(const Tensor& a, const Tensor& b) {
  Tensor out = binary_arith(BinaryOp::div, "div", a, b, 1.0, /*floating_only=*/true);
  record("DivBackward", {a, b}, out, [a, b](const TensorList& g) {
    Tensor ga, gb;
    if (a.requires_grad()) ga = reduce_grad(div(g[0], b), a);
    if (b.requires_grad()) gb = reduce_grad(neg(div(mul(g[0], a), mul(b, b))), b);
    return TensorList{ga, gb};
  });
  return out;
}

Tensor pow(const Tensor& a, const Tensor& b) {
  Tensor out = binary_arith(BinaryOp::pow, "pow", a, b, 1.0, /*floating_only=*/true);
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
  Tensor out = binary_arith(BinaryOp::maximum, "maximum", a, b);
  record("MaximumBackward", {a, b}, out,
         [a, b](const TensorList& g) { return minmax_backward(g[0], a, b, true); });
  return out;
}

Tensor minimum(const Tensor& a, const Tensor& b) {
  Tensor out = binary_arith(BinaryOp::minimum, "minimum", a, b);
  record("MinimumBackward", {a, b}, out,
         [a, b](const TensorList& g) { return minmax_backward(g[0], a, b, false); });
  return out;
}

// ---- with a scalar ----

Tensor add(const Tensor& a, double s) {
  Tensor out = scalar_arith(ScalarOp::add, "add", a, s);
  record("AddScalarBackward", {a}, out,
         [dt = a.dtype()](const TensorList& g) { return TensorList{g[0].to(dt)}; });
  return out;
}

Tensor sub(const Tensor& a, double s) { return add(a, -s); }

Tensor mul(const Tensor& a, double s) {
  Tensor out = scalar_arith(ScalarOp::mul, "mul", a, s);
  record("MulScalarBackward", {a}, out,
         [dt = a.dtype(), s](const TensorList& g) { return TensorList{mul(g[0], s).to(dt)}; });
  return out;
}

Tensor div(const Tensor& a, double s) {
  Tensor out = scalar_arith(ScalarOp::div, "div", a, s, /*floating_only=*/true);
  record("DivScalarBackward", {a}, out,
         [dt = a.dtype(), s](const TensorList& g) { return TensorList{div(g[0], s).to(dt)}; });
  return out;
}

Tensor rsub(const Tensor& a, double s) {
  Tensor out = scalar_arith(ScalarOp::rsub, "rsub", a, s);
  record("RsubBackward", {a}, out,
         [dt = a.dtype()](const TensorList& g) { return TensorList{neg(g[0]).to(dt)}; });
  return out;
}

Tensor pow(const Tensor& a, double e) {
  Tensor out = scalar_arith(e == 2.0 ? ScalarOp::square : ScalarOp::pow, "pow", a, e,
                            /*floating_only=*/true);
  record("PowScalarBackward", {a}, out, [a, e](const TensorList& g) {
    if (e == 0.0) return TensorList{zeros_like(a)};
    return TensorList{mul(g[0], mul(pow(a, e - 1.0), e))};
  });
  return out;
}

// ---- unary ----

Tensor neg(const Tensor& a) {
  LS_CHECK(a.dtype() != kBool, "neg: not defined for bool tensors; use logical_not");
  Tensor out = unary_numeric(UnaryOp::neg, "neg", a);
  record("NegBackward", {a}, out, [](const TensorList& g) { return TensorList{neg(g[0])}; });
  return out;
}

Tensor exp(const Tensor& a) {
  Tensor out = unary_float(UnaryOp::exp, "exp", a);
  Tensor saved = out.detach();
  record("ExpBackward", {a}, out, [saved](const TensorList& g) {
    return TensorList{unary_grad(UnaryOp::exp, "exp_backward", g[0], saved)};
  });
  return out;
}

Tensor log(const Tensor& a) {
  Tensor out = unary_float(UnaryOp::log, "log", a);
  record("LogBackward", {a}, out, [a](const TensorList& g) {
    return TensorList{unary_grad(UnaryOp::log, "log_backward", g[0], a)};
  });
  return out;
}

Tensor sqrt(const Tensor& a) {
  Tensor out = unary_float(UnaryOp::sqrt, "sqrt", a);
  Tensor saved = out.detach();
  record("SqrtBackward", {a}, out, [saved](const TensorList& g) {
    return TensorList{unary_grad(UnaryOp::sqrt, "sqrt_backward", g[0], saved)};
  });
  return out;
}

Tensor rsqrt(const Tensor& a) {
  Tensor out = unary_float(UnaryOp::rsqrt, "rsqrt", a);
  Tensor saved = out.detach();
  record("RsqrtBackward", {a}, out, [saved](const TensorList& g) {
    return TensorList{unary_grad(UnaryOp::rsqrt, "rsqrt_backward", g[0], saved)};
  });
  return out;
}

Tensor abs(const Tensor& a) {
  Tensor out = unary_numeric(UnaryOp::abs, "abs", a);
  record("AbsBackward", {a}, out, [a](const TensorList& g) {
    return TensorList{unary_grad(UnaryOp::abs, "abs_backward", g[0], a)};
  });
  return out;
}

Tensor sign(const Tensor& a) {
  Tensor out = unary_numeric(UnaryOp::sign, "sign", a);
  record("SignBackward", {a}, out,
         [shape = a.shape(), opts = detail::options_on(a, a.dtype())](const TensorList&) {
           return TensorList{zeros(shape, opts)};
         });
  return out;
}

Tensor relu(const Tensor& a) {
  Tensor out = unary_numeric(UnaryOp::relu, "relu", a);
  record("ReluBackward", {a}, out, [a](const TensorList& g) {
    return TensorList{unary_grad(UnaryOp::relu, "relu_backward", g[0], a)};
  });
  return out;
}

Tensor tanh(const Tensor& a) {
  Tensor out = unary_float(UnaryOp::tanh, "tanh", a);
  Tensor saved = out.detach();
  record("TanhBackward", {a}, out, [saved](const TensorList& g) {
    return TensorList{unary_grad(UnaryOp::tanh, "tanh_backward", g[0], saved)};
  });
  return out;
}

Tensor sigmoid(const Tensor& a) {
  Tensor out = unary_float(UnaryOp::sigmoid, "sigmoid", a);
  Tensor saved = out.detach();
  record("SigmoidBackward", {a}, out, [saved](const TensorList& g) {
    return TensorList{unary_grad(UnaryOp::sigmoid, "sigmoid_backward", g[0], saved)};
  });
  return out;
}

Tensor gelu(const Tensor& a, GeluApprox approx) {
  const UnaryOp op = approx == GeluApprox::tanh ? UnaryOp::gelu_tanh : UnaryOp::gelu;
  Tensor out = unary_float(op, "gelu", a);
  record("GeluBackward", {a}, out, [a, op](const TensorList& g) {
    return TensorList{unary_grad(op, "gelu_backward", g[0], a)};
  });
  return out;
}

Tensor clamp(const Tensor& a, double lo, double hi) {
  LS_CHECK(!(lo > hi), "clamp: min ", lo, " is greater than max ", hi);
  Tensor out = unary_numeric(UnaryOp::clamp, "clamp", a, lo, hi);
  record("ClampBackward", {a}, out, [a, lo, hi](const TensorList& g) {
    return TensorList{unary_grad(UnaryOp::clamp, "clamp_backward", g[0], a, lo, hi)};
  });
  return out;
}

Tensor clamp_min(const Tensor& a, double lo) { return clamp(a, lo, INFINITY); }

// ---- comparisons ----

Tensor eq(const Tensor& a, const Tensor& b) { return binary_compare(CompareOp::eq, "eq", a, b); }
Tensor ne(const Tensor& a, const Tensor& b) { return binary_compare(CompareOp::ne, "ne", a, b); }
Tensor lt(const Tensor& a, const Tensor& b) { return binary_compare(CompareOp::lt, "lt", a, b); }
Tensor le(const Tensor& a, const Tensor& b) { return binary_compare(CompareOp::le, "le", a, b); }
Tensor gt(const Tensor& a, const Tensor& b) { return binary_compare(CompareOp::gt, "gt", a, b); }
Tensor ge(const Tensor& a, const Tensor& b) { return binary_compare(CompareOp::ge, "ge", a, b); }
Tensor eq(const Tensor& a, double b) { return scalar_compare(CompareOp::eq, "eq", a, b); }
Tensor ne(const Tensor& a, double b) { return scalar_compare(CompareOp::ne, "ne", a, b); }
Tensor lt(const Tensor& a, double b) { return scalar_compare(CompareOp::lt, "lt", a, b); }
Tensor le(const Tensor& a, double b) { return scalar_compare(CompareOp::le, "le", a, b); }
Tensor gt(const Tensor& a, double b) { return scalar_compare(CompareOp::gt, "gt", a, b); }
Tensor ge(const Tensor& a, double b) { return scalar_compare(CompareOp::ge, "ge", a, b); }

Tensor logical_not(const Tensor& a) { return eq(a, 0.0); }

Tensor isnan(const Tensor& a) { return scalar_compare(CompareOp::isnan, "isnan", a, 0.0); }

Tensor isfinite(const Tensor& a) {
  return scalar_compare(CompareOp::isfinite, "isfinite", a, 0.0);
}

// ---- selection ----

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  detail::check_defined(cond, "where");
  check_operands(a, b, "where");
  detail::check_same_device(cond, a, "where");
  const auto kernel = detail::kernel(&Kernels::where, a.device(), "where");
  const Dims shape =
      broadcast_shapes(cond.shape(), broadcast_shapes(a.shape(), b.shape(), "where"), "where");
  const DType dt = promote_types(a.dtype(), b.dtype());
  Tensor c, out = empty(shape, detail::options_on(a, dt));
  {
    autograd::NoGradGuard no_grad;
    c = (cond.dtype() == kBool ? cond : ne(cond, 0.0)).expand(shape);
    Tensor ae = (a.dtype() == dt ? a : a.to(dt)).expand(shape);
    Tensor be = (b.dtype() == dt ? b : b.to(dt)).expand(shape);
    kernel(out, c, ae, be);
  }
  Tensor cond_b = c;
  record("WhereBackward", {a, b}, out, [a, b, cond_b](const TensorList& g) {
    Tensor zero = zeros({}, detail::options_on(g[0], g[0].dtype()));
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
  Tensor v = full({}, value, detail::options_on(a, a.dtype()));
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

}  // namespace lockstep
