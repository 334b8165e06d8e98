// StopOnSignal: Note [Preemption] in include/lockstep/distributed/preemption.h.
#include "lockstep/distributed/preemption.h"

#include <algorithm>
#include <atomic>
#include <cctype>

#include "lockstep/base/error.h"
#include "lockstep/base/syscall.h"
#include "lockstep/distributed/error_file.h"
#include "lockstep/distributed/process_group.h"
#include "lockstep/tensor/tensor.h"

namespace lockstep::dist {

namespace {

// The first signal caught, or 0. A lock-free atomic is async-signal-safe to store from the
// handler; only the first store wins, so the signal named in the end is the one that came first.
std::atomic<int> g_caught{0};
std::atomic<bool> g_installed{false};
static_assert(std::atomic<int>::is_always_lock_free);

void on_signal(int sig) {
  int none = 0;
  g_caught.compare_exchange_strong(none, sig);
}

// What a job may stop on: signals sent to ask a process to end. Not the ones a fault raises
// (SEGV, BUS, FPE, ILL, TRAP, ABRT: a handler that returns re-runs the faulting instruction) nor
// the ones ordinary events send (CHLD, WINCH, URG, CONT, TSTP, TTIN, TTOU, PIPE).
constexpr int kStoppable[] = {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGALRM, SIGXCPU};

std::string upper(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

}  // namespace

StopOnSignal::StopOnSignal(std::vector<int> signals) : signals_(std::move(signals)) {
  LS_CHECK(!g_installed.exchange(true),
           "StopOnSignal: another one is alive in this process; signals have one handler each");
  g_caught = 0;
  previous_.resize(signals_.size());
  for (size_t i = 0; i < signals_.size(); ++i) {
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;  // a read or a wait the signal interrupts goes on
    if (::sigaction(signals_[i], &sa, &previous_[i]) != 0) {
      const int err = errno;
      for (size_t j = 0; j < i; ++j) ::sigaction(signals_[j], &previous_[j], nullptr);
      g_installed = false;
      LS_THROW("StopOnSignal: cannot catch ", signal_name(signals_[i]), ": ", errno_text(err));
    }
  }
  // A launcher blocks signals it reads itself; a worker it started may inherit the mask.
  sigset_t set;
  sigemptyset(&set);
  for (int s : signals_) sigaddset(&set, s);
  ::pthread_sigmask(SIG_UNBLOCK, &set, &previous_mask_);
}

StopOnSignal::~StopOnSignal() {
  ::pthread_sigmask(SIG_SETMASK, &previous_mask_, nullptr);
  for (size_t i = 0; i < signals_.size(); ++i) ::sigaction(signals_[i], &previous_[i], nullptr);
  g_installed = false;
}

int StopOnSignal::caught() const { return g_caught.load(); }

int StopOnSignal::agreed(ProcessGroup& pg) {
  int agreed = caught();
  if (pg.size() > 1) {
    Tensor sig = full({1}, static_cast<double>(agreed), kFloat64);
    pg.all_reduce_host(sig, {.op = ReduceOp::max});
    agreed = static_cast<int>(sig.item());
  }
  // For `lockstep run`: this worker's exit with 128 + agreed stops the job; it is no failure.
  if (agreed != 0)
    record_stop(agreed, "stopped by " + signal_name(agreed) + " after a step, to save and exit");
  return agreed;
}

std::vector<int> parse_signals(const std::string& text) {
  std::vector<int> out;
  if (upper(text) == "NONE") return out;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    const std::string item = text.substr(start, comma - start);
    std::string name = upper(item);
    if (name.rfind("SIG", 0) == 0) name = name.substr(3);
    int sig = 0;
    for (int s : kStoppable) {
      if (name == ::sigabbrev_np(s) || name == std::to_string(s)) sig = s;
    }
    LS_CHECK(sig != 0, "'", item,
             "' is not a signal to stop on: expected TERM, INT, HUP, QUIT, USR1, USR2, ALRM or "
             "XCPU, with or without SIG, or its number (a list is comma-separated; 'none' for "
             "none), in '",
             text, "'");
    if (std::find(out.begin(), out.end(), sig) == out.end()) out.push_back(sig);
    start = comma + 1;
  }
  return out;
}

std::string signal_name(int sig) {
  const char* abbrev = ::sigabbrev_np(sig);
  return abbrev ? std::string("SIG") + abbrev : "signal " + std::to_string(sig);
}

}  // namespace lockstep::dist
