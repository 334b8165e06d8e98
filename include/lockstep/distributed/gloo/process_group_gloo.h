// ProcessGroupGloo: collectives on CPU tensors over TCP, with the Gloo library as the engine.
#pragma once

#include <cstdint>
#include <memory>

#include "lockstep/distributed/cost_model.h"
#include "lockstep/distributed/process_group.h"

namespace lockstep::dist {

// Construction rendezvouses through config.store with every other rank (Gloo's full mesh: one
// TCP connection per pair of ranks) and returns once all are connected, or fails after
// config.timeout.
//
// Collectives run one at a time, in the order they were issued, on the group's communication
// thread; the calling thread only queues them. The transport binds to config.bind_address, else
// to the address of config.bind_interface, else to loopback. connect_world() always passes the
// address it chose once for the job (the local one that routes to MASTER_ADDR, or
// LOCKSTEP_SOCKET_IFNAME), so that a machine's hostname resolving to the wrong address cannot
// break a run.
//
// After a collective fails (a timeout, a peer that died) the group closes its connections, so
// that the other ranks fail promptly too instead of waiting out their own timeouts, and every
// later collective fails at once, naming the first failure. Build a new group to continue.
class ProcessGroupGloo : public ProcessGroup {
 public:
  explicit ProcessGroupGloo(const BackendConfig& config);
  ~ProcessGroupGloo() override;  // runs the collectives already queued, then stops the thread

  std::string_view backend() const override { return "gloo"; }
  // The address the transport listens on ("127.0.0.1").
  const std::string& address() const;

  // The link the group's cost model uses (Note [Cost model] in src/distributed/cost_model.cpp):
  // rank 0's, agreed when the group was made, so the same on every rank.
  const LinkModel& link() const;
  // The algorithm an all_reduce of `bytes` runs: gloo_all_reduce_algorithm with the group's link
  // and rank 0's LOCKSTEP_ALLREDUCE_ALGO. Each call asks here.
  AllReduceAlgorithm all_reduce_algorithm(int64_t bytes) const;
  // How many all_reduce calls this rank has finished with each algorithm (whole, direct): what
  // ran, for tests and benchmarks to check against what was asked for.
  struct AllReduceCounts {
    int64_t whole = 0;
    int64_t direct = 0;
  };
  AllReduceCounts all_reduce_counts() const;

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
  bool supports(Device device) const override { return device.is_cpu(); }

 private:
  class Impl;
  std::shared_ptr<Impl> impl_;  // shared with the wait hooks of its Works (weakly)
};

}  // namespace lockstep::dist
