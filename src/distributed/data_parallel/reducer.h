// Reducer: DDP's gradient buckets, the hooks that launch their all-reduces during backward, and
// the final callback that waits for them.
#pragma once

#include <chrono>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "distributed/diagnosis/slow_rank.h"
#include "lockstep/distributed/ddp.h"

namespace lockstep::dist {

// Broadcasts rank `root`'s values of `tensors` (one fused call per dtype); in ddp.cpp.
void broadcast_tensors(ProcessGroup& pg, const std::vector<Tensor>& tensors, int root);
// Collective: an Error on every rank naming the first parameter or buffer (name, shape, dtype)
// in which the ranks' models differ, `wrapper` naming who asks; in ddp.cpp.
void check_same_model(ProcessGroup& pg, const nn::Module& m, std::string_view wrapper);

class Reducer {
 public:
  // `params`: the parameters that require grad, in registration order, with their names.
  Reducer(std::vector<std::pair<std::string, Tensor>> params, ProcessGroupPtr pg,
          const DDPOptions& opts);
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  void set_no_sync(bool on) { no_sync_ = on; }
  bool no_sync() const { return no_sync_; }
  DDPStats stats() const { return stats_; }
  void set_comm_hook(CommHook hook);

  // Note [Join]: the number of ranks that contribute to the next synchronized backward (the
  // world size outside a Join); the reduced gradients are the mean over those ranks.
  void set_contributors(int n) { contributors_ = n; }
  // On a rank that joined: the bucket all-reduces of one synchronized backward of the others,
  // with zeros from this rank; with expose_grads its .grad() are the reduced views after.
  void shadow_backward(bool expose_grads);
  // Note [Slow rank]: a training forward starts this rank's clock for the step, unless a forward
  // since the last synchronized backward (an earlier micro-batch) already did.
  void start_step_clock();

 private:
  struct Bucket {
    DType dtype = DType::f32;
    Device device;               // the parameters' (one bucket, one device)
    std::vector<size_t> params;  // indices into params_
    int64_t numel = 0;           // gradient elements; the flat buffer has `extra` more:
    int64_t extra = 1;           // status, and in bucket 0 one time slot per rank
    Tensor flat;
    int pending = 0;  // parameters not yet ready this iteration
    GradBucket handle;
    WorkPtr work;
  };
  struct Slot {
    size_t bucket = 0;
    int64_t offset = 0;
    Tensor view;  // params_[i]'s .grad() while it is ours
  };

  // Lays the buckets out, parameters in `order`; current gradients are copied into the views.
  void build_buckets(const std::vector<size_t>& order);
  // hook.on_buckets, with the buckets as they are.
  void announce_buckets(const CommHook& hook);
  void on_grad_ready(size_t i);
  void ensure_view(size_t i);
  void launch_ready();
  void finalize();
  void reset_iteration();
  void rebuild_in_ready_order();
  void write_step_time(Bucket& b);
  std::vector<double> read_step_times() const;
  [[noreturn]] void throw_unused(const std::vector<size_t>& unused_here);

  std::vector<std::pair<std::string, Tensor>> params_;
  std::vector<int> hook_ids_;
  ProcessGroupPtr pg_;
  DDPOptions opts_;
  std::vector<Bucket> buckets_;
  std::vector<Slot> slots_;

  bool no_sync_ = false;
  bool iteration_active_ = false;  // a synced backward is running; finalize() is queued
  std::vector<bool> ready_;
  std::vector<size_t> ready_order_;
  size_t next_launch_ = 0;
  int64_t bytes_this_step_ = 0;
  int contributors_ = 0;  // 0: the world size
  bool rebuilt_ = false;
  bool step_clock_running_ = false;
  std::chrono::steady_clock::time_point step_start_;
  SlowRankWatch slow_rank_;
  DDPStats stats_;
};

}  // namespace lockstep::dist
