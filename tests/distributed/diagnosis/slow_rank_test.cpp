// The slow rank (Note [Slow rank]): the watch's verdicts on given times, and DDP with ranks as
// threads of which one sleeps in its forward: named on every rank, warned about by rank 0 alone,
// through every hook's dtype; a joined rank is left out; no warning when no rank lags.
#include <mutex>
#include <thread>

#include "distributed/ddp_helpers.h"
#include "distributed/diagnosis/slow_rank.h"
#include "distributed/thread_ranks.h"
#include "lockstep/base/log.h"
#include "lockstep/distributed/join.h"
#include "lockstep/distributed/powersgd.h"
#include "testing.h"

using namespace lockstep;
using namespace lockstep::dist;
using namespace std::chrono_literals;
using namespace lockstep::testing::ddp;
using lockstep::testing::run_ranks;

namespace {

// ---- the watch, on given times ----

TEST(SlowRankWatch, NamesTheSlowestAndTheLowerMedianLeavingOutRanksWithoutATime) {
  SlowRankWatch watch(1.5, 20);
  DDPStats s;
  // Rank 0 joined (0: no time). Counted, it would be the fastest and the median 10, not 12.
  EXPECT_FALSE(watch.observe({0, 10, 12, 40}, s));
  EXPECT_EQ(s.slowest_rank, 3);
  EXPECT_EQ(s.slowest_rank_ms, 40);
  EXPECT_EQ(s.median_rank_ms, 12);
  EXPECT_EQ(s.rank_compute_ms, (std::vector<double>{0, 10, 12, 40}));
  EXPECT_EQ(s.slow_rank_streak, 1);
  // Two ranks: the lower median is the faster one.
  watch.observe({30, 10}, s);
  EXPECT_EQ(s.slowest_rank, 0);
  EXPECT_EQ(s.median_rank_ms, 10);
  // No rank with a time: nothing named.
  watch.observe({0, 0}, s);
  EXPECT_EQ(s.slowest_rank, -1);
  EXPECT_EQ(s.slow_rank_streak, 0);
}

TEST(SlowRankWatch, WarnsAfterStepsInARowThenAtTwiceAndFourTimesThatMany) {
  SlowRankWatch watch(1.5, 3);
  DDPStats s;
  std::vector<int64_t> warned_at;
  std::string first;
  for (int64_t step = 1; step <= 13; ++step) {
    // Rank 2 at 40 and 42 ms (41 on average) against 10 and 14 ms (12 on average).
    const double slow = step % 2 == 1 ? 40 : 42, other = step % 2 == 1 ? 10 : 14;
    if (auto w = watch.observe({other, 5, slow}, s)) {
      warned_at.push_back(step);
      if (first.empty()) first = *w;
    }
    EXPECT_EQ(s.slow_rank_streak, step);
  }
  EXPECT_EQ(warned_at, (std::vector<int64_t>{3, 6, 12}));
  // Steps 1-3: rank 2 at 40, 42, 40 (40.7) against medians 10, 14, 10 (11.3): 3.6x.
  EXPECT_THAT(first, ::testing::StartsWith("rank 2 is the slowest for 3 steps: 40.7 ms of "
                                           "compute per step against a median of 11.3 ms (3.6x"));
  EXPECT_THAT(first, ::testing::HasSubstr("on rank 2"));
}

TEST(SlowRankWatch, AStreakEndsWhenTheRankIsWithinTheRatioOrAnotherIsSlowest) {
  SlowRankWatch watch(1.5, 3);
  DDPStats s;
  int warnings = 0;
  const std::vector<std::vector<double>> steps = {
      {10, 40}, {10, 40}, {10, 15},  // exactly 1.5x the median is not slow: the streak ends
      {10, 40}, {10, 40}, {40, 10},  // another rank is the slowest: a new streak
      {40, 10}, {10, 40}, {10, 40},
  };
  for (const auto& ms : steps) warnings += watch.observe(ms, s).has_value() ? 1 : 0;
  EXPECT_EQ(warnings, 0);
  EXPECT_EQ(s.slow_rank_streak, 2);
  EXPECT_TRUE(watch.observe({10, 40}, s).has_value());
}

TEST(SlowRankWatch, ZeroStepsNeverWarnsButStillNames) {
  SlowRankWatch watch(1.5, 0);
  DDPStats s;
  for (int i = 0; i < 100; ++i) EXPECT_FALSE(watch.observe({1, 100}, s));
  EXPECT_EQ(s.slowest_rank, 1);
  EXPECT_EQ(s.slow_rank_streak, 100);
}

TEST(SlowRankWatch, CarriedTimesAreNeverZeroAndFitAnF16) {
  EXPECT_EQ(carried_ms(0), kMinCarriedMs);
  EXPECT_EQ(carried_ms(12.5), 12.5);
  EXPECT_EQ(carried_ms(1e9), kMaxCarriedMs);
  EXPECT_LT(kMaxCarriedMs, 65504.0);  // the largest f16
}

TEST(SlowRankWatch, BadOptionsAreErrorsNamingTheField) {
  EXPECT_THAT(
      [] { SlowRankWatch(1.0, 20); },
      ::testing::ThrowsMessage<Error>(::testing::HasSubstr("slow_rank_ratio must be above 1")));
  EXPECT_THAT(
      [] { SlowRankWatch(1.5, -1); },
      ::testing::ThrowsMessage<Error>(::testing::HasSubstr("slow_rank_steps must be >= 0")));
}

// ---- DDP, ranks as threads ----

// The MLP behind a forward that first sleeps `delay` (the injected slowness).
class Sleepy : public nn::Module {
 public:
  Sleepy(std::chrono::milliseconds delay, uint64_t seed) : nn::Module("Sleepy"), delay_(delay) {
    net_ = register_module("net", mlp(seed));
  }
  Tensor forward(const Tensor& x) override {
    std::this_thread::sleep_for(delay_);
    return net_->forward(x);
  }

