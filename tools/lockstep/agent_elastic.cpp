// The node agent with elastic membership (`lockstep run --nnodes MIN:MAX`): who is in each
// generation, join requests, nodes that leave or are lost, and when a restart counts.
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <set>
#include <sstream>
#include <thread>

#include "agent_impl.h"
#include "job_signature.h"
#include "lockstep/base/error.h"

namespace lockstep::launch::agent_detail {

// Note [Elastic membership]
// With --nnodes MIN:MAX the job runs on whichever machines have joined, from MIN to MAX, and
// each change of membership starts a new generation (new ranks and world size, the workers'
// LOCKSTEP_RESTART_COUNT one higher), as torchrun's elastic agents do. Node 0 (--node-rank 0)
// hosts the store and decides every generation's membership; it must stay for the whole job,
// and when it goes the other nodes lose the store, stop their workers and exit 1. The other
// nodes give distinct --node-rank values above 0: a node's name, and the order of nodes in each
// generation (so rank 0 always runs on node 0, and ranks follow --node-rank order).
//
// Keys, under lockstep/<run-id>/agent/ (beside Note [Agent protocol]'s gen<g>/... keys):
//   join/next              counter: a node that wants in takes ticket t = add(join/next, 1)
//   join/<t>               its request: {id, host, nproc, signature} (Note [Job signature])
//   join/<t>/reply         node 0's answer: {"admitted": g} or {"refused": why}
//   join/<t>/withdrawn     the node stopped waiting for the answer (a signal, its timeout)
//   gen<g>/members         {"nodes": [{id, host, ticket}, ...]} (by id), or {"abort": why}
//   gen<g>/stopped/<id>    after generation g failed: this node has stopped its workers
//   gen<g>/withdrawn/<id>  the node stopped waiting for generation g to start
//   gen<g>/refused/<id>    node 0 left the node out of generation g: why (its workers failed
//                          at the start of g-1, the generation it had just joined)
//   gen<g>/restart_delay   seconds node 0 waits before publishing gen<g>/members after a
//                          failure that counts (Note [Restart backoff]); the others wait longer
//
// A rendezvous (node 0, form_generation): the members it already has, plus join requests as
// they come (each checked: --nproc-per-node must match, and so must the job's signature, Note
// [Job signature] in job_signature.cpp; the --node-rank must be free; a request past MAX is
// refused with the reason); once MIN are in, a last call of --rdzv-last-call seconds for more,
// cut short at MAX; past --rdzv-timeout without MIN, the job fails. While a generation runs,
// node 0 reads join requests at every monitor interval: one that fits stops the generation (a
// `membership` failure record) and the next rendezvous admits it; one past MAX, or one that
// fails a check, is refused at once, and the generation goes on untouched. A ticket whose
// request is not written within --node-timeout (its agent died in between) is skipped; a node
// that withdraws (join/<t>/withdrawn or gen<g>/withdrawn/<id>) is taken out of a rendezvous
// still forming. A node that withdraws
// after its generation was published is found lost by the heartbeat instead.
//
// When a generation fails, every node stops its workers and says so (gen<g>/stopped/<id>).
// Node 0 keeps the nodes that said so within --node-timeout; a node found lost (Note [Stall
// watch]) or that left (a SIGINT/SIGTERM to a node other than node 0: it stops its workers and
// exits, the others go on) is not waited for. A generation that lost a node is a membership
// change, as is one stopped for a joining node: neither counts against --max-restarts. A
// failure after which every node is back counts (torchrun's rule: restarts bound failures).
// Except one: a node new in generation g (admitted for it) whose workers fail before the
// generation ran with it (none of its ranks finished a collective; a program that makes none
// never ran with it either) is refused (gen<g+1>/refused/<id>: why, read by that node, which
// exits 1 saying so), and the others go on as a membership change: a machine that cannot run
// the job (a missing file, a broken device) must not cost the healthy job a restart.
// Fewer than MIN nodes left: the rendezvous waits for joins up to --rdzv-timeout, then fails.
// A signal to node 0 stops the whole job, as without elasticity.

namespace {

std::string nodes_text(const std::vector<Member>& ms) {
  std::string s;
  for (const auto& m : ms) {
    s += (s.empty() ? "" : ", ") + std::to_string(m.id) + " (host " + m.host + ")";
  }
  return s;
}

// adopt_members: node 0 left this node out of the generation (refused, or found lost).
struct LeftOut : AgentError {
  using AgentError::AgentError;
};

std::string seconds_text(double s) {
  std::ostringstream o;
  o << s;
  return o.str();
}

}  // namespace

void Agent::answer_join(const Member& m, const json& reply) {
  store_->set(key("join/" + std::to_string(m.ticket) + "/reply"), dump(reply));
}

std::vector<Member> Agent::take_join_requests(const std::vector<Member>& forming) {
  std::vector<Member> out;
  const int64_t issued = store_->add(key("join/next"), 0);
  while (next_ticket_ <= issued) {
    const std::string k = key("join/" + std::to_string(next_ticket_));
    if (!store_->check({k})) {
      // Its ticket is taken, its request not yet written: wait for it, but not for ever (its
      // agent may have died in between), or every later request would wait behind it.
      if (!unwritten_since_ || unwritten_ticket_ != next_ticket_) {
        unwritten_ticket_ = next_ticket_;
        unwritten_since_ = Clock::now();
      }
      if (std::chrono::duration<double>(Clock::now() - *unwritten_since_).count() <
          o_.node_timeout_s) {
        break;
      }
      ++next_ticket_;
      continue;
    }
    Member m;
    m.ticket = next_ticket_++;
    if (store_->check({key("join/" + std::to_string(m.ticket) + "/withdrawn")})) continue;
    int nproc = -1;
    JobSignature theirs;
    try {
      const json j = json::parse(store_->get_string(k));
      m.id = j.at("id").get<int>();
      m.host = j.at("host").get<std::string>();
      nproc = j.at("nproc").get<int>();
      theirs = JobSignature::from_json(j.at("signature"));
    } catch (const json::exception& e) {
      answer_join(m, {{"refused", std::string("malformed join request: ") + e.what()}});
      continue;
    }
    if (nproc != o_.nproc_per_node) {
      answer_join(m, {{"refused", "nodes disagree on --nproc-per-node: " +
                                      std::to_string(o_.nproc_per_node) + " on node 0, " +
                                      std::to_string(nproc) + " on the node that asks to join"}});
      continue;
    }
    // Note [Job signature]: another program, argument or shared setting is refused before it
    // can fail the job or train it wrong.
    if (const auto diff = signature_difference(job_signature(o_), theirs, "the job")) {
      say("refused node --node-rank " + std::to_string(m.id) + " (host " + m.host +
          "): its command differs from the job's: " + *diff);
      answer_join(m, {{"refused", "this node's command differs from the job's: " + *diff +
                                      "; start it with the job's program, arguments and "
                                      "launcher settings (what differs between machines "
                                      "belongs in the environment)"}});
      continue;
    }
    auto taken = [&](const std::vector<Member>& v) {
      return std::find_if(v.begin(), v.end(), [&](const Member& o) { return o.id == m.id; });
    };
    const Member* holder = nullptr;
    if (auto it = taken(members_); it != members_.end()) holder = &*it;
    if (auto it = taken(pending_); it != pending_.end()) holder = &*it;
    if (auto it = taken(out); it != out.end()) holder = &*it;
    if (auto it = taken(forming); it != forming.end()) holder = &*it;
    if (holder != nullptr) {
      answer_join(m, {{"refused", "another agent already joined as --node-rank " +
                                      std::to_string(m.id) + " (host " + holder->host +
                                      "); every machine needs its own --node-rank (0 is "
                                      "node 0's, which hosts the store)"}});
      continue;
    }
    out.push_back(m);
  }
  return out;
}

void Agent::refuse_waiting_joins(const std::string& why) {
  try {
    for (const auto& m : take_join_requests()) answer_join(m, {{"refused", why}});
    for (const auto& m : pending_) answer_join(m, {{"refused", why}});
    pending_.clear();
  } catch (const Error&) {
  }
}

namespace {

std::string full_text(const Member& m, int nnodes, int min_nodes) {
  return "the job already has " + std::to_string(nnodes) + " nodes, the most --nnodes " +
         std::to_string(min_nodes) + ":" + std::to_string(nnodes) + " allows; node --node-rank " +
         std::to_string(m.id) + " (host " + m.host + ") was not admitted";
}

}  // namespace

void Agent::admit_while_running(int g, bool ending) {
  for (const auto& m : take_join_requests()) {
    if (members_.size() + pending_.size() >= static_cast<size_t>(o_.nnodes)) {
      say("refused node --node-rank " + std::to_string(m.id) + " (host " + m.host +
          "): the job already has its most nodes (" + std::to_string(o_.nnodes) + ")");
      answer_join(m, {{"refused", full_text(m, o_.nnodes, o_.min_nodes)}});
      continue;
    }
    if (ending) {  // restarting a job whose node 0 is done would redo its last steps for nothing
      say("refused node --node-rank " + std::to_string(m.id) + " (host " + m.host +
          "): the job is ending");
      answer_join(m, {{"refused", "the job is ending (node 0's workers have finished)"}});
      continue;
    }
    pending_.push_back(m);
    const std::string why =
        "node --node-rank " + std::to_string(m.id) + " (host " + m.host + ") asks to join";
    store_->compare_set(gen_key(g, "failure"), "",
                        dump({{"membership", true},
                              {"node", -1},
                              {"rank", -1},
                              {"joining", m.id},
                              {"host", m.host},
                              {"status", why},
                              {"time", utc_now()}}));
  }
}

void Agent::drop_withdrawn(int g, std::vector<Member>& members) {
  for (auto it = members.begin(); it != members.end();) {
    const bool gone = it->id != 0 &&
                      (store_->check({gen_key(g, "withdrawn/" + std::to_string(it->id))}) ||
                       (it->ticket > 0 &&
                        store_->check({key("join/" + std::to_string(it->ticket) + "/withdrawn")})));
    if (gone) {
      say("node --node-rank " + std::to_string(it->id) + " (host " + it->host +
          ") withdrew before generation " + std::to_string(g) + " started");
      it = members.erase(it);
    } else {
      ++it;
    }
  }
}

bool Agent::form_generation(int g, std::vector<Member> members, std::string* why) {
  const auto deadline =
      Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(o_.rdzv_timeout_s * 1000));
  std::optional<Clock::time_point> last_call;
  for (;;) {
    for (const auto& m : take_join_requests(members)) {
      if (members.size() >= static_cast<size_t>(o_.nnodes)) {
        answer_join(m, {{"refused", full_text(m, o_.nnodes, o_.min_nodes)}});
      } else {
        members.push_back(m);
      }
    }
    drop_withdrawn(g, members);
    const auto now = Clock::now();
    if (members.size() >= static_cast<size_t>(o_.nnodes)) break;
    if (members.size() >= static_cast<size_t>(o_.min_nodes)) {
      if (!last_call) {
        // Not past the rendezvous deadline: MIN are in, so the deadline ends the wait for more.
        last_call = std::min(deadline, now + std::chrono::milliseconds(
                                                 static_cast<int64_t>(o_.rdzv_last_call_s * 1000)));
        if (o_.rdzv_last_call_s > 0) {
          say(std::to_string(members.size()) + " of --nnodes " + std::to_string(o_.min_nodes) +
              ":" + std::to_string(o_.nnodes) + " nodes are in; waiting " +
              seconds_text(o_.rdzv_last_call_s) + " s for more (--rdzv-last-call)");
        }
      }
      if (now >= *last_call) break;
    }
    if (now >= deadline) {
      *why = "rendezvous timed out after " + seconds_text(o_.rdzv_timeout_s) +
             " s: " + std::to_string(members.size()) + " node(s) in (" + nodes_text(members) +
             "), --nnodes " + std::to_string(o_.min_nodes) + ":" + std::to_string(o_.nnodes) +
             " needs at least " + std::to_string(o_.min_nodes);
      store_->set(gen_key(g, "members"), dump({{"abort", *why}}));
      for (const auto& m : members) {
        if (m.ticket > 0) answer_join(m, {{"admitted", g}});  // they read the abort there
      }
      return false;
    }
    if (const int sig = take_signal()) {
      store_->set(gen_key(g, "members"),
                  dump({{"abort", "the launcher on node 0 received " + signal_name(sig)}}));
      for (const auto& m : members) {
        if (m.ticket > 0) answer_join(m, {{"admitted", g}});
      }
      throw Interrupted(sig);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::sort(members.begin(), members.end(),
            [](const Member& a, const Member& b) { return a.id < b.id; });
  json nodes = json::array();
  for (const auto& m : members) nodes.push_back(m.to_json());
  store_->set(gen_key(g, "members"), dump({{"nodes", nodes}, {"restarts_used", restarts_used_}}));
  for (const auto& m : members) {
    if (m.ticket > 0 && admitted_.insert(m.ticket).second) answer_join(m, {{"admitted", g}});
  }
  pending_.clear();
  return true;
}

void Agent::wait_for_node_zero(const std::string& k, const std::string& withdrawn,
                               const std::string& what, const std::string& delay_key,
                               const std::function<void()>& recheck) {
  // Node 0 may first have to stop a running generation (a stop grace, a kill wait and the
  // verdict's wait) and hear from the nodes: that on top of the rendezvous.
  double wait_s = o_.rdzv_timeout_s + o_.node_timeout_s + kAnswerMargin.count();
  std::string bound =
      "--rdzv-timeout + --node-timeout + " + std::to_string(kAnswerMargin.count()) + " s";
  auto deadline = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(wait_s * 1000));
  bool delay_read = delay_key.empty();
  auto withdraw = [&] {
    if (withdrawn.empty()) return;
    try {
      store_->set(withdrawn, "1");
    } catch (const Error&) {
    }
  };
  while (!store_->check({k})) {
    if (const int sig = take_signal()) {
      withdraw();
      throw Interrupted(sig);
    }
    if (recheck) {
      try {
        recheck();
      } catch (const AgentError&) {
        withdraw();
        throw;
      }
    }
    // Note [Restart backoff]: node 0 says how long it waits before the generation, and this
    // node waits that much longer.
    if (!delay_read) {
      if (const auto text = try_get(delay_key)) {
        delay_read = true;
        double delay_s = 0;
        try {
          delay_s = std::max(0.0, json::parse(*text).get<double>());
        } catch (const json::exception&) {
        }
        wait_s += delay_s;
        bound += " + node 0's restart backoff of " + seconds_text(delay_s) + " s";
        deadline += std::chrono::milliseconds(static_cast<int64_t>(delay_s * 1000));
      }
    }
    if (Clock::now() >= deadline) {
      withdraw();
      throw AgentError(what + " within " + seconds_text(wait_s) + " s (" + bound + ")");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

void Agent::adopt_members(int g) {
  const std::string k = gen_key(g, "members");
  // A node that stops waiting says so, so that node 0 does not start a generation with it.
  wait_for_node_zero(
      k, o_.node_rank == 0 ? "" : gen_key(g, "withdrawn/" + std::to_string(o_.node_rank)),
      "node 0 did not start generation " + std::to_string(g), gen_key(g, "restart_delay"));
  const json j = json::parse(store_->get_string(k));
  if (j.contains("abort")) throw AgentError("the job failed: " + j["abort"].get<std::string>());
  std::vector<Member> ms;
  for (const auto& n : j.at("nodes")) ms.push_back(Member::from_json(n));
  const auto me =
      std::find_if(ms.begin(), ms.end(), [&](const Member& m) { return m.id == o_.node_rank; });
  if (me == ms.end()) {
    if (auto refused = try_get(gen_key(g, "refused/" + std::to_string(o_.node_rank)))) {
      throw LeftOut("node 0 refused this node: " + *refused);
    }
    throw LeftOut("node 0 left this node (--node-rank " + std::to_string(o_.node_rank) +
                  ") out of generation " + std::to_string(g) + " (" + nodes_text(ms) +
                  "): it found this node lost (no heartbeat for --node-timeout), or this "
                  "node did not say in time that it had stopped its workers");
  }
  restarts_used_ = j.value("restarts_used", restarts_used_);
  newcomers_.clear();
  for (const auto& m : ms) {
    if (std::none_of(members_.begin(), members_.end(),
                     [&](const Member& o) { return o.id == m.id; })) {
      newcomers_.insert(m.id);
    }
  }
  members_ = std::move(ms);
  nnodes_ = static_cast<int>(members_.size());
  node_rank_ = static_cast<int>(me - members_.begin());
  if (o_.node_rank == 0) {
    say("generation " + std::to_string(g) + ": " + std::to_string(nnodes_) + " node(s) by " +
        "--node-rank: " + nodes_text(members_) + "; world size " + std::to_string(world_size()));
  } else {
    say("generation " + std::to_string(g) + ": this machine is node " + std::to_string(node_rank_) +
        " of " + std::to_string(nnodes_) + " (ranks " +
        std::to_string(node_rank_ * o_.nproc_per_node) + " to " +
        std::to_string((node_rank_ + 1) * o_.nproc_per_node - 1) + "); world size " +
        std::to_string(world_size()));
  }
}

int Agent::join_job() {
  // A node 0 of fixed size (Note [Agent protocol]) writes node0/host as soon as its store is up,
  // and would never answer a join request: looked at before asking and while waiting, since this
  // node may have reached the store a moment before node 0 wrote it.
  const auto fixed_size_node_zero = [&] {
    if (store_->check({key("node0/host")})) {
      throw AgentError(
          "node 0 runs a job of a fixed size (--nnodes N), not an elastic one: give "
          "this node node 0's --nnodes");
    }
  };
  fixed_size_node_zero();
  const int64_t t = store_->add(key("join/next"), 1);
  const json request = {{"id", o_.node_rank},
                        {"host", hostname()},
                        {"nproc", o_.nproc_per_node},
                        {"signature", job_signature(o_).to_json()}};
  store_->set(key("join/" + std::to_string(t)), dump(request));
  const std::string k = key("join/" + std::to_string(t) + "/reply");
  wait_for_node_zero(k, key("join/" + std::to_string(t) + "/withdrawn"),
                     "node 0 did not admit this node", "", fixed_size_node_zero);
  const json reply = json::parse(store_->get_string(k));
  if (reply.contains("refused")) {
    throw AgentError("node 0 refused this node: " + reply["refused"].get<std::string>());
  }
  return reply.at("admitted").get<int>();
}

void Agent::publish_leaving(int g, int sig) {
  try {
    store_->compare_set(
        gen_key(g, "failure"), "",
        dump({{"left", true},
              {"node", node_rank_},
              {"rank", -1},
              {"id", o_.node_rank},
              {"host", hostname()},
              {"signal", signal_name(sig)},
              {"status", "left the job (its launcher received " + signal_name(sig) + ")"},
              {"time", utc_now()}}));
  } catch (const Error&) {
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
  // why, and the others go on as before (a membership change; Note [Elastic membership]).
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
      store_->set(gen_key(g + 1, "members"),
                  dump({{"abort", "the launcher on node 0 received " + signal_name(sig)}}));
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
  const bool membership = failure.value("membership", false) || here.size() < members_.size();
  if (!membership) {
    if (restarts_used_ >= o_.max_restarts) {
      *why = "no restarts left (--max-restarts " + std::to_string(o_.max_restarts) + ")";
      store_->set(gen_key(g + 1, "members"), dump({{"abort", event_text(failure) + "; " + *why}}));
      return false;
    }
    ++restarts_used_;
    // Note [Restart backoff]: node 0 waits; the other nodes, told how long, wait that much
    // longer for its next generation.
    const double delay = restart_delay();
    say("restarting the workers of every node" + restart_delay_text(delay) + " (restart " +
        std::to_string(restarts_used_) + " of " + std::to_string(o_.max_restarts) + ")");
    if (delay > 0) store_->set(gen_key(g + 1, "restart_delay"), dump(json(delay)));
    if (const int sig = wait_before_restart(delay)) {
      store_->set(gen_key(g + 1, "members"),
                  dump({{"abort", "the launcher on node 0 received " + signal_name(sig)}}));
      throw Interrupted(sig);
    }
  } else if (here.size() < members_.size()) {
    say(std::to_string(members_.size() - here.size()) + " node(s) gone; " +
        std::to_string(here.size()) + " remain (a membership change, not counted as a restart)");
  }
  // From here a replacement for a gone node may take its --node-rank, and the job's end waits
  // only for the nodes still here (exit_sync).
  members_ = here;
  nnodes_ = static_cast<int>(here.size());
  std::vector<Member> next = here;
  next.insert(next.end(), pending_.begin(), pending_.end());
  return form_generation(g + 1, next, why);
}

std::optional<Member> Agent::newcomer_failed_at_start(int g, const json& failure) {
  // Generation 0 has no members from before to go on with; a node lost, leaving, or stopped for
  // a joiner is no failure of its workers.
  if (g == 0 || failure.value("membership", false) || failure.value("left", false) ||
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

int Agent::elastic_rendezvous() {
  int g = 0;
  if (o_.node_rank == 0) {
    std::string why;
    if (!form_generation(0, {Member{0, hostname(), 0}}, &why)) throw AgentError(why);
  } else {
    g = join_job();
  }
  adopt_members(g);
  return g;
}

int Agent::run_elastic(int g) {
  const bool host = o_.node_rank == 0;
  for (;;) {
    GenResult r = run_generation(g);
    switch (r.outcome) {
      case Outcome::kSucceeded:
        if (host) refuse_waiting_joins("the job has finished");
        exit_sync(normal_exit_wait());
        return kExitOk;
      case Outcome::kInterrupted:
        if (host) refuse_waiting_joins("the job was stopped");
        if (host) exit_sync(kExitSyncAfterSignal);  // a node that leaves just goes
        return 128 + r.signal;
      case Outcome::kStoreLost:
        say("lost node 0's store at " + o_.master_addr + ":" + std::to_string(store_port_) +
            " (its launcher exited or the network failed; node 0 must stay for the whole job): " +
            r.why + "; workers stopped");
        return kExitJobFailed;
      case Outcome::kFailed:
        break;
    }
    if (const int sig = take_signal()) {  // a Ctrl-C while the failed group was being stopped
      if (host) {
        publish_interrupted(g + 1, sig);
        store_->set(gen_key(g + 1, "members"),
                    dump({{"abort", "the launcher on node 0 received " + signal_name(sig)}}));
        refuse_waiting_joins("the job was stopped");
      }
      say("received " + signal_name(sig) + "; not restarting");
      if (host) exit_sync(kExitSyncAfterSignal);
      return 128 + sig;
    }
    if (r.failure.value("interrupted", false)) {  // node 0 was told to stop the job
      print_summary(r.failure, restarts_used_);
      if (host) refuse_waiting_joins("the job was stopped");
      exit_sync(kExitSyncAfterSignal);
      return kExitJobFailed;
    }
    say(event_text(r.failure));
    try {
      store_->set(gen_key(g, "stopped/" + std::to_string(o_.node_rank)), "1");
      if (host) {
        std::string why;
        if (!next_generation(g, r.failure, &why)) {
          print_summary(r.failure, restarts_used_);
          print_peak_memory();
          say("not restarting: " + why);
          refuse_waiting_joins("the job failed");
          exit_sync(normal_exit_wait());
          return kExitJobFailed;
        }
      }
      ++g;
      adopt_members(g);
    } catch (const Interrupted& e) {
      say(std::string(e.what()) + " while restarting; not restarting");
      if (host) {
        refuse_waiting_joins("the job was stopped");
        exit_sync(kExitSyncAfterSignal);  // the others read the abort, not a lost store
      }
      return 128 + e.signal;
    } catch (const AgentError& e) {
      print_summary(r.failure, restarts_used_);
      say(e.what());
      // An aborted job: node 0 need not wait for this node at the end. A node left out is no
      // member: its count would let node 0 end before a member that is still running.
      if (dynamic_cast<const LeftOut*>(&e) == nullptr) exit_sync(kExitSyncAfterSignal);
      return kExitJobFailed;
    } catch (const Error& e) {
      say("lost node 0's store while restarting: " + e.message());
      return kExitJobFailed;
    }
  }
}

}  // namespace lockstep::launch::agent_detail
