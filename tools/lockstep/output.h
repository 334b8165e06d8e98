// The output multiplexer of `lockstep run`: every worker's stdout and stderr, line by line, to the
// launcher's terminal (prefixed "[rankN]: ", progress bars redrawn in place), to the worker's log
// files, and into the last lines kept for the failure summary; and the launcher's own messages.
#pragma once

#include <cstddef>
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "lockstep/base/syscall.h"
#include "worker_process.h"

namespace lockstep::launch {

// What --log-dir, --tee and --local-ranks-filter ask for.
struct OutputOptions {
  std::string log_dir;                  // empty: no files
  bool tee = false;                     // with log_dir: to the terminal as well
  std::vector<int> local_ranks_filter;  // empty: every local rank reaches the terminal

  // Whether the output of the worker with this local rank reaches the launcher's stdout and
  // stderr.
  bool to_terminal(int local_rank) const;
};

// The launcher's stdout and stderr, shared by every worker's lines and the launcher's own
// messages. Whole lines go out in one write each, so lines of different workers never mix.
class Terminal {
 public:
  Terminal();

  // Whether fd 1 or 2 is a terminal (where a redrawn line is shown in place).
  bool is_tty(int fd) const { return fd >= 1 && fd <= 2 && tty_[fd]; }
  // "lockstep run: MSG" on stderr.
  void say(const std::string& msg);
  // A worker's whole line on fd 1 or 2, prefixed with its rank.
  void line(int rank, int fd, const std::string& text);
  // A segment of a line the worker redraws (Note [Redrawn lines] in output.cpp); shown only
  // where fd is a terminal.
  void redraw(int rank, int fd, const std::string& segment);
  // Ends a redrawn line left open, if any: a shell prompt must not land on a worker's last
  // progress bar.
  void end_open_line();

 private:
  // The redrawn line on the terminal without its '\n'.
  struct OpenLine {
    int rank = -1;
    int fd = -1;
  };

  bool tty_[3] = {false, false, false};
  std::optional<OpenLine> open_line_;
};

// One worker's two output streams: each whole line goes to its log file (when there is one), to
// the terminal (when it reaches it) and into the tail kept for the failure summary.
class WorkerOutput {
 public:
  // Lines of each worker kept for the failure summary: the last kTailLines, each cut to
  // kTailLineBytes, at most kTailBytes in all (the oldest dropped first). A worker that prints
  // megabytes must not flood the summary, nor the failure record every node reads from the store.
  static constexpr size_t kTailLines = 20;
  static constexpr size_t kTailLineBytes = 512;
  static constexpr size_t kTailBytes = 8 * 1024;

  // `log_dir` non-empty: stdout.log and stderr.log are created there (lockstep::Error naming
  // the file when they cannot be).
  WorkerOutput(Terminal& terminal, int rank, bool to_terminal, const std::string& log_dir);
  WorkerOutput(const WorkerOutput&) = delete;
  WorkerOutput& operator=(const WorkerOutput&) = delete;

  // Where the bytes read from the worker's stdout and stderr go.
  LineSplitter& stdout_lines() { return out_; }
  LineSplitter& stderr_lines() { return err_; }
  // Its last lines, stdout and stderr interleaved as they arrived, oldest first.
  std::vector<std::string> tail() const { return {tail_.begin(), tail_.end()}; }

 private:
  void on_line(bool is_err, const std::string& line);
  void on_redraw(bool is_err, const std::string& segment);

  Terminal& terminal_;
  const int rank_;
  const bool to_terminal_;
  Fd out_log_, err_log_;
  LineSplitter out_, err_;
  std::deque<std::string> tail_;
  size_t tail_bytes_ = 0;
};

// `text` cut to at most `max` bytes (at a UTF-8 character boundary) with " [... N more bytes]"
// appended when it was longer.
std::string cut_text(const std::string& text, size_t max);

}  // namespace lockstep::launch
