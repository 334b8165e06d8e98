// The slow rank: what a rank writes into its time slot of the first bucket, and the watch that
// names the slowest rank of each step and warns when the same one lags for many steps.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "lockstep/distributed/ddp.h"

namespace lockstep::dist {

// Note [Slow rank]
// A data-parallel job runs at the pace of its slowest rank: every other rank waits for it in the
// all-reduce of each step, and nothing names it. So the step's compute time of every rank rides
// in the gradient all-reduce that happens anyway: the first bucket (index 0, always the first
// launched) has, after its gradients and the unused-parameter status element, one slot per rank.
// Rank r writes its time into slot r just before the bucket is launched and leaves the others
// zero; the all-reduce sums (the hook averages: the reducer multiplies back by the world size),
// so every rank reads every rank's time, at no extra collective. Rank 0 logs the warning.
//
// What is timed: from the first training forward after the last synchronized backward (so the
// micro-batches of an accumulation window count) to the launch of bucket 0, i.e. forward, the
// loss and backward up to the first full bucket. It starts after the forward's own collectives
// (the buffers' broadcast, the Join header, the sync check), in which a fast rank would wait for
// a slow one and take on its time; a collective inside the model's forward (SyncBatchNorm) still
// does that. Data loading before the forward and the optimizer step are not counted; a training
// forward whose backward never runs leaves the clock running into the next step's time.
//
// Zero means "no time": a rank inside a Join that has run out of data (it shadows the bucket
// all-reduces with zeros, Note [Join]), or one that ran backward without a DDP forward. Such a
// slot is left out of the slowest and the median, so a joined rank is never the fastest. A real
// time is at least kMinCarriedMs, so it never reads as zero.
//
// Precision: the slots have the bucket's dtype, or the wire's under a compression hook. f32
// carries milliseconds to a few nanoseconds; bf16 to about 3 significant digits (8 bits of
// mantissa: 41.3 ms may read 41.25), f16 to about 4, which is ample for a comparison against
// 1.5x the median. f16 ends at 65504, so times are capped at kMaxCarriedMs (a minute) in every
// dtype: a step slower than that reads as 60000 ms. Each slot's sum has one non-zero term, so
// the reduction itself adds no error; the average's division and the multiplication back round
// once each.
//
// The median is the lower median (of an even count, the smaller middle value): in a 2-rank job
// the slower rank is compared with the faster one, not with their mean. The warning needs the
// same rank to be the slowest and more than slow_rank_ratio x the median in slow_rank_steps
// synchronized steps in a row; it repeats at 2x, 4x, ... that many steps while the streak lasts,
// so a job with one slow machine for days logs a few lines, not thousands.
inline constexpr double kMinCarriedMs = 0.01;
inline constexpr double kMaxCarriedMs = 60000.0;

// `ms` clamped into [kMinCarriedMs, kMaxCarriedMs]: what a rank writes into its slot.
double carried_ms(double ms);

class SlowRankWatch {
 public:
  // `ratio` > 1; `steps` >= 0 (0: never warn).
  SlowRankWatch(double ratio, int64_t steps);

  // One synchronized step, every rank's time in ms (0: took no part). Sets stats' per-rank times,
  // slowest rank, its time and the median; returns the warning line when one is due.
  std::optional<std::string> observe(const std::vector<double>& ms, DDPStats& stats);

 private:
  double ratio_;
  int64_t steps_;
  int streak_rank_ = -1;  // the rank slower than ratio_ x the median in the last steps
  int64_t streak_ = 0;
  double streak_ms_sum_ = 0, streak_median_sum_ = 0;
  int64_t next_warning_ = 0;  // the streak length at which the next warning is due
};

}  // namespace lockstep::dist
