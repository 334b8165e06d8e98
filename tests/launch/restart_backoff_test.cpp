// The launcher's wait before a restart (Note [Restart backoff] in
// tools/lockstep/restart_backoff.h): doubling from --restart-backoff, capped, started over after a
// generation that ran long; and end to end, the waits a crash-looping program gets and says.
#include <gmock/gmock.h>

#include "launch/launcher_process.h"
#include "restart_backoff.h"

using lockstep::launch::kMaxRestartBackoffS;
using lockstep::launch::kRestartBackoffReset;
using lockstep::launch::RestartBackoff;
using namespace lockstep::testing::launch;
using ::testing::HasSubstr;

namespace {

TEST(RestartBackoff, DoublesWhileGenerationsFailQuicklyUpToTheCap) {
  RestartBackoff b(1);
  const double want[] = {1, 2, 4, 8, 16, 32, 60, 60};
  for (double w : want) EXPECT_EQ(b.delay_after(0.5), w);
}

TEST(RestartBackoff, AGenerationThatRanLongStartsTheDoublingOver) {
  RestartBackoff b(0.5);
  EXPECT_EQ(b.delay_after(1), 0.5);
  EXPECT_EQ(b.delay_after(1), 1);
  EXPECT_EQ(b.delay_after(1), 2);
  EXPECT_EQ(b.delay_after(kRestartBackoffReset), 0.5);
  EXPECT_EQ(b.delay_after(kRestartBackoffReset - 1), 1);
}

TEST(RestartBackoff, AFirstDelayAboveTheCapIsKeptAndZeroMeansAtOnce) {
  RestartBackoff big(120);
  EXPECT_EQ(big.delay_after(0), 120);
  EXPECT_EQ(big.delay_after(0), 120);
  RestartBackoff none(0);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(none.delay_after(0), 0);
}

TEST(RestartBackoff, ManyFailuresStayAtTheCap) {
  RestartBackoff b(0.001);
  double last = 0;
  for (int i = 0; i < 2000; ++i) last = b.delay_after(0);
  EXPECT_EQ(last, kMaxRestartBackoffS);
}

TEST_F(Launcher, RestartsOfAProgramThatFailsAtOnceWaitLongerEachTimeAndSaySo) {
  const Outcome o = run_launcher(
      {"run", "--standalone", "--max-restarts", "4", "--restart-backoff", "0.05", "/bin/false"},
      dir_, "false");
  EXPECT_TRUE(o.exited_with(1)) << o.describe();
  size_t at = 0;
  for (const char* step : {"in 0.05 s (restart 1 of 4)", "in 0.1 s (restart 2 of 4)",
                           "in 0.2 s (restart 3 of 4)", "in 0.4 s (restart 4 of 4)"}) {
    const size_t found = o.err.find(std::string("restarting the whole group ") + step, at);
    ASSERT_NE(found, std::string::npos) << "no '" << step << "' after the previous one\n"
                                        << o.describe();
    at = found;
  }
  EXPECT_THAT(o.err, HasSubstr("restarts used: 4 of 4")) << o.describe();
}

TEST_F(Launcher, RestartBackoffOutOfRangeIsAUsageError) {
  for (const char* bad : {"-1", "3601", "abc"}) {
    const Outcome o =
        run_launcher({"run", "--standalone", "--restart-backoff", bad, "/bin/true"}, dir_, "bad");
    expect_usage_error(o, out_, {"--restart-backoff", "from 0 to 3600", bad});
  }
}

}  // namespace
