// Training metrics as JSON Lines (one JSON object per line), the file `lockstep plot` reads.
//
// Records (keys in this order; optional ones left out when unset):
//   {"kind":"train","step":int,"epoch":int,"loss":float,"lr":float,"samples_per_s":float,
//    "loss_scale":float,"grad_norm":float,"time":float,"elapsed":float}
//   {"kind":"eval","step":int,"epoch":int,"test_accuracy":float,"test_loss":float,
//    "time":float,"elapsed":float}
// `time` is Unix time in seconds, `elapsed` seconds since this writer was made. A value that is
// not finite (a NaN or infinite loss) is written as null: the line stays valid JSON, and a
// reader sees that the value was missing rather than a made-up number.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

namespace lockstep::io {

struct TrainRecord {
  int64_t step = 0;
  int64_t epoch = 0;
  double loss = 0;
  double lr = 0;
  double samples_per_s = 0;
  std::optional<double> loss_scale{};  // mixed precision with a GradScaler
  std::optional<double> grad_norm{};   // when the program measures it (clip_grad_norm)
};

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
  ~MetricsWriter();
  MetricsWriter(MetricsWriter&& other) noexcept;
  MetricsWriter& operator=(MetricsWriter&& other) noexcept;
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  // Throw lockstep::Error when the line cannot be written (a full disk).
  void write(const TrainRecord& r);
  void write(const EvalRecord& r);

  const std::string& path() const { return path_; }

 private:
  void write_line(const std::string& line);

  std::string path_;
  int fd_ = -1;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace lockstep::io
