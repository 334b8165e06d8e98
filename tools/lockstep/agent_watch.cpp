// The agent's stall watch: its ranks' views (process states, collective traces), the heartbeat
// that notices a lost node, the warning and the verdict (Note [Stall watch]).
#include <algorithm>
#include <filesystem>
#include <sstream>
#include <thread>

#include "agent_impl.h"
#include "lockstep/base/error.h"

namespace lockstep::launch::agent_detail {

// Note [Stall watch]
// Every few seconds (kMaxWatchInterval at most) each agent reads its workers' states from /proc
// and their collective traces from the files they map (Note [Collective trace]), and publishes
// them under gen<g>/view/node<n>: that is also its heartbeat. Every agent reads the other
// nodes' views; one that has not changed for --node-timeout means that node's agent (its
// machine, or the link to it) is gone, and the job fails naming it, on node 0 as on the others
// (a node that loses node 0 notices through its store requests, within the same bound). Node 0
// judges the views (Note [Verdict] in verdict.h): when some ranks have waited in a collective
// for --stall-timeout, or a rank has been stopped that long, it prints the verdict as a warning,
// once per verdict, and stops nothing; the job fails only at the collective timeout. After a
// failure every agent publishes its final views (captured before stopping its workers, so a
// stopped rank still reads as stopped) under gen<g>/final/node<n>, and each prints the verdict
// first in its summary. SIGUSR1 to an agent prints the same, at once.
std::optional<std::string> Agent::try_get(const std::string& k) {
  if (!store_->check({k})) return std::nullopt;
  return store_->get_string(k);
}

void Agent::observe_processes() {
  const int64_t now = dist::trace_now_ns();
  for (auto& w : workers_) {
    if (w->proc->exit_status()) {
      if (w->exited_ns == 0) w->exited_ns = now;
      continue;
    }
    const char s = process_state(w->proc->pid());
    if (s == 'T' || s == 't') {
      if (w->stopped_since_ns == 0) w->stopped_since_ns = now;
    } else {
      w->stopped_since_ns = 0;
    }
  }
}

RankView Agent::view_of(const Worker& w) const {
  RankView v;
  v.rank = w.rank;
  v.node = node_rank_;
  v.host = hostname();
  if (const auto& st = w.proc->exit_status()) {
    v.process = "exited";
    v.process_detail = st->str();
    v.process_since_ns = w.exited_ns;
  } else {
    const char s = process_state(w.proc->pid());
    if (s == 'T' || s == 't') {
      v.process = "stopped";
      v.process_detail = std::string("state ") + s;
      v.process_since_ns = w.stopped_since_ns ? w.stopped_since_ns : dist::trace_now_ns();
    } else if (s != 0) {
      v.process = "running";
    }
  }
  std::string why;
  v.trace = dist::read_trace_file(w.trace_file, &why);
  if (!v.trace) {
    v.no_trace = std::filesystem::exists(w.trace_file)
                     ? why
                     : "it has not created its process group (init_process_group)";
  }
  return v;
}

json Agent::local_views() const {
  json views = json::array();
  for (const auto& w : workers_) views.push_back(to_json(view_of(*w)));
  return views;
}

std::vector<RankView> Agent::all_views(int g, const std::string& kind, const json& mine) {
  std::vector<RankView> out(static_cast<size_t>(world_size()));
  for (int r = 0; r < world_size(); ++r) {
    out[r].rank = r;
    out[r].node = r / o_.nproc_per_node;
    out[r].no_trace = "node " + std::to_string(out[r].node) + " has not reported";
  }
  auto take = [&](const json& views) {
    for (const auto& j : views) {
      RankView v = rank_view_from_json(j);
      if (v.rank >= 0 && v.rank < world_size()) out[v.rank] = std::move(v);
    }
  };
  for (int n = 0; n < nnodes_; ++n) {
    if (n == node_rank_) {
      take(mine);
      continue;
    }
    try {
      if (auto text = try_get(gen_key(g, kind + "/node" + std::to_string(n)))) {
        take(json::parse(*text).value("views", json::array()));
      }
    } catch (const json::exception&) {
    }
  }
  return out;
}

std::optional<json> Agent::watch(int g) {
  const json mine = local_views();
  store_->set(gen_key(g, "view/node" + std::to_string(node_rank_)),
              dump({{"beat", ++beat_}, {"views", mine}}));
  const auto now = Clock::now();
  // Another node's view that has not changed for --node-timeout: its agent is gone.
  for (int n = 0; n < nnodes_; ++n) {
    if (n == node_rank_) continue;
    const std::string text =
        try_get(gen_key(g, "view/node" + std::to_string(n))).value_or(std::string());
    auto it = heard_.find(n);
    if (it == heard_.end() || it->second.first != text) {
      heard_[n] = {text, now};
      continue;
    }
    const double silent = std::chrono::duration<double>(now - it->second.second).count();
    if (silent < o_.node_timeout_s) continue;
    const std::string host = host_of(n);
    std::ostringstream why;
    why.precision(0);
    why << std::fixed << "lost: its launcher has not been heard from for " << silent
        << " s (--node-timeout " << o_.node_timeout_s << " s); its machine, its launcher or the "
        << "network between it and node " << node_rank_ << " failed";
    return json{
        {"rank", -1},          {"node", n},         {"host", host},           {"lost", true},
        {"status", why.str()}, {"time", utc_now()}, {"seen_by", node_rank_}};
  }
  if (node_rank_ != 0 || o_.stall_timeout_s <= 0) return std::nullopt;
  const auto views = all_views(g, "view", mine);
  const int64_t now_ns = dist::trace_now_ns();
  const Verdict v = judge(views, now_ns);
  if (v.line.empty()) {
    warned_.clear();
    return std::nullopt;
  }
  double stalled = v.waited_s;
  for (const auto& r : views) {
    if (r.process == "stopped" && r.process_since_ns) {
      stalled = std::max(stalled, static_cast<double>(now_ns - r.process_since_ns) / 1e9);
    }
  }
  // One warning per collective and culprit: the seconds in the line change at every look.
  const std::string which = std::to_string(v.seq) + ":" + v.line.substr(0, v.line.find(" ("));
  if (stalled >= o_.stall_timeout_s && which != warned_) {
    warned_ = which;
    say("warning: " + v.line + " (the job goes on; it fails when the collective times out" +
        (o_.timeout.empty() ? std::string() : ", after --timeout " + o_.timeout + " s") +
        "; kill -USR1 " + std::to_string(::getpid()) + " prints every rank's state)");
  }
  return std::nullopt;
}

void Agent::report_now(int g) {
  report_requested_ = false;
  const json mine = local_views();
  try {
    store_->set(gen_key(g, "view/node" + std::to_string(node_rank_)),
                dump({{"beat", ++beat_}, {"views", mine}}));
  } catch (const Error&) {
  }
  const auto views = all_views(g, "view", mine);
  const int64_t now_ns = dist::trace_now_ns();
  const Verdict v = judge(views, now_ns);
  std::string text = "state of the job at " + clock_text(now_ns) +
                     " (SIGUSR1): " + (v.line.empty() ? "no rank waits in a collective" : v.line);
  for (const auto& d : rank_details(views, now_ns)) text += "\n  " + d;
  say(text);
}

void Agent::publish_final_views(int g) {
  observe_processes();
  final_views_ = local_views();
  try {
    store_->set(gen_key(g, "final/node" + std::to_string(node_rank_)),
                dump({{"views", final_views_}}));
  } catch (const Error&) {
  }
}

void Agent::judge_failure(int g) {
  verdict_lines_.clear();
  try {
    std::vector<std::string> keys;
    for (int n = 0; n < nnodes_; ++n)
      keys.push_back(gen_key(g, "final/node" + std::to_string(n)));
    const auto deadline = Clock::now() + kFinalViewWait;
    while (!store_->check(keys) && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  } catch (const Error&) {
  }
  std::vector<RankView> views;
  try {
    views = all_views(g, "final", final_views_);
  } catch (const Error&) {
    return;
  }
  const int64_t now_ns = dist::trace_now_ns();
  const Verdict v = judge(views, now_ns);
  if (v.line.empty()) return;
  verdict_lines_.push_back("verdict: " + v.line);
  for (const auto& d : rank_details(views, now_ns)) verdict_lines_.push_back("  " + d);
}

}  // namespace lockstep::launch::agent_detail
