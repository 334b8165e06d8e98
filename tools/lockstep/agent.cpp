// The node agent of `lockstep run`: its signals, the run from the store to the exit, and the one
// loop of generations, for a job of fixed size and an elastic one alike; the workers' output goes
// through output.h. The rest of the agent, by concern: agent_rendezvous.cpp (node 0's store, the
// first rendezvous, joining), agent_membership.cpp (Note [Membership]: who is in each generation),
// agent_workers.cpp (the workers, the failure summary), agent_watch.cpp (Note [Stall watch]),
// agent_restart.cpp (between generations).
//
// Note [Agent protocol]
// Every agent talks to node 0's TCP store under lockstep/<run-id>/agent/:
//   node0/host              written by node 0 once its store is up (a store that answers without
//                           it runs another --run-id)
//   join/..., gen<g>/members, gen<g>/stopped/<id>, ...
//                           who is in each generation: Note [Membership]
//   gen<g>/failure          why generation g ended (JSON), set with compare_set so that the first
//                           one wins: a failed worker, a lost node, a joining node (`membership`),
//                           a node that leaves (`left`), or a stop (`interrupted`: a launcher's
//                           signal, or the workers' own, Note [Preemption])
//   gen<g>/succeeded        counter: nodes whose workers all exited 0; all = the job succeeded
//   gen<g>/view/node<n>     node n's ranks (process states and collective traces, JSON) and a
//                           counter: the heartbeat (Note [Stall watch])
//   gen<g>/final/node<n>    the same, captured at the failure, for the verdict
//   exit                    agents done; node 0 keeps the store up until every agent has read
//                           the outcome
// Workers use the same store (LOCKSTEP_USE_AGENT_STORE=1) under lockstep/<run-id>/gen<g>/, so a
// restarted generation never sees the previous one's keys.
#include "agent.h"
#include "agent_impl.h"

#include <signal.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lockstep/base/error.h"
#include "lockstep/base/syscall.h"
#include "lockstep/distributed/shm/process_group_shm.h"
#include "lockstep/distributed/store/tcp_store.h"
#include "output.h"
#include "worker_process.h"

