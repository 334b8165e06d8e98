// The job's signature (Note [Job signature]) and the first difference between two, in words.
#include "job_signature.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <sstream>

namespace lockstep::launch {

// Note [Job signature]
// Every machine of a job runs the same training: a machine whose worker program or arguments
// differ either fails at once (a duplicated flag, another model: its ranks' first collective
// disagrees) and brings the job down with it, or, worse, trains with another --seed, batch size
// or optimizer setting and silently corrupts the run. So each agent describes what it will run,
// and the job checks it before the machine's workers start:
//   program   the worker program's file name: its directory may differ (installed under another
//             home or prefix on that machine), its name may not;
//   args      every argument, as the launcher passes it, compared exactly;
//   settings  the launcher's options that must agree: --nnodes (N or MIN:MAX), --max-restarts
//             (it reaches the workers as LOCKSTEP_MAX_RESTARTS), --restart-backoff (each
//             static agent waits it out on its own: Note [Restart backoff]), --timeout (the
//             collective timeout: ranks that give up at different times report the wrong rank), and
//             --node-timeout (each agent judges the others by it). --nproc-per-node is checked
//             on its own, first, as before.
// What may differ: the environment (a per-machine path or device list belongs there, e.g.
// DATA_DIR=/mnt/a), and the options about this machine alone (--node-rank, --master-addr as
// this machine reaches node 0, --log-dir, --tee, --local-ranks-filter, --monitor-interval,
// --stall-timeout, --rdzv-timeout, --rdzv-last-call, where the token comes from).
// The signature travels in a node's join request (Note [Membership] in agent_membership.cpp);
// node 0 compares it with its own and refuses a machine that differs, naming the first difference
// on both sides. An elastic job goes on untouched; a fixed one cannot start without the machine,
// so node 0 fails the start with the same message.

namespace {

bool is_flag(const std::string& a) {
  if (a.size() < 2 || a[0] != '-') return false;
  const char c = a[1];
  return !(std::isdigit(static_cast<unsigned char>(c)) || c == '.');  // "-1" is a value
}

// The argument at i with its flag or value: "--seed 2" for either word of it.
std::string with_neighbour(const std::vector<std::string>& v, size_t i) {
  const std::string& a = v[i];
  if (is_flag(a) && a.find('=') == std::string::npos && i + 1 < v.size() && !is_flag(v[i + 1])) {
    return a + " " + v[i + 1];
  }
  if (!is_flag(a) && i > 0 && is_flag(v[i - 1]) && v[i - 1].find('=') == std::string::npos) {
    return v[i - 1] + " " + a;
  }
  return a;
}

}  // namespace

nlohmann::json JobSignature::to_json() const {
  nlohmann::json s = nlohmann::json::array();
  for (const auto& [name, value] : settings) s.push_back({name, value});
  return {{"program", program}, {"args", args}, {"settings", s}};
}

JobSignature JobSignature::from_json(const nlohmann::json& j) {
  JobSignature s;
  s.program = j.at("program").get<std::string>();
  s.args = j.at("args").get<std::vector<std::string>>();
  for (const auto& p : j.at("settings")) {
    s.settings.emplace_back(p.at(0).get<std::string>(), p.at(1).get<std::string>());
  }
  return s;
}

JobSignature job_signature(const RunOptions& o) {
  JobSignature s;
  s.program = std::filesystem::path(o.program).filename().string();
  s.args = o.args;
  const std::string nnodes = o.elastic
                                 ? std::to_string(o.min_nodes) + ":" + std::to_string(o.nnodes)
                                 : std::to_string(o.nnodes);
  std::ostringstream node_timeout, backoff;
  node_timeout << o.node_timeout_s;
  backoff << o.restart_backoff_s;
  s.settings = {{"--nnodes", nnodes},
                {"--max-restarts", std::to_string(o.max_restarts)},
                {"--restart-backoff", backoff.str()},
                {"--timeout", o.timeout.empty() ? "(not set)" : o.timeout},
                {"--node-timeout", node_timeout.str()}};
  return s;
}

std::optional<std::string> signature_difference(const JobSignature& job, const JobSignature& theirs,
                                                const std::string& job_name) {
  if (theirs.program != job.program) {
    return "the program " + theirs.program + " where " + job_name + " runs " + job.program;
  }
  const auto& a = theirs.args;
  const auto& b = job.args;
  const size_t n = std::min(a.size(), b.size());
  size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  const std::string at = " (argument " + std::to_string(i + 1) + " of " + job.program + ")";
  if (i < n)
    return with_neighbour(a, i) + " where " + job_name + " runs " + with_neighbour(b, i) + at;
  if (a.size() > b.size()) {
    return "an extra " + with_neighbour(a, i) + at + ", which " + job_name + " does not give";
  }
  if (b.size() > a.size()) {
    return "the arguments end before " + with_neighbour(b, i) + at + ", which " + job_name +
           " gives";
  }
  for (const auto& [name, value] : theirs.settings) {
    const auto it = std::find_if(job.settings.begin(), job.settings.end(),
                                 [&](const auto& p) { return p.first == name; });
    const std::string other = it == job.settings.end() ? "(no such setting)" : it->second;
    if (value != other) {
      return name + " " + value + " where " + job_name + " runs " + name + " " + other;
    }
  }
  if (theirs.settings.size() != job.settings.size()) {
    return "other launcher settings than " + job_name + "'s (another lockstep version?)";
  }
  return std::nullopt;
}

}  // namespace lockstep::launch
