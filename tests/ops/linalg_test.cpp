// matmul and linear against naive loops: 1-D/2-D/batched with broadcasting, transposed and
// sliced operands, odd sizes, 16-bit floats; gradients by finite differences; error messages.
#include <array>
#include <cmath>
#include <functional>
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

// Row-major (m x k) @ (k x n) in plain loops.
std::vector<double> naive_mm(const std::vector<double>& a, const std::vector<double>& b, int64_t m,
                             int64_t k, int64_t n) {
  std::vector<double> c(static_cast<size_t>(m * n), 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0;
      for (int64_t p = 0; p < k; ++p) acc += a[i * k + p] * b[p * n + j];
      c[i * n + j] = acc;
    }
  return c;
}

// torch.matmul for operands of >= 2 dims with broadcast batch dims, from logical values.
std::vector<double> naive_bmm(const Tensor& a, const Tensor& b, Dims* out_shape) {
  const std::vector<double> av = values(a), bv = values(b);
  const int64_t m = a.size(-2), k = a.size(-1), n = b.size(-1);
  const int64_t nd = std::max(a.dim(), b.dim());
  Dims batch = Dims::filled(nd - 2, 1);
  for (int64_t i = 0; i < nd - 2; ++i) {
    const int64_t ia = i - (nd - a.dim()), ib = i - (nd - b.dim());
    batch[i] = std::max(ia >= 0 ? a.size(ia) : 1, ib >= 0 ? b.size(ib) : 1);
  }
  *out_shape = batch;
  out_shape->push_back(m);
  out_shape->push_back(n);
  std::vector<double> out;
  for (int64_t bi = 0; bi < batch.numel(); ++bi) {
    // Index of this batch entry inside a's and b's own (possibly size-1) batch dims.
    int64_t oa = 0, ob = 0, sa = 1, sb = 1, rem = bi;
    for (int64_t d = nd - 3; d >= 0; --d) {
      const int64_t idx = rem % batch[d];
      rem /= batch[d];
      const int64_t ia = d - (nd - a.dim()), ib = d - (nd - b.dim());
      if (ia >= 0) {
        oa += (a.size(ia) == 1 ? 0 : idx) * sa;
        sa *= a.size(ia);
      }
      if (ib >= 0) {
        ob += (b.size(ib) == 1 ? 0 : idx) * sb;
        sb *= b.size(ib);
      }
    }
    std::vector<double> am(av.begin() + oa * m * k, av.begin() + (oa + 1) * m * k);
    std::vector<double> bm(bv.begin() + ob * k * n, bv.begin() + (ob + 1) * k * n);
    std::vector<double> cm = naive_mm(am, bm, m, k, n);
    out.insert(out.end(), cm.begin(), cm.end());
  }
  return out;
}

void expect_values(const Tensor& got, const Dims& shape, const std::vector<double>& want,
                   double tol, const std::string& what) {
  ASSERT_EQ(got.shape(), shape) << what;
  std::vector<double> g = got.to_vector<double>();
  ASSERT_EQ(g.size(), want.size()) << what;
  for (size_t i = 0; i < g.size(); ++i) {
    ASSERT_NEAR(g[i], want[i], tol * (1 + std::abs(want[i]))) << what << " at flat index " << i;
  }
}

// Tolerance for a sum of k products in dtype dt.
double tol_for(DType dt, int64_t k) {
  if (dt == kFloat64) return 1e-12 * (k + 1);
  if (dt == kFloat32) return 1e-6 * (k + 1);
  return 2e-2;
}

}  // namespace

// ---- matmul: values ----

TEST(Matmul, TwoDimOddSizesBothDtypes) {
  Generator gen(1);
  const std::vector<std::array<int64_t, 3>> sizes = {{1, 1, 1},    {7, 5, 3},    {1, 7, 1},
                                                     {3, 1023, 2}, {1023, 7, 5}, {4, 3, 1023},
                                                     {0, 3, 2},    {2, 0, 3}};
  for (DType dt : {kFloat32, kFloat64}) {
    for (auto [m, k, n] : sizes) {
      Tensor a = randn({m, k}, gen, dt), b = randn({k, n}, gen, dt);
      Tensor c = matmul(a, b);
      EXPECT_EQ(c.dtype(), dt);
      expect_values(c, {m, n}, naive_mm(values(a), values(b), m, k, n), tol_for(dt, k),
                    "matmul " + Dims{m, k, n}.str());
    }
  }
}

