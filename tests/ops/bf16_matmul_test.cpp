// bf16 matrix products (oneDNN where the build and the CPU have it, Note [bf16 GEMM] in
// src/ops/cpu/bf16_gemm.cpp): every operand layout BLAS takes, batches, linear with and without
// bias, and gradients, against a double-precision product of the same bf16 values.
#include <fstream>
#include <sstream>
#include <thread>

#include "testing.h"

using namespace lockstep;

namespace {

bool cpu_has_bf16_instructions() {
  std::ifstream in("/proc/cpuinfo");
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string s = ss.str();
  return s.find(" avx512_bf16") != std::string::npos || s.find(" amx_bf16") != std::string::npos;
}

Tensor rand_bf16(const Dims& shape, uint64_t seed) {
  Generator gen(seed);
  return randn(shape, gen).to(kBFloat16);
}

// got (bf16) against the f64 product of the same bf16 inputs: one bf16 rounding of the result
// (2^-8 relative) plus f32 accumulation, scaled by the size of the terms.
void expect_bf16_close(const Tensor& got, const Tensor& want64, const std::string& what) {
  ASSERT_EQ(got.dtype(), kBFloat16) << what;
  ASSERT_EQ(got.shape(), want64.shape()) << what;
  const auto g = got.to_vector<double>(), w = want64.to_vector<double>();
  for (size_t i = 0; i < g.size(); ++i) {
    ASSERT_NEAR(g[i], w[i], std::abs(w[i]) * 0.008 + 0.02) << what << " element " << i;
  }
}

TEST(Bf16Matmul, UsesTheBf16KernelWhereTheCpuHasOne) {
  const std::string backend = bf16_matmul_backend();
#ifdef LOCKSTEP_EXPECT_ONEDNN
  if (cpu_has_bf16_instructions()) {
    EXPECT_EQ(backend.rfind("oneDNN", 0), 0u) << backend;
    EXPECT_EQ(backend.find("ref"), std::string::npos) << backend;
  }
#endif
  EXPECT_FALSE(backend.empty());
}

TEST(Bf16Matmul, EveryLayoutMatchesTheDoubleProduct) {
  const Tensor a = rand_bf16({37, 53}, 1), b = rand_bf16({53, 29}, 2);
  const Tensor at = rand_bf16({53, 37}, 3), bt = rand_bf16({29, 53}, 4);
  auto ref = [](const Tensor& x, const Tensor& y) {
    return matmul(x.to(kFloat64), y.to(kFloat64));
  };
  expect_bf16_close(matmul(a, b), ref(a, b), "a @ b");
  expect_bf16_close(matmul(at.t(), b), ref(at.t(), b), "a^T view @ b");
  expect_bf16_close(matmul(a, bt.t()), ref(a, bt.t()), "a @ b^T view");
  expect_bf16_close(matmul(at.t(), bt.t()), ref(at.t(), bt.t()), "both transposed");
  const Tensor rows = rand_bf16({80, 53}, 5).narrow(0, 10, 37);  // a row slice
  expect_bf16_close(matmul(rows, b), ref(rows, b), "row slice");
  const Tensor cols = rand_bf16({37, 106}, 6).narrow(1, 0, 53);  // ld > cols
  expect_bf16_close(matmul(cols, b), ref(cols, b), "wider leading dimension");
  const Tensor v = rand_bf16({53}, 7);
  expect_bf16_close(matmul(a, v), ref(a, v), "matrix @ vector");
  expect_bf16_close(matmul(v, b), ref(v, b), "vector @ matrix");
}

TEST(Bf16Matmul, BatchesBroadcastAndMatchTheDoubleProduct) {
  const Tensor a = rand_bf16({3, 1, 8, 16}, 8), b = rand_bf16({4, 16, 5}, 9);
  expect_bf16_close(matmul(a, b), matmul(a.to(kFloat64), b.to(kFloat64)), "broadcast batch");
  const Tensor w = rand_bf16({16, 5}, 10);
  expect_bf16_close(matmul(a, w), matmul(a.to(kFloat64), w.to(kFloat64)), "shared matrix");
}

TEST(Bf16Matmul, LinearWithAndWithoutBias) {
  const Tensor x = rand_bf16({2, 33, 64}, 11), w = rand_bf16({48, 64}, 12), b = rand_bf16({48}, 13);
  const Tensor want = linear(x.to(kFloat64), w.to(kFloat64), b.to(kFloat64));
  expect_bf16_close(linear(x, w, b), want, "linear + bias");
  expect_bf16_close(linear(x, w), linear(x.to(kFloat64), w.to(kFloat64)), "linear");
}

TEST(Bf16Matmul, GradientsMatchTheDoubleModel) {
  const Tensor x = rand_bf16({24, 40}, 14), w0 = rand_bf16({30, 40}, 15), b0 = rand_bf16({30}, 16);
  Tensor w = w0.detach().requires_grad_(), b = b0.detach().requires_grad_();
  sum(linear(x, w, b)).backward();
  Tensor w64 = w0.to(kFloat64).requires_grad_(), b64 = b0.to(kFloat64).requires_grad_();
  sum(linear(x.to(kFloat64), w64, b64)).backward();
  expect_bf16_close(w.grad(), w64.grad(), "weight gradient");
  expect_bf16_close(b.grad(), b64.grad(), "bias gradient");
}

// The bias gradient sums a bf16 output gradient (read as bf16, contiguous or strided) in double
// and rounds once: exactly the f64 column sums of the same bf16 values, rounded to f32 then bf16.
TEST(Bf16Matmul, BiasGradientIsTheRoundedColumnSumOfTheBf16Gradient) {
  const Tensor x = rand_bf16({37, 40}, 17), w0 = rand_bf16({29, 40}, 18), b0 = rand_bf16({29}, 19);
  const Tensor g_rows = rand_bf16({37, 29}, 20), g_cols = rand_bf16({29, 37}, 21).t();
  for (const Tensor& g : {g_rows, g_cols}) {
    Tensor w = w0.detach().requires_grad_(), b = b0.detach().requires_grad_();
    linear(x, w, b).backward(g);
    const Tensor want = sum(g.to(kFloat64), Dims{0}).to(kFloat32).to(kBFloat16);
    ASSERT_EQ(b.grad().dtype(), kBFloat16);
    EXPECT_EQ(b.grad().to_vector<double>(), want.to_vector<double>())
        << (g.is_contiguous() ? "contiguous" : "strided") << " gradient";
  }
}

TEST(Bf16Matmul, EmptyShapes) {
  EXPECT_EQ(matmul(rand_bf16({0, 4}, 1), rand_bf16({4, 3}, 2)).shape(), Dims({0, 3}));
  const Tensor z = matmul(rand_bf16({2, 0}, 1), rand_bf16({0, 3}, 2));
  for (double v : z.to_vector<double>()) EXPECT_EQ(v, 0.0);
}

}  // namespace

