// Failure agreement for the checkpoint collectives: a rank's error caught as text, and every
// rank learning every rank's error, so that no rank waits in a collective another has left.
#pragma once

#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "distributed/object_text.h"

namespace lockstep::dist {

// Runs `body` and returns why it failed ("" when it did not). Any exception is caught: a rank
// that left before the next collective would leave the others waiting in it.
inline std::string failure_of(const std::function<void()>& body) {
  try {
    body();
    return "";
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    return e.what()[0] ? e.what() : "unknown error";
  } catch (...) {
    return "unknown exception";
  }
}

// Every rank learns every rank's error ("" where it succeeded); throws the first one.
inline void agree(ProcessGroup& pg, const std::string& what, const std::string& error) {
  const std::vector<std::string> all = all_gather_text(pg, error);
  for (size_t r = 0; r < all.size(); ++r)
    LS_CHECK(all[r].empty(), what, " failed on rank ", r, ": ", all[r]);
}

}  // namespace lockstep::dist
