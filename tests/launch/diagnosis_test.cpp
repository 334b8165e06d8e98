// `lockstep run` when a job goes wrong (docs/LAUNCHER.md, "When a job goes wrong"): the collective
// timeout set by --timeout / LOCKSTEP_TIMEOUT reaching the workers and ending a rank that waits
// for a collective its peer never issues; and what the summary says about a worker that a
// signal killed (its peak resident memory, the machine's available memory, the out-of-memory
// killer when it was the one).
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <regex>
#include <string>
#include <thread>

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

// Whether process `pid` holds SIGUSR1 blocked (its SigBlk mask in /proc): `lockstep run` does from
// its first lines on, so a report asked for before the agent reads signals waits instead of
// killing the launcher, the default action.
bool blocks_sigusr1(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("SigBlk:", 0) == 0) {
      return (std::stoull(line.substr(7), nullptr, 16) >> (SIGUSR1 - 1)) & 1;
    }
  }
  return false;
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

// The number in "<what>: 12.3 MiB" (or KiB, GiB) of `text`, in MiB; -1 when absent.
double mib_after(const std::string& text, const std::string& what) {
  std::smatch m;
  if (!std::regex_search(text, m, std::regex(what + "([0-9.]+) (KiB|MiB|GiB)"))) return -1;
  const double v = std::stod(m[1]);
  return m[2] == "KiB" ? v / 1024 : m[2] == "GiB" ? v * 1024 : v;
}

TEST_F(Launcher, WorkerKilledBySignalReportsItsPeakMemory) {
  // Rank 1 touches 64 MiB, then SIGKILLs itself: not the out-of-memory killer.
  const Outcome o = run_launcher(
      {"run", "--standalone", "--nproc-per-node", "2", kWorker, "alloc", "64", "kill", "1"}, dir_,
      "launch");
  EXPECT_TRUE(o.exited_with(1)) << o.describe();
  const std::string own = own_lines(o.err);
  EXPECT_THAT(own, HasSubstr("rank 1 (local rank 1 on node 0")) << o.describe();
  EXPECT_THAT(own, HasSubstr("SIGKILL")) << o.describe();
  EXPECT_GE(mib_after(own, "rank 1's peak resident memory: "), 64) << o.describe();
  EXPECT_GT(mib_after(own, "memory available on host [^ ]+ when it died: "), 0) << o.describe();
  // Every worker of the node, the one that was stopped too. What the program holds before it
  // touches anything depends on the build (a CUDA build maps its libraries: about 90 MiB), so
  // the two ranks are compared: rank 1 holds the 64 MiB it touched more than rank 0.
  const double rank0 = mib_after(own, "peak resident memory of the workers on node 0: rank 0 ");
  const double rank1 =
      mib_after(own, "peak resident memory of the workers on node 0: rank 0 [^,]+, rank 1 ");
  EXPECT_GT(rank0, 0) << o.describe();
  EXPECT_GE(rank1 - rank0, 64 * 0.9) << o.describe();
  EXPECT_THAT(own, Not(HasSubstr("out-of-memory"))) << o.describe();
}

// A memory cgroup of its own for the test (cgroup v2 with the memory controller, else v1's
// memory hierarchy), limited to `limit` bytes without swap; removed at the end. `skip` says why
// none could be made.
struct MemoryCgroup {
  fs::path dir;
  std::string skip;

