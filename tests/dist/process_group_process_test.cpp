// ProcessGroup as real processes over TCP: the test binary re-runs itself as the ranks of a job,
// with the environment a launcher would set, and each rank calls init_process_group().
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <thread>

#include "dist/collective_sweep.h"
#include "lockstep/dist/init.h"
#include "lockstep/dist/tcp_store.h"
#include "testing.h"

using namespace lockstep;
using namespace lockstep::dist;
using namespace std::chrono_literals;

namespace {

constexpr const char* kModeEnv = "LOCKSTEP_TEST_PG_MODE";
constexpr const char* kReportEnv = "LOCKSTEP_TEST_PG_REPORT";
// Longer than any healthy run of these workers; a worker still alive then is a hang.
constexpr auto kHangGuard = 240s;
// The dying-peer test gives its collective a timeout far beyond the hang guard, so only a prompt
// failure (a closed connection) can end it in time.
constexpr auto kDyingPeerCollectiveTimeout = std::chrono::milliseconds(3'600'000);

void write_report(const std::string& text) {
  if (const char* path = std::getenv(kReportEnv)) std::ofstream(path) << text;
}

int worker_main(const std::string& mode) {
  try {
    InitOptions opts;
    opts.timeout = mode == "die" ? kDyingPeerCollectiveTimeout : 60s;
    auto pg = init_process_group(opts);
    LS_CHECK(is_initialized() && rank() == pg->rank() && world_size() == pg->size(),
             "accessors disagree with the group");
    LS_CHECK(is_main_process() == (rank() == 0), "is_main_process");
    LS_CHECK(pg->backend() == "gloo" || world_size() == 1, "backend ", pg->backend());
    if (mode == "sweep") {
      lockstep::testing::run_collective_sweep(*pg);
    } else if (mode == "die") {
      pg->barrier()->wait();
      if (rank() == world_size() - 1) _exit(7);  // dies without a word, like a SIGKILLed rank
      Tensor x = full({1 << 16}, 1.0, kFloat32);
      try {
        pg->all_reduce(x)->wait();
        LS_THROW("all_reduce succeeded although rank ", world_size() - 1, " is dead");
      } catch (const Error& e) {
        write_report(e.what());
        destroy_process_group();
        return 0;
      }
    } else if (mode == "subgroups") {
      // Even and odd ranks form groups; every rank reduces within its own.
      auto evens = new_group({0, 2});
      auto odds = new_group({1, 3});
      auto mine = rank() % 2 == 0 ? evens : odds;
      LS_CHECK(mine && mine->size() == 2 && mine->rank() == rank() / 2, "subgroup membership");
      LS_CHECK((rank() % 2 == 0 ? odds : evens) == nullptr, "a non-member got a group");
      Tensor x = full({5}, static_cast<double>(rank()), kInt64);
      mine->all_reduce(x)->wait();
      const double want = rank() % 2 == 0 ? 0 + 2 : 1 + 3;
      for (double v : x.to_vector<double>()) LS_CHECK(v == want, "subgroup sum ", v);
      pg->barrier()->wait();
    }
    destroy_process_group();
    LS_CHECK(!is_initialized(), "still initialized after destroy_process_group()");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[rank %s] %s\n", std::getenv("RANK"), e.what());
    write_report(e.what());
    return 1;
  }
}

[[maybe_unused]] const bool kRanAsWorker = [] {
  const char* mode = std::getenv(kModeEnv);
  if (mode == nullptr) return false;
  std::exit(worker_main(mode));
}();

struct Result {
  int status = 0;  // waitpid's status
  std::string report;
};

// Starts `world` ranks of this binary in `mode` and waits for all of them (killing them after
// kHangGuard). Rank 0 hosts the store on a port that was free a moment ago.
std::vector<Result> run_job(int world, const std::string& mode) {
  uint16_t port = 0;
  {
    TCPStoreOptions so;
    so.port = 0;
    so.is_server = true;
    so.token = "";
    port = TCPStore(so).port();
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
    env.push_back(std::string(kModeEnv) + "=" + mode);
    env.push_back(std::string(kReportEnv) + "=" + reports.back());
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
  const auto deadline = std::chrono::steady_clock::now() + kHangGuard;
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
      ADD_FAILURE() << "ranks still running after " << kHangGuard.count() << " s: killed";
      break;
    }
    std::this_thread::sleep_for(10ms);
  }
  for (int r = 0; r < world; ++r) {
    std::ifstream in(reports[r]);
    results[r].report.assign(std::istreambuf_iterator<char>(in), {});
    std::remove(reports[r].c_str());
  }
  return results;
}

bool exited_zero(const Result& r) { return WIFEXITED(r.status) && WEXITSTATUS(r.status) == 0; }

class GlooProcesses : public ::testing::TestWithParam<int> {};

TEST_P(GlooProcesses, EveryCollectiveEveryDtypeMatchesReference) {
  const auto results = run_job(GetParam(), "sweep");
  for (size_t r = 0; r < results.size(); ++r) {
    EXPECT_TRUE(exited_zero(results[r])) << "rank " << r << ": " << results[r].report;
  }
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, GlooProcesses, ::testing::Values(1, 2, 3, 4));

TEST(GlooProcesses, DyingPeerFailsTheOthersPromptly) {
  // Rank 3 exits in the middle of the job; ranks 0-2 are inside an all_reduce whose timeout is an
  // hour. Ranks 0 and 2 are rank 3's neighbours on the ring; rank 1 hears of it because the
  // failed ranks close their connections.
  const auto results = run_job(4, "die");
  ASSERT_EQ(results.size(), 4u);
  EXPECT_TRUE(WIFEXITED(results[3].status) && WEXITSTATUS(results[3].status) == 7);
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(exited_zero(results[r])) << "rank " << r << ": " << results[r].report;
    EXPECT_THAT(results[r].report, ::testing::HasSubstr("all_reduce #2"));
    EXPECT_THAT(results[r].report, ::testing::HasSubstr("closed its connection"));
    EXPECT_THAT(results[r].report, ::testing::Not(::testing::HasSubstr("timed out")));
  }
}

TEST(GlooProcesses, NewGroupReducesWithinSubsets) {
  const auto results = run_job(4, "subgroups");
  for (size_t r = 0; r < results.size(); ++r) {
    EXPECT_TRUE(exited_zero(results[r])) << "rank " << r << ": " << results[r].report;
  }
}

}  // namespace
