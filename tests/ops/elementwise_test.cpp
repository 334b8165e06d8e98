// Elementwise ops against naive references: broadcasting, layouts, odd sizes, dtypes, gradients.
#include <cmath>
#include <cstring>
#include <functional>

#include "ops/cpu/gelu_avx2.h"
#include "testing.h"

using namespace lockstep;
using lockstep::testing::expect_error;
using lockstep::testing::expect_gradcheck;
using lockstep::testing::make;
using lockstep::testing::non_contiguous;
using lockstep::testing::unravel;
using lockstep::testing::values;

namespace {

using BinaryRef = std::function<double(double, double)>;
using BinaryOp = std::function<Tensor(const Tensor&, const Tensor&)>;

// Naive broadcast: element of `t` at the output index `idx` (right-aligned, size-1 dims pinned).
double broadcast_at(const Tensor& t, const Dims& idx) {
  Dims i = Dims::filled(t.dim(), 0);
  const int64_t lead = idx.size() - t.dim();
  for (int64_t d = 0; d < t.dim(); ++d) i[d] = t.shape()[d] == 1 ? 0 : idx[d + lead];
  return t.at(i);
}

void check_binary(const BinaryOp& op, const BinaryRef& ref, const Tensor& a, const Tensor& b,
                  double tol = 1e-6) {
  Tensor out = op(a, b);
  const Dims shape = broadcast_shapes(a.shape(), b.shape());
  ASSERT_EQ(out.shape(), shape);
  for (int64_t i = 0; i < out.numel(); ++i) {
    const Dims idx = unravel(i, shape);
    const double want = ref(broadcast_at(a, idx), broadcast_at(b, idx));
    const double got = out.at(idx);
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << idx;
    } else {
      ASSERT_NEAR(got, want, tol * (1 + std::abs(want))) << "at " << idx;
    }
  }
}

struct BinaryCase {
  const char* name;
  BinaryOp op;
  BinaryRef ref;
};

std::vector<BinaryCase> binary_cases() {
  return {
      {"add", [](auto& a, auto& b) { return add(a, b); }, [](double x, double y) { return x + y; }},
      {"add_alpha", [](auto& a, auto& b) { return add(a, b, 0.5); },
       [](double x, double y) { return x + 0.5 * y; }},
      {"sub", [](auto& a, auto& b) { return sub(a, b); }, [](double x, double y) { return x - y; }},
      {"mul", [](auto& a, auto& b) { return mul(a, b); }, [](double x, double y) { return x * y; }},
      {"div", [](auto& a, auto& b) { return div(a, b); }, [](double x, double y) { return x / y; }},
      {"pow", [](auto& a, auto& b) { return pow(abs(a), b); },
       [](double x, double y) { return std::pow(std::abs(x), y); }},
      {"maximum", [](auto& a, auto& b) { return maximum(a, b); },
       [](double x, double y) { return std::max(x, y); }},
      {"minimum", [](auto& a, auto& b) { return minimum(a, b); },
       [](double x, double y) { return std::min(x, y); }},
  };
}

Tensor rnd(const Dims& shape, uint64_t seed, DType dt = kFloat32) {
  Generator g(seed);
  return randn(shape, g, dt);
}

}  // namespace

TEST(Elementwise, BinaryOpsMatchReferenceWithBroadcasting) {
  const std::vector<std::pair<Dims, Dims>> shapes = {
      {{1}, {1}},   {{7}, {7}},   {{1023}, {1023}}, {{3, 1, 5}, {4, 1}},
      {{2, 7}, {}}, {{}, {2, 3}}, {{1, 7}, {7, 1}}, {{4, 1023}, {1023}},
  };
  uint64_t seed = 0;
  for (const auto& c : binary_cases()) {
    for (const auto& [sa, sb] : shapes) {
      Tensor a = rnd(sa, ++seed), b = add(rnd(sb, ++seed), 3.0);  // b away from 0 for div
      SCOPED_TRACE(std::string(c.name) + " " + sa.str() + " " + sb.str());
      check_binary(c.op, c.ref, a, b);
      check_binary(c.op, c.ref, non_contiguous(a), non_contiguous(b));
    }
  }
}

