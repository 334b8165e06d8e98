// Runs ranks of a job as real processes: the test binary re-runs itself with RANK, WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT and a mode variable that a static initializer in the test file
// turns into a worker.
#pragma once

#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "lockstep/base/error.h"
#include "lockstep/distributed/store/tcp_store.h"

namespace lockstep::testing {

struct Result {
  int status = 0;  // waitpid's status
  std::string report;
};

// Starts `world` ranks of this binary with mode_env=mode and torchrun's variables, and waits
// for all of them (killing them after hang_guard). Rank r's report file (report_env) is read
// back into results[r].report. Rank 0 hosts the store on a port that was free a moment ago.
inline std::vector<Result> run_ranks_as_processes(int world, const char* mode_env,
                                                  const std::string& mode, const char* report_env,
                                                  std::chrono::seconds hang_guard) {
  uint16_t port = 0;
  {
    dist::TCPStoreOptions so;
    so.port = 0;
    so.is_server = true;
    so.token = "";
    port = dist::TCPStore(so).port();
  }
  std::string exe(4096, '\0');
  const ssize_t n = ::readlink("/proc/self/exe", exe.data(), exe.size() - 1);
  LS_CHECK(n > 0, "readlink /proc/self/exe");
  exe.resize(static_cast<size_t>(n));
  const std::string dir = ::testing::TempDir();
  std::vector<pid_t> pids;
  std::vector<std::string> reports;
  for (int r = 0; r < world; ++r) {
    reports.push_back(dir + "/pg_report_" + std::to_string(::getpid()) + "_" + std::to_string(r));
    std::remove(reports.back().c_str());
    std::vector<std::string> env;
    for (char** e = environ; *e; ++e) {
      const std::string s(*e);
      // The job's own variables only (a surrounding launcher's must not leak in).
      if (s.rfind("RANK=", 0) == 0 || s.rfind("WORLD_SIZE=", 0) == 0 || s.rfind("LOCAL_", 0) == 0 ||
          s.rfind("MASTER_", 0) == 0 || s.rfind("LOCKSTEP_", 0) == 0 || s.rfind("SLURM_", 0) == 0 ||
          s.rfind("OMPI_", 0) == 0) {
        continue;
      }
      env.push_back(s);
    }
    env.push_back("RANK=" + std::to_string(r));
    env.push_back("WORLD_SIZE=" + std::to_string(world));
    env.push_back("LOCAL_RANK=" + std::to_string(r));
    env.push_back("LOCAL_WORLD_SIZE=" + std::to_string(world));
    env.push_back("MASTER_ADDR=127.0.0.1");
    env.push_back("MASTER_PORT=" + std::to_string(port));
    env.push_back(std::string(mode_env) + "=" + mode);
    env.push_back(std::string(report_env) + "=" + reports.back());
    env.push_back("OMP_NUM_THREADS=1");
    std::vector<char*> envp;
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    std::vector<char*> argv = {exe.data(), nullptr};
    pid_t pid = 0;
    LS_CHECK(::posix_spawn(&pid, exe.c_str(), nullptr, nullptr, argv.data(), envp.data()) == 0,
             "posix_spawn");
    pids.push_back(pid);
  }
  std::vector<Result> results(static_cast<size_t>(world));
  std::vector<bool> done(static_cast<size_t>(world), false);
  const auto deadline = std::chrono::steady_clock::now() + hang_guard;
  int remaining = world;
  while (remaining > 0) {
    for (int r = 0; r < world; ++r) {
      if (done[r]) continue;
      int status = 0;
      if (::waitpid(pids[r], &status, WNOHANG) == pids[r]) {
        results[r].status = status;
        done[r] = true;
        --remaining;
      }
    }
    if (remaining > 0 && std::chrono::steady_clock::now() > deadline) {
      for (int r = 0; r < world; ++r) {
        if (!done[r]) ::kill(pids[r], SIGKILL);
      }
      for (int r = 0; r < world; ++r) {
        if (!done[r]) ::waitpid(pids[r], &results[r].status, 0);
      }
      ADD_FAILURE() << "ranks still running after " << hang_guard.count() << " s: killed";
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  for (int r = 0; r < world; ++r) {
    std::ifstream in(reports[r]);
    results[r].report.assign(std::istreambuf_iterator<char>(in), {});
    std::remove(reports[r].c_str());
  }
  return results;
}

inline bool exited_zero(const Result& r) {
  return WIFEXITED(r.status) && WEXITSTATUS(r.status) == 0;
}

}  // namespace lockstep::testing
