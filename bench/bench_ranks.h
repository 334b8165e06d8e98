// Starting the ranks of a benchmark job from the benchmark itself: the program re-runs its own
// binary once per rank with torchrun's variables (RANK, WORLD_SIZE, ...) plus the caller's, and
// waits for all of them. Shared by bench/allreduce.cpp and bench/ddp.cpp.
#pragma once

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "lockstep/distributed/store/tcp_store.h"

extern char** environ;

namespace lockstep::bench {

// A port that was free a moment ago (a store bound to port 0, then closed).
inline uint16_t free_port() {
  dist::TCPStoreOptions so;
  so.port = 0;
  so.is_server = true;
  so.token = "";
  return dist::TCPStore(so).port();
}

// Runs `procs` copies of this binary on this machine as ranks 0..procs-1 of one job (loopback
// rendezvous), each with the current environment plus `extra_env` ("NAME=value"). Returns true
// when every rank exited 0.
inline bool run_ranks(int procs, const std::vector<std::string>& extra_env) {
  const uint16_t port = free_port();
  std::string exe = std::filesystem::read_symlink("/proc/self/exe").string();
  std::vector<pid_t> pids;
  bool ok = true;
  for (int r = 0; r < procs; ++r) {
    std::vector<std::string> env = {
        "RANK=" + std::to_string(r),       "WORLD_SIZE=" + std::to_string(procs),
        "LOCAL_RANK=" + std::to_string(r), "LOCAL_WORLD_SIZE=" + std::to_string(procs),
        "MASTER_ADDR=127.0.0.1",           "MASTER_PORT=" + std::to_string(port),
    };
    env.insert(env.end(), extra_env.begin(), extra_env.end());
    // The inherited environment, less what is set above (getenv returns the first match).
    for (char** e = environ; *e; ++e) {
      const std::string entry = *e;
      const std::string name = entry.substr(0, entry.find('=') + 1);
      bool overridden = false;
      for (const auto& mine : env) overridden = overridden || mine.rfind(name, 0) == 0;
      if (!overridden) env.push_back(entry);
    }
    std::vector<char*> envp;
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    std::vector<char*> argv = {exe.data(), nullptr};
    pid_t pid = 0;
    if (::posix_spawn(&pid, exe.c_str(), nullptr, nullptr, argv.data(), envp.data()) != 0) {
      std::fprintf(stderr, "bench: cannot start rank %d of %s\n", r, exe.c_str());
      ok = false;
      break;
    }
    pids.push_back(pid);
  }
  for (pid_t pid : pids) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  return ok;
}

}  // namespace lockstep::bench
