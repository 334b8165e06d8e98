// CUDA elementwise kernels: the semantics of src/ops/cpu/elementwise.cpp (its formulas, its
// integer promotions and conversions, its NaN rules) over map<>() of loops.cuh. Each entry
// switches once on its op enum and dtype to a functor instantiated for that op, so the device
// loop has no branch on the op.
#include "ops/cuda/kernels.h"
#include "ops/cuda/loops.cuh"

namespace lockstep::cuda_ops {

namespace {

using detail::BinaryOp;
using detail::CompareOp;
using detail::ScalarOp;
using detail::UnaryOp;

constexpr double kSqrt2OverPi = 0.7978845608028654;  // sqrt(2 / pi)
constexpr double kInvSqrt2 = 0.7071067811865476;
constexpr double kInvSqrt2Pi = 0.3989422804014327;  // 1 / sqrt(2 pi)
constexpr double kGeluCoeff = 0.044715;

// The libm function of T's precision, as std:: picks it for the CPU kernel (expf for float).
template <typename T>
__device__ inline T d_exp(T x) {
  if constexpr (std::is_same_v<T, float>) return expf(x); else return exp(x);
}
template <typename T>
__device__ inline T d_log(T x) {
  if constexpr (std::is_same_v<T, float>) return logf(x); else return log(x);
}
template <typename T>
__device__ inline T d_sqrt(T x) {
  if constexpr (std::is_same_v<T, float>) return sqrtf(x); else return sqrt(x);
}
template <typename T>
__device__ inline T d_tanh(T x) {
  if constexpr (std::is_same_v<T, float>) return tanhf(x); else return tanh(x);
}
template <typename T>
__device__ inline T d_erf(T x) {
  if constexpr (std::is_same_v<T, float>) return erff(x); else return erf(x);
}
template <typename T>
__device__ inline T d_pow(T x, T y) {
  if constexpr (std::is_same_v<T, float>) return powf(x, y); else return pow(x, y);
}

// -- binary ---------------------------------------------------------------------------------
// `x + y` on two T promotes small integers to int; the static_cast back is the CPU's implicit
// conversion on store (u8 wraps).
template <typename T, BinaryOp Op>
struct BinaryFn {
  double alpha;
  __device__ T operator()(T x, T y) const {
    if constexpr (Op == BinaryOp::add) {
      // add/sub with alpha compute in double, as the CPU's `x + alpha * y` does.
      if (alpha == 1.0) return static_cast<T>(x + y);
      return static_cast<T>(static_cast<double>(x) + alpha * static_cast<double>(y));
    } else if constexpr (Op == BinaryOp::sub) {
      if (alpha == 1.0) return static_cast<T>(x - y);
      return static_cast<T>(static_cast<double>(x) - alpha * static_cast<double>(y));
    } else if constexpr (Op == BinaryOp::mul) {
      return static_cast<T>(x * y);
    } else if constexpr (Op == BinaryOp::div) {
      return x / y;
    } else if constexpr (Op == BinaryOp::pow) {
      return d_pow(x, y);
    } else if constexpr (Op == BinaryOp::maximum) {
      return (x != x) ? x : (x > y ? x : y);  // NaN propagates
    } else {
      return (x != x) ? x : (x < y ? x : y);
    }
  }
};

template <BinaryOp Op>
void run_binary(const char* name, const Tensor& out, const Tensor& a, const Tensor& b,
                double alpha) {
  dispatch_numeric(out.dtype(), name, [&]<typename T>() {
    map<T, T, T>(name, out, BinaryFn<T, Op>{alpha}, a, b);
  });
}

template <BinaryOp Op>
void run_binary_float(const char* name, const Tensor& out, const Tensor& a, const Tensor& b) {
  dispatch_float(out.dtype(), name, [&]<typename T>() {
    map<T, T, T>(name, out, BinaryFn<T, Op>{1.0}, a, b);
  });
}

void binary(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b, double alpha) {
  switch (op) {
    case BinaryOp::add:
      return run_binary<BinaryOp::add>("add", out, a, b, alpha);
    case BinaryOp::sub:
      return run_binary<BinaryOp::sub>("sub", out, a, b, alpha);
    case BinaryOp::mul:
      return run_binary<BinaryOp::mul>("mul", out, a, b, 1.0);
    case BinaryOp::div:
      return run_binary_float<BinaryOp::div>("div", out, a, b);
    case BinaryOp::pow:
      return run_binary_float<BinaryOp::pow>("pow", out, a, b);
    case BinaryOp::maximum:
      return run_binary<BinaryOp::maximum>("maximum", out, a, b, 1.0);
    case BinaryOp::minimum:
      return run_binary<BinaryOp::minimum>("minimum", out, a, b, 1.0);
  }
  LS_THROW("binary: unknown op ", static_cast<int>(op));
}

// -- binary with a scalar -------------------------------------------------------------------
// The scalar is converted to T once on the host, as the CPU kernel does.
template <typename T, ScalarOp Op>
struct ScalarFn {
  T s;
  __device__ T operator()(T x) const {
    if constexpr (Op == ScalarOp::add) {
      return static_cast<T>(x + s);
    } else if constexpr (Op == ScalarOp::mul) {
      return static_cast<T>(x * s);
    } else if constexpr (Op == ScalarOp::div) {
      return x / s;
    } else if constexpr (Op == ScalarOp::rsub) {
      return static_cast<T>(s - x);
    } else if constexpr (Op == ScalarOp::pow) {
      return d_pow(x, s);
    } else {
      return x * x;
    }
  }
};

template <ScalarOp Op>
void run_scalar(const char* name, const Tensor& out, const Tensor& a, double s) {
  dispatch_numeric(out.dtype(), name, [&]<typename T>() {
    map<T, T>(name, out, ScalarFn<T, Op>{static_cast<T>(s)}, a);
  });
}

template <ScalarOp Op>
void run_scalar_float(const char* name, const Tensor& out, const Tensor& a, double s) {
  dispatch_float(out.dtype(), name, [&]<typename T>() {
    map<T, T>(name, out, ScalarFn<T, Op>{static_cast<T>(s)}, a);
  });
}

void binary_scalar(ScalarOp op, const Tensor& out, const Tensor& a, double s) {
  switch (op) {
    case ScalarOp::add:
      return run_scalar<ScalarOp::add>("add", out, a, s);
    case ScalarOp::mul:
      return run_scalar<ScalarOp::mul>("mul", out, a, s);
    case ScalarOp::div:
      return run_scalar_float<ScalarOp::div>("div", out, a, s);
    case ScalarOp::rsub:
      return run_scalar<ScalarOp::rsub>("rsub", out, a, s);
    case ScalarOp::pow:
      return run_scalar_float<ScalarOp::pow>("pow", out, a, s);
    case ScalarOp::square:
      return run_scalar_float<ScalarOp::square>("pow", out, a, s);
  }
  LS_THROW("binary_scalar: unknown op ", static_cast<int>(op));
}

// -- comparisons ----------------------------------------------------------------------------
template <typename T, CompareOp Op>
__device__ inline bool compare_values(T x, T y) {
  if constexpr (Op == CompareOp::eq) return x == y;
  else if constexpr (Op == CompareOp::ne) return x != y;
  else if constexpr (Op == CompareOp::lt) return x < y;
  else if constexpr (Op == CompareOp::le) return x <= y;
  else if constexpr (Op == CompareOp::gt) return x > y;
  else if constexpr (Op == CompareOp::ge) return x >= y;
  else if constexpr (Op == CompareOp::isnan) return isnan(x);
  else return isfinite(x);
}

template <typename T, CompareOp Op>
struct CompareFn {
  __device__ bool operator()(T x, T y) const { return compare_values<T, Op>(x, y); }
};

// Compares in double, so that the scalar is never rounded to the tensor's type first.
template <typename T, CompareOp Op>
struct CompareScalarFn {
  double s;
  __device__ bool operator()(T x) const {
    return compare_values<double, Op>(static_cast<double>(x), s);
  }
};

template <CompareOp Op>
void run_compare(const char* name, const Tensor& out, const Tensor& a, const Tensor& b) {
  dispatch_numeric(a.dtype(), name, [&]<typename T>() {
    map<bool, T, T>(name, out, CompareFn<T, Op>{}, a, b);
  });
}

template <CompareOp Op>
void run_compare_scalar(const char* name, const Tensor& out, const Tensor& a, double s) {
  dispatch_numeric(a.dtype(), name, [&]<typename T>() {
    map<bool, T>(name, out, CompareScalarFn<T, Op>{s}, a);
  });
}

void compare(CompareOp op, const Tensor& out, const Tensor& a, const Tensor& b) {
  switch (op) {
    case CompareOp::eq:
      return run_compare<CompareOp::eq>("eq", out, a, b);
    case CompareOp::ne:
      return run_compare<CompareOp::ne>("ne", out, a, b);
    case CompareOp::lt:
      return run_compare<CompareOp::lt>("lt", out, a, b);
    case CompareOp::le:
      return run_compare<CompareOp::le>("le", out, a, b);
    case CompareOp::gt:
      return run_compare<CompareOp::gt>("gt", out, a, b);
    case CompareOp::ge:
      return run_compare<CompareOp::ge>("ge", out, a, b);
    case CompareOp::isnan:
    case CompareOp::isfinite:
      break;  // unary: compare_scalar only
  }
  LS_THROW("compare: op ", static_cast<int>(op), " is not a binary comparison");
}

void compare_scalar(CompareOp op, const Tensor& out, const Tensor& a, double s) {
  switch (op) {
    case CompareOp::eq:
      return run_compare_scalar<CompareOp::eq>("eq", out, a, s);
    case CompareOp::ne:
      return run_compare_scalar<CompareOp::ne>("ne", out, a, s);
    case CompareOp::lt:
      return run_compare_scalar<CompareOp::lt>("lt", out, a, s);
    case CompareOp::le:
      return run_compare_scalar<CompareOp::le>("le", out, a, s);
    case CompareOp::gt:
      return run_compare_scalar<CompareOp::gt>("gt", out, a, s);
    case CompareOp::ge:
      return run_compare_scalar<CompareOp::ge>("ge", out, a, s);
    case CompareOp::isnan:
      return run_compare_scalar<CompareOp::isnan>("isnan", out, a, s);
    case CompareOp::isfinite:
      return run_compare_scalar<CompareOp::isfinite>("isfinite", out, a, s);
  }
  LS_THROW("compare_scalar: unknown op ", static_cast<int>(op));
}

// -- unary ----------------------------------------------------------------------------------
template <typename T, UnaryOp Op>
struct UnaryFn {
  double lo, hi;  // clamp's bounds
  __device__ T operator()(T x) const {
    if constexpr (Op == UnaryOp::neg) {
      return static_cast<T>(-x);
    } else if constexpr (Op == UnaryOp::abs) {
      if constexpr (std::is_unsigned_v<T>) return x;
      else return x < 0 ? static_cast<T>(-x) : x;
    } else if constexpr (Op == UnaryOp::sign) {
      if constexpr (std::is_unsigned_v<T>) return static_cast<T>(T(0) < x);
      else return static_cast<T>((T(0) < x) - (x < T(0)));
    } else if constexpr (Op == UnaryOp::relu) {
      return x > 0 ? x : static_cast<T>(0);
    } else if constexpr (Op == UnaryOp::clamp) {
      if (x != x) return x;
      const double v = static_cast<double>(x);
      return v < lo ? static_cast<T>(lo) : (v > hi ? static_cast<T>(hi) : x);
    } else if constexpr (Op == UnaryOp::exp) {
      return d_exp(x);
    } else if constexpr (Op == UnaryOp::log) {
      return d_log(x);
    } else if constexpr (Op == UnaryOp::sqrt) {
      return d_sqrt(x);
    } else if constexpr (Op == UnaryOp::rsqrt) {
      return T(1) / d_sqrt(x);  // not rsqrt(): the CPU's rounding
    } else if constexpr (Op == UnaryOp::tanh) {
      return d_tanh(x);
    } else if constexpr (Op == UnaryOp::sigmoid) {
      return T(1) / (T(1) + d_exp(-x));
    } else if constexpr (Op == UnaryOp::gelu) {
      return T(0.5) * x * (T(1) + d_erf(x * T(kInvSqrt2)));
    } else {
      const T inner = T(kSqrt2OverPi) * (x + T(kGeluCoeff) * x * x * x);
      return T(0.5) * x * (T(1) + d_tanh(inner));
    }
  }
};

template <UnaryOp Op>
void run_unary(const char* name, const Tensor& out, const Tensor& a, double lo, double hi) {
  dispatch_numeric(a.dtype(), name, [&]<typename T>() {
    map<T, T>(name, out, UnaryFn<T, Op>{lo, hi}, a);
  });
}

template <UnaryOp Op>
void run_unary_float(const char* name, const Tensor& out, const Tensor& a) {
  dispatch_float(a.dtype(), name, [&]<typename T>() {
    map<T, T>(name, out, UnaryFn<T, Op>{0.0, 0.0}, a);
  });
}

void unary(UnaryOp op, const Tensor& out, const Tensor& a, double lo, double hi) {
  switch (op) {
    case UnaryOp::neg:
      return run_unary<UnaryOp::neg>("neg", out, a, lo, hi);
    case UnaryOp::abs:
      return run_unary<UnaryOp::abs>("abs", out, a, lo, hi);
    case UnaryOp::sign:
      return run_unary<UnaryOp::sign>("sign", out, a, lo, hi);
    case UnaryOp::relu:
      return run_unary<UnaryOp::relu>("relu", out, a, lo, hi);
    case UnaryOp::clamp:
      return run_unary<UnaryOp::clamp>("clamp", out, a, lo, hi);
    case UnaryOp::exp:
      return run_unary_float<UnaryOp::exp>("exp", out, a);
    case UnaryOp::log:
      return run_unary_float<UnaryOp::log>("log", out, a);
    case UnaryOp::sqrt:
      return run_unary_float<UnaryOp::sqrt>("sqrt", out, a);
    case UnaryOp::rsqrt:
      return run_unary_float<UnaryOp::rsqrt>("rsqrt", out, a);
    case UnaryOp::tanh:
      return run_unary_float<UnaryOp::tanh>("tanh", out, a);
    case UnaryOp::sigmoid:
      return run_unary_float<UnaryOp::sigmoid>("sigmoid", out, a);
    case UnaryOp::gelu:
      return run_unary_float<UnaryOp::gelu>("gelu", out, a);
    case UnaryOp::gelu_tanh:
      return run_unary_float<UnaryOp::gelu_tanh>("gelu", out, a);
  }
  LS_THROW("unary: unknown op ", static_cast<int>(op));
}

// -- unary backward -------------------------------------------------------------------------
// (gv, s): the incoming gradient and the saved input x, or output y for exp, sqrt, rsqrt, tanh
// and sigmoid. sqrt and rsqrt compute in double, as the CPU's `gv * 0.5 / y` does.
template <typename T, UnaryOp Op>
struct UnaryBackwardFn {
  double lo, hi;
  __device__ T operator()(T gv, T s) const {
    if constexpr (Op == UnaryOp::exp) {
      return gv * s;
    } else if constexpr (Op == UnaryOp::log) {
      return gv / s;
    } else if constexpr (Op == UnaryOp::sqrt) {
      return static_cast<T>(static_cast<double>(gv) * 0.5 / static_cast<double>(s));
    } else if constexpr (Op == UnaryOp::rsqrt) {
      const double y = static_cast<double>(s);
      return static_cast<T>(-0.5 * static_cast<double>(gv) * y * y * y);
    } else if constexpr (Op == UnaryOp::abs) {
      return s > 0 ? gv : (s < 0 ? -gv : static_cast<T>(0));
    } else if constexpr (Op == UnaryOp::relu) {
      return s > 0 ? gv : static_cast<T>(0);
    } else if constexpr (Op == UnaryOp::tanh) {
      return gv * (1 - s * s);
    } else if constexpr (Op == UnaryOp::sigmoid) {
      return gv * s * (1 - s);
    } else if constexpr (Op == UnaryOp::gelu) {
      const T x = s;
      const T cdf = T(0.5) * (T(1) + d_erf(x * T(kInvSqrt2)));
      const T pdf = T(kInvSqrt2Pi) * d_exp(T(-0.5) * x * x);
      return gv * (cdf + x * pdf);
    } else if constexpr (Op == UnaryOp::gelu_tanh) {
      const T x = s;
      const T inner = T(kSqrt2OverPi) * (x + T(kGeluCoeff) * x * x * x);
      const T t = d_tanh(inner);
      const T dinner = T(kSqrt2OverPi) * (T(1) + T(3 * kGeluCoeff) * x * x);
      return gv * (T(0.5) * (T(1) + t) + T(0.5) * x * (T(1) - t * t) * dinner);
    } else {  // clamp: the bounds compare in double; NaN passes no gradient
      return (s >= lo && s <= hi) ? gv : static_cast<T>(0);
    }
  }
};

template <UnaryOp Op>
void run_backward(const char* name, const Tensor& out, const Tensor& g, const Tensor& saved,
                  double lo, double hi) {
  dispatch_float(out.dtype(), name, [&]<typename T>() {
    map<T, T, T>(name, out, UnaryBackwardFn<T, Op>{lo, hi}, g, saved);
  });
}

void unary_backward(UnaryOp op, const Tensor& out, const Tensor& g, const Tensor& saved,
                    double lo, double hi) {
  switch (op) {
    case UnaryOp::exp:
      return run_backward<UnaryOp::exp>("exp_backward", out, g, saved, lo, hi);
    case UnaryOp::log:
      return run_backward<UnaryOp::log>("log_backward", out, g, saved, lo, hi);
    case UnaryOp::sqrt:
      return run_backward<UnaryOp::sqrt>("sqrt_backward", out, g, saved, lo, hi);
    case UnaryOp::rsqrt:
      return run_backward<UnaryOp::rsqrt>("rsqrt_backward", out, g, saved, lo, hi);
    case UnaryOp::abs:
      return run_backward<UnaryOp::abs>("abs_backward", out, g, saved, lo, hi);
    case UnaryOp::relu:
      return run_backward<UnaryOp::relu>("relu_backward", out, g, saved, lo, hi);
    case UnaryOp::tanh:
      return run_backward<UnaryOp::tanh>("tanh_backward", out, g, saved, lo, hi);
    case UnaryOp::sigmoid:
      return run_backward<UnaryOp::sigmoid>("sigmoid_backward", out, g, saved, lo, hi);
    case UnaryOp::gelu:
      return run_backward<UnaryOp::gelu>("gelu_backward", out, g, saved, lo, hi);
    case UnaryOp::gelu_tanh:
      return run_backward<UnaryOp::gelu_tanh>("gelu_backward", out, g, saved, lo, hi);
    case UnaryOp::clamp:
      return run_backward<UnaryOp::clamp>("clamp_backward", out, g, saved, lo, hi);
    case UnaryOp::neg:
    case UnaryOp::sign:
      break;  // their gradients need no kernel of their own
  }
  LS_THROW("unary_backward: no backward kernel for op ", static_cast<int>(op));
}

// -- where, in-place ------------------------------------------------------------------------
template <typename T>
struct WhereFn {
  __device__ T operator()(bool m, T x, T y) const { return m ? x : y; }
};

void where(const Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b) {
  dispatch_all(out.dtype(), "where", [&]<typename T>() {
    map<T, bool, T, T>("where", out, WhereFn<T>{}, cond, a, b);
  });
}

// add_: x + alpha * y with alpha converted to T (to float for the 16-bit floats, which compute
// in float and round once); mul_: x * y.
template <typename T, BinaryOp Op>
struct InplaceFn {
  acc_t<T> alpha;
  bool unit;  // alpha == 1
  __device__ T operator()(T x, T y) const {
    if constexpr (is_half_v<T>) {
      const float xf = static_cast<float>(x), yf = static_cast<float>(y);
      if constexpr (Op == BinaryOp::add) return convert<T>(xf + alpha * yf);
      else return convert<T>(xf * yf);
    } else if constexpr (Op == BinaryOp::add) {
      return unit ? static_cast<T>(x + y) : static_cast<T>(x + alpha * y);
    } else {
      return static_cast<T>(x * y);
    }
  }
};

void binary_inplace(BinaryOp op, const Tensor& self, const Tensor& other, double alpha) {
  if (op == BinaryOp::add) {
    dispatch_all(self.dtype(), "add_", [&]<typename T>() {
      if constexpr (std::is_same_v<T, bool>) {
        LS_THROW("add_: not defined for bool tensors");
      } else {
        const InplaceFn<T, BinaryOp::add> f{static_cast<acc_t<T>>(alpha), alpha == 1.0};
        map<T, T, T>("add_", self, f, self, other);
      }
    });
    return;
  }
  LS_CHECK(op == BinaryOp::mul, "binary_inplace: only add_ and mul_ have a kernel");
  dispatch_all(self.dtype(), "mul_", [&]<typename T>() {
    map<T, T, T>("mul_", self, InplaceFn<T, BinaryOp::mul>{acc_t<T>{}, true}, self, other);
  });
}

}  // namespace

void fill_elementwise_kernels(Kernels& k) {
  k.binary = binary;
  k.binary_scalar = binary_scalar;
  k.compare = compare;
  k.compare_scalar = compare_scalar;
  k.unary = unary;
  k.unary_backward = unary_backward;
  k.where = where;
  k.binary_inplace = binary_inplace;
}

}  // namespace lockstep::cuda_ops
