// `lockstep run` end to end: the real launcher (tools/lockstep) starts launch_worker
// (tests/launch/worker) on this machine; the tests check what the contract promises: the
// workers' environment, prefixed whole lines of output, log files, exit codes, the failure
// summary, restarts, that nothing is left running after a failure or a signal, several agents
// forming one job, a DDP run, a capped failure summary, and a job that survives a flood of
// connections to its store.
#include <poll.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <regex>
#include <set>

#include <gmock/gmock.h>

#include "launch/launcher_process.h"
#include "lockstep/distributed/store/tcp_store.h"

using namespace lockstep::testing::launch;
using ::testing::ContainsRegex;
using ::testing::HasSubstr;
using ::testing::Ne;
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

// own_lines without the lines that quote a worker's output, which itself names its rank.
std::string summary_lines(const std::string& err) {
  std::string s;
  for (const auto& line : split_lines(own_lines(err))) {
    if (line.find("words of rank") == std::string::npos &&
        line.find("output of rank") == std::string::npos &&
        line.find("kills itself") == std::string::npos) {
      s += line + "\n";
    }
  }
  return s;
}

std::string omp_threads_for(int nproc) {
  return std::to_string(std::max<long>(1, ::sysconf(_SC_NPROCESSORS_ONLN) / nproc));
}

TEST_F(Launcher, PrintsVersionAndHelp) {
  const Outcome v = run_launcher({"--version"}, dir_, "version");
  EXPECT_TRUE(v.exited_with(0)) << v.describe();
  EXPECT_THAT(v.out, HasSubstr("lockstep 0.1.0")) << v.describe();
  const Outcome h = run_launcher({"run", "--help"}, dir_, "help");
  EXPECT_TRUE(h.exited_with(0)) << h.describe();
  EXPECT_THAT(h.out + h.err, HasSubstr("--nproc-per-node")) << h.describe();
}

TEST_F(Launcher, MissingProgramIsAUsageError) {
  const Outcome o = run_launcher(
      {"run", "--standalone", "--nproc-per-node", "2", "lockstep_no_such_program", "x"}, dir_,
      "launch");
  expect_usage_error(o, out_, {"lockstep_no_such_program"});
}

TEST_F(Launcher, NodeRankNotBelowNnodesIsAUsageError) {
  const Outcome o =
      run_launcher({"run", "--nnodes", "2", "--node-rank", "2", "--nproc-per-node", "1",
                    "--master-port", std::to_string(free_port()), kWorker, "env", out_.string()},
                   dir_, "launch");
  expect_usage_error(o, out_, {"node-rank"});
}

TEST_F(Launcher, NonNumericNprocPerNodeIsAUsageError) {
  const Outcome o = run_launcher(
      {"run", "--standalone", "--nproc-per-node", "abc", kWorker, "env", out_.string()}, dir_,
      "launch");
  expect_usage_error(o, out_, {"abc"});
}

TEST_F(Launcher, MasterPortInUseIsAUsageError) {
  // Hold the port with a listening socket on every address.
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t len = sizeof(a);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(::listen(fd, 4), 0);
  ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  const std::string port = std::to_string(ntohs(a.sin_port));
  const Outcome o = run_launcher(
      {"run", "--nproc-per-node", "2", "--master-port", port, kWorker, "env", out_.string()}, dir_,
      "launch");
  ::close(fd);
  expect_usage_error(o, out_, {port, "in use", "--master-port 0"});
}

TEST_F(Launcher, EveryRankGetsItsEnvironment) {
  const Outcome o =
      run_launcher({"run", "--standalone", "--nproc-per-node", "3", kWorker, "env", out_.string()},
                   dir_, "launch");
  ASSERT_TRUE(o.exited_with(0)) << o.describe();
  const auto reports = read_env_reports(out_);
  ASSERT_EQ(reports.size(), 3u) << o.describe();
  const EnvReport& first = reports.begin()->second;
  std::set<std::string> error_files;
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(reports.count(r)) << "no report of rank " << r;
    EnvReport e = reports.at(r);
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(e["RANK"], std::to_string(r));
    EXPECT_EQ(e["LOCAL_RANK"], std::to_string(r));
    EXPECT_EQ(e["WORLD_SIZE"], "3");
    EXPECT_EQ(e["LOCAL_WORLD_SIZE"], "3");
    EXPECT_EQ(e["GROUP_RANK"], "0");
    EXPECT_THAT(e["MASTER_ADDR"], Ne(""));
    EXPECT_EQ(e["MASTER_ADDR"], first.at("MASTER_ADDR"));
    EXPECT_THAT(e["MASTER_PORT"], ContainsRegex("^[1-9][0-9]*$"));
    EXPECT_EQ(e["MASTER_PORT"], first.at("MASTER_PORT"));
    EXPECT_EQ(e["LOCKSTEP_RESTART_COUNT"], "0");
    EXPECT_EQ(e["LOCKSTEP_MAX_RESTARTS"], "0");
    EXPECT_THAT(e["LOCKSTEP_RUN_ID"], Ne(""));
    EXPECT_EQ(e["LOCKSTEP_RUN_ID"], first.at("LOCKSTEP_RUN_ID"));
    EXPECT_EQ(e["OMP_NUM_THREADS"], omp_threads_for(3));
    EXPECT_EQ(e["LOCKSTEP_USE_AGENT_STORE"], "1");
    EXPECT_THAT(e["LOCKSTEP_STORE_TOKEN"], Ne(""));
    EXPECT_EQ(e["LOCKSTEP_STORE_TOKEN"], first.at("LOCKSTEP_STORE_TOKEN"));
    EXPECT_THAT(e["LOCKSTEP_ERROR_FILE"], Ne(""));
    error_files.insert(e["LOCKSTEP_ERROR_FILE"]);
  }
  EXPECT_EQ(error_files.size(), 3u) << "ranks share an error file";
}

