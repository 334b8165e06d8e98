// Reductions against naive references over dims, keepdim, layouts and dtypes; gradients.
#include <cmath>
#include <limits>

#include "testing.h"

using namespace lockstep;
using lockstep::testing::expect_error;
using lockstep::testing::expect_gradcheck;
using lockstep::testing::non_contiguous;
using lockstep::testing::unravel;
using lockstep::testing::values;

namespace {

// Naive reduction: groups elements by their index with reduced dims zeroed.
struct Groups {
  Dims keep_shape;                         // keepdim shape
  std::vector<std::vector<double>> items;  // per output, in flat order
};

Groups group(const Tensor& t, const std::vector<int64_t>& dims) {
  Groups g;
  g.keep_shape = t.shape();
  std::vector<bool> red(t.dim(), dims.empty());
  for (int64_t d : dims) red[d < 0 ? d + t.dim() : d] = true;
  for (int64_t d = 0; d < t.dim(); ++d)
    if (red[d]) g.keep_shape[d] = 1;
  g.items.resize(g.keep_shape.numel());
  for (int64_t i = 0; i < t.numel(); ++i) {
    Dims idx = unravel(i, t.shape());
    int64_t o = 0;
    for (int64_t d = 0; d < t.dim(); ++d) o = o * g.keep_shape[d] + (red[d] ? 0 : idx[d]);
    g.items[o].push_back(t.at(idx));
  }
  return g;
}

}  // namespace

TEST(Reduce, SumMeanVarMatchReference) {
  Generator gen(3);
  const std::vector<std::pair<Dims, std::vector<int64_t>>> cases = {
      {{7}, {0}},          {{1023}, {}},      {{3, 5}, {0}},       {{3, 5}, {1}},
      {{3, 5}, {-1, 0}},   {{2, 3, 4}, {1}},  {{2, 3, 4}, {0, 2}}, {{1, 7, 1}, {0, 2}},
      {{64, 1023}, {0}},   {{4, 1, 9}, {1}},
  };
  for (DType dt : {kFloat32, kFloat64}) {
    for (const auto& [shape, dims] : cases) {
      Tensor base = randn(shape, gen, dt);
      for (const Tensor& t : {base, non_contiguous(base)}) {
        for (bool keepdim : {false, true}) {
          Groups g = group(t, dims);
          Tensor s = sum(t, Dims(dims), keepdim);
          Tensor m = mean(t, Dims(dims), keepdim);
          Tensor v = var(t, Dims(dims), 1, keepdim);
          Dims want_shape;
          for (int64_t d = 0; d < t.dim(); ++d) {
            bool r = dims.empty();
            for (int64_t x : dims) r = r || (x < 0 ? x + t.dim() : x) == d;
            if (!r) want_shape.push_back(t.shape()[d]);
            else if (keepdim) want_shape.push_back(1);
          }
          ASSERT_EQ(s.shape(), want_shape) << shape << " keepdim " << keepdim;
          const auto vs = values(s), vm = values(m), vv = values(v);
          for (size_t o = 0; o < g.items.size(); ++o) {
            double ref = 0;
            for (double x : g.items[o]) ref += x;
            const double n = static_cast<double>(g.items[o].size());
            double ss = 0;
            for (double x : g.items[o]) ss += (x - ref / n) * (x - ref / n);
            const double tol = dt == kFloat32 ? 1e-4 : 1e-10;
            ASSERT_NEAR(vs[o], ref, tol * (1 + std::abs(ref)));
            ASSERT_NEAR(vm[o], ref / n, tol);
            if (n > 1) ASSERT_NEAR(vv[o], ss / (n - 1), tol * (1 + ss));
          }
        }
      }
    }
  }
}

