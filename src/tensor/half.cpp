// IEEE binary16 conversions (round to nearest even, subnormals, NaN and infinity preserved).
#include "lockstep/tensor/half.h"

namespace lockstep {

float f16_bits_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t u;
  if (exp == 0x1f) {  // inf / NaN: keep the payload
    u = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {  // normal
    u = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {  // signed zero
    u = sign;
  } else {  // subnormal: value = mant * 2^-24, renormalize
    int shift = 0;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      ++shift;
    }
    mant &= 0x3ffu;
    u = sign | (static_cast<uint32_t>(113 - shift) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t float_to_f16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) {  // NaN: quiet, keep the top payload bits
    return static_cast<uint16_t>(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));
  }
  if (abs >= 0x477ff000u) {  // rounds to >= 65520: infinity
    return static_cast<uint16_t>(sign | 0x7c00u);
  }
  if (abs < 0x38800000u) {  // below the smallest normal (2^-14): subnormal or zero
    // The subnormal value is abs / 2^-24 rounded to nearest even. Build the full 24-bit
    // significand and shift it right by the exponent difference.
    int32_t e = static_cast<int32_t>(abs >> 23);  // biased f32 exponent
    if (e < 102) return sign;                       // < 2^-25: rounds to zero
    uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    int shift = 126 - e;  // 14 + (127 - 1 - e) ... number of bits to drop, in [14, 24]
    uint32_t half_ulp = 1u << (shift - 1);
    uint32_t rest = mant & ((1u << shift) - 1);
    uint32_t q = mant >> shift;
    if (rest > half_ulp || (rest == half_ulp && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  // Normal: rebias the exponent and round the mantissa from 23 to 10 bits.
  uint32_t v = abs - (112u << 23);
  uint32_t lsb = (v >> 13) & 1u;
  v += 0xfffu + lsb;
  return static_cast<uint16_t>(sign | (v >> 13));
}

}  // namespace lockstep
