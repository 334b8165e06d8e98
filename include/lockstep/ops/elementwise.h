// Elementwise ops with NumPy broadcasting, their scalar overloads and operators.
#pragma once

#include "lockstep/tensor/tensor.h"

namespace lockstep {

// Binary ops broadcast both operands to a common shape and promote dtypes (promote_types).
Tensor add(const Tensor& a, const Tensor& b, double alpha = 1.0);  // a + alpha * b
Tensor sub(const Tensor& a, const Tensor& b, double alpha = 1.0);  // a - alpha * b
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor pow(const Tensor& a, const Tensor& b);
Tensor maximum(const Tensor& a, const Tensor& b);
Tensor minimum(const Tensor& a, const Tensor& b);

Tensor add(const Tensor& a, double b);
Tensor sub(const Tensor& a, double b);
Tensor mul(const Tensor& a, double b);
Tensor div(const Tensor& a, double b);
Tensor pow(const Tensor& a, double exponent);
Tensor rsub(const Tensor& a, double b);  // b - a

// Unary.
Tensor neg(const Tensor& a);
Tensor exp(const Tensor& a);
Tensor log(const Tensor& a);
Tensor sqrt(const Tensor& a);
Tensor rsqrt(const Tensor& a);
Tensor abs(const Tensor& a);
Tensor relu(const Tensor& a);
Tensor tanh(const Tensor& a);
Tensor sigmoid(const Tensor& a);
Tensor sign(const Tensor& a);
enum class GeluApprox { none, tanh };
Tensor gelu(const Tensor& a, GeluApprox approx = GeluApprox::none);
Tensor clamp(const Tensor& a, double min, double max);
Tensor clamp_min(const Tensor& a, double min);

// Comparisons return bool tensors (no gradient).
Tensor eq(const Tensor& a, const Tensor& b);
Tensor ne(const Tensor& a, const Tensor& b);
Tensor lt(const Tensor& a, const Tensor& b);
Tensor le(const Tensor& a, const Tensor& b);
Tensor gt(const Tensor& a, const Tensor& b);
Tensor ge(const Tensor& a, const Tensor& b);
Tensor eq(const Tensor& a, double b);
Tensor ne(const Tensor& a, double b);
Tensor lt(const Tensor& a, double b);
Tensor le(const Tensor& a, double b);
Tensor gt(const Tensor& a, double b);
Tensor ge(const Tensor& a, double b);
Tensor logical_not(const Tensor& a);
Tensor isnan(const Tensor& a);
Tensor isfinite(const Tensor& a);

// cond ? a : b, all three broadcast; cond is bool (or any dtype, nonzero = true).
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);
// a with `value` wherever mask is true (mask broadcasts to a).
Tensor masked_fill(const Tensor& a, const Tensor& mask, double value);

// True when every element of a and b is within atol + rtol * |b|.
bool allclose(const Tensor& a, const Tensor& b, double rtol = 1e-5, double atol = 1e-8);
// Exact equality of shape and every element (NaN never equal).
bool equal(const Tensor& a, const Tensor& b);

inline Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
inline Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
inline Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
inline Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
inline Tensor operator-(const Tensor& a) { return neg(a); }
inline Tensor operator+(const Tensor& a, double b) { return add(a, b); }
inline Tensor operator-(const Tensor& a, double b) { return sub(a, b); }
inline Tensor operator*(const Tensor& a, double b) { return mul(a, b); }
inline Tensor operator/(const Tensor& a, double b) { return div(a, b); }
inline Tensor operator+(double a, const Tensor& b) { return add(b, a); }
inline Tensor operator-(double a, const Tensor& b) { return rsub(b, a); }
inline Tensor operator*(double a, const Tensor& b) { return mul(b, a); }

// Result shape of broadcasting a and b; throws naming both shapes when they do not broadcast.
Dims broadcast_shapes(const Dims& a, const Dims& b, const char* op = "broadcast");

}  // namespace lockstep
