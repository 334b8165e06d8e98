// f32 matrix products on both CPU paths (Note [f32 GEMM] in src/ops/cpu/bf16_gemm.cpp): oneDNN's
// brgemm where the CPU runs it, OpenBLAS otherwise, switched with set_f32_gemm_onednn. Each path
// against a double-precision product of the same f32 values: odd sizes (tails not a multiple of
// 8 or 16), every operand layout BLAS takes, row slices, linear's bias (also strided), batches
// folded into one product and batches of large products, NaN and inf propagation.
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "ops/cpu/bf16_gemm.h"
#include "testing.h"

using namespace lockstep;

namespace {

bool cpu_has_avx512f() {
  std::ifstream in("/proc/cpuinfo");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str().find(" avx512f") != std::string::npos;
}

// The paths to check: OpenBLAS always, oneDNN where it runs here.
std::vector<bool> paths() {
  std::vector<bool> onednn{false};
  cpu::set_f32_gemm_onednn(true);
  if (cpu::f32_gemm_onednn_enabled()) onednn.push_back(true);
  return onednn;
}

// Sends f32 products to one path for a scope, and back to the default after it.
struct F32Path {
  explicit F32Path(bool onednn) { cpu::set_f32_gemm_onednn(onednn); }
  ~F32Path() { cpu::set_f32_gemm_onednn(true); }
};

// got (f32) against the f64 value: f32 accumulation over k terms of size ~1 (randn operands).
void expect_f32_close(const Tensor& got, const Tensor& want64, int64_t k, const std::string& what) {
  ASSERT_EQ(got.dtype(), kFloat32) << what;
  ASSERT_EQ(got.shape(), want64.shape()) << what;
  const auto g = got.to_vector<double>(), w = want64.to_vector<double>();
  const double tol = 2e-6 * std::sqrt(static_cast<double>(k) + 1) * 4;
  for (size_t i = 0; i < g.size(); ++i)
    ASSERT_NEAR(g[i], w[i], tol * (1 + std::abs(w[i]))) << what << " element " << i;
}

Tensor f64(const Tensor& t) { return t.to(kFloat64); }

// The double product of the f32 values, in plain loops (not through any gemm kernel).
Tensor naive(const Tensor& a, const Tensor& b) {
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  const auto av = a.to_vector<double>(), bv = b.to_vector<double>();
  std::vector<double> c(static_cast<size_t>(m * n), 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t p = 0; p < k; ++p)
      for (int64_t j = 0; j < n; ++j) c[i * n + j] += av[i * k + p] * bv[p * n + j];
  return from_vector(c, {m, n});
}

}  // namespace

TEST(F32Gemm, OneDnnRunsWhereTheCpuHasAvx512) {
#ifdef LOCKSTEP_EXPECT_ONEDNN
  cpu::set_f32_gemm_onednn(true);
  if (cpu_has_avx512f()) EXPECT_TRUE(cpu::f32_gemm_onednn_enabled());
  cpu::set_f32_gemm_onednn(false);
  EXPECT_FALSE(cpu::f32_gemm_onednn_enabled());
  cpu::set_f32_gemm_onednn(true);
#else
  EXPECT_FALSE(cpu::f32_gemm_onednn_enabled());
#endif
}

TEST(F32Gemm, EveryLayoutAndOddSizeMatchesTheDoubleProduct) {
  Generator gen(7);
  // (m, k, n): tails of 1-15 past multiples of 8 and 16, a single row or column, k = 1, and
  // train_gpt's shapes at a small batch.
  const std::vector<std::array<int64_t, 3>> sizes = {
      {37, 53, 29}, {1, 19, 33}, {45, 1, 17}, {31, 77, 1}, {130, 128, 384}, {128, 512, 131}};
  for (bool onednn : paths()) {
    F32Path path(onednn);
    const std::string on = onednn ? "oneDNN " : "OpenBLAS ";
    for (auto [m, k, n] : sizes) {
      const std::string sz = std::to_string(m) + "x" + std::to_string(k) + "x" + std::to_string(n);
      const Tensor a = randn({m, k}, gen), b = randn({k, n}, gen);
      const Tensor at = randn({k, m}, gen), bt = randn({n, k}, gen);
      expect_f32_close(matmul(a, b), naive(a, b), k, on + "a @ b " + sz);
      expect_f32_close(matmul(at.t(), b), naive(at.t(), b), k, on + "a^T view @ b " + sz);
      expect_f32_close(matmul(a, bt.t()), naive(a, bt.t()), k, on + "a @ b^T view " + sz);
      expect_f32_close(matmul(at.t(), bt.t()), naive(at.t(), bt.t()), k, on + "both^T " + sz);
      const Tensor rows = randn({m + 9, k}, gen).narrow(0, 5, m);  // a row slice
      expect_f32_close(matmul(rows, b), naive(rows, b), k, on + "row slice " + sz);
      const Tensor cols = randn({m, k + 6}, gen).narrow(1, 3, k);  // leading dim > k
      expect_f32_close(matmul(cols, b), naive(cols, b), k, on + "column slice " + sz);
    }
  }
}

