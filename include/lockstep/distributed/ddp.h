// DistributedDataParallel: a Module wrapper whose backward averages gradients across ranks, in
// buckets whose all-reduces overlap the rest of the backward pass.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "lockstep/distributed/comm_hook.h"
#include "lockstep/distributed/parallel_module.h"
#include "lockstep/distributed/process_group.h"
#include "lockstep/nn/module.h"

namespace lockstep::dist {

// Bucket caps, as PyTorch's DDP: a small first bucket so that communication starts early in the
// backward pass, then large ones so that per-collective latency is paid rarely.
inline constexpr int64_t kDefaultFirstBucketBytes = int64_t{1} << 20;
inline constexpr int64_t kDefaultBucketBytes = int64_t{25} << 20;
// DDPOptions::bucket_bytes = kBucketBytesFromGroup: the cap bucket_bytes_from_group gives.
inline constexpr int64_t kBucketBytesFromGroup = -1;
// The slow-rank warning (Note [Slow rank], src/distributed/diagnosis/slow_rank.h): a rank whose
// compute time is more than this many times the median ...
inline constexpr double kDefaultSlowRankRatio = 1.5;
// ... in this many synchronized steps in a row.
inline constexpr int64_t kDefaultSlowRankSteps = 20;

// The bucket cap the group's link makes worth it: for a gloo group, bucket_bytes_for its link
// (Note [Cost model] in src/distributed/cost_model.cpp, LOCKSTEP_NET_CALIBRATE included) and size,
// within [kDefaultFirstBucketBytes, kDefaultBucketBytes]; for another group, kDefaultBucketBytes.
// The same on every rank: a gloo group's link is rank 0's.
int64_t bucket_bytes_from_group(const ProcessGroup& pg);

struct DDPOptions {
  int64_t first_bucket_bytes = kDefaultFirstBucketBytes;
  // A cap in bytes, or kBucketBytesFromGroup to take bucket_bytes_from_group's.
  int64_t bucket_bytes = kDefaultBucketBytes;
  // Parameters that took no part in an iteration's backward are reduced with zero contribution.
  // Without it such a parameter is an error on every rank, naming it.
  bool find_unused_parameters = false;
  // Broadcast buffers (BatchNorm statistics) from rank 0 before each forward in training mode.
  bool broadcast_buffers = true;
  CommHook comm_hook = allreduce_hook();
  // Every this many training forwards (0: never), check that every rank still holds the same
  // parameters and buffers (dist::check_in_sync, Note [Sync check]): an Error on every rank,
  // naming the first tensor that differs and the ranks on each side. Skipped inside a dist::Join,
  // whose joined ranks could not take part.
  int64_t check_sync_every = 0;
  // Every synchronized step measures each rank's compute time (Note [Slow rank]: carried in the
  // first bucket, no extra collective; DDPStats has the result). Rank 0 logs a warning when the
  // same rank is the slowest and more than slow_rank_ratio x the median (> 1) in slow_rank_steps
  // steps in a row (0: never warn).
  double slow_rank_ratio = kDefaultSlowRankRatio;
  int64_t slow_rank_steps = kDefaultSlowRankSteps;
};

// What an engineer tunes DDP with.
struct DDPStats {
  std::vector<int64_t> bucket_bytes;     // per bucket, in launch order
  std::vector<int64_t> bucket_params;    // parameters per bucket
  int64_t bytes_reduced_last_step = 0;   // gradient bytes all-reduced by the last synced backward
  int64_t synced_steps = 0;              // backward passes that communicated
  double exposed_comm_seconds_last = 0;  // waiting for communication after backward ended
  double exposed_comm_seconds_total = 0;
  bool buckets_rebuilt = false;  // rebuilt in gradient-ready order after step 1
  // Note [Slow rank]: the last synced step's compute time of each rank (forward and backward up
  // to the first bucket), in ms, 0 for a rank that took no part (joined); the slowest rank (-1
  // until a step measured one), its time, and the lower median over the ranks that took part;
  // how many steps in a row that rank was above slow_rank_ratio x the median. The same on every
  // rank.
  std::vector<double> rank_compute_ms;
  int slowest_rank = -1;
  double slowest_rank_ms = 0;
  double median_rank_ms = 0;
  int64_t slow_rank_streak = 0;
  std::string str() const;  // a few lines for logs
};

class Reducer;
class Join;

// Construction (on every rank of `pg`, collectively): checks that every rank built the same
// model (parameter names, shapes, dtypes, order; an Error on every rank naming the first
// difference), broadcasts rank 0's parameters and buffers, and lays the gradients out in buckets
// (reverse registration order). Each parameter's .grad() is then a view into its bucket's flat
// buffer. backward() returns with every rank holding the same averaged gradients. The training
// loop's interface (no_sync, clip_grad_norm, full_state_dict...) is ParallelModule's.
class DistributedDataParallel : public ParallelModule {
 public:
  DistributedDataParallel(std::shared_ptr<nn::Module> module, ProcessGroupPtr pg,
                          DDPOptions opts = {});
  ~DistributedDataParallel() override;

  Tensor forward(const Tensor& x) override;
  const std::shared_ptr<nn::Module>& module() const override { return module_; }
  const ProcessGroupPtr& process_group() const override { return pg_; }

  // The parameters' .grad() (optim::clip_grad_norm; every rank holds the same), or where the comm
  // hook keeps the average (CommHook::clip_grad_norm, ZeRO-1's shards).
  double clip_grad_norm(double max_norm) override;
  // The wrapped module's state_dict(), after what the comm hook left in flight (ZeRO-1's
  // all-gathers) has landed; and into it.
  nn::NamedTensors full_state_dict() override;
  void load_full_state_dict(const nn::NamedTensors& state) override;

  DDPStats stats() const;

  // Replaces DDPOptions::comm_hook (as PyTorch's register_comm_hook): before the first
  // synchronized backward only, every rank the same hook.
  void register_comm_hook(CommHook hook);

 protected:
  bool set_no_sync(bool no_sync) override;
  void gather_full_params() override;
  void release_full_params() noexcept override {}

 private:
  friend class Join;  // Note [Join]: the header in forward, the shadowed collectives
  // Before a training forward: rank `root`'s buffers to every rank, when broadcast_buffers.
  void broadcast_buffers(int root);

  std::shared_ptr<nn::Module> module_;
  ProcessGroupPtr pg_;
  DDPOptions opts_;
  std::unique_ptr<Reducer> reducer_;
  Join* join_ = nullptr;           // the Join this model is inside, if any
  int64_t training_forwards_ = 0;  // for check_sync_every
};

}  // namespace lockstep::dist
