// Philox generator and random tensors: reproducible, thread-count independent, right moments.
#include <cmath>

#include "testing.h"

using namespace lockstep;

TEST(Random, PhiloxKnownAnswer) {
  // Known-answer vectors of Philox4x32-10 from the Random123 distribution (kat_vectors):
  // counter = 0, key = 0 and counter = all ones, key = all ones.
  auto z = Generator::philox(0, 0);
  EXPECT_EQ(z[0], 0x6627e8d5u);
  EXPECT_EQ(z[1], 0xe169c58du);
  EXPECT_EQ(z[2], 0xbc57ac4cu);
  EXPECT_EQ(z[3], 0x9b00dbd8u);
}

TEST(Random, SameSeedSameValuesAndDrawsAdvance) {
  Generator g1(42), g2(42);
  Tensor a = rand({1000}, g1);
  Tensor b = rand({1000}, g2);
  EXPECT_TRUE(equal(a, b));
  Tensor c = rand({1000}, g1);
  EXPECT_FALSE(equal(a, c));
  Generator g3(43);
  EXPECT_FALSE(equal(a, rand({1000}, g3)));
}

TEST(Random, IndependentOfThreadCount) {
  const int saved = get_num_threads();
  set_num_threads(1);
  Generator g1(7);
  Tensor a = randn({300001}, g1);
  Tensor ai = randint(0, 1000, {300001}, g1);
  set_num_threads(2);
  Generator g2(7);
  Tensor b = randn({300001}, g2);
  Tensor bi = randint(0, 1000, {300001}, g2);
  set_num_threads(saved);
  EXPECT_TRUE(equal(a, b));
  EXPECT_TRUE(equal(ai, bi));
}

TEST(Random, UniformRangeAndMoments) {
  Generator g(1);
  Tensor u = rand({1000000}, g, kFloat32, -2.0, 3.0);
  auto v = u.to_vector<float>();
  double s = 0, ss = 0;
  for (float x : v) {
    ASSERT_GE(x, -2.0f);
    ASSERT_LT(x, 3.0f);
    s += x;
    ss += static_cast<double>(x) * x;
  }
  const double m = s / v.size(), var = ss / v.size() - m * m;
  EXPECT_NEAR(m, 0.5, 0.01);
  EXPECT_NEAR(var, 25.0 / 12.0, 0.02);
}

TEST(Random, NormalMoments) {
  Generator g(2);
  Tensor n = randn({1000000}, g, kFloat64, 1.0, 2.0);
  auto v = n.to_vector<double>();
  double s = 0, ss = 0;
  for (double x : v) {
    s += x;
    ss += x * x;
  }
  const double m = s / v.size(), var = ss / v.size() - m * m;
  EXPECT_NEAR(m, 1.0, 0.01);
  EXPECT_NEAR(var, 4.0, 0.03);
}

TEST(Random, RandintRangeCoversAllValues) {
  Generator g(3);
  Tensor r = randint(-3, 4, {10000}, g);
  std::vector<int> seen(7, 0);
  for (int64_t x : r.to_vector<int64_t>()) {
    ASSERT_GE(x, -3);
    ASSERT_LT(x, 4);
    seen[x + 3]++;
  }
  for (int c : seen) EXPECT_GT(c, 1200);
}
