// Smoke test: the library links and a tensor round-trips.
#include <gtest/gtest.h>

#include "lockstep/lockstep.h"

using namespace lockstep;

TEST(Smoke, AddBackward) {
  Tensor a = full({2, 3}, 2.0).requires_grad_();
  Tensor b = full({3}, 3.0).requires_grad_();
  Tensor y = sum(mul(a, b));
  y.backward();
  EXPECT_DOUBLE_EQ(y.item(), 36.0);
  EXPECT_DOUBLE_EQ(a.grad().at({1, 2}), 3.0);
  EXPECT_DOUBLE_EQ(b.grad().at({0}), 4.0);
}
