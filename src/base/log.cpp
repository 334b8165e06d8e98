// Leveled log lines: the threshold, the time and rank prefix, one write(2) per message.
#include "lockstep/base/log.h"

#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>

#include "lockstep/base/env_var.h"
#include "lockstep/base/syscall.h"
#include "lockstep/base/worker_env.h"

namespace lockstep {

namespace {

constexpr int kUnknownRank = -1;
constexpr int kLevelUnset = -1;

std::atomic<int> g_level{kLevelUnset};
std::atomic<int> g_rank{kUnknownRank};
std::atomic<bool> g_progress_line_open{false};

// The sink is replaced rarely and read on every line: readers copy the pointer under the lock
// and call the sink outside it, so a sink may itself log or take its time.
std::mutex g_sink_mutex;
std::shared_ptr<const LogSink> g_sink;

std::shared_ptr<const LogSink> current_sink() {
  std::lock_guard<std::mutex> lock(g_sink_mutex);
  return g_sink;
}

// "2026-12-02T20:41:07.123Z"
std::string utc_timestamp() {
  timespec ts{};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  std::tm tm{};
  ::gmtime_r(&ts.tv_sec, &tm);
  char buf[48];
  const size_t n = std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%S", &tm);
  std::snprintf(buf + n, sizeof buf - n, ".%03dZ", static_cast<int>(ts.tv_nsec / 1000000));
  return buf;
}

// A log line never fails: a bad RANK (read_dist_env reports it) leaves the prefix out.
int rank_from_env() {
  try {
    return static_cast<int>(env_int(env::kRank, 0, 1'000'000'000).value_or(kUnknownRank));
  } catch (const Error&) {
    return kUnknownRank;
  }
}

}  // namespace

const char* log_level_name(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug:
      return "DEBUG";
    case LogLevel::kInfo:
      return "INFO";
    case LogLevel::kWarning:
      return "WARNING";
    case LogLevel::kError:
      return "ERROR";
  }
  return "?";
}

std::optional<LogLevel> parse_log_level(std::string_view name) {
  std::string lower;
  for (char c : name)
    lower.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  if (lower == "debug") return LogLevel::kDebug;
  if (lower == "info") return LogLevel::kInfo;
  if (lower == "warning" || lower == "warn") return LogLevel::kWarning;
  if (lower == "error") return LogLevel::kError;
  return std::nullopt;
}

LogLevel log_level_from_env() {
  const auto v = env_string(kLogLevelEnv);
  if (!v) return LogLevel::kInfo;
  if (const auto level = parse_log_level(*v)) return *level;
  // Written without the threshold: it is the threshold that is being worked out.
  detail::log_write(LogLevel::kWarning,
                    detail::str_cat(kLogLevelEnv, "=", *v,
                                    " is not a log level; expected one of debug, info, warning, "
                                    "error (any case); using info"));
  return LogLevel::kInfo;
}

LogLevel log_level() {
  int v = g_level.load(std::memory_order_relaxed);
  if (v != kLevelUnset) return static_cast<LogLevel>(v);
  // Once per process, so that a bad value is reported once; a set_log_level() that came first
  // wins over the environment.
  static std::once_flag once;
  std::call_once(once, [] {
    int expected = kLevelUnset;
    g_level.compare_exchange_strong(expected, static_cast<int>(log_level_from_env()));
  });
  return static_cast<LogLevel>(g_level.load());
}

void set_log_level(LogLevel level) { g_level.store(static_cast<int>(level)); }

namespace {
// Note [Log level at start]
// The threshold is read at the first log line, which in a program that logs little comes at the
// end of the run: a misspelt LOCKSTEP_LOG_LEVEL would be reported only after hours of training.
// Reading it when the program starts (static initialization of this file, which any use of the
// log links in) reports it first. Everything it touches is constant-initialized above; a
// set_log_level() in main() still wins.
[[maybe_unused]] const bool g_level_read_at_start = (log_level(), true);
}  // namespace

bool log_enabled(LogLevel level) { return level >= log_level(); }

void set_log_rank(int rank) { g_rank.store(rank < 0 ? kUnknownRank : rank); }

int log_rank() {
  const int r = g_rank.load(std::memory_order_relaxed);
  return r != kUnknownRank ? r : rank_from_env();
}

void set_log_sink(LogSink sink) {
  auto p = sink ? std::make_shared<const LogSink>(std::move(sink)) : nullptr;
  std::lock_guard<std::mutex> lock(g_sink_mutex);
  g_sink = std::move(p);
}

namespace detail {

void set_progress_line_open(bool open) { g_progress_line_open.store(open); }

void log_write(LogLevel level, std::string_view msg) {
  std::string prefix = utc_timestamp();
  const int rank = log_rank();
  if (rank != kUnknownRank) prefix += " [rank " + std::to_string(rank) + "]";
  prefix += ' ';
  prefix += log_level_name(level);
  prefix += ": ";
  // Every line of a multi-line message gets the prefix: a reader (or the launcher, which
  // prefixes by line) sees whose it is and when.
  if (!msg.empty() && msg.back() == '\n') msg.remove_suffix(1);
  std::string text;
  text.reserve(msg.size() + prefix.size() + 1);
  for (;;) {
    const size_t nl = msg.find('\n');
    text += prefix;
    text += msg.substr(0, nl);
    text += '\n';
    if (nl == std::string_view::npos) break;
    msg.remove_prefix(nl + 1);
  }
  if (const auto sink = current_sink()) {
    (*sink)(level, text);
    return;
  }
  std::fflush(stdout);  // what the program printf'ed before this line comes before it
  // Note [Open progress line] in include/lockstep/base/log.h
  if (g_progress_line_open.exchange(false)) write_best_effort(1, "\n");
  write_best_effort(level >= LogLevel::kWarning ? 2 : 1, text);
}

}  // namespace detail

}  // namespace lockstep