TEST_F(Launcher, PassesTheUsersOmpNumThreadsThrough) {
  const Outcome o =
      run_launcher({"run", "--standalone", "--nproc-per-node", "2", kWorker, "env", out_.string()},
                   dir_, "launch", {"OMP_NUM_THREADS=5"});
  ASSERT_TRUE(o.exited_with(0)) << o.describe();
  const auto reports = read_env_reports(out_);
  ASSERT_EQ(reports.size(), 2u) << o.describe();
  for (auto [r, e] : reports) EXPECT_EQ(e["OMP_NUM_THREADS"], "5") << "rank " << r;
}

TEST_F(Launcher, ReadsOptionsFromTheEnvironment) {
  const std::string port = std::to_string(free_port());
  const Outcome o = run_launcher({"run", kWorker, "env", out_.string()}, dir_, "launch",
                                 {"LOCKSTEP_NPROC_PER_NODE=2", "LOCKSTEP_MASTER_PORT=" + port,
                                  "LOCKSTEP_RUN_ID=from-env", "LOCKSTEP_MAX_RESTARTS=3"});
  ASSERT_TRUE(o.exited_with(0)) << o.describe();
  const auto reports = read_env_reports(out_);
  EXPECT_EQ(reports.size(), 2u) << o.describe();
  for (auto [r, e] : reports) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(e["WORLD_SIZE"], "2");
    EXPECT_EQ(e["MASTER_PORT"], port);
    EXPECT_EQ(e["LOCKSTEP_RUN_ID"], "from-env");
    EXPECT_EQ(e["LOCKSTEP_MAX_RESTARTS"], "3");
  }
}

// A Kubernetes pod of a PyTorchJob starts `torchrun` with PET_ variables (Note [torchrun's
// variables]): `lockstep run` in its place reads them; the command line still wins.
TEST_F(Launcher, ReadsTorchrunsPetVariablesAsAPyTorchJobSetsThem) {
  const std::string port = std::to_string(free_port());
  const std::vector<std::string> pod = {"PET_NNODES=1", "PET_NPROC_PER_NODE=2", "PET_NODE_RANK=0",
                                        "PET_MASTER_ADDR=127.0.0.1", "PET_MASTER_PORT=" + port,
                                        "PET_RDZV_ID=from-pet", "PET_MAX_RESTARTS=2"};
  const Outcome o = run_launcher({"run", kWorker, "env", out_.string()}, dir_, "pet", pod);
  ASSERT_TRUE(o.exited_with(0)) << o.describe();
  auto reports = read_env_reports(out_);
  EXPECT_EQ(reports.size(), 2u) << o.describe();
  for (auto [r, e] : reports) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(e["WORLD_SIZE"], "2");
    EXPECT_EQ(e["MASTER_PORT"], port);
    EXPECT_EQ(e["LOCKSTEP_RUN_ID"], "from-pet");
    EXPECT_EQ(e["LOCKSTEP_MAX_RESTARTS"], "2");
  }
  fs::remove_all(out_);
  fs::create_directories(out_);
  const Outcome given = run_launcher(
      {"run", "--nproc-per-node", "1", "--master-port", "0", kWorker, "env", out_.string()}, dir_,
      "given", pod);
  ASSERT_TRUE(given.exited_with(0)) << given.describe();
  reports = read_env_reports(out_);
  ASSERT_EQ(reports.size(), 1u) << given.describe();
  EXPECT_EQ(reports[0]["WORLD_SIZE"], "1");
}

// Everything after PROGRAM belongs to the program, options included; `--` marks PROGRAM too.
TEST_F(Launcher, PassesProgramArgumentsThrough) {
  const Outcome o = run_launcher({"run", "--standalone", "--nproc-per-node", "1", kWorker, "env",
                                  out_.string(), "--nproc-per-node", "4", "x"},
                                 dir_, "plain");
  ASSERT_TRUE(o.exited_with(0)) << o.describe();
  auto reports = read_env_reports(out_);
  ASSERT_EQ(reports.size(), 1u) << o.describe();
  EXPECT_EQ(reports[0]["ARGS"], "--nproc-per-node 4 x");
  fs::remove_all(out_);
  fs::create_directories(out_);
  const Outcome d = run_launcher({"run", "--standalone", "--nproc-per-node", "1", "--", kWorker,
                                  "env", out_.string(), "--tee"},
                                 dir_, "dashes");
  ASSERT_TRUE(d.exited_with(0)) << d.describe();
  reports = read_env_reports(out_);
  ASSERT_EQ(reports.size(), 1u) << d.describe();
  EXPECT_EQ(reports[0]["ARGS"], "--tee");
}

TEST_F(Launcher, PrefixesEveryLineWithItsRank) {
  const Outcome o =
      run_launcher({"run", "--standalone", "--nproc-per-node", "2", kWorker, "env", out_.string()},
                   dir_, "launch");
  ASSERT_TRUE(o.exited_with(0)) << o.describe();
  auto out = split_lines(o.out);
  std::sort(out.begin(), out.end());
  EXPECT_THAT(out,
              ::testing::ElementsAre("[rank0]: hello from rank 0", "[rank1]: hello from rank 1"))
      << o.describe();
  // stderr to stderr.
  EXPECT_EQ(count_lines_with(o.err, "[rank0]: env of rank 0 written"), 1u) << o.describe();
  EXPECT_EQ(count_lines_with(o.err, "[rank1]: env of rank 1 written"), 1u) << o.describe();
}

