// MetricsWriter: every line is a JSON object with the agreed keys and types, written at once,
// appended across writers, non-finite values as null, a clear error for a bad path. The reader
// (read_metrics): what the writer wrote comes back, restarts keep what the final model went
// through, unknown keys are skipped, and bad input names the file and line.
#include "lockstep/io/metrics.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "lockstep/base/error.h"

namespace lockstep::io {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

class Metrics : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::path(::testing::TempDir()) /
           ("metrics_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    path_ = (dir_ / "metrics.jsonl").string();
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Every line of the file, each parsed (a line that does not parse fails the test).
  std::vector<json> records() const {
    std::ifstream in(path_);
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string text = ss.str();
    EXPECT_TRUE(text.empty() || text.back() == '\n') << "last line unfinished: " << text;
    std::vector<json> out;
    std::istringstream lines(text);
    for (std::string line; std::getline(lines, line);) {
      try {
        out.push_back(json::parse(line));
      } catch (const json::exception& e) {
        ADD_FAILURE() << "not JSON: " << line << " (" << e.what() << ")";
      }
    }
    return out;
  }

  fs::path dir_;
  std::string path_;
};

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::vector<std::string> keys(const json& j) {
  std::vector<std::string> k;
  for (auto it = j.begin(); it != j.end(); ++it) k.push_back(it.key());
  return k;
}

TEST_F(Metrics, PeakResidentMemoryIsThisProcesssAndWrittenWhenSet) {
  const double before = peak_rss_mib();
  EXPECT_GT(before, 1.0);  // a process of this size holds more than a MiB
  {
    // 64 MiB touched: the peak grows by about as much (it never shrinks).
    std::vector<char> big(64u << 20);
    for (size_t i = 0; i < big.size(); i += 4096) big[i] = static_cast<char>(i);
    volatile char keep = big[4096];  // the pages must be touched, not optimized away
    (void)keep;
    EXPECT_GE(peak_rss_mib(), before + 60);
  }
  const double peak = peak_rss_mib();
  {
    MetricsWriter w(path_, false);
    w.write(
        TrainRecord{.step = 1, .loss = 0.5, .lr = 0.1, .samples_per_s = 1, .peak_rss_mib = peak});
  }
  const auto r = records();
  ASSERT_EQ(r.size(), 1u);
  EXPECT_DOUBLE_EQ(r[0]["peak_rss_mib"].get<double>(), peak);
}

TEST_F(Metrics, TheSlowRankIsWrittenWhenSetAfterThePeakMemory) {
  {
    MetricsWriter w(path_, false);
    w.write(TrainRecord{.step = 7,
                        .loss = 0.5,
                        .lr = 0.1,
                        .samples_per_s = 1,
                        .peak_rss_mib = 12.5,
                        .slowest_rank = 2,
                        .slowest_rank_ms = 41.25,
                        .median_rank_ms = 12.5});
  }
  const auto r = records();
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(keys(r[0]),
            (std::vector<std::string>{"kind", "step", "epoch", "loss", "lr", "samples_per_s",
                                      "peak_rss_mib", "slowest_rank", "slowest_rank_ms",
                                      "median_rank_ms", "time", "elapsed"}));
  EXPECT_TRUE(r[0]["slowest_rank"].is_number_integer());
  EXPECT_EQ(r[0]["slowest_rank"].get<int64_t>(), 2);
  EXPECT_EQ(r[0]["slowest_rank_ms"].get<double>(), 41.25);
  EXPECT_EQ(r[0]["median_rank_ms"].get<double>(), 12.5);
}

TEST_F(Metrics, TheWorldSizeIsWrittenWhenSetAfterTheEpoch) {
  {
    MetricsWriter w(path_, false);
    w.write(TrainRecord{.step = 3, .epoch = 1, .world_size = 3, .loss = 0.5, .lr = 0.1});
    w.write(TrainRecord{.step = 4, .loss = 0.5, .lr = 0.1});  // a program that does not report it
  }
  const auto r = records();
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(keys(r[0]), (std::vector<std::string>{"kind", "step", "epoch", "world_size", "loss",
                                                  "lr", "samples_per_s", "time", "elapsed"}));
  EXPECT_TRUE(r[0]["world_size"].is_number_integer());
  EXPECT_EQ(r[0]["world_size"].get<int64_t>(), 3);
  EXPECT_FALSE(r[1].contains("world_size"));
}

TEST_F(Metrics, TrainAndEvalRecordsHaveTheAgreedKeysAndTypes) {
  const double before = unix_now();
  {
    MetricsWriter w(path_);
    w.write(TrainRecord{.step = 100,
                        .epoch = 1,
                        .loss = 0.5,
                        .lr = 0.01,
                        .samples_per_s = 1234.5,
                        .loss_scale = 65536.0,
                        .grad_norm = 1.25});
    w.write(TrainRecord{.step = 200, .epoch = 1, .loss = 0.25, .lr = 0.005, .samples_per_s = 99});
    w.write(EvalRecord{.step = 200, .epoch = 1, .test_accuracy = 0.875, .test_loss = 0.375});
    w.write(EvalRecord{.step = 300, .epoch = 2, .test_accuracy = 0.9});
  }
  const double after = unix_now();
  const auto r = records();
  ASSERT_EQ(r.size(), 4u);

  EXPECT_EQ(keys(r[0]),
            (std::vector<std::string>{"kind", "step", "epoch", "loss", "lr", "samples_per_s",
                                      "loss_scale", "grad_norm", "time", "elapsed"}));
  EXPECT_EQ(r[0]["kind"], "train");
  EXPECT_TRUE(r[0]["step"].is_number_integer());
  EXPECT_TRUE(r[0]["epoch"].is_number_integer());
  EXPECT_EQ(r[0]["step"].get<int64_t>(), 100);
  EXPECT_EQ(r[0]["epoch"].get<int64_t>(), 1);
  EXPECT_DOUBLE_EQ(r[0]["loss"].get<double>(), 0.5);
  EXPECT_DOUBLE_EQ(r[0]["lr"].get<double>(), 0.01);
  EXPECT_DOUBLE_EQ(r[0]["samples_per_s"].get<double>(), 1234.5);
  EXPECT_DOUBLE_EQ(r[0]["loss_scale"].get<double>(), 65536.0);
  EXPECT_DOUBLE_EQ(r[0]["grad_norm"].get<double>(), 1.25);
  // Optional keys are left out, not written as null.
  EXPECT_EQ(keys(r[1]), (std::vector<std::string>{"kind", "step", "epoch", "loss", "lr",
                                                  "samples_per_s", "time", "elapsed"}));

  EXPECT_EQ(keys(r[2]), (std::vector<std::string>{"kind", "step", "epoch", "test_accuracy",
                                                  "test_loss", "time", "elapsed"}));
  EXPECT_EQ(r[2]["kind"], "eval");
  EXPECT_DOUBLE_EQ(r[2]["test_accuracy"].get<double>(), 0.875);
  EXPECT_DOUBLE_EQ(r[2]["test_loss"].get<double>(), 0.375);
  EXPECT_EQ(keys(r[3]), (std::vector<std::string>{"kind", "step", "epoch", "test_accuracy", "time",
                                                  "elapsed"}));

  double last_elapsed = 0;
  for (const auto& j : r) {
    ASSERT_TRUE(j["time"].is_number_float()) << j;
    ASSERT_TRUE(j["elapsed"].is_number_float()) << j;
    EXPECT_GE(j["time"].get<double>(), before - 1e-3) << j;
    EXPECT_LE(j["time"].get<double>(), after + 1e-3) << j;
    EXPECT_GE(j["elapsed"].get<double>(), last_elapsed) << j;
    EXPECT_LE(j["elapsed"].get<double>(), after - before + 1e-3) << j;
    last_elapsed = j["elapsed"].get<double>();
  }
}

TEST_F(Metrics, EachRecordIsInTheFileAsSoonAsItIsWritten) {
  MetricsWriter w(path_);
  w.write(TrainRecord{.step = 1, .loss = 2.0});
  ASSERT_EQ(records().size(), 1u);  // the writer is still open: nothing waits in a buffer
  w.write(EvalRecord{.step = 1, .test_accuracy = 0.5});
  EXPECT_EQ(records().size(), 2u);
}

TEST_F(Metrics, AppendsToAnExistingFileUnlessToldNotTo) {
  {
    MetricsWriter w(path_);
    w.write(TrainRecord{.step = 1});
    w.write(TrainRecord{.step = 2});
  }
  {
    MetricsWriter resumed(path_);  // a resumed run continues the file
    resumed.write(TrainRecord{.step = 3});
  }
  auto r = records();
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[0]["step"], 1);
  EXPECT_EQ(r[2]["step"], 3);
  {
    MetricsWriter fresh(path_, /*append=*/false);
    fresh.write(TrainRecord{.step = 7});
  }
  r = records();
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0]["step"], 7);
}

