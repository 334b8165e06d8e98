// CPU elementwise kernels: each entry switches once on its op enum to a typed lambda and runs
// one strided loop (src/ops/cpu/loops.h) over it; never a call per element.
#include <cmath>

#include "ops/cpu/gelu_avx2.h"
#include "ops/cpu/kernels.h"
#include "ops/cpu/loops.h"
#include "tensor/dispatch.h"

namespace lockstep::cpu {

namespace {

// out = op(a, b) in the operands' (one) numeric dtype.
template <typename Op>
void run_binary(const char* name, const Tensor& out, const Tensor& a, const Tensor& b,
                const Op& op) {
  dispatch_numeric(out.dtype(), name, [&]<typename T>() { binary_loop<T, T, T>(out, a, b, op); });
}

// The same for ops that fronts compute in f32/f64 only.
template <typename Op>
void run_binary_float(const char* name, const Tensor& out, const Tensor& a, const Tensor& b,
                      const Op& op) {
  dispatch_float(out.dtype(), name, [&]<typename T>() { binary_loop<T, T, T>(out, a, b, op); });
}

// out = op(a, s) with the scalar converted to the compute type once.
template <typename Op>
void run_scalar(const char* name, const Tensor& out, const Tensor& a, double s, const Op& op) {
  dispatch_numeric(out.dtype(), name, [&]<typename T>() {
    const T sv = static_cast<T>(s);
    unary_loop<T, T>(out, a, [&](T x) { return op(x, sv); });
  });
}

template <typename Op>
void run_scalar_float(const char* name, const Tensor& out, const Tensor& a, double s,
                      const Op& op) {
  dispatch_float(out.dtype(), name, [&]<typename T>() {
    const T sv = static_cast<T>(s);
    unary_loop<T, T>(out, a, [&](T x) { return op(x, sv); });
  });
}

template <typename Op>
void run_compare(const char* name, const Tensor& out, const Tensor& a, const Tensor& b,
                 const Op& op) {
  dispatch_numeric(a.dtype(), name, [&]<typename T>() { binary_loop<bool, T, T>(out, a, b, op); });
}

// Compares in double, so that a scalar is never rounded to the tensor's type first.
template <typename Op>
void run_compare_scalar(const char* name, const Tensor& out, const Tensor& a, double s,
                        const Op& op) {
  dispatch_numeric(a.dtype(), name, [&]<typename T>() {
    unary_loop<bool, T>(out, a, [&](T x) { return op(static_cast<double>(x), s); });
  });
}

template <typename Op>
void run_unary(const char* name, const Tensor& out, const Tensor& a, const Op& op) {
  dispatch_numeric(a.dtype(), name, [&]<typename T>() { unary_loop<T, T>(out, a, op); });
}

template <typename Op>
void run_unary_float(const char* name, const Tensor& out, const Tensor& a, const Op& op) {
  dispatch_float(a.dtype(), name, [&]<typename T>() { unary_loop<T, T>(out, a, op); });
}

constexpr double kSqrt2OverPi = 0.7978845608028654;  // sqrt(2 / pi)
constexpr double kInvSqrt2 = 0.7071067811865476;
constexpr double kInvSqrt2Pi = 0.3989422804014327;  // 1 / sqrt(2 pi)
constexpr double kGeluCoeff = 0.044715;

}  // namespace

void binary_kernel(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b, double alpha) {
  switch (op) {
    case BinaryOp::add:
      if (alpha == 1.0) return run_binary("add", out, a, b, [](auto x, auto y) { return x + y; });
      return run_binary("add", out, a, b, [alpha](auto x, auto y) {
        return static_cast<decltype(x)>(x + alpha * y);
      });
    case BinaryOp::sub:
      if (alpha == 1.0) return run_binary("sub", out, a, b, [](auto x, auto y) { return x - y; });
      return run_binary("sub", out, a, b, [alpha](auto x, auto y) {
        return static_cast<decltype(x)>(x - alpha * y);
      });
    case BinaryOp::mul:
      return run_binary("mul", out, a, b, [](auto x, auto y) { return x * y; });
    case BinaryOp::div:
      return run_binary_float("div", out, a, b, [](auto x, auto y) { return x / y; });
    case BinaryOp::pow:
      return run_binary_float("pow", out, a, b, [](auto x, auto y) {
        return static_cast<decltype(x)>(std::pow(x, y));
      });
    case BinaryOp::maximum:
      return run_binary("maximum", out, a, b, [](auto x, auto y) {
        return (x != x) ? x : (x > y ? x : y);  // NaN propagates
      });
    case BinaryOp::minimum:
      return run_binary("minimum", out, a, b,
                        [](auto x, auto y) { return (x != x) ? x : (x < y ? x : y); });
  }
  LS_THROW("binary: unknown op ", static_cast<int>(op));
}

void binary_scalar_kernel(ScalarOp op, const Tensor& out, const Tensor& a, double s) {
  switch (op) {
    case ScalarOp::add:
      return run_scalar("add", out, a, s, [](auto x, auto y) { return x + y; });
    case ScalarOp::mul:
      return run_scalar("mul", out, a, s, [](auto x, auto y) { return x * y; });
    case ScalarOp::div:
      return run_scalar_float("div", out, a, s, [](auto x, auto y) { return x / y; });
    case ScalarOp::rsub:
      return run_scalar("rsub", out, a, s, [](auto x, auto y) { return y - x; });
    case ScalarOp::pow:
      return run_scalar_float("pow", out, a, s, [](auto x, auto y) {
        return static_cast<decltype(x)>(std::pow(x, y));
      });
    case ScalarOp::square:
      return run_scalar_float("pow", out, a, s, [](auto x, auto) { return x * x; });
  }
  LS_THROW("binary_scalar: unknown op ", static_cast<int>(op));
}

void compare_kernel(CompareOp op, const Tensor& out, const Tensor& a, const Tensor& b) {
  switch (op) {
    case CompareOp::eq:
      return run_compare("eq", out, a, b, [](auto x, auto y) { return x == y; });
    case CompareOp::ne:
      return run_compare("ne", out, a, b, [](auto x, auto y) { return x != y; });
    case CompareOp::lt:
      return run_compare("lt", out, a, b, [](auto x, auto y) { return x < y; });
    case CompareOp::le:
      return run_compare("le", out, a, b, [](auto x, auto y) { return x <= y; });
    case CompareOp::gt:
      return run_compare("gt", out, a, b, [](auto x, auto y) { return x > y; });
    case CompareOp::ge:
      return run_compare("ge", out, a, b, [](auto x, auto y) { return x >= y; });
    case CompareOp::isnan:
    case CompareOp::isfinite:
      break;  // unary: compare_scalar only
  }
  LS_THROW("compare: op ", static_cast<int>(op), " is not a binary comparison");
}

void compare_scalar_kernel(CompareOp op, const Tensor& out, const Tensor& a, double s) {
  switch (op) {
    case CompareOp::eq:
      return run_compare_scalar("eq", out, a, s, [](double x, double y) { return x == y; });
    case CompareOp::ne:
      return run_compare_scalar("ne", out, a, s, [](double x, double y) { return x != y; });
    case CompareOp::lt:
      return run_compare_scalar("lt", out, a, s, [](double x, double y) { return x < y; });
    case CompareOp::le:
      return run_compare_scalar("le", out, a, s, [](double x, double y) { return x <= y; });
    case CompareOp::gt:
      return run_compare_scalar("gt", out, a, s, [](double x, double y) { return x > y; });
    case CompareOp::ge:
      return run_compare_scalar("ge", out, a, s, [](double x, double y) { return x >= y; });
    case CompareOp::isnan:
      return run_compare_scalar("isnan", out, a, s, [](double x, double) { return std::isnan(x); });
    case CompareOp::isfinite:
      return run_compare_scalar("isfinite", out, a, s,
                                [](double x, double) { return std::isfinite(x); });
  }
  LS_THROW("compare_scalar: unknown op ", static_cast<int>(op));
}

namespace {

template <typename T>
T gelu_tanh_value(T x) {
  const T inner = T(kSqrt2OverPi) * (x + T(kGeluCoeff) * x * x * x);
  return T(0.5) * x * (T(1) + std::tanh(inner));
}

template <typename T>
T gelu_tanh_grad(T gv, T x) {
  const T inner = T(kSqrt2OverPi) * (x + T(kGeluCoeff) * x * x * x);
  const T t = std::tanh(inner);
  const T dinner = T(kSqrt2OverPi) * (T(1) + T(3 * kGeluCoeff) * x * x);
  return gv * (T(0.5) * (T(1) + t) + T(0.5) * x * (T(1) - t * t) * dinner);
}

// Note [bf16 GELU]
// Under autocast the MLP's GELU gets bf16 activations (the output of the first linear), and
// elementwise.cpp hands them over as they are (contiguous, one shape) instead of converting
// them to f32 and back around the f32 kernel. Each value is computed in f32 and rounded once,
// the same bits as that round trip: the AVX2 kernel, or these f32 loops without AVX2.
void gelu_tanh_bf16(const Tensor& out, const Tensor& a) {
  LS_CHECK(out.dtype() == kBFloat16 && a.is_contiguous() && out.is_contiguous() &&
               a.shape() == out.shape(),
           "gelu: the bf16 kernel takes contiguous bf16 tensors of one shape");
  auto* y = static_cast<uint16_t*>(out.data_ptr());
  const auto* x = static_cast<const uint16_t*>(a.data_ptr());
  if (gelu_tanh_bf16_avx2(y, x, a.numel())) return;  // Note [GELU on AVX2]
  parallel_for(0, a.numel(), kElementwiseGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      y[i] = float_to_bf16_bits(gelu_tanh_value(bf16_bits_to_float(x[i])));
  });
}

void gelu_tanh_backward_bf16(const Tensor& out, const Tensor& g, const Tensor& saved) {
  LS_CHECK(out.dtype() == kBFloat16 && saved.dtype() == kBFloat16 && g.is_contiguous() &&
               saved.is_contiguous() && out.is_contiguous() && g.shape() == out.shape() &&
               saved.shape() == out.shape(),
           "gelu_backward: the bf16 kernel takes contiguous bf16 tensors of one shape");
  auto* dx = static_cast<uint16_t*>(out.data_ptr());
  const auto* gp = static_cast<const uint16_t*>(g.data_ptr());
  const auto* x = static_cast<const uint16_t*>(saved.data_ptr());
  if (gelu_tanh_backward_bf16_avx2(dx, gp, x, out.numel())) return;  // Note [GELU on AVX2]
  parallel_for(0, out.numel(), kElementwiseGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      dx[i] = float_to_bf16_bits(
          gelu_tanh_grad(bf16_bits_to_float(gp[i]), bf16_bits_to_float(x[i])));
  });
}

}  // namespace

