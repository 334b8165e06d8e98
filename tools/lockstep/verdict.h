// The launcher's verdict: from every rank's collective trace and process state, one line that
// says which rank holds the job up and why (Note [Verdict]), and the per-rank details after it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lockstep/distributed/trace.h"

namespace lockstep::launch {

// What the agents know of one rank: its process (read from /proc by its node's agent) and its
// trace (read from the file its worker maps, Note [Collective trace]).
struct RankView {
  int rank = -1;
  int node = -1;
  std::string host;
  // "running", "stopped" (state T or t), "exited", or "unknown" (not started, or its node did
  // not answer).
  std::string process = "unknown";
  std::string process_detail;    // "state T", "killed by SIGKILL", "exit code 1"
  int64_t process_since_ns = 0;  // stopped or exited since (0: unknown)
  std::optional<dist::TraceSnapshot> trace;
  std::string no_trace;  // why trace is empty ("it has not initialized its process group yet")
};

struct Verdict {
  std::string line;      // empty: nobody waits in a collective and no rank is stopped
  int64_t seq = 0;       // the collective some ranks wait in (0: none)
  double waited_s = 0;   // how long the longest of them has waited
  bool culprit = false;  // the line names a rank at fault (not only "every rank issued it")
};

// Note [Verdict]
// The collective #K to explain is the oldest one a rank has issued but not finished (pending,
// or failed at its timeout). Then, in order:
// - ranks whose trace stops before #K never issued it: they are named, with the last collective
//   they finished and their process state ("rank 1 never issued all_reduce #8 (it last finished
//   broadcast #7 at 12:00:03; it is stopped (state T) since 12:00:01); ranks 0,2,3 waited 300 s
//   in all_reduce #8");
// - ranks that issued different #K (kind, dtype, size, root or op): both sides are named;
// - a stopped or exited rank is named;
// - otherwise every rank issued #K and it does not finish: the transport (a lost link) is named.
// With no rank waiting, a stopped rank is still named. The same views give the same line on
// every node.
Verdict judge(const std::vector<RankView>& ranks, int64_t now_ns);

// One line per rank after the verdict: process state and its last `last_n` collectives.
std::vector<std::string> rank_details(const std::vector<RankView>& ranks, int64_t now_ns,
                                      int last_n = 3);

// "12:00:03" (UTC) of a trace time.
std::string clock_text(int64_t ns);

// What the agents exchange through the store.
nlohmann::json to_json(const RankView& v);
RankView rank_view_from_json(const nlohmann::json& j);

}  // namespace lockstep::launch
