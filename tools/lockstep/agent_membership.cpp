// Who is in each generation (Note [Membership]): join requests, node 0 forming a generation and
// answering joins while one runs, a node withdrawing or leaving. The first rendezvous, joining and
// adopting a generation are in agent_rendezvous.cpp, the loop of generations in agent.cpp, the
// next generation after a failure in agent_restart.cpp.
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "agent_impl.h"
#include "job_signature.h"
#include "lockstep/base/error.h"

namespace lockstep::launch::agent_detail {

// Note [Membership]
// With --nnodes MIN:MAX the job runs on whichever machines have joined, from MIN to MAX, and
// each change of membership starts a new generation (new ranks and world size, the workers'
// LOCKSTEP_RESTART_COUNT one higher), as torchrun's elastic agents do. Node 0 (--node-rank 0)
// hosts the store and decides every generation's membership; it must stay for the whole job,
// and when it goes the other nodes lose the store, stop their workers and exit 1. The other
// nodes give distinct --node-rank values above 0: a node's name, and the order of nodes in each
// generation (so rank 0 always runs on node 0, and ranks follow --node-rank order).
//
// Keys, under lockstep/<run-id>/agent/ (beside Note [Agent protocol]'s):
//   join/next              counter: a node that wants in takes ticket t = add(join/next, 1)
//   join/<t>               its request: {id, host, nproc, signature} (Note [Job signature])
//   join/<t>/reply         node 0's answer: {"admitted": g} or {"refused": why}, with
//                          "fatal": true when the job cannot start (a fixed job's refusal)
//   join/<t>/withdrawn     the node stopped waiting for the answer (a signal, its timeout)
//   join/<t>/told          the node read that the job cannot start (a fatal refusal, or an
//                          abort of the generation it was admitted to); node 0 waits for it
//   gen<g>/members         {"nodes": [{id, host, ticket}, ...]} (by id), or {"abort": why}
//   gen<g>/stopped/<id>    after generation g failed: this node has stopped its workers
//   gen<g>/withdrawn/<id>  the node stopped waiting for generation g to start
//   gen<g>/refused/<id>    node 0 left the node out of generation g: why (found lost, late to
//                          say it stopped, or, elastic, its workers failed at the start of
//                          g-1, the generation it had just joined)
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
// still forming. A node that withdraws after its generation was published is found lost by the
// heartbeat instead.
//
// When a generation fails, every node stops its workers and says so (gen<g>/stopped/<id>).
// Node 0 keeps the nodes that said so within --node-timeout; a node found lost (Note [Stall
// watch]) or that left (a SIGINT/SIGTERM to a node other than node 0: it stops its workers and
// exits, the others go on) is not waited for. Node 0 tells each node it leaves out why
// (gen<g+1>/refused/<id>) before the next generation forms, so that one still running (only
// slow) learns it while it waits rather than after. A generation that lost a node is a membership
// change, as is one stopped for a joining node: neither counts against --max-restarts. A
// failure after which every node is back counts (torchrun's rule: restarts bound failures).
// Except one, in an elastic job: a node new in generation g (admitted for it) whose workers
// fail before the generation ran with it (none of its ranks finished a collective; a program
// that makes none never ran with it either) is refused (gen<g+1>/refused/<id>: why, read by
// that node, which exits 1 saying so), and the others go on as a membership change: a machine
// that cannot run the job (a missing file, a broken device) must not cost the healthy job a
// restart.
// Fewer than MIN nodes left: the rendezvous waits for joins up to --rdzv-timeout, then fails.
// A signal to node 0 stops the whole job.
//
// A job of fixed size (--nnodes N) runs the same protocol as one of MIN = MAX = N, through the
// same loop (run_generations in agent.cpp), with a policy that keeps it what the user asked for:
// a job that stops rather than changes. Every node's signal stops the job (an `interrupted`
// record; no node leaves). A node that runs another command or another version fails the start
// for every node, saying what differs (elastic: it is refused and the job goes on). A node that
// withdraws from a rendezvous (a signal while it waits) aborts it; one stopped while node 0
// publishes the generation also writes that generation's `interrupted` record. A node found lost
// (or late to say it stopped) is a failure like a worker's: it counts against --max-restarts, and
// the restart waits up to --rdzv-timeout for an agent with that --node-rank to join again: the
// node itself, if it was only slow (told it was left out, it asks to join again with a new
// ticket; members are matched by --node-rank and ticket, so an agent whose place another took is
// no member), or a new one. A new agent that asks while the old one is still a member is refused
// (its --node-rank is taken); it is admitted once node 0 has found the old one lost.

void Agent::answer_join(const Member& m, const json& reply) {
  store_->set(key("join/" + std::to_string(m.ticket) + "/reply"), dump(reply));
}

std::vector<Member> Agent::take_join_requests(const std::vector<Member>& forming,
                                              std::string* fatal) {
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
    m.id = -1;
    m.ticket = next_ticket_++;
    if (store_->check({key("join/" + std::to_string(m.ticket) + "/withdrawn")})) continue;
    // The start already failed (a fixed job): every request read with it gets the same answer.
    if (fatal != nullptr && !fatal->empty()) {
      answer_join(m, {{"refused", *fatal}, {"fatal", true}});
      told_.push_back(m.ticket);
      continue;
    }
    // A fixed job cannot start without this node: the refusal ends its rendezvous, and every
    // node says the same (Note [Membership]); node 0 waits for the node to have read it.
    const auto refuse_fatally = [&](const std::string& why) {
      answer_join(m, {{"refused", why}, {"fatal", true}});
      told_.push_back(m.ticket);
      *fatal = why;
    };
    int nproc = -1;
    JobSignature theirs;
    try {
      const json j = json::parse(store_->get_string(k));
      if (j.is_object()) m.id = j.value("id", -1);
      m.host = j.at("host").get<std::string>();
      nproc = j.at("nproc").get<int>();
      theirs = JobSignature::from_json(j.at("signature"));
    } catch (const json::exception& e) {
      const std::string what = std::string("malformed (another lockstep version?): ") + e.what();
      if (fatal == nullptr) {
        answer_join(m, {{"refused", "its join request is " + what}});
        continue;
      }
      refuse_fatally((m.id >= 0 ? "node " + std::to_string(m.id) + "'s join request"
                                : std::string("a join request")) +
                     " is " + what + "; run the same lockstep version on every machine");
      continue;
    }
    if (nproc != o_.nproc_per_node) {
      const std::string why = "nodes disagree on --nproc-per-node: " +
                              std::to_string(o_.nproc_per_node) + " on node 0, " +
                              std::to_string(nproc);
      if (fatal == nullptr) {
        answer_join(m, {{"refused", why + " on the node that asks to join"}});
        continue;
      }
      refuse_fatally(why + " on node " + std::to_string(m.id) + " (host " + m.host + ")");
      continue;
    }
    // Note [Job signature]: another program, argument or shared setting is refused before it
    // can fail the job or train it wrong.
    const char* const label = fatal == nullptr ? "the job" : "node 0";
    if (const auto diff = signature_difference(job_signature(o_), theirs, label)) {
      if (fatal != nullptr) {
        refuse_fatally("node " + std::to_string(m.id) + " (host " + m.host +
                           ") runs another command than node 0: " + *diff +
                           "; start every machine with the same program, arguments and "
                           "launcher settings (what differs between machines belongs in the "
                           "environment)");
        continue;
      }
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

std::string Agent::full_text(const Member& m) const {
  return "the job already has " + std::to_string(o_.nnodes) + " nodes, the most " + nnodes_text() +
         " allows; node --node-rank " + std::to_string(m.id) + " (host " + m.host +
         ") was not admitted";
}

void Agent::admit_while_running(int g, bool ending) {
  for (const auto& m : take_join_requests()) {
    if (members_.size() + pending_.size() >= static_cast<size_t>(o_.nnodes)) {
      say("refused node --node-rank " + std::to_string(m.id) + " (host " + m.host +
          "): the job already has its most nodes (" + std::to_string(o_.nnodes) + ")");
      answer_join(m, {{"refused", full_text(m)}});
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

std::string Agent::drop_withdrawn(int g, std::vector<Member>& members) {
  std::string said;
  for (auto it = members.begin(); it != members.end();) {
    const bool gone = it->id != 0 &&
                      (store_->check({gen_key(g, "withdrawn/" + std::to_string(it->id))}) ||
                       (it->ticket > 0 &&
                        store_->check({key("join/" + std::to_string(it->ticket) + "/withdrawn")})));
    if (gone) {
      said = "node --node-rank " + std::to_string(it->id) + " (host " + it->host +
             ") withdrew before generation " + std::to_string(g) + " started";
      if (o_.elastic) say(said);  // a fixed job says it in why it stops
      it = members.erase(it);
    } else {
      ++it;
    }
  }
  return said;
}

void Agent::abort_generation(int g, const std::vector<Member>& members, const std::string& why) {
  store_->set(gen_key(g, "members"), dump({{"abort", why}}));
  for (const auto& m : members) {
    // Those waiting for their answer read the abort there, and say so (wait_until_told).
    if (m.ticket > 0 && admitted_.insert(m.ticket).second) {
      answer_join(m, {{"admitted", g}});
      told_.push_back(m.ticket);
    }
  }
  // Requests read with the abort: refused with it (they would wait for an answer in vain).
  for (const auto& m : take_join_requests()) {
    answer_join(m, {{"refused", why}, {"fatal", true}});
    told_.push_back(m.ticket);
  }
}

void Agent::wait_until_told() {
  const auto deadline =
      Clock::now() + std::min<std::chrono::milliseconds>(
                         kExitSyncTimeout, std::chrono::milliseconds(
                                               static_cast<int64_t>(o_.node_timeout_s * 1000)));
  try {
    for (const int64_t t : told_) {
      while (!store_->check({key("join/" + std::to_string(t) + "/told")}) &&
             Clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
  } catch (const Error&) {
  }
}

void Agent::say_told() {
  if (my_ticket_ == 0) return;
  try {
    store_->set(key("join/" + std::to_string(my_ticket_) + "/told"), "1");
  } catch (const Error&) {
  }
}

bool Agent::form_generation(int g, std::vector<Member> members, std::string* why) {
  const auto deadline =
      Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(o_.rdzv_timeout_s * 1000));
  std::optional<Clock::time_point> last_call;
  // Note [Membership]: a fixed job stops where an elastic one would go on without a node.
  std::string fatal;
  for (;;) {
    // (A request with another command cannot stop a rendezvous that needs no one more.)
    const bool complete = members.size() >= static_cast<size_t>(o_.nnodes);
    for (const auto& m : take_join_requests(members, o_.elastic || complete ? nullptr : &fatal)) {
      if (members.size() >= static_cast<size_t>(o_.nnodes)) {
        answer_join(m, {{"refused", full_text(m)}});
      } else {
        members.push_back(m);
        say("node --node-rank " + std::to_string(m.id) + " (host " + m.host + ") is in (" +
            std::to_string(members.size()) + " of " + nnodes_text() + ")");
      }
    }
    if (const std::string said = drop_withdrawn(g, members); !said.empty() && !o_.elastic) {
      fatal = said + "; a job of fixed size (" + nnodes_text() + ") stops with it";
    }
    if (!fatal.empty()) {
      *why = fatal;
      abort_generation(g, members, *why);
      return false;
    }
    const auto now = Clock::now();
    if (members.size() >= static_cast<size_t>(o_.nnodes)) break;
    if (members.size() >= static_cast<size_t>(o_.min_nodes)) {
      if (!last_call) {
        // Not past the rendezvous deadline: MIN are in, so the deadline ends the wait for more.
        last_call = std::min(deadline, now + std::chrono::milliseconds(
                                                 static_cast<int64_t>(o_.rdzv_last_call_s * 1000)));
        if (o_.rdzv_last_call_s > 0) {
          say(std::to_string(members.size()) + " of " + nnodes_text() + " nodes are in; waiting " +
              seconds_text(o_.rdzv_last_call_s) + " s for more (--rdzv-last-call)");
        }
      }
      if (now >= *last_call) break;
    }
    if (now >= deadline) {
      *why = "rendezvous timed out after " + seconds_text(o_.rdzv_timeout_s) + " s: ";
      if (o_.elastic) {
        *why += std::to_string(members.size()) + " node(s) in (" + nodes_text(members) + "), " +
                nnodes_text() + " needs at least " + std::to_string(o_.min_nodes);
      } else {
        std::string missing;
        for (int r = 0; r < o_.nnodes; ++r) {
          if (std::none_of(members.begin(), members.end(),
                           [&](const Member& m) { return m.id == r; })) {
            missing += (missing.empty() ? "" : ", ") + std::to_string(r);
          }
        }
        *why += std::to_string(members.size()) + " of " + std::to_string(o_.nnodes) +
                " nodes joined; missing node ranks: " + missing +
                " (started with --node-rank and the same --master-addr/--master-port/--run-id?)";
      }
      abort_generation(g, members, *why);
      return false;
    }
    if (const int sig = take_signal()) {
      abort_generation(g, members, "the launcher on node 0 received " + signal_name(sig));
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

}  // namespace lockstep::launch::agent_detail