TEST(Matmul, NonContiguousOperands) {
  Generator gen(2);
  const int64_t m = 7, k = 9, n = 5;
  Tensor a = randn({m, k}, gen, kFloat64), b = randn({k, n}, gen, kFloat64);
  const std::vector<double> want = naive_mm(values(a), values(b), m, k, n);
  // Each pair: a layout of a, a layout of b, both with the same values.
  std::vector<std::pair<Tensor, Tensor>> cases = {
      {non_contiguous(a), b},                                   // a transposed in memory
      {a, non_contiguous(b)},                                   // b transposed in memory
      {non_contiguous(a), non_contiguous(b)},                   // both
      {randn({k, m}, gen, kFloat64).t().detach().copy_(a), b},  // a.t() of a contiguous tensor
  };
  // Row and column slices: a leading dimension larger than the row (ld > cols).
  {
    Tensor big = zeros({m + 3, k + 4}, kFloat64);
    Tensor view = big.narrow(0, 1, m).narrow(1, 2, k);
    view.copy_(a);
    cases.push_back({view, b});
  }
  // A column step of 2: neither layout fits, so the kernel must copy.
  {
    Tensor big = zeros({m, 2 * k}, kFloat64);
    Tensor view = big.slice(1, 0, 2 * k, 2);
    view.copy_(a);
    cases.push_back({view, b});
  }
  // An expanded operand (stride 0 along the rows).
  {
    Tensor row = randn({1, k}, gen, kFloat64);
    Tensor ae = row.expand({m, k});
    cases.push_back({ae, b});
  }
  for (size_t i = 0; i < cases.size(); ++i) {
    auto [x, y] = cases[i];
    const int64_t kk = x.size(1);
    std::vector<double> w = naive_mm(values(x), values(y), m, kk, n);
    expect_values(matmul(x, y), {m, n}, w, 1e-12, "case " + std::to_string(i));
  }
  // The sliced-view case has the same values as a, so the same product.
  expect_values(matmul(cases[4].first, b), {m, n}, want, 1e-12, "sliced");
}

// Transposed and row-sliced operands go to BLAS as views with transpose flags: the product
// allocates its output and nothing else. A column step of 2 fits neither layout and is copied.
TEST(Matmul, TransposedOperandsAreNotCopied) {
  Generator gen(12);
  Tensor at = randn({9, 7}, gen).t(), bt = randn({5, 9}, gen).t();  // (7, 9), (9, 5)
  Tensor rows = randn({10, 9}, gen).narrow(0, 2, 7);                // ld 9, offset
  Tensor cols = randn({7, 12}, gen).narrow(1, 1, 9);                // ld 12 > 9
  Tensor batched = randn({2, 9, 7}, gen).transpose(1, 2);           // (2, 7, 9)
  Tensor stepped = randn({7, 18}, gen).slice(1, 0, 18, 2);          // column step 2
  auto allocations_of = [](const std::function<void()>& f) {
    const int64_t before = cpu_allocator_stats().allocations;
    f();
    return cpu_allocator_stats().allocations - before;
  };
  EXPECT_EQ(allocations_of([&] { matmul(at, bt); }), 1);
  EXPECT_EQ(allocations_of([&] { matmul(rows, bt); }), 1);
  EXPECT_EQ(allocations_of([&] { matmul(cols, bt.t().t()); }), 1);
  EXPECT_EQ(allocations_of([&] { matmul(batched, bt); }), 1);
  EXPECT_EQ(allocations_of([&] { matmul(randn({9}, gen), bt); }), 2);  // randn + output
  EXPECT_EQ(allocations_of([&] { matmul(stepped, bt); }), 2);          // the copy + output
  Tensor w = randn({5, 9}, gen), wt = randn({9, 5}, gen).t(), b = randn({5}, gen);
  EXPECT_EQ(allocations_of([&] { linear(at, w, b); }), 1);
  EXPECT_EQ(allocations_of([&] { linear(at, wt, b); }), 1);
  EXPECT_EQ(allocations_of([&] { linear(randn({2, 3, 9}, gen), w); }), 2);  // randn + output
}

