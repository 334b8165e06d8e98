// What is left of a collective's time at one of its stages.
#pragma once

#include <algorithm>
#include <chrono>

namespace lockstep::dist::detail {

// The time left until `deadline`, never 0 (a backend's 0 means its default timeout).
inline std::chrono::milliseconds time_left(std::chrono::steady_clock::time_point deadline) {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
      deadline - std::chrono::steady_clock::now());
  return std::max(ms, std::chrono::milliseconds(1));
}

}  // namespace lockstep::dist::detail
