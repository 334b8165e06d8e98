// The host side of src/ops/cuda/philox.cuh, which the CUDA random kernels (rand, randn, randint,
// dropout) compute with on the device: its Philox blocks are Generator::philox's bit for bit, and
// its per-element values, under Note [Random tensors]'s block and lane mapping, are the CPU
// kernels' (so a device kernel that maps elements the same way draws the CPU's numbers).
#include <cstdint>
#include <vector>

#include "ops/cuda/philox.cuh"
#include "ops/kernels.h"
#include "testing.h"

using namespace lockstep;
using detail::kCpuKernels;

namespace {

const uint64_t kSeeds[] = {0, 1, 42, 0xDEADBEEFCAFEF00DULL, ~0ULL};
const uint64_t kBlocks[] = {0, 1, 2, 1000, 0xFFFFFFFFULL, 0x100000000ULL, (1ULL << 63) + 5, ~0ULL};

philox::Block block_at(uint64_t seed, uint64_t start, int64_t i, int per_block) {
  return philox::philox(seed, start + static_cast<uint64_t>(i / per_block));
}

}  // namespace

TEST(Philox, BlocksMatchGenerator) {
  for (uint64_t seed : kSeeds) {
    for (uint64_t block : kBlocks) {
      const std::array<uint32_t, 4> want = Generator::philox(seed, block);
      const philox::Block got = philox::philox(seed, block);
      for (int k = 0; k < 4; ++k)
        ASSERT_EQ(got.x[k], want[k]) << "seed " << seed << " block " << block << " lane " << k;
    }
  }
}

TEST(Philox, UnitConversionsMatchGenerator) {
  const uint32_t xs[] = {0u, 1u, 255u, 256u, 0x80000000u, 0xFFFFFF00u, 0xFFFFFFFFu, 12345678u};
  for (uint32_t hi : xs) {
    EXPECT_EQ(philox::to_unit_float(hi), Generator::to_unit_float(hi)) << hi;
    for (uint32_t lo : xs)
      EXPECT_EQ(philox::to_unit_double(hi, lo), Generator::to_unit_double(hi, lo)) << hi << lo;
  }
  EXPECT_LT(philox::to_unit_float(0xFFFFFFFFu), 1.0f);
  EXPECT_LT(philox::to_unit_double(0xFFFFFFFFu, 0xFFFFFFFFu), 1.0);
}

// Each CPU fill kernel against the header's value of every element (37: a partial last block).
TEST(Philox, ElementValuesMatchCpuKernels) {
  const int64_t n = 37;
  const uint64_t start = 7;
  for (uint64_t seed : kSeeds) {
    // rand: 32-bit draws for f32 (4 elements a block), 53-bit ones for f64 (2 a block).
    for (DType dt : {kFloat32, kFloat64}) {
      const bool wide = dt == kFloat64;
      const double low = -2.5, high = 3.0;
      Tensor t = empty({n}, TensorOptions(dt));
      kCpuKernels.rand_uniform(t, seed, start, low, high);
      const std::vector<double> got = t.to_vector<double>();
      for (int64_t i = 0; i < n; ++i) {
        const int per = wide ? 2 : 4;
        double want = philox::uniform_value(block_at(seed, start, i, per),
                                            static_cast<int>(i % per), wide, low, high, high - low);
        if (!wide) want = static_cast<float>(want);
        ASSERT_EQ(got[i], want) << dtype_name(dt) << " seed " << seed << " element " << i;
      }
    }
    // randn: lane pairs of 4-element blocks.
    for (DType dt : {kFloat32, kFloat64}) {
      Tensor t = empty({n}, TensorOptions(dt));
      kCpuKernels.rand_normal(t, seed, start, 0.5, 2.0);
      const std::vector<double> got = t.to_vector<double>();
      for (int64_t i = 0; i < n; ++i) {
        double want = philox::normal_value(block_at(seed, start, i, 4), static_cast<int>(i % 4),
                                           0.5, 2.0);
        if (dt == kFloat32) want = static_cast<float>(want);
        ASSERT_EQ(got[i], want) << dtype_name(dt) << " seed " << seed << " element " << i;
      }
    }
    // randint: 64 bits from two lanes, 2 elements a block.
    for (auto [low, high] : {std::pair<int64_t, int64_t>{-5, 11}, {0, 1000003}, {3, 4}}) {
      Tensor t = empty({n}, TensorOptions(kInt64));
      kCpuKernels.randint(t, seed, start, low, high);
      const std::vector<int64_t> got = t.to_vector<int64_t>();
      for (int64_t i = 0; i < n; ++i) {
        const int64_t want =
            philox::randint_value(block_at(seed, start, i, 2), static_cast<int>(i % 2), low,
                                  static_cast<uint64_t>(high - low));
        ASSERT_EQ(got[i], want) << "seed " << seed << " element " << i;
      }
    }
    // dropout's keep-mask: lane i % 4 of block start + i / 4.
    for (double p : {0.0, 0.1, 0.5, 0.999, 1.0}) {
      Tensor mask = empty({n}, TensorOptions(kUInt8));
      kCpuKernels.dropout_mask(mask, seed, start, p);
      const std::vector<int64_t> got = mask.to_vector<int64_t>();
      for (int64_t i = 0; i < n; ++i) {
        const bool want =
            philox::keep_value(block_at(seed, start, i, 4), static_cast<int>(i % 4), p);
        ASSERT_EQ(got[i], want ? 1 : 0) << "p " << p << " seed " << seed << " element " << i;
      }
    }
  }
}
