// The node agent of `lockstep run`: rendezvous, the workers of each generation, failure and
// restart; their output goes through the multiplexer in output.h.
//
// Note [Agent protocol]
// Every agent talks to node 0's TCP store under lockstep/<run-id>/agent/:
//   node<r>/claims, node<r>/host, node<r>/nproc   rendezvous: each node rank joins once
//   node<r>/signature                             what it runs (Note [Job signature])
//   joined                                        counter; all nnodes joined = go
//   gen<g>/failure                                first failure of generation g (JSON), set
//                                                 with compare_set so the first one wins
//   gen<g>/succeeded                              nodes whose workers all exited 0
//   gen<g>/stopped                                nodes that stopped their workers after a
//                                                 failure; all stopped = start generation g+1
//   gen<g>/view/node<n>                           node n's ranks (process states and collective
//                                                 traces, JSON) and a counter: the heartbeat
//                                                 (Note [Stall watch])
//   gen<g>/final/node<n>                          the same, captured at the failure, for the
//                                                 verdict
//   exit                                          agents done; node 0 keeps the store up until
//                                                 every agent has read the outcome
// Workers use the same store (LOCKSTEP_USE_AGENT_STORE=1) under lockstep/<run-id>/gen<g>/, so a
// restarted generation never sees the previous one's keys.
#include "agent.h"
#include "agent_impl.h"

#include <poll.h>
#include <signal.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "job_signature.h"
#include "lockstep/base/error.h"
#include "lockstep/base/syscall.h"
#include "lockstep/base/worker_env.h"
#include "lockstep/distributed/error_file.h"
#include "lockstep/distributed/shm/process_group_shm.h"
#include "lockstep/distributed/store/tcp_store.h"
#include "output.h"
#include "verdict.h"
#include "why_died.h"
#include "worker_process.h"

extern char** environ;

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
    } else if (si.ssi_signo != SIGCHLD && pending_signal_ == 0) {
      pending_signal_ = static_cast<int>(si.ssi_signo);
    }
  }
  return pending_signal_;
}

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

void Agent::start_workers(int g) {
  workers_.clear();
  if (g == 0) oom_counter_ = find_oom_counter();
  if (oom_counter_) oom_kills_at_start_ = read_oom_kills(*oom_counter_);
  // The worker environment: ours, less what the launcher sets (base/worker_env.h).
  std::vector<std::string> base;
  bool user_omp = false;
  for (char** e = environ; *e; ++e) {
    const std::string entry = *e;
    const std::string name = entry.substr(0, entry.find('='));
    if (name == env::kOmpNumThreads) user_omp = true;
    if (name == env::kTimeout) continue;  // --timeout's (LOCKSTEP_TIMEOUT is read as --timeout)
    if (name == env::kStoreTokenFile) continue;  // the launcher's LOCKSTEP_STORE_TOKEN replaces it
    if (std::find(env::kLauncherSet.begin(), env::kLauncherSet.end(), name) ==
        env::kLauncherSet.end()) {
      base.push_back(entry);
    }
  }
  if (!user_omp) {
    base.push_back(std::string(env::kOmpNumThreads) + "=" +
                   std::to_string(std::max(1, online_cpus() / o_.nproc_per_node)));
  }
  const std::string attempt = "attempt_" + std::to_string(g);
  for (int l = 0; l < o_.nproc_per_node; ++l) {
    auto w = std::make_unique<Worker>();
    w->local_rank = l;
    w->rank = node_rank_ * o_.nproc_per_node + l;
    const auto dir = std::filesystem::path(tmp_dir_) / attempt / std::to_string(w->rank);
    std::filesystem::create_directories(dir);
    w->error_file = (dir / "error.json").string();
    w->trace_file = (dir / "trace").string();
    const bool to_terminal = o_.output.to_terminal(l);
    WorkerSpec spec;
    spec.program = o_.program;
    spec.args = o_.args;
    spec.env = base;
    auto set = [&](const char* n, const std::string& v) { spec.env.push_back(n + ("=" + v)); };
    set(env::kRank, std::to_string(w->rank));
    set(env::kLocalRank, std::to_string(l));
    set(env::kWorldSize, std::to_string(world_size()));
    set(env::kLocalWorldSize, std::to_string(o_.nproc_per_node));
    set(env::kGroupRank, std::to_string(node_rank_));
    set(env::kMasterAddr, o_.master_addr);
    set(env::kMasterPort, std::to_string(store_port_));
    set(env::kRestartCount, std::to_string(g));
    set(env::kMaxRestarts, std::to_string(o_.max_restarts));
    set(env::kRunId, o_.run_id);
    set(env::kUseAgentStore, "1");
    set(env::kStoreToken, token_);
    set(env::kErrorFile, w->error_file);
    set(env::kTraceFile, w->trace_file);
    if (!o_.timeout.empty()) set(env::kTimeout, o_.timeout);
    // Only where the worker's stdout really ends on the terminal: with --log-dir and no --tee,
    // or filtered out, a progress bar would reach only the log file (where plain lines belong).
    if (terminal_.is_tty(1) && to_terminal) set(env::kStdoutIsTty, "1");
    const std::string logs = o_.output.log_dir.empty()
                                 ? std::string()
                                 : (std::filesystem::path(o_.output.log_dir) / o_.run_id / attempt /
                                    std::to_string(w->rank))
                                       .string();
    w->log_dir = logs;
    w->output = std::make_unique<WorkerOutput>(terminal_, w->rank, to_terminal, logs);
    w->proc = std::make_unique<WorkerProcess>(spec);
    workers_.push_back(std::move(w));
  }
}

