// Philox4x32-10 and the unit-interval conversions of Note [Random tensors] (src/ops/factory.cpp),
// callable from host and device: CUDA kernels draw exactly the numbers of Generator::philox
// (src/tensor/generator.cpp). Plain C++ when not compiled by nvcc, so a CPU test checks the host
// side bit for bit against the Generator (tests/ops/philox_test.cpp).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define LS_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define LS_HOST_DEVICE inline
#endif

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

}  // namespace lockstep::philox
