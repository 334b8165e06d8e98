// lockstep::Error and LS_CHECK / LS_THROW: the message, then file:line.
#include "lockstep/base/error.h"

#include <gtest/gtest.h>

#include <string>

namespace lockstep {
namespace {

TEST(Error, CheckThrowsTheConcatenatedMessageWithFileAndLine) {
  const int expected = 3, found = 4;
  try {
    LS_CHECK(expected == found, "expected ", expected, " rows, found ", found);
    FAIL() << "LS_CHECK did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.message(), "expected 3 rows, found 4");
    const std::string what = e.what();
    EXPECT_EQ(what.rfind("expected 3 rows, found 4 (", 0), 0u) << what;
    EXPECT_NE(what.find("error_test.cpp:"), std::string::npos) << what;
  }
}

TEST(Error, CheckThatHoldsDoesNotEvaluateTheMessage) {
  int evaluated = 0;
  auto count = [&] {
    ++evaluated;
    return "x";
  };
  LS_CHECK(true, count());
  EXPECT_EQ(evaluated, 0);
}

TEST(Error, ThrowAlwaysThrowsAndIsAStdRuntimeError) {
  EXPECT_THROW(LS_THROW("no ", 1), std::runtime_error);
}

}  // namespace
}  // namespace lockstep
