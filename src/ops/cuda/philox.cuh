// Philox4x32-10 and the unit-interval conversions of Note [Random tensors] (src/ops/factory.cpp),
// callable from host and device: CUDA kernels draw exactly the numbers of Generator::philox
// (src/tensor/generator.cpp). Plain C++ when not compiled by nvcc, so a CPU test checks the host
// side bit for bit against the Generator (tests/ops/philox_test.cpp).
#pragma once

#include <cmath>
#include <cstdint>

#include "base/host_device.h"

namespace lockstep::philox {

struct Block {
  uint32_t x[4];
};

// The constants and rounds of Generator::philox; counter (block, 0), key seed.
LS_HOST_DEVICE Block philox(uint64_t seed, uint64_t block) {
  uint32_t c0 = static_cast<uint32_t>(block), c1 = static_cast<uint32_t>(block >> 32);
  uint32_t c2 = 0, c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int r = 0; r < 10; ++r) {
    const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * c0;
    const uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * c2;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return Block{{c0, c1, c2, c3}};
}

// Generator::to_unit_float: 24 bits, [0, 1).
LS_HOST_DEVICE float to_unit_float(uint32_t x) {
  return static_cast<float>(x >> 8) * 0x1.0p-24f;
}

// Generator::to_unit_double: 53 bits of (hi, lo), [0, 1).
LS_HOST_DEVICE double to_unit_double(uint32_t hi, uint32_t lo) {
  const uint64_t v = (static_cast<uint64_t>(hi) << 32 | lo) >> 11;
  return static_cast<double>(v) * 0x1.0p-53;
}

// Dropout's and randn's 32-bit lane as a double in [0, 1) (all 32 bits, exact in a double).
LS_HOST_DEVICE double lane_unit(uint32_t x) { return static_cast<double>(x) * 0x1.0p-32; }

// a * b and a + b rounded on their own: in device code nvcc would otherwise contract
// `a + b * c` into one fused multiply-add, which the CPU build (no -march) never does.
LS_HOST_DEVICE double mul_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
LS_HOST_DEVICE double add_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}

// -- the values of Note [Random tensors], element k of the elements block `b` feeds --------
// rand: low + span * u, u from lane k (32-bit draw, 4 elements a block) or from lanes 2k,
// 2k + 1 (`wide`: f64, 2 elements a block); high itself (rounding) maps to low.
LS_HOST_DEVICE double uniform_value(const Block& b, int k, bool wide, double low, double high,
                                    double span) {
  const double u = wide ? to_unit_double(b.x[2 * k], b.x[2 * k + 1])
                        : static_cast<double>(to_unit_float(b.x[k]));
  const double v = add_rn(low, mul_rn(span, u));
  return v < high ? v : low;
}

// randn: Box-Muller on the lane pair (0, 1) or (2, 3) holding lane k; the even lane takes the
// cosine, the odd one the sine. Host: glibc's log/sin/cos; device: CUDA's (Note [CUDA random
// fills] in src/ops/cuda/factory.cu).
LS_HOST_DEVICE double normal_value(const Block& b, int k, double mean, double std) {
  const int pair = k & ~1;
  const double u1 = (static_cast<double>(b.x[pair]) + 1.0) * 0x1.0p-32;  // (0, 1], exact
  const double u2 = static_cast<double>(b.x[pair + 1]) * 0x1.0p-32;
  using std::cos, std::log, std::sin, std::sqrt;
  const double r = sqrt(-2.0 * log(u1));  // -2 * x is exact
  const double angle = mul_rn(2.0 * M_PI, u2);
  const double z = mul_rn(r, (k & 1) ? sin(angle) : cos(angle));
  return add_rn(mean, mul_rn(std, z));
}

// randint: low + (64 bits of lanes 2k, 2k + 1) mod span (2 elements a block).
LS_HOST_DEVICE int64_t randint_value(const Block& b, int k, int64_t low, uint64_t span) {
  const uint64_t r = static_cast<uint64_t>(b.x[2 * k]) << 32 | b.x[2 * k + 1];
  return low + static_cast<int64_t>(r % span);
}

// dropout: element k of the block keeps when its lane, as u in [0, 1), is >= p.
LS_HOST_DEVICE bool keep_value(const Block& b, int k, double p) { return lane_unit(b.x[k]) >= p; }

}  // namespace lockstep::philox