TEST_F(Metrics, NonFiniteValuesAreNull) {
  constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
  constexpr double kInf = std::numeric_limits<double>::infinity();
  {
    MetricsWriter w(path_);
    w.write(
        TrainRecord{.step = 5, .loss = kNaN, .lr = 0.1, .samples_per_s = kInf, .grad_norm = -kInf});
    w.write(EvalRecord{.step = 5, .test_accuracy = kNaN, .test_loss = kInf});
  }
  const auto r = records();
  ASSERT_EQ(r.size(), 2u);
  EXPECT_TRUE(r[0]["loss"].is_null()) << r[0];
  EXPECT_TRUE(r[0]["samples_per_s"].is_null()) << r[0];
  EXPECT_TRUE(r[0]["grad_norm"].is_null()) << r[0];
  EXPECT_DOUBLE_EQ(r[0]["lr"].get<double>(), 0.1);
  EXPECT_TRUE(r[1]["test_accuracy"].is_null()) << r[1];
  EXPECT_TRUE(r[1]["test_loss"].is_null()) << r[1];
}

TEST_F(Metrics, UnopenablePathIsAnErrorNamingThePathAndTheReason) {
  const std::string bad = (dir_ / "no" / "such" / "dir" / "m.jsonl").string();
  try {
    MetricsWriter w(bad);
    FAIL() << "opened " << bad;
  } catch (const Error& e) {
    EXPECT_NE(e.message().find(bad), std::string::npos) << e.what();
    EXPECT_NE(e.message().find("No such file or directory"), std::string::npos) << e.what();
  }
}

