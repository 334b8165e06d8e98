// max_pool2d and avg_pool2d against naive nested-loop references; -inf padding, NaN,
// count_include_pad, layouts, odd sizes; gradients; errors.
#include <cmath>
#include <limits>
#include <vector>

#include "lockstep/tensor/cuda.h"
#include "testing.h"

using namespace lockstep;
using lockstep::testing::expect_close;
using lockstep::testing::expect_error;
using lockstep::testing::expect_gradcheck;
using lockstep::testing::non_contiguous;
using lockstep::testing::values;

namespace {

struct PoolCase {
  Dims shape;
  Pool2dOptions opts;
};

struct NaivePool {
  std::vector<double> out;
  Dims shape;
};

// Windows over a zero/-inf padded plane; avg divides by kh * kw (padding counted).
NaivePool naive_pool(const std::vector<double>& x, const Dims& xs, const Pool2dOptions& o,
                     bool is_max) {
  const int64_t nd = xs.size();
  const int64_t H = xs[nd - 2], W = xs[nd - 1];
  const int64_t planes = xs.numel() / (H * W);
  const int64_t sh = o.stride_h ? o.stride_h : o.kernel_h;
  const int64_t sw = o.stride_w ? o.stride_w : o.kernel_w;
  const int64_t Ho = (H + 2 * o.pad_h - o.kernel_h) / sh + 1;
  const int64_t Wo = (W + 2 * o.pad_w - o.kernel_w) / sw + 1;
  NaivePool r;
  r.shape = xs;
  r.shape[nd - 2] = Ho;
  r.shape[nd - 1] = Wo;
  for (int64_t p = 0; p < planes; ++p)
    for (int64_t y = 0; y < Ho; ++y)
      for (int64_t xo = 0; xo < Wo; ++xo) {
        double best = -std::numeric_limits<double>::infinity(), acc = 0;
        for (int64_t i = 0; i < o.kernel_h; ++i)
          for (int64_t j = 0; j < o.kernel_w; ++j) {
            const int64_t h = y * sh - o.pad_h + i, w = xo * sw - o.pad_w + j;
            const bool in = h >= 0 && h < H && w >= 0 && w < W;
            const double v = in ? x[(p * H + h) * W + w] : 0.0;
            if (in) best = std::max(best, v);
            acc += v;
          }
        r.out.push_back(is_max ? best : acc / static_cast<double>(o.kernel_h * o.kernel_w));
      }
  return r;
}

std::vector<PoolCase> cases() {
  return {
      {{2, 3, 8, 8}, Pool2dOptions::square(2)},        // stride = kernel
      {{2, 3, 7, 7}, Pool2dOptions::square(2)},        // floor drops the last row
      {{1, 2, 7, 9}, Pool2dOptions::square(3, 2, 1)},  // stride 2, padding
      {{2, 1, 7, 8}, {3, 2, 1, 2, 1, 0}},              // rectangular
      {{1, 1, 1, 1}, Pool2dOptions::square(1)},        // a single element
      {{3, 7, 5}, Pool2dOptions::square(2, 1)},        // unbatched (C, H, W), overlap
      {{1, 2, 1, 1023}, {1, 3, 1, 2, 0, 1}},           // long row
      {{1, 1, 4, 4}, Pool2dOptions::square(4)},        // kernel = input
      {{1, 1, 5, 5}, Pool2dOptions::square(2, 3, 1)},  // stride > kernel
  };
}

}  // namespace

TEST(Pool2d, MatchesNaiveReference) {
  Generator gen(21);
  for (const PoolCase& cs : cases()) {
    for (DType dt : {kFloat32, kFloat64}) {
      Tensor x = randn(cs.shape, gen, dt);
      for (const Tensor& in : {x, non_contiguous(x)}) {
        for (bool is_max : {true, false}) {
          const NaivePool want = naive_pool(values(x), x.shape(), cs.opts, is_max);
          Tensor y = is_max ? max_pool2d(in, cs.opts) : avg_pool2d(in, cs.opts);
          ASSERT_EQ(y.shape(), want.shape) << cs.shape;
          ASSERT_EQ(y.dtype(), dt);
          expect_close(values(y), want.out, dt == kFloat32 ? 1e-6 : 1e-13,
                       std::string(is_max ? "max " : "avg ") + cs.shape.str() +
                           (in.is_contiguous() ? "" : " strided"));
        }
      }
    }
  }
}

TEST(Pool2d, MaxPaddingIsMinusInfinity) {
  // All values negative: zero padding would win every border window.
  Generator gen(22);
  Tensor x = sub(rand({1, 1, 5, 5}, gen), 2.0);  // in [-2, -1)
  Tensor y = max_pool2d(x, Pool2dOptions::square(3, 2, 1));
  for (double v : values(y)) EXPECT_LT(v, -0.999);
}

TEST(Pool2d, MaxPropagatesNaN) {
  Tensor x = zeros({1, 1, 4, 4});
  x.set_at({0, 0, 1, 2}, std::nan(""));
  Tensor y = max_pool2d(x, Pool2dOptions::square(2));
  EXPECT_TRUE(std::isnan(y.at({0, 0, 0, 1})));
  EXPECT_EQ(y.at({0, 0, 0, 0}), 0.0);
  EXPECT_EQ(y.at({0, 0, 1, 1}), 0.0);
}

TEST(Pool2d, AvgCountsPadding) {
  Tensor x = ones({1, 1, 2, 2});
  Tensor y = avg_pool2d(x, Pool2dOptions::square(2, 1, 1));  // 3x3 windows of one real element+
  ASSERT_EQ(y.shape(), Dims({1, 1, 3, 3}));
  EXPECT_DOUBLE_EQ(y.at({0, 0, 0, 0}), 0.25);
  EXPECT_DOUBLE_EQ(y.at({0, 0, 0, 1}), 0.5);
  EXPECT_DOUBLE_EQ(y.at({0, 0, 1, 1}), 1.0);
}

