// Runs `lockstep run` (tools/lockstep) as a child process for the launch tests: output captured
// to files, a hang guard, checks on what the workers left behind (environment reports, pid files
// of workers and their children), and the tests' fixture.
#pragma once

#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace lockstep::testing::launch {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

inline constexpr const char* kTool = LOCKSTEP_TOOL;
inline constexpr const char* kWorker = LAUNCH_WORKER;
inline constexpr const char* kPidDirEnv = "LAUNCH_TEST_PID_DIR";
// Far beyond what any launch here needs; only a launcher that hangs reaches it.
inline constexpr auto kHangGuard = 120s;
// How long processes that were killed may take to disappear.
inline constexpr auto kReapWait = 5s;

inline std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  return {std::istreambuf_iterator<char>(in), {}};
}

inline std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// A launcher that was started and not yet waited for.
struct Launch {
  pid_t pid = -1;
  fs::path out, err;
};

struct Outcome {
  int status = 0;  // waitpid's status
  std::string out, err;
  bool hung = false;

  bool exited_with(int code) const { return WIFEXITED(status) && WEXITSTATUS(status) == code; }
  // For failure messages: how it ended and what it wrote.
  std::string describe() const {
    std::string how = WIFEXITED(status)     ? "exit code " + std::to_string(WEXITSTATUS(status))
                      : WIFSIGNALED(status) ? "killed by signal " + std::to_string(WTERMSIG(status))
                                            : "status " + std::to_string(status);
    return how + (hung ? " (hung: killed by the test)" : "") + "\n--- stdout ---\n" + out +
           "--- stderr ---\n" + err + "---";
  }
};

// This environment without the variables of a job or of a launcher (ours must not leak into the
// launcher under test), plus `extra` ("NAME=value").
inline std::vector<std::string> launcher_env(const std::vector<std::string>& extra) {
  static const char* const kDropped[] = {"RANK=",
                                         "WORLD_SIZE=",
                                         "LOCAL_",
                                         "GROUP_RANK=",
                                         "MASTER_",
                                         "LOCKSTEP_",
                                         "OMP_NUM_THREADS=",
                                         "SLURM_",
                                         "OMPI_",
                                         "LAUNCH_TEST_",
                                         "GLOO_SOCKET_IFNAME="};
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    const std::string s(*e);
    bool drop = false;
    for (const char* prefix : kDropped) drop = drop || s.rfind(prefix, 0) == 0;
    if (!drop) env.push_back(s);
  }
  env.insert(env.end(), extra.begin(), extra.end());
  return env;
}

// Starts `lockstep ARGS...` in its own process group, stdin from /dev/null, stdout and stderr to
// <dir>/<name>.out and .err (stdout to `stdout_fd` instead when given, e.g. a pseudo-terminal),
// with the default disposition of the stop signals (a shell may start us with SIGINT ignored,
// which the launcher would inherit). With `fd_limit`, its RLIMIT_NOFILE (soft and hard) is that.
// With `sh_setup`, that shell command runs first in the process that then becomes the launcher
// ($$ is the launcher's pid: "echo $$ > CGROUP/cgroup.procs" puts it into a cgroup).
inline Launch start_launcher(const std::vector<std::string>& args, const fs::path& dir,
                             const std::string& name,
                             const std::vector<std::string>& extra_env = {}, int stdout_fd = -1,
                             int fd_limit = 0, const std::string& sh_setup = "") {
  Launch l;
  l.out = dir / (name + ".out");
  l.err = dir / (name + ".err");
  std::vector<std::string> argv_s = {kTool};
  std::string setup = sh_setup;
  if (fd_limit > 0) {
    setup += (setup.empty() ? "" : " && ") + ("ulimit -n " + std::to_string(fd_limit));
  }
  if (!setup.empty()) argv_s = {"/bin/sh", "-c", setup + " && exec \"$0\" \"$@\"", kTool};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::string> env_s = launcher_env(extra_env);
  std::vector<char*> envp;
  for (auto& e : env_s) envp.push_back(e.data());
  envp.push_back(nullptr);

  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  if (stdout_fd >= 0)
    posix_spawn_file_actions_adddup2(&fa, stdout_fd, 1);
  else
    posix_spawn_file_actions_addopen(&fa, 1, l.out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&fa, 2, l.err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t defaults, empty;
  sigemptyset(&defaults);
  for (int s : {SIGINT, SIGTERM, SIGQUIT, SIGHUP, SIGPIPE}) sigaddset(&defaults, s);
  sigemptyset(&empty);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  posix_spawnattr_setsigmask(&attr, &empty);
  posix_spawnattr_setpgroup(&attr, 0);
  posix_spawnattr_setflags(&attr,
                           POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETSIGMASK);
  const int rc = ::posix_spawn(&l.pid, argv[0], &fa, &attr, argv.data(), envp.data());
  posix_spawnattr_destroy(&attr);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) {
    ADD_FAILURE() << "posix_spawn " << kTool << ": " << std::strerror(rc);
    l.pid = -1;
  }
  return l;
}