TEST_F(Metrics, AMovedWriterKeepsWritingTheSameFile) {
  MetricsWriter a(path_);
  a.write(TrainRecord{.step = 1});
  MetricsWriter b(std::move(a));
  b.write(TrainRecord{.step = 2});
  EXPECT_EQ(b.path(), path_);
  EXPECT_EQ(records().size(), 2u);
}

// ---------------------------------------------------------------------------------------------
// Reading

using ::testing::HasSubstr;

// A train record as the writer lays it out (keys in its order, "time" and "elapsed" last).
std::string train_line(int64_t step, double loss, double lr, double speed) {
  std::ostringstream os;
  os.precision(17);
  os << R"({"kind":"train","step":)" << step << R"(,"epoch":0,"loss":)" << loss << R"(,"lr":)" << lr
     << R"(,"samples_per_s":)" << speed << R"(,"time":1700000000.5,"elapsed":)" << step * 0.1
     << "}\n";
  return os.str();
}

std::string eval_line(int64_t step, double acc) {
  std::ostringstream os;
  os.precision(17);
  os << R"({"kind":"eval","step":)" << step << R"(,"epoch":0,"test_accuracy":)" << acc
     << R"(,"time":1700000000.5,"elapsed":1.5})"
     << "\n";
  return os.str();
}

MetricsFile parse(const std::string& text, const std::string& name = "m.jsonl") {
  std::istringstream in(text);
  return parse_metrics(in, name);
}

// The MetricsFileError message parse() throws for `text`, or "" when it throws none.
std::string parse_error(const std::string& text) {
  try {
    parse(text);
  } catch (const MetricsFileError& e) {
    return e.what();
  }
  return "";
}