void unary_kernel(UnaryOp op, const Tensor& out, const Tensor& a, double lo, double hi) {
  switch (op) {
    case UnaryOp::neg:
      return run_unary("neg", out, a, [](auto x) { return static_cast<decltype(x)>(-x); });
    case UnaryOp::abs:
      return run_unary("abs", out, a, [](auto x) {
        if constexpr (std::is_unsigned_v<decltype(x)>)
          return x;
        else
          return x < 0 ? static_cast<decltype(x)>(-x) : x;
      });
    case UnaryOp::sign:
      return run_unary("sign", out, a, [](auto x) {
        using T = decltype(x);
        return static_cast<T>((T(0) < x) - (x < T(0)));
      });
    case UnaryOp::relu:
      return run_unary("relu", out, a,
                       [](auto x) { return x > 0 ? x : static_cast<decltype(x)>(0); });
    case UnaryOp::clamp:
      return run_unary("clamp", out, a, [lo, hi](auto x) {
        using T = decltype(x);
        if (x != x) return x;
        const double v = static_cast<double>(x);
        return v < lo ? static_cast<T>(lo) : (v > hi ? static_cast<T>(hi) : x);
      });
    case UnaryOp::exp:
      return run_unary_float("exp", out, a, [](auto x) { return std::exp(x); });
    case UnaryOp::log:
      return run_unary_float("log", out, a, [](auto x) { return std::log(x); });
    case UnaryOp::sqrt:
      return run_unary_float("sqrt", out, a, [](auto x) { return std::sqrt(x); });
    case UnaryOp::rsqrt:
      return run_unary_float("rsqrt", out, a,
                             [](auto x) { return static_cast<decltype(x)>(1) / std::sqrt(x); });
    case UnaryOp::tanh:
      return run_unary_float("tanh", out, a, [](auto x) { return std::tanh(x); });
    case UnaryOp::sigmoid:
      return run_unary_float("sigmoid", out, a, [](auto x) {
        using T = decltype(x);
        return T(1) / (T(1) + std::exp(-x));
      });
    case UnaryOp::gelu:
      return run_unary_float("gelu", out, a, [](auto x) {
        using T = decltype(x);
        return T(0.5) * x * (T(1) + std::erf(x * T(kInvSqrt2)));
      });
    case UnaryOp::gelu_tanh:
      if (a.dtype() == kFloat32 && out.dtype() == kFloat32 && a.is_contiguous() &&
          out.is_contiguous() && a.shape() == out.shape() &&
          gelu_tanh_f32_avx2(out.data<float>(), a.data<float>(), a.numel()))
        return;  // Note [GELU on AVX2]
      if (a.dtype() == kBFloat16) return gelu_tanh_bf16(out, a);
      return run_unary_float("gelu", out, a, [](auto x) { return gelu_tanh_value(x); });
  }
  LS_THROW("unary: unknown op ", static_cast<int>(op));
}

