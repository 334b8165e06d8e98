// The node agent of `lockstep run`: rendezvous with the other machines' agents through the TCP
// store, start this machine's workers, relay their output, stop everyone on the first failure,
// restart the whole group while restarts remain, and report.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

#include "output.h"

namespace lockstep::launch {

// Exit codes of `lockstep run`.
inline constexpr int kExitOk = 0;
inline constexpr int kExitJobFailed = 1;
inline constexpr int kExitUsage = 2;  // bad input, found before any worker started

// Where node 0's store listens (Note [Store bind address] in run_options.cpp).
struct StoreBind {
  std::string address;  // empty: every interface
  std::string why;      // for the line that says where
};

struct RunOptions {
  int nproc_per_node = 1;
  // --nnodes N, or MIN:MAX (elastic: Note [Membership] in agent_membership.cpp). nnodes is N
  // or MAX.
  int nnodes = 1;
  int min_nodes = 1;
  bool elastic = false;
  // Elastic: once MIN nodes have joined, how long a rendezvous waits for more (up to MAX).
  double rdzv_last_call_s = 30;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;  // 0: any free port (one machine)
  bool standalone = false;  // one machine; the store takes a free port on loopback
  int max_restarts = 0;
  // Seconds before the first restart, doubling while generations fail quickly (Note [Restart
  // backoff] in restart_backoff.h); 0: at once.
  double restart_backoff_s = 1;
  double monitor_interval_s = 0.1;
  OutputOptions output;  // where the workers' lines go: terminal, log files (output.h)
  std::string run_id = "none";
  // The store's shared secret (Note [Store token] in run_options.cpp); empty: a random one, on
  // one machine. token_source says where it came from ("--token-file PATH", ...).
  std::string token;
  std::string token_source;
  StoreBind store_bind;  // node 0 only
  double rdzv_timeout_s = 900;
  // --timeout: the workers' collective timeout in seconds, passed as LOCKSTEP_TIMEOUT (checked,
  // as given); empty: not set, LOCKSTEP_TIMEOUT is removed from the workers' environment.
  std::string timeout;
  // Note [Stall watch] in agent_watch.cpp: warn (once per collective) when ranks have waited this
  // long in a collective another rank holds up; 0: never.
  double stall_timeout_s = 60;
  // A node whose agent has not been heard from for this long is lost: the job fails.
  double node_timeout_s = 30;
  // When the job is stopped by a signal (the launcher's own, or another node's), how long the
  // workers have to finish their step and save (Note [Preemption] in
  // include/lockstep/distributed/preemption.h) before SIGKILL.
  double stop_grace_s = 30;
  std::string program;  // resolved, absolute
  std::vector<std::string> args;
};

// Thrown for bad input, found by the option checks (run_options.h) or by the agent itself (a
// port in use); exit code 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Runs the agent of this node until the job ends; returns the launcher's exit code (0, 1, or
// 128 + signal when SIGINT/SIGTERM stopped it).
int run_agent(const RunOptions& opts);

}  // namespace lockstep::launch
