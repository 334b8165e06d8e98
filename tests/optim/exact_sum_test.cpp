// ExactSum: the sum does not depend on the order of the terms nor on how they are split, and it
// is the correctly rounded sum where that is known; clip_grad_norm's norm does not change when
// the gradient is cut into other tensors.
#include <algorithm>
#include <cmath>
#include <random>

#include "lockstep/optim/exact_sum.h"
#include "testing.h"

using namespace lockstep;
using lockstep::optim::ExactSum;

TEST(ExactSum, SumsThatLoseBitsInDoubleAreExact) {
  ExactSum s;
  s.add(1e16);
  for (int k = 0; k < 1000; ++k) s.add(1.0);  // each lost when added to 1e16 in double
  s.add(-1e16);
  EXPECT_EQ(s.value(), 1000.0);
  ExactSum tiny;
  tiny.add(std::ldexp(1.0, -1074));  // the smallest subnormal
  tiny.add(std::ldexp(1.0, -1074));
  EXPECT_EQ(tiny.value(), std::ldexp(1.0, -1073));
  ExactSum big;
  big.add(std::ldexp(1.0, 1000));
  big.add(std::ldexp(1.0, 1000));
  EXPECT_EQ(big.value(), std::ldexp(1.0, 1001));
}

TEST(ExactSum, OrderAndSplitDoNotChangeTheBits) {
  std::mt19937_64 gen(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<double> xs;
  for (int k = 0; k < 20000; ++k) xs.push_back(normal(gen) * std::pow(10.0, (k % 13) - 6));
  ExactSum a;
  for (double x : xs) a.add_square(x);
  std::shuffle(xs.begin(), xs.end(), gen);
  ExactSum parts[3];
  for (size_t k = 0; k < xs.size(); ++k) parts[k % 3].add_square(xs[k]);
  ExactSum b = ExactSum::from_limbs(parts[2].limbs());
  b.add(parts[0]);
  b.add(parts[1]);
  EXPECT_EQ(a.value(), b.value());
  double naive = 0;
  for (double x : xs) naive += x * x;
  EXPECT_NEAR(a.value(), naive, 1e-12 * naive);
}

TEST(ExactSum, DoubleSquaresKeepTheirLowBits) {
  const double v = 1.0 + std::ldexp(1.0, -30);  // v^2 = 1 + 2^-29 + 2^-60: the last is lost in hi
  ExactSum s;
  s.add_square(v);
  s.add(-1.0);
  s.add(-std::ldexp(1.0, -29));
  EXPECT_EQ(s.value(), std::ldexp(1.0, -60));
}

TEST(ExactSum, InfinityAndNaNArePassedOn) {
  ExactSum s;
  s.add(1.0);
  s.add_square(1e200);
  EXPECT_TRUE(std::isinf(s.value()));
  s.add(std::nan(""));
  EXPECT_TRUE(std::isnan(s.value()));
}

TEST(ClipGradNorm, TheNormIsTheSameBitsHoweverTheGradientIsCut) {
  Generator gen(3);
  const Tensor g = randn({1001}, gen);
  Tensor whole = zeros({1001}).requires_grad_(true);
  whole.set_grad(g.clone());
  const double a = optim::clip_grad_norm({whole}, 1e9);
  std::vector<Tensor> pieces;
  for (int64_t at : {0, 7, 500, 999}) {
    const int64_t n = (at == 0 ? 7 : at == 7 ? 493 : at == 500 ? 499 : 2);
    Tensor p = zeros({n}).requires_grad_(true);
    p.set_grad(g.narrow(0, at, n).clone());
    pieces.push_back(p);
  }
  std::reverse(pieces.begin(), pieces.end());
  EXPECT_EQ(optim::clip_grad_norm(pieces, 1e9), a);
  double naive = 0;
  for (double x : g.to_vector<double>()) naive += x * x;
  EXPECT_NEAR(a, std::sqrt(naive), 1e-12 * std::sqrt(naive));
}