TEST(Reduce, SumOverEverythingAndDtypes) {
  Tensor i = from_vector<int32_t>({1, 2, 3, 4}, {2, 2});
  EXPECT_EQ(sum(i).dtype(), kInt64);
  EXPECT_EQ(sum(i).item(), 10);
  EXPECT_EQ(values(sum(i, {0})), (std::vector<double>{4, 6}));
  EXPECT_EQ(sum(from_vector<uint8_t>({1, 0, 1}, {3}).to(kBool)).item(), 2);
  EXPECT_EQ(sum(zeros({0, 3})).item(), 0.0);
  EXPECT_EQ(values(sum(zeros({0, 3}), {0})), (std::vector<double>{0, 0, 0}));
  // f32 sums accumulate in double: a million 0.1f values sum accurately.
  EXPECT_NEAR(sum(full({1000000}, 0.1)).item(), 100000.0, 1.0);
  EXPECT_EQ(sum(full({300}, 1.0, kBFloat16)).item(), 300.0);
  EXPECT_EQ(sum(full({300}, 1.0, kBFloat16)).dtype(), kBFloat16);
  expect_error([] { (void)mean(zeros({2}, kInt64)); }, {"mean", "floating"});
  expect_error([] { (void)sum(zeros({2, 3}), {2}); }, {"dimension 2 is out of range"});
  expect_error([] { (void)sum(zeros({2, 3}), {1, -1}); }, {"appears twice"});
}

TEST(Reduce, MaxMinArgmax) {
  Tensor a = from_vector<float>({3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 9}, {3, 4});
  auto [mx, imx] = max(a, 1);
  EXPECT_EQ(values(mx), (std::vector<double>{4, 9, 9}));
  EXPECT_EQ(values(imx), (std::vector<double>{2, 1, 3}));
  auto [mn, imn] = min(a, 0, true);
  EXPECT_EQ(mn.shape(), (Dims{1, 4}));
  EXPECT_EQ(values(mn), (std::vector<double>{3, 1, 2, 1}));
  EXPECT_EQ(values(imn), (std::vector<double>{0, 0, 1, 0}));
  EXPECT_EQ(max(a).item(), 9);
  EXPECT_EQ(min(a).item(), 1);
  EXPECT_EQ(argmax(a).item(), 5);
  EXPECT_EQ(values(argmax(a.t(), 0)), (std::vector<double>{2, 1, 3}));
  EXPECT_EQ(values(argmin(a, 1)), (std::vector<double>{1, 2, 1}));  // first index wins ties
  Tensor n = from_vector<float>({1, NAN, 3}, {3});
  EXPECT_TRUE(std::isnan(max(n).item()));
  EXPECT_EQ(values(argmax(from_vector<int64_t>({-5, 7, 7}, {3}), 0)), (std::vector<double>{1}));
  // Odd sizes through the naive reference.
  Generator gen(4);
  for (Dims shape : {Dims{1, 1}, Dims{7, 3}, Dims{2, 1023}}) {
    Tensor t = randn(shape, gen);
    for (int64_t d : {0, 1}) {
      auto [v, idx] = max(t, d);
      Groups g = group(t, {d});
      for (size_t o = 0; o < g.items.size(); ++o) {
        auto it = std::max_element(g.items[o].begin(), g.items[o].end());
        ASSERT_EQ(values(v)[o], *it);
        ASSERT_EQ(values(idx)[o], it - g.items[o].begin());
      }
    }
  }
  expect_error([] { (void)max(zeros({0})); }, {"empty tensor"});
}

TEST(Reduce, GradientsMatchFiniteDifferences) {
  Generator gen(8);
  Tensor a = randn({3, 4, 5}, gen, kFloat64).requires_grad_();
  Tensor nc = randn({5, 4}, gen, kFloat64).t().detach().requires_grad_();
  using V = const std::vector<Tensor>&;
  expect_gradcheck([](V x) { return sum(x[0]); }, {a});
  expect_gradcheck([](V x) { return sum(x[0], {0, 2}); }, {a});
  expect_gradcheck([](V x) { return sum(x[0], {1}, true); }, {nc});
  expect_gradcheck([](V x) { return mean(x[0], {-1}); }, {a});
  expect_gradcheck([](V x) { return mean(x[0]); }, {nc});
  expect_gradcheck([](V x) { return var(x[0], {1}); }, {a});
  expect_gradcheck([](V x) { return var(x[0], {0}, 0, true); }, {nc});
  expect_gradcheck([](V x) { return max(x[0], 1).first; }, {a});
  expect_gradcheck([](V x) { return min(x[0], 0, true).first; }, {nc});
  expect_gradcheck([](V x) { return max(x[0]); }, {a});
}
