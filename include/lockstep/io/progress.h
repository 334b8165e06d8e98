// Training progress for rank 0: a bar redrawn in place on a terminal, plain lines elsewhere.
//
//   epoch 1 [=======>            ] 120/469 loss 0.4321 2345 samples/s ETA 0:12
//
// On a terminal (LOCKSTEP_STDOUT_IS_TTY=1, which `lockstep run` sets when its own stdout is one,
// or stdout being a terminal) the line is redrawn with '\r' at most max_redraws_per_s times a
// second. Otherwise (a log file, a pipe) the same line without the bar is logged at info level
// every log_every steps and at the last step. The ETA comes from the rate over the last few
// seconds, not since the start, so it follows the current speed.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <string>

namespace lockstep::io {

// "0:07", "12:34", "1:02:03"; "?" for a negative or non-finite time.
std::string format_duration(double seconds);

// "[=====>    ]": `width` cells between the brackets, `done` of `total` filled ('>' at the
// head while unfinished). done is clamped to [0, total]; total <= 0 gives an empty bar.
std::string format_bar(int64_t done, int64_t total, int width);

// What one progress line shows.
struct ProgressLine {
  int64_t epoch = 0;
  int64_t step = 0;   // steps done in this epoch
  int64_t total = 0;  // steps in this epoch; 0: unknown (no bar, no "/total", no ETA)
  double loss = 0;
  double samples_per_s = 0;  // <= 0: not shown (no rate yet)
  double eta_s = -1;         // < 0 or non-finite: not shown
  int bar_width = 0;         // 0: no bar (plain lines)
};

// "epoch 1 [=====>    ] 120/469 loss 0.4321 2345 samples/s ETA 0:12"
std::string format_progress_line(const ProgressLine& p);

struct ProgressOptions {
  int64_t log_every = 100;  // plain lines: one every this many steps (and at the last step)
  int bar_width = 20;
  double max_redraws_per_s = 10;
  // The rate (and so the ETA) is measured over about this many seconds of recent steps.
  double rate_window_s = 10;
  // Unset: LOCKSTEP_STDOUT_IS_TTY=1 or stdout is a terminal.
  std::optional<bool> terminal{};
  // Unset: only on rank 0 (lockstep::log_rank() is 0 or unknown); other ranks show nothing.
  std::optional<bool> enabled{};
  int fd = 1;  // where the bar is drawn
  // Seconds on a monotonic clock; unset: std::chrono::steady_clock. Tests pass their own.
  std::function<double()> clock{};
};

class Progress {
 public:
  explicit Progress(ProgressOptions opts = {});
  ~Progress();  // finish()
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // Starts an epoch of `total_steps` steps (0: unknown); ends the previous epoch's bar.
  void start_epoch(int64_t epoch, int64_t total_steps);
  // `step` steps of the epoch are done; `loss` is the latest loss, `samples` how many samples
  // this step covered (over all ranks, for the job's throughput).
  void update(int64_t step, double loss, int64_t samples);
  // Draws the last state and ends the bar's line; a plain line for the last step if it was not
  // logged yet. Nothing when nothing is pending.
  void finish();

  bool enabled() const { return enabled_; }
  bool terminal() const { return terminal_; }
  // The recent rate; 0 before the first update of an epoch.
  double samples_per_s() const;
  double steps_per_s() const;
  // Seconds until the epoch's last step at the recent rate; -1 when unknown.
  double eta_s() const;

 private:
  struct Mark {
    double t;
    int64_t step;
    int64_t samples;  // cumulative in the epoch
  };
  double now() const;
  ProgressLine line() const;
  void draw(bool final);

  ProgressOptions opts_;
  bool enabled_ = false;
  bool terminal_ = false;
  bool tty_fd_ = false;  // opts_.fd itself is a terminal (not the launcher's pipe)
  int64_t epoch_ = 0, total_ = 0, step_ = 0, samples_ = 0;
  double loss_ = 0;
  std::deque<Mark> window_;       // marks of the last rate_window_s, oldest first
  Mark current_{0, 0, 0};         // the latest update
  double last_draw_ = -1;         // when the bar was last drawn; < 0: not in this epoch
  int64_t last_logged_step_ = 0;  // plain mode
  bool pending_ = false;          // an update not yet drawn or logged
  bool line_open_ = false;        // a bar is on the terminal without its '\n'
};

}  // namespace lockstep::io
