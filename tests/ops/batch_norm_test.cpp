// batch_norm against a naive per-channel reference (training and evaluation, 2-D, 3-D and 4-D
// inputs, the running statistics after a step), finite-difference gradients for input, weight
// and bias, autocast, and errors.
#include <cmath>
#include <string>
#include <vector>

#include "lockstep/tensor/cuda.h"
#include "testing.h"

using namespace lockstep;
using lockstep::testing::expect_error;
using lockstep::testing::expect_gradcheck;
using lockstep::testing::expect_near_all;
using lockstep::testing::non_contiguous;
using lockstep::testing::values;

namespace {

// Channel statistics of x (N, C, *) read as (N, C, S): the mean and the biased variance.
struct Stats {
  std::vector<double> mean, var;
};

Stats naive_stats(const std::vector<double>& x, int64_t n, int64_t c, int64_t s) {
  Stats st{std::vector<double>(c, 0.0), std::vector<double>(c, 0.0)};
  const double m = static_cast<double>(n * s);
  for (int64_t k = 0; k < c; ++k) {
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < s; ++j) st.mean[k] += x[(i * c + k) * s + j];
    st.mean[k] /= m;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < s; ++j) {
        const double d = x[(i * c + k) * s + j] - st.mean[k];
        st.var[k] += d * d;
      }
    st.var[k] /= m;
  }
  return st;
}

// (x - mean) / sqrt(var + eps) * w + b per channel (w, b empty: 1 and 0).
std::vector<double> naive_normalize(const std::vector<double>& x, int64_t n, int64_t c, int64_t s,
                                    const Stats& st, const std::vector<double>& w,
                                    const std::vector<double>& b, double eps) {
  std::vector<double> y(x.size());
  for (int64_t i = 0; i < n; ++i)
    for (int64_t k = 0; k < c; ++k)
      for (int64_t j = 0; j < s; ++j) {
        const int64_t p = (i * c + k) * s + j;
        double v = (x[p] - st.mean[k]) / std::sqrt(st.var[k] + eps);
        if (!w.empty()) v = v * w[k] + b[k];
        y[p] = v;
      }
  return y;
}

int64_t inner_size(const Dims& shape) {
  int64_t s = 1;
  for (int64_t d = 2; d < shape.size(); ++d) s *= shape[d];
  return s;
}

}  // namespace

TEST(BatchNorm, TrainingNormalizesWithBatchStatisticsAndUpdatesRunningOnes) {
  Generator gen(71);
  const double momentum = 0.3, eps = 1e-4;
  for (DType dt : {kFloat32, kFloat64}) {
    const double tol = dt == kFloat64 ? 1e-10 : 3e-5;
    for (const Dims& shape : {Dims{16, 5}, Dims{4, 3, 7}, Dims{3, 4, 5, 6}, Dims{2, 1, 1, 3}}) {
      const std::string what = std::string(dtype_name(dt)) + " " + shape.str();
      const int64_t n = shape[0], c = shape[1], s = inner_size(shape);
      // Offset and scaled per element so that channels differ.
      Tensor x = randn(shape, gen, dt, 3.0, 2.0);
      Tensor w = randn({c}, gen, dt), b = randn({c}, gen, dt);
      Tensor rm = randn({c}, gen, dt), rv = rand({c}, gen, dt, 0.5, 2.0);
      const std::vector<double> rm0 = values(rm), rv0 = values(rv);
      const std::vector<double> xv = values(x);
      const Stats st = naive_stats(xv, n, c, s);

      Tensor y = batch_norm(x, rm, rv, w, b, true, momentum, eps);
      ASSERT_EQ(y.shape(), shape) << what;
      EXPECT_EQ(y.dtype(), dt) << what;
      expect_near_all(y, naive_normalize(xv, n, c, s, st, values(w), values(b), eps), tol, what);

      // Running statistics: (1 - momentum) * old + momentum * batch, the variance unbiased.
      const double m = static_cast<double>(n * s);
      std::vector<double> want_rm(c), want_rv(c);
      for (int64_t k = 0; k < c; ++k) {
        want_rm[k] = (1 - momentum) * rm0[k] + momentum * st.mean[k];
        want_rv[k] = (1 - momentum) * rv0[k] + momentum * st.var[k] * m / (m - 1);
      }
      expect_near_all(rm, want_rm, tol, what + " running_mean");
      expect_near_all(rv, want_rv, tol, what + " running_var");

      // Without affine parameters and without running statistics.
      expect_near_all(batch_norm(x, Tensor(), Tensor(), Tensor(), Tensor(), true, momentum, eps),
                      naive_normalize(xv, n, c, s, st, {}, {}, eps), tol, what + " plain");
    }
  }
}

