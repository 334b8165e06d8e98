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

#include "distributed/collective_sweep.h"
#include "distributed/spawn_ranks.h"
#include "lockstep/distributed/init.h"
#include "lockstep/distributed/store/tcp_store.h"
#include "testing.h"

using namespace lockstep;
using namespace lockstep::dist;
using namespace std::chrono_literals;
using lockstep::testing::exited_zero;
using lockstep::testing::Result;
using lockstep::testing::run_ranks_as_processes;

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
    opts.backend = "gloo";  // these are the Gloo backend's processes (auto would choose shm)
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

std::vector<Result> run_job(int world, const std::string& mode) {
  return run_ranks_as_processes(world, kModeEnv, mode, kReportEnv, kHangGuard);
}

class GlooProcesses : public ::testing::TestWithParam<int> {};

TEST_P(GlooProcesses, EveryCollectiveEveryDtypeMatchesReference) {
  const auto results = run_job(GetParam(), "sweep");
  for (size_t r = 0; r < results.size(); ++r) {
    EXPECT_TRUE(exited_zero(results[r])) << "rank " << r << ": " << results[r].report;
  }
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, GlooProcesses,
                         ::testing::ValuesIn(lockstep::testing::process_sweep_world_sizes(true)));

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
