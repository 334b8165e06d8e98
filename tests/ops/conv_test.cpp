// conv2d against a naive nested-loop reference: stride, padding, dilation, groups, bias,
// layouts, odd sizes, batch chunking; gradients by reference and by finite differences; errors.
#include <cmath>
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

struct ConvCase {
  int64_t n, c, h, w, o, kh, kw;
  Conv2dOptions opts;
  bool bias;
};

int64_t out_size(int64_t in, int64_t k, int64_t stride, int64_t pad, int64_t dil) {
  return (in + 2 * pad - dil * (k - 1) - 1) / stride + 1;
}

// out[n][o][y][x] = b[o] + sum_{c in group, i, j} x[n][c][y*s - p + i*d][x*s - p + j*d]
// w[o][c'][i][j]
std::vector<double> naive_conv(const std::vector<double>& x, const Dims& xs,
                               const std::vector<double>& w, const Dims& ws,
                               const std::vector<double>* b, const Conv2dOptions& o) {
  const int64_t N = xs[0], C = xs[1], H = xs[2], W = xs[3];
  const int64_t O = ws[0], Cg = ws[1], KH = ws[2], KW = ws[3];
  const int64_t Og = O / o.groups;
  const int64_t Ho = out_size(H, KH, o.stride_h, o.pad_h, o.dilation_h);
  const int64_t Wo = out_size(W, KW, o.stride_w, o.pad_w, o.dilation_w);
  std::vector<double> out(N * O * Ho * Wo, 0.0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t oc = 0; oc < O; ++oc)
      for (int64_t y = 0; y < Ho; ++y)
        for (int64_t xo = 0; xo < Wo; ++xo) {
          double acc = b ? (*b)[oc] : 0.0;
          const int64_t g = oc / Og;
          for (int64_t cc = 0; cc < Cg; ++cc) {
            const int64_t c = g * Cg + cc;
            for (int64_t i = 0; i < KH; ++i)
              for (int64_t j = 0; j < KW; ++j) {
                const int64_t ih = y * o.stride_h - o.pad_h + i * o.dilation_h;
                const int64_t iw = xo * o.stride_w - o.pad_w + j * o.dilation_w;
                if (ih < 0 || ih >= H || iw < 0 || iw >= W) continue;
                acc += x[((n * C + c) * H + ih) * W + iw] * w[((oc * Cg + cc) * KH + i) * KW + j];
              }
          }
          out[((n * O + oc) * Ho + y) * Wo + xo] = acc;
        }
  (void)C;
  return out;
}

std::vector<ConvCase> cases() {
  return {
      {2, 3, 7, 7, 4, 3, 3, {}, true},                                 // plain 3x3
      {1, 1, 1, 1, 1, 1, 1, {}, false},                                // all ones
      {2, 3, 7, 9, 5, 3, 3, Conv2dOptions::square(2, 1), true},        // stride 2, padding
      {2, 2, 9, 8, 3, 3, 3, Conv2dOptions::square(1, 2, 2), false},    // dilation 2
      {2, 4, 6, 7, 6, 3, 2, Conv2dOptions::square(1, 1, 1, 2), true},  // groups 2
      {1, 4, 5, 5, 8, 3, 3, Conv2dOptions::square(2, 1, 1, 4), true},  // depthwise, x2 mult
      {3, 2, 5, 6, 3, 1, 1, {}, true},                                 // 1x1
      {1, 2, 7, 8, 2, 2, 3, {1, 2, 0, 1, 2, 1, 1}, true},              // rectangular everything
      {1, 1, 1, 1023, 2, 1, 3, Conv2dOptions::square(1, 1), true},     // long row
      {7, 1, 4, 4, 1, 4, 4, {}, false},                                // kernel = input
      {1, 6, 7, 7, 4, 3, 3, Conv2dOptions::square(2, 2, 2, 2), true},  // all of them
  };
}

}  // namespace