TEST_F(Launcher, LinesOfRanksNeverInterleave) {
  constexpr int kLines = 300;
  const Outcome o = run_launcher(
      {"run", "--standalone", "--nproc-per-node", "2", kWorker, "lines", std::to_string(kLines)},
      dir_, "launch");
  ASSERT_TRUE(o.exited_with(0)) << o.describe();
  const std::regex whole(R"(^\[rank(\d)\]: \1:(\d+):\1{200}$)");
  std::map<int, int> next;  // rank -> the line index expected next
  int bad = 0;
  for (const auto& line : split_lines(o.out)) {
    std::smatch m;
    if (!std::regex_match(line, m, whole)) {
      if (++bad <= 3) ADD_FAILURE() << "not one whole line of one rank: " << line;
      continue;
    }
    const int r = std::stoi(m[1]);
    EXPECT_EQ(std::stoi(m[2]), next[r]) << "rank " << r << "'s lines out of order";
    next[r] = std::stoi(m[2]) + 1;
  }
  EXPECT_EQ(bad, 0);
  EXPECT_EQ(next[0], kLines);
  EXPECT_EQ(next[1], kLines);
}

TEST_F(Launcher, FailedWorkerStopsEveryProcessAndIsSummarized) {
  const Outcome o =
      run_launcher({"run", "--standalone", "--nproc-per-node", "2", kWorker, "exit", "3"}, dir_,
                   "launch", pid_env());
  EXPECT_TRUE(o.exited_with(1)) << o.describe();
  const std::string summary = summary_lines(o.err);
  EXPECT_THAT(summary, HasSubstr("rank 1")) << o.describe();
  EXPECT_THAT(summary, HasSubstr("node 0")) << o.describe();
  EXPECT_THAT(summary, HasSubstr("exit code 3")) << o.describe();
  EXPECT_THAT(summary, ContainsRegex("[0-9][0-9]:[0-9][0-9]:[0-9][0-9]")) << "no time\n"
                                                                          << o.describe();
  // Once forwarded, and at least once more quoted in the summary.
  EXPECT_GE(count_lines_with(o.err, "last words of rank 1"), 2u) << o.describe();
  // Both workers and both grandchildren.
  EXPECT_EQ(recorded_pids(pids_).size(), 4u);
  EXPECT_EQ(leftovers(pids_), "");
}

TEST_F(Launcher, WorkerKilledBySignalIsSummarized) {
  const Outcome o =
      run_launcher({"run", "--standalone", "--nproc-per-node", "2", kWorker, "sigkill"}, dir_,
                   "launch", pid_env());
  EXPECT_TRUE(o.exited_with(1)) << o.describe();
  const std::string summary = summary_lines(o.err);
  EXPECT_THAT(summary, HasSubstr("rank 1")) << o.describe();
  EXPECT_THAT(summary, HasSubstr("SIGKILL")) << o.describe();
  EXPECT_EQ(recorded_pids(pids_).size(), 4u);
  EXPECT_EQ(leftovers(pids_), "");
}

TEST_F(Launcher, UncaughtExceptionReachesTheSummary) {
  const Outcome o = run_launcher({"run", "--standalone", "--nproc-per-node", "2", kWorker, "throw"},
                                 dir_, "launch");
  EXPECT_TRUE(o.exited_with(1)) << o.describe();
  // Not only in the worker's forwarded output (the default terminate handler prints it too).
  EXPECT_THAT(own_lines(o.err), HasSubstr("boom from rank 1")) << o.describe();
}

TEST_F(Launcher, RestartsTheGroupAfterAFailure) {
  const Outcome o = run_launcher({"run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
                                  "2", kWorker, "fail-first"},
                                 dir_, "launch");
  EXPECT_TRUE(o.exited_with(0)) << o.describe();
  EXPECT_THAT(o.out, HasSubstr("[rank0]: restart count 1")) << o.describe();
  EXPECT_THAT(o.out, HasSubstr("[rank1]: restart count 1")) << o.describe();
  EXPECT_THAT(o.out, Not(HasSubstr("restart count 2"))) << o.describe();
}

