// The output multiplexer of `lockstep run`: workers' lines to the terminal (prefixed, progress
// bars redrawn in place), to log files and into the failure summary's tail.
#include "output.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>

namespace lockstep::launch {

namespace {

std::string prefix(int rank) { return "[rank" + std::to_string(rank) + "]: "; }

}  // namespace

bool OutputOptions::to_terminal(int local_rank) const {
  const auto& f = local_ranks_filter;
  return (log_dir.empty() || tee) &&
         (f.empty() || std::find(f.begin(), f.end(), local_rank) != f.end());
}

// Note [Redrawn lines]
// A worker's progress bar arrives as segments ended by '\r' (Note [Carriage returns] in
// worker_process.h). Where the launcher's stdout or stderr is a terminal, each segment is shown
// at once as "\r[rankN]: segment" plus an erase to the end of the line, and the line stays open
// (no '\n'). The next whole line of the same worker and stream replaces it (the bar's final
// state, or a line the worker printed over its bar, as its own terminal would show); any other
// line first ends the open one with '\n', so the bar's last state stays visible above it and
// its next redraw starts on a fresh line. Log files and output that is not a terminal never see
// the segments, only the lines.
constexpr const char* kEraseToEol = "\x1b[K";

Terminal::Terminal() {
  tty_[1] = ::isatty(1) == 1;
  tty_[2] = ::isatty(2) == 1;
}

void Terminal::end_open_line() {
  if (open_line_) write_best_effort(open_line_->fd, "\n");
  open_line_.reset();
}

void Terminal::say(const std::string& msg) {
  if (is_tty(2)) end_open_line();
  write_best_effort(2, "lockstep run: " + msg + "\n");
}

void Terminal::line(int rank, int fd, const std::string& text) {
  const std::string prefixed = prefix(rank) + text;
  if (is_tty(fd) && open_line_) {
    if (open_line_->rank == rank && open_line_->fd == fd) {  // Note [Redrawn lines]
      open_line_.reset();
      write_best_effort(fd, "\r" + prefixed + kEraseToEol + "\n");
      return;
    }
    end_open_line();
  }
  // One write per line: lines of different workers never mix.
  write_best_effort(fd, prefixed + "\n");
}

void Terminal::redraw(int rank, int fd, const std::string& segment) {
  if (!is_tty(fd)) return;  // Note [Redrawn lines]
  if (open_line_ && (open_line_->rank != rank || open_line_->fd != fd)) end_open_line();
  write_best_effort(fd, "\r" + prefix(rank) + segment + kEraseToEol);
  open_line_ = OpenLine{rank, fd};
}

namespace {

Fd create_log(const std::filesystem::path& path) {
  const int flags = O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC;
  return Fd(LS_SYSCHECK_MSG(::open(path.c_str(), flags, 0644), "cannot create the log file ",
                            path.string()));
}

}  // namespace

WorkerOutput::WorkerOutput(Terminal& terminal, int rank, bool to_terminal,
                           const std::string& log_dir)
    : terminal_(terminal),
      rank_(rank),
      to_terminal_(to_terminal),
      out_([this](const std::string& line) { on_line(false, line); },
           [this](const std::string& segment) { on_redraw(false, segment); }),
      err_([this](const std::string& line) { on_line(true, line); },
           [this](const std::string& segment) { on_redraw(true, segment); }) {
  if (!log_dir.empty()) {
    std::filesystem::create_directories(log_dir);
    out_log_ = create_log(std::filesystem::path(log_dir) / "stdout.log");
    err_log_ = create_log(std::filesystem::path(log_dir) / "stderr.log");
  }
}

std::string cut_text(const std::string& text, size_t max) {
  if (text.size() <= max) return text;
  size_t n = max;
  // Not inside a UTF-8 sequence: back up over its continuation bytes (10xxxxxx).
  while (n > 0 && (static_cast<unsigned char>(text[n]) & 0xC0) == 0x80) --n;
  return text.substr(0, n) + " [... " + std::to_string(text.size() - n) + " more bytes]";
}

void WorkerOutput::on_line(bool is_err, const std::string& line) {
  tail_.push_back(cut_text(line, kTailLineBytes));
  tail_bytes_ += tail_.back().size();
  while (tail_.size() > kTailLines || tail_bytes_ > kTailBytes) {
    tail_bytes_ -= tail_.front().size();
    tail_.pop_front();
  }
  const Fd& log = is_err ? err_log_ : out_log_;
  if (log) write_best_effort(log.get(), line + "\n");
  if (to_terminal_) terminal_.line(rank_, is_err ? 2 : 1, line);
}

void WorkerOutput::on_redraw(bool is_err, const std::string& segment) {
  if (to_terminal_) terminal_.redraw(rank_, is_err ? 2 : 1, segment);
}

}  // namespace lockstep::launch