TEST(Conv2d, MatchesNaiveReference) {
  Generator gen(11);
  for (const ConvCase& cs : cases()) {
    for (DType dt : {kFloat32, kFloat64}) {
      Tensor x = randn({cs.n, cs.c, cs.h, cs.w}, gen, dt);
      Tensor w = randn({cs.o, cs.c / cs.opts.groups, cs.kh, cs.kw}, gen, dt);
      Tensor b = cs.bias ? randn({cs.o}, gen, dt) : Tensor();
      std::vector<double> bv = cs.bias ? values(b) : std::vector<double>();
      const auto want =
          naive_conv(values(x), x.shape(), values(w), w.shape(), cs.bias ? &bv : nullptr, cs.opts);
      const double tol = dt == kFloat32 ? 1e-4 : 1e-11;
      Tensor y = conv2d(x, w, b, cs.opts);
      ASSERT_EQ(y.shape(),
                Dims({cs.n, cs.o,
                      out_size(cs.h, cs.kh, cs.opts.stride_h, cs.opts.pad_h, cs.opts.dilation_h),
                      out_size(cs.w, cs.kw, cs.opts.stride_w, cs.opts.pad_w, cs.opts.dilation_w)}));
      ASSERT_EQ(y.dtype(), dt);
      expect_close(values(y), want, tol, "contiguous " + x.shape().str() + w.shape().str());
      // The same values through strided views of input and weight.
      Tensor y2 = conv2d(non_contiguous(x), non_contiguous(w), b, cs.opts);
      expect_close(values(y2), want, tol, "non-contiguous " + x.shape().str());
    }
  }
}

TEST(Conv2d, PermutedChannelsLastInput) {
  Generator gen(12);
  Tensor nhwc = randn({2, 5, 6, 3}, gen, kFloat64);
  Tensor x = nhwc.permute({0, 3, 1, 2});  // (2, 3, 5, 6), channels innermost in memory
  ASSERT_FALSE(x.is_contiguous());
  Tensor w = randn({4, 3, 3, 3}, gen, kFloat64);
  const auto opts = Conv2dOptions::square(2, 1);
  const auto want = naive_conv(values(x), x.shape(), values(w), w.shape(), nullptr, opts);
  expect_close(values(conv2d(x, w, Tensor(), opts)), want, 1e-11, "permuted");
}

TEST(Conv2d, BatchLargerThanOneColumnChunk) {
  // 60 samples x 8 channels x 3x3 x 64x64 outputs of f32 is ~70 MB of columns, more than one
  // chunk, so forward and the accumulated weight gradient cross a chunk boundary.
  Generator gen(13);
  Tensor x = randn({60, 8, 66, 66}, gen).requires_grad_();
  Tensor w = randn({2, 8, 3, 3}, gen).requires_grad_();
  Tensor b = randn({2}, gen).requires_grad_();
  Tensor y = conv2d(x, w, b);
  ASSERT_EQ(y.shape(), Dims({60, 2, 64, 64}));
  const std::vector<double> xv = x.to_vector<double>(), wv = w.to_vector<double>();
  const std::vector<double> bv = b.to_vector<double>();
  expect_close(y.to_vector<double>(), naive_conv(xv, x.shape(), wv, w.shape(), &bv, {}), 1e-4,
               "chunked forward");
  // sum(y) has dW[o][c][i][j] = sum over n, y, x of x[n][c][y + i][x + j].
  sum(y).backward();
  std::vector<double> dw(wv.size(), 0.0);
  for (int64_t c = 0; c < 8; ++c)
    for (int64_t i = 0; i < 3; ++i)
      for (int64_t j = 0; j < 3; ++j) {
        double acc = 0;
        for (int64_t n = 0; n < 60; ++n)
          for (int64_t yy = 0; yy < 64; ++yy)
            for (int64_t xx = 0; xx < 64; ++xx)
              acc += xv[((n * 8 + c) * 66 + yy + i) * 66 + xx + j];
        for (int64_t o = 0; o < 2; ++o) dw[((o * 8 + c) * 3 + i) * 3 + j] = acc;
      }
  expect_close(w.grad().to_vector<double>(), dw, 1e-4, "chunked dW");
  EXPECT_NEAR(b.grad().at({0}), 60.0 * 64 * 64, 1e-3);
  // dX[n][c][h][w] = sum over o and taps covering (h, w) of W: check the last sample's corner
  // (covered by tap (0, 0) only) and a middle element (all nine taps).
  double all_taps = 0;
  for (int64_t o = 0; o < 2; ++o)
    for (int64_t k = 0; k < 9; ++k) all_taps += wv[(o * 8 + 5) * 9 + k];
  EXPECT_NEAR(x.grad().at({59, 5, 0, 0}), wv[(0 * 8 + 5) * 9] + wv[(1 * 8 + 5) * 9], 1e-4);
  EXPECT_NEAR(x.grad().at({59, 5, 30, 30}), all_taps, 1e-4);
}

