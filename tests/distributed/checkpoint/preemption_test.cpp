// StopOnSignal (Note [Preemption]): a caught signal only raises a flag, the ranks agree on it
// after the same step whichever of them it reached, and the previous dispositions come back.
#include <signal.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include <gmock/gmock.h>

#include "distributed/spawn_ranks.h"
#include "lockstep/base/error.h"
#include "lockstep/distributed/init.h"
#include "lockstep/distributed/preemption.h"

using namespace lockstep;
using namespace lockstep::dist;
using ::testing::HasSubstr;

namespace {

constexpr const char* kModeEnv = "LOCKSTEP_TEST_PREEMPT_MODE";
constexpr const char* kReportEnv = "LOCKSTEP_TEST_PREEMPT_REPORT";
constexpr int kWorld = 3;

TEST(ParseSignals, NamesNumbersAndLists) {
  EXPECT_EQ(parse_signals("TERM"), std::vector<int>{SIGTERM});
  EXPECT_EQ(parse_signals("sigusr1"), std::vector<int>{SIGUSR1});
  EXPECT_EQ(parse_signals("15"), std::vector<int>{SIGTERM});
  EXPECT_EQ(parse_signals("TERM,USR1,TERM"), (std::vector<int>{SIGTERM, SIGUSR1}));
  EXPECT_TRUE(parse_signals("none").empty());
  EXPECT_EQ(signal_name(SIGUSR1), "SIGUSR1");
}

TEST(ParseSignals, WhatCannotBeCaughtIsAnErrorNamingIt) {
  for (const std::string bad :
       {"KILL", "STOP", "SEGV", "11", "BUS", "CHLD", "CONT", "FOO", "", "TERM,", "99", "0"}) {
    try {
      parse_signals(bad);
      ADD_FAILURE() << "'" << bad << "' was accepted";
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("is not a signal to stop on: expected TERM, INT, HUP"))
          << bad;
    }
  }
}

struct sigaction disposition(int sig) {
  struct sigaction sa {};
  ::sigaction(sig, nullptr, &sa);
  return sa;
}

TEST(StopOnSignal, ASignalIsCaughtNotFatalAndTheOldHandlerComesBack) {
  ASSERT_EQ(disposition(SIGUSR2).sa_handler, SIG_DFL);
  const auto hup = disposition(SIGHUP).sa_handler;  // SIG_IGN under nohup
  sigset_t blocked, mask;
  sigemptyset(&blocked);
  sigaddset(&blocked, SIGUSR2);
  ::pthread_sigmask(SIG_BLOCK, &blocked, nullptr);  // as a launcher's worker may inherit it
  {
    StopOnSignal stop({SIGUSR2, SIGHUP});
    EXPECT_EQ(stop.caught(), 0);
    ::raise(SIGUSR2);  // the default action would end this process
    EXPECT_EQ(stop.caught(), SIGUSR2);
    ::raise(SIGHUP);
    EXPECT_EQ(stop.caught(), SIGUSR2) << "the first signal is the one named";
    EXPECT_THROW(StopOnSignal another, Error) << "two handlers of one signal";
  }
  EXPECT_EQ(disposition(SIGUSR2).sa_handler, SIG_DFL);
  EXPECT_EQ(disposition(SIGHUP).sa_handler, hup);
  ::pthread_sigmask(SIG_SETMASK, nullptr, &mask);
  EXPECT_TRUE(sigismember(&mask, SIGUSR2)) << "the mask before comes back";
  ::pthread_sigmask(SIG_UNBLOCK, &blocked, nullptr);
  StopOnSignal again({SIGUSR2});
  EXPECT_EQ(again.caught(), 0) << "a new StopOnSignal starts from nothing caught";
}

// Rank `mode` raises SIGTERM during step 4; every rank reports the step at which it learned of it
// and the signal.
int worker(const std::string& mode) {
  try {
    auto pg = init_process_group();
    const int signalled = std::stoi(mode);
    StopOnSignal stop;
    std::string report;
    for (int step = 1; step <= 10; ++step) {
      if (pg->rank() == signalled && step == 4) ::raise(SIGTERM);
      if (const int sig = stop.agreed(*pg)) {
        report = "step " + std::to_string(step) + " " + signal_name(sig);
        break;
      }
    }
    destroy_process_group();
    if (const char* path = std::getenv(kReportEnv)) std::ofstream(path) << report;
    return 0;
  } catch (const std::exception& e) {
    if (const char* path = std::getenv(kReportEnv)) std::ofstream(path) << e.what();
    return 1;
  }
}

[[maybe_unused]] const bool kRanAsWorker = [] {
  const char* mode = std::getenv(kModeEnv);
  if (mode == nullptr) return false;
  std::exit(worker(mode));
}();

TEST(StopOnSignal, EveryRankStopsAfterTheStepInWhichAnyRankWasSignalled) {
  for (int signalled : {0, kWorld - 1}) {
    const auto results = lockstep::testing::run_ranks_as_processes(
        kWorld, kModeEnv, std::to_string(signalled), kReportEnv, std::chrono::seconds(120));
    for (int r = 0; r < kWorld; ++r) {
      EXPECT_TRUE(lockstep::testing::exited_zero(results[r])) << "rank " << r;
      EXPECT_EQ(results[r].report, "step 4 SIGTERM")
          << "rank " << r << " (rank " << signalled << " was signalled)";
    }
  }
}

}  // namespace
