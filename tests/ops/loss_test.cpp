// cross_entropy (reductions, ignore_index, label smoothing, (N, C, d...) inputs) and mse_loss
// against naive references; gradients by formula and finite differences; errors.
#include <cmath>
#include <string>
#include <vector>

#include "lockstep/tensor/cuda.h"
#include "testing.h"

using namespace lockstep;
using lockstep::testing::expect_error;
using lockstep::testing::expect_gradcheck;
using lockstep::testing::non_contiguous;
using lockstep::testing::values;

namespace {

// Per-position losses of logits (N, C, D...) flattened to (N, C, D) and targets (N, D), PyTorch
// semantics: (1 - e) * nll + e * mean over classes of -log p_c, zero where ignored.
std::vector<double> naive_ce_rows(const std::vector<double>& x, const std::vector<int64_t>& t,
                                  int64_t n, int64_t c, int64_t d, int64_t ignore, double eps) {
  std::vector<double> loss(static_cast<size_t>(n * d), 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t p = 0; p < d; ++p) {
      const int64_t tgt = t[i * d + p];
      if (tgt == ignore) continue;
      auto at = [&](int64_t k) { return x[(i * c + k) * d + p]; };
      double mx = -INFINITY;
      for (int64_t k = 0; k < c; ++k) mx = std::max(mx, at(k));
      double s = 0;
      for (int64_t k = 0; k < c; ++k) s += std::exp(at(k) - mx);
      const double lse = mx + std::log(s);
      double smooth = 0;
      for (int64_t k = 0; k < c; ++k) smooth += lse - at(k);
      loss[i * d + p] = (1 - eps) * (lse - at(tgt)) + eps * smooth / static_cast<double>(c);
    }
  return loss;
}

double reduce(const std::vector<double>& loss, const std::vector<int64_t>& t, int64_t ignore,
              Reduction r) {
  double s = 0;
  int64_t count = 0;
  for (size_t i = 0; i < loss.size(); ++i) {
    s += loss[i];
    count += t[i] != ignore;
  }
  return r == Reduction::mean ? s / static_cast<double>(count) : s;
}

std::vector<int64_t> ivalues(const Tensor& t) { return t.to_vector<int64_t>(); }

struct CeCase {
  Dims shape;  // logits
  double eps;
  bool with_ignored;
};

// Random targets for logits of `shape`, some set to ignore_index when asked.
Tensor make_targets(const Dims& shape, Generator& gen, int64_t ignore, bool with_ignored) {
  Dims ts = shape;
  ts.erase(1);
  Tensor t = randint(0, shape[1], ts, gen);
  if (with_ignored) {
    for (int64_t i = 0; i < t.numel(); i += 3) t.set_at(lockstep::testing::unravel(i, ts), ignore);
  }
  return t;
}

}  // namespace

TEST(CrossEntropy, ValuesAllReductionsIgnoreAndSmoothing) {
  Generator gen(31);
  const std::vector<CeCase> cases = {
      {{7, 5}, 0.0, false},    {{7, 5}, 0.0, true},    {{7, 5}, 0.1, false},
      {{7, 5}, 0.25, true},    {{1, 1}, 0.0, false},   {{3, 1023}, 0.1, true},
      {{1023, 3}, 0.0, true},  {{4, 5, 7}, 0.0, true}, {{2, 3, 4, 5}, 0.2, true},
      {{3, 1, 2}, 0.0, false},
  };
  for (DType dt : {kFloat32, kFloat64}) {
    const double tol = dt == kFloat64 ? 1e-11 : 2e-5;
    for (const CeCase& cc : cases) {
      for (int64_t ignore : {int64_t{-100}, int64_t{1}}) {
        Tensor x = randn(cc.shape, gen, dt, 0.0, 2.0);
        Tensor t = make_targets(cc.shape, gen, ignore, cc.with_ignored);
        const int64_t n = cc.shape[0], c = cc.shape[1], d = x.numel() / std::max<int64_t>(n * c, 1);
        std::vector<int64_t> tv = ivalues(t);
        std::vector<double> rows = naive_ce_rows(values(x), tv, n, c, d, ignore, cc.eps);
        const std::string what = cc.shape.str() + " eps " + std::to_string(cc.eps) + " ignore " +
                                 std::to_string(ignore) + " " + std::string(dtype_name(dt));
        CrossEntropyOptions o;
        o.ignore_index = ignore;
        o.label_smoothing = cc.eps;
        o.reduction = Reduction::none;
        Tensor none = cross_entropy(x, t, o);
        ASSERT_EQ(none.shape(), t.shape()) << what;
        EXPECT_EQ(none.dtype(), dt);
        std::vector<double> got = none.to_vector<double>();
        for (size_t i = 0; i < rows.size(); ++i)
          ASSERT_NEAR(got[i], rows[i], tol * (1 + std::abs(rows[i]))) << what << " row " << i;
        for (Reduction r : {Reduction::mean, Reduction::sum}) {
          o.reduction = r;
          const double want = reduce(rows, tv, ignore, r);
          Tensor l = cross_entropy(x, t, o);
          EXPECT_EQ(l.dim(), 0);
          if (std::isnan(want)) {
            EXPECT_TRUE(std::isnan(l.item())) << what;
          } else {
            EXPECT_NEAR(l.item(), want, tol * (1 + std::abs(want))) << what;
          }
        }
      }
    }
  }
}

