// Where a Fashion-MNIST run stands, and how its checkpoint carries what the library's checkpoint
// has no field for: the epoch's loss sums and the learning rate of the writing run's world, as
// user metadata. Trainer (train_fashion_mnist.cpp) writes and reads it through these functions.
#pragma once

#include <charconv>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "lockstep/base/error.h"
#include "lockstep/io/checkpoint.h"

namespace lockstep::examples {

// Where training stands: optimizer steps taken in all; within `epoch`, the samples all ranks
// together consumed and the losses of its optimizer steps so far, which the epoch's train_loss
// averages (so a resumed epoch reports the uninterrupted one's). A checkpoint stores exactly this.
struct Position {
  int64_t step = 0;
  int64_t epoch = 0;
  int64_t epoch_consumed = 0;
  double epoch_loss_sum = 0;  // this rank's
  int64_t epoch_loss_steps = 0;
};

// The user metadata that holds Position's loss sums (one per rank, %.17g) and count.
constexpr const char* kLossSumsKey = "epoch_loss_sums";
constexpr const char* kLossStepsKey = "epoch_loss_steps";
// The user metadata that holds the learning rate --lr-scaling gave the writing run's world, before
// the schedule (%.17g): Note [Rescaling].
constexpr const char* kScaledLrKey = "scaled_lr";

// Note [Rescaling]
// A checkpoint resumed with another number of ranks continues the epoch exactly. The sampler
// deals out the rest of the epoch's order to the new ranks (DistributedSampler::set_start_index),
// so no sample is skipped or seen twice (but for the padding when the rest does not split evenly
// over the new ranks), and the learning rate is the one --lr-scaling gives the new world's
// effective batch. The optimizer's state dict holds each group's learning rate
// ("group.<g>.lr"), so loading it brings back the writing run's; the scheduler then sets this
// run's base rate (scaled_lr() of this world, taken when it was built, before the load) times
// the schedule at the resumed step, and every step from there on uses it. The checkpoint
// records the writing run's base rate (user.scaled_lr), so that rank 0 can say that the rate
// changed and by how much: "learning rate rescaled from 0.05 to 0.075 (world size 2 -> 3,
// --lr-scaling linear)". The metrics' train records carry world_size, so the change shows there
// too. What stays approximate: the schedule counts optimizer steps, and a step covers another
// number of samples in the new world (a cosine decay reaches its end at this world's count of
// steps per epoch, from the resumed step on).

// Writes the epoch's loss sums (every rank's, in rank order), their step count and the base
// learning rate into a checkpoint's user metadata.
inline void put_position(io::Metadata& user, const std::vector<double>& loss_sums,
                         int64_t loss_steps, double scaled_lr) {
  std::string text;
  char buf[32];
  for (size_t r = 0; r < loss_sums.size(); ++r) {
    std::snprintf(buf, sizeof buf, "%s%.17g", r ? " " : "", loss_sums[r]);
    text += buf;
  }
  user[kLossSumsKey] = text;
  user[kLossStepsKey] = std::to_string(loss_steps);
  std::snprintf(buf, sizeof buf, "%.17g", scaled_lr);
  user[kScaledLrKey] = buf;
}

// The epoch's loss sums, one per rank of the writing run, and their step count.
struct EpochLoss {
  std::vector<double> sums;
  int64_t steps = 0;
};

// A checkpoint's EpochLoss; none for one written before they were recorded. Metadata that is
// there but not numbers is an error that names `path`.
inline std::optional<EpochLoss> epoch_loss_of(const io::TrainingCheckpoint& ckpt,
                                              const std::string& path) {
  const auto sums_it = ckpt.user.find(kLossSumsKey);
  const auto steps_it = ckpt.user.find(kLossStepsKey);
  if (sums_it == ckpt.user.end() || steps_it == ckpt.user.end()) return std::nullopt;
  // strtod, not operator>>: a run whose loss diverged has written "nan" or "inf".
  EpochLoss loss;
  std::istringstream in(sums_it->second);
  bool numbers = true;
  for (std::string word; in >> word;) {
    char* end = nullptr;
    loss.sums.push_back(std::strtod(word.c_str(), &end));
    numbers = numbers && end == word.c_str() + word.size();
  }
  loss.steps = -1;
  const std::string& steps_text = steps_it->second;
  const auto [end, ec] =
      std::from_chars(steps_text.data(), steps_text.data() + steps_text.size(), loss.steps);
  LS_CHECK(numbers && !loss.sums.empty() && ec == std::errc() &&
               end == steps_text.data() + steps_text.size() && loss.steps >= 0,
           "--resume ", path, ": metadata user.", kLossSumsKey, " should be numbers and user.",
           kLossStepsKey, " a count, found '", sums_it->second, "' and '", steps_text, "'");
  return loss;
}

// The base learning rate the writing run recorded; none for a checkpoint written before it was.
inline std::optional<double> recorded_scaled_lr(const io::TrainingCheckpoint& ckpt,
                                                const std::string& path) {
  const auto it = ckpt.user.find(kScaledLrKey);
  if (it == ckpt.user.end()) return std::nullopt;
  char* end = nullptr;
  const double lr = std::strtod(it->second.c_str(), &end);
  LS_CHECK(!it->second.empty() && end == it->second.c_str() + it->second.size(), "--resume ",
           path, ": metadata user.", kScaledLrKey, " should be a number, found '", it->second, "'");
  return lr;
}

}  // namespace lockstep::examples
