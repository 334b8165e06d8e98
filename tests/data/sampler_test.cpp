// Samplers: the Philox permutation, and DistributedSampler's PyTorch semantics (padding,
// drop_last, striding over ranks, epochs, seeds) plus its evaluation mode without padding.
#include <algorithm>
#include <map>
#include <numeric>
#include <set>

#include "lockstep/data/sampler.h"
#include "testing.h"

using namespace lockstep;
using namespace lockstep::data;
using lockstep::testing::expect_error;

namespace {

using Indices = std::vector<int64_t>;

std::vector<Indices> all_ranks(int64_t size, DistributedSamplerOptions opts, int64_t epoch = 0) {
  std::vector<Indices> out;
  for (int64_t r = 0; r < opts.num_replicas; ++r) {
    opts.rank = r;
    DistributedSampler s(size, opts);
    s.set_epoch(epoch);
    out.push_back(s.indices());
    EXPECT_EQ(static_cast<int64_t>(out.back().size()), s.num_samples()) << "rank " << r;
  }
  return out;
}

// Rank r's i-th index sits at position r + i * R of the padded global order.
Indices interleave(const std::vector<Indices>& ranks) {
  Indices out;
  for (size_t i = 0; i < ranks[0].size(); ++i)
    for (const Indices& r : ranks)
      if (i < r.size()) out.push_back(r[i]);
  return out;
}

bool is_permutation_of_range(Indices v, int64_t n) {
  std::sort(v.begin(), v.end());
  for (int64_t i = 0; i < n; ++i)
    if (static_cast<int64_t>(v.size()) != n || v[i] != i) return false;
  return static_cast<int64_t>(v.size()) == n;
}

TEST(RandomPermutation, IsAPermutationDeterministicAndSeedDependent) {
  Indices a = random_permutation(1000, 7);
  EXPECT_TRUE(is_permutation_of_range(a, 1000));
  EXPECT_EQ(a, random_permutation(1000, 7));
  EXPECT_NE(a, random_permutation(1000, 8));
  Indices identity(1000);
  std::iota(identity.begin(), identity.end(), 0);
  EXPECT_NE(a, identity);
  EXPECT_TRUE(random_permutation(0, 1).empty());
  EXPECT_EQ(random_permutation(1, 1), (Indices{0}));
}

TEST(RandomPermutation, AllOrdersEquallyLikely) {
  // 6 orders of 3 elements over 6000 seeds: each ~1000 (sd ~29); a biased shuffle (for example
  // swapping with any position, not only with earlier ones) lands far outside.
  std::map<Indices, int> counts;
  for (uint64_t seed = 0; seed < 6000; ++seed) ++counts[random_permutation(3, seed)];
  ASSERT_EQ(counts.size(), 6u);
  for (auto& [order, n] : counts) {
    EXPECT_GT(n, 880);
    EXPECT_LT(n, 1120);
  }
  // And the first element of a longer permutation is uniform too.
  std::vector<int> first(10);
  for (uint64_t seed = 0; seed < 5000; ++seed) ++first[random_permutation(10, seed)[0]];
  for (int n : first) EXPECT_NEAR(n, 500, 90);
}

TEST(DistributedSampler, MatchesPyTorchWithoutShuffle) {
  // torch DistributedSampler(range(10), num_replicas=3, rank=r, shuffle=False).
  auto ranks = all_ranks(10, {.num_replicas = 3, .shuffle = false});
  EXPECT_EQ(ranks[0], (Indices{0, 3, 6, 9}));
  EXPECT_EQ(ranks[1], (Indices{1, 4, 7, 0}));
  EXPECT_EQ(ranks[2], (Indices{2, 5, 8, 1}));
  // drop_last=True: 10 // 3 = 3 each, the tail 9 dropped.
  auto dropped = all_ranks(10, {.num_replicas = 3, .shuffle = false, .drop_last = true});
  EXPECT_EQ(dropped[0], (Indices{0, 3, 6}));
  EXPECT_EQ(dropped[1], (Indices{1, 4, 7}));
  EXPECT_EQ(dropped[2], (Indices{2, 5, 8}));
  // Fewer samples than replicas: padding repeats the list cyclically.
  auto tiny = all_ranks(2, {.num_replicas = 5, .shuffle = false});
  EXPECT_EQ(interleave(tiny), (Indices{0, 1, 0, 1, 0}));
  auto none = all_ranks(2, {.num_replicas = 5, .shuffle = false, .drop_last = true});
  for (const Indices& r : none) EXPECT_TRUE(r.empty());
}

TEST(DistributedSampler, PaddingRepeatsTheStartOfThePermutation) {
  for (int64_t size : {1, 7, 10, 11, 12, 100, 101}) {
    for (int64_t replicas : {1, 2, 3, 4, 8}) {
      DistributedSamplerOptions opts{.num_replicas = replicas, .seed = 42};
      auto ranks = all_ranks(size, opts, /*epoch=*/3);
      const int64_t per_rank = (size + replicas - 1) / replicas;
      for (const Indices& r : ranks) EXPECT_EQ(static_cast<int64_t>(r.size()), per_rank);
      Indices global = interleave(ranks);
      ASSERT_EQ(static_cast<int64_t>(global.size()), per_rank * replicas);
      Indices perm(global.begin(), global.begin() + size);
      EXPECT_EQ(perm, random_permutation(size, 42 + 3)) << size << " " << replicas;
      for (int64_t k = size; k < per_rank * replicas; ++k)
        EXPECT_EQ(global[k], perm[(k - size) % size]);
      // Every index appears, and only the padding repeats.
      std::set<int64_t> seen(global.begin(), global.end());
      EXPECT_EQ(static_cast<int64_t>(seen.size()), size);
    }
  }
}

TEST(DistributedSampler, DisjointWhenSizeIsAMultiple) {
  auto ranks = all_ranks(120, {.num_replicas = 4, .seed = 9});
  std::set<int64_t> all;
  for (const Indices& r : ranks) {
    EXPECT_EQ(r.size(), 30u);
    for (int64_t i : r) EXPECT_TRUE(all.insert(i).second) << "index " << i << " on two ranks";
  }
  EXPECT_EQ(all.size(), 120u);
}

TEST(DistributedSampler, DropLastTruncatesToAMultiple) {
  for (int64_t size : {10, 11, 12, 13}) {
    auto ranks = all_ranks(size, {.num_replicas = 4, .seed = 1, .drop_last = true});
    Indices global = interleave(ranks);
    EXPECT_EQ(static_cast<int64_t>(global.size()), size / 4 * 4);
    for (const Indices& r : ranks) EXPECT_EQ(static_cast<int64_t>(r.size()), size / 4);
    Indices perm = random_permutation(size, 1);
    EXPECT_EQ(global, Indices(perm.begin(), perm.begin() + size / 4 * 4));
  }
}

TEST(DistributedSampler, EpochAndSeedDecideTheOrder) {
  DistributedSampler a(50, 2, 1, true, 5);
  DistributedSampler b(50, 2, 1, true, 5);
  EXPECT_EQ(a.epoch(), 0);
  Indices e0 = a.indices();
  EXPECT_EQ(e0, b.indices());
  EXPECT_EQ(e0, a.indices());  // indices() does not advance anything
  a.set_epoch(1);
  Indices e1 = a.indices();
  EXPECT_NE(e0, e1);
  b.set_epoch(1);
  EXPECT_EQ(e1, b.indices());
  a.set_epoch(0);
  EXPECT_EQ(e0, a.indices());
  DistributedSampler c(50, 2, 1, true, 6);
  EXPECT_NE(e0, c.indices());
  // seed + epoch: seed 5 at epoch 1 is seed 6 at epoch 0, as in torch.
  EXPECT_EQ(e1, c.indices());
  // Without shuffle the epoch changes nothing.
  DistributedSampler d(50, 2, 1, false);
  Indices d0 = d.indices();
  d.set_epoch(4);
  EXPECT_EQ(d0, d.indices());
}

TEST(DistributedSampler, EvalModeCoversExactlyOnce) {
  for (int64_t size : {0, 1, 2, 9, 10, 11, 12, 97}) {
    for (bool shuffle : {false, true}) {
      auto ranks = all_ranks(size, {.num_replicas = 4, .shuffle = shuffle, .pad = false});
      Indices all;
      for (size_t r = 0; r < ranks.size(); ++r) {
        const int64_t expected = size / 4 + (static_cast<int64_t>(r) < size % 4 ? 1 : 0);
        EXPECT_EQ(static_cast<int64_t>(ranks[r].size()), expected) << size << " rank " << r;
        all.insert(all.end(), ranks[r].begin(), ranks[r].end());
      }
      EXPECT_TRUE(is_permutation_of_range(all, size)) << size;
    }
  }
  DistributedSampler s(10, {.num_replicas = 3, .rank = 2, .shuffle = false, .pad = false});
  EXPECT_EQ(s.indices(), (Indices{2, 5, 8}));
  EXPECT_EQ(s.total_size(), 10);
}

TEST(DistributedSampler, ValidatesArguments) {
  expect_error([] { DistributedSampler(10, 2, 2); },
               {"rank must be in [0, num_replicas)", "rank=2", "num_replicas=2"});
  expect_error([] { DistributedSampler(10, 2, -1); }, {"rank=-1", "num_replicas=2"});
  expect_error([] { DistributedSampler(10, 0, 0); },
               {"num_replicas must be positive", "num_replicas=0", "rank=0"});
  expect_error([] { DistributedSampler(-1, 1, 0); }, {"dataset size must be >= 0", "-1"});
  expect_error([] { DistributedSampler(10, {.drop_last = true, .pad = false}); },
               {"drop_last needs pad=true"});
}

TEST(SequentialSampler, InOrder) {
  SequentialSampler s(4);
  EXPECT_EQ(s.indices(), (Indices{0, 1, 2, 3}));
  EXPECT_EQ(s.num_samples(), 4);
  s.set_epoch(3);
  EXPECT_EQ(s.indices(), (Indices{0, 1, 2, 3}));
}

}  // namespace

