// Rank 0's choice of the checkpoint to resume, for every rank: the protocol that
// dist::resolve_resume (files) and dist::resolve_sharded_resume (directories) share.
#pragma once

#include <functional>
#include <string>

#include "lockstep/distributed/process_group.h"
#include "lockstep/io/checkpoint.h"

namespace lockstep::dist {

struct ResumeSearch {
  const char* what = "checkpoint";  // "no <what> of BASE verifies"
  // The newest checkpoint of `base` that verifies, with the newer ones that did not.
  std::function<io::CheckpointChoice(const std::string& base)> latest_valid;
  // Why an explicit --resume PATH is no checkpoint of this kind ("" when it is one).
  std::function<std::string(const std::string& path)> explicit_problem;
};

// "auto": rank 0's search.latest_valid(base), a warning on rank 0 for each newer one skipped, an
// error when some exist and none verifies; any other value must pass search.explicit_problem on
// rank 0. Every rank returns rank 0's choice or throws its error.
io::CheckpointChoice resolve_resume_with(ProcessGroup& pg, const std::string& resume,
                                         const std::string& base, const ResumeSearch& search);

}  // namespace lockstep::dist