TEST(Pool2d, MaxBackwardRoutesToArgmax) {
  // Overlapping windows: an element that wins two windows gets both gradients.
  Tensor x = zeros({1, 1, 3, 3}, kFloat64);
  x.set_at({0, 0, 1, 1}, 5.0);
  x.set_at({0, 0, 0, 0}, 1.0);
  x.requires_grad_();
  Tensor y = max_pool2d(x, Pool2dOptions::square(2, 1));  // 2x2 output, all windows hold (1, 1)
  Tensor g = from_vector<double>({1, 2, 3, 4}, {1, 1, 2, 2});
  y.backward(g);
  EXPECT_DOUBLE_EQ(x.grad().at({0, 0, 1, 1}), 10.0);
  EXPECT_DOUBLE_EQ(sum(x.grad()).item(), 10.0);
}

TEST(Pool2d, Gradcheck) {
  Generator gen(23);
  for (const PoolCase& cs : cases()) {
    if (cs.shape.numel() > 200) continue;
    // Non-contiguous leaf: the values of a transposed buffer.
    Tensor base = randn(cs.shape, gen, kFloat64);
    Tensor x = non_contiguous(base).detach().requires_grad_();
    expect_gradcheck([&](const std::vector<Tensor>& in) { return max_pool2d(in[0], cs.opts); },
                     {x});
    expect_gradcheck([&](const std::vector<Tensor>& in) { return avg_pool2d(in[0], cs.opts); },
                     {x});
  }
  Tensor p = randn({2, 6, 5, 3}, gen, kFloat64).permute({0, 3, 1, 2}).detach().requires_grad_();
  ASSERT_FALSE(p.is_contiguous());
  expect_gradcheck(
      [&](const std::vector<Tensor>& in) {
        return max_pool2d(in[0], Pool2dOptions::square(3, 2, 1));
      },
      {p});
  expect_gradcheck(
      [&](const std::vector<Tensor>& in) {
        return avg_pool2d(in[0], Pool2dOptions::square(3, 2, 1));
      },
      {p});
}

TEST(Pool2d, HalfPrecision) {
  Generator gen(24);
  Tensor x = randn({2, 2, 6, 6}, gen);
  for (DType dt : {kBFloat16, kFloat16}) {
    Tensor xh = x.to(dt).requires_grad_();
    Tensor m = max_pool2d(xh);
    Tensor a = avg_pool2d(xh);
    EXPECT_EQ(m.dtype(), dt);
    expect_close(values(m), values(max_pool2d(x.to(dt).to(kFloat32))), 0, "half max");
    expect_close(values(a), values(avg_pool2d(x)), 0.02, "half avg");
    add(sum(m), sum(a)).backward();
    EXPECT_EQ(xh.grad().dtype(), dt);
  }
}

TEST(Pool2d, Errors) {
  expect_error(
      [] {
        max_pool2d(zeros({1, 1, 2, 2}), Pool2dOptions::square(3));
      },
      {"max_pool2d:", "smaller than the kernel 3x3", "[1, 1, 2, 2]"});
  expect_error(
      [] {
        avg_pool2d(zeros({1, 1, 8, 8}), Pool2dOptions::square(2, 1, 2));
      },
      {"avg_pool2d: padding (2, 2) must be between 0 and half the kernel 2x2"});
  expect_error(
      [] {
        max_pool2d(zeros({8, 8}));
      },
      {"max_pool2d: expected input of shape (N, C, H, W) or (C, H, W), got [8, 8]"});
  expect_error(
      [] {
        avg_pool2d(zeros({1, 1, 8, 8}, kInt32));
      },
      {"avg_pool2d: expected a floating-point input, got i32"});
  expect_error(
      [] {
        max_pool2d(zeros({1, 1, 8, 8}), Pool2dOptions::square(0));
      },
      {"max_pool2d: kernel size must be positive"});
  expect_error(
      [] {
        max_pool2d(zeros({1, 1, 8, 8}), Pool2dOptions::square(2, -1));
      },
      {"max_pool2d: stride must be non-negative"});
}

TEST(Pool2d, ParallelPlanesMatchReference) {
  const int prev = get_num_threads();
  set_num_threads(4);
  Generator gen(25);
  Tensor x = randn({4, 16, 64, 63}, gen);
  for (bool is_max : {true, false}) {
    const auto opts = Pool2dOptions::square(3, 2, 1);
    const NaivePool want = naive_pool(values(x), x.shape(), opts, is_max);
    Tensor y = is_max ? max_pool2d(x, opts) : avg_pool2d(x, opts);
    ASSERT_EQ(y.shape(), want.shape);
    expect_close(values(y), want.out, 1e-6, is_max ? "max" : "avg");
  }
  set_num_threads(prev);
}

TEST(Pool2d, TensorOnAnotherDeviceFailsNamingOpAndDevice) {
  if (cuda::compiled_with_cuda())
    GTEST_SKIP() << "this build has CUDA kernels, which would run on the borrowed host memory; "
                    "tests/cuda/ checks ops on cuda:0 (and tests/cuda/no_cuda_test.cpp the "
                    "CPU-only build's errors)";
  std::vector<float> data(16);
  const Tensor x = borrow(data.data(), {1, 4, 4}, kFloat32, cuda_device(0));
  lockstep::testing::expect_error([&] { max_pool2d(x); }, {"max_pool2d", "cuda:0"});
  lockstep::testing::expect_error([&] { avg_pool2d(x); }, {"avg_pool2d", "cuda:0"});
}