TEST(CrossEntropy, NonContiguousLogitsAndInt32Targets) {
  Generator gen(32);
  Tensor x = randn({6, 5}, gen, kFloat64);
  Tensor t = randint(0, 5, {6}, gen);
  std::vector<int64_t> tv = ivalues(t);
  const double want =
      reduce(naive_ce_rows(values(x), tv, 6, 5, 1, -100, 0.0), tv, -100, Reduction::mean);
  EXPECT_NEAR(cross_entropy(non_contiguous(x), t).item(), want, 1e-12);
  EXPECT_NEAR(cross_entropy(x, t.to(kInt32)).item(), want, 1e-12);
  // A class-strided (N, C, d) view: logits permuted from (N, d, C).
  Tensor xp = randn({3, 4, 5}, gen, kFloat64).permute({0, 2, 1});  // (3, 5, 4)
  Tensor tp = randint(0, 5, {3, 4}, gen);
  std::vector<int64_t> tpv = ivalues(tp);
  const double want_p =
      reduce(naive_ce_rows(values(xp), tpv, 3, 5, 4, -100, 0.1), tpv, -100, Reduction::sum);
  CrossEntropyOptions o;
  o.reduction = Reduction::sum;
  o.label_smoothing = 0.1;
  EXPECT_NEAR(cross_entropy(xp, tp, o).item(), want_p, 1e-11);
}

TEST(CrossEntropy, AllIgnoredMeanIsNaN) {
  Tensor x = zeros({2, 3}, kFloat64);
  Tensor t = full({2}, -100.0, kInt64);
  EXPECT_TRUE(std::isnan(cross_entropy(x, t).item()));
  CrossEntropyOptions o;
  o.reduction = Reduction::sum;
  EXPECT_EQ(cross_entropy(x, t, o).item(), 0.0);
}

TEST(CrossEntropy, GradientMatchesSoftmaxMinusSmoothedOneHot) {
  // For mean reduction: dx[i, c] = (softmax(x_i)_c - (1 - e) [c == t_i] - e / C) / count, and 0
  // on ignored rows.
  Generator gen(33);
  const int64_t n = 5, c = 4;
  const double eps = 0.2;
  Tensor x = randn({n, c}, gen, kFloat64).requires_grad_();
  Tensor t = from_vector<int64_t>({0, 3, -100, 2, 1}, {n});
  CrossEntropyOptions o;
  o.label_smoothing = eps;
  cross_entropy(x, t, o).backward();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t ti = static_cast<int64_t>(t.at({i}));
    double mx = -INFINITY, s = 0;
    for (int64_t k = 0; k < c; ++k) mx = std::max(mx, x.at({i, k}));
    for (int64_t k = 0; k < c; ++k) s += std::exp(x.at({i, k}) - mx);
    for (int64_t k = 0; k < c; ++k) {
      const double p = std::exp(x.at({i, k}) - mx) / s;
      const double want = ti == -100 ? 0.0 : (p - (1 - eps) * (k == ti) - eps / c) / 4.0;
      EXPECT_NEAR(x.grad().at({i, k}), want, 1e-12) << i << "," << k;
    }
  }
}