TEST(Conv2d, GradientsMatchNaiveReference) {
  // Backward for a random dy against the reference's loops run in reverse: every product
  // x[xi] * w[wi] that reaches y[yi] sends dy[yi] * w[wi] to dX[xi] and dy[yi] * x[xi] to dW[wi].
  Generator gen(14);
  for (const ConvCase& cs : cases()) {
    Tensor x = randn({cs.n, cs.c, cs.h, cs.w}, gen, kFloat64).requires_grad_();
    Tensor w = randn({cs.o, cs.c / cs.opts.groups, cs.kh, cs.kw}, gen, kFloat64).requires_grad_();
    Tensor b = randn({cs.o}, gen, kFloat64).requires_grad_();
    Tensor y = conv2d(x, w, b, cs.opts);
    Tensor dy = randn(y.shape(), gen, kFloat64);
    y.backward(dy);
    const auto dyv = values(dy), xv = values(x), wv = values(w);
    const int64_t O = cs.o, Cg = cs.c / cs.opts.groups, Og = O / cs.opts.groups;
    const int64_t Ho = y.shape()[2], Wo = y.shape()[3];
    const Conv2dOptions& o = cs.opts;
    std::vector<double> dx(xv.size(), 0.0), dw(wv.size(), 0.0), db(O, 0.0);
    for (int64_t n = 0; n < cs.n; ++n)
      for (int64_t oc = 0; oc < O; ++oc)
        for (int64_t yy = 0; yy < Ho; ++yy)
          for (int64_t xx = 0; xx < Wo; ++xx) {
            const double g = dyv[((n * O + oc) * Ho + yy) * Wo + xx];
            db[oc] += g;
            for (int64_t cc = 0; cc < Cg; ++cc)
              for (int64_t i = 0; i < cs.kh; ++i)
                for (int64_t j = 0; j < cs.kw; ++j) {
                  const int64_t c = (oc / Og) * Cg + cc;
                  const int64_t ih = yy * o.stride_h - o.pad_h + i * o.dilation_h;
                  const int64_t iw = xx * o.stride_w - o.pad_w + j * o.dilation_w;
                  if (ih < 0 || ih >= cs.h || iw < 0 || iw >= cs.w) continue;
                  const int64_t xi = ((n * cs.c + c) * cs.h + ih) * cs.w + iw;
                  const int64_t wi = ((oc * Cg + cc) * cs.kh + i) * cs.kw + j;
                  dx[xi] += g * wv[wi];
                  dw[wi] += g * xv[xi];
                }
          }
    expect_close(values(x.grad()), dx, 1e-11, "dX " + x.shape().str());
    expect_close(values(w.grad()), dw, 1e-11, "dW " + w.shape().str());
    expect_close(values(b.grad()), db, 1e-11, "db");
  }
}

TEST(Conv2d, Gradcheck) {
  Generator gen(15);
  // Stride 2, padding 1, dilation 2, groups 2, bias; a non-contiguous input leaf.
  Tensor x = randn({2, 6, 7, 4}, gen, kFloat64).permute({0, 3, 1, 2}).detach().requires_grad_();
  ASSERT_FALSE(x.is_contiguous());
  Tensor w = randn({4, 2, 3, 2}, gen, kFloat64).requires_grad_();
  Tensor b = randn({4}, gen, kFloat64).requires_grad_();
  const Conv2dOptions opts{2, 1, 1, 2, 2, 1, 2};
  expect_gradcheck([&](const std::vector<Tensor>& in) { return conv2d(in[0], in[1], in[2], opts); },
                   {x, w, b});
  // Without bias, plain options, odd sizes.
  Tensor x2 = randn({1, 1, 7, 1}, gen, kFloat64).requires_grad_();
  Tensor w2 = randn({3, 1, 3, 1}, gen, kFloat64).requires_grad_();
  expect_gradcheck([&](const std::vector<Tensor>& in) { return conv2d(in[0], in[1]); }, {x2, w2});
  // Only the weight needs a gradient.
  Tensor x3 = randn({2, 2, 5, 5}, gen, kFloat64);
  Tensor w3 = randn({2, 2, 2, 2}, gen, kFloat64).requires_grad_();
  expect_gradcheck(
      [&](const std::vector<Tensor>& in) {
        return conv2d(in[0], in[1], Tensor(), Conv2dOptions::square(2, 1));
      },
      {x3, w3});
}