TEST_F(Launcher, GivesUpWhenNoRestartRemains) {
  const fs::path logs = dir_ / "logs";
  const Outcome o =
      run_launcher({"run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                    "--log-dir", logs.string(), "--run-id", "giveup", kWorker, "exit", "3"},
                   dir_, "launch");
  EXPECT_TRUE(o.exited_with(1)) << o.describe();
  EXPECT_TRUE(fs::is_directory(logs / "giveup" / "attempt_0"));
  EXPECT_TRUE(fs::is_directory(logs / "giveup" / "attempt_1"));
  EXPECT_FALSE(fs::exists(logs / "giveup" / "attempt_2")) << "restarted more than --max-restarts";
  EXPECT_THAT(read_text(logs / "giveup" / "attempt_1" / "1" / "stderr.log"),
              HasSubstr("last words of rank 1 (stderr)"));
}

// Note [A rank that leaves before joining]: without the launcher's word rank 0 would wait 300 s
// (the rendezvous timeout) in the join, past the test's hang guard.
TEST_F(Launcher, ARankThatExitsZeroWithoutJoiningFailsTheOthersAtOnceNamingIt) {
  const Outcome o =
      run_launcher({"run", "--standalone", "--nproc-per-node", "2", kWorker, "leave-before-join"},
                   dir_, "launch");
  EXPECT_TRUE(o.exited_with(1)) << o.describe();
  const std::string summary = summary_lines(o.err);
  EXPECT_THAT(summary, HasSubstr("the job failed: rank 0")) << o.describe();
  EXPECT_THAT(summary, HasSubstr("rank 1 (node 0, host ")) << o.describe();
  EXPECT_THAT(summary, HasSubstr("exited with exit code 0 without joining the process group"))
      << o.describe();
}

// A rank that joined leaves nothing for the launcher to say: rank 0, still running, finds no
// join `error` key in the store after the launcher reaped rank 1 (launch_worker fails, naming
// the key's text, when it does).
TEST_F(Launcher, ARankThatExitsZeroAfterJoiningDisturbsNoOne) {
  const Outcome o =
      run_launcher({"run", "--standalone", "--nproc-per-node", "2", kWorker, "leave-after-join"},
                   dir_, "launch");
  EXPECT_TRUE(o.exited_with(0)) << o.describe();
  EXPECT_THAT(o.out, HasSubstr("[rank0]: rank 0 done")) << o.describe();
  EXPECT_THAT(o.out + o.err, Not(HasSubstr("without joining"))) << o.describe();
}

class LauncherSignal : public Launcher, public ::testing::WithParamInterface<int> {};

TEST_P(LauncherSignal, StopsEveryWorkerAndExitsWith128PlusSignal) {
  const int sig = GetParam();
  const Launch l =
      start_launcher({"run", "--standalone", "--nproc-per-node", "2", kWorker, "sleep"}, dir_,
                     "launch", pid_env());
  // Until both workers and their grandchildren run.
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (recorded_pids(pids_).size() < 4 && running(l.pid) &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_EQ(recorded_pids(pids_).size(), 4u);
  ::kill(l.pid, sig);
  const Outcome o = wait_launcher(l);
  EXPECT_TRUE(o.exited_with(128 + sig)) << o.describe();
  EXPECT_EQ(leftovers(pids_), "");
}

INSTANTIATE_TEST_SUITE_P(Signals, LauncherSignal, ::testing::Values(SIGTERM, SIGINT),
                         [](const auto& info) { return std::string(sigabbrev_np(info.param)); });

// Workers that catch SIGTERM to save (Note [Preemption]) get --stop-grace (30 s by default) to
// finish before SIGKILL: a 4-second save completes; with --stop-grace 1 it is cut short.
TEST_F(Launcher, WorkersThatSaveOnSigtermGetTheStopGrace) {
  for (const char* grace : {"", "1"}) {
    std::vector<std::string> args = {"run", "--standalone", "--nproc-per-node", "2"};
    if (*grace) args.insert(args.end(), {"--stop-grace", grace});
    args.insert(args.end(), {kWorker, "slow-stop", "4"});
    const Launch l = start_launcher(args, dir_, std::string("grace") + grace);
    std::string out;
    const auto deadline = std::chrono::steady_clock::now() + 60s;
    while (running(l.pid) && std::chrono::steady_clock::now() < deadline &&
           (out.find("rank 0 ready") == std::string::npos ||
            out.find("rank 1 ready") == std::string::npos)) {
      std::this_thread::sleep_for(20ms);
      std::ifstream in(l.out);
      out.assign(std::istreambuf_iterator<char>(in), {});
    }
    ::kill(l.pid, SIGTERM);
    const Outcome o = wait_launcher(l);
    EXPECT_TRUE(o.exited_with(128 + SIGTERM)) << o.describe();
    if (*grace) {
      EXPECT_THAT(o.err, HasSubstr("stopping the workers (SIGKILL after 1 s, --stop-grace)"));
      EXPECT_THAT(o.out, Not(HasSubstr("saved after"))) << o.describe();
    } else {
      EXPECT_THAT(o.err, HasSubstr("stopping the workers (SIGKILL after 30 s, --stop-grace)"));
      EXPECT_THAT(o.out, HasSubstr("[rank0]: rank 0 saved after SIGTERM")) << o.describe();
      EXPECT_THAT(o.out, HasSubstr("[rank1]: rank 1 saved after SIGTERM")) << o.describe();
    }
  }
}

// The first entry of /dev/shm that begins with `prefix`, or "".
std::string in_dev_shm(const std::string& prefix) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/dev/shm", ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(prefix, 0) == 0) return name;
  }
  return "";
}

// Stopped while an shm group is being built, the job's workers die of the signal and run no
// cleanup: the segment rank 0 created is still in /dev/shm. The launcher removes it once they
// have exited (Note [Segments of dead jobs]).
TEST_F(Launcher, ASegmentOfWorkersStoppedDuringShmSetupIsRemoved) {
  const std::string run_id = "shmsetup" + std::to_string(::getpid());
  const std::string prefix = "lockstep-shm-" + run_id + "-";
  const Launch l = start_launcher({"run", "--standalone", "--nproc-per-node", "2", "--run-id",
                                   run_id, kWorker, "shm-setup"},
                                  dir_, "launch");
  std::string segment;
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while ((segment = in_dev_shm(prefix)).empty() && running(l.pid) &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_NE(segment, "") << "rank 0 created no segment";
  ::kill(l.pid, SIGTERM);
  const Outcome o = wait_launcher(l);
  EXPECT_TRUE(o.exited_with(128 + SIGTERM)) << o.describe();
  EXPECT_EQ(in_dev_shm(prefix), "") << segment << " outlived the job";
}

TEST_F(Launcher, TwoStandaloneJobsRunSideBySide) {
  const fs::path a = out_ / "a", b = out_ / "b";
  fs::create_directories(a);
  fs::create_directories(b);
  const Launch la = start_launcher(
      {"run", "--standalone", "--nproc-per-node", "2", kWorker, "env", a.string()}, dir_, "a");
  const Launch lb = start_launcher(
      {"run", "--standalone", "--nproc-per-node", "2", kWorker, "env", b.string()}, dir_, "b");
  const Outcome oa = wait_launcher(la), ob = wait_launcher(lb);
  ASSERT_TRUE(oa.exited_with(0)) << oa.describe();
  ASSERT_TRUE(ob.exited_with(0)) << ob.describe();
  auto ra = read_env_reports(a), rb = read_env_reports(b);
  ASSERT_EQ(ra.size(), 2u);
  ASSERT_EQ(rb.size(), 2u);
  EXPECT_NE(ra[0]["MASTER_PORT"], rb[0]["MASTER_PORT"]);
}

// Two agents on one machine form a job of 2 nodes x 2 workers; node 1 starts first and waits.
TEST_F(Launcher, TwoAgentsFormOneJob) {
  const std::string port = std::to_string(free_port());
  auto args = [&](const char* node) {
    return std::vector<std::string>{
        "run",  //
        "--nnodes",      "2",         "--node-rank",   node, "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", port, "--run-id",         "two-agents",
        kWorker,         "env",       out_.string()};
  };
  const Launch l1 = start_launcher(args("1"), dir_, "node1");
  std::this_thread::sleep_for(1s);
  const Launch l0 = start_launcher(args("0"), dir_, "node0");
  const Outcome o0 = wait_launcher(l0), o1 = wait_launcher(l1);
  ASSERT_TRUE(o0.exited_with(0)) << o0.describe();
  ASSERT_TRUE(o1.exited_with(0)) << o1.describe();
  const auto reports = read_env_reports(out_);
  ASSERT_EQ(reports.size(), 4u);
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(reports.count(r)) << "no report of rank " << r;
    EnvReport e = reports.at(r);
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(e["RANK"], std::to_string(r));
    EXPECT_EQ(e["LOCAL_RANK"], std::to_string(r % 2));
    EXPECT_EQ(e["GROUP_RANK"], std::to_string(r / 2));
    EXPECT_EQ(e["WORLD_SIZE"], "4");
    EXPECT_EQ(e["LOCAL_WORLD_SIZE"], "2");
    EXPECT_EQ(e["MASTER_ADDR"], "127.0.0.1");
    EXPECT_EQ(e["MASTER_PORT"], port);
    EXPECT_EQ(e["LOCKSTEP_RUN_ID"], "two-agents");
  }
  EXPECT_THAT(o0.out, HasSubstr("[rank1]: hello from rank 1"));
  EXPECT_THAT(o1.out, HasSubstr("[rank2]: hello from rank 2"));
  EXPECT_THAT(o1.out, HasSubstr("[rank3]: hello from rank 3"));
}