TEST_F(Metrics, WhatTheWriterWroteTheReaderReadsBack) {
  constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
  {
    MetricsWriter w(path_);
    w.write(TrainRecord{.step = 1,
                        .loss = 2.5,
                        .lr = 0.01,
                        .samples_per_s = 100,
                        .loss_scale = 65536.0,
                        .grad_norm = 0.75});
    w.write(TrainRecord{.step = 2, .loss = kNaN, .lr = 0.02, .samples_per_s = 200});
    w.write(EvalRecord{.step = 2, .test_accuracy = 0.625, .test_loss = 0.5});
  }
  const MetricsFile m = read_metrics(path_);
  EXPECT_EQ(m.path, path_);
  ASSERT_EQ(m.train.size(), 2u);
  EXPECT_EQ(m.train[0].step, 1);
  EXPECT_EQ(m.train[0].loss, 2.5);
  EXPECT_EQ(m.train[0].lr, 0.01);
  EXPECT_EQ(m.train[0].samples_per_s, 100);
  EXPECT_EQ(m.train[0].loss_scale, 65536.0);
  EXPECT_EQ(m.train[0].grad_norm, 0.75);
  EXPECT_TRUE(std::isnan(m.train[1].loss));        // written as null
  EXPECT_TRUE(std::isnan(m.train[1].loss_scale));  // left out
  EXPECT_EQ(m.train[1].lr, 0.02);
  ASSERT_EQ(m.eval.size(), 1u);
  EXPECT_EQ(m.eval[0].step, 2);
  EXPECT_EQ(m.eval[0].test_accuracy, 0.625);
  EXPECT_EQ(m.eval[0].test_loss, 0.5);
  EXPECT_TRUE(m.restarts.empty());
  EXPECT_TRUE(m.warnings.empty());
}

TEST_F(Metrics, ARestartKeepsWhatTheFinalModelWentThrough) {
  std::string text;
  for (int s = 1; s <= 6; ++s) text += train_line(s, 10.0 + s, 0.1, 100);  // first attempt
  text += eval_line(3, 0.30) + eval_line(6, 0.60);
  for (int s = 4; s <= 5; ++s) text += train_line(s, 20.0 + s, 0.1, 100);  // resumed from step 3
  text += eval_line(3, 0.33);  // the resumed run evaluates step 3 again
  const MetricsFile m = parse(text);
  std::vector<int64_t> steps;
  std::map<int64_t, double> loss;
  for (const TrainPoint& p : m.train) steps.push_back(p.step), loss[p.step] = p.loss;
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 3, 4, 5}));  // step 6 belonged to the old attempt
  EXPECT_EQ(loss[3], 13.0);
  EXPECT_EQ(loss[4], 24.0);
  EXPECT_EQ(loss[5], 25.0);
  ASSERT_EQ(m.eval.size(), 1u);  // step 6's evaluation is gone, step 3's replaced
  EXPECT_EQ(m.eval[0].step, 3);
  EXPECT_EQ(m.eval[0].test_accuracy, 0.33);
  EXPECT_EQ(m.restarts, (std::vector<int64_t>{4}));
}

TEST_F(Metrics, TheReaderShowsAWorldSizeChangeAndReadsFilesWithoutIt) {
  {
    MetricsWriter w(path_);
    for (int64_t s = 1; s <= 3; ++s)
      w.write(TrainRecord{.step = s, .world_size = 2, .loss = 1.0, .lr = 0.05});
  }
  {
    // Resumed at step 2 with 3 ranks: step 3 of the 2-rank run is replaced.
    MetricsWriter resumed(path_);
    for (int64_t s = 3; s <= 4; ++s)
      resumed.write(TrainRecord{.step = s, .world_size = 3, .loss = 1.0, .lr = 0.075});
  }
  const MetricsFile m = read_metrics(path_);
  std::vector<int64_t> worlds;
  for (const TrainPoint& p : m.train) worlds.push_back(p.world_size);
  EXPECT_EQ(worlds, (std::vector<int64_t>{2, 2, 3, 3}));
  EXPECT_EQ(m.restarts, (std::vector<int64_t>{3}));

  // A file from before world_size was written (or null) reads as 0: not recorded.
  const MetricsFile old =
      parse(train_line(1, 1.0, 0.1, 10) + R"({"kind":"train","step":2,"world_size":null})");
  ASSERT_EQ(old.train.size(), 2u);
  EXPECT_EQ(old.train[0].world_size, 0);
  EXPECT_EQ(old.train[1].world_size, 0);
  // Anything but a positive integer is an error naming the line and the value.
  EXPECT_THAT(parse_error(R"({"kind":"train","step":1,"world_size":0})"),
              HasSubstr("m.jsonl:1: \"world_size\" must be a positive integer, got 0"));
  EXPECT_THAT(parse_error(R"({"kind":"train","step":1,"world_size":2.5})"),
              HasSubstr("\"world_size\" must be a positive integer, got 2.5"));
  EXPECT_THAT(parse_error(R"({"kind":"train","step":1,"world_size":"2"})"),
              HasSubstr("\"world_size\" must be a positive integer, got \"2\""));
}

