// Dtype dispatch: calls a template lambda with the C++ type behind a runtime DType.
#pragma once

#include <cstdint>
#include <type_traits>

#include "lockstep/base/error.h"
#include "lockstep/tensor/tensor.h"

namespace lockstep::cpu {

template <typename T>
inline constexpr bool is_half_type_v = std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>;

// Value conversion between any two element types (16-bit floats go through float).
template <typename To, typename From>
inline To convert(From v) {
  if constexpr (std::is_same_v<To, From>) {
    return v;
  } else if constexpr (is_half_type_v<From>) {
    return convert<To>(static_cast<float>(v));
  } else if constexpr (is_half_type_v<To>) {
    return To(static_cast<float>(v));
  } else if constexpr (std::is_same_v<To, bool>) {
    return v != From(0);
  } else {
    return static_cast<To>(v);
  }
}

// f.template operator()<T>() for the dtype's type; `op` names the caller in the error.
#define LS_DISPATCH_CASE(DT, T) \
  case DType::DT:               \
    return f.template operator()<T>();

template <typename F>
decltype(auto) dispatch_all(DType t, const char* op, F&& f) {
  switch (t) {
    LS_DISPATCH_CASE(f32, float)
    LS_DISPATCH_CASE(f64, double)
    LS_DISPATCH_CASE(bf16, BFloat16)
    LS_DISPATCH_CASE(f16, Half)
    LS_DISPATCH_CASE(i32, int32_t)
    LS_DISPATCH_CASE(i64, int64_t)
    LS_DISPATCH_CASE(u8, uint8_t)
    LS_DISPATCH_CASE(b8, bool)
  }
  LS_THROW(op, ": unsupported dtype");
}

// f32, f64, i32, i64, u8: the types that kernels compute in directly (16-bit floats are
// computed in f32 by the op and converted back).
template <typename F>
decltype(auto) dispatch_numeric(DType t, const char* op, F&& f) {
  switch (t) {
    LS_DISPATCH_CASE(f32, float)
    LS_DISPATCH_CASE(f64, double)
    LS_DISPATCH_CASE(i32, int32_t)
    LS_DISPATCH_CASE(i64, int64_t)
    LS_DISPATCH_CASE(u8, uint8_t)
    default:
      break;
  }
  LS_THROW(op, ": dtype ", dtype_name(t), " is not supported (expected f32, f64, i32, i64 or u8)");
}

template <typename F>
decltype(auto) dispatch_float(DType t, const char* op, F&& f) {
  switch (t) {
    LS_DISPATCH_CASE(f32, float)
    LS_DISPATCH_CASE(f64, double)
    default:
      break;
  }
  LS_THROW(op, ": dtype ", dtype_name(t), " is not supported (expected f32 or f64)");
}

template <typename F>
decltype(auto) dispatch_index(DType t, const char* op, F&& f) {
  switch (t) {
    LS_DISPATCH_CASE(i32, int32_t)
    LS_DISPATCH_CASE(i64, int64_t)
    default:
      break;
  }
  LS_THROW(op, ": indices must be i64 or i32, got ", dtype_name(t));
}

#undef LS_DISPATCH_CASE

// Accumulation type for sums: double for floating types, int64 for integers.
template <typename T>
using acc_t = std::conditional_t<std::is_floating_point_v<T> || is_half_type_v<T>, double, int64_t>;

}  // namespace lockstep::cpu
