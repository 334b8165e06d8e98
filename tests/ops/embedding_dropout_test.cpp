// embedding (lookup, index checks, scatter-add backward) and dropout (mask statistics, scale,
// reproducibility across thread counts, gradients, edge probabilities).
#include <cmath>
#include <string>
#include <vector>

#include "testing.h"

using namespace lockstep;
using lockstep::testing::expect_error;
using lockstep::testing::expect_gradcheck;
using lockstep::testing::non_contiguous;
using lockstep::testing::values;

// ---- embedding ----

TEST(Embedding, ValuesAnyIndexShapeAndLayout) {
  Generator gen(51);
  for (DType dt : {kFloat32, kFloat64, DType::bf16}) {
    for (auto [num, dim] : std::vector<std::pair<int64_t, int64_t>>{{10, 7}, {1, 1}, {5, 1023}}) {
      Tensor w = randn({num, dim}, gen).to(dt);
      std::vector<Tensor> weights = {w, non_contiguous(w)};
      Tensor idx = randint(0, num, {3, 4}, gen);
      std::vector<int64_t> iv = idx.to_vector<int64_t>();
      std::vector<double> wv = values(w);
      for (const Tensor& wi : weights) {
        for (DType it : {kInt64, kInt32}) {
          Tensor out = embedding(wi, idx.to(it));
          ASSERT_EQ(out.shape(), (Dims{3, 4, dim}));
          EXPECT_EQ(out.dtype(), dt);
          std::vector<double> got = out.to_vector<double>();
          for (size_t i = 0; i < iv.size(); ++i)
            for (int64_t j = 0; j < dim; ++j)
              ASSERT_EQ(got[i * dim + j], wv[iv[i] * dim + j]) << i << "," << j;
        }
      }
    }
  }
  // A 0-dim index selects one row: shape (dim).
  Tensor w = randn({4, 3}, gen, kFloat64);
  Tensor row = embedding(w, full({}, 2.0, kInt64));
  ASSERT_EQ(row.shape(), (Dims{3}));
  for (int64_t j = 0; j < 3; ++j) EXPECT_EQ(row.at({j}), w.at({2, j}));
}

TEST(Embedding, BackwardScatterAddsRepeatedIndices) {
  Generator gen(52);
  const int64_t num = 6, dim = 5;
  Tensor w = randn({num, dim}, gen, kFloat64).requires_grad_();
  Tensor idx = from_vector<int64_t>({1, 4, 1, 1, 0, 4, 5}, {7});
  Tensor g = randn({7, dim}, gen, kFloat64);
  sum(mul(embedding(w, idx), g)).backward();
  std::vector<double> want(num * dim, 0.0);
  std::vector<int64_t> iv = idx.to_vector<int64_t>();
  for (size_t i = 0; i < iv.size(); ++i)
    for (int64_t j = 0; j < dim; ++j) want[iv[i] * dim + j] += g.at({static_cast<int64_t>(i), j});
  std::vector<double> got = w.grad().to_vector<double>();
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-12) << i;
}

TEST(Embedding, BackwardManyIndicesWideRows) {
  // Enough work that the backward splits the columns across threads.
  Generator gen(53);
  const int64_t num = 7, dim = 1023, count = 300;
  Tensor w = randn({num, dim}, gen).requires_grad_();
  Tensor idx = randint(0, num, {count}, gen);
  Tensor g = randn({count, dim}, gen);
  embedding(w, idx).backward(g);
  std::vector<int64_t> iv = idx.to_vector<int64_t>();
  std::vector<double> gv = g.to_vector<double>(), want(num * dim, 0.0);
  for (int64_t i = 0; i < count; ++i)
    for (int64_t j = 0; j < dim; ++j) want[iv[i] * dim + j] += gv[i * dim + j];
  std::vector<double> got = w.grad().to_vector<double>();
  for (size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-4) << i;
}

TEST(Embedding, Gradcheck) {
  Generator gen(54);
  Tensor idx = from_vector<int64_t>({0, 2, 2, 3, 0, 1}, {2, 3});
  auto fn = [idx](const std::vector<Tensor>& in) { return embedding(in[0], idx); };
  expect_gradcheck(fn, {randn({4, 3}, gen, kFloat64).requires_grad_()});
  expect_gradcheck(fn, {randn({3, 4}, gen, kFloat64).t().detach().requires_grad_()});
}

TEST(Embedding, Errors) {
  expect_error(
      [] {
        embedding(zeros({10, 3}), from_vector<int64_t>({2, 10}, {2}));
      },
      {"embedding", "index 10", "10 embeddings"});
  expect_error(
      [] {
        embedding(zeros({10, 3}), from_vector<int64_t>({-1}, {1}));
      },
      {"embedding", "index -1"});
  expect_error([] { embedding(zeros({10, 3}), zeros({2})); }, {"embedding", "f32"});
  expect_error([] { embedding(zeros({10}), zeros({2}, kInt64)); }, {"embedding", "[10]"});
}

// ---- dropout ----

TEST(Dropout, IdentityWhenOffOrZero) {
  Generator gen(61);
  Tensor x = randn({4, 5}, gen);
  EXPECT_TRUE(dropout(x, 0.5, false, gen).is_same(x));
  EXPECT_TRUE(dropout(x, 0.0, true, gen).is_same(x));
}