TEST(Matmul, OneDimensionalOperands) {
  Generator gen(3);
  Tensor v = randn({7}, gen, kFloat64), w = randn({7}, gen, kFloat64);
  Tensor mat = randn({7, 4}, gen, kFloat64), mat2 = randn({5, 7}, gen, kFloat64);
  double dot = 0;
  for (int64_t i = 0; i < 7; ++i) dot += v.at({i}) * w.at({i});
  Tensor d = matmul(v, w);
  EXPECT_EQ(d.dim(), 0);
  EXPECT_NEAR(d.item(), dot, 1e-12);
  // vec @ mat -> (4); mat @ vec -> (5).
  expect_values(matmul(v, mat), {4}, naive_mm(values(v), values(mat), 1, 7, 4), 1e-12, "v@M");
  expect_values(matmul(mat2, v), {5}, naive_mm(values(mat2), values(v), 5, 7, 1), 1e-12, "M@v");
  // A strided vector.
  Tensor vs = non_contiguous(v);
  expect_values(matmul(vs, mat), {4}, naive_mm(values(v), values(mat), 1, 7, 4), 1e-12, "vs@M");
  // batched @ vec -> (3, 5); vec @ batched -> (3, 4).
  Tensor batch = randn({3, 5, 7}, gen, kFloat64);
  Tensor r = matmul(batch, v);
  ASSERT_EQ(r.shape(), (Dims{3, 5}));
  for (int64_t b = 0; b < 3; ++b)
    for (int64_t i = 0; i < 5; ++i) {
      double acc = 0;
      for (int64_t p = 0; p < 7; ++p) acc += batch.at({b, i, p}) * v.at({p});
      EXPECT_NEAR(r.at({b, i}), acc, 1e-12);
    }
  Tensor batch2 = randn({3, 7, 4}, gen, kFloat64);
  Tensor r2 = matmul(v, batch2);
  ASSERT_EQ(r2.shape(), (Dims{3, 4}));
  for (int64_t b = 0; b < 3; ++b)
    for (int64_t j = 0; j < 4; ++j) {
      double acc = 0;
      for (int64_t p = 0; p < 7; ++p) acc += v.at({p}) * batch2.at({b, p, j});
      EXPECT_NEAR(r2.at({b, j}), acc, 1e-12);
    }
}

TEST(Matmul, BatchedWithBroadcasting) {
  Generator gen(4);
  struct Case {
    Tensor a, b;
  };
  std::vector<Case> cases = {
      {randn({2, 1, 3, 4}, gen, kFloat64), randn({5, 4, 6}, gen, kFloat64)},
      {randn({3, 4}, gen, kFloat64), randn({2, 4, 5}, gen, kFloat64)},
      {randn({2, 3, 4}, gen, kFloat64), randn({4, 5}, gen, kFloat64)},     // one gemm
      {randn({2, 3, 7, 4}, gen, kFloat64), randn({4, 1}, gen, kFloat64)},  // one gemm, n = 1
      {randn({2, 3, 4}, gen, kFloat64), randn({2, 4, 5}, gen, kFloat64)},  // plain bmm
      {randn({1, 3, 4}, gen, kFloat64), randn({6, 4, 2}, gen, kFloat64)},
      {randn({4, 3, 1023}, gen, kFloat64), randn({1023, 2}, gen, kFloat64)},
  };
  // Transposed matrices inside a batch, a permuted batch, an expanded batch.
  cases.push_back({randn({2, 4, 3}, gen, kFloat64).transpose(1, 2),
                   randn({2, 5, 4}, gen, kFloat64).transpose(1, 2)});
  cases.push_back({randn({3, 2, 4}, gen, kFloat64).transpose(0, 1), randn({4, 5}, gen, kFloat64)});
  cases.push_back(
      {randn({3, 4}, gen, kFloat64).expand({6, 3, 4}), randn({6, 4, 2}, gen, kFloat64)});
  cases.push_back(
      {randn({2, 3, 4}, gen, kFloat64).slice(1, 0, 3, 2), randn({4, 5}, gen, kFloat64)});
  for (size_t i = 0; i < cases.size(); ++i) {
    Dims shape;
    std::vector<double> want = naive_bmm(cases[i].a, cases[i].b, &shape);
    expect_values(matmul(cases[i].a, cases[i].b), shape, want, 1e-12,
                  "case " + std::to_string(i) + " " + cases[i].a.shape().str() + " @ " +
                      cases[i].b.shape().str());
  }
}