// Note [Job signature]: two agents whose worker arguments differ both fail the start, naming the
// first difference, and no worker runs.
TEST_F(Launcher, TwoAgentsWithAnotherArgumentFailTheStartNamingIt) {
  const std::string port = std::to_string(free_port());
  auto args = [&](const char* node, const char* seed) {
    return std::vector<std::string>{
        "run",      "--nnodes",     "2",     "--node-rank", node,          "--master-port", port,
        "--run-id", "two-commands", kWorker, "env",         out_.string(), "--seed",        seed};
  };
  const Launch l0 = start_launcher(args("0", "1"), dir_, "node0");
  const Launch l1 = start_launcher(args("1", "2"), dir_, "node1");
  const Outcome o0 = wait_launcher(l0), o1 = wait_launcher(l1);
  for (const Outcome* o : {&o0, &o1}) {
    EXPECT_TRUE(o->exited_with(1)) << o->describe();
    EXPECT_THAT(o->err, HasSubstr("node 1 (host "));
    EXPECT_THAT(o->err, HasSubstr(") runs another command than node 0: --seed 2 where node 0 runs "
                                  "--seed 1 (argument 4 of launch_worker)"))
        << o->describe();
  }
  EXPECT_TRUE(dir_is_empty(out_)) << "a worker ran although the machines disagree";
}

TEST_F(Launcher, MissingNodeFailsTheRendezvous) {
  const Outcome o =
      run_launcher({"run", "--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "1",
                    "--master-port", std::to_string(free_port()), "--rdzv-timeout", "2", "--run-id",
                    "missing", kWorker, "env", out_.string()},
                   dir_, "launch");
  EXPECT_TRUE(WIFEXITED(o.status) && WEXITSTATUS(o.status) != 0) << o.describe();
  // A line that says node rank 1 is missing.
  const std::regex missing("missing", std::regex::icase), one(R"(\b1\b)");
  bool named = false;
  for (const auto& line : split_lines(o.err)) {
    named = named || (std::regex_search(line, missing) && std::regex_search(line, one));
  }
  EXPECT_TRUE(named) << o.describe();
  EXPECT_TRUE(dir_is_empty(out_)) << "a worker ran without the whole job";
}

// Node 0 is up (its store answers) but in another job: node 1's rendezvous timeout says so
// instead of calling node rank 0 missing. Node 0 of this run id with another --nnodes (elastic)
// refuses node 1 at once, naming the difference, and goes on waiting.
TEST_F(Launcher, ANodeWhoseNodeZeroRunsAnotherJobIsToldWhatIsTrue) {
  const std::string port = std::to_string(free_port());
  const std::vector<std::string> token = {"LOCKSTEP_STORE_TOKEN=shared"};
  auto args = [&](const char* node, const char* nnodes, const char* run_id, const char* rdzv) {
    return std::vector<std::string>{
        "run",  "--nnodes",       nnodes, "--node-rank", node,  "--master-port", port, "--run-id",
        run_id, "--rdzv-timeout", rdzv,   kWorker,       "env", out_.string()};
  };
  for (const bool elastic : {true, false}) {
    SCOPED_TRACE(elastic ? "elastic node 0" : "another run id");
    // Node 0 outlasts node 1's rendezvous; node 1 starts once node 0's store is up, and its
    // timeout (also its store requests') leaves room for a loaded machine.
    const Launch l0 =
        start_launcher(args("0", elastic ? "2:2" : "2", elastic ? "job" : "other-job", "300"), dir_,
                       "node0", token);
    ASSERT_TRUE(wait_for_stderr(l0, "the store listens on")) << wait_launcher(l0).describe();
    const Outcome o1 = run_launcher(args("1", "2", "job", "8"), dir_, "node1", token);
    EXPECT_TRUE(o1.exited_with(1)) << o1.describe();
    if (elastic) {
      EXPECT_THAT(o1.err, HasSubstr("node 0 refused this node: this node's command differs from "
                                    "the job's: --nnodes 2 where the job runs --nnodes 2:2"))
          << o1.describe();
    } else {
      EXPECT_THAT(o1.err, HasSubstr("rendezvous timed out after 8 s: node 0 is up (its store "
                                    "answered) but has not joined this job: does it run with "
                                    "another --run-id (this node's is 'job')?"))
          << o1.describe();
    }
    EXPECT_THAT(o1.err, ::testing::Not(HasSubstr("missing node ranks"))) << o1.describe();
    ::kill(l0.pid, SIGTERM);
    const Outcome o0 = wait_launcher(l0);
    EXPECT_TRUE(o0.exited_with(128 + SIGTERM)) << o0.describe();
  }
  EXPECT_TRUE(dir_is_empty(out_));
}

