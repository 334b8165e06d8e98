// PowerSGD: a communication hook for DDP that sends a low-rank approximation of each gradient
// matrix, with error feedback (after PyTorch's powerSGD_hook). How it works: powersgd.cpp.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "lockstep/distributed/comm_hook.h"
#include "lockstep/tensor/generator.h"

namespace lockstep::dist {

struct PowerSGDOptions {
  // r: each gradient, viewed as a shape[0] x rest matrix, travels as P (shape[0] x r) and
  // Q (rest x r); capped at the matrix's smaller side.
  int64_t matrix_approximation_rank = 1;
  // Synchronized steps reduced by a plain all-reduce before compression starts (the first
  // steps' gradients change fast; PyTorch's default).
  int64_t start_powersgd_iter = 1000;
  // A matrix is compressed only when (shape[0] + rest) * r * this < shape[0] * rest; the others,
  // and every 1-D tensor, travel uncompressed.
  double min_compression_rate = 2;
  // Adds what compression left out of a step's gradient to the next step's (one more copy of the
  // gradients in memory). Without it, PowerSGD rarely reaches the uncompressed accuracy.
  bool use_error_feedback = true;
  // Starts each step's power iteration from the last step's Q instead of a new random one.
  bool warm_start = true;
  // Added to a column's norm before dividing by it; 0 leaves a zero column zero.
  double orthogonalization_epsilon = 0;
  // Seeds the random Q, which must be the same on every rank (every rank passes the same seed).
  uint64_t seed = 0;
};

// What PowerSGD keeps between steps: the options, the step count, each parameter's error and Q
// (by parameter name, so they survive DDP's rebuild of its buckets), and the generator of the
// random Qs. One per DDP model: a hook from powersgd_hook() serves the process group of its first
// bucket and refuses another (thread ranks make one each). start() and finish() are the hook's.
class PowerSGDState {
 public:
  explicit PowerSGDState(PowerSGDOptions opts = {});

  const PowerSGDOptions& options() const { return opts_; }
  // The step being reduced (counted from 0 at each start of bucket 0, the first of every step).
  int64_t iteration() const { return started_ - 1; }
  // This rank's error of a parameter's gradient: what the last compressed step left out of it,
  // added to its next gradient (undefined before compression starts, or without error feedback).
  Tensor error(const std::string& name) const;
  // A compressed parameter's Q (rest x r) of the last step (undefined for one sent whole).
  Tensor q(const std::string& name) const;

  // The hook's two halves (comm_hook.h).
  WorkPtr start(ProcessGroup& pg, GradBucket& bucket);
  void finish(GradBucket& bucket);

 private:
  struct Pending;
  PowerSGDOptions opts_;
  // The group this state serves while that group lives (a later one may take it over), and its
  // rank and size for the refusal's message.
  std::mutex group_mu_;
  std::weak_ptr<const ProcessGroup> group_;
  int group_rank_ = -1, group_size_ = 0;
  int64_t started_ = 0;
  Generator gen_;
  std::map<std::string, Tensor> errors_;
  std::map<std::string, Tensor> qs_;
  std::map<int, std::shared_ptr<Pending>> pending_;  // by bucket index, from start to finish
};

CommHook powersgd_hook(std::shared_ptr<PowerSGDState> state);
CommHook powersgd_hook(PowerSGDOptions opts = {});

}  // namespace lockstep::dist
