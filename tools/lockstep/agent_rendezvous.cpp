// The agent's way into a job: node 0's store (hosted there, reached from the other nodes), the
// fixed-size rendezvous (Note [Agent protocol] in agent.cpp) and its checks of the joined nodes,
// the waits on the store, and a node's host for messages.
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

void Agent::rendezvous() {
  const std::string me = "node" + std::to_string(o_.node_rank);
  if (store_->add(key(me + "/claims"), 1) > 1) {
    throw AgentError("another agent already joined as --node-rank " + std::to_string(o_.node_rank) +
                     " (host " + store_->get_string(key(me + "/host")) +
                     "); every machine needs its own --node-rank in [0, " +
                     std::to_string(o_.nnodes) + ")");
  }
  store_->set(key(me + "/host"), hostname());
  store_->set(key(me + "/nproc"), std::to_string(o_.nproc_per_node));
  store_->set(key(me + "/signature"), dump(job_signature(o_).to_json()));
  store_->add(key("joined"), 1);
  int sig = 0;
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(o_.rdzv_timeout_s * 1000));
  if (!wait_for_count(key("joined"), o_.nnodes, timeout, &sig)) {
    if (sig != 0) throw Interrupted(sig);
    std::string missing;
    int joined = 0;
    bool zero_elsewhere = false;
    for (int r = 0; r < o_.nnodes; ++r) {
      if (store_->check({key("node" + std::to_string(r) + "/host")})) {
        ++joined;
      } else if (r == 0) {
        zero_elsewhere = true;  // its store answered this node: node 0 is up, in another job
      } else {
        missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
    }
    std::string why =
        "rendezvous timed out after " + std::to_string(static_cast<int>(o_.rdzv_timeout_s)) +
        " s: " + std::to_string(joined) + " of " + std::to_string(o_.nnodes) + " nodes joined";
    if (zero_elsewhere) {
      // An elastic node 0 takes join requests (Note [Elastic membership]) instead.
      why += store_->check({key("join/next")})
                 ? "; node 0 is up (its store answered) but runs an elastic job (--nnodes "
                   "MIN:MAX): give this node node 0's --nnodes"
                 : "; node 0 is up (its store answered) but has not joined this job: does it "
                   "run with another --run-id (this node's is '" +
                       o_.run_id + "')?";
    }
    if (!missing.empty()) {
      why += "; missing node ranks: " + missing +
             " (started with --node-rank and the same --master-addr/--master-port/--run-id?)";
    }
    throw AgentError(why);
  }
  // Every node checks every node's keys against node 0's, and all of them fail the start with
  // the same message where they disagree. Node 0's store must outlive the others' reading: each
  // node counts itself in `checked` once it has read what it needs, and node 0 waits for all of
  // them (at most --node-timeout) before it fails and its store closes. (Without the wait node 1
  // could find the store gone mid-check and say "lost the connection to the store" instead.)
  std::optional<std::string> refusal;
  try {
    check_joined_nodes();
  } catch (const AgentError& e) {
    refusal = e.what();
  }
  store_->add(key("checked"), 1);
  if (!refusal) return;
  if (o_.node_rank == 0) {
    int ignored = 0;
    (void)wait_for_count(key("checked"), o_.nnodes,
                         std::chrono::milliseconds(static_cast<int64_t>(o_.node_timeout_s * 1000)),
                         &ignored);
  }
  throw AgentError(*refusal);
}

void Agent::check_joined_nodes() {
  // Every node wrote its keys before it counted itself in `joined`; one that did not is of
  // another lockstep version, and a get would wait for it until the store's timeout.
  const auto written_by = [&](int r, const std::string& name, const std::string& what) {
    const std::string k = key("node" + std::to_string(r) + "/" + name);
    if (!store_->check({k})) {
      throw AgentError("node " + std::to_string(r) + "'s " + what +
                       " is malformed (another lockstep version?): it joined without writing "
                       "it; run the same lockstep version on every machine");
    }
    return store_->get_string(k);
  };
  for (int r = 0; r < o_.nnodes; ++r) {
    const std::string n = written_by(r, "nproc", "--nproc-per-node");
    if (n != std::to_string(o_.nproc_per_node)) {
      throw AgentError("nodes disagree on --nproc-per-node: " + std::to_string(o_.nproc_per_node) +
                       " here (node " + std::to_string(o_.node_rank) + "), " + n + " on node " +
                       std::to_string(r));
    }
  }
  // Note [Job signature]: every node compares every node's with node 0's, so all of them fail
  // the start with the same message.
  const auto signature_of = [&](int r) {
    try {
      return JobSignature::from_json(json::parse(written_by(r, "signature", "job signature")));
    } catch (const json::exception& e) {
      throw AgentError("node " + std::to_string(r) + "'s job signature is malformed (another " +
                       "lockstep version?): " + e.what());
    }
  };
  const JobSignature job = signature_of(0);
  for (int r = 1; r < o_.nnodes; ++r) {
    if (const auto diff = signature_difference(job, signature_of(r), "node 0")) {
      throw AgentError("node " + std::to_string(r) + " (host " + host_of(r) +
                       ") runs another command than node 0: " + *diff +
                       "; start every machine with the same program, arguments and launcher "
                       "settings (what differs between machines belongs in the environment)");
    }
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
  if (o_.elastic) {
    return n >= 0 && n < static_cast<int>(members_.size()) ? members_[n].host : "?";
  }
  try {
    return try_get(key("node" + std::to_string(n) + "/host")).value_or("?");
  } catch (const Error&) {
    return "?";
  }
}

}  // namespace lockstep::launch::agent_detail
