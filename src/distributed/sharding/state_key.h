// The names of a wrapped optimizer's state entries, as the sharded optimizers (ZeRO-1's,
// FSDP's) take them apart: "<index>.<field>" per parameter, beside the global "step" and
// "group.<g>.lr" (Optimizer::state_dict()).
#pragma once

#include <cstddef>
#include <string>

namespace lockstep::dist::detail {

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

}  // namespace lockstep::dist::detail
