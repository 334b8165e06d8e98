// Which machine this process runs on, as ranks compare it through the store, and the layout of a
// group's ranks over machines.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "lockstep/distributed/store/store.h"

namespace lockstep::dist::detail {

// "host-a (boot 1b2c...)": equal on two processes exactly when they share one running kernel,
// hence one /dev/shm (a host name alone can repeat across machines).
std::string machine_identity();

// Publishes `mine` under "<prefix><rank>" and returns every rank's, in rank order. A rank that
// does not publish within `timeout` is an Error that says who was waiting for what.
std::vector<std::string> exchange_machine_identities(Store& store, const std::string& prefix,
                                                     int rank, int size, const std::string& mine,
                                                     std::chrono::milliseconds timeout,
                                                     const std::string& who);

// How a group's ranks lie on machines. Regular is the layout `lockstep run` gives: the same
// number of ranks on every machine, each machine's ranks contiguous (machine m holds ranks
// m * local_size .. m * local_size + local_size - 1).
struct MachineLayout {
  int machines = 1;
  int local_size = 1;  // meaningful when regular
  bool regular = true;
  std::string found;  // "host-a: ranks 0,1; host-b: ranks 2,3"
};
MachineLayout machine_layout(const std::vector<std::string>& identity_by_rank);

}  // namespace lockstep::dist::detail
