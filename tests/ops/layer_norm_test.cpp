// layer_norm against a naive per-row reference (with and without weight/bias, strided inputs,
// odd sizes); gradients by formula and finite differences; errors.
#include <cmath>
#include <string>
#include <vector>

#include "lockstep/tensor/cuda.h"
#include "ops/cpu/norm_avx2.h"
#include "testing.h"

using namespace lockstep;
using lockstep::testing::expect_error;
using lockstep::testing::expect_gradcheck;
using lockstep::testing::expect_near_all;
using lockstep::testing::non_contiguous;
using lockstep::testing::values;

namespace {

// Rows of n trailing elements: (x - mean) / sqrt(var + eps) * w + b, biased variance.
std::vector<double> naive_layer_norm(const std::vector<double>& x, int64_t n,
                                     const std::vector<double>* w, const std::vector<double>* b,
                                     double eps) {
  std::vector<double> y(x.size());
  const int64_t rows = static_cast<int64_t>(x.size()) / n;
  for (int64_t r = 0; r < rows; ++r) {
    double mean = 0, var = 0;
    for (int64_t i = 0; i < n; ++i) mean += x[r * n + i];
    mean /= static_cast<double>(n);
    for (int64_t i = 0; i < n; ++i) var += (x[r * n + i] - mean) * (x[r * n + i] - mean);
    var /= static_cast<double>(n);
    for (int64_t i = 0; i < n; ++i) {
      double v = (x[r * n + i] - mean) / std::sqrt(var + eps);
      if (w) v *= (*w)[i];
      if (b) v += (*b)[i];
      y[r * n + i] = v;
    }
  }
  return y;
}

}  // namespace

TEST(LayerNorm, ValuesOddSizesAffineOrNot) {
  Generator gen(41);
  struct Case {
    Dims x, norm;
  };
  const std::vector<Case> cases = {{{7, 1023}, {1023}}, {{2, 3, 4}, {3, 4}}, {{5, 1}, {1}},
                                   {{1023, 7}, {7}},    {{1, 1}, {1}},       {{9}, {9}}};
  for (DType dt : {kFloat32, kFloat64}) {
    const double tol = dt == kFloat64 ? 1e-10 : 2e-5;
    for (const Case& c : cases) {
      Tensor x = randn(c.x, gen, dt, 1.5, 2.0);
      Tensor w = randn(c.norm, gen, dt), b = randn(c.norm, gen, dt);
      std::vector<double> xv = values(x), wv = values(w), bv = values(b);
      const int64_t n = c.norm.numel();
      const std::string what = c.x.str() + " over " + c.norm.str();
      Tensor y = layer_norm(x, c.norm, w, b);
      ASSERT_EQ(y.shape(), c.x);
      EXPECT_EQ(y.dtype(), dt);
      expect_near_all(y, naive_layer_norm(xv, n, &wv, &bv, 1e-5), tol, what + " affine");
      expect_near_all(layer_norm(x, c.norm), naive_layer_norm(xv, n, nullptr, nullptr, 1e-5), tol,
                      what + " plain");
      expect_near_all(layer_norm(x, c.norm, w, Tensor(), 0.1),
                      naive_layer_norm(xv, n, &wv, nullptr, 0.1), tol, what + " weight only");
    }
  }
}

TEST(LayerNorm, NonContiguousInputs) {
  Generator gen(42);
  Tensor x = randn({6, 5}, gen, kFloat64);
  Tensor w = randn({5}, gen, kFloat64), b = randn({5}, gen, kFloat64);
  std::vector<double> wv = values(w), bv = values(b);
  const std::vector<double> want = naive_layer_norm(values(x), 5, &wv, &bv, 1e-5);
  expect_near_all(layer_norm(non_contiguous(x), {5}, non_contiguous(w), non_contiguous(b)), want,
                  1e-12, "transposed x, strided w and b");
  Tensor xs = randn({6, 10}, gen, kFloat64).slice(1, 0, 10, 2);
  expect_near_all(layer_norm(xs, {5}, w, b), naive_layer_norm(values(xs), 5, &wv, &bv, 1e-5), 1e-12,
                  "column-sliced x");
}

