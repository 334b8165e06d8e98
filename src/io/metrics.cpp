// MetricsWriter: JSON Lines records of training and evaluation.
#include "lockstep/io/metrics.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <utility>

#include <nlohmann/json.hpp>

#include "lockstep/base/error.h"

namespace lockstep::io {

namespace {

// nlohmann's ordered_json keeps the keys in the order written, so lines read the same way as the
// format in the header.
using json = nlohmann::ordered_json;

// Non-finite values become null (nlohmann writes them so too; explicit here because it is the
// documented format, not an accident of the library).
json number(double v) { return std::isfinite(v) ? json(v) : json(nullptr); }

double unix_seconds() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

// The record's line, with the keys every record ends with: "time" and "elapsed" since `start`.
std::string stamped(json& record, std::chrono::steady_clock::time_point start) {
  record["time"] = unix_seconds();
  record["elapsed"] =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return record.dump();
}

}  // namespace

MetricsWriter::MetricsWriter(const std::string& path, bool append)
    : path_(path), start_(std::chrono::steady_clock::now()) {
  const int flags = O_WRONLY | O_CREAT | O_CLOEXEC | (append ? O_APPEND : O_TRUNC);
  fd_ = ::open(path.c_str(), flags, 0644);
  LS_CHECK(fd_ >= 0, "cannot open the metrics file ", path, ": ", std::strerror(errno));
}

MetricsWriter::~MetricsWriter() {
  if (fd_ >= 0) ::close(fd_);
}

MetricsWriter::MetricsWriter(MetricsWriter&& other) noexcept
    : path_(std::move(other.path_)), fd_(std::exchange(other.fd_, -1)), start_(other.start_) {}

MetricsWriter& MetricsWriter::operator=(MetricsWriter&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
    start_ = other.start_;
  }
  return *this;
}

void MetricsWriter::write(const TrainRecord& r) {
  json j;
  j["kind"] = "train";
  j["step"] = r.step;
  j["epoch"] = r.epoch;
  j["loss"] = number(r.loss);
  j["lr"] = number(r.lr);
  j["samples_per_s"] = number(r.samples_per_s);
  if (r.loss_scale) j["loss_scale"] = number(*r.loss_scale);
  if (r.grad_norm) j["grad_norm"] = number(*r.grad_norm);
  write_line(stamped(j, start_));
}

void MetricsWriter::write(const EvalRecord& r) {
  json j;
  j["kind"] = "eval";
  j["step"] = r.step;
  j["epoch"] = r.epoch;
  j["test_accuracy"] = number(r.test_accuracy);
  if (r.test_loss) j["test_loss"] = number(*r.test_loss);
  write_line(stamped(j, start_));
}

void MetricsWriter::write_line(const std::string& line) {
  LS_CHECK(fd_ >= 0, "MetricsWriter: write after the writer was moved from");
  const std::string text = line + "\n";
  size_t done = 0;
  // One write(2) in practice; the loop only covers a signal or a short write.
  while (done < text.size()) {
    const ssize_t n = ::write(fd_, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    LS_CHECK(n > 0, "cannot write to the metrics file ", path_, ": ",
             n < 0 ? std::strerror(errno) : "nothing written");
    done += static_cast<size_t>(n);
  }
}

}  // namespace lockstep::io
