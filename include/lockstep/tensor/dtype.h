// DType: the element types a Tensor can hold, with their sizes and names.
#pragma once

#include <cstdint>
#include <string_view>

namespace lockstep {

enum class DType : uint8_t { f32, f64, bf16, f16, i32, i64, u8, b8 };

inline constexpr DType kFloat32 = DType::f32;
inline constexpr DType kFloat64 = DType::f64;
inline constexpr DType kBFloat16 = DType::bf16;
inline constexpr DType kFloat16 = DType::f16;
inline constexpr DType kInt32 = DType::i32;
inline constexpr DType kInt64 = DType::i64;
inline constexpr DType kUInt8 = DType::u8;
inline constexpr DType kBool = DType::b8;

constexpr int64_t dtype_size(DType t) {
  switch (t) {
    case DType::f64:
    case DType::i64:
      return 8;
    case DType::f32:
    case DType::i32:
      return 4;
    case DType::bf16:
    case DType::f16:
      return 2;
    case DType::u8:
    case DType::b8:
      return 1;
  }
  return 0;
}

constexpr bool is_floating(DType t) {
  return t == DType::f32 || t == DType::f64 || t == DType::bf16 || t == DType::f16;
}
constexpr bool is_half(DType t) { return t == DType::bf16 || t == DType::f16; }

// "f32", "bf16", ... (the same names the safetensors format uses are produced by io/).
std::string_view dtype_name(DType t);
// Parses "f32", "float32", "bf16", "bfloat16", ...; throws lockstep::Error on anything else.
DType parse_dtype(std::string_view name);

// The result type of a binary op on two dtypes (a simplified version of NumPy's promotion:
// floating beats integer, wider beats narrower, bf16 with f16 gives f32).
DType promote_types(DType a, DType b);

}  // namespace lockstep
