// The job's signature (Note [Job signature]): what every machine of a job must run alike, and the
// first difference between two, in words, for a node that is refused.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "agent.h"

namespace lockstep::launch {

struct JobSignature {
  std::string program;  // the file name of the worker program, without its directory
  std::vector<std::string> args;
  // Launcher settings that must agree, as {"--max-restarts", "0"}, in a fixed order.
  std::vector<std::pair<std::string, std::string>> settings;

  nlohmann::json to_json() const;
  // Throws nlohmann::json::exception on a malformed one.
  static JobSignature from_json(const nlohmann::json& j);
};

JobSignature job_signature(const RunOptions& o);

// The first way `theirs` differs from `job`, as "--seed 2 where <job_name> runs --seed 1";
// nullopt when they agree.
std::optional<std::string> signature_difference(const JobSignature& job, const JobSignature& theirs,
                                                const std::string& job_name);

}  // namespace lockstep::launch