// A node of another lockstep version asks to join without its job signature: node 0 of a fixed
// job fails the start at once, saying so, instead of waiting for a node that cannot join until
// --rdzv-timeout. The test plays that node, writing a join request without the signature.
TEST_F(Launcher, ANodeThatWritesNoSignatureIsCalledAnotherVersionAtOnce) {
  const std::string port = std::to_string(free_port());
  const Launch l0 = start_launcher(
      {"run", "--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "1", "--master-port", port,
       "--run-id", "old", "--rdzv-timeout", "100", "--node-timeout", "3", kWorker, "env",
       out_.string()},
      dir_, "node0", {"LOCKSTEP_STORE_TOKEN=shared"});
  ASSERT_TRUE(wait_for_stderr(l0, "the store listens on")) << wait_launcher(l0).describe();
  lockstep::dist::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(std::stoi(port));
  so.wait_for_workers = false;
  so.token = "shared";
  lockstep::dist::TCPStore older(so);
  const std::string agent = "lockstep/old/agent/";
  const int64_t ticket = older.add(agent + "join/next", 1);
  older.set(agent + "join/" + std::to_string(ticket),
            R"({"id": 1, "host": "older", "nproc": 1})");
  // The node is told too (node 0 keeps its store up until the node says it read the answer,
  // join/<t>/told, or for --node-timeout).
  const std::string reply_key = agent + "join/" + std::to_string(ticket) + "/reply";
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!older.check({reply_key}) && running(l0.pid) &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const std::string reply = older.get_string(reply_key);
  EXPECT_THAT(reply, HasSubstr("another lockstep version")) << reply;
  older.set(agent + "join/" + std::to_string(ticket) + "/told", "1");
  const Outcome o0 = wait_launcher(l0);
  EXPECT_TRUE(o0.exited_with(1)) << o0.describe();
  EXPECT_THAT(o0.err, HasSubstr("node 1's join request is malformed (another lockstep version?): "))
      << o0.describe();
  EXPECT_THAT(o0.err, HasSubstr("signature")) << o0.describe();
  EXPECT_TRUE(dir_is_empty(out_)) << "a worker ran";
}

TEST_F(Launcher, LogDirWithTeeWritesFilesAndTerminal) {
  const fs::path logs = dir_ / "logs";
  const Outcome o =
      run_launcher({"run", "--standalone", "--nproc-per-node", "2", "--log-dir", logs.string(),
                    "--tee", "--run-id", "teed", kWorker, "env", out_.string()},
                   dir_, "launch");
  ASSERT_TRUE(o.exited_with(0)) << o.describe();
  for (int r = 0; r < 2; ++r) {
    const std::string rs = std::to_string(r);
    const fs::path d = logs / "teed" / "attempt_0" / rs;
    EXPECT_EQ(read_text(d / "stdout.log"), "hello from rank " + rs + "\n") << d;
    EXPECT_EQ(read_text(d / "stderr.log"), "env of rank " + rs + " written\n") << d;
    EXPECT_THAT(o.out, HasSubstr("[rank" + rs + "]: hello from rank " + rs)) << o.describe();
    EXPECT_THAT(o.err, HasSubstr("[rank" + rs + "]: env of rank " + rs + " written"))
        << o.describe();
  }
}

TEST_F(Launcher, LogDirWithoutTeeWritesOnlyFiles) {
  const fs::path logs = dir_ / "logs";
  const Outcome o =
      run_launcher({"run", "--standalone", "--nproc-per-node", "2", "--log-dir", logs.string(),
                    "--run-id", "quiet", kWorker, "env", out_.string()},
                   dir_, "launch");
  ASSERT_TRUE(o.exited_with(0)) << o.describe();
  EXPECT_THAT(o.out + o.err, Not(HasSubstr("[rank"))) << o.describe();
  for (int r = 0; r < 2; ++r) {
    const std::string rs = std::to_string(r);
    const fs::path d = logs / "quiet" / "attempt_0" / rs;
    EXPECT_EQ(read_text(d / "stdout.log"), "hello from rank " + rs + "\n") << d;
    EXPECT_EQ(read_text(d / "stderr.log"), "env of rank " + rs + " written\n") << d;
  }
}

TEST_F(Launcher, LocalRanksFilterShowsOnlyThoseRanks) {
  const Outcome o = run_launcher({"run", "--standalone", "--nproc-per-node", "2",
                                  "--local-ranks-filter", "1", kWorker, "env", out_.string()},
                                 dir_, "launch");
  ASSERT_TRUE(o.exited_with(0)) << o.describe();
  EXPECT_EQ(read_env_reports(out_).size(), 2u) << "rank 0 must still run";
  EXPECT_THAT(split_lines(o.out), ::testing::ElementsAre("[rank1]: hello from rank 1"))
      << o.describe();
  EXPECT_THAT(o.err, HasSubstr("[rank1]: env of rank 1 written")) << o.describe();
  EXPECT_THAT(o.err, Not(HasSubstr("[rank0]"))) << o.describe();
}