 private:
  std::chrono::milliseconds delay_;
  std::shared_ptr<nn::Module> net_;
};

// Warning lines logged while it lives.
class CaptureWarnings {
 public:
  CaptureWarnings() {
    set_log_sink([this](LogLevel level, std::string_view text) {
      if (level != LogLevel::kWarning) return;
      std::lock_guard<std::mutex> lock(mu_);
      lines_.emplace_back(text);
    });
  }
  ~CaptureWarnings() { set_log_sink(nullptr); }
  std::vector<std::string> lines() {
    std::lock_guard<std::mutex> lock(mu_);
    return lines_;
  }

 private:
  std::mutex mu_;
  std::vector<std::string> lines_;
};

// Trains `steps` steps with rank r's forward sleeping delays[r]; every rank's last stats. `hook`,
// when given, makes each rank's comm hook (a hook with state, as PowerSGD's, serves one model).
std::vector<DDPStats> train(const std::vector<std::chrono::milliseconds>& delays, int steps,
                            DDPOptions opts, const std::function<CommHook()>& hook = nullptr) {
  const int world = static_cast<int>(delays.size());
  std::vector<DDPStats> stats(delays.size());
  const auto errors = run_ranks(world, [&](int r, ProcessGroupPtr pg) {
    DDPOptions mine = opts;
    if (hook) mine.comm_hook = hook();
    auto ddp =
        std::make_shared<DistributedDataParallel>(std::make_shared<Sleepy>(delays[r], 3), pg, mine);
    optim::SGD opt(ddp->parameters(), {.lr = 0.1});
    const Data d = make_data(8, 20 + r);
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      cross_entropy(ddp->forward(d.x), d.y).backward();
      opt.step();
    }
    stats[r] = ddp->stats();
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
  return stats;
}

// The injected delay is a lower bound on the slow rank's time (sleep_for sleeps at least that
// long); the others sleep an eighth of it, so the slow rank stays above 1.5x the median unless
// the machine holds a fast rank back by more than half the delay in any one of the steps.
class SlowRankDDP : public ::testing::TestWithParam<std::string> {};

TEST_P(SlowRankDDP, TheSleepingRankIsNamedOnEveryRankAndRankZeroWarns) {
  constexpr auto kSlow = 120ms, kOthers = 15ms;  // 8x: robust to a loaded machine
  // One step more than the streak needs, for the first: its allocations and the buckets'
  // rebuild can hold a fast rank back past the slow one on a loaded machine (it did once under
  // the sanitizer build: a streak of 4 of 5).
  constexpr int kWarnAfter = 4, kSteps = 6;
  DDPOptions o;
  o.slow_rank_steps = kWarnAfter;
  if (GetParam() == "bf16") o.comm_hook = bf16_compress_hook();
  if (GetParam() == "fp16") o.comm_hook = fp16_compress_hook();
  // PowerSGD sends the times beside its P, through the same average all-reduce.
  std::function<CommHook()> hook;
  if (GetParam() == "powersgd") hook = [] { return powersgd_hook({.start_powersgd_iter = 0}); };
  CaptureWarnings warnings;
  const auto stats = train({kOthers, kOthers, kSlow}, kSteps, o, hook);
  // A time is rounded twice on its way (into the wire's dtype, then the average's division):
  // each half a unit in the last place, 2^-8 of the value in bf16, 2^-11 in f16.
  const double precision =
      GetParam() == "bf16" ? 1.0 / 128 : (GetParam() == "fp16" ? 1.0 / 1024 : 1e-6);
  for (int r = 0; r < 3; ++r) {
    const DDPStats& s = stats[r];
    SCOPED_TRACE("rank " + std::to_string(r) + ": " + s.str());
    ASSERT_EQ(s.rank_compute_ms.size(), 3u);
    EXPECT_EQ(s.slowest_rank, 2);
    EXPECT_GE(s.slowest_rank_ms, kSlow.count() * (1 - precision));
    EXPECT_EQ(s.slowest_rank_ms, s.rank_compute_ms[2]);
    EXPECT_GE(s.median_rank_ms, kOthers.count() * (1 - precision));
    EXPECT_GT(s.slowest_rank_ms, 1.5 * s.median_rank_ms);
    EXPECT_GE(s.slow_rank_streak, kSteps - 1);
    EXPECT_LE(s.slow_rank_streak, kSteps);
    EXPECT_THAT(s.str(), ::testing::HasSubstr("slowest rank 2: "));
    // Every rank read the same sums.
    EXPECT_EQ(s.rank_compute_ms, stats[0].rank_compute_ms);
  }
  const auto lines = warnings.lines();
  ASSERT_EQ(lines.size(), 1u) << "one warning, from rank 0 alone";
  EXPECT_THAT(lines[0], ::testing::HasSubstr("rank 2 is the slowest for 4 steps: "));
  // The warning's time is the mean over the streak: at least the delay.
  const auto at = lines[0].find("steps: ") + 7;
  EXPECT_GE(std::stod(lines[0].substr(at)), kSlow.count() * (1 - precision)) << lines[0];
}

INSTANTIATE_TEST_SUITE_P(Hooks, SlowRankDDP,
                         ::testing::Values("allreduce", "bf16", "fp16", "powersgd"));

TEST(SlowRankDDPEven, NoWarningWhenEveryRankSleepsAlike) {
  // Every rank sleeps 20 ms: to be warned about, one would have to lag by 10 ms more than the
  // others in each of 6 steps in a row.
  DDPOptions o;
  o.slow_rank_steps = 6;
  CaptureWarnings warnings;
  const auto stats = train({20ms, 20ms, 20ms}, 8, o);
  EXPECT_EQ(warnings.lines(), std::vector<std::string>{});
  for (const auto& s : stats) {
    EXPECT_GE(s.slowest_rank, 0) << s.str();
    EXPECT_GE(s.median_rank_ms, 20.0 * (1 - 1e-6)) << s.str();  // f32 rounds once or twice
  }
}

TEST(SlowRankDDPJoin, AJoinedRankHasNoTimeAndIsNeitherSlowestNorInTheMedian) {
  // Rank 2 has 1 batch, ranks 0 and 1 have 3: in steps 2 and 3 rank 2 shadows them.
  constexpr int kWorld = 3;
  std::vector<DDPStats> stats(kWorld);
  const auto errors = run_ranks(kWorld, [&](int r, ProcessGroupPtr pg) {
    auto ddp = std::make_shared<DistributedDataParallel>(mlp(1), pg);
    optim::SGD opt(ddp->parameters(), {.lr = 0.1});
    const Data d = make_data(4, 30 + r);
    {
      Join join(*ddp, {.optimizer = &opt});
      for (int b = 0; join.next(b < (r == 2 ? 1 : 3)); ++b) {
        opt.zero_grad();
        cross_entropy(ddp->forward(d.x), d.y).backward();
        opt.step();
      }
    }
    stats[r] = ddp->stats();
  });
  for (const auto& e : errors) ASSERT_EQ(e, "");
  for (int r = 0; r < kWorld; ++r) {
    const DDPStats& s = stats[r];
    SCOPED_TRACE("rank " + std::to_string(r) + ": " + s.str());
    ASSERT_EQ(s.rank_compute_ms.size(), 3u);
    EXPECT_EQ(s.rank_compute_ms[2], 0.0);
    EXPECT_GT(s.rank_compute_ms[0], 0.0);
    EXPECT_GT(s.rank_compute_ms[1], 0.0);
    const int slower = s.rank_compute_ms[0] >= s.rank_compute_ms[1] ? 0 : 1;
    EXPECT_EQ(s.slowest_rank, slower);
    // The lower median of the two that took part is the faster one.
    EXPECT_EQ(s.median_rank_ms, s.rank_compute_ms[1 - slower]);
  }
}

}  // namespace