TEST(Elementwise, LargeParallelInputsMatchReference) {
  // Large enough for the multi-threaded path, with a broadcast operand.
  Tensor a = rnd({300, 701}, 1), b = rnd({701}, 2);
  Tensor out = add(a, b);
  const auto va = a.to_vector<float>(), vb = b.to_vector<float>(), vo = out.to_vector<float>();
  for (int64_t i = 0; i < 300 * 701; ++i) ASSERT_EQ(vo[i], va[i] + vb[i % 701]) << i;
  Tensor t = a.t();  // transposed input, contiguous output
  Tensor e = exp(t);
  for (int64_t i = 0; i < 701; i += 50)
    for (int64_t j = 0; j < 300; j += 37)
      ASSERT_FLOAT_EQ(static_cast<float>(e.at({i, j})), std::exp(static_cast<float>(a.at({j, i}))));
}

// GELU's tanh form in f32 (the AVX2 kernels where the CPU has them, Note [GELU on AVX2]) against
// the f64 formula, values and gradients, over x from -12 to 12 (the clamped exp past either
// end), 1003 elements (not a multiple of 8), and more than one thread's chunk (70,001); huge
// negative x gives 0 and a zero gradient; a NaN gives NaN forward and backward.
TEST(Elementwise, GeluTanhFloat32MatchesFloat64) {
  const double c = std::sqrt(2 / M_PI), k = 0.044715;
  auto ref = [&](double x) { return 0.5 * x * (1 + std::tanh(c * (x + k * x * x * x))); };
  auto dref = [&](double x) {
    const double t = std::tanh(c * (x + k * x * x * x));
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * k * x * x);
  };
  for (int64_t n : {1003, 70001}) {
    Tensor x = arange(0.0, static_cast<double>(n), 1.0, kFloat32);
    x = add(mul(x, 24.0 / static_cast<double>(n - 1)), -12.0).detach().requires_grad_();
    Generator gen(7);
    Tensor w = randn({n}, gen);
    Tensor y = gelu(x, GeluApprox::tanh);
    sum(mul(y, w)).backward();
    const auto vx = values(x), vy = values(y), vg = values(x.grad()), vw = values(w);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_NEAR(vy[i], ref(vx[i]), 2e-6 * (1 + std::abs(ref(vx[i])))) << "x=" << vx[i];
      ASSERT_NEAR(vg[i], vw[i] * dref(vx[i]), 2e-6 * (1 + std::abs(vw[i] * dref(vx[i]))))
          << "x=" << vx[i];
    }
  }
  // Far below -10 the tanh form is 0 in f32 (tanh(u) rounds to -1), and so is its derivative;
  // a clamped exp must not leave them growing like x and x^3.
  for (double big : {-50.0, -1e5, -1e13, -3e38}) {
    Tensor xb = full({9}, big, kFloat32).requires_grad_();
    Tensor yb = gelu(xb, GeluApprox::tanh);
    sum(yb).backward();
    EXPECT_EQ(yb.at({8}), 0.0) << big;
    // At -3e38 x^2 overflows and the derivative is NaN, in the portable formula as well.
    if (big > -1e19) EXPECT_EQ(xb.grad().at({8}), 0.0) << big;
  }
  Tensor x = full({9}, 1.0, kFloat32);
  x.set_at({8}, std::nan(""));
  x.requires_grad_();
  Tensor y = gelu(x, GeluApprox::tanh);
  sum(y).backward();
  EXPECT_TRUE(std::isnan(y.at({8})));
  EXPECT_TRUE(std::isnan(x.grad().at({8})));
  EXPECT_NEAR(y.at({0}), ref(1.0), 1e-6);
}