TEST(BatchNorm, EvaluationNormalizesWithRunningStatisticsAndLeavesThem) {
  Generator gen(72);
  for (const Dims& shape : {Dims{6, 4}, Dims{2, 4, 9}, Dims{2, 4, 3, 5}}) {
    const int64_t n = shape[0], c = shape[1], s = inner_size(shape);
    Tensor x = randn(shape, gen, kFloat64);
    Tensor w = randn({c}, gen, kFloat64), b = randn({c}, gen, kFloat64);
    Tensor rm = randn({c}, gen, kFloat64), rv = rand({c}, gen, kFloat64, 0.5, 2.0);
    const Stats running{values(rm), values(rv)};
    Tensor y = batch_norm(x, rm, rv, w, b, false, 0.1, 1e-5);
    expect_near_all(y, naive_normalize(values(x), n, c, s, running, values(w), values(b), 1e-5),
                    1e-12, shape.str());
    EXPECT_EQ(values(rm), running.mean);
    EXPECT_EQ(values(rv), running.var);
  }
}

TEST(BatchNorm, NonContiguousInputAndLargeOffsetStatistics) {
  Generator gen(73);
  Tensor x = non_contiguous(randn({5, 3, 4, 2}, gen));
  const std::vector<double> xv = values(x);
  expect_near_all(batch_norm(x, Tensor(), Tensor(), Tensor(), Tensor(), true),
                  naive_normalize(xv, 5, 3, 8, naive_stats(xv, 5, 3, 8), {}, {}, 1e-5), 3e-5,
                  "non-contiguous");
  // |mean| >> std: the statistics must not cancel (Note [Batch statistics in one pass] in
  // src/ops/cpu/norm.cpp).
  Tensor big = add(mul(randn({64, 2}, gen, kFloat64), 1e-3), 1e6);
  Tensor rm = zeros({2}, kFloat64), rv = zeros({2}, kFloat64);
  (void)batch_norm(big, rm, rv, Tensor(), Tensor(), true, 1.0, 0.0);
  const std::vector<double> bv = values(big);
  const Stats st = naive_stats(bv, 64, 2, 1);
  for (int k = 0; k < 2; ++k) {
    EXPECT_NEAR(rv.at({k}), st.var[k] * 64.0 / 63.0, 1e-9 * st.var[k]) << k;
    EXPECT_NEAR(rm.at({k}), st.mean[k], 1e-9) << k;
  }
}

TEST(BatchNorm, Gradcheck) {
  Generator gen(74);
  auto leaf = [&](const Dims& s) { return randn(s, gen, kFloat64).requires_grad_(); };
  auto train = [](const std::vector<Tensor>& in) {
    return batch_norm(in[0], Tensor(), Tensor(), in[1], in[2], true, 0.1, 1e-5);
  };
  expect_gradcheck(train, {leaf({6, 3}), leaf({3}), leaf({3})});
  expect_gradcheck(train, {leaf({2, 3, 4}), leaf({3}), leaf({3})});
  expect_gradcheck(train, {leaf({2, 2, 3, 3}), leaf({2}), leaf({2})});
  expect_gradcheck(train, {non_contiguous(randn({4, 3, 2}, gen, kFloat64)).requires_grad_(),
                           leaf({3}), leaf({3})});
  // Training with running statistics (updated by every evaluation gradcheck makes; they do not
  // enter the output), and without affine parameters.
  Tensor rm = zeros({3}, kFloat64), rv = ones({3}, kFloat64);
  expect_gradcheck(
      [&](const std::vector<Tensor>& in) {
        return batch_norm(in[0], rm, rv, Tensor(), Tensor(), true, 0.1, 1e-5);
      },
      {leaf({5, 3, 2})});
  // Evaluation: the running statistics are constants.
  Tensor erm = randn({3}, gen, kFloat64), erv = rand({3}, gen, kFloat64, 0.5, 2.0);
  expect_gradcheck(
      [&](const std::vector<Tensor>& in) {
        return batch_norm(in[0], erm, erv, in[1], in[2], false, 0.1, 1e-5);
      },
      {leaf({4, 3, 2, 2}), leaf({3}), leaf({3})});
}

