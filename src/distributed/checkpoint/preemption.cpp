// StopOnSignal: Note [Preemption] in include/lockstep/distributed/preemption.h.
#include "lockstep/distributed/preemption.h"

#include <string.h>

#include <algorithm>
#include <atomic>
#include <cctype>

#include "lockstep/base/error.h"
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
      LS_THROW("StopOnSignal: cannot catch ", signal_name(signals_[i]), ": ", ::strerror(err));
    }
  }
  // A launcher blocks signals it reads itself; a worker it started may inherit the mask.
  sigset_t set;
  sigemptyset(&set);
  for (int s : signals_) sigaddset(&set, s);
  ::pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
}

StopOnSignal::~StopOnSignal() {
  for (size_t i = 0; i < signals_.size(); ++i) ::sigaction(signals_[i], &previous_[i], nullptr);
  g_installed = false;
}

int StopOnSignal::caught() const { return g_caught.load(); }

int StopOnSignal::agreed(ProcessGroup& pg) {
  if (pg.size() == 1) return caught();
  Tensor sig = full({1}, static_cast<double>(caught()), kFloat64);
  pg.all_reduce_host(sig, {.op = ReduceOp::max});
  return static_cast<int>(sig.item());
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
    if (!name.empty() && std::all_of(name.begin(), name.end(), ::isdigit)) {
      sig = name.size() <= 2 ? std::stoi(name) : 0;
      if (sig >= NSIG) sig = 0;
    } else {
      for (int s = 1; s < NSIG && sig == 0; ++s) {
        const char* abbrev = ::sigabbrev_np(s);
        if (abbrev != nullptr && name == abbrev) sig = s;
      }
    }
    LS_CHECK(sig != 0 && sig != SIGKILL && sig != SIGSTOP, "'", item,
             "' is not a signal that can be caught: expected a name such as TERM, SIGTERM, USR1, "
             "INT, HUP or a number (a list is comma-separated; 'none' for none), in '",
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
