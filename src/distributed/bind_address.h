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

// Note [Who may reach rank 0's store]
// Where rank 0's own store (ranks started without the launcher: srun, mpirun, by hand) listens.
// When MASTER_ADDR resolves to loopback only, the job is on this machine: its address (nothing
// else can connect). Otherwise every interface, which is safe only with a token: the store holds
// the job's keys, and whoever connects can read them and stop the job. So without one
// (LOCKSTEP_STORE_TOKEN or LOCKSTEP_STORE_TOKEN_FILE) every rank fails at once, saying how to
// set one, unless LOCKSTEP_STORE_INSECURE=1 says the network is trusted (a warning then). "" means
// every interface.
std::string store_listen_address(const DistEnv& env);

}  // namespace lockstep::dist::detail
