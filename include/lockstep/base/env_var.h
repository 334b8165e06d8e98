// Reading environment variables: the one place the library and its examples call getenv, and the
// one parser of their values (integers, numbers, flags), each checked against its range.
//
// Every function treats NAME= (empty) as unset and returns nullopt for it. A value that does not
// parse or is out of range is a lockstep::Error naming the variable, what it must hold and what
// it held: `LOCKSTEP_CPU_CACHE_MB='abc' is not an integer: expected one from 0 to 1048576 MiB`,
// `WORLD_SIZE=0 is out of range: expected from 1 to 16777216`. Names of the variables are in
// lockstep/base/worker_env.h; tests/lint/env_reads.sh keeps getenv out of every other file.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace lockstep {

// Where values come from: the process environment, or a map in tests.
using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;
// The process environment, as set (an empty value included).
std::optional<std::string> process_env(const std::string& name);

// The words an error adds to a variable's range, so that it says what the number counts and
// how to fix it: {.unit = "seconds", .note = "a week"} reads "from 0.001 to 604800 seconds (a
// week)".
struct EnvHelp {
  const char* unit = nullptr;
  const char* note = nullptr;
};

// The value, or nullopt when unset or empty.
std::optional<std::string> env_string(const std::string& name,
                                      const EnvLookup& lookup = process_env);

// A decimal integer in [min, max] (no sign but '-', no spaces, nothing after the digits).
std::optional<int64_t> env_int(const std::string& name, int64_t min, int64_t max,
                               const EnvHelp& help = {}, const EnvLookup& lookup = process_env);

// A finite decimal number in [min, max] ("300", "0.5", "1e3").
std::optional<double> env_double(const std::string& name, double min, double max,
                                 const EnvHelp& help = {}, const EnvLookup& lookup = process_env);

// A switch: 1, true, yes, on or 0, false, no, off (any case).
std::optional<bool> env_flag(const std::string& name, const EnvHelp& help = {},
                             const EnvLookup& lookup = process_env);

}  // namespace lockstep
