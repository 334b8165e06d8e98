// The node agent's insides, shared by its files (agent.cpp, agent_rendezvous.cpp,
// agent_membership.cpp, agent_workers.cpp, agent_restart.cpp, agent_watch.cpp): its constants, the
// worker record, and the Agent class, its methods grouped by the file that defines them. Only
// agent.h is the agent's interface.
#pragma once

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <ctime>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "agent.h"
#include "lockstep/base/syscall.h"
#include "lockstep/distributed/store/tcp_store.h"
#include "output.h"
#include "restart_backoff.h"
#include "verdict.h"
#include "why_died.h"
#include "worker_process.h"

namespace lockstep::launch::agent_detail {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

// SIGTERM first; what is still alive after this gets SIGKILL. After a failure: the others are
// stuck in collectives with the failed rank, and a worker that catches SIGTERM to save
// (Note [Preemption]) cannot agree with its peers. After a signal, --stop-grace instead.
constexpr auto kStopGrace = std::chrono::seconds(3);
// How long node 0 keeps the store up for the other agents to read the outcome (at least; also
// three monitor intervals, since that is how long an agent may take to look).
constexpr auto kExitSyncTimeout = std::chrono::seconds(10);
// After a signal the wait is short: the user asked the job to stop.
constexpr auto kExitSyncAfterSignal = std::chrono::seconds(3);
// Connection attempts to node 0's store are made in slices this long, so that a signal is seen.
constexpr auto kConnectSlice = std::chrono::seconds(1);
// SIGKILLed workers that have still not exited after this (stuck in the kernel) are given up.
constexpr auto kKillWait = std::chrono::seconds(10);
// A worker's error message (LOCKSTEP_ERROR_FILE) in the failure summary is cut to this.
constexpr size_t kMaxError = 2048;
// How long the output of exited workers is still read (a grandchild that escaped the process
// group could hold a pipe open forever).
constexpr auto kDrainTimeout = std::chrono::seconds(1);
// After a failure, how long an agent waits for the other nodes' views of their ranks before it
// prints the verdict without them.
constexpr auto kFinalViewWait = std::chrono::seconds(5);
// What a node waiting for node 0's answer or for a generation allows beyond
// --rdzv-timeout + --node-timeout: node 0 may first have to stop a running generation
// (kStopGrace, kKillWait, kFinalViewWait).
constexpr auto kAnswerMargin = std::chrono::seconds(30);
// The stall watch looks at most this often, and at least four times per --stall-timeout and six
// times per --node-timeout.
constexpr double kMaxWatchInterval = 5.0;
constexpr double kMinWatchInterval = 0.2;

// The agent's own failures, for the user: no source location.
struct AgentError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A signal stopped the agent before its workers ran.
struct Interrupted : std::runtime_error {
  explicit Interrupted(int sig)
      : std::runtime_error("interrupted by " + signal_name(sig)), signal(sig) {}
  int signal;
};

// adopt_members: node 0 left this node out of the generation (refused, or found lost).
struct LeftOut : AgentError {
  using AgentError::AgentError;
};

// adopt_members, in a job of fixed size: node 0 left this live node out of the generation (found
// lost while it was only slow, or late to say it stopped); it asks to join again.
struct Rejoin : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

inline std::string hostname() {
  char buf[256] = {};
  ::gethostname(buf, sizeof buf - 1);
  return buf;
}

// JSON text of a failure record; invalid UTF-8 in a worker's lines becomes U+FFFD rather than an
// exception.
inline std::string dump(const nlohmann::json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

inline std::string random_hex(size_t bytes) {
  std::random_device rd;
  std::string s;
  const char* digits = "0123456789abcdef";
  for (size_t i = 0; i < bytes; ++i) {
    const unsigned v = rd() & 0xff;
    s += digits[v >> 4];
    s += digits[v & 15];
  }
  return s;
}

inline std::string seconds_text(double s) {
  std::ostringstream o;
  o << s;
  return o.str();
}

inline int online_cpus() {
  const long n = ::sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

struct Worker {
  int local_rank = 0;
  int rank = 0;
  std::string error_file;
  std::string trace_file;                // Note [Collective trace]: the world group's ring
  int64_t stopped_since_ns = 0;          // first seen in state T (0: running)
  int64_t exited_ns = 0;                 // first seen exited
  bool join_checked = false;             // exited 0: Note [A rank that leaves before joining]
  std::string log_dir;                   // its stdout.log and stderr.log, with --log-dir
  std::unique_ptr<WorkerOutput> output;  // where its lines go (output.h)
  std::unique_ptr<WorkerProcess> proc;
};

enum class Outcome { kSucceeded, kFailed, kInterrupted, kStoreLost };

// A process's state letter from /proc/<pid>/stat ('R', 'S', 'T', ...); 0 if unreadable.
inline char process_state(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(in, line)) return 0;
  const size_t paren = line.rfind(')');  // the command name may hold spaces and parentheses
  return paren != std::string::npos && paren + 2 < line.size() ? line[paren + 2] : 0;
}

// A node of a generation (Note [Membership] in agent_membership.cpp).
struct Member {
  int id = 0;  // its --node-rank
  std::string host;
  int64_t ticket = 0;  // its join request; 0: node 0, which hosts the store and asks no one

  json to_json() const { return {{"id", id}, {"host", host}, {"ticket", ticket}}; }
  static Member from_json(const json& j) {
    return {j.at("id").get<int>(), j.at("host").get<std::string>(), j.at("ticket").get<int64_t>()};
  }
};

// "0 (host a), 2 (host b)": nodes by --node-rank, for messages.
inline std::string nodes_text(const std::vector<Member>& ms) {
  std::string s;
  for (const auto& m : ms) {
    s += (s.empty() ? "" : ", ") + std::to_string(m.id) + " (host " + m.host + ")";
  }
  return s;
}

struct GenResult {
  Outcome outcome = Outcome::kFailed;
  json failure;     // kFailed: the first failure of the generation
  int signal = 0;   // kInterrupted
  bool left = false;  // kInterrupted: this node left an elastic job (the others go on)
  std::string why;  // kStoreLost
};

class Agent {
 public:
  Agent(const RunOptions& o, Terminal& terminal)
      : o_(o),
        terminal_(terminal),
        nnodes_(o.nnodes),
        node_rank_(o.node_rank),
        backoff_(o.restart_backoff_s) {}
  ~Agent() {
    workers_.clear();
    if (!tmp_dir_.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(tmp_dir_, ec);
    }
  }

  int run();

 private:
  std::string key(const std::string& k) const { return "lockstep/" + o_.run_id + "/agent/" + k; }
  std::string gen_key(int g, const std::string& k) const {
    return key("gen" + std::to_string(g) + "/" + k);
  }
  // Of the current generation: with --nnodes MIN:MAX they change when nodes leave or join.
  int world_size() const { return nnodes_ * o_.nproc_per_node; }
  // Note [Membership]: the policy that makes a job of fixed size (--nnodes N) what it is, an
  // elastic one with MIN = MAX = N that stops rather than changes. A node other than node 0
  // leaves on a signal only in an elastic job; in a fixed one every node's signal stops the job.
  bool leaves_on_signal() const { return o_.elastic && o_.node_rank != 0; }
  // "--nnodes 2" or "--nnodes 1:4", as the user gave it.
  std::string nnodes_text() const {
    return "--nnodes " + (o_.elastic ? std::to_string(o_.min_nodes) + ":" : std::string()) +
           std::to_string(o_.nnodes);
  }
  void say(const std::string& msg) const { terminal_.say(msg); }

  // agent.cpp: signals, the loop of generations, the end of the job
  void setup_signals();
  // A SIGINT/SIGTERM/SIGHUP received so far (the first one), or 0. Reads everything queued on
  // the signalfd; a signal is remembered until the agent acts on it.
  int take_signal();
  GenResult run_generation(int g);
  // `by_worker`: the workers stopped on a signal of their own (Note [Preemption]).
  void publish_interrupted(int g, int sig, bool by_worker = false);
  // A node other than node 0 out of generation g (a signal): node 0 does not form it with this
  // node; an elastic job goes on without it, a fixed one stops (Note [Membership]), also if node
  // 0 started the generation meanwhile.
  void withdraw(int g, int sig);
  void exit_sync(std::chrono::milliseconds timeout);
  // How long node 0 keeps the store up at the end for the others to read the outcome.
  std::chrono::milliseconds normal_exit_wait() const;
  // The one loop of generations, fixed or elastic, from generation g (Note [Membership]).
  int run_generations(int g);

  // agent_rendezvous.cpp: node 0's store, the first rendezvous, joining, adopting a generation
  void connect_store();
  // Node 0 forms generation 0, another node asks to join; returns the generation it starts in.
  int rendezvous();
  // A node other than node 0: asks node 0 to join; returns the generation it joins.
  int join_job();
  // Every node: reads gen<g>/members (waiting for it), sets members_, nnodes_, node_rank_; an
  // AgentError when the job was aborted or this node was left out.
  void adopt_members(int g);
  bool wait_for_count(const std::string& k, int64_t want, std::chrono::milliseconds timeout,
                      int* interrupted);
  // Waits for node 0 to write key k; on a signal (Interrupted) or past the deadline (AgentError
  // starting with `what`) it first sets `withdrawn` (unless empty) for node 0 to see. Once
  // `delay_key` (unless empty) holds node 0's restart backoff, the deadline moves by it (Note
  // [Restart backoff]); `recheck` (unless empty) runs at every look and may throw an AgentError
  // (withdrawn first too).
  void wait_for_node_zero(const std::string& k, const std::string& withdrawn,
                          const std::string& what, const std::string& delay_key = "",
                          const std::function<void()>& recheck = {});
  // The host of the generation's node n, for messages ("?" when unknown).
  std::string host_of(int n);

  // agent_membership.cpp: Note [Membership]
  // Node 0: join requests not yet answered, those that may join (others refused at once).
  // (Not those with an id already in `forming`, the members a rendezvous is forming.) With
  // `fatal` (a rendezvous of a fixed job), a node that runs another command or another version
  // ends the reading: it is refused, and *fatal says why the job cannot start.
  std::vector<Member> take_join_requests(const std::vector<Member>& forming = {},
                                         std::string* fatal = nullptr);
  // Node 0: takes out of `members` the nodes that withdrew from generation g (a signal or a
  // timeout while they waited for it); returns what it said about them (empty: none).
  std::string drop_withdrawn(int g, std::vector<Member>& members);
  void answer_join(const Member& m, const json& reply);
  // A join refused for want of room: the job already has MAX nodes.
  std::string full_text(const Member& m) const;
  void refuse_waiting_joins(const std::string& why);
  // Node 0, while generation g runs: a node that asks to join (and fits) stops the generation,
  // unless `ending` (node 0's workers all succeeded: the job is about to end; it is refused).
  void admit_while_running(int g, bool ending);
  // Node 0: waits for MIN nodes and the last call (joins answered meanwhile), then publishes
  // gen<g>/members; false when it published an abort instead (why in *why).
  bool form_generation(int g, std::vector<Member> members, std::string* why);
  // Node 0: publishes an abort of generation g (the nodes in `members` are answered so that they
  // read it) and keeps in told_ the tickets of those that will say they read it.
  void abort_generation(int g, const std::vector<Member>& members, const std::string& why);
  // Node 0, the job ending at a rendezvous: waits (briefly) until the nodes it told have read
  // why (join/<t>/told), so that they do not lose the store instead.
  void wait_until_told();
  // A joiner: says it read node 0's answer that the job cannot start.
  void say_told();
  void publish_leaving(int g, int sig);

  // agent_workers.cpp: the worker set, the failure record and its summary
  void start_workers(int g);
  // Drains every readable stream for up to `timeout` (0: what is there now).
  void pump_output(std::chrono::milliseconds timeout);
  bool all_exited();
  void reap();
  // `sig` to every live worker's process group, SIGKILL to those alive `grace` later; returns
  // when all have exited and their output has been read.
  void stop_workers(int sig, std::chrono::milliseconds grace = kStopGrace);
  // The grace after a stopping signal: --stop-grace.
  std::chrono::milliseconds stop_grace() const {
    return std::chrono::milliseconds(static_cast<int64_t>(o_.stop_grace_s * 1000));
  }
  void drain_after_exit();
  // Reads a failed worker's remaining output (its last lines belong in the summary).
  void drain_worker(Worker& w);
  // Note [A rank that leaves before joining]
  void tell_ranks_waiting_to_join(int g);
  json describe_failure(const Worker& w) const;
  // The signal a worker that exited 128 + it said it stopped on to save (its error file's
  // stop_signal, Note [Preemption]), or 0.
  int stop_signal_of(const Worker& w) const;
  void print_summary(const json& f, int generation) const;
  // One line: every local worker's peak resident memory (after they all exited).
  void print_peak_memory() const;

  // agent_restart.cpp: between generations
  // Note [Restart backoff]: the wait before restarting after the generation that just ended,
  // said as " in 0.4 s" (empty for none); then waited for, watching for a signal (returned, or 0).
  double restart_delay();
  static std::string restart_delay_text(double delay_s);
  int wait_before_restart(double delay_s);
  // Node 0, after generation g failed: the nodes still here and whether the restart counts;
  // false when the job ends (why in *why).
  bool next_generation(int g, const json& failure, std::string* why);
  // Node 0, after generation g failed: the node new in g whose workers failed before the
  // generation ran with it (none of its ranks finished a collective), if that is the failure.
  std::optional<Member> newcomer_failed_at_start(int g, const json& failure);
  std::string event_text(const json& failure) const;

  // agent_watch.cpp: Note [Stall watch]
  std::optional<std::string> try_get(const std::string& k);
  void observe_processes();
  RankView view_of(const Worker& w) const;
  json local_views() const;
  // Every rank's view: this node's as of now, the others' as last published under `kind`.
  std::vector<RankView> all_views(int g, const std::string& kind, const json& mine);
  // Publishes this node's views (the heartbeat), judges a stall (node 0 warns), and returns a
  // failure record when another node has gone unheard for --node-timeout.
  std::optional<json> watch(int g);
  // SIGUSR1: the verdict and every rank's details, now, without stopping anything.
  void report_now(int g);
  // After a failure, before the workers are stopped: this node's views for the verdict; then,
  // once they are stopped, every node's, judged into verdict_lines_.
  void publish_final_views(int g);
  void judge_failure(int g);

  RunOptions o_;
  Terminal& terminal_;
  // The current generation's node count and this node's place in it (its ranks are
  // node_rank_ * nproc_per_node + local rank): set by adopt_members.
  int nnodes_;
  int node_rank_;
  // Note [Membership]
  std::vector<Member> members_;  // the current generation's, by id
  std::vector<Member> pending_;  // node 0: admitted to the next generation
  std::set<int> newcomers_;      // node 0: ids in the current generation, not in the one before
  int64_t next_ticket_ = 1;      // node 0: the first join request not yet read
  std::set<int64_t> admitted_;   // node 0: join requests answered with a generation
  // node 0: a ticket taken but its request not written yet, since when (skipped after
  // --node-timeout: its agent may have died in between)
  int64_t unwritten_ticket_ = 0;
  std::optional<Clock::time_point> unwritten_since_;
  int restarts_used_ = 0;        // failures restarted (elastic membership changes do not count)
  std::vector<int64_t> told_;    // node 0: join tickets told why the job cannot start
  int64_t my_ticket_ = 0;        // this node's last join request (0: node 0, or none yet)
  RestartBackoff backoff_;       // Note [Restart backoff]
  Clock::time_point generation_started_{};
  Fd sigfd_;
  int pending_signal_ = 0;
  bool second_interrupt_ = false;  // a SIGINT after the stopping signal: SIGKILL without grace
  std::string tmp_dir_;
  std::string token_;
  uint16_t store_port_ = 0;
  std::unique_ptr<dist::TCPStore> store_;
  std::vector<std::unique_ptr<Worker>> workers_;
  // Note [Out-of-memory evidence] in why_died.h: the cgroup's count when the workers started.
  std::optional<OomCounter> oom_counter_;
  std::optional<int64_t> oom_kills_at_start_;
  bool report_requested_ = false;  // SIGUSR1 arrived
  // Note [Stall watch]
  int64_t beat_ = 0;
  std::map<int, std::pair<std::string, Clock::time_point>> heard_;  // node: last view, when
  std::string warned_;                      // the last stall warning printed
  json final_views_;                        // this node's, captured at the failure
  std::vector<std::string> verdict_lines_;  // printed first in the failure summary
};

}  // namespace lockstep::launch::agent_detail