// bf16 GELU (Note [bf16 GELU] in src/ops/cpu/elementwise.cpp) reads and writes bf16 directly;
// its values and gradients must be the bits of the f32 kernel between .to(kFloat32) and
// .to(kBFloat16): 1003 (not a multiple of 8) and 70,001 (several threads' chunks) elements over
// [-12, 12], and NaN, infinities, huge and subnormal inputs.
TEST(Elementwise, GeluTanhBf16IsTheRoundedFloat32Kernel) {
  auto expect_same_bits = [](const Tensor& got, const Tensor& want, const char* what) {
    ASSERT_EQ(got.dtype(), kBFloat16) << what;
    const auto g = got.to_vector<double>(), w = want.to_vector<double>();
    ASSERT_EQ(g.size(), w.size()) << what;
    for (size_t i = 0; i < g.size(); ++i) {
      if (std::isnan(w[i])) {
        ASSERT_TRUE(std::isnan(g[i])) << what << " element " << i;
      } else {
        ASSERT_EQ(g[i], w[i]) << what << " element " << i;
        ASSERT_EQ(std::signbit(g[i]), std::signbit(w[i])) << what << " element " << i;
      }
    }
  };
  for (int64_t n : {1003, 70001}) {
    Tensor x = arange(0.0, static_cast<double>(n), 1.0, kFloat32);
    x = add(mul(x, 24.0 / static_cast<double>(n - 1)), -12.0).to(kBFloat16);
    const double specials[] = {std::nan(""), INFINITY, -INFINITY, -1e5, -3e38, 3e38, 1e-40, -1e-40,
                               0.0, -0.0};
    for (size_t i = 0; i < std::size(specials); ++i)
      x.set_at({static_cast<int64_t>(7 * i + 3)}, specials[i]);
    Generator gen(8);
    const Tensor w = randn({n}, gen).to(kBFloat16);

    Tensor xb = x.detach().requires_grad_();
    Tensor yb = gelu(xb, GeluApprox::tanh);
    sum(mul(yb, w)).backward();
    Tensor x32 = x.to(kFloat32).requires_grad_();
    Tensor y32 = gelu(x32, GeluApprox::tanh);
    sum(mul(y32, w.to(kFloat32))).backward();
    expect_same_bits(yb, y32.to(kBFloat16), "gelu");
    expect_same_bits(xb.grad(), x32.grad().to(kBFloat16), "gelu gradient");
  }
}

// Note [GELU on AVX-512]: the 16-lane f32 kernel computes each lane as the 8-lane one does, so
// values and gradients are the same bits (NaN where it is NaN), at sizes that are not a multiple
// of 16 (the masked tail) and over several threads' chunks, with NaN, infinities, huge and
// subnormal inputs. Skipped only where the CPU lacks AVX-512F.
TEST(Elementwise, GeluTanhOn16LanesGivesThe8LaneBits) {
  cpu::set_gelu_avx512(true);
  if (!cpu::gelu_avx512_enabled()) GTEST_SKIP() << "this CPU has no AVX-512F";
  for (int64_t n : {13, 1003, 70001}) {
    Tensor x = arange(0.0, static_cast<double>(n), 1.0, kFloat32);
    x = add(mul(x, 24.0 / static_cast<double>(n - 1)), -12.0);
    const double specials[] = {std::nan(""), INFINITY, -INFINITY, -1e5, -3e38, 3e38, 1e-40, -1e-40,
                               0.0, -0.0};
    for (size_t i = 0; i < std::size(specials) && 7 * i + 3 < static_cast<size_t>(n); ++i)
      x.set_at({static_cast<int64_t>(7 * i + 3)}, specials[i]);
    Generator gen(9);
    const Tensor w = randn({n}, gen);
    std::vector<float> y[2], dx[2];
    for (int wide = 0; wide < 2; ++wide) {
      cpu::set_gelu_avx512(wide == 1);
      Tensor xi = x.detach().requires_grad_();
      Tensor yi = gelu(xi, GeluApprox::tanh);
      sum(mul(yi, w)).backward();
      y[wide] = yi.to_vector<float>();
      dx[wide] = xi.grad().to_vector<float>();
    }
    cpu::set_gelu_avx512(true);
    for (int64_t i = 0; i < n; ++i) {
      uint32_t a, b, ga, gb;
      std::memcpy(&a, &y[1][i], 4);
      std::memcpy(&b, &y[0][i], 4);
      std::memcpy(&ga, &dx[1][i], 4);
      std::memcpy(&gb, &dx[0][i], 4);
      if (std::isnan(y[0][i])) {
        ASSERT_TRUE(std::isnan(y[1][i])) << "n=" << n << " element " << i;
      } else {
        ASSERT_EQ(a, b) << "gelu n=" << n << " element " << i << " x=" << x.at({i});
      }
      if (std::isnan(dx[0][i])) {
        ASSERT_TRUE(std::isnan(dx[1][i])) << "n=" << n << " element " << i;
      } else {
        ASSERT_EQ(ga, gb) << "gelu gradient n=" << n << " element " << i << " x=" << x.at({i});
      }
    }
  }
}

