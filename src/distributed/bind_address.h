// The address the transport binds to: chosen once per world by connect_world() and handed to
// every group's backend in BackendConfig.
#pragma once

#include <string>

#include "lockstep/distributed/init.h"

namespace lockstep::dist::detail {

// One of the two is set.
struct BindChoice {
  std::string address;    // a local address ("10.1.2.3")
  std::string interface;  // an interface ("eth0") whose address the transport takes
};

// LOCKSTEP_SOCKET_IFNAME (or GLOO_SOCKET_IFNAME) when set: a local address, or an interface that
// must exist (an Error listing the machine's interfaces otherwise). Else the local address that
// routes to MASTER_ADDR: the other ranks reach rank 0's machine, so they reach this address the
// same way (loopback for a job on one machine, MASTER_ADDR's default).
BindChoice choose_bind(const DistEnv& env);

}  // namespace lockstep::dist::detail