// Note [Cross-entropy exp]: contiguous f32 rows take 8-lane exps. Against the f64 formulas at a
// vocabulary of 256 (train_gpt's) and 37 (4 vectors and a tail of 5), with label smoothing and an
// ignored row; a -inf logit keeps probability and gradient exactly 0; a NaN logit makes its
// row's loss and gradient NaN and no other row's.
TEST(CrossEntropy, Float32RowsMatchTheDoubleFormulas) {
  for (int64_t c : {256, 37}) {
    Generator gen(static_cast<uint64_t>(c));
    const int64_t n = 6;
    const double eps = 0.1;
    const Tensor t = from_vector<int64_t>({0, 3, -100, c - 1, 1, 7}, {n});
    std::vector<float> xv = mul(randn({n, c}, gen), 3.0).to_vector<float>();
    // Row i's log-sum-exp in f64.
    auto lse = [&](int64_t i) {
      double mx = -INFINITY, s = 0;
      for (int64_t k = 0; k < c; ++k) mx = std::max(mx, static_cast<double>(xv[i * c + k]));
      for (int64_t k = 0; k < c; ++k) s += std::exp(xv[i * c + k] - mx);
      return mx + std::log(s);
    };

    // Per-row losses and the mean's gradient, with a -inf logit in row 1.
    xv[1 * c + 5] = -INFINITY;
    Tensor x = from_vector<float>(xv, {n, c}).requires_grad_();
    CrossEntropyOptions o;
    o.label_smoothing = eps;
    cross_entropy(x, t, o).backward();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t ti = static_cast<int64_t>(t.at({i}));
      const double l = lse(i);
      for (int64_t k = 0; k < c; ++k) {
        const double p = std::exp(xv[i * c + k] - l);
        const double want = ti == -100 ? 0.0 : (p - (1 - eps) * (k == ti) - eps / c) / 5.0;
        ASSERT_NEAR(x.grad().at({i, k}), want, 1e-8 + 2e-6 * std::abs(want))
            << "C " << c << " (" << i << ", " << k << ")";
      }
    }
    // The -inf logit's probability is exactly 0: without smoothing its gradient is exactly 0
    // (exp8 alone would give e^-87 there).
    Tensor x0 = from_vector<float>(xv, {n, c}).requires_grad_();
    cross_entropy(x0, t).backward();
    EXPECT_EQ(x0.grad().at({1, 5}), 0.0) << "C " << c;
    EXPECT_GT(std::abs(x0.grad().at({1, 6})), 0.0) << "C " << c;

    // Losses per row (no -inf now: it makes the smoothing term infinite), and a NaN in row 4.
    xv[1 * c + 5] = 0.5f;
    xv[4 * c + 2] = NAN;
    Tensor xn = from_vector<float>(xv, {n, c}).requires_grad_();
    CrossEntropyOptions none = o;
    none.reduction = Reduction::none;
    Tensor per_row = cross_entropy(xn, t, none);
    sum(per_row).backward();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t ti = static_cast<int64_t>(t.at({i}));
      if (ti == -100) continue;
      EXPECT_EQ(std::isnan(per_row.at({i})), i == 4) << "C " << c << " row " << i;
      for (int64_t k = 0; k < c; ++k)
        ASSERT_EQ(std::isnan(xn.grad().at({i, k})), i == 4)
            << "C " << c << " (" << i << ", " << k << ")";
      if (i == 4) continue;
      const double l = lse(i);
      double sum_logp = 0;
      for (int64_t k = 0; k < c; ++k) sum_logp += xv[i * c + k] - l;
      const double want = (1 - eps) * (l - xv[i * c + ti]) - eps * sum_logp / c;
      EXPECT_NEAR(per_row.at({i}), want, 2e-6 * (1 + std::abs(want))) << "C " << c << " row " << i;
    }
  }
}

TEST(CrossEntropy, Gradcheck) {
  Generator gen(34);
  for (Reduction r : {Reduction::none, Reduction::mean, Reduction::sum}) {
    for (double eps : {0.0, 0.3}) {
      CrossEntropyOptions o;
      o.reduction = r;
      o.label_smoothing = eps;
      o.ignore_index = 2;
      for (const Dims& shape : {Dims{4, 3}, Dims{3, 4, 2}, Dims{2, 3, 2, 2}}) {
        Tensor t = make_targets(shape, gen, 2, false);
        auto fn = [t, o](const std::vector<Tensor>& in) { return cross_entropy(in[0], t, o); };
        expect_gradcheck(fn, {randn(shape, gen, kFloat64).requires_grad_()});
      }
      // A non-contiguous leaf.
      Tensor t = randint(0, 4, {5}, gen);
      auto fn = [t, o](const std::vector<Tensor>& in) { return cross_entropy(in[0], t, o); };
      expect_gradcheck(fn, {randn({4, 5}, gen, kFloat64).t().detach().requires_grad_()});
    }
  }
}

TEST(CrossEntropy, HalfLogits) {
  Generator gen(35);
  Tensor x = randn({6, 7}, gen).to(DType::bf16);
  Tensor t = randint(0, 7, {6}, gen);
  std::vector<int64_t> tv = ivalues(t);
  const double want =
      reduce(naive_ce_rows(values(x), tv, 6, 7, 1, -100, 0.0), tv, -100, Reduction::mean);
  Tensor l = cross_entropy(x, t);
  EXPECT_EQ(l.dtype(), DType::bf16);
  EXPECT_NEAR(l.item(), want, 2e-2 * (1 + want));
}