TEST(Elementwise, UnaryOpsMatchReference) {
  struct Case {
    const char* name;
    std::function<Tensor(const Tensor&)> op;
    std::function<double(double)> ref;
  };
  const std::vector<Case> cases = {
      {"neg", [](auto& a) { return neg(a); }, [](double x) { return -x; }},
      {"exp", [](auto& a) { return exp(a); }, [](double x) { return std::exp(x); }},
      {"log", [](auto& a) { return log(abs(a)); }, [](double x) { return std::log(std::abs(x)); }},
      {"sqrt", [](auto& a) { return sqrt(abs(a)); },
       [](double x) { return std::sqrt(std::abs(x)); }},
      {"rsqrt", [](auto& a) { return rsqrt(abs(a)); },
       [](double x) { return 1 / std::sqrt(std::abs(x)); }},
      {"abs", [](auto& a) { return abs(a); }, [](double x) { return std::abs(x); }},
      {"relu", [](auto& a) { return relu(a); }, [](double x) { return x > 0 ? x : 0; }},
      {"tanh", [](auto& a) { return tanh(a); }, [](double x) { return std::tanh(x); }},
      {"sigmoid", [](auto& a) { return sigmoid(a); },
       [](double x) { return 1 / (1 + std::exp(-x)); }},
      {"gelu", [](auto& a) { return gelu(a); },
       [](double x) { return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0))); }},
      {"gelu_tanh", [](auto& a) { return gelu(a, GeluApprox::tanh); },
       [](double x) {
         return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
       }},
      {"clamp", [](auto& a) { return clamp(a, -0.5, 0.7); },
       [](double x) { return std::min(0.7, std::max(-0.5, x)); }},
      {"sign", [](auto& a) { return sign(a); }, [](double x) { return (x > 0) - (x < 0); }},
      {"pow3", [](auto& a) { return pow(a, 3.0); }, [](double x) { return x * x * x; }},
      {"pow2", [](auto& a) { return pow(a, 2.0); }, [](double x) { return x * x; }},
      {"add_s", [](auto& a) { return add(a, 1.5); }, [](double x) { return x + 1.5; }},
      {"rsub_s", [](auto& a) { return 2.0 - a; }, [](double x) { return 2.0 - x; }},
      {"div_s", [](auto& a) { return div(a, 4.0); }, [](double x) { return x / 4; }},
  };
  for (const auto& c : cases) {
    for (Dims shape : {Dims{1}, Dims{7}, Dims{1023}, Dims{3, 7}}) {
      for (DType dt : {kFloat32, kFloat64}) {
        Tensor a = rnd(shape, 11, dt);
        for (const Tensor& in : {a, non_contiguous(a)}) {
          Tensor out = c.op(in);
          EXPECT_EQ(out.dtype(), dt) << c.name;
          const auto vin = values(in), vout = values(out);
          for (size_t i = 0; i < vin.size(); ++i)
            ASSERT_NEAR(vout[i], c.ref(vin[i]), 1e-5 * (1 + std::abs(c.ref(vin[i]))))
                << c.name << " " << shape << " at " << i;
        }
      }
    }
  }
}

