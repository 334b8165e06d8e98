// ProcessGroupHier: collectives on CPU tensors composed of an shm group inside each machine and
// Gloo groups across machines.
#pragma once

#include <memory>
#include <string>

#include "lockstep/distributed/process_group.h"

namespace lockstep::dist {

struct HierOptions {
  // Testing hook: when set, replaces this rank's detected machine identity (host name and boot
  // id) in the layout exchange, so that one machine can play several. The shm sub-group still
  // checks the real identity. Never set outside tests.
  std::string machine_identity_for_testing;
};

// Construction publishes every rank's machine through config.store and requires the layout
// `lockstep run` gives: the same number of ranks L on every machine, the ranks of a machine
// contiguous (rank = machine * L + local rank); anything else is an Error naming what was found,
// on every rank. It then builds an shm group of the machine's ranks and a Gloo group of local
// rank i of every machine (each through its own PrefixStore); with one machine only the shm
// group does work, with one rank per machine only the Gloo group.
//
// all_reduce is a reduce_scatter inside the machine, an all_reduce of each shard across machines
// and an all_gather inside the machine (Note [Hierarchical all_reduce] in
// src/distributed/hier/process_group_hier.cpp). Ranks and results are a flat Gloo group's.
// Collectives run on the calling thread and return a completed Work. After a collective fails
// the group is poisoned: every later call fails at once, naming the first failure.
class ProcessGroupHier : public ProcessGroup {
 public:
  explicit ProcessGroupHier(const BackendConfig& config, const HierOptions& options = {});
  ~ProcessGroupHier() override;

  std::string_view backend() const override { return "hier"; }
  int num_machines() const;
  int local_size() const;  // ranks per machine

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
  std::unique_ptr<Impl> impl_;
};

}  // namespace lockstep::dist
