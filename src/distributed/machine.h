// Which machine this process runs on, as ranks compare it through the store.
#pragma once

#include <string>

namespace lockstep::dist::detail {

// "host-a (boot 1b2c...)": equal on two processes exactly when they share one running kernel,
// hence one /dev/shm (a host name alone can repeat across machines).
std::string machine_identity();

}  // namespace lockstep::dist::detail