TEST(BatchNorm, GradientsMatchTheClosedForm) {
  // y = xhat * w + b summed against a fixed g: dw = sum g * xhat, db = sum g, and in training
  // dx = w / std * (g - mean(g) - xhat * mean(g * xhat)) per channel.
  Generator gen(75);
  const int64_t n = 4, c = 2, s = 3;
  Tensor x = randn({n, c, s}, gen, kFloat64).requires_grad_();
  Tensor w = randn({c}, gen, kFloat64).requires_grad_(),
         b = randn({c}, gen, kFloat64).requires_grad_();
  Tensor g = randn({n, c, s}, gen, kFloat64);
  sum(mul(batch_norm(x, Tensor(), Tensor(), w, b, true, 0.1, 1e-5), g)).backward();
  const std::vector<double> xv = values(x), gv = values(g), wv = values(w);
  const Stats st = naive_stats(xv, n, c, s);
  std::vector<double> dx(xv.size()), dw(c, 0.0), db(c, 0.0);
  for (int64_t k = 0; k < c; ++k) {
    const double istd = 1 / std::sqrt(st.var[k] + 1e-5), m = static_cast<double>(n * s);
    double sg = 0, sgx = 0;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < s; ++j) {
        const int64_t p = (i * c + k) * s + j;
        sg += gv[p];
        sgx += gv[p] * (xv[p] - st.mean[k]) * istd;
      }
    db[k] = sg;
    dw[k] = sgx;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < s; ++j) {
        const int64_t p = (i * c + k) * s + j;
        const double xhat = (xv[p] - st.mean[k]) * istd;
        dx[p] = wv[k] * istd * (gv[p] - sg / m - xhat * sgx / m);
      }
  }
  expect_near_all(x.grad(), dx, 1e-10, "dx");
  expect_near_all(w.grad(), dw, 1e-10, "dweight");
  expect_near_all(b.grad(), db, 1e-10, "dbias");
}

TEST(BatchNorm, AutocastRunsInFloatAndUpdatesTheCallersStatistics) {
  Generator gen(76);
  Tensor x = randn({8, 3, 4}, gen).to(kBFloat16);
  Tensor rm = zeros({3}), rv = ones({3}), w = ones({3}), b = zeros({3});
  Tensor y;
  {
    amp::autocast ac(kBFloat16);
    y = batch_norm(x, rm, rv, w, b, true, 0.5, 1e-5);
  }
  EXPECT_EQ(y.dtype(), kFloat32);
  const std::vector<double> xv = values(x);
  const Stats st = naive_stats(xv, 8, 3, 4);
  expect_near_all(y, naive_normalize(xv, 8, 3, 4, st, {}, {}, 1e-5), 1e-4, "autocast output");
  for (int k = 0; k < 3; ++k) EXPECT_NEAR(rm.at({k}), 0.5 * st.mean[k], 1e-5) << k;
  // Outside autocast a bf16 input computes in f32 and returns bf16.
  EXPECT_EQ(batch_norm(x, Tensor(), Tensor(), Tensor(), Tensor(), true).dtype(), kBFloat16);
}

TEST(BatchNorm, ErrorsNameTheArgumentAndShapes) {
  const Tensor x = zeros({4, 3, 2});
  expect_error([&] { batch_norm(zeros({4}), Tensor(), Tensor(), Tensor(), Tensor(), true); },
               {"batch_norm", "(N, C, *)", "[4]"});
  expect_error([&] { batch_norm(x, zeros({2}), ones({2}), Tensor(), Tensor(), true); },
               {"batch_norm", "running_mean", "[2]", "3 channels"});
  expect_error([&] { batch_norm(x, Tensor(), Tensor(), zeros({4}), Tensor(), true); },
               {"batch_norm", "weight", "[4]"});
  expect_error([&] { batch_norm(x, Tensor(), Tensor(), Tensor(), Tensor(), false); },
               {"batch_norm", "running_mean", "undefined"});
  expect_error([&] { batch_norm(x, zeros({3}), Tensor(), Tensor(), Tensor(), true); },
               {"batch_norm", "both"});
  expect_error(
      [&] {
        batch_norm(zeros({1, 3}), Tensor(), Tensor(), Tensor(), Tensor(), true);
      },
      {"batch_norm", "more than one value per channel", "[1, 3]"});
  expect_error(
      [&] {
        batch_norm(zeros({4, 3}, kInt64), Tensor(), Tensor(), Tensor(), Tensor(), true);
      },
      {"batch_norm", "floating-point", "i64"});
}

TEST(BatchNorm, TensorOnAnotherDeviceFailsNamingOpAndDevice) {
  if (cuda::compiled_with_cuda())
    GTEST_SKIP() << "this build has CUDA kernels, which would run on the borrowed host memory; "
                    "tests/cuda/ checks ops on cuda:0 (and tests/cuda/no_cuda_test.cpp the "
                    "CPU-only build's errors)";
  std::vector<float> data(12);
  const Tensor x = borrow(data.data(), {4, 3}, kFloat32, cuda_device(0));
  expect_error([&] { batch_norm(x, Tensor(), Tensor(), Tensor(), Tensor(), true); },
               {"batch_norm", "cuda:0"});
}