// Enough small products that the batch is split across threads (Note [Batched GEMM threading] in
// src/ops/cpu/gemm.cpp).
TEST(Matmul, ManySmallBatchedProducts) {
  Generator gen(13);
  const int64_t nb = 600, m = 17, k = 32, n = 31;
  for (bool transposed : {false, true}) {
    Tensor a = transposed ? randn({nb, k, m}, gen, kFloat64).transpose(1, 2)
                          : randn({nb, m, k}, gen, kFloat64);
    Tensor b = randn({nb, k, n}, gen, kFloat64);
    std::vector<double> av = a.contiguous().to_vector<double>(), bv = b.to_vector<double>();
    std::vector<double> want;
    for (int64_t i = 0; i < nb; ++i) {
      std::vector<double> am(av.begin() + i * m * k, av.begin() + (i + 1) * m * k);
      std::vector<double> bm(bv.begin() + i * k * n, bv.begin() + (i + 1) * k * n);
      std::vector<double> cm = naive_mm(am, bm, m, k, n);
      want.insert(want.end(), cm.begin(), cm.end());
    }
    for (int threads : {1, 2}) {
      const int prev = get_num_threads();
      set_num_threads(threads);
      Tensor c = matmul(a, b);
      set_num_threads(prev);
      expect_values(c, {nb, m, n}, want, 1e-12, "threads " + std::to_string(threads));
    }
  }
}

TEST(Matmul, HalfTypesComputeInFloat) {
  Generator gen(5);
  for (DType dt : {DType::bf16, DType::f16}) {
    Tensor a = randn({5, 33}, gen).to(dt), b = randn({33, 3}, gen).to(dt);
    Tensor c = matmul(a, b);
    EXPECT_EQ(c.dtype(), dt);
    // The reference rounds the exact product of the rounded inputs once.
    std::vector<double> want = naive_mm(values(a), values(b), 5, 33, 3);
    expect_values(c, {5, 3}, want, 1e-2, std::string(dtype_name(dt)));
  }
}

// ---- matmul: gradients ----

TEST(Matmul, Gradcheck) {
  Generator gen(6);
  auto mm = [](const std::vector<Tensor>& in) { return matmul(in[0], in[1]); };
  auto leaf = [&](const Dims& s) { return randn(s, gen, kFloat64).requires_grad_(); };
  expect_gradcheck(mm, {leaf({3, 4}), leaf({4, 5})});
  // Non-contiguous leaves: transposed views.
  expect_gradcheck(mm, {randn({4, 3}, gen, kFloat64).t().detach().requires_grad_(),
                        randn({5, 4}, gen, kFloat64).t().detach().requires_grad_()});
  // 1-D operands.
  expect_gradcheck(mm, {leaf({4}), leaf({4})});
  expect_gradcheck(mm, {leaf({4}), leaf({4, 3})});
  expect_gradcheck(mm, {leaf({3, 4}), leaf({4})});
  expect_gradcheck(mm, {leaf({2, 3, 4}), leaf({4})});
  expect_gradcheck(mm, {leaf({4}), leaf({2, 4, 3})});
  // Broadcast batch dims, both ways.
  expect_gradcheck(mm, {leaf({2, 1, 3, 4}), leaf({3, 4, 2})});
  expect_gradcheck(mm, {leaf({3, 4}), leaf({2, 4, 5})});
  expect_gradcheck(mm, {leaf({2, 3, 4}), leaf({4, 5})});  // dB folds the batch into one gemm
  expect_gradcheck(mm, {leaf({1, 3, 4}), leaf({2, 4, 5})});
  // Only one input requires grad.
  expect_gradcheck(mm, {leaf({3, 4}), randn({4, 2}, gen, kFloat64)});
  expect_gradcheck(mm, {randn({2, 3, 4}, gen, kFloat64), leaf({4, 2})});
}

TEST(Matmul, GradientValuesAgainstFormula) {
  // dA = G @ B^T and dB = A^T @ G for a plain product with an all-ones upstream gradient.
  Generator gen(7);
  Tensor a = randn({7, 5}, gen, kFloat64).requires_grad_();
  Tensor b = randn({5, 3}, gen, kFloat64).requires_grad_();
  sum(matmul(a, b)).backward();
  for (int64_t i = 0; i < 7; ++i)
    for (int64_t p = 0; p < 5; ++p) {
      double want = 0;
      for (int64_t j = 0; j < 3; ++j) want += b.at({p, j});
      EXPECT_NEAR(a.grad().at({i, p}), want, 1e-12);
    }
  for (int64_t p = 0; p < 5; ++p)
    for (int64_t j = 0; j < 3; ++j) {
      double want = 0;
      for (int64_t i = 0; i < 7; ++i) want += a.at({i, p});
      EXPECT_NEAR(b.grad().at({p, j}), want, 1e-12);
    }
}

