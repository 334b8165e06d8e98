// The caching CPU allocator: alignment, reuse, and no OS allocations in a steady state.
#include "testing.h"

using namespace lockstep;

TEST(Allocator, SteadyStateAsksTheOsForNothing) {
  auto step = [] {
    Tensor a = ones({256, 1024});
    Tensor b = ones({1024});
    Tensor c = add(a, b);
    Tensor d = mul(c, c);
    (void)sum(d).item();
  };
  step();
  step();
  const AllocatorStats before = cpu_allocator_stats();
  for (int i = 0; i < 20; ++i) step();
  const AllocatorStats after = cpu_allocator_stats();
  EXPECT_GT(after.allocations, before.allocations);
  EXPECT_EQ(after.os_allocations, before.os_allocations);
}

TEST(Allocator, ReusesFreedBlocksOfTheSameClass) {
  void* first;
  {
    Tensor a = empty({12345});
    first = a.storage()->data();
  }
  Tensor b = empty({12340});  // same size class
  EXPECT_EQ(b.storage()->data(), first);
}

TEST(Allocator, EmptyCacheReleasesMemory) {
  { Tensor a = empty({1 << 20}); }
  EXPECT_GT(cpu_allocator_stats().cached_bytes, 0);
  cpu_allocator_empty_cache();
  EXPECT_EQ(cpu_allocator_stats().cached_bytes, 0);
}
