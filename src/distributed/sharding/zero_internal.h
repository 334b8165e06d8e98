// What the files of ZeroRedundancyOptimizer share (Note [ZeRO-1] in zero.cpp): the link that
// comm_hook() holds, and the text of the wrapped optimizer's state entries.
#pragma once

#include <cstdio>
#include <string>

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

// "<index>.<field>" -> (index, field); false for the global entries.
inline bool split_key(const std::string& name, size_t& index, std::string& field) {
  const size_t dot = name.find('.');
  if (dot == std::string::npos || dot == 0) return false;
  const std::string idx = name.substr(0, dot);
  if (idx.find_first_not_of("0123456789") != std::string::npos) return false;
  index = std::stoul(idx);
  field = name.substr(dot + 1);
  return true;
}

}  // namespace detail

}  // namespace lockstep::dist
