// Philox generator and random tensors: reproducible, thread-count independent, right moments.
#include <cmath>

#include "testing.h"

using namespace lockstep;

TEST(Random, PhiloxKnownAnswer) {
  // The known-answer vector of Philox4x32-10 for counter = 0, key = 0 (Random123's
  // kat_vectors); our counter's upper two words are always zero, so that is the one we can check.
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

TEST(Random, NeighbouringWideDrawsShareNoBits) {
  // f64 rand and randint take 64 random bits per element; neighbours must not overlap.
  Generator g(9);
  Tensor u = rand({20000}, g, kFloat64);
  auto v = u.to_vector<double>();
  int same = 0;
  for (size_t i = 0; i + 1 < v.size(); ++i) {
    const uint64_t a = static_cast<uint64_t>(v[i] * 0x1.0p53), b = static_cast<uint64_t>(v[i + 1] * 0x1.0p53);
    same += (a & 0x1fffff) == (b >> 32);  // low 21 bits of one vs top 21 bits of the next
  }
  EXPECT_LT(same, 5);
  Tensor r = randint(0, int64_t{1} << 62, {20000}, g);
  auto w = r.to_vector<int64_t>();
  int shared = 0;
  for (size_t i = 0; i + 1 < w.size(); ++i)
    shared += (static_cast<uint64_t>(w[i]) & 0x3fffffffu) == (static_cast<uint64_t>(w[i + 1]) >> 32);
  EXPECT_LT(shared, 5);
}
