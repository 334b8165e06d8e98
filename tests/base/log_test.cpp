// lockstep::log: level names and LOCKSTEP_LOG_LEVEL, the threshold, the UTC time and rank
// prefix, log_rank0, stdout/stderr routing and one write per line.
#include "lockstep/base/log.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <iterator>
#include <mutex>
#include <regex>
#include <sstream>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace lockstep {
namespace {

struct Captured {
  std::mutex mutex;
  std::vector<std::pair<LogLevel, std::string>> lines;
  std::string text() {
    std::lock_guard<std::mutex> lock(mutex);
    std::string s;
    for (const auto& l : lines) s += l.second;
    return s;
  }
  size_t size() {
    std::lock_guard<std::mutex> lock(mutex);
    return lines.size();
  }
};

class Log : public ::testing::Test {
 protected:
  void SetUp() override {
    ::unsetenv("RANK");
    ::unsetenv(kLogLevelEnv);
    set_log_rank(-1);
    set_log_level(LogLevel::kInfo);
    set_log_sink([this](LogLevel level, std::string_view text) {
      std::lock_guard<std::mutex> lock(captured_.mutex);
      captured_.lines.emplace_back(level, std::string(text));
    });
  }
  void TearDown() override {
    set_log_sink(nullptr);
    set_log_rank(-1);
    set_log_level(LogLevel::kInfo);
    ::unsetenv("RANK");
    ::unsetenv(kLogLevelEnv);
  }
  Captured captured_;
};

// Counts how often it is formatted: a message below the threshold must not be.
struct Counted {
  int* count;
};
std::ostream& operator<<(std::ostream& os, const Counted& c) {
  ++*c.count;
  return os << "counted";
}

const char* const kTime = R"(\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z)";

TEST_F(Log, ParsesLevelNamesInAnyCase) {
  EXPECT_EQ(parse_log_level("debug"), LogLevel::kDebug);
  EXPECT_EQ(parse_log_level("INFO"), LogLevel::kInfo);
  EXPECT_EQ(parse_log_level("Warning"), LogLevel::kWarning);
  EXPECT_EQ(parse_log_level("warn"), LogLevel::kWarning);
  EXPECT_EQ(parse_log_level("eRRoR"), LogLevel::kError);
  EXPECT_EQ(parse_log_level("verbose"), std::nullopt);
  EXPECT_EQ(parse_log_level(""), std::nullopt);
  EXPECT_EQ(parse_log_level("info "), std::nullopt);
  EXPECT_STREQ(log_level_name(LogLevel::kWarning), "WARNING");
  EXPECT_STREQ(log_level_name(LogLevel::kDebug), "DEBUG");
}

TEST_F(Log, LevelFromTheEnvironment) {
  EXPECT_EQ(log_level_from_env(), LogLevel::kInfo);  // unset
  ::setenv(kLogLevelEnv, "Debug", 1);
  EXPECT_EQ(log_level_from_env(), LogLevel::kDebug);
  ::setenv(kLogLevelEnv, "ERROR", 1);
  EXPECT_EQ(log_level_from_env(), LogLevel::kError);
  EXPECT_EQ(captured_.size(), 0u) << captured_.text();
}

TEST_F(Log, BadEnvironmentValueWarnsOnceNamingTheLevelsAndGivesInfo) {
  ::setenv(kLogLevelEnv, "verbose", 1);
  EXPECT_EQ(log_level_from_env(), LogLevel::kInfo);
  ASSERT_EQ(captured_.size(), 1u) << captured_.text();
  EXPECT_EQ(captured_.lines[0].first, LogLevel::kWarning);
  const std::string& w = captured_.lines[0].second;
  EXPECT_NE(w.find("LOCKSTEP_LOG_LEVEL=verbose"), std::string::npos) << w;
  EXPECT_NE(w.find("debug, info, warning, error"), std::string::npos) << w;
}

// Note [Log level at start] in src/base/log.cpp: a program that never logs (this test binary
// listing no tests) still reports a bad LOCKSTEP_LOG_LEVEL, before anything else it prints.
TEST_F(Log, BadEnvironmentValueIsReportedWhenTheProgramStarts) {
  const std::string out = ::testing::TempDir() + "log_at_start_" + std::to_string(::getpid());
  std::vector<std::string> env_s;
  for (char** e = environ; *e; ++e) {
    if (std::string(*e).rfind(kLogLevelEnv, 0) != 0) env_s.emplace_back(*e);
  }
  env_s.push_back(std::string(kLogLevelEnv) + "=bogus");
  std::vector<char*> envp;
  for (auto& e : env_s) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::string exe = "/proc/self/exe", filter = "--gtest_filter=Log.NoSuchTest",
              list = "--gtest_list_tests";
  char* argv[] = {exe.data(), filter.data(), list.data(), nullptr};
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  pid_t pid = 0;
  ASSERT_EQ(::posix_spawn(&pid, exe.c_str(), &fa, nullptr, argv, envp.data()), 0);
  posix_spawn_file_actions_destroy(&fa);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  std::ifstream in(out);
  const std::string text{std::istreambuf_iterator<char>(in), {}};
  std::remove(out.c_str());
  EXPECT_EQ(text.find("WARNING: LOCKSTEP_LOG_LEVEL=bogus is not a log level"), text.find(' ') + 1)
      << "not the first line:\n"
      << text;
}

TEST_F(Log, ThresholdDropsLowerLevelsWithoutFormattingThem) {
  int formatted = 0;
  set_log_level(LogLevel::kWarning);
  EXPECT_EQ(log_level(), LogLevel::kWarning);
  log_debug("d ", Counted{&formatted});
  log_info("i ", Counted{&formatted});
  EXPECT_EQ(captured_.size(), 0u) << captured_.text();
  EXPECT_EQ(formatted, 0);
  log_warning("w ", Counted{&formatted});
  log_error("e");
  ASSERT_EQ(captured_.size(), 2u);
  EXPECT_EQ(formatted, 1);
  EXPECT_EQ(captured_.lines[0].first, LogLevel::kWarning);
  EXPECT_EQ(captured_.lines[1].first, LogLevel::kError);

  set_log_level(LogLevel::kDebug);
  log(LogLevel::kDebug, "now shown");
  ASSERT_EQ(captured_.size(), 3u);
  EXPECT_NE(captured_.lines[2].second.find("DEBUG: now shown"), std::string::npos);
}

TEST_F(Log, PrefixHasUtcTimeWithMillisecondsRankAndLevel) {
  set_log_rank(3);
  log_warning("loss is ", 2.5, " at step ", 7);
  ASSERT_EQ(captured_.size(), 1u);
  const std::string line = captured_.lines[0].second;
  EXPECT_TRUE(std::regex_match(
      line,
      std::regex(std::string("^") + kTime + R"( \[rank 3\] WARNING: loss is 2\.5 at step 7\n$)")))
      << line;
}

TEST_F(Log, TimeIsUtcWhateverTheTimeZone) {
  const char* old_tz = std::getenv("TZ");
  const std::string saved = old_tz ? old_tz : "";
  ::setenv("TZ", "XST+05", 1);  // five hours behind UTC, no tzdata needed
  ::tzset();
  const std::time_t before = std::time(nullptr);
  log_info("now");
  const std::time_t after = std::time(nullptr);
  if (old_tz) {
    ::setenv("TZ", saved.c_str(), 1);
  } else {
    ::unsetenv("TZ");
  }
  ::tzset();
  ASSERT_EQ(captured_.size(), 1u);
  std::tm tm{};
  const std::string line = captured_.lines[0].second;
  ASSERT_NE(::strptime(line.c_str(), "%Y-%m-%dT%H:%M:%S", &tm), nullptr) << line;
  const std::time_t logged = ::timegm(&tm);
  EXPECT_GE(logged, before) << line;
  EXPECT_LE(logged, after) << line;
}

TEST_F(Log, RankComesFromSetLogRankElseFromRankElseNone) {
  log_info("a");
  ::setenv("RANK", "5", 1);
  log_info("b");
  set_log_rank(2);
  log_info("c");
  set_log_rank(-1);
  ::setenv("RANK", "x", 1);  // not a rank
  log_info("d");
  ASSERT_EQ(captured_.size(), 4u);
  const std::string t = kTime;
  EXPECT_TRUE(std::regex_match(captured_.lines[0].second, std::regex(t + " INFO: a\n")))
      << captured_.lines[0].second;
  EXPECT_TRUE(
      std::regex_match(captured_.lines[1].second, std::regex(t + R"( \[rank 5\] INFO: b\n)")))
      << captured_.lines[1].second;
  EXPECT_TRUE(
      std::regex_match(captured_.lines[2].second, std::regex(t + R"( \[rank 2\] INFO: c\n)")))
      << captured_.lines[2].second;
  EXPECT_TRUE(std::regex_match(captured_.lines[3].second, std::regex(t + " INFO: d\n")))
      << captured_.lines[3].second;
}

TEST_F(Log, EveryLineOfAMessageGetsThePrefix) {
  set_log_rank(1);
  log_error("first\nsecond\n");
  ASSERT_EQ(captured_.size(), 1u);
  const std::string t = kTime;
  EXPECT_TRUE(std::regex_match(
      captured_.lines[0].second,
      std::regex(t + R"( \[rank 1\] ERROR: first\n)" + t + R"( \[rank 1\] ERROR: second\n)")))
      << captured_.lines[0].second;
}

TEST_F(Log, Rank0PrintsInfoOnlyOnRankZeroButWarningsEverywhere) {
  set_log_rank(1);
  log_rank0(LogLevel::kInfo, "info from 1");
  log_rank0(LogLevel::kDebug, "debug from 1");
  log_rank0(LogLevel::kWarning, "warning from 1");
  log_rank0(LogLevel::kError, "error from 1");
  set_log_rank(0);
  log_rank0(LogLevel::kInfo, "info from 0");
  set_log_rank(-1);  // unknown: a single process, which is rank 0
  log_rank0(LogLevel::kInfo, "info from nobody");
  const std::string text = captured_.text();
  EXPECT_EQ(text.find("info from 1"), std::string::npos) << text;
  EXPECT_EQ(text.find("debug from 1"), std::string::npos) << text;
  EXPECT_NE(text.find("WARNING: warning from 1"), std::string::npos) << text;
  EXPECT_NE(text.find("ERROR: error from 1"), std::string::npos) << text;
  EXPECT_NE(text.find("INFO: info from 0"), std::string::npos) << text;
  EXPECT_NE(text.find("INFO: info from nobody"), std::string::npos) << text;
  EXPECT_EQ(captured_.size(), 4u) << text;
}

// Points fd 1 and 2 at files for the length of a scope.
class RedirectStdio {
 public:
  RedirectStdio(const std::string& out, const std::string& err) {
    std::fflush(stdout);
    std::fflush(stderr);
    saved_out_ = ::dup(1);
    saved_err_ = ::dup(2);
    const int o = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int e = ::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(o, 1);
    ::dup2(e, 2);
    ::close(o);
    ::close(e);
  }
  ~RedirectStdio() {
    std::fflush(stdout);
    ::dup2(saved_out_, 1);
    ::dup2(saved_err_, 2);
    ::close(saved_out_);
    ::close(saved_err_);
  }

