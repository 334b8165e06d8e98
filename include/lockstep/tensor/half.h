// bfloat16 and IEEE float16 storage types with round-to-nearest-even conversion from float.
#pragma once

#include <cstdint>
#include <cstring>

namespace lockstep {

// Conversions are bit-exact: f32 -> 16-bit rounds to nearest, ties to even; NaN stays NaN
// (made quiet, sign and top payload bits kept); infinities and signed zeros are preserved;
// float16 subnormals are produced and read correctly.
inline float bf16_bits_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep it NaN, make it quiet
    return static_cast<uint16_t>((u >> 16) | 0x0040u);
  }
  uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;
  return static_cast<uint16_t>(u >> 16);
}

float f16_bits_to_float(uint16_t h);
uint16_t float_to_f16_bits(float f);

// Bulk conversions of n contiguous values, bit-identical to the scalar ones above; they use the
// CPU's F16C instructions when it has them (any x86-64 since 2012) and the scalar code otherwise.
void f16_bits_to_float_n(const uint16_t* src, float* dst, int64_t n);
void float_to_f16_bits_n(const float* src, uint16_t* dst, int64_t n);
// The same for bf16, bit for bit the scalar conversions (AVX2 where the CPU has it).
void bf16_bits_to_float_n(const uint16_t* src, float* dst, int64_t n);
void float_to_bf16_bits_n(const float* src, uint16_t* dst, int64_t n);

struct BFloat16 {
  uint16_t bits = 0;
  BFloat16() = default;
  BFloat16(float f) : bits(float_to_bf16_bits(f)) {}  // NOLINT: implicit like a float
  operator float() const { return bf16_bits_to_float(bits); }
  static BFloat16 from_bits(uint16_t b) {
    BFloat16 h;
    h.bits = b;
    return h;
  }
};

struct Half {
  uint16_t bits = 0;
  Half() = default;
  Half(float f) : bits(float_to_f16_bits(f)) {}  // NOLINT
  operator float() const { return f16_bits_to_float(bits); }
  static Half from_bits(uint16_t b) {
    Half h;
    h.bits = b;
    return h;
  }
};

static_assert(sizeof(BFloat16) == 2 && sizeof(Half) == 2);

}  // namespace lockstep