TEST(Conv2d, HalfPrecisionComputesInFloat) {
  Generator gen(16);
  Tensor x = randn({2, 3, 6, 6}, gen);
  Tensor w = randn({4, 3, 3, 3}, gen);
  Tensor b = randn({4}, gen);
  Tensor ref = conv2d(x, w, b, Conv2dOptions::square(1, 1));
  for (DType dt : {kBFloat16, kFloat16}) {
    Tensor xh = x.to(dt).requires_grad_();
    Tensor y = conv2d(xh, w.to(dt), b.to(dt), Conv2dOptions::square(1, 1));
    EXPECT_EQ(y.dtype(), dt);
    // Inputs rounded to 8 (bf16) or 11 (f16) bits: ~27 products of size ~1.
    expect_close(values(y), values(ref), dt == kBFloat16 ? 0.1 : 0.02, dtype_name(dt).data());
    sum(y).backward();
    EXPECT_EQ(xh.grad().dtype(), dt);
    EXPECT_EQ(xh.grad().shape(), xh.shape());
  }
}

TEST(Conv2d, ZeroBatch) {
  Tensor x = zeros({0, 3, 5, 5});
  Tensor w = ones({2, 3, 3, 3});
  EXPECT_EQ(conv2d(x, w).shape(), Dims({0, 2, 3, 3}));
}

TEST(Conv2d, ErrorsNameTheOpAndShapes) {
  Tensor w = zeros({32, 1, 3, 3});
  expect_error(
      [&] {
        conv2d(zeros({2, 3, 8, 8}), w);
      },
      {"conv2d: input has 3 channels but weight expects 1", "[32, 1, 3, 3]", "[2, 3, 8, 8]"});
  expect_error(
      [&] {
        conv2d(zeros({1, 1, 2, 2}), w);
      },
      {"conv2d:", "smaller than the kernel 3x3", "[1, 1, 2, 2]", "[32, 1, 3, 3]"});
  // Dilation makes the kernel span 5x5.
  expect_error(
      [&] {
        conv2d(zeros({1, 1, 4, 4}), w, Tensor(), Conv2dOptions::square(1, 0, 2));
      },
      {"smaller than the kernel", "5x5 with dilation"});
  expect_error(
      [&] {
        conv2d(zeros({1, 3, 8, 8}), zeros({4, 1, 3, 3}), Tensor(),
               Conv2dOptions::square(1, 0, 1, 2));
      },
      {"conv2d: groups 2 does not divide the input's 3 channels", "[1, 3, 8, 8]"});
  expect_error(
      [&] {
        conv2d(zeros({1, 4, 8, 8}), zeros({3, 2, 3, 3}), Tensor(),
               Conv2dOptions::square(1, 0, 1, 2));
      },
      {"conv2d: groups 2 does not divide the weight's 3 output channels", "[3, 2, 3, 3]"});
  expect_error(
      [&] {
        conv2d(zeros({1, 4, 8, 8}), zeros({4, 1, 3, 3}), Tensor(),
               Conv2dOptions::square(1, 0, 1, 2));
      },
      {"input has 4 channels but weight expects 2", "[4, 1, 3, 3]"});
  expect_error(
      [&] {
        conv2d(zeros({1, 1, 8, 8}), w, zeros({31}));
      },
      {"conv2d: bias of shape [31]", "32 output channels"});
  expect_error(
      [&] {
        conv2d(zeros({1, 8, 8}), w);
      },
      {"conv2d: expected input of shape (N, C, H, W), got [1, 8, 8]"});
  expect_error(
      [&] {
        conv2d(zeros({1, 1, 8, 8}), zeros({32, 1, 3, 3}, kFloat64));
      },
      {"conv2d: input is f32 but weight is f64"});
  expect_error(
      [&] {
        conv2d(zeros({1, 1, 8, 8}), w, Tensor(), Conv2dOptions::square(0));
      },
      {"conv2d: stride must be positive"});
  expect_error(
      [&] {
        conv2d(zeros({1, 1, 8, 8}, kInt64), zeros({32, 1, 3, 3}, kInt64));
      },
      {"conv2d: expected a floating-point input, got i64"});
}

TEST(Conv2d, TensorOnAnotherDeviceFailsNamingOpAndDevice) {
  if (cuda::compiled_with_cuda())
    GTEST_SKIP() << "this build has CUDA kernels, which would run on the borrowed host memory; "
                    "tests/cuda/ checks ops on cuda:0 (and tests/cuda/no_cuda_test.cpp the "
                    "CPU-only build's errors)";
  std::vector<float> data(64);
  const Tensor x = borrow(data.data(), {1, 1, 4, 4}, kFloat32, cuda_device(0));
  const Tensor w = borrow(data.data(), {1, 1, 3, 3}, kFloat32, cuda_device(0));
  expect_error([&] { conv2d(x, w); }, {"conv2d", "cuda:0"});
}