void Agent::pump_output(std::chrono::milliseconds timeout) {
  std::vector<pollfd> fds;
  std::vector<std::pair<Worker*, bool>> who;
  for (auto& w : workers_) {
    if (w->proc->stdout_fd() >= 0) {
      fds.push_back({w->proc->stdout_fd(), POLLIN, 0});
      who.emplace_back(w.get(), false);
    }
    if (w->proc->stderr_fd() >= 0) {
      fds.push_back({w->proc->stderr_fd(), POLLIN, 0});
      who.emplace_back(w.get(), true);
    }
  }
  fds.push_back({sigfd_.get(), POLLIN, 0});  // SIGCHLD or a stop request wakes us up
  const int n = ::poll(fds.data(), fds.size(), static_cast<int>(timeout.count()));
  if (n <= 0) return;
  for (size_t i = 0; i + 1 < fds.size(); ++i) {
    if (fds[i].revents == 0) continue;
    Worker& w = *who[i].first;
    w.proc->drain(fds[i].fd, who[i].second ? w.output->stderr_lines() : w.output->stdout_lines());
  }
}

void Agent::reap() {
  for (auto& w : workers_) w->proc->poll_exit();
}

bool Agent::all_exited() {
  return std::all_of(workers_.begin(), workers_.end(),
                     [](const auto& w) { return w->proc->exit_status().has_value(); });
}

void Agent::drain_after_exit() {
  const auto deadline = Clock::now() + kDrainTimeout;
  while (Clock::now() < deadline &&
         std::any_of(workers_.begin(), workers_.end(),
                     [](const auto& w) { return w->proc->streams_open(); })) {
    pump_output(std::chrono::milliseconds(20));
  }
}

void Agent::drain_worker(Worker& w) {
  const auto deadline = Clock::now() + kDrainTimeout;
  while (w.proc->streams_open() && Clock::now() < deadline) {
    std::vector<pollfd> fds;
    if (w.proc->stdout_fd() >= 0) fds.push_back({w.proc->stdout_fd(), POLLIN, 0});
    if (w.proc->stderr_fd() >= 0) fds.push_back({w.proc->stderr_fd(), POLLIN, 0});
    if (::poll(fds.data(), fds.size(), 20) <= 0) continue;
    for (const auto& p : fds) {
      if (p.revents == 0) continue;
      w.proc->drain(
          p.fd, p.fd == w.proc->stdout_fd() ? w.output->stdout_lines() : w.output->stderr_lines());
    }
  }
}

