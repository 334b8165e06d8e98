// How long the launcher waits before restarting a failed group (Note [Restart backoff]).
#pragma once

#include <algorithm>
#include <cmath>

namespace lockstep::launch {

// Note [Restart backoff]
// A program that fails at once (a bad path, a missing file) would be restarted as fast as it
// fails, a hundred times a second with a large --max-restarts, flooding the terminal and the
// logs and hammering whatever it touches (a shared file system, a GPU driver). So before each
// restart the launcher waits: --restart-backoff seconds (1 by default) after the first failure,
// twice as long after each further generation that failed within kRestartBackoffReset of its
// start, at most kMaxRestartBackoffS (or --restart-backoff itself, when larger). A generation
// that ran at least kRestartBackoffReset starts the doubling over: that job trains, it does not
// crash-loop. --restart-backoff 0 restarts at once.
// Who waits: only node 0, before it publishes the next generation's members (Note
// [Membership]), in a job of fixed size and an elastic one alike; the other
// nodes wait for those members only --rdzv-timeout + --node-timeout + 30 s, less than a doubled
// delay can be (up to 60 s, or --restart-backoff up to 3600), so node 0 first writes its delay
// (gen<g+1>/restart_delay) and each of them moves its deadline by that much.
inline constexpr double kMaxRestartBackoffS = 60;
inline constexpr double kRestartBackoffReset = 60;
inline constexpr double kMaxRestartBackoffOption = 3600;  // --restart-backoff's range

class RestartBackoff {
 public:
  explicit RestartBackoff(double first_s) : first_s_(first_s) {}

  // The wait before the next restart, after a generation that ran `ran_s` seconds.
  double delay_after(double ran_s) {
    if (ran_s >= kRestartBackoffReset) quick_failures_ = 0;
    const double cap = std::max(first_s_, kMaxRestartBackoffS);
    const double d = std::min(first_s_ * std::ldexp(1.0, std::min(quick_failures_, 30)), cap);
    ++quick_failures_;
    return d;
  }

 private:
  double first_s_;
  int quick_failures_ = 0;  // failures in a row since the last long generation
};

}  // namespace lockstep::launch