// Waits for the launcher; past `guard` kills its process group and fails the test.
inline Outcome wait_launcher(const Launch& l, std::chrono::seconds guard = kHangGuard) {
  Outcome o;
  if (l.pid <= 0) {
    o.status = -1;
    return o;
  }
  const auto deadline = std::chrono::steady_clock::now() + guard;
  while (::waitpid(l.pid, &o.status, WNOHANG) != l.pid) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(-l.pid, SIGKILL);
      ::waitpid(l.pid, &o.status, 0);
      o.hung = true;
      break;
    }
    std::this_thread::sleep_for(20ms);
  }
  o.out = read_text(l.out);
  o.err = read_text(l.err);
  if (o.hung) ADD_FAILURE() << "lockstep still running after " << guard.count() << " s";
  return o;
}

inline Outcome run_launcher(const std::vector<std::string>& args, const fs::path& dir,
                            const std::string& name,
                            const std::vector<std::string>& extra_env = {}) {
  return wait_launcher(start_launcher(args, dir, name, extra_env));
}

// A TCP port that nothing listened on a moment ago.
inline uint16_t free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  EXPECT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  ::close(fd);
  return ntohs(a.sin_port);
}

// The NAME=value lines a worker in `env` mode wrote.
using EnvReport = std::map<std::string, std::string>;

inline EnvReport read_env_report(const fs::path& p) {
  EnvReport r;
  for (const auto& line : split_lines(read_text(p))) {
    const auto eq = line.find('=');
    if (eq != std::string::npos) r[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return r;
}

// rank -> report, for every rank<R>.env in dir.
inline std::map<int, EnvReport> read_env_reports(const fs::path& dir) {
  std::map<int, EnvReport> reports;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("rank", 0) == 0 && e.path().extension() == ".env") {
      reports[std::stoi(name.substr(4))] = read_env_report(e.path());
    }
  }
  return reports;
}

inline bool dir_is_empty(const fs::path& dir) {
  return fs::is_directory(dir) && fs::directory_iterator(dir) == fs::directory_iterator();
}

inline std::vector<pid_t> recorded_pids(const fs::path& pid_dir) {
  std::vector<pid_t> pids;
  for (const auto& e : fs::directory_iterator(pid_dir)) {
    if (e.path().extension() == ".pid") pids.push_back(std::stoi(e.path().stem().string()));
  }
  return pids;
}

// Alive and not a zombie (a zombie has exited; it waits only for a parent, possibly an init that
// does not reap, to collect it).
inline bool running(pid_t pid) {
  if (::kill(pid, 0) != 0 && errno == ESRCH) return false;
  const std::string stat = read_text("/proc/" + std::to_string(pid) + "/stat");
  const auto paren = stat.rfind(')');
  if (paren == std::string::npos || paren + 2 >= stat.size()) return false;
  const char state = stat[paren + 2];
  return state != 'Z' && state != 'X';
}

