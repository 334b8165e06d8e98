// Progress: the training progress bar (terminal) or periodic progress lines (elsewhere).
#include "lockstep/io/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "lockstep/base/env_var.h"
#include "lockstep/base/log.h"
#include "lockstep/base/syscall.h"
#include "lockstep/base/worker_env.h"

namespace lockstep::io {

namespace {

// Erase to the end of the line (ANSI EL): a shorter redraw leaves nothing of a longer one. Only
// written when the fd is a terminal itself; under `lockstep run` the launcher clears instead.
constexpr const char* kEraseToEol = "\x1b[K";
// Marks kept per rate window: enough for a smooth rate, few enough that a fast loop (thousands
// of steps a second) does not keep one per step.
constexpr double kMarksPerWindow = 50;

std::string printf_str(const char* fmt, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, v);
  return buf;
}

}  // namespace

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const long long total = std::llround(seconds);
  const long long h = total / 3600, m = total % 3600 / 60, s = total % 60;
  char buf[48];
  if (h > 0) {
    std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", h, m, s);
  } else {
    std::snprintf(buf, sizeof buf, "%lld:%02lld", m, s);
  }
  return buf;
}

std::string format_bar(int64_t done, int64_t total, int width) {
  if (width <= 0) return "[]";
  std::string cells(static_cast<size_t>(width), ' ');
  if (total > 0 && done >= total) {
    cells.assign(static_cast<size_t>(width), '=');
  } else if (total > 0 && done > 0) {
    const auto filled = static_cast<size_t>(done * width / total);  // < width, since done < total
    cells.replace(0, filled, filled, '=');
    cells[filled] = '>';
  }
  return "[" + cells + "]";
}

std::string format_progress_line(const ProgressLine& p) {
  std::string s = "epoch ";
  s += std::to_string(p.epoch);
  if (p.bar_width > 0 && p.total > 0) {
    s += ' ';
    s += format_bar(p.step, p.total, p.bar_width);
  }
  s += " step ";
  s += std::to_string(p.step);
  if (p.total > 0) {
    s += '/';
    s += std::to_string(p.total);
  }
  // Four decimals for the usual losses; a diverging one switches to an exponent rather than
  // growing the line.
  s += " loss ";
  s += printf_str(std::fabs(p.loss) < 1000 ? "%.4f" : "%.4g", p.loss);
  if (p.samples_per_s > 0 && std::isfinite(p.samples_per_s)) {
    s += ' ';
    s += printf_str(p.samples_per_s >= 100 ? "%.0f" : "%.1f", p.samples_per_s);
    s += " samples/s";
  }
  if (p.total > 0 && p.step < p.total && std::isfinite(p.eta_s) && p.eta_s >= 0) {
    s += " ETA ";
    s += format_duration(p.eta_s);
  }
  return s;
}

Progress::Progress(ProgressOptions opts) : opts_(std::move(opts)) {
  enabled_ = opts_.enabled.value_or(log_rank() <= 0);
  tty_fd_ = ::isatty(opts_.fd) == 1;
  if (opts_.terminal) {
    terminal_ = *opts_.terminal;
  } else {
    terminal_ = env_flag(env::kStdoutIsTty).value_or(false) || tty_fd_;
  }
}

Progress::~Progress() {
  try {
    finish();
  } catch (...) {
    // Destructors never throw; a progress line is not worth a terminate.
  }
}

double Progress::now() const {
  if (opts_.clock) return opts_.clock();
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void Progress::start_epoch(int64_t epoch, int64_t total_steps) {
  finish();
  epoch_ = epoch;
  total_ = total_steps;
  step_ = samples_ = last_logged_step_ = 0;
  loss_ = 0;
  window_.clear();
  current_ = {now(), 0, 0};
  window_.push_back(current_);
  last_draw_ = -1;
  pending_ = false;
}

void Progress::update(int64_t step, double loss, int64_t samples) {
  if (!enabled_) return;
  const double t = now();
  step_ = step;
  loss_ = loss;
  samples_ += samples;
  current_ = {t, step, samples_};
  if (window_.empty() || t - window_.back().t >= opts_.rate_window_s / kMarksPerWindow) {
    window_.push_back(current_);
  }
  // Keep one mark at least rate_window_s old, so the rate spans about that long.
  while (window_.size() > 1 && t - window_[1].t >= opts_.rate_window_s) window_.pop_front();
  pending_ = true;
  const bool last = total_ > 0 && step >= total_;
  if (terminal_) {
    const double min_gap = opts_.max_redraws_per_s > 0 ? 1.0 / opts_.max_redraws_per_s : 0;
    if (last_draw_ < 0 || last || t - last_draw_ >= min_gap) {
      draw(false);
      last_draw_ = t;
    }
  } else if ((opts_.log_every > 0 && step % opts_.log_every == 0) || last) {
    log_info(format_progress_line(line()));
    last_logged_step_ = step;
    pending_ = false;
  }
}

void Progress::finish() {
  if (!enabled_) return;
  if (terminal_) {
    if (pending_ || line_open_) draw(true);
  } else if (pending_ && step_ != last_logged_step_) {
    log_info(format_progress_line(line()));
    last_logged_step_ = step_;
  }
  pending_ = false;
}

double Progress::steps_per_s() const {
  if (window_.empty()) return 0;
  const Mark &a = window_.front(), &b = current_;
  return b.t > a.t ? static_cast<double>(b.step - a.step) / (b.t - a.t) : 0;
}

double Progress::samples_per_s() const {
  if (window_.empty()) return 0;
  const Mark &a = window_.front(), &b = current_;
  return b.t > a.t ? static_cast<double>(b.samples - a.samples) / (b.t - a.t) : 0;
}

double Progress::eta_s() const {
  const double rate = steps_per_s();
  if (total_ <= 0 || rate <= 0) return -1;
  return static_cast<double>(std::max<int64_t>(total_ - step_, 0)) / rate;
}

ProgressLine Progress::line() const {
  ProgressLine p;
  p.epoch = epoch_;
  p.step = step_;
  p.total = total_;
  p.loss = loss_;
  p.samples_per_s = samples_per_s();
  p.eta_s = eta_s();
  p.bar_width = terminal_ ? opts_.bar_width : 0;
  return p;
}

// On a terminal: "\r<line>" + erase, the cursor left at the end of the line. Into the
// launcher's pipe: "<line>\r", so that the launcher sees a finished segment and forwards it at
// once (it clears the rest of the terminal line itself; docs/LOGGING.md). The final draw ends
// with '\n' instead.
void Progress::draw(bool final) {
  const std::string text = format_progress_line(line());
  std::string out = tty_fd_ ? "\r" + text + kEraseToEol : text;
  out += final ? "\n" : (tty_fd_ ? "" : "\r");
  if (opts_.fd == 1) std::fflush(stdout);  // the program's own output first
  write_best_effort(opts_.fd, out);
  line_open_ = !final;
  // Note [Open progress line] in include/lockstep/base/log.h
  if (opts_.fd == 1) detail::set_progress_line_open(!final);
  pending_ = false;
}

}  // namespace lockstep::io
