// Generator: a seedable counter-based random number generator (Philox4x32-10).
#pragma once

#include <array>
#include <cstdint>

namespace lockstep {

// Counter-based: value i of a draw depends only on (seed, offset, i), so a tensor of random
// numbers is the same whatever the thread count that filled it. Each draw of n values advances
// the offset by ceil(n / 4) blocks.
class Generator {
 public:
  explicit Generator(uint64_t seed = 0) : seed_(seed) {}

  uint64_t seed() const { return seed_; }
  uint64_t offset() const { return offset_; }
  void manual_seed(uint64_t seed) {
    seed_ = seed;
    offset_ = 0;
  }
  void set_offset(uint64_t offset) { offset_ = offset; }

  // Reserves `n` values; returns the block offset at which they start.
  uint64_t reserve(int64_t n) {
    uint64_t start = offset_;
    offset_ += static_cast<uint64_t>((n + 3) / 4);
    return start;
  }

  // The Philox4x32-10 block for (key=seed, counter=block).
  static std::array<uint32_t, 4> philox(uint64_t seed, uint64_t block);
  // Uniform in [0, 1) from 32 random bits (24 bits of mantissa).
  static float to_unit_float(uint32_t x) { return static_cast<float>(x >> 8) * 0x1.0p-24f; }
  static double to_unit_double(uint32_t hi, uint32_t lo) {
    uint64_t v = (static_cast<uint64_t>(hi) << 32 | lo) >> 11;
    return static_cast<double>(v) * 0x1.0p-53;
  }

  // A single value, for host-side use (shuffles, initial choices).
  uint32_t next_u32();
  uint64_t next_u64();
  double next_double();

 private:
  uint64_t seed_ = 0;
  uint64_t offset_ = 0;
};

}  // namespace lockstep
