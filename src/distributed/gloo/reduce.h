// Element-wise reduction kernels handed to Gloo, per dtype and op, and the in-place average.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "lockstep/base/error.h"
#include "lockstep/distributed/process_group.h"
#include "lockstep/tensor/half.h"

namespace lockstep::dist::detail {

// Gloo's signature: out[i] = a[i] op b[i] for n elements; out may alias a or b.
using ReduceFn = void (*)(void* out, const void* a, const void* b, size_t n);

struct Sum {
  template <typename T>
  static T apply(T a, T b) {
    return a + b;
  }
};
struct Product {
  template <typename T>
  static T apply(T a, T b) {
    return a * b;
  }
};
struct Min {
  template <typename T>
  static T apply(T a, T b) {
    return std::min(a, b);
  }
};
struct Max {
  template <typename T>
  static T apply(T a, T b) {
    return std::max(a, b);
  }
};

template <typename T, typename Op>
void reduce_native(void* out, const void* a, const void* b, size_t n) {
  auto* o = static_cast<T*>(out);
  const auto* x = static_cast<const T*>(a);
  const auto* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) o[i] = Op::apply(x[i], y[i]);
}

// bf16 and f16 travel as 16-bit words; each pair is reduced in f32 and rounded back (to nearest
// even), so sums are sums of numbers, not of bit patterns.
template <typename Op>
void reduce_bf16(void* out, const void* a, const void* b, size_t n) {
  auto* o = static_cast<uint16_t*>(out);
  const auto* x = static_cast<const uint16_t*>(a);
  const auto* y = static_cast<const uint16_t*>(b);
  for (size_t i = 0; i < n; ++i) {
    o[i] = float_to_bf16_bits(Op::apply(bf16_bits_to_float(x[i]), bf16_bits_to_float(y[i])));
  }
}

template <typename Op>
void reduce_f16(void* out, const void* a, const void* b, size_t n) {
  auto* o = static_cast<uint16_t*>(out);
  const auto* x = static_cast<const uint16_t*>(a);
  const auto* y = static_cast<const uint16_t*>(b);
  for (size_t i = 0; i < n; ++i) {
    o[i] = float_to_f16_bits(Op::apply(f16_bits_to_float(x[i]), f16_bits_to_float(y[i])));
  }
}

template <typename Op>
ReduceFn reduce_fn_for(DType t) {
  switch (t) {
    case DType::f32:
      return &reduce_native<float, Op>;
    case DType::f64:
      return &reduce_native<double, Op>;
    case DType::i32:
      return &reduce_native<int32_t, Op>;
    case DType::i64:
      return &reduce_native<int64_t, Op>;
    case DType::bf16:
      return &reduce_bf16<Op>;
    case DType::f16:
      return &reduce_f16<Op>;
    default:
      LS_THROW("no reduction kernel for ", dtype_name(t), " tensors");
  }
}

// avg is a sum followed by this division, as PyTorch DDP divides its gradients.
inline ReduceFn reduce_fn(DType t, ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      return reduce_fn_for<Sum>(t);
    case ReduceOp::product:
      return reduce_fn_for<Product>(t);
    case ReduceOp::min:
      return reduce_fn_for<Min>(t);
    case ReduceOp::max:
      return reduce_fn_for<Max>(t);
  }
  LS_THROW("unknown reduce op ", static_cast<int>(op));
}

// data[i] /= divisor for a contiguous floating-point buffer.
inline void divide_in_place(void* data, DType t, size_t n, int divisor) {
  switch (t) {
    case DType::f32: {
      auto* p = static_cast<float*>(data);
      const float d = static_cast<float>(divisor);
      for (size_t i = 0; i < n; ++i) p[i] /= d;
      return;
    }
    case DType::f64: {
      auto* p = static_cast<double*>(data);
      for (size_t i = 0; i < n; ++i) p[i] /= divisor;
      return;
    }
    case DType::bf16: {
      auto* p = static_cast<uint16_t*>(data);
      for (size_t i = 0; i < n; ++i) p[i] = float_to_bf16_bits(bf16_bits_to_float(p[i]) / divisor);
      return;
    }
    case DType::f16: {
      auto* p = static_cast<uint16_t*>(data);
      for (size_t i = 0; i < n; ++i) p[i] = float_to_f16_bits(f16_bits_to_float(p[i]) / divisor);
      return;
    }
    default:
      LS_THROW("avg of ", dtype_name(t), " tensors is not defined");
  }
}

}  // namespace lockstep::dist::detail