TEST_F(Launcher, DdpRanksEndWithIdenticalParameters) {
  const Outcome o = run_launcher(
      {"run", "--standalone", "--nproc-per-node", "2", kWorker, "ddp", out_.string(), "5"}, dir_,
      "launch");
  ASSERT_TRUE(o.exited_with(0)) << o.describe();
  const std::string h0 = read_text(out_ / "rank0.hash"), h1 = read_text(out_ / "rank1.hash");
  EXPECT_THAT(h0, ContainsRegex("^[0-9]+\n$"));
  EXPECT_EQ(h0, h1) << "the ranks' parameters differ after DDP training";
}

}  // namespace

namespace {

// A node waiting for node 0's store (which never comes) stops at Ctrl-C with 130, long before
// the 900 s rendezvous timeout.
TEST_F(Launcher, SignalWhileWaitingForNodeZeroExitsAtOnce) {
  const Launch l =
      start_launcher({"run", "--nnodes", "2", "--node-rank", "1", "--master-port",
                      std::to_string(free_port()), "--run-id", "waits", kWorker, "sleep"},
                     dir_, "launch", pid_env());
  std::this_thread::sleep_for(1500ms);  // inside the connect loop
  ::kill(l.pid, SIGINT);
  const Outcome o = wait_launcher(l);
  EXPECT_TRUE(o.exited_with(130)) << o.describe();
  EXPECT_THAT(o.err, ::testing::HasSubstr("interrupted by SIGINT before the workers started"));
  EXPECT_TRUE(recorded_pids(pids_).empty());
}

}  // namespace

namespace {

// Lines of /proc/net/tcp or tcp6 for sockets listening on `port`: their local addresses in the
// kernel's hex ("0100007F" is 127.0.0.1, all zeros is every interface).
std::vector<std::string> listening_addresses(const char* table, uint16_t port) {
  std::vector<std::string> found;
  char want[8];
  std::snprintf(want, sizeof want, "%04X", port);
  for (const auto& line : split_lines(read_text(table))) {
    std::istringstream in(line);
    std::string slot, local, remote, state;
    in >> slot >> local >> remote >> state;
    const auto colon = local.rfind(':');
    if (state == "0A" && colon != std::string::npos && local.substr(colon + 1) == want) {
      found.push_back(local.substr(0, colon));
    }
  }
  return found;
}

// Once, --standalone's store listened on every interface. It is reachable from this machine
// only; without --standalone it listens on the address toward --master-addr (here 127.0.0.1).
TEST_F(Launcher, StoreListensOnLoopbackForOneMachine) {
  for (const bool standalone : {true, false}) {
    SCOPED_TRACE(standalone ? "--standalone" : "--master-addr 127.0.0.1");
    std::vector<std::string> args = {"run", "--nproc-per-node", "1"};
    args.push_back(standalone ? "--standalone" : "--master-port=0");
    args.insert(args.end(), {kWorker, "redraw", (dir_ / "go").string()});
    const Launch l = start_launcher(args, dir_, standalone ? "standalone" : "addr");
    const std::regex listens("the store listens on 127\\.0\\.0\\.1:([0-9]+) ");
    std::smatch m;
    std::string err;
    const auto deadline = std::chrono::steady_clock::now() + 60s;
    while (!std::regex_search(err = read_text(l.err), m, listens) &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(20ms);
    }
    ASSERT_EQ(m.size(), 2u) << err;
    const auto port = static_cast<uint16_t>(std::stoi(m[1]));
    // The worker waits for `go`: the store is up while we look.
    EXPECT_THAT(listening_addresses("/proc/net/tcp", port), ::testing::ElementsAre("0100007F"));
    EXPECT_EQ(listening_addresses("/proc/net/tcp6", port).size(), 0u) << "listens on IPv6";
    std::ofstream(dir_ / "go") << "go\n";
    const Outcome o = wait_launcher(l);
    EXPECT_TRUE(o.exited_with(0)) << o.describe();
    fs::remove(dir_ / "go");
  }
}

// A worker that printed a megabyte: the summary quotes a few kilobytes of it, each long line cut
// and saying so, and says where the whole output is.
TEST_F(Launcher, FailureSummaryIsCappedAndSaysWhereTheFullOutputIs) {
  constexpr int kLines = 200, kBytes = 5000;  // 1 MB
  const Outcome o = run_launcher({"run", "--standalone", "--nproc-per-node", "1", kWorker, "spew",
                                  std::to_string(kLines), std::to_string(kBytes)},
                                 dir_, "terminal");
  ASSERT_TRUE(o.exited_with(1)) << o.describe().substr(0, 4000);
  EXPECT_GE(o.out.size(), size_t{kLines} * kBytes) << "the output itself is not cut";
  const std::string own = own_lines(o.err);
  EXPECT_LT(own.size(), 12u * 1024) << own.substr(0, 4000);
  EXPECT_THAT(own, HasSubstr("final words of rank 0")) << own.substr(0, 4000);
  EXPECT_THAT(own, ContainsRegex("\\[\\.\\.\\. [0-9]+ more bytes\\]")) << own.substr(0, 4000);
  EXPECT_THAT(own, HasSubstr("full output of rank 0 went to the terminal")) << own.substr(0, 4000);

  const fs::path logs = dir_ / "logs";
  const Outcome l = run_launcher(
      {"run", "--standalone", "--nproc-per-node", "1", "--log-dir", logs.string(), "--run-id",
       "spew", kWorker, "spew", std::to_string(kLines), std::to_string(kBytes)},
      dir_, "logged");
  ASSERT_TRUE(l.exited_with(1)) << l.describe().substr(0, 4000);
  const fs::path rank_logs = logs / "spew" / "attempt_0" / "0";
  EXPECT_LT(l.err.size(), 12u * 1024) << l.err.substr(0, 4000);
  EXPECT_THAT(l.err, HasSubstr((rank_logs / "stdout.log").string())) << l.err.substr(0, 4000);
  EXPECT_GE(fs::file_size(rank_logs / "stdout.log"), size_t{kLines} * kBytes);
}

// A launcher that runs out of descriptors while it starts workers says so, and how to fix it.
TEST_F(Launcher, OutOfDescriptorsWhileStartingWorkersIsSaidPlainly) {
  constexpr int kFdLimit = 48, kWorkers = 64;  // two pipes a worker: not enough
  const Launch l = start_launcher(
      {"run", "--standalone", "--nproc-per-node", std::to_string(kWorkers), kWorker, "sleep"}, dir_,
      "launch", pid_env(), -1, kFdLimit);
  const Outcome o = wait_launcher(l);
  EXPECT_TRUE(o.exited_with(1)) << o.describe();
  EXPECT_THAT(own_lines(o.err), ContainsRegex("no file descriptor left[^\n]*ulimit -n"))
      << o.describe();
  EXPECT_EQ(leftovers(pids_), "");
}

// Connections to a store port from a stranger: `idle` ones that never say anything (reopened as
// the server closes them) and `slow` ones that send a byte of a frame now and then. Runs until
// destroyed.
class Flood {
 public:
  Flood(uint16_t port, int idle, int slow) : port_(port), slow_(slow) {
    fds_.assign(static_cast<size_t>(idle + slow), -1);
    thread_ = std::thread([this] { run(); });
  }
  ~Flood() {
    stop_ = true;
    thread_.join();
    for (int fd : fds_) {
      if (fd >= 0) ::close(fd);
    }
  }
  int64_t opened() const { return opened_.load(); }