TEST(CrossEntropy, Errors) {
  expect_error(
      [] {
        cross_entropy(zeros({2, 10}), from_vector<int64_t>({3, 12}, {2}));
      },
      {"cross_entropy", "target 12", "10 classes"});
  expect_error(
      [] {
        cross_entropy(zeros({2, 10}), from_vector<int64_t>({-1, 0}, {2}));
      },
      {"cross_entropy", "target -1", "10 classes"});
  expect_error(
      [] {
        cross_entropy(zeros({2, 10}), zeros({3}, kInt64));
      },
      {"cross_entropy", "[2, 10]", "[2]", "[3]"});
  expect_error([] { cross_entropy(zeros({2, 10}), zeros({2})); }, {"cross_entropy", "f32"});
  expect_error([] { cross_entropy(zeros({10}), zeros({}, kInt64)); }, {"cross_entropy", "[10]"});
  CrossEntropyOptions o;
  o.label_smoothing = 1.5;
  expect_error(
      [o] {
        cross_entropy(zeros({2, 3}), zeros({2}, kInt64), o);
      },
      {"label_smoothing", "1.5"});
}

// ---- mse_loss ----

TEST(MseLoss, ValuesAllReductions) {
  Generator gen(36);
  for (DType dt : {kFloat32, kFloat64}) {
    const double tol = dt == kFloat64 ? 1e-12 : 1e-5;
    for (const Dims& shape : {Dims{7}, Dims{1}, Dims{3, 1023}, Dims{2, 3, 5}}) {
      Tensor x = randn(shape, gen, dt), y = randn(shape, gen, dt);
      std::vector<Tensor> xs = {x};
      if (shape.size() >= 2) xs.push_back(non_contiguous(x));
      for (const Tensor& xi : xs) {
        std::vector<double> xv = values(xi), yv = values(y), sq(xv.size());
        double s = 0;
        for (size_t i = 0; i < xv.size(); ++i) {
          sq[i] = (xv[i] - yv[i]) * (xv[i] - yv[i]);
          s += sq[i];
        }
        Tensor none = mse_loss(xi, y, Reduction::none);
        ASSERT_EQ(none.shape(), shape);
        std::vector<double> got = none.to_vector<double>();
        for (size_t i = 0; i < sq.size(); ++i) ASSERT_NEAR(got[i], sq[i], tol * (1 + sq[i]));
        EXPECT_NEAR(mse_loss(xi, y, Reduction::sum).item(), s, tol * (1 + s));
        const double m = s / static_cast<double>(sq.size());
        EXPECT_NEAR(mse_loss(xi, y).item(), m, tol * (1 + m));
      }
    }
  }
}

TEST(MseLoss, Gradcheck) {
  Generator gen(37);
  for (Reduction r : {Reduction::none, Reduction::mean, Reduction::sum}) {
    auto fn = [r](const std::vector<Tensor>& in) { return mse_loss(in[0], in[1], r); };
    expect_gradcheck(fn, {randn({3, 4}, gen, kFloat64).requires_grad_(),
                          randn({3, 4}, gen, kFloat64).requires_grad_()});
    expect_gradcheck(fn, {randn({4, 3}, gen, kFloat64).t().detach().requires_grad_(),
                          randn({3, 4}, gen, kFloat64)});
    expect_gradcheck(fn, {randn({5}, gen, kFloat64),
                          randn({10}, gen, kFloat64).slice(0, 0, 10, 2).detach().requires_grad_()});
  }
}

TEST(MseLoss, Errors) {
  expect_error([] { mse_loss(zeros({2, 3}), zeros({3, 2})); }, {"mse_loss", "[2, 3]", "[3, 2]"});
  expect_error([] { mse_loss(zeros({2}), zeros({2}, kFloat64)); }, {"mse_loss", "f32", "f64"});
}

TEST(Loss, TensorOnAnotherDeviceFailsNamingOpAndDevice) {
  if (cuda::compiled_with_cuda())
    GTEST_SKIP() << "this build has CUDA kernels, which would run on the borrowed host memory; "
                    "tests/cuda/ checks ops on cuda:0 (and tests/cuda/no_cuda_test.cpp the "
                    "CPU-only build's errors)";
  std::vector<float> data(6);
  std::vector<int64_t> labels(2);
  const Tensor x = borrow(data.data(), {2, 3}, kFloat32, cuda_device(0));
  const Tensor t = borrow(labels.data(), {2}, kInt64, cuda_device(0));
  expect_error([&] { cross_entropy(x, t); }, {"cross_entropy", "cuda:0"});
  expect_error([&] { mse_loss(x, x); }, {"mse_loss", "cuda:0"});
}
