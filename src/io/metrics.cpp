// Metrics as JSON Lines: MetricsWriter appends training and evaluation records, read_metrics
// reads a file of them back as the final model went through it (Note [Restarts]).
#include "lockstep/io/metrics.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <string_view>
#include <utility>

#include <nlohmann/json.hpp>

#include "lockstep/base/error.h"
#include "lockstep/base/syscall.h"

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

double peak_rss_mib() {
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_maxrss) / 1024.0;  // Linux: KiB
}

MetricsWriter::MetricsWriter(const std::string& path, bool append)
    : path_(path), start_(std::chrono::steady_clock::now()) {
  const int flags = O_WRONLY | O_CREAT | O_CLOEXEC | (append ? O_APPEND : O_TRUNC);
  fd_ =
      Fd(LS_SYSCHECK_MSG(::open(path.c_str(), flags, 0644), "cannot open the metrics file ", path));
}

void MetricsWriter::write(const TrainRecord& r) {
  json j;
  j["kind"] = "train";
  j["step"] = r.step;
  j["epoch"] = r.epoch;
  if (r.world_size) j["world_size"] = *r.world_size;
  j["loss"] = number(r.loss);
  j["lr"] = number(r.lr);
  j["samples_per_s"] = number(r.samples_per_s);
  if (r.loss_scale) j["loss_scale"] = number(*r.loss_scale);
  if (r.grad_norm) j["grad_norm"] = number(*r.grad_norm);
  if (r.peak_rss_mib) j["peak_rss_mib"] = number(*r.peak_rss_mib);
  if (r.slowest_rank) j["slowest_rank"] = *r.slowest_rank;
  if (r.slowest_rank_ms) j["slowest_rank_ms"] = number(*r.slowest_rank_ms);
  if (r.median_rank_ms) j["median_rank_ms"] = number(*r.median_rank_ms);
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
  LS_CHECK(fd_.valid(), "MetricsWriter: write after the writer was moved from");
  const std::string text = line + "\n";
  size_t done = 0;
  // One write(2) in practice; the loop only covers a signal or a short write.
  while (done < text.size()) {
    const ssize_t n = ::write(fd_.get(), text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    LS_CHECK(n > 0, "cannot write to the metrics file ", path_, ": ",
             n < 0 ? errno_text(errno) : std::string("nothing written"));
    done += static_cast<size_t>(n);
  }
}

// ---------------------------------------------------------------------------------------------
// Reading

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// The start of a bad value or line, for an error message.
std::string excerpt(std::string_view s) {
  constexpr size_t kMax = 40;
  return s.size() <= kMax ? std::string(s) : std::string(s.substr(0, kMax)) + "...";
}

// A number, or NaN where the key is absent or null (the writer spells a NaN loss as null).
double number_or_nan(const nlohmann::json& j, const char* key, const std::string& where) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return kNaN;
  if (!it->is_number()) {
    throw MetricsFileError(where + "\"" + key + "\" must be a number, got " + excerpt(it->dump()));
  }
  return it->get<double>();
}

int64_t integer_step(const nlohmann::json& j, const std::string& where) {
  const auto it = j.find("step");
  if (it == j.end()) throw MetricsFileError(where + "record without \"step\"");
  if (it->is_number_integer()) return it->get<int64_t>();
  if (it->is_number_float()) {
    const double v = it->get<double>();
    if (std::isfinite(v) && v == std::floor(v) && std::abs(v) < 9e15)
      return static_cast<int64_t>(v);
  }
  throw MetricsFileError(where + "\"step\" must be an integer, got " + excerpt(it->dump()));
}

// "world_size": a positive integer, or 0 where the record has none (null counts as none).
int64_t world_size_of(const nlohmann::json& j, const std::string& where) {
  const auto it = j.find("world_size");
  if (it == j.end() || it->is_null()) return 0;
  if (it->is_number_integer() && it->get<int64_t>() >= 1) return it->get<int64_t>();
  throw MetricsFileError(where + "\"world_size\" must be a positive integer, got " +
                         excerpt(it->dump()));
}

}  // namespace