inline std::string cmdline(pid_t pid) {
  std::string c = read_text("/proc/" + std::to_string(pid) + "/cmdline");
  for (char& ch : c) ch = ch == '\0' ? ' ' : ch;
  return c;
}

// Polls up to kReapWait for every recorded pid to be gone; returns those still running.
inline std::vector<pid_t> still_running(const fs::path& pid_dir) {
  const auto deadline = std::chrono::steady_clock::now() + kReapWait;
  std::vector<pid_t> left;
  do {
    left.clear();
    for (pid_t p : recorded_pids(pid_dir)) {
      if (running(p)) left.push_back(p);
    }
    if (left.empty()) break;
    std::this_thread::sleep_for(50ms);
  } while (std::chrono::steady_clock::now() < deadline);
  return left;
}

// "pid (cmdline)" of every recorded process still running after kReapWait; "" when none is.
inline std::string leftovers(const fs::path& pid_dir) {
  std::string s;
  for (pid_t p : still_running(pid_dir)) s += std::to_string(p) + " (" + cmdline(p) + ") ";
  return s;
}

// Kills what a test's workers left running (only processes that still look like ours).
inline void kill_leftovers(const fs::path& pid_dir) {
  if (!fs::is_directory(pid_dir)) return;
  for (pid_t p : recorded_pids(pid_dir)) {
    const std::string c = cmdline(p);
    if (running(p) && (c.find("sleep") == 0 || c.find("launch_worker") != std::string::npos)) {
      ::kill(p, SIGKILL);
    }
  }
}

// Until the launcher `l` has written `needle` to its stderr (a sign of readiness, such as node
// 0's "the store listens on"), it ended, or a minute passed; whether it wrote it.
inline bool wait_for_stderr(const Launch& l, const std::string& needle) {
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  for (;;) {
    if (read_text(l.err).find(needle) != std::string::npos) return true;
    if (!running(l.pid) || std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(20ms);
  }
}

// Lines of `text` that contain `needle`.
inline size_t count_lines_with(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (const auto& line : split_lines(text)) n += line.find(needle) != std::string::npos;
  return n;
}

// A test of the launcher: its own directory (out_ for the workers' reports, pids_ for their
// pids), and whatever its workers left running killed at the end.
class Launcher : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = std::string(info->test_suite_name()) + "." + info->name();
    std::replace(name.begin(), name.end(), '/', '_');
    dir_ = fs::path(::testing::TempDir()) / ("launch_" + std::to_string(::getpid()) + "_" + name);
    fs::remove_all(dir_);
    out_ = dir_ / "out";
    pids_ = dir_ / "pids";
    fs::create_directories(out_);
    fs::create_directories(pids_);
  }
  void TearDown() override {
    kill_leftovers(pids_);
    if (!HasFailure()) fs::remove_all(dir_);
  }
  // Makes every worker record its pid and its grandchild's in pids_.
  std::vector<std::string> pid_env() const {
    return {std::string(kPidDirEnv) + "=" + pids_.string()};
  }

  fs::path dir_, out_, pids_;
};

// Bad input: exit code 2, a `lockstep run: ` line naming the problem, and no worker started.
inline void expect_usage_error(const Outcome& o, const fs::path& out_dir,
                               const std::vector<std::string>& needles) {
  EXPECT_TRUE(o.exited_with(2)) << o.describe();
  bool named = false;
  for (const auto& line : split_lines(o.err)) {
    if (line.rfind("lockstep run: ", 0) != 0) continue;
    bool all = true;
    for (const auto& n : needles) all = all && line.find(n) != std::string::npos;
    named = named || all;
  }
  EXPECT_TRUE(named) << "no line starting with 'lockstep run: ' names "
                     << ::testing::PrintToString(needles) << "\n"
                     << o.describe();
  EXPECT_TRUE(dir_is_empty(out_dir)) << "a worker ran";
  EXPECT_THAT(o.out + o.err, ::testing::Not(::testing::HasSubstr("[rank"))) << o.describe();
}

}  // namespace lockstep::testing::launch