namespace {

// conv2d on bf16 (Note [bf16 conv] in src/ops/cpu/conv.cpp): forward and the three gradients
// against the f64 conv of the same bf16 values, with padding, stride, dilation and groups.
TEST(Bf16Conv, ForwardAndGradientsMatchTheDoubleConv) {
  struct Case {
    Dims x, w;
    Conv2dOptions o;
  };
  const std::vector<Case> cases = {
      {{4, 3, 12, 12}, {8, 3, 3, 3}, {}},
      {{2, 4, 9, 11},
       {6, 2, 3, 2},
       {.stride_h = 2,
        .stride_w = 1,
        .pad_h = 1,
        .pad_w = 2,
        .dilation_h = 1,
        .dilation_w = 2,
        .groups = 2}},
      {{3, 1, 28, 28}, {32, 1, 3, 3}, {}},  // the CNN's first layer (K = 9)
  };
  for (size_t c = 0; c < cases.size(); ++c) {
    const Case& k = cases[c];
    const std::string what = "case " + std::to_string(c);
    const Tensor x0 = rand_bf16(k.x, 20 + c), w0 = rand_bf16(k.w, 30 + c),
                 b0 = rand_bf16({k.w[0]}, 40 + c);
    Tensor x = x0.detach().requires_grad_(), w = w0.detach().requires_grad_(),
           b = b0.detach().requires_grad_();
    Tensor y = conv2d(x, w, b, k.o);
    Tensor x64 = x0.to(kFloat64).requires_grad_(), w64 = w0.to(kFloat64).requires_grad_(),
           b64 = b0.to(kFloat64).requires_grad_();
    Tensor y64 = conv2d(x64, w64, b64, k.o);
    expect_bf16_close(y, y64.detach(), what + " output");
    // A fixed upstream gradient, rounded to bf16 for both.
    const Tensor g = rand_bf16(y.shape(), 50 + c);
    sum(mul(y, g)).backward();
    sum(mul(y64, g.to(kFloat64))).backward();
    expect_bf16_close(x.grad(), x64.grad(), what + " input gradient");
    expect_bf16_close(w.grad(), w64.grad(), what + " weight gradient");
    expect_bf16_close(b.grad(), b64.grad(), what + " bias gradient");
  }
}

}  // namespace

namespace {

// One cached primitive executed from several threads at once (DataParallel's replicas do this):
// every thread gets the single-threaded result.
TEST(Bf16Matmul, ConcurrentProductsOfOneShapeAgree) {
  const Tensor a = rand_bf16({64, 96}, 60), b = rand_bf16({96, 80}, 61);
  const std::vector<double> want = matmul(a, b).to_vector<double>();
  std::vector<int> mismatches(4, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 50; ++i) {
        if (matmul(a, b).to_vector<double>() != want) ++mismatches[t];
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < 4; ++t) EXPECT_EQ(mismatches[t], 0) << "thread " << t;
}

}  // namespace