void Agent::stop_workers(int sig) {
  for (auto& w : workers_) {
    if (!w->proc->exit_status()) w->proc->signal_group(sig);
  }
  const auto deadline = Clock::now() + kStopGrace;
  reap();
  while (!all_exited() && Clock::now() < deadline) {
    pump_output(std::chrono::milliseconds(20));
    take_signal();  // remembered: a Ctrl-C now still ends the job once this group is stopped
    reap();
  }
  for (auto& w : workers_) {
    if (!w->proc->exit_status()) w->proc->signal_group(SIGKILL);
  }
  const auto kill_deadline = Clock::now() + kKillWait;
  while (!all_exited()) {
    if (Clock::now() >= kill_deadline) {
      for (auto& w : workers_) {
        if (!w->proc->exit_status()) {
          say("rank " + std::to_string(w->rank) + " (pid " + std::to_string(w->proc->pid()) +
              ") did not exit " + std::to_string(kKillWait.count()) +
              " s after SIGKILL (stuck in the kernel?); giving up on it");
        }
      }
      break;
    }
    pump_output(std::chrono::milliseconds(20));
    take_signal();
    reap();
  }
  drain_after_exit();
}

// Note [A rank that leaves before joining]
// A worker that exits 0 without calling init_process_group is no failure to the launcher, but
// the other ranks wait for it in the join (Note [Join check] in src/distributed/init.cpp) until
// the rendezvous timeout, 300 s by default. The launcher knows at once, and the workers join
// through its store under lockstep/<run-id>/gen<g>/: a rank that has not claimed rank/<r> by
// the time it exited never will, so the agent writes the join's `error` key (compare_set: a
// rank's own error stays first), and every rank waiting in the join fails at once with that
// message, which the failure summary then quotes. A rank that joined (and finished its work)
// and exits 0 has its claim in the store and changes nothing.
void Agent::tell_ranks_waiting_to_join(int g) {
  if (world_size() == 1) return;  // a world of one joins through no store
  const std::string world = "lockstep/" + o_.run_id + "/gen" + std::to_string(g) + "/";
  for (auto& w : workers_) {
    const auto& st = w->proc->exit_status();
    if (!st || !st->ok() || w->join_checked) continue;
    w->join_checked = true;
    if (store_->check({world + "rank/" + std::to_string(w->rank)})) continue;  // it joined
    store_->compare_set(
        world + "error", "",
        "rank " + std::to_string(w->rank) + " (node " + std::to_string(node_rank_) + ", host " +
            hostname() + ") exited with " + st->str() +
            " without joining the process group, so the world of " +
            std::to_string(world_size()) +
            " ranks cannot form: every rank must call init_process_group (the launcher saw it "
            "exit)");
  }
}

json Agent::describe_failure(const Worker& w) const {
  const ExitStatus& s = *w.proc->exit_status();
  json f = {{"rank", w.rank},          {"local_rank", w.local_rank}, {"node", node_rank_},
            {"host", hostname()},      {"status", s.str()},          {"time", utc_now()},
            {"tail", w.output->tail()}};
  if (s.max_rss_kib >= 0) f["peak_rss_kib"] = s.max_rss_kib;
  if (s.signaled) {
    // Note [Out-of-memory evidence]: only SIGKILL can be the OOM killer's.
    std::string oom;
    if (s.signal == SIGKILL && oom_counter_ && oom_kills_at_start_) {
      const auto now = read_oom_kills(*oom_counter_);
      if (now && *now > *oom_kills_at_start_) {
        oom = "the oom_kill count of " + oom_counter_->file + " rose from " +
              std::to_string(*oom_kills_at_start_) + " to " + std::to_string(*now) +
              " while the job ran";
      }
    }
    if (s.signal == SIGKILL) {
      const std::string line = kernel_log_oom_line(w.proc->pid());
      if (!line.empty()) oom += (oom.empty() ? "" : "; ") + ("the kernel log says: " + line);
    }
    if (!oom.empty()) f["oom"] = oom;
    if (const auto avail = mem_available_kib()) f["mem_available_kib"] = *avail;
  }
  // Where the summary says its full output is.
  if (!w.log_dir.empty()) f["log_dir"] = w.log_dir;
  f["to_terminal"] = o_.output.to_terminal(w.local_rank);
  std::ifstream in(w.error_file);
  if (in) {
    try {
      const json e = json::parse(in);
      if (e.contains("message")) f["error"] = cut_text(e["message"].get<std::string>(), kMaxError);
    } catch (const std::exception&) {
      f["error"] = "(the worker's error file " + w.error_file + " is not valid JSON)";
    }
  }
  return f;
}

