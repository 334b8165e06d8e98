// `lockstep run` when a job goes wrong (docs/LAUNCHER.md, "When a job goes wrong"): the collective
// timeout set by --timeout / LOCKSTEP_TIMEOUT reaching the workers and ending a rank that waits
// for a collective its peer never issues; and what the summary says about a worker that a
// signal killed (its peak resident memory, the machine's available memory, the out-of-memory
// killer when it was the one).
#include <unistd.h>

#include <cstdio>
#include <regex>

#include <gmock/gmock.h>

#include "launch/launcher_process.h"

using namespace lockstep::testing::launch;
using ::testing::ContainsRegex;
using ::testing::HasSubstr;
using ::testing::Not;

namespace {

// The launcher's own lines on stderr: everything but workers' forwarded output.
std::string own_lines(const std::string& err) {
  std::string own;
  for (const auto& line : split_lines(err)) {
    if (line.rfind("[rank", 0) != 0) own += line + "\n";
  }
  return own;
}

TEST_F(Launcher, TimeoutReachesEveryWorkerAsLockstepTimeout) {
  Outcome o = run_launcher({"run", "--standalone", "--nproc-per-node", "2", "--timeout", "2.5",
                            kWorker, "env", out_.string()},
                           dir_, "flag");
  ASSERT_TRUE(o.exited_with(0)) << o.describe();
  auto reports = read_env_reports(out_);
  ASSERT_EQ(reports.size(), 2u) << o.describe();
  for (auto [r, e] : reports) EXPECT_EQ(e["LOCKSTEP_TIMEOUT"], "2.5") << "rank " << r;

  // From the launcher's environment, as every option.
  fs::remove_all(out_);
  fs::create_directories(out_);
  o = run_launcher({"run", "--standalone", "--nproc-per-node", "2", kWorker, "env", out_.string()},
                   dir_, "env", {"LOCKSTEP_TIMEOUT=7"});
  ASSERT_TRUE(o.exited_with(0)) << o.describe();
  reports = read_env_reports(out_);
  ASSERT_EQ(reports.size(), 2u) << o.describe();
  for (auto [r, e] : reports) EXPECT_EQ(e["LOCKSTEP_TIMEOUT"], "7") << "rank " << r;

  // Not given: not set (the program's own choice, else the library's default, stands).
  fs::remove_all(out_);
  fs::create_directories(out_);
  o = run_launcher({"run", "--standalone", kWorker, "env", out_.string()}, dir_, "none");
  ASSERT_TRUE(o.exited_with(0)) << o.describe();
  reports = read_env_reports(out_);
  ASSERT_EQ(reports.size(), 1u) << o.describe();
  EXPECT_EQ(reports.at(0).count("LOCKSTEP_TIMEOUT"), 0u);
}

TEST_F(Launcher, BadTimeoutIsAUsageError) {
  for (const char* bad : {"0", "-3", "abc", "1e9"}) {
    SCOPED_TRACE(bad);
    Outcome o = run_launcher({"run", "--timeout", bad, kWorker, "env", out_.string()}, dir_, "bad");
    expect_usage_error(o, out_, {"--timeout", "seconds", std::string("'") + bad + "'"});
    o = run_launcher({"run", kWorker, "env", out_.string()}, dir_, "bad_env",
                     {std::string("LOCKSTEP_TIMEOUT=") + bad});
    expect_usage_error(o, out_, {"LOCKSTEP_TIMEOUT", "--timeout", std::string("'") + bad + "'"});
  }
}

// Rank 1 never issues the all_reduce rank 0 waits in. The program sets no timeout: --timeout 2
// (LOCKSTEP_TIMEOUT in the workers) ends rank 0 after about 2 s instead of the default 30 min.
TEST_F(Launcher, ShortTimeoutEndsARankWaitingForASkippedCollective) {
  const auto start = std::chrono::steady_clock::now();
  const Outcome o = run_launcher({"run", "--standalone", "--nproc-per-node", "2", "--timeout", "2",
                                  kWorker, "skip-collective"},
                                 dir_, "launch",
                                 // Joining must not race the short timeout on a busy machine.
                                 {"LOCKSTEP_RENDEZVOUS_TIMEOUT=60"});
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_TRUE(o.exited_with(1)) << o.describe();
  std::smatch m;
  const std::string out = o.out + o.err;
  ASSERT_TRUE(std::regex_search(out, m, std::regex("rank 0 waited ([0-9]+) ms"))) << o.describe();
  const long waited = std::stol(m[1]);
  EXPECT_GE(waited, 1900) << o.describe();
  EXPECT_LT(waited, 10'000) << o.describe();
  EXPECT_LT(took, 60) << o.describe();
  const std::string own = own_lines(o.err);
  EXPECT_THAT(own, HasSubstr("the job failed: rank 0")) << o.describe();
  EXPECT_THAT(own, ContainsRegex("its error: .*(timed out|timeout)")) << o.describe();
}

}  // namespace
