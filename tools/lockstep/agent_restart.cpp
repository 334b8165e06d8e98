// The agent between generations: Note [Restart backoff]'s wait, node 0's choice of the next
// generation after a failure (who is still here, a newcomer refused, whether the restart counts:
// Note [Membership]), and the one line that says why a generation ended.
#include <poll.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "agent_impl.h"
#include "lockstep/base/error.h"

namespace lockstep::launch::agent_detail {

double Agent::restart_delay() {
  return backoff_.delay_after(
      std::chrono::duration<double>(Clock::now() - generation_started_).count());
}

std::string Agent::restart_delay_text(double delay_s) {
  if (delay_s <= 0) return "";
  std::ostringstream s;
  s << " in " << delay_s << " s";
  return s.str();
}

int Agent::wait_before_restart(double delay_s) {
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(
                         std::chrono::duration<double>(std::max(0.0, delay_s)));
  for (;;) {
    if (const int sig = take_signal()) return sig;
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) return 0;
    pollfd p{sigfd_.get(), POLLIN, 0};
    ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count(), 1000)));
  }
}

bool Agent::next_generation(int g, const json& failure, std::string* why) {
  // Who is gone already: a node found lost, or one that left.
  std::set<int> gone;
  const int failed_node = failure.value("node", -1);
  // Node 0 is never gone: it is this agent (another node found its heartbeat late).
  if ((failure.value("lost", false) || failure.value("left", false)) && failed_node > 0 &&
      failed_node < nnodes_) {
    gone.insert(members_[failed_node].id);
  }
  // A node just admitted whose workers failed before the generation ran with it: it goes, told
  // why, and the others go on as before (a membership change; Note [Membership]).
  if (const auto m = newcomer_failed_at_start(g, failure)) {
    const std::string what = event_text(failure);
    say("node --node-rank " + std::to_string(m->id) + " (host " + m->host + ") joined generation " +
        std::to_string(g) +
        ", but its workers failed before the generation ran with it; it is refused and the job "
        "goes on without it");
    store_->set(gen_key(g + 1, "refused/" + std::to_string(m->id)),
                "its workers failed at the start of generation " + std::to_string(g) +
                    ", before the job ran with them (" + what +
                    "); the job goes on without this node: fix what failed on this machine and "
                    "start it again");
    gone.insert(m->id);
  }
  // The others say they stopped their workers; one that does not within --node-timeout is lost.
  const auto deadline =
      Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(o_.node_timeout_s * 1000));
  std::vector<Member> here;
  for (;;) {
    here.clear();
    bool waiting = false;
    for (const auto& m : members_) {
      if (gone.count(m.id)) continue;
      if (store_->check({gen_key(g, "stopped/" + std::to_string(m.id))})) {
        here.push_back(m);
      } else {
        waiting = true;
      }
    }
    if (!waiting) break;
    if (const int sig = take_signal()) {
      abort_generation(g + 1, {}, "the launcher on node 0 received " + signal_name(sig));
      throw Interrupted(sig);
    }
    if (Clock::now() >= deadline) {
      for (const auto& m : members_) {
        if (gone.count(m.id) ||
            std::any_of(here.begin(), here.end(), [&](const Member& h) { return h.id == m.id; })) {
          continue;
        }
        say("node --node-rank " + std::to_string(m.id) + " (host " + m.host +
            ") did not say it stopped its workers within --node-timeout " +
            seconds_text(o_.node_timeout_s) + " s; it is left out");
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  // The nodes left out: told why before the next generation forms (read in adopt_members), so
  // that one still here learns it now (and, in a fixed job, asks to join again).
  std::string gone_ids;
  for (const auto& m : members_) {
    if (std::any_of(here.begin(), here.end(), [&](const Member& h) { return h.id == m.id; })) {
      continue;
    }
    gone_ids += (gone_ids.empty() ? "" : ", ") + std::to_string(m.id);
    const std::string k = gen_key(g + 1, "refused/" + std::to_string(m.id));
    if (!store_->check({k})) {
      store_->set(k, "node 0 found this node lost (no heartbeat for --node-timeout), or it did "
                     "not say within --node-timeout that it had stopped its workers");
    }
  }
  const size_t before = members_.size();
  const bool gone_now = here.size() < before;
  // From here a replacement for a gone node may take its --node-rank, and the job's end waits
  // only for the nodes still here (exit_sync).
  members_ = here;
  nnodes_ = static_cast<int>(here.size());
  // Note [Membership]: a joining node is never a failure; a node gone is a change of membership
  // in an elastic job, and a failure like any other in a fixed one.
  const bool counts = !failure.value("membership", false) && (!o_.elastic || !gone_now);
  if (counts) {
    if (restarts_used_ >= o_.max_restarts) {
      *why = "no restarts left (--max-restarts " + std::to_string(o_.max_restarts) + ")";
      abort_generation(g + 1, {}, event_text(failure) + "; " + *why);
      return false;
    }
    ++restarts_used_;
    // Note [Restart backoff]: node 0 waits; the other nodes, told how long, wait that much
    // longer for its next generation.
    const double delay = restart_delay();
    say(event_text(failure) + "; restarting the whole group" + restart_delay_text(delay) +
        " (restart " + std::to_string(restarts_used_) + " of " + std::to_string(o_.max_restarts) +
        ")");
    if (gone_now) {
      say("waiting up to --rdzv-timeout " + seconds_text(o_.rdzv_timeout_s) +
          " s for an agent with --node-rank " + gone_ids + " to join again (" + nnodes_text() +
          " needs every node)");
    }
    if (delay > 0) store_->set(gen_key(g + 1, "restart_delay"), dump(json(delay)));
    if (const int sig = wait_before_restart(delay)) {
      abort_generation(g + 1, {}, "the launcher on node 0 received " + signal_name(sig));
      throw Interrupted(sig);
    }
  } else {
    say(event_text(failure));
    if (gone_now) {
      say(std::to_string(before - here.size()) + " node(s) gone; " + std::to_string(here.size()) +
          " remain (a membership change, not counted as a restart)");
    }
  }
  std::vector<Member> next = here;
  next.insert(next.end(), pending_.begin(), pending_.end());
  return form_generation(g + 1, next, why);
}

std::optional<Member> Agent::newcomer_failed_at_start(int g, const json& failure) {
  // Generation 0 has no members from before to go on with; a node lost, leaving, or stopped for
  // a joiner is no failure of its workers.
  // A fixed job cannot go on without the node (Note [Membership]).
  if (!o_.elastic || g == 0 || failure.value("membership", false) || failure.value("left", false) ||
      failure.value("lost", false) || failure.value("interrupted", false)) {
    return std::nullopt;
  }
  const int n = failure.value("node", -1);
  if (n <= 0 || n >= nnodes_ || !newcomers_.count(members_[n].id)) return std::nullopt;
  // "Ran with it": one of its ranks finished a collective of this generation (the final views,
  // published before the workers were stopped: Note [Collective trace]).
  std::vector<RankView> views;
  try {
    views = all_views(g, "final", final_views_);
  } catch (const Error&) {
    return std::nullopt;  // unknown: a failure like any other
  }
  for (const auto& v : views) {
    if (v.node != n || !v.trace) continue;
    const auto& t = *v.trace;
    const bool finished_one =
        t.finished > static_cast<int64_t>(t.records.size()) ||
        std::any_of(t.records.begin(), t.records.end(), [](const dist::TraceRecord& r) {
          return r.state == dist::TraceState::finished;
        });
    if (finished_one) return std::nullopt;
  }
  return members_[n];
}

// One line for every node: why generation g ended.
std::string Agent::event_text(const json& f) const {
  const std::string node = "node " + std::to_string(f.value("node", -1)) + " (host " +
                           f.value("host", std::string("?")) + ")";
  if (f.value("membership", false)) {
    return f.value("status", std::string("a node asks to join")) +
           "; the workers stop for a generation with it (a membership change, not counted as a "
           "restart)";
  }
  if (f.value("left", false) || f.value("lost", false)) {
    return node + " " + f.value("status", std::string("is gone"));
  }
  if (f.value("rank", -1) < 0) {
    return node + " could not start its workers: " + f.value("status", std::string("?"));
  }
  return "rank " + std::to_string(f.value("rank", -1)) + " on " + node + " ended with " +
         f.value("status", std::string("?"));
}

}  // namespace lockstep::launch::agent_detail
