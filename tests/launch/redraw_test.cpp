// `lockstep run` and lines redrawn with '\r' (a progress bar): shown at once, in place, where the
// launcher's stdout is a terminal (a pseudo-terminal here); only the clean lines in log files and
// in output that is not a terminal.
#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <termios.h>
#include <unistd.h>

#include <algorithm>

#include "launch/launcher_process.h"

using namespace lockstep::testing::launch;

namespace {

// What the worker's "redraw" mode writes ends up as these lines wherever '\r' is not shown.
const char* const kCleanLines = "b\ndone\nx\ntail\n";

class Redraw : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::path(::testing::TempDir()) /
           ("redraw_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir_);
  }
  fs::path dir_;
};

// The output of a launcher whose stdout is a pseudo-terminal (raw: '\n' stays '\n').
struct TtyOutcome {
  int status = -1;
  std::string tty;  // everything written to the terminal
  std::string err;  // stderr, to a file
  bool saw_first_bar_early = false;
};

// Runs `lockstep ARGS...` with its stdout on a new pseudo-terminal. Once the terminal shows
// "bar 1" it creates `go`, which the worker waits for before it writes the rest: so the bar
// must have been forwarded before any newline followed it.
TtyOutcome run_on_tty(const std::vector<std::string>& args, const fs::path& dir,
                      const fs::path& go) {
  TtyOutcome o;
  const int master = ::posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
  EXPECT_GE(master, 0) << std::strerror(errno);
  if (master < 0) return o;
  EXPECT_EQ(::grantpt(master), 0);
  EXPECT_EQ(::unlockpt(master), 0);
  const std::string slave_name = ::ptsname(master);
  const int slave = ::open(slave_name.c_str(), O_RDWR | O_NOCTTY | O_CLOEXEC);
  EXPECT_GE(slave, 0) << slave_name << ": " << std::strerror(errno);
  termios t{};
  ::tcgetattr(slave, &t);
  ::cfmakeraw(&t);
  ::tcsetattr(slave, TCSANOW, &t);

  const Launch l = start_launcher(args, dir, "launch", {}, slave);
  const pid_t pid = l.pid;
  const fs::path err = l.err;
  ::close(slave);
  if (pid <= 0) {
    ::close(master);
    return o;
  }

  // Read until every holder of the terminal closed it (EIO), then reap.
  const auto deadline = std::chrono::steady_clock::now() + kHangGuard;
  bool hung = false;
  for (;;) {
    if (std::chrono::steady_clock::now() > deadline) {
      hung = true;
      ::kill(-pid, SIGKILL);
      break;
    }
    pollfd p{master, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    char buf[4096];
    const ssize_t n = ::read(master, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    o.tty.append(buf, static_cast<size_t>(n));
    if (!fs::exists(go) && o.tty.find("bar 1") != std::string::npos) {
      o.saw_first_bar_early = o.tty.find("bar 2") == std::string::npos;
      std::ofstream(go) << "go\n";
    }
  }
  ::close(master);
  ::waitpid(pid, &o.status, 0);
  EXPECT_FALSE(hung) << "lockstep still running after " << kHangGuard.count() << " s";
  o.err = read_text(err);
  return o;
}

// Shows the escape and '\r' characters in a failure message.
std::string visible(const std::string& s) {
  std::string v;
  for (char c : s) {
    if (c == '\r') {
      v += "\\r";
    } else if (c == '\n') {
      v += "\\n\n";
    } else if (c == '\x1b') {
      v += "\\e";
    } else {
      v += c;
    }
  }
  return v;
}

TEST_F(Redraw, ATerminalSeesEachSegmentAtOnceAndInPlace) {
  const fs::path go = dir_ / "go";
  const TtyOutcome o = run_on_tty(
      {"run", "--standalone", "--nproc-per-node", "1", kWorker, "redraw", go.string()}, dir_, go);
  ASSERT_TRUE(WIFEXITED(o.status) && WEXITSTATUS(o.status) == 0) << o.status << "\n"
                                                                 << visible(o.tty) << o.err;
  EXPECT_TRUE(o.saw_first_bar_early) << "the bar waited for a newline:\n" << visible(o.tty);
  // Each segment replaces the line ("\r", erase to the end); a whole line of the same worker
  // replaces it and ends it.
  const std::string seg = "\r[rank0]: ", erase = "\x1b[K";
  const std::string want = "[rank0]: tty=1\n" +                             //
                           seg + "a" + erase + seg + "b" + erase + "\n" +   //
                           seg + "bar 1" + erase + seg + "bar 2" + erase +  //
                           seg + "done" + erase + "\n" +                    //
                           seg + "x" + erase + seg + "x" + erase + "\n" +   //
                           seg + "tail" + erase + seg + "tail" + erase + "\n";
  EXPECT_EQ(visible(o.tty), visible(want));
}

TEST_F(Redraw, OutputThatIsNotATerminalGetsOnlyTheLastSegmentOfEachLine) {
  const Outcome o = run_launcher(
      {"run", "--standalone", "--nproc-per-node", "1", kWorker, "redraw", "-"}, dir_, "launch");
  ASSERT_TRUE(o.exited_with(0)) << o.describe();
  std::string want = "[rank0]: tty=none\n";
  for (const auto& line : split_lines(kCleanLines)) want += "[rank0]: " + line + "\n";
  EXPECT_EQ(visible(o.out), visible(want));
}

TEST_F(Redraw, LogFilesGetOnlyTheLastSegmentOfEachLine) {
  const fs::path logs = dir_ / "logs";
  // On a terminal too: the file must not get what the terminal gets.
  const TtyOutcome o =
      run_on_tty({"run", "--standalone", "--nproc-per-node", "1", "--log-dir", logs.string(),
                  "--tee", "--run-id", "cr", kWorker, "redraw", "-"},
                 dir_, dir_ / "go");
  ASSERT_TRUE(WIFEXITED(o.status) && WEXITSTATUS(o.status) == 0) << o.status << "\n"
                                                                 << visible(o.tty) << o.err;
  EXPECT_EQ(visible(read_text(logs / "cr" / "attempt_0" / "0" / "stdout.log")),
            visible(std::string("tty=1\n") + kCleanLines));
}

TEST_F(Redraw, NoTerminalVariableWhenTheOutputGoesOnlyToFiles) {
  const fs::path logs = dir_ / "logs";
  const TtyOutcome o = run_on_tty({"run", "--standalone", "--nproc-per-node", "1", "--log-dir",
                                   logs.string(), "--run-id", "quiet", kWorker, "redraw", "-"},
                                  dir_, dir_ / "go");
  ASSERT_TRUE(WIFEXITED(o.status) && WEXITSTATUS(o.status) == 0) << o.status << "\n"
                                                                 << visible(o.tty) << o.err;
  EXPECT_EQ(o.tty, "");
  EXPECT_EQ(visible(read_text(logs / "quiet" / "attempt_0" / "0" / "stdout.log")),
            visible(std::string("tty=none\n") + kCleanLines));
}

}  // namespace