TEST(Elementwise, DtypesAndPromotion) {
  Tensor i = from_vector<int32_t>({1, 2, 3}, {3});
  Tensor l = from_vector<int64_t>({10, 20, 30}, {3});
  Tensor f = from_vector<float>({0.5f, 0.5f, 0.5f}, {3});
  EXPECT_EQ(add(i, i).dtype(), kInt32);
  EXPECT_EQ(add(i, l).dtype(), kInt64);
  EXPECT_EQ(values(add(i, l)), (std::vector<double>{11, 22, 33}));
  EXPECT_EQ(add(i, f).dtype(), kFloat32);
  EXPECT_EQ(values(add(i, f)), (std::vector<double>{1.5, 2.5, 3.5}));
  EXPECT_EQ(div(i, i).dtype(), kFloat32);  // true division
  EXPECT_EQ(values(div(i, from_vector<int32_t>({2, 2, 2}, {3}))),
            (std::vector<double>{0.5, 1, 1.5}));
  EXPECT_EQ(mul(i, 2.0).dtype(), kInt32);
  EXPECT_EQ(mul(i, 0.5).dtype(), kFloat32);
  EXPECT_EQ(exp(i).dtype(), kFloat32);
  EXPECT_EQ(add(f, from_vector<double>({1, 1, 1}, {3})).dtype(), kFloat64);
  // bf16 and f16 arithmetic is computed in f32 and rounded once.
  for (DType h : {kBFloat16, kFloat16}) {
    Tensor a = full({5}, 1.0, h), b = full({5}, 1.0 / 256, h);
    Tensor c = add(a, b);
    EXPECT_EQ(c.dtype(), h);
    EXPECT_EQ(c.at({0}), h == kBFloat16 ? 1.0 : 1.00390625);  // bf16 has 8 bits of mantissa
    EXPECT_EQ(add(full({1}, 1.0, kBFloat16), full({1}, 1.0, kFloat16)).dtype(), kFloat32);
  }
  EXPECT_EQ(values(neg(i)), (std::vector<double>{-1, -2, -3}));
  EXPECT_EQ(values(relu(from_vector<int64_t>({-1, 5}, {2}))), (std::vector<double>{0, 5}));
}

TEST(Elementwise, ComparisonsWhereMaskedFill) {
  Tensor a = from_vector<float>({1, 2, 3, NAN}, {4});
  Tensor b = from_vector<float>({1, 3, 2, 0}, {4});
  EXPECT_EQ(values(eq(a, b)), (std::vector<double>{1, 0, 0, 0}));
  EXPECT_EQ(values(ne(a, b)), (std::vector<double>{0, 1, 1, 1}));
  EXPECT_EQ(values(lt(a, b)), (std::vector<double>{0, 1, 0, 0}));
  EXPECT_EQ(values(le(a, b)), (std::vector<double>{1, 1, 0, 0}));
  EXPECT_EQ(values(gt(a, b)), (std::vector<double>{0, 0, 1, 0}));
  EXPECT_EQ(values(ge(a, b)), (std::vector<double>{1, 0, 1, 0}));
  EXPECT_EQ(values(gt(a, 1.5)), (std::vector<double>{0, 1, 1, 0}));
  EXPECT_EQ(values(isnan(a)), (std::vector<double>{0, 0, 0, 1}));
  EXPECT_EQ(values(isfinite(div(b, zeros({4})))), (std::vector<double>{0, 0, 0, 0}));
  EXPECT_EQ(eq(a, b).dtype(), kBool);
  Tensor cond = from_vector<uint8_t>({1, 0}, {2, 1}).to(kBool);
  Tensor w = where(cond, ones({2, 3}), zeros({3}));
  EXPECT_EQ(values(w), (std::vector<double>{1, 1, 1, 0, 0, 0}));
  Tensor m = masked_fill(arange(0.0, 4.0, 1.0).reshape({2, 2}),
                         from_vector<uint8_t>({1, 0}, {2}).to(kBool), -1.0);
  EXPECT_EQ(values(m), (std::vector<double>{-1, 1, -1, 3}));
  EXPECT_TRUE(allclose(a.narrow(0, 0, 3), from_vector<float>({1, 2, 3}, {3})));
  EXPECT_FALSE(allclose(a, a));  // NaN is not close to anything
  expect_error([] { (void)masked_fill(zeros({2}), zeros({3}).to(kBool), 1.0); }, {"masked_fill"});
}

