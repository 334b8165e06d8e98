// DType names, parsing and promotion.
#include "lockstep/tensor/dtype.h"

#include <string>

#include "lockstep/base/error.h"

namespace lockstep {

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::u8: return "u8";
    case DType::b8: return "bool";
  }
  return "?";
}

DType parse_dtype(std::string_view name) {
  if (name == "f32" || name == "float32" || name == "float") return DType::f32;
  if (name == "f64" || name == "float64" || name == "double") return DType::f64;
  if (name == "bf16" || name == "bfloat16") return DType::bf16;
  if (name == "f16" || name == "float16" || name == "half") return DType::f16;
  if (name == "i32" || name == "int32") return DType::i32;
  if (name == "i64" || name == "int64") return DType::i64;
  if (name == "u8" || name == "uint8") return DType::u8;
  if (name == "bool" || name == "b8") return DType::b8;
  LS_THROW("unknown dtype '", std::string(name),
           "': expected one of f32, f64, bf16, f16, i32, i64, u8, bool");
}

namespace {
// Rank in the promotion lattice: bool < u8 < i32 < i64 < (half types) < f32 < f64.
int rank_of(DType t) {
  switch (t) {
    case DType::b8: return 0;
    case DType::u8: return 1;
    case DType::i32: return 2;
    case DType::i64: return 3;
    case DType::bf16: return 4;
    case DType::f16: return 4;
    case DType::f32: return 5;
    case DType::f64: return 6;
  }
  return 0;
}
}  // namespace

DType promote_types(DType a, DType b) {
  if (a == b) return a;
  if (is_half(a) && is_half(b)) return DType::f32;
  return rank_of(a) >= rank_of(b) ? a : b;
}

}  // namespace lockstep