// Resuming an epoch with the same rank count continues exactly where each rank stopped: every
// rank's indices after set_start_index(k * R) are its uninterrupted indices from position k on.
TEST(DistributedSampler, StartIndexWithTheSameRanksIsTheTailOfTheEpoch) {
  for (int64_t size : {0, 1, 7, 10, 101}) {
    for (int64_t r : {1, 2, 3}) {
      for (bool drop_last : {false, true}) {
        for (bool pad : {true, false}) {
          if (!pad && drop_last) continue;
          DistributedSamplerOptions o{
              .num_replicas = r, .seed = 5, .drop_last = drop_last, .pad = pad};
          for (int64_t k = 0; k * r <= size + r; ++k) {
            for (int64_t rank = 0; rank < r; ++rank) {
              o.rank = rank;
              DistributedSampler full(size, o), resumed(size, o);
              full.set_epoch(2);
              resumed.set_epoch(2);
              resumed.set_start_index(k * r);
              const Indices all = full.indices();
              const Indices tail(all.begin() + std::min<size_t>(k, all.size()), all.end());
              if (!pad && k * r > size) continue;  // beyond the data: nothing left
              EXPECT_EQ(resumed.indices(), tail)
                  << "size " << size << " ranks " << r << " rank " << rank << " k " << k
                  << " drop_last " << drop_last << " pad " << pad;
              EXPECT_EQ(resumed.num_samples(), static_cast<int64_t>(tail.size()));
            }
          }
        }
      }
    }
  }
}