namespace lockstep::launch {

namespace agent_detail {

void Agent::setup_signals() {
  // Blocked before any thread exists (the store server's), so every thread inherits the mask
  // and the signals are read only here, from the signalfd.
  sigset_t set;
  sigemptyset(&set);
  for (int s : {SIGINT, SIGTERM, SIGHUP, SIGCHLD, SIGUSR1}) sigaddset(&set, s);
  LS_SYSCHECK(::sigprocmask(SIG_BLOCK, &set, nullptr));
  sigfd_ = Fd(LS_SYSCHECK(::signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC)));
  ::signal(SIGPIPE, SIG_IGN);  // a closed terminal or log pipe is an error return, not death
}

int Agent::take_signal() {
  signalfd_siginfo si{};
  while (::read(sigfd_.get(), &si, sizeof si) == static_cast<ssize_t>(sizeof si)) {
    if (si.ssi_signo == SIGUSR1) {
      report_requested_ = true;
    } else if (si.ssi_signo == SIGINT && pending_signal_ != 0) {
      second_interrupt_ = true;  // Ctrl-C again: no more waiting for the workers to save
    } else if (si.ssi_signo != SIGCHLD && pending_signal_ == 0) {
      pending_signal_ = static_cast<int>(si.ssi_signo);
    }
  }
  return pending_signal_;
}

void Agent::publish_interrupted(int g, int sig, bool by_worker) {
  try {
    json f = {{"interrupted", true},
              {"node", node_rank_},
              {"signal", signal_name(sig)},
              {"time", utc_now()}};
    if (by_worker) f["by_worker"] = true;
    store_->compare_set(gen_key(g, "failure"), "", dump(f));
  } catch (const Error&) {
    // Node 0 is gone: the other nodes lose the store and stop anyway.
  }
}

GenResult Agent::run_generation(int g) {
  // However the generation ends, its workers have exited by then: what shm segments they left in
  // /dev/shm (killed while a group was being built) go (Note [Segments of dead jobs]).
  struct RemoveDeadSegments {
    Agent& agent;
    ~RemoveDeadSegments() {
      try {
        if (const size_t n = dist::remove_dead_shm_segments(); n > 0) {
          agent.say("removed " + std::to_string(n) + " shared-memory segment" +
                    (n == 1 ? "" : "s") + " that exited workers left in /dev/shm");
        }
      } catch (const std::exception&) {  // a full stderr: the job's outcome matters more
      }
    }
  } remove_dead_segments{*this};
  GenResult result;
  generation_started_ = Clock::now();
  try {
    start_workers(g);
  } catch (const std::exception& e) {
    // What did start is stopped, and the other nodes hear of it as of a failed worker.
    const auto* le = dynamic_cast<const Error*>(&e);
    const std::string why = le ? le->message() : std::string(e.what());
    say("cannot start the workers: " + why);
    result.outcome = Outcome::kFailed;
    result.failure = {{"node", node_rank_},
                      {"host", hostname()},
                      {"rank", -1},
                      {"local_rank", -1},
                      {"status", "a start failure (" + why + ")"},
                      {"time", utc_now()}};
    try {
      store_->compare_set(gen_key(g, "failure"), "", dump(result.failure));
      result.failure = json::parse(store_->get_string(gen_key(g, "failure")));
    } catch (const Error&) {
    }
    stop_workers(SIGTERM);
    return result;
  }
  bool published = false, success_counted = false;
  auto next_check = Clock::now();
  heard_.clear();
  warned_.clear();
  verdict_lines_.clear();
  const double watch_s =
      std::clamp(std::min(o_.stall_timeout_s > 0 ? o_.stall_timeout_s / 4 : kMaxWatchInterval,
                          o_.node_timeout_s / 6),
                 kMinWatchInterval, kMaxWatchInterval);
  const auto watch_every = std::chrono::milliseconds(static_cast<int64_t>(watch_s * 1000));
  auto next_watch = Clock::now() + watch_every;
  try {
    for (;;) {
      const auto wait =
          std::chrono::duration_cast<std::chrono::milliseconds>(next_check - Clock::now());
      pump_output(std::max(std::chrono::milliseconds(0), wait));
      if (const int sig = take_signal()) {
        // Tell the other nodes first, so that they stop too (and do not restart); in an elastic
        // job a node other than node 0 leaves, and the others go on without it.
        if (leaves_on_signal()) {
          // Once its workers all succeeded the node is done: leaving would restart the others.
          if (!success_counted) {
            publish_leaving(g, sig);
            result.left = true;
          }
        } else {
          publish_interrupted(g, sig);
        }
        say("received " + signal_name(sig) + "; stopping the workers (SIGKILL after " +
            seconds_text(o_.stop_grace_s) + " s, --stop-grace)");
        stop_workers(sig, stop_grace());
        result.outcome = Outcome::kInterrupted;
        result.signal = sig;
        return result;
      }
      reap();
      observe_processes();
      if (report_requested_) report_now(g);
      if (!published && Clock::now() >= next_watch) {
        next_watch = Clock::now() + watch_every;
        if (auto lost = watch(g)) {
          store_->compare_set(gen_key(g, "failure"), "", dump(*lost));
          published = true;
          next_check = Clock::now();
        }
      }
      if (!published) {
        for (auto& w : workers_) {
          const auto& st = w->proc->exit_status();
          if (st && !st->ok()) {
            drain_worker(*w);  // its last lines belong in the summary
            if (const int sig = stop_signal_of(*w)) {
              // Note [Preemption]: every rank agreed to stop on `sig` and saves; the job stops
              // as if this launcher had been sent it, and the workers' own time to finish is
              // left to them (they need no signal from here).
              publish_interrupted(g, sig, /*by_worker=*/true);
              say("rank " + std::to_string(w->rank) + " stopped on " + signal_name(sig) +
                  " to save (it exits " + std::to_string(128 + sig) +
                  "); waiting for the workers (SIGKILL after " + seconds_text(o_.stop_grace_s) +
                  " s, --stop-grace)");
              stop_workers(0, stop_grace());
              result.outcome = Outcome::kInterrupted;
              result.signal = sig;
              return result;
            }
            store_->compare_set(gen_key(g, "failure"), "", dump(describe_failure(*w)));
            published = true;
            next_check = Clock::now();
            break;
          }
        }
      }
      if (!published) tell_ranks_waiting_to_join(g);
      if (!published && !success_counted && all_exited()) {
        drain_after_exit();
        store_->add(gen_key(g, "succeeded"), 1);
        success_counted = true;
      }
      if (Clock::now() < next_check) continue;
      next_check = Clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(o_.monitor_interval_s * 1000));
      if (o_.node_rank == 0 && !published) admit_while_running(g, success_counted);
      if (store_->check({gen_key(g, "failure")})) {
        result.outcome = Outcome::kFailed;
        result.failure = json::parse(store_->get_string(gen_key(g, "failure")));
        // A node joins or leaves, or another node's launcher got a stopping signal: nothing
        // failed, and the workers may save before they exit (Note [Preemption]), which takes
        // --stop-grace. When the workers stopped by themselves (by_worker), these are stopping
        // as well and need no signal. After a failure they get 3 s.
        const bool planned = result.failure.value("membership", false) ||
                             result.failure.value("left", false) ||
                             result.failure.value("interrupted", false);
        const int sig = result.failure.value("by_worker", false) ? 0 : SIGTERM;
        if (result.failure.value("membership", false)) {  // a node joins: nothing to judge
          stop_workers(sig, stop_grace());
          return result;
        }
        publish_final_views(g);  // before stopping: a stopped rank must still read as stopped
        stop_workers(sig, planned ? stop_grace() : kStopGrace);
        judge_failure(g);
        return result;
      }
      if (success_counted && store_->add(gen_key(g, "succeeded"), 0) >= nnodes_) {
        result.outcome = Outcome::kSucceeded;
        return result;
      }
    }
  } catch (const Error& e) {
    // Only a client loses its store: node 0's agent (and so the job's rendezvous) is gone.
    result.outcome = Outcome::kStoreLost;
    result.why = e.message();
    stop_workers(SIGTERM);
    return result;
  }
}