TEST(LayerNorm, HalfTypes) {
  Generator gen(43);
  for (DType dt : {DType::bf16, DType::f16}) {
    Tensor x = randn({4, 16}, gen).to(dt), w = randn({16}, gen).to(dt), b = randn({16}, gen).to(dt);
    std::vector<double> wv = values(w), bv = values(b);
    Tensor y = layer_norm(x, {16}, w, b);
    EXPECT_EQ(y.dtype(), dt);
    expect_near_all(y, naive_layer_norm(values(x), 16, &wv, &bv, 1e-5), 3e-2,
                    std::string(dtype_name(dt)));
  }
}

TEST(LayerNorm, Gradcheck) {
  Generator gen(44);
  auto leaf = [&](const Dims& s) { return randn(s, gen, kFloat64).requires_grad_(); };
  auto full_ln = [](const std::vector<Tensor>& in) {
    return layer_norm(in[0], in[1].shape(), in[1], in[2]);
  };
  expect_gradcheck(full_ln, {leaf({4, 5}), leaf({5}), leaf({5})});
  expect_gradcheck(full_ln, {leaf({2, 3, 4}), leaf({3, 4}), leaf({3, 4})});
  expect_gradcheck(full_ln, {leaf({3, 1}), leaf({1}), leaf({1})});
  // Non-contiguous leaves.
  expect_gradcheck(
      full_ln,
      {randn({5, 4}, gen, kFloat64).t().detach().requires_grad_(),
       randn({10}, gen, kFloat64).slice(0, 0, 10, 2).detach().requires_grad_(), leaf({5})});
  // Without affine parameters, and with only some inputs needing a gradient.
  auto plain = [](const std::vector<Tensor>& in) { return layer_norm(in[0], {6}); };
  expect_gradcheck(plain, {leaf({3, 6})});
  expect_gradcheck(full_ln, {randn({4, 5}, gen, kFloat64), leaf({5}), randn({5}, gen, kFloat64)});
  expect_gradcheck(full_ln, {leaf({4, 5}), randn({5}, gen, kFloat64), randn({5}, gen, kFloat64)});
}

TEST(LayerNorm, ParameterGradientsOverManyRows) {
  // dbias = column sums of g and dweight = column sums of g * xhat, over enough rows that the
  // backward splits them into several blocks.
  Generator gen(45);
  const int64_t rows = 4099, n = 37;
  Tensor x = randn({rows, n}, gen, kFloat64);
  Tensor w = randn({n}, gen, kFloat64).requires_grad_(),
         b = randn({n}, gen, kFloat64).requires_grad_();
  Tensor g = randn({rows, n}, gen, kFloat64);
  sum(mul(layer_norm(x, {n}, w, b), g)).backward();
  std::vector<double> xv = x.to_vector<double>(), gv = g.to_vector<double>();
  std::vector<double> xhat = naive_layer_norm(xv, n, nullptr, nullptr, 1e-5);
  std::vector<double> dw(n, 0.0), db(n, 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < n; ++i) {
      dw[i] += gv[r * n + i] * xhat[r * n + i];
      db[i] += gv[r * n + i];
    }
  expect_near_all(w.grad(), dw, 1e-9, "dweight");
  expect_near_all(b.grad(), db, 1e-9, "dbias");
}