TEST_F(Metrics, ReaderIsLenientAboutUnknownAndMissingOptionalKeys) {
  const MetricsFile m =
      parse(R"({"kind":"train","step":1,"loss":1.5,"lr":0.1,"samples_per_s":10,"new_key":[1,2]})"
            "\n\n"
            R"({"kind":"hparams","batch":64})"
            "\n"
            R"({"kind":"train","step":2,"loss":null,"lr":0.1,"samples_per_s":10})"
            "\r\n"
            R"({"kind":"eval","step":2,"test_accuracy":0.5})"
            "\n"
            R"({"kind":"train","step":3,"lo)");  // being written right now
  ASSERT_EQ(m.train.size(), 2u);
  EXPECT_TRUE(std::isnan(m.train[0].loss_scale));
  EXPECT_TRUE(std::isnan(m.train[1].loss));  // null: a NaN loss
  ASSERT_EQ(m.eval.size(), 1u);
  EXPECT_TRUE(std::isnan(m.eval[0].test_loss));
  ASSERT_EQ(m.warnings.size(), 1u);
  EXPECT_THAT(m.warnings[0], HasSubstr("m.jsonl:6: skipped the last line"));
}

TEST_F(Metrics, BadInputNamesTheFileAndLine) {
  const std::string ok = train_line(1, 1.0, 0.1, 10);
  EXPECT_THAT(parse_error(ok + "not json\n"), HasSubstr("m.jsonl:2: not a JSON object: not json"));
  EXPECT_THAT(parse_error(ok + "[1, 2]\n"), HasSubstr("m.jsonl:2: not a JSON object"));
  EXPECT_THAT(parse_error(ok + "{\"kind\":\"train\",\"loss\":1.0}\n" + ok),
              HasSubstr("m.jsonl:2: record without \"step\""));
  EXPECT_THAT(parse_error("{\"kind\":\"eval\",\"step\":\"3\"}\n"),
              HasSubstr("m.jsonl:1: \"step\" must be an integer, got \"3\""));
  EXPECT_THAT(parse_error("{\"kind\":\"train\",\"step\":1.5}\n"),
              HasSubstr("\"step\" must be an integer"));
  EXPECT_THAT(parse_error("{\"step\":1}\n"), HasSubstr("m.jsonl:1: record without \"kind\""));
  EXPECT_THAT(parse_error("{\"kind\":7,\"step\":1}\n"),
              HasSubstr("m.jsonl:1: \"kind\" must be a string, got 7"));
  EXPECT_THAT(parse_error(ok + "{\"kind\":\"train\",\"step\":2,\"loss\":\"high\"}\n"),
              HasSubstr("m.jsonl:2: \"loss\" must be a number, got \"high\""));
  EXPECT_THAT(parse_error(""), HasSubstr("m.jsonl: the file is empty"));
  EXPECT_THAT(parse_error("\n  \n"), HasSubstr("m.jsonl: the file is empty"));
  EXPECT_THAT(parse_error("{\"kind\":\"hparams\"}\n"),
              HasSubstr("m.jsonl: no \"train\" or \"eval\" records"));
  EXPECT_EQ(parse_error(ok), "");
  // A garbled line that ends with a newline is not a line being written: an error.
  EXPECT_THAT(parse_error(ok + "{\"kind\":\"tr\n"), HasSubstr("m.jsonl:2: not a JSON object"));

  // A file that cannot be read: its path and errno's text.
  try {
    read_metrics((dir_ / "missing.jsonl").string());
    ADD_FAILURE() << "expected MetricsFileError";
  } catch (const MetricsFileError& e) {
    EXPECT_THAT(e.what(), HasSubstr("missing.jsonl: cannot open: No such file or directory"));
  }
  try {
    read_metrics(dir_.string());
    ADD_FAILURE() << "expected MetricsFileError";
  } catch (const MetricsFileError& e) {
    EXPECT_THAT(e.what(), HasSubstr(": is a directory"));
  }
}

}  // namespace
}  // namespace lockstep::io
