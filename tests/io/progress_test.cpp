// Progress: the formatting functions, the ETA from the recent rate, redraw rate limiting and the
// bar's bytes, plain lines every N steps, and the logger ending an open bar line.
#include "lockstep/io/progress.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <mutex>
#include <regex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "lockstep/base/log.h"

namespace lockstep::io {
namespace {

namespace fs = std::filesystem;

TEST(ProgressFormat, Durations) {
  EXPECT_EQ(format_duration(0), "0:00");
  EXPECT_EQ(format_duration(7), "0:07");
  EXPECT_EQ(format_duration(59.6), "1:00");
  EXPECT_EQ(format_duration(754), "12:34");
  EXPECT_EQ(format_duration(3723), "1:02:03");
  EXPECT_EQ(format_duration(100 * 3600 + 5), "100:00:05");
  EXPECT_EQ(format_duration(-1), "?");
  EXPECT_EQ(format_duration(std::numeric_limits<double>::quiet_NaN()), "?");
  EXPECT_EQ(format_duration(std::numeric_limits<double>::infinity()), "?");
}

TEST(ProgressFormat, BarCells) {
  EXPECT_EQ(format_bar(0, 10, 10), "[          ]");
  EXPECT_EQ(format_bar(5, 10, 10), "[=====>    ]");
  EXPECT_EQ(format_bar(1, 3, 10), "[===>      ]");
  EXPECT_EQ(format_bar(9, 10, 10), "[=========>]");
  EXPECT_EQ(format_bar(10, 10, 10), "[==========]");
  EXPECT_EQ(format_bar(15, 10, 10), "[==========]");
  EXPECT_EQ(format_bar(-3, 10, 10), "[          ]");
  EXPECT_EQ(format_bar(3, 0, 4), "[    ]");
  // The width never changes with the numbers.
  for (int width : {1, 7, 20}) {
    for (int64_t done = 0; done <= 13; ++done) {
      EXPECT_EQ(format_bar(done, 13, width).size(), static_cast<size_t>(width) + 2)
          << done << "/13 width " << width;
    }
  }
}

TEST(ProgressFormat, Lines) {
  ProgressLine p{.epoch = 1,
                 .step = 120,
                 .total = 469,
                 .loss = 0.43214,
                 .samples_per_s = 2345.4,
                 .eta_s = 12.2,
                 .bar_width = 20};
  EXPECT_EQ(format_progress_line(p),
            "epoch 1 [=====>              ] step 120/469 loss 0.4321 2345 samples/s ETA 0:12");
  p.bar_width = 0;
  EXPECT_EQ(format_progress_line(p), "epoch 1 step 120/469 loss 0.4321 2345 samples/s ETA 0:12");
  p.step = 469;  // done: no ETA
  EXPECT_EQ(format_progress_line(p), "epoch 1 step 469/469 loss 0.4321 2345 samples/s");
  // Unknown total, slow rate, no rate yet, a loss that is not a number or diverges.
  EXPECT_EQ(format_progress_line({.epoch = 2, .step = 7, .loss = 1, .samples_per_s = 12.54}),
            "epoch 2 step 7 loss 1.0000 12.5 samples/s");
  EXPECT_EQ(format_progress_line({.epoch = 0, .step = 1, .total = 10, .loss = NAN}),
            "epoch 0 step 1/10 loss nan");
  EXPECT_EQ(format_progress_line({.epoch = 0, .step = 1, .loss = 123456789.0}),
            "epoch 0 step 1 loss 1.235e+08");
}

// A clock the test moves.
struct FakeClock {
  double t = 1000;
  std::function<double()> fn() {
    return [this] { return t; };
  }
};

TEST(Progress, EtaFollowsTheRecentRateNotTheAverage) {
  FakeClock clock;
  Progress p({.log_every = 0,
              .rate_window_s = 5,
              .terminal = false,
              .enabled = true,
              .clock = clock.fn()});
  p.start_epoch(0, 1000);
  EXPECT_EQ(p.eta_s(), -1);  // no step yet: no rate
  int64_t step = 0;
  for (int i = 0; i < 100; ++i) {  // slow: 1 step/s
    clock.t += 1.0;
    p.update(++step, 1.0, 32);
  }
  EXPECT_NEAR(p.steps_per_s(), 1.0, 1e-9);
  EXPECT_NEAR(p.eta_s(), 900, 1e-6);
  for (int i = 0; i < 100; ++i) {  // fast: 10 steps/s
    clock.t += 0.1;
    p.update(++step, 1.0, 32);
  }
  // Over the last ~5 s the rate is 10 steps/s: 800 steps left take 80 s (the average since the
  // start, 200 steps in 110 s, would say 440 s).
  EXPECT_NEAR(p.steps_per_s(), 10.0, 0.5);
  EXPECT_NEAR(p.samples_per_s(), 320.0, 16);
  EXPECT_NEAR(p.eta_s(), 80, 4);
  // A new epoch starts a new measurement.
  p.start_epoch(1, 1000);
  EXPECT_EQ(p.steps_per_s(), 0);
  EXPECT_EQ(p.eta_s(), -1);
}

class ProgressPlain : public ::testing::Test {
 protected:
  void SetUp() override {
    set_log_rank(-1);
    set_log_level(LogLevel::kInfo);
    set_log_sink([this](LogLevel, std::string_view text) {
      std::lock_guard<std::mutex> lock(mutex_);
      lines_.emplace_back(text);
    });
  }
  void TearDown() override {
    set_log_sink(nullptr);
    set_log_rank(-1);
  }
  std::vector<std::string> lines() {
    std::lock_guard<std::mutex> lock(mutex_);
    return lines_;
  }
  std::mutex mutex_;
  std::vector<std::string> lines_;
};

TEST_F(ProgressPlain, PlainModeLogsEveryNStepsAndTheLast) {
  FakeClock clock;
  {
    Progress p({.log_every = 10, .terminal = false, .enabled = true, .clock = clock.fn()});
    p.start_epoch(3, 25);
    for (int64_t s = 1; s <= 25; ++s) {
      clock.t += 0.5;
      p.update(s, 0.125, 64);
    }
    p.finish();  // the last step was logged already: nothing more
  }
  const auto l = lines();
  ASSERT_EQ(l.size(), 3u);
  EXPECT_TRUE(std::regex_search(
      l[0], std::regex(R"(INFO: epoch 3 step 10/25 loss 0\.1250 128 samples/s ETA 0:08\n$)")))
      << l[0];
  EXPECT_NE(l[1].find("INFO: epoch 3 step 20/25 "), std::string::npos) << l[1];
  EXPECT_NE(l[2].find("INFO: epoch 3 step 25/25 "), std::string::npos) << l[2];
  for (const auto& line : l) EXPECT_EQ(line.find('['), line.find("[rank")) << "no bar: " << line;
}

TEST_F(ProgressPlain, PlainModeWithUnknownTotalLogsTheLastStepAtFinish) {
  FakeClock clock;
  Progress p({.log_every = 10, .terminal = false, .enabled = true, .clock = clock.fn()});
  p.start_epoch(0, 0);
  for (int64_t s = 1; s <= 15; ++s) {
    clock.t += 1;
    p.update(s, 2.0, 8);
  }
  EXPECT_EQ(lines().size(), 1u);
  p.finish();
  p.finish();  // twice: still one line for step 15
  const auto l = lines();
  ASSERT_EQ(l.size(), 2u);
  EXPECT_NE(l[1].find("INFO: epoch 0 step 15 loss 2.0000 8.0 samples/s\n"), std::string::npos)
      << l[1];
}

TEST_F(ProgressPlain, OnlyRankZeroShowsProgressByDefault) {
  set_log_rank(1);
  Progress other({.terminal = false});
  EXPECT_FALSE(other.enabled());
  other.start_epoch(0, 1);
  other.update(1, 1.0, 1);
  other.finish();
  set_log_rank(0);
  Progress zero({.terminal = false});
  EXPECT_TRUE(zero.enabled());
  zero.start_epoch(0, 1);
  zero.update(1, 1.0, 1);
  EXPECT_EQ(lines().size(), 1u);
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p);
  return {std::istreambuf_iterator<char>(in), {}};
}

fs::path temp_file(const std::string& name) {
  return fs::path(::testing::TempDir()) / (name + "_" + std::to_string(::getpid()));
}

// Into a file (as into the launcher's pipe): "line\r" per redraw, "line\n" at the end; no more
// than max_redraws_per_s redraws a second; the last step always drawn.
TEST(Progress, TerminalModeRedrawsAtMostTenTimesASecond) {
  const fs::path path = temp_file("progress_bar");
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ASSERT_GE(fd, 0);
  FakeClock clock;
  {
    Progress p({.bar_width = 10,
                .max_redraws_per_s = 10,
                .terminal = true,
                .enabled = true,
                .fd = fd,
                .clock = clock.fn()});
    p.start_epoch(1, 200);
    for (int64_t s = 1; s <= 200; ++s) {  // 2 s of steps, 100 a second
      clock.t += 0.01;
      p.update(s, 0.5, 10);
    }
    p.finish();
  }
  ::close(fd);
  const std::string out = read_file(path);
  fs::remove(path);
  ASSERT_FALSE(out.empty());
  EXPECT_EQ(out.back(), '\n');
  EXPECT_EQ(out.find('\x1b'), std::string::npos) << "escapes are for terminals only";
  std::vector<std::string> segments;
  std::string cur;
  for (char c : out) {
    if (c == '\r' || c == '\n') {
      segments.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  // 2 s at 10 redraws/s, the first at once, the last step, and the final line.
  EXPECT_GE(segments.size(), 20u);
  EXPECT_LE(segments.size(), 23u);
  const std::regex bar(
      R"(^epoch 1 \[[=> ]{10}\] step \d+/200 loss 0\.5000( \d+ samples/s)?( ETA \d+:\d\d)?$)");
  for (const auto& s : segments) EXPECT_TRUE(std::regex_match(s, bar)) << s;
  EXPECT_EQ(segments.back(), "epoch 1 [==========] step 200/200 loss 0.5000 1000 samples/s");
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1);
}

// Points fd 1 at a file for the length of a scope.
class RedirectStdout {
 public:
  explicit RedirectStdout(const fs::path& path) {
    std::fflush(stdout);
    saved_ = ::dup(1);
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 1);
    ::close(fd);
  }
  ~RedirectStdout() {
    std::fflush(stdout);
    ::dup2(saved_, 1);
    ::close(saved_);
  }

 private:
  int saved_;
};

// Note [Open progress line] (include/lockstep/base/log.h): a log line while the bar is drawn
// starts on a line of its own.
TEST(Progress, ALogLineEndsTheOpenBarLineFirst) {
  const fs::path path = temp_file("progress_and_log");
  set_log_sink(nullptr);
  set_log_rank(-1);
  set_log_level(LogLevel::kInfo);
  FakeClock clock;
  {
    RedirectStdout redirect(path);
    Progress p({.bar_width = 4, .terminal = true, .enabled = true, .clock = clock.fn()});
    p.start_epoch(0, 4);
    clock.t += 1;
    p.update(1, 1.0, 1);
    log_info("between");
    log_info("and again");  // the line is already ended: no empty line
    clock.t += 1;
    p.update(2, 1.0, 1);
    p.finish();
  }
  const std::string out = read_file(path);
  fs::remove(path);
  const std::regex want(
      "^epoch 0 \\[=>  \\] step 1/4 loss 1.0000 1.0 samples/s ETA 0:03\r\n"
      "[^\n]*Z INFO: between\n"
      "[^\n]*Z INFO: and again\n"
      "epoch 0 \\[==> \\] step 2/4 loss 1.0000 1.0 samples/s ETA 0:02\r"
      "epoch 0 \\[==> \\] step 2/4 loss 1.0000 1.0 samples/s ETA 0:02\n$");
  EXPECT_TRUE(std::regex_match(out, want)) << out;
}

}  // namespace
}  // namespace lockstep::io