  explicit MemoryCgroup(int64_t limit) {
    const std::string name = "lockstep_test_" + std::to_string(::getpid());
    const std::string controllers = read_text("/sys/fs/cgroup/cgroup.controllers");
    const bool v2 = controllers.find("memory") != std::string::npos;
    const fs::path root = v2 ? "/sys/fs/cgroup" : "/sys/fs/cgroup/memory";
    if (!v2 && !fs::exists(root / "memory.limit_in_bytes")) {
      skip =
          "no memory cgroup: neither cgroup v2 with the memory controller nor v1's memory "
          "hierarchy is mounted under /sys/fs/cgroup";
      return;
    }
    std::error_code ec;
    if (!fs::create_directory(root / name, ec) || ec) {
      skip = "cannot create a memory cgroup in " + root.string() + ": " +
             (ec ? ec.message() : "it exists") + " (not root, or a read-only cgroup mount)";
      return;
    }
    dir = root / name;
    const std::string bytes = std::to_string(limit);
    const bool ok = v2 ? write(dir / "memory.max", bytes) && write(dir / "memory.swap.max", "0")
                       : write(dir / "memory.limit_in_bytes", bytes);
    // No swap to escape to: the worker must meet the limit, not page out to disk.
    const bool memsw = !v2 && fs::exists(dir / "memory.memsw.limit_in_bytes");
    if (memsw) write(dir / "memory.memsw.limit_in_bytes", bytes);
    if (!ok) {
      skip = "cannot set the memory limit of " + dir.string();
    } else if (!v2 && !memsw && split_lines(read_text("/proc/swaps")).size() > 1) {
      skip = "swap is on and cgroup v1 here cannot limit it (no memory.memsw.limit_in_bytes)";
    }
  }
  ~MemoryCgroup() {
    if (dir.empty()) return;
    // Its processes have exited; an empty cgroup can be removed (retried: exit takes a moment).
    for (int i = 0; i < 100 && ::rmdir(dir.c_str()) != 0; ++i) std::this_thread::sleep_for(50ms);
  }
  static bool write(const fs::path& p, const std::string& v) {
    std::ofstream out(p);
    out << v;
    out.flush();
    return static_cast<bool>(out);
  }
};

TEST_F(Launcher, WorkerKilledByTheOomKillerIsSaidSo) {
  // The launcher and its workers in a cgroup of 384 MiB; rank 1 touches 1 GiB. The limit leaves
  // room for what the three processes hold before (a CUDA build's workers map about 90 MiB of
  // libraries each), so that rank 1, growing, is the one the killer picks.
  MemoryCgroup cg(int64_t{384} << 20);
  if (!cg.skip.empty()) GTEST_SKIP() << cg.skip;
  const Outcome o = wait_launcher(start_launcher(
      {"run", "--standalone", "--nproc-per-node", "2", kWorker, "alloc", "1024", "hold", "1"}, dir_,
      "launch", {}, -1, 0, "echo $$ > " + (cg.dir / "cgroup.procs").string()));
  EXPECT_TRUE(o.exited_with(1)) << o.describe();
  const std::string own = own_lines(o.err);
  EXPECT_THAT(own, HasSubstr("rank 1 (local rank 1 on node 0")) << o.describe();
  EXPECT_THAT(own, HasSubstr("SIGKILL")) << o.describe();
  EXPECT_THAT(own, HasSubstr("rank 1 was killed by the out-of-memory killer (the oom_kill count "
                             "of " +
                             cg.dir.string()))
      << o.describe();
  // Near the limit, far below the 1 GiB it asked for: its anonymous memory grew to 384 MiB less
  // what the launcher and rank 0 hold; the resident size adds the program's mapped files.
  const double peak = mib_after(own, "rank 1's peak resident memory: ");
  EXPECT_GT(peak, 32) << o.describe();
  EXPECT_LT(peak, 512) << o.describe();
  EXPECT_THAT(own, Not(HasSubstr("touched 1024 MiB"))) << o.describe();
}

// ---- The verdict, the stall warning and SIGUSR1 (Note [Verdict], Note [Stall watch]) --

// The position of `what` in `text` (npos when absent), for checking the order of lines.
size_t at(const std::string& text, const std::string& what) { return text.find(what); }

