// The agent's way into a job: node 0's store (hosted there, reached from the other nodes), the
// first rendezvous (node 0 forms generation 0, the others ask to join: Note [Membership] in
// agent_membership.cpp), adopting a generation's members, the waits on the store, and a node's
// host for messages.
#include <algorithm>
#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "agent_impl.h"
#include "job_signature.h"
#include "lockstep/base/error.h"
#include "lockstep/distributed/store/tcp_store.h"

namespace lockstep::launch::agent_detail {

void Agent::connect_store() {
  // Note [Store token] in run_options.cpp: chosen there, except the random one of one machine.
  token_ = !o_.token.empty() ? o_.token : random_hex(16);
  dist::TCPStoreOptions so;
  so.host = o_.master_addr;
  so.port = o_.standalone ? 0 : static_cast<uint16_t>(o_.master_port);
  so.is_server = o_.node_rank == 0;
  so.wait_for_workers = false;
  so.token = token_;
  so.timeout = std::chrono::milliseconds(static_cast<int64_t>(o_.rdzv_timeout_s * 1000));
  if (so.is_server) {
    so.server.bind_address = o_.store_bind.address;  // Note [Store bind address] in run_options.cpp
    try {
      store_ = std::make_unique<dist::TCPStore>(so);
      const std::string& a = o_.store_bind.address;
      const std::string where = a.empty()                          ? "every interface, port "
                                : a.find(':') != std::string::npos ? "[" + a + "]:"
                                                                   : a + ":";
      say("the store listens on " + where + std::to_string(store_->port()) + " (" +
          o_.store_bind.why + ")");
    } catch (const Error& e) {
      // Another port is the cure only for a port that is taken or privileged; anything else
      // (the bind address, descriptors, ...) is said as it is, without the advice.
      const std::string port = std::to_string(so.port);
      const bool in_use = e.message().find("is already in use") != std::string::npos;
      const bool denied = e.message().find("(errno " + std::to_string(EACCES) + ")") !=
                          std::string::npos;
      if (!in_use && !denied) {
        throw UsageError("node 0 cannot start the store (port " + port + "): " + e.message());
      }
      throw UsageError(
          "node 0 cannot host the store on port " + port + ": " +
          (in_use ? "port " + port + " is already in use (another job or store listens there)"
                  : "this user may not listen on port " + port + " (" + e.message() + ")") +
          (o_.nnodes == 1 ? "; choose another --master-port, or --master-port 0 for any free "
                            "port (or --standalone)"
                          : "; choose another --master-port (the same on every machine)"));
    }
  } else {
    // In slices, watching for signals: a Ctrl-C while node 0 is not up yet must not wait for
    // the rendezvous timeout.
    const auto deadline = Clock::now() + so.timeout;
    for (;;) {
      dist::TCPStoreOptions slice = so;
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      slice.timeout = std::clamp<std::chrono::milliseconds>(
          left, std::chrono::milliseconds(1),
          std::chrono::duration_cast<std::chrono::milliseconds>(kConnectSlice));
      try {
        store_ = std::make_unique<dist::TCPStore>(slice);
        store_->set_timeout(so.timeout);
        break;
      } catch (const dist::StoreTokenRejected&) {
        // Node 0 is up and has answered: another try gets the same answer.
        throw AgentError("node 0's store at " + o_.master_addr + ":" +
                         std::to_string(o_.master_port) + " refused this node's token (from " +
                         o_.token_source +
                         "): every machine of a job needs node 0's token; give this one the "
                         "same --token-file, LOCKSTEP_STORE_TOKEN or --run-id as node 0");
      } catch (const Error& e) {
        if (const int sig = take_signal()) throw Interrupted(sig);
        if (Clock::now() >= deadline) {
          throw AgentError(
              "node " + std::to_string(o_.node_rank) + " cannot reach node 0's store at " +
              o_.master_addr + ":" + std::to_string(o_.master_port) + " within " +
              std::to_string(static_cast<int>(o_.rdzv_timeout_s)) + " s: " + e.message());
        }
      }
    }
  }
  store_port_ = store_->port();
}

bool Agent::wait_for_count(const std::string& k, int64_t want, std::chrono::milliseconds timeout,
                           int* interrupted) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    if (store_->add(k, 0) >= want) return true;
    if (const int sig = take_signal()) {
      *interrupted = sig;
      return false;
    }
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

int Agent::rendezvous() {
  if (o_.node_rank != 0) {
    const int g = join_job();
    adopt_members(g);
    return g;
  }
  // Note [Agent protocol]: a joiner whose node 0 has not written this runs under another
  // --run-id.
  store_->set(key("node0/host"), hostname());
  std::string why;
  if (!form_generation(0, {Member{0, hostname(), 0}}, &why)) {
    wait_until_told();
    throw AgentError(why);
  }
  adopt_members(0);
  return 0;
}

int Agent::join_job() {
  // Node 0 writes node0/host as soon as its store is up: a store that answers without it for
  // --rdzv-timeout is another job's (the run id is part of every key).
  const auto started = Clock::now();
  bool node_zero_seen = false;
  const auto node_zero_in_this_job = [&] {
    if (node_zero_seen || (node_zero_seen = store_->check({key("node0/host")}))) return;
    if (std::chrono::duration<double>(Clock::now() - started).count() >= o_.rdzv_timeout_s) {
      throw AgentError("rendezvous timed out after " + seconds_text(o_.rdzv_timeout_s) +
                       " s: node 0 is up (its store answered) but has not joined this job: "
                       "does it run with another --run-id (this node's is '" +
                       o_.run_id + "')?");
    }
  };
  const int64_t t = store_->add(key("join/next"), 1);
  my_ticket_ = t;
  const json request = {{"id", o_.node_rank},
                        {"host", hostname()},
                        {"nproc", o_.nproc_per_node},
                        {"signature", job_signature(o_).to_json()}};
  store_->set(key("join/" + std::to_string(t)), dump(request));
  const std::string k = key("join/" + std::to_string(t) + "/reply");
  wait_for_node_zero(k, key("join/" + std::to_string(t) + "/withdrawn"),
                     "node 0 did not admit this node", "", node_zero_in_this_job);
  const json reply = json::parse(store_->get_string(k));
  if (reply.contains("refused")) {
    if (reply.value("fatal", false)) say_told();  // node 0 waits for it before it ends
    throw AgentError("node 0 refused this node: " + reply["refused"].get<std::string>());
  }
  return reply.at("admitted").get<int>();
}


void Agent::adopt_members(int g) {
  const std::string k = gen_key(g, "members");
  const std::string refused_key = gen_key(g, "refused/" + std::to_string(o_.node_rank));
  // Node 0 leaves a node out before it forms the generation, and says why: an elastic job goes
  // on without it; a fixed one needs it, so a node that is still here asks to join again
  // (Note [Membership]).
  const auto left_out = [&] {
    if (o_.node_rank == 0) return;
    if (auto why = try_get(refused_key)) {
      if (!o_.elastic) throw Rejoin(*why);
      throw LeftOut("node 0 refused this node: " + *why);
    }
  };
  // A node that stops waiting says so, so that node 0 does not start a generation with it.
  wait_for_node_zero(
      k, o_.node_rank == 0 ? "" : gen_key(g, "withdrawn/" + std::to_string(o_.node_rank)),
      "node 0 did not start generation " + std::to_string(g), gen_key(g, "restart_delay"),
      left_out);
  const json j = json::parse(store_->get_string(k));
  if (j.contains("abort")) {
    say_told();  // a joiner: node 0 waits for it before it ends
    throw AgentError("the job failed: " + j["abort"].get<std::string>());
  }
  std::vector<Member> ms;
  for (const auto& n : j.at("nodes")) ms.push_back(Member::from_json(n));
  // By --node-rank and join request: an agent that another took the place of is not a member.
  const auto me = std::find_if(ms.begin(), ms.end(), [&](const Member& m) {
    return m.id == o_.node_rank && m.ticket == my_ticket_;
  });
  if (me == ms.end()) {
    left_out();
    if (auto refused = try_get(refused_key)) {
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
  // A fixed job's layout is the user's own --nnodes and --node-rank: said only when elastic.
  if (!o_.elastic) return;
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

std::string Agent::host_of(int n) {
  return n >= 0 && n < static_cast<int>(members_.size()) ? members_[n].host : "?";
}

}  // namespace lockstep::launch::agent_detail
