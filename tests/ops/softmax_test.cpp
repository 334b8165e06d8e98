// softmax and log_softmax against a naive per-row reference: every dim, strided inputs, odd
// sizes, huge logits, 16-bit floats; gradients by finite differences; errors.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "testing.h"

using namespace lockstep;
using lockstep::testing::expect_near_all;
using lockstep::testing::expect_error;
using lockstep::testing::expect_gradcheck;
using lockstep::testing::non_contiguous;
using lockstep::testing::values;

namespace {

// Softmax along `dim` of row-major values with `shape`, in plain loops.
std::vector<double> naive_softmax(const std::vector<double>& x, const Dims& shape, int64_t dim,
                                  bool log) {
  int64_t inner = 1;
  for (int64_t d = dim + 1; d < shape.size(); ++d) inner *= shape[d];
  const int64_t n = shape[dim], outer = shape.numel() / std::max<int64_t>(n * inner, 1);
  std::vector<double> y(x.size());
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t i = 0; i < inner; ++i) {
      auto at = [&](int64_t j) { return o * n * inner + j * inner + i; };
      double mx = -INFINITY;
      for (int64_t j = 0; j < n; ++j) mx = std::max(mx, x[at(j)]);
      double s = 0;
      for (int64_t j = 0; j < n; ++j) s += std::exp(x[at(j)] - mx);
      for (int64_t j = 0; j < n; ++j)
        y[at(j)] = log ? x[at(j)] - mx - std::log(s) : std::exp(x[at(j)] - mx) / s;
    }
  return y;
}

}  // namespace

TEST(Softmax, ValuesEveryDimOddSizes) {
  Generator gen(21);
  const std::vector<Dims> shapes = {{7}, {1, 1}, {3, 1023}, {1023, 3}, {2, 7, 5}, {4, 1, 6}};
  for (DType dt : {kFloat32, kFloat64}) {
    const double tol = dt == kFloat64 ? 1e-12 : 1e-5;
    for (const Dims& shape : shapes) {
      Tensor x = randn(shape, gen, dt, 0.0, 3.0);
      for (int64_t d = -1; d < shape.size(); ++d) {
        const int64_t dim = d < 0 ? shape.size() - 1 : d;
        const std::string what = shape.str() + " dim " + std::to_string(d);
        Tensor s = softmax(x, d), ls = log_softmax(x, d);
        ASSERT_EQ(s.shape(), shape);
        EXPECT_EQ(s.dtype(), dt);
        expect_near_all(s, naive_softmax(values(x), shape, dim, false), tol, "softmax " + what);
        expect_near_all(ls, naive_softmax(values(x), shape, dim, true), tol, "log_softmax " + what);
      }
    }
  }
}

TEST(Softmax, NonContiguousInputs) {
  Generator gen(22);
  Tensor base = randn({6, 9}, gen, kFloat64);
  std::vector<Tensor> views = {non_contiguous(base), base.slice(1, 1, 9, 2),
                               randn({5, 4, 3}, gen, kFloat64).permute({2, 0, 1}),
                               randn({1, 7}, gen, kFloat64).expand({4, 7})};
  for (size_t v = 0; v < views.size(); ++v) {
    const Tensor& x = views[v];
    for (int64_t d = 0; d < x.dim(); ++d) {
      const std::string what = "view " + std::to_string(v) + " dim " + std::to_string(d);
      expect_near_all(softmax(x, d), naive_softmax(values(x), x.shape(), d, false), 1e-12, what);
      expect_near_all(log_softmax(x, d), naive_softmax(values(x), x.shape(), d, true), 1e-12, what);
    }
  }
}

TEST(Softmax, StableForHugeLogits) {
  Tensor x = from_vector<float>({1000.f, 1001.f, 1002.f, -1000.f}, {1, 4});
  std::vector<double> want = naive_softmax(values(x), x.shape(), 1, false);
  Tensor s = softmax(x, 1), ls = log_softmax(x, 1);
  for (int64_t i = 0; i < 4; ++i) {
    EXPECT_TRUE(std::isfinite(ls.at({0, i})));
    EXPECT_NEAR(s.at({0, i}), want[i], 1e-6);
  }
  EXPECT_NEAR(ls.at({0, 2}), -std::log(1 + std::exp(-1.0) + std::exp(-2.0)), 1e-5);
  EXPECT_NEAR(ls.at({0, 3}), -2002.0 - std::log(1 + std::exp(-1.0) + std::exp(-2.0)), 1e-2);
}

TEST(Softmax, ZeroDimTensor) {
  Tensor x = scalar_tensor(3.0, kFloat64);
  EXPECT_DOUBLE_EQ(softmax(x, 0).item(), 1.0);
  EXPECT_DOUBLE_EQ(log_softmax(x, -1).item(), 0.0);
}

TEST(Softmax, HalfTypes) {
  Generator gen(23);
  for (DType dt : {DType::bf16, DType::f16}) {
    Tensor x = randn({3, 17}, gen).to(dt);
    Tensor s = softmax(x, 1), ls = log_softmax(x, 1);
    EXPECT_EQ(s.dtype(), dt);
    expect_near_all(s, naive_softmax(values(x), x.shape(), 1, false), 1e-2, "softmax");
    expect_near_all(ls, naive_softmax(values(x), x.shape(), 1, true), 2e-2, "log_softmax");
  }
}

TEST(Softmax, Gradcheck) {
  Generator gen(24);
  auto leaf = [&](const Dims& s) { return randn(s, gen, kFloat64).requires_grad_(); };
  for (bool log : {false, true}) {
    for (int64_t dim : {0, 1, -1}) {
      auto fn = [log, dim](const std::vector<Tensor>& in) {
        return log ? log_softmax(in[0], dim) : softmax(in[0], dim);
      };
      expect_gradcheck(fn, {leaf({3, 5})});
      expect_gradcheck(fn, {leaf({2, 4, 3})});
      expect_gradcheck(fn, {randn({5, 3}, gen, kFloat64).t().detach().requires_grad_()});
    }
  }
  // The upstream gradient can be strided (here expanded by a broadcast multiply).
  auto chained = [](const std::vector<Tensor>& in) { return mul(softmax(in[0], 1), in[1]); };
  expect_gradcheck(chained, {leaf({4, 6}), leaf({6})});
}

TEST(Softmax, GradientValuesAgainstFormula) {
  // d/dx_j sum_i w_i y_i = y_j (w_j - sum_i w_i y_i).
  Generator gen(25);
  Tensor x = randn({1, 7}, gen, kFloat64).requires_grad_();
  Tensor w = randn({1, 7}, gen, kFloat64);
  Tensor y = softmax(x, 1);
  sum(mul(y, w)).backward();
  std::vector<double> yv = values(y), wv = values(w);
  double dot = 0;
  for (int i = 0; i < 7; ++i) dot += yv[i] * wv[i];
  for (int64_t j = 0; j < 7; ++j) EXPECT_NEAR(x.grad().at({0, j}), yv[j] * (wv[j] - dot), 1e-12);
}

TEST(Softmax, Errors) {
  expect_error([] { softmax(zeros({2, 3}), 2); }, {"softmax", "dimension 2", "out of range"});
  expect_error([] { log_softmax(zeros({2, 3}), -3); }, {"log_softmax", "-3"});
  expect_error([] { softmax(zeros({2, 3}, kInt64), 1); }, {"softmax", "i64"});
}
