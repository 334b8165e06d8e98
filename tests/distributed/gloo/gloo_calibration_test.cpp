// LOCKSTEP_NET_CALIBRATE (Note [Link calibration] in src/distributed/gloo/process_group_gloo.cpp):
// a gloo group of more than two ranks fits its link to all_reduces it times when it is made, and
// every rank takes rank 0's fit; without the setting the link is the settings'.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "distributed/cost_model_settings.h"
#include "distributed/thread_ranks.h"
#include "lockstep/base/log.h"
#include "lockstep/base/worker_env.h"
#include "lockstep/lockstep.h"
#include "testing.h"

using namespace lockstep;
using namespace lockstep::dist;

namespace {

// Every setting the link depends on is cleared before and after each test, and info lines are
// logged whatever LOCKSTEP_LOG_LEVEL says.
class GlooCalibration : public ::testing::Test {
 protected:
  void SetUp() override {
    lockstep::testing::clear_cost_model_settings();
    level_ = log_level();
    set_log_level(LogLevel::kInfo);
  }
  void TearDown() override {
    lockstep::testing::clear_cost_model_settings();
    set_log_level(level_);
    set_log_sink({});
  }

 private:
  LogLevel level_ = LogLevel::kInfo;
};

// Each rank's group link, once the group is made; each group must still reduce correctly.
std::vector<LinkModel> links_of(int world) {
  std::vector<LinkModel> links(static_cast<size_t>(world));
  const auto errors = lockstep::testing::run_ranks(world, [&](int r, ProcessGroupPtr pg) {
    const auto* gloo = dynamic_cast<const ProcessGroupGloo*>(pg.get());
    ASSERT_NE(gloo, nullptr);
    links[r] = gloo->link();
    Tensor t = full({1000}, static_cast<double>(r + 1));
    pg->all_reduce(t)->wait();
    EXPECT_EQ(t.to_vector<float>()[999], world * (world + 1) / 2.0f) << "rank " << r;
  });
  for (int r = 0; r < world; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  return links;
}

TEST_F(GlooCalibration, FitsTheLinkWhenTheGroupIsMadeAndEveryRankTakesRankZeros) {
  std::mutex mu;
  std::vector<std::string> said;
  set_log_sink([&](LogLevel, std::string_view text) {
    if (text.find("LOCKSTEP_NET_CALIBRATE=1") == std::string_view::npos) return;
    std::lock_guard<std::mutex> lock(mu);
    said.emplace_back(text);
  });
  ::setenv(env::kNetCalibrate, "1", 1);
  for (int world : {3, 4}) {
    said.clear();
    const auto links = links_of(world);
    const LinkModel defaults;
    for (int r = 0; r < world; ++r) {
      EXPECT_TRUE(std::isfinite(links[r].alpha) && links[r].alpha > 0)
          << world << " ranks, rank " << r << ": alpha " << links[r].alpha;
      EXPECT_TRUE(std::isfinite(links[r].beta) && links[r].beta > 0)
          << world << " ranks, rank " << r << ": beta " << links[r].beta;
      // Rank 0's fit, to the bit: the ranks must never choose apart.
      EXPECT_EQ(links[r].alpha, links[0].alpha) << world << " ranks, rank " << r;
      EXPECT_EQ(links[r].beta, links[0].beta) << world << " ranks, rank " << r;
    }
    EXPECT_NE(links[0].alpha, defaults.alpha) << world << " ranks";
    EXPECT_NE(links[0].beta, defaults.beta) << world << " ranks";
    // One line, rank 0's, saying what it measured and what the model now uses.
    ASSERT_EQ(said.size(), 1u) << world << " ranks";
    std::printf("%s", said[0].c_str());  // what this machine measured, for whoever reads the log
    EXPECT_NE(said[0].find("all_reduce of 4096 bytes took"), std::string::npos) << said[0];
    EXPECT_NE(said[0].find("the cost model uses alpha"), std::string::npos) << said[0];
  }
}

TEST_F(GlooCalibration, IsOffByDefaultSoTheSettingsDescribeTheLink) {
  for (const LinkModel& m : links_of(3)) {
    EXPECT_EQ(m.alpha, LinkModel{}.alpha);
    EXPECT_EQ(m.beta, LinkModel{}.beta);
  }
  ::setenv(env::kNetAlphaUs, "2000", 1);
  ::setenv(env::kNetGbps, "1", 1);
  ::setenv(env::kNetCalibrate, "0", 1);
  for (const LinkModel& m : links_of(3)) {
    EXPECT_DOUBLE_EQ(m.alpha, 2e-3);
    EXPECT_DOUBLE_EQ(m.beta, 8e-9);
  }
}

// Two ranks always send whole tensors, so no link would change their choice: nothing is timed.
TEST_F(GlooCalibration, TwoRanksKeepTheSettings) {
  ::setenv(env::kNetCalibrate, "1", 1);
  for (const LinkModel& m : links_of(2)) {
    EXPECT_EQ(m.alpha, LinkModel{}.alpha);
    EXPECT_EQ(m.beta, LinkModel{}.beta);
  }
}

}  // namespace