 private:
  int saved_out_, saved_err_;
};

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  return {std::istreambuf_iterator<char>(in), {}};
}

TEST_F(Log, InfoGoesToStdoutWarningsAndErrorsToStderr) {
  set_log_sink(nullptr);
  const std::string dir = ::testing::TempDir();
  const std::string out = dir + "/log_test_out_" + std::to_string(::getpid());
  const std::string err = dir + "/log_test_err_" + std::to_string(::getpid());
  {
    RedirectStdio redirect(out, err);
    log_info("to stdout");
    log_warning("to stderr");
    log_error("also to stderr");
  }
  const std::string o = read_file(out), e = read_file(err);
  std::remove(out.c_str());
  std::remove(err.c_str());
  EXPECT_NE(o.find("INFO: to stdout\n"), std::string::npos) << o;
  EXPECT_EQ(o.find("stderr"), std::string::npos) << o;
  EXPECT_NE(e.find("WARNING: to stderr\n"), std::string::npos) << e;
  EXPECT_NE(e.find("ERROR: also to stderr\n"), std::string::npos) << e;
  EXPECT_EQ(e.find("to stdout"), std::string::npos) << e;
}

// Many threads logging into one pipe: every line arrives whole, since each is one write(2) (a
// pipe keeps writes up to PIPE_BUF bytes together).
TEST_F(Log, LinesOfThreadsNeverInterleave) {
  set_log_sink(nullptr);
  constexpr int kThreads = 8, kLines = 200;
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  std::string got;
  std::thread reader([&] {
    char buf[4096];
    for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) got.append(buf, n);
  });
  std::fflush(stdout);
  const int saved = ::dup(1);
  ::dup2(fds[1], 1);
  ::close(fds[1]);
  {
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([t] {
        const std::string body(300, static_cast<char>('a' + t));
        for (int i = 0; i < kLines; ++i) log_info(t, ":", i, ":", body);
      });
    }
    for (auto& th : threads) th.join();
  }
  ::dup2(saved, 1);  // closes the pipe's last write end: the reader sees end of file
  ::close(saved);
  reader.join();
  ::close(fds[0]);
  const std::regex whole(std::string("^") + kTime + R"( INFO: (\d):(\d+):(.*)$)");
  int count = 0, bad = 0;
  std::istringstream in(got);
  for (std::string line; std::getline(in, line); ++count) {
    std::smatch m;
    if (!std::regex_match(line, m, whole) ||
        m[3].str() != std::string(300, static_cast<char>('a' + std::stoi(m[1])))) {
      if (++bad <= 3) ADD_FAILURE() << "not one whole line: " << line.substr(0, 120);
    }
  }
  EXPECT_EQ(bad, 0);
  EXPECT_EQ(count, kThreads * kLines);
}

}  // namespace
}  // namespace lockstep