TEST(Elementwise, BroadcastErrorNamesBothShapes) {
  expect_error(
      [] {
        (void)add(zeros({3, 4}), zeros({5}));
      },
      {"add: shapes [3, 4] and [5] cannot be broadcast", "4 vs 5"});
  expect_error([] { (void)mul(zeros({2, 3}), zeros({3, 2})); }, {"mul: shapes [2, 3] and [3, 2]"});
}

TEST(Elementwise, InPlaceOps) {
  Tensor a = arange(0.0, 6.0, 1.0).reshape({2, 3});
  a.add_(ones({3}), 2.0);
  EXPECT_EQ(values(a), (std::vector<double>{2, 3, 4, 5, 6, 7}));
  a.t().mul_(2.0);  // through a non-contiguous view
  EXPECT_EQ(values(a), (std::vector<double>{4, 6, 8, 10, 12, 14}));
  a.narrow(1, 1, 1).zero_();
  EXPECT_EQ(values(a), (std::vector<double>{4, 0, 8, 10, 0, 14}));
  a.t().copy_(from_vector<int32_t>({1, 2, 3, 4, 5, 6}, {3, 2}));
  EXPECT_EQ(values(a), (std::vector<double>{1, 3, 5, 2, 4, 6}));
  a.add_(1.0);
  EXPECT_EQ(a.at({0, 0}), 2.0);
  Tensor h = full({4}, 1.0, kBFloat16);
  h.add_(full({4}, 2.0, kBFloat16), 0.5);
  EXPECT_EQ(values(h), (std::vector<double>{2, 2, 2, 2}));
}