// Note [Restarts]
// A resumed run appends to the file it was writing, starting again from its checkpoint's step.
// The curves should show what the final model went through, so a train record whose step is not
// after the previous train record's starts a new trajectory at that step: the train and eval
// records from that step on are dropped (replaced by what follows, or gone where the resumed run
// has not got as far yet). An eval record replaces an earlier one for the same step. Only train
// records mark restarts: an eval logged a little late must not erase training history. A run
// resumed with another number of ranks shows as a change of the train records' world_size, also
// where it resumed right after the last recorded step (and so replaced nothing).
MetricsFile parse_metrics(std::istream& in, const std::string& name) {
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw MetricsFileError(name + ": read error");
  MetricsFile m;
  m.path = name;
  std::map<int64_t, EvalPoint> evals;
  size_t pos = 0;
  int64_t line_no = 0;
  bool any_line = false;
  while (pos < text.size()) {
    const size_t nl = text.find('\n', pos);
    const bool complete = nl != std::string::npos;
    std::string_view line(text.data() + pos, (complete ? nl : text.size()) - pos);
    pos = complete ? nl + 1 : text.size();
    ++line_no;
    while (!line.empty() && std::isspace(static_cast<unsigned char>(line.back()))) {
      line.remove_suffix(1);
    }
    while (!line.empty() && std::isspace(static_cast<unsigned char>(line.front()))) {
      line.remove_prefix(1);
    }
    if (line.empty()) continue;
    any_line = true;
    const std::string where = name + ":" + std::to_string(line_no) + ": ";
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() && !complete) {
      // The writer is in the middle of this line (reading a run that is still training).
      m.warnings.push_back(where + "skipped the last line, which is not complete yet");
      continue;
    }
    if (j.is_discarded() || !j.is_object()) {
      throw MetricsFileError(where + "not a JSON object: " + excerpt(line));
    }
    const auto kind_it = j.find("kind");
    if (kind_it == j.end()) throw MetricsFileError(where + "record without \"kind\"");
    if (!kind_it->is_string()) {
      throw MetricsFileError(where + "\"kind\" must be a string, got " + excerpt(kind_it->dump()));
    }
    const std::string& kind = kind_it->get_ref<const std::string&>();
    if (kind != "train" && kind != "eval") continue;  // a kind of record this reader skips
    const int64_t step = integer_step(j, where);
    if (kind == "train") {
      TrainPoint p{step,
                   number_or_nan(j, "loss", where),
                   number_or_nan(j, "lr", where),
                   number_or_nan(j, "samples_per_s", where),
                   number_or_nan(j, "loss_scale", where),
                   number_or_nan(j, "grad_norm", where),
                   world_size_of(j, where)};
      if (!m.train.empty() && step <= m.train.back().step) {  // Note [Restarts]
        m.restarts.push_back(step);
        while (!m.train.empty() && m.train.back().step >= step) m.train.pop_back();
        evals.erase(evals.lower_bound(step), evals.end());
      }
      m.train.push_back(p);
    } else {
      evals[step] = EvalPoint{step, number_or_nan(j, "test_accuracy", where),
                              number_or_nan(j, "test_loss", where)};
    }
  }
  for (const auto& [step, e] : evals) m.eval.push_back(e);
  if (!any_line) throw MetricsFileError(name + ": the file is empty (no records yet?)");
  if (m.train.empty() && m.eval.empty()) {
    throw MetricsFileError(name + ": no \"train\" or \"eval\" records");
  }
  return m;
}

MetricsFile read_metrics(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) throw MetricsFileError(path + ": is a directory");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw MetricsFileError(path + ": cannot open: " + errno_text(errno));
  return parse_metrics(in, path);
}

}  // namespace lockstep::io