// ---- matmul: errors ----

TEST(Matmul, Errors) {
  Tensor a = zeros({64, 784}), b = zeros({512, 10});
  try {
    matmul(a, b);
    ADD_FAILURE() << "expected lockstep::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.message(),
              "matmul: shapes [64, 784] and [512, 10] cannot be multiplied (784 != 512)");
  }
  expect_error([] { matmul(zeros({3}), zeros({4})); }, {"matmul", "[3]", "[4]", "3 != 4"});
  expect_error([] { matmul(zeros({2, 3}), zeros({3, 4}, kFloat64)); }, {"matmul", "f32", "f64"});
  expect_error(
      [] {
        matmul(zeros({2, 2, 3}), zeros({3, 3, 4}));
      },
      {"matmul", "[2, 2, 3]", "[3, 3, 4]", "broadcast"});
  expect_error([] { matmul(zeros({}), zeros({3})); }, {"matmul", "[]", "[3]"});
  expect_error([] { matmul(zeros({2, 3}, kInt64), zeros({3, 4}, kInt64)); }, {"matmul", "i64"});
}

// ---- linear ----

namespace {

// y[r, o] = sum_i x[r, i] w[o, i] + b[o], x given as rows.
std::vector<double> naive_linear(const std::vector<double>& x, const std::vector<double>& w,
                                 const std::vector<double>* b, int64_t rows, int64_t in,
                                 int64_t out) {
  std::vector<double> y(static_cast<size_t>(rows * out));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < out; ++o) {
      double acc = b ? (*b)[o] : 0.0;
      for (int64_t i = 0; i < in; ++i) acc += x[r * in + i] * w[o * in + i];
      y[r * out + o] = acc;
    }
  return y;
}

}  // namespace

TEST(Linear, ValuesOddSizesWithAndWithoutBias) {
  Generator gen(8);
  const std::vector<std::array<int64_t, 3>> sizes = {{1, 1, 1},    {7, 5, 3},    {1023, 7, 5},
                                                     {3, 1023, 2}, {4, 6, 1023}, {5, 1, 7}};
  for (DType dt : {kFloat32, kFloat64}) {
    for (auto [rows, in, out] : sizes) {
      Tensor x = randn({rows, in}, gen, dt), w = randn({out, in}, gen, dt),
             b = randn({out}, gen, dt);
      std::vector<double> bv = values(b);
      const std::string what = Dims{rows, in, out}.str() + " " + std::string(dtype_name(dt));
      expect_values(linear(x, w, b), {rows, out},
                    naive_linear(values(x), values(w), &bv, rows, in, out), tol_for(dt, in),
                    what + " bias");
      expect_values(linear(x, w), {rows, out},
                    naive_linear(values(x), values(w), nullptr, rows, in, out), tol_for(dt, in),
                    what + " no bias");
    }
  }
}

TEST(Linear, NonContiguousAndBatchedInputs) {
  Generator gen(9);
  const int64_t in = 6, out = 4;
  Tensor w = randn({out, in}, gen, kFloat64), b = randn({out}, gen, kFloat64);
  std::vector<double> wv = values(w), bv = values(b);
  // x (2, 3, in): leading dims flatten into rows.
  Tensor x3 = randn({2, 3, in}, gen, kFloat64);
  expect_values(linear(x3, w, b), {2, 3, out}, naive_linear(values(x3), wv, &bv, 6, in, out), 1e-12,
                "3-D x");
  // 1-D x.
  Tensor x1 = randn({in}, gen, kFloat64);
  expect_values(linear(x1, w, b), {out}, naive_linear(values(x1), wv, &bv, 1, in, out), 1e-12,
                "1-D x");
  // Transposed x, transposed weight (w given as (in, out).t()), strided bias.
  Tensor x = randn({5, in}, gen, kFloat64);
  std::vector<double> want = naive_linear(values(x), wv, &bv, 5, in, out);
  Tensor xt = non_contiguous(x), wt = non_contiguous(w), bs = non_contiguous(b);
  ASSERT_FALSE(xt.is_contiguous());
  ASSERT_FALSE(wt.is_contiguous());
  ASSERT_FALSE(bs.is_contiguous());
  expect_values(linear(xt, w, b), {5, out}, want, 1e-12, "x transposed");
  expect_values(linear(x, wt, b), {5, out}, want, 1e-12, "w transposed");
  expect_values(linear(x, w, bs), {5, out}, want, 1e-12, "bias strided");
  expect_values(linear(xt, wt, bs), {5, out}, want, 1e-12, "all strided");
  // A permuted 3-D x that cannot be viewed as rows (copied).
  Tensor xp = randn({3, 2, in}, gen, kFloat64).transpose(0, 1);
  expect_values(linear(xp, w, b), {2, 3, out}, naive_linear(values(xp), wv, &bv, 6, in, out), 1e-12,
                "permuted 3-D x");
}