void Agent::print_summary(const json& f, int generation) const {
  if (f.value("interrupted", false)) {
    say("the job was stopped: the launcher on node " + std::to_string(f.value("node", 0)) +
        " received " + f.value("signal", std::string("a signal")) + " at " +
        f.value("time", std::string("?")));
    return;
  }
  for (const auto& line : verdict_lines_) say(line);
  if (f.value("left", false) || f.value("membership", false)) {  // elastic: the last change
    say("the job failed after this change: " + event_text(f));
    return;
  }
  if (f.value("lost", false)) {
    say("the job failed: node " + std::to_string(f.value("node", -1)) + " (host " +
        f.value("host", std::string("?")) + ") is " + f.value("status", std::string("?")) +
        "; seen by node " + std::to_string(f.value("seen_by", -1)) + " at " +
        f.value("time", std::string("?")));
    return;
  }
  if (f.value("rank", -1) < 0) {
    say("the job failed: node " + std::to_string(f.value("node", -1)) + " (host " +
        f.value("host", std::string("?")) + ") could not start its workers: " +
        f.value("status", std::string("?")) + " at " + f.value("time", std::string("?")));
    return;
  }
  std::ostringstream s;
  s << "the job failed: rank " << f.value("rank", -1) << " (local rank "
    << f.value("local_rank", -1) << " on node " << f.value("node", -1) << ", host "
    << f.value("host", std::string("?")) << ") ended with " << f.value("status", std::string("?"))
    << " at " << f.value("time", std::string("?")) << "; restarts used: " << generation << " of "
    << o_.max_restarts;
  say(s.str());
  const std::string rank_n = "rank " + std::to_string(f.value("rank", -1));
  if (f.contains("oom")) {
    say(rank_n + " was killed by the out-of-memory killer (" + f["oom"].get<std::string>() + ")");
  }
  if (f.contains("peak_rss_kib") || f.contains("mem_available_kib")) {
    std::string mem;
    if (f.contains("peak_rss_kib")) {
      mem = rank_n + "'s peak resident memory: " + format_kib(f["peak_rss_kib"].get<int64_t>());
    }
    if (f.contains("mem_available_kib")) {
      mem += (mem.empty() ? "" : "; ") +
             ("memory available on host " + f.value("host", std::string("?")) +
              " when it died: " + format_kib(f["mem_available_kib"].get<int64_t>()));
    }
    say(mem);
  }
  if (f.contains("error")) say("its error: " + f["error"].get<std::string>());
  const auto tail = f.value("tail", std::vector<std::string>{});
  if (tail.empty()) {
    say("rank " + std::to_string(f.value("rank", -1)) + " printed nothing");
  } else {
    std::string lines;
    for (const auto& l : tail) lines += "  | " + l + "\n";
    say("last lines of rank " + std::to_string(f.value("rank", -1)) + ":\n" +
        lines.substr(0, lines.size() - 1));
  }
  const std::string rank = "rank " + std::to_string(f.value("rank", -1));
  const std::string where =
      "node " + std::to_string(f.value("node", -1)) + ", host " + f.value("host", std::string("?"));
  if (f.contains("log_dir")) {
    const std::string dir = f["log_dir"].get<std::string>();
    say("the full output of " + rank + ": " + dir + "/stdout.log and " + dir + "/stderr.log (on " +
        where + ")");
  } else if (f.value("to_terminal", false)) {
    say("the full output of " + rank + " went to the terminal of the launcher on " + where);
  } else if (f.contains("to_terminal")) {
    say("the output of " + rank + " was not kept: --local-ranks-filter left it off the terminal " +
        "and there is no --log-dir");
  }
}

void Agent::print_peak_memory() const {
  std::string line;
  for (const auto& w : workers_) {
    const auto& st = w->proc->exit_status();
    if (!st || st->max_rss_kib < 0) continue;
    line += (line.empty() ? "" : ", ") +
            ("rank " + std::to_string(w->rank) + " " + format_kib(st->max_rss_kib));
  }
  if (!line.empty()) {
    say("peak resident memory of the workers on node " + std::to_string(node_rank_) + ": " +
        line);
  }
}

