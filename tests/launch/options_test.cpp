// `lockstep run`'s checks before anything starts: numbers out of range named with their range
// (as the flag or as its LOCKSTEP_ variable), the store token of a job on several machines
// (Note [Store token] in tools/lockstep/run_options.cpp), and a log directory that cannot be used.
#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gmock/gmock.h>

#include "launch/launcher_process.h"

using namespace lockstep::testing::launch;
using ::testing::HasSubstr;
using ::testing::Not;

namespace {

// `lockstep run ARGS... launch_worker env OUT` (on one machine unless ARGS say otherwise).
std::vector<std::string> run_args(const std::vector<std::string>& options, const fs::path& out) {
  std::vector<std::string> a = {"run"};
  a.insert(a.end(), options.begin(), options.end());
  a.insert(a.end(), {kWorker, "env", out.string()});
  return a;
}

// The launcher's own lines, without the workers' forwarded ones.
std::string own_lines(const std::string& err) {
  std::string own;
  for (const auto& line : split_lines(err)) {
    if (line.rfind("[rank", 0) != 0) own += line + "\n";
  }
  return own;
}

void write_file(const fs::path& p, const std::string& text, mode_t mode) {
  std::ofstream(p) << text;
  ASSERT_EQ(::chmod(p.c_str(), mode), 0) << p;
}

struct BadNumber {
  std::vector<std::string> options;
  std::vector<std::string> needles;  // what the message must say
};

TEST_F(Launcher, NumbersOutOfRangeAreRejectedNamingTheFlagAndItsRange) {
  const std::string huge = "99999999999999999999";
  const std::vector<BadNumber> cases = {
      {{"--nnodes", huge}, {"--nnodes", "from 1 to", huge}},
      {{"--nnodes", "0"}, {"--nnodes", "from 1 to"}},
      {{"--node-rank", huge}, {"--node-rank", "from 0 to 0"}},
      {{"--master-port", huge}, {"--master-port", "to 65535"}},
      {{"--master-port", "65536"}, {"--master-port", "to 65535"}},
      {{"--max-restarts", huge}, {"--max-restarts", "from 0 to"}},
      {{"--max-restarts", "-1"}, {"--max-restarts", "from 0 to"}},
      {{"--nproc-per-node", "10000"}, {"--nproc-per-node", "from 1 to 4096", "10000"}},
      {{"--nproc-per-node", huge}, {"--nproc-per-node", "from 1 to 4096"}},
      // Below the floor, the agent would spin on the store.
      {{"--monitor-interval", "1e-9"}, {"--monitor-interval", "from 0.01", "1e-9"}},
      {{"--monitor-interval", "nan"}, {"--monitor-interval", "seconds"}},
      {{"--rdzv-timeout", "1e300"}, {"--rdzv-timeout", "seconds from"}},
      {{"--rdzv-timeout", "0"}, {"--rdzv-timeout", "seconds from"}},
      {{"--stop-grace", "-1"}, {"--stop-grace", "seconds from 0 to 3600", "-1"}},
      {{"--stop-grace", "3601"}, {"--stop-grace", "seconds from 0 to 3600"}},
  };
  int i = 0;
  for (const BadNumber& c : cases) {
    SCOPED_TRACE(::testing::PrintToString(c.options));
    std::vector<std::string> options = {"--standalone"};
    if (c.options[0] == "--nnodes" || c.options[0] == "--master-port") options.clear();
    options.insert(options.end(), c.options.begin(), c.options.end());
    const Outcome o = run_launcher(run_args(options, out_), dir_, "case" + std::to_string(i++));
    expect_usage_error(o, out_, c.needles);
  }
}

TEST_F(Launcher, BadEnvironmentValueIsReportedAsItsVariable) {
  const Outcome port = run_launcher(run_args({}, out_), dir_, "port", {"LOCKSTEP_MASTER_PORT=abc"});
  expect_usage_error(port, out_, {"LOCKSTEP_MASTER_PORT", "abc"});
  EXPECT_THAT(port.err, Not(HasSubstr(": --master-port"))) << port.describe();
  const Outcome flag =
      run_launcher(run_args({}, out_), dir_, "flag", {"LOCKSTEP_STANDALONE=maybe"});
  expect_usage_error(flag, out_, {"LOCKSTEP_STANDALONE", "maybe"});
  // On the command line, the flag is named.
  const Outcome given = run_launcher(run_args({"--master-port", "abc"}, out_), dir_, "given",
                                     {"LOCKSTEP_MASTER_PORT=29600"});
  expect_usage_error(given, out_, {"--master-port", "abc"});
  EXPECT_THAT(given.err, Not(HasSubstr("LOCKSTEP_MASTER_PORT"))) << given.describe();
}

// A bad PET_ value is named as torchrun's variable; PET_ and LOCKSTEP_ disagreeing is refused,
// naming both (Note [torchrun's variables]).
TEST_F(Launcher, TorchrunsVariablesAreCheckedAndNamed) {
  const Outcome bad = run_launcher(run_args({}, out_), dir_, "bad", {"PET_MASTER_PORT=abc"});
  expect_usage_error(bad, out_, {"PET_MASTER_PORT (torchrun's variable for --master-port)", "abc"});
  const Outcome both = run_launcher(run_args({}, out_), dir_, "both",
                                    {"PET_NNODES=2", "LOCKSTEP_NNODES=1"});
  expect_usage_error(both, out_, {"LOCKSTEP_NNODES=1 and PET_NNODES=2", "disagree"});
  const Outcome same = run_launcher(run_args({"--standalone"}, out_), dir_, "same",
                                    {"PET_NNODES=1", "LOCKSTEP_NNODES=1"});
  EXPECT_TRUE(same.exited_with(0)) << same.describe();
}

// The port-in-use message suggests --master-port 0; it works on one machine.
TEST_F(Launcher, MasterPortZeroTakesAFreePortOnOneMachine) {
  const Outcome o =
      run_launcher(run_args({"--nproc-per-node", "2", "--master-port", "0"}, out_), dir_, "launch");
  ASSERT_TRUE(o.exited_with(0)) << o.describe();
  const auto reports = read_env_reports(out_);
  ASSERT_EQ(reports.size(), 2u) << o.describe();
  EXPECT_THAT(reports.at(0).at("MASTER_PORT"), ::testing::MatchesRegex("[1-9][0-9]*"));
  EXPECT_EQ(reports.at(0).at("MASTER_PORT"), reports.at(1).at("MASTER_PORT"));
  EXPECT_THAT(o.err, HasSubstr("listens on 127.0.0.1:" + reports.at(0).at("MASTER_PORT")));
  // Other machines could not know it.
  fs::remove_all(out_);
  fs::create_directories(out_);
  const Outcome multi = run_launcher(
      run_args({"--nnodes", "2", "--master-port", "0", "--run-id", "zero"}, out_), dir_, "multi");
  expect_usage_error(multi, out_, {"--master-port", "one machine"});
}

// torchrun's words (Note [nproc-per-node words] in tools/lockstep/run_options.cpp), with every GPU
// hidden (CUDA_VISIBLE_DEVICES empty), so the outcome is the same with or without one.
TEST_F(Launcher, NprocGpuWithoutAGpuIsRefusedSayingWhatToGiveInstead) {
  const Outcome o = run_launcher(run_args({"--standalone", "--nproc-per-node", "gpu"}, out_), dir_,
                                 "gpu", {"CUDA_VISIBLE_DEVICES="});
  expect_usage_error(o, out_, {"--nproc-per-node gpu", "no CUDA GPU is visible", "cpu", "auto"});
}

// Runs `lockstep run --nproc-per-node WORD` with every GPU hidden and this thread (hence the
// launcher it spawns) on one CPU, so that a count of CPUs is 1 on any machine.
Outcome run_on_one_cpu(const std::string& word, const fs::path& out, const fs::path& dir) {
  cpu_set_t old_set, one;
  CPU_ZERO(&old_set);
  EXPECT_EQ(::sched_getaffinity(0, sizeof(old_set), &old_set), 0);
  int first = 0;
  while (first < CPU_SETSIZE && !CPU_ISSET(first, &old_set)) ++first;
  CPU_ZERO(&one);
  CPU_SET(first, &one);
  EXPECT_EQ(::sched_setaffinity(0, sizeof(one), &one), 0);
  const Outcome o =
      run_launcher(run_args({"--standalone", "--nproc-per-node", word, "--master-port", "0"}, out),
                   dir, word, {"CUDA_VISIBLE_DEVICES="});
  EXPECT_EQ(::sched_setaffinity(0, sizeof(old_set), &old_set), 0);
  return o;
}

TEST_F(Launcher, NprocAutoWithoutAGpuStartsOneWorkerPerCpu) {
  const Outcome o = run_on_one_cpu("auto", out_, dir_);
  ASSERT_TRUE(o.exited_with(0)) << o.describe();
  EXPECT_THAT(o.err, HasSubstr("--nproc-per-node auto = 1 (no GPU found: one per CPU)"));
  const auto reports = read_env_reports(out_);
  ASSERT_EQ(reports.size(), 1u) << o.describe();
  EXPECT_EQ(reports.at(0).at("LOCAL_WORLD_SIZE"), "1");
}

TEST_F(Launcher, NprocCpuStartsOneWorkerPerCpu) {
  const Outcome o = run_on_one_cpu("cpu", out_, dir_);
  ASSERT_TRUE(o.exited_with(0)) << o.describe();
  EXPECT_THAT(o.err, HasSubstr("--nproc-per-node cpu = 1 (one per CPU)"));
  EXPECT_EQ(read_env_reports(out_).size(), 1u) << o.describe();
}

TEST_F(Launcher, NprocAnUnknownWordListsTheWordsAndTheRange) {
  const Outcome o =
      run_launcher(run_args({"--standalone", "--nproc-per-node", "gpus"}, out_), dir_, "word");
  expect_usage_error(o, out_, {"--nproc-per-node", "from 1 to 4096", "gpu, cpu or auto"});
}

TEST_F(Launcher, SeveralMachinesWithoutASecretAreRefused) {
  const Outcome o =
      run_launcher(run_args({"--nnodes", "2", "--master-port", std::to_string(free_port())}, out_),
                   dir_, "launch");
  expect_usage_error(o, out_, {"LOCKSTEP_STORE_TOKEN", "--token-file", "--run-id", "--insecure"});
}

TEST_F(Launcher, TokenFileThatOthersCanReadIsRefused) {
  const fs::path token = dir_ / "token";
  write_file(token, "s3cret\n", 0644);
  const Outcome o =
      run_launcher(run_args({"--nnodes", "2", "--master-port", std::to_string(free_port()),
                             "--token-file", token.string()},
                            out_),
                   dir_, "launch");
  expect_usage_error(o, out_, {token.string(), "0644", "chmod 600"});
}

TEST_F(Launcher, EmptyOrMissingTokenFileIsRefused) {
  const fs::path token = dir_ / "token";
  write_file(token, " \n", 0600);
  const Outcome empty =
      run_launcher(run_args({"--standalone", "--token-file", token.string()}, out_), dir_, "e");
  expect_usage_error(empty, out_, {token.string(), "empty"});
  const Outcome missing = run_launcher(
      run_args({"--standalone", "--token-file", (dir_ / "none").string()}, out_), dir_, "m");
  expect_usage_error(missing, out_, {(dir_ / "none").string(), "cannot open"});
  const Outcome dir =
      run_launcher(run_args({"--standalone", "--token-file", out_.string()}, out_), dir_, "d");
  expect_usage_error(dir, out_, {out_.string(), "not a regular file"});
}

// Two agents on this machine with a given way to share the token: both finish, and every worker
// got that token.
void run_two_agents(const std::vector<std::string>& secret, const fs::path& dir,
                    const fs::path& out, std::vector<Outcome>& outcomes) {
  const std::string port = std::to_string(free_port());
  auto args = [&](const char* node) {
    std::vector<std::string> options = {"--nnodes",         "2", "--node-rank",   node,
                                        "--nproc-per-node", "1", "--master-port", port};
    options.insert(options.end(), secret.begin(), secret.end());
    return run_args(options, out);
  };
  const Launch l1 = start_launcher(args("1"), dir, "node1");
  const Launch l0 = start_launcher(args("0"), dir, "node0");
  outcomes = {wait_launcher(l0), wait_launcher(l1)};
}

TEST_F(Launcher, TokenFileGivesTheStoresToken) {
  const fs::path token = dir_ / "token";
  write_file(token, "  a shared secret\n", 0600);
  std::vector<Outcome> o;
  run_two_agents({"--token-file", token.string()}, dir_, out_, o);
  ASSERT_TRUE(o[0].exited_with(0)) << o[0].describe();
  ASSERT_TRUE(o[1].exited_with(0)) << o[1].describe();
  const auto reports = read_env_reports(out_);
  ASSERT_EQ(reports.size(), 2u);
  for (const auto& [r, e] : reports) {
    EXPECT_EQ(e.at("LOCKSTEP_STORE_TOKEN"), "a shared secret") << "rank " << r;
  }
}

TEST_F(Launcher, InsecureRunsSeveralMachinesWithAWarning) {
  std::vector<Outcome> o;
  run_two_agents({"--insecure"}, dir_, out_, o);
  for (const Outcome& a : o) {
    ASSERT_TRUE(a.exited_with(0)) << a.describe();
    EXPECT_THAT(own_lines(a.err), ::testing::ContainsRegex("warning: --insecure: [^\n]*trust"))
        << a.describe();
  }
  EXPECT_EQ(read_env_reports(out_).size(), 2u);
}

TEST_F(Launcher, LogDirThatCannotBeUsedFailsBeforeAnyWorker) {
  const fs::path file = dir_ / "a_file";
  write_file(file, "x", 0644);
  const Outcome is_file =
      run_launcher(run_args({"--standalone", "--log-dir", file.string()}, out_), dir_, "f");
  expect_usage_error(is_file, out_, {file.string(), "not a directory"});
  const fs::path under = file / "logs";
  const Outcome under_file =
      run_launcher(run_args({"--standalone", "--log-dir", under.string()}, out_), dir_, "u");
  expect_usage_error(under_file, out_, {under.string(), "cannot create"});
  if (::geteuid() != 0) {  // root writes anywhere
    const fs::path ro = dir_ / "read_only";
    fs::create_directories(ro);
    ASSERT_EQ(::chmod(ro.c_str(), 0555), 0);
    const Outcome read_only =
        run_launcher(run_args({"--standalone", "--log-dir", ro.string()}, out_), dir_, "r");
    expect_usage_error(read_only, out_, {ro.string(), "not writable"});
    ::chmod(ro.c_str(), 0755);
  }
  // A directory that does not exist yet is created, and the job runs.
  const fs::path fresh = dir_ / "new" / "logs";
  const Outcome ok =
      run_launcher(run_args({"--standalone", "--log-dir", fresh.string()}, out_), dir_, "ok");
  EXPECT_TRUE(ok.exited_with(0)) << ok.describe();
  EXPECT_TRUE(fs::is_directory(fresh));
}

TEST_F(Launcher, RunIdThatIsNotOneSafeFileNameIsRefusedAndNothingLandsOutsideTheLogDir) {
  const fs::path logs = dir_ / "logs";
  struct Bad {
    std::string id, found;
  };
  const std::vector<Bad> cases = {{"..", "'..'"},
                                  {".", "'.'"},
                                  {"../escaped", "'/' at position 3"},
                                  {"a/b", "'/' at position 2"},
                                  {"job 1", "byte 0x20 at position 4"},
                                  {"x$y", "'$' at position 2"},
                                  {std::string(129, 'a'), "got 129 characters"}};
  for (const Bad& c : cases) {
    SCOPED_TRACE(c.id);
    const Outcome o =
        run_launcher(run_args({"--standalone", "--log-dir", logs.string(), "--run-id", c.id}, out_),
                     dir_, "bad");
    expect_usage_error(o, out_, {"--run-id", "letters, digits, '-', '_' or '.'", c.found});
  }
  // Nothing was created beside or above the log directory (nor the directory itself).
  EXPECT_FALSE(fs::exists(logs));
  EXPECT_FALSE(fs::exists(dir_ / "escaped"));
  EXPECT_FALSE(fs::exists(dir_ / "attempt_0"));
  // From the environment, the message names the variable.
  const Outcome env =
      run_launcher(run_args({"--standalone"}, out_), dir_, "env", {"LOCKSTEP_RUN_ID=.."});
  expect_usage_error(env, out_, {"LOCKSTEP_RUN_ID (the variable for --run-id)", "'..'"});
  // The allowed characters, at the longest allowed length, run.
  const std::string ok_id = "Job-7_v1.2" + std::string(128 - 10, 'x');
  const Outcome ok = run_launcher(
      run_args({"--standalone", "--log-dir", logs.string(), "--run-id", ok_id}, out_), dir_, "ok");
  EXPECT_TRUE(ok.exited_with(0)) << ok.describe();
  EXPECT_TRUE(fs::is_directory(logs / ok_id / "attempt_0"));
}

TEST_F(Launcher, StandaloneWithAMasterPortIsRefusedRatherThanThePortIgnored) {
  const Outcome flag =
      run_launcher(run_args({"--standalone", "--master-port", "80"}, out_), dir_, "flag");
  expect_usage_error(flag, out_, {"--master-port 80", "--standalone", "drop --master-port"});
  const Outcome env =
      run_launcher(run_args({"--standalone"}, out_), dir_, "env", {"LOCKSTEP_MASTER_PORT=80"});
  expect_usage_error(env, out_, {"LOCKSTEP_MASTER_PORT (the variable for --master-port) 80"});
  // 0 asks for what --standalone does anyway: any free port.
  const Outcome zero =
      run_launcher(run_args({"--standalone", "--master-port", "0"}, out_), dir_, "zero");
  EXPECT_TRUE(zero.exited_with(0)) << zero.describe();
}

TEST_F(Launcher, TokenLongerThanTheStoreTakesIsRefusedNamingItsSourceNotThePort) {
  const std::string huge(7000, 'a');
  const Outcome env =
      run_launcher(run_args({}, out_), dir_, "env", {"LOCKSTEP_STORE_TOKEN=" + huge});
  expect_usage_error(env, out_, {"LOCKSTEP_STORE_TOKEN", "7000 bytes", "at most 4096"});
  EXPECT_THAT(env.err, Not(HasSubstr("--master-port"))) << env.describe();
  const fs::path file = dir_ / "token";
  write_file(file, huge + "\n", 0600);
  const Outcome from_file =
      run_launcher(run_args({"--token-file", file.string()}, out_), dir_, "file");
  expect_usage_error(from_file, out_, {"--token-file " + file.string(), "more than 4096 bytes"});
  EXPECT_THAT(from_file.err, Not(HasSubstr("--master-port"))) << from_file.describe();
  // The longest the store takes works.
  const Outcome longest = run_launcher(run_args({"--master-port", "0"}, out_), dir_, "longest",
                                       {"LOCKSTEP_STORE_TOKEN=" + std::string(4096, 'b')});
  EXPECT_TRUE(longest.exited_with(0)) << longest.describe();
}

}  // namespace