void unary_backward_kernel(UnaryOp op, const Tensor& out, const Tensor& g, const Tensor& saved,
                           double lo, double hi) {
  // (gv, s): the incoming gradient and the saved input x or output y.
  auto run = [&](const char* name, const auto& f) { run_binary_float(name, out, g, saved, f); };
  switch (op) {
    case UnaryOp::exp:
      return run("exp_backward", [](auto gv, auto y) { return gv * y; });
    case UnaryOp::log:
      return run("log_backward", [](auto gv, auto x) { return gv / x; });
    case UnaryOp::sqrt:
      return run("sqrt_backward",
                 [](auto gv, auto y) { return static_cast<decltype(gv)>(gv * 0.5 / y); });
    case UnaryOp::rsqrt:
      return run("rsqrt_backward",
                 [](auto gv, auto y) { return static_cast<decltype(gv)>(-0.5 * gv * y * y * y); });
    case UnaryOp::abs:
      return run("abs_backward", [](auto gv, auto x) {
        return x > 0 ? gv : (x < 0 ? -gv : static_cast<decltype(gv)>(0));
      });
    case UnaryOp::relu:
      return run("relu_backward",
                 [](auto gv, auto x) { return x > 0 ? gv : static_cast<decltype(gv)>(0); });
    case UnaryOp::tanh:
      return run("tanh_backward", [](auto gv, auto y) { return gv * (1 - y * y); });
    case UnaryOp::sigmoid:
      return run("sigmoid_backward", [](auto gv, auto y) { return gv * y * (1 - y); });
    case UnaryOp::gelu:
      return run("gelu_backward", [](auto gv, auto x) {
        using T = decltype(x);
        const T cdf = T(0.5) * (T(1) + std::erf(x * T(kInvSqrt2)));
        const T pdf = T(kInvSqrt2Pi) * std::exp(T(-0.5) * x * x);
        return gv * (cdf + x * pdf);
      });
    case UnaryOp::gelu_tanh:
      if (out.dtype() == kFloat32 && g.dtype() == kFloat32 && saved.dtype() == kFloat32 &&
          out.is_contiguous() && g.is_contiguous() && saved.is_contiguous() &&
          g.shape() == out.shape() && saved.shape() == out.shape() &&
          gelu_tanh_backward_f32_avx2(out.data<float>(), g.data<float>(), saved.data<float>(),
                                      out.numel()))
        return;  // Note [GELU on AVX2]
      if (g.dtype() == kBFloat16) return gelu_tanh_backward_bf16(out, g, saved);
      return run("gelu_backward", [](auto gv, auto x) { return gelu_tanh_grad(gv, x); });
    case UnaryOp::clamp:
      return run("clamp_backward", [lo, hi](auto gv, auto x) {
        return (x >= lo && x <= hi) ? gv : static_cast<decltype(gv)>(0);
      });
    case UnaryOp::neg:
    case UnaryOp::sign:
      break;  // their gradients need no kernel of their own
  }
  LS_THROW("unary_backward: no backward kernel for op ", static_cast<int>(op));
}

