// Checking `lockstep run`'s options before anything starts: every number in its range, the
// program, the store's token and address (Notes [Store token] and [Store bind address] in
// run_options.cpp) and the log directory.
#pragma once

#include <map>
#include <set>
#include <string>
#include <vector>

#include "agent.h"
#include "restart_backoff.h"

namespace lockstep::launch {

// The ranges of the numeric options; messages and docs/LAUNCHER.md say the same.
// Each worker costs the launcher two pipes and a log file or two; beyond this, one launcher per
// GPU or socket is the better shape anyway.
inline constexpr int kMaxNprocPerNode = 4096;
inline constexpr int kMaxNnodes = 65536;  // with kMaxNprocPerNode, a world size that fits an int
inline constexpr int kMaxMaxRestarts = 1'000'000;
// The agent checks the store this often: below the floor it would spin on the store.
inline constexpr double kMinMonitorInterval = 0.01;
inline constexpr double kMaxMonitorInterval = 3600;
// --stall-timeout (Note [Stall watch] in agent_watch.cpp): 0 turns the warning off.
inline constexpr double kMaxStallTimeout = 7 * 24 * 3600;
// --node-timeout: how long an agent may go unheard before the others call its node lost.
inline constexpr double kMinNodeTimeout = 1;
inline constexpr double kMaxNodeTimeout = 3600;
// --stop-grace: the workers' time to save after a stopping signal.
inline constexpr double kMaxStopGrace = 3600;
inline constexpr double kMinRdzvTimeout = 0.1;
inline constexpr double kMaxRdzvTimeout = 7 * 24 * 3600;
// --run-id: one file-name component (Note [Run id] in run_options.cpp).
inline constexpr size_t kMaxRunIdLength = 128;

// The options as given: numbers as text, so that a bad one is reported by this code (naming the
// option or its environment variable and the range) rather than converted or clamped by CLI11.
struct RawRunOptions {
  std::string nproc = "1";
  std::string nnodes = "1";
  std::string node_rank = "0";
  std::string master_addr = "127.0.0.1";
  std::string master_port = "29500";
  bool standalone = false;
  std::string max_restarts = "0";
  std::string restart_backoff = "1";
  std::string monitor_interval = "0.1";
  std::string log_dir;
  bool tee = false;
  std::string local_ranks_filter;
  std::string run_id;
  std::string rdzv_timeout = "900";
  std::string rdzv_last_call = "30";
  std::string timeout;  // empty: the workers' own (InitOptions::timeout, else 30 minutes)
  std::string stall_timeout = "60";
  std::string node_timeout = "30";
  std::string stop_grace = "30";
  std::string token_file;
  bool insecure = false;
  // Options that were on the command line ("--nnodes"); the others came from LOCKSTEP_<NAME> or
  // their default.
  std::set<std::string> on_command_line;
  // Options whose LOCKSTEP_<NAME> was filled from torchrun's PET_ variable, and that variable
  // (Note [torchrun's variables]): "--nnodes" -> "PET_NNODES".
  std::map<std::string, std::string> from_torchrun;
};

// Note [torchrun's variables] (run_options.cpp): each option torchrun shares with `lockstep
// run` is taken from torchrun's PET_<NAME> when neither the command line nor LOCKSTEP_<NAME>
// gives it, by setting LOCKSTEP_<NAME>; recorded in raw.from_torchrun. UsageError when both
// variables are set and differ. Before the command line is parsed.
void adopt_torchrun_env(RawRunOptions& raw);

// "LOCKSTEP_MASTER_PORT" for "--master-port".
std::string env_name_of(const std::string& flag);

// Checks a flag's LOCKSTEP_<NAME> (when the command line does not give the flag) before CLI11
// reads it: UsageError naming the variable unless it is 1/0, true/false, yes/no or on/off.
void check_flag_env(const std::string& flag, const std::set<std::string>& on_command_line);

// Everything checked and resolved (the program found on PATH, the token read, the log directory
// tried); UsageError (exit code 2, nothing started) naming what is wrong. Warnings (--insecure)
// go to stderr.
RunOptions check_run_options(const RawRunOptions& raw, const std::vector<std::string>& command);

// The token of --token-file PATH: a regular file of this user that no one else may read or
// write, not empty; surrounding whitespace (an editor's newline) is not part of it.
std::string read_token_file(const std::string& path);

// That `dir` exists or can be created and that a file can be created in it (one is, and removed).
void check_log_dir(const std::string& dir);

}  // namespace lockstep::launch
