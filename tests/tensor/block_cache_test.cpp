// The caching core of the CUDA device allocator (Note [Block cache] in
// src/tensor/block_cache.cpp) on a device of host memory with a capacity, so that it is checked
// without a GPU: cutting, merging, streams, the bound on what varying sizes reserve, and the
// retry when the device runs out.
#include <cstdlib>
#include <random>
#include <utility>
#include <unordered_map>
#include <vector>

#include "tensor/block_cache.h"
#include "testing.h"

namespace {

using lockstep::detail::BlockCache;

constexpr size_t KiB = 1024, MiB = 1024 * KiB;

// Host memory standing in for a device of `capacity` bytes.
struct FakeDevice {
  size_t capacity, used = 0;
  std::unordered_map<void*, size_t> live;

  explicit FakeDevice(size_t cap) : capacity(cap) {}
  ~FakeDevice() { EXPECT_TRUE(live.empty()) << live.size() << " segments never released"; }

  BlockCache::Device device() {
    return {.reserve =
                [this](size_t n) -> void* {
                  if (used + n > capacity) return nullptr;
                  void* p = std::malloc(n);  // never touched: the pages are not committed
                  used += n;
                  live[p] = n;
                  return p;
                },
            .release =
                [this](void* p) {
                  auto it = live.find(p);
                  ASSERT_NE(it, live.end()) << "released something never reserved";
                  used -= it->second;
                  live.erase(it);
                  std::free(p);
                }};
  }
};

// Two streams: what the cache compares is their addresses.
int stream_a, stream_b;
const void* const A = &stream_a;
const void* const B = &stream_b;

TEST(BlockCache, SmallRequestsAreCutFromOneSegmentSideBySide) {
  FakeDevice dev(64 * MiB);
  BlockCache cache(dev.device());
  char* a = static_cast<char*>(cache.allocate(1000, A));
  char* b = static_cast<char*>(cache.allocate(1000, A));
  char* c = static_cast<char*>(cache.allocate(1, A));
  EXPECT_EQ(cache.stats().reserves, 1);
  EXPECT_EQ(cache.stats().reserved_bytes, static_cast<int64_t>(BlockCache::kSmallSegment));
  EXPECT_EQ(b, a + 1024);
  EXPECT_EQ(c, b + 1024);
  EXPECT_EQ(cache.size_of(a), 1024u);
  EXPECT_EQ(cache.size_of(c), 512u);
  EXPECT_EQ(cache.stats().allocated_bytes, 2560);
  for (void* p : {a, b, c}) EXPECT_TRUE(cache.free(p));
  EXPECT_EQ(cache.stats().allocated_bytes, 0);
}

TEST(BlockCache, FreedNeighboursMergeSoTheSegmentIsOneBlockAgain) {
  FakeDevice dev(64 * MiB);
  BlockCache cache(dev.device());
  std::vector<void*> p;
  for (int i = 0; i < 6; ++i) p.push_back(cache.allocate(100 * KiB, A));
  // Freed out of order: merges with the successor, the predecessor, or both.
  for (int i : {1, 3, 2, 5, 0, 4}) ASSERT_TRUE(cache.free(p[static_cast<size_t>(i)]));
  EXPECT_EQ(cache.free_blocks(), 1u);
  EXPECT_EQ(cache.segments(), 1u);
  cache.release_free_segments();
  EXPECT_EQ(cache.segments(), 0u);
  EXPECT_EQ(cache.stats().releases, 1);
  EXPECT_EQ(cache.stats().reserved_bytes, 0);
  EXPECT_TRUE(dev.live.empty());
}

TEST(BlockCache, AMergedRunServesALargerRequestWithoutReserving) {
  FakeDevice dev(64 * MiB);
  BlockCache cache(dev.device());
  void* a = cache.allocate(256 * KiB, A);
  void* b = cache.allocate(256 * KiB, A);
  void* c = cache.allocate(256 * KiB, A);
  cache.free(a);
  cache.free(b);
  // 512 KiB free where a and b were (the segment's tail is free too, but larger: best fit).
  EXPECT_EQ(cache.allocate(400 * KiB, A), a);
  EXPECT_EQ(cache.stats().reserves, 1);
  (void)c;
}

TEST(BlockCache, BlocksAreReusedOnTheirOwnStreamOnly) {
  FakeDevice dev(64 * MiB);
  BlockCache cache(dev.device());
  void* a = cache.allocate(4 * MiB, A);
  EXPECT_EQ(cache.stream_of(a), A);
  cache.free(a);
  void* b = cache.allocate(4 * MiB, B);
  EXPECT_EQ(cache.stream_of(b), B);
  EXPECT_EQ(cache.stats().reserves, 2) << "stream B took stream A's block";
  cache.free(b);
  EXPECT_EQ(cache.allocate(4 * MiB, A), a);
  // And the other way round (the pools are ordered by stream: one of the two directions looks
  // past the end of the other stream's blocks, the other into them).
  // B's freed 20 MiB segment would fit 18 MiB; A's own rest (16 MiB) would not.
  void* c = cache.allocate(18 * MiB, A);
  EXPECT_EQ(cache.stats().reserves, 3) << "stream A took stream B's block";
  EXPECT_EQ(cache.stream_of(c), A);
}

TEST(BlockCache, ALargeRestOfOneMiBOrLessStaysWithItsBlock) {
  FakeDevice dev(64 * MiB);
  BlockCache cache(dev.device());
  // Requests from 10 MiB up reserve their own size rounded to 2 MiB: 19.5 MiB -> 20 MiB, and
  // the rest of 0.5 MiB is not cut off.
  void* a = cache.allocate(19 * MiB + 512 * KiB, A);
  EXPECT_EQ(cache.size_of(a), 20 * MiB);
  EXPECT_EQ(cache.stats().splits, 0);
  // 8 MiB from a 20 MiB segment: the 12 MiB rest is a block of its own, which serves the next.
  void* b = cache.allocate(8 * MiB, A);
  EXPECT_EQ(cache.size_of(b), 8 * MiB);
  EXPECT_EQ(cache.allocate(12 * MiB, A), static_cast<char*>(b) + 8 * MiB);
  EXPECT_EQ(cache.stats().reserves, 2);
}

TEST(BlockCache, OutOfMemoryReleasesFreeSegmentsAndRetriesOnce) {
  FakeDevice dev(40 * MiB);
  BlockCache cache(dev.device());
  void* a = cache.allocate(15 * MiB, A);  // a segment of its own size, 16 MiB
  cache.free(a);
  // 30 MiB do not fit beside the cached 16: the free segment goes back and the retry succeeds.
  void* b = cache.allocate(30 * MiB, A);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(cache.stats().oom_retries, 1);
  EXPECT_EQ(cache.stats().releases, 1);
  // Nothing free to give back: no memory, said by nullptr (the CUDA allocator throws).
  EXPECT_EQ(cache.allocate(30 * MiB, A), nullptr);
  EXPECT_EQ(cache.stats().oom_retries, 2);
  EXPECT_EQ(cache.stats().allocated_bytes, static_cast<int64_t>(30 * MiB));
  cache.free(b);
}

// Out of memory, the owner's reclaim runs first (the CUDA allocator frees the blocks whose
// other-stream fences passed); a block it frees serves the request without a new segment.
TEST(BlockCache, ReclaimRunsBeforeTheRetryAndWhatItFreesIsUsed) {
  FakeDevice dev(20 * MiB);
  void* held = nullptr;
  BlockCache* self = nullptr;
  int reclaims = 0;
  BlockCache::Device d = dev.device();
  d.reclaim = [&] {
    ++reclaims;
    if (held != nullptr) self->free(std::exchange(held, nullptr));
  };
  BlockCache cache(d);
  self = &cache;
  held = cache.allocate(18 * MiB, A);  // a whole 18 MiB segment, "fenced"
  void* p = cache.allocate(12 * MiB, A);
  EXPECT_EQ(reclaims, 1);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(cache.stats().reserves, 1) << "the reclaimed block was not used";
  EXPECT_EQ(cache.stats().releases, 0);
  EXPECT_EQ(cache.allocate(size_t{1} << 60, A), nullptr) << "beyond kMaxBytes";
  cache.free(p);
}

TEST(BlockCache, UnknownAndDoubleFreesChangeNothing) {
  FakeDevice dev(64 * MiB);
  BlockCache cache(dev.device());
  void* a = cache.allocate(1000, A);
  int stranger = 0;
  EXPECT_FALSE(cache.free(&stranger));
  EXPECT_TRUE(cache.free(a));
  EXPECT_FALSE(cache.free(a));
  EXPECT_EQ(cache.free_blocks(), 1u);
  EXPECT_EQ(cache.stats().allocated_bytes, 0);
}

// Tensors of sizes that vary from step to step (a GPT's activations at varying sequence
// lengths): what is reserved stays within a small multiple of the peak in use, and after the
// first steps nothing more is reserved. A cache that hands out only blocks of nearly the
// request's size would reserve a new segment for most new sizes.
TEST(BlockCache, VaryingSizesDoNotGrowTheCacheWithoutBound) {
  FakeDevice dev(size_t{64} << 30);
  BlockCache cache(dev.device());
  std::mt19937_64 rng(5);
  std::uniform_int_distribution<size_t> size(1, 48 * MiB), small(1, 900 * KiB);
  int64_t reserves_after_warmup = 0;
  // Some tensors live across steps (parameters, optimizer state), pinning their segments.
  std::vector<void*> kept;
  for (int i = 0; i < 6; ++i) kept.push_back(cache.allocate(small(rng) + i * 3 * MiB, A));
  for (int step = 0; step < 400; ++step) {
    if (step % 50 == 25) {  // now and then one of them is replaced by another size
      cache.free(kept[static_cast<size_t>(step / 50) % kept.size()]);
      kept[static_cast<size_t>(step / 50) % kept.size()] = cache.allocate(size(rng) / 4, A);
    }
    std::vector<void*> live;
    for (int i = 0; i < 12; ++i) live.push_back(cache.allocate(i % 3 == 0 ? small(rng) : size(rng), A));
    // Free in an order that leaves holes, as a backward frees activations.
    for (size_t i = 0; i < live.size(); i += 2) cache.free(live[i]);
    for (size_t i = 1; i < live.size(); i += 2) cache.free(live[i]);
    if (step == 49) reserves_after_warmup = cache.stats().reserves;
  }
  const auto& s = cache.stats();
  std::cout << "peak allocated " << s.peak_allocated_bytes / MiB << " MiB, peak reserved "
            << s.peak_reserved_bytes / MiB << " MiB, reserves " << s.reserves << " ("
            << reserves_after_warmup << " in the first 50 steps), splits " << s.splits << "\n";
  EXPECT_LE(s.peak_reserved_bytes, 2 * s.peak_allocated_bytes);
  EXPECT_LE(s.reserves, reserves_after_warmup + 10);
  for (void* p : kept) cache.free(p);
  cache.release_free_segments();
  EXPECT_EQ(cache.stats().reserved_bytes, 0);
}

}  // namespace