// Rank 1 never issues the all_reduce rank 0 waits in: within --stall-timeout the launcher warns
// naming rank 1, without stopping anything; at --timeout the job fails and the summary starts
// with the verdict, then each rank's details, then the failure.
TEST_F(Launcher, ARankThatNeverIssuedTheCollectiveIsWarnedAboutThenNamedFirst) {
  const Outcome o = run_launcher({"run", "--standalone", "--nproc-per-node", "2", "--timeout", "8",
                                  "--stall-timeout", "1", kWorker, "skip-collective"},
                                 dir_, "launch", {"LOCKSTEP_RENDEZVOUS_TIMEOUT=60"});
  EXPECT_TRUE(o.exited_with(1)) << o.describe();
  const std::string own = own_lines(o.err);
  std::smatch m;
  ASSERT_TRUE(std::regex_search(
      own, m,
      std::regex("warning: rank 1 never issued all_reduce #1 \\(sum, 4 x f32\\) \\(it finished no "
                 "collective\\); rank 0 waited ([0-9.]+) s in all_reduce #1")))
      << o.describe();
  EXPECT_GE(std::stod(m[1]), 1.0) << o.describe();
  EXPECT_LT(std::stod(m[1]), 8.0) << "warned before the timeout\n" << o.describe();
  EXPECT_THAT(own, ContainsRegex("verdict: rank 1 never issued all_reduce #1 \\(sum, 4 x f32\\) "
                                 "\\(it finished no collective\\); rank 0 waited [0-9.]+ s"))
      << o.describe();
  EXPECT_THAT(own, ContainsRegex("  rank 0 \\(node 0, host .*, pid [0-9]+\\): exited .*; issued 1, "
                                 "finished 1; last: all_reduce #1 \\(sum, 4 x f32\\) failed at"))
      << o.describe();
  EXPECT_THAT(own, ContainsRegex("  rank 1 \\(node 0, host .*, pid [0-9]+\\): running; issued 0"))
      << o.describe();
  EXPECT_LT(at(own, "warning: rank 1"), at(own, "verdict: rank 1")) << o.describe();
  EXPECT_LT(at(own, "verdict: rank 1"), at(own, "the job failed: rank 0")) << o.describe();
  // Warned once, not at every look.
  EXPECT_EQ(own.find("warning: rank 1", at(own, "warning: rank 1") + 1), std::string::npos)
      << o.describe();
}

// Rank 1 stops itself (SIGSTOP) after the first all_reduce; rank 0 waits in the second. The
// warning and the verdict say rank 1 is stopped, with since when.
TEST_F(Launcher, AStoppedRankIsWarnedAboutWithinTheStallTimeoutAndNamedAtTheTimeout) {
  const Outcome o = run_launcher({"run", "--standalone", "--nproc-per-node", "2", "--timeout", "6",
                                  "--stall-timeout", "1.5", kWorker, "hang", "stop"},
                                 dir_, "launch", {"LOCKSTEP_RENDEZVOUS_TIMEOUT=60"});
  EXPECT_TRUE(o.exited_with(1)) << o.describe();
  const std::string own = own_lines(o.err);
  const std::string named =
      "rank 1 never issued all_reduce #2 \\(sum, 1024 x f32\\) \\(it last finished all_reduce #1 "
      "\\(sum, 1024 x f32\\) at [0-9:]+; it is stopped \\(state [Tt]\\) since [0-9:]+\\); rank 0 "
      "waited ([0-9.]+) s in all_reduce #2";
  std::smatch m;
  ASSERT_TRUE(std::regex_search(own, m, std::regex("warning: " + named))) << o.describe();
  EXPECT_LT(std::stod(m[1]), 6.0) << "warned before the timeout\n" << o.describe();
  EXPECT_THAT(own, ContainsRegex("verdict: " + named)) << o.describe();
  EXPECT_THAT(own, ContainsRegex("  rank 1 \\(node 0, host .*\\): stopped \\(state [Tt]\\)"))
      << o.describe();
}