TEST(Elementwise, GradientsMatchFiniteDifferences) {
  Generator gen(5);
  auto leaf = [&](const Dims& s, double shift = 0.0) {
    return add(randn(s, gen, kFloat64), shift).detach().requires_grad_();
  };
  // Broadcasting and non-contiguous leaves.
  Tensor a = leaf({3, 4}), b = leaf({4}), c = leaf({3, 1});
  Tensor nc = randn({4, 3}, gen, kFloat64).t().detach().requires_grad_();
  Tensor pos = add(abs(randn({3, 4}, gen, kFloat64)), 0.5).detach().requires_grad_();
  using V = const std::vector<Tensor>&;
  expect_gradcheck([](V x) { return add(x[0], x[1], 0.7); }, {a, b});
  expect_gradcheck([](V x) { return sub(x[0], x[1]); }, {a, c});
  expect_gradcheck([](V x) { return mul(x[0], x[1]); }, {nc, b});
  expect_gradcheck([](V x) { return div(x[0], x[1]); }, {a, pos});
  expect_gradcheck([](V x) { return pow(x[0], x[1]); }, {pos, a});
  expect_gradcheck([](V x) { return maximum(x[0], x[1]); }, {a, c});
  expect_gradcheck([](V x) { return minimum(x[0], x[1]); }, {nc, b});
  expect_gradcheck([](V x) { return neg(x[0]); }, {nc});
  expect_gradcheck([](V x) { return exp(x[0]); }, {nc});
  expect_gradcheck([](V x) { return log(x[0]); }, {pos});
  expect_gradcheck([](V x) { return sqrt(x[0]); }, {pos});
  expect_gradcheck([](V x) { return rsqrt(x[0]); }, {pos});
  expect_gradcheck([](V x) { return abs(x[0]); }, {a});
  expect_gradcheck([](V x) { return relu(x[0]); }, {nc});
  expect_gradcheck([](V x) { return tanh(x[0]); }, {nc});
  expect_gradcheck([](V x) { return sigmoid(x[0]); }, {nc});
  expect_gradcheck([](V x) { return gelu(x[0]); }, {nc});
  expect_gradcheck([](V x) { return gelu(x[0], GeluApprox::tanh); }, {nc});
  expect_gradcheck([](V x) { return clamp(x[0], -0.3, 0.4); }, {a});
  expect_gradcheck([](V x) { return pow(x[0], 3.0); }, {nc});
  expect_gradcheck([](V x) { return pow(x[0], 0.5); }, {pos});
  expect_gradcheck([](V x) { return mul(add(x[0], 2.0), 3.0) / 5.0; }, {nc});
  expect_gradcheck([](V x) { return 1.0 - x[0]; }, {nc});
  expect_gradcheck([](V x) { return where(gt(x[0], 0.0), x[0], x[1]); }, {a, b});
  expect_gradcheck([](V x) { return masked_fill(x[0], gt(x[0], 0.2), 3.0); }, {a});
  expect_gradcheck([](V x) { return x[0].to(kFloat32).to(kFloat64); }, {a},
                   {.eps = 1e-3, .atol = 1e-3, .rtol = 1e-2});
}

TEST(Threads, BlasSharesTheOpenMPTeam) {
  // See Note [OpenMP BLAS] in CMakeLists.txt: a pthreads OpenBLAS fights our OpenMP threads.
  EXPECT_STREQ(blas_threading(), "openmp");
  const int saved = get_num_threads();
  set_num_threads(1);
  EXPECT_EQ(get_num_threads(), 1);
  set_num_threads(saved);
  EXPECT_THROW(set_num_threads(0), Error);
}

TEST(Elementwise, InPlaceWithOverlappingOperands) {
  // Each result must equal the out-of-place computation, as if the source were read first.
  Tensor x = arange(0.0, 9.0, 1.0).reshape({3, 3});
  Tensor want = add(x, x.t());
  x.add_(x.t());
  EXPECT_TRUE(equal(x, want));
  Tensor y = arange(0.0, 10.0, 1.0);
  y.slice(0, 1, 10).copy_(y.slice(0, 0, 9));
  EXPECT_EQ(values(y), (std::vector<double>{0, 0, 1, 2, 3, 4, 5, 6, 7, 8}));
  Tensor z = arange(0.0, 10.0, 1.0);
  z.slice(0, 0, 9).copy_(z.slice(0, 1, 10));
  EXPECT_EQ(values(z), (std::vector<double>{1, 2, 3, 4, 5, 6, 7, 8, 9, 9}));
  // Large enough for the threaded path.
  Tensor v = arange(0.0, 200001.0, 1.0);
  v.slice(0, 1, 200001).copy_(v.slice(0, 0, 200000));
  auto vv = v.to_vector<double>();
  for (int64_t i = 1; i < 200001; ++i) ASSERT_EQ(vv[i], i - 1) << i;
  Tensor m = arange(0.0, 90000.0, 1.0).reshape({300, 300});
  Tensor mwant = mul(m, m.t());
  m.mul_(m.t());
  EXPECT_TRUE(equal(m, mwant));
  // Writing into an expanded view would write each shared element several times.
  Tensor e = zeros({1, 3}).expand({4, 3});
  expect_error([&] { e.add_(ones({4, 3})); }, {"add_", "expanded view"});
  expect_error([&] { e.fill_(1.0); }, {"fill_", "expanded view"});
}
