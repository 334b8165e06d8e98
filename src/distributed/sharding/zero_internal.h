// What the files of ZeroRedundancyOptimizer share (Note [ZeRO-1] in zero.cpp): the link that
// comm_hook() holds, exact text for a double, and the names of the wrapped optimizer's state
// entries (state_key.h).
#pragma once

#include <cstdio>
#include <string>

#include "distributed/sharding/state_key.h"
#include "lockstep/distributed/zero.h"

namespace lockstep::dist {

// What comm_hook() holds: the optimizer while it lives (its destructor clears it).
struct ZeroRedundancyOptimizer::HookLink {
  ZeroRedundancyOptimizer* zero = nullptr;
};

namespace detail {

// Exact text for a double (hexadecimal floating point).
inline std::string exact(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%a", v);
  return buf;
}

}  // namespace detail

}  // namespace lockstep::dist