// Ranks that disagree on a collective: the backend's signature check fails both at once
// (DISTRIBUTED.md, "Ranks that disagree"), and the verdict names both sides from the traces.
TEST_F(Launcher, RanksThatIssueDifferentCollectivesAreBothNamedInTheVerdict) {
  struct Case {
    const char* hang;
    const char* backend;
    const char* expected;
  };
  for (const Case& c :
       {Case{"mismatch-size", "shm",
             "rank 0 issued all_reduce #1 (sum, 1024 x f32), rank 1 issued all_reduce #1 (sum, "
             "512 x f32)"},
        Case{"mismatch-size", "gloo",
             "rank 0 issued all_reduce #1 (sum, 1024 x f32), rank 1 issued all_reduce #1 (sum, "
             "512 x f32)"},
        Case{"mismatch-op", "shm",
             "rank 0 issued all_reduce #1 (sum, 1024 x f32), rank 1 issued broadcast #1 (root 0, "
             "1024 x f32)"}}) {
    SCOPED_TRACE(std::string(c.hang) + " over " + c.backend);
    const Outcome o = run_launcher({"run", "--standalone", "--nproc-per-node", "2", "--timeout",
                                    "60", kWorker, "hang", c.hang},
                                   dir_, "launch", {std::string("LOCKSTEP_BACKEND=") + c.backend});
    EXPECT_TRUE(o.exited_with(1)) << o.describe();
    const std::string own = own_lines(o.err);
    EXPECT_THAT(
        own, HasSubstr(std::string("verdict: the ranks disagree on collective #1: ") + c.expected))
        << o.describe();
  }
}

// Rank 1 is killed while rank 0 waits for it: the verdict names rank 1 and how it ended.
TEST_F(Launcher, AKilledRankIsNamedInTheVerdictWithItsSignal) {
  const Outcome o = run_launcher(
      {"run", "--standalone", "--nproc-per-node", "2", kWorker, "hang", "die"}, dir_, "launch");
  EXPECT_TRUE(o.exited_with(1)) << o.describe();
  EXPECT_THAT(own_lines(o.err),
              ContainsRegex("verdict: rank 1 never issued all_reduce #1 \\(sum, 1024 x f32\\) "
                            "\\(it finished no collective; it exited \\(signal SIGKILL \\(9\\)\\) "
                            "at [0-9:]+\\); rank 0 waited"))
      << o.describe();
}

// SIGUSR1 to the launcher prints the verdict and every rank's details at once, and stops
// nothing: the job then ends only when the test stops it.
TEST_F(Launcher, SigusrOnePrintsEveryRanksStateWithoutStoppingTheJob) {
  const Launch l = start_launcher({"run", "--standalone", "--nproc-per-node", "2", "--timeout",
                                   "120", "--stall-timeout", "0", kWorker, "skip-collective"},
                                  dir_, "launch", {"LOCKSTEP_RENDEZVOUS_TIMEOUT=60"});
  std::string err;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  // Until the new process is `lockstep run` (not yet exec'd, or the loader still at work), SIGUSR1
  // would kill it: that is no fault of the launcher.
  while (!blocks_sigusr1(l.pid) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ::kill(l.pid, SIGUSR1);  // most likely before the agent reads signals: held, not fatal
  while (std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    ::kill(l.pid, SIGUSR1);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    std::ifstream in(l.err);
    err.assign(std::istreambuf_iterator<char>(in), {});
    if (err.find("(SIGUSR1): rank 1 never issued") != std::string::npos) break;
  }
  ::kill(l.pid, SIGTERM);
  const Outcome o = wait_launcher(l);
  EXPECT_THAT(o.err, ContainsRegex("state of the job at [0-9:]+ \\(SIGUSR1\\): rank 1 never issued "
                                   "all_reduce #1 \\(sum, 4 x f32\\)"))
      << o.describe();
  EXPECT_THAT(o.err,
              ContainsRegex("\n  rank 0 \\(node 0, host .*\\): running; issued 1, finished "
                            "0; last: all_reduce #1 \\(sum, 4 x f32\\) (queued|started) since"))
      << o.describe();
  EXPECT_THAT(o.err, HasSubstr("received SIGTERM")) << "SIGUSR1 stopped nothing\n" << o.describe();
  EXPECT_THAT(o.err, Not(HasSubstr("verdict:"))) << o.describe();
}

}  // namespace