// A checkpoint taken with N ranks and resumed with M: the samples read before (a prefix of the
// epoch's order) and after cover the epoch, none skipped and none read twice but for padding.
TEST(DistributedSampler, StartIndexWithOtherRanksSkipsNothingAndRepeatsNothing) {
  const int64_t size = 103;
  for (int64_t n : {1, 2, 4}) {
    for (int64_t m : {1, 2, 3}) {
      for (int64_t steps : {0, 1, 5, 12}) {
        const int64_t batch = 2;
        // N ranks each read `steps` batches of `batch`: positions [0, consumed) of the order.
        const int64_t consumed = steps * batch * n;
        std::multiset<int64_t> seen;
        for (int64_t rank = 0; rank < n; ++rank) {
          DistributedSampler s(size, n, rank, true, 9);
          s.set_epoch(1);
          const Indices mine = s.indices();
          seen.insert(mine.begin(), mine.begin() + steps * batch);
        }
        int64_t padded = 0;
        std::multiset<int64_t> after;
        for (int64_t rank = 0; rank < m; ++rank) {
          DistributedSampler s(size, m, rank, true, 9);
          s.set_epoch(1);
          s.set_start_index(consumed);
          const Indices mine = s.indices();
          after.insert(mine.begin(), mine.end());
          padded += s.num_samples();
          EXPECT_EQ(s.num_samples(), (size - consumed + m - 1) / m);
        }
        padded -= size - consumed;
        ASSERT_GE(padded, 0);
        ASSERT_LT(padded, m);
        std::multiset<int64_t> both = seen;
        both.insert(after.begin(), after.end());
        // Every sample at least once; exactly `padded` extra reads in all.
        for (int64_t i = 0; i < size; ++i) EXPECT_GE(both.count(i), 1u) << "sample " << i;
        EXPECT_EQ(static_cast<int64_t>(both.size()), size + padded)
            << "n " << n << " m " << m << " steps " << steps;
      }
    }
  }
}

TEST(DistributedSampler, SetEpochClearsTheStartIndex) {
  DistributedSampler s(50, 2, 1, true, 3);
  s.set_epoch(0);
  const Indices whole = s.indices();
  s.set_start_index(20);
  EXPECT_EQ(s.num_samples(), 15);
  s.set_epoch(0);
  EXPECT_EQ(s.start_index(), 0);
  EXPECT_EQ(s.indices(), whole);
  expect_error([&] { s.set_start_index(-1); }, {"consumed must be >= 0"});
}