void Agent::publish_interrupted(int g, int sig) {
  try {
    const json f = {{"interrupted", true},
                    {"node", node_rank_},
                    {"signal", signal_name(sig)},
                    {"time", utc_now()}};
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
        if (o_.elastic && o_.node_rank != 0) {
          // Once its workers all succeeded the node is done: leaving would restart the others.
          if (!success_counted) publish_leaving(g, sig);
        } else {
          publish_interrupted(g, sig);
        }
        say("received " + signal_name(sig) + "; stopping the workers");
        stop_workers(sig);
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
      if (o_.elastic && o_.node_rank == 0 && !published) admit_while_running(g, success_counted);
      if (store_->check({gen_key(g, "failure")})) {
        result.outcome = Outcome::kFailed;
        result.failure = json::parse(store_->get_string(gen_key(g, "failure")));
        if (result.failure.value("membership", false)) {  // a node joins: nothing to judge
          stop_workers(SIGTERM);
          return result;
        }
        publish_final_views(g);  // before stopping: a stopped rank must still read as stopped
        stop_workers(SIGTERM);
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
    if (o_.elastic) {
      first_generation = elastic_rendezvous();
    } else {
      rendezvous();
    }
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
  return o_.elastic ? run_elastic(first_generation) : run_static();
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

std::chrono::milliseconds Agent::normal_exit_wait() const {
  return std::max<std::chrono::milliseconds>(
      kExitSyncTimeout,
      std::chrono::milliseconds(static_cast<int64_t>(o_.monitor_interval_s * 3000)) +
          std::chrono::seconds(5));
}

int Agent::run_static() {
  for (int g = 0;; ++g) {
    GenResult r = run_generation(g);
    switch (r.outcome) {
      case Outcome::kSucceeded:
        exit_sync(normal_exit_wait());
        return kExitOk;
      case Outcome::kInterrupted:
        exit_sync(kExitSyncAfterSignal);  // node 0 lets the others read why
        return 128 + r.signal;
      case Outcome::kStoreLost:
        say("lost node 0's store at " + o_.master_addr + ":" + std::to_string(store_port_) +
            " (its launcher exited or the network failed): " + r.why + "; workers stopped");
        return kExitJobFailed;
      case Outcome::kFailed:
        break;
    }
    // A lost node cannot take part in a restart (that needs elastic membership).
    const bool interrupted =
        r.failure.value("interrupted", false) || r.failure.value("lost", false);
    if (const int sig = take_signal()) {  // a Ctrl-C while the failed group was being stopped
      publish_interrupted(g + 1, sig);
      print_summary(r.failure, g);
      print_peak_memory();
      say("received " + signal_name(sig) + "; not restarting");
      exit_sync(kExitSyncAfterSignal);
      return 128 + sig;
    }
    if (g < o_.max_restarts && !interrupted) {
      const double delay = restart_delay();
      say("rank " + std::to_string(r.failure.value("rank", -1)) + " on node " +
          std::to_string(r.failure.value("node", -1)) + " ended with " +
          r.failure.value("status", std::string("?")) + "; restarting the whole group" +
          restart_delay_text(delay) + " (restart " + std::to_string(g + 1) + " of " +
          std::to_string(o_.max_restarts) + ")");
      try {
        store_->add(gen_key(g, "stopped"), 1);
        int sig = 0;
        const auto timeout =
            std::chrono::milliseconds(static_cast<int64_t>(o_.rdzv_timeout_s * 1000));
        if (!wait_for_count(gen_key(g, "stopped"), nnodes_, timeout, &sig)) {
          if (sig != 0) {
            // The others go on to generation g+1: meet them there with the stop.
            publish_interrupted(g + 1, sig);
            say("received " + signal_name(sig) + " while restarting; not restarting");
            exit_sync(kExitSyncAfterSignal);
            return 128 + sig;
          }
          say("not every node stopped its workers within the rendezvous timeout; giving up");
          print_summary(r.failure, g);
          print_peak_memory();
          return kExitJobFailed;
        }
      } catch (const Error& e) {
        say("lost node 0's store while restarting: " + e.message());
        return kExitJobFailed;
      }
      if (const int sig = wait_before_restart(delay)) {
        publish_interrupted(g + 1, sig);  // the other nodes meet it in generation g+1
        say("received " + signal_name(sig) + " while waiting to restart; not restarting");
        exit_sync(kExitSyncAfterSignal);
        return 128 + sig;
      }
      continue;
    }
    print_summary(r.failure, g);
    print_peak_memory();
    exit_sync(normal_exit_wait());
    return kExitJobFailed;
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