TEST(Dropout, MaskStatisticsAndScale) {
  Generator gen(62);
  for (DType dt : {kFloat32, kFloat64, DType::bf16}) {
    for (double p : {0.1, 0.5, 0.9}) {
      const int64_t n = 100003;
      Tensor x = rand({n}, gen, dt, 1.0, 2.0);
      Tensor y = dropout(x, p, true, gen);
      EXPECT_EQ(y.dtype(), dt);
      std::vector<double> xv = x.to_vector<double>(), yv = y.to_vector<double>();
      int64_t zeros_seen = 0;
      for (int64_t i = 0; i < n; ++i) {
        if (yv[i] == 0) {
          ++zeros_seen;
        } else {
          ASSERT_NEAR(yv[i], xv[i] / (1 - p), (dt == DType::bf16 ? 1e-2 : 1e-6) * yv[i]) << i;
        }
      }
      // Binomial(n, p): 5 standard deviations.
      const double sd = std::sqrt(n * p * (1 - p));
      EXPECT_NEAR(static_cast<double>(zeros_seen), n * p, 5 * sd) << "p " << p;
    }
  }
}

TEST(Dropout, OddSizesAndStridedInputs) {
  Generator gen(68);
  for (const Dims& shape : {Dims{1}, Dims{7}, Dims{3, 1023}}) {
    Tensor base = randn(shape, gen, kFloat64);
    std::vector<Tensor> inputs = {base, non_contiguous(base)};
    if (shape.size() == 2) inputs.push_back(randn({3, 2046}, gen, kFloat64).slice(1, 0, 2046, 2));
    for (const Tensor& x : inputs) {
      Tensor y = dropout(x, 0.25, true, gen);
      ASSERT_EQ(y.shape(), shape);
      std::vector<double> xv = values(x), yv = values(y);
      for (size_t i = 0; i < xv.size(); ++i) {
        if (yv[i] != 0.0) ASSERT_NEAR(yv[i], xv[i] / 0.75, 1e-12) << shape << " " << i;
      }
    }
  }
}

TEST(Dropout, ProbabilityOneGivesZerosAndZeroGradient) {
  Generator gen(63);
  Tensor x = randn({3, 7}, gen, kFloat64).requires_grad_();
  Tensor y = dropout(x, 1.0, true, gen);
  for (double v : y.to_vector<double>()) EXPECT_EQ(v, 0.0);
  sum(y).backward();
  for (double v : x.grad().to_vector<double>()) EXPECT_EQ(v, 0.0);
}

TEST(Dropout, ReproducibleAcrossThreadCountsAndLayouts) {
  const int prev = get_num_threads();
  Generator data_gen(640);
  Tensor x = rand({300, 257}, data_gen, kFloat32, 1.0, 2.0);
  std::vector<std::vector<double>> runs;
  for (int threads : {1, 2, 4}) {
    set_num_threads(threads);
    Generator gen(64);
    runs.push_back(dropout(x, 0.3, true, gen).to_vector<double>());
  }
  set_num_threads(prev);
  EXPECT_EQ(runs[0], runs[1]);
  EXPECT_EQ(runs[0], runs[2]);
  // The mask follows logical (row-major) order, so a transposed input with the same values
  // gives the same output.
  Generator gen(64);
  Tensor xt = non_contiguous(x);
  EXPECT_EQ(dropout(xt, 0.3, true, gen).to_vector<double>(), runs[0]);
  // A generator advances: the next draw differs.
  EXPECT_NE(dropout(x, 0.3, true, gen).to_vector<double>(), runs[0]);
}

TEST(Dropout, GradientIsMaskTimesScale) {
  Generator gen(65);
  Tensor x = randn({50, 40}, gen, kFloat64).requires_grad_();
  Tensor y = dropout(x, 0.4, true, gen);
  y.backward(ones_like(y));
  std::vector<double> xv = values(x), yv = values(y), gv = x.grad().to_vector<double>();
  for (size_t i = 0; i < xv.size(); ++i) {
    const double want = yv[i] == 0 ? 0.0 : 1.0 / 0.6;
    ASSERT_NEAR(gv[i], want, 1e-12) << i;
  }
  // Finite differences with a generator reset before every call, so the mask is fixed.
  auto fn = [](const std::vector<Tensor>& in) {
    Generator g(66);
    return dropout(in[0], 0.5, true, g);
  };
  expect_gradcheck(fn, {randn({6, 5}, gen, kFloat64).requires_grad_()});
  expect_gradcheck(fn, {randn({5, 6}, gen, kFloat64).t().detach().requires_grad_()});
}

TEST(Dropout, Errors) {
  Generator gen(67);
  expect_error([&] { dropout(zeros({3}), -0.1, true, gen); }, {"dropout", "-0.1", "[0, 1]"});
  expect_error([&] { dropout(zeros({3}), 1.5, true, gen); }, {"dropout", "1.5"});
  expect_error([&] { dropout(zeros({3}, kInt64), 0.5, true, gen); }, {"dropout", "i64"});
}
