// Text through the object collectives: the one encoding of the small objects ranks exchange
// (errors, tokens, JSON headers, signatures, exact numbers as text).
#pragma once

#include <string>
#include <vector>

#include "lockstep/distributed/process_group.h"
#include "lockstep/distributed/store/store.h"  // to_bytes, to_string

namespace lockstep::dist {

// Collective: rank `root`'s text on every rank (the others' `text` is not read).
inline std::string broadcast_text(ProcessGroup& pg, const std::string& text, int root = 0) {
  return to_string(pg.broadcast_object(to_bytes(text), root));
}

// Collective: every rank's text, in rank order.
inline std::vector<std::string> all_gather_text(ProcessGroup& pg, const std::string& text) {
  std::vector<std::string> out;
  for (const Bytes& b : pg.all_gather_object(to_bytes(text))) out.push_back(to_string(b));
  return out;
}

}  // namespace lockstep::dist