// Note [layer_norm on AVX2]: the f32 rows on AVX2 give the bits of the portable loops, forward
// and backward (dx, dweight, dbias), at row lengths below, at and past 4 and 8 with tails, with
// and without the affine parameters; a NaN in one row stays in that row's output and dx (and
// in dweight, dbias, which sum over rows). Also right: against the f64 layer norm.
TEST(LayerNorm, Float32Avx2RowsHaveThePortableBits) {
  struct Run {
    std::vector<float> y, dx, dw, db;
  };
  for (int64_t n : {1, 3, 4, 7, 8, 13, 128, 133}) {
    for (bool affine : {true, false}) {
      Generator gen(static_cast<uint64_t>(n) + (affine ? 100 : 0));
      const int64_t rows = 37;
      std::vector<float> xv = add(mul(randn({rows, n}, gen), 2.0), 0.5).to_vector<float>();
      if (n > 2) xv[5 * n + 2] = NAN;
      const Tensor x0 = from_vector<float>(xv, {rows, n});
      const Tensor w0 = randn({n}, gen), b0 = randn({n}, gen), gy = randn({rows, n}, gen);
      auto run = [&](bool avx2) {
        cpu::set_layer_norm_avx2(avx2);
        Tensor x = x0.clone().requires_grad_(), w = w0.clone().requires_grad_(),
               b = b0.clone().requires_grad_();
        Tensor y = affine ? layer_norm(x, {n}, w, b) : layer_norm(x, {n});
        sum(mul(y, gy)).backward();
        cpu::set_layer_norm_avx2(true);
        Run r{y.to_vector<float>(), x.grad().to_vector<float>(), {}, {}};
        if (affine) {
          r.dw = w.grad().to_vector<float>();
          r.db = b.grad().to_vector<float>();
        }
        return r;
      };
      const Run portable = run(false);
      cpu::set_layer_norm_avx2(true);
      if (!cpu::layer_norm_avx2_enabled()) GTEST_SKIP() << "no AVX2 here";
      const Run avx2 = run(true);
      const std::string what = "n " + std::to_string(n) + (affine ? " affine" : "");
      auto same = [&](const std::vector<float>& a, const std::vector<float>& b, const char* name) {
        ASSERT_EQ(a.size(), b.size()) << what << " " << name;
        for (size_t i = 0; i < a.size(); ++i) {
          if (std::isnan(a[i])) {
            ASSERT_TRUE(std::isnan(b[i])) << what << " " << name << " " << i;
          } else {
            ASSERT_EQ(a[i], b[i]) << what << " " << name << " " << i;
          }
        }
      };
      same(portable.y, avx2.y, "y");
      same(portable.dx, avx2.dx, "dx");
      same(portable.dw, avx2.dw, "dweight");
      same(portable.db, avx2.db, "dbias");
      // The NaN stays in row 5; row 0 is right against f64.
      for (int64_t i = 0; i < rows * n; ++i)
        ASSERT_EQ(std::isnan(avx2.y[i]), n > 2 && i / n == 5) << what << " y " << i;
      const Tensor x64 = x0.narrow(0, 0, 1).to(kFloat64);
      const Tensor want =
          affine ? layer_norm(x64, {n}, w0.to(kFloat64), b0.to(kFloat64)) : layer_norm(x64, {n});
      const std::vector<double> wv = want.to_vector<double>();
      for (int64_t i = 0; i < n; ++i)
        ASSERT_NEAR(avx2.y[i], wv[i], 1e-5 * (1 + std::abs(wv[i]))) << what << " row 0, " << i;
    }
  }
}

TEST(LayerNorm, Errors) {
  expect_error([] { layer_norm(zeros({3, 4}), {5}); }, {"layer_norm", "[5]", "[3, 4]"});
  expect_error(
      [] {
        layer_norm(zeros({3, 4}), {4}, zeros({3}));
      },
      {"layer_norm", "weight", "[3]", "[4]"});
  expect_error(
      [] {
        layer_norm(zeros({3, 4}), {4}, Tensor(), zeros({4}, kFloat64));
      },
      {"layer_norm", "bias", "f64", "f32"});
  expect_error([] { layer_norm(zeros({3, 4}), {}); }, {"layer_norm", "[]"});
}

TEST(LayerNorm, TensorOnAnotherDeviceFailsNamingOpAndDevice) {
  if (cuda::compiled_with_cuda())
    GTEST_SKIP() << "this build has CUDA kernels, which would run on the borrowed host memory; "
                    "tests/cuda/ checks ops on cuda:0 (and tests/cuda/no_cuda_test.cpp the "
                    "CPU-only build's errors)";
  std::vector<float> data(12);
  const Tensor x = borrow(data.data(), {3, 4}, kFloat32, cuda_device(0));
  expect_error([&] { layer_norm(x, {4}); }, {"layer_norm", "cuda:0"});
}
