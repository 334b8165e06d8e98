// ProcessGroupNCCL: collectives on CUDA tensors with NCCL, on a communication stream of the group's
// own, watched by a thread that aborts a stuck collective. Built in CUDA builds only.
#pragma once

#include <memory>

#include "lockstep/distributed/process_group.h"
#include "lockstep/tensor/cuda.h"

namespace lockstep::dist {

// Construction: rank 0 creates NCCL's unique id and publishes it through config.store, the
// others read it there (bounded by the store's timeout); every rank then creates its
// communicator on the calling thread's current device (init_process_group has bound it to
// cuda:LOCAL_RANK), and every tensor of its collectives must be on that device.
//
// Collectives are queued on stream(), a high-priority stream that first waits for the caller's
// current stream (an event), so that they read what the caller computed before the call and run
// alongside what it computes after. Work::wait() makes the caller's current stream wait for the
// collective and returns at once; Work::synchronize() blocks the host (Note [Stream-ordered
// works] in process_group_nccl.cpp). A barrier's wait() blocks the host, as a barrier must.
//
// A watchdog thread per group polls the works in flight. One still running after its timeout,
// or an error NCCL reports asynchronously, fails every work in flight (naming the op and its
// sequence number), aborts the communicator (ncclCommAbort), so that no kernel waits forever
// for a peer, and poisons the group: every later collective fails at once naming the first
// failure. Build a new group to continue.
class ProcessGroupNCCL : public ProcessGroup {
 public:
  explicit ProcessGroupNCCL(const BackendConfig& config);
  // Waits for the collectives in flight (each bounded by its timeout), then destroys the
  // communicator.
  ~ProcessGroupNCCL() override;

  std::string_view backend() const override { return "nccl"; }
  int device() const;
  const cuda::Stream& stream() const;

 protected:
  void do_all_reduce(Tensor tensor, ReduceOp op, std::chrono::milliseconds timeout,
                     const WorkPtr& work) override;
  void do_broadcast(Tensor tensor, int root, std::chrono::milliseconds timeout,
                    const WorkPtr& work) override;
  void do_all_gather(Tensor output, Tensor input, std::chrono::milliseconds timeout,
                     const WorkPtr& work) override;
  void do_reduce_scatter(Tensor output, Tensor input, ReduceOp op,
                         std::chrono::milliseconds timeout, const WorkPtr& work) override;
  void do_barrier(std::chrono::milliseconds timeout, const WorkPtr& work) override;
  bool supports(Device device) const override;
  Device object_device() const override;
  WorkPtr create_work(std::string description, int64_t seq) override;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace lockstep::dist