 private:
  // Reopening is bounded per round, so that the flood does not take every CPU of the machine.
  static constexpr int kReopenPerRound = 200;

  int open_one() {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(port_);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 && errno != EINPROGRESS) {
      ::close(fd);
      return -1;
    }
    ++opened_;
    return fd;
  }

  void run() {
    // A frame header's first bytes (magic, version, hello), one per slow connection per round.
    const uint8_t frame[] = {0x4C, 1, 1, 0, 0, 0, 1, 0};
    size_t next_byte = 0;
    while (!stop_) {
      int reopened = 0;
      for (int& fd : fds_) {
        if (fd < 0 && reopened++ < kReopenPerRound) fd = open_one();
      }
      std::vector<pollfd> p;
      for (int fd : fds_) p.push_back({fd, POLLIN, 0});
      ::poll(p.data(), p.size(), 100);
      for (size_t i = 0; i < fds_.size(); ++i) {
        if (fds_[i] < 0) continue;
        char buf[64];
        if (p[i].revents != 0 && ::read(fds_[i], buf, sizeof buf) <= 0) {  // closed by the server
          ::close(fds_[i]);
          fds_[i] = -1;
        }
      }
      for (int i = 0; i < slow_; ++i) {
        int& fd = fds_[fds_.size() - 1 - static_cast<size_t>(i)];
        if (fd >= 0) (void)::send(fd, &frame[next_byte], 1, MSG_NOSIGNAL);
      }
      next_byte = (next_byte + 1) % sizeof frame;
    }
  }

  const uint16_t port_;
  const int slow_;
  std::vector<int> fds_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> opened_{0};
  std::thread thread_;
};

// Once, with thousands of idle connections to its store, a launcher that had to restart its
// workers could not create their pipes (EMFILE). Under a descriptor limit that the flood alone
// would exhaust, the job restarts a SIGKILLed rank and finishes.
TEST_F(Launcher, JobRestartsAndFinishesWhileItsStoreIsFlooded) {
  constexpr int kIdle = 2000, kSlow = 8, kFdLimit = 1024;
  rlimit lim{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &lim), 0);
  if (lim.rlim_max < kIdle + kSlow + 100) GTEST_SKIP() << "this test needs more descriptors";
  lim.rlim_cur = lim.rlim_max;
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &lim), 0);
  const fs::path go = dir_ / "go";
  const Launch l =
      start_launcher({"run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                      kWorker, "killed-then-train", go.string(), out_.string(), "3"},
                     dir_, "launch", pid_env(), -1, kFdLimit);
  // The store's port, from the launcher's first line.
  const std::regex listens("listens on 127\\.0\\.0\\.1:([0-9]+)");
  std::smatch m;
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  std::string err;
  while (!std::regex_search(err = read_text(l.err), m, listens) &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(20ms);
  }
  ASSERT_TRUE(m.size() == 2) << err;
  {
    Flood flood(static_cast<uint16_t>(std::stoi(m[1])), kIdle, kSlow);
    while (flood.opened() < kIdle + kSlow && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(50ms);
    }
    std::this_thread::sleep_for(1s);  // the server has taken what it can
    std::ofstream(go) << "go\n";      // rank 1 SIGKILLs itself now
    const Outcome o = wait_launcher(l);
    EXPECT_GE(flood.opened(), kIdle + kSlow);
    EXPECT_TRUE(o.exited_with(0)) << o.describe();
    EXPECT_THAT(o.out, HasSubstr("[rank1]: rank 1 kills itself")) << o.describe();
    EXPECT_THAT(o.err, HasSubstr("restarting the whole group")) << o.describe();
    EXPECT_THAT(o.err, Not(HasSubstr("open files"))) << o.describe();
  }
  const std::string h0 = read_text(out_ / "rank0.hash"), h1 = read_text(out_ / "rank1.hash");
  EXPECT_THAT(h0, ContainsRegex("^[0-9]+\n$")) << "the restarted group did not train";
  EXPECT_EQ(h0, h1);
  EXPECT_EQ(leftovers(pids_), "");
}

}  // namespace
