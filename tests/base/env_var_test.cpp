// The environment parser (lockstep/base/env_var.h): good values, unset and empty, and every bad
// value an error that names the variable, what it must hold and what it held.
#include "lockstep/base/env_var.h"

#include <cstdint>
#include <map>
#include <string>

#include "testing.h"

namespace lockstep {
namespace {

using testing::expect_error;

constexpr const char* kVar = "LOCKSTEP_SOME_VAR";

EnvLookup holding(const std::string& value) {
  return [value](const std::string& name) -> std::optional<std::string> {
    if (name == kVar) return value;
    return std::nullopt;
  };
}

const EnvLookup kUnset = [](const std::string&) -> std::optional<std::string> {
  return std::nullopt;
};

std::optional<int64_t> cache_mb(const std::string& value) {
  return env_int(kVar, 0, 1 << 20, {.unit = "MiB"}, holding(value));
}

TEST(EnvInt, ReadsDecimalIntegersWithinTheRangeBoundsIncluded) {
  EXPECT_EQ(cache_mb("0"), 0);
  EXPECT_EQ(cache_mb("512"), 512);
  EXPECT_EQ(cache_mb("1048576"), 1048576);
  EXPECT_EQ(env_int(kVar, -10, 10, {}, holding("-5")), -5);
  EXPECT_EQ(env_int(kVar, 0, INT64_MAX, {}, holding("9223372036854775807")), INT64_MAX);
}

TEST(EnvInt, UnsetAndEmptyAreBothUnset) {
  EXPECT_EQ(env_int(kVar, 0, 10, {}, kUnset), std::nullopt);
  EXPECT_EQ(env_int(kVar, 0, 10, {}, holding("")), std::nullopt);
}

TEST(EnvInt, TextIsNotAnIntegerAndTheErrorSaysWhatWasExpected) {
  expect_error([] { cache_mb("abc"); },
               {"LOCKSTEP_SOME_VAR='abc' is not an integer: expected one from 0 to 1048576 MiB"});
}

TEST(EnvInt, TrailingJunkSpacesSignsAndFractionsAreNotIntegers) {
  for (const char* bad : {"12abc", "12 ", " 12", "+12", "1.5", "0x10", "1e3", "-", "12MB"}) {
    expect_error([&] { cache_mb(bad); },
                 {std::string("LOCKSTEP_SOME_VAR='") + bad + "' is not an integer"});
  }
}

TEST(EnvInt, NegativeBelowTheRangeIsOutOfRange) {
  expect_error([] { cache_mb("-5"); },
               {"LOCKSTEP_SOME_VAR=-5 is out of range: expected from 0 to 1048576 MiB"});
}

TEST(EnvInt, AboveTheRangeIsOutOfRange) {
  expect_error([] { cache_mb("1048577"); }, {"LOCKSTEP_SOME_VAR=1048577 is out of range"});
}

// strtoull would have wrapped it or saturated it; it is reported as it was written.
TEST(EnvInt, TwentyDigitsAreOutOfRangeNotGarbled) {
  expect_error([] { cache_mb("99999999999999999999"); },
               {"LOCKSTEP_SOME_VAR=99999999999999999999 is out of range: expected from 0 to "
                "1048576"});
  expect_error([] { cache_mb("-99999999999999999999"); }, {"is out of range"});
}

TEST(EnvInt, TheNoteSaysWhyOrHowToFix) {
  expect_error([] { env_int(kVar, 1, 64, {.note = "a test switch"}, holding("65")); },
               {"LOCKSTEP_SOME_VAR=65 is out of range: expected from 1 to 64 (a test switch)"});
}

TEST(EnvDouble, ReadsDecimalNumbersWithFractionsAndExponents) {
  EXPECT_EQ(env_double(kVar, 0.001, 604800, {}, holding("300")), 300.0);
  EXPECT_EQ(env_double(kVar, 0.001, 604800, {}, holding("0.5")), 0.5);
  EXPECT_EQ(env_double(kVar, 0.001, 604800, {}, holding("1e3")), 1000.0);
  EXPECT_EQ(env_double(kVar, 0.001, 604800, {}, holding("")), std::nullopt);
  EXPECT_EQ(env_double(kVar, 0.001, 604800, {}, kUnset), std::nullopt);
}

TEST(EnvDouble, BadNumbersNameTheUnitAndTheRange) {
  const EnvHelp seconds{.unit = "seconds", .note = "a week"};
  for (const char* bad : {"30s", "abc", "nan", "inf", "-inf", " 3", "3 ", "1,5"}) {
    expect_error([&] { env_double(kVar, 0.001, 604800, seconds, holding(bad)); },
                 {std::string("LOCKSTEP_SOME_VAR='") + bad +
                  "' is not a number of seconds: expected one from 0.001 to 604800 seconds (a "
                  "week)"});
  }
  for (const char* bad : {"0", "-1", "604800.5", "1e999"}) {
    expect_error([&] { env_double(kVar, 0.001, 604800, seconds, holding(bad)); },
                 {std::string("LOCKSTEP_SOME_VAR=") + bad +
                  " is out of range: expected from 0.001 to 604800 seconds (a week)"});
  }
}

TEST(EnvFlag, AcceptsTheUsualSpellingsInAnyCase) {
  for (const char* on : {"1", "true", "TRUE", "yes", "Yes", "on", "ON"})
    EXPECT_EQ(env_flag(kVar, {}, holding(on)), true) << on;
  for (const char* off : {"0", "false", "False", "no", "NO", "off", "Off"})
    EXPECT_EQ(env_flag(kVar, {}, holding(off)), false) << off;
  EXPECT_EQ(env_flag(kVar, {}, holding("")), std::nullopt);
  EXPECT_EQ(env_flag(kVar, {}, kUnset), std::nullopt);
}

TEST(EnvFlag, AnythingElseIsAnErrorListingTheSpellings) {
  for (const char* bad : {"2", "y", "enable", "1 ", "truee"}) {
    expect_error([&] { env_flag(kVar, {}, holding(bad)); },
                 {std::string("LOCKSTEP_SOME_VAR='") + bad +
                  "' is not a switch: expected 1, true, yes, on or 0, false, no, off"});
  }
}

TEST(EnvString, EmptyIsUnsetAndAnythingElseIsKeptAsWritten) {
  EXPECT_EQ(env_string(kVar, holding(" a b ")), " a b ");
  EXPECT_EQ(env_string(kVar, holding("")), std::nullopt);
  EXPECT_EQ(env_string(kVar, kUnset), std::nullopt);
}

TEST(EnvString, TheProcessEnvironmentIsTheDefault) {
  ASSERT_EQ(::setenv(kVar, "17", 1), 0);
  EXPECT_EQ(env_string(kVar), "17");
  EXPECT_EQ(env_int(kVar, 0, 100), 17);
  ASSERT_EQ(::setenv(kVar, "", 1), 0);
  EXPECT_EQ(process_env(kVar), "");  // set, but empty: unset for the parsers
  EXPECT_EQ(env_int(kVar, 0, 100), std::nullopt);
  ASSERT_EQ(::unsetenv(kVar), 0);
  EXPECT_EQ(process_env(kVar), std::nullopt);
}

}  // namespace
}  // namespace lockstep