TEST(F32Gemm, LinearWithBiasMatchesTheDoubleProduct) {
  Generator gen(11);
  for (bool onednn : paths()) {
    F32Path path(onednn);
    const std::string on = onednn ? "oneDNN " : "OpenBLAS ";
    for (auto [rows, in, out] : std::vector<std::array<int64_t, 3>>{{37, 53, 29}, {67, 128, 384}}) {
      const Tensor x = randn({rows, in}, gen), w = randn({out, in}, gen), b = randn({out}, gen);
      const Tensor want = naive(x, w.t()) + f64(b);
      expect_f32_close(linear(x, w, b), want, in, on + "linear with bias");
      expect_f32_close(linear(x, w, Tensor()), naive(x, w.t()), in, on + "linear, no bias");
      // A strided bias (every other element of a longer buffer).
      const Tensor every_other = randn({out, 2}, gen).select(1, 0);  // stride 2
      expect_f32_close(linear(x, w, every_other), naive(x, w.t()) + f64(every_other), in,
                       on + "strided bias");
      // A batched input: its batch folds into the rows of one product.
      const Tensor x3 = randn({3, rows, in}, gen);
      const Tensor want3 = naive(x3.reshape({3 * rows, in}), w.t()) + f64(b);
      expect_f32_close(linear(x3, w, b).reshape({3 * rows, out}), want3, in, on + "batched");
    }
  }
}

TEST(F32Gemm, BatchesOfLargeProductsMatchTheDoubleProduct) {
  Generator gen(13);
  for (bool onednn : paths()) {
    F32Path path(onednn);
    const std::string on = onednn ? "oneDNN " : "OpenBLAS ";
    // 129 x 131 x 133 per entry is above the small-product threshold (2^21 multiply-adds), so
    // each entry is its own call; b differs per entry, so nothing folds.
    const Tensor a = randn({2, 129, 131}, gen), b = randn({2, 131, 133}, gen);
    const Tensor c = matmul(a, b);
    for (int64_t i = 0; i < 2; ++i)
      expect_f32_close(c.select(0, i), naive(a.select(0, i), b.select(0, i)), 131,
                       on + "batch entry " + std::to_string(i));
    // A shared b against a batch whose rows do not merge (a transposed batch of a).
    const Tensor ab = randn({131, 2, 129}, gen).permute({1, 2, 0});  // (2, 129, 131), strided
    const Tensor bs = randn({131, 133}, gen);
    const Tensor cs = matmul(ab, bs);
    for (int64_t i = 0; i < 2; ++i)
      expect_f32_close(cs.select(0, i), naive(ab.select(0, i), bs), 131,
                       on + "shared b, entry " + std::to_string(i));
  }
}

TEST(F32Gemm, NanAndInfPropagateToTheirRowsAndColumnsOnly) {
  Generator gen(17);
  for (bool onednn : paths()) {
    F32Path path(onednn);
    const std::string on = onednn ? "oneDNN " : "OpenBLAS ";
    const int64_t m = 21, k = 35, n = 19;
    Tensor a = randn({m, k}, gen), b = randn({k, n}, gen);
    auto av = a.to_vector<float>();
    av[3 * k + 4] = std::numeric_limits<float>::quiet_NaN();  // row 3
    av[9 * k + 0] = std::numeric_limits<float>::infinity();   // row 9
    a = from_vector(av, {m, k});
    const auto c = matmul(a, b).to_vector<float>();
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        const float x = c[i * n + j];
        if (i == 3) {
          EXPECT_TRUE(std::isnan(x)) << on << "(" << i << ", " << j << ")";
        } else if (i == 9) {
          // inf * b(0, j) plus finite terms: +-inf by the sign of b(0, j).
          EXPECT_TRUE(std::isinf(x)) << on << "(" << i << ", " << j << ")";
        } else {
          EXPECT_TRUE(std::isfinite(x)) << on << "(" << i << ", " << j << ")";
        }
      }
  }
}

TEST(F32Gemm, GradientsOnBothPathsMatchTheFormulas) {
  Generator gen(19);
  const Tensor x0 = randn({45, 37}, gen), w0 = randn({29, 37}, gen), b0 = randn({29}, gen);
  const Tensor gy = randn({45, 29}, gen);
  for (bool onednn : paths()) {
    F32Path path(onednn);
    Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true),
           b = b0.clone().requires_grad_(true);
    sum(linear(x, w, b) * gy).backward();
    // Against the formulas in f64: dx = g w, dw = g^T x, db = column sums of g.
    expect_f32_close(x.grad(), naive(gy, w0), 29, "dx");
    expect_f32_close(w.grad(), naive(gy.t(), x0), 45, "dw");
    expect_f32_close(b.grad(), sum(f64(gy), {0}), 45, "db");
  }
}

// linear's bias gradient sums the rows of g in f64, in row order, per column, and rounds once:
// the AVX2 loop (8 columns at a time) has those bits. Column counts with tails of 5 and 1 past
// a multiple of 8, and a NaN in one column that stays in that column.
TEST(F32Gemm, BiasGradientIsTheRoundedF64ColumnSum) {
  for (int64_t out : {29, 129}) {
    Generator gen(static_cast<uint64_t>(out));
    const int64_t rows = 53, in = 7;
    std::vector<float> gv = randn({rows, out}, gen).to_vector<float>();
    gv[11 * out + 3] = std::numeric_limits<float>::quiet_NaN();
    const Tensor gy = from_vector<float>(gv, {rows, out});
    Tensor x = randn({rows, in}, gen), w = randn({out, in}, gen);
    Tensor b = randn({out}, gen).requires_grad_(true);
    sum(linear(x, w, b) * gy).backward();
    const std::vector<float> db = b.grad().to_vector<float>();
    for (int64_t j = 0; j < out; ++j) {
      double acc = 0;
      for (int64_t i = 0; i < rows; ++i) acc += static_cast<double>(gv[i * out + j]);
      if (j == 3) {
        EXPECT_TRUE(std::isnan(db[j])) << "column " << j;
      } else {
        EXPECT_EQ(db[j], static_cast<float>(acc)) << "out " << out << " column " << j;
      }
    }
  }
}
