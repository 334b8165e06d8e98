// Environment variables read and parsed, each value checked against its range.
#include "lockstep/base/env_var.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <sstream>

#include "lockstep/base/error.h"

namespace lockstep {

namespace {

// " MiB (why)": what follows a range in an error.
std::string help_text(const EnvHelp& help) {
  std::string s;
  if (help.unit) s = std::string(" ") + help.unit;
  if (help.note) s += std::string(" (") + help.note + ")";
  return s;
}

template <typename T>
std::string range_text(T min, T max, const EnvHelp& help) {
  std::ostringstream os;
  os.precision(15);  // 1048576.0 as written, not 1.04858e+06
  os << "from " << min << " to " << max << help_text(help);
  return os.str();
}

// Parses all of `v` as a T; out of range (a 20-digit integer) is told apart from no number.
template <typename T>
std::optional<T> parse_all(const std::string& v, bool& overflow) {
  T x{};
  const char* end = v.data() + v.size();
  const auto [p, ec] = std::from_chars(v.data(), end, x);
  overflow = ec == std::errc::result_out_of_range && p == end;
  if (ec != std::errc() || p != end) return std::nullopt;
  return x;
}

}  // namespace

std::optional<std::string> process_env(const std::string& name) {
  // Copied at once: a later setenv may invalidate getenv's pointer.
  const char* v = std::getenv(name.c_str());
  if (v == nullptr) return std::nullopt;
  return std::string(v);
}

std::optional<std::string> env_string(const std::string& name, const EnvLookup& lookup) {
  auto v = lookup(name);
  if (v && v->empty()) return std::nullopt;  // NAME= counts as unset
  return v;
}

std::optional<int64_t> env_int(const std::string& name, int64_t min, int64_t max,
                               const EnvHelp& help, const EnvLookup& lookup) {
  const auto v = env_string(name, lookup);
  if (!v) return std::nullopt;
  bool overflow = false;
  const auto x = parse_all<int64_t>(*v, overflow);
  LS_CHECK(x || overflow, name, "='", *v, "' is not an integer: expected one ",
           range_text(min, max, help));
  LS_CHECK(x && *x >= min && *x <= max, name, "=", *v, " is out of range: expected ",
           range_text(min, max, help));
  return x;
}

std::optional<double> env_double(const std::string& name, double min, double max,
                                 const EnvHelp& help, const EnvLookup& lookup) {
  const auto v = env_string(name, lookup);
  if (!v) return std::nullopt;
  bool overflow = false;
  const auto x = parse_all<double>(*v, overflow);
  // from_chars takes "inf" and "nan"; neither is a value any variable may hold.
  LS_CHECK((x && std::isfinite(*x)) || overflow, name, "='", *v, "' is not a number",
           help.unit ? std::string(" of ") + help.unit : std::string(), ": expected one ",
           range_text(min, max, help));
  LS_CHECK(x && *x >= min && *x <= max, name, "=", *v, " is out of range: expected ",
           range_text(min, max, help));
  return x;
}

std::optional<bool> env_flag(const std::string& name, const EnvHelp& help,
                             const EnvLookup& lookup) {
  const auto v = env_string(name, lookup);
  if (!v) return std::nullopt;
  std::string lower;
  for (const char c : *v) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (lower == "1" || lower == "true" || lower == "yes" || lower == "on") return true;
  if (lower == "0" || lower == "false" || lower == "no" || lower == "off") return false;
  LS_THROW(name, "='", *v, "' is not a switch: expected 1, true, yes, on or 0, false, no, off",
           help_text(help));
}

}  // namespace lockstep