TEST(Linear, HalfTypes) {
  Generator gen(10);
  for (DType dt : {DType::bf16, DType::f16}) {
    Tensor x = randn({4, 9}, gen).to(dt), w = randn({3, 9}, gen).to(dt), b = randn({3}, gen).to(dt);
    std::vector<double> bv = values(b);
    Tensor y = linear(x, w, b);
    EXPECT_EQ(y.dtype(), dt);
    expect_values(y, {4, 3}, naive_linear(values(x), values(w), &bv, 4, 9, 3), 1e-2,
                  std::string(dtype_name(dt)));
  }
}

TEST(Linear, Gradcheck) {
  Generator gen(11);
  auto lin = [](const std::vector<Tensor>& in) { return linear(in[0], in[1], in[2]); };
  auto lin_nb = [](const std::vector<Tensor>& in) { return linear(in[0], in[1]); };
  auto leaf = [&](const Dims& s) { return randn(s, gen, kFloat64).requires_grad_(); };
  expect_gradcheck(lin, {leaf({5, 3}), leaf({4, 3}), leaf({4})});
  expect_gradcheck(lin_nb, {leaf({5, 3}), leaf({4, 3})});
  expect_gradcheck(lin, {leaf({2, 3, 3}), leaf({4, 3}), leaf({4})});
  expect_gradcheck(lin, {leaf({3}), leaf({4, 3}), leaf({4})});
  // Non-contiguous leaves.
  expect_gradcheck(lin, {randn({3, 5}, gen, kFloat64).t().detach().requires_grad_(),
                         randn({3, 4}, gen, kFloat64).t().detach().requires_grad_(),
                         randn({8}, gen, kFloat64).slice(0, 0, 8, 2).detach().requires_grad_()});
  // Only some inputs need a gradient.
  expect_gradcheck(lin, {randn({5, 3}, gen, kFloat64), leaf({4, 3}), randn({4}, gen, kFloat64)});
  expect_gradcheck(lin, {leaf({5, 3}), randn({4, 3}, gen, kFloat64), leaf({4})});
}

TEST(Linear, Errors) {
  try {
    linear(zeros({64, 784}), zeros({10, 512}));
    ADD_FAILURE() << "expected lockstep::Error";
  } catch (const Error& e) {
    EXPECT_THAT(e.message(),
                ::testing::StartsWith("linear: shapes [64, 784] and [10, 512] cannot be multiplied "
                                      "(784 != 512"));
  }
  expect_error(
      [] {
        linear(zeros({2, 3}), zeros({4, 3}), zeros({5}));
      },
      {"linear", "bias", "[5]", "[4, 3]"});
  expect_error([] { linear(zeros({2, 3}), zeros({4, 3}, kFloat64)); }, {"linear", "f32", "f64"});
  expect_error([] { linear(zeros({2, 3}), zeros({3})); }, {"linear", "2-D", "[3]"});
}

// A tensor on a device this build has no kernels for fails in the kernel lookup, naming the op.
TEST(Linalg, TensorOnAnotherDeviceFailsNamingOpAndDevice) {
  if (cuda::compiled_with_cuda())
    GTEST_SKIP() << "this build has CUDA kernels, which would run on the borrowed host memory; "
                    "tests/cuda/ checks ops on cuda:0 (and tests/cuda/no_cuda_test.cpp the "
                    "CPU-only build's errors)";
  std::vector<float> data(12);
  const Tensor a = borrow(data.data(), {3, 4}, kFloat32, cuda_device(0));
  const Tensor b = borrow(data.data(), {4, 3}, kFloat32, cuda_device(0));
  expect_error([&] { matmul(a, b); }, {"matmul", "cuda:0"});
  expect_error([&] { linear(a, a); }, {"linear", "cuda:0"});
  expect_error([&] { matmul(a, zeros({4, 3})); }, {"matmul", "different devices"});
}
