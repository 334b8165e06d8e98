// The slow rank (Note [Slow rank]): the per-step verdict over every rank's compute time, and the
// warning when one rank lags for many steps in a row.
#include "distributed/diagnosis/slow_rank.h"

#include <algorithm>
#include <cstdio>

#include "lockstep/base/error.h"

namespace lockstep::dist {

namespace {

std::string one_decimal(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", v);
  return buf;
}

}  // namespace

double carried_ms(double ms) { return std::clamp(ms, kMinCarriedMs, kMaxCarriedMs); }

SlowRankWatch::SlowRankWatch(double ratio, int64_t steps) : ratio_(ratio), steps_(steps) {
  LS_CHECK(ratio_ > 1.0,
           "DistributedDataParallel: DDPOptions::slow_rank_ratio must be above 1 (a rank that "
           "many times the median is slow), got ",
           ratio_);
  LS_CHECK(steps_ >= 0, "DistributedDataParallel: DDPOptions::slow_rank_steps must be >= 0 (0: ",
           "never warn), got ", steps_);
}

std::optional<std::string> SlowRankWatch::observe(const std::vector<double>& ms, DDPStats& stats) {
  stats.rank_compute_ms = ms;
  std::vector<double> taking_part;
  int slowest = -1;
  for (size_t r = 0; r < ms.size(); ++r) {
    if (ms[r] <= 0) continue;  // joined, or no DDP forward: no time (Note [Slow rank])
    taking_part.push_back(ms[r]);
    if (slowest < 0 || ms[r] > ms[slowest]) slowest = static_cast<int>(r);
  }
  if (slowest < 0) {
    stats.slowest_rank = -1;
    stats.slowest_rank_ms = stats.median_rank_ms = 0;
    stats.slow_rank_streak = streak_ = 0;
    return std::nullopt;
  }
  // The lower median: with two ranks, the faster one.
  const auto mid = taking_part.begin() + static_cast<std::ptrdiff_t>((taking_part.size() - 1) / 2);
  std::nth_element(taking_part.begin(), mid, taking_part.end());
  const double median = *mid;
  stats.slowest_rank = slowest;
  stats.slowest_rank_ms = ms[slowest];
  stats.median_rank_ms = median;

  if (taking_part.size() < 2 || ms[slowest] <= ratio_ * median) {
    stats.slow_rank_streak = streak_ = 0;
    return std::nullopt;
  }
  if (slowest != streak_rank_ || streak_ == 0) {
    streak_rank_ = slowest;
    streak_ = 0;
    streak_ms_sum_ = streak_median_sum_ = 0;
    next_warning_ = steps_;
  }
  ++streak_;
  streak_ms_sum_ += ms[slowest];
  streak_median_sum_ += median;
  stats.slow_rank_streak = streak_;
  if (steps_ == 0 || streak_ != next_warning_) return std::nullopt;
  next_warning_ *= 2;
  const double mean_ms = streak_ms_sum_ / static_cast<double>(streak_);
  const double mean_median = streak_median_sum_ / static_cast<double>(streak_);
  return lockstep::detail::str_cat(
      "rank ", slowest, " is the slowest for ", streak_, " steps: ", one_decimal(mean_ms),
      " ms of compute per step against a median of ", one_decimal(mean_median), " ms (",
      one_decimal(mean_ms / mean_median),
      "x; forward and backward up to the first gradient "
      "bucket, averaged over those steps). Every other rank waits for it in each step's "
      "all-reduce: look for a busier or slower machine or device, or a larger share of the data, "
      "on rank ",
      slowest);
}

}  // namespace lockstep::dist
