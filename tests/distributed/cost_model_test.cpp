// The alpha-beta cost model (Note [Cost model] in src/distributed/cost_model.cpp): what it
// predicts, what it chooses, the bucket size it proposes, its fit, and its settings.
#include "lockstep/distributed/cost_model.h"

#include <cmath>
#include <cstdlib>
#include <string>

#include "distributed/cost_model_settings.h"
#include "lockstep/base/worker_env.h"
#include "testing.h"

using namespace lockstep;
using namespace lockstep::dist;

namespace {

constexpr int64_t kKiB = 1024, kMiB = 1024 * 1024;
// 1 Gbit/s links, 50 us rounds.
const LinkModel kGigabit{50e-6, 8e-9};

TEST(CostModel, PredictsRoundsAndBytesOfEachAlgorithm) {
  const int64_t n = 8 * kMiB;
  // Four ranks: whole sends 3 x N, the others 1.5 x N; rounds 2, 3, 6 and 4.
  EXPECT_DOUBLE_EQ(predict_all_reduce(AllReduceAlgorithm::kWhole, n, 4, kGigabit),
                   2 * 50e-6 + 3.0 * n * 8e-9);
  EXPECT_DOUBLE_EQ(predict_all_reduce(AllReduceAlgorithm::kDirect, n, 4, kGigabit),
                   3 * 50e-6 + 1.5 * n * 8e-9);
  EXPECT_DOUBLE_EQ(predict_all_reduce(AllReduceAlgorithm::kRing, n, 4, kGigabit),
                   6 * 50e-6 + 1.5 * n * 8e-9);
  EXPECT_DOUBLE_EQ(predict_all_reduce(AllReduceAlgorithm::kHalvingDoubling, n, 4, kGigabit),
                   4 * 50e-6 + 1.5 * n * 8e-9);
  // Six ranks are not a power of two: halving-doubling folds 2 of them into partners first and
  // unfolds them last, N bytes each way (2 N and 2 rounds more than four ranks).
  EXPECT_DOUBLE_EQ(predict_all_reduce(AllReduceAlgorithm::kHalvingDoubling, n, 6, kGigabit),
                   (4 + 2) * 50e-6 + (1.5 + 2) * n * 8e-9);
  // Two ranks: direct is whole (the same bytes, the same rounds).
  EXPECT_DOUBLE_EQ(predict_all_reduce(AllReduceAlgorithm::kDirect, n, 2, kGigabit),
                   predict_all_reduce(AllReduceAlgorithm::kWhole, n, 2, kGigabit));
  // Nothing to do: one rank, no bytes.
  EXPECT_EQ(predict_all_reduce(AllReduceAlgorithm::kRing, n, 1, kGigabit), 0);
  EXPECT_EQ(predict_all_reduce(AllReduceAlgorithm::kDirect, 0, 4, kGigabit), 0);
}

TEST(CostModel, ChoosesWholeForSmallTensorsAndDirectForLargeOnes) {
  // Four ranks: whole and direct cross where alpha = 1.5 N beta, N = 4167 bytes at 1 Gbit/s.
  EXPECT_EQ(choose_all_reduce(4 * kKiB, 4, kGigabit), AllReduceAlgorithm::kWhole);
  EXPECT_EQ(choose_all_reduce(5 * kKiB, 4, kGigabit), AllReduceAlgorithm::kDirect);
  EXPECT_EQ(choose_all_reduce(64 * kMiB, 4, kGigabit), AllReduceAlgorithm::kDirect);
  // A slower round moves the crossover up in proportion.
  const LinkModel slow{2e-3, 8e-9};
  EXPECT_EQ(choose_all_reduce(128 * kKiB, 4, slow), AllReduceAlgorithm::kWhole);
  EXPECT_EQ(choose_all_reduce(256 * kKiB, 4, slow), AllReduceAlgorithm::kDirect);
  // Without rank order the ring and halving-doubling are candidates, but direct has fewer rounds
  // than either for the same bytes.
  EXPECT_EQ(choose_all_reduce(64 * kMiB, 8, kGigabit, false), AllReduceAlgorithm::kDirect);
  // Two ranks: whole, at every size.
  EXPECT_EQ(choose_all_reduce(64 * kMiB, 2, kGigabit), AllReduceAlgorithm::kWhole);
}

TEST(CostModel, TheGlooChoiceIsWholeForTwoRanksElseTheSettingElseTheModel) {
  // Two ranks: whole whatever the setting or the size.
  for (AlgorithmSetting s : {AlgorithmSetting::kAuto, AlgorithmSetting::kDirect}) {
    EXPECT_EQ(gloo_all_reduce_algorithm(64 * kMiB, 2, kGigabit, s), AllReduceAlgorithm::kWhole);
  }
  // A forced algorithm wins over the model at sizes where the model picks the other one.
  EXPECT_EQ(gloo_all_reduce_algorithm(64 * kMiB, 4, kGigabit, AlgorithmSetting::kWhole),
            AllReduceAlgorithm::kWhole);
  EXPECT_EQ(gloo_all_reduce_algorithm(4 * kKiB, 4, kGigabit, AlgorithmSetting::kDirect),
            AllReduceAlgorithm::kDirect);
  // Auto: the model's choice, on both sides of the crossover.
  EXPECT_EQ(gloo_all_reduce_algorithm(4 * kKiB, 4, kGigabit, AlgorithmSetting::kAuto),
            AllReduceAlgorithm::kWhole);
  EXPECT_EQ(gloo_all_reduce_algorithm(64 * kMiB, 4, kGigabit, AlgorithmSetting::kAuto),
            AllReduceAlgorithm::kDirect);
}

TEST(CostModel, TheDefaultLinkKeepsSmallGradientsWhole) {
  // The default link (10 Gbit/s, 50 us): a 4 KiB all_reduce over 4 ranks goes whole, 1 MiB direct.
  const LinkModel d;
  EXPECT_EQ(choose_all_reduce(4 * kKiB, 4, d), AllReduceAlgorithm::kWhole);
  EXPECT_EQ(choose_all_reduce(kMiB, 4, d), AllReduceAlgorithm::kDirect);
}

TEST(CostModel, HierIsSharedMemoryPlusTheNetworkOnAShareOfTheBytes) {
  const LinkModel shm{2e-6, 0.2e-9};
  const int64_t n = 16 * kMiB;
  // One rank per machine: only the network, as the flat model says.
  EXPECT_DOUBLE_EQ(predict_hier_all_reduce(n, 4, 1, shm, kGigabit),
                   predict_all_reduce(AllReduceAlgorithm::kDirect, n, 4, kGigabit));
  // One machine: only shared memory.
  EXPECT_DOUBLE_EQ(predict_hier_all_reduce(n, 1, 4, shm, kGigabit), 2 * 2e-6 + 1.5 * n * 0.2e-9);
  // Two ranks per machine share its link: the network part carries N / 2 per rank at half the
  // bandwidth each, the same machine bytes as one rank per machine.
  EXPECT_DOUBLE_EQ(predict_hier_all_reduce(n, 4, 2, shm, kGigabit),
                   2 * 2e-6 + 1.0 * n * 0.2e-9 + 3 * 50e-6 + 1.5 * (n / 2) * 16e-9);
}

TEST(CostModel, BucketSizeKeepsLatencyUnderItsShare) {
  // 1 Gbit/s, 4 ranks: 3 alpha is 5% of the time from 3 x 50e-6 x 0.95 / (0.05 x 1.5 x 8e-9)
  // = 237.5 kB: one MiB.
  EXPECT_EQ(bucket_bytes_for(kGigabit, 4), kMiB);
  // 2 ms rounds (a loaded machine): 9.5 MB, so 10 MiB; its latency share is then under 5% and
  // one MiB less is over.
  const LinkModel slow{2e-3, 8e-9};
  const int64_t b = bucket_bytes_for(slow, 4);
  EXPECT_EQ(b, 10 * kMiB);
  auto share = [&](int64_t bytes) {
    return 3 * slow.alpha / predict_all_reduce(AllReduceAlgorithm::kDirect, bytes, 4, slow);
  };
  EXPECT_LE(share(b), 0.05);
  EXPECT_GT(share(b - kMiB), 0.05);
  lockstep::testing::expect_error([] { bucket_bytes_for(LinkModel{}, 4, 1.5); },
                                  {"overhead must be in (0, 1)"});
}

TEST(CostModel, FitRecoversAlphaAndBetaFromMeasurements) {
  // Each size run by the algorithm the model chooses, as the gloo backend does.
  std::vector<LinkSample> samples;
  for (int64_t b = 4 * kKiB; b <= 64 * kMiB; b *= 4) {
    const AllReduceAlgorithm a = choose_all_reduce(b, 4, kGigabit);
    samples.push_back({b, predict_all_reduce(a, b, 4, kGigabit), a});
  }
  EXPECT_EQ(samples.front().algorithm, AllReduceAlgorithm::kWhole);
  EXPECT_EQ(samples.back().algorithm, AllReduceAlgorithm::kDirect);
  const LinkModel m = fit_link(4, samples);
  EXPECT_NEAR(m.alpha, kGigabit.alpha, 1e-9);
  EXPECT_NEAR(m.beta, kGigabit.beta, 1e-15);
  lockstep::testing::expect_error(
      [] {
        fit_link(4, {{kMiB, 0.01}, {kMiB, 0.02}});
      },
      {"at least two sizes"});
  lockstep::testing::expect_error(
      [] {
        fit_link(4, {{kMiB, 0.01}, {0, 0.02}});
      },
      {"expected both above 0"});
}

// Settings: read by the gloo backend when a group is made (rank 0's are used by every rank).
// Cleared before each test as well as after, so that the caller's environment cannot change
// what a test sees.
class CostModelEnv : public ::testing::Test {
 protected:
  void SetUp() override { lockstep::testing::clear_cost_model_settings(); }
  void TearDown() override { lockstep::testing::clear_cost_model_settings(); }

};

TEST_F(CostModelEnv, SettingsSetTheLinkAndForceAnAlgorithm) {
  EXPECT_EQ(algorithm_setting_from_env(), AlgorithmSetting::kAuto);
  ::setenv("LOCKSTEP_NET_ALPHA_US", "2000", 1);
  ::setenv("LOCKSTEP_NET_GBPS", "1", 1);
  const LinkModel m = link_from_env();
  EXPECT_DOUBLE_EQ(m.alpha, 2e-3);
  EXPECT_DOUBLE_EQ(m.beta, 8e-9);
  ::setenv("LOCKSTEP_ALLREDUCE_ALGO", "direct", 1);
  EXPECT_EQ(algorithm_setting_from_env(), AlgorithmSetting::kDirect);
  ::setenv("LOCKSTEP_ALLREDUCE_ALGO", "whole", 1);
  EXPECT_EQ(algorithm_setting_from_env(), AlgorithmSetting::kWhole);
}

TEST_F(CostModelEnv, BadSettingsAreErrorsSayingWhatWasExpected) {
  ::setenv("LOCKSTEP_NET_GBPS", "fast", 1);
  lockstep::testing::expect_error([] { link_from_env(); },
                                  {"LOCKSTEP_NET_GBPS='fast' is not a number of Gbit/s"});
  ::setenv("LOCKSTEP_NET_GBPS", "0", 1);
  lockstep::testing::expect_error([] { link_from_env(); }, {"LOCKSTEP_NET_GBPS=0 is out of range"});
  ::unsetenv("LOCKSTEP_NET_GBPS");
  ::setenv("LOCKSTEP_NET_ALPHA_US", "-5", 1);
  lockstep::testing::expect_error([] { link_from_env(); },
                                  {"LOCKSTEP_NET_ALPHA_US=-5 is out of range", "microseconds"});
  ::setenv("LOCKSTEP_ALLREDUCE_ALGO", "ring", 1);
  lockstep::testing::expect_error(
      [] { algorithm_setting_from_env(); },
      {"LOCKSTEP_ALLREDUCE_ALGO='ring' is not one of auto, whole, direct"});
}

}  // namespace