void where_kernel(const Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b) {
  dispatch_all(out.dtype(), "where", [&]<typename T>() {
    ternary_loop<T, bool, T, T>(out, cond, a, b, [](bool m, T x, T y) { return m ? x : y; });
  });
}

void binary_inplace_kernel(BinaryOp op, const Tensor& self, const Tensor& o, double alpha) {
  if (op == BinaryOp::add) {
    dispatch_all(self.dtype(), "add_", [&]<typename T>() {
      if constexpr (std::is_same_v<T, bool>) {
        LS_THROW("add_: not defined for bool tensors");
      } else if constexpr (is_half_type_v<T>) {
        const float al = static_cast<float>(alpha);
        binary_loop<T, T, T>(self, self, o, [al](T x, T y) {
          return T(static_cast<float>(x) + al * static_cast<float>(y));
        });
      } else if (alpha == 1.0) {
        binary_loop<T, T, T>(self, self, o, [](T x, T y) { return static_cast<T>(x + y); });
      } else {
        const T al = static_cast<T>(alpha);
        binary_loop<T, T, T>(self, self, o, [al](T x, T y) { return static_cast<T>(x + al * y); });
      }
    });
    return;
  }
  LS_CHECK(op == BinaryOp::mul, "binary_inplace: only add_ and mul_ have a kernel");
  dispatch_all(self.dtype(), "mul_", [&]<typename T>() {
    if constexpr (is_half_type_v<T>) {
      binary_loop<T, T, T>(
          self, self, o, [](T x, T y) { return T(static_cast<float>(x) * static_cast<float>(y)); });
    } else {
      binary_loop<T, T, T>(self, self, o, [](T x, T y) { return static_cast<T>(x * y); });
    }
  });
}

}  // namespace lockstep::cpu