void Agent::withdraw(int g, int sig) {
  try {
    store_->set(gen_key(g, "withdrawn/" + std::to_string(o_.node_rank)), "1");
    if (!o_.elastic) publish_interrupted(g, sig);
  } catch (const Error&) {
  }
}

void Agent::exit_sync(std::chrono::milliseconds timeout) {
  try {
    store_->add(key("exit"), 1);
    if (o_.node_rank == 0) {
      int sig = 0;
      wait_for_count(key("exit"), nnodes_, timeout, &sig);
    }
  } catch (const Error&) {
    // Node 0 is gone after the outcome was known; nothing is lost.
  }
}

std::chrono::milliseconds Agent::normal_exit_wait() const {
  return std::max<std::chrono::milliseconds>(
      kExitSyncTimeout,
      std::chrono::milliseconds(static_cast<int64_t>(o_.monitor_interval_s * 3000)) +
          std::chrono::seconds(5));
}

int Agent::run() {
  setup_signals();
  char tmpl[] = "/tmp/lockstep-run-XXXXXX";
  const char* tmp_root = std::getenv("TMPDIR");
  std::string pattern =
      std::string(tmp_root && *tmp_root ? tmp_root : "/tmp") + "/lockstep-run-XXXXXX";
  std::vector<char> buf(pattern.begin(), pattern.end());
  buf.push_back('\0');
  char* made = ::mkdtemp(buf.data());
  if (made == nullptr) made = ::mkdtemp(tmpl);
  LS_CHECK(made != nullptr, "cannot create a temporary directory: ", errno_text(errno));
  tmp_dir_ = made;

  int first_generation = 0;
  try {
    connect_store();
    first_generation = rendezvous();
  } catch (const Interrupted& e) {
    say(std::string(e.what()) + " before the workers started");
    return 128 + e.signal;
  } catch (const AgentError& e) {
    say(e.what());
    return kExitJobFailed;
  } catch (const UsageError&) {
    throw;
  } catch (const Error& e) {
    say("rendezvous failed: " + e.message());
    return kExitJobFailed;
  }
  // Everyone joined: from now on a store request that gets no reply for --node-timeout means
  // node 0 (or the network) is gone, the bound within which node 0 notices a lost node too
  // (Note [Stall watch]); the workers are stopped rather than left waiting.
  store_->set_timeout(std::chrono::milliseconds(static_cast<int64_t>(o_.node_timeout_s * 1000)));
  return run_generations(first_generation);
}

