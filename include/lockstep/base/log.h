// Leveled log lines with UTC time and rank: lockstep::log_info("epoch ", e, " done").
//
// A line reads `2026-12-02T20:41:07.123Z [rank 1] WARNING: text` (no `[rank N]` when the rank is
// unknown). debug and info go to stdout, warning and error to stderr, each line with one
// write(2), so lines of threads and processes never mix. The threshold comes from
// LOCKSTEP_LOG_LEVEL (debug, info, warning, error; any case) and defaults to info.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <string_view>

#include "lockstep/base/error.h"

namespace lockstep {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

inline constexpr const char* kLogLevelEnv = "LOCKSTEP_LOG_LEVEL";

// "DEBUG", "INFO", "WARNING", "ERROR".
const char* log_level_name(LogLevel level);
// "debug", "info", "warning" (or "warn"), "error", in any case; nullopt for anything else.
std::optional<LogLevel> parse_log_level(std::string_view name);
// The level LOCKSTEP_LOG_LEVEL names; info when it is unset or empty. A value that names no
// level is reported with one warning that lists the accepted names, and gives info.
LogLevel log_level_from_env();

// The threshold: lines below it are dropped. Read from the environment at first use, until
// set_log_level() sets it.
LogLevel log_level();
void set_log_level(LogLevel level);
bool log_enabled(LogLevel level);

// The rank in the prefix: the one set here (dist::init_process_group() sets it), else env RANK,
// else none (-1). set_log_rank(-1) goes back to the environment.
void set_log_rank(int rank);
int log_rank();

// Where lines go instead of stdout/stderr: the sink gets the level and the finished text
// (prefix on every line, ending in '\n'). An empty function restores the default. For tests,
// and for programs that want the lines elsewhere too.
using LogSink = std::function<void(LogLevel level, std::string_view text)>;
void set_log_sink(LogSink sink);

namespace detail {
// Note [Open progress line]
// A progress bar on a terminal is a line without its '\n': it is redrawn in place with '\r'. A
// log line written then would land on the bar's line, so the bar says that its line is open and
// the logger ends that line (a '\n' to stdout, where the bar is) before it writes. The next
// redraw of the bar starts on a fresh line below.
void set_progress_line_open(bool open);
// Formats `msg` (each of its lines prefixed) and writes it, without checking the threshold.
void log_write(LogLevel level, std::string_view msg);
}  // namespace detail

// Streams the arguments into one message (as LS_CHECK does) and logs it at `level`; the
// arguments are not formatted when the level is below the threshold.
template <typename... Args>
void log(LogLevel level, const Args&... args) {
  if (log_enabled(level)) detail::log_write(level, detail::str_cat(args...));
}

template <typename... Args>
void log_debug(const Args&... args) {
  log(LogLevel::kDebug, args...);
}
template <typename... Args>
void log_info(const Args&... args) {
  log(LogLevel::kInfo, args...);
}
template <typename... Args>
void log_warning(const Args&... args) {
  log(LogLevel::kWarning, args...);
}
template <typename... Args>
void log_error(const Args&... args) {
  log(LogLevel::kError, args...);
}

// The common case in a data-parallel program, where every rank runs the same code: debug and
// info lines only from rank 0 (or when the rank is unknown), so that N ranks do not print N
// copies. Warnings and errors print on every rank, since a problem of one rank must reach the
// user whichever rank has it.
template <typename... Args>
void log_rank0(LogLevel level, const Args&... args) {
  if (level >= LogLevel::kWarning || log_rank() <= 0) log(level, args...);
}

}  // namespace lockstep
