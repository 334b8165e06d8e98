// One worker process of `lockstep run`: started in its own process group with its output on
// pipes, read back line by line, stopped with its whole process group.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "lockstep/base/syscall.h"

namespace lockstep::launch {

// How a worker ended, as waitpid() reported it.
struct ExitStatus {
  bool signaled = false;
  int code = 0;    // exit code when !signaled
  int signal = 0;  // terminating signal when signaled
  // The worker's peak resident memory (wait4's ru_maxrss: the process itself, not its children),
  // in KiB; -1 when unknown.
  int64_t max_rss_kib = -1;
  bool ok() const { return !signaled && code == 0; }
  std::string str() const;  // "exit code 3" / "signal SIGKILL (9)"
};

// "SIGKILL" for 9, "signal 42" for what has no name.
std::string signal_name(int sig);

// Lines a worker wrote on one stream. `sink` receives each whole line (without '\n'); a line
// longer than kMaxLine is cut into pieces of that size, and a last line without a newline is
// delivered at end of file.
//
// Note [Carriage returns]
// A progress bar redraws its line in place: "bar 1\rbar 2\rbar 3\n". Each '\r' ends a segment;
// `redraw` (when given) receives every non-empty segment the moment its '\r' arrives, for a
// terminal to show at once. The line that '\n' ends, the one `sink` gets, is its last non-empty
// segment: the bar's final state ("bar 3"), and "text\r\n" is "text". So log files hold clean
// lines, and a bar that is only ever redrawn leaves nothing in them.
class LineSplitter {
 public:
  static constexpr size_t kMaxLine = 64 * 1024;
  using Sink = std::function<void(const std::string& line)>;
  explicit LineSplitter(Sink sink, Sink redraw = nullptr)
      : sink_(std::move(sink)), redraw_(std::move(redraw)) {}
  void feed(const char* data, size_t n);
  void finish();

 private:
  Sink sink_, redraw_;
  std::string partial_;
  std::string last_segment_;  // the last non-empty segment ended by '\r' in this line
};

// Raises this process's soft RLIMIT_NOFILE to its hard limit, so that connections to the store it
// hosts cannot leave it without descriptors for its workers' pipes. Workers start with the soft
// limit the launcher was given (a program that uses select() needs descriptors below 1024).
void raise_descriptor_limit();

struct WorkerSpec {
  std::string program;            // absolute path
  std::vector<std::string> args;  // argv[1..]
  std::vector<std::string> env;   // "NAME=value", complete
};

class WorkerProcess {
 public:
  static constexpr int kMaxReadsPerDrain = 16;
  // Starts the process (fork + exec): its own process group, stdin from /dev/null, stdout and
  // stderr to pipes, killed by the kernel if the launcher dies (PR_SET_PDEATHSIG). Throws
  // lockstep::Error when it cannot be started (saying so plainly when the launcher is out of
  // descriptors or processes); a program that fails to exec exits 127 with the reason on its
  // stderr.
  explicit WorkerProcess(const WorkerSpec& spec);
  ~WorkerProcess();
  WorkerProcess(const WorkerProcess&) = delete;
  WorkerProcess& operator=(const WorkerProcess&) = delete;

  pid_t pid() const { return pid_; }
  int stdout_fd() const { return out_.get(); }
  int stderr_fd() const { return err_.get(); }
  // Reads what is available on `fd` (one of the two above) into `splitter`; closes the fd at end
  // of file. Returns false once the stream is closed.
  bool drain(int fd, LineSplitter& splitter);
  bool streams_open() const { return out_.valid() || err_.valid(); }

  // Non-blocking: the exit status once the process has exited (and been reaped).
  std::optional<ExitStatus> poll_exit();
  const std::optional<ExitStatus>& exit_status() const { return status_; }
  // Sends `sig` to the worker's whole process group (its children too).
  void signal_group(int sig);

 private:
  pid_t pid_ = -1;
  Fd out_, err_;  // the read ends of the worker's stdout and stderr pipes
  std::optional<ExitStatus> status_;
};

}  // namespace lockstep::launch