int Agent::run_generations(int g) {
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
        // A node that left is no longer counted at the end; the others let node 0 know they
        // read why.
        if (!r.left) exit_sync(kExitSyncAfterSignal);
        return 128 + r.signal;
      case Outcome::kStoreLost:
        say("lost node 0's store at " + o_.master_addr + ":" + std::to_string(store_port_) +
            " (its launcher exited or the network failed; node 0 must stay for the whole job): " +
            r.why + "; workers stopped");
        return kExitJobFailed;
      case Outcome::kFailed:
        break;
    }
    if (const int sig = take_signal()) {  // a signal while the failed group was being stopped
      try {
        if (host) {
          publish_interrupted(g + 1, sig);
          abort_generation(g + 1, {}, "the launcher on node 0 received " + signal_name(sig));
          refuse_waiting_joins("the job was stopped");
        } else {
          withdraw(g + 1, sig);
          store_->set(gen_key(g, "stopped/" + std::to_string(o_.node_rank)), "1");
        }
      } catch (const Error&) {
      }
      print_summary(r.failure, restarts_used_);
      print_peak_memory();
      say("received " + signal_name(sig) + "; not restarting");
      if (!leaves_on_signal()) exit_sync(kExitSyncAfterSignal);
      return 128 + sig;
    }
    if (r.failure.value("interrupted", false)) {  // another launcher's signal, or the workers'
      print_summary(r.failure, restarts_used_);
      print_peak_memory();
      if (host) refuse_waiting_joins("the job was stopped");
      exit_sync(kExitSyncAfterSignal);
      return kExitJobFailed;
    }
    // Node 0 says what happened when it says what comes next (next_generation).
    if (!host) say(event_text(r.failure));
    try {
      store_->set(gen_key(g, "stopped/" + std::to_string(o_.node_rank)), "1");
      if (host) {
        std::string why;
        if (!next_generation(g, r.failure, &why)) {
          print_summary(r.failure, restarts_used_);
          print_peak_memory();
          // With --max-restarts 0 the summary's "restarts used: 0 of 0" says it already.
          if (o_.elastic || o_.max_restarts > 0) say("not restarting: " + why);
          refuse_waiting_joins("the job failed");
          exit_sync(normal_exit_wait());
          wait_until_told();
          return kExitJobFailed;
        }
      }
      ++g;
      for (;;) {
        try {
          adopt_members(g);
          break;
        } catch (const Rejoin& e) {
          // A fixed job: node 0 left this node out, found lost while it was only slow.
          say("node 0 left this node out of generation " + std::to_string(g) + " (" + e.what() +
              "); asking to join again");
          g = join_job();
        }
      }
    } catch (const Interrupted& e) {
      say(std::string(e.what()) + " while restarting; not restarting");
      if (host) refuse_waiting_joins("the job was stopped");
      if (!host) withdraw(g, e.signal);  // wait_for_node_zero withdrew it; a fixed job stops
      // A node other than node 0 withdrew (wait_for_node_zero): elastic, it just goes.
      if (!leaves_on_signal()) exit_sync(kExitSyncAfterSignal);
      return 128 + e.signal;
    } catch (const AgentError& e) {
      print_summary(r.failure, restarts_used_);
      print_peak_memory();
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

}  // namespace agent_detail

int run_agent(const RunOptions& opts) {
  Terminal terminal;
  int code;
  {
    agent_detail::Agent agent(opts, terminal);
    code = agent.run();
  }
  terminal.end_open_line();  // a shell prompt must not land on a worker's last progress bar
  return code;
}

}  // namespace lockstep::launch
