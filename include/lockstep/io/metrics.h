// Training metrics as JSON Lines (one JSON object per line): MetricsWriter writes them, and
// read_metrics reads them back (for `lockstep plot`).
//
// Records (keys in this order; optional ones left out when unset):
//   {"kind":"train","step":int,"epoch":int,"world_size":int,"loss":float,"lr":float,
//    "samples_per_s":float,
//    "loss_scale":float,"grad_norm":float,"peak_rss_mib":float,"slowest_rank":int,
//    "slowest_rank_ms":float,"median_rank_ms":float,"time":float,"elapsed":float}
//   {"kind":"eval","step":int,"epoch":int,"test_accuracy":float,"test_loss":float,
//    "time":float,"elapsed":float}
// `time` is Unix time in seconds, `elapsed` seconds since this writer was made. A value that is
// not finite (a NaN or infinite loss) is written as null: the line stays valid JSON, and a
// reader sees that the value was missing rather than a made-up number.
#pragma once

#include <chrono>
#include <cstdint>
#include <istream>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "lockstep/base/syscall.h"

namespace lockstep::io {

struct TrainRecord {
  int64_t step = 0;
  int64_t epoch = 0;
  // The number of ranks that trained this step, when the program reports it: a run resumed at
  // another world size shows in the file as a change of it from one record to the next.
  std::optional<int64_t> world_size{};
  double loss = 0;
  double lr = 0;
  double samples_per_s = 0;
  std::optional<double> loss_scale{};  // mixed precision with a GradScaler
  std::optional<double> grad_norm{};   // when the program measures it (clip_grad_norm)
  // The writing process's peak resident memory so far, in MiB (getrusage's ru_maxrss), when the
  // program reports it (peak_rss_mib()).
  std::optional<double> peak_rss_mib{};
  // Under DDP, when the program reports them (DDPStats, Note [Slow rank]): the rank with the
  // longest compute time in this step (forward and backward up to the first gradient bucket), its
  // time in ms, and the median over the ranks, in ms.
  std::optional<int64_t> slowest_rank{};
  std::optional<double> slowest_rank_ms{};
  std::optional<double> median_rank_ms{};
};

// This process's peak resident memory so far, in MiB (getrusage(RUSAGE_SELF).ru_maxrss).
double peak_rss_mib();

struct EvalRecord {
  int64_t step = 0;
  int64_t epoch = 0;
  double test_accuracy = 0;  // a fraction in [0, 1]
  std::optional<double> test_loss{};
};

// Appends records to a JSON Lines file. Each record is one write(2) of one whole line, so the
// file holds complete lines up to the last record written even if the process is killed (a
// crash loses at most the line being written), and a resumed run appends to the same file.
// Meant for one writer per file (rank 0); not thread-safe.
class MetricsWriter {
 public:
  // Opens `path` for appending (creating it), or truncates it when `append` is false. Throws
  // lockstep::Error naming the path and the reason when it cannot be opened.
  explicit MetricsWriter(const std::string& path, bool append = true);
  MetricsWriter(MetricsWriter&& other) noexcept = default;
  MetricsWriter& operator=(MetricsWriter&& other) noexcept = default;
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  // Throw lockstep::Error when the line cannot be written (a full disk).
  void write(const TrainRecord& r);
  void write(const EvalRecord& r);

  const std::string& path() const { return path_; }

 private:
  void write_line(const std::string& line);

  std::string path_;
  Fd fd_;
  std::chrono::steady_clock::time_point start_;
};

// ---------------------------------------------------------------------------------------------
// Reading

// A metrics file that cannot be read or is malformed. what() is meant for the user as it stands
// ("NAME:LINE: what is wrong"), without a source location: `lockstep plot` exits 2 on it.
struct MetricsFileError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// One "kind":"train" record as read back. NaN marks a value the record did not have (or had as
// null, which is how the writer spells a NaN loss).
struct TrainPoint {
  int64_t step = 0;
  double loss, lr, samples_per_s, loss_scale, grad_norm;
  int64_t world_size = 0;  // 0: not recorded (a program that does not report it, an older file)
};

// One "kind":"eval" record as read back; NaN as above.
struct EvalPoint {
  int64_t step = 0;
  double test_accuracy, test_loss;
};

// One metrics file as the final model went through it: steps strictly increasing, the records a
// resumed run replaced are gone (Note [Restarts] in src/io/metrics.cpp).
struct MetricsFile {
  std::string path;
  std::vector<TrainPoint> train;
  std::vector<EvalPoint> eval;
  std::vector<int64_t> restarts;      // the step each resumed run restarted at
  std::vector<std::string> warnings;  // e.g. a half-written last line that was skipped
};

// Parses a metrics file's text; `name` prefixes error messages ("NAME:LINE: ..."). Throws
// MetricsFileError for a line that is not a JSON object, a record without an integer "step" or a
// string "kind", a value of the wrong type, or a file without train or eval records. Records of
// other kinds are skipped, and so are keys it does not know.
MetricsFile parse_metrics(std::istream& in, const std::string& name);
// Reads the file at `path` (MetricsFileError also when it cannot be opened).
MetricsFile read_metrics(const std::string& path);

}  // namespace lockstep::io
